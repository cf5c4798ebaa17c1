"""The block's attention layout leaks nothing, training touches one block, the chain is seeded."""

import pytest
import torch

from spheroid import checkpoint
from spheroid.chain import denoise, encode_context, euler_steps, score, score_bound
from spheroid.checkpoint import CheckpointError
from spheroid.config import ModelConfig, RunConfig, override
from spheroid.decoding import generate
from spheroid.loading import load_chain, write_genesis_codebook
from spheroid.model import (
    CleanStream,
    DiffusionBlock,
    KVCache,
    Reference,
    Span,
    attention_mask,
    make_codebook,
    packed_causal,
    packed_kv,
)
from spheroid.noise import sigma_grid
from spheroid.resume import clear_run
from spheroid.train import (
    block_loss,
    make_optimizer,
    train_block,
    train_step,
)

from .conftest import randomize


def blocks_for(cfg: RunConfig) -> list[DiffusionBlock]:
    return [randomize(DiffusionBlock(cfg.model, cfg.noise.sigma_data, b), seed=b).eval() for b in range(4)]


def with_model(cfg: RunConfig, **changes) -> RunConfig:
    if changes.get("layout") == "merged":
        changes.setdefault("channel", "z")  # nothing to relay in the merged layout
    return RunConfig(model=override(cfg.model, **changes), noise=cfg.noise, train=cfg.train)


def test_codebook_is_fixed_by_its_seed_with_unit_rows():
    cfg = ModelConfig(d_model=32)
    a, b = make_codebook(cfg), make_codebook(cfg)
    assert torch.equal(a, b)
    assert torch.allclose(a.norm(dim=1), torch.ones(256))
    assert not torch.equal(a, make_codebook(ModelConfig(d_model=32, codebook_seed=1)))


def test_mask_for_k1_and_k2():
    m = attention_mask(3, 3, 0, 1).int()
    # rows: clean 0..2 then noisy 0..2 (targets of positions 0..2); columns likewise
    assert m.tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0],
        [1, 0, 0, 1, 0, 0],
        [1, 1, 0, 0, 1, 0],
        [1, 1, 1, 0, 0, 1],
    ]
    m2 = attention_mask(4, 4, 0, 2).int()
    assert m2[4:, :4].tolist() == [[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 0]]
    assert m2[4:, 4:].tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


@pytest.mark.parametrize("layout, chunk, channel", [("concat", 1, "relay"), ("concat", 4, "relay"), ("concat", 1, "z"),
                                                    ("concat", 4, "z"), ("merged", 1, "z")])
def test_chain_does_not_leak_future_bytes(tiny, layout, chunk, channel):
    """Changing the bytes after position i changes nothing in any prediction that may not see them:
    with chunks of K, no target of a chunk whose clean context ends at or before i (the chunk's
    other targets included). Covers every input a block reads: the clean bytes, the chain's z and,
    with the relay channel, the earlier blocks' clean streams."""
    tiny = with_model(tiny, layout=layout, channel=channel)
    blocks = blocks_for(tiny)
    codebook = make_codebook(tiny.model)
    t = tiny.model.context
    window = torch.randint(0, 256, (1, t + 1), generator=torch.Generator().manual_seed(0))
    anchor = (torch.arange(t) // chunk) * chunk  # the last clean byte each target's chunk sees

    def run(w: torch.Tensor) -> torch.Tensor:
        gen = torch.Generator().manual_seed(7)
        return denoise(blocks, tiny.noise, codebook, w[:, :-1], t, gen, chunk=chunk)[0]

    base = run(window)
    for i in range(t):
        changed = window.clone()
        changed[0, i + 1 :] = (changed[0, i + 1 :] + 1 + i) % 256
        out = run(changed)
        protected = anchor <= i
        torch.testing.assert_close(out[protected], base[protected], rtol=0, atol=1e-5)
        if i + 1 < t and (i + 1) % chunk == 0:
            # the first prediction that may see byte i+1 does see it, so the test is not vacuous
            assert not torch.allclose(out[i + 1], base[i + 1])


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_relay_block_reads_its_predecessors_stream_only_up_to_its_anchors(tiny, chunk):
    """The relayed activations are an input like the clean bytes: position p reads them up to its
    chunk's anchor and no further, and does read them (the channel is not vacuous)."""
    block = randomize(DiffusionBlock(tiny.model, 0.5, index=1)).eval()
    t, d = tiny.model.context, tiny.model.d_model
    gen = torch.Generator().manual_seed(2)
    x, z, sigma = torch.randint(0, 256, (1, t), generator=gen), torch.randn(1, t, d, generator=gen), torch.tensor([2.0])
    previous = CleanStream(1)
    previous.out = torch.randn(1, t, d, generator=gen)
    base = block(x, z, sigma, 0, chunk, previous=previous)
    anchor = (torch.arange(t) // chunk) * chunk
    for i in range(t - 1):
        changed = CleanStream(1)
        changed.out = previous.out.clone()
        changed.out[0, i + 1 :] = torch.randn(t - i - 1, d, generator=gen)  # (a constant would be normed away)
        out = block(x, z, sigma, 0, chunk, previous=changed)
        torch.testing.assert_close(out[0, anchor <= i], base[0, anchor <= i], rtol=0, atol=1e-5)
        if (i + 1) % chunk == 0:
            assert not torch.allclose(out[0, i + 1], base[0, i + 1])
    with pytest.raises(ValueError, match="block 0's clean stream"):
        block(x, z, sigma)  # a relay block needs its predecessor's stream


@pytest.mark.parametrize("layout", ["concat", "merged"])
def test_block_output_depends_on_its_own_noisy_target_not_later_ones(tiny, layout):
    """At training time position p sees x_<=p and z_p; later context and later targets are invisible."""
    block = randomize(DiffusionBlock(with_model(tiny, layout=layout).model, 0.5)).eval()
    t = tiny.model.context
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (1, t), generator=gen)
    z = torch.randn(1, t, 32, generator=gen)
    sigma = torch.tensor([2.0])
    base = block(x, z, sigma)
    i = t // 2
    x2, z2 = x.clone(), z.clone()
    x2[0, i + 1 :] = (x2[0, i + 1 :] + 3) % 256
    z2[0, i + 1 :] += 1.0
    out = block(x2, z2, sigma)
    torch.testing.assert_close(out[0, : i + 1], base[0, : i + 1], rtol=0, atol=1e-5)
    z3 = z.clone()
    z3[0, i] += 1.0
    assert not torch.allclose(block(x, z3, sigma)[0, i], base[0, i])


def test_a_training_step_of_block_b_changes_block_b_only(tiny):
    blocks = [DiffusionBlock(tiny.model, 0.5) for _ in range(4)]
    codebook = make_codebook(tiny.model)
    before = [{k: v.clone() for k, v in b.state_dict().items()} for b in blocks]
    b = 2
    opt = make_optimizer(blocks[b], tiny)
    windows = torch.randint(0, 256, (4, tiny.model.context + 1))
    train_step(blocks[b], block_loss(blocks[b], tiny, b, codebook), opt, windows, torch.Generator(), 1.0)
    for i, blk in enumerate(blocks):
        same = all(torch.equal(v, before[i][k]) for k, v in blk.state_dict().items())
        assert same == (i != b), f"block {i} {'changed' if not same else 'did not change'}"
    assert torch.equal(codebook, make_codebook(tiny.model))  # the codebook is never trained


def test_chain_is_deterministic_for_a_seed(tiny):
    blocks = blocks_for(tiny)
    codebook = make_codebook(tiny.model)
    windows = torch.randint(0, 256, (3, tiny.model.context + 1), generator=torch.Generator().manual_seed(0))

    def run(seed: int):
        return score(blocks, tiny.noise, codebook, windows, 2, torch.Generator().manual_seed(seed))

    assert run(5) == run(5)
    assert run(5) != run(6)
    text = [generate(blocks, tiny.noise, codebook, b"ab", 10, 2, 1.0, s)
            for s in (1, 1, 2)]
    assert text[0] == text[1] and len(text[0]) == 10 and text[0] != text[2]


def test_merged_generation_matches_scoring_of_the_same_window(tiny):
    """A merged-layout chain generates byte L from the same computation that scores position L-1."""
    merged = with_model(tiny, layout="merged")
    blocks = blocks_for(merged)
    codebook = make_codebook(merged.model)
    prompt = b"hello, world"
    x = torch.tensor([list(prompt)])
    logits = denoise(blocks, merged.noise, codebook, x, x.shape[1], torch.Generator().manual_seed(4))
    out = generate(blocks, merged.noise, codebook, prompt, 1, 1, 0.0, 4)
    assert out[0] == logits[0, -1].argmax().item()
    with pytest.raises(ValueError, match="merged"):
        generate(blocks, merged.noise, codebook, prompt, 4, 2, 0.0, 0)


def test_averaged_draws_score_at_least_as_well_as_one_draw_on_average(tiny):
    """log of a mean >= mean of logs (Jensen): the M-draw CE never exceeds the one-draw CE."""
    blocks = blocks_for(tiny)
    windows = torch.randint(0, 256, (4, tiny.model.context + 1), generator=torch.Generator().manual_seed(0))
    s = score(blocks, tiny.noise, make_codebook(tiny.model), windows, 4, torch.Generator().manual_seed(0))
    assert s.ce_averaged <= s.ce_one_draw + 1e-6
    assert s.bytes_scored == 4 * tiny.model.context


@pytest.mark.parametrize("layout", ["plain", "two_stream"])
def test_reference_is_causal(tiny, layout):
    model = randomize(Reference(override(tiny.model, reference_layout=layout))).eval()
    x = torch.randint(0, 256, (1, 16))
    base = model(x)
    for i in range(15):
        x2 = x.clone()
        x2[0, i + 1 :] = (x2[0, i + 1 :] + 1) % 256
        out = model(x2)
        torch.testing.assert_close(out[0, : i + 1], base[0, : i + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(out[0, i + 1], base[0, i + 1])
    assert len(model.layers) == tiny.model.n_blocks * tiny.model.layers_per_block


def test_two_stream_reference_predicts_from_its_query_stream(tiny):
    """Its logits come from the query tokens reading the clean stream: the same layers as the plain
    reference's, computing another function of the bytes."""
    cfg = override(tiny.model, reference_layout="two_stream")
    torch.manual_seed(0)
    two = randomize(Reference(cfg)).eval()
    plain = Reference(tiny.model).eval()
    plain.load_state_dict(two.state_dict())  # the same parameters, nothing added
    x = torch.randint(0, 256, (2, 16))
    assert two(x).shape == plain(x).shape == (2, 16, 256)
    assert not torch.allclose(two(x), plain(x))


def test_stochastic_sampler_is_seeded_and_differs_from_euler(tiny):
    blocks = blocks_for(tiny)
    codebook = make_codebook(tiny.model)
    x = torch.randint(0, 256, (2, tiny.model.context), generator=torch.Generator().manual_seed(0))
    churned = override(tiny.noise, churn=0.5)

    def run(noise):
        return denoise(blocks, noise, codebook, x, x.shape[1], torch.Generator().manual_seed(3))

    torch.testing.assert_close(run(churned), run(churned), rtol=0, atol=0)
    assert not torch.allclose(run(churned), run(tiny.noise))


def test_chain_state_training_reads_frozen_earlier_blocks_and_updates_only_its_own(tiny, tmp_path):
    cfg = RunConfig(model=tiny.model, noise=tiny.noise, train=override(tiny.train, block_input="chain"))
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    with pytest.raises(CheckpointError, match="has no block 0 yet: train it first"):
        train_block(cfg, 1, data, tmp_path, torch.device("cpu"))
    train_block(cfg, 0, data, tmp_path, torch.device("cpu"))
    block0 = (tmp_path / "block-0.json").read_bytes()
    train_block(cfg, 1, data, tmp_path, torch.device("cpu"))
    assert (tmp_path / "block-0.json").read_bytes() == block0  # (it names its weights by their sha256)
    assert checkpoint.load(tmp_path, "block-1").config.train.block_input == "chain"
    # a block trained for another noise schedule is refused as an earlier block
    other = RunConfig(model=tiny.model, noise=override(tiny.noise, p_mean=0.0), train=cfg.train)
    with pytest.raises(CheckpointError, match="another model or noise configuration"):
        train_block(other, 1, data, tmp_path, torch.device("cpu"))


def test_a_block_resumed_on_other_earlier_blocks_than_it_read_is_refused(tiny, tmp_path):
    """Blocks trained in order read fixed earlier blocks: a block 1 whose block 0 was trained again
    since is not resumed (nor taken as trained) on the new one, which would mix two trainings."""
    cfg = RunConfig(model=tiny.model, noise=tiny.noise, train=override(tiny.train, block_input="chain", steps=4))
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    train_block(cfg, 0, data, tmp_path, torch.device("cpu"))
    train_block(cfg, 1, data, tmp_path, torch.device("cpu"))
    train_block(cfg, 1, data, tmp_path, torch.device("cpu"))  # the same block 0: already trained, nothing to do
    clear_run(tmp_path, "block-0")
    train_block(RunConfig(model=cfg.model, noise=cfg.noise, train=override(cfg.train, seed=7)), 0, data, tmp_path,
                torch.device("cpu"))
    with pytest.raises(CheckpointError, match="trained against other versions of block-0 than the folder holds now: "
                                              "--fresh to train block-1 again"):
        train_block(cfg, 1, data, tmp_path, torch.device("cpu"))


def test_variational_bound_terms(tiny):
    blocks = blocks_for(tiny)
    codebook = make_codebook(tiny.model)
    windows = torch.randint(0, 256, (3, tiny.model.context + 1), generator=torch.Generator().manual_seed(0))

    def run(seed: int):
        return score_bound(blocks, tiny.noise, codebook, windows, torch.Generator().manual_seed(seed), 2)

    terms = run(0)
    assert terms.prior == pytest.approx(1 / (2 * 10.0**2))  # unit rows against N(0, sigma_max^2)
    assert terms.diffusion > 0 and terms.reconstruction > 0
    assert terms.total == pytest.approx(terms.prior + terms.diffusion + terms.reconstruction)
    assert run(0) == terms and run(1) != terms


def test_genesis_codebook_from_a_reference(tiny, tmp_path):
    ref = Reference(tiny.model)
    checkpoint.save(tmp_path, checkpoint.REFERENCE, ref, tiny, {})
    digest = write_genesis_codebook(tmp_path, tmp_path / "genesis.safetensors")
    cfg = override(tiny.model, codebook_file=str(tmp_path / "genesis.safetensors"), codebook_sha256=digest,
                   codebook_norm=2.0)
    rows = make_codebook(cfg)
    expected = ref.tok_emb.weight.detach()
    torch.testing.assert_close(rows, 2.0 * expected / expected.norm(dim=1, keepdim=True))
    assert not torch.allclose(rows, make_codebook(override(tiny.model, codebook_norm=2.0)))
    with pytest.raises(ValueError, match="does not match its sha256"):
        make_codebook(override(cfg, codebook_sha256="0" * 64))
    with pytest.raises(ValueError, match="needs both"):
        override(tiny.model, codebook_file="x")


def test_kv_cached_reference_matches_the_full_forward(tiny):
    model = randomize(Reference(tiny.model)).eval()
    x = torch.randint(0, 256, (1, 14))
    full = model(x)
    caches = [KVCache() for _ in model.layers]
    outs = []
    for lo, hi in ((0, 9), (9, 10), (10, 14)):  # a prompt, one byte, then a few at once
        h = model.embed(x[:, lo:hi], lo)
        for layer, cache in zip(model.layers, caches, strict=True):
            h = layer(h, None, None, cache)
        outs.append(model.head(model.norm(h)))
    torch.testing.assert_close(torch.cat(outs, dim=1), full, rtol=0, atol=1e-5)
    assert caches[0].nbytes == 2 * 14 * tiny.model.d_model * 4


def concat_sequence(net, z_in, c_noise, x, start, chunk):
    """method.md's layout taken literally: one [clean | noisy] sequence under attention_mask, with a
    condition per token. The block computes it as two streams; this is the oracle it must match."""
    b, n_clean = x.shape
    n = z_in.shape[1]
    anchor = start + (torch.arange(n) // chunk) * chunk
    clean = net.tok_emb(x) + net.pos_emb[:n_clean]
    noisy = net.noisy_in(z_in) + net.tok_emb(x[:, anchor]) + net.pos_emb[start : start + n]
    h = torch.cat([clean, noisy], dim=1)
    cond = torch.cat([net.clean_cond.expand(b, n_clean, -1), net.noise_emb(c_noise)[:, None].expand(b, n, -1)], dim=1)
    mask = attention_mask(n_clean, n, start, chunk)
    for layer in net.layers:
        h = layer(h, mask, cond)
    return net.readout(h[:, n_clean:], cond[:, n_clean:])


@pytest.mark.parametrize("chunk, start, n", [(1, 0, 20), (4, 0, 20), (4, 8, 8), (1, 19, 1)])
def test_two_streams_compute_the_masked_concat_sequence(tiny, chunk, start, n):
    """Outputs and every parameter's gradient equal the literal masked sequence's (in float64, so
    only a different computation, not summation order, could tell them apart)."""
    net = randomize(DiffusionBlock(override(tiny.model, layers_per_block=2, context=32), 0.5)).net.double()
    x, c_noise = torch.randint(0, 256, (3, 20)), torch.randn(3, dtype=torch.float64)
    z = torch.randn(3, n, net.pos_emb.shape[1], dtype=torch.float64)
    grads = []
    for forward in (net, lambda *a: concat_sequence(net, *a)):
        net.zero_grad()
        out = forward(z, c_noise, x, start, chunk)
        out.pow(2).sum().backward()
        grads.append((out.detach(), [p.grad.clone() for p in net.parameters()]))
    (split, split_grads), (oracle, oracle_grads) = grads
    torch.testing.assert_close(split, oracle, rtol=1e-9, atol=1e-9)
    for a, b in zip(split_grads, oracle_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("chunk", [1, 4])
def test_cached_clean_stream_gives_the_logits_of_the_full_forward(tiny, chunk):
    cfg = override(tiny.model, layers_per_block=2, context=32)
    block = randomize(DiffusionBlock(cfg, 0.5)).eval()
    x, z, sigma = torch.randint(0, 256, (1, 20)), torch.randn(1, chunk, cfg.d_model), torch.tensor([2.0])
    full = block(x, z, sigma, 19, chunk)  # a fresh stream
    stream = CleanStream(2)
    block(x[:, :12], torch.randn(1, chunk, cfg.d_model), sigma, 11, chunk, stream)  # a shorter window first
    torch.testing.assert_close(block(x, z, sigma, 19, chunk, stream), full, rtol=0, atol=1e-5)
    assert stream.kv[0].k.shape[2] == stream.seen == 20  # it grew by the new bytes only
    torch.testing.assert_close(block(x, z, sigma, 19, chunk, stream), full, rtol=0, atol=1e-5)  # and reads


def test_packed_sequences_compute_what_each_computes_alone(tiny):
    """Serving batches concurrent sessions by packing their hops into one sequence: each must get
    the z, logits and clean streams (relayed ones included) of its own traversal run alone, whatever
    its window, its cached prefix, its chunk size and the others beside it."""
    cfg = with_model(tiny, layers_per_block=2, context=32)
    blocks, codebook = dict(enumerate(blocks_for(cfg))), make_codebook(cfg.model)
    grid = sigma_grid(cfg.noise, 4)
    gen = torch.Generator().manual_seed(0)
    # (window length, cached prefix, noisy positions from start, chunk)
    shapes = [(20, 19, 1, 1), (9, 0, 3, 3), (30, 12, 2, 1), (5, 5, 1, 1)]
    alone, packed, spans, zs = [], [], [], []
    for length, cached, n, chunk in shapes:
        x = torch.randint(0, 256, (1, length), generator=gen)
        span = Span(x, length - 1 if n == 1 else length - n, n, chunk)
        z = torch.randn(1, n, cfg.model.d_model, generator=gen)
        for streams in (alone, packed):
            streams.append({})
            if cached:
                encode_context(list(blocks.values()), x[:, :cached], streams[-1])
        spans.append(span)
        zs.append(z)
    one = [euler_steps(blocks, cfg.noise, grid, codebook, [s], z, range(4), None, [st])
           for s, z, st in zip(spans, zs, alone, strict=True)]
    together = euler_steps(blocks, cfg.noise, grid, codebook, spans, torch.cat(zs, dim=1), range(4), None, packed)
    # (packed, the matrix products run over other shapes: float32 rounding, relative to the values)
    torch.testing.assert_close(together, torch.cat(one, dim=1), rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(packed, alone, strict=True):
        for b in range(4):
            torch.testing.assert_close(mine[b].out, theirs[b].out, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(mine[b].kv[1].v, theirs[b].kv[1].v, rtol=1e-5, atol=1e-5)
    sigma = torch.full((1,), cfg.noise.sigma_min)
    logits = blocks[3].forward_packed(spans, together, sigma, [s[3] for s in packed], [s[2] for s in packed])
    expected = [blocks[3](s.x, z, sigma, s.start, s.chunk, st[3], st[2]) for s, z, st in zip(spans, one, alone,
                                                                                            strict=True)]
    torch.testing.assert_close(logits, torch.cat(expected, dim=1), rtol=1e-5, atol=1e-5)


def test_packed_reference_layers_extend_each_sessions_cache(tiny):
    """The reference pipeline's batched hops: new positions of sessions holding different prefixes."""
    model = randomize(Reference(with_model(tiny, context=32).model)).eval()
    texts = [torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n)) for n in (12, 7, 20)]
    held = [5, 0, 19]
    caches = [[KVCache() for _ in model.layers] for _ in texts]
    with torch.no_grad():
        for text, h0, cache in zip(texts, held, caches, strict=True):
            h = model.embed(text[:, :h0], 0)
            for layer, c in zip(model.layers, cache, strict=True):
                h = layer(h, None, None, c) if h0 else h
        new = [t.shape[1] - h0 for t, h0 in zip(texts, held, strict=True)]
        h = torch.cat([model.embed(t[:, h0:], h0) for t, h0 in zip(texts, held, strict=True)], dim=1)
        mask = packed_causal(held, new, h.device)
        for n, layer in enumerate(model.layers):
            h = layer(h, mask, None, packed_kv([c[n] for c in caches], new))
        for text, part in zip(texts, h.split(new, dim=1), strict=True):
            whole = model.head(model.norm(part[:, -1]))
            torch.testing.assert_close(whole, model(text)[:, -1], rtol=0, atol=1e-5)
    assert [c[0].k.shape[2] for c in caches] == [12, 7, 20]


def test_relayed_streams_grown_byte_by_byte_match_the_whole_context(tiny):
    """A serving session extends every block's clean stream by the new bytes only; with the relay
    channel the result must equal the streams computed over the whole context at once."""
    cfg = with_model(tiny, layers_per_block=2, context=32)
    blocks = blocks_for(cfg)
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    whole = encode_context(blocks, x)
    grown: dict = {}
    for end in (9, 10, 20):
        encode_context(blocks, x[:, :end], grown)
    for b in range(4):  # (values up to about 20: float32 rounding alone differs by 1e-5 here and there)
        torch.testing.assert_close(grown[b].out, whole[b].out, rtol=0, atol=1e-4)
    assert not torch.allclose(whole[1].out, encode_context(with_z(blocks, cfg), x)[1].out)


def with_z(blocks: list[DiffusionBlock], cfg: RunConfig) -> list[DiffusionBlock]:
    """The same weights, read as a model whose blocks do not relay."""
    z_cfg = override(cfg.model, channel="z")
    out = []
    for b, block in enumerate(blocks):
        twin = DiffusionBlock(z_cfg, cfg.noise.sigma_data, b).eval()
        twin.load_state_dict({k: v for k, v in block.state_dict().items() if not k.startswith("relay_head.")})
        out.append(twin)
    return out


def test_a_block_records_the_versions_it_read_and_a_mismatch_is_refused(tiny, tmp_path):
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    for b in range(4):
        train_block(tiny, b, data, tmp_path, torch.device("cpu"))
    reads = checkpoint.load(tmp_path, "block-2").state["reads"]
    assert sorted(reads) == ["block-0", "block-1"]
    assert reads["block-1"]["sha256"] == checkpoint.load(tmp_path, "block-1").sha256
    load_chain(tmp_path, torch.device("cpu"))
    clear_run(tmp_path, "block-0")  # as --fresh does
    train_block(RunConfig(model=tiny.model, noise=tiny.noise, train=override(tiny.train, seed=5)), 0, data, tmp_path,
                torch.device("cpu"))  # block 0 replaced under the blocks that read it
    with pytest.raises(CheckpointError, match="block-1 .* was trained against block-0 .* retrain block-1"):
        load_chain(tmp_path, torch.device("cpu"))


def test_blocks_trained_all_at_once_read_genesis_states_then_published_snapshots(tiny, tmp_path):
    cfg = RunConfig(model=tiny.model, noise=tiny.noise, train=override(tiny.train, refresh_every=1))
    data = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    train_block(cfg, 2, data, tmp_path, torch.device("cpu"))  # nothing published yet: it never waits
    assert {v["sha256"] for v in checkpoint.load(tmp_path, "block-2").state["reads"].values()} == {"genesis"}
    train_block(cfg, 0, data, tmp_path, torch.device("cpu"))
    train_block(cfg, 1, data, tmp_path, torch.device("cpu"))
    assert checkpoint.load(tmp_path, "block-1").state["reads"]["block-0"] == {
        "sha256": checkpoint.load(tmp_path, "block-0").sha256, "step": 3}
    train_block(cfg, 3, data, tmp_path, torch.device("cpu"))
    load_chain(tmp_path, torch.device("cpu"))  # later snapshots of the blocks it read are fine


def test_a_swarm_block_must_be_assembled_with_the_same_or_a_later_round_of_what_it_read(tiny, tmp_path):
    """Swarm blocks record the round of each earlier block they read (the assembled blocks, their round)."""
    cfg = RunConfig(model=tiny.model, noise=tiny.noise, train=override(tiny.train, refresh_every=100))
    blocks = [DiffusionBlock(cfg.model, cfg.noise.sigma_data, b) for b in range(4)]
    reads = {}
    for b, block in enumerate(blocks):
        checkpoint.save(tmp_path, f"block-{b}", block, cfg, {"block": b, "round": 6, "samples": 48, "hash": "ab",
                                                            "reads": dict(reads)})
        reads[f"block-{b}"] = {"round": 5, "samples": 40, "hash": "cd"}
    load_chain(tmp_path, torch.device("cpu"))
    checkpoint.save(tmp_path, "block-0", blocks[0], cfg, {"block": 0, "round": 4, "samples": 32, "hash": "ef",
                                                          "reads": {}})  # an older block 0 than blocks 1-3 read
    with pytest.raises(CheckpointError, match="block-1 .* trained against block-0 at round 5, hash cd.* round 4"):
        load_chain(tmp_path, torch.device("cpu"))


def test_the_relay_loss_trains_what_a_block_hands_on(tiny):
    """With relay_loss, every relayed block (not the last, not with channel z) has a head on its clean
    stream whose next-byte CE joins its loss, and the gradient reaches it; the reported CE stays the
    denoiser's. The relay head is causal: its logits at p depend on bytes up to p only."""
    cfg = with_model(tiny, relay_loss=1.0)
    blocks = [randomize(DiffusionBlock(cfg.model, 0.5, index=b)) for b in range(4)]
    assert [b.relay_head is not None for b in blocks] == [True, True, True, False]
    assert DiffusionBlock(with_model(tiny, relay_loss=1.0, channel="z").model, 0.5, index=0).relay_head is None
    codebook = make_codebook(cfg.model)
    windows = torch.randint(0, 256, (4, cfg.model.context + 1), generator=torch.Generator().manual_seed(1))
    plain = with_model(tiny, relay_loss=0.0)
    torch.manual_seed(0)
    with_relay, ce = block_loss(blocks[1], cfg, 1, codebook, blocks[:1])(windows, torch.Generator().manual_seed(2))
    torch.manual_seed(0)
    without, ce_plain = block_loss(blocks[1], plain, 1, codebook, blocks[:1])(windows, torch.Generator().manual_seed(2))
    assert ce == pytest.approx(ce_plain) and with_relay > without
    with_relay.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks[1].relay_head.parameters())
    stream = CleanStream(1)
    x = windows[:1, :-1]
    blocks[0].encode(x, stream)
    changed = x.clone()
    changed[0, 9:] = (changed[0, 9:] + 1) % 256
    other = CleanStream(1)
    blocks[0].encode(changed, other)
    with torch.no_grad():
        assert torch.equal(blocks[0].relay_logits(stream)[0, :9], blocks[0].relay_logits(other)[0, :9])


def test_configurations_written_before_the_relay_loss_load_without_it(tiny):
    data = tiny.to_dict()
    del data["model"]["relay_loss"]
    assert RunConfig.from_dict(data).model.relay_loss == 0.0


def test_gates_start_where_the_config_says_and_older_configs_meant_adaln_zero(tiny):
    """gate_init: each layer's attention and MLP gates start at G (1: a plain layer, 0: the identity);
    shift and scale start at zero. A configuration from before the field trained with AdaLN-Zero."""
    d = tiny.model.d_model
    for gate in (1.0, 0.0):
        ada = DiffusionBlock(with_model(tiny, gate_init=gate).model, 0.5).net.layers[0].ada
        assert torch.equal(ada.weight, torch.zeros_like(ada.weight))
        assert ada.bias.view(6, d).mean(dim=1).tolist() == [0.0, 0.0, gate, 0.0, 0.0, gate]
    data = tiny.to_dict()
    del data["model"]["gate_init"]
    assert tiny.model.gate_init == 1.0 and RunConfig.from_dict(data).model.gate_init == 0.0
