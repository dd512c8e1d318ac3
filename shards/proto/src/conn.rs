//! The per-peer connection state machine.
//!
//! A [`Connection`] is the protocol state a shard keeps for one peer node: the handshake,
//! liveness (heartbeats, suspicion, death), reconnection with backoff, draining and close. It
//! performs no I/O; the shard moves frames between it and a UCX endpoint.
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
//! connection (the client dials again, and a fresh `Hello` restarts the handshake) or a client
//! that has used up [`ConnConfig::max_reconnect_attempts`]. A client with attempts left passes
//! straight through `Failed` into `Backoff`, after emitting [`Event::Failed`]. The backoff delay
//! for failure number `k` (from 0) is drawn uniformly from `[d/2, d]` with
//! `d = min(backoff_max, backoff_initial · 2^k)` ("equal jitter"), using the connection's own
//! [`Rng`] seeded by the caller.
//!
//! # Liveness
//!
//! In `Ready` and `Draining` a heartbeat is sent every [`ConnConfig::heartbeat_interval`] and the
//! peer answers each with a `HeartbeatAck`. Every valid frame from the peer counts as a sign of
//! life. After `suspect_after` intervals of silence the peer is reported suspect
//! ([`Event::PeerSuspect`]; [`Event::PeerRecovered`] if it speaks again), and after `dead_after`
//! intervals it is declared dead ([`Event::PeerDead`] then [`Event::Failed`]). The timer is set
//! exactly at `last_heard + dead_after · interval`, so a caller that honours
//! [`Connection::poll_timeout`] detects a silent peer no later than that.
//!
//! # Incarnations
//!
//! Every frame header carries its sender's incarnation. Once connected, frames whose incarnation
//! differs from the one learned in the handshake are dropped and counted
//! ([`ConnStats::dropped_stale`]); a `Hello` from an older incarnation is dropped the same way. A
//! `Hello` from a newer incarnation (the peer restarted) replaces the session:
//! [`Event::Failed`] with [`FailReason::SessionReplaced`] (so in-flight work fails), then
//! [`Event::PeerRestarted`] and [`Event::Connected`] once the new handshake completes.
//!
//! # Calling order
//!
//! As in quinn-proto:
//!
//! 1. Create with [`Connection::client`] (then [`Connection::connect`]) or
//!    [`Connection::server`].
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

use crate::handshake::{
    Handshake, HandshakeConfig, HandshakeError, HandshakeMessage, NonceGen, PeerInfo, Reject,
    RejectReason, Role, MAX_HANDSHAKE_LEN,
};
use crate::ids::{Incarnation, NodeId, ReqId, ShardId};
use crate::rng::Rng;
use crate::shard_map::ShardMap;
use crate::time::Timestamp;
use crate::wire::{encode_frame, FrameHeader, FrameKind, Limits, WireError};
use std::collections::VecDeque;
use std::time::Duration;
use thiserror::Error;

/// Connection settings.
#[derive(Clone, Debug)]
pub struct ConnConfig {
    /// This node's identity, key, versions and handshake timeout.
    pub handshake: HandshakeConfig,
    /// The local shard that owns this connection (written as `src_shard`).
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
    /// Client only: consecutive failed attempts after which the connection stays `Failed`;
    /// `None` retries forever.
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
    /// First handshake in progress (client), or waiting for / answering a hello (server).
    Connecting,
    /// Handshake complete; frames flow.
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
    /// The handshake failed (timeout, bad proof, rejection...).
    Handshake(HandshakeError),
    /// The peer stopped answering heartbeats.
    PeerDead,
    /// The transport reported an error.
    Transport,
    /// The peer started a new session (it restarted or reconnected).
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
    /// A handshake completed; frames flow.
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
    /// Not expected in this role or state (e.g. a hello sent to a client).
    Unexpected,
    /// The frame's wire version is not the negotiated one.
    VersionMismatch,
    /// The connection is closed.
    Closed,
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
    /// Frames dropped as unexpected, version-mismatched, or after close.
    pub dropped_other: u64,
    /// Heartbeats sent.
    pub heartbeats_sent: u64,
    /// Heartbeat acks received.
    pub heartbeat_acks: u64,
    /// Handshakes completed.
    pub handshakes: u64,
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

/// One peer's connection state. See the module docs for states and calling order.
#[derive(Clone, Debug)]
pub struct Connection {
    cfg: ConnConfig,
    role: Role,
    state: State,
    handshake: Option<Handshake>,
    /// Client nonce of the last handshake that completed (server side; to spot duplicate hellos).
    last_client_nonce: Option<[u8; 32]>,
    peer: Option<PeerInfo>,
    remote_shard: ShardId,
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

impl Connection {
    /// A client connection that will dial `peer`; call [`Connection::connect`] to start.
    /// `cfg.handshake.expected_peer` is set to `peer`.
    pub fn client(mut cfg: ConnConfig, peer: NodeId, seeds: Seeds) -> Connection {
        cfg.handshake.expected_peer = Some(peer);
        Connection::new(cfg, Role::Client, State::Idle, seeds)
    }

    /// A server connection for an endpoint a client dialled, waiting for its hello from `now`
    /// (the handshake deadline runs from `now`).
    pub fn server(now: Timestamp, cfg: ConnConfig, seeds: Seeds) -> Connection {
        let mut c = Connection::new(cfg, Role::Server, State::Connecting, seeds);
        let nonce = c.nonces.next_nonce();
        c.handshake = Some(Handshake::server(now, c.cfg.handshake.clone(), nonce));
        c
    }

    fn new(cfg: ConnConfig, role: Role, state: State, seeds: Seeds) -> Connection {
        Connection {
            cfg,
            role,
            state,
            handshake: None,
            last_client_nonce: None,
            peer: None,
            remote_shard: ShardId::new(0),
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

    /// The peer, as learned by the last completed handshake.
    pub fn peer(&self) -> Option<&PeerInfo> {
        self.peer.as_ref()
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

    /// The peer's shard that owns this node (the `dst_shard` of frames we send), once connected.
    pub fn remote_shard(&self) -> ShardId {
        self.remote_shard
    }

    /// A header for an application frame of `kind` on the current session: version, shards and
    /// incarnation filled in; set `id`, `req_id`, the deadline and `payload_len` yourself. Valid
    /// in `Ready` and `Draining` (responses still flow while draining).
    pub fn frame_header(&self, kind: FrameKind) -> Result<FrameHeader, ConnError> {
        match (self.state, &self.peer) {
            (State::Ready | State::Draining, Some(peer)) => Ok(FrameHeader {
                version: peer.version,
                src_shard: self.cfg.local_shard,
                dst_shard: self.remote_shard,
                incarnation: self.cfg.handshake.incarnation,
                ..FrameHeader::new(kind)
            }),
            _ => Err(ConnError::InvalidState {
                op: "build a frame header",
                state: self.state,
            }),
        }
    }

    /// Starts (or, from `Failed`, restarts) dialling. Client only.
    pub fn connect(&mut self, now: Timestamp) -> Result<(), ConnError> {
        if self.role != Role::Client || !matches!(self.state, State::Idle | State::Failed) {
            return Err(ConnError::InvalidState {
                op: "connect",
                state: self.state,
            });
        }
        self.failures = 0;
        self.state = State::Connecting;
        self.start_client_handshake(now);
        Ok(())
    }

    /// Processes one frame received from the peer. `payload` is the frame's payload (empty for
    /// rendezvous frames whose data comes separately).
    pub fn handle_frame(
        &mut self,
        now: Timestamp,
        header: &FrameHeader,
        payload: &[u8],
    ) -> Received {
        if self.state == State::Closed {
            return self.drop_frame(DropReason::Closed);
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
                self.handshake = None;
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

    /// Advances timers: handshake deadline, heartbeats, suspicion and death, backoff, drain
    /// deadline. Does nothing before [`Connection::poll_timeout`]'s time.
    pub fn handle_timeout(&mut self, now: Timestamp) {
        match self.state {
            State::Connecting | State::Reconnecting => {
                if let Some(hs) = self.handshake.as_mut() {
                    hs.handle_timeout(now);
                }
                self.after_handshake_input(now);
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
                    self.next_heartbeat = now.saturating_add(interval);
                }
            }
            State::Backoff => {
                if now >= self.backoff_until {
                    self.state = State::Reconnecting;
                    self.stats.reconnects += 1;
                    self.events.push_back(Event::Reconnecting {
                        attempt: self.failures,
                    });
                    self.start_client_handshake(now);
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
                self.handshake.as_ref().and_then(Handshake::poll_timeout)
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
        if let HandshakeMessage::Hello(hello) = msg {
            if self.role != Role::Server {
                return self.drop_frame(DropReason::Unexpected);
            }
            let in_progress = self.handshake.as_ref().filter(|h| !h.is_finished());
            let same_attempt = in_progress.and_then(Handshake::client_nonce) == Some(hello.nonce)
                || self.last_client_nonce == Some(hello.nonce);
            if same_attempt {
                // A duplicate of the hello we are answering or have answered.
                return self.drop_frame(DropReason::Unexpected);
            }
            if self.peer.is_some_and(|p| hello.incarnation < p.incarnation) {
                return self.drop_frame(DropReason::StaleIncarnation);
            }
            if self.state == State::Draining {
                let reject = Reject::of_hello(
                    hello,
                    RejectReason::Shutdown,
                    self.cfg.handshake.min_version,
                    self.cfg.handshake.max_version,
                );
                self.push_handshake(HandshakeMessage::Reject(reject));
                return Received::Consumed;
            }
            let fresh_wait = in_progress.is_some_and(|h| h.client_nonce().is_none());
            if !fresh_wait {
                if self.state == State::Ready {
                    self.events.push_back(Event::Failed {
                        reason: FailReason::SessionReplaced,
                    });
                }
                let nonce = self.nonces.next_nonce();
                self.handshake = Some(Handshake::server(now, self.cfg.handshake.clone(), nonce));
            }
            self.state = State::Connecting;
        } else if !matches!(&self.handshake, Some(h) if !h.is_finished()) {
            let _ = header;
            return self.drop_frame(DropReason::Unexpected);
        }
        if let Some(hs) = self.handshake.as_mut() {
            hs.handle_message(now, msg);
        }
        self.after_handshake_input(now);
        Received::Consumed
    }

    fn after_handshake_input(&mut self, now: Timestamp) {
        let Some(hs) = self.handshake.as_mut() else {
            return;
        };
        let mut out = Vec::new();
        while let Some(m) = hs.poll_transmit() {
            out.push(m);
        }
        let outcome = hs.outcome().cloned();
        let client_nonce = hs.client_nonce();
        for m in out {
            self.push_handshake(m);
        }
        match outcome {
            None => {}
            Some(Ok(peer)) => {
                self.handshake = None;
                self.last_client_nonce = client_nonce;
                self.on_connected(now, peer);
            }
            Some(Err(e)) => {
                self.handshake = None;
                self.fail(now, FailReason::Handshake(e));
            }
        }
    }

    fn on_connected(&mut self, now: Timestamp, peer: PeerInfo) {
        if let Some(old) = self.peer {
            if old.incarnation != peer.incarnation {
                self.events.push_back(Event::PeerRestarted {
                    old: old.incarnation,
                    new: peer.incarnation,
                });
            }
        }
        self.remote_shard = ShardMap::new(peer.shard_count)
            .map(|m| m.owner_of(self.cfg.handshake.node_id))
            .unwrap_or(ShardId::new(0));
        self.peer = Some(peer);
        self.state = State::Ready;
        self.failures = 0;
        self.suspect = false;
        self.last_heard = now;
        self.next_heartbeat = now.saturating_add(self.cfg.heartbeat_interval);
        self.stats.handshakes += 1;
        self.events.push_back(Event::Connected(peer));
    }

    fn fail(&mut self, now: Timestamp, reason: FailReason) {
        self.handshake = None;
        self.suspect = false;
        self.events.push_back(Event::Failed { reason });
        let may_retry = self.role == Role::Client
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

    fn start_client_handshake(&mut self, now: Timestamp) {
        let nonce = self.nonces.next_nonce();
        self.handshake = Some(Handshake::client(now, self.cfg.handshake.clone(), nonce));
        self.after_handshake_input(now);
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
        self.handshake = None;
        self.state = State::Closed;
        self.events.push_back(Event::Closed {
            reason: CloseReason::Local,
        });
    }

    fn control_header(&self, kind: FrameKind) -> FrameHeader {
        FrameHeader {
            version: self
                .peer
                .map_or(crate::wire::MAX_WIRE_VERSION, |p| p.version),
            src_shard: self.cfg.local_shard,
            dst_shard: self.remote_shard,
            incarnation: self.cfg.handshake.incarnation,
            ..FrameHeader::new(kind)
        }
    }

    fn push_handshake(&mut self, msg: HandshakeMessage) {
        let mut t = Transmit::control(FrameHeader {
            // Handshake frames always use the frozen version-1 header so that any peer can read
            // them and answer, if need be, with a version-mismatch rejection.
            version: crate::wire::HANDSHAKE_WIRE_VERSION,
            ..self.control_header(msg.kind())
        });
        // Cannot fail: the inline buffer holds MAX_HANDSHAKE_LEN, the largest message.
        t.payload_len = msg.encode(&mut t.payload).unwrap_or(0);
        t.header.payload_len = t.payload_len as u64;
        self.transmits.push_back(t);
    }

    fn drop_frame(&mut self, reason: DropReason) -> Received {
        match reason {
            DropReason::StaleIncarnation => self.stats.dropped_stale += 1,
            DropReason::NotReady => self.stats.dropped_not_ready += 1,
            DropReason::Malformed => self.stats.dropped_malformed += 1,
            _ => self.stats.dropped_other += 1,
        }
        Received::Dropped(reason)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use crate::handshake::PreSharedKey;
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
        let mut c = Connection::client(cfg(1), NodeId::new(2), seeds(1));
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
        assert_eq!(h.dst_shard, c.remote_shard());
        assert_eq!(
            c.remote_shard(),
            ShardMap::new(2).unwrap().owner_of(NodeId::new(1))
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
            Received::Dropped(DropReason::Unexpected)
        );
        assert_eq!(s.stats().delivered, 1);
        assert_eq!(s.stats().dropped_stale, 1);
        assert_eq!(s.stats().dropped_malformed, 1);
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
        let mut c = Connection::client(cfg(1), NodeId::new(2), seeds(3));
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
        let mut c2 = Connection::client(cfg(1), NodeId::new(2), seeds(9));
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

    #[test]
    fn transport_error_and_attempt_limit() {
        let mut cf = cfg(1);
        cf.max_reconnect_attempts = Some(1);
        let now = Timestamp::ZERO;
        let mut c = Connection::client(cf, NodeId::new(2), seeds(1));
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
}
