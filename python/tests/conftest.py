"""Shared fixtures. Every test runs under a hard alarm, so that no bug can hang the suite."""

import asyncio
import os
import signal
import subprocess
import threading

import pytest
import pytest_asyncio

import shardcx

KEY = b"python tests' pre-shared key"
#: Longest a test may run before the process is killed (SIGALRM's default action).
HARD_LIMIT_S = int(os.environ.get("SHARDCX_TEST_LIMIT_S", "120"))


def _dump_stacks(test: str) -> None:
    """Writes the stack of every thread of this process (gdb: the shards' Rust threads too) to
    a file in SHARDCX_STACKS_DIR, which scripts/test-python prints when pytest fails: the alarm
    kills the process without a report, so this is all that says where a hang was."""
    out_dir = os.environ.get("SHARDCX_STACKS_DIR")
    if not out_dir:
        return
    try:
        r = subprocess.run(
            ["gdb", "-p", str(os.getpid()), "-batch", "-nx", "-ex", "set pagination off",
             "-ex", "thread apply all bt 30"],
            capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL,
        )
        text = r.stdout or r.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"(no stacks: {e})"
    path = os.path.join(out_dir, f"pytest-{os.getpid()}.txt")
    with open(path, "w") as f:
        f.write(f"{test} still ran {HARD_LIMIT_S - 15} s after it started; its threads:\n{text}")


@pytest.fixture(autouse=True)
def hard_limit(request):
    # 15 s before the alarm, the stacks (a thread of its own: it runs while the event loop's
    # thread waits in a call that does not release the GIL only if that call ever does).
    watchdog = threading.Timer(max(1, HARD_LIMIT_S - 15), _dump_stacks, [request.node.nodeid])
    watchdog.daemon = True
    watchdog.start()
    signal.alarm(HARD_LIMIT_S)
    yield
    signal.alarm(0)
    watchdog.cancel()


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
