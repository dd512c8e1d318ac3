"""Ping-pong benchmark: 8-byte asyncio round trips (p50/p99) and a message rate.

    python examples/pingpong.py                      # server in a child process, client here
    python examples/pingpong.py --listen 13337       # server only
    python examples/pingpong.py --connect HOST:13337 # client only
    python examples/pingpong.py --lib ucxx           # the same with UCXX (scripts/compare-ucxx)

The round trip is ``await ep.send(8 bytes); await ep.recv(8 bytes)`` against a server that
receives and sends back each message. The rate test sends ``--rate-msgs`` 8-byte messages in
windows of ``--window`` concurrent sends; the server receives each window with as many
concurrent receives and acknowledges it (8 bytes), and the next window starts on the
acknowledgement, so that no receiver queues messages without bound; the rate is messages over
the time. Only untagged ``send``/``recv`` with fixed sizes are used, so that the same code
runs on shardcx and on UCXX. ``--json`` prints the figures as one JSON line.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

SIZE = 8
HEADER = 24  # warmup + iters, rate messages, window: three little-endian u64


class Lib:
    """The few calls the benchmark makes, on shardcx or on UCXX."""

    def __init__(self, name: str, args) -> None:
        self.name = name
        self.args = args
        self.node = None

    async def start(self) -> None:
        if self.name == "shardcx":
            import shardcx

            key = os.environ.get("SHARDCX_PSK", "pingpong example key")
            self.node = shardcx.Node(shards=1, psk=key, transports=self.args.transports)
        else:
            import ucxx

            ucxx.init(progress_mode=self.args.progress_mode)
            self.node = ucxx

    async def listen(self, handler, port: int):
        if self.name == "shardcx":
            return await self.node.create_listener(handler, port)
        return self.node.create_listener(handler, port)  # UCXX's is not a coroutine

    async def connect(self, host: str, port: int):
        if self.name == "shardcx":
            return await self.node.create_endpoint(host, port, deadline=10)
        return await self.node.create_endpoint(host, port)

    async def stop(self) -> None:
        if self.name == "shardcx":
            await self.node.close()


async def serve(lib: Lib, port: int) -> None:
    await lib.start()
    done = asyncio.get_running_loop().create_future()

    async def handler(ep):
        try:
            hdr = bytearray(HEADER)
            await ep.recv(hdr)
            pings = int.from_bytes(hdr[0:8], "little")
            n = int.from_bytes(hdr[8:16], "little")
            window = int.from_bytes(hdr[16:24], "little")
            buf = bytearray(SIZE)
            for _ in range(pings):
                await ep.recv(buf)
                await ep.send(buf)
            bufs = [bytearray(SIZE) for _ in range(window)]
            got = 0
            while got < n:
                k = min(window, n - got)
                await asyncio.gather(*(ep.recv(bufs[i]) for i in range(k)))
                got += k
                await ep.send(buf)
            await ep.close()
        finally:
            if not done.done():
                done.set_result(None)

    listener = await lib.listen(handler, port)
    print(f"listening {listener.port}", flush=True)
    await done
    await lib.stop()


async def client(lib: Lib, host: str, port: int) -> dict:
    args = lib.args
    await lib.start()
    ep = await lib.connect(host, port)
    pings = args.warmup + args.iters
    hdr = b"".join(v.to_bytes(8, "little") for v in (pings, args.rate_msgs, args.window))
    await ep.send(hdr)
    msg = bytearray(SIZE)
    buf = bytearray(SIZE)
    lat = []
    for i in range(pings):
        t0 = time.perf_counter_ns()
        await ep.send(msg)
        await ep.recv(buf)
        if i >= args.warmup:
            lat.append(time.perf_counter_ns() - t0)
    lat.sort()
    n = args.rate_msgs
    t0 = time.perf_counter()
    sent = 0
    while sent < n:
        k = min(args.window, n - sent)
        await asyncio.gather(*(ep.send(msg) for _ in range(k)))
        sent += k
        await ep.recv(buf)
    rate = n / (time.perf_counter() - t0)
    await ep.close()
    await lib.stop()
    return {
        "lib": lib.name if lib.name == "shardcx" else f"ucxx-{args.progress_mode}",
        "transports": args.transports,
        "rtt_p50_us": lat[len(lat) // 2] / 1e3,
        "rtt_p99_us": lat[int(len(lat) * 0.99)] / 1e3,
        "rtt_mean_us": statistics.fmean(lat) / 1e3,
        "rate_msgs_per_s": rate,
        "iters": args.iters,
        "window": args.window,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", type=int, metavar="PORT", help="run the server only")
    p.add_argument("--connect", metavar="HOST:PORT", help="run the client only")
    p.add_argument("--lib", choices=["shardcx", "ucxx"], default="shardcx")
    p.add_argument("--progress-mode", default="polling", help="UCXX's progress mode")
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--rate-msgs", type=int, default=50000)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--transports", default="tcp", help="shardcx's UCX transports")
    p.add_argument(
        "--poll", type=float, default=0.0, metavar="SECONDS",
        help="shardcx: event loops poll this long before sleeping (shardcx.polling_loop_factory)",
    )
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args()
    lib = Lib(args.lib, args)

    def run(coro):
        if args.lib == "shardcx" and args.poll > 0:
            import shardcx

            with asyncio.Runner(loop_factory=shardcx.polling_loop_factory(args.poll)) as r:
                return r.run(coro)
        return asyncio.run(coro)

    if args.listen is not None:
        run(serve(lib, args.listen))
        return
    if args.connect:
        host, port = args.connect.rsplit(":", 1)
        res = run(client(lib, host, int(port)))
    else:
        srv = subprocess.Popen(
            [sys.executable, __file__, "--listen", "0", "--lib", args.lib,
             "--progress-mode", args.progress_mode, "--transports", args.transports,
             "--poll", str(args.poll)],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            # UCX may print warnings first.
            for _ in range(100):
                line = srv.stdout.readline()
                if not line or line.startswith("listening "):
                    break
            if not line.startswith("listening "):
                sys.exit(f"server did not start: {line!r}")
            res = run(client(lib, "127.0.0.1", int(line.split()[1])))
            srv.wait(timeout=30)
        finally:
            if srv.poll() is None:
                srv.kill()
                srv.wait()
    if args.json:
        print(json.dumps(res), flush=True)
    else:
        print(
            f"{res['lib']}: 8-byte round trip p50 {res['rtt_p50_us']:.1f} us, "
            f"p99 {res['rtt_p99_us']:.1f} us ({res['iters']} iterations); "
            f"message rate {res['rate_msgs_per_s'] / 1e3:.1f} k/s (window {args.window})"
        )


if __name__ == "__main__":
    main()
