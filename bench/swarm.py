"""Decentralised block training over an emulated wide-area network: CE against bytes moved.

For each configuration it runs a swarm on 127.0.0.1 (default: four blocks, two replicas each,
every node its own `spheroid node` process) with every node behind its own WAN link from
bench/wan.py (default 20 ms one way, so 40 ms round trip, and 50 Mbit/s per direction): nodes
listen on one port and announce the link's, so every node-to-node connection crosses a link.

While the swarm trains, every `--snapshot-s` seconds the script assembles it (directly, not
through the emulator) and records the bytes the nodes have sent to each other so far, from the
nodes' own counters (client traffic such as these status requests and assemblies is counted
apart and left out). When a run is over it scores every snapshot: the chain's CE from pure noise,
one draw (M = 1), on fixed windows of wiki.valid.tokens. Of the bytes moved, it also reports those
of the state transfers by which each node refreshes its frozen copies of the earlier blocks it reads
(`refresh MiB`). Configurations compared:

  paper  plain averaging of float32 updates every H = 10 local steps (what the paper reports)
  best   int2 updates (-1, 0 or 1 times a scale per 256 values, lz4 where it helps) with error
         feedback every H = 100 local steps, plain averaging, 1.5 times the local steps, and
         refreshes of the earlier blocks by their change from the copy held, in int2, at most
         every 300 steps: the best of the variants tried (docs/history.md)

Two byte counts: `MiB sent` is what the nodes sent to each other (the figure the comparison and
the plot use); `MiB in+out` is what a node's own status line and `spheroid swarm`'s `moved` show,
summed over the nodes: sent plus received, client traffic (these status requests and assemblies)
included, so each node-to-node byte counts twice there.

Writes JSON (--out; default runs/swarm-<preset>.json, so that no run replaces a committed result:
the committed ones were written with --out bench/results/...), with the commit and command that made
it, a PNG of CE against bytes moved beside it, and prints a table.

    python bench/swarm.py [--preset ci|default] [--only paper,best] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import provenance  # noqa: E402
from wan import LinkSpec, Network  # noqa: E402

from spheroid.config import REFERENCE_PART, parse_addr  # noqa: E402
from spheroid.data import fixed_windows, load_bytes  # noqa: E402
from spheroid.launch import LocalSwarm, free_ports, status_line  # noqa: E402
from spheroid.train import evaluate_chain  # noqa: E402

log = logging.getLogger("bench.swarm")

CONFIGS: dict[str, list[str]] = {
    "paper": ["--every", "10", "--codec", "fp32", "--outer", "average"],
    # int2 with error feedback every 100 steps, plain averaging; allowed 1.5x the local steps, since
    # what a wide-area swarm runs short of is bytes, not steps (the comparison also reads its CE at
    # equal steps); earlier blocks refreshed by their change from the copy held, in int2, each at
    # most every 300 steps
    "best": ["--every", "100", "--codec", "int2", "--lz4", "--error-feedback", "--outer", "average",
             "--steps-scale", "1.5", "--refresh-codec", "int2", "--refresh-every", "300"],
}
PRESETS: dict[str, dict] = {
    # a smoke run for the test suite: seconds of training, numbers meaningless
    "ci": {"flags": ["--d-model", "32", "--n-heads", "2", "--layers-per-block", "1", "--context", "32",
                     "--batch", "8", "--steps", "80", "--warmup", "10"],
           "replicas": 2, "blocks": 2, "snapshot_s": 3.0, "windows": 16},
    # about 10 minutes on a 2-core CPU for both configurations
    "default": {"flags": ["--d-model", "64", "--n-heads", "4", "--layers-per-block", "2", "--context", "64",
                          "--batch", "16", "--steps", "800", "--warmup", "50"],
                "replicas": 2, "blocks": 4, "snapshot_s": 15.0, "windows": 256},
}


def swarm_bytes(members) -> int:
    """Bytes the nodes sent to each other (their own counters, client traffic left out)."""
    return sum(m.status.swarm_traffic.sent.wire_bytes for m in members if m.status is not None)


def moved_bytes(nodes: dict) -> int:
    """What the nodes' own status lines call moved, summed over them: sent plus received, clients included."""
    return sum(n["traffic"]["sent"]["wire_bytes"] + n["traffic"]["received"]["wire_bytes"]
               for n in nodes.values() if "traffic" in n)


def node_flags(preset_flags: list[str], flags: list[str]) -> list[str]:
    """The preset's flags with a configuration's on top; `--steps-scale F` multiplies the preset's --steps."""
    flags = list(flags)
    out = list(preset_flags)
    if "--steps-scale" in flags:
        i = flags.index("--steps-scale")
        scale = float(flags[i + 1])
        del flags[i : i + 2]
        j = out.index("--steps")
        out[j + 1] = str(round(int(out[j + 1]) * scale))
    return [*out, *flags]


def run_config(name: str, flags: list[str], p: dict, spec: LinkSpec, work: Path, data: str | None) -> dict:
    """One swarm run behind the emulator: snapshots of (time, bytes, steps, assembled model)."""
    run_flags = [*node_flags(p["flags"], flags), "--n-blocks", str(p["blocks"]), "--threads", "1"]
    parts = [block for block in range(p["blocks"]) for _ in range(p["replicas"])]
    return {"config": name, "flags": flags, **run_swarm(work / name, run_flags, parts, spec, p["snapshot_s"], data)}


def run_swarm(folder: Path, run_flags: list[str], parts: list[int], spec: LinkSpec, snapshot_s: float,
              data: str | None) -> dict:
    """Nodes with `run_flags` training `parts` (one node per entry: a block, or REFERENCE_PART), every
    node behind its own link, until all are done; every `snapshot_s` seconds the swarm is assembled
    (directly, not through the links) and the bytes the nodes sent each other and the FLOPs they
    trained so far are recorded beside it."""
    shutil.rmtree(folder, ignore_errors=True)
    snapshots = []
    started = time.monotonic()
    with Network() as net, LocalSwarm(folder / "nodes", data, run_flags) as local:
        seed, counts = None, Counter()
        ports = iter(free_ports(2 * len(parts)))  # chosen at once: no two alike
        for part in parts:
            listen, link_port = f"127.0.0.1:{next(ports)}", next(ports)
            net.add(("127.0.0.1", link_port), parse_addr(listen), spec)
            prefix = "ref" if part == REFERENCE_PART else f"b{part}"
            member = local.add(f"{prefix}-{chr(97 + counts[part])}", part, listen=listen,
                               announce=f"127.0.0.1:{link_port}", seeds=[seed.addr] if seed else [])
            counts[part] += 1
            seed = seed or member
        done = False
        while not done:
            time.sleep(snapshot_s)
            members = local.poll()
            done = all(m.training is not None and m.training.done for m in members)
            out = folder / "snapshots" / f"{len(snapshots):03d}"
            try:
                local.assemble(out)
            except Exception as exc:  # noqa: BLE001 - a block not reachable yet: no snapshot this time
                log.info("%s: no snapshot yet at %.0fs (%s); the next in %.0fs", folder.name,
                         time.monotonic() - started, exc, snapshot_s)
                continue
            trained = [m.training for m in members if m.training is not None]
            snapshots.append({"wall_s": time.monotonic() - started, "bytes": swarm_bytes(members),
                              "mean_step": sum(t.step for t in trained) / max(len(trained), 1),
                              "flops": sum(t.train_flops for t in trained), "folder": str(out)})
            for m in members:
                log.info("%s %s", folder.name, status_line(m))
        final = {m.name: {"training": m.training.to_dict(), "swarm_traffic": m.status.swarm_traffic.to_dict(),
                          "traffic": m.status.traffic.to_dict()} for m in members}  # (as the nodes sent them)
        codes = local.stop()
    return {"snapshots": snapshots, "nodes": final, "exit_codes": codes, "wall_s": time.monotonic() - started,
            "link_bytes": sum(sum(link.bytes.values()) for link in net.links),
            "refresh_bytes": sum(n["training"].get("earlier", {}).get("bytes", 0) for n in final.values()),
            "moved_bytes": moved_bytes(final)}


def score(run: dict, windows: torch.Tensor) -> None:
    for snap in run["snapshots"]:
        chain, _ = evaluate_chain(snap["folder"], windows, draws=1, seed=0, device=torch.device("cpu"))
        snap["ce"] = chain.ce_one_draw


def compare(runs: dict[str, dict]) -> dict:
    """For each configuration: the bytes it needed to reach the paper-like configuration's final CE."""
    if "paper" not in runs:
        return {}
    target = runs["paper"]["snapshots"][-1]["ce"]
    paper_bytes = runs["paper"]["snapshots"][-1]["bytes"]
    out = {"paper_final_ce": target, "paper_bytes": paper_bytes, "configs": {}}
    paper_steps = runs["paper"]["snapshots"][-1]["mean_step"]
    for name, run in runs.items():
        reached = next((s for s in run["snapshots"] if s["ce"] <= target), None)
        at_paper_steps = min(run["snapshots"], key=lambda s: abs(s["mean_step"] - paper_steps))
        out["configs"][name] = {"final_ce": run["snapshots"][-1]["ce"], "bytes": run["snapshots"][-1]["bytes"],
                                "steps": run["snapshots"][-1]["mean_step"],
                                "ce_at_paper_steps": at_paper_steps["ce"], "step_of_that": at_paper_steps["mean_step"],
                                "bytes_to_reach": reached["bytes"] if reached else None,
                                "steps_to_reach": reached["mean_step"] if reached else None,
                                "bytes_ratio": paper_bytes / reached["bytes"] if reached else None}
    return out


def paper_label(c: dict) -> str:
    return f"{c['configs']['paper']['steps']:.0f}"


def plot(runs: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, run in runs.items():
        xs = [max(s["bytes"], 1) / 2**20 for s in run["snapshots"]]
        ax.plot(xs, [s["ce"] for s in run["snapshots"]], marker="o", label=f"{name}: {' '.join(run['flags'])}")
    ax.set_xscale("log")
    ax.set_xlabel("bytes moved between nodes (MiB, log)")
    ax.set_ylabel("validation CE of the assembled model (nats/byte, M = 1)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="default")
    parser.add_argument("--only", default=",".join(CONFIGS), help="configurations to run, comma-separated")
    parser.add_argument("--add", action="append", default=[], metavar="NAME=FLAGS",
                        help='another configuration to run, e.g. --add "h40=--every 40 --codec int8" (repeatable)')
    parser.add_argument("--delay-ms", type=float, default=20.0, help="one-way delay of every link")
    parser.add_argument("--mbit", type=float, default=50.0, help="bandwidth of every link, per direction")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"), help="WikiText folder")
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON results (default runs/swarm-<preset>.json; pass bench/results/... to commit one)")
    parser.add_argument("--work", type=Path, default=None,
                        help="node folders and snapshots (default runs/swarm-<preset>)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    p = PRESETS[args.preset]
    out = args.out or Path("runs") / f"swarm-{args.preset}.json"
    work = args.work or Path("runs") / f"swarm-{args.preset}"
    out.parent.mkdir(parents=True, exist_ok=True)
    spec = LinkSpec(args.delay_ms, args.mbit)
    context = int(p["flags"][p["flags"].index("--context") + 1])
    windows = fixed_windows(load_bytes(args.data, "valid"), p["windows"], context + 1)
    configs = {name: CONFIGS[name] for name in args.only.split(",") if name}
    for item in args.add:
        name, sep, flags = item.partition("=")
        if not sep or not name:
            raise SystemExit(f"--add wants NAME=FLAGS, got {item!r}")
        configs[name] = flags.split()
    runs = {}
    for name, flags in configs.items():
        log.info("running %s: %s", name, " ".join(flags))
        runs[name] = run_config(name, flags, p, spec, work, args.data)
        score(runs[name], windows)
    result = {**provenance(), "preset": args.preset, "link": {"delay_ms_one_way": spec.delay_ms, "mbit": spec.mbit},
              "swarm": {"blocks": p["blocks"], "replicas": p["replicas"], "node_flags": p["flags"]},
              "runs": runs, "comparison": compare(runs)}
    out.write_text(json.dumps(result, indent=2))
    plot(runs, out.with_suffix(".png"))
    print(f"\n{'config':<7} {'flags':<44} {'final CE':>9} {'MiB sent':>9} {'MiB in+out':>11} {'refresh MiB':>12} "
          f"{'wall s':>7}")
    for name, run in runs.items():
        last = run["snapshots"][-1]
        print(f"{name:<7} {' '.join(run['flags']):<44} {last['ce']:>9.4f} {last['bytes'] / 2**20:>9.2f} "
              f"{run['moved_bytes'] / 2**20:>11.2f} {run['refresh_bytes'] / 2**20:>12.2f} {last['wall_s']:>7.0f}")
    print("MiB sent: what the nodes sent each other, at the last snapshot (the comparison's bytes); MiB in+out: "
          "sent plus received at the end, clients included (the nodes' `moved`), summed over the nodes")
    c = result["comparison"]
    for name, row in c.get("configs", {}).items():
        if name == "paper":
            continue
        print(f"{name} at about the paper-like run's {paper_label(c)} steps: CE {row['ce_at_paper_steps']:.4f} "
              f"(step {row['step_of_that']:.0f})")
        if row["bytes_ratio"]:
            print(f"{name} reached the paper-like final CE {c['paper_final_ce']:.4f} at step "
                  f"{row['steps_to_reach']:.0f} after {row['bytes_to_reach'] / 2**20:.2f} MiB: "
                  f"{row['bytes_ratio']:.1f}x fewer bytes")
        else:
            print(f"{name} did not reach the paper-like final CE {c['paper_final_ce']:.4f} "
                  f"(its final: {row['final_ce']:.4f})")
    print(f"results: {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
