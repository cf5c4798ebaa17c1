"""Averaging same-block updates in deadline rounds, as a butterfly all-reduce, sans I/O.

Every replica of a block shares a versioned starting point (`SharedState`: the block's parameters
as one flat vector, the outer momentum when the outer step has one, and a `Version`). A round:

  1. each replica trains H local steps from the shared starting point; its update is its
     parameters minus that starting point;
  2. reduce-scatter: the round's group (the replica and the peers in step with it, sorted) splits
     the vector into one contiguous range per member. Each replica sends the part of its update in
     member m's range to m (a `Part`, tagged with the round, the starting point's hash and the
     samples behind it). The owner checks every part (size, finite, norm against the other parts),
     and at `wait / 2` after the round's start, or when every member's part is in, averages them
     weighted by samples (as claimed, up to `max_samples_ratio` times the median part's or its
     own): its range's `Reduced`;
  3. all-gather: each owner sends its `Reduced` to the group and to any other contributor, and each
     replica closes the round when every range has come in, or `wait` after the round's start,
     whichever is first: it applies the outer step to the assembled average and so gets the next
     shared starting point. A round starts when the replica's update is ready, or earlier (by up to
     `wait / 2`) when a member's message of the round says its sender's round started earlier.

So a node sends 2 (n - 1) / n of the vector per round whatever the number n of replicas, where
sending the whole update to every peer costs n - 1 vectors. A group larger than
`AveragingConfig.flat` does the same in two levels (`Layout`): in rows of about sqrt(n) members
and then in columns, at `wait / 2` and `3 wait / 4`, so that a member exchanges with about
2 sqrt(n) peers, not n - 1, and still sends about two vectors. Replicas that received the same
cells compute bit-identical states: each cell was averaged once, by its owner, and passed through
the wire codec before anyone, its owner too, used it (in two levels twice, since the column owners
who pass a cell on to their rows send it as they decoded it).

A cell that did not arrive by the deadline (its owner, or the column owner passing it on, died or
straggled) is not averaged this round: the shared state keeps it as it was, and each replica
carries its own part of it over as local progress (`Closed.carry`), as it does for a cell its part
was left out of (it came late, or was refused). No local work is lost; it goes into the next
round's update. With `feedback` (error feedback, for the lossy codecs) a replica also carries what
the codec lost of its parts (its update minus what their owners decoded), and an owner adds what
the codec lost of its last average of a cell to its next average of that cell: rounding errors are
sent later, not dropped. A round counts the samples behind each cell (as its owner counted
them, `max_samples_ratio` capping what a part claims) weighted by its size, a missing cell none,
so the version rule below makes replicas that missed cells adopt a state that has them when one
exists.

Who is waited for: the group is the replica and the peers in step with it: those whose parts went
into at least half of the values of its previous round (owners of cells that did not arrive aside),
which everyone who closed that round with the same cells computes alike (or that announced its
version as members). A replica is a member of its next group only if its own parts did, so it and
its peers agree on the group without depending on when announcements arrive; half, not all, so
that a column lost with its owner does not drop the rest of that owner's row. A replica that
fetched its state (a joiner, a restart) is not a member: it sends its parts to the members' ranges
and owns none; once its parts are in, it is a contributor, in step, and a member from the next
round on. It announces its version to the row it sends its parts to, and the owners there wait for
its parts as for their row's, but no later than the row stage's time, so a slow joiner delays
nobody past it. A column owner that dies also takes with it the cells it would
have passed on to its row; the owners of those cells notice its row's average missing and send
their cells to that row themselves.

The state's hash is a hash of hashes: of each leaf of `LEAF` values of the parameters (and of the
outer momentum), so that a replica need not hash the whole state every round. A cell's owner sends,
with its average, the digests of the leaves that lie within its cell once the round's outer step is
applied; a replica hashes only the leaves of its own cells, those that straddle two cells, those
of missing cells, and `CHECKED_LEAVES` leaves of the cells it received, picked at random among them
each round, to check their owners' digests (where a cell's are wrong it hashes the whole cell and
uses its own digests, so its hash then differs from its peers' and the version rule below settles
which state the swarm keeps). So hashing costs about 1 / n of the state per round, not all of it;
an owner could still send its peers different values under the same digests, and only the
replicas whose sample falls on its cell would see it (an owner that sends one peer a whole cell of
other values is seen by that peer with a chance of about 1 - (1 - 1 / (n - 1))^CHECKED_LEAVES a
round: 71% at 8 replicas, where checking one whole cell gave 1 / (n - 1), 14%).

When replicas diverge anyway (a late range, a restart), they announce their `Version` and one rule
settles which state the swarm keeps: a later round wins, then the state that averaged more samples,
then the smaller hash. A replica that sees a preferred version fetches that state and rebases its
local progress onto it, if it can trust it (`trust`): the version is confirmed (two peers announce
it, or every peer of the block there does), or it is a state of the round that made its own, which
it checks against that round (its values wherever it received a cell, its samples against what its
missed cells could add), or, for a replica in no group (done training), a later round that a peer
of its last round can have reached by then. So no one member takes the swarm over by announcing a
later round or more samples.

Nothing here does I/O or reads a clock: times are passed in and the wire codec is a function, so
the same code runs inside a node and inside a deterministic simulation (tests/test_averaging.py).

One mechanism a module:

    config      AveragingConfig: how replicas average, as every benchmark states it
    state       the shared state, its Version, and its hash over leaves (and checking peers' digests)
    layout      who averages which values: the group in rows, the vector in columns and cells
    parts       what replicas send each other: parts, averages, their contributors as a bitmap
    rule        whose parts count and how much: outliers by norm, claimed samples capped, the average
    outer       the outer step: plain averaging or Nesterov momentum
    membership  who the next group is, which state the swarm keeps, adopting it
    trust       which preferred states a replica may take: confirmed, or checked against its own round
    replica     one replica's side of the rounds (the state machine), and what a round closes with
"""

from __future__ import annotations

from .config import AveragingConfig
from .layout import Layout, split
from .outer import OUTER_STEPS
from .parts import Contributors, Outgoing, Part, Reduced, group_digest
from .replica import Closed, Counters, Replica
from .rule import norm
from .state import CHECKED_LEAVES, DIGEST, LEAF, SharedState, Version, leaf_digests, leaf_range, state_hash, tree_hash
from .trust import UNCONFIRMED, Made, confirmed

__all__ = [
    "CHECKED_LEAVES", "DIGEST", "LEAF", "OUTER_STEPS", "AveragingConfig", "Closed", "Contributors",
    "Counters", "Layout", "Made", "Outgoing", "Part", "Reduced", "Replica", "SharedState", "UNCONFIRMED", "Version",
    "confirmed", "group_digest", "leaf_digests", "leaf_range", "norm", "split", "state_hash", "tree_hash",
]
