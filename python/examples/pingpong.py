"""Ping-pong benchmark: 8-byte asyncio round trips (p50/p99) and a one-way message rate.

    python examples/pingpong.py                      # server in a child process, client here
    python examples/pingpong.py --listen 13337       # server only
    python examples/pingpong.py --connect HOST:13337 # client only

The round trip is ``await ep.send(8 bytes); await ep.recv(8 bytes)`` against a server that
echoes each message. The rate test sends ``--rate-msgs`` 8-byte messages in windows of
``--window`` concurrent sends; the server receives each window with as many concurrent
receives and acknowledges it, and the next window starts on the acknowledgement (so that the
receiver's queue of unexpected messages stays bounded); the rate is messages over the time. Prints one JSON line with the figures when ``--json`` is given.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import shardcx

KEY = os.environ.get("SHARDCX_PSK", "pingpong example key").encode()
SIZE = 8
TAG_PING, TAG_RATE, TAG_DONE = 1, 2, 3


async def serve(port: int, shards: int, transports: str, ready=None) -> None:
    done = asyncio.get_running_loop().create_future()

    async def handler(ep):
        buf = bytearray(SIZE)
        try:
            while True:
                # One receive for every kind: pings are echoed, rate messages counted.
                tag, data = await ep.recv_tagged(deadline=3600)
                if tag == TAG_PING:
                    await ep.send(data, TAG_PING)
                elif tag == TAG_RATE:
                    n, window = int.from_bytes(data[:8], "little"), int.from_bytes(data[8:], "little")
                    bufs = [bytearray(SIZE) for _ in range(window)]
                    got = 0
                    while got < n:
                        k = min(window, n - got)
                        await asyncio.gather(*(ep.recv(bufs[i], TAG_RATE, deadline=60) for i in range(k)))
                        got += k
                        await ep.send(buf, TAG_DONE)
                else:
                    break
        finally:
            if not done.done():
                done.set_result(None)

    async with shardcx.Node(shards=shards, psk=KEY, transports=transports) as node:
        lst = await node.create_listener(handler, port=port)
        print(f"listening {lst.port}", flush=True)
        await done


async def client(host: str, port: int, args) -> dict:
    async with shardcx.Node(shards=args.shards, psk=KEY, transports=args.transports) as node:
        ep = await node.create_endpoint(host, port, deadline=10)
        msg = bytes(SIZE)
        buf = bytearray(SIZE)
        lat = []
        for i in range(args.warmup + args.iters):
            t0 = time.perf_counter_ns()
            await ep.send(msg, TAG_PING)
            await ep.recv(buf, TAG_PING)
            if i >= args.warmup:
                lat.append(time.perf_counter_ns() - t0)
        lat.sort()
        n = args.rate_msgs
        await ep.send(n.to_bytes(8, "little") + args.window.to_bytes(8, "little"), TAG_RATE)
        t0 = time.perf_counter()
        sent = 0
        while sent < n:
            k = min(args.window, n - sent)
            await asyncio.gather(*(ep.send(msg, TAG_RATE) for _ in range(k)))
            sent += k
            await ep.recv(buf, TAG_DONE, deadline=60)
        rate = n / (time.perf_counter() - t0)
        await ep.send(b"", 0)  # ends the server's handler
        await ep.close()
    return {
        "lib": "shardcx",
        "rtt_p50_us": lat[len(lat) // 2] / 1e3,
        "rtt_p99_us": lat[int(len(lat) * 0.99)] / 1e3,
        "rtt_mean_us": statistics.fmean(lat) / 1e3,
        "rate_msgs_per_s": rate,
        "iters": args.iters,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", type=int, metavar="PORT", help="run the server only")
    p.add_argument("--connect", metavar="HOST:PORT", help="run the client only")
    p.add_argument("--iters", type=int, default=10000)
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--rate-msgs", type=int, default=50000)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--transports", default="tcp")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args()
    if args.listen is not None:
        asyncio.run(serve(args.listen, args.shards, args.transports))
        return
    if args.connect:
        host, port = args.connect.rsplit(":", 1)
        res = asyncio.run(client(host, int(port), args))
    else:
        srv = subprocess.Popen(
            [sys.executable, __file__, "--listen", "0", "--shards", str(args.shards),
             "--transports", args.transports],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            line = srv.stdout.readline()
            if not line.startswith("listening "):
                sys.exit(f"server did not start: {line!r}")
            res = asyncio.run(client("127.0.0.1", int(line.split()[1]), args))
            srv.wait(timeout=30)
        finally:
            if srv.poll() is None:
                srv.kill()
    if args.json:
        print(json.dumps(res))
    else:
        print(
            f"8-byte round trip over {args.transports}: p50 {res['rtt_p50_us']:.1f} us, "
            f"p99 {res['rtt_p99_us']:.1f} us ({res['iters']} iterations); "
            f"message rate {res['rate_msgs_per_s'] / 1e3:.1f} k/s (window {args.window})"
        )


if __name__ == "__main__":
    main()
