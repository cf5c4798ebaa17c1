"""The models: one self-contained diffusion block, the end-to-end reference, and the shared codebook.

Read top-down: the codebook, the attention mask of the clean/noisy layout, the caches of a clean
stream, packing several sequences into one (a serving node's batch of sessions), the transformer
layer (optionally modulated by the noise level, AdaLN-style), the noise-level embedding, the
block's network F, the EDM preconditioning wrapper around it, and the end-to-end references (plain
causal, and two-stream like the blocks).

Shapes: B batch, L clean context bytes, N noisy target positions, d model width, V = 256.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as fn
from safetensors.torch import load as safetensors_load
from torch import nn

from .config import REFERENCE_PART, ModelConfig


def make_codebook(cfg: ModelConfig) -> torch.Tensor:
    """The fixed target codebook e(.): V x d rows of norm `codebook_norm`.

    Never trained: every worker regenerates the same matrix from `codebook_seed`, or loads the same
    genesis file (checked against `codebook_sha256`, so a worker never trains against other rows).
    """
    if cfg.codebook_file:
        rows = load_genesis_codebook(cfg.codebook_file, cfg.codebook_sha256, (cfg.vocab, cfg.d_model))
    else:
        rows = torch.randn(cfg.vocab, cfg.d_model, generator=torch.Generator().manual_seed(cfg.codebook_seed))
    return cfg.codebook_norm * rows / rows.norm(dim=1, keepdim=True)


def load_genesis_codebook(path: str, sha256: str, shape: tuple[int, int]) -> torch.Tensor:
    """A genesis codebook file: safetensors with one tensor "codebook" of the given shape."""
    try:
        blob = Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read the genesis codebook {path} (--codebook-file): {exc.strerror or exc}") from exc
    if hashlib.sha256(blob).hexdigest() != sha256:
        raise ValueError(f"codebook file {path} does not match its sha256 {sha256[:12]}: fetch the swarm's own")
    rows = safetensors_load(blob).get("codebook")
    if rows is None or tuple(rows.shape) != shape:
        raise ValueError(f"codebook file {path} must hold a tensor 'codebook' of shape {shape}")
    return rows.float()


def attention_mask(n_clean: int, n_noisy: int, start: int, chunk: int) -> torch.Tensor:
    """Who may attend to whom in the concatenated [clean | noisy] sequence; True = may attend.

    Clean token j holds byte x_j. Noisy token n holds the noisy embedding of the byte at position
    start + n + 1 (the target of position p = start + n). Noisy tokens come in chunks of `chunk`:
      - clean tokens attend causally to clean tokens and never to noisy ones;
      - a noisy token attends to the clean tokens up to its chunk's first position p0 (so it sees
        x_<=p0, everything known before the chunk) and to all noisy tokens of its own chunk.
    With chunk = 1 this is the plain next-byte model: target p sees x_<=p and its own noisy token.
    """
    if start + 1 > n_clean:
        raise ValueError(f"noisy tokens start at position {start} but only {n_clean} clean bytes are given")
    clean = torch.arange(n_clean)
    noisy = torch.arange(n_noisy)
    group = noisy // chunk  # (N,) chunk index of each noisy token
    first = start + group * chunk  # (N,) first target position of each noisy token's chunk
    mask = torch.zeros(n_clean + n_noisy, n_clean + n_noisy, dtype=torch.bool)
    mask[:n_clean, :n_clean] = clean[None, :] <= clean[:, None]
    mask[n_clean:, :n_clean] = clean[None, :] <= first[:, None]
    mask[n_clean:, n_clean:] = group[None, :] == group[:, None]
    return mask


@functools.lru_cache(maxsize=32)
def noisy_rows(n_clean: int, n_noisy: int, start: int, chunk: int, device: torch.device) -> torch.Tensor:
    """The noisy tokens' rows of attention_mask, (N, L + N), built once per shape and device.

    The clean rows need no mask: they are plain causal attention among the clean tokens."""
    return attention_mask(n_clean, n_noisy, start, chunk)[n_clean:].to(device)


class KVCache:
    """Keys and values of the positions a layer has already seen (serving: one per session and layer)."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # (B, heads, seen, d/heads)
        self.v: torch.Tensor | None = None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else 2 * self.k.numel() * self.k.element_size()

    def truncate(self, n: int) -> None:
        """Keep the first n positions (a serving session whose later bytes changed)."""
        if self.k is not None:
            self.k, self.v = (t[:, :, :n] if n else None for t in (self.k, self.v))


class CleanStream:
    """One block's clean stream over a prefix of the context: each layer's keys and values (which the
    noisy tokens read) and the stream's output (which the next block starts from, with the relay
    channel). Computed once per context and reused by every Euler step of the block; serving keeps
    one per session so that a traversal computes only the new bytes."""

    def __init__(self, n_layers: int) -> None:
        self.kv = [KVCache() for _ in range(n_layers)]
        self.out: torch.Tensor | None = None  # (B, seen, d)

    @property
    def seen(self) -> int:
        return 0 if self.out is None else self.out.shape[1]

    @property
    def nbytes(self) -> int:
        own = 0 if self.out is None else self.out.numel() * self.out.element_size()
        return own + sum(c.nbytes for c in self.kv)

    def truncate(self, n: int) -> None:
        """Keep the first n positions: the stream is causal, so they do not depend on the bytes after."""
        for cache in self.kv:
            cache.truncate(n)
        if self.out is not None:
            self.out = self.out[:, :n] if n else None


@dataclass(frozen=True)
class Span:
    """One sequence of a packed batch: clean bytes x (B, L) and n noisy tokens for the targets of
    positions start.., in chunks of `chunk`. A serving node packs concurrent sessions' hops, one span
    each, into one sequence per layer call (`packed_mask`), so they share each call instead of taking
    turns; a batch of one span is the plain computation."""

    x: torch.Tensor
    start: int
    n: int
    chunk: int | None  # None: the model's own (ModelConfig.chunk), for a batch of one


def packed_mask(rows: list[torch.Tensor], seen: list[int]) -> torch.Tensor:
    """The attention mask of sequences run as one, concatenated along positions.

    rows[i] (n_i, seen_i + n_i): what sequence i's n_i new tokens may see of its own seen_i earlier
    keys (cached) and of its new ones. Packed, the keys are every sequence's earlier keys, then every
    sequence's new ones (what `PackedKV` holds), and no token sees another sequence's. One sequence
    keeps its own mask.
    """
    if len(rows) == 1:
        return rows[0]
    new = [r.shape[0] for r in rows]
    mask = torch.zeros(sum(new), sum(seen) + sum(new), dtype=torch.bool, device=rows[0].device)
    row, old, fresh = 0, 0, sum(seen)
    for r, s, n in zip(rows, seen, new, strict=True):
        mask[row : row + n, old : old + s] = r[:, :s]
        mask[row : row + n, fresh : fresh + n] = r[:, s:]
        row, old, fresh = row + n, old + s, fresh + n
    return mask


def packed_causal(seen: list[int], new: list[int], device: torch.device) -> torch.Tensor | None:
    """`packed_mask` for new positions that follow their sequence's cached ones causally; None for one
    sequence, where attention is plainly causal."""
    if len(seen) == 1:
        return None
    return packed_mask([torch.arange(s + n, device=device)[None, :] <= s + torch.arange(n, device=device)[:, None]
                        for s, n in zip(seen, new, strict=True)], seen)


class PackedKV:
    """Several sequences' KV caches read as one (what a packed batch's attention needs): their keys one
    after another, and `extend` hands each cache the new positions of its own sequence."""

    def __init__(self, caches: list[KVCache], new: list[int] | None = None) -> None:
        self.caches, self.new = caches, new
        held = [c for c in caches if c.k is not None]
        self.k = torch.cat([c.k for c in held], dim=2) if held else None
        self.v = torch.cat([c.v for c in held], dim=2) if held else None

    def extend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v (1, heads, sum(new), d/heads): the sequences' new positions, in order."""
        for cache, kk, vv in zip(self.caches, k.split(self.new, dim=2), v.split(self.new, dim=2), strict=True):
            cache.extend(kk, vv)
        if self.k is None:
            return k, v
        return torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)


def packed_kv(caches: list[KVCache], new: list[int] | None = None) -> KVCache | PackedKV:
    """The caches as one layer call reads them: one sequence's own cache, or several packed."""
    return caches[0] if len(caches) == 1 else PackedKV(caches, new)


class Attention(nn.Module):
    def __init__(self, d: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None, cache: KVCache | None = None,
                memory: KVCache | None = None) -> torch.Tensor:
        """`cache`: earlier positions' keys and values, which these positions join; `memory`: keys and
        values read but not extended (the clean stream, for noisy tokens), placed before these."""
        b, s, d = h.shape
        q, k, v = self.qkv(h).view(b, s, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if cache is not None:  # these s positions follow the ones in the cache
            k, v = cache.extend(k, v)
        if memory is not None:
            k, v = torch.cat([memory.k, k], dim=2), torch.cat([memory.v, v], dim=2)
        seen = k.shape[2] - s
        if mask is None and seen == 0:  # plain causal
            out = fn.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif mask is None:  # causal, the queries being the last s positions
            positions = torch.arange(k.shape[2], device=h.device)
            keep = positions[None, :] <= seen + positions[:s, None]  # (s, seen + s)
            out = fn.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        else:
            out = fn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(b, s, d))


class Layer(nn.Module):
    """A pre-norm transformer layer. When `conditioned`, AdaLN-Zero modulation from a condition vector."""

    def __init__(self, d: int, n_heads: int, mlp_ratio: int, conditioned: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(d, elementwise_affine=not conditioned)
        self.attn = Attention(d, n_heads)
        self.norm2 = nn.LayerNorm(d, elementwise_affine=not conditioned)
        self.mlp = nn.Sequential(nn.Linear(d, mlp_ratio * d), nn.GELU(), nn.Linear(mlp_ratio * d, d))
        self.ada = nn.Linear(d, 6 * d) if conditioned else None

    def forward(
        self, h: torch.Tensor, mask: torch.Tensor | None, cond: torch.Tensor | None = None,
        cache: KVCache | None = None, memory: KVCache | None = None,
    ) -> torch.Tensor:
        if self.ada is None:
            h = h + self.attn(self.norm1(h), mask, cache, memory)
            return h + self.mlp(self.norm2(h))
        # cond: (B, S, d) one condition per token, (B, 1, d) one per sequence or (d,) one for all
        # -> shift, scale and gate for both sublayers
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(fn.silu(cond)).chunk(6, dim=-1)
        h = h + gate1 * self.attn(self.norm1(h) * (1 + scale1) + shift1, mask, cache, memory)
        return h + gate2 * self.mlp(self.norm2(h) * (1 + scale2) + shift2)


class NoiseEmbedding(nn.Module):
    """c_noise (a scalar per sequence) -> a d-vector: sinusoidal features, then a small MLP."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.register_buffer("freqs", torch.exp(torch.linspace(0, math.log(1000.0), d // 2)), persistent=False)
        self.mlp = nn.Sequential(nn.Linear(2 * (d // 2), d), nn.SiLU(), nn.Linear(d, d))

    def forward(self, c_noise: torch.Tensor) -> torch.Tensor:
        angles = c_noise[:, None] * self.freqs[None, :]  # (B, d/2)
        return self.mlp(torch.cat([angles.sin(), angles.cos()], dim=-1))


class BlockNet(nn.Module):
    """F of one block: reads the clean context and the scaled noisy tokens, returns (B, N, d).

    Self-contained: its own context embedding, positions, noise embedding, layers and final norm.
    Two layouts (ModelConfig.layout):
      - "concat": [clean | noisy] tokens under `attention_mask`, any chunk size K, run as two
        streams (see `forward`). Clean tokens get a learned condition of their own, so the clean
        stream does not depend on the noise level and serving can cache it.
      - "merged" (K = 1 only): one token per position holding x_i and the noisy target z_i, under
        a plain causal mask: half the tokens of "concat", and one noise condition per sequence.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.tok_emb = nn.Embedding(cfg.vocab, d)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.context, d))
        self.noisy_in = nn.Linear(d, d)
        self.noise_emb = NoiseEmbedding(d)
        self.clean_cond = nn.Parameter(torch.zeros(d))
        self.layers = nn.ModuleList(Layer(d, cfg.n_heads, cfg.mlp_ratio, True) for _ in range(cfg.layers_per_block))
        self.norm_out = nn.LayerNorm(d, elementwise_affine=False)
        self.ada_out = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.layout = cfg.layout
        self.noisy_anchor = cfg.noisy_anchor

    def encode(self, x: torch.Tensor, stream: CleanStream, relay: torch.Tensor | None) -> None:
        """Extend `stream` over the bytes of x (B, L) it has not seen: a plain causal pass whose keys
        and values each layer keeps, and whose output the stream keeps.

        relay: (B, L, d) the previous block's clean-stream output for the same bytes (channel
        "relay", blocks after the first): this block's clean stream starts from it, so block b
        computes on the context 2 x (b + 1) layers deep instead of re-reading the raw bytes.
        """
        self.encode_packed([x], [stream], [relay])

    def encode_packed(self, xs: list[torch.Tensor], streams: list[CleanStream],
                      relays: list[torch.Tensor | None]) -> None:
        """`encode` for several sequences (B = 1 each) at once, their new positions packed into one."""
        todo = [i for i, (x, stream) in enumerate(zip(xs, streams, strict=True)) if stream.seen < x.shape[1]]
        if not todo:
            return
        seen = [streams[i].seen for i in todo]
        new = [xs[i].shape[1] - s for i, s in zip(todo, seen, strict=True)]
        parts = []
        for i, s in zip(todo, seen, strict=True):
            n_clean = xs[i].shape[1]
            h = self.tok_emb(xs[i][:, s:]) + self.pos_emb[s:n_clean]  # (B, L - seen, d)
            parts.append(h if relays[i] is None else h + relays[i][:, s:n_clean])
        h = torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
        mask = packed_causal(seen, new, h.device)
        for n, layer in enumerate(self.layers):
            # causal; each sequence's new keys and values join its own cache
            h = layer(h, mask, self.clean_cond, cache=packed_kv([streams[i].kv[n] for i in todo], new))
        for i, out in zip(todo, h.split(new, dim=1), strict=True):
            streams[i].out = out if streams[i].out is None else torch.cat([streams[i].out, out], dim=1)

    def forward(
        self, z_in: torch.Tensor, c_noise: torch.Tensor, x: torch.Tensor, start: int, chunk: int,
        stream: CleanStream | None = None, relay: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """z_in: (B, N, d) scaled noisy targets of positions start..start+N-1; x: (B, L) clean bytes.

        The concat layout runs as two streams, which computes exactly the masked [clean | noisy]
        sequence of `attention_mask`: clean tokens attend only to clean tokens, causally, so the
        clean stream is a plain causal pass (`encode`) whose keys and values each layer keeps; the
        noisy tokens then read those and attend within their own chunk (the noisy rows of the mask).
        Each stream carries one condition broadcast over its tokens (a learned one for clean tokens,
        the noise level's for noisy ones) instead of one per token. Against one masked sequence this
        keeps a quarter fewer activations for backward and trains faster (docs/method.md).

        `stream`: this block's clean stream, extended here to cover x (a fresh one if None), so the
        Euler steps of one traversal, and a serving session's traversals, compute it once.
        `relay`: the previous block's clean-stream output (B, L, d), for the relay channel.
        """
        self.check_positions(start, z_in.shape[1])
        if self.layout == "merged":
            return self.forward_merged(z_in, c_noise, x, start, chunk, relay)
        return self.forward_packed(z_in, c_noise, [Span(x, start, z_in.shape[1], chunk)],
                                   [stream or CleanStream(len(self.layers))], [relay])

    def forward_packed(self, z_in: torch.Tensor, c_noise: torch.Tensor, spans: list[Span],
                       streams: list[CleanStream], relays: list[torch.Tensor | None]) -> torch.Tensor:
        """`forward` (concat layout) for several sequences at once: z_in (1, sum of n, d) holds their
        noisy tokens one after another (B as x's batch for a single span); so does the result."""
        for span in spans:
            self.check_positions(span.start, span.n)
        self.encode_packed([s.x for s in spans], streams, relays)
        # each noisy token also carries the last clean byte its chunk may see (its anchor), so the
        # nearest context is at hand from the first step instead of having to be found by attention;
        # with the relay channel, also the previous block's clean-stream output there
        # (noisy_anchor "stream": instead, this block's own clean-stream output there, which holds both)
        parts = []
        for span, relay, stream in zip(spans, relays, streams, strict=True):
            anchor = span.start + (torch.arange(span.n, device=span.x.device) // span.chunk) * span.chunk  # (N,)
            position = self.pos_emb[span.start : span.start + span.n]
            if self.noisy_anchor == "stream":
                parts.append(stream.out[:, anchor] + position)  # (B, N, d)
                continue
            part = self.tok_emb(span.x[:, anchor]) + position  # (B, N, d)
            parts.append(part if relay is None else part + relay[:, anchor])
        noisy = self.noisy_in(z_in) + (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0])
        noisy_cond = self.noise_emb(c_noise)[:, None, :]  # (B, 1, d)
        lengths = [s.x.shape[1] for s in spans]
        mask = packed_mask([noisy_rows(n_clean, s.n, s.start, s.chunk, s.x.device)  # (N, L + N) each
                            for n_clean, s in zip(lengths, spans, strict=True)], lengths)
        for n, layer in enumerate(self.layers):
            noisy = layer(noisy, mask, noisy_cond, memory=packed_kv([st.kv[n] for st in streams]))
        return self.readout(noisy, noisy_cond)  # (B, N, d)

    def check_positions(self, start: int, n: int) -> None:
        if start + n > self.pos_emb.shape[0]:
            raise ValueError(f"positions up to {start + n} exceed the context of {self.pos_emb.shape[0]}")

    def forward_merged(self, z_in: torch.Tensor, c_noise: torch.Tensor, x: torch.Tensor, start: int,
                       chunk: int, relay: torch.Tensor | None) -> torch.Tensor:
        if chunk != 1 or start != 0 or z_in.shape[1] != x.shape[1]:
            raise ValueError("the merged layout denoises every position of its context at once, with K = 1; "
                             "train with --layout concat for chunks")
        if relay is not None:
            raise ValueError("the merged layout has no clean stream to relay; use --channel z with it")
        h = self.tok_emb(x) + self.noisy_in(z_in) + self.pos_emb[: x.shape[1]]  # (B, T, d): x_i and z_i
        cond = self.noise_emb(c_noise)[:, None, :]  # (B, 1, d), broadcast over positions
        for layer in self.layers:
            h = layer(h, None, cond)
        return self.readout(h, cond)

    def readout(self, h: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        shift, scale = self.ada_out(fn.silu(cond)).chunk(2, dim=-1)
        return self.out(self.norm_out(h) * (1 + scale) + shift)


class DiffusionBlock(nn.Module):
    """One block: EDM preconditioning around F, and a head from the denoised embedding to logits.

    D = c_skip * z + c_out * F(c_in * z, c_noise, context);  logits = head(D).
    """

    def __init__(self, cfg: ModelConfig, sigma_data: float, index: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.sigma_data = sigma_data
        self.index = index
        # the relay channel: every block after the first starts from its predecessor's clean stream
        self.reads_relay = cfg.channel == "relay" and index > 0
        self.net = BlockNet(cfg)
        self.head_norm = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab)
        # the relay loss's head: reads next-byte logits off the clean stream this block hands on
        self.relay_head = (relay_head(cfg)
                           if cfg.channel == "relay" and cfg.relay_loss and index < cfg.n_blocks - 1 else None)
        init_weights(self)
        for layer in self.net.layers:  # AdaLN: no shift or scale at first; gates at cfg.gate_init
            nn.init.zeros_(layer.ada.weight)
            nn.init.zeros_(layer.ada.bias)
            d = cfg.d_model
            with torch.no_grad():  # the six chunks are shift, scale, gate of attention, then of the MLP
                layer.ada.bias[2 * d : 3 * d] = cfg.gate_init
                layer.ada.bias[5 * d : 6 * d] = cfg.gate_init
        # F starts at zero (so D starts at c_skip * z) and reads the noisy input only once it learns
        # to: at high noise that input is almost pure noise and would drown the context at first
        for lin in (self.net.ada_out, self.net.out, self.net.noisy_in):
            nn.init.zeros_(lin.weight)
            nn.init.zeros_(lin.bias)

    @staticmethod
    def coefficients(sigma: torch.Tensor, sigma_data: float, skip: bool = True) -> tuple[torch.Tensor, ...]:
        """EDM's c_skip, c_out, c_in, c_noise for noise level sigma (c_skip = 0 without the skip path)."""
        sd2 = sigma_data**2
        c_skip = sd2 / (sigma**2 + sd2) if skip else torch.zeros_like(sigma)
        c_out = sigma * sigma_data / (sigma**2 + sd2).sqrt()
        c_in = 1 / (sigma**2 + sd2).sqrt()
        c_noise = sigma.log() / 4
        return c_skip, c_out, c_in, c_noise

    def forward(
        self, x: torch.Tensor, z: torch.Tensor, sigma: torch.Tensor, start: int = 0, chunk: int | None = None,
        stream: CleanStream | None = None, previous: CleanStream | None = None,
    ) -> torch.Tensor:
        """x: (B, L) clean bytes; z: (B, N, d) noisy targets; sigma: (B,). Returns logits (B, N, V).

        `stream`: this block's clean stream (extended to cover x here); `previous`: the previous
        block's, covering x, which a block reading the relay channel needs (`encode_context`)."""
        c_skip, c_out, c_in, c_noise = self.preconditioning(sigma)
        f = self.net(c_in * z, c_noise, x, start, chunk or self.cfg.chunk, stream, self.relay_from(previous, x))
        return self.head(self.head_norm(c_skip * z + c_out * f))

    def forward_packed(self, spans: list[Span], z: torch.Tensor, sigma: torch.Tensor, streams: list[CleanStream],
                       previous: list[CleanStream | None]) -> torch.Tensor:
        """`forward` for several sequences packed into one (`BlockNet.forward_packed`), all at noise level
        sigma: z (1, sum of n, d) -> logits (1, sum of n, V)."""
        if len(spans) == 1:  # any batch size, either layout
            span = spans[0]
            return self(span.x, z, sigma, span.start, span.chunk, streams[0], previous[0])
        c_skip, c_out, c_in, c_noise = self.preconditioning(sigma)
        relays = [self.relay_from(p, s.x) for p, s in zip(previous, spans, strict=True)]
        f = self.net.forward_packed(c_in * z, c_noise, spans, streams, relays)
        return self.head(self.head_norm(c_skip * z + c_out * f))

    def preconditioning(self, sigma: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """c_skip, c_out, c_in shaped (B, 1, 1) to scale z, and c_noise (B,), for noise levels sigma (B,)."""
        c_skip, c_out, c_in, c_noise = self.coefficients(sigma.float(), self.sigma_data, self.cfg.edm_skip)
        return c_skip[:, None, None], c_out[:, None, None], c_in[:, None, None], c_noise

    def encode(self, x: torch.Tensor, stream: CleanStream, previous: CleanStream | None = None) -> None:
        """Extend this block's clean stream over x (B, L); `previous` as for forward."""
        self.net.encode(x, stream, self.relay_from(previous, x))

    def relay_from(self, previous: CleanStream | None, x: torch.Tensor) -> torch.Tensor | None:
        """What this block reads of its predecessor: its clean-stream output over x, or nothing."""
        if not self.reads_relay:
            return None
        if previous is None or previous.seen < x.shape[1]:
            raise ValueError(f"block {self.index} starts from block {self.index - 1}'s clean stream (channel "
                             "'relay'): run it in the chain, after the blocks before it")
        return previous.out


    def relay_logits(self, stream: CleanStream) -> torch.Tensor | None:
        """Next-byte logits (B, L, V) off the clean stream this block hands on (the relay loss), or
        None where nothing is relayed or trained (the last block, or relay_loss 0)."""
        return None if self.relay_head is None else self.relay_head(stream.out)


def relay_head(cfg: ModelConfig) -> nn.Sequential:
    """The relay loss's head: LayerNorm, then a linear readout to logits, or a small MLP
    (`relay_head_hidden` wide) that only the local loss reads."""
    d, hidden = cfg.d_model, cfg.relay_head_hidden
    if not hidden:
        return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, cfg.vocab))
    return nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, cfg.vocab))


def inherit(block: nn.Module, previous: nn.Module) -> int:
    """Copy into `block` every tensor of `previous` with the same name and shape (block b starting
    from block b-1's weights, `init_from_previous`); returns how many tensors were copied."""
    theirs = previous.state_dict()
    mine = {k: v for k, v in block.state_dict().items() if k in theirs and theirs[k].shape == v.shape}
    with torch.no_grad():
        for k, v in mine.items():
            v.copy_(theirs[k])
    return len(mine)


class Reference(nn.Module):
    """The end-to-end baseline, next-byte CE, in one of two layouts (ModelConfig.reference_layout):

      - "plain": a causal transformer on the clean bytes;
      - "two_stream": the blocks' layout with nothing noisy in it: a clean causal stream that only
        supplies keys and values, and one query token per target position (its byte x_p and its
        position, as a block's noisy token carries its anchor) that reads them up to p and predicts
        y_p. So a gap between BlockTrain and this reference measures the training, not the layout.

    Depth is n_blocks * layers_per_block, the total depth of the BlockTrain model it is compared
    with (n_blocks = 1: the depth of one block).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.two_stream = cfg.reference_layout == "two_stream"
        self.tok_emb = nn.Embedding(cfg.vocab, d)
        self.pos_emb = nn.Parameter(torch.zeros(cfg.context, d))
        depth = cfg.n_blocks * cfg.layers_per_block
        self.layers = nn.ModuleList(Layer(d, cfg.n_heads, cfg.mlp_ratio, False) for _ in range(depth))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, cfg.vocab)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T) bytes -> logits (B, T, V) for the byte after each position."""
        h = self.embed(x, 0)  # (B, T, d)
        if not self.two_stream:
            for layer in self.layers:
                h = layer(h, None)
            return self.read_off(h)
        query, n = h, x.shape[1]  # query token p: x_p at position p
        mask = noisy_rows(n, n, 0, 1, x.device)  # (T, 2T): clean bytes up to p, and itself
        for layer in self.layers:
            kv = KVCache()
            h = layer(h, None, cache=kv)
            query = layer(query, mask, memory=kv)
        return self.read_off(query)

    def read_off(self, h: torch.Tensor) -> torch.Tensor:
        """Next-byte logits (..., V) from the last layer's hidden states (..., d): on one machine (`forward`),
        or on a reference pipeline's last node."""
        return self.head(self.norm(h))

    def embed(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """Bytes at positions start.. -> the first layer's input (B, T, d)."""
        if start + x.shape[1] > self.pos_emb.shape[0]:
            raise ValueError(f"positions up to {start + x.shape[1]} exceed the context of {self.pos_emb.shape[0]}")
        return self.tok_emb(x) + self.pos_emb[start : start + x.shape[1]]


def part_module(cfg: ModelConfig, sigma_data: float, part: int) -> DiffusionBlock | Reference:
    """The module of one part of the model a swarm trains: block `part`, or the end-to-end reference
    (REFERENCE_PART); built on the current default device (the meta device counts parameters)."""
    return Reference(cfg) if part == REFERENCE_PART else DiffusionBlock(cfg, sigma_data, part)


def init_weights(module: nn.Module) -> None:
    """GPT-2 style initialisation: N(0, 0.02) weights, zero biases, for every linear and embedding."""
    for m in module.modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)
    for name, p in module.named_parameters():
        if name.endswith("pos_emb"):
            nn.init.normal_(p, std=0.02)


def parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
