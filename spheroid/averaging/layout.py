"""Who averages which values in a round: the sorted group laid out in rows (one row up to
`AveragingConfig.flat` members), the vector in column ranges and each column in one cell per row,
so that a member exchanges with about 2 sqrt(n) peers rather than n - 1."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass


def split(lo: int, hi: int, k: int) -> list[tuple[int, int]]:
    """[lo, hi) cut into k contiguous ranges whose sizes differ by at most one, the longer first."""
    size, extra = divmod(hi - lo, k)
    out = []
    for i in range(k):
        out.append((lo, lo + size + (i < extra)))
        lo = out[-1][1]
    return out


@dataclass(frozen=True)
class Layout:
    """Who averages which values in a round: the sorted group laid out in rows.

    The vector is cut into g column ranges, g the length of the shortest row, and each column
    range into one cell per row (R of them). In its row, the member at position c owns column c
    (a longer row's last member owns none): its row's parts of that range come to it
    (reduce-scatter in the row). It averages them and sends the average's cell for row r to column
    c's owner in row r, which averages the rows' averages of that cell (reduce-scatter in the
    column) and sends the result to its column and its row; each column owner passes the cells of
    its column it receives on to its row (all-gather). So a member exchanges with its row and its
    column, about 2 sqrt(n) peers, and sends at most 2 (1 + 1 / g) vectors a round (2 (1 - 1 / n)
    when the rows are equal). A group of up to `AveragingConfig.flat` members is one row: each
    member owns one range, and every other member sends it its part of it.
    """

    rows: tuple[tuple[str, ...], ...]
    columns: tuple[tuple[int, int], ...]  # column c's range of the vector
    cells: tuple[tuple[tuple[int, int], ...], ...]  # cells[c][r]: column c's cell for row r
    where: dict[str, int]  # member -> its row

    @classmethod
    def of(cls, group: list[str], n_params: int, flat: int) -> Layout:
        members = sorted(group)
        n = len(members)
        n_rows = 1 if n <= flat or n_params < 4 * n else math.isqrt(n)  # (two levels: every cell has values)
        rows = tuple(tuple(members[a:b]) for a, b in split(0, n, n_rows))
        columns = tuple(split(0, n_params, len(rows[-1])))
        cells = tuple(tuple(split(lo, hi, n_rows)) for lo, hi in columns)
        return cls(rows, columns, cells, {m: r for r, row in enumerate(rows) for m in row})

    @property
    def two_level(self) -> bool:
        return len(self.rows) > 1

    def row_of(self, name: str) -> int:
        """A member's row; anyone else's (a joiner sending its parts) by a hash every replica computes alike."""
        if name in self.where:
            return self.where[name]
        return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big") % len(self.rows)

    def owner(self, r: int, c: int) -> str:
        """Row r's owner of column c, who is also the owner of column c's cell for row r."""
        return self.rows[r][c]

    def owned(self, name: str) -> list[int]:
        """The columns a member owns in its row: none or one (none for anyone else)."""
        if name not in self.where:
            return []
        c = self.rows[self.where[name]].index(name)
        return [c] if c < len(self.columns) else []

    def all_cells(self) -> list[tuple[int, int, tuple[int, int]]]:
        """(column, row, cell) for every cell, in the vector's order."""
        return [(c, r, cell) for c, cells in enumerate(self.cells) for r, cell in enumerate(cells)]
