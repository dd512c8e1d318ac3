"""Echo server and client.

    python examples/echo.py                         # both here: a server node and a client node
    python examples/echo.py --listen 13337          # server only (Ctrl-C stops it)
    python examples/echo.py --connect HOST:13337    # client only

The client sends a few messages of growing size (tag messages, a numpy array, a Python object
and an active message), checks that each comes back unchanged, and prints what it did. The
pre-shared key comes from SHARDCX_PSK (both sides must hold the same).
"""

import argparse
import asyncio
import os

import numpy as np

import shardcx

KEY = os.environ.get("SHARDCX_PSK", "echo example pre-shared key")


async def echo(ep: shardcx.Endpoint) -> None:
    """Echoes tag messages (with their tags), objects and active messages until the client
    closes the endpoint (then the receive raises shardcx.Closed, which ends the handler)."""

    async def tags():
        while True:
            tag, data = await ep.recv_tagged(deadline=3600)
            await ep.send(data, tag)

    async def ams():
        while True:
            await ep.am_send(await ep.am_recv(deadline=3600))

    async with asyncio.TaskGroup() as tg:
        tg.create_task(tags())
        tg.create_task(ams())


async def serve(port: int) -> None:
    async with shardcx.Node(psk=KEY) as node:
        listener = await node.create_listener(echo, port=port)
        print(f"echo server listening on port {listener.port}", flush=True)
        await asyncio.Event().wait()


async def client(host: str, port: int) -> None:
    async with shardcx.Node(psk=KEY) as node:
        ep = await node.create_endpoint(host, port, deadline=10)
        for i, size in enumerate([0, 8, 4096, 1 << 20, (16 << 20) - 64]):
            data = os.urandom(size)
            await ep.send(data, tag=i)
            back = bytearray(size)
            assert await ep.recv(back, tag=i) == size and back == data
            print(f"echoed {size} bytes with tag {i}")
        a = np.linspace(0, 1, 1000).reshape(10, 100)
        await ep.send(a, tag=10)
        b = np.empty_like(a)
        await ep.recv(b, tag=10)
        assert (a == b).all()
        print(f"echoed a {a.dtype} array of shape {a.shape}")
        obj = {"hello": ["world", 42, 3.5]}
        await ep.send_obj(obj, tag=11)
        assert await ep.recv_obj(tag=11) == obj
        print(f"echoed the object {obj!r}")
        await ep.am_send(b"an active message")
        assert await ep.am_recv() == b"an active message"
        print("echoed an active message")
        await ep.close()


async def both() -> None:
    async with shardcx.Node(psk=KEY) as server:
        listener = await server.create_listener(echo, port=0, host="127.0.0.1")
        await client("127.0.0.1", listener.port)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--listen", type=int, metavar="PORT", help="run the server only")
    p.add_argument("--connect", metavar="HOST:PORT", help="run the client only")
    args = p.parse_args()
    if args.listen is not None:
        try:
            asyncio.run(serve(args.listen))
        except KeyboardInterrupt:
            pass
    elif args.connect:
        host, port = args.connect.rsplit(":", 1)
        asyncio.run(client(host, int(port)))
    else:
        asyncio.run(both())


if __name__ == "__main__":
    main()
