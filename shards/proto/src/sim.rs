//! A deterministic network simulator for protocol tests.
//!
//! [`Sim`] runs N nodes in virtual time. Each node holds one real [`Connection`] per *rail* it
//! has to a peer (a pair of shards, see [`crate::Rails`]), plus a small RPC layer built from this
//! crate's own parts ([`PendingTable`] on the caller, [`DedupWindow`] on the callee). Frames are
//! really encoded to bytes, carried by a lossy network model and decoded again, so the wire
//! format is exercised too. A frame travels on its rail's endpoint: it reaches the connection of
//! that rail on the other node whatever its header says, as with UCX endpoints, so the
//! connection's own shard checks are what stands between a misaddressed frame and the
//! application.
//!
//! # The net layer
//!
//! Each node plays the net layer's part: [`Sim::connect`] opens the *primary* of a node pair on
//! rail (0, 0) (a pre-shared-key handshake; its server connection exists before the hello
//! arrives, as if the server had been told to expect it). When a primary becomes ready, both
//! nodes record its session ([`PeerInfo`] and [`SessionSecret`]) in their node-wide session
//! table ([`SimNode::session`]). [`Sim::join`] opens another rail by joining that session. A
//! frame arriving on a rail with no connection (or one that has failed or closed) is handled as
//! a net layer must: a `Hello` gets a new [`Connection::server`]; a `Join` is decoded, its
//! node's session looked up by node id, and a [`Connection::join_server`] made with it (the
//! connection checks the incarnations, the rail and the proof itself), or, with no session, the
//! join is answered with [`Connection::refuse`] ([`RejectReason::UnknownSession`]); anything
//! else is dropped ([`NetStats::unrouted`]).
//!
//! A `Hello` that a ready connection declines ([`crate::conn::DropReason::Opening`]: a restarted
//! or reconnecting peer, or anyone naming it) gets a *pending opening* beside it, a
//! [`Connection::server_beside`] ([`SimNode::pending_opening`]), as the net layer does: the
//! `Hello`s and `Confirm`s of that rail go to it, every other frame to the ready connection.
//! When it is ready it replaces the ready connection, which is reported as
//! [`Event::Failed`] with [`FailReason::SessionReplaced`] (its calls fail); when it fails it is
//! dropped ([`NetStats::pending_failed`]) and the ready connection never noticed.
//!
//! The network model ([`NetConfig`]) delays each frame by a uniform latency, loses it with some
//! probability, duplicates it with some probability, and with some probability adds extra delay
//! so it overtakes or is overtaken (reordering). Partitions cut a pair of nodes in both directions,
//! including frames already in flight. Nodes can crash and restart with a new incarnation.
//!
//! Everything random comes from one [`Rng`] seeded at construction, and all iteration is in a
//! fixed order, so a run is a pure function of its seed and inputs: a failing seed reproduces.
//!
//! # The RPC layer
//!
//! [`Sim::call`] (on the primary) or [`Sim::call_on`] (on any rail) sends an `RpcRequest`
//! carrying a `u64` argument with a deadline, on one rail, and the callee answers on the rail it
//! arrived on. Until it
//! completes the caller retransmits it every [`RpcConfig::retry_interval`] under the same request
//! id (the function is *not* idempotent: the callee's dedup window must prevent a second
//! execution). The callee executes `arg * 2 + 1`, caches the reply, and answers duplicates from
//! the cache. Each call ends in exactly one [`RpcOutcome`]: a reply, a refusal, expiry at its
//! deadline, or failure of its connection.

use crate::conn::{ConnConfig, Connection, DropReason, Event, FailReason, Received, Seeds, State};
use crate::handshake::{HandshakeMessage, PeerInfo, RejectReason, SessionSecret};
use crate::ids::{Incarnation, NodeId, ReqId, ShardId};
use crate::rails::Rail;
use crate::request::{DedupKey, DedupVerdict, DedupWindow, PendingTable};
use crate::rng::Rng;
use crate::time::Timestamp;
use crate::wire::{decode_frame, encode_frame, FrameHeader, FrameKind, Limits};
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;
use thiserror::Error;

/// Network behaviour.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NetConfig {
    /// Smallest one-way latency.
    pub latency_min: Duration,
    /// Largest one-way latency (before reordering delay).
    pub latency_max: Duration,
    /// Probability that a frame is lost.
    pub loss: f64,
    /// Probability that a frame is delivered twice.
    pub duplicate: f64,
    /// Probability that a frame gets up to `reorder_delay` of extra delay.
    pub reorder: f64,
    /// The most extra delay a reordered frame gets.
    pub reorder_delay: Duration,
}

/// The simulated RPC layer's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcConfig {
    /// Time between retransmissions of an unanswered request.
    pub retry_interval: Duration,
    /// Dedup window capacity (requests).
    pub dedup_entries: usize,
    /// Dedup window age.
    pub dedup_age: Duration,
}

/// Something a connection reported, with when and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimEvent {
    /// When.
    pub at: Timestamp,
    /// The node whose connection reported it.
    pub node: usize,
    /// The peer node (index) of that connection.
    pub peer: usize,
    /// The connection's rail, from `node`'s side.
    pub rail: Rail,
    /// What.
    pub event: Event,
}

/// How a call ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RpcResult {
    /// The callee's reply.
    Reply(u64),
    /// The callee refused it (expired on arrival, or too old for its dedup window).
    Refused,
    /// The deadline passed.
    Expired,
    /// The connection failed (or the caller crashed) first.
    ConnectionLost,
}

/// One finished call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RpcOutcome {
    /// Calling node.
    pub node: usize,
    /// Called node.
    pub peer: usize,
    /// The rail it was sent on, from the calling node's side.
    pub rail: Rail,
    /// Request id (unique per calling node incarnation).
    pub req_id: ReqId,
    /// The caller's incarnation.
    pub incarnation: Incarnation,
    /// The argument.
    pub arg: u64,
    /// When it was issued.
    pub issued: Timestamp,
    /// Its deadline.
    pub deadline: Timestamp,
    /// When it ended.
    pub at: Timestamp,
    /// How.
    pub result: RpcResult,
}

/// Network counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NetStats {
    /// Frames handed to the network.
    pub sent: u64,
    /// Frames delivered to a node.
    pub delivered: u64,
    /// Frames lost at random.
    pub lost: u64,
    /// Extra copies created.
    pub duplicated: u64,
    /// Frames dropped by a partition or a crashed node.
    pub cut: u64,
    /// Frames that did not decode.
    pub malformed: u64,
    /// Frames that arrived on a rail with no connection and opened none.
    pub unrouted: u64,
    /// Pending openings made beside a ready connection (see the module docs).
    pub pending_opened: u64,
    /// Pending openings that failed (their handshake did, or timed out) and were dropped.
    pub pending_failed: u64,
}

/// Simulator errors.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum SimError {
    /// Time stopped advancing (a state machine keeps asking to be woken at the same instant).
    #[error("livelock at {at:?}")]
    Livelock {
        /// The instant.
        at: Timestamp,
    },
    /// No such node.
    #[error("no node {node}")]
    NoSuchNode {
        /// The index given.
        node: usize,
    },
    /// The node holds no session with the peer to join.
    #[error("node {node} has no session with node {peer}")]
    NoSession {
        /// The joining node.
        node: usize,
        /// The peer.
        peer: usize,
    },
}

#[derive(Clone, Debug)]
struct Packet {
    from: usize,
    to: usize,
    /// The rail's endpoint it travels on, from the sender's side.
    rail: Rail,
    bytes: Vec<u8>,
}

#[derive(Clone, Copy, Debug)]
struct PendingCall {
    peer: usize,
    rail: Rail,
    arg: u64,
    issued: Timestamp,
    next_send: Timestamp,
}

/// One simulated node.
#[derive(Clone, Debug)]
pub struct SimNode {
    id: NodeId,
    incarnation: Incarnation,
    cfg: ConnConfig,
    up: bool,
    dials: BTreeSet<usize>,
    accepts: BTreeSet<usize>,
    /// Connections by (peer index, rail from this node's side).
    conns: BTreeMap<(usize, Rail), Connection>,
    /// Pending openings beside ready connections, by the same key (see the module docs).
    beside: BTreeMap<(usize, Rail), Connection>,
    /// The node-wide session table: peer node id → the session's peer and secret.
    sessions: BTreeMap<NodeId, (PeerInfo, SessionSecret)>,
    pending: PendingTable<PendingCall>,
    dedup: DedupWindow<u64>,
    executions: HashMap<DedupKey, u32>,
}

/// The simulator. See the module docs.
#[derive(Clone, Debug)]
pub struct Sim {
    now: Timestamp,
    rng: Rng,
    net: NetConfig,
    rpc: RpcConfig,
    limits: Limits,
    nodes: Vec<SimNode>,
    in_flight: BTreeMap<(Timestamp, u64), Packet>,
    seq: u64,
    cuts: BTreeSet<(usize, usize)>,
    rail_cuts: BTreeSet<((usize, ShardId), (usize, ShardId))>,
    events: Vec<SimEvent>,
    outcomes: Vec<RpcOutcome>,
    stats: NetStats,
}

impl Default for NetConfig {
    /// 50–150 µs latency, no loss, duplication or reordering.
    fn default() -> NetConfig {
        NetConfig {
            latency_min: Duration::from_micros(50),
            latency_max: Duration::from_micros(150),
            loss: 0.0,
            duplicate: 0.0,
            reorder: 0.0,
            reorder_delay: Duration::from_millis(1),
        }
    }
}

impl Default for RpcConfig {
    /// Retry every 20 ms; remember 10,000 requests for 10 s.
    fn default() -> RpcConfig {
        RpcConfig {
            retry_interval: Duration::from_millis(20),
            dedup_entries: 10_000,
            dedup_age: Duration::from_secs(10),
        }
    }
}

impl SimNode {
    /// The node's connection settings on shard `shard`.
    fn cfg_on(&self, shard: ShardId) -> ConnConfig {
        ConnConfig {
            local_shard: shard,
            ..self.cfg.clone()
        }
    }

    /// The node's id.
    pub fn id(&self) -> NodeId {
        self.id
    }

    /// The node's current incarnation.
    pub fn incarnation(&self) -> Incarnation {
        self.incarnation
    }

    /// Whether the node is running.
    pub fn is_up(&self) -> bool {
        self.up
    }

    /// The primary connection to `peer` (rail (0, 0)), if linked.
    pub fn conn(&self, peer: usize) -> Option<&Connection> {
        self.conns.get(&(peer, PRIMARY))
    }

    /// The connection to `peer` on `rail` (this node's side), if any.
    pub fn rail(&self, peer: usize, rail: Rail) -> Option<&Connection> {
        self.conns.get(&(peer, rail))
    }

    /// Every connection to `peer`, by rail, in rail order.
    pub fn rails(&self, peer: usize) -> impl Iterator<Item = (Rail, &Connection)> + '_ {
        self.conns
            .range((peer, MIN_RAIL)..=(peer, MAX_RAIL))
            .map(|((_, rail), c)| (*rail, c))
    }

    /// The pending opening beside this node's connection to `peer` on `rail`, if any.
    pub fn pending_opening(&self, peer: usize, rail: Rail) -> Option<&Connection> {
        self.beside.get(&(peer, rail))
    }

    /// The session this node holds with node `peer_id`, from its session table.
    pub fn session(&self, peer_id: NodeId) -> Option<&(PeerInfo, SessionSecret)> {
        self.sessions.get(&peer_id)
    }

    /// How many times this node executed each request it received.
    pub fn executions(&self) -> &HashMap<DedupKey, u32> {
        &self.executions
    }

    /// Calls still pending.
    pub fn pending_calls(&self) -> usize {
        self.pending.len()
    }
}

/// The rail of every primary the simulator opens.
const PRIMARY: Rail = Rail {
    local: ShardId::new(0),
    remote: ShardId::new(0),
};
const MIN_RAIL: Rail = PRIMARY;
const MAX_RAIL: Rail = Rail {
    local: ShardId::new(u16::MAX),
    remote: ShardId::new(u16::MAX),
};

impl Sim {
    /// A simulator with no nodes at time zero.
    pub fn new(seed: u64, net: NetConfig, rpc: RpcConfig) -> Sim {
        Sim {
            now: Timestamp::ZERO,
            rng: Rng::new(seed),
            net,
            rpc,
            limits: Limits::default(),
            nodes: Vec::new(),
            in_flight: BTreeMap::new(),
            seq: 0,
            cuts: BTreeSet::new(),
            rail_cuts: BTreeSet::new(),
            events: Vec::new(),
            outcomes: Vec::new(),
            stats: NetStats::default(),
        }
    }

    /// Adds a node with the given connection settings (its identity is `cfg.handshake.node_id`
    /// and `cfg.handshake.incarnation`); returns its index.
    pub fn add_node(&mut self, cfg: ConnConfig) -> usize {
        self.nodes.push(SimNode {
            id: cfg.handshake.node_id,
            incarnation: cfg.handshake.incarnation,
            cfg,
            up: true,
            dials: BTreeSet::new(),
            accepts: BTreeSet::new(),
            conns: BTreeMap::new(),
            beside: BTreeMap::new(),
            sessions: BTreeMap::new(),
            pending: PendingTable::new(),
            dedup: DedupWindow::new(self.rpc.dedup_entries, self.rpc.dedup_age),
            executions: HashMap::new(),
        });
        self.nodes.len() - 1
    }

    /// Links `client` to `server` with a primary on rail (0, 0): the client dials now, the
    /// server waits for its hello.
    pub fn connect(&mut self, client: usize, server: usize) -> Result<(), SimError> {
        self.check(client)?;
        self.check(server)?;
        self.nodes[client].dials.insert(server);
        self.nodes[server].accepts.insert(client);
        self.open_server(server, client);
        self.open_client(client, server);
        Ok(())
    }

    /// Joins rail `rail` (`client`'s side) from `client` to `server` to the session `client`
    /// holds with `server` (from a ready primary). The join client replaces any connection
    /// `client` had on that rail.
    pub fn join(&mut self, client: usize, server: usize, rail: Rail) -> Result<(), SimError> {
        self.check(client)?;
        self.check(server)?;
        let server_id = self.nodes[server].id;
        let Some((peer, secret)) = self.nodes[client].sessions.get(&server_id).cloned() else {
            return Err(SimError::NoSession {
                node: client,
                peer: server,
            });
        };
        self.join_with(client, server, rail, peer, secret)
    }

    /// [`Sim::join`] with a session given by the caller (a stale or forged one, say).
    pub fn join_with(
        &mut self,
        client: usize,
        server: usize,
        rail: Rail,
        session_peer: PeerInfo,
        secret: SessionSecret,
    ) -> Result<(), SimError> {
        self.check(client)?;
        self.check(server)?;
        let seeds = self.seeds();
        let now = self.now;
        let n = &mut self.nodes[client];
        let cfg = ConnConfig {
            local_shard: rail.local,
            ..n.cfg.clone()
        };
        let mut conn = Connection::join_client(cfg, session_peer, secret, rail.remote, seeds);
        // A fresh client connection is Idle, so connect cannot fail.
        let _ = conn.connect(now);
        n.conns.insert((server, rail), conn);
        self.flush(client);
        Ok(())
    }

    /// Closes `node`'s connection to `peer` on `rail` (sending `Close` if it is up).
    pub fn close_rail(&mut self, node: usize, peer: usize, rail: Rail) -> Result<(), SimError> {
        self.check(node)?;
        let now = self.now;
        if let Some(c) = self.nodes[node].conns.get_mut(&(peer, rail)) {
            c.close(now);
        }
        self.flush(node);
        Ok(())
    }

    /// Sends raw `bytes` from `from` to `to` on the endpoint of `rail` (`from`'s side), as a
    /// faulty or malicious peer could.
    pub fn inject(&mut self, from: usize, to: usize, rail: Rail, bytes: Vec<u8>) {
        self.send_bytes(from, to, rail, bytes);
    }

    /// The current virtual time.
    pub fn now(&self) -> Timestamp {
        self.now
    }

    /// A node.
    ///
    /// # Panics
    ///
    /// If `i` is not an index returned by [`Sim::add_node`] (this is test support).
    pub fn node(&self, i: usize) -> &SimNode {
        &self.nodes[i]
    }

    /// Every connection event so far.
    pub fn events(&self) -> &[SimEvent] {
        &self.events
    }

    /// Every finished call so far.
    pub fn outcomes(&self) -> &[RpcOutcome] {
        &self.outcomes
    }

    /// Network counters.
    pub fn net_stats(&self) -> NetStats {
        self.stats
    }

    /// Changes the network behaviour from now on.
    pub fn set_net(&mut self, net: NetConfig) {
        self.net = net;
    }

    /// Cuts `a` and `b` apart (both directions, frames in flight included).
    pub fn partition(&mut self, a: usize, b: usize) {
        self.cuts.insert((a.min(b), a.max(b)));
    }

    /// Heals a partition.
    pub fn heal(&mut self, a: usize, b: usize) {
        self.cuts.remove(&(a.min(b), a.max(b)));
    }

    /// Cuts one rail: between shard `rail.local` of `a` and shard `rail.remote` of `b`, both
    /// directions, frames in flight included. The pair's other rails are unaffected.
    pub fn cut_rail(&mut self, a: usize, b: usize, rail: Rail) {
        self.rail_cuts.insert(rail_cut(a, b, rail));
    }

    /// Heals a rail cut.
    pub fn heal_rail(&mut self, a: usize, b: usize, rail: Rail) {
        self.rail_cuts.remove(&rail_cut(a, b, rail));
    }

    /// Stops a node: its state is lost, its pending calls end as [`RpcResult::ConnectionLost`],
    /// frames to it are dropped.
    pub fn crash(&mut self, i: usize) -> Result<(), SimError> {
        self.check(i)?;
        let now = self.now;
        let node = &mut self.nodes[i];
        node.up = false;
        node.conns.clear();
        node.beside.clear();
        node.sessions.clear();
        let incarnation = node.incarnation;
        for (req_id, call) in node.pending.drain() {
            self.outcomes.push(RpcOutcome {
                node: i,
                peer: call.peer,
                rail: call.rail,
                req_id,
                incarnation,
                arg: call.arg,
                issued: call.issued,
                deadline: Timestamp::MAX,
                at: now,
                result: RpcResult::ConnectionLost,
            });
        }
        Ok(())
    }

    /// Starts a crashed (or running) node again with the next incarnation and fresh state; it
    /// re-dials the peers it dialled and waits for those that dialled it.
    pub fn restart(&mut self, i: usize) -> Result<(), SimError> {
        if self.nodes.get(i).is_some_and(|n| n.up) {
            self.crash(i)?;
        }
        self.check(i)?;
        let node = &mut self.nodes[i];
        node.incarnation = node.incarnation.next();
        node.cfg.handshake.incarnation = node.incarnation;
        node.up = true;
        node.pending = PendingTable::new();
        node.dedup = DedupWindow::new(self.rpc.dedup_entries, self.rpc.dedup_age);
        let accepts: Vec<usize> = node.accepts.iter().copied().collect();
        let dials: Vec<usize> = node.dials.iter().copied().collect();
        for peer in accepts {
            self.open_server(i, peer);
        }
        for peer in dials {
            self.open_client(i, peer);
        }
        Ok(())
    }

    /// Issues a call from `node` to `peer` with `timeout` on the primary. Returns `None`
    /// (nothing sent) when the connection is not ready.
    pub fn call(&mut self, node: usize, peer: usize, arg: u64, timeout: Duration) -> Option<ReqId> {
        self.call_on(node, peer, PRIMARY, arg, timeout)
    }

    /// Issues a call from `node` to `peer` with `timeout` on `rail` (`node`'s side). Returns
    /// `None` (nothing sent) when that rail's connection is not ready.
    pub fn call_on(
        &mut self,
        node: usize,
        peer: usize,
        rail: Rail,
        arg: u64,
        timeout: Duration,
    ) -> Option<ReqId> {
        let now = self.now;
        let n = self.nodes.get_mut(node)?;
        if !n.up || n.conns.get(&(peer, rail)).map(Connection::state) != Some(State::Ready) {
            return None;
        }
        let deadline = now.saturating_add(timeout);
        let call = PendingCall {
            peer,
            rail,
            arg,
            issued: now,
            next_send: now,
        };
        let id = n.pending.insert(deadline, call);
        self.send_request(node, id);
        Some(id)
    }

    /// Runs until virtual time `until` (inclusive), processing everything due.
    pub fn run_until(&mut self, until: Timestamp) -> Result<(), SimError> {
        let mut same_instant = 0u32;
        loop {
            let next = match self.next_wakeup() {
                Some(t) if t <= until => t.max(self.now),
                _ => {
                    self.now = self.now.max(until);
                    return Ok(());
                }
            };
            if next == self.now {
                same_instant += 1;
                if same_instant > 100_000 {
                    return Err(SimError::Livelock { at: next });
                }
            } else {
                same_instant = 0;
            }
            self.now = next;
            self.step();
        }
    }

    /// Runs for `d` of virtual time.
    pub fn run_for(&mut self, d: Duration) -> Result<(), SimError> {
        self.run_until(self.now.saturating_add(d))
    }

    fn check(&self, i: usize) -> Result<(), SimError> {
        if i < self.nodes.len() {
            Ok(())
        } else {
            Err(SimError::NoSuchNode { node: i })
        }
    }

    fn seeds(&mut self) -> Seeds {
        let mut nonce = [0u8; 32];
        self.rng.fill_bytes(&mut nonce);
        Seeds {
            rng: self.rng.next_u64(),
            nonce,
        }
    }

    fn open_server(&mut self, node: usize, peer: usize) {
        let seeds = self.seeds();
        let now = self.now;
        let n = &mut self.nodes[node];
        let conn = Connection::server(now, n.cfg_on(PRIMARY.local), seeds);
        n.conns.insert((peer, PRIMARY), conn);
    }

    fn open_client(&mut self, node: usize, peer: usize) {
        let seeds = self.seeds();
        let now = self.now;
        let peer_id = self.nodes[peer].id;
        let n = &mut self.nodes[node];
        let mut conn = Connection::client(n.cfg_on(PRIMARY.local), peer_id, PRIMARY.remote, seeds);
        // A fresh client connection is Idle, so connect cannot fail.
        let _ = conn.connect(now);
        n.conns.insert((peer, PRIMARY), conn);
        self.flush(node);
    }

    /// The net layer's part for a frame that arrived on a rail with no usable connection (none,
    /// or one that failed or closed): a hello opens a server, a join a join server on the
    /// node's session with its sender (or is refused), anything else is dropped.
    fn accept(
        &mut self,
        node: usize,
        from: usize,
        rail: Rail,
        header: &FrameHeader,
        payload: &[u8],
    ) {
        let now = self.now;
        let msg = HandshakeMessage::decode(header.kind, payload);
        let session = match &msg {
            Ok(HandshakeMessage::Hello(_)) => None,
            Ok(HandshakeMessage::Join(join)) => {
                match self.nodes[node].sessions.get(&join.node_id).cloned() {
                    Some(s) => Some(s),
                    None => {
                        let cfg = self.nodes[node].cfg_on(rail.local);
                        if let Some(t) = msg.as_ref().ok().and_then(|m| {
                            Connection::refuse(&cfg, header, m, RejectReason::UnknownSession)
                        }) {
                            self.send_bytes(node, from, rail, t.to_vec());
                        }
                        return;
                    }
                }
            }
            _ => {
                self.stats.unrouted += 1;
                return;
            }
        };
        let seeds = self.seeds();
        let n = &mut self.nodes[node];
        let cfg = n.cfg_on(rail.local);
        let mut conn = match session {
            Some((peer, secret)) => Connection::join_server(now, cfg, peer, secret, seeds),
            None => Connection::server(now, cfg, seeds),
        };
        conn.handle_frame(now, header, payload);
        n.conns.insert((from, rail), conn);
        self.flush(node);
    }

    /// The net layer's part for a `Hello` that the ready connection of `rail` declined: a
    /// pending opening beside it (see the module docs), fed the `Hello`.
    fn open_beside(
        &mut self,
        node: usize,
        from: usize,
        rail: Rail,
        header: &FrameHeader,
        payload: &[u8],
    ) {
        let seeds = self.seeds();
        let now = self.now;
        let n = &mut self.nodes[node];
        let Some(ready) = n
            .conns
            .get(&(from, rail))
            .and_then(Connection::peer)
            .copied()
        else {
            return;
        };
        let mut conn = Connection::server_beside(now, n.cfg_on(rail.local), seeds, ready);
        conn.handle_frame(now, header, payload);
        n.beside.insert((from, rail), conn);
        self.stats.pending_opened += 1;
        self.flush(node);
    }

    fn next_wakeup(&mut self) -> Option<Timestamp> {
        let mut t = self.in_flight.keys().next().map(|(at, _)| *at);
        let mut consider = |x: Option<Timestamp>| {
            if let Some(x) = x {
                t = Some(t.map_or(x, |t| t.min(x)));
            }
        };
        for n in self.nodes.iter_mut().filter(|n| n.up) {
            for c in n.conns.values().chain(n.beside.values()) {
                consider(c.poll_timeout());
            }
            consider(n.pending.poll_timeout());
            consider(n.dedup.poll_timeout());
        }
        for n in self.nodes.iter().filter(|n| n.up) {
            for (_, call) in n.pending.iter() {
                consider(Some(call.next_send));
            }
        }
        t
    }

    fn step(&mut self) {
        let now = self.now;
        while let Some(entry) = self.in_flight.first_entry() {
            if entry.key().0 > now {
                break;
            }
            let p = entry.remove();
            self.deliver(p);
        }
        for i in 0..self.nodes.len() {
            if !self.nodes[i].up {
                continue;
            }
            let n = &mut self.nodes[i];
            for c in n.conns.values_mut().chain(n.beside.values_mut()) {
                if c.poll_timeout().is_some_and(|t| t <= now) {
                    c.handle_timeout(now);
                }
            }
            self.flush(i);
            let incarnation = self.nodes[i].incarnation;
            while let Some((req_id, call)) = self.nodes[i].pending.poll_expired(now) {
                self.outcomes.push(RpcOutcome {
                    node: i,
                    peer: call.peer,
                    rail: call.rail,
                    req_id,
                    incarnation,
                    arg: call.arg,
                    issued: call.issued,
                    deadline: now,
                    at: now,
                    result: RpcResult::Expired,
                });
            }
            self.nodes[i].dedup.expire(now);
            let mut due: Vec<ReqId> = self.nodes[i]
                .pending
                .iter()
                .filter(|(_, call)| call.next_send <= now)
                .map(|(id, _)| id)
                .collect();
            // The table iterates in hash order; sort so the run stays a function of the seed.
            due.sort_unstable();
            for id in due {
                self.send_request(i, id);
            }
        }
    }

    fn send_request(&mut self, node: usize, id: ReqId) {
        let now = self.now;
        let retry = self.rpc.retry_interval;
        let n = &mut self.nodes[node];
        let Some(deadline) = n.pending.deadline(id) else {
            return;
        };
        let Some(call) = n.pending.get(id).copied() else {
            return;
        };
        // Reschedule first, so a call whose connection is not ready waits for the next retry.
        if let Some(c) = n.pending.get_mut(id) {
            c.next_send = now.saturating_add(retry);
        }
        let Some(conn) = n.conns.get(&(call.peer, call.rail)) else {
            return;
        };
        let Ok(header) = conn.frame_header(FrameKind::RpcRequest) else {
            return;
        };
        let header = FrameHeader {
            req_id: id,
            ..header.with_deadline(now, deadline)
        };
        self.send_app(node, call.peer, call.rail, header, &call.arg.to_le_bytes());
    }

    fn send_app(
        &mut self,
        node: usize,
        peer: usize,
        rail: Rail,
        header: FrameHeader,
        payload: &[u8],
    ) {
        let mut buf = vec![0u8; crate::wire::payload_offset() + payload.len()];
        if encode_frame(&header, payload, &mut buf, &self.limits).is_ok() {
            self.send_bytes(node, peer, rail, buf);
        }
    }

    fn is_cut(&self, from: usize, to: usize, rail: Rail) -> bool {
        self.cuts.contains(&(from.min(to), from.max(to)))
            || self.rail_cuts.contains(&rail_cut(from, to, rail))
    }

    fn send_bytes(&mut self, from: usize, to: usize, rail: Rail, bytes: Vec<u8>) {
        self.stats.sent += 1;
        if self.is_cut(from, to, rail) {
            self.stats.cut += 1;
            return;
        }
        if self.rng.gen_bool(self.net.loss) {
            self.stats.lost += 1;
            return;
        }
        let copies = if self.rng.gen_bool(self.net.duplicate) {
            self.stats.duplicated += 1;
            2
        } else {
            1
        };
        for _ in 0..copies {
            let mut delay = self
                .rng
                .duration_between(self.net.latency_min, self.net.latency_max);
            if self.rng.gen_bool(self.net.reorder) {
                delay += self
                    .rng
                    .duration_between(Duration::ZERO, self.net.reorder_delay);
            }
            self.seq += 1;
            let at = self.now.saturating_add(delay);
            self.in_flight.insert(
                (at, self.seq),
                Packet {
                    from,
                    to,
                    rail,
                    bytes: bytes.clone(),
                },
            );
        }
    }

    fn deliver(&mut self, p: Packet) {
        let now = self.now;
        if self.is_cut(p.from, p.to, p.rail) || !self.nodes[p.to].up {
            self.stats.cut += 1;
            return;
        }
        let (header, payload) = match decode_frame(&p.bytes, &self.limits) {
            Ok((h, pl)) => (h, pl.to_vec()),
            Err(_) => {
                self.stats.malformed += 1;
                return;
            }
        };
        self.stats.delivered += 1;
        // The receiving side of the rail's endpoint.
        let rail = p.rail.mirror();
        let usable = self.nodes[p.to]
            .conns
            .get(&(p.from, rail))
            .is_some_and(|c| !matches!(c.state(), State::Failed | State::Closed));
        let opening = matches!(header.kind, FrameKind::Hello | FrameKind::Join);
        if !usable && (opening || !self.nodes[p.to].conns.contains_key(&(p.from, rail))) {
            self.accept(p.to, p.from, rail, &header, &payload);
            return;
        }
        // The rest of a handshake beside a ready connection goes to its pending opening.
        if matches!(header.kind, FrameKind::Hello | FrameKind::Confirm) {
            if let Some(pending) = self.nodes[p.to].beside.get_mut(&(p.from, rail)) {
                pending.handle_frame(now, &header, &payload);
                self.flush(p.to);
                return;
            }
        }
        let Some(conn) = self.nodes[p.to].conns.get_mut(&(p.from, rail)) else {
            return;
        };
        let received = conn.handle_frame(now, &header, &payload);
        if received == Received::Dropped(DropReason::Opening) {
            self.open_beside(p.to, p.from, rail, &header, &payload);
            return;
        }
        let peer_id = conn.peer().map(|info| info.node_id);
        self.flush(p.to);
        if received == Received::Deliver {
            if let Some(peer_id) = peer_id {
                self.on_app_frame(p.to, p.from, rail, peer_id, &header, &payload);
            }
        }
    }

    fn on_app_frame(
        &mut self,
        node: usize,
        from: usize,
        rail: Rail,
        peer_id: NodeId,
        header: &FrameHeader,
        payload: &[u8],
    ) {
        let now = self.now;
        match header.kind {
            FrameKind::RpcRequest => {
                let reply_header = |n: &SimNode, kind| {
                    n.conns
                        .get(&(from, rail))
                        .and_then(|c| c.frame_header(kind).ok())
                        .map(|h| FrameHeader {
                            req_id: header.req_id,
                            ..h
                        })
                };
                let n = &mut self.nodes[node];
                let Ok(arg_bytes) = <[u8; 8]>::try_from(payload) else {
                    if let Some(h) = reply_header(n, FrameKind::RpcError) {
                        self.send_app(node, from, rail, h, &[]);
                    }
                    return;
                };
                let key = DedupKey {
                    node: peer_id,
                    incarnation: header.incarnation,
                    shard: header.src_shard,
                    req_id: header.req_id,
                };
                let reply = match n.dedup.check_and_insert(now, key) {
                    DedupVerdict::Fresh if header.ttl_ns == 0 => {
                        n.dedup.complete(key, u64::MAX);
                        None
                    }
                    DedupVerdict::Fresh => {
                        *n.executions.entry(key).or_insert(0) += 1;
                        let r = u64::from_le_bytes(arg_bytes)
                            .wrapping_mul(2)
                            .wrapping_add(1);
                        n.dedup.complete(key, r);
                        Some(r)
                    }
                    DedupVerdict::Done(r) if *r != u64::MAX => Some(*r),
                    DedupVerdict::InProgress => return,
                    DedupVerdict::Done(_) | DedupVerdict::TooOld => None,
                };
                match reply {
                    Some(r) => {
                        if let Some(h) = reply_header(n, FrameKind::RpcResponse) {
                            self.send_app(node, from, rail, h, &r.to_le_bytes());
                        }
                    }
                    None => {
                        if let Some(h) = reply_header(n, FrameKind::RpcError) {
                            self.send_app(node, from, rail, h, &[]);
                        }
                    }
                }
            }
            FrameKind::RpcResponse | FrameKind::RpcError => {
                let n = &mut self.nodes[node];
                let deadline = n.pending.deadline(header.req_id).unwrap_or(now);
                let Some(call) = n.pending.complete(header.req_id) else {
                    return;
                };
                let result = match <[u8; 8]>::try_from(payload) {
                    Ok(b) if header.kind == FrameKind::RpcResponse => {
                        RpcResult::Reply(u64::from_le_bytes(b))
                    }
                    _ => RpcResult::Refused,
                };
                self.outcomes.push(RpcOutcome {
                    node,
                    peer: call.peer,
                    rail: call.rail,
                    req_id: header.req_id,
                    incarnation: n.incarnation,
                    arg: call.arg,
                    issued: call.issued,
                    deadline,
                    at: now,
                    result,
                });
            }
            _ => {}
        }
    }

    /// Moves every queued transmit of `node` onto the network and records its events; a primary
    /// that becomes ready enters its session in the node's session table.
    fn flush(&mut self, node: usize) {
        let now = self.now;
        let keys: Vec<(usize, Rail)> = self.nodes[node].conns.keys().copied().collect();
        for (peer, rail) in keys {
            while let Some(conn) = self.nodes[node].conns.get_mut(&(peer, rail)) {
                if let Some(t) = conn.poll_transmit() {
                    self.send_bytes(node, peer, rail, t.to_vec());
                    continue;
                }
                let Some(event) = conn.poll_event() else {
                    break;
                };
                match &event {
                    Event::Failed { .. } => self.fail_calls(node, peer, rail),
                    Event::Connected(info) => {
                        if let Some(secret) = conn.session_secret().cloned() {
                            self.nodes[node]
                                .sessions
                                .insert(info.node_id, (*info, secret));
                        }
                    }
                    _ => {}
                }
                self.events.push(SimEvent {
                    at: now,
                    node,
                    peer,
                    rail,
                    event,
                });
            }
        }
        self.flush_beside(node);
    }

    /// [`Sim::flush`] for the pending openings of `node`: one that is ready replaces the
    /// connection it was opened beside, one that failed is dropped.
    fn flush_beside(&mut self, node: usize) {
        let now = self.now;
        let keys: Vec<(usize, Rail)> = self.nodes[node].beside.keys().copied().collect();
        for (peer, rail) in keys {
            while let Some(conn) = self.nodes[node].beside.get_mut(&(peer, rail)) {
                if let Some(t) = conn.poll_transmit() {
                    self.send_bytes(node, peer, rail, t.to_vec());
                    continue;
                }
                let Some(event) = conn.poll_event() else {
                    break;
                };
                let record = |sim: &mut Sim, event| {
                    sim.events.push(SimEvent {
                        at: now,
                        node,
                        peer,
                        rail,
                        event,
                    });
                };
                match event {
                    Event::Connected(info) => {
                        if let Some(secret) = conn.session_secret().cloned() {
                            self.nodes[node]
                                .sessions
                                .insert(info.node_id, (info, secret));
                        }
                        // The connection it was opened beside ends here.
                        self.fail_calls(node, peer, rail);
                        record(
                            self,
                            Event::Failed {
                                reason: FailReason::SessionReplaced,
                            },
                        );
                        record(self, Event::Connected(info));
                        let n = &mut self.nodes[node];
                        if let Some(up) = n.beside.remove(&(peer, rail)) {
                            n.conns.insert((peer, rail), up);
                        }
                    }
                    Event::Failed { .. } => {
                        record(self, event);
                        self.nodes[node].beside.remove(&(peer, rail));
                        self.stats.pending_failed += 1;
                    }
                    other => record(self, other),
                }
            }
        }
        // A promoted connection's outputs after its `Connected`, if any, go out with the
        // connections' at the next flush.
    }

    fn fail_calls(&mut self, node: usize, peer: usize, rail: Rail) {
        let now = self.now;
        let n = &mut self.nodes[node];
        for (id, call) in n
            .pending
            .drain_where(|_, c| c.peer == peer && c.rail == rail)
        {
            self.outcomes.push(RpcOutcome {
                node,
                peer,
                rail,
                req_id: id,
                incarnation: n.incarnation,
                arg: call.arg,
                issued: call.issued,
                deadline: Timestamp::MAX,
                at: now,
                result: RpcResult::ConnectionLost,
            });
        }
    }
}

/// The key of a cut rail: both ends, (node, shard), in order.
fn rail_cut(a: usize, b: usize, rail: Rail) -> ((usize, ShardId), (usize, ShardId)) {
    let (x, y) = ((a, rail.local), (b, rail.remote));
    (x.min(y), x.max(y))
}
