"""Calling Rust RPC functions from Python: a `shardcx node` process (the `shardcx` binary,
built by scripts/test-python) serves `shardcx.bench.echo` (bytes => bytes) and
`shardcx.bench.sink` (bytes => u64), plus the built-in discovery functions."""

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import pytest_asyncio

import shardcx

from conftest import KEY

ROOT = Path(__file__).resolve().parents[2]


def shardcx_bin() -> Path:
    """The `shardcx` binary: SHARDCX_BIN, else the release build of the target directory."""
    if "SHARDCX_BIN" in os.environ:
        return Path(os.environ["SHARDCX_BIN"])
    target = Path(os.environ.get("CARGO_TARGET_DIR", ROOT / "target"))
    return target / "release" / "shardcx"


class RustNode:
    """A `shardcx node` process on loopback (tcp), stopped when its stdin closes."""

    def __init__(self, tmp: Path, shards: int = 2, key: bytes = KEY) -> None:
        binary = shardcx_bin()
        if not binary.exists():
            pytest.fail(f"{binary} is missing: run scripts/test-python (it builds it)")
        keyfile = tmp / "psk"
        keyfile.write_bytes(key)
        self.proc = subprocess.Popen(
            [str(binary), "node", "--listen", "127.0.0.1:0", "--shards", str(shards),
             "--transport", "tcp", "--psk-file", str(keyfile), "--stop-on-stdin-eof"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        line = self.proc.stdout.readline()
        if not line.startswith("listening "):
            self.proc.kill()
            pytest.fail(f"shardcx node did not start: {line!r} {self.proc.stderr.read()}")
        self.port = int(line.split()[1].rsplit(":", 1)[1])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def rust_node(tmp_path):
    node = RustNode(tmp_path)
    yield node
    node.stop()


@pytest_asyncio.fixture
async def peer(rust_node):
    async with shardcx.Node(shards=2, psk=KEY) as node:
        yield await node.connect("127.0.0.1", rust_node.port, deadline=10)


def pattern(n: int) -> bytes:
    return bytes((i * 131 + 7) & 0xFF for i in range(n))


async def test_calls_a_rust_function_by_name(peer):
    for size in (0, 1, 8, 4096, 65536, 1 << 20):
        data = pattern(size)
        assert await peer.call("shardcx.bench.echo", data) == data
    # Any buffer: a bytearray and a memoryview slice.
    assert await peer.call("shardcx.bench.echo", bytearray(b"abc")) == b"abc"
    assert await peer.call("shardcx.bench.echo", memoryview(b"xyz")[1:]) == b"yz"


async def test_concurrent_calls_spread_over_shards_and_reach_each_remote_shard(peer):
    calls = [peer.call("shardcx.bench.echo", i.to_bytes(4, "little")) for i in range(200)]
    replies = await asyncio.gather(*calls)
    assert replies == [i.to_bytes(4, "little") for i in range(200)]
    for shard in (0, 1):
        assert await peer.call("shardcx.bench.echo", b"s", shard=shard) == b"s"


async def test_functions_are_discovered(peer):
    functions = {f.name: f for f in await peer.functions()}
    assert functions["shardcx.bench.echo"].takes_bytes
    assert not functions["shardcx.bench.sink"].takes_bytes
    assert "shardcx.discover" in functions
    assert all(isinstance(f.id, int) and f.version >= 1 for f in functions.values())


async def test_an_unknown_name_and_a_non_bytes_function_are_typed_errors(peer):
    with pytest.raises(shardcx.UnknownFunction):
        await peer.call("no.such.function", b"")
    with pytest.raises(shardcx.SchemaMismatch, match="not declared over bytes"):
        await peer.call("shardcx.bench.sink", b"1234")
    # The peer and the connection are fine afterwards.
    assert await peer.call("shardcx.bench.echo", b"ok") == b"ok"


async def test_deadlines_and_cancellation(peer):
    with pytest.raises(shardcx.Timeout):
        await peer.call("shardcx.bench.echo", b"late", deadline=0)
    big = pattern(8 << 20)
    task = asyncio.ensure_future(peer.call("shardcx.bench.echo", big))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await peer.call("shardcx.bench.echo", b"after") == b"after"


async def test_a_shard_the_peer_does_not_have_is_an_error(peer):
    with pytest.raises(shardcx.Error):
        await peer.call("shardcx.bench.echo", b"x", shard=7, deadline=5)
    with pytest.raises(ValueError):
        await peer.call("shardcx.bench.echo", b"x", shard=-1)


async def test_a_wrong_key_is_refused(rust_node):
    async with shardcx.Node(psk=b"another sixteen-byte key") as node:
        with pytest.raises(shardcx.AuthFailed):
            await node.connect("127.0.0.1", rust_node.port, deadline=10)


async def test_a_killed_server_fails_calls_promptly(tmp_path):
    server = RustNode(tmp_path, shards=1)
    try:
        async with shardcx.Node(psk=KEY) as node:
            peer = await node.connect("127.0.0.1", server.port, deadline=10)
            assert await peer.call("shardcx.bench.echo", b"up") == b"up"
            server.proc.kill()
            server.proc.wait()
            start = time.monotonic()
            with pytest.raises((shardcx.ConnectionLost, shardcx.Closed, shardcx.Timeout)):
                await peer.call("shardcx.bench.echo", b"down", deadline=10)
            assert time.monotonic() - start < 11
    finally:
        server.stop()


async def test_an_endpoints_peer_takes_calls(server, client):
    ep = await client.create_endpoint("127.0.0.1", server.port)
    assert ep.peer.node_id == ep.peer_node
    names = {f.name for f in await ep.peer.functions()}
    assert "shardcx.discover" in names
    with pytest.raises(shardcx.UnknownFunction):
        await ep.peer.call("shardcx.bench.echo", b"")
    await ep.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
