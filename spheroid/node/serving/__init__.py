"""A node that serves consecutive blocks for inference, and coordinates the requests of clients.

A client sends `generate` or `score` to any serving node, which becomes the request's coordinator:
it picks a route (spheroid/pipeline.py) and, for every traversal, sends a `hop` to the route's
first node. Each node on the route runs the Euler steps of its blocks (in a worker thread, so the
event loop, and a training loop beside it, keep going; the hops of concurrent sessions that arrive
while a batch runs make the next batch, packed into one sequence per layer call: `Batcher`) and
streams the noisy tensor to the next;
the first node draws the starting noise itself, the last one reads off the logits and sends the
bytes (or, for scoring, the summed negative log-likelihood) to the coordinator in `hop_done`.
Activations move node to node and never through the client or the coordinator. With the relay
channel a hop also carries its last block's clean stream over the context, which the next node's
first block starts from: per session each node keeps what it was sent, so after a session's first
traversal only the new positions travel.

A hop that fails reports `hop_error` naming the node it could not reach; a traversal that gets no
answer within `hop_timeout` is retried on a route without the nodes that are gone or do not answer
a ping; after `retries` failed attempts the client gets a clear error. A node that refused a hop
only because it was busy (`Busy`) is routed around if another node serves its blocks, else asked
again after pauses that last at most `hop_timeout` in all. Nothing waits without a timeout.

A coordinator runs the decode loop local generation runs (decoding.Decoder: which traversal
next, the bytes it yielded), each traversal a trip along the route, and the last node picks the
bytes from the logits as one machine does (decoding.pick_bytes). Noise and sampling use generators
derived from the seed and each byte's index (decoding.traversal_generators; a generation hop's
`traversal` is the index of its first byte), so a pipeline produces the bytes `spheroid generate
CKPT` produces locally for the same seed, in every mode. Mode `spec` (speculative decoding) checks
bytes drafted by prompt lookup in the same traversal as the next one: the last node keeps them by
the speculative-sampling rule (decoding.accept_draft), so the output is distributed as `ar`'s, and
is `ar`'s very bytes at temperature 0.

The package: `base` (PipelineServer: coordinating requests, relaying hops), `blocks` (BlockServer),
`reference` (ReferenceServer), `sessions` (what a node keeps of a session between traversals) and
`batcher` (continuous batching of the hops that wait).
"""

from .base import (
    BUSY_PAUSE_S,
    MAX_GENERATE,
    MAX_OFFSET,
    MAX_PROMPT,
    MAX_REQUESTS,
    MAX_SEED,
    MAX_TEXT,
    HopFailed,
    PipelineServer,
)
from .batcher import Allowance, Batcher
from .blocks import BlockServer
from .reference import ReferenceServer
from .sessions import Busy, Session, SessionCache, StaleSession

__all__ = [
    "BUSY_PAUSE_S", "MAX_GENERATE", "MAX_OFFSET", "MAX_PROMPT", "MAX_REQUESTS", "MAX_SEED", "MAX_TEXT", "Allowance",
    "Batcher", "BlockServer", "Busy", "HopFailed", "PipelineServer", "ReferenceServer", "Session", "SessionCache",
    "StaleSession",
]
