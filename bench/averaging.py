"""One averaging round among N local processes on loopback: spheroid's butterfly against gloo.

For each N in --procs it runs N processes twice, on 127.0.0.1, with the same tensors:

  spheroid  each process is a real node (TCP, the handshake, msgpack frames, the wire codec)
            holding one replica of a block of --params float32 values; the nodes form a full mesh,
            then run rounds of spheroid/node/averager.py: reduce-scatter of the updates' parts to
            their owners, the owners' averages (with their cells' leaf digests) back to everyone,
            the outer step, the state's hash
  gloo      torch.distributed with the gloo backend: all_reduce (sum) of the same update, then a
            division by N (the average)

Once every process has started and met its peers, this script names a wall-clock instant;
every round starts at such an instant in all processes (each waits for it), after --warmup untimed
rounds, --warmup-interval apart (the timed ones are --interval apart). The warm-up is what a node
that has run a while has behind it: a new process's heap grows over its first rounds, while glibc
settles where each round's buffers go, and every page it grows by faults in once (4 KiB zeroed,
and on a virtual machine a page the host may have to back). Measured with 8 spheroid processes on
this 2-core VM: up to 19,000 such faults per process over the first 15 rounds, one 16 MiB chunk
(4,097) now and then after 30; about 5 ms of kernel CPU per process per round over 20 rounds after
two warm-up rounds, as much as the round's Python. Both systems get the same warm-up. (With one
warm-up round the first timed round at 8 processes took three times the others.) The time of a
round is from that instant to the last process's end; the table gives the median over --rounds. CPU: each
process's CPU time (all its threads) spent in the timed rounds' averaging, per round, and its two
parts, in user space (Python, the arithmetic, hashing) and in the kernel (the sockets' copies,
system calls): on a machine with fewer cores than processes it is what the round's time is made of.
Bytes sent per node: what the kernel counted on the loopback interface (/proc/net/dev, "lo")
during the timed rounds, divided by N, the same count for both; and for spheroid, the nodes' own
counters of wire bytes sent. Nothing else should use loopback while this runs. The ratio columns put spheroid against
gloo, measured in the same run.

With --repeats K, each N runs K pairs of the two systems back to back, the order alternating
(gloo first, then spheroid first, ...; an even K balances the order), so that a machine that slows
down or speeds up over minutes weighs on both alike. Each pair gives a ratio; the table gives their
median and range, and each system's median time and CPU over its K runs. On a shared machine with fewer cores than
processes the ratio of one pair moves by a tenth or more from run to run: one pair is one sample.

Writes JSON (--out; default runs/averaging.json: the committed result was written with --out
bench/results/averaging.json), with the commit and command that made it.

    python bench/averaging.py [--procs 2,4,8] [--params 4194304] [--rounds 5] [--warmup 40] [--repeats 1]
                              [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from provenance import provenance  # noqa: E402

from spheroid.averaging import AveragingConfig, Replica, SharedState  # noqa: E402
from spheroid.cli import run_async  # noqa: E402
from spheroid.config import NodeConfig  # noqa: E402
from spheroid.launch import free_ports  # noqa: E402
from spheroid.node.averager import Averager  # noqa: E402
from spheroid.node.identity import load_or_create  # noqa: E402
from spheroid.node.node import Node, tune_allocator  # noqa: E402

log = logging.getLogger("bench.averaging")


def loopback_tx_bytes() -> int:
    """Bytes the kernel sent on the loopback interface so far."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])  # receive has 8 fields, then transmit bytes
    raise RuntimeError("no loopback interface in /proc/net/dev")


def updates(rank: int, count: int, params: int) -> list[torch.Tensor]:
    """The `count` updates a process contributes to its rounds, the warm-up's first: the same in both
    systems. Made before the first round, as views of one random vector, each shifted by a value
    from the last: made between rounds instead (about 20 ms of CPU each at 4M values), a process done
    early would make its next update while the others are still in their round, and slow them."""
    pool = torch.randn(params + count - 1, generator=torch.Generator().manual_seed(rank)) * 0.01
    return [pool[r : r + params] for r in range(count)]


class CpuTime:
    """CPU seconds this process (all its threads) spends between `start` and `stop`, summed over the
    times it is started: in user space and in the kernel, by getrusage."""

    def __init__(self) -> None:
        self.user = self.sys = 0.0

    def start(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.user, self.sys = self.user - usage.ru_utime, self.sys - usage.ru_stime

    def stop(self) -> None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.user, self.sys = self.user + usage.ru_utime, self.sys + usage.ru_stime

    def per_round(self, rounds: int) -> dict:
        return {"cpu_s_per_round": (self.user + self.sys) / rounds, "user_s_per_round": self.user / rounds,
                "sys_s_per_round": self.sys / rounds}


def round_start(start0: float, r: int, a: argparse.Namespace) -> float:
    """When round r starts (warm-up rounds are r < 0, the first timed round is 0)."""
    return start0 + (min(r, 0) + a.warmup) * a.warmup_interval + max(r, 0) * a.interval


async def sleep_until(t: float) -> None:
    await asyncio.sleep(max(0.0, t - time.time()))


def ready_then_start(folder: Path, rank: int) -> float:
    """Say this process is ready (started, met its peers); the instant of the first round, once the
    script has named it."""
    parent = os.getppid()
    (folder / f"{rank}.ready").touch()
    while not (start := folder / "start").exists():
        if os.getppid() != parent:
            raise SystemExit("the bench script that started this process is gone")
        time.sleep(0.01)
    return float(start.read_text())


def name_start(folder: Path, procs: list[subprocess.Popen], timeout: float) -> float:
    """Wait until every member process is ready, then name the instant the first round starts."""
    deadline = time.monotonic() + timeout
    while len(list(folder.glob("*.ready"))) < len(procs):
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError("a member process failed before its first round")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the processes were not all ready within --setup-s {timeout:g}: raise it")
        time.sleep(0.02)
    start = time.time() + 0.5
    (folder / "start.tmp").write_text(repr(start))
    (folder / "start.tmp").rename(folder / "start")  # (whole, or not there)
    return start


# --- one process ---------------------------------------------------------------------------------


async def spheroid_member(a: argparse.Namespace, folder: Path) -> dict:
    ports = [int(p) for p in a.ports.split(",")]
    cfg = NodeConfig(listen=f"127.0.0.1:{ports[a.rank]}", peers=tuple(f"127.0.0.1:{p}" for p in ports[:a.rank]),
                     identity=str(folder / f"node-{a.rank}.json"), role="bench", blocks=(0,))
    ident = load_or_create(cfg.identity)
    node = Node(cfg, ident)
    await node.start()
    try:
        while len([c for c in node.conns.values() if not c.closed]) < a.n - 1:  # the full mesh
            await asyncio.sleep(0.05)
        deltas = updates(a.rank, a.warmup + a.rounds, a.params)
        start0 = await asyncio.to_thread(ready_then_start, folder, a.rank)
        genesis = torch.randn(a.params, generator=torch.Generator().manual_seed(0))
        replica = Replica(node.id, SharedState.create(0, 0, genesis, None), AveragingConfig(wait=a.interval),
                          expected=set(node.conns))
        averager = Averager(node, 0, replica, "fp32", "none")
        rounds, sent, cpu = [], 0, CpuTime()
        for r, delta in zip(range(-a.warmup, a.rounds), deltas, strict=True):  # rounds before 0: the warm-up
            start = round_start(start0, r, a)
            await sleep_until(start)
            if r == 0:
                await averager.flush()
                sent, cpu = node.traffic.totals()["sent"]["wire_bytes"], CpuTime()
            cpu.start()  # (the update's making is not the round's work)
            closed = await averager.round(delta, 8)
            cpu.stop()
            rounds.append({"start": start, "end": time.time(), "contributors": len(closed.contributors),
                           "missing": len(closed.missing), "hash": closed.state.version.hash})
        cpu.start()
        await averager.flush()
        cpu.stop()
        sent = node.traffic.totals()["sent"]["wire_bytes"] - sent
        await sleep_until(round_start(start0, a.rounds, a))  # the others may still be sending to it
        return {"rounds": rounds[a.warmup:], "sent_bytes_per_round": sent / a.rounds, **cpu.per_round(a.rounds)}
    finally:
        await node.stop()
        ident.release()


def gloo_member(a: argparse.Namespace) -> dict:
    import torch.distributed as dist

    port = int(a.ports.split(",")[0])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=a.rank, world_size=a.n)
    try:
        deltas = updates(a.rank, a.warmup + a.rounds, a.params)
        start0 = ready_then_start(a.folder, a.rank)
        rounds, cpu = [], CpuTime()
        for r, delta in zip(range(-a.warmup, a.rounds), deltas, strict=True):
            start = round_start(start0, r, a)
            x = delta.clone()  # (all_reduce sums into it)
            time.sleep(max(0.0, start - time.time()))
            if r >= 0:
                cpu.start()
            dist.all_reduce(x)
            x /= a.n
            rounds.append({"start": start, "end": time.time()})
            if r >= 0:
                cpu.stop()
        dist.barrier()
        return {"rounds": rounds[a.warmup:], **cpu.per_round(a.rounds)}
    finally:
        dist.destroy_process_group()


# --- one configuration ---------------------------------------------------------------------------


def run(kind: str, n: int, a: argparse.Namespace) -> dict:
    """N processes of one kind; their per-round times and the loopback bytes of the timed rounds."""
    ports, rounds, interval = free_ports(n), a.rounds, a.interval
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for rank in range(n):
            out = Path(tmp) / f"{rank}.json"
            cmd = [sys.executable, __file__, "--member", kind, "--rank", str(rank), "--n", str(n), "--ports",
                   ",".join(map(str, ports)), "--params", str(a.params), "--rounds", str(rounds),
                   "--interval", str(interval), "--warmup", str(a.warmup), "--warmup-interval",
                   str(a.warmup_interval), "--member-out", str(out), "--folder", tmp]
            procs.append((subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}), out))
        try:
            first = round_start(name_start(Path(tmp), [p for p, _ in procs], a.setup_s), 0, a)  # (after the warm-up)
            time.sleep(max(0.0, first - 0.05 - time.time()))
            tx0 = loopback_tx_bytes()
            time.sleep(max(0.0, first + rounds * interval - 0.05 - time.time()))
            tx1 = loopback_tx_bytes()
            results = []
            for proc, out in procs:
                if proc.wait(timeout=(rounds + 2) * interval + 60) != 0:
                    raise RuntimeError(f"a {kind} process failed (exit {proc.returncode})")
                results.append(json.loads(out.read_text()))
        finally:
            for proc, _ in procs:
                proc.kill()  # (those still running after a failure; the others are reaped already)
                proc.wait()
    times = [max(m["rounds"][r]["end"] for m in results) - results[0]["rounds"][r]["start"] for r in range(rounds)]
    late = [t for t in times if t > interval]
    if late:
        raise RuntimeError(f"{kind} rounds took {max(late):.2f}s, longer than --interval {interval}: raise it")
    row = {"system": kind, "procs": n, "round_s": statistics.median(times), "round_s_all": times,
           "loopback_bytes_per_node": (tx1 - tx0) / n / rounds,
           **{f"{part}_s_per_node": statistics.mean(m[f"{part}_s_per_round"] for m in results)
              for part in ("cpu", "user", "sys")}}
    if kind == "spheroid":
        row["node_bytes_per_node"] = statistics.mean(m["sent_bytes_per_round"] for m in results)
        row["agree"] = all(len({m["rounds"][r]["hash"] for m in results}) == 1 for r in range(rounds))
        row["complete"] = all(r["missing"] == 0 and r["contributors"] == n for m in results for r in m["rounds"])
    return row


def summary(rows: list[dict], n: int, tensor_bytes: int) -> dict:
    """One process count's line of the table, from its pairs of runs. The ratio is the median of the
    pairs' ratios, not the ratio of the medians: a pair's two runs are minutes apart, so a machine's
    drift over a longer time cancels within each pair."""
    runs = {kind: sorted((r for r in rows if r["procs"] == n and r["system"] == kind), key=lambda r: r["pair"])
            for kind in ("gloo", "spheroid")}
    if [r["pair"] for r in runs["gloo"]] != [r["pair"] for r in runs["spheroid"]]:
        raise ValueError(f"the runs of {n} processes do not make whole pairs")
    ratios = [ours["round_s"] / gloo["round_s"] for gloo, ours in zip(runs["gloo"], runs["spheroid"], strict=True)]

    def median(kind: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[kind])

    return {"procs": n, "pairs": len(ratios), "gloo_round_s": median("gloo", "round_s"),
            "spheroid_round_s": median("spheroid", "round_s"),
            "time_ratio": statistics.median(ratios), "time_ratio_min": min(ratios), "time_ratio_max": max(ratios),
            "time_ratios": ratios,
            **{f"{kind}_{part}_s_per_node": median(kind, f"{part}_s_per_node")
               for kind in ("gloo", "spheroid") for part in ("cpu", "user", "sys")},
            "gloo_bytes_per_node": median("gloo", "loopback_bytes_per_node"),
            "spheroid_bytes_per_node": median("spheroid", "loopback_bytes_per_node"),
            "spheroid_bytes_over_tensor": median("spheroid", "loopback_bytes_per_node") / tensor_bytes,
            "gloo_bytes_over_tensor": median("gloo", "loopback_bytes_per_node") / tensor_bytes,
            "agree": all(r["agree"] for r in runs["spheroid"]),
            "complete": all(r["complete"] for r in runs["spheroid"])}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--procs", default="2,4,8", help="process counts, comma-separated")
    parser.add_argument("--params", type=int, default=1 << 22, help="float32 values averaged (default 16 MiB)")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=40, help="untimed rounds first, in both systems")
    parser.add_argument("--warmup-interval", type=float, default=0.5, help="seconds between warm-up round starts")
    parser.add_argument("--repeats", type=int, default=1,
                        help="pairs of runs (gloo, spheroid) per process count, in alternating order (even: "
                             "balanced)")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between round starts")
    parser.add_argument("--setup-s", type=float, default=120.0,
                        help="the longest to wait for the processes to start and meet")
    parser.add_argument("--out", type=Path, default=Path("runs/averaging.json"),
                        help="JSON results (default runs/averaging.json; pass bench/results/averaging.json to "
                             "commit one)")
    # one process of a run (internal)
    parser.add_argument("--member", choices=["spheroid", "gloo"], help=argparse.SUPPRESS)
    for name, kind in (("--rank", int), ("--n", int), ("--ports", str),
                       ("--member-out", Path), ("--folder", Path)):
        parser.add_argument(name, type=kind, help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if a.member else logging.INFO,
                        format="%(asctime)s %(name)s: %(message)s")
    if a.member:
        torch.set_num_threads(1)
        tune_allocator()  # as `spheroid node` does (both systems: it is only glibc's heap)
        result = (run_async(spheroid_member(a, a.folder)) if a.member == "spheroid" else gloo_member(a))
        a.member_out.write_text(json.dumps(result))
        return result

    if a.repeats < 1 or a.warmup < 0 or a.warmup_interval <= 0:
        parser.error("need --repeats >= 1, --warmup >= 0 and --warmup-interval > 0")
    rows = []
    for n in [int(x) for x in a.procs.split(",")]:
        for k in range(a.repeats):
            for kind in ("gloo", "spheroid") if k % 2 == 0 else ("spheroid", "gloo"):
                log.info("%s, %d processes, %d values, %d rounds (pair %d of %d)", kind, n, a.params, a.rounds,
                         k + 1, a.repeats)
                rows.append({**run(kind, n, a), "pair": k})
    tensor_bytes = 4 * a.params
    table = [summary(rows, n, tensor_bytes) for n in sorted({r["procs"] for r in rows})]
    result = {**provenance(), "params": a.params, "tensor_bytes": tensor_bytes, "rounds": a.rounds,
              "repeats": a.repeats,
              "warmup": a.warmup, "warmup_interval": a.warmup_interval, "interval": a.interval,
              "table": table, "runs": rows,
              "cpus": os.cpu_count(), "torch": torch.__version__}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=2))
    print(f"\none averaging round of {tensor_bytes / 2**20:.0f} MiB (float32), median of {a.rounds} after "
          f"{a.warmup} warm-up rounds; "
          f"{a.repeats} pair(s) of runs: times and CPU are each system's median over them, the ratio the median of "
          f"the pairs' ratios [their range]; bytes sent per node on loopback, as a multiple of the tensor; "
          f"cpu: seconds of CPU per node per round (user space + kernel)")
    print(f"{'procs':>5} | {'gloo s':>7} | {'spheroid s':>10} | {'ratio':>5} {'[range]':>11} | {'gloo cpu':>19} | "
          f"{'spheroid cpu':>19} | {'gloo x':>6} | {'spheroid x':>10} | replicas agree")

    def cpu(t: dict, kind: str) -> str:
        user, kernel = t[f"{kind}_user_s_per_node"], t[f"{kind}_sys_s_per_node"]
        return f"{t[f'{kind}_cpu_s_per_node']:.3f} ({user:.3f}+{kernel:.3f})"

    for t in table:
        spread = f"[{t['time_ratio_min']:.2f}-{t['time_ratio_max']:.2f}]"
        print(f"{t['procs']:>5} | {t['gloo_round_s']:>7.3f} | {t['spheroid_round_s']:>10.3f} | {t['time_ratio']:>5.2f} "
              f"{spread:>11} | {cpu(t, 'gloo'):>19} | {cpu(t, 'spheroid'):>19} "
              f"| {t['gloo_bytes_over_tensor']:>6.2f} | {t['spheroid_bytes_over_tensor']:>10.2f} | "
              f"{'yes' if t['agree'] and t['complete'] else 'NO'}")
    print(f"\nJSON: {a.out}")
    return result


if __name__ == "__main__":
    main()
