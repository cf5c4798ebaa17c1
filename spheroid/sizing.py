"""What one training step of a model shape holds and costs, worker by worker: the shapes themselves,
exact parameter counts, the bytes autograd saves for backward, the frozen blocks' chain streams, the
FLOPs, and the bits a codec puts on the wire.

It stands apart from spheroid/projection.py, which combines these figures into the three training
methods' workers, memory and traffic, because this is the part checked against torch term by term:
each figure here can be read, and calibrated, without the methods' bookkeeping.

Why a model and not only measurements: the shapes that matter (1B to 65B parameters) do not fit
on the machines that run the benchmarks. So every figure here is either exact by construction
(parameter counts: the real modules, built on the meta device) or an itemised formula that the
tests calibrate against what torch really does at tiny shapes (activations within 15% of the bytes
autograd saves, FLOPs within 20% of torch's FlopCounterMode), so that a reader can see each term
and where it comes from.

Activations are counted at a stated precision: `act_bytes` = 4 (CPU, fp32) or 2 (CUDA, bf16 autocast)
for what matmuls read and write (linear inputs, q/k/v, attention outputs, the MLP's hidden layer).
Under autocast the residual stream and the layer norms stay fp32 (layer_norm runs in fp32 and a
residual add promotes to it), and so does the cross-entropy's log-softmax (`logits.float()`): those
terms are 4 bytes whatever act_bytes is. Attention is fused by default (torch's
scaled_dot_product_attention picks a flash or memory-efficient kernel on CUDA and a flash kernel on
the CPU): it saves q, k, v, its output and one log-sum-exp per head and query, never the B x h x T x T
probabilities; `fused_attention=False` models the math kernel, which saves them.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace

import torch
from torch import nn

from .config import ModelConfig, RunConfig
from .model import DiffusionBlock, Reference
from .wire.tensors import encode_tensor

FP32 = 4  # bytes of what stays fp32 under autocast: residual stream, layer norms, log-softmax, statistics
INDEX = 8  # bytes of an int64 index (bytes in, targets)


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
# every shape projection.largest_model() tries, smallest first
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
