"""Configuration dataclasses and their JSON round trip.

Everything that decides what a checkpoint means lives here, so that the JSON written beside every
checkpoint is enough to rebuild the model, the noise schedule and the training run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass, field
from typing import Any

from .wire.tensors import CODEC_OPTIONS

# how a swarm node may refresh its copies of earlier blocks: fp32 snapshots, or changes in a lossy codec
REFRESH_CODECS = tuple(CODEC_OPTIONS)
# the number that names the end-to-end reference wherever the wire and a node name the part of the
# model they train (`blocks` in hello, `block` in version, update, state_get...): replicas of the
# whole reference (data-parallel local SGD, DiLoCo-style) average through the same messages as a
# block's replicas, and can share a swarm with blocks 0..B-1 without being taken for one of them
REFERENCE_PART = 65535


def part_name(part: int) -> str:
    """How logs and errors name a part of the model: "block B", or "the reference"."""
    return "the reference" if part == REFERENCE_PART else f"block {part}"


@functools.cache
def _float_fields(kind: type) -> tuple[str, ...]:
    hints = typing.get_type_hints(kind)
    return tuple(f.name for f in dataclasses.fields(kind) if hints[f.name] is float)


def require_finite(config: Any) -> None:
    """Refuse NaN and infinities in a configuration's float fields: they pass every range check and
    fail later, mid-run, as a loss of NaN."""
    if bad := [name for name in _float_fields(type(config)) if not math.isfinite(getattr(config, name))]:
        raise ValueError(f"{', '.join(bad)} must be finite, got {', '.join(str(getattr(config, n)) for n in bad)}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the model. A BlockTrain model is `n_blocks` blocks of `layers_per_block` layers."""

    vocab: int = 256  # bytes are tokens
    d_model: int = 128
    n_heads: int = 4
    layers_per_block: int = 2
    n_blocks: int = 4
    context: int = 128  # bytes of clean context a block (or the reference) reads
    mlp_ratio: int = 4
    chunk: int = 1  # K: noisy tokens of one chunk attend to each other (1 = plain next-byte model)
    layout: str = "concat"  # "concat": [clean | noisy] tokens, any K; "merged": one token per position, K = 1
    codebook_seed: int = 0  # the shared, fixed target codebook e(.) is generated from this seed
    codebook_norm: float = 1.0  # row norm of the codebook
    # a genesis codebook: a safetensors file every worker of a swarm loads instead of the seeded
    # rows (made by `spheroid codebook`), pinned by its sha256; "" = seeded random rows
    codebook_file: str = ""
    codebook_sha256: str = ""
    # EDM's skip path c_skip * z in D. Off by default (D = c_out * F; z only reaches F): at inference z
    # carries the chain's own state, not a noisy truth, and through the skip it reached the head
    # unfiltered; see docs/compose.md
    edm_skip: bool = False
    # what block b reads of the blocks before it besides z: "relay" = its clean stream starts from
    # block b-1's clean-stream output (frozen copies, forward only), so the stack computes
    # n_blocks x layers_per_block deep on the context; "z" = nothing (each block re-reads the raw
    # bytes: an ensemble, not depth; method.md's setting). See docs/compose.md
    channel: str = "relay"
    # with the relay channel, the weight of a next-byte loss on each relayed clean stream (every block
    # but the last), read off by a head of its own: without it nothing trains what a block hands on
    # when its last layer's clean-stream output feeds no query of its own (docs/compose.md); ignored
    # with channel "z"
    relay_loss: float = 1.0
    # where each block layer's AdaLN gates start: 1 = as a plain pre-norm layer's residual branches
    # (the references'), 0 = AdaLN-Zero (every layer starts as the identity, as in DiT); with the
    # relay loss, 1 made the depth preset's chain 0.009 better and its block 0 0.06 (docs/compose.md)
    gate_init: float = 1.0
    # the relay loss's head: 0 = a linear readout (LayerNorm, then d x 256); H > 0 = a small MLP
    # (LayerNorm, d x H, GELU, H x 256), used only for the local loss and never relayed (docs/compose.md)
    relay_head_hidden: int = 0
    # what a block's noisy token carries of its anchor position besides its noisy target: "embedding" =
    # the anchor byte's embedding (and, with the relay channel, the previous block's clean-stream
    # output there); "stream" = this block's own clean-stream output there (what it hands on, so the
    # denoiser's loss trains it directly); concat layout only (docs/compose.md)
    noisy_anchor: str = "embedding"
    # the end-to-end reference's layout: "plain" (a causal transformer) or "two_stream" (the blocks'
    # clean stream plus one query token per position, nothing noisy); ignored by blocks
    reference_layout: str = "plain"

    def __post_init__(self) -> None:
        require_finite(self)
        if self.codebook_norm <= 0:
            raise ValueError(f"codebook_norm must be positive, got {self.codebook_norm}")
        sizes = {"vocab": self.vocab, "d_model": self.d_model, "n_heads": self.n_heads, "context": self.context,
                 "mlp_ratio": self.mlp_ratio, "n_blocks": self.n_blocks, "layers_per_block": self.layers_per_block}
        if small := [name for name, size in sizes.items() if size < 1]:
            raise ValueError(f"{', '.join(small)} must be at least 1")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by n_heads {self.n_heads}")
        if self.chunk < 1 or self.chunk > self.context:
            raise ValueError(f"chunk must be in [1, context={self.context}], got {self.chunk}")
        if bool(self.codebook_file) != bool(self.codebook_sha256):
            raise ValueError("a genesis codebook needs both codebook_file and codebook_sha256")
        if self.layout not in ("concat", "merged"):
            raise ValueError(f"layout must be 'concat' or 'merged', got {self.layout!r}")
        if self.layout == "merged" and self.chunk != 1:
            raise ValueError("the merged layout has K = 1; use layout 'concat' for chunks")
        if self.channel not in ("relay", "z"):
            raise ValueError(f"channel must be 'relay' or 'z', got {self.channel!r}")
        if self.channel == "relay" and self.layout == "merged" and self.n_blocks > 1:
            raise ValueError("the merged layout has no clean stream to relay: use channel 'z' with it")
        if self.relay_loss < 0:
            raise ValueError(f"relay_loss must be >= 0, got {self.relay_loss}")
        if self.relay_head_hidden < 0:
            raise ValueError(f"relay_head_hidden must be >= 0, got {self.relay_head_hidden}")
        if self.noisy_anchor not in ("embedding", "stream"):
            raise ValueError(f"noisy_anchor must be 'embedding' or 'stream', got {self.noisy_anchor!r}")
        if self.noisy_anchor == "stream" and self.layout != "concat":
            raise ValueError("noisy_anchor 'stream' needs the concat layout's clean stream")
        if self.reference_layout not in ("plain", "two_stream"):
            raise ValueError(f"reference_layout must be 'plain' or 'two_stream', got {self.reference_layout!r}")


@dataclass(frozen=True)
class NoiseConfig:
    """The noise levels of the variance-exploding diffusion and how the blocks split them."""

    sigma_min: float = 1.0
    sigma_max: float = 10.0
    p_mean: float = -1.2
    p_std: float = 1.2
    overlap: float = 0.1  # gamma: each band is widened by (hi/lo)**gamma in log space
    sigma_data: float = 0.5
    steps_per_block: int = 1  # Euler steps each block takes in the inference chain
    churn: float = 0.0  # stochastic sampler: before each step, re-inject noise up to sigma * (1 + churn)

    def __post_init__(self) -> None:
        require_finite(self)
        if not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(f"need 0 < sigma_min < sigma_max, got {self.sigma_min}, {self.sigma_max}")
        if self.p_std <= 0 or self.sigma_data <= 0 or self.overlap < 0 or self.steps_per_block < 1:
            raise ValueError("p_std and sigma_data must be positive, overlap >= 0, steps_per_block >= 1")
        if self.churn < 0:
            raise ValueError(f"churn must be >= 0, got {self.churn}")


@dataclass(frozen=True)
class TrainConfig:
    """One training run: the same for a block and for the end-to-end reference."""

    steps: int = 800
    batch: int = 32
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.95
    weight_decay: float = 0.1
    warmup: int = 100
    grad_clip: float = 1.0
    seed: int = 0
    # what a block learns to denoise: "noised" = e(y) + sigma * eps (DiffusionBlocks, method.md), or
    # "chain" = the states the chain of the earlier, frozen blocks produces from pure noise (the
    # default, a change of method measured in docs/compose.md: the worker of block b also holds
    # blocks 0..b-1, forward only, and still updates block b alone)
    block_input: str = "chain"
    # blocks trained all at once (as a swarm trains them): every R steps a block trainer publishes its
    # block and reloads the newest published snapshots of the earlier blocks it reads (before the
    # first, their genesis states); 0 = the earlier blocks are trained first and stay fixed
    refresh_every: int = 0
    # how a swarm node refreshes its copies of the earlier blocks: "fp32", verified float32 snapshots;
    # "int8", "int4", "int2", "fp16" or "bf16", the change from the copy it holds to the holder's
    # state, in that codec (lz4 on top; a change from a state more than a round old, in int8 when
    # int4 or int2 is asked), taken from the copy as it is (spheroid/node/worker.py)
    refresh_codec: str = "fp32"
    # mixed chunk sizes: each batch trains under the chunk mask of a K drawn uniformly from these, so
    # one checkpoint serves ar (K = 1), sweeps and drafts; empty = always the model's chunk
    chunks: tuple[int, ...] = ()
    # block b starts from the weights of block b-1 as it read it (every tensor of the same name and
    # shape), instead of its seeded genesis state; for blocks trained in order (docs/compose.md)
    init_from_previous: bool = False
    # noisy tokens per training sequence: 0 = one per position (all of them); N = one aligned segment
    # of N positions, drawn per batch (the clean stream and the relay loss still cover every
    # position), so the denoiser, and the chain states the earlier blocks compute, cost N/context
    noisy_positions: int = 0

    def __post_init__(self) -> None:
        require_finite(self)
        object.__setattr__(self, "chunks", tuple(self.chunks))  # a JSON list reads back as a list
        if any(not isinstance(k, int) or k < 1 for k in self.chunks):
            raise ValueError(f"chunks must be sizes of at least 1, got {list(self.chunks)}")
        if self.refresh_every < 0:
            raise ValueError(f"need refresh_every >= 0, got {self.refresh_every}")
        if self.noisy_positions < 0:
            raise ValueError(f"need noisy_positions >= 0, got {self.noisy_positions}")
        if self.refresh_codec not in REFRESH_CODECS:
            raise ValueError(f"refresh_codec must be one of {', '.join(REFRESH_CODECS)}, got {self.refresh_codec!r}")
        if self.block_input not in ("noised", "chain"):
            raise ValueError(f"block_input must be 'noised' or 'chain', got {self.block_input!r}")
        if self.steps < 0 or self.batch < 1 or self.lr <= 0:  # 0 steps: a swarm node that only holds its block
            raise ValueError("steps must be at least 0, batch at least 1 and lr positive")


@dataclass(frozen=True)
class RunConfig:
    """What a checkpoint file records: model, noise and training configuration together."""

    model: ModelConfig = field(default_factory=ModelConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.train.chunks and max(self.train.chunks) > self.model.context:
            raise ValueError(f"chunk sizes {list(self.train.chunks)} must be at most the context, {self.model.context}")
        if self.train.noisy_positions and self.model.context % self.train.noisy_positions:
            raise ValueError(f"noisy_positions {self.train.noisy_positions} must divide the context, "
                             f"{self.model.context}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunConfig:
        model = data.get("model", {})
        if isinstance(model, dict) and "channel" not in model:
            model = {**model, "channel": "z"}  # written before the relay channel existed: z only
        if isinstance(model, dict) and "relay_loss" not in model:
            model = {**model, "relay_loss": 0.0}  # written before the relay loss existed: none
        if isinstance(model, dict) and "gate_init" not in model:
            model = {**model, "gate_init": 0.0}  # written before gate_init existed: AdaLN-Zero
        train = data.get("train", {})
        if isinstance(train, dict) and "refresh_snapshot_every" in train:
            # written when changes of a copy drifted until a periodic snapshot: no longer needed
            train = {k: v for k, v in train.items() if k != "refresh_snapshot_every"}
        return cls(
            model=_build(ModelConfig, model),
            noise=_build(NoiseConfig, data.get("noise", {})),
            train=_build(TrainConfig, train),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    def differences(self, other: RunConfig) -> list[str]:
        """What `other` sets otherwise, as 'table.field: ours -> theirs' (for errors that refuse it)."""
        mine, theirs = self.to_dict(), other.to_dict()
        return [f"{table}.{name}: {value!r} -> {theirs[table][name]!r}"
                for table in mine for name, value in mine[table].items() if theirs[table][name] != value]

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls.from_dict(json.loads(text))


def _build(kind: type, data: dict[str, Any]) -> Any:
    """Build a dataclass from a dict, refusing unknown keys (so a typo never passes silently) and
    values of the wrong JSON type (a "32" for an int, a list for a float), which would otherwise fail
    deep inside training, or not at all."""
    if not isinstance(data, dict):
        raise ValueError(f"{kind.__name__}: expected a JSON object, got {type(data).__name__}")
    hints = typing.get_type_hints(kind)
    unknown = set(data) - set(hints)
    if unknown:
        raise ValueError(f"{kind.__name__}: unknown field(s) {sorted(unknown)}")
    return kind(**{name: _typed(kind, name, value, hints[name]) for name, value in data.items()})


def _typed(kind: type, name: str, value: Any, hint: Any) -> Any:
    """`value` as field `name` of `kind` holds it (an int where a float goes, a list where a tuple of
    ints goes), or a ValueError naming the field."""
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if hint is float and (is_int or isinstance(value, float)):
        return float(value)
    if (hint is int and is_int) or (hint in (str, bool) and isinstance(value, hint)):
        return value
    if typing.get_origin(hint) is tuple and isinstance(value, (list, tuple)):
        item = typing.get_args(hint)[0]
        return tuple(_typed(kind, name, v, item) for v in value)
    wanted = getattr(hint, "__name__", str(hint))
    raise ValueError(f"{kind.__name__}.{name} must be {wanted}, got {value!r} ({type(value).__name__})")


def override(config: Any, **changes: Any) -> Any:
    """A copy of a (nested) config with the non-None values of `changes` applied."""
    return dataclasses.replace(config, **{k: v for k, v in changes.items() if v is not None})


@dataclass(frozen=True)
class NodeConfig:
    """One node of the swarm: where it listens, whom it knows, how it proves it belongs."""

    listen: str = "127.0.0.1:7400"
    announce: str = ""  # the address peers should dial (for NAT or port forwarding); default: listen
    peers: tuple[str, ...] = ()  # seed addresses, re-contacted now and then so a split swarm heals
    swarm: str = "spheroid"
    identity: str = "node-identity.json"  # persistent node id; a lock keeps a second process off it
    role: str = "worker"
    blocks: tuple[int, ...] = ()  # blocks it trains
    serves: tuple[int, ...] = ()  # consecutive blocks it serves for inference
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    ping_interval: float = 2.0
    gossip_interval: float = 3.0  # until membership settles; then doubling each time up to gossip_max
    gossip_max: float = 24.0  # (below forget_after, so that gossip keeps the peers it learned)
    seed_interval: float = 10.0
    dead_after: float = 8.0  # a connection silent this long is dropped (pings keep live ones talking)
    forget_after: float = 30.0  # a peer neither connected nor advertised this long is forgotten
    status_interval: float = 5.0
    timeout: float = 10.0  # every wait for a peer: connect, drain, reply
    handshake_timeout: float = 10.0  # a connection must finish its handshake within this
    max_unauthenticated: int = 128  # connections in their handshake at once, in all
    max_unauthenticated_per_host: int = 32  # ... and from one source address
    max_clients: int = 256  # client connections (status, generate, ...) open at once, in all
    max_clients_per_host: int = 64  # ... and from one source address
    max_peers: int = 64  # connections it dials
    max_inbound_peers: int = 256  # connections peers dialled in, in all (beyond: busy)
    max_inbound_peers_per_host: int = 64  # ... and from one source address
    # a connection that reach() dialled (averaging with a peer beyond those) is closed once it has
    # carried nothing but pings this long while the node holds more than max_peers connections
    reach_idle: float = 60.0
    max_known: int = 10_000  # entries of the known-peers table (full: a random one not connected nor a seed goes)
    recv_budget: int = 384 << 20  # bytes of incoming tensor streams the node holds, all connections together

    def __post_init__(self) -> None:
        for addr in (self.listen, *self.peers, *([self.announce] if self.announce else [])):
            parse_addr(addr)
        if self.ping_interval <= 0 or self.dead_after <= self.ping_interval:
            raise ValueError("need 0 < ping_interval < dead_after")
        if not 0 < self.gossip_interval <= self.gossip_max < self.forget_after:
            raise ValueError("need 0 < gossip_interval <= gossip_max < forget_after")
        if bool(self.tls_cert) != bool(self.tls_key) or (self.tls_ca and not self.tls_cert):
            raise ValueError("--tls-cert and --tls-key go together, and --tls-ca with them")

    @property
    def address(self) -> str:
        return self.announce or self.listen


def parse_addr(addr: str) -> tuple[str, int]:
    """'host:port' -> (host, port), with a clear error for anything else."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"address {addr!r} is not HOST:PORT")
    return host.strip("[]"), int(port)
