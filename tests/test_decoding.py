"""Decoding: the windows a generation reads, prompt-lookup drafts, and speculative decoding, which
must give chunk-1 generation's distribution (its very bytes at temperature 0) in fewer traversals."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as fn

from spheroid.decoding import (
    accept_draft,
    generate,
    lookup_draft,
    next_traversal,
    probabilities,
    sample,
    traversal_generators,
    window_start,
)
from spheroid.model import make_codebook

from .test_model import blocks_for


def test_windows_start_at_zero_then_move_by_half_the_context():
    context = 16
    for k in (1, 4):
        for n in range(1, 80):
            start = window_start(n, k, context)
            assert 0 <= start < n and n - start <= context - k + 1  # k noisy positions fit beside it
            assert (start == 0) == (n <= context - k + 1)
            assert start % (context // 2) == 0
    # consecutive ar traversals share a window until it is full, so a session's caches stay valid
    assert [window_start(n, 1, 16) for n in (16, 17, 24, 25, 32, 33)] == [0, 8, 8, 16, 16, 24]
    # a chunk too long for a half step slides byte by byte
    assert window_start(40, 15, 16) == 38


def test_every_seed_a_request_may_name_makes_generators():
    """Seeds go up to 2^63 - 1 (torch's limit); a byte's generator seed, derived from the request's seed
    and the byte's index, used to overflow from about 2^42 on ("Overflow when unpacking long long":
    the hop failed on every node). Small seeds keep their generators."""
    cpu = torch.device("cpu")
    for seed, index in ((2**63 - 1, 0), (2**63 - 1, 2**48), (2**45, 7)):
        noise, sampling = traversal_generators(seed, index, cpu)
        assert noise.initial_seed() != sampling.initial_seed()
    assert traversal_generators(5, 3, cpu)[0].initial_seed() == (5 * 1_000_003 + 3) * 2


def test_lookup_drafts_what_followed_the_longest_earlier_match():
    assert lookup_draft(b"the cat sat. the cat", 8) == b" sat. th"
    assert lookup_draft(b"the cat sat. the cat", 3) == b" sa"
    assert lookup_draft(b"abcdef", 4) == b""  # no earlier occurrence of a 3-byte suffix
    assert lookup_draft(b"abab", 4) == b""  # shorter than 3 bytes
    assert lookup_draft(b"xyzxyz", 0) == b""


def test_a_speculative_traversal_checks_drafts_inside_the_window_of_its_first_byte():
    out = b"0123456789 0123456"  # 18 bytes: the window of a context of 16 starts at 8
    t = next_traversal(out, 100, 1, 8, 16)
    assert t.ctx == out[8:] + t.draft and t.draft == b"789 0123"[: 16 - 10]  # only 6 fit beside the 10
    assert (t.start, t.n_noisy, t.chunk) == (len(out) - 8 - 1, len(t.draft) + 1, 1)
    assert next_traversal(out, 3, 1, 8, 16).draft == b"78"  # never past the bytes asked for
    assert next_traversal(out, 100, 4, 0, 16) == next_traversal(out, 100, 4, 0, 16)
    assert next_traversal(out, 100, 4, 0, 16).n_noisy == 4


def test_the_speculative_rule_keeps_the_distribution_of_each_byte():
    """Whatever the draft, the first byte out is distributed as p: accepted with p(d), else drawn
    from p without d. Checked over 4,000 seeds against p with a generous margin."""
    logits = torch.full((2, 256), -30.0)
    logits[0, :4] = torch.tensor([2.0, 1.0, 0.5, 0.0])
    p = fn.softmax(logits[0], dim=-1)[:4]
    for drafted in (0, 3):
        counts = torch.zeros(4)
        for seed in range(4000):
            counts[accept_draft(logits, bytes([drafted]), 1.0, seed, 0)[0]] += 1
        assert (counts / 4000 - p).abs().max() < 0.03, (drafted, counts / 4000, p)


def test_at_temperature_zero_drafts_are_kept_while_they_are_the_most_likely_byte():
    logits = torch.zeros(4, 256)
    logits[0, 7] = logits[1, 8] = logits[2, 9] = logits[3, 10] = 5.0
    assert accept_draft(logits, bytes([7, 8, 9]), 0.0, 0, 0) == bytes([7, 8, 9, 10])  # all kept, and one more
    assert accept_draft(logits, bytes([7, 1, 9]), 0.0, 0, 0) == bytes([7, 8])  # the first refused is replaced
    assert accept_draft(logits[:1], b"", 0.0, 0, 0) == bytes([7])


def test_any_temperature_above_zero_gives_probabilities_and_a_tiny_one_the_most_likely_byte():
    logits = torch.randn(4, 256, generator=torch.Generator().manual_seed(0)) * 30
    for temperature in (1e-300, 5e-324, 1e-30, 0.7, 1e300):  # (1e-300 is 0 in float32)
        probs = probabilities(logits, temperature)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(4))
    best = logits.argmax(-1)
    assert torch.equal(sample(logits, 1e-300, traversal_generators(0, 0, torch.device("cpu"))[1]), best)
    assert accept_draft(logits, bytes(best[:3].tolist()), 1e-300, 0, 0) == bytes(best.tolist())
    assert accept_draft(logits, bytes([int(best[0]) ^ 1]), 1e-300, 0, 0) == bytes(best[:1].tolist())
    assert torch.allclose(probabilities(logits, 0.7), fn.softmax(logits / 0.7, dim=-1), atol=1e-6)


def test_speculative_generation_is_chunk_one_generation_in_fewer_traversals(tiny):
    """At temperature 0 the very bytes of ar, over several window moves (context 16, 40 bytes); at
    temperature 1 a deterministic function of the seed. Greedy text repeats, so drafts are kept."""
    blocks, codebook = blocks_for(tiny), make_codebook(tiny.model)
    ar, spec = {}, {}
    for prompt in (b"ab", b"the cat, the cat, the"):
        expected = generate(blocks, tiny.noise, codebook, prompt, 40, 1, 0.0, 3, stats=ar)
        assert generate(blocks, tiny.noise, codebook, prompt, 40, 1, 0.0, 3, draft=8, stats=spec) == expected
        assert ar["traversals"] == 40 and spec["traversals"] < 40
    assert 0 < spec["kept"] <= spec["drafted"]
    # drafts from a sweep of the same blocks: a traversal of their own, the same bytes again
    swept = {}
    assert generate(blocks, tiny.noise, codebook, b"ab", 40, 1, 0.0, 3, draft=4, stats=swept,
                    drafter="sweep") == generate(blocks, tiny.noise, codebook, b"ab", 40, 1, 0.0, 3)
    assert swept["drafted"] > 0 and swept["kept"] <= swept["drafted"]
    sampled = [generate(blocks, tiny.noise, codebook, b"ab", 30, 1, 1.0, s, draft=4) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1] and len(sampled[0]) == 30 and sampled[0] != sampled[2]


def test_mixed_chunk_training_draws_each_k_and_records_the_mix(tiny):
    """train.chunks: each batch's K is drawn from the mix (K = 1 included); the mix survives the JSON
    written beside a checkpoint; a K beyond the context is refused before training starts."""
    from spheroid.config import RunConfig, TrainConfig
    from spheroid.train import block_loss, chunk_sampler

    mixed = RunConfig(model=tiny.model, noise=tiny.noise, train=TrainConfig(steps=3, batch=4, chunks=(1, 4, 16)))
    draw, gen = chunk_sampler(mixed), torch.Generator().manual_seed(0)
    assert {draw(gen) for _ in range(60)} == {1, 4, 16}
    assert RunConfig.from_dict(json.loads(json.dumps(mixed.to_dict()))).train.chunks == (1, 4, 16)
    assert chunk_sampler(tiny)(gen) == tiny.model.chunk
    block = blocks_for(tiny)[0]
    windows = torch.randint(0, 256, (4, tiny.model.context + 1), generator=torch.Generator().manual_seed(1))
    loss, ce = block_loss(block, mixed, 0, make_codebook(tiny.model))(windows, gen)
    assert torch.isfinite(loss) and ce > 0
    with pytest.raises(ValueError, match="at most the context"):  # (refused as a configuration)
        RunConfig(model=tiny.model, noise=tiny.noise, train=TrainConfig(chunks=(1, 17)))
    with pytest.raises(ValueError, match="at least 1"):
        TrainConfig(chunks=(0,))
