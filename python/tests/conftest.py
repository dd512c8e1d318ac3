"""Shared fixtures. Every test runs under a hard alarm, so that no bug can hang the suite."""

import asyncio
import os
import signal

import pytest
import pytest_asyncio

import shardcx

KEY = b"python tests' pre-shared key"
#: Longest a test may run before the process is killed (SIGALRM's default action).
HARD_LIMIT_S = int(os.environ.get("SHARDCX_TEST_LIMIT_S", "120"))


@pytest.fixture(autouse=True)
def hard_limit():
    signal.alarm(HARD_LIMIT_S)
    yield
    signal.alarm(0)


async def echo_handler(ep: shardcx.Endpoint) -> None:
    """Echoes tag messages (with their tags) and active messages until the endpoint ends."""

    async def tags():
        while True:
            tag, data = await ep.recv_tagged(deadline=60)
            await ep.send(data, tag)

    async def ams():
        while True:
            data = await ep.am_recv(deadline=60)
            await ep.am_send(data)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(tags())
        tg.create_task(ams())


@pytest_asyncio.fixture
async def server():
    """A one-shard echo node listening on a free port of loopback."""
    node = shardcx.Node(shards=1, psk=KEY)
    listener = await node.create_listener(echo_handler, port=0, host="127.0.0.1")
    node.port = listener.port
    yield node
    async with asyncio.timeout(30):
        await node.close()


@pytest_asyncio.fixture
async def client():
    node = shardcx.Node(shards=1, psk=KEY)
    yield node
    async with asyncio.timeout(30):
        await node.close()
