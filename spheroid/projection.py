"""Projected training memory, traffic and FLOPs of three ways to train one model shape.

Three methods, each judged by its largest worker (what one machine must hold) and its busiest
sender (what one uplink must carry):

  e2e         one worker trains the plain end-to-end reference (`Reference`, layout "plain", depth
              n_blocks x layers_per_block) alone; it sends nothing.
  diloco      N workers each hold and train the whole reference and average their change every H
              local steps, by reduce-scatter and all-gather (spheroid/averaging/): each sends
              2 (N - 1) / N of the parameter vector a round, in the codec.
  blocktrain  B blocks (`DiffusionBlock`, layout "concat", channel "relay", block_input "chain"),
              r workers per block. The worker of block b also holds frozen copies of blocks
              0..b-1 (forward only: no gradients, no optimizer state, nothing saved for backward)
              and every R steps receives each one's change in the refresh codec; the holder of
              block a sends it to every later block's workers. With r > 1 the replicas of a block
              average as diloco's workers do. So the largest worker is block B-1's and the busiest
              sender is block 0's holder.

What one worker trains, saves for backward, holds of the frozen blocks' streams and computes per step,
and what a codec sends per value, come from spheroid/sizing.py (exact counts, and formulas the tests
calibrate against torch); this module puts them together into each method's workers.

Memory of a worker (`Memory`, bytes; reported in MiB):
  weights, gradients, optimizer   4 + 4 + 8 bytes per trained parameter (fp32 master, AdamW moments)
  averaging                       the round's shared starting point (4 bytes a parameter), DiLoCo's
                                  outer momentum (4) and the error-feedback residual (4), when the
                                  worker averages with peers
  activations                     tensors autograd saves for backward in one step (`sizing.activation_terms`)
  cast_weights                    under bf16 autocast, the bf16 copies of the trained linear weights
                                  that autocast keeps for backward (2 bytes each)
  chain_streams                   the frozen blocks' clean streams (keys, values, outputs), held
                                  while a block's loss is computed
  frozen                          frozen copies of earlier blocks (frozen_bytes per parameter; 4: fp32
                                  copies, as `EarlierBlocks` holds them)
  reader_copies                   a holder's copies of what it sent its readers (spheroid/node/worker.py
                                  `ReadersCopies`), so that it can send the next change from them
`total` adds them all, crediting no overlap (gradients do not exist during the forward pass, the
chain streams are freed before the backward pass): a budget, slightly pessimistic. `device` leaves
out `averaging` and `reader_copies`, which are read once a round and can wait in host memory (as
DiLoCo implementations keep the outer state); whether a worker fits a GPU is judged on `device`.
(A spheroid node trains on the CPU and holds them all.) Not included: the CUDA context and the
allocator's slack (about 0.5-1 GiB on a GPU), the CUDA libraries' workspaces (cuBLAS: tens of MiB),
the data, transient buffers. On an H200 a real step's forward peak (torch's allocated memory) came
within 3% of `device` at width 1024, context 1024, once cuBLAS's workspace was set aside.

The `project()` dict (JSON-ready; the benchmark result key `projection`):

  {"schema": 1, "assumptions": {...the settings used...},
   "shapes": {NAME: {"shape": {d_model, n_layers, n_heads, context, note},
                     "methods": {"e2e" | "diloco" | "blocktrain_B4" | "blocktrain_B8": FIGURES
                                 or {"skipped": REASON}},
                     "fit": [the method keys whose largest worker fits the memory budget]}},
   "largest_model": {METHOD KEY: `largest_model()`'s dict}}

  FIGURES = {"method", "n_blocks", "workers" (how many in all),
             "parameters": {"total", "largest_worker" (it trains), "largest_worker_frozen"},
             "largest_worker": its name (the most device memory),
             "memory_mib": {each term above, "total", "device"},
             "busiest_worker": its name,
             "bytes_per_step": {"busiest_worker", "total"} (sent, all workers in lockstep),
             "flops_per_step": {"largest_worker", "total"},
             "bytes_per_hour": {"busiest_worker", "total"},
             "fits": whether the largest worker's device memory is within the budget}
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace

from .config import NoiseConfig, RunConfig, TrainConfig
from .sizing import LADDER, SHAPES, Counts, Shape, activation_terms, chain_streams, codec_bits, counts, worker_flops

METHODS = ("e2e", "diloco", "blocktrain")
MIB = 2**20
MEMORY_BUDGET = 24 * 2**30  # a 24 GiB consumer GPU
FLOPS_PER_SECOND = 50e12  # sustained training throughput assumed for a consumer GPU (bf16), to turn steps into hours
# a holder's copies of what it sent its readers: at most this many, and this many bytes (spheroid/node/worker.py)
READER_COPIES, READER_COPIES_BYTES = 64, 256 << 20


# --- settings ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Exchange:
    """How workers exchange: diloco's averaging, blocktrain's replicas' averaging and its refreshes.

    Defaults: the rounds of spheroid's averaging (H = 20, `AveragingConfig.every`), refreshes as often
    (a worker refreshes every `refresh_every or every` steps), and int2 for both streams, so that the
    methods are compared on the same codec (int2 averaging needs error feedback, whose residual costs
    memory); DiLoCo's outer Nesterov step, whose momentum costs memory too.
    """

    workers: int = 8  # diloco: N replicas of the whole model
    replicas: int = 1  # blocktrain: r workers per block (all B * r of them train)
    every: int = 20  # H: local steps per averaging round
    codec: str = "int2"  # averaging
    refresh_every: int = 20  # R: a block's steps between refreshes of each frozen copy (0: never)
    refresh_codec: str = "int2"  # fp32 = snapshots; any other = the change from the copy the reader holds
    outer: str = "nesterov"  # "average" (spheroid's default) or "nesterov" (DiLoCo: momentum on every replica)
    feedback: bool | None = None  # error feedback (a residual per replica); None: only where int2 needs it
    codec_bits: float | None = None  # measured bits per value (say after lz4); None: the raw codec's
    refresh_bits: float | None = None

    @property
    def averaging_bits(self) -> float:
        return self.codec_bits if self.codec_bits is not None else codec_bits(self.codec)

    @property
    def refreshing_bits(self) -> float:
        return self.refresh_bits if self.refresh_bits is not None else codec_bits(self.refresh_codec)

    def averaging_state(self) -> int:
        """fp32 vectors a replica keeps to average: the round's starting point, the outer momentum, the
        error-feedback residual."""
        feedback = self.codec == "int2" if self.feedback is None else self.feedback
        return 1 + (self.outer == "nesterov") + feedback


@dataclass(frozen=True)
class Workload:
    """One optimizer step of one worker: `batch` sequences of the model's context, activations at
    `act_bytes` (4: CPU fp32; 2: CUDA bf16 autocast, as spheroid trains on a GPU), fused attention or
    the math kernel, frozen copies at `frozen_bytes` a parameter."""

    batch: int = 1
    act_bytes: int = 2
    fused_attention: bool = True
    frozen_bytes: int = 4


# --- workers -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Memory:
    """One worker's memory, in bytes, by what holds it (see the module's docstring)."""

    weights: int = 0
    gradients: int = 0
    optimizer: int = 0
    averaging: int = 0
    activations: int = 0
    cast_weights: int = 0
    chain_streams: int = 0
    frozen: int = 0
    reader_copies: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def device(self) -> int:
        """What must sit on the accelerator every step: all but what the exchange reads once a round."""
        return self.total - self.averaging - self.reader_copies

    def mib(self) -> dict[str, float]:
        return {**{f.name: getattr(self, f.name) / MIB for f in fields(self)},
                "total": self.total / MIB, "device": self.device / MIB}


@dataclass(frozen=True)
class Worker:
    """One kind of worker of a method (`count` of them alike): what it trains and holds, its memory, its
    FLOPs per step, and the bytes it sends and receives per step of its own."""

    name: str
    block: int | None
    count: int
    trained: int
    frozen: int
    memory: Memory
    activation_terms: dict[str, int]
    flops: float
    sent: float
    received: float
    kept_parameters: int  # bytes of its parameters that autograd references as saved (fp32 runs only)


@dataclass(frozen=True)
class Plan:
    """A method at one configuration: its workers, and the figures the comparison reads off them."""

    method: str
    n_blocks: int
    exchange: Exchange
    workers: list[Worker] = field(default_factory=list)

    @property
    def largest(self) -> Worker:
        return max(self.workers, key=lambda w: (w.memory.device, w.block or 0))

    @property
    def busiest(self) -> Worker:
        return max(self.workers, key=lambda w: (w.sent, -(w.block or 0)))

    @property
    def n_workers(self) -> int:
        return sum(w.count for w in self.workers)

    @property
    def parameters(self) -> int:
        """Parameters of the model trained (one replica's for diloco; all blocks' for blocktrain)."""
        return self.workers[0].trained if self.method != "blocktrain" else sum(w.trained for w in self.workers)

    def total(self, what: str) -> float:
        return sum(getattr(w, what) * w.count for w in self.workers)


def _train_memory(trained: Counts, terms: dict[str, int], act_bytes: int, peers: int, exchange: Exchange) -> Memory:
    return Memory(
        weights=4 * trained.params, gradients=4 * trained.params, optimizer=8 * trained.params,
        averaging=4 * trained.params * exchange.averaging_state() if peers > 1 else 0,
        activations=sum(terms.values()),
        cast_weights=act_bytes * trained.linear_weights if act_bytes < 4 else 0,
    )


def _averaging_bytes(params: int, peers: int, every: int, bits: float) -> float:
    """Bytes a replica sends per local step: 2 (n - 1) / n of the vector a round (reduce-scatter, then
    all-gather), a round every `every` steps."""
    return 2 * (peers - 1) / peers * params * bits / 8 / every if peers > 1 else 0.0


def plan(method: str, cfg: RunConfig, workload: Workload = Workload(), exchange: Exchange = Exchange()) -> Plan:
    """Every worker of `method` training `cfg`'s model (for e2e and diloco: the reference of depth
    n_blocks x layers_per_block; for blocktrain: its blocks), with the workload and exchange given."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    batch, a, fused = workload.batch, workload.act_bytes, workload.fused_attention
    if method in ("e2e", "diloco"):
        ref = counts(cfg.model, "reference")
        peers = exchange.workers if method == "diloco" else 1
        terms = activation_terms(cfg, "reference", batch, a, fused)
        sent = _averaging_bytes(ref.params, peers, exchange.every, exchange.averaging_bits)
        worker = Worker("reference" if method == "e2e" else "replica", None, peers, ref.params, 0,
                        _train_memory(ref, terms, a, peers, exchange), terms, worker_flops(cfg, "reference", batch),
                        sent, sent, 4 * (ref.linear_weights + ref.norm_params))
        return Plan(method, 1, exchange, [worker])
    m, r = cfg.model, exchange.replicas
    reads = cfg.train.block_input == "chain" or m.channel == "relay"  # `train.reads_earlier`
    refresh = exchange.refresh_every
    block_params = [counts(m, b).params for b in range(m.n_blocks)]
    workers = []
    for b in range(m.n_blocks):
        own = counts(m, b)
        frozen = sum(block_params[:b]) if reads else 0
        readers = m.n_blocks - 1 - b if reads and refresh else 0  # later blocks, r workers each, served by r holders
        copies = min(readers, max(1, min(READER_COPIES, READER_COPIES_BYTES // (4 * own.params))))
        terms = activation_terms(cfg, b, batch, a, fused)
        memory = replace(_train_memory(own, terms, a, r, exchange),
                         chain_streams=chain_streams(cfg, b, batch, a) if reads else 0,
                         frozen=workload.frozen_bytes * frozen,
                         reader_copies=4 * own.params * copies if exchange.refresh_codec != "fp32" else 0)
        averaging = _averaging_bytes(own.params, r, exchange.every, exchange.averaging_bits)
        per_refresh = exchange.refreshing_bits / 8 / refresh if refresh else 0.0
        workers.append(Worker(f"block {b}", b, r, own.params, frozen, memory, terms, worker_flops(cfg, b, batch),
                              averaging + readers * own.params * per_refresh,
                              averaging + (frozen * per_refresh if reads else 0.0),
                              4 * (own.linear_weights + own.norm_params)))
    return Plan(method, m.n_blocks, exchange, workers)


# --- the projection at public shapes -------------------------------------------------------------------


def _run_config(shape: Shape, method: str, n_blocks: int) -> RunConfig:
    return RunConfig(model=shape.model(method, n_blocks), noise=NoiseConfig(), train=TrainConfig(block_input="chain"))


def shape_plan(shape: Shape, method: str, n_blocks: int = 4, workload: Workload = Workload(),
               exchange: Exchange = Exchange()) -> Plan:
    """`plan` at a public shape (n_blocks: blocktrain's B; ignored by the others)."""
    return plan(method, _run_config(shape, method, n_blocks), workload, exchange)


def flops_per_step(method: str, shape: Shape | RunConfig, n_blocks: int = 4, batch: int = 1,
                   exchange: Exchange = Exchange()) -> dict[str, float]:
    """FLOPs of one optimizer step: of the worker that computes most (blocktrain: block B-1, which also
    runs the frozen blocks' forward passes) and of all workers together."""
    p = _plan_of(method, shape, n_blocks, Workload(batch=batch), exchange)
    return {"largest_worker": max(w.flops for w in p.workers), "total": p.total("flops")}


def bytes_per_step(method: str, shape: Shape | RunConfig, n_blocks: int = 4,
                   exchange: Exchange = Exchange()) -> dict[str, float]:
    """Bytes sent per optimizer step, all workers stepping in lockstep: by the busiest sender and by all."""
    p = _plan_of(method, shape, n_blocks, Workload(), exchange)
    return {"busiest_worker": p.busiest.sent, "total": p.total("sent")}


def bytes_per_hour(method: str, shape: Shape | RunConfig, n_blocks: int = 4, batch: int = 1,
                   flops_per_second: float = FLOPS_PER_SECOND, steps_per_second: float | None = None,
                   exchange: Exchange = Exchange()) -> dict[str, float]:
    """Bytes sent per hour by the busiest sender and by all (`hourly`)."""
    return hourly(_plan_of(method, shape, n_blocks, Workload(batch=batch), exchange), flops_per_second,
                  steps_per_second)


def hourly(p: Plan, flops_per_second: float = FLOPS_PER_SECOND,
           steps_per_second: float | None = None) -> dict[str, float]:
    """Bytes a plan's busiest sender, and all its workers, send per hour. Each worker steps at
    `steps_per_second`, or (default) at `flops_per_second` over its own FLOPs per step (50e12: a
    consumer GPU's sustained bf16 training rate, an assumption): so a blocktrain holder sends each
    reader its refresh at the reader's pace (slower for later blocks, which run the chain), and
    averages with its replicas at its own pace."""
    x = p.exchange
    rate = {w.name: 3600 * (steps_per_second or flops_per_second / w.flops) for w in p.workers}
    per_worker = {}
    for w in p.workers:
        if p.method != "blocktrain":
            per_worker[w.name] = w.sent * rate[w.name]
            continue
        averaging = _averaging_bytes(w.trained, x.replicas, x.every, x.averaging_bits) * rate[w.name]
        readers = [r for r in p.workers if r.block > w.block and r.frozen] if x.refresh_every else []
        per_worker[w.name] = averaging + sum(w.trained * x.refreshing_bits / 8 / x.refresh_every * rate[r.name]
                                             for r in readers)
    return {"busiest_worker": max(per_worker.values()),
            "total": sum(per_worker[w.name] * w.count for w in p.workers)}


def _plan_of(method: str, shape: Shape | RunConfig, n_blocks: int, workload: Workload, exchange: Exchange) -> Plan:
    if isinstance(shape, Shape):
        return shape_plan(shape, method, n_blocks, workload, exchange)
    return plan(method, shape, workload, exchange)


def figures(p: Plan, memory_bytes: int = MEMORY_BUDGET, flops_per_second: float = FLOPS_PER_SECOND) -> dict:
    """The JSON figures of a plan (the module's docstring lists the keys)."""
    big, busy = p.largest, p.busiest
    return {
        "method": p.method, "n_blocks": p.n_blocks, "workers": p.n_workers,
        "parameters": {"total": p.parameters, "largest_worker": big.trained, "largest_worker_frozen": big.frozen},
        "largest_worker": big.name,
        "memory_mib": big.memory.mib(),
        "busiest_worker": busy.name,
        "bytes_per_step": {"busiest_worker": busy.sent, "total": p.total("sent")},
        "flops_per_step": {"largest_worker": max(w.flops for w in p.workers), "total": p.total("flops")},
        "bytes_per_hour": hourly(p, flops_per_second),
        "fits": big.memory.device <= memory_bytes,
    }


def _method_keys(blocks: Iterable[int]) -> dict[str, tuple[str, int]]:
    return {"e2e": ("e2e", 1), "diloco": ("diloco", 1), **{f"blocktrain_B{b}": ("blocktrain", b) for b in blocks}}


def largest_model(method: str, memory_bytes: int = MEMORY_BUDGET, n_blocks: int = 4,
                  workload: Workload = Workload(), exchange: Exchange = Exchange(),
                  ladder: Iterable[Shape] = LADDER.values()) -> dict:
    """The largest shape of the ladder whose largest worker fits in `memory_bytes` at the workload
    (default: one sequence of the shape's context a step, bf16 activations, fp32 master weights and
    AdamW, fp32 frozen copies): {"method", "n_blocks", "budget_mib", "batch", "act_bytes", "shape"
    (its name, or None), "figures" (its `figures`, or None), "first_too_large" ({"shape",
    "largest_worker_mib"} of the smallest shape that does not fit, or None)}. Shapes whose layers do
    not split into n_blocks are passed over for blocktrain."""
    fitting, too_large = [], []
    for shape in ladder:
        try:
            p = shape_plan(shape, method, n_blocks, workload, exchange)
        except ValueError:  # layers not divisible into the blocks
            continue
        (fitting if p.largest.memory.device <= memory_bytes else too_large).append((p.parameters, shape, p))
    best = max(fitting, key=lambda x: x[0], default=None)
    first_out = min(too_large, key=lambda x: x[0], default=None)
    return {
        "method": method, "n_blocks": n_blocks if method == "blocktrain" else 1,
        "budget_mib": memory_bytes / MIB, "batch": workload.batch, "act_bytes": workload.act_bytes,
        "shape": best[1].name if best else None,
        "figures": figures(best[2], memory_bytes) if best else None,
        "first_too_large": ({"shape": first_out[1].name, "largest_worker_mib": first_out[2].largest.memory.device / MIB}
                            if first_out else None),
    }


def project(shapes: Iterable[Shape] = SHAPES.values(), blocks: Iterable[int] = (4, 8),
            memory_bytes: int = MEMORY_BUDGET, workload: Workload = Workload(), exchange: Exchange = Exchange(),
            flops_per_second: float = FLOPS_PER_SECOND, ladder: Iterable[Shape] = LADDER.values()) -> dict:
    """The whole projection as a JSON-ready dict (keys in the module's docstring)."""
    keys = _method_keys(tuple(blocks))
    out: dict = {
        "schema": 1,
        "assumptions": {
            "memory_budget_mib": memory_bytes / MIB, "batch_sequences": workload.batch,
            "act_bytes": workload.act_bytes, "fused_attention": workload.fused_attention,
            "frozen_bytes_per_parameter": workload.frozen_bytes, "master_weights": "fp32", "optimizer": "AdamW",
            "flops_per_second": flops_per_second, "diloco_workers": exchange.workers,
            "blocktrain_replicas": exchange.replicas, "every": exchange.every, "codec": exchange.codec,
            "codec_bits": exchange.averaging_bits, "refresh_every": exchange.refresh_every,
            "refresh_codec": exchange.refresh_codec, "refresh_bits": exchange.refreshing_bits,
            "outer": exchange.outer,
            "step_rate": "each worker at flops_per_second / its FLOPs per step",
            "vocab": 256, "mlp_ratio": 4,
        },
        "shapes": {},
    }
    for shape in shapes:
        methods, fit = {}, []
        for key, (method, n_blocks) in keys.items():
            try:
                p = shape_plan(shape, method, n_blocks, workload, exchange)
            except ValueError as exc:
                methods[key] = {"skipped": str(exc)}
                continue
            methods[key] = figures(p, memory_bytes, flops_per_second)
            if methods[key]["fits"]:
                fit.append(key)
        out["shapes"][shape.name] = {"shape": shape.as_dict(), "methods": methods, "fit": fit}
    ladder = tuple(ladder)
    out["largest_model"] = {key: largest_model(method, memory_bytes, n_blocks, workload, exchange, ladder)
                            for key, (method, n_blocks) in keys.items()}
    return out


# --- at a bench's own shape ----------------------------------------------------------------------------


def at_bench_shape(cfg: RunConfig, method: str, workers: int = 1, every: int = 20, codec: str = "fp32",
                   refresh_every: int | None = None, refresh_codec: str | None = None, batch: int | None = None,
                   codec_bits: float | None = None, refresh_bits: float | None = None,
                   outer: str = "average") -> dict:
    """The model at a small bench's own configuration, CPU fp32, to set beside measured figures.

    `workers`: diloco's N replicas, or blocktrain's r workers per block (ignored by e2e); `every`: H;
    `refresh_every`/`refresh_codec`: cfg.train's unless given; `batch`: cfg.train.batch unless given;
    `codec_bits`/`refresh_bits`: effective bits per value (a measured lz4 ratio times the codec's),
    else the raw codec's; `outer`: the averaging's outer step, "average" as spheroid's default (its
    state: the round's starting point only) or "nesterov" (and the outer momentum).

    Returns {"method", "batch", "context", "act_bytes",
             "workers": [per kind of worker: {"worker", "block", "count", "parameters", "frozen_parameters",
                         "memory_mib" (`Memory` in MiB), "activation_terms_mib",
                         "kept_for_backward_mib" (activations plus the parameters autograd holds as saved:
                         what a saved-tensor count that does not tell parameters apart, as bench/memory.py's,
                         sees), "bytes_per_step": {"sent", "received"}, "flops_per_step"}],
             "largest_worker", "busiest_worker", "bytes_per_step": {"busiest_worker", "total"},
             "codec_bits", "refresh_bits"}."""
    exchange = Exchange(
        workers=workers if method == "diloco" else 1, replicas=workers if method == "blocktrain" else 1,
        every=every, codec=codec,
        refresh_every=cfg.train.refresh_every if refresh_every is None else refresh_every,
        refresh_codec=refresh_codec or cfg.train.refresh_codec, outer=outer, codec_bits=codec_bits,
        refresh_bits=refresh_bits)
    workload = Workload(batch=batch or cfg.train.batch, act_bytes=4)
    p = plan(method, cfg, workload, exchange)
    return {
        "method": method, "batch": workload.batch, "context": cfg.model.context, "act_bytes": 4,
        "workers": [{
            "worker": w.name, "block": w.block, "count": w.count, "parameters": w.trained,
            "frozen_parameters": w.frozen, "memory_mib": w.memory.mib(),
            "activation_terms_mib": {k: v / MIB for k, v in w.activation_terms.items()},
            "kept_for_backward_mib": (w.memory.activations + w.kept_parameters) / MIB,
            "bytes_per_step": {"sent": w.sent, "received": w.received}, "flops_per_step": w.flops,
        } for w in p.workers],
        "largest_worker": p.largest.name, "busiest_worker": p.busiest.name,
        "bytes_per_step": {"busiest_worker": p.busiest.sent, "total": p.total("sent")},
        "codec_bits": exchange.averaging_bits, "refresh_bits": exchange.refreshing_bits,
    }
