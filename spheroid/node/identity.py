"""A node's persistent identity: a random id in a small JSON file, locked while a node uses it.

The id is stable across restarts, so peers recognise a restarted node. The lock (an flock on a
file beside it) keeps a second process on the same machine from running with the same identity;
peers refuse a second node with a live id from another address (see node.py).
"""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

from ..checkpoint import atomic_write
from ..wire.session import is_node_id


class IdentityError(Exception):
    """The identity file is unreadable, malformed or already in use."""


class Identity:
    def __init__(self, node_id: str, lock_fd: int) -> None:
        self.node_id = node_id
        self._lock_fd = lock_fd

    def release(self) -> None:
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1


def load_or_create(path: str | os.PathLike) -> Identity:
    """The identity in `path`, created on first use; IdentityError if another process holds it."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise IdentityError(f"cannot keep the identity {path} (--identity) there: {exc.strerror or exc}") from exc
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(lock_fd)
        raise IdentityError(f"identity {path} is in use by another running node; give this node its own "
                            "--identity FILE") from None
    try:
        if path.exists():
            try:
                node_id = json.loads(path.read_text())["node"]
            except (OSError, ValueError, KeyError, TypeError) as exc:
                raise IdentityError(f"identity file {path} is unreadable ({exc}); move it away to make a new one") \
                    from None
            if not is_node_id(node_id):
                raise IdentityError(f"identity file {path} holds no valid node id")
        else:
            node_id = os.urandom(16).hex()
            atomic_write(path, json.dumps({"node": node_id}).encode())
    except BaseException:
        os.close(lock_fd)
        raise
    return Identity(node_id, lock_fd)
