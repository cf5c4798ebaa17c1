import lzma

import pytest
import torch

from spheroid.data import DataError, fixed_windows, load_bytes, random_windows


def test_real_wikitext_loads_from_xz(data_dir):
    valid = load_bytes(data_dir, "valid", "tokens")
    assert valid.dtype == torch.uint8 and valid.numel() == 1_121_681
    assert bytes(valid[:3].tolist()) == b" \n "
    assert load_bytes(data_dir, "valid", "raw").numel() == 1_146_846


def test_plain_and_xz_files_give_the_same_bytes(tmp_path):
    text = b" = Title = \n some text \n" * 10
    (tmp_path / "wiki.train.tokens").write_bytes(text)
    with lzma.open(tmp_path / "wiki.valid.tokens.xz", "wb") as f:
        f.write(text)
    assert torch.equal(load_bytes(tmp_path, "train"), load_bytes(tmp_path, "valid"))


def test_folder_from_the_environment(tmp_path, monkeypatch):
    (tmp_path / "wiki.test.raw").write_bytes(b"hello world\n")
    monkeypatch.setenv("SPHEROID_DATA", str(tmp_path))
    assert bytes(load_bytes(None, "test", "raw").tolist()) == b"hello world\n"


def test_no_folder_is_one_clear_error(monkeypatch):
    monkeypatch.delenv("SPHEROID_DATA", raising=False)
    with pytest.raises(DataError, match="--data DIR or set SPHEROID_DATA"):
        load_bytes(None, "train")


def test_missing_folder_and_missing_file_name_the_expected_files(tmp_path):
    with pytest.raises(DataError, match=r"does not exist.*wiki\.train\.tokens"):
        load_bytes(tmp_path / "nope", "train")
    (tmp_path / "README").write_text("not wikitext")
    with pytest.raises(DataError, match=r"no wiki\.valid\.raw\[\.xz\].*found \['README'\]"):
        load_bytes(tmp_path, "valid", "raw")


def test_corrupt_xz_is_a_clear_error(tmp_path):
    (tmp_path / "wiki.train.tokens.xz").write_bytes(b"definitely not xz")
    with pytest.raises(DataError, match="cannot read"):
        load_bytes(tmp_path, "train")


def test_a_truncated_xz_is_a_clear_error(tmp_path):
    text = bytes(range(256)) * 4000
    with lzma.open(tmp_path / "whole.xz", "wb", preset=0) as f:
        f.write(text)
    (tmp_path / "wiki.train.tokens.xz").write_bytes((tmp_path / "whole.xz").read_bytes()[:-200])
    with pytest.raises(DataError, match=r"cannot read .*wiki\.train\.tokens\.xz.*re-fetch it"):
        load_bytes(tmp_path, "train")


def test_windows_are_contiguous_slices():
    data = torch.arange(200, dtype=torch.uint8)
    w = random_windows(data, 8, 17, torch.Generator().manual_seed(0))
    assert w.shape == (8, 17) and w.dtype == torch.long
    assert torch.all(w[:, 1:] - w[:, :-1] == 1)
    f = fixed_windows(data, 4, 10)
    assert f[0, 0] == 0 and f[-1, -1] == 199
    assert torch.equal(f, fixed_windows(data, 4, 10))
    with pytest.raises(DataError, match="shorter than one window"):
        random_windows(data[:5], 1, 10, torch.Generator())
