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
//! A frame travels as one eager active message [`FRAME_AM`] whose UCX AM header is
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
//! not `Ready`, is dropped and counted ([`NetStats::dropped_unauthenticated`]).
//!
//! An application frame whose payload is longer than [`NetConfig::rndv_threshold`] (8 KiB by
//! default) travels instead as [`FRAME_RNDV_AM`], sent with UCX rendezvous: its UCX AM header
//! is [`RNDV_AM_HEADER_LEN`] = 64 bytes, the 16 bytes above (`addr_len` zero) then the
//! 48-byte [`FrameHeader`] (with [`FrameFlags::RNDV`]), and its UCX payload is the application
//! payload itself, not copied on the sending side. The receiver's AM handler keeps UCX's
//! descriptor and queues it with the header; the net task checks the header (size limit
//! first, then `payload_len` against UCX's length, then the connection as for any frame), and
//! only then is a buffer chosen and the data pulled. Data nobody takes is declined, which
//! completes the sender's operation. The sender posts rendezvous frames in queue order, but
//! waits for their completion (the peer has pulled the data) in a task of its own, so that
//! heartbeats and small frames do not queue behind a large transfer; a transfer not done
//! within [`NetConfig::rndv_timeout`] fails the connection.
//!
//! Application frames of a ready connection are dispatched by kind:
//!
//! - [`FrameKind::Am`]: to the handler of their [`AmId`] ([`ShardCtx::set_net_handler`],
//!   which gets a `Vec<u8>`; for rendezvous data, [`ShardCtx::set_net_handler_rndv`] chooses
//!   the destination buffer, else the data is pulled into a vector for the plain handler).
//!   [`ShardCtx::send_am`] sends one from any shard.
//! - Requests ([`FrameKind::RpcRequest`], [`FrameKind::RmaPut`], [`FrameKind::RmaGet`]) and
//!   [`FrameKind::RpcCancel`]: to the handler of their kind ([`ShardCtx::set_frame_handler`]),
//!   with the frame header (`id`, `req_id`, `ttl_ns`). A request whose `ttl_ns` is zero had no
//!   time left when sent and is dropped ([`NetStats::dropped_expired`]). The handler answers
//!   with [`ShardCtx::reply`]. For rendezvous data of a request kind,
//!   [`ShardCtx::set_frame_handler_rndv`] chooses the destination buffer per frame (a
//!   [`RndvBuf`]: pool, aligned host memory or a vector), else it is pulled into a vector.
//! - Replies ([`FrameKind::RpcResponse`], [`FrameKind::RpcError`], [`FrameKind::RmaReply`]):
//!   complete the pending request with their `req_id` on this shard, if it was sent to that
//!   node with a kind the reply answers; others are dropped
//!   ([`NetStats::dropped_unmatched`]).
//!
//! ## Requests
//!
//! [`ShardCtx::request`] runs on the shard that owns the peer (forwarded there from other
//! shards, and its result forwarded back). The owner keeps one [`PendingTable`] of requests
//! for all its peers, so request ids are never reused on a connection, even across sessions.
//! The request's deadline (`now + timeout`) travels as the frame's `ttl_ns`. The request ends
//! with the first of: a matching reply; its deadline ([`NetError::TimedOut`]); the failure or
//! close of the connection, which fails every request pending for that node with the
//! connection's error ([`NetError::PeerDead`], [`NetError::Transport`], [`NetError::Closed`]);
//! a restart of the peer (its old incarnation's requests fail with [`NetError::Closed`]); this
//! node's shutdown, which first waits for pending requests' answers for at most the mesh's
//! drain timeout ([`NetError::ShuttingDown`] after it). A dropped request future removes its
//! entry, also when the caller is on another shard: the forwarded job on the owner races the
//! request with a cancel flag that the caller's future sets when it is dropped (the mesh
//! itself runs a forwarded job to its end). An [`FrameKind::RpcRequest`] given up before its
//! answer (dropped, or timed out) is followed by an [`FrameKind::RpcCancel`] frame with its
//! `id` and `req_id`, for the server to stop working on it.
//! [`ShardCtx::request_with_ttl`] announces less time to the receiver than the caller waits,
//! so that a receiver can report its own deadline expiring before the caller gives up.
//!
//! Deadlines cost no timer per request: the net task keeps one timer, armed for the earliest
//! deadline of the shard (its connections' and its requests'), and fails the requests whose
//! deadline has passed when it fires. A request is therefore failed at its deadline plus the
//! timer's lateness (glommio's timer resolution and the executor's wake-up, as with a timer of
//! its own), plus, on a busy shard, the time the net task takes to get its turn. The timer is
//! moved only to an earlier deadline: when the earliest request is answered, the timer fires
//! at its (now useless) deadline and is set again for the next one, so answered requests cost
//! no timer operation, and an idle shard has no timer (or at most one stale one) armed.
//!
//! An eager application frame is sent inline by the caller that queues it (on the owner
//! shard), without a switch to the connection's sender task, when nothing queued must go
//! first: it is done at once when UCX completes the send in place, and otherwise handed to the
//! sender task, which keeps its buffer alive and reports its failure as for its own sends.
//!
//! The net task also follows proto's calling order: after each input it drains
//! `poll_transmit` (into the connection's sender task, which owns the endpoint and sends frames
//! in order) and `poll_event`, and it sleeps until the earliest `poll_timeout` (handshake
//! deadline, heartbeats, suspicion and death, and the pending requests' deadlines) or the
//! next input. An endpoint error becomes
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
//! - Payloads are capped by [`NetConfig::max_message_size`] (16 MiB by default) on both
//!   sides: a sender refuses a larger one with [`NetError::TooLarge`] before forwarding it; a
//!   receiver checks the announced length before it allocates or pulls anything (an eager
//!   message is refused before it is copied out of UCX's buffer) and counts it in
//!   [`NetStats::dropped_too_large`]. Nodes with different limits can talk, but a frame over
//!   the receiver's limit is dropped silently (a request then times out).
//! - A request nobody handles is dropped, not answered with an error: its sender times out.
//! - There is no retry and no at-most-once window here: that is the RPC layer's, on top.
//! - No flow control: the number of requests in flight is bounded only by the mesh's lane
//!   capacity (from other shards) and by memory; rendezvous transfers in flight are not
//!   capped, and a receiver's pull of rendezvous data cannot hand its buffer back on timeout
//!   (UCX may still write it; it is dropped once UCX lets go).
//! - Rendezvous data arrives in order of its headers, but a rendezvous handler's `on_data`
//!   may run after handlers of frames that arrived later.
//! - Half-open handshakes from unauthenticated nodes are not capped in number.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::io::Read;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::future;
use glommio::sync::Semaphore;
use glommio::timer::{sleep, Timer};
use glommio::Task;

use crate::boot::ShardCtx;
use crate::error::NetError;
use crate::pool::PoolBuf;
use crate::proto::conn::{DropReason, FailReason, Received};
use crate::proto::handshake::{HandshakeError, HandshakeMessage, RejectReason};
use crate::proto::request::DedupHasher;
use crate::proto::wire::{
    decode_frame, encode_frame, frame_len, payload_offset, ttl_from_deadline, HEADER_LEN,
    NO_DEADLINE_TTL,
};
use crate::proto::{
    AmId, ConnConfig, Connection, Event, FrameFlags, FrameHeader, FrameKind, HandshakeConfig,
    Incarnation, Limits, NodeId, PendingTable, PreSharedKey, ReqId, Seeds, ShardId, ShardMap,
    State, Timestamp, WireError,
};
use crate::ucx::{
    AlignedBuf, AmIdRaw, AmPayload, AmProto, AmRndv, AmSend, Endpoint, EpOptions, ErrorMode,
    IoBufMut,
};
use crate::ucx::{Listener, Worker, WorkerAddress};

/// UCX active-message id of the bootstrap directory (listener → client).
pub const DIRECTORY_AM: AmIdRaw = 0x5C00;
/// UCX active-message id of every frame between connected nodes.
pub const FRAME_AM: AmIdRaw = 0x5C01;
/// Bytes of the UCX AM header of a [`FRAME_AM`] message (see the module docs).
pub const AM_HEADER_LEN: usize = 16;
/// UCX active-message id of application frames whose payload follows by rendezvous.
pub const FRAME_RNDV_AM: AmIdRaw = 0x5C02;
/// Bytes of the UCX AM header of a [`FRAME_RNDV_AM`] message: the [`AM_HEADER_LEN`]-byte header
/// of [`FRAME_AM`] (with `addr_len` zero) followed by the 48-byte [`FrameHeader`].
pub const RNDV_AM_HEADER_LEN: usize = AM_HEADER_LEN + HEADER_LEN;
/// Longest timeout a [`ShardCtx::request`] may wait (longer ones are cut to this).
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

const DIRECTORY_MAGIC: u32 = u32::from_le_bytes(*b"SCXD");
/// How often a shard that is shutting down looks whether its requests have been answered.
const DRAIN_POLL: Duration = Duration::from_millis(2);
/// Largest worker address accepted in a directory or a hello.
const MAX_ADDR_LEN: usize = 64 << 10;
/// Entries of a shard's owner cache (see [`ShardCtx::owner_of`]).
const OWNER_CACHE: usize = 16;
/// Inputs the net task handles with one reading of the clock.
const BATCH_CLOCK: u32 = 32;

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
    /// Application payloads longer than this many bytes travel by rendezvous
    /// ([`FRAME_RNDV_AM`]); shorter ones eager. Default 8 KiB.
    pub rndv_threshold: usize,
    /// Largest application payload this node sends or accepts, checked before anything is
    /// allocated for it. Default [`Limits::DEFAULT_MAX_MESSAGE_SIZE`] (16 MiB).
    pub max_message_size: u64,
    /// Time allowed for one rendezvous transfer, on either side, default 10 s. A sender whose
    /// payload is not pulled in time fails the connection; a receiver that has not received
    /// the data in time gives up on it ([`NetError::TimedOut`]).
    pub rndv_timeout: Duration,
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
    /// Application frames received by rendezvous (whatever became of them).
    pub rendezvous: u64,
    /// Frames dropped because their payload exceeds [`NetConfig::max_message_size`]
    /// (nothing was allocated for them; rendezvous data was declined).
    pub dropped_too_large: u64,
    /// Requests dropped because their deadline (`ttl_ns`) had already passed when sent.
    pub dropped_expired: u64,
    /// Replies that match no pending request of this shard (late, or from another node).
    pub dropped_unmatched: u64,
    /// Rendezvous frames declined by the handler's buffer choice, or whose pull failed.
    pub declined: u64,
    /// [`FrameKind::RpcCancel`] frames sent for RPC requests given up before their reply.
    pub cancels_sent: u64,
    /// Eager frames sent inline by the caller (see "Frames") whose send UCX had not completed
    /// at once: handed to the connection's sender task, which waits for them in order.
    pub inline_in_flight: u64,
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
type FrameHandler = Rc<dyn Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Vec<u8>)>;
type RndvHandler = Rc<dyn Fn(&Rc<ShardCtx>, NodeId, FrameHeader, AmRndv)>;
type LostHook = Rc<dyn Fn(Option<NodeId>, &NetError)>;
type Waiter = Rc<Queue<Result<RemoteNode, NetError>>>;
/// What a [`ShardCtx::request`] resolves with.
type Reply = Result<(FrameHeader, Vec<u8>), NetError>;

/// A request in flight on the shard that owns its node.
struct Pending {
    node: NodeId,
    kind: FrameKind,
    /// The frame's `id` (for the [`FrameKind::RpcCancel`] sent when it times out).
    id: u32,
    waiter: Rc<Slot<Reply>>,
}

/// Where the answer of one request lands, for the one task that waits for it (cheaper than a
/// [`Queue`]: one allocation per request).
struct Slot<T> {
    value: RefCell<Option<T>>,
    waker: RefCell<Option<Waker>>,
}

impl<T> Slot<T> {
    fn new() -> Rc<Self> {
        Rc::new(Self {
            value: RefCell::new(None),
            waker: RefCell::new(None),
        })
    }

    /// Stores the answer (the first one wins) and wakes the waiting task.
    fn push(&self, value: T) {
        {
            let mut v = self.value.borrow_mut();
            if v.is_some() {
                return;
            }
            *v = Some(value);
        }
        let w = self.waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Resolves with the answer.
    fn wait(&self) -> impl Future<Output = T> + '_ {
        poll_fn(move |cx| match self.value.borrow_mut().take() {
            Some(v) => Poll::Ready(v),
            None => {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}

/// A frame for a sender task: UCX AM header and payload; or a frame already posted by
/// [`queue_frame`] (see [`send_inline`]).
enum Outbound {
    /// A [`FRAME_AM`] message: the payload is the (address and) encoded frame.
    Eager([u8; AM_HEADER_LEN], Vec<u8>),
    /// A [`FRAME_RNDV_AM`] message: the header carries the frame header, the payload is the
    /// application payload itself (not copied).
    Rndv(Box<[u8; RNDV_AM_HEADER_LEN]>, Vec<u8>),
    /// A [`FRAME_AM`] message posted inline whose completion UCX has not reported yet: the
    /// sender awaits it (keeping its buffer alive) as if it had posted it itself.
    Posted(AmSend<Vec<u8>>),
    /// A [`FRAME_AM`] message posted inline failed at once: the sender reports the transport
    /// error and stops, as after a send of its own failed.
    Failed,
}

/// An application frame of a ready connection, for [`dispatch`].
enum Delivery {
    Eager {
        node: NodeId,
        header: FrameHeader,
        payload: Vec<u8>,
    },
    Rndv {
        node: NodeId,
        header: FrameHeader,
        data: AmPayload,
    },
}

enum Inbound {
    Frame {
        node: NodeId,
        addr_len: usize,
        bytes: Vec<u8>,
    },
    Rndv {
        node: NodeId,
        header: [u8; HEADER_LEN],
        data: AmPayload,
    },
    TooLarge,
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
    /// The sender task's endpoint, for [`send_inline`]; it goes when the sender ends.
    ep: Weak<Endpoint>,
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
    // Looked up several times per frame: hashed with proto's keyed multiply-fold hash rather
    // than SipHash (keys from the network; one random key per shard, see `DedupHasher`).
    peers: RefCell<HashMap<NodeId, Peer, DedupHasher>>,
    handlers: RefCell<HashMap<AmId, Handler, DedupHasher>>,
    rndv_handlers: RefCell<HashMap<AmId, RndvHandler, DedupHasher>>,
    frame_handlers: RefCell<HashMap<FrameKind, FrameHandler, DedupHasher>>,
    frame_rndv_handlers: RefCell<HashMap<FrameKind, RndvHandler, DedupHasher>>,
    pending: RefCell<PendingTable<Pending>>,
    limits: Limits,
    stats: Cell<NetStats>,
    generation: Cell<u64>,
    tasks: RefCell<Vec<Task<()>>>,
    /// Called when a connection ends (see [`ShardCtx::on_peer_lost`]).
    lost_hooks: RefCell<Vec<LostHook>>,
    /// The listener's accept loop (shard 0 of a listening node), until it stops accepting.
    acceptor: RefCell<Option<Task<()>>>,
    live_senders: Rc<Cell<usize>>,
    /// When the net task's timer fires ([`Timestamp::MAX`]: no timer armed). A request due
    /// earlier wakes the net task to re-arm it (see [`request_local`]).
    timer_at: Cell<Timestamp>,
    /// Recently looked-up owners ([`ShardCtx::owner_of`]), direct-mapped by node id.
    owners: [Cell<Option<(NodeId, ShardId)>>; OWNER_CACHE],
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
            rndv_threshold: 8 << 10,
            max_message_size: Limits::DEFAULT_MAX_MESSAGE_SIZE,
            rndv_timeout: Duration::from_secs(10),
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

/// Parses the UCX AM header of a [`FRAME_RNDV_AM`] message: the sender and the raw frame header.
fn parse_rndv_header(h: &[u8]) -> Option<(NodeId, [u8; HEADER_LEN])> {
    if h.len() != RNDV_AM_HEADER_LEN {
        return None;
    }
    let (node, addr_len) = parse_am_header(&h[..AM_HEADER_LEN])?;
    if addr_len != 0 {
        return None;
    }
    let mut frame = [0u8; HEADER_LEN];
    frame.copy_from_slice(&h[AM_HEADER_LEN..]);
    Some((node, frame))
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

    /// Whether the queue is open and holds nothing.
    fn is_idle(&self) -> bool {
        !self.closed.get() && self.items.borrow().is_empty()
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
        let limits = Limits {
            max_message_size: settings.cfg.max_message_size,
        };
        let hasher = DedupHasher::random();
        Ok(Self {
            settings,
            epoch: Instant::now(),
            my_address: worker.address()?.as_bytes().to_vec(),
            inbox: Queue::new(),
            directories: Queue::new(),
            bootstrap_lock: Semaphore::new(1),
            limits,
            peers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            handlers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            rndv_handlers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            frame_handlers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            frame_rndv_handlers: RefCell::new(HashMap::with_hasher(hasher)),
            pending: RefCell::new(PendingTable::new()),
            stats: Cell::new(NetStats::default()),
            generation: Cell::new(0),
            tasks: RefCell::new(Vec::new()),
            acceptor: RefCell::new(None),
            lost_hooks: RefCell::new(Vec::new()),
            live_senders: Rc::new(Cell::new(0)),
            timer_at: Cell::new(Timestamp::MAX),
            owners: Default::default(),
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
    // Largest eager message that can be valid: a hello's address and a frame at the limit.
    let cap = usize::try_from(net.settings.cfg.max_message_size)
        .unwrap_or(usize::MAX)
        .saturating_add(payload_offset() + MAX_ADDR_LEN);
    ctx.worker()
        .set_am_handler(FRAME_AM, move |header, payload| {
            let item = match (parse_am_header(header), payload) {
                // Refused before it is copied out of UCX's buffer.
                (Some(_), AmPayload::Data(d)) if d.len() > cap => Inbound::TooLarge,
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
    let inbox = net.inbox.clone();
    ctx.worker()
        .set_am_handler(FRAME_RNDV_AM, move |header, data| {
            // The data stays with UCX (rendezvous) or in its descriptor (eager) until the net
            // task has checked the frame; dropping it declines it.
            let item = match parse_rndv_header(header) {
                Some((node, header)) => Inbound::Rndv { node, header, data },
                None => Inbound::Malformed,
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
            *net.acceptor.borrow_mut() = Some(task);
        }
    }
    Ok(())
}

/// Stops accepting, waits (at most `drain`) for the requests this shard sent to be answered,
/// then closes every connection (sending `Close` where a session is up), fails what is still
/// pending with [`NetError::ShuttingDown`], lets the sender tasks flush within the linger time,
/// and stops the net task.
pub(crate) async fn shutdown(ctx: &Rc<ShardCtx>, drain: Duration) {
    ctx.stop_accepting().await;
    let net = ctx.net();
    let until = Instant::now() + drain;
    while !net.pending.borrow().is_empty() && Instant::now() < until {
        sleep(DRAIN_POLL).await;
    }
    let now = net.now();
    let nodes: Vec<NodeId> = net.peers.borrow().keys().copied().collect();
    for node in nodes {
        if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
            p.conn.close(now);
        }
        service(net, node);
        net.peers.borrow_mut().remove(&node);
    }
    let left = net.pending.borrow_mut().drain();
    for (_, p) in left {
        p.waiter.push(Err(NetError::ShuttingDown));
    }
    run_lost_hooks(net, None, &NetError::ShuttingDown);
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

/// Runs the hooks of [`ShardCtx::on_peer_lost`] (`None`: every node).
fn run_lost_hooks(net: &NetState, node: Option<NodeId>, err: &NetError) {
    // Cloned: a hook may register another.
    let hooks = net.lost_hooks.borrow().clone();
    for hook in hooks {
        hook(node, err);
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
///
/// One timer serves the connections' deadlines and the requests' ([`handle_timeouts`]). It is
/// re-armed only when the next deadline is earlier than the time it is set for: a deadline
/// that moved later (its request was answered) is waited for by letting the timer fire early
/// and arming it again then, so that answered requests cost no timer operation.
async fn net_loop(ctx: Rc<ShardCtx>) {
    let net = ctx.net().clone();
    let mut timer: Option<(Timer, bool)> = None;
    loop {
        if let Some(t) = next_timeout(&net) {
            if t < net.timer_at.get() {
                // Not before `t` on the net clock: the timer's instant is taken after `now`.
                timer = Some((Timer::new(t.saturating_duration_since(net.now())), false));
                net.timer_at.set(t);
            }
        }
        let first = poll_fn(|cx| {
            if let Some(item) = net.inbox.try_next() {
                return Poll::Ready(Some(Some(item)));
            }
            if net.inbox.closed.get() {
                return Poll::Ready(None);
            }
            *net.inbox.waker.borrow_mut() = Some(cx.waker().clone());
            let Some((t, charged)) = timer.as_mut() else {
                return Poll::Pending;
            };
            // The timer is polled (put in the reactor) once; after that the clock says whether
            // it is due: a wake-up by the timer implies it.
            let due = if *charged {
                net.now() >= net.timer_at.get()
            } else {
                *charged = true;
                std::pin::Pin::new(t).poll(cx).is_ready()
            };
            if due {
                timer = None;
                net.timer_at.set(Timestamp::MAX);
                Poll::Ready(Some(None))
            } else {
                Poll::Pending
            }
        })
        .await;
        let Some(first) = first else { return };
        let mut item = first;
        // The clock is read once per batch of inputs (and every BATCH_CLOCK of them): what
        // it dates is the connections' liveness, whose timers count in heartbeat intervals.
        let mut now = net.now();
        let mut handled = 0u32;
        loop {
            // Each frame reaches its handler before the next input is handled: a `Close` (or
            // an endpoint error) that follows data frames must not fail the requests and
            // receives those frames answer.
            if let Some(i) = item {
                handled += 1;
                if handled % BATCH_CLOCK == 0 {
                    now = net.now();
                }
                match handle_inbound(&ctx, &net, i, now) {
                    Some(Delivery::Eager {
                        node,
                        header,
                        payload,
                    }) => dispatch(&ctx, node, &header, payload),
                    Some(Delivery::Rndv { node, header, data }) => {
                        deliver_rndv(&ctx, node, header, data)
                    }
                    None => {}
                }
            }
            item = match net.inbox.try_next() {
                Some(i) => Some(i),
                None => break,
            };
        }
        handle_timeouts(&ctx, &net);
    }
}

/// Whether some handler or pending request on this shard takes `header` from `node`; counts
/// the frame as dropped when none does.
fn wanted(net: &NetState, node: NodeId, header: &FrameHeader) -> bool {
    let want = match header.kind {
        FrameKind::Am => {
            let id = AmId::new(header.id);
            net.handlers.borrow().contains_key(&id) || net.rndv_handlers.borrow().contains_key(&id)
        }
        k if is_reply_kind(k) => {
            let fits = net
                .pending
                .borrow()
                .get(header.req_id)
                .is_some_and(|p| p.node == node && reply_fits(p.kind, k));
            if !fits {
                net.count(|s| s.dropped_unmatched += 1);
                return false;
            }
            true
        }
        k => {
            if is_request_kind(k) && header.ttl_ns == 0 {
                net.count(|s| s.dropped_expired += 1);
                return false;
            }
            net.frame_handlers.borrow().contains_key(&k)
                || net.frame_rndv_handlers.borrow().contains_key(&k)
        }
    };
    if !want {
        net.count(|s| s.dropped_no_handler += 1);
    }
    want
}

/// Hands an application frame (its whole payload here) to its handler or pending request.
fn dispatch(ctx: &Rc<ShardCtx>, node: NodeId, header: &FrameHeader, payload: Vec<u8>) {
    let net = ctx.net();
    if !wanted(net, node, header) {
        return;
    }
    match header.kind {
        FrameKind::Am => {
            let h = net.handlers.borrow().get(&AmId::new(header.id)).cloned();
            match h {
                Some(h) => {
                    net.count(|s| s.delivered += 1);
                    h(ctx, node, payload);
                }
                // Only a rendezvous handler: it cannot take eager data.
                None => net.count(|s| s.dropped_no_handler += 1),
            }
        }
        k if is_reply_kind(k) => {
            let p = net.pending.borrow_mut().complete(header.req_id);
            if let Some(p) = p {
                net.count(|s| s.delivered += 1);
                p.waiter.push(Ok((*header, payload)));
            }
        }
        k => {
            let h = net.frame_handlers.borrow().get(&k).cloned();
            if let Some(h) = h {
                net.count(|s| s.delivered += 1);
                h(ctx, node, header, payload);
            }
        }
    }
}

/// An application frame whose payload came by [`FRAME_RNDV_AM`]: to the AM id's rendezvous
/// handler, which picks the buffer, or pulled into a vector (its length is checked against the
/// limit already) for [`dispatch`]. Data nobody wants is declined without allocating.
fn deliver_rndv(ctx: &Rc<ShardCtx>, node: NodeId, header: FrameHeader, data: AmPayload) {
    let net = ctx.net();
    let rndv = match data {
        AmPayload::Data(d) => return dispatch(ctx, node, &header, d.into_vec()),
        AmPayload::Rendezvous(r) => r,
    };
    net.count(|s| s.rendezvous += 1);
    if !wanted(net, node, &header) {
        return;
    }
    let h = if header.kind == FrameKind::Am {
        net.rndv_handlers
            .borrow()
            .get(&AmId::new(header.id))
            .cloned()
    } else {
        net.frame_rndv_handlers.borrow().get(&header.kind).cloned()
    };
    if let Some(h) = h {
        net.count(|s| s.delivered += 1);
        h(ctx, node, header, rndv);
        return;
    }
    let len = rndv.len();
    let c = ctx.clone();
    glommio::spawn_local(async move {
        match pull(&c, node, rndv, vec![0u8; len]).await {
            Ok(buf) => dispatch(&c, node, &header, buf),
            Err(_) => c.net().count(|s| s.declined += 1),
        }
    })
    .detach();
}

/// Pulls rendezvous data from `node` into `buf`, within [`NetConfig::rndv_timeout`].
async fn pull<B: IoBufMut>(
    ctx: &Rc<ShardCtx>,
    node: NodeId,
    rndv: AmRndv,
    buf: B,
) -> Result<B, NetError> {
    let len = rndv.len();
    if buf.bytes_total() < len {
        return Err(NetError::BufferTooSmall {
            need: len,
            got: buf.bytes_total(),
        });
    }
    let timeout = ctx.net().settings.cfg.rndv_timeout;
    let recv = ctx.worker().am_recv_data(rndv, buf);
    ctx.wake_driver();
    // On timeout the receive is dropped: UCX's request is cancelled and the buffer parked with
    // the worker until UCX lets go of it, then dropped.
    let got = future::or(async { Some(recv.await) }, async {
        sleep(timeout).await;
        None
    })
    .await;
    match got {
        Some((Ok(n), buf)) if n == len => Ok(buf),
        Some((Ok(_), _)) => Err(NetError::Receive {
            node,
            source: crate::ucx::Error::MessageTruncated,
        }),
        Some((Err(source), _)) => Err(NetError::Receive { node, source }),
        None => Err(NetError::TimedOut { what: "rendezvous" }),
    }
}

/// A buffer that rendezvous data of a frame is pulled into, chosen by a
/// [`ShardCtx::set_frame_handler_rndv`] handler: one variant per kind of memory (GPU memory
/// joins them with CUDA support).
#[derive(Debug)]
#[non_exhaustive]
pub enum RndvBuf {
    /// A block of the shard's registered pool ([`ShardCtx::pool`]): no registration per
    /// transfer. Pool blocks are aligned to their size class (at least 256 bytes).
    Pool(PoolBuf),
    /// Plain host memory with a chosen alignment.
    Host(AlignedBuf),
    /// A vector (what frames without a rendezvous handler are pulled into).
    Vec(Vec<u8>),
}

impl RndvBuf {
    /// The buffer's bytes (all of them; the data is in the first `payload_len`), or `None`
    /// for a pool block whose memory a remote key was packed for
    /// ([`crate::ucx::MemSlice::as_slice`]).
    pub fn bytes(&self) -> Option<&[u8]> {
        match self {
            RndvBuf::Pool(b) => b.as_slice(),
            RndvBuf::Host(b) => Some(b.as_slice()),
            RndvBuf::Vec(v) => Some(v),
        }
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RndvBuf::Pool(b) => b.len(),
            RndvBuf::Host(b) => b.len(),
            RndvBuf::Vec(v) => v.len(),
        }
    }

    /// Whether the buffer has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Pulls `rndv` into this buffer (see [`pull`]).
    async fn pull(
        self,
        ctx: &Rc<ShardCtx>,
        node: NodeId,
        rndv: AmRndv,
    ) -> Result<RndvBuf, NetError> {
        match self {
            RndvBuf::Pool(b) => pull(ctx, node, rndv, b).await.map(RndvBuf::Pool),
            RndvBuf::Host(b) => pull(ctx, node, rndv, b).await.map(RndvBuf::Host),
            RndvBuf::Vec(b) => pull(ctx, node, rndv, b).await.map(RndvBuf::Vec),
        }
    }
}

/// Kinds a [`ShardCtx::request`] may send.
fn is_request_kind(k: FrameKind) -> bool {
    matches!(
        k,
        FrameKind::RpcRequest | FrameKind::RmaPut | FrameKind::RmaGet
    )
}

/// Kinds that answer a request (they complete a pending entry).
fn is_reply_kind(k: FrameKind) -> bool {
    matches!(
        k,
        FrameKind::RpcResponse | FrameKind::RpcError | FrameKind::RmaReply
    )
}

/// Whether `reply` answers a request of kind `request`.
fn reply_fits(request: FrameKind, reply: FrameKind) -> bool {
    matches!(
        (request, reply),
        (
            FrameKind::RpcRequest,
            FrameKind::RpcResponse | FrameKind::RpcError
        ) | (FrameKind::RmaPut | FrameKind::RmaGet, FrameKind::RmaReply)
    )
}

/// The earliest deadline of this shard: its connections' and its pending requests'.
fn next_timeout(net: &NetState) -> Option<Timestamp> {
    let conns = net
        .peers
        .borrow()
        .values()
        .filter_map(|p| p.conn.poll_timeout())
        .min();
    let requests = net.pending.borrow_mut().poll_timeout();
    match (conns, requests) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Fails the requests whose deadline has passed ([`NetError::TimedOut`], and a cancel frame
/// for an RPC request), and runs the connections' timers that are due.
fn handle_timeouts(ctx: &ShardCtx, net: &NetState) {
    let now = net.now();
    loop {
        // Not borrowed across the cancel: `queue_frame` does not touch the table, but a waker
        // might run code that does.
        let expired = net.pending.borrow_mut().poll_expired(now);
        let Some((req_id, p)) = expired else { break };
        if p.kind == FrameKind::RpcRequest {
            send_cancel(ctx, p.node, p.id, req_id);
        }
        p.waiter.push(Err(NetError::TimedOut { what: "request" }));
    }
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

/// Counts a frame that could not be decoded.
fn count_bad_frame(net: &NetState, e: &WireError) {
    if matches!(e, WireError::MessageTooLarge { .. }) {
        net.count(|s| s.dropped_too_large += 1);
    } else {
        net.count(|s| s.dropped_malformed += 1);
    }
}

/// What the connection said about an application frame: whether to deliver it.
fn count_received(net: &NetState, header: &FrameHeader, received: Received) -> bool {
    match received {
        Received::Deliver => !header.kind.is_control(),
        Received::Consumed => false,
        Received::Dropped(DropReason::NotReady) => {
            net.count(|s| s.dropped_unauthenticated += 1);
            false
        }
        Received::Dropped(_) => {
            net.count(|s| s.dropped_other += 1);
            false
        }
    }
}

/// Handles one input arrived by `now`; returns an application frame to deliver.
fn handle_inbound(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    item: Inbound,
    now: Timestamp,
) -> Option<Delivery> {
    match item {
        Inbound::Wake => None,
        Inbound::Malformed => {
            net.count(|s| s.dropped_malformed += 1);
            None
        }
        Inbound::TooLarge => {
            net.count(|s| s.dropped_too_large += 1);
            None
        }
        Inbound::Rndv { node, header, data } => {
            let header = match FrameHeader::decode(&header, &net.limits) {
                Ok(h) => h,
                Err(e) => {
                    count_bad_frame(net, &e);
                    return None;
                }
            };
            let len = match &data {
                AmPayload::Data(d) => d.len(),
                AmPayload::Rendezvous(r) => r.len(),
            };
            if header.kind.is_control() || header.payload_len != len as u64 {
                net.count(|s| s.dropped_malformed += 1);
                return None;
            }
            let received = match net.peers.borrow_mut().get_mut(&node) {
                Some(p) => p.conn.handle_frame(now, &header, &[]),
                None => Received::Dropped(DropReason::NotReady),
            };
            service(net, node);
            count_received(net, &header, received).then_some(Delivery::Rndv { node, header, data })
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
            let (header, payload) = match decode_frame(frame, &net.limits) {
                Ok(hp) => hp,
                Err(e) => {
                    count_bad_frame(net, &e);
                    return None;
                }
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
            count_received(net, &header, received).then(|| Delivery::Eager {
                node,
                header,
                payload: payload.to_vec(),
            })
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
    // The sender holds the only strong reference: the endpoint goes when the sender ends.
    let ep = Rc::new(ep);
    let weak_ep = Rc::downgrade(&ep);
    let send = sender(
        Rc::downgrade(ctx),
        ep,
        out.clone(),
        net.inbox.clone(),
        (node, generation),
        live.clone(),
        (net.settings.cfg.linger, net.settings.cfg.rndv_timeout),
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
            ep: weak_ep,
            generation,
            waiters: Vec::new(),
        },
    );
}

/// Owns a connection's endpoint: sends its frames in order; reports the endpoint's failure.
///
/// An eager frame is awaited before the next is posted. A rendezvous frame is posted in order
/// too, but its completion (the peer has pulled the data) is awaited by a task of its own,
/// within [`NetConfig::rndv_timeout`], so that heartbeats and small frames are not held up
/// behind a large transfer. Those tasks count as live senders, so that shutdown waits for them
/// within the linger time. A frame that [`send_inline`] posted and UCX did not complete at once
/// is awaited here in its queue position.
async fn sender(
    ctx: Weak<ShardCtx>,
    ep: Rc<Endpoint>,
    out: Rc<Queue<Outbound>>,
    inbox: Rc<Queue<Inbound>>,
    (node, generation): (NodeId, u64),
    live: Rc<Cell<usize>>,
    (linger, rndv_timeout): (Duration, Duration),
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
            Next::Frame(Some(Outbound::Rndv(header, payload))) => {
                let mut send = ep.am_send(FRAME_RNDV_AM, &header[..], payload, AmProto::Rendezvous);
                // The first poll posts the send, so frames leave in queue order.
                let first = future::poll_once(&mut send).await;
                if let Some(c) = ctx.upgrade() {
                    c.wake_driver();
                }
                match first {
                    Some((Ok(()), _)) => {}
                    Some((Err(_), _)) => {
                        inbox.push(Inbound::TransportError { node, generation });
                        break;
                    }
                    None => {
                        let inbox = inbox.clone();
                        let live = live.clone();
                        live.set(live.get() + 1);
                        glommio::spawn_local(async move {
                            // Dropping the send on timeout cancels it; UCX keeps the buffer
                            // parked until it lets go of it.
                            let done = future::or(async { send.await.0.is_ok() }, async {
                                sleep(rndv_timeout).await;
                                false
                            })
                            .await;
                            if !done {
                                inbox.push(Inbound::TransportError { node, generation });
                            }
                            live.set(live.get() - 1);
                        })
                        .detach();
                    }
                }
            }
            Next::Frame(Some(Outbound::Eager(header, payload))) => {
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
            Next::Frame(Some(Outbound::Posted(send))) => {
                let (res, _payload) = send.await;
                if res.is_err() {
                    inbox.push(Inbound::TransportError { node, generation });
                    break;
                }
            }
            Next::Frame(Some(Outbound::Failed)) => {
                inbox.push(Inbound::TransportError { node, generation });
                break;
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
        p.out.push(Outbound::Eager(header, payload));
    }
    let mut handshakes = 0;
    // Why the requests pending for this node are lost, if they are.
    let mut lost = None;
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
                lost.get_or_insert(err);
            }
            // Requests sent to the old incarnation are void.
            Event::PeerRestarted { .. } | Event::Closed { .. } => {
                lost.get_or_insert(NetError::Closed { node });
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
        lost.get_or_insert(NetError::Closed { node });
    }
    drop(peers);
    if handshakes > 0 {
        net.count(|s| s.handshakes += handshakes);
    }
    if let Some(err) = lost {
        fail_pending(net, node, &err);
        run_lost_hooks(net, Some(node), &err);
    }
}

/// Fails every request pending on this shard for `node` with `err`.
fn fail_pending(net: &NetState, node: NodeId, err: &NetError) {
    let mut pending = net.pending.borrow_mut();
    let ids: Vec<ReqId> = pending
        .iter()
        .filter(|(_, p)| p.node == node)
        .map(|(id, _)| id)
        .collect();
    for id in ids {
        if let Some(p) = pending.cancel(id) {
            p.waiter.push(Err(err.clone()));
        }
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

/// The parts of an application frame's header that the caller chooses.
#[derive(Clone, Copy)]
struct FrameSpec {
    kind: FrameKind,
    id: u32,
    req_id: ReqId,
    ttl_ns: u64,
}

/// A frame's payload: owned (moved into a rendezvous send as it is) or borrowed (copied).
enum FramePayload<'a> {
    Owned(Vec<u8>),
    Borrowed(&'a [u8]),
}

impl FramePayload<'_> {
    fn as_slice(&self) -> &[u8] {
        match self {
            FramePayload::Owned(v) => v,
            FramePayload::Borrowed(b) => b,
        }
    }

    fn into_vec(self) -> Vec<u8> {
        match self {
            FramePayload::Owned(v) => v,
            FramePayload::Borrowed(b) => b.to_vec(),
        }
    }
}

/// Queues an application frame to `node` on this shard, its owner: eager with its header in
/// one buffer when the payload is at most [`NetConfig::rndv_threshold`], else by rendezvous
/// with the payload as it is. The size is checked against the limit before anything else.
fn queue_frame(
    ctx: &ShardCtx,
    node: NodeId,
    spec: FrameSpec,
    payload: Vec<u8>,
) -> Result<(), NetError> {
    queue_frame_from(ctx, node, spec, FramePayload::Owned(payload))
}

/// [`queue_frame`] for an owned or a borrowed payload.
fn queue_frame_from(
    ctx: &ShardCtx,
    node: NodeId,
    spec: FrameSpec,
    payload: FramePayload<'_>,
) -> Result<(), NetError> {
    let net = ctx.net();
    let cfg = &net.settings.cfg;
    let len = payload.as_slice().len() as u64;
    if len > cfg.max_message_size {
        return Err(NetError::TooLarge {
            len,
            max: cfg.max_message_size,
        });
    }
    if spec.kind.is_control() {
        return Err(NetError::BadKind {
            kind: spec.kind,
            op: "send an application frame",
        });
    }
    let peers = net.peers.borrow();
    let p = peers.get(&node).ok_or(NetError::NotConnected { node })?;
    let header = FrameHeader {
        id: spec.id,
        req_id: spec.req_id,
        ttl_ns: spec.ttl_ns,
        payload_len: len,
        ..p.conn
            .frame_header(spec.kind)
            .map_err(|_| NetError::NotConnected { node })?
    };
    let item = if payload.as_slice().len() > cfg.rndv_threshold {
        let header = FrameHeader {
            flags: FrameFlags::RNDV,
            ..header
        };
        let mut am = Box::new([0u8; RNDV_AM_HEADER_LEN]);
        am[..AM_HEADER_LEN].copy_from_slice(&frame_am_header(net.settings.node_id, 0));
        am[AM_HEADER_LEN..].copy_from_slice(&header.to_bytes());
        Outbound::Rndv(am, payload.into_vec())
    } else {
        let flen = frame_len(len, &net.limits).map_err(|source| NetError::Wire { source })?;
        let mut frame = vec![0u8; flen];
        encode_frame(&header, payload.as_slice(), &mut frame, &net.limits)
            .map_err(|source| NetError::Wire { source })?;
        let am = frame_am_header(net.settings.node_id, 0);
        match send_inline(ctx, p, am, frame) {
            Inline::Done => return Ok(()),
            Inline::Queue(item) => item,
        }
    };
    if p.out.push(item) {
        Ok(())
    } else {
        Err(NetError::NotConnected { node })
    }
}

/// What [`send_inline`] leaves for the connection's sender task.
enum Inline {
    /// UCX completed the send in place: nothing is left.
    Done,
    /// To be pushed to the out queue: the frame itself, or its posted send, or its failure.
    Queue(Outbound),
}

/// Sends an eager frame from the caller, without waking the sender task, when nothing queued
/// must go first: the out queue is open and empty, and the sender's endpoint is alive.
///
/// Frames leave in queue order because the sender posts a frame in the same poll in which it
/// takes it from the queue (an eager send's first poll posts it; a rendezvous send is polled
/// once before anything else): an empty queue means every earlier frame, rendezvous posts
/// included, is already with UCX, which keeps the order of sends posted on one endpoint. A
/// send that UCX completed in place (`ucp_am_send_nbx` returned `NULL`) is done; one still in
/// flight goes to the queue as [`Outbound::Posted`], so that the sender keeps its buffer alive
/// and fails the connection if it fails, and later frames queue behind it; one that failed at
/// once goes as [`Outbound::Failed`], which the sender reports as it would its own failure.
fn send_inline(ctx: &ShardCtx, p: &Peer, am: [u8; AM_HEADER_LEN], frame: Vec<u8>) -> Inline {
    let ep = match p.ep.upgrade() {
        Some(ep) if p.out.is_idle() => ep,
        _ => return Inline::Queue(Outbound::Eager(am, frame)),
    };
    let mut send = ep.am_send(FRAME_AM, &am, frame, AmProto::Eager);
    // The first poll posts the send. No task waits on it yet: if it is still in flight, the
    // sender's first poll of `Outbound::Posted` replaces the no-op waker with its own (and the
    // push that hands it over wakes the sender anyway).
    let first = std::pin::Pin::new(&mut send).poll(&mut Context::from_waker(Waker::noop()));
    ctx.wake_driver();
    match first {
        Poll::Ready((Ok(()), _payload)) => Inline::Done,
        Poll::Ready((Err(_), _payload)) => Inline::Queue(Outbound::Failed),
        Poll::Pending => {
            ctx.net().count(|s| s.inline_in_flight += 1);
            Inline::Queue(Outbound::Posted(send))
        }
    }
}

/// Cancels a pending request when its future ends or is dropped (no-op once completed). An
/// RPC request that was still pending (its caller gave up: dropped, or timed out) is followed
/// by an [`FrameKind::RpcCancel`] frame with its `id` and `req_id`, so that the server can stop
/// working on it.
struct PendingGuard<'a> {
    ctx: &'a ShardCtx,
    node: NodeId,
    spec: FrameSpec,
    /// Cleared once the request has its answer: whoever gave it removed the entry.
    armed: bool,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let net = self.ctx.net();
        let was_pending = net.pending.borrow_mut().cancel(self.spec.req_id).is_some();
        if was_pending && self.spec.kind == FrameKind::RpcRequest {
            send_cancel(self.ctx, self.node, self.spec.id, self.spec.req_id);
        }
    }
}

/// Sends the [`FrameKind::RpcCancel`] of an RPC request given up (dropped or timed out).
fn send_cancel(ctx: &ShardCtx, node: NodeId, id: u32, req_id: ReqId) {
    let cancel = FrameSpec {
        kind: FrameKind::RpcCancel,
        id,
        req_id,
        ttl_ns: NO_DEADLINE_TTL,
    };
    // Best effort: a connection that has gone has taken the request with it.
    if queue_frame(ctx, node, cancel, Vec::new()).is_ok() {
        ctx.net().count(|s| s.cancels_sent += 1);
    }
}

/// Set by a caller on another shard that stopped waiting for a forwarded request (its future
/// was dropped), so that the owner shard drops the request too (and, for RPC, sends the
/// cancel). `Send + Sync`: the flag and the owner task's waker cross between the two threads.
#[derive(Default)]
struct ForwardCancel {
    cancelled: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl ForwardCancel {
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
        let w = self
            .waker
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Resolves once [`ForwardCancel::cancel`] has been called.
    fn wait(&self) -> impl Future<Output = ()> + '_ {
        poll_fn(move |cx| {
            if self.cancelled.load(Ordering::SeqCst) {
                return Poll::Ready(());
            }
            *self
                .waker
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(cx.waker().clone());
            // Looked at again after the waker is in place: a cancel in between is not lost.
            if self.cancelled.load(Ordering::SeqCst) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
    }
}

/// Cancels the owner's side of a forwarded request when the caller's future is dropped before
/// the answer came back.
struct CancelOnDrop(Option<Arc<ForwardCancel>>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.cancel();
        }
    }
}

/// Sends a request to `node` on this shard, its owner, and waits for the reply, at most
/// `timeout`; the frame's `ttl_ns` is `ttl` (at most `timeout`).
///
/// The deadline has no timer of its own: the net task's timer, armed for the shard's earliest
/// deadline ([`net_loop`]), fails the request at its deadline, as precisely as a timer of its
/// own would (glommio's timers, and the executor's wake-up). Only when the net task has ended
/// (after [`shutdown`]) does a request wait with a timer of its own.
async fn request_local(
    ctx: &Rc<ShardCtx>,
    node: NodeId,
    (kind, id): (FrameKind, u32),
    payload: Vec<u8>,
    (timeout, ttl): (Duration, Duration),
) -> Reply {
    if !is_request_kind(kind) {
        return Err(NetError::BadKind {
            kind,
            op: "send a request",
        });
    }
    let net = ctx.net();
    let timeout = timeout.min(MAX_REQUEST_TIMEOUT);
    let now = net.now();
    let deadline = now.saturating_add(timeout);
    let waiter = Slot::new();
    let req_id = net.pending.borrow_mut().insert(
        deadline,
        Pending {
            node,
            kind,
            id,
            waiter: waiter.clone(),
        },
    );
    let spec = FrameSpec {
        kind,
        id,
        req_id,
        ttl_ns: ttl_from_deadline(now, now.saturating_add(ttl.min(timeout))),
    };
    let mut guard = PendingGuard {
        ctx,
        node,
        spec: FrameSpec {
            ttl_ns: NO_DEADLINE_TTL,
            ..spec
        },
        armed: true,
    };
    queue_frame(ctx, node, spec, payload)?;
    if net.inbox.closed.get() {
        let got = future::or(async { Some(waiter.wait().await) }, async {
            sleep(deadline.saturating_duration_since(net.now())).await;
            None
        })
        .await;
        return got.unwrap_or(Err(NetError::TimedOut { what: "request" }));
    }
    if deadline < net.timer_at.get() {
        // Due before the net task's timer: it re-arms on this wake-up.
        net.inbox.push(Inbound::Wake);
    }
    let answer = waiter.wait().await;
    // Every answer is given after its entry left the table (reply, expiry, failure, drain).
    guard.armed = false;
    answer
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

    /// The shard of this node that owns (holds the connection to) `node`. Remembered for
    /// recently asked nodes (the shard count never changes), so that asking again per call
    /// costs no hashing.
    pub fn owner_of(&self, node: NodeId) -> ShardId {
        if self.shard_count() == 1 {
            return ShardId::new(0);
        }
        let net = self.net();
        let v = node.get();
        // `usize::try_from` of a value below OWNER_CACHE cannot fail.
        let slot = &net.owners[usize::try_from((v ^ (v >> 32)) % OWNER_CACHE as u64).unwrap_or(0)];
        if let Some((n, s)) = slot.get() {
            if n == node {
                return s;
            }
        }
        let s = local_map(self).owner_of(node);
        slot.set(Some((node, s)));
        s
    }

    /// This shard's connection counters.
    pub fn net_stats(&self) -> NetStats {
        self.net().stats.get()
    }

    /// The ready connection to `node` on this shard, if there is one.
    pub fn session(&self, node: NodeId) -> Option<RemoteNode> {
        self.net()
            .peers
            .borrow()
            .get(&node)
            .and_then(|p| ready_remote(&p.conn))
    }

    /// Whether this shard holds a ready connection to `node`.
    pub fn is_connected(&self, node: NodeId) -> bool {
        self.session(node).is_some()
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
    /// Payloads over [`NetConfig::rndv_threshold`] go by rendezvous (see
    /// [`ShardCtx::set_net_handler_rndv`]); over [`NetConfig::max_message_size`] they are
    /// refused with [`NetError::TooLarge`].
    pub async fn send_am(
        self: &Rc<Self>,
        node: NodeId,
        id: AmId,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let spec = FrameSpec {
            kind: FrameKind::Am,
            id: id.get(),
            req_id: ReqId::NONE,
            ttl_ns: NO_DEADLINE_TTL,
        };
        self.send_spec(node, spec, payload).await
    }

    /// [`NetError::TooLarge`] for a payload over [`NetConfig::max_message_size`].
    fn check_len(&self, payload: &[u8]) -> Result<(), NetError> {
        let max = self.net().settings.cfg.max_message_size;
        let len = payload.len() as u64;
        if len > max {
            return Err(NetError::TooLarge { len, max });
        }
        Ok(())
    }

    /// Sends `spec` with `payload` from this shard, through the owner shard of `node`.
    async fn send_spec(
        self: &Rc<Self>,
        node: NodeId,
        spec: FrameSpec,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        // Refused here, before the payload crosses to the owner.
        self.check_len(&payload)?;
        let owner = self.owner_of(node);
        if owner == self.id() {
            queue_frame(self, node, spec, payload)
        } else {
            self.forward(owner, move |c| async move {
                queue_frame(&c, node, spec, payload)
            })
            .await?
        }
    }

    /// Registers, on this shard, the rendezvous handler of application frames with `id`: for
    /// a frame whose payload came by rendezvous (longer than the sender's
    /// [`NetConfig::rndv_threshold`]), `choose` picks the buffer the data is pulled into
    /// (a [`crate::PoolBuf`], a `Vec<u8>`, an aligned or device buffer...) before any byte is
    /// received, and `on_data` gets the buffer once the data is in it.
    ///
    /// `choose` sees the frame header (`payload_len` is the data's length, already checked
    /// against [`NetConfig::max_message_size`]); returning `None` declines the data (the sender
    /// completes, nothing is received). `on_data` gets `Ok(buf)` with the data in its first
    /// `payload_len` bytes, or an error ([`NetError::BufferTooSmall`], [`NetError::Receive`],
    /// [`NetError::TimedOut`] after [`NetConfig::rndv_timeout`]); on error the buffer is
    /// dropped once UCX no longer uses it. Both run on this shard and must not block;
    /// `on_data` may run after handlers of frames that arrived later.
    ///
    /// Frames of `id` that arrive eager still go to the handler of
    /// [`ShardCtx::set_net_handler`]; when `id` has no rendezvous handler, rendezvous data is
    /// pulled into a `Vec<u8>` for that handler. Register both on every shard that may own a
    /// peer.
    pub fn set_net_handler_rndv<B, C, D>(&self, id: AmId, choose: C, on_data: D)
    where
        B: IoBufMut,
        C: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader) -> Option<B> + 'static,
        D: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Result<B, NetError>) + 'static,
    {
        let handler = rndv_handler(choose, on_data, |c, node, rndv, buf| async move {
            pull(&c, node, rndv, buf).await
        });
        self.net().rndv_handlers.borrow_mut().insert(id, handler);
    }

    /// Registers, on this shard, the handler of incoming frames of `kind` (replacing any
    /// previous one): [`FrameKind::RpcRequest`], [`FrameKind::RpcCancel`],
    /// [`FrameKind::RmaPut`] or [`FrameKind::RmaGet`]; other kinds are refused with
    /// [`NetError::BadKind`] (active messages have [`ShardCtx::set_net_handler`], replies
    /// complete [`ShardCtx::request`]).
    ///
    /// The handler gets the sending node, the frame header (`id`, `req_id`, and `ttl_ns`: the
    /// request's remaining time when it was sent; requests sent with none left are dropped and
    /// counted in [`NetStats::dropped_expired`]) and the payload (pulled into a vector first
    /// when it came by rendezvous). It runs on the shard's net task, must not block, and may
    /// spawn tasks, e.g. to answer with [`ShardCtx::reply`]. Register it on every shard that
    /// may own a peer; a request with no handler is dropped (and its sender times out).
    pub fn set_frame_handler<F>(&self, kind: FrameKind, handler: F) -> Result<(), NetError>
    where
        F: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Vec<u8>) + 'static,
    {
        if !matches!(
            kind,
            FrameKind::RpcRequest | FrameKind::RpcCancel | FrameKind::RmaPut | FrameKind::RmaGet
        ) {
            return Err(NetError::BadKind {
                kind,
                op: "register a frame handler",
            });
        }
        self.net()
            .frame_handlers
            .borrow_mut()
            .insert(kind, Rc::new(handler));
        Ok(())
    }

    /// Registers, on this shard, the rendezvous handler of incoming request frames of `kind`
    /// ([`FrameKind::RpcRequest`], [`FrameKind::RmaPut`] or [`FrameKind::RmaGet`]; others are
    /// refused with [`NetError::BadKind`]), replacing any previous one: for a frame whose
    /// payload came by rendezvous, `choose` picks the buffer the data is pulled into before any
    /// byte is received, and `on_data` gets it once the data is in it. The counterpart of
    /// [`ShardCtx::set_net_handler_rndv`] for requests; the buffer is a [`RndvBuf`], so that
    /// one handler may choose a different kind of memory per frame (e.g. per RPC function).
    ///
    /// `choose` runs on the net task after the frame's checks (size limit, connection,
    /// `ttl_ns`) and sees its header (`payload_len` is the data's length); returning `None`
    /// declines the data (the sender's transfer completes, nothing is received; a request
    /// declined that way gets no reply unless `choose` sends one, e.g. with
    /// [`ShardCtx::reply_now`]). `on_data` gets `Ok(buf)` with the data in its first
    /// `payload_len` bytes, or an error ([`NetError::BufferTooSmall`], [`NetError::Receive`],
    /// [`NetError::TimedOut`] after [`NetConfig::rndv_timeout`]). Both run on this shard and
    /// must not block; `on_data` may run after handlers of frames that arrived later.
    ///
    /// Eager frames of `kind` still go to the handler of [`ShardCtx::set_frame_handler`];
    /// without a rendezvous handler, rendezvous data is pulled into a `Vec<u8>` for it.
    pub fn set_frame_handler_rndv<C, D>(
        &self,
        kind: FrameKind,
        choose: C,
        on_data: D,
    ) -> Result<(), NetError>
    where
        C: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader) -> Option<RndvBuf> + 'static,
        D: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Result<RndvBuf, NetError>) + 'static,
    {
        if !is_request_kind(kind) {
            return Err(NetError::BadKind {
                kind,
                op: "register a rendezvous frame handler",
            });
        }
        let handler = rndv_handler(choose, on_data, |c, node, rndv, buf: RndvBuf| async move {
            buf.pull(&c, node, rndv).await
        });
        self.net()
            .frame_rndv_handlers
            .borrow_mut()
            .insert(kind, handler);
        Ok(())
    }

    /// Sends one application frame of `kind` with `id` and `req_id` (no deadline) to the
    /// connected `node`, from any shard (forwarded to the owner). Resolves once the frame is
    /// queued on the owner's endpoint. Payloads over [`NetConfig::rndv_threshold`] go by
    /// rendezvous; over [`NetConfig::max_message_size`] they are refused
    /// ([`NetError::TooLarge`]). Control kinds are refused ([`NetError::BadKind`]).
    pub async fn send_frame(
        self: &Rc<Self>,
        node: NodeId,
        kind: FrameKind,
        id: u32,
        req_id: ReqId,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let spec = FrameSpec {
            kind,
            id,
            req_id,
            ttl_ns: NO_DEADLINE_TTL,
        };
        self.send_spec(node, spec, payload).await
    }

    /// Sends a request of `kind` ([`FrameKind::RpcRequest`], [`FrameKind::RmaPut`] or
    /// [`FrameKind::RmaGet`]) with `id` and `payload` to the connected `node`, from any shard,
    /// and resolves with the reply's header and payload: an [`FrameKind::RpcResponse`] or
    /// [`FrameKind::RpcError`] for an RPC request, an [`FrameKind::RmaReply`] for RMA.
    ///
    /// The request runs on the shard that owns `node` (forwarded there from other shards): it
    /// takes a fresh [`ReqId`] from that shard's pending table, sends the frame with the
    /// deadline in its `ttl_ns`, and waits. Errors: [`NetError::TimedOut`] (`"request"`) when
    /// no reply came within `timeout` (at most [`MAX_REQUEST_TIMEOUT`]);
    /// [`NetError::PeerDead`], [`NetError::Transport`] or [`NetError::Closed`] when the
    /// connection fails or closes first (every pending request of the node fails then);
    /// [`NetError::ShuttingDown`] when this node stops; [`NetError::NotConnected`],
    /// [`NetError::TooLarge`], [`NetError::BadKind`] before sending. Dropping the future
    /// forgets the request on the owner shard too (a late reply is dropped and counted), and
    /// an RPC request given up is followed by a cancel frame (see
    /// [`ShardCtx::request_with_ttl`]).
    pub async fn request(
        self: &Rc<Self>,
        node: NodeId,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
        timeout: Duration,
    ) -> Result<(FrameHeader, Vec<u8>), NetError> {
        self.request_with_ttl(node, kind, id, payload, timeout, timeout)
            .await
    }

    /// [`ShardCtx::request`] whose frame announces `ttl` (at most `timeout`) as the time the
    /// receiver has, while the caller waits up to `timeout`: a receiver that gives up at its
    /// deadline can still answer within the caller's (the RPC layer's server-side expiry).
    ///
    /// Dropping the future before it resolves gives the request up on the owner shard, also
    /// when it was forwarded there from another shard; an [`FrameKind::RpcRequest`] given up
    /// that way (or by its timeout) is followed by an [`FrameKind::RpcCancel`] frame with the
    /// same `id` and `req_id` ([`NetStats::cancels_sent`]).
    pub async fn request_with_ttl(
        self: &Rc<Self>,
        node: NodeId,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
        timeout: Duration,
        ttl: Duration,
    ) -> Result<(FrameHeader, Vec<u8>), NetError> {
        self.check_len(&payload)?;
        let owner = self.owner_of(node);
        if owner == self.id() {
            request_local(self, node, (kind, id), payload, (timeout, ttl)).await
        } else {
            let cancel = Arc::new(ForwardCancel::default());
            let mut on_drop = CancelOnDrop(Some(cancel.clone()));
            let got = self
                .forward(owner, move |c| async move {
                    future::or(
                        request_local(&c, node, (kind, id), payload, (timeout, ttl)),
                        async {
                            cancel.wait().await;
                            Err(NetError::TimedOut { what: "request" })
                        },
                    )
                    .await
                })
                .await;
            // Answered (or failed): nothing to cancel on the owner.
            on_drop.0 = None;
            got?
        }
    }

    /// Answers `request` like [`ShardCtx::reply`], at once and without a task, on the shard
    /// that owns `node` (where frame handlers run); the payload is copied into the frame (a
    /// payload over [`NetConfig::rndv_threshold`] is copied once more, into the rendezvous
    /// send). Errors: [`NetError::BadKind`], [`NetError::TooLarge`], and
    /// [`NetError::NotConnected`] when `node` has no ready connection on this shard.
    pub fn reply_now(
        &self,
        node: NodeId,
        request: &FrameHeader,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), NetError> {
        let spec = reply_spec(request, kind)?;
        queue_frame_from(self, node, spec, FramePayload::Borrowed(payload))
    }

    /// Answers `request` (a frame header given to a [`ShardCtx::set_frame_handler`] handler)
    /// from `node` with a reply of `kind`, from any shard: [`FrameKind::RpcResponse`] or
    /// [`FrameKind::RpcError`] for an [`FrameKind::RpcRequest`], [`FrameKind::RmaReply`] for
    /// [`FrameKind::RmaPut`] and [`FrameKind::RmaGet`] (else [`NetError::BadKind`]). The reply
    /// carries the request's `id` and `req_id`.
    pub async fn reply(
        self: &Rc<Self>,
        node: NodeId,
        request: &FrameHeader,
        kind: FrameKind,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let spec = reply_spec(request, kind)?;
        self.send_spec(node, spec, payload).await
    }

    /// Requests of this shard waiting for a reply.
    pub fn pending_requests(&self) -> usize {
        self.net().pending.borrow().len()
    }

    /// Stops the node's listener, if it runs on this shard (shard 0 of a listening node): new
    /// clients can no longer fetch the directory, and a `connect` to this node's address fails
    /// from then on. Connections already made are not touched, and a client that already holds
    /// the directory may still complete its handshake. Does nothing on other shards or when
    /// called again. [`crate::ShardsBuilder::run`] calls it at shut-down; the facade's node
    /// calls it as soon as every shard's closure has returned.
    pub async fn stop_accepting(&self) {
        let task = self.net().acceptor.borrow_mut().take();
        if let Some(t) = task {
            // Cancelling the accept loop drops the listener, which closes it in UCX.
            t.cancel().await;
        }
    }

    /// Registers, on this shard, `hook` to run when a connection this shard owns ends: with
    /// the remote node and the error its pending requests failed with
    /// ([`NetError::PeerDead`], [`NetError::Transport`], [`NetError::Closed`]), after every
    /// frame that arrived before the end has been handled. At shut-down it runs once with
    /// [`NetError::ShuttingDown`] and no node, meaning every node. For modules that keep
    /// per-peer operations of their own (tag receives); it must not block.
    pub fn on_peer_lost(&self, hook: impl Fn(Option<NodeId>, &NetError) + 'static) {
        self.net().lost_hooks.borrow_mut().push(Rc::new(hook));
    }
}

/// A rendezvous handler: `choose` picks the buffer on the net task (`None` declines the data);
/// a task then pulls the data into it with `pull` and hands the result to `on_data`.
fn rndv_handler<B, C, D, P, F>(choose: C, on_data: D, pull: P) -> RndvHandler
where
    B: 'static,
    C: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader) -> Option<B> + 'static,
    D: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Result<B, NetError>) + 'static,
    P: Fn(Rc<ShardCtx>, NodeId, AmRndv, B) -> F + 'static,
    F: Future<Output = Result<B, NetError>> + 'static,
{
    let (on_data, pull) = (Rc::new(on_data), Rc::new(pull));
    Rc::new(move |ctx, node, header, rndv| {
        let Some(buf) = choose(ctx, node, &header) else {
            // Dropping `rndv` declines the data.
            ctx.net().count(|s| s.declined += 1);
            return;
        };
        let (c, on_data, pull) = (ctx.clone(), on_data.clone(), pull.clone());
        glommio::spawn_local(async move {
            let res = pull(c.clone(), node, rndv, buf).await;
            if res.is_err() {
                c.net().count(|s| s.declined += 1);
            }
            on_data(&c, node, &header, res);
        })
        .detach();
    })
}

/// The frame that answers `request` with `kind`: its `id` and `req_id`, no deadline
/// ([`NetError::BadKind`] when `kind` does not answer that request's kind).
fn reply_spec(request: &FrameHeader, kind: FrameKind) -> Result<FrameSpec, NetError> {
    if !reply_fits(request.kind, kind) {
        return Err(NetError::BadKind {
            kind,
            op: "answer this request",
        });
    }
    Ok(FrameSpec {
        kind,
        id: request.id,
        req_id: request.req_id,
        ttl_ns: NO_DEADLINE_TTL,
    })
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
