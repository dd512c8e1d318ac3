"""Endpoints between two nodes of this process over tcp on loopback."""

import asyncio
import os
import pickle
import socket
import sys
import time

import numpy as np
import pytest

import shardcx
from conftest import KEY, echo_handler

SIZES = [0, 1, 8, 100, 4095, 4096, 65536, 1 << 20, (4 << 20) + 3, 16 << 20]


def pattern(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


async def test_echo_sizes_with_content_checks(server, client):
    async with asyncio.timeout(60):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        for i, n in enumerate(SIZES):
            data = pattern(n, i)
            await ep.send(data, tag=i)
            out = bytearray(n + 16)
            got = await ep.recv(out, tag=i, deadline=20)
            assert got == n
            assert out[:n] == data, f"echo of {n} bytes differs"
            assert out[n:] == bytes(16), "recv wrote past the message"
        await ep.close()
        assert ep.closed()


async def test_numpy_arrays(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        for dtype, shape in [(np.float64, (3, 1000)), (np.int32, (257,)), (np.uint8, (0,))]:
            a = (np.arange(np.prod(shape)) * 3 + 1).astype(dtype).reshape(shape)
            await ep.send(a)
            b = np.zeros(shape, dtype)
            assert await ep.recv(b, deadline=10) == a.nbytes
            np.testing.assert_array_equal(a, b)
        # A non-contiguous view is refused before anything is sent.
        with pytest.raises(ValueError):
            await ep.send(np.zeros((4, 4))[:, 1])
        with pytest.raises(TypeError):
            await ep.recv(b"read-only")


async def test_objects(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        objs = [None, 42, "héllo", {"a": [1, 2.5, (3, b"x")]}, np.arange(10), list(range(10000))]
        for o in objs:
            await ep.send_obj(o)
            back = await ep.recv_obj(deadline=10)
            if isinstance(o, np.ndarray):
                np.testing.assert_array_equal(back, o)
            else:
                assert back == o


async def test_active_messages(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        msgs = [pattern(n, n) for n in (0, 5, 8192, 1 << 20)]
        for m in msgs:
            await ep.am_send(m)
        for m in msgs:
            assert await ep.am_recv(deadline=10) == m


async def test_tags_and_masks():
    """Messages wait for the receive whose tag matches; a mask widens the match."""
    got = asyncio.get_running_loop().create_future()

    async def handler(ep):
        # Take tag 0x22 first, then whatever came earliest under mask 0xF0 (0x13 < 0x22).
        a = await ep.recv_tagged(0x22, shardcx.MAX_TAG, deadline=10)
        b = await ep.recv_tagged(0x10, 0xF0, deadline=10)
        c = await ep.recv_tagged(deadline=10)
        got.set_result([a, b, c])

    async with asyncio.timeout(30):
        async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
            lst = await server.create_listener(handler, host="127.0.0.1")
            ep = await client.create_endpoint("127.0.0.1", lst.port)
            for t in (0x31, 0x13, 0x22):
                await ep.send(bytes([t]), tag=t)
            assert await got == [(0x22, b"\x22"), (0x13, b"\x13"), (0x31, b"\x31")]
            with pytest.raises(ValueError):
                await ep.send(b"", tag=shardcx.MAX_TAG + 1)


async def test_many_concurrent_endpoints():
    """64 endpoints between two 2-shard nodes, all exchanging at once."""
    async with asyncio.timeout(60):
        async with shardcx.Node(shards=2, psk=KEY) as server, shardcx.Node(
            shards=2, psk=KEY
        ) as client:
            lst = await server.create_listener(echo_handler, host="127.0.0.1")
            eps = await asyncio.gather(
                *(client.create_endpoint("127.0.0.1", lst.port) for _ in range(64))
            )
            assert len({ep._ep for ep in eps}) == 64

            async def talk(i, ep):
                for j in range(20):
                    data = f"{i}:{j}".encode() * (1 + j)
                    await ep.send(data, tag=j)
                    out = bytearray(len(data))
                    await ep.recv(out, tag=j, deadline=20)
                    assert out == data
                await ep.close()

            await asyncio.gather(*(talk(i, ep) for i, ep in enumerate(eps)))


async def test_cancelled_recv_takes_nothing_and_writes_nothing(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        canary = bytearray(b"\xaa" * 64)
        task = asyncio.create_task(ep.recv(canary, tag=7, deadline=20))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not ep._pending and not client._ops
        # The echo of this message must go to the next receive, not the cancelled one.
        await ep.send(b"after the cancel", tag=7)
        out = bytearray(16)
        assert await ep.recv(out, tag=7, deadline=10) == 16
        assert out == b"after the cancel"
        await asyncio.sleep(0.1)
        assert canary == b"\xaa" * 64
        # Cancelled in the middle of a large echo: the endpoint keeps working.
        big = pattern(8 << 20, 1)
        await ep.send(big, tag=8)
        t = asyncio.create_task(ep.recv(bytearray(len(big)), tag=8, deadline=20))
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await ep.send(b"still here", tag=9)
        assert await ep.recv_tagged(9, shardcx.MAX_TAG, deadline=10) == (9, b"still here")


async def test_deadlines(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        for call in (
            lambda: ep.recv(bytearray(8), tag=99, deadline=0.2),
            lambda: ep.recv_obj(tag=98, deadline=0.2),
            lambda: ep.am_recv(deadline=0.2),
        ):
            start = time.monotonic()
            with pytest.raises(shardcx.Timeout) as e:
                await call()
            took = time.monotonic() - start
            assert 0.15 < took < 2.0, took
            assert isinstance(e.value, TimeoutError)
        # The endpoint still works after timeouts.
        await ep.send(b"ok", tag=99)
        assert await ep.recv_tagged(99, shardcx.MAX_TAG, deadline=10) == (99, b"ok")
        with pytest.raises(ValueError):
            await ep.recv(bytearray(1), deadline=-1)


async def test_too_large(server, client):
    async with asyncio.timeout(30):
        ep = await client.create_endpoint("127.0.0.1", server.port)
        await ep.send(b"x" * 100, tag=1)
        with pytest.raises(shardcx.TooLarge):
            await ep.recv(bytearray(10), tag=1, deadline=10)
        # Over the node's size limit: refused by the sender.
        small = shardcx.Node(psk=KEY, max_message_size=1 << 20)
        try:
            ep2 = await small.create_endpoint("127.0.0.1", server.port)
            with pytest.raises(shardcx.TooLarge):
                await ep2.send(bytes(2 << 20))
        finally:
            await small.close()


async def test_close_from_either_side():
    """The peer's pending calls fail with Closed; this side's with Cancelled; later calls with
    Closed."""
    server_saw = asyncio.get_running_loop().create_future()

    async def handler(ep):
        try:
            await ep.recv(bytearray(8), deadline=20)
        except shardcx.Error as e:
            server_saw.set_result(e)

    async with asyncio.timeout(30):
        async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
            lst = await server.create_listener(handler, host="127.0.0.1")
            ep = await client.create_endpoint("127.0.0.1", lst.port)
            pending = asyncio.create_task(ep.recv(bytearray(8), deadline=20))
            await asyncio.sleep(0.1)
            await ep.close()
            with pytest.raises(shardcx.Cancelled):
                await pending
            with pytest.raises(shardcx.Closed):
                await ep.send(b"late")
            assert isinstance(await server_saw, shardcx.Closed)
            await ep.close()  # idempotent


async def test_wrong_key_is_refused(server):
    async with asyncio.timeout(30):
        async with shardcx.Node(psk=b"not the server's key at all") as other:
            start = time.monotonic()
            with pytest.raises(shardcx.AuthFailed):
                await other.create_endpoint("127.0.0.1", server.port, deadline=10)
            assert time.monotonic() - start < 5
        async with shardcx.Node(psk=None) as keyless:
            with pytest.raises(shardcx.AuthFailed):
                await keyless.create_endpoint("127.0.0.1", server.port, deadline=10)


async def test_nothing_listening_or_no_listener(client):
    async with asyncio.timeout(30):
        with pytest.raises((shardcx.Unreachable, shardcx.Timeout)):
            await client.create_endpoint("127.0.0.1", 1, deadline=3)
        # A node whose listener was closed refuses new endpoints.
        async with shardcx.Node(psk=KEY) as server:
            lst = await server.create_listener(echo_handler, host="127.0.0.1")
            lst.close()
            assert lst.closed()
            with pytest.raises(shardcx.Unreachable):
                await client.create_endpoint("127.0.0.1", lst.port, deadline=5)


async def test_server_node_stops_with_calls_pending(client):
    """Every pending call raises when the server node stops."""
    server = shardcx.Node(psk=KEY)

    async def handler(ep):
        await asyncio.sleep(3600)

    async with asyncio.timeout(40):
        lst = await server.create_listener(handler, host="127.0.0.1")
        eps = [await client.create_endpoint("127.0.0.1", lst.port) for _ in range(3)]
        pending = [asyncio.create_task(ep.recv(bytearray(8), deadline=30)) for ep in eps]
        pending += [asyncio.create_task(ep.am_recv(deadline=30)) for ep in eps]
        pending.append(asyncio.create_task(eps[0].recv_obj(deadline=30)))
        await asyncio.sleep(0.2)
        start = time.monotonic()
        await server.close()
        for p in pending:
            with pytest.raises((shardcx.Closed, shardcx.ConnectionLost)):
                await p
        assert time.monotonic() - start < 10
        with pytest.raises((shardcx.Closed, shardcx.ConnectionLost)):
            await eps[1].send(b"x")


async def test_server_process_killed_with_calls_pending(client, tmp_path):
    """A server process that dies (SIGKILL): the pending calls raise, within the heartbeats'
    bound."""
    script = tmp_path / "server.py"
    script.write_text(
        "import asyncio, shardcx, sys\n"
        "async def main():\n"
        f"    node = shardcx.Node(psk={KEY!r})\n"
        "    async def handler(ep):\n"
        "        await asyncio.sleep(3600)\n"
        "    lst = await node.create_listener(handler, host='127.0.0.1')\n"
        "    print(lst.port, flush=True)\n"
        "    await asyncio.sleep(120)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(script), stdout=asyncio.subprocess.PIPE
    )
    try:
        async with asyncio.timeout(60):
            port = int((await proc.stdout.readline()).decode())
            ep = await client.create_endpoint("127.0.0.1", port, deadline=10)
            pending = [
                asyncio.create_task(ep.recv(bytearray(8), deadline=50)),
                asyncio.create_task(ep.am_recv(deadline=50)),
            ]
            await asyncio.sleep(0.2)
            proc.kill()
            await proc.wait()
            start = time.monotonic()
            for p in pending:
                with pytest.raises((shardcx.ConnectionLost, shardcx.Closed)):
                    await p
            assert time.monotonic() - start < 30
            # Sends are handed off; one that fails ends the endpoint, so a later call raises.
            with pytest.raises((shardcx.ConnectionLost, shardcx.Closed)):
                for _ in range(500):
                    await ep.send(b"into the void")
                    await asyncio.sleep(0.01)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_module_docstring_example_runs():
    """The example in the package's docstring is code that works."""
    doc = shardcx.__doc__
    block = doc.split("::", 1)[1].split("\n\nA :class:", 1)[0]
    code = "\n".join(line[4:] for line in block.splitlines())
    body = "async def _example():\n" + "\n".join("    " + l for l in code.splitlines())
    body += "\n    return out\n"
    scope = {}
    exec(compile(body, "<shardcx docstring>", "exec"), scope)
    async with asyncio.timeout(30):
        assert await scope["_example"]() == b"hello"


def test_public_api_is_documented():
    for name in shardcx.__all__:
        obj = getattr(shardcx, name)
        if callable(obj):
            assert obj.__doc__, f"{name} has no docstring"
    for cls in (shardcx.Node, shardcx.Endpoint, shardcx.Listener, shardcx.Peer):
        for attr, member in vars(cls).items():
            if not attr.startswith("_") and callable(member):
                assert member.__doc__, f"{cls.__name__}.{attr} has no docstring"


async def test_sends_in_a_tight_loop_are_bounded_and_ordered():
    """Sends return without waiting for the shard, but at most SEND_WINDOW are in flight per
    endpoint; the peer receives every one, in order."""
    n = 3000
    done = asyncio.get_running_loop().create_future()

    async def handler(ep):
        buf = bytearray(8)
        for i in range(n):
            await ep.recv(buf, deadline=20)
            if int.from_bytes(buf, "little") != i:
                done.set_exception(AssertionError(f"message {i} was {bytes(buf)!r}"))
                return
        done.set_result(n)

    async with asyncio.timeout(60):
        async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
            lst = await server.create_listener(handler, host="127.0.0.1")
            ep = await client.create_endpoint("127.0.0.1", lst.port)
            most = 0
            for i in range(n):
                await ep.send(i.to_bytes(8, "little"))
                most = max(most, sum(not f.done() for f in ep._sends))
            assert most <= shardcx.SEND_WINDOW + 1
            assert await done == n


def test_polling_event_loop_runs_endpoints():
    """An event loop from polling_loop_factory drives nodes like the default one."""

    async def main():
        async with asyncio.timeout(30):
            async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
                lst = await server.create_listener(echo_handler, host="127.0.0.1")
                ep = await client.create_endpoint("127.0.0.1", lst.port)
                for i in range(100):
                    await ep.send(i.to_bytes(4, "little"), tag=3)
                    assert await ep.recv_tagged(3, shardcx.MAX_TAG, deadline=10) == (
                        3,
                        i.to_bytes(4, "little"),
                    )
                return type(asyncio.get_running_loop()._selector)

    with asyncio.Runner(loop_factory=shardcx.polling_loop_factory(50e-6)) as runner:
        assert runner.run(main()) is shardcx.PollingSelector


async def test_messages_sent_before_a_close_are_received_after_it():
    """The peer's close reaches this side before its receives are posted: the messages sent
    before the close still come, then receives raise Closed, and sends at once."""
    result = asyncio.get_running_loop().create_future()

    async def handler(ep):
        await asyncio.sleep(0.3)  # the client sends, closes, and its close arrives meanwhile
        try:
            got = [await ep.recv_tagged(deadline=5) for _ in range(3)]
        except shardcx.Error as e:
            result.set_exception(AssertionError(f"a message sent before the close was lost: {e!r}"))
            return
        try:
            await ep.recv_tagged(deadline=5)
        except shardcx.Closed:
            pass
        else:
            result.set_exception(AssertionError("a fourth message came"))
            return
        try:
            await ep.send(b"too late")
        except shardcx.Closed:
            result.set_result(got)

    async with asyncio.timeout(30):
        async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
            lst = await server.create_listener(handler, host="127.0.0.1")
            ep = await client.create_endpoint("127.0.0.1", lst.port)
            for i in range(3):
                await ep.send(bytes([i]) * 1000, tag=i)
            await ep.close()
            assert await result == [(i, bytes([i]) * 1000) for i in range(3)]


async def test_a_node_that_cannot_start_raises():
    async with asyncio.timeout(30):
        with pytest.raises(shardcx.Error, match="too short"):
            await shardcx.Node(psk=b"short").create_listener(echo_handler)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            s.listen()
            node = shardcx.Node(psk=KEY)
            with pytest.raises(shardcx.Error, match="in use"):
                await node.create_listener(echo_handler, s.getsockname()[1], host="127.0.0.1")
            assert node.stopped()
            # Later calls raise the start's error again.
            with pytest.raises(shardcx.Error, match="in use"):
                await node.create_endpoint("127.0.0.1", s.getsockname()[1])


async def test_a_failing_handler_closes_its_endpoint():
    """A handler that raises closes its endpoint (the peer's calls raise Closed, not Timeout)
    and reports the error to the event loop's exception handler."""
    loop = asyncio.get_running_loop()
    reported = loop.create_future()
    loop.set_exception_handler(lambda _loop, ctx: reported.set_result(ctx))

    async def handler(ep):
        raise ValueError("handler bug")

    try:
        async with asyncio.timeout(30):
            async with shardcx.Node(psk=KEY) as server, shardcx.Node(psk=KEY) as client:
                lst = await server.create_listener(handler, host="127.0.0.1")
                ep = await client.create_endpoint("127.0.0.1", lst.port)
                start = time.monotonic()
                with pytest.raises(shardcx.Closed):
                    await ep.recv(bytearray(8), deadline=20)
                assert time.monotonic() - start < 5
                ctx = await reported
                assert isinstance(ctx["exception"], ValueError)
    finally:
        loop.set_exception_handler(None)
