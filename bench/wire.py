"""Wire benchmark: the node protocol against a raw socket, codec throughput, and codec size ratios.

(a) Moves one float32 tensor (64 MiB by default) to a real `spheroid node` process over 127.0.0.1
    with the node protocol (a chunked tensor stream, then a probe the node answers once it holds
    the whole tensor), and the same bytes over a plain socket (1 MiB writes) to a sink process
    (uvloop, as a node) that reads them into one reused buffer and answers one byte: no framing,
    no codec, no copy. Reports both throughputs and their ratio.
(b) Encode and decode throughput of every codec on a 16 MiB float32 tensor.
(c) Encoded size relative to float32 for every codec, on real block weights and on real weight
    deltas (the change of a block over a few steps of a short training run on WikiText).

Writes JSON (--out; default runs/wire.json: the committed result was written with --out
bench/results/wire.json), with the commit and command that made it.

    python bench/wire.py [--mib 64] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from provenance import provenance

from spheroid.cli import run_async
from spheroid.config import ModelConfig, NodeConfig, RunConfig, TrainConfig
from spheroid.data import load_bytes, random_windows
from spheroid.model import DiffusionBlock, make_codebook
from spheroid.node.client import connect
from spheroid.train import block_loss, make_optimizer, train_step
from spheroid.wire import decode_tensor, encode_tensor
from spheroid.wire.messages import Probe
from spheroid.wire.tensors import COMPRESSIONS, TENSOR_CODECS

log = logging.getLogger("bench.wire")
CODECS = [(c, z) for c in TENSOR_CODECS for z in COMPRESSIONS]  # every registered codec, each way


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sink(asyncio.BufferedProtocol):
    """The baseline receiver at its cheapest, on uvloop as a node runs: the kernel reads into one
    reused 1 MiB buffer and nothing else touches the bytes. The stream is an 8-byte length, then
    that many bytes, answered with one byte; repeated."""

    def __init__(self) -> None:
        self.buffer = bytearray(1 << 20)
        self.header = b""
        self.remaining = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)

    def buffer_updated(self, nbytes: int) -> None:
        at = 0
        while at < nbytes:
            if len(self.header) < 8:  # (a length, possibly split between reads)
                take = min(8 - len(self.header), nbytes - at)
                self.header += bytes(self.buffer[at : at + take])
                at += take
                self.remaining = int.from_bytes(self.header, "big") if len(self.header) == 8 else 0
                continue
            take = min(self.remaining, nbytes - at)
            self.remaining -= take
            at += take
            if self.remaining == 0:
                self.header = b""
                self.transport.write(b"k")


async def sink(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(Sink, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def start_process(args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def transfer(tensor: torch.Tensor, repeats: int) -> dict:
    """(a): best-of-`repeats` seconds to move `tensor` by the node protocol and by a raw socket."""
    node_port, sink_port = free_port(), free_port()
    ident = Path(os.environ.get("TMPDIR", "/tmp")) / f"spheroid-wire-bench-{os.getpid()}.json"
    node = start_process(["-m", "spheroid", "-q", "node", "--listen", f"127.0.0.1:{node_port}", "--identity",
                          str(ident)])
    raw_sink = start_process([__file__, "--sink", str(sink_port)])
    try:
        await wait_port(node_port)
        await wait_port(sink_port)
        payload = tensor.numpy().tobytes()
        view = memoryview(payload)
        raw_times, proto_times = [], []
        reader, writer = await asyncio.open_connection("127.0.0.1", sink_port)
        conn = await connect(f"127.0.0.1:{node_port}", NodeConfig(role="client", timeout=120))
        for _ in range(repeats):
            t0 = time.perf_counter()
            writer.write(len(payload).to_bytes(8, "big"))
            for at in range(0, len(payload), 1 << 20):  # 1 MiB at a time, as the protocol's chunks go
                writer.write(view[at : at + (1 << 20)])
                await writer.drain()
            assert await reader.readexactly(1) == b"k"
            raw_times.append(time.perf_counter() - t0)

            t0 = time.perf_counter()
            stream = await conn.send_tensor(tensor)
            reply = await conn.request(Probe(streams=[stream]), timeout=120)
            proto_times.append(time.perf_counter() - t0)
            assert reply.bytes == len(payload)
        wire_bytes = conn.traffic.totals()["sent"]["wire_bytes"] / repeats
        writer.close()
        await conn.close()
    finally:
        for proc in (node, raw_sink):
            proc.terminate()
            proc.wait(timeout=20)
        for suffix in ("", ".lock", ".peers.json"):
            Path(f"{ident}{suffix}").unlink(missing_ok=True)
    mib = len(payload) / 2**20
    raw_s, proto_s = min(raw_times), min(proto_times)
    return {"mib": mib, "raw_socket_s": raw_s, "protocol_s": proto_s, "raw_socket_mib_s": mib / raw_s,
            "protocol_mib_s": mib / proto_s, "ratio": raw_s / proto_s, "protocol_wire_bytes": wire_bytes,
            "payload_bytes": len(payload), "raw_times": raw_times, "protocol_times": proto_times}


def throughput(tensor: torch.Tensor, repeats: int) -> list[dict]:
    """(b): MiB/s of float32 input through encode and back through decode, per codec."""
    mib = tensor.numel() * 4 / 2**20
    rows = []
    for codec, compression in CODECS:
        enc, dec = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            payload = encode_tensor(tensor, codec, compression)
            enc.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            decode_tensor(payload)
            dec.append(time.perf_counter() - t0)
        rows.append({"codec": codec, "compression": compression, "encode_mib_s": mib / min(enc),
                     "decode_mib_s": mib / min(dec), "size_ratio": len(payload) / (tensor.numel() * 4)})
    return rows


def real_weights(data_dir: str | None, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's flattened weights after a short training run, and its change over the last (up to 10) steps."""
    if steps < 1:
        raise ValueError(f"--train-steps must be at least 1, got {steps}")
    cfg = RunConfig(model=ModelConfig(d_model=128, n_heads=4, layers_per_block=2, context=128),
                    train=TrainConfig(steps=steps, batch=16, warmup=10))
    torch.manual_seed(0)
    block = DiffusionBlock(cfg.model, cfg.noise.sigma_data)
    loss = block_loss(block, cfg, 1, make_codebook(cfg.model))
    opt, gen = make_optimizer(block, cfg), torch.Generator().manual_seed(0)
    data = load_bytes(data_dir, "train")
    before = None
    for step in range(steps):
        if step == max(0, steps - 10):
            before = torch.nn.utils.parameters_to_vector(block.parameters()).detach().clone()
        train_step(block, loss, opt, random_windows(data, cfg.train.batch, cfg.model.context + 1, gen), gen, 1.0)
    after = torch.nn.utils.parameters_to_vector(block.parameters()).detach().clone()
    return after, after - before


def sizes(name: str, tensor: torch.Tensor) -> list[dict]:
    """(c): encoded bytes over float32 bytes, per codec."""
    return [{"tensor": name, "codec": c, "compression": z,
             "size_ratio": len(encode_tensor(tensor, c, z)) / (tensor.numel() * 4)} for c, z in CODECS]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=64, help="size of the transferred float32 tensor")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--train-steps", type=int, default=40, help="steps of the run that makes real deltas")
    parser.add_argument("--data", default=os.environ.get("SPHEROID_DATA"))
    parser.add_argument("--out", type=Path, default=Path("runs/wire.json"),
                        help="JSON results (default runs/wire.json; pass bench/results/wire.json to commit one)")
    parser.add_argument("--sink", type=int, help=argparse.SUPPRESS)  # internal: run the raw-socket sink
    args = parser.parse_args(argv)
    if args.sink:
        run_async(sink(args.sink))
        return {}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    tensor = torch.randn(args.mib * 2**20 // 4, generator=torch.Generator().manual_seed(0))
    log.info("(a) moving %d MiB over the node protocol and a raw socket, best of %d", args.mib, args.repeats)
    moved = run_async(transfer(tensor, args.repeats))
    log.info("(b) codec throughput on 16 MiB")
    speed = throughput(tensor[: 4 * 2**20], args.repeats)
    log.info("(c) size ratios on real block weights and deltas (%d training steps)", args.train_steps)
    weights, delta = real_weights(args.data, args.train_steps)
    ratios = sizes("block weights", weights) + sizes("weight delta (10 steps)", delta)
    result = {**provenance(), "transfer": moved, "throughput": speed, "sizes": ratios, "torch": torch.__version__,
              "weights_elements": weights.numel()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print_tables(result)
    print(f"\nJSON: {args.out}")
    return result


def print_tables(r: dict) -> None:
    m = r["transfer"]
    print(f"\n(a) {m['mib']:.0f} MiB float32 over 127.0.0.1")
    print(f"  raw socket          {m['raw_socket_s']:.3f} s  {m['raw_socket_mib_s']:8.1f} MiB/s")
    print(f"  node protocol       {m['protocol_s']:.3f} s  {m['protocol_mib_s']:8.1f} MiB/s  "
          f"(ratio {m['ratio']:.2f}; {m['protocol_wire_bytes'] / m['payload_bytes'] - 1:+.4%} bytes of framing)")
    print("\n(b) codec          encode MiB/s  decode MiB/s  size / fp32 (random normal)")
    for row in r["throughput"]:
        print(f"  {row['codec']:>4}+{row['compression']:<5}  {row['encode_mib_s']:12.1f}  {row['decode_mib_s']:12.1f}"
              f"  {row['size_ratio']:10.3f}")
    print("\n(c) size / fp32      " + "  ".join(f"{c}+{z}" for c, z in CODECS))
    for name in dict.fromkeys(row["tensor"] for row in r["sizes"]):
        cells = [row["size_ratio"] for row in r["sizes"] if row["tensor"] == name]
        print(f"  {name:<24}" + "  ".join(f"{v:>{len(c) + len(z) + 1}.3f}" for v, (c, z) in zip(cells, CODECS,
                                                                                            strict=True)))


if __name__ == "__main__":
    main()
