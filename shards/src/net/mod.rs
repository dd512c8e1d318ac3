//! Connections between nodes: bootstrap, sessions and rails, and frames on them.
//!
//! A *node* is one [`ShardsBuilder`](crate::ShardsBuilder) set of shards, known to others by
//! its [`NodeId`] (configured, or drawn from `/dev/urandom`) and, for one run, its
//! [`Incarnation`] (the start time in nanoseconds unless configured). Nodes authenticate each
//! other with proto's handshake and a pre-shared key ([`crate::ShardsBuilder::psk`]).
//!
//! The module is one file per subsystem: [`bootstrap`] (listener, directory, connect),
//! `session` (the connection state of each peer, the handshake, timers and failures),
//! [`inbound`] (what UCX delivers, dispatched by the progress driver), [`outbound`] (sends, in
//! place or through the connection's sender task) and [`request`] (requests, replies,
//! deadlines, cancellation).
//!
//! ## Rails
//!
//! Every shard has its own connection (a *rail*: one UCX endpoint each way between two shards'
//! workers, one [`Connection`] on each side) to the remote shards it is paired with; local
//! shard `i` always has its *default rail* to remote shard `i mod M`. A call goes out on the
//! caller's rail, its answer comes back on it, and a call for a rail another local shard holds
//! is forwarded to that shard over the mesh ([`ShardCtx::forward`]). One pre-shared-key
//! handshake per node pair authenticates the session; every other rail joins it with a proof.
//! The `session` module's docs have the details.
//!
//! ## Connecting
//!
//! 1. **Bootstrap.** Shard 0 of a node built with [`crate::ShardsBuilder::listen`] listens on a
//!    plain TCP socket (not a UCX listener: see [`bootstrap`] for why). Before the user future
//!    starts it gathers every shard's worker address (one forward per shard) into a
//!    [`Directory`] (node id, incarnation, shard count, worker addresses). A client sends
//!    [`bootstrap::BOOTSTRAP_REQUEST`] and gets the directory back; anything else, or nothing
//!    within [`NetConfig::accept_timeout`], gets the connection closed (and counted), and at
//!    most [`NetConfig::max_half_open`] bootstrap connections are served at once.
//!    [`ShardCtx::bootstrap`] fetches a directory from the calling shard within
//!    [`NetConfig::connect_timeout`] ([`NetError::Unreachable`] when nothing answers,
//!    [`NetError::TimedOut`] at the deadline).
//! 2. **Rails.** [`ShardCtx::connect`] asks local shard 0 to establish the node pair: a
//!    primary handshake on its default rail, then a join on every other shard's rails. Each
//!    rail's client connects to the remote shard by worker address and runs a client
//!    [`Connection`]; its first frame (a `Hello` or a `Join`) carries the client's worker
//!    address, from which the remote shard creates the reverse endpoint and a server
//!    [`Connection`]. The handshake has its own deadline ([`NetConfig::handshake_timeout`]); a
//!    failure ends the connect with a typed
//!    [`NetError`]: [`NetError::Refused`] for a wrong key (with proto's reject reason),
//!    [`NetError::TimedOut`], [`NetError::Handshake`] for other handshake failures.
//!
//! ## Frames on UCX
//!
//! Control frames (handshake, heartbeats, close) travel as eager active messages
//! [`FRAME_AM`] whose UCX AM header is [`AM_HEADER_LEN`] = 16 bytes, little-endian:
//!
//! ```text
//!  0  u64  sender's NodeId
//!  8  u32  addr_len: length of the sender's worker address that starts the payload (Hello
//!           and Join only, else 0)
//! 12  u8   mode: the UCX error mode of the sender's endpoint (Hello and Join: 1 none, 2 peer;
//!           0 in other frames, and "not said", answered in the receiver's own mode)
//! 13  [3]  reserved, zero
//! ```
//!
//! and whose payload is the worker address (`addr_len` bytes) followed by the proto frame (the
//! 48-byte [`FrameHeader`] and its payload). The receiver of a `Hello` or `Join` makes its
//! endpoint to that address in that mode (see "Error modes" below).
//!
//! Application frames (active messages, requests, replies, cancels) travel as [`DATA_AM`]:
//! the UCX AM header is the frame's *data header* (proto's `wire` module, "Data header": the
//! sender's node id and the [`FrameHeader`]'s fields in 28 bytes, 36 or 44 with a request id
//! and a deadline; at most [`DATA_HEADER_LEN`]), followed by the frame's *user header* (the
//! application's AM header, up to [`MAX_USER_HEADER`] bytes; empty for other kinds); the UCX
//! payload is the application payload itself, its length the frame's `payload_len`. So a send
//! copies nothing on our side: UCX is handed the header (built on the stack) and the caller's
//! bytes. A payload of at most
//! [`NetConfig::rndv_threshold`] bytes goes eager, a longer one with UCX rendezvous (the
//! receiver chooses the buffer before the data moves; see below).
//!
//! ## The hot path
//!
//! An application frame with eager data is handled inside UCX's receive callback, as
//! `ucx_perftest` handles its messages: the [`DATA_AM`] handler is an inline one
//! ([`Worker::set_am_handler_inline`](crate::ucx::Worker::set_am_handler_inline)), so a short
//! message is read where the transport put it (a shared-memory FIFO element, a TCP receive
//! buffer: no UCX descriptor is allocated for it) and larger eager data comes in UCX's
//! descriptor. The callback decodes the data header, finds the connection, feeds
//! [`Connection::handle_frame`] (the clock is read once per driver round, by the first frame
//! that needs it) and calls the handler there, on the driver's stack, with a [`Frame`]: a
//! handler that reads the payload in place and answers inline ([`ShardCtx::send_frame_now`],
//! [`ShardCtx::reply_now`]; a send from inside a callback is allowed by `ucp.h`, which forbids
//! only `progress`) costs no task switch and no allocation. A short payload is copied into a
//! buffer of the shard's, reused while no frame keeps it (a handler that keeps the frame, in a
//! task say, keeps its copy, and the next message gets a new buffer); a descriptor stays with
//! its frame until the frame is dropped. [`NetStats::dispatched_in_callback`] counts them. At
//! most [`crate::driver::DISPATCH_BUDGET`] frames are dispatched in the callback per
//! `progress` call: one call can deliver thousands (a TCP read of a flood), and the rest are
//! recorded, so that the driver dispatches them a budget per round with the shard's timers,
//! heartbeats, mesh and tasks served in between, as for any recorded input.
//!
//! The rest is recorded by the callbacks and dispatched by the shard's progress driver right
//! after `ucp_worker_progress` returns ([`crate::driver`], "The hot path"), in order and at most
//! [`crate::driver::DISPATCH_BUDGET`] per round: control frames (handshakes, heartbeats,
//! close), rendezvous data, a frame that arrives while inputs are recorded before it (order is
//! kept) or while another frame's handler runs (a send UCX delivered at once to this same
//! worker), and the connection's follow-up work when a frame changed its state (frames to
//! send, events), which is never done inside UCX's callback.
//!
//! A send on a shard's rail ([`ShardCtx::send_frame_now`], and every send that reaches the
//! shard holding the rail) is handed to UCX by the caller when nothing queued must go first:
//! with [`Endpoint::am_send_now`](crate::ucx::Endpoint::am_send_now) when UCX can complete it
//! in place (its short path: no request, no callback, no allocation), else posted from an
//! owned buffer (copied when borrowed; a payload over UCX's short limit or the rendezvous
//! threshold), the rail's *sender task* then only tracking its completion
//! ([`NetStats::sent_posted`]). Behind queued frames (or with an endpoint still wiring up) the
//! frame is queued for the sender task, which posts frames in order and keeps their buffers
//! until UCX completes them; the driver is told ([`ShardCtx::wake_driver`]) so that it yields
//! to the sender at its next round.
//!
//! A send made from a task (not from a handler, nor from anything else the driver runs) that
//! finds UCX's send queue to the peer full (a shared-memory FIFO of 64 slots, a socket's
//! buffer: UCX answers the in-place send with `NoResource`) waits for room instead, for at
//! most [`NetConfig::send_pace`] (500 µs by default): it progresses the shard's worker and
//! offers the frame again, as `ucx_perftest`'s sender does, so a producer that outruns its
//! receiver goes at the receiver's speed with every frame in place
//! ([`NetStats::sends_paced`]) rather than posting or queueing each frame behind the full
//! queue until it yields, which cost several times as much. Frames that arrive during that
//! wait are recorded for the driver, in order: no handler runs inside a task's send. A wait
//! that gives up ([`NetStats::pace_timeouts`]: a stalled peer) posts or queues the frame as
//! before, and the rail's sends do not wait again for twenty times the span.
//!
//! Finding the rail costs no lookup on the common paths. Each rail keeps what a send reads
//! (its data-header template, made once when its connection becomes ready and dropped when
//! it no longer can send; its queue, endpoint and backlog) in one `Rc` beside its connection.
//! While a frame's handler runs, the dispatch holds the rail the frame came in on, so the
//! handler's answer on that rail (an echo, an RPC reply: [`ShardCtx::reply_now`], a send
//! naming the frame's shard) goes straight to it; and a send or route from a task finds the
//! rail the last one looked up when it goes to the same place (a one-entry cache the shard
//! forgets whenever its rails change, and which never yields a rail that has gone). Anything
//! else takes the lookup.
//!
//! Receiving needs no lookup either when a frame comes in on the rail the last one came in on
//! (most do). The rail keeps, beside its template, its connection's
//! [`DataLane`](crate::proto::DataLane) while the connection is ready and its peer not
//! suspect: the shard, incarnation and version a deliverable frame's header carries. The
//! dispatch checks a frame against the last rail's lane with a few comparisons, neither
//! looking into the peer table nor calling into the connection, and notes the frame for the
//! connection, which is told (counted as delivered, the peer heard then) before it is next
//! changed, so its heartbeat and failure timers see the peer heard. Any change of the
//! connection remakes the lane (none while it is suspect, draining, closed or failed), a rail
//! that goes takes its lane with it, and a frame the lane does not admit takes the lookup and
//! [`Connection::handle_frame`], which says why it is dropped. From 719 to 596 instructions
//! per received 64-byte message on shared memory (`scripts/count-instructions --test am-rate`).
//!
//! A frame from a node with no connection that is not a well-formed `Hello` from that same
//! node, and any non-handshake frame of a connection that is not `Ready`, is dropped and
//! counted ([`NetStats::dropped_unauthenticated`]).
//!
//! ## Rendezvous
//!
//! A [`DATA_AM`] frame whose payload is longer than [`NetConfig::rndv_threshold`] (8 KiB by
//! default) is sent with UCX rendezvous ([`FrameFlags::RNDV`] in its header). The receiver's
//! callback keeps UCX's descriptor and queues it with the header; the dispatch checks the
//! header (size limit first, then `payload_len` against UCX's length, then the connection as
//! for any frame), and only then is a buffer chosen and the data pulled. Data nobody takes is
//! declined, which completes the sender's operation. The sender posts rendezvous frames in
//! queue order, but waits for their completion (the peer has pulled the data) in a task of
//! its own, so that heartbeats and small frames do not queue behind a large transfer; a
//! transfer not done within [`NetConfig::rndv_timeout`] fails the connection.
//!
//! Application frames of a ready connection are dispatched by kind:
//!
//! - [`FrameKind::Am`]: to the handler of their [`AmId`] ([`ShardCtx::set_frame_handler_am`]
//!   with the [`Frame`], or [`ShardCtx::set_net_handler`] with a copy of the payload; for
//!   rendezvous data, [`ShardCtx::set_net_handler_rndv`] chooses the destination buffer, else
//!   the data is pulled into a vector for the plain handler). [`ShardCtx::send_am`] sends one
//!   from any shard.
//! - Requests ([`FrameKind::RpcRequest`], [`FrameKind::RmaPut`], [`FrameKind::RmaGet`]) and
//!   [`FrameKind::RpcCancel`]: to the handler of their kind ([`ShardCtx::set_frame_handler`]),
//!   with the [`Frame`] (header: `id`, `req_id`, `ttl_ns`). A request whose `ttl_ns` is zero had
//!   no time left when sent and is dropped ([`NetStats::dropped_expired`]). The handler answers
//!   with [`ShardCtx::reply_now`] or [`ShardCtx::reply`]. For rendezvous data of a request
//!   kind, [`ShardCtx::set_frame_handler_rndv`] chooses the destination buffer per frame (a
//!   [`RndvBuf`]: pool, aligned host memory or a vector), else it is pulled into a vector.
//! - Replies ([`FrameKind::RpcResponse`], [`FrameKind::RpcError`], [`FrameKind::RmaReply`]):
//!   complete the pending request with their `req_id` on this shard, if it was sent to that
//!   node with a kind the reply answers; others are dropped
//!   ([`NetStats::dropped_unmatched`]).
//!
//! ## Requests
//!
//! See [`request`]: [`ShardCtx::request`] runs on the shard that holds the rail, with one
//! pending table per shard, a deadline carried in the frame's `ttl_ns`, one timer per shard for
//! all deadlines, and cancellation that reaches the owner and (for RPC) the server.
//!
//! The net task of each shard serves the timers: it sleeps until the earliest `poll_timeout`
//! of its connections (handshake deadline, heartbeats, suspicion and death) and requests, and
//! handles what is due. An endpoint error becomes [`Connection::handle_transport_error`]. A
//! connection that fails or closes is removed; its sender task flushes what is queued (a
//! `Reject`, a `Close`) within a linger time and drops the endpoint.
//!
//! ## Error modes
//!
//! UCX 1.12's shared-memory transports cannot detect a failed peer, so endpoints use
//! [`ErrorMode::Peer`] when the transport list contains `tcp` (or is not set) and
//! [`ErrorMode::None`] otherwise; heartbeats detect dead peers in both cases. The bootstrap
//! is a plain TCP exchange outside UCX, so any transport list can connect.
//!
//! The two endpoints of a pair must be in one mode: UCX 1.12 matches the endpoint a worker
//! makes toward a peer with the one the peer made toward it, and dies when their modes differ
//! (`ucs_fatal("endpoint reconfiguration not supported yet")` in `ucp_wireup_init_lanes`, or a
//! SIGSEGV after `ucp_ep_create` logs "asymmetric endpoint configuration is not supported").
//! So a `Hello` or `Join` says the mode of the endpoint it was sent on (the `mode` byte of its
//! AM header, above), and the endpoint that answers it is made in that mode, not this node's
//! (`session::endpoint_to`). Such a pair talks in the connecting side's mode: a node whose own
//! endpoints use PEER may hold a rail in mode NONE (from a shared-memory client), whose peer's
//! failure only heartbeats detect. An opening that says no mode (a build before 2026-12-03) is
//! answered in this node's own mode.
//!
//! History: until 2026-12-02 the answering endpoint asked for this node's mode, and a peer in
//! the other one crashed the node before any handshake (`shardcx node --transport tcp` under
//! `UCX_TLS=tcp`, connected to by `shardcx bench --transport shm`). The next fix asked UCX for
//! no mode, to adopt the internal endpoint the peer's wire-up made; but where that wire-up had
//! not arrived yet (the answering endpoint then gets UCX's default, NONE, and sends a wire-up
//! of its own), a peer in mode PEER died in `ucp_wireup_init_lanes` on receiving it (the fault
//! suite's R8, 64 client shards connecting at once, saw it on 2026-12-02).
//!
//! The connecting side's `ucp_ep_create` asks for its own mode: were the peer to have made an
//! endpoint toward it first (two nodes of different modes dialling each other at the same
//! moment, see the limits below), UCX 1.12 could match that one and crash there the same way.
//! UCX trusts what its peers' wire-up messages say: a modified peer that says one mode and
//! opens its endpoint in the other can still crash a node.
//!
//! ## Limits (what is not here yet)
//!
//! - A failed session is not re-established by itself (`max_reconnect_attempts` is 0): call
//!   [`ShardCtx::connect`] again.
//! - Two nodes connecting to each other at the same moment are not reconciled: a rail is one
//!   connection per shard pair, and the second handshake on it fails.
//!   Connecting to a node that is already connected (either way) returns the existing session.
//! - Payloads are capped by [`NetConfig::max_message_size`] (16 MiB by default) on both
//!   sides: a sender refuses a larger one with [`NetError::TooLarge`] before forwarding it; a
//!   receiver checks the announced length before it allocates or pulls anything and counts it
//!   in [`NetStats::dropped_too_large`]. Nodes with different limits can talk, but a frame
//!   over the receiver's limit is dropped silently (a request then times out).
//! - A request nobody handles is dropped, not answered with an error: its sender times out.
//! - There is no retry and no at-most-once window here: that is the RPC layer's, on top.
//! - No flow control: the number of requests in flight is bounded only by the mesh's lane
//!   capacity (from other shards) and by memory; rendezvous transfers in flight are not
//!   capped, and a receiver's pull of rendezvous data cannot hand its buffer back on timeout
//!   (UCX may still write it; it is dropped once UCX lets go).
//! - Rendezvous data arrives in order of its headers, but a rendezvous handler's `on_data`
//!   may run after handlers of frames that arrived later.
//! - Half-open handshakes are capped per shard ([`NetConfig::max_half_open`]): a flood of
//!   `Hello`s from made-up nodes can keep a legitimate new node out until their handshake
//!   deadline passes, but cannot exhaust the shard's endpoints. Bootstrap connections are
//!   also capped per client IP address ([`NetConfig::max_half_open_per_addr`]), so a flood
//!   of raw connections from one host leaves room for others; a flood from many addresses
//!   can still fill the listener until the attackers' [`NetConfig::accept_timeout`] passes.
//! - UCX 1.12 takes no memory handle per operation (`UCP_OP_ATTR_FIELD_MEMH` came later):
//!   registered buffers are found by UCX's registration cache.

//!
//! [`Connection`]: crate::proto::Connection
//! [`Connection::handle_frame`]: crate::proto::Connection::handle_frame
//! [`Connection::handle_transport_error`]: crate::proto::Connection::handle_transport_error
//! [`FrameHeader`]: crate::proto::FrameHeader
//! [`FrameFlags::RNDV`]: crate::proto::FrameFlags::RNDV
pub mod bootstrap;
pub mod buffers;
pub mod inbound;
pub mod outbound;
mod report;
pub mod request;
mod session;

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::{poll_fn, Future};
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use glommio::Task;

use crate::boot::ShardCtx;
use crate::proto::request::DedupHasher;
use crate::proto::{
    AmId, ConnConfig, FrameHeader, FrameKind, HandshakeConfig, Incarnation, Limits, NodeId,
    PendingTable, PreSharedKey, ShardId, State, Timestamp,
};
use crate::ucx::{AmIdRaw, EpOptions, ErrorMode, Worker};

pub use crate::error::NetError;
pub use bootstrap::Directory;
pub use buffers::RecycledBuf;
pub use inbound::{preempt_due, Frame, FrameView, Incoming, Payload, RndvBuf};

use inbound::{AnyHandler, Inbound, RndvHandler};
use request::Pending;
pub use request::{ReplyHandler, SentRequest};
use session::PeerRails;

/// UCX active-message id of control frames between connected nodes (see the module docs).
pub const FRAME_AM: AmIdRaw = 0x5C01;
/// UCX active-message id of application frames, eager or rendezvous (see the module docs).
pub const DATA_AM: AmIdRaw = 0x5C02;
/// Bytes of the routing part of a UCX AM header: the sender's node id and an address length.
pub const AM_HEADER_LEN: usize = 16;
/// Most bytes of the UCX AM header of a [`DATA_AM`] message before its user header: its data
/// header (see [`data_am_header`]).
pub const DATA_HEADER_LEN: usize = crate::proto::wire::DATA_HEADER_MAX;
/// Longest user header of an application frame (the application's AM header). UCX 1.12 carries
/// an AM header in one fragment of its transport, about 8 KiB on shared memory and TCP.
pub const MAX_USER_HEADER: usize = 4096;
/// Longest timeout a [`ShardCtx::request`] may wait (longer ones are cut to this).
pub const MAX_REQUEST_TIMEOUT: Duration = Duration::from_secs(24 * 3600);

/// How often a shard that is shutting down looks whether its requests have been answered.
const DRAIN_POLL: Duration = Duration::from_millis(2);
/// Largest worker address accepted in a directory or a hello.
const MAX_ADDR_LEN: usize = 64 << 10;

/// Settings of the connections between nodes.
#[derive(Debug, Clone)]
pub struct NetConfig {
    /// Time allowed for a bootstrap (listener connect and directory), default 5 s.
    pub connect_timeout: Duration,
    /// Time a client connected to the listener has to send its bootstrap request before the
    /// listener closes the connection ([`NetStats::bootstraps_timed_out`]), default 3 s.
    pub accept_timeout: Duration,
    /// Most half-open connections per shard: bootstrap connections the listener is serving,
    /// and, on each shard, rails opened by a `Hello` whose handshake is not complete. Beyond
    /// it a new bootstrap connection is closed at once ([`NetStats::bootstraps_over_cap`])
    /// and a new `Hello` is dropped unanswered ([`NetStats::openings_over_cap`]). Default 64.
    pub max_half_open: usize,
    /// Most bootstrap connections the listener serves at once from one client IP address;
    /// beyond it a new one from that address is closed at once
    /// ([`NetStats::bootstraps_over_cap`]). Default 16: a flood from one host cannot fill
    /// [`NetConfig::max_half_open`] and keep other clients out.
    pub max_half_open_per_addr: usize,
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
    /// Application payloads longer than this many bytes travel by rendezvous; shorter ones
    /// eager. Default 8 KiB.
    pub rndv_threshold: usize,
    /// Largest application payload this node sends or accepts, checked before anything is
    /// allocated for it. Default [`Limits::DEFAULT_MAX_MESSAGE_SIZE`] (16 MiB).
    pub max_message_size: u64,
    /// Time allowed for one rendezvous transfer, on either side, default 10 s. A sender whose
    /// payload is not pulled in time fails the connection; a receiver that has not received
    /// the data in time gives up on it ([`NetError::TimedOut`]).
    pub rndv_timeout: Duration,
    /// Idle receive vectors kept per shard for rendezvous data that no handler chose a buffer
    /// for and that did not fit the shard's pool ([`buffers`]), default 32 MiB.
    pub rndv_cache_bytes: usize,
    /// Bytes of one rail's rendezvous data (from one shard of a peer) that may be in flight
    /// at once into buffers the runtime picks (frames with no rendezvous handler, such as the
    /// facade's active messages and checked puts); default 512 KiB. A pull starts while the
    /// rail's pulls in flight are under it (one always starts when none is), the others wait
    /// in arrival order and take their buffer when they start, so that a stream of large
    /// messages lands in a few buffers still in the receiving core's cache (see [`buffers`],
    /// "Pulls in flight, per rail"). Pulls of other rails, and into buffers a handler chose,
    /// never wait for it. Waits are counted in
    /// [`NetStats::rndv_pulls_waited`]. `usize::MAX` lets every pull start at once, as before
    /// this setting existed; 0 pulls one at a time.
    pub rndv_pull_budget: usize,
    /// Most bytes of application frames (headers and payload) one rail may hold that UCX has
    /// not completed: queued for the rail's sender, or posted and not yet taken by the peer
    /// (a rendezvous not yet pulled). A peer that is stopped, slow or cut off stops
    /// completing sends; without a bound, a sender that does not wait for answers would queue
    /// without end. A send that would go over it is refused at once with
    /// [`NetError::Backlogged`] (nothing queued, nothing sent; counted in
    /// [`NetStats::sends_backlogged`]); a rail that holds nothing takes any frame up to
    /// [`NetConfig::max_message_size`]. Frames UCX takes in place never count. Default
    /// 64 MiB. [`ShardCtx::backlog_bytes`](crate::ShardCtx::backlog_bytes) reads a peer's
    /// backlog, [`NetStats::backlog_peak_bytes`] the largest seen.
    pub max_backlog_bytes: u64,
    /// Frames from one peer that this node refused as malformed ([`ShardCtx::strike`]: an RPC
    /// request whose envelope or arguments do not decode) within [`NetConfig::strike_window`],
    /// counted over all of the node's shards, at which the peer is dropped ([`ShardCtx::drop_peer`]): every shard
    /// closes its rails to it, its session is forgotten, and its handshakes are refused
    /// ([`RejectReason::Banned`](crate::proto::handshake::RejectReason::Banned)) for
    /// [`NetConfig::strike_ban`]. Default 100; 0 never drops a peer.
    pub strike_limit: u32,
    /// The window of [`NetConfig::strike_limit`], default 10 s.
    pub strike_window: Duration,
    /// How long a dropped peer is refused, default 30 s.
    pub strike_ban: Duration,
    /// How long a send from a task waits for room when UCX's send queue to the peer is full
    /// (a shared-memory FIFO, a socket's buffer), progressing the shard's UCX worker while it
    /// waits, so that a producer that outruns its receiver is paced at the receiver's speed
    /// instead of queueing copies behind the full queue ([`NetStats::sends_paced`]; see "The
    /// hot path" in the module docs). Frames that arrive meanwhile are recorded for the
    /// driver, in order; no handler runs inside the send. Past it, the frame is posted or
    /// queued as it would be without waiting ([`NetStats::pace_timeouts`]), and the rail's
    /// sends do not wait again for twenty times this span. Sends from handlers (and anything
    /// else the progress driver runs) never wait. Default 500 µs (a receiver frees
    /// slots of UCX's shared-memory FIFO in batches of half of it, 32 messages: a handler
    /// of 10 µs a message makes a sender wait about 320 µs); `Duration::ZERO` never waits.
    pub send_pace: Duration,
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

/// Where a frame or request goes: a node, on the calling shard's default rail to it, or one
/// shard of it (see "Rails" in the module docs, and the `session` module's). A [`NodeId`] converts
/// into the former.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Dest {
    /// The remote node.
    pub node: NodeId,
    /// The remote shard, or `None` for the calling shard's default rail.
    pub shard: Option<ShardId>,
}

impl Dest {
    /// Shard `shard` of `node`.
    pub fn shard(node: NodeId, shard: ShardId) -> Dest {
        Dest {
            node,
            shard: Some(shard),
        }
    }
}

/// Where a call runs (see [`ShardCtx::route`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Route {
    /// On this shard, on its rail to this remote shard.
    Here(ShardId),
    /// Forwarded to this local shard, which holds the rail.
    There(ShardId),
}

impl From<NodeId> for Dest {
    fn from(node: NodeId) -> Dest {
        Dest { node, shard: None }
    }
}

/// Counters of one shard's connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Pre-shared-key handshakes completed on this shard (one per node pair and session).
    pub handshakes: u64,
    /// Rails that joined a session on this shard (`Join`/`Joined` completed).
    pub joins: u64,
    /// Joins tried again because the peer did not know the session yet (its primary rail's
    /// shard had not finished the handshake when the join reached another of its shards).
    pub join_retries: u64,
    /// Application frames delivered to handlers.
    pub delivered: u64,
    /// Application frames with eager data dispatched inside UCX's receive callback (the
    /// others were recorded and dispatched by the driver right after `progress`: rendezvous
    /// data, and frames that arrived behind recorded inputs).
    pub dispatched_in_callback: u64,
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
    /// Application frames handed to UCX in place (no copy, no request: see "The hot path").
    pub sent_in_place: u64,
    /// Application frames posted to UCX at once from an owned buffer (longer than UCX's
    /// short-message limit, or a rendezvous; nothing queued before them): no task switch;
    /// the rail's sender tracks the completion when UCX does not complete them at once.
    pub sent_posted: u64,
    /// Application frames queued for the connection's sender task instead (UCX could not take
    /// them at once, or frames before them were still queued), copied when borrowed.
    pub sent_queued: u64,
    /// Handler calls that panicked (caught on the driver; the frame is dropped, the shard
    /// goes on).
    pub handler_panics: u64,
    /// Dispatch rounds that stopped at the driver's budget with inputs left (a flood).
    pub dispatch_budget_hits: u64,
    /// Dispatches cut short because the shard's executor wanted the thread back for its
    /// timers and I/O (glommio's preempt timer fired: slow handlers): a driver round that
    /// left inputs recorded for the next one, or a `progress` call whose later frames were
    /// recorded instead of dispatched in UCX's callback (counted when the cut is made, also
    /// if no frame came after it).
    pub dispatch_preempted: u64,
    /// Rendezvous data without a chosen buffer received into a block of the shard's pool.
    pub rndv_pooled: u64,
    /// ... into a recycled vector of the shard's receive cache ([`buffers`]).
    pub rndv_recycled: u64,
    /// ... into a vector allocated for it (the cache had none of its size class idle).
    pub rndv_allocated: u64,
    /// Rendezvous pulls into the runtime's buffers that waited for the same rail's earlier ones
    /// ([`NetConfig::rndv_pull_budget`]).
    pub rndv_pulls_waited: u64,
    /// Bootstrap connections answered with the directory (on the listening shard).
    pub bootstraps_served: u64,
    /// Bootstrap connections closed because their first bytes were not a bootstrap request
    /// (a foreign client, a UCX client dialling the port, garbage).
    pub bootstraps_refused: u64,
    /// Bootstrap connections closed because no request came within
    /// [`NetConfig::accept_timeout`].
    pub bootstraps_timed_out: u64,
    /// Bootstrap connections closed as soon as accepted: [`NetConfig::max_half_open`] were
    /// being served.
    pub bootstraps_over_cap: u64,
    /// `Hello`s dropped unanswered (no endpoint made) because this shard had
    /// [`NetConfig::max_half_open`] rails whose server handshake was not complete.
    pub openings_over_cap: u64,
    /// Rails opened by a peer whose handshake did not complete within
    /// [`NetConfig::handshake_timeout`]; their endpoints were closed. Pending openings are
    /// counted apart ([`NetStats::pending_expired`]).
    pub handshakes_expired: u64,
    /// `Hello`s for a rail that was ready, each answered by a pending opening beside the rail
    /// (a connection and an endpoint of its own; see "Openings beside a ready rail" in the
    /// `session` docs): a peer that restarted or reconnects, or anyone naming it.
    pub pending_openings: u64,
    /// Pending openings closed without replacing their rail: their handshake failed (a wrong
    /// proof, a refusal, a transport error), it completed for an incarnation older than the
    /// rail's by then, or a later `Hello` of the same node, shard and incarnation from another
    /// worker address took their place.
    pub pending_refused: u64,
    /// Pending openings closed at [`NetConfig::handshake_timeout`] without replacing their
    /// rail (not counted in [`NetStats::handshakes_expired`]).
    pub pending_expired: u64,
    /// Application frames received on this shard's rails and handed on (to a handler or a
    /// pending request), by [`Traffic`] class (index: `Traffic as usize`).
    pub frames_in: [u64; Traffic::COUNT],
    /// Their payload bytes (rendezvous data included), by [`Traffic`] class.
    pub bytes_in: [u64; Traffic::COUNT],
    /// Application frames sent from this shard (in place, posted or queued), by [`Traffic`]
    /// class.
    pub frames_out: [u64; Traffic::COUNT],
    /// Their payload bytes, by [`Traffic`] class.
    pub bytes_out: [u64; Traffic::COUNT],
    /// Times a ready rail's peer went silent for `suspect_after` heartbeat intervals
    /// ([`NetConfig::suspect_after`]).
    pub heartbeat_misses: u64,
    /// Rails whose peer stayed silent for `dead_after` heartbeat intervals and was declared
    /// dead.
    pub peers_dead: u64,
    /// Rails that failed (handshake, transport error, dead peer), whatever the cause.
    pub rails_failed: u64,
    /// Sessions that a peer's restart (a new incarnation) replaced.
    pub peer_restarts: u64,
    /// Connects the facade made by itself to a peer's known address when an operation found
    /// no session (its first use, or after the session was lost), that succeeded.
    pub reconnects: u64,
    /// ... that failed (the peer then backs off).
    pub reconnects_failed: u64,
    /// Sends refused because their rail held [`NetConfig::max_backlog_bytes`] already
    /// ([`NetError::Backlogged`]).
    pub sends_backlogged: u64,
    /// The most bytes one of this shard's rails has held that UCX had not completed (see
    /// [`NetConfig::max_backlog_bytes`]), since the shard started.
    pub backlog_peak_bytes: u64,
    /// Peers this shard dropped for misbehaviour ([`NetConfig::strike_limit`],
    /// [`ShardCtx::drop_peer`]).
    pub peers_dropped: u64,
    /// Handshakes refused because their node was dropped and is still banned.
    pub refused_banned: u64,
    /// Of [`NetStats::sent_in_place`], frames sent from a task that found UCX's send queue
    /// full and waited for room ([`NetConfig::send_pace`]).
    pub sends_paced: u64,
    /// Sends from a task that waited [`NetConfig::send_pace`] without UCX taking the frame,
    /// which was then posted or queued.
    pub pace_timeouts: u64,
}

/// A shard's rails by state ([`ShardCtx::rail_states`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RailStates {
    /// Handshake or join under way.
    pub connecting: usize,
    /// Frames flow.
    pub ready: usize,
    /// Finishing in-flight work before closing.
    pub draining: usize,
    /// Failed or closed, not yet removed.
    pub closing: usize,
    /// Pending openings beside ready rails (a peer's restart or reconnect under way).
    pub pending_openings: usize,
}

/// What an application frame carries, for [`NetStats`]' traffic counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Traffic {
    /// Active messages (application ids).
    Am = 0,
    /// Tag messages ([`crate::tag`]).
    Tag = 1,
    /// RPC requests, replies, errors and cancels.
    Rpc = 2,
    /// Checked remote memory access (put, get and their replies).
    Rma = 3,
}

impl Traffic {
    /// How many classes there are.
    pub const COUNT: usize = 4;
    /// Every class, in index order.
    pub const ALL: [Traffic; Traffic::COUNT] =
        [Traffic::Am, Traffic::Tag, Traffic::Rpc, Traffic::Rma];

    /// The class of an application frame of `kind` with AM id `id`; `None` for the
    /// connection's own frames (handshake, heartbeats, close).
    pub fn of(kind: FrameKind, id: u32) -> Option<Traffic> {
        match kind {
            FrameKind::Am if id == crate::tag::TAG_AM.get() => Some(Traffic::Tag),
            FrameKind::Am => Some(Traffic::Am),
            FrameKind::RpcRequest
            | FrameKind::RpcResponse
            | FrameKind::RpcError
            | FrameKind::RpcCancel => Some(Traffic::Rpc),
            FrameKind::RmaPut | FrameKind::RmaGet | FrameKind::RmaReply => Some(Traffic::Rma),
            _ => None,
        }
    }

    /// Its name in metrics and logs: `am`, `tag`, `rpc`, `rma`.
    pub fn name(self) -> &'static str {
        match self {
            Traffic::Am => "am",
            Traffic::Tag => "tag",
            Traffic::Rpc => "rpc",
            Traffic::Rma => "rma",
        }
    }
}

impl NetStats {
    /// The frames dropped, by reason, each with its name in metrics and logs (`reason` label).
    pub fn dropped_by_reason(&self) -> [(&'static str, u64); 8] {
        [
            ("unauthenticated", self.dropped_unauthenticated),
            ("malformed", self.dropped_malformed),
            ("misrouted", self.dropped_misrouted),
            ("no_handler", self.dropped_no_handler),
            ("too_large", self.dropped_too_large),
            ("expired", self.dropped_expired),
            ("unmatched_reply", self.dropped_unmatched),
            ("other", self.dropped_other),
        ]
    }

    /// Counts a frame handed to its handler (`inline`: dispatched in UCX's callback).
    #[inline]
    pub(crate) fn delivered_frame(&mut self, header: &FrameHeader, inline: bool) {
        self.delivered += 1;
        self.dispatched_in_callback += u64::from(inline);
        self.traffic(header, true);
    }

    /// Counts one frame of `header`'s kind and payload in (`inbound`) or out.
    pub(crate) fn traffic(&mut self, header: &FrameHeader, inbound: bool) {
        self.traffic_of(header.kind, header.id, header.payload_len, inbound);
    }

    /// Counts one frame of `kind` and `id` with `len` payload bytes in (`inbound`) or out.
    pub(crate) fn traffic_of(&mut self, kind: FrameKind, id: u32, len: u64, inbound: bool) {
        if let Some(t) = Traffic::of(kind, id) {
            let (frames, bytes) = if inbound {
                (&mut self.frames_in, &mut self.bytes_in)
            } else {
                (&mut self.frames_out, &mut self.bytes_out)
            };
            frames[t as usize] += 1;
            bytes[t as usize] += len;
        }
    }
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
    /// The node's sessions, shared by its shards (see `session`).
    pub(crate) sessions: session::SessionTable,
    /// The peers this node dropped for misbehaviour, shared by its shards (see
    /// [`ShardCtx::drop_peer`]).
    pub(crate) bans: std::sync::Arc<Bans>,
}

/// Nodes dropped for misbehaviour and until when their handshakes are refused
/// ([`RejectReason::Banned`](crate::proto::handshake::RejectReason::Banned)); a generation
/// that every shard's timer compares with the one it last saw, to close its own rails to a node
/// another shard dropped.
#[derive(Debug, Default)]
pub(crate) struct Bans {
    until: std::sync::Mutex<HashMap<NodeId, Instant>>,
    generation: std::sync::atomic::AtomicU64,
    /// Strikes against peers, counted node-wide ([`ShardCtx::strike`]): when the current window
    /// began, and how many in it.
    strikes: std::sync::Mutex<HashMap<NodeId, (Instant, u32)>>,
}

impl Bans {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<NodeId, Instant>> {
        self.until.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether `node` is refused now (an expired ban is forgotten).
    pub(crate) fn is_banned(&self, node: NodeId) -> bool {
        let mut until = self.lock();
        match until.get(&node) {
            Some(t) if *t > Instant::now() => true,
            Some(_) => {
                until.remove(&node);
                false
            }
            None => false,
        }
    }

    fn ban(&self, node: NodeId, until: Instant) {
        self.lock().insert(node, until);
        self.generation
            .fetch_add(1, std::sync::atomic::Ordering::Release);
    }

    pub(crate) fn generation(&self) -> u64 {
        self.generation.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Counts one strike against `node` at `now`; true when it reaches `limit` within
    /// `window` (the count then starts again).
    fn strike(&self, node: NodeId, now: Instant, limit: u32, window: Duration) -> bool {
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        let e = strikes.entry(node).or_insert((now, 0));
        if now.duration_since(e.0) > window {
            *e = (now, 0);
        }
        e.1 += 1;
        let out = e.1 >= limit;
        if out {
            strikes.remove(&node);
        }
        out
    }

    fn forgive(&self, node: NodeId) {
        let mut strikes = self.strikes.lock().unwrap_or_else(|e| e.into_inner());
        strikes.remove(&node);
    }
}

type LostHook = Rc<dyn Fn(Option<NodeId>, &NetError)>;

/// A single-consumer queue with a waker; `close` ends the consumer's `next` once empty.
pub(crate) struct Queue<T> {
    items: RefCell<VecDeque<T>>,
    waker: RefCell<Option<Waker>>,
    closed: Cell<bool>,
}

/// Where the answer of one operation lands, for the one task that waits for it (cheaper than a
/// [`Queue`]: one allocation per operation).
pub(crate) struct Slot<T> {
    value: RefCell<Option<T>>,
    waker: RefCell<Option<Waker>>,
}

/// One task waiting for shard 0 to establish a node pair (see `session`): the outcome, or
/// `None` when the caller establishing it gave up before the end (its future dropped).
type EstablishWaiter = Rc<Slot<Option<Result<(), NetError>>>>;

/// The epoch of the net layer's [`Timestamp`]s: the first time one was taken in this process.
/// One for every shard, so that a frame's arrival ([`Frame::arrived_at`]) means the same on
/// any of them.
fn epoch() -> Instant {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

/// `at` as a [`Timestamp`] of the net layer's clock (nanoseconds since its epoch, saturating:
/// an instant before the epoch is zero), the clock of [`Frame::arrived_at`].
pub fn timestamp_of(at: Instant) -> Timestamp {
    let since = at.saturating_duration_since(epoch());
    Timestamp::from_nanos(crate::proto::time::duration_to_nanos(since))
}

/// The instant of a net-layer [`Timestamp`] (see [`timestamp_of`]).
pub fn instant_of(t: Timestamp) -> Instant {
    epoch() + Duration::from_nanos(t.as_nanos())
}

/// The rail a frame came in on, for its handler's call ([`NetState::inline_rail`]).
pub(crate) struct InlineRail {
    node: NodeId,
    remote: ShardId,
    tx: Rc<session::RailTx>,
}

/// How the frame whose handler is about to run came in ([`NetState::set_inline_rail`]).
pub(crate) enum Arrival {
    /// On the rail the last frame came in on ([`NetState::rx_rail`]), admitted by its lane:
    /// the handler's answer finds that rail there, with no reference counted for the call.
    Lane,
    /// On this rail, found in the peer table.
    Rail(InlineRail),
}

/// A destination looked up, and the rail it routes to ([`NetState::route_cache`]).
pub(crate) struct CachedRoute {
    dest: Dest,
    remote: ShardId,
    tx: Rc<session::RailTx>,
}

/// Forgets the rail of the frame whose handler ran ([`NetState::set_inline_rail`]). It does
/// not restore an earlier one: dispatches do not nest (a frame that arrives during another's
/// dispatch is recorded, `NetState::dispatching`).
pub(crate) struct InlineRailGuard<'a>(&'a NetState);

impl Drop for InlineRailGuard<'_> {
    #[inline]
    fn drop(&mut self) {
        if self.0.inline_lane.replace(false) {
            return;
        }
        if let Ok(mut slot) = self.0.inline_rail.try_borrow_mut() {
            *slot = None;
        }
    }
}

/// The handlers of AM ids on one shard, with the last one looked up kept beside the table
/// (most traffic uses a few ids: a hit costs a comparison, not a hash and a probe).
struct Handlers {
    map: RefCell<HashMap<AmId, AnyHandler, DedupHasher>>,
    last: RefCell<Option<(AmId, AnyHandler)>>,
}

impl Handlers {
    fn new(hasher: DedupHasher) -> Handlers {
        Handlers {
            map: RefCell::new(HashMap::with_hasher(hasher)),
            last: RefCell::new(None),
        }
    }

    /// The handler of `id`.
    #[inline(always)]
    fn get(&self, id: AmId) -> Option<AnyHandler> {
        if let Ok(last) = self.last.try_borrow() {
            if let Some((_, h)) = last.as_ref().filter(|(i, _)| *i == id) {
                return Some(h.clone());
            }
        }
        let h = self.map.borrow().get(&id).cloned();
        if let (Some(h), Ok(mut last)) = (&h, self.last.try_borrow_mut()) {
            *last = Some((id, h.clone()));
        }
        h
    }

    /// Whether `id` has a handler.
    fn contains(&self, id: AmId) -> bool {
        self.map.borrow().contains_key(&id)
    }

    /// Installs the handler of `id`, replacing any previous one.
    fn insert(&self, id: AmId, handler: AnyHandler) {
        self.map.borrow_mut().insert(id, handler);
        // A handler looked up before is not used again (held by a dispatch, it runs to its end).
        if let Ok(mut last) = self.last.try_borrow_mut() {
            *last = None;
        }
    }
}

/// One shard's network state (in its [`ShardCtx`]).
pub(crate) struct NetState {
    settings: NodeSettings,
    my_address: Vec<u8>,
    /// What UCX's callbacks (and the sender tasks) recorded, in arrival order, for the
    /// driver's dispatch ([`inbound`]).
    inbox: Rc<RefCell<VecDeque<Inbound>>>,
    // Looked up once per frame: hashed with proto's keyed multiply-fold hash rather than
    // SipHash (keys from the network; one random key per shard, see `DedupHasher`).
    peers: RefCell<HashMap<NodeId, PeerRails, DedupHasher>>,
    /// On shard 0: node pairs being established, with who waits for each (see `session`).
    establishing: RefCell<HashMap<NodeId, Vec<EstablishWaiter>>>,
    handlers: Handlers,
    rndv_handlers: RefCell<HashMap<AmId, RndvHandler, DedupHasher>>,
    frame_handlers: RefCell<inbound::KindHandlers>,
    frame_rndv_handlers: RefCell<HashMap<FrameKind, RndvHandler, DedupHasher>>,
    pending: RefCell<PendingTable<Pending>>,
    limits: Limits,
    stats: RefCell<NetStats>,
    generation: Cell<u64>,
    tasks: RefCell<Vec<Task<()>>>,
    /// Called when a connection ends (see [`ShardCtx::on_peer_lost`]).
    lost_hooks: RefCell<Vec<LostHook>>,
    /// The listener's accept loop (shard 0 of a listening node), until it stops accepting.
    acceptor: RefCell<Option<Task<()>>>,
    live_senders: Rc<Cell<usize>>,
    /// Rendezvous sends whose data the peer has not pulled yet (counted by the rail's sender
    /// while it awaits their completion): a shutdown closes no rail under them.
    rndv_in_flight: Rc<Cell<usize>>,
    /// When the net task's timer fires ([`Timestamp::MAX`]: no timer armed). A deadline due
    /// earlier wakes the net task to re-arm it ([`NetState::rearm`]).
    timer_at: Cell<Timestamp>,
    /// The net task, while it waits.
    timer_waker: RefCell<Option<Waker>>,
    /// Set by [`NetState::rearm`]: the net task looks at its deadlines again.
    rearm_asked: Cell<bool>,
    /// Set by [`shutdown`]: the net task has ended or is ending.
    closed: Cell<bool>,
    /// The worker's largest AM header ([`crate::ucx::Worker::max_am_header`]).
    max_am_header: usize,
    /// Idle vectors for rendezvous data ([`buffers`]).
    recv_cache: Rc<RefCell<buffers::RecvCache>>,
    /// Rendezvous pulls into the runtime's buffers, per rail ([`buffers::PullGates`]).
    pulls: RefCell<buffers::PullGates<inbound::WaitingPull>>,
    /// The clock reading of the driver's current round, taken by the first frame of the round
    /// that needs one: the round's number and the reading ([`NetState::batch_now`]).
    batch: Cell<Option<(u64, Timestamp, Instant)>>,
    /// The rail of the frame whose handler runs, when its dispatch looked that rail up (set for
    /// the handler's call; a frame its lane admitted sets `inline_lane` instead), so that the
    /// handler's answer on that rail finds it with no lookup ([`NetState::inline_rail_to`]).
    inline_rail: RefCell<Option<InlineRail>>,
    /// Set instead of `inline_rail` while the handler of a frame its lane admitted runs: its
    /// rail is the one in `rx_rail` ([`Arrival::Lane`]).
    inline_lane: Cell<bool>,
    /// The last destination a send or route looked up, and its rail (most calls from a task go
    /// to the peer the last one went to): a hit costs a comparison, not a hash and a probe.
    /// Forgotten whenever this shard's rails change ([`NetState::rails_changed`]); a rail that
    /// goes is never found through it (its template is gone).
    route_cache: RefCell<Option<CachedRoute>>,
    /// The rail the last application frame came in on (most frames come on the rail the last
    /// one came on): a frame from the same node and remote shard that the rail's
    /// [`DataLane`](crate::proto::DataLane) admits is delivered with no look into the peer
    /// table and no call into the connection ([`inbound`]'s `accepted`). Forgotten whenever
    /// this shard's rails change; a rail that goes admits nothing (its lane is gone).
    rx_rail: RefCell<Option<InlineRail>>,
    /// Set while a frame is dispatched inside UCX's callback: a frame UCX delivers meanwhile
    /// (a handler's send to its own worker) is recorded instead ([`inbound`]). Also set while
    /// a task's send waits for room and progresses the worker ([`outbound`]'s `send_paced`),
    /// so that what arrives then is recorded too and no handler runs inside the send.
    dispatching: Cell<bool>,
    /// Frames that may still be dispatched inside UCX's callback during the current
    /// `progress` call: set to [`crate::driver::DISPATCH_BUDGET`] by the dispatch hook after
    /// every round; past it, frames are recorded and dispatched by the driver a budget per
    /// round (one `progress` call can deliver thousands over tcp: handled in one go, they
    /// would keep the shard's timers, heartbeats and other tasks waiting).
    inline_left: Cell<usize>,
    /// The buffers short eager payloads are copied into for an inline dispatch, oldest
    /// first, each reused once no frame keeps it ([`inbound`]).
    inline_bytes: RefCell<VecDeque<Rc<Vec<u8>>>>,
    /// The vector of the last short request sent, for the next one's encoding
    /// ([`ShardCtx::request_buffer`]).
    spare_request: crate::SpareVec,
    /// The waiters of requests answered on this shard, for the next ones (`request`): up to
    /// [`request::SPARE_WAITERS`], so that a window of calls in flight together allocates
    /// none once the first window has run.
    spare_waiters: RefCell<Vec<Rc<Slot<request::Reply>>>>,
    /// The [`Bans`] generation this shard last closed rails for.
    bans_seen: Cell<u64>,
    /// The most bytes one rail's backlog held ([`NetStats::backlog_peak_bytes`], which is
    /// written only when this grows: the stats are not borrowed for every posted frame).
    backlog_peak: Cell<u64>,
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
            accept_timeout: Duration::from_secs(3),
            max_half_open: 64,
            max_half_open_per_addr: 16,
            handshake_timeout: Duration::from_secs(5),
            heartbeat_interval: Duration::from_millis(100),
            suspect_after: 3,
            dead_after: 10,
            linger: Duration::from_secs(1),
            error_mode: None,
            rndv_threshold: 8 << 10,
            max_message_size: Limits::DEFAULT_MAX_MESSAGE_SIZE,
            rndv_timeout: Duration::from_secs(10),
            rndv_cache_bytes: 32 << 20,
            rndv_pull_budget: 512 << 10,
            max_backlog_bytes: 64 << 20,
            strike_limit: 100,
            strike_window: Duration::from_secs(10),
            strike_ban: Duration::from_secs(30),
            send_pace: Duration::from_micros(500),
        }
    }
}

/// Reads little-endian integers off the front of a byte slice.
pub(crate) struct Reader<'a>(pub(crate) &'a [u8]);

impl<'a> Reader<'a> {
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }

    pub(crate) fn u32(&mut self) -> Option<u32> {
        let mut w = [0u8; 4];
        w.copy_from_slice(self.take(4)?);
        Some(u32::from_le_bytes(w))
    }

    pub(crate) fn u64(&mut self) -> Option<u64> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Some(u64::from_le_bytes(w))
    }
}

/// The routing part of a UCX AM header ([`FRAME_AM`], and the start of a [`DATA_AM`] one) from
/// `node` whose payload starts with an address of `addr_len` bytes (no error mode said).
pub fn frame_am_header(node: NodeId, addr_len: u32) -> [u8; AM_HEADER_LEN] {
    let mut h = [0u8; AM_HEADER_LEN];
    h[..8].copy_from_slice(&node.get().to_le_bytes());
    h[8..12].copy_from_slice(&addr_len.to_le_bytes());
    h
}

/// The [`FRAME_AM`] header of a `Hello` or `Join` from `node` whose payload starts with its
/// worker address (`addr_len` bytes), sent on an endpoint in error mode `mode`: the receiver
/// answers in that mode (see "Error modes" in the module docs).
pub fn opening_am_header(node: NodeId, addr_len: u32, mode: ErrorMode) -> [u8; AM_HEADER_LEN] {
    let mut h = frame_am_header(node, addr_len);
    h[12] = match mode {
        ErrorMode::None => 1,
        ErrorMode::Peer => 2,
    };
    h
}

/// The UCX AM header of a [`DATA_AM`] message from `node`: the data header of `header` (proto's
/// `wire` module, "Data header"), then `user`.
pub fn data_am_header(node: NodeId, header: &FrameHeader, user: &[u8]) -> Vec<u8> {
    let mut h = vec![0u8; header.data_header_len() + user.len()];
    // Cannot fail: `h` has the data header's length and more.
    let n = header.encode_data(node, &mut h).unwrap_or(0);
    h[n..].copy_from_slice(user);
    h
}

/// What a [`FRAME_AM`] header says (see "Frames on UCX" in the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct ControlHead {
    /// The sender.
    node: NodeId,
    /// Length of the worker address that starts the payload (0: none).
    addr_len: usize,
    /// The error mode of the sender's endpoint (`None` when not said).
    mode: Option<ErrorMode>,
}

/// A [`FRAME_AM`] header; `None` when malformed (a wrong length, an address too long, an
/// unknown mode, a reserved byte set).
fn parse_am_header(h: &[u8]) -> Option<ControlHead> {
    if h.len() != AM_HEADER_LEN || h[13..].iter().any(|&b| b != 0) {
        return None;
    }
    let mode = match h[12] {
        0 => None,
        1 => Some(ErrorMode::None),
        2 => Some(ErrorMode::Peer),
        _ => return None,
    };
    let mut r = Reader(h);
    let node = NodeId::new(r.u64()?);
    let addr_len = r.u32()? as usize;
    (addr_len <= MAX_ADDR_LEN).then_some(ControlHead {
        node,
        addr_len,
        mode,
    })
}

impl<T> Queue<T> {
    pub(crate) fn new() -> Rc<Self> {
        Rc::new(Self {
            items: RefCell::new(VecDeque::new()),
            waker: RefCell::new(None),
            closed: Cell::new(false),
        })
    }

    pub(crate) fn push(&self, item: T) -> bool {
        if self.closed.get() {
            return false;
        }
        self.items.borrow_mut().push_back(item);
        self.wake();
        true
    }

    pub(crate) fn close(&self) {
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
    pub(crate) fn is_idle(&self) -> bool {
        !self.closed.get() && self.items.borrow().is_empty()
    }

    /// Whether the queue holds items (open or closed).
    pub(crate) fn has_items(&self) -> bool {
        !self.items.borrow().is_empty()
    }

    pub(crate) fn try_next(&self) -> Option<T> {
        self.items.borrow_mut().pop_front()
    }

    pub(crate) fn next(&self) -> impl Future<Output = Option<T>> + '_ {
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

impl<T> Slot<T> {
    pub(crate) fn new() -> Rc<Self> {
        Rc::new(Self {
            value: RefCell::new(None),
            waker: RefCell::new(None),
        })
    }

    /// Stores the answer (the first one wins) and wakes the waiting task.
    pub(crate) fn push(&self, value: T) {
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

    /// Forgets the answer and the waiting task, if any: the slot is as new.
    pub(crate) fn reset(&self) {
        self.value.borrow_mut().take();
        self.waker.borrow_mut().take();
    }

    /// Resolves with the answer.
    pub(crate) fn wait(&self) -> impl Future<Output = T> + '_ {
        poll_fn(move |cx| match self.value.borrow_mut().take() {
            Some(v) => Poll::Ready(v),
            None => {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
    }
}

impl NetState {
    pub(crate) fn new(settings: NodeSettings, worker: &Worker) -> Result<Self, crate::ucx::Error> {
        let limits = Limits {
            max_message_size: settings.cfg.max_message_size,
        };
        let recv_cache = buffers::RecvCache::new(settings.cfg.rndv_cache_bytes);
        let hasher = DedupHasher::random();
        let pulls = RefCell::new(buffers::PullGates::new(
            settings.cfg.rndv_pull_budget,
            hasher.clone(),
        ));
        Ok(Self {
            settings,
            my_address: worker.address()?.as_bytes().to_vec(),
            inbox: Rc::new(RefCell::new(VecDeque::new())),
            limits,
            peers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            establishing: RefCell::new(HashMap::new()),
            handlers: Handlers::new(hasher.clone()),
            rndv_handlers: RefCell::new(HashMap::with_hasher(hasher.clone())),
            frame_handlers: RefCell::default(),
            frame_rndv_handlers: RefCell::new(HashMap::with_hasher(hasher)),
            pending: RefCell::new(PendingTable::new()),
            stats: RefCell::new(NetStats::default()),
            generation: Cell::new(0),
            tasks: RefCell::new(Vec::new()),
            acceptor: RefCell::new(None),
            lost_hooks: RefCell::new(Vec::new()),
            live_senders: Rc::new(Cell::new(0)),
            rndv_in_flight: Rc::new(Cell::new(0)),
            timer_at: Cell::new(Timestamp::MAX),
            timer_waker: RefCell::new(None),
            rearm_asked: Cell::new(false),
            bans_seen: Cell::new(0),
            backlog_peak: Cell::new(0),
            batch: Cell::new(None),
            dispatching: Cell::new(false),
            inline_rail: RefCell::new(None),
            inline_lane: Cell::new(false),
            route_cache: RefCell::new(None),
            rx_rail: RefCell::new(None),
            inline_left: Cell::new(crate::driver::DISPATCH_BUDGET),
            inline_bytes: RefCell::new(VecDeque::new()),
            spare_request: crate::SpareVec::new(0, 2 * request::RECYCLED_REQUEST),
            spare_waiters: RefCell::new(Vec::new()),
            closed: Cell::new(false),
            max_am_header: worker.max_am_header(),
            recv_cache,
            pulls,
        })
    }

    fn now(&self) -> Timestamp {
        timestamp_of(Instant::now())
    }

    /// The clock a request sent now is dated by (its deadline counts from it): inside a
    /// frame's dispatch in UCX's callback (a handler making a call, e.g. a [`ReplyHandler`]
    /// making the next one), the reading its batch took in this `progress`, so that a flood
    /// of such calls reads the clock once per batch; else a fresh reading. The batch's reading
    /// is as old as the batch's handlers have run before this one: a batch stops once
    /// glommio's preempt timer fires ([`crate::PREEMPT_TIMER`]), so about that long at most,
    /// more only in a handler that itself runs long. The deadline comes that much sooner.
    #[inline]
    fn request_now(&self, round: u64) -> Timestamp {
        match self.batch.get() {
            Some((r, now, _)) if r == round && self.dispatching.get() => now,
            _ => self.now(),
        }
    }

    /// The clock reading of driver round `round`: read by the first caller in the round, the
    /// same for the rest of it (one clock reading per batch of frames).
    fn batch_now(&self, round: u64) -> (Timestamp, Instant) {
        match self.batch.get() {
            Some((r, now, at)) if r == round => (now, at),
            _ => {
                let at = Instant::now();
                let now = timestamp_of(at);
                self.batch.set(Some((round, now, at)));
                (now, at)
            }
        }
    }

    /// The reading [`NetState::batch_now`] took in round `round`, if it took one.
    fn batch_taken(&self, round: u64) -> Option<Instant> {
        self.batch
            .get()
            .and_then(|(r, _, at)| (r == round).then_some(at))
    }

    /// The rail of the frame whose handler runs, if it is the one to `(node, remote)` and can
    /// send (a rail replaced meanwhile cannot: the caller then looks the new one up).
    #[inline]
    fn inline_rail_to(&self, node: NodeId, remote: ShardId) -> Option<Rc<session::RailTx>> {
        // A lane-admitted frame's rail is the last one a frame came in on (`rx_rail`). Should
        // the rails change during the handler, that is forgotten and the answer's rail looked
        // up instead.
        let cur = if self.inline_lane.get() {
            &self.rx_rail
        } else {
            &self.inline_rail
        };
        let cur = cur.try_borrow().ok()?;
        cur.as_ref()
            .filter(|r| r.node == node && r.remote == remote && r.tx.template().is_some())
            .map(|r| r.tx.clone())
    }

    /// The remote shard and rail that `dest` routes to from this shard, if it is the last
    /// destination looked up (or the remote shard that one routed to) and its rail can still
    /// send.
    #[inline]
    fn cached_route(&self, dest: Dest) -> Option<(ShardId, Rc<session::RailTx>)> {
        let c = self.route_cache.try_borrow().ok()?;
        let c = c.as_ref()?;
        // The same destination, or the remote shard the cached one routed to (whose rail
        // this shard holds, so a call naming it goes there too).
        let hit = c.dest.node == dest.node
            && (c.dest.shard == dest.shard || dest.shard == Some(c.remote))
            && c.tx.template().is_some();
        hit.then(|| (c.remote, c.tx.clone()))
    }

    /// Remembers that `dest` routes to `remote` on rail `tx`.
    #[inline]
    fn remember_route(&self, dest: Dest, remote: ShardId, tx: &Rc<session::RailTx>) {
        if let Ok(mut c) = self.route_cache.try_borrow_mut() {
            *c = Some(CachedRoute {
                dest,
                remote,
                tx: tx.clone(),
            });
        }
    }

    /// This shard's rails changed (one added, replaced or removed, or a node's shard count):
    /// routes looked up before may no longer hold.
    pub(super) fn rails_changed(&self) {
        // A borrow is held only for the length of a comparison: this never finds one.
        let cleared = self.route_cache.try_borrow_mut().map(|mut c| *c = None);
        debug_assert!(
            cleared.is_ok(),
            "route cache borrowed while the rails change"
        );
        if let Ok(mut c) = self.rx_rail.try_borrow_mut() {
            *c = None;
        }
    }

    /// The rail to `(node, remote)` if it is the one the last frame came in on and its lane
    /// admits a frame with `header` received at `now` ([`session::RailTx::admit`]).
    #[inline]
    fn admitted(&self, node: NodeId, header: &FrameHeader, now: Timestamp) -> bool {
        let Ok(c) = self.rx_rail.try_borrow() else {
            return false;
        };
        c.as_ref().is_some_and(|r| {
            r.node == node && r.remote == header.src_shard && r.tx.admit(header, now)
        })
    }

    /// Remembers the rail a frame from `(node, remote)` was delivered on, for
    /// [`NetState::admitted`].
    #[inline]
    fn remember_rx_rail(&self, node: NodeId, remote: ShardId, tx: &Rc<session::RailTx>) {
        if let Ok(mut c) = self.rx_rail.try_borrow_mut() {
            *c = Some(InlineRail {
                node,
                remote,
                tx: tx.clone(),
            });
        }
    }

    /// Records how the frame whose handler is about to run came in (`Arrival::Rail`: its rail,
    /// kept in `inline_rail`; `Arrival::Lane`: the rail in `rx_rail`, flagged by `inline_lane`),
    /// until the guard is dropped (whatever the handler does, even unwinding).
    #[inline]
    fn set_inline_rail(&self, arrival: Arrival) -> InlineRailGuard<'_> {
        match arrival {
            Arrival::Lane => self.inline_lane.set(true),
            Arrival::Rail(rail) => {
                if let Ok(mut slot) = self.inline_rail.try_borrow_mut() {
                    *slot = Some(rail);
                }
            }
        }
        InlineRailGuard(self)
    }

    #[inline(always)]
    fn count(&self, f: impl FnOnce(&mut NetStats)) {
        f(&mut self.stats.borrow_mut());
    }

    fn ep_options(&self) -> EpOptions {
        EpOptions {
            error_mode: self.settings.error_mode,
        }
    }

    /// Wakes the net task so that it arms its timer for a deadline earlier than the one it
    /// waits for.
    fn rearm(&self) {
        self.rearm_asked.set(true);
        let w = self.timer_waker.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// Registers the shard's AM handlers and starts its net task. Called once per shard before its
/// mesh starts serving, so that a shard that has answered the directory gathering (see
/// [`bootstrap`]) already handles frames. The caller then gives the driver [`dispatch_hook`].
pub(crate) fn install(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    inbound::register(ctx)?;
    let task = glommio::spawn_local(session::timer_loop(ctx.clone()));
    ctx.net().tasks.borrow_mut().push(task);
    report::spawn(ctx);
    Ok(())
}

pub(crate) use inbound::dispatch_hook;

/// On shard 0 of a listening node: gathers the directory and starts the listener. Called once
/// per shard after the mesh has started, before the user future.
pub(crate) async fn listen(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    bootstrap::listen(ctx).await
}

/// Stops accepting, waits (at most `drain`) for the requests this shard sent to be answered
/// and for the data of its rendezvous sends to be pulled (a `Close` behind a rendezvous frame
/// reached the peer before it had pulled the data, which was then lost: a node that ended right
/// after a large send lost about one such send in thirty over shared memory), then closes every
/// connection (sending `Close` where a session is up), fails what is still pending with
/// [`NetError::ShuttingDown`], lets the sender tasks flush within the linger time, and stops
/// the net task.
pub(crate) async fn shutdown(ctx: &Rc<ShardCtx>, drain: Duration) {
    ctx.stop_accepting().await;
    let net = ctx.net();
    let until = Instant::now() + drain;
    while (!net.pending.borrow().is_empty() || sends_unfinished(net)) && Instant::now() < until {
        sleep(DRAIN_POLL).await;
    }
    let unanswered = net.pending.borrow().len();
    if unanswered > 0 {
        tracing::warn!(
            unanswered,
            ?drain,
            "shutdown: requests still unanswered after the drain deadline fail with ShuttingDown"
        );
    }
    session::close_all(net);
    tracing::debug!("shutdown: connections closed");
    let left = net.pending.borrow_mut().drain();
    for (_, p) in left {
        p.waiter.answer(net, Err(NetError::ShuttingDown));
    }
    session::run_lost_hooks(net, None, &NetError::ShuttingDown);
    net.closed.set(true);
    net.rearm();
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

/// Whether a rendezvous send of this shard's is still waiting for its data to be pulled, or a
/// rail of its still holds frames queued for its sender (which may be rendezvous ones).
fn sends_unfinished(net: &NetState) -> bool {
    net.rndv_in_flight.get() > 0
        || net
            .peers
            .borrow()
            .values()
            .any(|p| p.rails.iter().any(|r| r.tx.out.has_items()))
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

    /// The shard of this node whose calls to `node` need no hop: with rails, every shard holds
    /// its own default rail to every connected node, so this is the calling shard. Kept for
    /// callers that route by it; see [`ShardCtx::owner_of_shard`] for a remote shard.
    pub fn owner_of(&self, _node: NodeId) -> ShardId {
        self.id()
    }

    /// The local shard that holds the rail to shard `shard` of `node` (this shard when it has
    /// one), or `None` when `node` is not connected on this shard or has no such shard, and
    /// also when the rail is this shard's by the rails' rule but is not up (proto's
    /// [`Rails::owner_of_remote`](crate::proto::Rails::owner_of_remote) says whose it is).
    pub fn owner_of_shard(&self, node: NodeId, shard: ShardId) -> Option<ShardId> {
        match self.route(Dest::shard(node, shard)).ok()? {
            Route::Here(_) => Some(self.id()),
            Route::There(owner) => Some(owner),
        }
    }

    /// Where a call for `dest` runs: here, on the rail to which remote shard; or forwarded to
    /// the local shard that holds the rail (see "Rails" in the module docs).
    pub(crate) fn route(&self, dest: Dest) -> Result<Route, NetError> {
        let net = self.net();
        if let Some((remote, _)) = net.cached_route(dest) {
            return Ok(Route::Here(remote));
        }
        let node = dest.node;
        let peers = net.peers.borrow();
        let p = peers.get(&node).ok_or(NetError::NotConnected { node })?;
        let route = self.route_in(p, dest)?;
        if let Route::Here(remote) = route {
            if let Some(r) = p.get(remote) {
                net.remember_route(dest, remote, &r.tx);
            }
        }
        Ok(route)
    }

    /// [`ShardCtx::route`] with `dest.node`'s rails already looked up.
    pub(in crate::net) fn route_in(&self, p: &PeerRails, dest: Dest) -> Result<Route, NetError> {
        let node = dest.node;
        // A named shard this shard holds the rail to (an answer to the shard a frame came
        // from): no need of the rails' rule.
        if let Some(j) = dest.shard.filter(|j| j.get() < p.remote_count) {
            if p.get(j).is_some() {
                return Ok(Route::Here(j));
            }
        }
        let rails = session::rails_with(self, p.remote_count).ok_or(NetError::BadShardCount {
            node,
            count: p.remote_count,
        })?;
        match dest.shard {
            None => Ok(Route::Here(rails.default_remote(self.id()))),
            Some(j) if j.get() >= p.remote_count => Err(NetError::NoSuchShard { node, shard: j }),
            Some(j) if p.get(j).is_some() => Ok(Route::Here(j)),
            Some(j) => {
                let owner = rails.owner_of_remote(j);
                if owner == self.id() {
                    Err(NetError::NotConnected { node })
                } else {
                    Ok(Route::There(owner))
                }
            }
        }
    }

    /// This shard's connection counters.
    pub fn net_stats(&self) -> NetStats {
        *self.net().stats.borrow()
    }

    /// The ready default rail from this shard to `node`, if there is one.
    pub fn session(&self, node: NodeId) -> Option<RemoteNode> {
        let peers = self.net().peers.borrow();
        let p = peers.get(&node)?;
        let remote = session::default_remote(self, p)?;
        session::ready_remote(p.get(remote)?.conn())
    }

    /// The ready rail from this shard to shard `shard` of `node`, if this shard has one.
    pub fn rail(&self, node: NodeId, shard: ShardId) -> Option<RemoteNode> {
        let peers = self.net().peers.borrow();
        session::ready_remote(peers.get(&node)?.get(shard)?.conn())
    }

    /// Whether this shard holds a ready default rail to `node`.
    pub fn is_connected(&self, node: NodeId) -> bool {
        self.session(node).is_some()
    }

    /// Remote nodes with a ready default rail from this shard.
    pub fn connected_nodes(&self) -> Vec<RemoteNode> {
        let nodes: Vec<NodeId> = self.net().peers.borrow().keys().copied().collect();
        nodes.into_iter().filter_map(|n| self.session(n)).collect()
    }

    /// This shard's rails by state, and the pending openings beside ready rails.
    pub fn rail_states(&self) -> RailStates {
        let mut r = RailStates::default();
        for p in self.net().peers.borrow().values() {
            for rail in &p.rails {
                match rail.conn().state() {
                    State::Ready => r.ready += 1,
                    State::Draining => r.draining += 1,
                    State::Failed | State::Closed => r.closing += 1,
                    State::Idle | State::Connecting | State::Backoff | State::Reconnecting => {
                        r.connecting += 1
                    }
                }
            }
            r.pending_openings += p.pending.len();
        }
        r
    }

    /// The bytes of application frames this shard's rails to `node` hold that UCX has not
    /// completed (queued, or posted and in flight; see [`NetConfig::max_backlog_bytes`]); 0
    /// for a node this shard has no rail to.
    pub fn backlog_bytes(&self, node: NodeId) -> u64 {
        self.net()
            .peers
            .borrow()
            .get(&node)
            .map_or(0, |p| p.rails.iter().map(|r| r.tx.backlog.bytes()).sum())
    }

    /// The bytes all of this shard's rails hold that UCX has not completed (the sum of
    /// [`ShardCtx::backlog_bytes`] over its peers).
    pub fn backlog_total(&self) -> u64 {
        self.net()
            .peers
            .borrow()
            .values()
            .flat_map(|p| p.rails.iter())
            .map(|r| r.tx.backlog.bytes())
            .sum()
    }

    /// Counts one frame from `node` that this shard refused as malformed (the RPC server calls
    /// it for a request whose envelope or arguments do not decode; a handler may call it for
    /// its own refusals). Strikes are counted node-wide (every shard's add up): at
    /// [`NetConfig::strike_limit`] strikes within [`NetConfig::strike_window`], the peer is
    /// dropped ([`ShardCtx::drop_peer`]); returns whether this strike dropped it.
    pub fn strike(&self, node: NodeId) -> bool {
        let net = self.net();
        let cfg = &net.settings.cfg;
        if cfg.strike_limit == 0 {
            return false;
        }
        let out =
            net.settings
                .bans
                .strike(node, Instant::now(), cfg.strike_limit, cfg.strike_window);
        if out {
            self.drop_peer(node);
        }
        out
    }

    /// Drops `node`: its handshakes are refused for [`NetConfig::strike_ban`]
    /// ([`RejectReason::Banned`](crate::proto::handshake::RejectReason::Banned)), the node's
    /// session is forgotten, this shard's rails to it close at once (a `Close` goes to the
    /// peer; what was pending on them fails with [`NetError::Closed`]), and every other shard
    /// closes its own at its next heartbeat tick. Connects to it are refused too while the ban
    /// lasts. Counted in [`NetStats::peers_dropped`].
    pub fn drop_peer(&self, node: NodeId) {
        let net = self.net();
        let ban = net.settings.cfg.strike_ban;
        tracing::warn!(%node, ?ban, "peer dropped: it kept sending frames this node refused");
        net.settings.bans.ban(node, Instant::now() + ban);
        if let Ok(mut t) = net.settings.sessions.lock() {
            t.remove(&node);
        }
        net.settings.bans.forgive(node);
        net.count(|s| s.peers_dropped += 1);
        session::close_node(net, node);
        // The other shards look at the bans on their timer; this one has closed its rails.
        net.bans_seen.set(net.settings.bans.generation());
        net.rearm();
    }

    /// Whether `node` was dropped ([`ShardCtx::drop_peer`]) and is still refused.
    pub fn is_banned(&self, node: NodeId) -> bool {
        self.net().settings.bans.is_banned(node)
    }

    /// Counts a connect made again to a known peer's address after its session was lost
    /// ([`NetStats::reconnects`], [`NetStats::reconnects_failed`]): for the facade's lazy
    /// reconnection, which runs outside this crate.
    pub fn count_reconnect(&self, ok: bool) {
        self.net().count(|s| {
            if ok {
                s.reconnects += 1;
            } else {
                s.reconnects_failed += 1;
            }
        });
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

/// Fills `buf` from `/dev/urandom`.
pub(crate) fn os_random(buf: &mut [u8]) -> std::io::Result<()> {
    use std::io::Read;
    std::fs::File::open("/dev/urandom")?.read_exact(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn am_header_round_trip() {
        let h = frame_am_header(NodeId::new(42), 17);
        let head = |node, addr_len, mode| ControlHead {
            node: NodeId::new(node),
            addr_len,
            mode,
        };
        assert_eq!(parse_am_header(&h), Some(head(42, 17, None)));
        assert_eq!(parse_am_header(&h[..8]), None);
        let mut bad = h;
        bad[15] = 1;
        assert_eq!(parse_am_header(&bad), None);
        for mode in [ErrorMode::None, ErrorMode::Peer] {
            let h = opening_am_header(NodeId::new(7), 300, mode);
            assert_eq!(parse_am_header(&h), Some(head(7, 300, Some(mode))));
        }
        let mut bad = h;
        bad[12] = 3;
        assert_eq!(parse_am_header(&bad), None, "an unknown mode");
    }

    #[test]
    fn error_mode_follows_transports() {
        assert_eq!(error_mode_for(Some("sm,self")), ErrorMode::None);
        assert_eq!(error_mode_for(Some("sm,tcp")), ErrorMode::Peer);
        assert_eq!(error_mode_for(Some("tcp")), ErrorMode::Peer);
    }
}
