import json

import pytest
import torch

from spheroid import checkpoint
from spheroid.checkpoint import CheckpointError
from spheroid.config import RunConfig, override
from spheroid.loading import load_chain
from spheroid.model import DiffusionBlock


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


def test_the_same_weights_save_to_the_same_bytes(tmp_path, tiny):
    """A checkpoint's file is named by its sha256, and training records the sha256 of the blocks it
    read: the same weights must give the same file every time (safetensors writes metadata entries
    in a random order, so two entries gave one of two hashes at random)."""
    block = DiffusionBlock(tiny.model, tiny.noise.sigma_data, 0)
    shas = set()
    for i in range(12):
        checkpoint.save(tmp_path / str(i), "block-0", block, tiny, {"step": 1})
        shas.add(checkpoint.load(tmp_path / str(i), "block-0").sha256)
    assert len(shas) == 1


def test_truncated_weights_are_refused_with_a_clear_error(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    path = tmp_path / json.loads((tmp_path / "block-1.json").read_text())["weights"]
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"block-1\.[0-9a-f]{16}\.safetensors .* does not match the sha256 .* one "
                                              r"of the two is"):
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


@pytest.mark.parametrize("table, field, value, error", [
    ("model", "d_model", "32", r"ModelConfig\.d_model must be int, got '32'"),
    ("model", "n_heads", 0, "n_heads must be at least 1"),
    ("model", "edm_skip", 1, r"ModelConfig\.edm_skip must be bool"),
    ("noise", "sigma_max", "x", r"NoiseConfig\.sigma_max must be float"),
    ("train", "steps", 2.5, r"TrainConfig\.steps must be int, got 2\.5"),
    ("train", "chunks", 5, r"TrainConfig\.chunks must be tuple"),
    ("train", "chunks", [1, "4"], r"TrainConfig\.chunks must be int, got '4'"),
])
def test_config_values_of_the_wrong_type_are_refused_naming_the_field(table, field, value, error):
    with pytest.raises(ValueError, match=error):
        RunConfig.from_dict({table: {field: value}})


def test_config_ints_where_floats_go_and_lists_where_tuples_go_read_as_such():
    cfg = RunConfig.from_dict({"train": {"lr": 1, "chunks": [1, 4]}, "noise": {"sigma_max": 20}})
    assert cfg.train.lr == 1.0 and type(cfg.train.lr) is float and cfg.noise.sigma_max == 20.0
    assert cfg.train.chunks == (1, 4)
    assert RunConfig.from_dict(json.loads(cfg.to_json())) == cfg


def test_a_save_killed_before_its_record_leaves_the_previous_checkpoint_loadable(tmp_path, tiny, monkeypatch):
    """The new weights are written under their own name, and the record (the commit point) after: a
    crash between the two leaves the old record naming the old weights, both intact."""
    old, new = (DiffusionBlock(tiny.model, tiny.noise.sigma_data, 0) for _ in range(2))  # (other random weights)
    checkpoint.save(tmp_path, "block-0", old, tiny, {"step": 1})
    writes, write = [], checkpoint.atomic_write

    def killed_at_the_record(path, data):
        if path.suffix == ".json":
            raise KeyboardInterrupt  # (as a second Ctrl-C would, between the two writes)
        writes.append(path)
        write(path, data)

    with monkeypatch.context() as m:
        m.setattr(checkpoint, "atomic_write", killed_at_the_record)
        with pytest.raises(KeyboardInterrupt):
            checkpoint.save(tmp_path, "block-0", new, tiny, {"step": 2})
    assert writes and writes[0].exists()  # the new weights were written, beside the old
    entry = checkpoint.load(tmp_path, "block-0")
    assert entry.state == {"step": 1}
    assert all(torch.equal(entry.tensors[k], v) for k, v in old.state_dict().items())
    checkpoint.save(tmp_path, "block-0", new, tiny, {"step": 2})  # the next save takes the left-over file away
    assert checkpoint.load(tmp_path, "block-0").state == {"step": 2}
    assert len(list(tmp_path.glob("block-0*.safetensors"))) == 1


def test_a_record_under_another_name_or_naming_weights_elsewhere_is_refused(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    b0, b1 = (tmp_path / "block-0.json").read_text(), (tmp_path / "block-1.json").read_text()
    (tmp_path / "block-0.json").write_text(b1)
    (tmp_path / "block-1.json").write_text(b0)
    with pytest.raises(CheckpointError, match="is the record of 'block-1', not of 'block-0': was it renamed"):
        checkpoint.load(tmp_path, "block-0")
    record = json.loads(b0)
    for weights in ("../block-0.safetensors", "/etc/passwd", 5):
        (tmp_path / "block-0.json").write_text(json.dumps({**record, "weights": weights}))
        with pytest.raises(CheckpointError, match="not a .safetensors file beside it"):
            checkpoint.load(tmp_path, "block-0")
    for state in ([], {"reads": {"block-0": 5}}):
        (tmp_path / "block-0.json").write_text(json.dumps({**record, "state": state}))
        with pytest.raises(CheckpointError, match="its state must be a map, and its reads a map of maps"):
            checkpoint.load(tmp_path, "block-0")


def test_a_block_beyond_the_models_is_named(tmp_path, tiny):
    save_blocks(tmp_path, tiny)
    one = RunConfig(model=override(tiny.model, n_blocks=1), noise=tiny.noise, train=tiny.train)
    checkpoint.save(tmp_path, "block-0", DiffusionBlock(one.model, 0.5, 0), one, {})
    with pytest.raises(CheckpointError, match=r"holds block\(s\) \[1, 2, 3\] beyond the 1 of its block 0's model"):
        checkpoint.load_blocks(tmp_path)


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


def test_a_configuration_names_what_another_sets_otherwise():
    ours = RunConfig()
    theirs = RunConfig(model=override(ours.model, d_model=64), train=override(ours.train, steps=ours.train.steps + 1))
    assert ours.differences(theirs) == [f"model.d_model: {ours.model.d_model} -> 64",
                                        f"train.steps: {ours.train.steps} -> {ours.train.steps + 1}"]
    assert ours.differences(ours) == []
