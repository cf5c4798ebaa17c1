"""The results pages, made from the result files: docs/results.md and the README's results table.

Every figure on those pages is read from a JSON file in bench/results/ (the files the docs cite; older
explorations are in bench/results/archive/, listed in its INDEX.md), with the commit and command that
produced it. Files written before the bench scripts recorded that are marked "older, commit unknown",
with the date and the description the README gave them when they were committed; nothing is guessed.

    python bench/report.py            # write docs/results.md and the README's section between the markers
    python bench/report.py --check    # write nothing; exit 1 when either differs from what it would write
    make results                      # the same as the first

tests/test_report.py fails when the committed pages differ from what this script writes, so a
result file changed without the pages (or the pages edited by hand) is caught. Deterministic (files
in sorted order, fixed number formats, no clock) and quick: only the standard library.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
BEGIN = "<!-- results:begin -->"
END = "<!-- results:end -->"
MIB = 2**20

# Files written before the bench scripts recorded their commit and command: the date and what the
# README said of each run when it was committed (its text, not a reconstruction).
LEGACY: dict[str, tuple[str, str]] = {
    "averaging": ("2026-12-03", "`python bench/averaging.py --rounds 20 --interval 1.5 --repeats 4`; protocol "
                                "version 11"),
    "compose-mini": ("2026-11-29", "`python bench/compose.py --preset mini`; round 1 of the grid"),
    "compose-mini-round2": ("2026-11-29", "`python bench/compose.py --preset mini --only paper_noskip "
                                          "chain_input_noskip ...`; round 2, same references"),
    "compose-mini-round3": ("2026-11-29", "`python bench/compose.py --preset mini --only chain_input_noskip genesis "
                                          "chain_input_noskip_genesis chain_input_noskip_merged`; round 3"),
    "inference-default": ("2026-12-01", "`python bench/inference.py --preset default`"),
    "memory-depth": ("2026-11-30", "`python bench/memory.py --preset depth`"),
    "memory-small": ("2026-11-29", "`python bench/memory.py --preset small`"),
    "quality-depth": ("2026-11-30", "`python bench/quality.py --preset depth --set model.gate_init=1.0 "
                                    "--reuse-references runs/quality-depth`"),
    "quality-depth-gate0": ("2026-11-30", "the depth preset with the relay loss and AdaLN-Zero gates (the default "
                                          "then), the same references; in order and all at once (R = 100)"),
    "quality-depth-relay-untrained": ("2026-11-30", "the depth preset before the relay loss (relay channel only, "
                                                    "AdaLN-Zero gates), in order and all at once (R = 100)"),
    "quality-paper": ("2026-11-29", "`python bench/quality.py --preset paper --set model.edm_skip=true --set "
                                    "train.block_input=noised`: method.md's setting, one H200, before the defaults "
                                    "changed"),
    "quality-small": ("2026-11-29", "`python bench/quality.py --preset small`, z only between blocks (the defaults "
                                    "before the relay channel), plain references only"),
    "quality-small-methodmd": ("2026-11-29", "`python bench/quality.py --preset small --set model.edm_skip=true "
                                             "--set train.block_input=noised`: method.md's setting"),
    "simulate": ("2026-12-03", "`python bench/simulate.py --minutes 3 --partition 60,120`"),
    "swarm-p9": ("2026-12-01", "`python bench/swarm.py --preset default --only paper,best --out "
                               "bench/results/swarm-p9.json`; protocol version 9"),
    "swarm-r200": ("2026-12-01", "`python bench/swarm.py --preset default --only paper,best --add "
                                 "\"int2-r200=--every 100 --refresh-every 200 $F\" --add \"int2-r300=--every 100 "
                                 "--refresh-every 300 $F\"` with F = `--codec int2 --lz4 --error-feedback --outer "
                                 "average --steps-scale 1.5 --refresh-codec int2`; protocol version 8 (`best` was "
                                 "then the same as int2-r200 with refreshes every 100)"),
    "wire": ("2026-12-02", "`python bench/wire.py --repeats 10`; protocol version 10"),
}


# --- formats -------------------------------------------------------------------------------------


def ce(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def mib(n: float | None) -> str:
    return "-" if n is None else f"{n / MIB:,.2f}"


def num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def sci(x: float | None) -> str:
    return "-" if x is None else f"{x:.2e}"


def count(x: int | None) -> str:
    return "-" if x is None else f"{x:,}"


def cell(text: object) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[object]], right: set[int] | None = None) -> str:
    """A markdown table; columns in `right` (default: all but the first) aligned right."""
    right = set(range(1, len(header))) if right is None else right
    lines = ["| " + " | ".join(header) + " |",
             "|" + "|".join("---:" if i in right else "---" for i in range(len(header))) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def source(name: str) -> str:
    return f"`bench/results/{name}.json`"


def stamp(data: dict) -> dict:
    """A file's provenance (bench/provenance.py's keys): at its top level, or under "provenance"."""
    if data.get("commit"):
        return data
    nested = data.get("provenance")
    return nested if isinstance(nested, dict) and nested.get("commit") else {}


def made_by(name: str, data: dict) -> str:
    """Where a file's figures come from: its commit and command, or "older, commit unknown"."""
    data = stamp(data)
    if not data:
        date, said = LEGACY.get(name, ("date unknown", "not described"))
        return f"older, commit unknown (committed {date}; the README then: {said})"
    dirty = ", on a tree with uncommitted changes" if data.get("dirty") else ""
    machine = data.get("machine") or {}
    where = ", ".join(x for x in (f"{machine['cpus']} CPUs" if machine.get("cpus") else "",
                                  f"torch {machine['torch']}" if machine.get("torch") else "") if x)
    text = f"commit `{data['commit'][:10]}`{dirty}, `{data.get('command', '?')}`, {str(data.get('date', '?'))[:10]}"
    if where:
        text += f" ({where})"
    again = data.get("summarised")
    if isinstance(again, dict) and again.get("commit"):
        text += f"; summarised again at commit `{again['commit'][:10]}`"
    return text


def short_made_by(data: dict) -> str:
    data = stamp(data)
    return f"commit `{data['commit'][:10]}`" if data else "older, commit unknown"


def head(title: str, name: str, data: dict) -> list[str]:
    return [f"### {title}", "", f"{source(name)}: {made_by(name, data)}.", ""]


def setting(cfg: dict, group: str, key: str, shown: Callable[[object], str] = str) -> str:
    value = (cfg.get(group) or {}).get(key)
    return "not recorded" if value is None else shown(value)


def model_line(cfg: dict) -> str:
    m, t = cfg.get("model", {}), cfg.get("train", {})
    return (f"d_model {m.get('d_model')}, {m.get('n_blocks')} blocks x {m.get('layers_per_block')} layer(s), context "
            f"{m.get('context')}, batch {t.get('batch')}, {t.get('steps')} steps, lr {t.get('lr')}; channel "
            f"{setting(cfg, 'model', 'channel')}, relay loss {setting(cfg, 'model', 'relay_loss')}, gates start at "
            f"{setting(cfg, 'model', 'gate_init')}, block input {setting(cfg, 'train', 'block_input')}, EDM skip "
            f"{setting(cfg, 'model', 'edm_skip', lambda v: 'on' if v else 'off')}")


# --- the sections ---------------------------------------------------------------------------------


def quality_rows(data: dict) -> list[list[object]]:
    """Rows of one quality file: references, the chain(s) and block 0 alone, in either schema."""
    rows = []
    if "references" in data:  # since the two-stream references (2026-11-30)
        names = {"plain": "plain reference", "two_stream": "two-stream reference"}
        for key in sorted(data["references"], key=lambda k: (-data["references"][k]["depth"], k)):
            r = data["references"][key]
            rows.append([f"{names.get(r['layout'], r['layout'])}, {r['depth']} layer(s)", ce(r["ce"]),
                         ce(r.get("ce_raw")), count(r.get("params")), sci(r.get("train_flops")),
                         num(r.get("wall_s"), 0)])
        titles = {"ordered": "chain, blocks in order", "concurrent": "chain, all blocks at once"}
        for key in ("ordered", "concurrent"):
            c = data["chains"].get(key)
            if not c:
                continue
            if key == "concurrent":
                titles[key] += f" (R = {data.get('refresh_every')})"
            raw = c.get("raw") or {}
            rows.append([f"{titles[key]}, M = 1 / M = {data.get('draws_m8', 8)}", f"{ce(c['ce'])} / {ce(c['ce_m8'])}",
                         f"{ce(raw.get('ce'))} / {ce(raw.get('ce_m8'))}", count(c.get("params")),
                         sci(c.get("train_flops")), " + ".join(num(s, 0) for s in c.get("wall_s", []))])
        c = data["chains"]["ordered"]
        rows.append(["its block 0 alone", ce(c["block0_alone_ce"]), ce((c.get("raw") or {}).get("block0_alone_ce")),
                     count(c.get("params_per_block")), sci((c.get("train_flops_per_block") or [None])[0]),
                     num((c.get("wall_s") or [None])[0], 0)])
        return rows
    raw, flops, wall = data.get("raw", {}), data.get("flops", {}), data.get("wall_s", {})
    model = data["config"]["model"]
    rows.append([f"end-to-end reference ({model['n_blocks'] * model['layers_per_block']} layers)",
                 ce(data["reference_ce"]), ce(raw.get("reference_ce")), "-", sci(flops.get("reference")),
                 num(wall.get("reference"), 0)])
    rows.append([f"one-block-deep reference ({model['layers_per_block']} layers)",
                 ce(data["single_block_reference_ce"]), ce(raw.get("single_block_reference_ce")), "-",
                 sci(flops.get("single_block_reference")), num(wall.get("single_block_reference"), 0)])
    rows.append([f"chain, M = 1 / M = {data.get('draws_m8', 8)}",
                 f"{ce(data['blocktrain_ce'])} / {ce(data['blocktrain_ce_m8'])}",
                 f"{ce(raw.get('blocktrain_ce'))} / {ce(raw.get('blocktrain_ce_m8'))}", "-",
                 sci(flops.get("blocktrain")),
                 " + ".join(num(s, 0) for s in wall.get("blocks", []))])
    rows.append(["block 0 alone (at sigma_max)", ce(data["block0_alone_ce"]), ce(raw.get("block0_alone_ce")), "-",
                 sci((flops.get("per_block") or [None])[0]), num((wall.get("blocks") or [None])[0], 0)])
    return rows


QUALITY = [("quality-depth", "Quality, `--preset depth`: the defaults"),
           ("quality-depth-gate0", "Quality, `--preset depth`, AdaLN-Zero gates (`--gate-init 0`)"),
           ("quality-depth-relay-untrained", "Quality, `--preset depth`, without the relay loss (`--relay-loss 0`)"),
           ("quality-small", "Quality, `--preset small`, z only between blocks (`--channel z`)"),
           ("quality-small-methodmd", "Quality, `--preset small`, method.md's setting"),
           ("quality-paper", "Quality, `--preset paper`, method.md's setting (one GPU)")]


def quality_section(results: dict) -> list[str]:
    out = ["## Quality: the chain against its end-to-end references", "",
           "CE in nats/byte on `wiki.valid.tokens` (and `wiki.valid.raw`) from pure noise with a clean context; M: "
           "draws averaged. What one worker could train alone is the one-block-deep reference or block 0 alone; "
           "train s: each trainer's wall time (blocks in order: one per block).", ""]
    for name, title in QUALITY:
        if name not in results:
            continue
        data = results[name]
        out += head(title, name, data)
        out += [f"{model_line(data['config'])}; {data.get('eval_windows')} windows, {data.get('device', 'cpu')}.", ""]
        out += [table(["model", "CE valid.tokens", "CE valid.raw", "params", "train FLOPs", "train s"],
                      quality_rows(data)), ""]
    return out


def depth_section(results: dict) -> list[str]:
    """bench/depth.py's screens: one row per job's result, as the file lists them."""
    out = []
    for name in sorted(n for n in results if n.startswith("depth-")):
        d = results[name]
        if not isinstance(d.get("table"), list):
            continue
        if not out:
            out += ["## Depth screens: `bench/depth.py`", "",
                    "Where the chain's gap to the end-to-end reference goes and what closes it. Gap: CE minus the "
                    "plain reference of the same depth trained in the same run (negative: below it); FLOPs ratio: "
                    "training FLOPs over that reference's.", ""]
        out += head(f"Depth screens, `--preset {d.get('preset')}` ({name})", name, d)
        rows = [[r.get("job", "-"), r.get("scale", "-"), r.get("what", "-"), r.get("status", "-"), ce(r.get("ce")),
                 ce(r.get("ce_m8")), ce(r.get("block0_alone_ce")),
                 "-" if r.get("gap") is None else f"{r['gap']:+.3f}", num(r.get("flops_ratio"))]
                for r in d["table"]]
        out += [table(["job", "scale", "what", "status", "CE", "CE, M = 8", "block 0 alone", "gap", "FLOPs ratio"],
                      rows, right={4, 5, 6, 7, 8}), ""]
    return out


def memory_section(results: dict) -> list[str]:
    out = ["## Training memory", "",
           "MiB, each trainer in its own process (`bench/memory.py`): before, peak resident before the first step; "
           "training = peak - before; activations, what autograd keeps for backward in one step; weights, parameters, "
           "gradients and AdamW moments; frozen, the earlier blocks a block holds and runs forward. Ratios against the "
           "plain full-depth reference at the same batch.", ""]
    labels = {"reference": "plain reference (full depth)", "reference-two-stream": "two-stream reference (full depth)",
              "reference-1block": "plain reference (one block deep)", "block": "block 0, noised inputs",
              "block-merged": "block 0, `merged` layout", "last-block": "last block, the default (chain states, relay)"}
    for name, title in (("memory-depth", "`--preset depth` shapes"), ("memory-small", "`--preset small` shapes")):
        if name not in results:
            continue
        data = results[name]
        out += head(f"Training memory, {title}", name, data)
        rows = [[labels.get(r["trainer"], r["trainer"]), r["batch"], num(r["before_mb"], 0), num(r["peak_mb"], 0),
                 num(r["training_mb"], 0), num(r["activations_mb"], 0), num(r["weights_mb"], 1),
                 num(r.get("frozen_mb"), 1), num(r["peak_ratio"]), num(r["training_ratio"]),
                 num(r["activations_ratio"])] for r in data["rows"]]
        out += [table(["trainer", "batch", "before", "peak", "training", "activations", "weights", "frozen",
                       "peak / ref", "training / ref", "activations / ref"], rows), ""]
    return out


def compose_section(results: dict) -> list[str]:
    names = sorted(n for n in results if n.startswith("compose-"))
    if not names:
        return []
    out = ["## What makes the blocks compose: `bench/compose.py`", "",
           "Every variant trains its own blocks under the same budget; \"vs 1blk\" and \"vs b0\" are the chain "
           "(M draws) minus the one-block-deep reference and minus block 0 alone: negative is what is wanted. "
           "The discussion is in docs/compose.md.", ""]
    for name in names:
        data = results[name]
        refs = data["references"]
        out += head(f"Compose, `--preset {data['preset']}` ({name})", name, data)
        out += [f"References in the same run: full depth {ce(refs['reference']['ce'])}, one block deep "
                f"{ce(refs['single_block_reference']['ce'])}; {data.get('eval_windows')} windows.", ""]
        rows = []
        for v in data["variants"]:
            changed = " (method change)" if v.get("method_change") else ""
            rows.append([f"{v['note']}{changed}", ce(v["blocktrain_ce_m1"]), ce(v["blocktrain_ce"]), v["draws"],
                         ce(v["block0_alone_ce"]), ce(v.get("bound_ce")), f"{v['vs_single_block_reference']:+.3f}",
                         f"{v['vs_block0_alone']:+.3f}"])
        out += [table(["variant", "M = 1", "M avg", "M", "block 0 alone", "bound", "vs 1blk", "vs b0"], rows), ""]
    return out


def swarm_section(results: dict) -> list[str]:
    names = sorted(n for n in results if n.startswith("swarm-"))
    if not names:
        return []
    out = ["## Swarm training over an emulated WAN: `bench/swarm.py`", "",
           "Every node behind its own link; CE of the assembled chain from pure noise, one draw, on fixed windows of "
           "`wiki.valid.tokens`. **MiB sent**: what the nodes sent each other (their own counters; status requests and "
           "assemblies of the bench are clients, left out), the figure the comparison uses. **MiB in+out**: what a "
           "node's status line and `spheroid swarm`'s `moved` show, summed over the nodes: sent plus received, "
           "clients included, so every node-to-node byte counts twice (recorded since the bench wrote it). "
           "Refreshes: what the readers of blocks 1 to 3 fetched of the earlier blocks.", ""]
    for name in names:
        data = results[name]
        link, swarm = data["link"], data["swarm"]
        out += head(f"Swarm, `--preset {data['preset']}` ({name})", name, data)
        out += [f"{swarm['blocks']} blocks x {swarm['replicas']} replicas, one node process each; links of "
                f"{num(link['delay_ms_one_way'], 0)} ms one way and {num(link['mbit'], 0)} Mbit/s; node flags "
                f"`{' '.join(swarm['node_flags'])}`.", ""]
        comparison = data.get("comparison") or {}
        configs = comparison.get("configs", {})
        target = comparison.get("paper_final_ce")
        rows = []
        for run_name, run in data["runs"].items():
            last = run["snapshots"][-1]
            c = configs.get(run_name, {})
            reach = ("-" if run_name == "paper" or not c else
                     f"step {c['steps_to_reach']:.0f}, {mib(c['bytes_to_reach'])} MiB ({c['bytes_ratio']:.1f}x fewer)"
                     if c.get("bytes_ratio") else "not reached")
            rows.append([run_name, f"`{' '.join(run['flags'])}`", ce(last["ce"]), mib(last["bytes"]),
                         mib(run.get("moved_bytes")), mib(run.get("refresh_bytes")),
                         f"{ce(c.get('ce_at_paper_steps'))} (step {c.get('step_of_that', 0):.0f})" if c else "-",
                         reach])
        out += [table(["config", "flags", "final CE (M = 1)", "MiB sent", "MiB in+out", "of which refreshes",
                       "CE at about the paper-like run's steps", f"reaches the paper-like final CE {ce(target)} at"],
                      rows, right={2, 3, 4, 5, 6}), ""]
    return out


def averaging_section(results: dict) -> list[str]:
    data = results.get("averaging")
    if not data:
        return []
    out = ["## One averaging round against gloo: `bench/averaging.py`", ""]
    out += head("Averaging", "averaging", data)
    out += [f"{count(data['params'])} float32 values ({mib(data['tensor_bytes'])} MiB) on 127.0.0.1, {data['cpus']} "
            f"CPUs; per run {data['warmup']} warm-up rounds, then the median of {data['rounds']} rounds "
            f"{data['interval']} s apart; {data['repeats']} pairs of runs (gloo, spheroid) per process count. Times "
            "and CPU (user + kernel, per node and round): each system's median over its runs; ratio: the median of the "
            "pairs' ratios [their range]; bytes: loopback bytes per node over the tensor's size.", ""]
    rows = [[t["procs"], num(t["gloo_round_s"], 3), num(t["spheroid_round_s"], 3),
             f"{t['time_ratio']:.2f} [{t['time_ratio_min']:.2f}-{t['time_ratio_max']:.2f}]",
             num(t["gloo_cpu_s_per_node"], 3), num(t["spheroid_cpu_s_per_node"], 3),
             num(t["gloo_bytes_over_tensor"]), num(t["spheroid_bytes_over_tensor"]), "yes" if t["agree"] else "no"]
            for t in data["table"]]
    out += [table(["processes", "gloo s", "spheroid s", "time ratio [range]", "gloo CPU s", "spheroid CPU s",
                   "gloo bytes / tensor", "spheroid bytes / tensor", "replicas agree"], rows), ""]
    return out


def simulate_section(results: dict) -> list[str]:
    d = results.get("simulate")
    if not d:
        return []
    c = d["config"]
    out = ["## A 1,000-node swarm, simulated: `bench/simulate.py`", ""]
    out += head("Simulation", "simulate", d)
    out += [f"{count(c['nodes'])} nodes, {c['blocks']} blocks ({d['replicas_per_block']} replicas each), rounds of "
            f"{num(c['compute_s'], 0)} s compute ({c['stragglers']:.0%} of nodes 5x slower), a {num(c['wait_s'], 0)} s "
            f"deadline, {num(c['latency_s'] * 1000, 0)} ms links of {num(c['mbit'], 0)} Mbit/s, sizes counted as for "
            f"{mib(c['block_bytes'])} MiB blocks, {c['churn']:.0%} of nodes leaving and as many joining per minute, "
            f"every block split in halves from {num(c['partition'][0], 0)} s to {num(c['partition'][1], 0)} s, "
            f"{num(c['minutes'], 0)} minutes of training then {num(c['settle_s'], 0)} s to settle.", ""]
    states = d["distinct_states_per_block_at_end"]
    rows = [
        ["rounds closed / closed by their deadline", f"{count(d['rounds_closed'])} / {d['closed_by_deadline']:.0%}"],
        ["longest wait in a round (s)", num(d["waited_s_max"], 1)],
        ["rounds with a cell missing at the deadline", f"{d['rounds_with_missing_cells']:.0%}"],
        ["replicas that closed a round with the same cells and the same state", f"{d['same_cells_same_state']:.0%}"],
        ["members of a round's main group on its most common state, mean / worst",
         f"{d['members_on_the_main_state']['mean']:.0%} / {d['members_on_the_main_state']['min']:.0%}"],
        ["all replicas closing a round on its most common state, mean / worst",
         f"{d['closers_on_the_main_state']['mean']:.0%} / {d['closers_on_the_main_state']['min']:.0%}"],
        ["the main group's size, median / smallest",
         f"{num(d['main_group_size']['median'], 1)} / {d['main_group_size']['min']}"],
        ["joiners / became members", f"{d['joiners']} / {d['joiners_became_members']}"],
        ["joiners with two rounds' time / became members",
         f"{d['joiners_in_time']} / {d['joiners_in_time_became_members']}"],
        ["time from joining to a first round as a member, median / longest (s)",
         f"{num(d['joiner_s_to_first_member_round']['median'], 0)} / "
         f"{num(d['joiner_s_to_first_member_round']['max'], 0)}"],
        ["distinct states per block at the end", ", ".join(str(states[k]) for k in sorted(states, key=int))],
        ["peers a node sends parts and averages to per round, mean / max",
         f"{num(d['peers_per_node_round']['mean'], 0)} / {d['peers_per_node_round']['max']}"],
        ["peers a node sends anything to per round, mean / p99 / max",
         f"{num(d['all_peers_per_node_round']['mean'], 0)} / {d['all_peers_per_node_round']['p99']} / "
         f"{d['all_peers_per_node_round']['max']}"],
        ["averaging bytes a node sends per round over the block's size, mean / max",
         f"{num(d['bytes_sent_per_node_round_over_block']['mean'])} / "
         f"{num(d['bytes_sent_per_node_round_over_block']['max'])}"],
        ["state transfers", count(d["state_fetches"])],
    ]
    out += [table(["figure", "value"], rows), ""]
    return out


def wire_section(results: dict) -> list[str]:
    d = results.get("wire")
    if not d:
        return []
    t = d["transfer"]
    out = ["## Wire: `bench/wire.py`", ""]
    out += head("Wire", "wire", d)
    out += [table([f"{num(t['mib'], 0)} MiB float32 over 127.0.0.1, best of {len(t.get('raw_times', []))}", "seconds",
                   "MiB/s"],
                  [["raw socket (no framing, no codec)", num(t["raw_socket_s"], 3), num(t["raw_socket_mib_s"], 0)],
                   ["node protocol (chunk frames to a `spheroid node` process)", num(t["protocol_s"], 3),
                    num(t["protocol_mib_s"], 0)],
                   ["ratio", "", f"**{t['ratio']:.2f}**"]]), ""]
    sizes = {(s["tensor"], s["codec"], s["compression"]): s["size_ratio"] for s in d["sizes"]}
    tensors = sorted({s["tensor"] for s in d["sizes"]})
    rows = [[f"{s['codec']}{' + lz4' if s['compression'] == 'lz4' else ''}", num(s["encode_mib_s"], 0),
             num(s["decode_mib_s"], 0), num(s["size_ratio"], 3),
             *(num(sizes.get((tensor, s["codec"], s["compression"])), 3) for tensor in tensors)]
            for s in d["throughput"]]
    out += [f"Codecs on 16 MiB of random normal values, and their sizes on a block of {count(d['weights_elements'])} "
            "values after a short training run and on its change over the last 10 steps:", "",
            table(["codec", "encode MiB/s", "decode MiB/s", "size / fp32: random normal",
                   *(f"size / fp32: {tensor}" for tensor in tensors)], rows), ""]
    return out


def inference_section(results: dict) -> list[str]:
    names = sorted(n for n in results if n.startswith("inference-"))
    out = []
    for name in names:
        d = results[name]
        link = d["link"]
        out += ["## Serving through a pipeline of nodes: `bench/inference.py`", ""] if not out else []
        out += head(f"Serving, `--preset {d['preset']}` ({name})", name, d)
        out += [f"{d['n_bytes']} bytes after a validation prompt, mean of {d['prompts']} prompts, over {d['hops']} "
                f"serving nodes each behind a link of {num(link['delay_ms_one_way'], 0)} ms one way and "
                f"{num(link['mbit'], 0)} Mbit/s. Valid CE at K: the blocks' CE under that chunk's mask (M = 1); "
                "samples' CE: the generated bytes scored by the end-to-end reference.", ""]
        rows = [[r["name"], r["k"], num(r["temperature"], 1), num(r["wall_s"]), f"{r['speedup_vs_ar']:.1f}x",
                 num(r["traversals"], 1), num(r["bytes_per_traversal"]), num(r["node_bytes"] / 1024, 1),
                 ce(r.get("valid_ce_m1")), ce(r.get("sample_ce_under_reference"))] for r in d["modes"]]
        out += [table(["mode", "K", "T", "seconds", "vs ar", "traversals", "bytes/traversal", "KiB between nodes",
                       "valid CE at K", "samples' CE"], rows), ""]
        if d.get("concurrent"):
            rows = [[r["name"], r["sessions"], num(r["wall_s"]), num(r["bytes_per_s"], 1), f"{r['vs_reference']:.2f}x"]
                    for r in d["concurrent"]]
            out += ["Sessions at once (total generated bytes per second):", "",
                    table(["pipeline", "sessions", "seconds", "bytes/s", "vs reference"], rows), ""]
        q = d.get("quality_against_k") or {}
        if q:
            chunks = [str(k) for k in q["chunks"]]
            rows = [[f"valid CE at K = {k}", ce(q["trained_k1"]["valid_ce_m1"].get(k)),
                     ce(q["trained_mixed"]["valid_ce_m1"].get(k))] for k in chunks]
            for key, label in (("sweep", "sweep drafts kept (bytes per traversal)"),
                               ("lookup", "prompt-lookup drafts kept (bytes per traversal)")):
                rows.append([label] + [f"{q[m][f'{key}_drafts_kept']:.2f} ({q[m][f'{key}_bytes_per_traversal']:.2f})"
                                       for m in ("trained_k1", "trained_mixed")])
            out += [f"Blocks trained at K = 1 against blocks trained with K drawn from {{{q['mix']}}} per batch:", "",
                    table(["", "trained at K = 1", "trained at mixed K"], rows), ""]
    return out


# --- bench/peers.py: which method when ------------------------------------------------------------

METHODS = {"e2e": "end-to-end, one worker", "diloco": "DiLoCo: replicas of the end-to-end model",
           "blocktrain": "BlockTrain: one worker per block"}


def peers_table(d: dict) -> str:
    rows = [[METHODS.get(r["name"], r["name"]), r["workers"], ce(r["ce"]), params(r.get("params")),
             mib(r["bytes_max_worker"]), mib(r["bytes_total"]), sci(r["train_flops"]),
             num(r["train_memory_mb_max_worker"], 1), num(r["wall_s"], 0)] for r in d["rows"]]
    return table(["method", "workers", "CE", "parameters", "MiB sent, busiest worker", "MiB sent, all",
                  "training FLOPs", "training MiB, largest worker", "wall s"], rows)


def params(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}M"


def peers_section(results: dict) -> list[str]:
    d = results.get("peers")
    if not d:
        return []
    out = ["## Which method when: `bench/peers.py`", ""]
    out += head("BlockTrain, DiLoCo and end-to-end on the same FLOPs", "peers", d)
    link = d.get("link") or {}
    cfg = d.get("config") or {}
    text = ("The same model shape, data and training FLOPs for every row; workers behind links of "
            f"{num(link.get('delay_ms_one_way'), 0)} ms one way and {num(link.get('mbit'), 0)} Mbit/s. CE: the "
            "chain's at M = 1, or the reference's; MiB sent: what workers sent each other; training MiB: weights, "
            "gradients, optimizer state, activations and frozen copies of the largest worker.")
    if "flops_spread" in cfg:
        text += f" The rows' FLOPs lie within {cfg['flops_spread']:.1%} of each other."
    if isinstance(cfg.get("diloco"), dict):
        s = cfg["diloco"]
        text += (f" DiLoCo's row is the best of its grid: H = {s.get('every')}, outer learning rate "
                 f"{s.get('outer_lr')}, {s.get('codec')}.")
    out += [text, "", peers_table(d), ""]
    if d.get("grid"):
        rows = [[g["every"], g["outer_lr"], g["codec"], ce(g["ce"]), mib(g["bytes_total"])]
                for g in sorted(d["grid"], key=lambda g: (g["every"], g["outer_lr"], g["codec"]))]
        out += ["DiLoCo's grid (every run of the coordinate search):", "",
                table(["H (--every)", "outer lr", "codec", "CE", "MiB sent, all"], rows), ""]
    if d.get("projection_check"):
        rows = [[METHODS.get(p["name"], p["name"]), num(p["memory_mb_model"], 1), num(p["memory_mb_measured"], 1),
                 num(p["bytes_per_step_model"], 0), num(p.get("payload_per_step_measured"), 0),
                 num(p["bytes_per_step_measured"], 0)] for p in d["projection_check"]]
        out += ["spheroid/projection.py's model at this bench's shape against the measurement (largest worker's "
                "training memory; busiest worker's bytes per step: the payload the model counts, and all it sent, "
                "pings, versions and peer lists included):", "",
                table(["method", "memory MiB, model", "memory MiB, measured", "bytes/step, model",
                       "payload bytes/step, measured", "bytes/step sent, measured"], rows), ""]
    out += projection_lines(d.get("projection"))
    return out


def projection_lines(p: object) -> list[str]:
    """The projection to public model shapes (spheroid/projection.py), where the file has one."""
    if not isinstance(p, dict) or not isinstance(p.get("largest_model"), dict):
        return []
    rows = []
    for key in sorted(p["largest_model"]):
        best = p["largest_model"][key]
        if not isinstance(best, dict):
            continue
        fig = best.get("figures") or {}
        memory = fig.get("memory_mib") or {}
        hourly = fig.get("bytes_per_hour")
        busiest = hourly.get("busiest_worker") if isinstance(hourly, dict) else None
        over = best.get("first_too_large") or {}
        rows.append([key, best.get("shape") or "none", num(memory.get("device", memory.get("total")), 0),
                     num(memory.get("total"), 0), "-" if busiest is None else num(busiest / MIB, 0),
                     f"{over['shape']} ({num(over.get('largest_worker_mib'), 0)} MiB)" if over.get("shape") else "-"])
    if not rows:
        return []
    budget = (p.get("assumptions") or {}).get("memory_budget_mib")
    return [f"The largest model shape whose largest worker trains in {num(budget, 0)} MiB of device memory, by the "
            "projection (spheroid/projection.py; its assumptions are in the file): MiB of that worker on the device "
            "and in all (host buffers included), and what the busiest worker sends an hour:", "",
            table(["method", "largest shape", "device MiB", "all MiB", "MiB sent an hour", "first shape too large"],
                  rows), ""]


# --- the pages ------------------------------------------------------------------------------------

SECTIONS = [peers_section, quality_section, depth_section, memory_section, compose_section, swarm_section,
            averaging_section, simulate_section, wire_section, inference_section]
RENDERED = ("peers", "quality-", "depth-", "memory-", "compose-", "swarm-", "averaging", "simulate", "wire",
            "inference-")


def load(folder: Path = RESULTS) -> dict[str, dict]:
    """Every result file in `folder` (not its archive), by name, in sorted order."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def results_page(results: dict[str, dict]) -> str:
    out = ["# Results", "",
           "<!-- generated by `python bench/report.py` (`make results`) from bench/results/*.json: do not edit by "
           "hand -->", "",
           "Every figure on this page is read from a result file in `bench/results/`, named with the commit and "
           "command that produced it; files written before the bench scripts recorded them say \"older, commit "
           "unknown\", with the date and description the README gave them. `python bench/report.py` writes this page "
           "and the README's results table, and `tests/test_report.py` fails when they differ from the files. How "
           "the figures moved over time, what was tried and dropped, and the runs behind them: "
           "[history.md](history.md) and `bench/results/archive/INDEX.md`.", "",
           "To add a result, run a bench with `--out bench/results/NAME.json` (by default they write under `runs/`), "
           "then `make results`.", ""]
    for section in SECTIONS:
        out += section(results)
    others = [n for n in results if not n.startswith(RENDERED)]
    if others:
        out += ["## Other result files", "", "Not rendered by bench/report.py yet:", ""]
        out += [f"- {source(n)}: {short_made_by(results[n])}" for n in others] + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def headline(results: dict[str, dict]) -> str:
    """The README's table: one line per headline figure, each with its file and commit."""
    rows = []
    q = results.get("quality-depth")
    if q and "chains" in q:
        c, m = q["chains"]["ordered"], q["config"]["model"]
        rows.append([f"chain of {m['n_blocks']} blocks of {m['layers_per_block']} layer(s), each trained alone "
                     f"(`--preset {q['preset']}`)",
                     f"CE {ce(c['ce'])}; its block 0 alone {ce(c['block0_alone_ce'])}, the best one-block-deep "
                     f"reference {ce(q['single_block_reference_ce'])}, the full-depth reference "
                     f"{ce(q['reference_ce'])}", "quality-depth", q])
    s = results.get("swarm-p9")
    if s and s.get("comparison", {}).get("configs", {}).get("best", {}).get("bytes_ratio"):
        c = s["comparison"]
        b = c["configs"]["best"]
        rows.append([f"{s['swarm']['blocks']} blocks x {s['swarm']['replicas']} replicas, a node each, over emulated "
                     "WAN links",
                     f"`best` reaches the paper-like run's final CE {ce(c['paper_final_ce'])} after "
                     f"{mib(b['bytes_to_reach'])} MiB sent, against {mib(c['paper_bytes'])} MiB: "
                     f"{b['bytes_ratio']:.1f}x fewer bytes", "swarm-p9", s])
    a = results.get("averaging")
    if a:
        t = max(a["table"], key=lambda t: t["procs"])
        rows.append([f"one averaging round of {mib(a['tensor_bytes'])} MiB, {t['procs']} processes",
                     f"{t['time_ratio']:.2f}x gloo's all_reduce time [{t['time_ratio_min']:.2f}-"
                     f"{t['time_ratio_max']:.2f}], {t['spheroid_bytes_over_tensor']:.2f}x the tensor sent per node",
                     "averaging", a])
    m = results.get("simulate")
    if m:
        states = m["distinct_states_per_block_at_end"]
        rows.append([f"{count(m['config']['nodes'])} nodes simulated: churn, stragglers, a partition",
                     f"{count(m['rounds_closed'])} rounds, {m['closed_by_deadline']:.0%} closed by their deadline; "
                     f"{m['joiners_became_members']} of {m['joiners']} joiners became members; "
                     f"{max(states.values())} state per block at the end", "simulate", m])
    i = results.get("inference-default")
    if i:
        sp = i["speculative"]
        ar = next((c for c in i.get("concurrent", []) if c["name"] == "ar"), None)
        text = (f"exact speculative decoding (greedy) {sp['spec_speedup_vs_ar']:.1f}x faster than one byte per "
                f"traversal, the same bytes")
        if ar:
            text += (f"; {ar['sessions']} sessions: {num(ar['bytes_per_s'], 1)} bytes/s, {ar['vs_reference']:.2f}x "
                     "an autoregressive pipeline of the reference")
        rows.append([f"serving through {i['hops']} nodes over emulated WAN links", text, "inference-default", i])
    w = results.get("wire")
    if w:
        rows.append([f"one {num(w['transfer']['mib'], 0)} MiB tensor to a node over 127.0.0.1",
                     f"{w['transfer']['ratio']:.2f} of a raw socket's throughput", "wire", w])
    mem = results.get("memory-depth")
    if mem:
        last = next((r for r in mem["rows"] if r["trainer"] == "last-block"), None)
        if last:
            rows.append(["training memory of the last block (it also runs the earlier ones)",
                         f"{last['training_ratio']:.2f} of the full-depth reference's at batch {last['batch']}",
                         "memory-depth", mem])
    out = [BEGIN, "<!-- generated by `python bench/report.py` from bench/results: do not edit by hand -->", "",
           table(["what", "result", "file", "made by"],
                 [[what, result, f"[{name}.json](bench/results/{name}.json)", short_made_by(data)]
                  for what, result, name, data in rows], right=set()), ""]
    if results.get("peers"):
        out += ["Which method when (`bench/peers.py`, " + short_made_by(results["peers"]) + "):", "",
                peers_table(results["peers"]), ""]
    out += ["All figures, with their settings and provenance: [docs/results.md](docs/results.md).", END]
    return "\n".join(out)


def with_headline(readme: str, block: str) -> str:
    """The README with its section between the markers replaced by `block`."""
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise ValueError(f"README.md has no {BEGIN} ... {END} section")
    return readme[:start] + block + readme[end + len(END):]


def generate(folder: Path | None = None, readme: Path | None = None, page: Path | None = None) -> dict[Path, str]:
    """What the pages should hold, {path: text}: by default docs/results.md and README.md from bench/results."""
    results = load(folder or RESULTS)
    readme = readme or README
    return {page or PAGE: results_page(results), readme: with_headline(readme.read_text(), headline(results))}


def main(argv: list[str] | None = None, folder: Path | None = None, readme: Path | None = None,
         page: Path | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 when a page is out of date")
    args = parser.parse_args(argv)
    stale = []
    for path, text in generate(folder, readme, page).items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            path.write_text(text)
    for path in stale:
        shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        print(f"{shown}: {'out of date (run `python bench/report.py`)' if args.check else 'written'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
