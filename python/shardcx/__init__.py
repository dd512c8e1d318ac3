"""shardcx for Python: asyncio endpoints over a thread-per-core UCX runtime.

The API has the shape of ucx-py/UCXX's asyncio API::

    import shardcx

    async def handler(ep):
        buf = bytearray(5)
        await ep.recv(buf)
        await ep.send(buf)
        await ep.close()

    async with shardcx.Node(psk=b"sixteen byte key") as server:
        listener = await server.create_listener(handler, port=0)
        async with shardcx.Node(psk=b"sixteen byte key") as client:
            ep = await client.create_endpoint("127.0.0.1", listener.port)
            await ep.send(b"hello")
            out = bytearray(5)
            await ep.recv(out)

A :class:`Node` is one shardcx node: its shards run on threads of their own (one per core
when pinned) and own the UCX workers; Python's event loop never waits on them. Calls are
handed to a shard and return futures; completions come back on the loop's thread through a
file descriptor the loop watches. Endpoints are channels on the authenticated session between
two nodes (one pre-shared-key handshake per node pair).

Rust RPC functions declared over bytes (``Vec<u8> => Vec<u8>``) are called by name::

    async with shardcx.Node(psk=key) as node:
        peer = await node.connect("127.0.0.1", port)        # no listener needed there
        reply = await peer.call("shardcx.bench.echo", b"ping")

Every call takes ``deadline=`` (seconds; the node's default when left out) and fails with a
typed exception, subclasses of :class:`Error`: :class:`Timeout`, :class:`Closed`,
:class:`ConnectionLost`, :class:`Cancelled`, :class:`TooLarge`, :class:`AuthFailed`,
:class:`Unreachable`, and for RPC :class:`UnknownFunction`, :class:`SchemaMismatch`,
:class:`RemoteError`.

Buffers: ``send`` copies the caller's buffer when it is called; ``recv`` copies into the
caller's buffer on the loop's thread once the message is there. No Python memory is lent to
UCX, so cancelling a task (``task.cancel()``, ``asyncio.timeout``) cancels the operation and
leaves the caller's buffer alone.
"""

from __future__ import annotations

import asyncio
import atexit
import ipaddress
import itertools
import os
import pickle
import selectors
import socket
import time
import weakref
from collections import deque
from typing import Any, Awaitable, Callable, NamedTuple, Optional

from . import _shardcx
from ._shardcx import MAX_TAG

__all__ = [
    "Node",
    "Listener",
    "Endpoint",
    "Peer",
    "Function",
    "Error",
    "Timeout",
    "Closed",
    "ConnectionLost",
    "Cancelled",
    "TooLarge",
    "AuthFailed",
    "Unreachable",
    "UnknownFunction",
    "SchemaMismatch",
    "RemoteError",
    "MAX_TAG",
    "PollingSelector",
    "polling_loop_factory",
    "SEND_WINDOW",
]

#: Longest a node may take to start its shards (``SHARDCX_START_LIMIT_S``; seconds).
_START_LIMIT_S = float(os.environ.get("SHARDCX_START_LIMIT_S", "30"))

#: Most sends of one endpoint handed to its shard and not finished (see :meth:`Endpoint.send`).
SEND_WINDOW = 64

#: Bits of a wire tag that name the receiving endpoint (the rest is the application's tag).
_EP_SHIFT = _shardcx.USER_TAG_BITS
_EP_MASK = ((1 << _shardcx.EP_BITS) - 1) << _EP_SHIFT


class Error(Exception):
    """Base class of every shardcx error."""


class Timeout(Error, TimeoutError):
    """The call's deadline passed before it completed."""


class Closed(Error):
    """The endpoint or node is closed (by this side or the peer), or the peer node stopped."""


class ConnectionLost(Error, ConnectionError):
    """The connection to the peer node failed (it died, or the transport broke)."""


class Cancelled(Error):
    """The operation was cancelled by the runtime (its endpoint was closed while it waited)."""


class TooLarge(Error):
    """A message is larger than the receiving buffer, or than the node's size limit."""


class AuthFailed(Error):
    """The peer refused this node's pre-shared key (or this node has none)."""


class Unreachable(Error, ConnectionError):
    """No shardcx node listens at the address, or it has no listener."""


class UnknownFunction(Error, LookupError):
    """The peer node serves no RPC function of that name (or id)."""


class SchemaMismatch(Error, TypeError):
    """The RPC function does not take and return bytes (``Vec<u8> => Vec<u8>``), or the
    peer's declaration differs from the one looked up."""


class RemoteError(Error):
    """The RPC function failed on the peer (its error, a panic, a request it could not read,
    or it was too busy): the message says which."""


_KINDS = {
    "Error": Error,
    "Timeout": Timeout,
    "Closed": Closed,
    "ConnectionLost": ConnectionLost,
    "Cancelled": Cancelled,
    "TooLarge": TooLarge,
    "AuthFailed": AuthFailed,
    "Unreachable": Unreachable,
    "UnknownFunction": UnknownFunction,
    "SchemaMismatch": SchemaMismatch,
    "RemoteError": RemoteError,
}


def _exc(kind: str, msg: str) -> Error:
    return _KINDS.get(kind, Error)(msg)


def _byte_view(buf: Any, writable: bool = False) -> memoryview:
    """A flat byte view of a buffer-protocol object (bytes, bytearray, numpy array, ...)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if writable and mv.readonly:
        raise TypeError("recv needs a writable buffer")
    if not mv.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


def _check_tag(tag: int, what: str = "tag") -> int:
    if not 0 <= tag <= MAX_TAG:
        raise ValueError(f"{what} must be in 0..={MAX_TAG}, not {tag}")
    return tag


class PollingSelector(selectors.EpollSelector):
    """An epoll selector that polls (``epoll_wait`` with no timeout) for up to ``spin``
    seconds before it blocks: the event loop then sees completions from the shards without a
    thread wake-up, at the cost of a busy thread while it waits. For a core of its own; see
    :func:`polling_loop_factory`."""

    def __init__(self, spin: float = 100e-6) -> None:
        super().__init__()
        self._spin = spin

    def select(self, timeout: Optional[float] = None):
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        end = time.perf_counter() + (self._spin if timeout is None else min(self._spin, timeout))
        while time.perf_counter() < end:
            ready = super().select(0)
            if ready:
                return ready
        if timeout is not None:
            timeout = max(0.0, timeout - self._spin)
        return super().select(timeout)


def polling_loop_factory(spin: float = 100e-6) -> Callable[[], asyncio.AbstractEventLoop]:
    """A loop factory for ``asyncio.Runner(loop_factory=...)`` (or ``asyncio.run`` from
    Python 3.12): event loops that poll for ``spin`` seconds before they sleep (UCXX's
    "polling" progress mode, for the event loop's side). Lower latency when the loop's thread
    has a core to itself; on a machine with fewer cores than busy threads it costs more than
    it saves."""
    return lambda: asyncio.SelectorEventLoop(PollingSelector(spin))


_live_nodes: "weakref.WeakSet[Node]" = weakref.WeakSet()


@atexit.register
def _stop_live_nodes() -> None:
    # Shard threads must not run UCX while the interpreter tears itself down.
    for node in list(_live_nodes):
        rt = node._rt
        if rt is not None:
            rt.stop()
            rt.join(5.0)


class Node:
    """One shardcx node: ``shards`` shard threads with their UCX workers.

    :param shards: number of shard threads (each owns a UCX worker and its connections).
    :param psk: the pre-shared key (at least 16 bytes; ``str`` is UTF-8 encoded) that both
        nodes of a connection must hold; a node without one can neither listen nor connect.
    :param transports: UCX transports, e.g. ``"tcp"`` or ``"sm,tcp"`` (listening and
        connecting by address need ``tcp``); ``None`` leaves it to ``UCX_TLS`` or UCX.
    :param pinned: pin shard ``i`` to CPU ``i`` (off by default: a Python process usually
        shares its cores with other work, and two pinned busy threads on one core starve).
    :param max_message_size: largest message this node sends or accepts, in bytes.
    :param deadline: default deadline of every call, in seconds.
    :param io_memory: glommio io memory per shard (locked memory), in bytes.
    :param am_queue_limit: most active messages kept per endpoint for ``am_recv``; more are
        dropped and counted in :attr:`Endpoint.am_dropped`.
    :param spin: how long (seconds) a shard keeps polling UCX after its last event before it
        sleeps (``SHARDCX_SPIN`` in the environment sets the default, 0). Polling cuts the
        wake-up cost when messages come back to back, but a polling shard competes for its
        core with the Python thread: keep it 0 unless the node has cores to spare.
    :param unexpected_count, unexpected_bytes: bounds, per peer node and shard, of the tag
        messages that arrive before their ``recv`` is posted; messages beyond them are
        **dropped** (and counted by the runtime): receive as fast as peers send, or have them
        wait for an answer (see ``examples/pingpong.py``'s rate test).

    The node starts with its first :meth:`create_listener`, :meth:`create_endpoint` or
    :meth:`connect` (a node
    listens on the one port it is started with), and stops with :meth:`close` or at the end
    of ``async with``. It belongs to the event loop that started it.
    """

    def __init__(
        self,
        shards: int = 1,
        psk: bytes | str | None = None,
        transports: Optional[str] = "tcp",
        *,
        pinned: bool = False,
        max_message_size: int = 64 << 20,
        deadline: float = _shardcx.DEFAULT_DEADLINE,
        io_memory: int = 1 << 20,
        am_queue_limit: int = 65536,
        spin: float = float(os.environ.get("SHARDCX_SPIN", "0.0")),
        unexpected_count: int = 4096,
        unexpected_bytes: int = 256 << 20,
    ) -> None:
        if shards < 1:
            raise ValueError("shards must be at least 1")
        self._shards = shards
        self._psk = psk.encode() if isinstance(psk, str) else psk
        self._transports = transports
        self._pinned = pinned
        self._max_message_size = max_message_size
        self._deadline = float(deadline)
        self._io_memory = io_memory
        self._am_queue_limit = am_queue_limit
        self._spin = spin
        self._unexpected = (unexpected_count, unexpected_bytes)
        self._rt: Optional[_shardcx.Runtime] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._started: Optional[asyncio.Future] = None
        self._stopped: Optional[asyncio.Future] = None
        self._port: Optional[int] = None
        self._node_id: Optional[int] = None
        self._ops: dict[int, asyncio.Future] = {}
        self._on_done: dict[int, Callable[[Any], Any]] = {}
        self._early: dict[int, list] = {}
        self._op_ids = itertools.count(1)
        self._endpoints: dict[int, Endpoint] = {}
        self._listener: Optional[Listener] = None
        self._handler_tasks: set[asyncio.Task] = set()
        self._next_shard = 0
        self._closing = False

    # -- life ---------------------------------------------------------------------------------

    async def __aenter__(self) -> "Node":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    @property
    def node_id(self) -> Optional[int]:
        """This node's id (a 64-bit integer), once started."""
        return self._node_id

    @property
    def shard_count(self) -> int:
        """Number of shards."""
        return self._shards

    def started(self) -> bool:
        """Whether the node is running."""
        return self._started is not None and self._started.done() and not self.stopped()

    def stopped(self) -> bool:
        """Whether the node has stopped."""
        return self._stopped is not None and self._stopped.done()

    async def _start(self, listen: Optional[tuple[str, int]]) -> None:
        if self._rt is not None:
            await asyncio.shield(self._started)
            return
        if self._closing:
            raise Closed("the node is closed")
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._started = loop.create_future()
        self._stopped = loop.create_future()
        self._rt = _shardcx.Runtime(
            self._shards,
            self._psk,
            self._transports,
            listen,
            self._pinned,
            self._max_message_size,
            self._deadline,
            self._io_memory,
            self._spin,
            *self._unexpected,
        )
        _live_nodes.add(self)
        loop.add_reader(self._rt.fileno(), self._on_events)
        try:
            async with asyncio.timeout(_START_LIMIT_S):
                await asyncio.shield(self._started)
        except TimeoutError:
            # A shard that never reached its serving loop: say so rather than wait forever.
            exc = Error(
                f"the node's {self._shards} shard(s) did not all start within "
                f"{_START_LIMIT_S:.0f} s (SHARDCX_START_LIMIT_S)"
            )
            if not self._started.done():
                self._started.set_exception(exc)
                # Read here; other callers of `_start` get it from the future.
                self._started.exception()
            self._rt.stop()
            self._finish(Closed("the node did not start"))
            raise exc from None

    async def close(self, *, deadline: float = 15.0) -> None:
        """Closes every endpoint and stops the node: it stops accepting, drains the work in
        flight, closes its connections and ends its shard threads. Idempotent."""
        self._closing = True
        rt = self._rt
        if rt is None or self.stopped():
            return
        rt.set_accepting(False)
        if self._listener is not None:
            self._listener._closed = True
        for ep in list(self._endpoints.values()):
            if not ep.closed():
                try:
                    await ep.close(deadline=min(deadline, 1.0))
                except Error:
                    pass
        rt.stop()
        try:
            async with asyncio.timeout(deadline):
                await asyncio.shield(self._stopped)
        except TimeoutError:
            pass
        finally:
            await asyncio.to_thread(rt.join, deadline)
            self._finish(Closed("the node stopped"))

    def _finish(self, exc: Error) -> None:
        if self._loop is not None and self._rt is not None:
            try:
                self._loop.remove_reader(self._rt.fileno())
            except (ValueError, RuntimeError):
                pass
        if self._stopped is not None and not self._stopped.done():
            self._stopped.set_result(None)
        for ep in list(self._endpoints.values()):
            ep._end(exc)
        for op, fut in list(self._ops.items()):
            if not fut.done():
                fut.set_exception(type(exc)(str(exc)))
        self._ops.clear()
        for task in list(self._handler_tasks):
            task.cancel()

    # -- listening and connecting -------------------------------------------------------------

    async def create_listener(
        self,
        handler: Callable[["Endpoint"], Awaitable[Any]],
        port: int = 0,
        *,
        host: str = "0.0.0.0",
    ) -> "Listener":
        """Listens on ``host:port`` (port 0 picks a free one: see :attr:`Listener.port`) and
        runs ``await handler(ep)`` as a task of this loop for every endpoint a peer opens.

        A node listens on one port, the one it starts with: call this before the node's first
        :meth:`create_endpoint`. :class:`Error` otherwise.
        """
        if self._listener is not None and not self._listener.closed():
            raise Error("this node already has a listener")
        if self._rt is None:
            await self._start((host, port))
        elif self._port is None or (port != 0 and port != self._port):
            raise Error(
                "a node listens on the port it was started with: create the listener "
                "before the first endpoint, or use another Node"
            )
        listener = Listener(self, handler, self._port)
        self._listener = listener
        self._rt.set_accepting(True)
        return listener

    async def create_endpoint(
        self, host: str, port: int, *, deadline: Optional[float] = None
    ) -> "Endpoint":
        """Connects to the node listening at ``host:port`` (the pre-shared-key handshake once
        per node pair) and opens an endpoint on its listener.

        Errors: :class:`Unreachable` (nothing listens there, or no listener),
        :class:`AuthFailed` (the keys differ), :class:`Timeout`.
        """
        await self._start(None)
        ip = await self._resolve(host, port)
        shard = self._next_shard
        self._next_shard = (shard + 1) % self._shards

        def opened(result: Any) -> "Endpoint":
            # Registered as the completion is read, before any later event of the same batch
            # (the peer's first messages, or its close) looks the endpoint up.
            ep_id, remote_ep, node, remote_shard = result
            ep = Endpoint(self, ep_id, remote_ep, shard, node, remote_shard)
            self._endpoints[ep_id] = ep
            # The peer's first messages or its close may come on another shard's rail, ahead
            # of this completion: they waited for it.
            for early in self._early.pop(ep_id, []):
                self._on_endpoint_event(early)
            return ep

        return await self._call(
            shard,
            lambda op: self._rt.connect(op, shard, ip, port, self._dl(deadline), True),
            on_done=opened,
        )

    async def connect(self, host: str, port: int, *, deadline: Optional[float] = None) -> "Peer":
        """Connects to the shardcx node listening at ``host:port`` (the pre-shared-key
        handshake once per node pair), with no endpoint: for calling its RPC functions
        (:meth:`Peer.call`). The node may be any shardcx node (a Rust server, ``shardcx
        node``), not only a Python one with a listener.

        Errors: :class:`Unreachable`, :class:`AuthFailed`, :class:`Timeout`.
        """
        await self._start(None)
        ip = await self._resolve(host, port)
        shard = self._next_shard
        self._next_shard = (shard + 1) % self._shards
        node_id = await self._call(
            shard, lambda op: self._rt.connect(op, shard, ip, port, self._dl(deadline), False)
        )
        return Peer(self, node_id)

    async def _resolve(self, host: str, port: int) -> str:
        try:
            return str(ipaddress.ip_address(host))
        except ValueError:
            infos = await self._loop.getaddrinfo(
                host, port, family=socket.AF_INET, type=socket.SOCK_STREAM
            )
            if not infos:
                raise Unreachable(f"cannot resolve {host!r}") from None
            return infos[0][4][0]

    # -- operations ---------------------------------------------------------------------------

    def _dl(self, deadline: Optional[float]) -> float:
        if deadline is None:
            return self._deadline
        if deadline < 0:
            raise ValueError("deadline must not be negative")
        return float(deadline)

    def _submit(self, submit: Callable[[int], None], owner: Any = None) -> tuple:
        """Hands an operation to its shard (``submit`` with a fresh op id) and returns the id
        and the future its completion resolves; ``owner`` (an endpoint) tracks it too."""
        if self._rt is None or self.stopped():
            raise Closed("the node is not running")
        op = next(self._op_ids)
        fut = self._loop.create_future()
        submit(op)
        self._ops[op] = fut
        if owner is not None:
            owner._pending[op] = fut
        return op, fut

    async def _call(
        self,
        shard: int,
        submit: Callable[[int], None],
        owner: Any = None,
        on_done: Optional[Callable[[Any], Any]] = None,
    ) -> Any:
        """Submits an operation to ``shard`` and waits for its completion. A cancelled wait
        cancels the operation on the shard. ``on_done`` maps the result as the completion is
        read (in the event batch, not when the waiting task resumes)."""
        op, fut = self._submit(submit, owner)
        if on_done is not None:
            self._on_done[op] = on_done
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.cancelled() and self._ops.pop(op, None) is not None:
                self._rt.cancel(shard, op)
            raise
        finally:
            self._ops.pop(op, None)
            self._on_done.pop(op, None)
            if owner is not None:
                owner._pending.pop(op, None)

    def _on_events(self) -> None:
        rt = self._rt
        if rt is None:
            return
        for ev in rt.drain():
            kind = ev[0]
            if kind == "done":
                fut = self._ops.pop(ev[1], None)
                hook = self._on_done.pop(ev[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(ev[2] if hook is None else hook(ev[2]))
            elif kind == "failed":
                fut = self._ops.pop(ev[1], None)
                if fut is not None and not fut.done():
                    fut.set_exception(_exc(ev[2], ev[3]))
            elif kind in ("am", "peer_closed"):
                self._on_endpoint_event(ev)
            elif kind == "accept":
                self._on_accept(*ev[1:])
            elif kind == "peer_lost":
                exc_kind, msg = ev[2], ev[3]
                for ep in list(self._endpoints.values()):
                    if ep._peer_node == ev[1]:
                        ep._end(_exc(exc_kind, msg))
            elif kind == "started":
                self._port, self._node_id = ev[1], ev[2]
                if not self._started.done():
                    self._started.set_result(None)
            elif kind == "start_failed":
                exc = _exc(ev[2], ev[3])
                if not self._started.done():
                    self._started.set_exception(exc)
                self._finish(Closed("the node did not start"))
            elif kind == "stopped":
                exc = Closed("the node stopped") if len(ev) == 1 else _exc(ev[2], ev[3])
                if not self._started.done():
                    self._started.set_exception(exc)
                self._finish(exc if isinstance(exc, Closed) else Closed(str(exc)))

    def _on_endpoint_event(self, ev: tuple) -> None:
        ep = self._endpoints.get(ev[1])
        if ep is None:
            # An endpoint whose opening has not completed here yet (its events can overtake
            # the completion), kept while openings are under way; else a closed one's.
            if self._on_done:
                self._early.setdefault(ev[1], []).append(ev)
            else:
                self._early.clear()
        elif ev[0] == "am":
            ep._on_am(ev[2])
        else:
            ep._on_peer_closed(ev[2])

    def _on_accept(self, ep_id: int, remote_ep: int, shard: int, node: int, rshard: int) -> None:
        ep = Endpoint(self, ep_id, remote_ep, shard, node, rshard)
        self._endpoints[ep_id] = ep
        listener = self._listener
        if listener is None or listener.closed():
            # Accepted by the shard just before the listener closed: tell the peer.
            self._loop.create_task(_quiet(ep.close()))
            return
        task = self._loop.create_task(listener._run(ep))
        self._handler_tasks.add(task)
        task.add_done_callback(self._handler_tasks.discard)


async def _quiet(aw: Awaitable[Any]) -> None:
    try:
        await aw
    except Error:
        pass


class Function(NamedTuple):
    """An RPC function a node serves (from :meth:`Peer.functions`)."""

    #: Its name, unique within the node (e.g. ``"kv.get"``).
    name: str
    #: Its id, unique within the node.
    id: int
    #: Its version, set by its author.
    version: int
    #: Whether it takes and returns bytes (``Vec<u8> => Vec<u8>``): only those can be called
    #: from Python.
    takes_bytes: bool


class Peer:
    """A connected node, for RPC (from :meth:`Node.connect` or :attr:`Endpoint.peer`).

    Each call runs on one of this node's shards (in turn), on that shard's own connection to
    the peer: calls from several tasks spread over the shards.
    """

    def __init__(self, node: Node, node_id: int) -> None:
        self._node = node
        self._node_id = node_id

    def __repr__(self) -> str:
        return f"<shardcx.Peer node {self._node_id:#x}>"

    @property
    def node_id(self) -> int:
        """The peer node's id."""
        return self._node_id

    def _shard(self) -> int:
        node = self._node
        shard = node._next_shard
        node._next_shard = (shard + 1) % node._shards
        return shard

    async def call(
        self,
        name: str,
        data: Any = b"",
        *,
        shard: Optional[int] = None,
        deadline: Optional[float] = None,
    ) -> bytes:
        """Calls the peer's RPC function ``name`` with the bytes of ``data`` (any C-contiguous
        buffer, copied when called) and returns its reply.

        The function is found by name through the peer's built-in discovery (once per name
        and shard; looked up again if the peer forgot it, e.g. after a restart) and must be
        declared over bytes (``Vec<u8> => Vec<u8>`` in Rust). ``shard`` sends the call to that
        shard of the peer (``None``: the calling shard's own connection, no hop when both
        nodes have as many shards). A cancelled task cancels the call on the peer too.

        Errors: :class:`UnknownFunction`, :class:`SchemaMismatch` (raised before anything is
        sent), :class:`RemoteError` (the function failed: its message), :class:`TooLarge`,
        :class:`Timeout` (the deadline covers the lookup and the call),
        :class:`ConnectionLost`, :class:`Closed`.
        """
        if shard is not None and not 0 <= shard < 1 << 16:
            raise ValueError(f"shard must be in 0..65535, not {shard}")
        node = self._node
        me = self._shard()
        view = _byte_view(data)
        received = await node._call(
            me,
            lambda op: node._rt.rpc_call(
                op, me, self._node_id, shard, name, view, node._dl(deadline)
            ),
        )
        return received.to_bytes()

    async def functions(self, *, deadline: Optional[float] = None) -> list[Function]:
        """The RPC functions the peer serves (its built-ins included), by its discovery."""
        node = self._node
        me = self._shard()
        listed = await node._call(
            me, lambda op: node._rt.rpc_functions(op, me, self._node_id, node._dl(deadline))
        )
        return [Function(*f) for f in listed]


class Listener:
    """A node's listener (from :meth:`Node.create_listener`)."""

    def __init__(self, node: Node, handler: Callable[["Endpoint"], Awaitable[Any]], port: int):
        self._node = node
        self._handler = handler
        self._port = port
        self._closed = False

    @property
    def port(self) -> int:
        """The port it listens on."""
        return self._port

    def closed(self) -> bool:
        """Whether :meth:`close` was called (or the node stopped)."""
        return self._closed or self._node.stopped()

    def close(self) -> None:
        """Stops taking new endpoints (peers' :meth:`Node.create_endpoint` then fail with
        :class:`Unreachable`); endpoints already open stay open."""
        self._closed = True
        if self._node._rt is not None:
            self._node._rt.set_accepting(False)

    async def _run(self, ep: "Endpoint") -> None:
        try:
            try:
                await self._handler(ep)
            except* Error:
                # The endpoint or node ended under the handler (also inside a task group):
                # that is the handler's way out.
                pass
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # A failed handler must not leave its peer waiting until its deadlines: the
            # endpoint is closed (the peer's calls raise Closed), and the error reported.
            await _quiet(ep.close())
            asyncio.get_running_loop().call_exception_handler(
                {
                    "message": f"shardcx listener handler failed; {ep!r} closed",
                    "exception": e,
                }
            )


class Endpoint:
    """One end of a channel between two nodes (from :meth:`Node.create_endpoint`, or given to
    a listener's handler).

    Tag messages (``send``/``recv``, ``send_obj``/``recv_obj``) from one endpoint arrive in
    the order sent; ``recv`` takes the earliest message whose tag matches ``tag`` under
    ``tag_mask`` (``(msg_tag ^ tag) & tag_mask == 0``; tags are 0..=:data:`MAX_TAG`). Active
    messages (``am_send``/``am_recv``) are a separate stream.
    """

    def __init__(
        self, node: Node, ep: int, remote_ep: int, shard: int, peer_node: int, remote_shard: int
    ) -> None:
        self._node = node
        self._ep = ep
        self._remote_ep = remote_ep
        self._shard = shard
        self._peer_node = peer_node
        self._remote_shard = remote_shard
        self._pending: dict[int, asyncio.Future] = {}
        self._end_exc: Optional[Error] = None
        # Tag messages sent and received; after the peer closes, receives go on until this
        # side has received as many as the peer sent (``_peer_sent``).
        self._sent = 0
        self._received = 0
        # Sends handed to the shard and not finished yet, oldest first (see `send`).
        self._sends: deque[asyncio.Future] = deque()
        self._peer_sent: Optional[int] = None
        self._am: deque = deque()
        self._am_waiters: deque[asyncio.Future] = deque()
        #: Active messages dropped because the queue of unreceived ones was full.
        self.am_dropped = 0

    def __repr__(self) -> str:
        state = "closed" if self.closed() else "open"
        return f"<shardcx.Endpoint {self._ep} to node {self._peer_node:#x} ({state})>"

    @property
    def peer_node(self) -> int:
        """The remote node's id."""
        return self._peer_node

    @property
    def peer(self) -> Peer:
        """The remote node, for RPC calls (:meth:`Peer.call`)."""
        return Peer(self._node, self._peer_node)

    def closed(self) -> bool:
        """Whether the endpoint is closed (by this side or the peer) or its connection ended."""
        return self._end_exc is not None

    def _check(self) -> None:
        if self._end_exc is not None:
            raise type(self._end_exc)(str(self._end_exc))

    def _on_peer_closed(self, sent: int) -> None:
        self._peer_sent = sent
        self._check_peer_closed()

    def _check_peer_closed(self) -> None:
        if self._peer_sent is not None and self._received >= self._peer_sent:
            self._end(Closed("the peer closed the endpoint"))

    def _end(self, exc: Error) -> None:
        """Ends the endpoint: pending calls fail with ``exc`` and their shard operations are
        cancelled."""
        if self._end_exc is not None:
            return
        self._end_exc = exc
        node = self._node
        for op, fut in list(self._pending.items()):
            if not fut.done():
                if node._rt is not None and not node.stopped():
                    node._rt.cancel(self._shard, op)
                node._ops.pop(op, None)
                fut.set_exception(type(exc)(str(exc)))
        self._pending.clear()
        while self._am_waiters:
            w = self._am_waiters.popleft()
            if not w.done():
                w.set_exception(type(exc)(str(exc)))
        node._endpoints.pop(self._ep, None)

    # -- tag messages -------------------------------------------------------------------------

    async def send(self, buf: Any, tag: int = 0, *, deadline: Optional[float] = None) -> None:
        """Sends the bytes of ``buf`` (any C-contiguous buffer: bytes, bytearray, memoryview,
        numpy array) with ``tag``.

        The bytes are copied and handed to the endpoint's shard at once: the caller may reuse
        the buffer as soon as this is called. It returns without waiting for the shard unless
        :data:`SEND_WINDOW` sends of this endpoint are still in flight (then it waits for the
        oldest). A send that fails after it was handed over (connection lost, deadline) ends
        the endpoint: its pending and later calls raise that error."""
        self._check()
        if self._peer_sent is not None:
            raise Closed("the peer closed the endpoint")
        mv = _byte_view(buf)
        wire = (self._remote_ep << _EP_SHIFT) | _check_tag(tag)
        node = self._node
        # The runtime's limit counts the tag trailer; refused here, before hand-off.
        trailer = _shardcx.TAG_TRAILER_LEN
        if len(mv) + trailer > node._max_message_size:
            raise TooLarge(
                f"message of {len(mv)} bytes is over this node's limit "
                f"(max_message_size={node._max_message_size}, {trailer} bytes of it for the tag)"
            )
        dl = node._dl(deadline)
        op, fut = node._submit(
            lambda op: node._rt.tag_send(
                op, self._shard, self._peer_node, self._remote_shard, wire, mv, dl
            ),
            owner=self,
        )
        self._sent += 1
        self._sends.append(fut)
        fut.add_done_callback(lambda f: self._send_done(op, f))
        # Back-pressure: at most SEND_WINDOW sends in flight per endpoint.
        while self._sends and self._sends[0].done():
            self._sends.popleft()
        if len(self._sends) > SEND_WINDOW:
            # Not `await fut`: cancelling the caller must not cancel a send already handed over.
            await asyncio.wait([self._sends[0]])
            self._check()

    def _send_done(self, op: int, fut: asyncio.Future) -> None:
        self._pending.pop(op, None)
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            # A stream with a hole in it is no stream: the endpoint ends with the error.
            self._end(exc)

    async def _recv_msg(self, tag: int, tag_mask: int, deadline: Optional[float]) -> Any:
        self._check()
        pattern = (self._ep << _EP_SHIFT) | (_check_tag(tag) & tag_mask)
        mask = _EP_MASK | (_check_tag(tag_mask, "tag_mask"))
        node = self._node
        msg = await node._call(
            self._shard,
            lambda op: node._rt.tag_recv(
                op, self._shard, self._peer_node, pattern, mask, node._dl(deadline)
            ),
            self,
        )
        self._received += 1
        self._check_peer_closed()
        return msg

    async def recv(
        self,
        buf: Any,
        tag: int = 0,
        tag_mask: int = MAX_TAG,
        *,
        deadline: Optional[float] = None,
    ) -> int:
        """Receives the earliest message matching ``tag``/``tag_mask`` into ``buf`` (a
        writable C-contiguous buffer, numpy arrays included) and returns its length in bytes.
        A message longer than ``buf`` raises :class:`TooLarge` (the message is consumed)."""
        mv = _byte_view(buf, writable=True)
        msg = await self._recv_msg(tag, tag_mask, deadline)
        n = len(msg)
        if n > len(mv):
            raise TooLarge(f"message of {n} bytes does not fit a buffer of {len(mv)} bytes")
        msg.copy_into(mv[:n])
        return n

    async def recv_tagged(
        self, tag: int = 0, tag_mask: int = 0, *, deadline: Optional[float] = None
    ) -> tuple[int, bytes]:
        """Receives the earliest message matching ``tag``/``tag_mask`` (by default any tag)
        and returns ``(its tag, its bytes)``."""
        msg = await self._recv_msg(tag, tag_mask, deadline)
        return msg.tag, msg.to_bytes()

    async def send_obj(self, obj: Any, tag: int = 0, *, deadline: Optional[float] = None) -> None:
        """Sends any picklable object as one message (pickle protocol 5)."""
        await self.send(pickle.dumps(obj, protocol=5), tag, deadline=deadline)

    async def recv_obj(
        self, tag: int = 0, tag_mask: int = MAX_TAG, *, deadline: Optional[float] = None
    ) -> Any:
        """Receives an object sent with :meth:`send_obj`. It is unpickled: only connect to
        nodes you trust with code execution (which a shared pre-shared key already implies)."""
        msg = await self._recv_msg(tag, tag_mask, deadline)
        return pickle.loads(msg.to_bytes())

    # -- active messages ----------------------------------------------------------------------

    async def am_send(self, buf: Any, *, deadline: Optional[float] = None) -> None:
        """Sends the bytes of ``buf`` as an active message to the remote endpoint (received
        there with :meth:`am_recv`, in the order sent)."""
        self._check()
        mv = _byte_view(buf)
        node = self._node
        await node._call(
            self._shard,
            lambda op: node._rt.am_send(
                op,
                self._shard,
                self._peer_node,
                self._remote_shard,
                self._remote_ep,
                mv,
                node._dl(deadline),
            ),
            self,
        )

    async def am_recv(self, *, deadline: Optional[float] = None) -> bytes:
        """Returns the next active message's bytes."""
        if self._am:
            return self._am.popleft().to_bytes()
        self._check()
        fut = self._node._loop.create_future()
        self._am_waiters.append(fut)
        try:
            async with asyncio.timeout(self._node._dl(deadline)):
                msg = await fut
        except TimeoutError:
            raise Timeout(f"am_recv timed out after {self._node._dl(deadline)} s") from None
        finally:
            if fut in self._am_waiters:
                self._am_waiters.remove(fut)
        return msg.to_bytes()

    def _on_am(self, msg: Any) -> None:
        while self._am_waiters:
            w = self._am_waiters.popleft()
            if not w.done():
                w.set_result(msg)
                return
        if len(self._am) >= self._node._am_queue_limit:
            self.am_dropped += 1
            return
        self._am.append(msg)

    # -- closing ------------------------------------------------------------------------------

    async def close(self, *, deadline: Optional[float] = None) -> None:
        """Closes the endpoint: its pending calls fail with :class:`Cancelled`, later ones with
        :class:`Closed`. The peer receives the messages sent before the close, then its
        receives fail with :class:`Closed` (its sends at once). Idempotent."""
        if self._end_exc is not None:
            return
        sends = [f for f in self._sends if not f.done()]
        if sends:
            # Sends handed over before the close go out before it (the peer counts them).
            await asyncio.wait(sends, timeout=self._node._dl(deadline))
        if self._end_exc is not None:
            return
        self._end(Cancelled("the endpoint was closed"))
        self._end_exc = Closed("the endpoint is closed")
        node = self._node
        if node._rt is None or node.stopped():
            return
        try:
            await node._call(
                self._shard,
                lambda op: node._rt.close_ep(
                    op,
                    self._shard,
                    self._peer_node,
                    self._remote_shard,
                    self._remote_ep,
                    self._sent,
                    node._dl(deadline),
                ),
            )
        except (Closed, ConnectionLost, Unreachable):
            # The peer is gone already: nothing to tell it.
            pass
