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

Why a model and not only measurements: the shapes that matter (1B to 65B parameters) do not fit
on the machines that run the benchmarks. So every figure here is either exact by construction
(parameter counts: the real modules, built on the meta device) or an itemised formula that the
tests calibrate against what torch really does at tiny shapes (activations within 15% of the bytes
autograd saves, FLOPs within 20% of torch's FlopCounterMode), so that a reader can see each term
and where it comes from.

Memory of a worker (`Memory`, bytes; reported in MiB):
  weights, gradients, optimizer   4 + 4 + 8 bytes per trained parameter (fp32 master, AdamW moments)
  averaging                       the round's shared starting point (4 bytes a parameter), DiLoCo's
                                  outer momentum (4) and the error-feedback residual (4), when the
                                  worker averages with peers
  activations                     tensors autograd saves for backward in one step (`activation_terms`)
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

Activations are counted at a stated precision: `act_bytes` = 4 (CPU, fp32) or 2 (CUDA, bf16 autocast)
for what matmuls read and write (linear inputs, q/k/v, attention outputs, the MLP's hidden layer).
Under autocast the residual stream and the layer norms stay fp32 (layer_norm runs in fp32 and a
residual add promotes to it), and so does the cross-entropy's log-softmax (`logits.float()`): those
terms are 4 bytes whatever act_bytes is. Attention is fused by default (torch's
scaled_dot_product_attention picks a flash or memory-efficient kernel on CUDA and a flash kernel on
the CPU): it saves q, k, v, its output and one log-sum-exp per head and query, never the B x h x T x T
probabilities; `fused_attention=False` models the math kernel, which saves them.

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

import contextlib
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields, replace

import torch
from torch import nn

from .config import ModelConfig, NoiseConfig, RunConfig, TrainConfig
from .model import DiffusionBlock, Reference
from .wire.tensors import encode_tensor

METHODS = ("e2e", "diloco", "blocktrain")
MIB = 2**20
FP32 = 4  # bytes of what stays fp32 under autocast: residual stream, layer norms, log-softmax, statistics
INDEX = 8  # bytes of an int64 index (bytes in, targets)
MEMORY_BUDGET = 24 * 2**30  # a 24 GiB consumer GPU
FLOPS_PER_SECOND = 50e12  # sustained training throughput assumed for a consumer GPU (bf16), to turn steps into hours
# a holder's copies of what it sent its readers: at most this many, and this many bytes (spheroid/node/worker.py)
READER_COPIES, READER_COPIES_BYTES = 64, 256 << 20


# --- shapes ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A public model shape: width, depth, heads and context. Built as spheroid's layers (GPT-style,
    MLP ratio 4, biases, learned positions) over 256 byte values, so its parameter counts differ from
    the original's (no 50k-token embedding; LLaMA's SwiGLU MLP is 3 x 8/3 d^2, spheroid's 2 x 4 d^2)."""

    name: str
    d_model: int
    n_layers: int
    n_heads: int
    context: int = 2048
    note: str = ""

    def model(self, method: str, n_blocks: int = 1) -> ModelConfig:
        """The ModelConfig a method trains at this shape: the reference (one "block" of all the
        layers), or n_blocks blocks of n_layers / n_blocks layers each."""
        if method != "blocktrain":
            return ModelConfig(d_model=self.d_model, n_heads=self.n_heads, layers_per_block=self.n_layers,
                               n_blocks=1, context=self.context, reference_layout="plain")
        if self.n_layers % n_blocks:
            raise ValueError(f"{self.n_layers} layers do not split into {n_blocks} equal blocks")
        return ModelConfig(d_model=self.d_model, n_heads=self.n_heads, layers_per_block=self.n_layers // n_blocks,
                           n_blocks=n_blocks, context=self.context, layout="concat", channel="relay")

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "name"}


def _shapes(*shapes: Shape) -> dict[str, Shape]:
    return {s.name: s for s in shapes}


GPT3_NOTE = "GPT-3 (Brown et al. 2020, table 2.1)"
SHAPES = _shapes(
    Shape("gpt3-small-125m", 768, 12, 12, note=GPT3_NOTE),
    Shape("gpt3-xl-1.3b", 2048, 24, 16, note=GPT3_NOTE + "; 16 heads of 128 (the table's 24 heads do not divide 2048)"),
    Shape("llama-7b", 4096, 32, 32, note="LLaMA (Touvron et al. 2023); GPT-style MLP here, not SwiGLU"),
)
# every shape largest_model() tries, smallest first
LADDER = _shapes(
    SHAPES["gpt3-small-125m"],
    Shape("gpt3-medium-350m", 1024, 24, 16, note=GPT3_NOTE),
    Shape("gpt3-large-760m", 1536, 24, 16, note=GPT3_NOTE),
    SHAPES["gpt3-xl-1.3b"],
    Shape("gpt3-2.7b", 2560, 32, 32, note=GPT3_NOTE),
    Shape("gpt3-6.7b", 4096, 32, 32, note=GPT3_NOTE),
    SHAPES["llama-7b"],
    Shape("gpt3-13b", 5120, 40, 40, note=GPT3_NOTE + "; width 5120 (the table's 5140 does not split into 40 heads)"),
    Shape("llama-33b", 6656, 60, 52, note="LLaMA (Touvron et al. 2023), the '30B' model"),
    Shape("llama-65b", 8192, 80, 64, note="LLaMA (Touvron et al. 2023)"),
    Shape("gpt3-175b", 12288, 96, 96, note=GPT3_NOTE),
)


# --- parameters, exactly -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Counts:
    """What a module holds: all its parameters, the weights of its linear layers (what matmuls read,
    what autocast casts to bf16) and the affine parameters of its layer norms (saved for backward too)."""

    params: int
    linear_weights: int
    norm_params: int
    relay_head: bool = False  # (a block) whether it has the relay loss's head

    def __sub__(self, other: Counts) -> Counts:
        return Counts(self.params - other.params, self.linear_weights - other.linear_weights,
                      self.norm_params - other.norm_params, self.relay_head)

    def __add__(self, other: Counts) -> Counts:
        return Counts(self.params + other.params, self.linear_weights + other.linear_weights,
                      self.norm_params + other.norm_params, self.relay_head)

    def __mul__(self, k: int) -> Counts:
        return Counts(self.params * k, self.linear_weights * k, self.norm_params * k, self.relay_head)


def _count(module: nn.Module) -> Counts:
    mods = list(module.modules())
    return Counts(
        params=sum(p.numel() for p in module.parameters()),
        linear_weights=sum(m.weight.numel() for m in mods if isinstance(m, nn.Linear)),
        norm_params=sum(p.numel() for m in mods if isinstance(m, nn.LayerNorm) for p in m.parameters()),
        relay_head=getattr(module, "relay_head", None) is not None,
    )


@contextlib.contextmanager
def _no_init() -> Iterator[None]:
    """torch.nn.init's initialisers as no-ops: on the meta device they write nothing anyway, but each
    call still costs about a millisecond through torch's reference implementations, so that building a
    module's 100 tensors took most of the projection's time."""
    names = ("normal_", "zeros_", "ones_", "uniform_", "kaiming_uniform_", "trunc_normal_", "constant_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


@functools.lru_cache(maxsize=256)
def _built(cfg: ModelConfig, worker: str | int) -> Counts:
    """The real module, built on the meta device (no memory, no values), counted."""
    with torch.device("meta"), _no_init():
        module = Reference(cfg) if worker == "reference" else DiffusionBlock(cfg, 0.5, worker)
    return _count(module)


@functools.lru_cache(maxsize=256)
def counts(cfg: ModelConfig, worker: str | int) -> Counts:
    """Exact counts of the reference ("reference") or of block `worker` at this configuration.

    Built at one and two layers per block and extended linearly to the configured depth: a layer's
    parameters do not depend on how many there are, so this is exact, and it takes milliseconds where
    building 80 layers of width 8192, even on the meta device, takes a fifth of a second (a test checks
    it against the module built at full depth). Blocks differ only in whether they have the relay
    loss's head (every block but the last), so block 0 stands for the others but the last."""
    if worker != "reference" and worker < cfg.n_blocks - 1:
        worker = 0
    if cfg.layers_per_block <= 2:
        return _built(cfg, worker)
    one = _built(replace(cfg, layers_per_block=1), worker)
    per_layer = _built(replace(cfg, layers_per_block=2), worker) - one
    return one + per_layer * (cfg.layers_per_block - 1)


def parameters(cfg: ModelConfig, worker: str | int) -> int:
    """Parameters of the reference ("reference") or of block `worker` (an index), exactly."""
    return counts(cfg, worker).params


# --- codecs --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def codec_bits(codec: str) -> float:
    """Bits a value takes on the wire in a codec (config names: fp32, fp16, bf16, int8, int4, int2),
    its per-chunk scales included, before lz4: measured by encoding 65536 values with the wire's
    own encoder, so it is what a sender sends. int2 at its most (values that all round to +-1: a bit
    for each value's "not zero" and a sign bit for each, 2 bits; typical updates, about 70% zeros,
    take about 1.3): pass a measured figure where it matters. A tensor's header (tens of bytes) is left
    out: the bits are the growth of the encoded size from n to 2n values."""
    n, wire = 1 << 16, "raw" if codec == "fp32" else codec  # (n: whole chunks of every codec)
    return 8 * (len(encode_tensor(torch.ones(2 * n), wire)) - len(encode_tensor(torch.ones(n), wire))) / n


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


# --- activations ---------------------------------------------------------------------------------------


def _layer_terms(d: int, heads: int, mlp: int, a: int, fused: bool, tokens: int, keys: int, adaln: bool,
                 q_only: bool = False) -> dict[str, int]:
    """What one transformer layer saves for backward over `tokens` query tokens, each attending to
    `keys` keys (`Layer.forward`, as autograd sees it):

      residual_stream   the input of each layer norm (d each; fp32)
      norm_outputs      AdaLN: each norm's output, kept by its modulation `norm(h) * (1 + scale)` (fp32)
      linear_inputs     the inputs of qkv and of the MLP's first linear (d each); attn.proj reads the
                        attention output, which is kept anyway
      branch_outputs    AdaLN: attn.proj's and the MLP's outputs, kept by the gates (d each)
      qkv               qkv's output (3d: the fused kernel keeps q, k, v as views of it; the math kernel
                        keeps copies; `q_only`: only q comes from it, k and v are joined copies)
      attention_output  the attention's output (d)
      attention_lse     fused: one fp32 log-sum-exp per head and query
      attention_probabilities  math kernel: softmax(q k^T) per head, query and key
      mlp_hidden        the MLP's hidden layer before and after the GELU (2 x mlp_ratio x d)
      norm_statistics   each layer norm's mean and 1/std (fp32)
    """
    t = tokens
    terms = {
        "residual_stream": 2 * d * FP32 * t,
        "norm_outputs": 2 * d * FP32 * t if adaln else 0,
        "linear_inputs": 2 * d * a * t,
        "branch_outputs": 2 * d * a * t if adaln else 0,
        "qkv": (d if q_only and not fused else 3 * d) * a * t,
        "attention_output": d * a * t,
        "attention_lse": heads * FP32 * t if fused else 0,
        "attention_probabilities": 0 if fused else heads * keys * a * t,
        "mlp_hidden": 2 * mlp * d * a * t,
        "norm_statistics": 2 * 2 * FP32 * t,
    }
    return terms


def _add(total: dict[str, int], terms: dict[str, int], times: int = 1) -> dict[str, int]:
    for k, v in terms.items():
        total[k] = total.get(k, 0) + v * times
    return total


def activation_terms(cfg: RunConfig, worker: str | int, batch: int, act_bytes: int = 4,
                     fused_attention: bool = True) -> dict[str, int]:
    """Bytes autograd saves for backward in one training step of the reference ("reference") or of
    block `worker`, term by term (the frozen earlier blocks run without gradients: they save nothing).

    Left out, as under 1% at the tests' tiny shapes and less beyond: what is saved once per sequence
    rather than per token (the noise embedding, the AdaLN modulation vectors, EDM's coefficients).
    """
    m = cfg.model
    d, heads, mlp, v, t, a = m.d_model, m.n_heads, m.mlp_ratio, m.vocab, m.context, act_bytes
    n = batch * t  # tokens of one stream
    layer = functools.partial(_layer_terms, d, heads, mlp, a, fused_attention)
    if worker == "reference":
        if m.reference_layout != "plain":
            raise ValueError("the projection models the plain reference only")
        terms = _add({}, layer(n, t, adaln=False), m.n_blocks * m.layers_per_block)
        terms["final_norm_and_head"] = (d * FP32 + d * a) * n  # the norm's input (fp32) and the head's input
        terms["norm_statistics"] += 2 * FP32 * n
        terms["cross_entropy"] = v * FP32 * n  # log-softmax of fp32 logits
        terms["indices"] = INDEX * (batch * (t + 1) + n)  # the byte windows, the targets
        return terms
    if m.layout != "concat":
        raise ValueError("the projection models the concat layout (two streams) only")
    relay, noisy = counts(m, worker).relay_head, noisy_positions(cfg)
    k = batch * noisy  # noisy tokens
    # the clean stream: t tokens, causal; the noisy stream: `noisy` tokens, each reading t + noisy keys
    terms = _add({}, layer(n, t, adaln=True), m.layers_per_block)
    terms = _add(terms, layer(k, t + noisy, adaln=True, q_only=True), m.layers_per_block)
    terms["joined_keys_values"] = m.layers_per_block * 2 * (t + noisy) * d * a * batch  # cat(clean, noisy) k, v
    terms["attention_mask"] = m.layers_per_block * noisy * (t + noisy) * a if fused_attention else 0  # a float bias
    terms["noisy_input"] = d * a * k  # noisy_in's input, c_in * z
    # readout: norm_out's input and its output (kept by the modulation), out's input; then the head's
    # norm input D and the head's input
    terms["readout_and_head"] = (2 * d * FP32 + d * a + d * FP32 + d * a) * k
    terms["norm_statistics"] += 2 * 2 * FP32 * k
    terms["cross_entropy"] = v * FP32 * k
    terms["indices"] = INDEX * (batch * (t + 1) + 2 * k)  # windows, anchors, targets
    if relay:  # the relay loss's head on the clean stream's output: its norm's input, the linear's input,
        hidden = m.relay_head_hidden  # and where it is an MLP, its hidden layer before and after the GELU
        terms["relay_head"] = (d * FP32 + d * a + 2 * hidden * a) * n
        terms["norm_statistics"] += 2 * FP32 * n
        terms["cross_entropy"] += v * FP32 * n
        terms["indices"] += INDEX * n
    return terms


def noisy_positions(cfg: RunConfig) -> int:
    """Noisy tokens per training sequence: one per position, or train.noisy_positions (`noisy_span`)."""
    n = cfg.train.noisy_positions
    return n if n and n < cfg.model.context else cfg.model.context


def chain_streams(cfg: RunConfig, block: int, batch: int, act_bytes: int = 4) -> int:
    """Bytes of the frozen blocks' clean streams a block trainer holds while its loss is computed:
    per block that ran, each layer's keys and values (views of its qkv output, 3d a token) and the
    stream's output (d, fp32). With chain states the blocks 0..block-1 ran, and the block itself
    (without gradients) at the levels where the chain reaches its own steps; with noised inputs and
    the relay channel only blocks 0..block-1's clean streams ran."""
    m, ran = cfg.model, _frozen_runs(cfg, block)
    blocks = block + (max(own for own in ran.own_steps) > 0)
    per_token = m.layers_per_block * 3 * m.d_model * act_bytes + m.d_model * FP32
    return blocks * per_token * batch * m.context if ran.streams else 0


# --- FLOPs ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Runs:
    """What a block trainer runs of the frozen blocks each step: `streams` whether their clean
    streams run at all; per level it may train at, how many Euler steps its own block takes
    without gradients (`own_steps`); `earlier_steps` Euler steps of each earlier block."""

    streams: bool
    earlier_steps: int
    own_steps: tuple[int, ...]


def _frozen_runs(cfg: RunConfig, block: int) -> _Runs:
    m, spb = cfg.model, cfg.noise.steps_per_block
    if cfg.train.block_input == "chain":  # `chain_state_loss`: the levels it reads at inference
        levels = list(range(block * spb, (block + 1) * spb)) + ([m.n_blocks * spb] if block == m.n_blocks - 1 else [])
        return _Runs(True, spb, tuple(level - block * spb for level in levels))
    return _Runs(m.channel == "relay" and block > 0, 0, (0,))


def _forward_flops(cfg: RunConfig, batch: int) -> dict[str, float]:
    """Forward FLOPs of the pieces of a model, per step: 2 per multiply-add of every matmul applied per
    token, plus attention's two products (q k^T and the weights times v: 4 x queries x keys x d),
    counted dense as torch's FlopCounterMode counts them (a causal flash kernel skips the masked half).
    Matmuls applied once per sequence (AdaLN, the noise embedding) are left out."""
    m = cfg.model
    d, v, t, b, k = m.d_model, m.vocab, m.context, batch, noisy_positions(cfg)
    layer = (4 + 2 * m.mlp_ratio) * d * d  # qkv, proj, the MLP's two linears
    depth, hidden = m.layers_per_block, m.relay_head_hidden
    return {
        "reference": depth * m.n_blocks * (2 * b * t * layer + 4 * b * t * t * d) + 2 * b * t * d * v,
        "clean_stream": depth * (2 * b * t * layer + 4 * b * t * t * d),
        # the noisy stream (k queries on t + k keys), noisy_in, out and the head
        "noisy_step": depth * (2 * b * k * layer + 4 * b * k * (t + k) * d) + 2 * b * k * (2 * d * d + d * v),
        "relay_head": 2 * b * t * (d * hidden + hidden * v if hidden else d * v),
        "euler": 2 * b * k * v * d,  # softmax(logits) @ codebook
    }


def worker_flops(cfg: RunConfig, worker: str | int, batch: int) -> float:
    """FLOPs of one optimizer step of the reference or of block `worker`: 3 x forward for what trains
    (the backward pass computes the gradients of a matmul's input and of its weight: twice its
    forward), plus the forward passes of the frozen blocks (and the block's own passes without
    gradients) that compute its chain states, averaged over the levels it trains at (the last block
    reads off at sigma_min half the time: one more pass of its own).

    In a block where nothing reads its clean stream's output (no relay head, noisy anchors from the
    embedding), autograd skips the backward pass of the stream's last layer past its keys and values
    (attention output, proj, MLP)."""
    m, f = cfg.model, _forward_flops(cfg, batch)
    if worker == "reference":
        return 3 * f["reference"]
    d, tokens = m.d_model, batch * m.context
    relay = counts(m, worker).relay_head
    read = relay or m.noisy_anchor == "stream"  # what reads the clean stream's output
    own = f["clean_stream"] + f["noisy_step"] + (f["relay_head"] if relay else 0)
    # the last clean layer past its keys and values, where nothing reads the stream's output
    no_backward = 0 if read else 4 * tokens * m.context * d + 2 * tokens * (1 + 2 * m.mlp_ratio) * d * d
    runs = _frozen_runs(cfg, worker)
    step = f["noisy_step"] + f["euler"]
    frozen = worker * (f["clean_stream"] + runs.earlier_steps * step) if runs.streams else 0
    own_steps = sum(runs.own_steps) / len(runs.own_steps)
    own_clean = sum(s > 0 for s in runs.own_steps) / len(runs.own_steps)
    return 3 * own - 2 * no_backward + frozen + own_steps * step + own_clean * f["clean_stream"]


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

