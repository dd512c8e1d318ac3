//! Connections between nodes: bootstrap, handshake, and frames on the owner shards.
//!
//! A *node* is one [`ShardsBuilder`](crate::ShardsBuilder) set of shards, known to others by
//! its [`NodeId`] (configured, or drawn from `/dev/urandom`) and, for one run, its
//! [`Incarnation`] (the start time in nanoseconds unless configured). Nodes authenticate each
//! other with proto's handshake and a pre-shared key ([`crate::ShardsBuilder::psk`]).
//!
//! ## Who holds the endpoint
//!
//! For a pair of nodes A and B, the shard of A that owns B is
//! `o = ShardMap::new(A's shard count).owner_of(B)` and the shard of B that owns A is
//! `r = ShardMap::new(B's shard count).owner_of(A)`. The session lives on `o` and `r` only:
//! `o` holds one UCX endpoint to `r`'s worker and a client [`Connection`], `r` holds one
//! endpoint back to `o`'s worker and a server [`Connection`]. Every other shard reaches the peer
//! by forwarding to its owner over the mesh ([`ShardCtx::forward`]).
//!
//! ## Connecting
//!
//! 1. **Bootstrap.** Shard 0 of a node built with [`crate::ShardsBuilder::listen`] binds a UCX
//!    [`Listener`] (this needs the `tcp` transport in UCX 1.12). Before the user future starts
//!    it gathers every shard's worker address (one forward per shard) into a [`Directory`]
//!    (node id, incarnation, shard count, worker addresses). On every accepted connection it
//!    sends the directory as active message [`DIRECTORY_AM`], flushes, and drops the endpoint
//!    when the client goes or after the connect timeout. [`ShardCtx::bootstrap`] opens an
//!    endpoint to the listener from the calling shard and waits, within
//!    [`NetConfig::connect_timeout`], for the directory, for the endpoint's error
//!    ([`NetError::Unreachable`]) or for the deadline ([`NetError::TimedOut`]). UCX AM handlers
//!    do not say which endpoint a message came from, so bootstraps are serialised per shard
//!    (one in flight at a time) and the reply is unambiguous.
//! 2. **Session.** [`ShardCtx::connect`] computes `o` and `r` from the directory, forwards to
//!    `o` (unless it is the caller), which connects to `r` by worker address and runs a client
//!    [`Connection`]. The first frame, the `Hello`, carries `o`'s worker address; `r`, on a
//!    `Hello` from a node it has no connection with (and that it owns), creates the reverse
//!    endpoint to that address and a server [`Connection`]. The handshake has its own deadline
//!    ([`NetConfig::handshake_timeout`]); a failure ends the connect with a typed
//!    [`NetError`]: [`NetError::Refused`] for a wrong key (with proto's reject reason),
//!    [`NetError::TimedOut`], [`NetError::Handshake`] for other handshake failures.
//!
//! ## Frames
//!
//! Every frame travels as one eager active message [`FRAME_AM`] whose UCX AM header is
//! [`AM_HEADER_LEN`] = 16 bytes, little-endian:
//!
//! ```text
//!  0  u64  sender's NodeId
//!  8  u32  addr_len: length of the sender's worker address that starts the payload (Hello only)
//! 12  u32  reserved, zero
//! ```
//!
//! and whose payload is the worker address (`addr_len` bytes) followed by the proto frame (the
//! 48-byte [`FrameHeader`] and its payload). The AM handler only queues the bytes; the shard's
//! *net task* decodes them, finds the connection by node id and feeds
//! [`Connection::handle_frame`]. A frame from a node with no connection that is not a
//! well-formed `Hello` from that same node, and any non-handshake frame of a connection that is
//! not `Ready`, is dropped and counted ([`NetStats::dropped_unauthenticated`]). Application
//! frames ([`FrameKind::Am`]) of a ready connection go to the handler registered for their
//! [`AmId`] ([`ShardCtx::set_net_handler`]); [`ShardCtx::send_am`] sends one from any shard.
//!
//! The net task also follows proto's calling order: after each input it drains
//! `poll_transmit` (into the connection's sender task, which owns the endpoint and sends frames
//! in order) and `poll_event`, and it sleeps until the earliest `poll_timeout` (handshake
//! deadline, heartbeats, suspicion and death) or the next input. An endpoint error becomes
//! [`Connection::handle_transport_error`]. A connection that fails or closes is removed; its
//! sender task flushes what is queued (a `Reject`, a `Close`) within a linger time and drops
//! the endpoint.
//!
//! ## Error modes
//!
//! UCX 1.12's shared-memory transports cannot detect a failed peer, so endpoints use
//! [`ErrorMode::Peer`] when the transport list contains `tcp` (or is not set) and
//! [`ErrorMode::None`] otherwise; heartbeats detect dead peers in both cases. The bootstrap
//! endpoints always use [`ErrorMode::Peer`]: a socket-address connect needs `tcp` anyway.
//!
//! ## Limits (what is not here yet)
//!
//! - A failed session is not re-established by itself (`max_reconnect_attempts` is 0): call
//!   [`ShardCtx::connect`] again.
//! - Two nodes connecting to each other at the same moment are not reconciled: the shard that
//!   owns both directions holds one connection per peer node, and the second handshake fails.
//!   Connecting to a node that is already connected (either way) returns the existing session.
//! - Frames are sent eager; a large payload is not yet carried by rendezvous.
//! - Half-open handshakes from unauthenticated nodes are not capped in number.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::io::Read;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::future;
use glommio::sync::Semaphore;
use glommio::timer::sleep;
use glommio::Task;

use crate::boot::ShardCtx;
use crate::error::NetError;
use crate::proto::conn::{FailReason, Received};
use crate::proto::handshake::{HandshakeError, HandshakeMessage, RejectReason};
use crate::proto::wire::{decode_frame, encode_frame, frame_len};
use crate::proto::{
    AmId, ConnConfig, Connection, Event, FrameHeader, FrameKind, HandshakeConfig, Incarnation,
    Limits, NodeId, PreSharedKey, Seeds, ShardId, ShardMap, State, Timestamp,
};
use crate::ucx::{AmIdRaw, AmPayload, AmProto, Endpoint, EpOptions, ErrorMode, Listener};
use crate::ucx::{Worker, WorkerAddress};

/// UCX active-message id of the bootstrap directory (listener → client).
pub const DIRECTORY_AM: AmIdRaw = 0x5C00;
/// UCX active-message id of every frame between connected nodes.
pub const FRAME_AM: AmIdRaw = 0x5C01;
/// Bytes of the UCX AM header of a [`FRAME_AM`] message (see the module docs).
pub const AM_HEADER_LEN: usize = 16;

const DIRECTORY_MAGIC: u32 = u32::from_le_bytes(*b"SCXD");
/// Largest worker address accepted in a directory or a hello.
const MAX_ADDR_LEN: usize = 64 << 10;

/// Settings of the connections between nodes.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Time allowed for a bootstrap (listener connect and directory), default 5 s.
    pub connect_timeout: Duration,
    /// Time allowed for the handshake, default 5 s.
    pub handshake_timeout: Duration,
    /// Heartbeat interval on ready connections, default 100 ms.
    pub heartbeat_interval: Duration,
    /// Missed heartbeat intervals before the peer is suspect, default 3.
    pub suspect_after: u32,
    /// Missed heartbeat intervals before the peer is dead, default 10.
    pub dead_after: u32,
    /// How long a dropped connection's endpoint may take to flush its last frames, default 1 s.
    pub linger: Duration,
    /// Endpoint error mode; `None` picks it from the transport list (see the module docs).
    pub error_mode: Option<ErrorMode>,
}

/// A node's bootstrap directory: who it is and where each of its shards' workers are.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Directory {
    /// The node.
    pub node_id: NodeId,
    /// Its incarnation.
    pub incarnation: Incarnation,
    /// Worker address of each of its shards, in shard order (its shard count is the length).
    pub workers: Vec<WorkerAddress>,
}

/// A connected remote node, as seen from this node. `Send + Copy`: pass it between shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RemoteNode {
    /// The remote node.
    pub node_id: NodeId,
    /// Its incarnation, as authenticated by the handshake.
    pub incarnation: Incarnation,
    /// Its shard count.
    pub shard_count: u16,
    /// The local shard that owns it (holds the endpoint).
    pub owner: ShardId,
    /// Its shard that owns this node.
    pub remote_shard: ShardId,
}

/// Counters of one shard's connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Handshakes completed on this shard.
    pub handshakes: u64,
    /// Application frames delivered to handlers.
    pub delivered: u64,
    /// Frames dropped because their sender had no ready (authenticated) connection.
    pub dropped_unauthenticated: u64,
    /// Frames dropped as malformed (bad AM header, frame, or address).
    pub dropped_malformed: u64,
    /// Frames dropped because this shard does not own their sender.
    pub dropped_misrouted: u64,
    /// Application frames with no handler registered for their id.
    pub dropped_no_handler: u64,
    /// Other frames dropped by the connection state machine (stale incarnation, unexpected).
    pub dropped_other: u64,
}

/// Node identity and settings, resolved once in [`crate::ShardsBuilder::run`]; `Send`.
#[derive(Debug, Clone)]
pub(crate) struct NodeSettings {
    pub(crate) node_id: NodeId,
    pub(crate) incarnation: Incarnation,
    pub(crate) psk: Option<PreSharedKey>,
    pub(crate) listen: Option<SocketAddr>,
    pub(crate) listen_addr: std::sync::Arc<std::sync::OnceLock<SocketAddr>>,
    pub(crate) error_mode: ErrorMode,
    pub(crate) cfg: NetConfig,
}

type Handler = Rc<dyn Fn(&Rc<ShardCtx>, NodeId, Vec<u8>)>;
type Waiter = Rc<Queue<Result<RemoteNode, NetError>>>;

/// A frame for a sender task: UCX AM header and payload.
type Outbound = ([u8; AM_HEADER_LEN], Vec<u8>);

enum Inbound {
    Frame {
        node: NodeId,
        addr_len: usize,
        bytes: Vec<u8>,
    },
    Malformed,
    TransportError {
        node: NodeId,
        generation: u64,
    },
    Wake,
}

/// A single-consumer queue with a waker; `close` ends the consumer's `next` once empty.
struct Queue<T> {
    items: RefCell<VecDeque<T>>,
    waker: RefCell<Option<Waker>>,
    closed: Cell<bool>,
}

struct Peer {
    conn: Connection,
    out: Rc<Queue<Outbound>>,
    generation: u64,
    waiters: Vec<Waiter>,
}

/// One shard's network state (in its [`ShardCtx`]).
pub(crate) struct NetState {
    settings: NodeSettings,
    epoch: Instant,
    my_address: Vec<u8>,
    inbox: Rc<Queue<Inbound>>,
    directories: Rc<Queue<Vec<u8>>>,
    bootstrap_lock: Semaphore,
    peers: RefCell<HashMap<NodeId, Peer>>,
    handlers: RefCell<HashMap<AmId, Handler>>,
    stats: Cell<NetStats>,
    generation: Cell<u64>,
    tasks: RefCell<Vec<Task<()>>>,
    live_senders: Rc<Cell<usize>>,
}

impl NetConfig {
    fn conn_config(
        &self,
        s: &NodeSettings,
        psk: PreSharedKey,
        shard_count: u16,
        local: ShardId,
    ) -> ConnConfig {
        let mut hs = HandshakeConfig::new(s.node_id, s.incarnation, shard_count, psk);
        hs.timeout = self.handshake_timeout;
        let mut c = ConnConfig::new(hs);
        c.local_shard = local;
        c.heartbeat_interval = self.heartbeat_interval;
        c.suspect_after = self.suspect_after;
        c.dead_after = self.dead_after.max(self.suspect_after);
        c.max_reconnect_attempts = Some(0);
        c
    }
}

impl Default for NetConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(100),
            suspect_after: 3,
            dead_after: 10,
            linger: Duration::from_secs(1),
            error_mode: None,
        }
    }
}

impl Directory {
    /// The directory as bytes (the payload of [`DIRECTORY_AM`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&DIRECTORY_MAGIC.to_le_bytes());
        out.extend_from_slice(&(self.workers.len() as u32).to_le_bytes());
        out.extend_from_slice(&self.node_id.get().to_le_bytes());
        out.extend_from_slice(&self.incarnation.get().to_le_bytes());
        for w in &self.workers {
            out.extend_from_slice(&(w.as_bytes().len() as u32).to_le_bytes());
            out.extend_from_slice(w.as_bytes());
        }
        out
    }

    /// Parses a directory received from the network; `None` if it is malformed.
    pub fn decode(b: &[u8]) -> Option<Directory> {
        let mut r = Reader(b);
        if r.u32()? != DIRECTORY_MAGIC {
            return None;
        }
        let count = r.u32()?;
        if count == 0 || count > u32::from(crate::proto::shard_map::MAX_SHARDS) {
            return None;
        }
        let node_id = NodeId::new(r.u64()?);
        let incarnation = Incarnation::new(r.u64()?);
        let mut workers = Vec::with_capacity(count as usize);
        for _ in 0..count {
            let len = r.u32()? as usize;
            if len == 0 || len > MAX_ADDR_LEN {
                return None;
            }
            workers.push(WorkerAddress::from_bytes(r.take(len)?.to_vec()));
        }
        if !r.0.is_empty() {
            return None;
        }
        Some(Directory {
            node_id,
            incarnation,
            workers,
        })
    }

    /// The node's shard count.
    pub fn shard_count(&self) -> u16 {
        // The decoder caps the count at MAX_SHARDS, which fits.
        u16::try_from(self.workers.len()).unwrap_or(u16::MAX)
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    fn u32(&mut self) -> Option<u32> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.take(4)?);
        Some(u32::from_le_bytes(w))
    }

    fn u64(&mut self) -> Option<u64> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Some(u64::from_le_bytes(w))
    }
}

/// The UCX AM header of a [`FRAME_AM`] message from `node` whose payload starts with an address
/// of `addr_len` bytes.
pub fn frame_am_header(node: NodeId, addr_len: u32) -> [u8; AM_HEADER_LEN] {
    let mut h = [0u8; AM_HEADER_LEN];
    h[..8].copy_from_slice(&node.get().to_le_bytes());
    h[8..12].copy_from_slice(&addr_len.to_le_bytes());
    h
}

fn parse_am_header(h: &[u8]) -> Option<(NodeId, usize)> {
    if h.len() != AM_HEADER_LEN || h[12..].iter().any(|&b| b != 0) {
        return None;
    }
    let mut r = Reader(h);
    let node = NodeId::new(r.u64()?);
    let addr_len = r.u32()? as usize;
    (addr_len <= MAX_ADDR_LEN).then_some((node, addr_len))
}

impl<T> Queue<T> {
    fn new() -> Rc<Self> {
        Rc::new(Self {
            items: RefCell::new(VecDeque::new()),
            waker: RefCell::new(None),
            closed: Cell::new(false),
        })
    }

    fn push(&self, item: T) -> bool {
        if self.closed.get() {
            return false;
        }
        self.items.borrow_mut().push_back(item);
        self.wake();
        true
    }

    fn close(&self) {
        self.closed.set(true);
        self.wake();
    }

    fn wake(&self) {
        let w = self.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn try_next(&self) -> Option<T> {
        self.items.borrow_mut().pop_front()
    }

    fn next(&self) -> impl Future<Output = Option<T>> + '_ {
        poll_fn(move |cx| {
            if let Some(item) = self.try_next() {
                Poll::Ready(Some(item))
            } else if self.closed.get() {
                Poll::Ready(None)
            } else {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.out.close();
    }
}

impl NetState {
    pub(crate) fn new(settings: NodeSettings, worker: &Worker) -> Result<Self, crate::ucx::Error> {
        Ok(Self {
            settings,
            epoch: Instant::now(),
            my_address: worker.address()?.as_bytes().to_vec(),
            inbox: Queue::new(),
            directories: Queue::new(),
            bootstrap_lock: Semaphore::new(1),
            peers: RefCell::new(HashMap::new()),
            handlers: RefCell::new(HashMap::new()),
            stats: Cell::new(NetStats::default()),
            generation: Cell::new(0),
            tasks: RefCell::new(Vec::new()),
            live_senders: Rc::new(Cell::new(0)),
        })
    }

    fn now(&self) -> Timestamp {
        Timestamp::from_nanos(u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX))
    }

    fn count(&self, f: impl FnOnce(&mut NetStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    fn ep_options(&self) -> EpOptions {
        EpOptions {
            error_mode: self.settings.error_mode,
        }
    }
}

/// Registers the shard's AM handlers and starts its net task. Called once per shard before its
/// mesh starts serving, so that a shard that has answered the directory gathering (see
/// [`listen`]) already handles frames.
pub(crate) fn install(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    let shard = ctx.id().index();
    let ucx = |source| crate::BootError::Ucx { shard, source };
    let net = ctx.net();
    let inbox = net.inbox.clone();
    ctx.worker()
        .set_am_handler(FRAME_AM, move |header, payload| {
            let item = match (parse_am_header(header), payload) {
                (Some((node, addr_len)), AmPayload::Data(d)) => Inbound::Frame {
                    node,
                    addr_len,
                    bytes: d.into_vec(),
                },
                _ => Inbound::Malformed,
            };
            inbox.push(item);
        })
        .map_err(ucx)?;
    let dirs = net.directories.clone();
    ctx.worker()
        .set_am_handler(DIRECTORY_AM, move |_header, payload| {
            if let AmPayload::Data(d) = payload {
                dirs.push(d.into_vec());
            }
        })
        .map_err(ucx)?;
    let task = glommio::spawn_local(net_loop(ctx.clone()));
    net.tasks.borrow_mut().push(task);
    Ok(())
}

/// On shard 0 of a listening node: gathers the directory and starts the listener. Called once
/// per shard after the mesh has started, before the user future.
pub(crate) async fn listen(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    let shard = ctx.id().index();
    let ucx = |source| crate::BootError::Ucx { shard, source };
    let net = ctx.net();
    if shard == 0 {
        if let Some(addr) = net.settings.listen {
            let dir = gather_directory(ctx).await?;
            let listener = Listener::bind(ctx.worker(), addr).map_err(ucx)?;
            let local = listener.local_addr().map_err(ucx)?;
            let _ = net.settings.listen_addr.set(local);
            let task = glommio::spawn_local(accept_loop(Rc::downgrade(ctx), listener, dir));
            net.tasks.borrow_mut().push(task);
        }
    }
    Ok(())
}

/// Closes every connection (sending `Close` where a session is up), lets the sender tasks
/// flush within the linger time, and stops the net task and the listener.
pub(crate) async fn shutdown(ctx: &Rc<ShardCtx>) {
    let net = ctx.net();
    let now = net.now();
    let nodes: Vec<NodeId> = net.peers.borrow().keys().copied().collect();
    for node in nodes {
        if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
            p.conn.close(now);
        }
        service(net, node);
        net.peers.borrow_mut().remove(&node);
    }
    net.inbox.close();
    // Each sender ends within the linger time once its queue is closed.
    let deadline = Instant::now() + net.settings.cfg.linger + Duration::from_millis(100);
    while net.live_senders.get() > 0 && Instant::now() < deadline {
        sleep(Duration::from_millis(1)).await;
    }
    let tasks = std::mem::take(&mut *net.tasks.borrow_mut());
    for t in tasks {
        t.cancel().await;
    }
}

async fn gather_directory(ctx: &Rc<ShardCtx>) -> Result<Rc<Vec<u8>>, crate::BootError> {
    let mut workers = Vec::with_capacity(ctx.shard_count());
    for i in 0..ctx.shard_count() {
        // The shard count was checked to fit u16 at boot.
        let to = ShardId::new(u16::try_from(i).unwrap_or(u16::MAX));
        let bytes = ctx
            .forward(to, |c| async move {
                c.worker().address().map(|a| a.as_bytes().to_vec())
            })
            .await
            .map_err(|e| crate::BootError::Listen {
                shard: 0,
                reason: e.to_string(),
            })?
            .map_err(|source| crate::BootError::Ucx { shard: i, source })?;
        workers.push(WorkerAddress::from_bytes(bytes));
    }
    let dir = Directory {
        node_id: ctx.node_id(),
        incarnation: ctx.incarnation(),
        workers,
    };
    Ok(Rc::new(dir.encode()))
}

async fn accept_loop(ctx: Weak<ShardCtx>, listener: Listener, dir: Rc<Vec<u8>>) {
    loop {
        let request = listener.accept().await;
        let Some(c) = ctx.upgrade() else { return };
        let linger = c.net().settings.cfg.connect_timeout;
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let Ok(ep) = Endpoint::accept(c.worker(), request, opts) else {
            continue;
        };
        let payload = dir.as_ref().clone();
        let weak = ctx.clone();
        drop(c);
        glommio::spawn_local(async move {
            let send = ep.am_send(DIRECTORY_AM, &[], payload, AmProto::Eager);
            if let Some(c) = weak.upgrade() {
                c.wake_driver();
            }
            let (res, _payload) = send.await;
            if res.is_ok() {
                let _ = future::or(ep.flush(), async {
                    sleep(linger).await;
                    Ok(())
                })
                .await;
                // Keep the endpoint until the client leaves (or the timeout), so that a close
                // from this side cannot overtake the directory.
                future::or(
                    async {
                        ep.failed().await;
                    },
                    sleep(linger),
                )
                .await;
            }
        })
        .detach();
    }
}

/// The per-shard net task: inputs, timers, outputs (see the module docs).
async fn net_loop(ctx: Rc<ShardCtx>) {
    let net = ctx.net().clone();
    loop {
        let first = match next_timeout(&net) {
            Some(t) => {
                let d = t.saturating_duration_since(net.now());
                future::or(async { net.inbox.next().await.map(Some) }, async {
                    sleep(d).await;
                    Some(None)
                })
                .await
            }
            None => net.inbox.next().await.map(Some),
        };
        let Some(first) = first else { return };
        let mut deliveries = Vec::new();
        let mut item = first;
        loop {
            if let Some(i) = item {
                if let Some(d) = handle_inbound(&ctx, &net, i) {
                    deliveries.push(d);
                }
            }
            item = match net.inbox.try_next() {
                Some(i) => Some(i),
                None => break,
            };
        }
        handle_timeouts(&net);
        for (node, id, payload) in deliveries {
            let h = net.handlers.borrow().get(&id).cloned();
            match h {
                Some(h) => {
                    net.count(|s| s.delivered += 1);
                    h(&ctx, node, payload);
                }
                None => net.count(|s| s.dropped_no_handler += 1),
            }
        }
    }
}

fn next_timeout(net: &NetState) -> Option<Timestamp> {
    net.peers
        .borrow()
        .values()
        .filter_map(|p| p.conn.poll_timeout())
        .min()
}

fn handle_timeouts(net: &NetState) {
    let now = net.now();
    let due: Vec<NodeId> = net
        .peers
        .borrow()
        .iter()
        .filter(|(_, p)| p.conn.poll_timeout().is_some_and(|t| t <= now))
        .map(|(n, _)| *n)
        .collect();
    for node in due {
        if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
            p.conn.handle_timeout(now);
        }
        service(net, node);
    }
}

/// Handles one input; returns an application frame to deliver.
fn handle_inbound(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    item: Inbound,
) -> Option<(NodeId, AmId, Vec<u8>)> {
    let now = net.now();
    match item {
        Inbound::Wake => None,
        Inbound::Malformed => {
            net.count(|s| s.dropped_malformed += 1);
            None
        }
        Inbound::TransportError { node, generation } => {
            if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
                if p.generation == generation {
                    p.conn.handle_transport_error(now);
                }
            }
            service(net, node);
            None
        }
        Inbound::Frame {
            node,
            addr_len,
            bytes,
        } => {
            let (Some(addr), Some(frame)) = (bytes.get(..addr_len), bytes.get(addr_len..)) else {
                net.count(|s| s.dropped_malformed += 1);
                return None;
            };
            let Ok((header, payload)) = decode_frame(frame, &Limits::default()) else {
                net.count(|s| s.dropped_malformed += 1);
                return None;
            };
            let known = net.peers.borrow().contains_key(&node);
            if !known && !accept_hello(ctx, net, node, addr, &header, payload) {
                return None;
            }
            let received = match net.peers.borrow_mut().get_mut(&node) {
                Some(p) => p.conn.handle_frame(now, &header, payload),
                None => return None,
            };
            service(net, node);
            match received {
                Received::Deliver if header.kind == FrameKind::Am => {
                    Some((node, AmId::new(header.id), payload.to_vec()))
                }
                Received::Deliver | Received::Consumed => None,
                Received::Dropped(crate::proto::conn::DropReason::NotReady) => {
                    net.count(|s| s.dropped_unauthenticated += 1);
                    None
                }
                Received::Dropped(_) => {
                    net.count(|s| s.dropped_other += 1);
                    None
                }
            }
        }
    }
}

/// A frame from a node without a connection: if it is a well-formed hello from that node, to
/// this shard as its owner, with a worker address, make the reverse endpoint and a server
/// connection. Otherwise count the frame as dropped.
fn accept_hello(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    addr: &[u8],
    header: &FrameHeader,
    payload: &[u8],
) -> bool {
    match HandshakeMessage::decode(header.kind, payload) {
        Ok(HandshakeMessage::Hello(h)) if h.node_id == node && !addr.is_empty() => {}
        Ok(HandshakeMessage::Hello(_)) => {
            net.count(|s| s.dropped_malformed += 1);
            return false;
        }
        _ => {
            net.count(|s| s.dropped_unauthenticated += 1);
            return false;
        }
    }
    if local_map(ctx).owner_of(node) != ctx.id() {
        net.count(|s| s.dropped_misrouted += 1);
        return false;
    }
    let Some(psk) = net.settings.psk.clone() else {
        net.count(|s| s.dropped_unauthenticated += 1);
        return false;
    };
    let Ok(seeds) = seeds() else {
        return false;
    };
    let address = WorkerAddress::from_bytes(addr.to_vec());
    let Ok(ep) = Endpoint::connect_to_worker(ctx.worker(), &address, net.ep_options()) else {
        net.count(|s| s.dropped_malformed += 1);
        return false;
    };
    let cfg = net
        .settings
        .cfg
        .conn_config(&net.settings, psk, shard_count_u16(ctx), ctx.id());
    let conn = Connection::server(net.now(), cfg, seeds);
    insert_peer(ctx, net, node, conn, ep);
    true
}

fn insert_peer(ctx: &Rc<ShardCtx>, net: &NetState, node: NodeId, conn: Connection, ep: Endpoint) {
    let generation = net.generation.get() + 1;
    net.generation.set(generation);
    let out = Queue::new();
    let live = net.live_senders.clone();
    live.set(live.get() + 1);
    let send = sender(
        Rc::downgrade(ctx),
        ep,
        out.clone(),
        net.inbox.clone(),
        node,
        generation,
        net.settings.cfg.linger,
    );
    glommio::spawn_local(async move {
        send.await;
        live.set(live.get() - 1);
    })
    .detach();
    net.peers.borrow_mut().insert(
        node,
        Peer {
            conn,
            out,
            generation,
            waiters: Vec::new(),
        },
    );
}

/// Owns a connection's endpoint: sends its frames in order; reports the endpoint's failure.
async fn sender(
    ctx: Weak<ShardCtx>,
    ep: Endpoint,
    out: Rc<Queue<Outbound>>,
    inbox: Rc<Queue<Inbound>>,
    node: NodeId,
    generation: u64,
    linger: Duration,
) {
    enum Next {
        Frame(Option<Outbound>),
        Failed,
    }
    loop {
        let next = future::or(async { Next::Frame(out.next().await) }, async {
            ep.failed().await;
            Next::Failed
        })
        .await;
        match next {
            Next::Frame(Some((header, payload))) => {
                let send = ep.am_send(FRAME_AM, &header, payload, AmProto::Eager);
                if let Some(c) = ctx.upgrade() {
                    c.wake_driver();
                }
                let (res, _payload) = send.await;
                if res.is_err() {
                    inbox.push(Inbound::TransportError { node, generation });
                    break;
                }
            }
            Next::Frame(None) => break,
            Next::Failed => {
                inbox.push(Inbound::TransportError { node, generation });
                break;
            }
        }
    }
    // Let the last frames (a reject, a close) leave before the endpoint goes.
    let _ = future::or(ep.flush(), async {
        sleep(linger).await;
        Ok(())
    })
    .await;
}

/// Drains a connection's outputs after an input: frames to its sender, events to waiters; and
/// removes it once failed or closed.
fn service(net: &NetState, node: NodeId) {
    let mut peers = net.peers.borrow_mut();
    let Some(p) = peers.get_mut(&node) else {
        return;
    };
    while let Some(t) = p.conn.poll_transmit() {
        let frame = t.to_vec();
        let (header, payload) = if t.header.kind == FrameKind::Hello {
            let mut payload = net.my_address.clone();
            payload.extend_from_slice(&frame);
            let len = u32::try_from(net.my_address.len()).unwrap_or(u32::MAX);
            (frame_am_header(net.settings.node_id, len), payload)
        } else {
            (frame_am_header(net.settings.node_id, 0), frame)
        };
        p.out.push((header, payload));
    }
    let mut handshakes = 0;
    while let Some(ev) = p.conn.poll_event() {
        match ev {
            Event::Connected(info) => {
                handshakes += 1;
                let remote = RemoteNode {
                    node_id: info.node_id,
                    incarnation: info.incarnation,
                    shard_count: info.shard_count,
                    owner: p.conn.config().local_shard,
                    remote_shard: p.conn.remote_shard(),
                };
                for w in p.waiters.drain(..) {
                    w.push(Ok(remote));
                }
            }
            Event::Failed { reason } => {
                let err = fail_error(node, reason);
                for w in p.waiters.drain(..) {
                    w.push(Err(err.clone()));
                }
            }
            _ => {}
        }
    }
    let gone = matches!(p.conn.state(), State::Failed | State::Closed);
    if gone {
        for w in p.waiters.drain(..) {
            w.push(Err(NetError::Closed { node }));
        }
        peers.remove(&node);
    }
    drop(peers);
    if handshakes > 0 {
        net.count(|s| s.handshakes += handshakes);
    }
}

fn fail_error(node: NodeId, reason: FailReason) -> NetError {
    match reason {
        FailReason::Handshake(HandshakeError::Rejected { reason }) => {
            NetError::Refused { node, reason }
        }
        FailReason::Handshake(HandshakeError::BadProof) => NetError::Refused {
            node,
            reason: RejectReason::BadProof,
        },
        FailReason::Handshake(HandshakeError::Timeout) => NetError::TimedOut { what: "handshake" },
        FailReason::Handshake(source) => NetError::Handshake { node, source },
        FailReason::PeerDead => NetError::PeerDead { node },
        _ => NetError::Transport { node },
    }
}

fn local_map(ctx: &ShardCtx) -> ShardMap {
    #[allow(clippy::expect_used)]
    // Invariant: `ShardsBuilder::run` refuses shard counts outside 1..=MAX_SHARDS.
    ShardMap::new(shard_count_u16(ctx)).expect("shard count checked at boot")
}

fn shard_count_u16(ctx: &ShardCtx) -> u16 {
    u16::try_from(ctx.shard_count()).unwrap_or(u16::MAX)
}

fn seeds() -> Result<Seeds, NetError> {
    let mut b = [0u8; 40];
    os_random(&mut b).map_err(|e| NetError::Random {
        reason: e.to_string(),
    })?;
    let mut rng = [0u8; 8];
    rng.copy_from_slice(&b[..8]);
    let mut nonce = [0u8; 32];
    nonce.copy_from_slice(&b[8..]);
    Ok(Seeds {
        rng: u64::from_le_bytes(rng),
        nonce,
    })
}

/// Fills `buf` from `/dev/urandom`.
pub(crate) fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

/// Opens (or joins) the session with `node` on this shard, its owner.
async fn open(
    ctx: &Rc<ShardCtx>,
    node: NodeId,
    address: WorkerAddress,
) -> Result<RemoteNode, NetError> {
    let net = ctx.net();
    let waiter = Queue::new();
    let joined = match net.peers.borrow_mut().get_mut(&node) {
        Some(p) => {
            if let Some(r) = ready_remote(&p.conn) {
                return Ok(r);
            }
            p.waiters.push(waiter.clone());
            true
        }
        None => false,
    };
    if !joined {
        let psk = net.settings.psk.clone().ok_or(NetError::NoKey)?;
        let ep = Endpoint::connect_to_worker(ctx.worker(), &address, net.ep_options())
            .map_err(|source| NetError::Ucx { source })?;
        let cfg = net
            .settings
            .cfg
            .conn_config(&net.settings, psk, shard_count_u16(ctx), ctx.id());
        let mut conn = Connection::client(cfg, node, seeds()?);
        conn.connect(net.now())
            .map_err(|_| NetError::Closed { node })?;
        insert_peer(ctx, net, node, conn, ep);
        if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
            p.waiters.push(waiter.clone());
        }
        service(net, node);
        net.inbox.push(Inbound::Wake);
    }
    let limit = net.settings.cfg.handshake_timeout + Duration::from_secs(1);
    let got = future::or(async { waiter.next().await }, async {
        sleep(limit).await;
        None
    })
    .await;
    got.unwrap_or(Err(NetError::TimedOut { what: "handshake" }))
}

fn ready_remote(conn: &Connection) -> Option<RemoteNode> {
    let peer = conn.peer()?;
    matches!(conn.state(), State::Ready).then(|| RemoteNode {
        node_id: peer.node_id,
        incarnation: peer.incarnation,
        shard_count: peer.shard_count,
        owner: conn.config().local_shard,
        remote_shard: conn.remote_shard(),
    })
}

/// Queues an application frame to `node` on this shard, its owner.
fn send_local(ctx: &ShardCtx, node: NodeId, id: AmId, payload: &[u8]) -> Result<(), NetError> {
    let net = ctx.net();
    let limits = Limits::default();
    let peers = net.peers.borrow();
    let p = peers.get(&node).ok_or(NetError::NotConnected { node })?;
    let mut header = p
        .conn
        .frame_header(FrameKind::Am)
        .map_err(|_| NetError::NotConnected { node })?;
    header.id = id.get();
    header.payload_len = payload.len() as u64;
    let len = frame_len(header.payload_len, &limits).map_err(|source| NetError::Wire { source })?;
    let mut frame = vec![0u8; len];
    encode_frame(&header, payload, &mut frame, &limits)
        .map_err(|source| NetError::Wire { source })?;
    if p.out
        .push((frame_am_header(net.settings.node_id, 0), frame))
    {
        Ok(())
    } else {
        Err(NetError::NotConnected { node })
    }
}

impl ShardCtx {
    /// This node's id (the same on every shard of the set).
    pub fn node_id(&self) -> NodeId {
        self.net().settings.node_id
    }

    /// This node's incarnation (fresh for every run unless configured).
    pub fn incarnation(&self) -> Incarnation {
        self.net().settings.incarnation
    }

    /// The address the node's listener is bound to (known once shard 0 has bound it, before any
    /// user future starts on shard 0), or `None` if the node does not listen.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.net().settings.listen_addr.get().copied()
    }

    /// The shard of this node that owns (holds the connection to) `node`.
    pub fn owner_of(&self, node: NodeId) -> ShardId {
        local_map(self).owner_of(node)
    }

    /// This shard's connection counters.
    pub fn net_stats(&self) -> NetStats {
        self.net().stats.get()
    }

    /// Remote nodes with a ready connection on this shard.
    pub fn connected_nodes(&self) -> Vec<RemoteNode> {
        self.net()
            .peers
            .borrow()
            .values()
            .filter_map(|p| ready_remote(&p.conn))
            .collect()
    }

    /// Registers, on this shard, the handler of application frames with `id` from connected
    /// nodes (replacing any previous one). It runs on the shard's net task; it must not block,
    /// and may spawn tasks (e.g. to answer with [`ShardCtx::send_am`]). Register it on every
    /// shard that may own a peer.
    pub fn set_net_handler<F>(&self, id: AmId, handler: F)
    where
        F: Fn(&Rc<ShardCtx>, NodeId, Vec<u8>) + 'static,
    {
        self.net()
            .handlers
            .borrow_mut()
            .insert(id, Rc::new(handler));
    }

    /// Fetches the directory of the node listening at `addr`, from this shard (see the module
    /// docs). Bounded by [`NetConfig::connect_timeout`].
    pub async fn bootstrap(&self, addr: SocketAddr) -> Result<Directory, NetError> {
        let net = self.net();
        let _permit = net
            .bootstrap_lock
            .acquire_permit(1)
            .await
            .map_err(|_| NetError::ShuttingDown)?;
        while net.directories.try_next().is_some() {}
        let opts = EpOptions {
            error_mode: ErrorMode::Peer,
        };
        let ep = Endpoint::connect(self.worker(), addr, opts)
            .map_err(|source| NetError::Unreachable { addr, source })?;
        self.wake_driver();
        enum Outcome {
            Dir(Option<Vec<u8>>),
            Failed(crate::ucx::Error),
            Timeout,
        }
        let timeout = net.settings.cfg.connect_timeout;
        let outcome = future::or(
            async { Outcome::Dir(net.directories.next().await) },
            future::or(async { Outcome::Failed(ep.failed().await) }, async {
                sleep(timeout).await;
                Outcome::Timeout
            }),
        )
        .await;
        drop(ep);
        match outcome {
            Outcome::Dir(Some(bytes)) => {
                Directory::decode(&bytes).ok_or(NetError::BadDirectory { addr })
            }
            Outcome::Dir(None) => Err(NetError::ShuttingDown),
            Outcome::Failed(source) => Err(NetError::Unreachable { addr, source }),
            Outcome::Timeout => Err(NetError::TimedOut { what: "bootstrap" }),
        }
    }

    /// Connects this node to the node listening at `addr`, from any shard: bootstraps from this
    /// shard, then runs the handshake on the owner shards of both sides (forwarding here to the
    /// local owner). Returns the existing session if there is one.
    pub async fn connect(self: &Rc<Self>, addr: SocketAddr) -> Result<RemoteNode, NetError> {
        if self.net().settings.psk.is_none() {
            return Err(NetError::NoKey);
        }
        let dir = self.bootstrap(addr).await?;
        if dir.node_id == self.node_id() {
            return Err(NetError::SelfConnect);
        }
        let remote_map =
            ShardMap::new(dir.shard_count()).map_err(|_| NetError::BadDirectory { addr })?;
        let r = remote_map.owner_of(self.node_id());
        let address = dir
            .workers
            .get(r.index())
            .cloned()
            .ok_or(NetError::BadDirectory { addr })?;
        let node = dir.node_id;
        let owner = self.owner_of(node);
        if owner == self.id() {
            open(self, node, address).await
        } else {
            self.forward(owner, move |c| async move { open(&c, node, address).await })
                .await?
        }
    }

    /// Sends application frame `id` with `payload` to the connected `node`, from any shard
    /// (forwarded to the owner). Resolves once the frame is queued on the owner's endpoint.
    pub async fn send_am(
        self: &Rc<Self>,
        node: NodeId,
        id: AmId,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let owner = self.owner_of(node);
        if owner == self.id() {
            send_local(self, node, id, &payload)
        } else {
            self.forward(
                owner,
                move |c| async move { send_local(&c, node, id, &payload) },
            )
            .await?
        }
    }
}

/// The error mode for `transports` (see the module docs).
pub(crate) fn error_mode_for(transports: Option<&str>) -> ErrorMode {
    let tls = transports
        .map(str::to_owned)
        .or_else(|| std::env::var("UCX_TLS").ok());
    match tls {
        Some(t)
            if !t
                .split(',')
                .any(|x| x.trim().contains("tcp") || x.trim() == "all") =>
        {
            ErrorMode::None
        }
        _ => ErrorMode::Peer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_round_trip_and_rejects_garbage() {
        let d = Directory {
            node_id: NodeId::new(7),
            incarnation: Incarnation::new(9),
            workers: vec![
                WorkerAddress::from_bytes(vec![1, 2, 3]),
                WorkerAddress::from_bytes(vec![4]),
            ],
        };
        let b = d.encode();
        assert_eq!(Directory::decode(&b), Some(d));
        for cut in 0..b.len() {
            assert_eq!(Directory::decode(&b[..cut]), None);
        }
        let mut long = b.clone();
        long.push(0);
        assert_eq!(Directory::decode(&long), None);
    }

    #[test]
    fn am_header_round_trip() {
        let h = frame_am_header(NodeId::new(42), 17);
        assert_eq!(parse_am_header(&h), Some((NodeId::new(42), 17)));
        assert_eq!(parse_am_header(&h[..8]), None);
        let mut bad = h;
        bad[15] = 1;
        assert_eq!(parse_am_header(&bad), None);
    }

    #[test]
    fn error_mode_follows_transports() {
        assert_eq!(error_mode_for(Some("sm,self")), ErrorMode::None);
        assert_eq!(error_mode_for(Some("sm,tcp")), ErrorMode::Peer);
        assert_eq!(error_mode_for(Some("tcp")), ErrorMode::Peer);
    }
}
