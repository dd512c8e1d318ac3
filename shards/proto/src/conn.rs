//! The per-rail connection state machine.
//!
//! A [`Connection`] is the protocol state a shard keeps for one *rail* to a peer node: one
//! (local shard, remote shard) pair of [`crate::Rails`], with its own UCX endpoints. It holds
//! the handshake, liveness (heartbeats, suspicion, death), reconnection with backoff, draining
//! and close. It performs no I/O; the shard moves frames between it and a UCX endpoint.
//!
//! # Primary and joined rails
//!
//! Authentication happens once per node pair, on one rail, the *primary*: a client made with
//! [`Connection::client`] runs the pre-shared-key handshake (hello / welcome / confirm) with a
//! server made with [`Connection::server`]. Both then hold the session's
//! [`SessionSecret`] ([`Connection::session_secret`]), which the net layer keeps with the
//! session's [`PeerInfo`] in its node-wide session table. Every other rail *joins* that session
//! ([`crate::handshake`] has the exchange): a client made with [`Connection::join_client`]
//! sends a `Join` and waits for `Joined`; the server's net layer decodes the `Join`, finds the
//! session of `join.node_id`, and makes a [`Connection::join_server`], which checks the join
//! (session, rail, proof) and answers. A rail is only ever `Ready` after a handshake or a join
//! that verified, so a rail from an unauthenticated endpoint is never accepted. The net layer
//! joins rails only when the session negotiated [`crate::Features::RAILS`].
//!
//! # Shards
//!
//! Every frame names its shards: `src_shard` the sender's, `dst_shard` the receiver's. A client
//! is told its rail's remote shard when it is made; a server learns it from the `src_shard` of
//! the first `Hello` or `Join` it processes ([`Connection::remote_shard`] is `None` until then).
//! From then on, every frame whose `src_shard` is not the remote shard, and at any time every
//! frame whose `dst_shard` is not [`ConnConfig::local_shard`], is dropped with
//! [`DropReason::Misrouted`] (counted in [`ConnStats::dropped_misrouted`]). A server refuses a
//! `Hello` or `Join` whose shards are not a rail of the pair with
//! [`RejectReason::NoSuchRail`].
//!
//! # States
//!
//! ```text
//!            connect()            handshake ok
//!   Idle ───────────────▶ Connecting ─────────▶ Ready ──start_drain()──▶ Draining ──▶ Closed
//!                             │                  │  ▲                       │
//!                  handshake  │   peer dead,     │  │ handshake ok          │ finish_drain() or
//!                  failed or  │   transport err  │  │                       │ drain deadline
//!                  timed out  ▼                  ▼  │                       ▼
//!                           Failed ──(client, attempts left)──▶ Backoff ──▶ Reconnecting
//! ```
//!
//! `Failed` is where a connection rests when it will not retry by itself: a server-side
//! connection (the client dials again, and a fresh `Hello` or `Join` restarts it), a primary
//! client that has used up [`ConnConfig::max_reconnect_attempts`], or **any join client**: a
//! join client never backs off and retries by itself, whatever `max_reconnect_attempts` says,
//! because the usual cause of a failed join (the session is gone: the server restarted, or the
//! primary was replaced) is not cured by waiting; the net layer falls back to a new session (a
//! full handshake), or calls [`Connection::connect`] again to send a fresh `Join`. A primary
//! client with attempts left passes straight through `Failed` into `Backoff`, after emitting
//! [`Event::Failed`]. The backoff delay for failure number `k` (from 0) is drawn uniformly from
//! `[d/2, d]` with `d = min(backoff_max, backoff_initial · 2^k)` ("equal jitter"), using the
//! connection's own [`Rng`] seeded by the caller.
//!
//! A server connection that is not `Ready` answers every new `Hello` (with a pre-shared-key
//! handshake). Every server connection answers every new `Join` (checked against the session
//! given to [`Connection::join_server`]; a connection made with [`Connection::server`] has
//! none and refuses joins with [`RejectReason::UnknownSession`]); a join that verifies while
//! `Ready` replaces the session at once ([`Event::Failed`] with
//! [`FailReason::SessionReplaced`], then [`Event::Connected`]): its proof shows it holds the
//! session. A refused `Join` ends the connection (`Failed`) only if it was not `Ready`: an
//! unauthenticated join never ends an authenticated rail. A duplicate of an opening already
//! processed (same nonce) is ignored.
//!
//! # Openings beside a ready connection
//!
//! A `Hello` proves nothing (anyone who can reach the endpoint can send one naming the peer),
//! so a `Ready` connection never takes one: [`Connection::handle_frame`] drops it with
//! [`DropReason::Opening`], and the session, its heartbeats and its application frames carry
//! on. The caller answers it with a *pending opening*: a [`Connection::server_beside`] of its
//! own (with its own endpoint, to the address the `Hello` came from), fed the `Hello` and the
//! rest of that handshake. Only when the pending opening reaches `Ready` (the other side
//! proved the key) does the caller let it replace the ready connection, and report that one
//! ended ([`FailReason::SessionReplaced`]); a pending opening that fails or reaches its
//! handshake deadline is dropped, and the ready connection never noticed. The net layer's
//! `session` module (and [`crate::sim`]) routes frames between the two: the rest of a
//! handshake (`Confirm`) to the pending opening, everything else to the ready connection.
//!
//! # Liveness
//!
//! In `Ready` and `Draining` a heartbeat is sent every [`ConnConfig::heartbeat_interval`] and the
//! peer answers each with a `HeartbeatAck`. Every valid frame from the peer counts as a sign of
//! life. After `suspect_after` intervals of silence the peer is reported suspect
//! ([`Event::PeerSuspect`]; [`Event::PeerRecovered`] if it speaks again), and after `dead_after`
//! intervals it is declared dead ([`Event::PeerDead`] then [`Event::Failed`]). The timer is set
//! exactly at `last_heard + dead_after · interval`, so a caller that honours
//! [`Connection::poll_timeout`] detects a silent peer no later than that. Each rail has its own
//! heartbeats: a rail that dies does not take the others with it.
//!
//! Heartbeats are sent on a grid: at the multiples of the interval (counted from the
//! timestamps' epoch) at least half an interval after the last one ([`heartbeat_tick`]), so
//! every connection of a process with the same interval sends at the same instants. A shard
//! holding many rails then wakes once per interval to send all their heartbeats, not once per
//! rail; the gap between two heartbeats of a rail is one interval (between a half and one and
//! a half for the first).
//!
//! # Incarnations
//!
//! Every frame header carries its sender's incarnation. Once connected, frames whose incarnation
//! differs from the one learned in the handshake are dropped and counted
//! ([`ConnStats::dropped_stale`]); a `Hello` from an older incarnation is dropped the same way. A
//! `Hello` from a newer incarnation (the peer restarted) is a `Hello` like any other: a ready
//! connection leaves it to a pending opening (above), which reports [`Event::PeerRestarted`]
//! and [`Event::Connected`] once its handshake completes, and then replaces the ready one (so
//! in-flight work on it fails). A `Join` must name exactly the incarnations of its session.
//!
//! # Calling order
//!
//! As in quinn-proto:
//!
//! 1. Create with [`Connection::client`] or [`Connection::join_client`] (then
//!    [`Connection::connect`]), or with [`Connection::server`] or [`Connection::join_server`]
//!    for the endpoint whose first frame (a `Hello` or a `Join`) just arrived, then feed it that
//!    frame.
//! 2. Feed inputs as they happen: [`Connection::handle_frame`] for every frame received from the
//!    peer, [`Connection::handle_timeout`] whenever the time last returned by
//!    [`Connection::poll_timeout`] is reached, [`Connection::handle_transport_error`] when the
//!    endpoint fails, and the local commands [`Connection::start_drain`],
//!    [`Connection::finish_drain`], [`Connection::close`].
//! 3. After **each** input, drain [`Connection::poll_transmit`] (send every frame it returns) and
//!    [`Connection::poll_event`], then re-arm the timer with [`Connection::poll_timeout`].
//!
//! Outputs are queued, never lost, if the caller drains them late; timers are level-triggered:
//! calling `handle_timeout` early does nothing, calling it late does everything that is due.
//! An opening frame that no connection will take (a `Join` for a node with no session, say) is
//! answered with [`Connection::refuse`].

use crate::handshake::{
    accept_join, Handshake, HandshakeConfig, HandshakeError, HandshakeMessage, Hello, Join,
    JoinAttempt, Nonce, NonceGen, PeerInfo, Reject, RejectReason, Role, SessionSecret,
    MAX_HANDSHAKE_LEN,
};
use crate::ids::{Incarnation, NodeId, ReqId, ShardId};
use crate::rails::{Rail, Rails};
use crate::rng::Rng;
use crate::time::Timestamp;
use crate::wire::{encode_frame, FrameHeader, FrameKind, Limits, WireError};
use std::collections::VecDeque;
use std::time::Duration;
use thiserror::Error;

/// When the heartbeat after one sent at `now` is due: the first multiple of `interval` (from
/// the timestamps' epoch) at least half an interval after `now` (see "Liveness" in the module
/// docs). A zero interval gives `now`.
pub fn heartbeat_tick(now: Timestamp, interval: Duration) -> Timestamp {
    let i = crate::time::duration_to_nanos(interval);
    if i == 0 {
        return now;
    }
    let earliest = now.as_nanos().saturating_add(i.div_ceil(2));
    match earliest.div_ceil(i).checked_mul(i) {
        Some(t) => Timestamp::from_nanos(t),
        None => Timestamp::MAX,
    }
}

/// Connection settings.
#[derive(Clone, Debug)]
pub struct ConnConfig {
    /// This node's identity, key, versions and handshake timeout (which bounds joins too).
    pub handshake: HandshakeConfig,
    /// The local shard that owns this connection (written as `src_shard`; frames whose
    /// `dst_shard` differs are dropped as misrouted).
    pub local_shard: ShardId,
    /// Time between heartbeats.
    pub heartbeat_interval: Duration,
    /// Missed intervals before the peer is suspect.
    pub suspect_after: u32,
    /// Missed intervals before the peer is dead (at least `suspect_after`).
    pub dead_after: u32,
    /// Backoff before the first reconnect attempt (before jitter).
    pub backoff_initial: Duration,
    /// Upper bound of the backoff (before jitter).
    pub backoff_max: Duration,
    /// Primary clients only ([`Connection::client`]): consecutive failed attempts after which
    /// the connection stays `Failed`; `None` retries forever. Join clients ignore it: they never
    /// retry by themselves (see the module docs). Servers never retry either.
    pub max_reconnect_attempts: Option<u32>,
}

/// Seeds a connection needs from its caller.
#[derive(Clone, Copy, Debug)]
pub struct Seeds {
    /// Seed of the backoff-jitter generator.
    pub rng: u64,
    /// Secret seed for handshake nonces (from the OS random source; see [`NonceGen`]).
    pub nonce: [u8; 32],
}

/// Connection state. See the module docs for the transitions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum State {
    /// Client created, `connect` not yet called.
    Idle,
    /// First handshake or join in progress (client), or waiting for / answering a hello or a
    /// join (server).
    Connecting,
    /// Handshake or join complete; frames flow.
    Ready,
    /// Finishing in-flight work; no new work should be started.
    Draining,
    /// Failed and not retrying by itself.
    Failed,
    /// Waiting before the next reconnect attempt.
    Backoff,
    /// A reconnect handshake is in progress.
    Reconnecting,
    /// Closed for good.
    Closed,
}

/// Why a connection failed.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum FailReason {
    /// The handshake or join failed (timeout, bad proof, rejection...).
    Handshake(HandshakeError),
    /// The peer stopped answering heartbeats.
    PeerDead,
    /// The transport reported an error.
    Transport,
    /// The peer started a new session (it restarted, reconnected or joined again).
    SessionReplaced,
}

/// Why a connection closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CloseReason {
    /// Closed locally (after draining or by `close`).
    Local,
    /// The peer sent `Close`.
    Peer,
}

/// Something the owner of a connection must know about.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// A handshake or join completed; frames flow. A join reports its session's [`PeerInfo`].
    Connected(PeerInfo),
    /// The peer is now known under a newer incarnation: everything from the old one is void.
    PeerRestarted {
        /// The previous incarnation.
        old: Incarnation,
        /// The new one.
        new: Incarnation,
    },
    /// The peer has been silent for `suspect_after` intervals.
    PeerSuspect,
    /// A suspect peer spoke again.
    PeerRecovered,
    /// The peer has been silent for `dead_after` intervals (followed by `Failed`).
    PeerDead,
    /// The session is lost: fail every operation in flight on it.
    Failed {
        /// Why.
        reason: FailReason,
    },
    /// Backoff elapsed; reconnect attempt number `attempt` (from 1) has begun.
    Reconnecting {
        /// Attempt number.
        attempt: u32,
    },
    /// Draining ended and a `Close` was sent.
    Drained {
        /// Whether the drain deadline cut it short.
        timed_out: bool,
    },
    /// The connection is closed for good.
    Closed {
        /// Who closed it.
        reason: CloseReason,
    },
}

/// What [`Connection::handle_frame`] did with a frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Received {
    /// An application frame from the current session: hand it to the application.
    Deliver,
    /// A control frame, consumed by the connection.
    Consumed,
    /// Dropped (and counted).
    Dropped(DropReason),
}

/// Why a frame was dropped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum DropReason {
    /// Sent by an older (or otherwise different) incarnation of the peer.
    StaleIncarnation,
    /// No session is established.
    NotReady,
    /// The payload did not decode.
    Malformed,
    /// Not expected in this role or state (e.g. a hello sent to a client, or a duplicate).
    Unexpected,
    /// The frame's wire version is not the negotiated one.
    VersionMismatch,
    /// The connection is closed.
    Closed,
    /// The frame's shards are not this rail's: `dst_shard` is not the local shard, or
    /// `src_shard` is not the remote shard.
    Misrouted,
    /// A `Hello` reached a `Ready` connection (of either role), which does not take it: an
    /// opening never resets an authenticated session (see "Openings beside a ready
    /// connection" in the module docs). The caller gives it a connection of its own,
    /// [`Connection::server_beside`].
    Opening,
}

/// Misuse of the connection API.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum ConnError {
    /// The operation is not valid in the current state.
    #[error("cannot {op} in state {state:?}")]
    InvalidState {
        /// The operation attempted.
        op: &'static str,
        /// The state the connection was in.
        state: State,
    },
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ConnStats {
    /// Application frames delivered.
    pub delivered: u64,
    /// Frames dropped for a stale incarnation.
    pub dropped_stale: u64,
    /// Frames dropped because no session was up.
    pub dropped_not_ready: u64,
    /// Frames dropped as malformed.
    pub dropped_malformed: u64,
    /// Frames dropped because their shards are not this rail's.
    pub dropped_misrouted: u64,
    /// Frames dropped as unexpected, version-mismatched, after close, or as an opening that a
    /// ready connection does not take ([`DropReason::Opening`]).
    pub dropped_other: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Heartbeat acks received.
    pub heartbeat_acks: u64,
    /// Pre-shared-key handshakes completed.
    pub handshakes: u64,
    /// Joins completed (either side).
    pub joins: u64,
    /// Joins refused with a `Reject` (server side).
    pub joins_refused: u64,
    /// Reconnect attempts begun.
    pub reconnects: u64,
}

/// A frame to send: a header and a small inline payload (handshake messages only; heartbeats and
/// close have none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Transmit {
    /// The frame header (`payload_len` already set).
    pub header: FrameHeader,
    payload: [u8; MAX_HANDSHAKE_LEN],
    payload_len: usize,
}

/// The session a join client joins, or a join server checks joins against.
#[derive(Clone, Debug)]
struct JoinSession {
    peer: PeerInfo,
    secret: SessionSecret,
}

/// The opening exchange in progress: a pre-shared-key handshake or a join (client side; the
/// server side of a join is one call, [`accept_join`]).
#[derive(Clone, Debug)]
#[allow(clippy::large_enum_variant)] // One per connection, alive only while it opens.
enum Attempt {
    Psk(Handshake),
    Join(JoinAttempt),
}

/// What an application frame's header must carry for a ready connection to deliver it
/// ([`Connection::data_lane`]): a caller that holds one can check a data frame itself, with a
/// few comparisons, and tell the connection afterwards ([`Connection::heard_data`]); a frame
/// the lane admits is one [`Connection::handle_frame`] would deliver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataLane {
    local_shard: ShardId,
    remote_shard: Option<ShardId>,
    incarnation: Incarnation,
    version: u8,
}

impl DataLane {
    /// Whether the connection the lane came from delivers an application frame with
    /// `header` (its kind is not a control kind: the caller checked).
    #[inline(always)]
    pub fn admits(&self, header: &FrameHeader) -> bool {
        header.dst_shard == self.local_shard
            && header.incarnation == self.incarnation
            && header.version == self.version
            && self.remote_shard.is_none_or(|r| r == header.src_shard)
    }
}

/// One rail's connection state. See the module docs for states and calling order.
#[derive(Clone, Debug)]
pub struct Connection {
    cfg: ConnConfig,
    role: Role,
    state: State,
    attempt: Option<Attempt>,
    /// Client nonce of the last opening (hello or join) that completed (server side; to spot
    /// duplicates).
    last_client_nonce: Option<Nonce>,
    /// Nonce of the last join refused (server side; to spot duplicates).
    last_refused_nonce: Option<Nonce>,
    peer: Option<PeerInfo>,
    /// The peer of the ready connection this one was opened beside
    /// ([`Connection::server_beside`]): the incarnation a restart is told from.
    beside: Option<PeerInfo>,
    remote_shard: Option<ShardId>,
    join: Option<JoinSession>,
    /// The secret of the session the last pre-shared-key handshake made (primary rails only).
    secret: Option<SessionSecret>,
    rng: Rng,
    nonces: NonceGen,
    last_heard: Timestamp,
    next_heartbeat: Timestamp,
    heartbeat_seq: u64,
    suspect: bool,
    backoff_until: Timestamp,
    failures: u32,
    drain_deadline: Timestamp,
    transmits: VecDeque<Transmit>,
    events: VecDeque<Event>,
    stats: ConnStats,
}

impl ConnConfig {
    /// Defaults: 100 ms heartbeats, suspect after 3 missed, dead after 10; backoff 50 ms to 5 s;
    /// unlimited reconnects; shard 0.
    pub fn new(handshake: HandshakeConfig) -> ConnConfig {
        ConnConfig {
            handshake,
            local_shard: ShardId::new(0),
            heartbeat_interval: Duration::from_millis(100),
            suspect_after: 3,
            dead_after: 10,
            backoff_initial: Duration::from_millis(50),
            backoff_max: Duration::from_secs(5),
            max_reconnect_attempts: None,
        }
    }

    /// The longest a silent peer can go undetected after the last frame heard from it:
    /// `dead_after · heartbeat_interval` (saturating).
    pub fn failure_detection_bound(&self) -> Duration {
        self.heartbeat_interval
            .saturating_mul(self.dead_after.max(self.suspect_after).max(1))
    }
}

impl Transmit {
    fn control(header: FrameHeader) -> Transmit {
        Transmit {
            header,
            payload: [0; MAX_HANDSHAKE_LEN],
            payload_len: 0,
        }
    }

    /// A handshake frame: `header` with the frozen handshake version, `msg`'s kind and length.
    fn handshake(header: FrameHeader, msg: &HandshakeMessage) -> Transmit {
        let mut t = Transmit::control(FrameHeader {
            // Handshake frames always use the frozen version-1 header so that any peer can read
            // them and answer, if need be, with a version-mismatch rejection.
            version: crate::wire::HANDSHAKE_WIRE_VERSION,
            kind: msg.kind(),
            ..header
        });
        // Cannot fail: the inline buffer holds MAX_HANDSHAKE_LEN, the largest message.
        t.payload_len = msg.encode(&mut t.payload).unwrap_or(0);
        t.header.payload_len = t.payload_len as u64;
        t
    }

    /// The payload bytes.
    pub fn payload(&self) -> &[u8] {
        &self.payload[..self.payload_len]
    }

    /// Writes header and payload into `buf` as one frame (payload at
    /// [`crate::wire::payload_offset`]); returns the length.
    pub fn encode(&self, buf: &mut [u8]) -> Result<usize, WireError> {
        encode_frame(&self.header, self.payload(), buf, &Limits::default())
    }

    /// The frame as a fresh vector.
    pub fn to_vec(&self) -> Vec<u8> {
        let mut buf = vec![0u8; crate::wire::payload_offset() + self.payload_len];
        // Cannot fail: the buffer is sized exactly and handshake payloads are far below any limit.
        let _ = self.encode(&mut buf);
        buf
    }
}

impl Attempt {
    fn is_finished(&self) -> bool {
        match self {
            Attempt::Psk(h) => h.is_finished(),
            Attempt::Join(j) => j.is_finished(),
        }
    }

    fn poll_transmit(&mut self) -> Option<HandshakeMessage> {
        match self {
            Attempt::Psk(h) => h.poll_transmit(),
            Attempt::Join(j) => j.poll_transmit(),
        }
    }

    fn outcome(&self) -> Option<&Result<PeerInfo, HandshakeError>> {
        match self {
            Attempt::Psk(h) => h.outcome(),
            Attempt::Join(j) => j.outcome(),
        }
    }

    fn poll_timeout(&self) -> Option<Timestamp> {
        match self {
            Attempt::Psk(h) => h.poll_timeout(),
            Attempt::Join(j) => j.poll_timeout(),
        }
    }

    fn handle_timeout(&mut self, now: Timestamp) {
        match self {
            Attempt::Psk(h) => h.handle_timeout(now),
            Attempt::Join(j) => j.handle_timeout(now),
        }
    }

    fn handle_message(&mut self, now: Timestamp, msg: &HandshakeMessage) {
        match self {
            Attempt::Psk(h) => h.handle_message(now, msg),
            Attempt::Join(j) => j.handle_message(now, msg),
        }
    }

    /// The client nonce of the attempt, once known.
    fn client_nonce(&self) -> Option<Nonce> {
        match self {
            Attempt::Psk(h) => h.client_nonce(),
            Attempt::Join(j) => Some(*j.nonce()),
        }
    }
}

impl Connection {
    /// A primary client connection that will dial node `peer`, on the rail to the peer's shard
    /// `remote_shard` (the `dst_shard` of every frame it sends; with
    /// `(cfg.local_shard, remote_shard)` a rail of the pair, or the server refuses it with
    /// [`RejectReason::NoSuchRail`]); call [`Connection::connect`] to start the pre-shared-key
    /// handshake. `cfg.handshake.expected_peer` is set to `peer`.
    pub fn client(
        mut cfg: ConnConfig,
        peer: NodeId,
        remote_shard: ShardId,
        seeds: Seeds,
    ) -> Connection {
        cfg.handshake.expected_peer = Some(peer);
        let mut c = Connection::new(cfg, Role::Client, State::Idle, seeds);
        c.remote_shard = Some(remote_shard);
        c
    }

    /// A client connection that will join the session with `session_peer` (the server node as
    /// learned by the session's primary handshake) keyed by `secret`, on the rail to the peer's
    /// shard `remote_shard`; call [`Connection::connect`] to send the `Join`. On success it is
    /// `Ready` with `session_peer` as its peer ([`Event::Connected`]); it has no
    /// [`Connection::session_secret`] of its own. It never retries by itself (see the module
    /// docs). If `(cfg.local_shard, remote_shard)` is no rail of the pair, `connect` fails it at
    /// once with [`HandshakeError::NoSuchRail`].
    pub fn join_client(
        mut cfg: ConnConfig,
        session_peer: PeerInfo,
        secret: SessionSecret,
        remote_shard: ShardId,
        seeds: Seeds,
    ) -> Connection {
        cfg.handshake.expected_peer = Some(session_peer.node_id);
        let mut c = Connection::new(cfg, Role::Client, State::Idle, seeds);
        c.remote_shard = Some(remote_shard);
        c.join = Some(JoinSession {
            peer: session_peer,
            secret,
        });
        c
    }

    /// A server connection for an endpoint a client dialled, waiting for its hello from `now`
    /// (the handshake deadline runs from `now`). It refuses joins
    /// ([`RejectReason::UnknownSession`]): make a [`Connection::join_server`] for those.
    pub fn server(now: Timestamp, cfg: ConnConfig, seeds: Seeds) -> Connection {
        let mut c = Connection::new(cfg, Role::Server, State::Connecting, seeds);
        let nonce = c.nonces.next_nonce();
        c.attempt = Some(Attempt::Psk(Handshake::server(
            now,
            c.cfg.handshake.clone(),
            nonce,
        )));
        c
    }

    /// A server connection for a `Hello` that a ready connection with `ready` (its peer)
    /// declined ([`DropReason::Opening`]), on an endpoint of its own; feed it that frame with
    /// [`Connection::handle_frame`]. It is a [`Connection::server`] that knows the peer it
    /// would replace: it drops a `Hello` from an incarnation older than `ready`'s
    /// ([`DropReason::StaleIncarnation`]), and reports [`Event::PeerRestarted`] before
    /// [`Event::Connected`] when its handshake completes with another incarnation. The caller
    /// lets it replace the ready connection only once it is `Ready` (see "Openings beside a
    /// ready connection" in the module docs).
    pub fn server_beside(
        now: Timestamp,
        cfg: ConnConfig,
        seeds: Seeds,
        ready: PeerInfo,
    ) -> Connection {
        let mut c = Connection::server(now, cfg, seeds);
        c.beside = Some(ready);
        c
    }

    /// A server connection for an endpoint whose first frame is a `Join` to the session with
    /// `session_peer` (the client node as learned by the session's primary handshake) keyed by
    /// `secret`, from the net layer's session table; feed it that frame with
    /// [`Connection::handle_frame`]. It checks the join against the session (node,
    /// incarnations, shard count, version, rails negotiated), the rail and the proof, and answers
    /// `Joined` (then `Ready`, [`Event::Connected`]) or a `Reject` (then `Failed`). Like a
    /// [`Connection::server`] it also answers a `Hello`, which makes it a primary.
    pub fn join_server(
        now: Timestamp,
        cfg: ConnConfig,
        session_peer: PeerInfo,
        secret: SessionSecret,
        seeds: Seeds,
    ) -> Connection {
        let mut c = Connection::server(now, cfg, seeds);
        c.join = Some(JoinSession {
            peer: session_peer,
            secret,
        });
        c
    }

    /// The `Reject` of an opening frame (`msg`, a `Hello` or a `Join`, which arrived with
    /// `header`) for which the net layer makes no connection: for instance a `Join` from a node
    /// with no session ([`RejectReason::UnknownSession`]), or any opening while at capacity
    /// ([`RejectReason::Busy`]). Addressed from `cfg.local_shard` back to `header.src_shard`.
    /// `None` if `msg` opens nothing.
    pub fn refuse(
        cfg: &ConnConfig,
        header: &FrameHeader,
        msg: &HandshakeMessage,
        reason: RejectReason,
    ) -> Option<Transmit> {
        let echo = msg.opening_nonce()?;
        Some(reject_transmit(cfg, header.src_shard, echo, reason))
    }

    fn new(cfg: ConnConfig, role: Role, state: State, seeds: Seeds) -> Connection {
        Connection {
            cfg,
            role,
            state,
            attempt: None,
            last_client_nonce: None,
            last_refused_nonce: None,
            peer: None,
            beside: None,
            remote_shard: None,
            join: None,
            secret: None,
            rng: Rng::new(seeds.rng),
            nonces: NonceGen::new(seeds.nonce),
            last_heard: Timestamp::ZERO,
            next_heartbeat: Timestamp::MAX,
            heartbeat_seq: 0,
            suspect: false,
            backoff_until: Timestamp::MAX,
            failures: 0,
            drain_deadline: Timestamp::MAX,
            transmits: VecDeque::new(),
            events: VecDeque::new(),
            stats: ConnStats::default(),
        }
    }

    /// The current state.
    pub fn state(&self) -> State {
        self.state
    }

    /// Client or server.
    pub fn role(&self) -> Role {
        self.role
    }

    /// Whether this connection joins a session ([`Connection::join_client`]) or checks joins
    /// against one ([`Connection::join_server`]), rather than being only a primary.
    pub fn is_join(&self) -> bool {
        self.join.is_some()
    }

    /// The peer, as learned by the last completed handshake (or given with the joined session).
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
    }

    /// The secret of the session this connection authenticated, while it is `Ready` or
    /// `Draining` after a pre-shared-key handshake (a primary rail). `None` on joined rails (the
    /// net layer already holds their session's secret) and while no session is up.
    pub fn session_secret(&self) -> Option<&SessionSecret> {
        match self.state {
            State::Ready | State::Draining => self.secret.as_ref(),
            _ => None,
        }
    }

    /// Whether the peer is currently suspect.
    pub fn is_suspect(&self) -> bool {
        self.suspect
    }

    /// Counters.
    pub fn stats(&self) -> &ConnStats {
        &self.stats
    }

    /// The configuration.
    pub fn config(&self) -> &ConnConfig {
        &self.cfg
    }

    /// The peer's shard at the other end of this rail (the `dst_shard` of frames we send): a
    /// client's from creation, a server's from the first `Hello` or `Join` it processed.
    pub fn remote_shard(&self) -> Option<ShardId> {
        self.remote_shard
    }

    /// The rail this connection runs on, once its remote shard is known.
    pub fn rail(&self) -> Option<Rail> {
        self.remote_shard.map(|remote| Rail {
            local: self.cfg.local_shard,
            remote,
        })
    }

    /// A header for an application frame of `kind` on the current session: version, shards and
    /// incarnation filled in; set `id`, `req_id`, the deadline and `payload_len` yourself. Valid
    /// in `Ready` and `Draining` (responses still flow while draining).
    #[inline]
    pub fn frame_header(&self, kind: FrameKind) -> Result<FrameHeader, ConnError> {
        match (self.state, &self.peer) {
            (State::Ready | State::Draining, Some(peer)) => Ok(FrameHeader {
                version: peer.version,
                src_shard: self.cfg.local_shard,
                dst_shard: self.dst_shard(),
                incarnation: self.cfg.handshake.incarnation,
                ..FrameHeader::new(kind)
            }),
            _ => Err(ConnError::InvalidState {
                op: "build a frame header",
                state: self.state,
            }),
        }
    }

    /// Starts (or, from `Failed`, restarts) dialling: a pre-shared-key handshake, or for a join
    /// client a fresh `Join`. Client only.
    pub fn connect(&mut self, now: Timestamp) -> Result<(), ConnError> {
        if self.role != Role::Client || !matches!(self.state, State::Idle | State::Failed) {
            return Err(ConnError::InvalidState {
                op: "connect",
                state: self.state,
            });
        }
        self.failures = 0;
        self.state = State::Connecting;
        self.start_client_attempt(now);
        Ok(())
    }

    /// The lane of application frames while the connection is ready and its peer not suspect
    /// (see [`DataLane`]): `None` otherwise, and frames then go through
    /// [`Connection::handle_frame`]. Any change of the connection may change it.
    pub fn data_lane(&self) -> Option<DataLane> {
        match (self.state, self.peer) {
            (State::Ready, Some(peer)) if !self.suspect => Some(DataLane {
                local_shard: self.cfg.local_shard,
                remote_shard: self.remote_shard,
                incarnation: peer.incarnation,
                version: peer.version,
            }),
            _ => None,
        }
    }

    /// `n` application frames that the caller admitted by this connection's
    /// [`DataLane`] instead of [`Connection::handle_frame`], the last of them received at `at`:
    /// counted as delivered, and the peer heard then (as `handle_frame` does for each).
    pub fn heard_data(&mut self, at: Timestamp, n: u64) {
        if n == 0 {
            return;
        }
        self.stats.delivered += n;
        if at > self.last_heard {
            self.heard(at);
        }
    }

    /// Processes one frame received from the peer. `payload` is the frame's payload (empty for
    /// rendezvous frames whose data comes separately).
    #[inline]
    pub fn handle_frame(
        &mut self,
        now: Timestamp,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Received {
        if self.state == State::Closed {
            return self.drop_frame(DropReason::Closed);
        }
        if header.dst_shard != self.cfg.local_shard
            || self.remote_shard.is_some_and(|r| r != header.src_shard)
        {
            return self.drop_frame(DropReason::Misrouted);
        }
        if header.kind.is_handshake() {
            return match HandshakeMessage::decode(header.kind, payload) {
                Ok(msg) => self.on_handshake_message(now, header, &msg),
                Err(_) => self.drop_frame(DropReason::Malformed),
            };
        }
        let Some(peer) = self.peer else {
            return self.drop_frame(DropReason::NotReady);
        };
        if header.incarnation != peer.incarnation {
            return self.drop_frame(DropReason::StaleIncarnation);
        }
        if !matches!(self.state, State::Ready | State::Draining) {
            return self.drop_frame(DropReason::NotReady);
        }
        if header.version != peer.version {
            return self.drop_frame(DropReason::VersionMismatch);
        }
        self.heard(now);
        match header.kind {
            FrameKind::Heartbeat => {
                let ack = FrameHeader {
                    req_id: header.req_id,
                    ..self.control_header(FrameKind::HeartbeatAck)
                };
                self.transmits.push_back(Transmit::control(ack));
                Received::Consumed
            }
            FrameKind::HeartbeatAck => {
                self.stats.heartbeat_acks += 1;
                Received::Consumed
            }
            FrameKind::Close => {
                self.attempt = None;
                self.state = State::Closed;
                self.events.push_back(Event::Closed {
                    reason: CloseReason::Peer,
                });
                Received::Consumed
            }
            _ => {
                self.stats.delivered += 1;
                Received::Deliver
            }
        }
    }

    /// Advances timers: handshake or join deadline, heartbeats, suspicion and death, backoff,
    /// drain deadline. Does nothing before [`Connection::poll_timeout`]'s time.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        match self.state {
            State::Connecting | State::Reconnecting => {
                if let Some(a) = self.attempt.as_mut() {
                    a.handle_timeout(now);
                }
                self.after_attempt_input(now);
            }
            State::Ready | State::Draining => {
                let interval = self.cfg.heartbeat_interval;
                if now >= self.dead_at() {
                    self.events.push_back(Event::PeerDead);
                    self.fail(now, FailReason::PeerDead);
                    return;
                }
                if !self.suspect && now >= self.suspect_at() {
                    self.suspect = true;
                    self.events.push_back(Event::PeerSuspect);
                }
                if self.state == State::Draining && now >= self.drain_deadline {
                    self.end_drain(true);
                    return;
                }
                if now >= self.next_heartbeat {
                    self.heartbeat_seq += 1;
                    let hb = FrameHeader {
                        req_id: ReqId::new(self.heartbeat_seq),
                        ..self.control_header(FrameKind::Heartbeat)
                    };
                    self.transmits.push_back(Transmit::control(hb));
                    self.stats.heartbeats_sent += 1;
                    self.next_heartbeat = heartbeat_tick(now, interval);
                }
            }
            State::Backoff => {
                if now >= self.backoff_until {
                    self.state = State::Reconnecting;
                    self.stats.reconnects += 1;
                    self.events.push_back(Event::Reconnecting {
                        attempt: self.failures,
                    });
                    self.start_client_attempt(now);
                }
            }
            State::Idle | State::Failed | State::Closed => {}
        }
    }

    /// The transport under this connection failed (e.g. the UCX endpoint reported an error).
    pub fn handle_transport_error(&mut self, now: Timestamp) {
        if matches!(
            self.state,
            State::Connecting | State::Ready | State::Draining | State::Reconnecting
        ) {
            self.fail(now, FailReason::Transport);
        }
    }

    /// Begins draining: the caller stops starting new work and calls
    /// [`Connection::finish_drain`] when what is in flight has finished; at `now + timeout` the
    /// drain ends regardless. Outside `Ready` the connection simply closes.
    pub fn start_drain(&mut self, now: Timestamp, timeout: Duration) {
        match self.state {
            State::Ready => {
                self.state = State::Draining;
                self.drain_deadline = now.saturating_add(timeout);
            }
            State::Draining | State::Closed => {}
            _ => self.close_now(),
        }
    }

    /// Ends a drain: sends `Close` and closes. No effect outside `Draining`.
    pub fn finish_drain(&mut self, _now: Timestamp) {
        if self.state == State::Draining {
            self.end_drain(false);
        }
    }

    /// Closes at once, sending `Close` if a session is up.
    pub fn close(&mut self, _now: Timestamp) {
        if self.state != State::Closed {
            self.close_now();
        }
    }

    /// The next frame to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// When [`Connection::handle_timeout`] should next be called, if ever.
    pub fn poll_timeout(&self) -> Option<Timestamp> {
        match self.state {
            State::Connecting | State::Reconnecting => {
                self.attempt.as_ref().and_then(Attempt::poll_timeout)
            }
            State::Ready | State::Draining => {
                let mut t = self.next_heartbeat.min(self.dead_at());
                if !self.suspect {
                    t = t.min(self.suspect_at());
                }
                if self.state == State::Draining {
                    t = t.min(self.drain_deadline);
                }
                Some(t)
            }
            State::Backoff => Some(self.backoff_until),
            State::Idle | State::Failed | State::Closed => None,
        }
    }

    fn on_handshake_message(
        &mut self,
        now: Timestamp,
        header: &FrameHeader,
        msg: &HandshakeMessage,
    ) -> Received {
        match msg {
            HandshakeMessage::Hello(hello) => self.on_hello(now, header, hello),
            HandshakeMessage::Join(join) => self.on_join(now, header, join),
            _ => match self.attempt.as_mut() {
                Some(a) if !a.is_finished() => {
                    a.handle_message(now, msg);
                    self.after_attempt_input(now);
                    Received::Consumed
                }
                _ => self.drop_frame(DropReason::Unexpected),
            },
        }
    }

    fn on_hello(&mut self, now: Timestamp, header: &FrameHeader, hello: &Hello) -> Received {
        if self.state == State::Ready {
            return self.on_hello_while_ready(hello);
        }
        if self.role != Role::Server {
            return self.drop_frame(DropReason::Unexpected);
        }
        let in_progress = self.attempt.as_ref().filter(|a| !a.is_finished());
        let same_attempt = in_progress.and_then(Attempt::client_nonce) == Some(hello.nonce)
            || self.last_client_nonce == Some(hello.nonce);
        // A server still waiting for its first hello answers it with the handshake it has.
        let fresh_wait = matches!(in_progress, Some(Attempt::Psk(h)) if h.client_nonce().is_none());
        if same_attempt {
            // A duplicate of the hello we are answering or have answered.
            return self.drop_frame(DropReason::Unexpected);
        }
        if self
            .peer
            .or(self.beside)
            .is_some_and(|p| hello.incarnation < p.incarnation)
        {
            return self.drop_frame(DropReason::StaleIncarnation);
        }
        self.adopt_remote_shard(header.src_shard);
        let msg = HandshakeMessage::Hello(*hello);
        if self.state == State::Draining {
            self.refuse_opening(&msg, RejectReason::Shutdown);
            return Received::Consumed;
        }
        // An invalid shard count is no rail either, but the handshake refuses it with its own
        // reason (BadShardCount).
        let on_rail = Rails::new(self.cfg.handshake.shard_count, hello.shard_count)
            .map_or(true, |r| r.has_rail(self.cfg.local_shard, header.src_shard));
        if !on_rail {
            self.refuse_opening(&msg, RejectReason::NoSuchRail);
            if self.state != State::Ready {
                self.fail(
                    now,
                    FailReason::Handshake(HandshakeError::NoSuchRail {
                        local: self.cfg.local_shard,
                        remote: header.src_shard,
                    }),
                );
            }
            return Received::Consumed;
        }
        if !fresh_wait {
            let nonce = self.nonces.next_nonce();
            self.attempt = Some(Attempt::Psk(Handshake::server(
                now,
                self.cfg.handshake.clone(),
                nonce,
            )));
        }
        self.state = State::Connecting;
        if let Some(a) = self.attempt.as_mut() {
            a.handle_message(now, &msg);
        }
        self.after_attempt_input(now);
        Received::Consumed
    }

    /// A `Hello` to a ready connection, of either role: anyone who can reach the endpoint can
    /// send one naming the peer, so the session stays until another handshake has proved the
    /// key, on a connection of its own (see the module docs).
    fn on_hello_while_ready(&mut self, hello: &Hello) -> Received {
        if self.peer.is_some_and(|p| hello.incarnation < p.incarnation) {
            return self.drop_frame(DropReason::StaleIncarnation);
        }
        if self.last_client_nonce == Some(hello.nonce) {
            // A duplicate of the hello this session was made with.
            return self.drop_frame(DropReason::Unexpected);
        }
        self.drop_frame(DropReason::Opening)
    }

    fn on_join(&mut self, now: Timestamp, header: &FrameHeader, join: &Join) -> Received {
        if self.role != Role::Server {
            return self.drop_frame(DropReason::Unexpected);
        }
        if self.last_client_nonce == Some(join.nonce) || self.last_refused_nonce == Some(join.nonce)
        {
            // A duplicate of a join already accepted or refused.
            return self.drop_frame(DropReason::Unexpected);
        }
        self.adopt_remote_shard(header.src_shard);
        let msg = HandshakeMessage::Join(*join);
        if self.state == State::Draining {
            self.refuse_opening(&msg, RejectReason::Shutdown);
            return Received::Consumed;
        }
        let rail = Rail {
            local: self.cfg.local_shard,
            remote: header.src_shard,
        };
        let verdict = match &self.join {
            Some(s) => accept_join(&self.cfg.handshake, &s.peer, &s.secret, rail, join)
                .map(|joined| (joined, s.peer)),
            None => Err(HandshakeError::UnknownSession),
        };
        match verdict {
            Ok((joined, peer)) => {
                if self.state == State::Ready {
                    self.events.push_back(Event::Failed {
                        reason: FailReason::SessionReplaced,
                    });
                }
                self.attempt = None;
                self.last_client_nonce = Some(join.nonce);
                self.push_handshake(HandshakeMessage::Joined(joined));
                self.secret = None;
                self.stats.joins += 1;
                self.on_connected(now, peer);
            }
            Err(e) => {
                let reason = e.reject_reason().unwrap_or(RejectReason::BadProof);
                self.refuse_opening(&msg, reason);
                self.last_refused_nonce = Some(join.nonce);
                self.stats.joins_refused += 1;
                if self.state != State::Ready {
                    self.fail(now, FailReason::Handshake(e));
                }
            }
        }
        Received::Consumed
    }

    /// A server learns its remote shard from the first opening frame it processes.
    fn adopt_remote_shard(&mut self, src_shard: ShardId) {
        if self.remote_shard.is_none() {
            self.remote_shard = Some(src_shard);
        }
    }

    fn refuse_opening(&mut self, msg: &HandshakeMessage, reason: RejectReason) {
        if let Some(echo) = msg.opening_nonce() {
            let t = reject_transmit(&self.cfg, self.dst_shard(), echo, reason);
            self.transmits.push_back(t);
        }
    }

    fn after_attempt_input(&mut self, now: Timestamp) {
        let Some(a) = self.attempt.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        while let Some(m) = a.poll_transmit() {
            out.push(m);
        }
        let outcome = a.outcome().cloned();
        let client_nonce = a.client_nonce();
        let (secret, joined) = match a {
            Attempt::Psk(h) => (h.session_secret().cloned(), false),
            Attempt::Join(_) => (None, true),
        };
        for m in out {
            self.push_handshake(m);
        }
        match outcome {
            None => {}
            Some(Ok(peer)) => {
                self.attempt = None;
                self.last_client_nonce = client_nonce;
                self.secret = secret;
                if joined {
                    self.stats.joins += 1;
                } else {
                    self.stats.handshakes += 1;
                }
                self.on_connected(now, peer);
            }
            Some(Err(e)) => {
                self.attempt = None;
                self.fail(now, FailReason::Handshake(e));
            }
        }
    }

    fn on_connected(&mut self, now: Timestamp, peer: PeerInfo) {
        if let Some(old) = self.peer.or(self.beside) {
            if old.incarnation != peer.incarnation {
                self.events.push_back(Event::PeerRestarted {
                    old: old.incarnation,
                    new: peer.incarnation,
                });
            }
        }
        self.peer = Some(peer);
        self.state = State::Ready;
        self.failures = 0;
        self.suspect = false;
        self.last_heard = now;
        self.next_heartbeat = heartbeat_tick(now, self.cfg.heartbeat_interval);
        self.events.push_back(Event::Connected(peer));
    }

    fn fail(&mut self, now: Timestamp, reason: FailReason) {
        self.attempt = None;
        self.suspect = false;
        self.events.push_back(Event::Failed { reason });
        // Join clients never retry by themselves (see the module docs).
        let may_retry = self.role == Role::Client
            && self.join.is_none()
            && match self.cfg.max_reconnect_attempts {
                None => true,
                Some(max) => self.failures < max,
            };
        if may_retry {
            let delay = self.backoff_delay(self.failures);
            self.failures = self.failures.saturating_add(1);
            self.backoff_until = now.saturating_add(delay);
            self.state = State::Backoff;
        } else {
            self.state = State::Failed;
        }
    }

    /// The jittered backoff before attempt `k + 1`: uniform in `[d/2, d]`,
    /// `d = min(max, initial · 2^k)`.
    fn backoff_delay(&mut self, k: u32) -> Duration {
        let factor = 1u32.checked_shl(k.min(31)).unwrap_or(u32::MAX);
        let d = self
            .cfg
            .backoff_initial
            .saturating_mul(factor)
            .min(self.cfg.backoff_max);
        self.rng.duration_between(d / 2, d)
    }

    /// Starts a client's opening: a join for a join client, else a pre-shared-key handshake.
    fn start_client_attempt(&mut self, now: Timestamp) {
        let nonce = self.nonces.next_nonce();
        self.attempt = Some(match &self.join {
            Some(s) => Attempt::Join(JoinAttempt::new(
                now,
                &self.cfg.handshake,
                s.peer,
                s.secret.clone(),
                Rail {
                    local: self.cfg.local_shard,
                    remote: self.dst_shard(),
                },
                nonce,
            )),
            None => Attempt::Psk(Handshake::client(now, self.cfg.handshake.clone(), nonce)),
        });
        self.after_attempt_input(now);
    }

    fn heard(&mut self, now: Timestamp) {
        self.last_heard = self.last_heard.max(now);
        if self.suspect {
            self.suspect = false;
            self.events.push_back(Event::PeerRecovered);
        }
    }

    fn suspect_at(&self) -> Timestamp {
        self.last_heard.saturating_add(
            self.cfg
                .heartbeat_interval
                .saturating_mul(self.cfg.suspect_after.max(1)),
        )
    }

    fn dead_at(&self) -> Timestamp {
        self.last_heard
            .saturating_add(self.cfg.failure_detection_bound())
    }

    fn end_drain(&mut self, timed_out: bool) {
        self.transmits
            .push_back(Transmit::control(self.control_header(FrameKind::Close)));
        self.state = State::Closed;
        self.events.push_back(Event::Drained { timed_out });
        self.events.push_back(Event::Closed {
            reason: CloseReason::Local,
        });
    }

    fn close_now(&mut self) {
        if matches!(self.state, State::Ready | State::Draining) {
            self.transmits
                .push_back(Transmit::control(self.control_header(FrameKind::Close)));
        }
        self.attempt = None;
        self.state = State::Closed;
        self.events.push_back(Event::Closed {
            reason: CloseReason::Local,
        });
    }

    /// The `dst_shard` of frames we send. A client knows it from creation and a server adopts
    /// it from the first opening frame, before it sends anything, so the fallback is never
    /// written to the wire.
    fn dst_shard(&self) -> ShardId {
        self.remote_shard.unwrap_or(ShardId::new(0))
    }

    fn control_header(&self, kind: FrameKind) -> FrameHeader {
        FrameHeader {
            version: self
                .peer
                .map_or(crate::wire::MAX_WIRE_VERSION, |p| p.version),
            src_shard: self.cfg.local_shard,
            dst_shard: self.dst_shard(),
            incarnation: self.cfg.handshake.incarnation,
            ..FrameHeader::new(kind)
        }
    }

    fn push_handshake(&mut self, msg: HandshakeMessage) {
        let t = Transmit::handshake(self.control_header(msg.kind()), &msg);
        self.transmits.push_back(t);
    }

    fn drop_frame(&mut self, reason: DropReason) -> Received {
        match reason {
            DropReason::StaleIncarnation => self.stats.dropped_stale += 1,
            DropReason::NotReady => self.stats.dropped_not_ready += 1,
            DropReason::Malformed => self.stats.dropped_malformed += 1,
            DropReason::Misrouted => self.stats.dropped_misrouted += 1,
            _ => self.stats.dropped_other += 1,
        }
        Received::Dropped(reason)
    }
}

/// A `Reject` frame from `cfg`'s node and shard to shard `to`, echoing `echo`.
fn reject_transmit(cfg: &ConnConfig, to: ShardId, echo: Nonce, reason: RejectReason) -> Transmit {
    let reject = HandshakeMessage::Reject(Reject {
        reason,
        min_version: cfg.handshake.min_version,
        max_version: cfg.handshake.max_version,
        echo,
    });
    let header = FrameHeader {
        src_shard: cfg.local_shard,
        dst_shard: to,
        incarnation: cfg.handshake.incarnation,
        ..FrameHeader::new(FrameKind::Reject)
    };
    Transmit::handshake(header, &reject)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::handshake::{Joined, PreSharedKey};
    use crate::wire::decode_frame;

    fn cfg(node: u64) -> ConnConfig {
        let psk = PreSharedKey::new(&[9; 32]).unwrap();
        let mut c = ConnConfig::new(HandshakeConfig::new(
            NodeId::new(node),
            Incarnation::new(node),
            2,
            psk,
        ));
        c.heartbeat_interval = Duration::from_millis(10);
        c.suspect_after = 2;
        c.dead_after = 4;
        c
    }

    fn seeds(s: u64) -> Seeds {
        Seeds {
            rng: s,
            nonce: [s as u8; 32],
        }
    }

    /// Delivers every queued frame from `from` to `to`, through the byte encoding.
    fn deliver(now: Timestamp, from: &mut Connection, to: &mut Connection) -> bool {
        let mut moved = false;
        while let Some(t) = from.poll_transmit() {
            let bytes = t.to_vec();
            let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
            to.handle_frame(now, &h, p);
            moved = true;
        }
        moved
    }

    /// Delivers frames both ways until both are quiet.
    fn pump(now: Timestamp, a: &mut Connection, b: &mut Connection) {
        while deliver(now, a, b) | deliver(now, b, a) {}
    }

    fn ready_pair() -> (Connection, Connection) {
        let now = Timestamp::ZERO;
        let mut c = Connection::client(cfg(1), NodeId::new(2), ShardId::new(0), seeds(1));
        let mut s = Connection::server(now, cfg(2), seeds(2));
        c.connect(now).unwrap();
        pump(now, &mut c, &mut s);
        assert_eq!((c.state(), s.state()), (State::Ready, State::Ready));
        (c, s)
    }

    #[test]
    fn misuse_is_a_typed_error() {
        let now = Timestamp::ZERO;
        let mut s = Connection::server(now, cfg(2), seeds(2));
        assert!(matches!(
            s.connect(now),
            Err(ConnError::InvalidState { op: "connect", .. })
        ));
        assert!(s.frame_header(FrameKind::Am).is_err());
        let (mut c, _) = ready_pair();
        assert!(c.connect(now).is_err());
        let h = c.frame_header(FrameKind::Am).unwrap();
        assert_eq!(h.incarnation, Incarnation::new(1));
        assert_eq!(Some(h.dst_shard), c.remote_shard());
        assert_eq!(c.remote_shard(), Some(ShardId::new(0)));
        assert_eq!(
            c.rail(),
            Some(Rail {
                local: ShardId::new(0),
                remote: ShardId::new(0)
            })
        );
    }

    #[test]
    fn frames_are_checked_against_the_session() {
        let (mut c, mut s) = ready_pair();
        let now = Timestamp::from_nanos(1);
        let good = c.frame_header(FrameKind::Am).unwrap();
        assert_eq!(s.handle_frame(now, &good, &[]), Received::Deliver);
        let stale = FrameHeader {
            incarnation: Incarnation::new(0),
            ..good
        };
        assert_eq!(
            s.handle_frame(now, &stale, &[]),
            Received::Dropped(DropReason::StaleIncarnation)
        );
        let hello = FrameHeader::new(FrameKind::Hello);
        assert_eq!(
            s.handle_frame(now, &hello, &[1, 2, 3]),
            Received::Dropped(DropReason::Malformed)
        );
        assert_eq!(
            c.handle_frame(
                now,
                &FrameHeader {
                    kind: FrameKind::Hello,
                    payload_len: 64,
                    ..good
                },
                &[0; 64]
            ),
            // A ready connection declines hellos whatever its role (a newer one gets an opening
            // beside it); this one names incarnation 0, older than the session's.
            Received::Dropped(DropReason::StaleIncarnation)
        );
        assert_eq!(s.stats().delivered, 1);
        assert_eq!(s.stats().dropped_stale, 1);
        assert_eq!(s.stats().dropped_malformed, 1);
    }

    #[test]
    fn a_data_lane_admits_exactly_what_handle_frame_delivers() {
        let (mut c, mut s) = ready_pair();
        let now = Timestamp::from_nanos(1);
        let lane = s.data_lane().unwrap();
        let good = c.frame_header(FrameKind::Am).unwrap();
        // Each field the connection checks, changed one at a time, and the good header.
        let cases = [
            good,
            FrameHeader {
                incarnation: Incarnation::new(7),
                ..good
            },
            FrameHeader {
                version: good.version.wrapping_add(1),
                ..good
            },
            FrameHeader {
                dst_shard: ShardId::new(good.dst_shard.get() + 1),
                ..good
            },
            FrameHeader {
                src_shard: ShardId::new(good.src_shard.get() + 1),
                ..good
            },
            FrameHeader {
                kind: FrameKind::RpcRequest,
                id: 9,
                ..good
            },
        ];
        for h in cases {
            let admitted = lane.admits(&h);
            assert_eq!(
                admitted,
                s.handle_frame(now, &h, &[]) == Received::Deliver,
                "{h:?}"
            );
        }
        assert!(lane.admits(&good));
        // Only a ready connection whose peer is not suspect has one.
        assert!(c.data_lane().is_some());
        c.close(now);
        assert_eq!(c.data_lane(), None);
        let s2 = Connection::server(now, cfg(2), seeds(3));
        assert_eq!(s2.data_lane(), None);
        // Suspect: no lane until heard again.
        let quiet = Timestamp::ZERO + Duration::from_millis(25);
        s.handle_timeout(quiet);
        assert!(s.is_suspect());
        assert_eq!(s.data_lane(), None);
        s.heard_data(quiet, 1);
        assert!(!s.is_suspect());
        assert_eq!(s.data_lane(), Some(lane));
    }

    #[test]
    fn frames_admitted_by_the_lane_keep_the_peer_alive_once_told() {
        let (_, mut s) = ready_pair();
        let ms = |n| Timestamp::ZERO + Duration::from_millis(n);
        let delivered = s.stats().delivered;
        // Heard at 35 ms through the lane (10 ms heartbeats, dead after 4): not dead at 60 ms,
        // which a peer last heard at 0 is.
        s.heard_data(ms(35), 3);
        assert_eq!(s.stats().delivered, delivered + 3);
        // Nothing told: no change.
        s.heard_data(ms(50), 0);
        s.handle_timeout(ms(60));
        assert_eq!(s.state(), State::Ready);
        let (_, mut t) = ready_pair();
        t.handle_timeout(ms(60));
        assert_ne!(t.state(), State::Ready);
        // An older reading than the last does not move it back.
        s.heard_data(ms(1), 1);
        s.handle_timeout(ms(70));
        assert_eq!(s.state(), State::Ready);
    }

    #[test]
    fn heartbeats_fall_on_the_interval_grid() {
        let ms = |n| Timestamp::ZERO + Duration::from_millis(n);
        let i = Duration::from_millis(100);
        // At least half an interval on, then the next multiple.
        assert_eq!(heartbeat_tick(ms(0), i), ms(100));
        assert_eq!(heartbeat_tick(ms(49), i), ms(100));
        assert_eq!(heartbeat_tick(ms(50), i), ms(100));
        assert_eq!(heartbeat_tick(ms(51), i), ms(200));
        assert_eq!(heartbeat_tick(ms(100), i), ms(200));
        // A timer that fires late keeps the grid.
        assert_eq!(heartbeat_tick(ms(137), i), ms(200));
        assert_eq!(heartbeat_tick(ms(151), i), ms(300));
        assert_eq!(heartbeat_tick(ms(7), Duration::ZERO), ms(7));
        assert_eq!(heartbeat_tick(Timestamp::MAX, i), Timestamp::MAX);
        // Two connections made at different times send at the same instants from then on.
        let pair = |now| {
            let mut c = Connection::client(cfg(1), NodeId::new(2), ShardId::new(0), seeds(1));
            let mut s = Connection::server(now, cfg(2), seeds(2));
            c.connect(now).unwrap();
            pump(now, &mut c, &mut s);
            assert_eq!(c.state(), State::Ready);
            (c, s)
        };
        let mut pairs = [pair(ms(0)), pair(ms(33))];
        let mut sent: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
        // Timers handled 300 us late, as a timer fires.
        for t in (0..200_000)
            .step_by(100)
            .map(|us| Timestamp::ZERO + Duration::from_micros(us))
        {
            for (k, (c, s)) in pairs.iter_mut().enumerate() {
                let before = c.stats().heartbeats_sent;
                for x in [&mut *c, &mut *s] {
                    if x.poll_timeout()
                        .is_some_and(|due| t >= due + Duration::from_micros(300))
                    {
                        x.handle_timeout(t);
                    }
                }
                pump(t, c, s);
                if c.stats().heartbeats_sent > before {
                    sent[k].push(t.as_nanos() / 1_000_000);
                }
            }
        }
        // Every 10 ms on the grid, the later connection's first at 40 (33 + 5, rounded up).
        assert_eq!(sent[0], (1..20).map(|k| k * 10).collect::<Vec<_>>());
        assert_eq!(sent[1], (4..20).map(|k| k * 10).collect::<Vec<_>>());
        assert!(pairs
            .iter()
            .all(|(c, s)| c.state() == State::Ready && s.state() == State::Ready));
    }

    #[test]
    fn heartbeats_suspect_and_dead() {
        let (mut c, mut s) = ready_pair();
        let _ = (c.poll_event(), s.poll_event());
        let ms = |n| Timestamp::ZERO + Duration::from_millis(n);
        assert_eq!(c.poll_timeout(), Some(ms(10)));
        c.handle_timeout(ms(10));
        pump(ms(10), &mut c, &mut s);
        assert_eq!(c.stats().heartbeats_sent, 1);
        assert_eq!(c.stats().heartbeat_acks, 1);
        // Silence from now on: suspect after 2 intervals, dead after 4.
        let mut t = ms(10);
        while c.state() == State::Ready {
            t = c.poll_timeout().unwrap();
            c.handle_timeout(t);
            while c.poll_transmit().is_some() {}
        }
        assert_eq!(t, ms(50));
        let events: Vec<Event> = std::iter::from_fn(|| c.poll_event()).collect();
        assert_eq!(
            events,
            vec![
                Event::PeerSuspect,
                Event::PeerDead,
                Event::Failed {
                    reason: FailReason::PeerDead
                }
            ]
        );
        assert_eq!(c.state(), State::Backoff);
        // Backoff is within [initial/2, initial] for the first failure.
        let b = c.poll_timeout().unwrap();
        let d = b.saturating_duration_since(t);
        assert!(
            d >= Duration::from_millis(25) && d <= Duration::from_millis(50),
            "{d:?}"
        );
        c.handle_timeout(b);
        assert_eq!(c.state(), State::Reconnecting);
        assert_eq!(c.poll_event(), Some(Event::Reconnecting { attempt: 1 }));
        assert_eq!(
            c.poll_transmit().map(|t| t.header.kind),
            Some(FrameKind::Hello)
        );
    }

    #[test]
    fn backoff_grows_and_is_capped() {
        let mut c = Connection::client(cfg(1), NodeId::new(2), ShardId::new(0), seeds(3));
        for k in 0..20 {
            let d = c.backoff_delay(k);
            let full = Duration::from_millis(50)
                .saturating_mul(1 << k.min(31))
                .min(Duration::from_secs(5));
            assert!(d >= full / 2 && d <= full, "k={k}: {d:?}");
        }
    }

    #[test]
    fn drain_then_close() {
        let (mut c, mut s) = ready_pair();
        let _ = (c.poll_event(), s.poll_event());
        let now = Timestamp::from_nanos(5);
        c.start_drain(now, Duration::from_millis(100));
        assert_eq!(c.state(), State::Draining);
        assert!(c.frame_header(FrameKind::RpcResponse).is_ok());
        assert_eq!(
            c.poll_timeout(),
            Some(Timestamp::ZERO + Duration::from_millis(10))
        );
        c.finish_drain(now);
        assert_eq!(c.state(), State::Closed);
        assert_eq!(c.poll_event(), Some(Event::Drained { timed_out: false }));
        pump(now, &mut c, &mut s);
        assert_eq!(s.state(), State::Closed);
        assert_eq!(
            s.poll_event(),
            Some(Event::Closed {
                reason: CloseReason::Peer
            })
        );
        assert_eq!(c.poll_timeout(), None);
    }

    #[test]
    fn drain_deadline_and_hello_while_draining() {
        let (mut c, mut s) = ready_pair();
        let now = Timestamp::ZERO;
        s.start_drain(now, Duration::from_millis(5));
        // A new client attempt is refused with Shutdown while the server drains.
        let mut c2 = Connection::client(cfg(1), NodeId::new(2), ShardId::new(0), seeds(9));
        c2.connect(now).unwrap();
        pump(now, &mut c2, &mut s);
        assert_eq!(c2.state(), State::Backoff);
        assert!(std::iter::from_fn(|| c2.poll_event()).any(|e| e
            == Event::Failed {
                reason: FailReason::Handshake(HandshakeError::Rejected {
                    reason: RejectReason::Shutdown
                })
            }));
        let deadline = now + Duration::from_millis(5);
        s.handle_timeout(deadline);
        assert_eq!(s.state(), State::Closed);
        assert!(
            std::iter::from_fn(|| s.poll_event()).any(|e| e == Event::Drained { timed_out: true })
        );
        let _ = c.poll_event();
    }

    /// A `Hello` to a ready server, from the same incarnation or a newer one, whatever key is
    /// behind it, is declined ([`DropReason::Opening`]): the session, its frames and its
    /// heartbeats carry on, nothing is answered on the ready connection.
    #[test]
    fn a_ready_server_declines_hellos() {
        let (c, mut s) = ready_pair();
        let now = Timestamp::from_nanos(1);
        while s.poll_event().is_some() {}
        for inc in [1, 2] {
            let mut cf = cfg(1);
            cf.handshake.incarnation = Incarnation::new(inc);
            let mut forger = Connection::client(cf, NodeId::new(2), ShardId::new(0), seeds(7));
            forger.connect(now).unwrap();
            let t = forger.poll_transmit().unwrap();
            let bytes = t.to_vec();
            let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
            assert_eq!(
                s.handle_frame(now, &h, p),
                Received::Dropped(DropReason::Opening)
            );
            assert_eq!(s.state(), State::Ready);
            assert_eq!(s.poll_transmit(), None);
            assert_eq!(s.poll_event(), None);
        }
        // An older incarnation's is stale, as before.
        let mut cf = cfg(1);
        cf.handshake.incarnation = Incarnation::new(0);
        let mut old = Connection::client(cf, NodeId::new(2), ShardId::new(0), seeds(8));
        old.connect(now).unwrap();
        let bytes = old.poll_transmit().unwrap().to_vec();
        let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
        assert_eq!(
            s.handle_frame(now, &h, p),
            Received::Dropped(DropReason::StaleIncarnation)
        );
        let am = c.frame_header(FrameKind::Am).unwrap();
        assert_eq!(s.handle_frame(now, &am, &[]), Received::Deliver);
        assert_eq!(s.peer().unwrap().incarnation, Incarnation::new(1));
        assert_eq!(s.stats().handshakes, 1);
    }

    /// A restarted client's `Hello`, declined by the ready server, completes on a
    /// [`Connection::server_beside`], which reports the restart; one whose handshake fails
    /// (another key) ends `Failed` and leaves the ready connection as it was.
    #[test]
    fn a_server_beside_a_ready_one_reports_the_restart_or_fails_alone() {
        let (_, mut s) = ready_pair();
        let ready = *s.peer().unwrap();
        let now = Timestamp::from_nanos(1);
        let mut restarted = cfg(1);
        restarted.handshake.incarnation = Incarnation::new(5);
        let mut c = Connection::client(restarted, NodeId::new(2), ShardId::new(0), seeds(3));
        c.connect(now).unwrap();
        let mut p = Connection::server_beside(now, cfg(2), seeds(4), ready);
        pump(now, &mut c, &mut p);
        assert_eq!((c.state(), p.state()), (State::Ready, State::Ready));
        assert_eq!(
            std::iter::from_fn(|| p.poll_event()).collect::<Vec<_>>(),
            vec![
                Event::PeerRestarted {
                    old: Incarnation::new(1),
                    new: Incarnation::new(5)
                },
                Event::Connected(*p.peer().unwrap())
            ]
        );
        // Another key: the beside connection fails, the ready one never hears of it.
        let mut wrong = cfg(1);
        wrong.handshake.psk = PreSharedKey::new(&[3; 32]).unwrap();
        let mut forger = Connection::client(wrong, NodeId::new(2), ShardId::new(0), seeds(5));
        forger.connect(now).unwrap();
        let mut p = Connection::server_beside(now, cfg(2), seeds(6), ready);
        pump(now, &mut forger, &mut p);
        assert_ne!(p.state(), State::Ready);
        if let Some(t) = p.poll_timeout() {
            p.handle_timeout(t);
        }
        assert_eq!(p.state(), State::Failed);
        assert_eq!(s.state(), State::Ready);
        assert_eq!(s.poll_transmit(), None);
        // A `Hello` from an older incarnation than the ready peer's is stale there too.
        let mut older = cfg(1);
        older.handshake.incarnation = Incarnation::new(0);
        let mut o = Connection::client(older, NodeId::new(2), ShardId::new(0), seeds(7));
        o.connect(now).unwrap();
        let bytes = o.poll_transmit().unwrap().to_vec();
        let (h, pl) = decode_frame(&bytes, &Limits::default()).unwrap();
        let mut p = Connection::server_beside(now, cfg(2), seeds(8), ready);
        assert_eq!(
            p.handle_frame(now, &h, pl),
            Received::Dropped(DropReason::StaleIncarnation)
        );
    }

    #[test]
    fn transport_error_and_attempt_limit() {
        let mut cf = cfg(1);
        cf.max_reconnect_attempts = Some(1);
        let now = Timestamp::ZERO;
        let mut c = Connection::client(cf, NodeId::new(2), ShardId::new(0), seeds(1));
        c.connect(now).unwrap();
        c.handle_transport_error(now);
        assert_eq!(c.state(), State::Backoff);
        let t = c.poll_timeout().unwrap();
        c.handle_timeout(t);
        assert_eq!(c.state(), State::Reconnecting);
        c.handle_transport_error(t);
        assert_eq!(c.state(), State::Failed);
        assert_eq!(c.poll_timeout(), None);
        // A manual connect starts over.
        c.connect(t).unwrap();
        assert_eq!(c.state(), State::Connecting);
        c.close(t);
        assert_eq!(c.state(), State::Closed);
        let hb = FrameHeader::new(FrameKind::Heartbeat);
        assert_eq!(
            c.handle_frame(t, &hb, &[]),
            Received::Dropped(DropReason::Closed)
        );
    }

    /// A config for `node` with `shards` shards, on local shard `local`.
    fn rail_cfg(node: u64, shards: u16, local: u16) -> ConnConfig {
        let mut c = cfg(node);
        c.handshake.shard_count = shards;
        c.local_shard = ShardId::new(local);
        c
    }

    /// A primary between node 1 (2 shards) and node 2 (3 shards) on rail (0, 0), pumped to
    /// `Ready`; events drained.
    fn primary_2x3() -> (Connection, Connection) {
        let now = Timestamp::ZERO;
        let mut c =
            Connection::client(rail_cfg(1, 2, 0), NodeId::new(2), ShardId::new(0), seeds(1));
        let mut s = Connection::server(now, rail_cfg(2, 3, 0), seeds(2));
        c.connect(now).unwrap();
        pump(now, &mut c, &mut s);
        assert_eq!((c.state(), s.state()), (State::Ready, State::Ready));
        while c.poll_event().is_some() || s.poll_event().is_some() {}
        (c, s)
    }

    /// What a net layer does with a join arriving on an endpoint with no connection: decode it
    /// and make a join server with the session (the server's view of it).
    fn accept_first_join(
        now: Timestamp,
        client: &mut Connection,
        server_cfg: ConnConfig,
        session: PeerInfo,
        secret: SessionSecret,
    ) -> Connection {
        let t = client.poll_transmit().unwrap();
        let bytes = t.to_vec();
        let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
        let Ok(HandshakeMessage::Join(join)) = HandshakeMessage::decode(h.kind, p) else {
            panic!("expected a join, got {h:?}");
        };
        assert_eq!(join.node_id, client.config().handshake.node_id);
        let mut s = Connection::join_server(now, server_cfg, session, secret, seeds(7));
        assert_eq!(s.handle_frame(now, &h, p), Received::Consumed);
        s
    }

    fn events(c: &mut Connection) -> Vec<Event> {
        std::iter::from_fn(|| c.poll_event()).collect()
    }

    /// The primary's session as each side holds it: (server as the client knows it, client as
    /// the server knows it, secret).
    fn session_of(c: &Connection, s: &Connection) -> (PeerInfo, PeerInfo, SessionSecret) {
        (
            *c.peer().unwrap(),
            *s.peer().unwrap(),
            c.session_secret().cloned().unwrap(),
        )
    }

    fn join_client(
        local: u16,
        remote: u16,
        peer: PeerInfo,
        secret: &SessionSecret,
        seed: u64,
    ) -> Connection {
        Connection::join_client(
            rail_cfg(1, 2, local),
            peer,
            secret.clone(),
            ShardId::new(remote),
            seeds(seed),
        )
    }

    #[test]
    fn primary_rails_share_a_session_secret() {
        let (mut c, mut s) = primary_2x3();
        let secret = c.session_secret().cloned().unwrap();
        assert_eq!(s.session_secret(), Some(&secret));
        assert!(!c.is_join() && !s.is_join());
        assert_eq!((c.stats().handshakes, s.stats().joins), (1, 0));
        assert_eq!(s.remote_shard(), Some(ShardId::new(0)));
        let now = Timestamp::from_nanos(1);
        c.close(now);
        pump(now, &mut c, &mut s);
        assert_eq!((c.session_secret(), s.session_secret()), (None, None));
    }

    #[test]
    fn server_adopts_the_remote_shard_and_drops_misrouted_frames() {
        let now = Timestamp::ZERO;
        // 2 x 3: client shard 1 to server shard 1 is a rail.
        let mut c =
            Connection::client(rail_cfg(1, 2, 1), NodeId::new(2), ShardId::new(1), seeds(1));
        let mut s = Connection::server(now, rail_cfg(2, 3, 1), seeds(2));
        assert_eq!(s.remote_shard(), None);
        // Before anything: a frame for another shard is misrouted, one from any shard is not.
        let stray = FrameHeader {
            dst_shard: ShardId::new(0),
            ..FrameHeader::new(FrameKind::Heartbeat)
        };
        assert_eq!(
            s.handle_frame(now, &stray, &[]),
            Received::Dropped(DropReason::Misrouted)
        );
        let early = FrameHeader {
            src_shard: ShardId::new(2),
            dst_shard: ShardId::new(1),
            ..FrameHeader::new(FrameKind::Heartbeat)
        };
        assert_eq!(
            s.handle_frame(now, &early, &[]),
            Received::Dropped(DropReason::NotReady)
        );
        assert_eq!(s.remote_shard(), None, "only an opening frame sets it");
        c.connect(now).unwrap();
        pump(now, &mut c, &mut s);
        assert_eq!((c.state(), s.state()), (State::Ready, State::Ready));
        assert_eq!(s.remote_shard(), Some(ShardId::new(1)));
        let good = c.frame_header(FrameKind::Am).unwrap();
        assert_eq!(
            (good.src_shard, good.dst_shard),
            (ShardId::new(1), ShardId::new(1))
        );
        assert_eq!(s.handle_frame(now, &good, &[]), Received::Deliver);
        for bad in [
            FrameHeader {
                src_shard: ShardId::new(0),
                ..good
            },
            FrameHeader {
                dst_shard: ShardId::new(0),
                ..good
            },
        ] {
            assert_eq!(
                s.handle_frame(now, &bad, &[]),
                Received::Dropped(DropReason::Misrouted)
            );
        }
        let reply = s.frame_header(FrameKind::RpcResponse).unwrap();
        assert_eq!(c.handle_frame(now, &reply, &[]), Received::Deliver);
        let from_elsewhere = FrameHeader {
            src_shard: ShardId::new(2),
            ..reply
        };
        assert_eq!(
            c.handle_frame(now, &from_elsewhere, &[]),
            Received::Dropped(DropReason::Misrouted)
        );
        assert_eq!(s.stats().dropped_misrouted, 3);
        assert_eq!(c.stats().dropped_misrouted, 1);
    }

    #[test]
    fn hello_off_the_rails_is_refused() {
        let now = Timestamp::ZERO;
        // 2 x 3: (client 1, server 0) is no rail ((0,0), (1,1), (0,2)).
        let mut cf = rail_cfg(1, 2, 1);
        cf.max_reconnect_attempts = Some(0);
        let mut c = Connection::client(cf, NodeId::new(2), ShardId::new(0), seeds(1));
        let mut s = Connection::server(now, rail_cfg(2, 3, 0), seeds(2));
        c.connect(now).unwrap();
        pump(now, &mut c, &mut s);
        assert_eq!((c.state(), s.state()), (State::Failed, State::Failed));
        assert_eq!(
            events(&mut c),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::Rejected {
                    reason: RejectReason::NoSuchRail
                })
            }]
        );
        assert_eq!(
            events(&mut s),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::NoSuchRail {
                    local: ShardId::new(0),
                    remote: ShardId::new(1)
                })
            }]
        );
    }

    #[test]
    fn join_makes_a_ready_rail() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        // Client shard 0 joins server shard 2.
        let mut jc = join_client(0, 2, server_peer, &secret, 3);
        assert!(jc.is_join());
        jc.connect(now).unwrap();
        assert_eq!(jc.state(), State::Connecting);
        let mut js =
            accept_first_join(now, &mut jc, rail_cfg(2, 3, 2), client_peer, secret.clone());
        pump(now, &mut js, &mut jc);
        assert_eq!((jc.state(), js.state()), (State::Ready, State::Ready));
        assert_eq!(events(&mut jc), vec![Event::Connected(server_peer)]);
        assert_eq!(events(&mut js), vec![Event::Connected(client_peer)]);
        assert_eq!((jc.session_secret(), js.session_secret()), (None, None));
        assert_eq!((jc.stats().joins, js.stats().joins), (1, 1));
        assert_eq!((jc.stats().handshakes, js.stats().handshakes), (0, 0));
        assert_eq!(js.remote_shard(), Some(ShardId::new(0)));
        // Frames flow, with the rail's shards.
        let h = jc.frame_header(FrameKind::RpcRequest).unwrap();
        assert_eq!(
            (h.src_shard, h.dst_shard),
            (ShardId::new(0), ShardId::new(2))
        );
        assert_eq!(js.handle_frame(now, &h, &[]), Received::Deliver);
        // Heartbeats are per rail.
        let t = jc.poll_timeout().unwrap();
        jc.handle_timeout(t);
        pump(t, &mut jc, &mut js);
        assert_eq!(jc.stats().heartbeat_acks, 1);
        // A duplicate of the join is ignored.
        let mut again = join_client(0, 2, server_peer, &secret, 3);
        again.connect(now).unwrap();
        let dup = again.poll_transmit().unwrap().to_vec();
        let (h, p) = decode_frame(&dup, &Limits::default()).unwrap();
        assert_eq!(
            js.handle_frame(t, &h, p),
            Received::Dropped(DropReason::Unexpected)
        );
        assert_eq!(js.state(), State::Ready);
        assert!(js.poll_transmit().is_none() && js.poll_event().is_none());
    }

    #[test]
    fn join_with_a_wrong_secret_is_refused_and_not_retried() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        let wrong = SessionSecret::from_bytes([3; 32]);
        let mut jc = join_client(1, 1, server_peer, &wrong, 3);
        // It would retry forever were it a primary.
        assert_eq!(jc.config().max_reconnect_attempts, None);
        jc.connect(now).unwrap();
        let mut js = accept_first_join(now, &mut jc, rail_cfg(2, 3, 1), client_peer, secret);
        assert_eq!(js.state(), State::Failed);
        assert_eq!(js.stats().joins_refused, 1);
        pump(now, &mut js, &mut jc);
        assert_eq!(jc.state(), State::Failed, "join clients do not back off");
        assert_eq!(jc.poll_timeout(), None);
        assert_eq!(
            events(&mut jc),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::Rejected {
                    reason: RejectReason::BadProof
                })
            }]
        );
        assert_eq!(
            events(&mut js),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::BadProof)
            }]
        );
        // The net layer may send a fresh join on the same connection.
        jc.connect(now).unwrap();
        assert_eq!(jc.state(), State::Connecting);
        assert_eq!(
            jc.poll_transmit().map(|t| t.header.kind),
            Some(FrameKind::Join)
        );
    }

    #[test]
    fn join_clients_never_back_off_whatever_the_attempt_limit() {
        let (c, s) = primary_2x3();
        let (server_peer, _, secret) = session_of(&c, &s);
        for limit in [None, Some(0), Some(3)] {
            let mut cf = rail_cfg(1, 2, 1);
            cf.max_reconnect_attempts = limit;
            let mut jc =
                Connection::join_client(cf, server_peer, secret.clone(), ShardId::new(1), seeds(3));
            let now = Timestamp::ZERO;
            jc.connect(now).unwrap();
            let t = jc.poll_timeout().unwrap();
            jc.handle_timeout(t);
            assert_eq!(
                (jc.state(), jc.poll_timeout()),
                (State::Failed, None),
                "{limit:?}"
            );
            // A join in progress that loses its transport fails for good too.
            jc.connect(t).unwrap();
            jc.handle_transport_error(t);
            assert_eq!(jc.state(), State::Failed, "{limit:?}");
            assert_eq!(jc.stats().reconnects, 0);
        }
    }

    #[test]
    fn join_timeout_and_a_second_join_replacing_the_first() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        let mut jc = join_client(1, 1, server_peer, &secret, 3);
        jc.connect(now).unwrap();
        let mut js = accept_first_join(now, &mut jc, rail_cfg(2, 3, 1), client_peer, secret);
        assert_eq!(js.state(), State::Ready);
        // The Joined is lost: the client times out at the handshake deadline, and stays failed.
        assert_eq!(
            js.poll_transmit().map(|t| t.header.kind),
            Some(FrameKind::Joined)
        );
        let deadline = jc.poll_timeout().unwrap();
        assert_eq!(deadline, now + Duration::from_secs(5));
        jc.handle_timeout(deadline);
        assert_eq!(jc.state(), State::Failed);
        assert_eq!(
            events(&mut jc),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::Timeout)
            }]
        );
        // A fresh join on the same rail replaces the server's session.
        let _ = events(&mut js);
        jc.connect(deadline).unwrap();
        pump(deadline, &mut jc, &mut js);
        assert_eq!((jc.state(), js.state()), (State::Ready, State::Ready));
        assert_eq!(
            events(&mut js),
            vec![
                Event::Failed {
                    reason: FailReason::SessionReplaced
                },
                Event::Connected(client_peer)
            ]
        );
    }

    #[test]
    fn refused_join_does_not_end_a_ready_rail() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        let mut jc = join_client(1, 1, server_peer, &secret, 3);
        jc.connect(now).unwrap();
        let mut js = accept_first_join(now, &mut jc, rail_cfg(2, 3, 1), client_peer, secret);
        pump(now, &mut js, &mut jc);
        let _ = (events(&mut jc), events(&mut js));
        // A join forged without the secret, on the same endpoint.
        let mut forger = join_client(1, 1, server_peer, &SessionSecret::from_bytes([0; 32]), 4);
        forger.connect(now).unwrap();
        let bytes = forger.poll_transmit().unwrap().to_vec();
        let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
        assert_eq!(js.handle_frame(now, &h, p), Received::Consumed);
        assert_eq!(js.state(), State::Ready);
        assert_eq!(js.stats().joins_refused, 1);
        assert_eq!(
            js.poll_transmit().map(|t| t.header.kind),
            Some(FrameKind::Reject)
        );
        assert!(js.poll_event().is_none());
        // Its duplicate is ignored.
        assert_eq!(
            js.handle_frame(now, &h, p),
            Received::Dropped(DropReason::Unexpected)
        );
    }

    #[test]
    fn primary_server_refuses_joins_and_join_server_answers_hellos() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        let mut jc = join_client(1, 1, server_peer, &secret, 3);
        jc.connect(now).unwrap();
        let mut plain = Connection::server(now, rail_cfg(2, 3, 1), seeds(5));
        pump(now, &mut jc, &mut plain);
        assert_eq!((jc.state(), plain.state()), (State::Failed, State::Failed));
        assert!(events(&mut jc).contains(&Event::Failed {
            reason: FailReason::Handshake(HandshakeError::Rejected {
                reason: RejectReason::UnknownSession
            })
        }));
        // A join server answers a hello with a full handshake and becomes a primary.
        let mut js = Connection::join_server(now, rail_cfg(2, 3, 1), client_peer, secret, seeds(6));
        let mut pc =
            Connection::client(rail_cfg(1, 2, 1), NodeId::new(2), ShardId::new(1), seeds(8));
        pc.connect(now).unwrap();
        pump(now, &mut pc, &mut js);
        assert_eq!((pc.state(), js.state()), (State::Ready, State::Ready));
        assert!(js.session_secret().is_some());
        assert_eq!(js.session_secret(), pc.session_secret());
    }

    #[test]
    fn join_client_off_the_rails_fails_at_connect() {
        let (c, s) = primary_2x3();
        let (server_peer, _, secret) = session_of(&c, &s);
        let mut jc = join_client(1, 2, server_peer, &secret, 3);
        jc.connect(Timestamp::ZERO).unwrap();
        assert_eq!(jc.state(), State::Failed);
        assert!(jc.poll_transmit().is_none());
        assert_eq!(
            events(&mut jc),
            vec![Event::Failed {
                reason: FailReason::Handshake(HandshakeError::NoSuchRail {
                    local: ShardId::new(1),
                    remote: ShardId::new(2)
                })
            }]
        );
    }

    #[test]
    fn draining_join_server_refuses_with_shutdown() {
        let (c, s) = primary_2x3();
        let (server_peer, client_peer, secret) = session_of(&c, &s);
        let now = Timestamp::from_nanos(10);
        let mut jc = join_client(1, 1, server_peer, &secret, 3);
        jc.connect(now).unwrap();
        let mut js =
            accept_first_join(now, &mut jc, rail_cfg(2, 3, 1), client_peer, secret.clone());
        pump(now, &mut js, &mut jc);
        js.start_drain(now, Duration::from_millis(5));
        let mut late = join_client(1, 1, server_peer, &secret, 4);
        late.connect(now).unwrap();
        pump(now, &mut late, &mut js);
        assert_eq!(js.state(), State::Draining);
        assert!(events(&mut late).contains(&Event::Failed {
            reason: FailReason::Handshake(HandshakeError::Rejected {
                reason: RejectReason::Shutdown
            })
        }));
    }

    #[test]
    fn refuse_answers_openings_only() {
        let cf = rail_cfg(2, 3, 2);
        let (c, s) = primary_2x3();
        let (server_peer, _, secret) = session_of(&c, &s);
        let mut jc = join_client(0, 2, server_peer, &secret, 3);
        jc.connect(Timestamp::ZERO).unwrap();
        let bytes = jc.poll_transmit().unwrap().to_vec();
        let (h, p) = decode_frame(&bytes, &Limits::default()).unwrap();
        let msg = HandshakeMessage::decode(h.kind, p).unwrap();
        let t = Connection::refuse(&cf, &h, &msg, RejectReason::UnknownSession).unwrap();
        assert_eq!(
            (t.header.kind, t.header.src_shard, t.header.dst_shard),
            (FrameKind::Reject, ShardId::new(2), ShardId::new(0))
        );
        assert_eq!(t.header.incarnation, Incarnation::new(2));
        assert_eq!(t.header.version, crate::wire::HANDSHAKE_WIRE_VERSION);
        let back = t.to_vec();
        let (rh, rp) = decode_frame(&back, &Limits::default()).unwrap();
        assert_eq!(
            jc.handle_frame(Timestamp::ZERO, &rh, rp),
            Received::Consumed
        );
        assert_eq!(jc.state(), State::Failed);
        let joined = HandshakeMessage::Joined(Joined {
            echo: [0; 32],
            proof: [0; 32],
        });
        assert!(Connection::refuse(&cf, &h, &joined, RejectReason::Busy).is_none());
    }
}
