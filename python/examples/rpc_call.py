"""Calls a Rust RPC function from Python, by name.

    python examples/rpc_call.py                        # starts `shardcx node` here, calls it
    python examples/rpc_call.py --connect HOST:PORT    # a running `shardcx node` (or any node
                                                       # serving shardcx.bench.echo)

It connects to the node (no listener or endpoint needed on that side), lists the functions the
node serves (its discovery), calls `shardcx.bench.echo` (declared in Rust as
`Vec<u8> => Vec<u8>`) with payloads of growing size and checks each reply, then times
sequential 8-byte calls and prints the percentiles. The pre-shared key comes from SHARDCX_PSK
(both sides must hold the same); the `shardcx` binary from SHARDCX_BIN or the release build.
"""

import argparse
import asyncio
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import shardcx

KEY = os.environ.get("SHARDCX_PSK", "rpc_call example pre-shared key")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def start_node() -> tuple[subprocess.Popen, int]:
    """A `shardcx node` on loopback (2 shards, tcp), stopped when our end of its stdin closes."""
    target = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    binary = os.environ.get("SHARDCX_BIN", str(target / "release" / "shardcx"))
    keyfile = pathlib.Path(tempfile.mkdtemp()) / "psk"
    keyfile.write_text(KEY)
    proc = subprocess.Popen(
        [binary, "node", "--listen", "127.0.0.1:0", "--shards", "2", "--transport", "tcp",
         "--psk-file", str(keyfile), "--stop-on-stdin-eof"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("listening "):
        proc.kill()
        sys.exit(f"rpc_call: {binary} node did not start ({line!r})")
    return proc, int(line.split()[1].rsplit(":", 1)[1])


async def main(args: argparse.Namespace) -> None:
    proc = None
    if args.connect:
        host, port = args.connect.rsplit(":", 1)
        port = int(port)
    else:
        proc, port = start_node()
        host = "127.0.0.1"
    try:
        async with shardcx.Node(shards=1, psk=KEY) as node:
            peer = await node.connect(host, port, deadline=10)
            for f in await peer.functions():
                print(f"serves {f.name} (id {f.id:#x}, v{f.version})"
                      + (", callable from Python" if f.takes_bytes else ""))
            for size in (0, 8, 4096, 1 << 20):
                data = os.urandom(size)
                assert await peer.call("shardcx.bench.echo", data) == data
                print(f"echoed {size} bytes")
            rtts = []
            for _ in range(args.iters):
                t = time.perf_counter()
                await peer.call("shardcx.bench.echo", b"12345678")
                rtts.append((time.perf_counter() - t) * 1e6)
            rtts.sort()
            p = lambda q: rtts[min(len(rtts) - 1, int(q * len(rtts)))]  # noqa: E731
            print(f"{args.iters} calls of 8 bytes: p50 {p(0.5):.0f} us, p99 {p(0.99):.0f} us, "
                  f"mean {statistics.fmean(rtts):.0f} us")
    finally:
        if proc is not None:
            proc.stdin.close()
            proc.wait(timeout=20)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--connect", metavar="HOST:PORT")
    ap.add_argument("--iters", type=int, default=1000)
    asyncio.run(main(ap.parse_args()))
