"""bench/report.py: the committed results pages are what it makes of bench/results, and it says where
every figure came from."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import report  # noqa: E402

MACHINE_PATHS = ("/work/", "/tmp/", "/home/", "/root/")


def peers_result() -> dict:
    """A bench/results/peers.json as bench/peers.py writes it (figures made up for the test)."""
    rows = [{"name": name, "transport": transport, "workers": workers, "ce": ce, "bytes_total": sent * workers,
             "bytes_max_worker": sent, "train_flops": 1.5e14, "train_flops_max_worker": 1.5e14 / workers,
             "peak_rss_mb_max_worker": 700.0, "train_memory_mb_max_worker": memory, "wall_s": wall,
             "curve": [[0, 5.0], [sent * workers, ce]], "params": 437120 if name != "blocktrain" else 896896}
            for name, transport, workers, ce, sent, memory, wall in (
                ("e2e", "local", 1, 2.0512, 0, 120.5, 1800.0), ("diloco", "node", 4, 2.1034, 3 * 2**20, 118.25, 900.0),
                ("blocktrain", "node", 4, 2.2047, 2**20, 61.0, 700.0))]
    return {"commit": "0123456789abcdef0123456789abcdef01234567", "dirty": False,
            "command": "python bench/peers.py --preset default --out bench/results/peers.json",
            "date": "2026-12-05T10:00:00Z", "machine": {"cpus": 2, "torch": "2.13.0+cpu"},
            "link": {"delay_ms_one_way": 20.0, "mbit": 50.0},
            "config": {"flops_spread": 0.031, "diloco": {"every": 50, "outer_lr": 0.7, "codec": "int4"}},
            "rows": rows,
            "grid": [{"every": 50, "outer_lr": 0.7, "codec": "int4", "ce": 2.1034, "bytes_total": 12 * 2**20},
                     {"every": 25, "outer_lr": 0.7, "codec": "int4", "ce": 2.1101, "bytes_total": 24 * 2**20}],
            "projection_check": [{"name": "blocktrain", "memory_mb_model": 60.0, "memory_mb_measured": 61.0,
                                  "bytes_per_step_model": 400.0, "bytes_per_step_measured": 420.0}]}


def readme_with_markers(path: Path) -> Path:
    path.write_text(f"# spheroid\n\nbefore\n\n{report.BEGIN}\nstale\n{report.END}\n\nafter\n")
    return path


def test_the_committed_pages_are_what_bench_report_writes():
    """docs/results.md and the README's results section, against bench/results as committed: a result
    file changed without `make results`, or a page edited by hand, fails here."""
    for path, text in report.generate().items():
        assert path.read_text() == text, (f"{path.relative_to(ROOT)} differs from what bench/report.py makes of "
                                          "bench/results: run `python bench/report.py` (make results)")


def test_the_report_is_deterministic_and_needs_no_clock():
    assert report.generate() == report.generate()
    page = report.results_page(report.load())
    assert page.endswith("\n") and "\r" not in page


def test_older_files_say_commit_unknown_and_newer_ones_name_their_commit_and_command(tmp_path):
    old = json.loads((report.RESULTS / "wire.json").read_text())
    assert "commit" not in old
    (tmp_path / "wire.json").write_text(json.dumps(old))
    page = report.results_page(report.load(tmp_path))
    assert "`bench/results/wire.json`: older, commit unknown (committed 2026-12-02" in page
    new = {**old, "commit": "fedcba9876543210fedcba9876543210fedcba98", "dirty": True,
           "command": "python bench/wire.py --out bench/results/wire.json", "date": "2026-12-05T09:00:00Z"}
    (tmp_path / "wire.json").write_text(json.dumps(new))
    page = report.results_page(report.load(tmp_path))
    assert ("commit `fedcba9876`, on a tree with uncommitted changes, `python bench/wire.py --out "
            "bench/results/wire.json`, 2026-12-05") in page
    assert "`bench/results/wire.json`: older" not in page
    # a file the script has no section for yet is still listed, with its provenance
    (tmp_path / "newbench.json").write_text(json.dumps({"commit": "ab" * 20, "x": 1}))
    assert "- `bench/results/newbench.json`: commit `abababab" in report.results_page(report.load(tmp_path))


def test_which_method_when_is_rendered_from_peers_json_and_only_when_it_exists(tmp_path):
    readme = readme_with_markers(tmp_path / "README.md")
    shutil.copy(report.RESULTS / "wire.json", tmp_path / "wire.json")
    without = report.generate(tmp_path, readme, tmp_path / "results.md")
    assert not any("Which method when" in text for text in without.values())

    (tmp_path / "peers.json").write_text(json.dumps(peers_result()))
    pages = report.generate(tmp_path, readme, tmp_path / "results.md")
    page, top = pages[tmp_path / "results.md"], pages[readme]
    for text in (page, top):
        assert "Which method when" in text
        # method, CE, parameters, MiB sent by the busiest worker and by all, FLOPs, training memory, wall time
        assert ("| DiLoCo: replicas of the end-to-end model | 4 | 2.1034 | 0.44M | 3.00 | 12.00 | 1.50e+14 | 118.2 "
                "| 900 |" in text)
        assert "| BlockTrain: one worker per block | 4 | 2.2047 | 0.90M | 1.00 | 4.00 | 1.50e+14 | 61.0 | 700 |" in text
        assert "| end-to-end, one worker | 1 | 2.0512 | 0.44M | 0.00 | 0.00 |" in text
    assert "commit `0123456789`" in page and "H = 50, outer learning rate 0.7, int4" in page
    assert "| 25 | 0.7 | int4 | 2.1101 | 24.00 |" in page  # the grid, sorted
    assert "largest model shape" not in page  # no projection in the file: nothing rendered for it
    assert top.startswith("# spheroid\n\nbefore\n\n" + report.BEGIN) and top.endswith(report.END + "\n\nafter\n")

    with_projection = {**peers_result(), "projection": {
        "assumptions": {"memory_budget_mib": 24576.0},
        "largest_model": {"e2e": {"shape": "gpt2-medium", "figures": {"memory_mib": {"total": 20000.0},
                                                                      "bytes_per_hour": {"busiest_worker": 0}}},
                          "blocktrain_B4": {"shape": "llama-7b", "figures": {
                              "memory_mib": {"total": 30000.0, "device": 23000.0},
                              "bytes_per_hour": {"busiest_worker": 5 * 2**20}},
                              "first_too_large": {"shape": "llama-13b", "largest_worker_mib": 40000.0}}}}}
    (tmp_path / "peers.json").write_text(json.dumps(with_projection))
    page = report.results_page(report.load(tmp_path))
    assert "trains in 24,576 MiB of device memory" in page
    assert "| blocktrain_B4 | llama-7b | 23,000 | 30,000 | 5 | llama-13b (40,000 MiB) |" in page
    assert "| e2e | gpt2-medium | 20,000 | 20,000 | 0 | - |" in page


def test_check_says_when_a_page_is_stale_and_writing_makes_it_current(tmp_path, capsys):
    readme = readme_with_markers(tmp_path / "README.md")
    shutil.copy(report.RESULTS / "simulate.json", tmp_path / "simulate.json")
    args = {"folder": tmp_path, "readme": readme, "page": tmp_path / "results.md"}
    assert report.main(["--check"], **args) == 1 and not (tmp_path / "results.md").exists()
    assert "out of date" in capsys.readouterr().out
    assert report.main([], **args) == 0
    assert report.main(["--check"], **args) == 0
    assert "| 1,000 nodes simulated" in readme.read_text()
    data = json.loads((tmp_path / "simulate.json").read_text())
    (tmp_path / "simulate.json").write_text(json.dumps({**data, "rounds_closed": 6484}))
    assert report.main(["--check"], **args) == 1  # a result changed: the pages no longer match
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="results:begin"):
        report.generate(tmp_path, readme, tmp_path / "results.md")


def test_no_machine_paths_in_committed_results_or_docs():
    files = [*sorted((ROOT / "bench" / "results").rglob("*.json")), *sorted((ROOT / "bench" / "results").rglob("*.md")),
             *sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    found = [f"{path.relative_to(ROOT)}: {marker}" for path in files if path.exists()
             for marker in MACHINE_PATHS if marker in path.read_text()]
    assert not found, f"absolute machine paths (write them relative to the checkout): {found}"
