import json

import pytest
import torch

from spheroid import checkpoint
from spheroid.checkpoint import CheckpointError
from spheroid.config import RunConfig, override
from spheroid.model import DiffusionBlock
from spheroid.train import load_chain


def save_blocks(folder, cfg: RunConfig, n: int | None = None) -> list[DiffusionBlock]:
    blocks = [DiffusionBlock(cfg.model, cfg.noise.sigma_data, b) for b in range(cfg.model.n_blocks)]
    for b, block in enumerate(blocks[:n]):
        checkpoint.save(folder, checkpoint.block_name(b), block, cfg, {"step": 3, "block": b})
    return blocks


def test_round_trip_restores_weights_config_and_state(tmp_path, tiny):
    blocks = save_blocks(tmp_path, tiny)
    cfg, loaded, codebook = load_chain(tmp_path, torch.device("cpu"))
    assert cfg == tiny
    for a, b in zip(blocks, loaded, strict=True):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
            assert ka == kb and torch.equal(va, vb)
    entry = checkpoint.load(tmp_path, "block-2")
    assert entry.state == {"step": 3, "block": 2}
    record = json.loads((tmp_path / "block-2.json").read_text())
    assert RunConfig.from_dict(record["config"]) == tiny and len(record["sha256"]) == 64
    assert not list(tmp_path.glob("*.tmp"))  # atomic writes leave no temp files behind


def test_truncated_weights_are_refused_with_a_clear_error(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    path = tmp_path / "block-1.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="block-1.safetensors .* does not match the sha256 .* one of the two is"):
        load_chain(tmp_path, torch.device("cpu"))


def test_an_edited_record_or_weights_of_another_model_are_named_in_one_line(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    record = json.loads((tmp_path / "block-0.json").read_text())
    (tmp_path / "block-0.json").write_text(json.dumps({**record, "sha256": "0" * 64}))
    with pytest.raises(CheckpointError, match=r"recorded in .*block-0.json: one of the two is damaged"):
        checkpoint.load(tmp_path, "block-0")
    (tmp_path / "block-0.json").write_text(json.dumps(record))
    wide = RunConfig(model=override(tiny.model, d_model=64), noise=tiny.noise, train=tiny.train)
    checkpoint.save(tmp_path, "block-1", DiffusionBlock(wide.model, 0.5), tiny, {})  # weights of another width
    mismatch = r"do not fit its configuration \(.* is \(\d+, 64\) where .*\d+ shapes differ"
    with pytest.raises(CheckpointError, match=mismatch) as err:
        load_chain(tmp_path, torch.device("cpu"))
    assert "\n" not in str(err.value)


def test_garbage_record_and_missing_files_are_refused(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    (tmp_path / "block-3.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not JSON"):
        checkpoint.load(tmp_path, "block-3")
    with pytest.raises(CheckpointError, match="reference.json is missing"):
        checkpoint.load(tmp_path, "reference")


def test_missing_block_and_mismatched_config_are_refused(tmp_path, tiny):
    save_blocks(tmp_path, tiny, n=3)
    with pytest.raises(CheckpointError, match=r"lacks block\(s\) \[3\]"):
        checkpoint.load_blocks(tmp_path)
    other = RunConfig.from_dict({**tiny.to_dict(), "noise": {**tiny.to_dict()["noise"], "p_mean": 0.0}})
    checkpoint.save(tmp_path, "block-3", DiffusionBlock(other.model, 0.5), other, {})
    with pytest.raises(CheckpointError, match="another model or noise configuration"):
        checkpoint.load_blocks(tmp_path)


def test_unknown_config_fields_are_refused():
    with pytest.raises(ValueError, match="unknown field"):
        RunConfig.from_dict({"model": {"d_modle": 3}})


def test_a_worker_checkpoint_saved_under_protocol_8_keeps_its_state_under_this_protocols_hash():
    import hashlib

    from spheroid.averaging import SharedState, Version, state_hash
    from spheroid.node.worker import from_protocol_8

    params, momentum = torch.randn(40000), torch.randn(40000)
    old = Version(7, 512, hashlib.sha256(torch.cat([params, momentum]).numpy()).hexdigest())
    version = from_protocol_8(old, params, momentum)
    assert version == Version(7, 512, state_hash(params, momentum)) and version.hash != old.hash
    assert SharedState.unpack(version, torch.cat([params, momentum]), 40000).version == version
    assert from_protocol_8(version, params, momentum) == version  # this protocol's: as it is
    other = Version(7, 512, "ab" * 32)
    assert from_protocol_8(other, params, momentum) == other  # damaged: unpack will say so
    with pytest.raises(ValueError, match="does not match"):
        SharedState.unpack(other, torch.cat([params, momentum]), 40000)
