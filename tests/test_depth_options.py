"""The depth issue's options: an MLP relay head, noisy tokens that read their own block's clean stream,
block b starting from block b-1's weights, fewer noisy positions per batch. Each keeps today's
behaviour by default, leaks nothing, and changes what it says it changes."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from spheroid import checkpoint
from spheroid.chain import denoise
from spheroid.config import RunConfig, override
from spheroid.model import CleanStream, DiffusionBlock, make_codebook, parameter_count
from spheroid.train import block_loss, block_trainer, chain_state_loss

from .conftest import randomize


def changed(cfg: RunConfig, model: dict | None = None, train: dict | None = None) -> RunConfig:
    return RunConfig(model=override(cfg.model, **(model or {})), noise=cfg.noise,
                     train=override(cfg.train, **(train or {})))


def test_the_defaults_are_todays_model_and_old_configurations_load(tiny):
    assert (tiny.model.relay_head_hidden, tiny.model.noisy_anchor) == (0, "embedding")
    assert (tiny.train.init_from_previous, tiny.train.noisy_positions) == (False, 0)
    data = tiny.to_dict()
    for key in ("relay_head_hidden", "noisy_anchor"):
        del data["model"][key]
    for key in ("init_from_previous", "noisy_positions"):
        del data["train"][key]
    assert RunConfig.from_dict(data) == tiny
    # today's relay head: LayerNorm then one linear readout, so old checkpoints' keys still fit
    keys = {k for k in DiffusionBlock(tiny.model, 0.5, 0).state_dict() if k.startswith("relay_head")}
    assert keys == {"relay_head.0.weight", "relay_head.0.bias", "relay_head.1.weight", "relay_head.1.bias"}


def test_bad_values_are_refused(tiny):
    with pytest.raises(ValueError, match="relay_head_hidden"):
        changed(tiny, model={"relay_head_hidden": -1})
    with pytest.raises(ValueError, match="noisy_anchor"):
        changed(tiny, model={"noisy_anchor": "both"})
    with pytest.raises(ValueError, match="concat"):
        changed(tiny, model={"noisy_anchor": "stream", "layout": "merged", "channel": "z"})
    with pytest.raises(ValueError, match="divide the context"):
        changed(tiny, train={"noisy_positions": 5})


def test_an_mlp_relay_head_is_causal_and_wider(tiny):
    cfg = changed(tiny, model={"relay_head_hidden": 24})
    block = randomize(DiffusionBlock(cfg.model, 0.5, 0)).eval()
    linear = DiffusionBlock(tiny.model, 0.5, 0)
    d, v = cfg.model.d_model, cfg.model.vocab
    assert parameter_count(block) - parameter_count(linear) == (d * 24 + 24 + 24 * v + v) - (d * v + v)
    assert DiffusionBlock(cfg.model, 0.5, cfg.model.n_blocks - 1).relay_head is None  # the last hands on nothing
    t = cfg.model.context
    x = torch.randint(0, 256, (2, t), generator=torch.Generator().manual_seed(0))
    stream = CleanStream(1)
    block.encode(x, stream)
    logits = block.relay_logits(stream)
    assert logits.shape == (2, t, v)
    later = x.clone()
    later[:, 7:] = (later[:, 7:] + 1) % 256
    other = CleanStream(1)
    block.encode(later, other)
    with torch.no_grad():
        assert torch.equal(block.relay_logits(other)[:, :7], logits[:, :7])
        assert not torch.allclose(block.relay_logits(other)[:, 7], logits[:, 7])


@pytest.mark.parametrize("anchor, reads", [("stream", True), ("embedding", False)])
def test_noisy_tokens_read_their_own_clean_streams_output_only_when_asked(tiny, anchor, reads):
    """With noisy_anchor "stream" a block's prediction depends on the clean-stream output it hands
    on (at the anchor, and only there: no later position); by default it does not, with one layer."""
    cfg = changed(tiny, model={"noisy_anchor": anchor})
    block = randomize(DiffusionBlock(cfg.model, 0.5, 0)).eval()
    t, d = cfg.model.context, cfg.model.d_model
    gen = torch.Generator().manual_seed(3)
    x, z, sigma = torch.randint(0, 256, (1, t), generator=gen), torch.randn(1, t, d, generator=gen), torch.tensor([2.0])
    stream = CleanStream(1)
    block.encode(x, stream)
    with torch.no_grad():
        base = block(x, z, sigma, stream=stream)
        for i in (3, 9):
            other = CleanStream(1)
            block.encode(x, other)
            other.out = other.out.clone()
            other.out[0, i] += torch.randn(d, generator=gen)
            out = block(x, z, sigma, stream=other)
            torch.testing.assert_close(out[0, :i], base[0, :i], rtol=0, atol=1e-6)
            torch.testing.assert_close(out[0, i + 1 :], base[0, i + 1 :], rtol=0, atol=1e-6)
            assert bool(torch.allclose(out[0, i], base[0, i])) is not reads


def test_the_chain_with_noisy_tokens_reading_the_stream_does_not_leak(tiny):
    cfg = changed(tiny, model={"noisy_anchor": "stream"})
    blocks = [randomize(DiffusionBlock(cfg.model, 0.5, b), seed=b).eval() for b in range(cfg.model.n_blocks)]
    codebook = make_codebook(cfg.model)
    t = cfg.model.context
    window = torch.randint(0, 256, (1, t + 1), generator=torch.Generator().manual_seed(0))

    def run(w: torch.Tensor) -> torch.Tensor:
        return denoise(blocks, cfg.noise, codebook, w[:, :-1], t, torch.Generator().manual_seed(7))[0]

    base = run(window)
    for i in range(t - 1):
        later = window.clone()
        later[0, i + 1 :] = (later[0, i + 1 :] + 1 + i) % 256
        out = run(later)
        torch.testing.assert_close(out[: i + 1], base[: i + 1], rtol=0, atol=1e-5)
        assert not torch.allclose(out[i + 1], base[i + 1])


def test_the_denoisers_gradient_reaches_the_handed_on_stream_only_through_the_anchor(tiny):
    """Without a relay loss, the last layer's clean-stream output is trained only when noisy tokens
    read it: the gradient of the denoiser's CE w.r.t. that output is zero by default, not with "stream"."""
    for anchor, trained in (("embedding", False), ("stream", True)):
        cfg = changed(tiny, model={"noisy_anchor": anchor, "relay_loss": 0.0})
        block = randomize(DiffusionBlock(cfg.model, 0.5, 0))
        t, d = cfg.model.context, cfg.model.d_model
        gen = torch.Generator().manual_seed(4)
        x, z = torch.randint(0, 256, (2, t), generator=gen), torch.randn(2, t, d, generator=gen)
        stream = CleanStream(1)
        block.encode(x, stream)
        stream.out.retain_grad()
        block(x, z, torch.tensor([2.0, 3.0]), stream=stream).logsumexp(-1).sum().backward()
        assert (stream.out.grad is not None and bool(stream.out.grad.abs().sum() > 0)) is trained


@pytest.mark.parametrize("loss", [chain_state_loss, block_loss])
def test_fewer_noisy_positions_cost_less_and_train_on_one_segment(tiny, loss):
    codebook = make_codebook(tiny.model)
    windows = torch.randint(0, 256, (4, tiny.model.context + 1), generator=torch.Generator().manual_seed(1))
    flops = {}
    for n in (0, 4):
        cfg = changed(tiny, train={"noisy_positions": n})
        blocks = [DiffusionBlock(cfg.model, 0.5, b) for b in range(3)]
        seen = []
        hook = blocks[2].register_forward_hook(lambda m, args, out, seen=seen: seen.append((args[1].shape[1], args[3])))
        with FlopCounterMode(display=False) as counter:
            value, ce = loss(blocks[2], cfg, 2, codebook, blocks[:2])(windows, torch.Generator().manual_seed(2))
        hook.remove()
        flops[n] = counter.get_total_flops()
        assert torch.isfinite(value)
        start, count = seen[-1][1], seen[-1][0]  # the trained call: its noisy tokens' first position and count
        assert count == (n or tiny.model.context) and start % (n or 1) == 0 and start + count <= tiny.model.context
    assert flops[4] < flops[0]


def test_a_block_can_start_from_the_one_before_it(tiny, tmp_path):
    cfg = changed(tiny, train={"init_from_previous": True})
    trained = randomize(DiffusionBlock(cfg.model, 0.5, 0), seed=5)
    checkpoint.save(tmp_path, checkpoint.block_name(0), trained, cfg, {"block": 0, "step": 3})
    block, _, _ = block_trainer(cfg, 1, tmp_path, torch.device("cpu"))
    mine, theirs = block.state_dict(), trained.state_dict()
    assert mine.keys() == theirs.keys()  # (both have a relay head: block 1 of 4 hands on too)
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    plain, _, _ = block_trainer(tiny, 1, tmp_path, torch.device("cpu"))
    assert not torch.equal(plain.net.layers[0].attn.qkv.weight, trained.net.layers[0].attn.qkv.weight)
    two = changed(cfg, model={"n_blocks": 2})
    first = randomize(DiffusionBlock(two.model, 0.5, 0), seed=6)
    checkpoint.save(tmp_path / "two", checkpoint.block_name(0), first, two, {"block": 0, "step": 3})
    last, _, _ = block_trainer(two, 1, tmp_path / "two", torch.device("cpu"))  # the last block: no relay head
    assert last.relay_head is None and torch.equal(last.head.weight, first.head.weight)
