//! Sessions and rails: the connections of each shard to each remote shard it is paired with,
//! the handshakes that authenticate them (one per node pair, joined by every other rail), the
//! timers that drive them, and what happens when one ends.
//!
//! ## Rails
//!
//! Between a node of `N` shards and one of `M`, the rails are proto's [`Rails`]: the pairs
//! `(k mod N, k mod M)` for `k` in `0..max(N, M)`, the same set seen from both sides. Each rail
//! is one UCX endpoint in each direction between the two shards' own workers and one
//! [`Connection`] on each side, with its own heartbeats; frames on it never cross a shard.
//! Local shard `i` always has the rail `(i, i mod M)`, its *default rail* to that node: a call
//! with no explicit target goes out on it, and the answer comes back on it, with no hop on
//! either side. A call for remote shard `j` goes on the rail `(i, j)` when local shard `i` has
//! it, else it is forwarded to the local shard `j mod N`, which has.
//!
//! ## One authentication per node pair
//!
//! The first rail between two nodes runs proto's pre-shared-key handshake (the *primary*);
//! both sides then hold the session's secret in their node-wide session table
//! ([`SessionTable`], shared by the node's shards, touched only when rails are set up). Every
//! other rail *joins* that session with a one-round-trip proof keyed by the secret
//! (`Join`/`Joined`), so a rail from an endpoint that does not hold the session is refused
//! ([`RejectReason::UnknownSession`] when the node has no session, `BadProof` for a wrong
//! one), and a rail never outlives the incarnations it was proved for.
//!
//! ## Who sets the rails up
//!
//! [`ShardCtx::connect`](crate::ShardCtx::connect) bootstraps from the calling shard and then
//! asks local shard 0 to *establish* the node pair: shard 0 serialises establishments per
//! remote node (a second connect to the same node waits for the first), runs the primary on
//! its default rail `(0, 0)` unless the session table already holds a session with the
//! node's current incarnation, then asks every local shard (over the mesh) to make sure each
//! of its rails is up, joining the missing ones. The node that connects joins every rail;
//! the other side only answers, and then holds the same rails (it sends on them too).
//! A connect returns once every local shard has its rails, also when its own default rail was
//! up already (another shard's connect may be establishing the pair). Connecting again finds
//! the rails up and costs a bootstrap and one look per shard; a rail that failed is joined
//! again, and a node that restarted gets a new primary.
//!
//! ## Openings beside a ready rail
//!
//! A `Hello` proves nothing: anyone who can reach a shard's worker can send one naming a node
//! this shard has a ready rail with, with that node's incarnation or any other. So a ready
//! rail is never reset or replaced by a `Hello`. Its connection declines it (proto's
//! `DropReason::Opening`, or drops it as stale when it names an older incarnation than the
//! rail's peer), and the `Hello` gets a *pending opening* ([`PendingOpening`]): a
//! [`Connection::server_beside`] with its own endpoint to the worker address the `Hello`
//! carried, kept beside the rail. The rail, its heartbeats and its traffic carry on. The
//! pending opening replaces the rail only when its handshake completes (the sender proved the
//! pre-shared key: a restarted node, or one that dialled again); the rail's pending requests
//! then fail with [`NetError::Closed`], as for any replaced rail. One that fails or reaches
//! the handshake deadline is closed with its endpoint and counted
//! ([`NetStats::pending_refused`], [`NetStats::pending_expired`]); the rail never noticed.
//! Pending openings count towards the half-open cap ([`NetConfig::max_half_open`]), and the
//! shard's timer serves their deadlines.
//!
//! Which frames go where is decided by what the wire carries, the frame's kind and the
//! sender's incarnation in its header (or, for a `Hello`, in the `Hello`):
//!
//! - the rest of a pending opening's handshake goes to it: a `Hello` from the incarnation
//!   and the worker address it was opened for (a client trying again), and a `Confirm` whose
//!   header carries that incarnation (at most one pending opening per remote shard and
//!   incarnation; a `Hello` of that incarnation from another address replaces it);
//! - any other `Hello` for a ready rail opens one beside it (above);
//! - everything else goes to the rail: data frames (`DATA_AM`), heartbeats and their acks,
//!   `Close`, and the answers to a handshake this shard started (`Welcome`, `Joined`,
//!   `Reject`; a pending opening is a server and never waits for them); the rail's
//!   connection drops what does not carry its peer's incarnation;
//! - a `Join` is checked against the session (its proof) before anything is made of it, so
//!   it keeps its own path: a ready join server's connection takes one that names its peer's
//!   incarnations (a valid one replaces the session at once, a forged one is refused there),
//!   and any other is checked by [`accept_opening`], which replaces the rail only for a
//!   valid proof and refuses a forged one on an endpoint of its own.
//!
//! A rail that is not ready (a handshake under way, a failed rail) holds no session, and an
//! opening for it is handled as before: its connection takes it when it can (a server a new
//! `Hello`), else a new rail replaces it (an opening from another incarnation than the rail's
//! peer).
//!
//! [`NetStats::pending_refused`]: super::NetStats::pending_refused
//! [`NetStats::pending_expired`]: super::NetStats::pending_expired
//! [`NetConfig::max_half_open`]: super::NetConfig::max_half_open

use std::cell::Cell;
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use futures_lite::future;
use glommio::timer::{sleep, Timer};

use super::bootstrap::Directory;
use super::outbound::{self, Backlog, Outbound};
use super::request::send_cancel;
use super::{frame_am_header, opening_am_header, NetError, NetState, Queue, RemoteNode, Slot};
use crate::boot::ShardCtx;
use crate::proto::conn::{FailReason, Received};
use crate::proto::handshake::{
    accept_join, HandshakeError, HandshakeMessage, PeerInfo, RejectReason, Role,
};
use crate::proto::wire::DataTemplate;
use crate::proto::{
    ConnConfig, Connection, DataLane, Event, FrameHeader, FrameKind, Incarnation, NodeId,
    PreSharedKey, Rail, Rails, Seeds, SessionSecret, ShardId, State, Timestamp,
};
use crate::ucx::{Endpoint, ErrorMode, WorkerAddress};

type Waiter = Rc<Queue<Result<RemoteNode, NetError>>>;

/// A node's sessions with other nodes, shared by its shards: who each peer is and the secret
/// its rails are proved with. Locked only while rails are set up.
pub(crate) type SessionTable = Arc<Mutex<HashMap<NodeId, SessionRecord>>>;

/// One authenticated session (see the module docs). `Debug` shows the peer, not the secret.
#[derive(Clone)]
pub(crate) struct SessionRecord {
    pub(crate) peer: PeerInfo,
    pub(crate) secret: SessionSecret,
}

/// This shard's rails to one remote node.
pub(super) struct PeerRails {
    /// The node's shard count.
    pub(super) remote_count: u16,
    pub(super) rails: Vec<RailConn>,
    /// Openings beside ready rails (see "Openings beside a ready rail" in the module docs).
    pub(super) pending: Vec<PendingOpening>,
}

/// A `Hello` for a rail that was ready, answered on a connection and an endpoint of its own
/// ([`Connection::server_beside`]); it replaces the rail only once it is ready.
pub(super) struct PendingOpening {
    /// Its connection, sender and endpoint (to the address its `Hello` carried).
    pub(super) rail: RailConn,
    /// The incarnation its `Hello` named: the rest of its handshake carries it in the frame
    /// header.
    pub(super) incarnation: Incarnation,
    /// The worker address its `Hello` carried.
    addr: Vec<u8>,
    /// The node's shard count its `Hello` named.
    remote_count: u16,
}

/// One rail's connection on this shard.
pub(super) struct RailConn {
    /// The remote shard at the other end.
    pub(super) remote: ShardId,
    /// Read with [`RailConn::conn`]; changed through [`RailConn::conn_mut`], which keeps
    /// `tx`'s data-header template in step with the connection's state.
    conn: Connection,
    /// What a send on the rail reads, shared with the dispatch of a frame that came in on it.
    pub(super) tx: Rc<RailTx>,
    pub(super) generation: u64,
    waiters: Vec<Waiter>,
}

/// What a send on one rail reads (see "The hot path" in the module docs of [`super`]): kept
/// beside the rail's connection in an `Rc`, so that the dispatch of a frame that came in on
/// the rail hands it to the frame's handler, whose answer then goes out on the rail with no
/// lookup ([`NetState::inline_rail`](super::NetState)).
pub(super) struct RailTx {
    /// The data header of the rail's application frames ([`DataTemplate`]), present while its
    /// connection can send them (ready or draining; [`Connection::frame_header`]).
    template: Cell<Option<DataTemplate>>,
    /// This node's id, which the template starts with.
    me: NodeId,
    /// Frames for the rail's sender task, in order.
    pub(super) out: Rc<Queue<Outbound>>,
    /// The sender task's endpoint, for sends in place; it goes when the sender ends.
    pub(super) ep: Weak<Endpoint>,
    /// Bytes of application frames on this rail that UCX has not completed: queued for the
    /// sender, or posted and in flight ([`super::NetConfig::max_backlog_bytes`]).
    pub(super) backlog: Rc<Backlog>,
    /// The connection's [`DataLane`] while it is ready and its peer not suspect, kept in step
    /// with it like `template`: the dispatch of a data frame checks the frame's header against
    /// it and needs neither the peer table nor the connection ([`RailTx::admit`]).
    lane: Cell<Option<DataLane>>,
    /// The frames admitted by `lane` that the connection has not been told of yet, and when
    /// the last came: told ([`Connection::heard_data`]) before the connection is next changed
    /// ([`RailConn::conn_mut`]), so its timers see the peer heard.
    heard: Cell<(Timestamp, u64)>,
    /// Set when a send from a task that waited for room in UCX's send queue on this rail gave
    /// up ([`super::NetConfig::send_pace`]): no send waits again before then, so a stalled
    /// peer costs one wait now and then, not one per send.
    pub(super) pace_after: Cell<Option<std::time::Instant>>,
}

/// A rail's connection borrowed for a change ([`RailConn::conn_mut`]): when it is dropped, the
/// rail's data-header template is made again from the connection's state.
pub(super) struct ConnMut<'a>(&'a mut RailConn);

impl std::fmt::Debug for SessionRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRecord")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Drop for RailConn {
    fn drop(&mut self) {
        self.tx.template.set(None);
        self.tx.lane.set(None);
        self.tx.out.close();
    }
}

impl RailConn {
    /// The rail's connection.
    pub(super) fn conn(&self) -> &Connection {
        &self.conn
    }

    /// The rail's connection, to change: the data-header template follows its state when the
    /// borrow ends.
    pub(super) fn conn_mut(&mut self) -> ConnMut<'_> {
        let (at, n) = self.tx.heard.replace((Timestamp::ZERO, 0));
        self.conn.heard_data(at, n);
        ConnMut(self)
    }

    /// Feeds an application frame's header to the connection ([`Connection::handle_frame`]).
    /// Such a frame changes no connection's state (only control frames do: handshakes,
    /// heartbeats, `Close`), so the template is left as it is.
    #[inline]
    pub(super) fn data_frame(&mut self, now: Timestamp, header: &FrameHeader) -> Received {
        debug_assert!(!header.kind.is_control());
        let before = self.conn.state();
        let r = self.conn.handle_frame(now, header, &[]);
        debug_assert_eq!(before, self.conn.state());
        r
    }

    /// Makes the template again from the connection's state.
    fn refresh(&self) {
        let t = self
            .conn
            .frame_header(FrameKind::Am)
            .ok()
            .map(|h| DataTemplate::new(self.tx.me, &h));
        self.tx.template.set(t);
        self.tx.lane.set(self.conn.data_lane());
    }
}

impl RailTx {
    /// The data header of this rail's frames, or `None` when its connection cannot send them.
    #[inline]
    pub(super) fn template(&self) -> Option<DataTemplate> {
        self.template.get()
    }

    /// Whether the rail's connection delivers an application frame with `header` received
    /// at `now`, told by its [`DataLane`] (false when it has none: the caller then asks the
    /// connection); an admitted frame is noted for the connection (see `heard`).
    #[inline]
    pub(super) fn admit(&self, header: &FrameHeader, now: Timestamp) -> bool {
        match self.lane.get() {
            Some(lane) if lane.admits(header) => {
                let (at, n) = self.heard.get();
                self.heard.set((at.max(now), n + 1));
                true
            }
            _ => false,
        }
    }
}

impl std::ops::Deref for ConnMut<'_> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.0.conn
    }
}

impl std::ops::DerefMut for ConnMut<'_> {
    fn deref_mut(&mut self) -> &mut Connection {
        &mut self.0.conn
    }
}

impl Drop for ConnMut<'_> {
    fn drop(&mut self) {
        self.0.refresh();
    }
}

impl PeerRails {
    pub(super) fn get(&self, remote: ShardId) -> Option<&RailConn> {
        self.rails.iter().find(|r| r.remote == remote)
    }

    pub(super) fn get_mut(&mut self, remote: ShardId) -> Option<&mut RailConn> {
        self.rails.iter_mut().find(|r| r.remote == remote)
    }

    /// The pending opening from `remote` with `incarnation`, if any.
    pub(super) fn pending_from(
        &self,
        remote: ShardId,
        incarnation: Incarnation,
    ) -> Option<&PendingOpening> {
        self.pending
            .iter()
            .find(|q| q.rail.remote == remote && q.incarnation == incarnation)
    }

    /// The pending opening whose sender has `generation`, if any.
    pub(super) fn pending_mut(&mut self, generation: u64) -> Option<&mut PendingOpening> {
        self.pending
            .iter_mut()
            .find(|q| q.rail.generation == generation)
    }
}

impl PendingOpening {
    /// Whether its `Hello` came from the worker at `addr`.
    pub(super) fn is_from(&self, addr: &[u8]) -> bool {
        self.addr == addr
    }
}

/// The rails between this node and a node of `remote_count` shards.
pub(super) fn rails_with(ctx: &ShardCtx, remote_count: u16) -> Option<Rails> {
    Rails::new(shard_count_u16(ctx), remote_count).ok()
}

/// The remote shard this shard's calls to `node` go to when they name none: its default rail's
/// (`None` when this shard has no rail to `node`).
pub(super) fn default_remote(ctx: &ShardCtx, peer: &PeerRails) -> Option<ShardId> {
    rails_with(ctx, peer.remote_count).map(|r| r.default_remote(ctx.id()))
}

/// The first frame on a rail from a node this shard has no connection with on it: a `Hello`
/// (a new session) or a `Join` (a rail joining one this node holds), with the sender's worker
/// address. Makes the reverse endpoint and a server connection; refuses a join to no session
/// (`UnknownSession`, sent back on an endpoint of its own). Counts anything else as dropped.
pub(super) fn accept_opening(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    from: Opener<'_>,
    header: &FrameHeader,
    payload: &[u8],
) -> bool {
    let addr = from.addr;
    let msg = match HandshakeMessage::decode(header.kind, payload) {
        Ok(msg @ HandshakeMessage::Hello(_)) | Ok(msg @ HandshakeMessage::Join(_)) => msg,
        Ok(_) => {
            net.count(|s| s.dropped_unauthenticated += 1);
            return false;
        }
        Err(_) => {
            net.count(|s| s.dropped_malformed += 1);
            return false;
        }
    };
    let (claimed, count) = match &msg {
        HandshakeMessage::Hello(h) => (h.node_id, h.shard_count),
        HandshakeMessage::Join(j) => (j.node_id, j.shard_count),
        _ => return false,
    };
    if claimed != node || addr.is_empty() {
        net.count(|s| s.dropped_malformed += 1);
        return false;
    }
    let Some(psk) = net.settings.psk.clone() else {
        net.count(|s| s.dropped_unauthenticated += 1);
        return false;
    };
    if matches!(msg, HandshakeMessage::Hello(_)) && half_open(net) >= net.settings.cfg.max_half_open
    {
        // No endpoint is made for it and nothing is answered: whoever sends `Hello`s from
        // made-up nodes holds at most `max_half_open` endpoints of this shard, each until its
        // handshake deadline.
        net.count(|s| s.openings_over_cap += 1);
        return false;
    }
    let Ok(seeds) = seeds() else {
        return false;
    };
    let cfg = rail_config(ctx, net, psk);
    let Some(ep) = endpoint_to(ctx, net, from) else {
        return false;
    };
    if net.settings.bans.is_banned(node) {
        // Dropped for misbehaviour: told so at once, on an endpoint of its own.
        if let Some(t) = Connection::refuse(&cfg, header, &msg, RejectReason::Banned) {
            refuse_on(ep, frame_am_header(net.settings.node_id, 0), t.to_vec());
        }
        net.count(|s| s.refused_banned += 1);
        return false;
    }
    let conn = match &msg {
        HandshakeMessage::Join(join) => {
            let session = session_of(net, node);
            match session {
                Some(s) => {
                    // Checked before anything is made of it: a join that does not prove the
                    // session must not replace the rail this shard may hold on that pair
                    // (`insert_rail` retires the old one), nor start a sender. It is refused
                    // on an endpoint of its own, as a join to no session is.
                    let rail = Rail {
                        local: ctx.id(),
                        remote: header.src_shard,
                    };
                    if let Err(e) = accept_join(&cfg.handshake, &s.peer, &s.secret, rail, join) {
                        let reason = e.reject_reason().unwrap_or(RejectReason::BadProof);
                        if let Some(t) = Connection::refuse(&cfg, header, &msg, reason) {
                            refuse_on(ep, frame_am_header(net.settings.node_id, 0), t.to_vec());
                        }
                        net.count(|s| s.dropped_unauthenticated += 1);
                        return false;
                    }
                    Connection::join_server(net.now(), cfg, s.peer, s.secret, seeds)
                }
                None => {
                    // No session to join: tell the sender at once, so that it falls back to
                    // a primary handshake instead of waiting for its deadline.
                    if let Some(t) =
                        Connection::refuse(&cfg, header, &msg, RejectReason::UnknownSession)
                    {
                        refuse_on(ep, frame_am_header(net.settings.node_id, 0), t.to_vec());
                    }
                    net.count(|s| s.dropped_unauthenticated += 1);
                    return false;
                }
            }
        }
        _ => Connection::server(net.now(), cfg, seeds),
    };
    insert_rail(ctx, net, node, count, header.src_shard, conn, ep);
    net.rearm();
    true
}

/// A `Hello` that the ready rail to `(node, header.src_shard)` declined
/// ([`DropReason::Opening`](crate::proto::conn::DropReason::Opening)): a pending opening beside that rail (see the module docs), on an
/// endpoint to the worker address the `Hello` carried, replacing one from the same
/// incarnation; under the half-open cap, which counts pending openings. Returns its sender's
/// generation, for the caller to feed it the `Hello`.
pub(super) fn open_beside(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    from: Opener<'_>,
    header: &FrameHeader,
    payload: &[u8],
    ready: PeerInfo,
) -> Option<u64> {
    let addr = from.addr;
    let hello = match HandshakeMessage::decode(header.kind, payload) {
        Ok(HandshakeMessage::Hello(h)) if h.node_id == node && !addr.is_empty() => h,
        _ => {
            net.count(|s| s.dropped_malformed += 1);
            return None;
        }
    };
    let Some(psk) = net.settings.psk.clone() else {
        net.count(|s| s.dropped_unauthenticated += 1);
        return None;
    };
    let remote = header.src_shard;
    let replaces = net
        .peers
        .borrow()
        .get(&node)
        .and_then(|p| p.pending_from(remote, hello.incarnation))
        .is_some();
    if half_open(net).saturating_sub(usize::from(replaces)) >= net.settings.cfg.max_half_open {
        net.count(|s| s.openings_over_cap += 1);
        return None;
    }
    let seeds = seeds().ok()?;
    let cfg = rail_config(ctx, net, psk);
    let ep = endpoint_to(ctx, net, from)?;
    let conn = Connection::server_beside(net.now(), cfg, seeds, ready);
    let rail = make_rail(ctx, net, node, remote, conn, ep);
    let generation = rail.generation;
    let replaced = {
        let mut peers = net.peers.borrow_mut();
        let p = peers.get_mut(&node)?;
        let old = p
            .pending
            .iter()
            .position(|q| q.rail.remote == remote && q.incarnation == hello.incarnation)
            .map(|at| p.pending.swap_remove(at));
        p.pending.push(PendingOpening {
            rail,
            incarnation: hello.incarnation,
            addr: addr.to_vec(),
            remote_count: hello.shard_count,
        });
        old
    };
    // Dropped outside the borrow: its sender ends and its endpoint goes.
    let replaced = replaced.is_some();
    net.count(|s| {
        s.pending_openings += 1;
        s.pending_refused += u64::from(replaced);
    });
    tracing::debug!(
        node = %node,
        remote_shard = remote.get(),
        incarnation = hello.incarnation.get(),
        "a Hello for a ready rail: opening beside it"
    );
    net.rearm();
    Some(generation)
}

/// Handshakes under way on this shard that a peer opened: rails opened by a `Hello` whose
/// handshake is not complete, and pending openings.
fn half_open(net: &NetState) -> usize {
    net.peers
        .borrow()
        .values()
        .map(|p| {
            let rails = p
                .rails
                .iter()
                .filter(|r| r.conn.role() == Role::Server && r.conn.state() == State::Connecting)
                .count();
            rails + p.pending.len()
        })
        .sum()
}

/// Sends a refusal on an endpoint of its own, then drops it.
fn refuse_on(ep: Endpoint, header: [u8; super::AM_HEADER_LEN], frame: Vec<u8>) {
    glommio::spawn_local(async move {
        let (res, _) = ep
            .am_send(super::FRAME_AM, &header, frame, crate::ucx::AmProto::Eager)
            .await;
        if res.is_ok() {
            let _ = future::or(ep.flush(), async {
                sleep(Duration::from_secs(1)).await;
                Ok(())
            })
            .await;
        }
    })
    .detach();
}

/// The session table's record for `node`.
fn session_of(net: &NetState, node: NodeId) -> Option<SessionRecord> {
    net.settings
        .sessions
        .lock()
        .ok()
        .and_then(|t| t.get(&node).cloned())
}

/// Makes a rail's sender task and records the rail (replacing an older one on the same pair).
fn insert_rail(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    remote_count: u16,
    remote: ShardId,
    conn: Connection,
    ep: Endpoint,
) {
    let rail = make_rail(ctx, net, node, remote, conn, ep);
    let old = {
        let mut peers = net.peers.borrow_mut();
        let p = peers.entry(node).or_insert_with(|| PeerRails {
            remote_count,
            rails: Vec::new(),
            pending: Vec::new(),
        });
        p.remote_count = remote_count;
        net.rails_changed();
        match p.rails.iter().position(|r| r.remote == remote) {
            Some(at) => Some(std::mem::replace(&mut p.rails[at], rail)),
            None => {
                p.rails.push(rail);
                None
            }
        }
    };
    if let Some(old) = old {
        retire(net, node, old, NetError::Closed { node });
    }
}

/// A rail's connection with a new sender task on `ep` (the task holds the endpoint).
fn make_rail(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    remote: ShardId,
    conn: Connection,
    ep: Endpoint,
) -> RailConn {
    let generation = net.generation.get() + 1;
    net.generation.set(generation);
    let out = Queue::new();
    let backlog = Rc::new(Backlog::default());
    let live = net.live_senders.clone();
    live.set(live.get() + 1);
    // The sender holds the only strong reference: the endpoint goes when the sender ends.
    let ep = Rc::new(ep);
    let weak_ep = Rc::downgrade(&ep);
    let send = outbound::sender(
        Rc::downgrade(ctx),
        ep,
        (out.clone(), backlog.clone()),
        (node, remote, generation),
        live.clone(),
        (net.settings.cfg.linger, net.settings.cfg.rndv_timeout),
    );
    glommio::spawn_local(async move {
        send.await;
        live.set(live.get() - 1);
    })
    .detach();
    let rail = RailConn {
        remote,
        conn,
        tx: Rc::new(RailTx {
            template: Cell::new(None),
            me: net.settings.node_id,
            out,
            ep: weak_ep,
            backlog,
            lane: Cell::new(None),
            heard: Cell::new((Timestamp::ZERO, 0)),
            pace_after: Cell::new(None),
        }),
        generation,
        waiters: Vec::new(),
    };
    rail.refresh();
    rail
}

/// What is left of a rail that is gone: its waiters and pending requests fail with `err`.
fn retire(net: &NetState, node: NodeId, mut old: RailConn, err: NetError) {
    for w in old.waiters.drain(..) {
        w.push(Err(err.clone()));
    }
    let remote = old.remote;
    drop(old);
    fail_pending(net, node, remote, &err);
    run_lost_hooks(net, Some(node), &err);
}

/// Drains a rail's outputs after an input: frames to its sender, events to waiters; records a
/// session; and removes the rail once failed or closed.
pub(super) fn service(net: &NetState, node: NodeId, remote: ShardId) {
    let mut peers = net.peers.borrow_mut();
    let Some(p) = peers.get_mut(&node) else {
        return;
    };
    let Some(r) = p.get_mut(remote) else {
        return;
    };
    while let Some(t) = r.conn.poll_transmit() {
        let frame = t.to_vec();
        let liveness = t.header.kind.is_liveness();
        let (header, payload) = if matches!(t.header.kind, FrameKind::Hello | FrameKind::Join) {
            let mut payload = net.my_address.clone();
            payload.extend_from_slice(&frame);
            let len = u32::try_from(net.my_address.len()).unwrap_or(u32::MAX);
            let mode = net.settings.error_mode;
            (opening_am_header(net.settings.node_id, len, mode), payload)
        } else {
            (frame_am_header(net.settings.node_id, 0), frame)
        };
        r.tx.out.push(Outbound::Control(header, payload, liveness));
    }
    let (mut handshakes, mut joins, mut expired) = (0, 0, 0);
    let (mut suspect, mut dead, mut failed, mut restarted) = (0, 0, 0, 0);
    // Why the requests pending on this rail are lost, if they are.
    let mut lost = None;
    while let Some(ev) = r.conn.poll_event() {
        match ev {
            Event::PeerSuspect => {
                suspect += 1;
                tracing::debug!(node = %node, remote_shard = remote.get(), "peer silent: suspect");
            }
            Event::PeerDead => dead += 1,
            Event::Connected(info) => {
                if r.conn.session_secret().is_some() {
                    handshakes += 1;
                    tracing::info!(node = %node, remote_shard = remote.get(), "session up: authenticated");
                } else {
                    joins += 1;
                    tracing::debug!(node = %node, remote_shard = remote.get(), "rail joined the session");
                }
                if let Some(secret) = r.conn.session_secret() {
                    if let Ok(mut t) = net.settings.sessions.lock() {
                        t.insert(
                            node,
                            SessionRecord {
                                peer: info,
                                secret: secret.clone(),
                            },
                        );
                    }
                }
                let remote = ready_remote(&r.conn);
                for w in r.waiters.drain(..) {
                    w.push(remote.ok_or(NetError::Closed { node }));
                }
            }
            Event::Failed { reason } => {
                if r.conn.role() == Role::Server
                    && matches!(reason, FailReason::Handshake(HandshakeError::Timeout))
                {
                    expired += 1;
                }
                failed += 1;
                let err = fail_error(node, reason);
                tracing::warn!(node = %node, remote_shard = remote.get(), error = %err, "rail failed");
                for w in r.waiters.drain(..) {
                    w.push(Err(err.clone()));
                }
                lost.get_or_insert(err);
            }
            // Requests sent to the old incarnation are void.
            Event::PeerRestarted { .. } => {
                restarted += 1;
                tracing::info!(node = %node, remote_shard = remote.get(), "peer restarted (new incarnation)");
                lost.get_or_insert(NetError::Closed { node });
            }
            Event::Closed { .. } => {
                tracing::debug!(node = %node, remote_shard = remote.get(), "rail closed");
                lost.get_or_insert(NetError::Closed { node });
            }
            _ => {}
        }
    }
    let gone = matches!(r.conn.state(), State::Failed | State::Closed);
    let due = r.conn.poll_timeout();
    let removed = if gone {
        let at = p.rails.iter().position(|x| x.remote == remote);
        let old = at.map(|at| p.rails.swap_remove(at));
        net.rails_changed();
        if p.rails.is_empty() && p.pending.is_empty() {
            peers.remove(&node);
        }
        old
    } else {
        None
    };
    drop(peers);
    if handshakes + joins + expired + suspect + dead + failed + restarted > 0 {
        net.count(|s| {
            s.handshakes += handshakes;
            s.joins += joins;
            s.handshakes_expired += expired;
            s.heartbeat_misses += suspect;
            s.peers_dead += dead;
            s.rails_failed += failed;
            s.peer_restarts += restarted;
        });
    }
    if !gone && due.is_some_and(|t| t < net.timer_at.get()) {
        net.rearm();
    }
    if let Some(old) = removed {
        retire(
            net,
            node,
            old,
            lost.take().unwrap_or(NetError::Closed { node }),
        );
    } else if let Some(err) = lost {
        fail_pending(net, node, remote, &err);
        run_lost_hooks(net, Some(node), &err);
    }
}

/// Drains a pending opening's outputs after an input (the one of `node` whose sender has
/// `generation`): frames to its sender; once ready, it replaces the rail it was opened beside
/// (whose pending requests fail with [`NetError::Closed`]) and records the session; once
/// failed, it is dropped (its endpoint closed) and counted, the rail untouched.
pub(super) fn service_pending(net: &NetState, node: NodeId, generation: u64) {
    let mut peers = net.peers.borrow_mut();
    let Some(p) = peers.get_mut(&node) else {
        return;
    };
    let Some(q) = p.pending_mut(generation) else {
        return;
    };
    let remote = q.rail.remote;
    while let Some(t) = q.rail.conn.poll_transmit() {
        // A server's frames: no `Hello` or `Join`, so no address before them.
        q.rail.tx.out.push(Outbound::Control(
            frame_am_header(net.settings.node_id, 0),
            t.to_vec(),
            false,
        ));
    }
    let mut outcome = None;
    while let Some(ev) = q.rail.conn.poll_event() {
        match ev {
            Event::Connected(info) => outcome = Some(Ok(info)),
            Event::Failed { reason } => outcome = Some(Err(reason)),
            Event::PeerRestarted { old, new } => {
                tracing::info!(
                    node = %node,
                    remote_shard = remote.get(),
                    old = old.get(),
                    new = new.get(),
                    "peer restarted (new incarnation)"
                );
            }
            _ => {}
        }
    }
    let due = q.rail.conn.poll_timeout();
    let Some(outcome) = outcome else {
        drop(peers);
        if due.is_some_and(|t| t < net.timer_at.get()) {
            net.rearm();
        }
        return;
    };
    let at = p
        .pending
        .iter()
        .position(|q| q.rail.generation == generation);
    let Some(q) = at.map(|at| p.pending.swap_remove(at)) else {
        return;
    };
    let current = p
        .get(remote)
        .and_then(|r| r.conn.peer())
        .map(|peer| peer.incarnation);
    match outcome {
        Ok(info) if current.is_none_or(|c| c <= info.incarnation) => {
            let secret = q.rail.conn.session_secret().cloned();
            p.remote_count = q.remote_count;
            net.rails_changed();
            let old = match p.rails.iter().position(|r| r.remote == remote) {
                Some(at) => Some(std::mem::replace(&mut p.rails[at], q.rail)),
                None => {
                    p.rails.push(q.rail);
                    None
                }
            };
            drop(peers);
            if let (Some(secret), Ok(mut t)) = (secret, net.settings.sessions.lock()) {
                t.insert(node, SessionRecord { peer: info, secret });
            }
            let restarted = current.is_some_and(|c| c < info.incarnation);
            net.count(|s| {
                s.handshakes += 1;
                s.peer_restarts += u64::from(restarted);
            });
            tracing::info!(
                node = %node,
                remote_shard = remote.get(),
                "session up: authenticated (an opening beside the rail replaced it)"
            );
            if let Some(old) = old {
                retire(net, node, old, NetError::Closed { node });
            }
            net.rearm();
        }
        Ok(_) => {
            // Ready for an incarnation older than the rail's by now: given up.
            drop(peers);
            drop(q);
            net.count(|s| s.pending_refused += 1);
        }
        Err(reason) => {
            if p.rails.is_empty() && p.pending.is_empty() {
                peers.remove(&node);
            }
            drop(peers);
            // Its sender ends, and its endpoint goes.
            drop(q);
            let expired = matches!(reason, FailReason::Handshake(HandshakeError::Timeout));
            tracing::debug!(
                node = %node,
                remote_shard = remote.get(),
                reason = ?reason,
                "an opening beside a ready rail failed; the rail carries on"
            );
            net.count(|s| {
                if expired {
                    s.pending_expired += 1;
                } else {
                    s.pending_refused += 1;
                }
            });
        }
    }
}

/// Fails every request pending on this shard on the rail to `(node, remote)` with `err`.
fn fail_pending(net: &NetState, node: NodeId, remote: ShardId, err: &NetError) {
    // Taken out first: a reply handler may send another request (into the table).
    let failed = net
        .pending
        .borrow_mut()
        .drain_where(|_, p| p.node == node && p.remote == remote);
    for (_, p) in failed {
        p.waiter.answer(net, Err(err.clone()));
    }
}

/// Runs the hooks of [`ShardCtx::on_peer_lost`] (`None`: every node).
pub(super) fn run_lost_hooks(net: &NetState, node: Option<NodeId>, err: &NetError) {
    // Cloned: a hook may register another.
    let hooks = net.lost_hooks.borrow().clone();
    for hook in hooks {
        hook(node, err);
    }
}

/// Closes every rail of this shard at shut-down (a `Close` goes out where a session is up) and
/// removes them.
/// Closes this shard's rails to `node` at once (a `Close` to the peer where a session is up);
/// what was pending on them fails with [`NetError::Closed`]. For a peer dropped for
/// misbehaviour ([`crate::ShardCtx::drop_peer`]).
pub(super) fn close_node(net: &NetState, node: NodeId) {
    let now = net.now();
    let remotes: Vec<ShardId> = net
        .peers
        .borrow()
        .get(&node)
        .map(|p| p.rails.iter().map(|r| r.remote).collect())
        .unwrap_or_default();
    for remote in remotes {
        close_rail(net, node, remote, now);
    }
}

/// Closes the rail to `(node, remote)` at once (a `Close` to the peer where a session is up)
/// and services it, which retires it.
fn close_rail(net: &NetState, node: NodeId, remote: ShardId, now: Timestamp) {
    if let Some(r) = net
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.get_mut(remote))
    {
        r.conn_mut().close(now);
    }
    service(net, node, remote);
}

/// Closes this shard's rails to the nodes that another shard dropped since this one last
/// looked (see [`crate::ShardCtx::drop_peer`]): one atomic load per timer round otherwise.
fn close_banned(net: &NetState) {
    let generation = net.settings.bans.generation();
    if generation == net.bans_seen.get() {
        return;
    }
    net.bans_seen.set(generation);
    let banned: Vec<NodeId> = net
        .peers
        .borrow()
        .keys()
        .copied()
        .filter(|n| net.settings.bans.is_banned(*n))
        .collect();
    for node in banned {
        close_node(net, node);
    }
}

pub(super) fn close_all(net: &NetState) {
    let now = net.now();
    let rails: Vec<(NodeId, ShardId)> = net
        .peers
        .borrow()
        .iter()
        .flat_map(|(n, p)| p.rails.iter().map(|r| (*n, r.remote)))
        .collect();
    for (node, remote) in rails {
        close_rail(net, node, remote, now);
    }
    net.peers.borrow_mut().clear();
    net.rails_changed();
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

/// The settings of a connection of this shard's rails.
fn rail_config(ctx: &ShardCtx, net: &NetState, psk: PreSharedKey) -> ConnConfig {
    net.settings
        .cfg
        .conn_config(&net.settings, psk, shard_count_u16(ctx), ctx.id())
}

/// Who sent a `Hello` or `Join`: the worker address it carried and the error mode of the
/// endpoint it came on, as its AM header says (`None` when not said).
#[derive(Clone, Copy)]
pub(super) struct Opener<'a> {
    pub(super) addr: &'a [u8],
    pub(super) mode: Option<ErrorMode>,
}

/// An endpoint to the worker address a `Hello` or `Join` carried, in the error mode of the
/// endpoint the peer sent it on (this node's own when the opening says none): UCX 1.12 kills
/// a process whose endpoint meets one in the other mode (see "Error modes" in the `net`
/// docs). `None` (counted as malformed) when UCX refuses the address.
fn endpoint_to(ctx: &ShardCtx, net: &NetState, from: Opener<'_>) -> Option<Endpoint> {
    let address = WorkerAddress::from_bytes(from.addr.to_vec());
    let mut opts = net.ep_options();
    if let Some(mode) = from.mode {
        opts.error_mode = mode;
    }
    let ep = Endpoint::connect_to_worker(ctx.worker(), &address, opts).ok();
    if ep.is_none() {
        net.count(|s| s.dropped_malformed += 1);
    }
    ep
}

pub(super) fn shard_count_u16(ctx: &ShardCtx) -> u16 {
    u16::try_from(ctx.shard_count()).unwrap_or(u16::MAX)
}

fn seeds() -> Result<Seeds, NetError> {
    let mut b = [0u8; 40];
    super::os_random(&mut b).map_err(|e| NetError::Random {
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

/// How a rail is opened by this side.
#[derive(Clone)]
enum Opening {
    /// The pre-shared-key handshake: a new session (replacing a rail that is up, when the peer
    /// refused joins to the session it belongs to).
    Primary { fresh: bool },
    /// A join of the session `.0`.
    Join(SessionRecord),
}

/// Opens the rail from this shard to `remote` of `node` (worker `address`), or returns it if it
/// is up with `incarnation`; waits for its handshake within the handshake timeout.
async fn open_rail(
    ctx: &Rc<ShardCtx>,
    (node, incarnation, remote_count): (NodeId, crate::proto::Incarnation, u16),
    remote: ShardId,
    address: WorkerAddress,
    how: Opening,
) -> Result<RemoteNode, NetError> {
    let net = ctx.net();
    let waiter = Queue::new();
    let joined = match net
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.get_mut(remote))
    {
        Some(r) => match ready_remote(&r.conn) {
            Some(up)
                if up.incarnation == incarnation
                    && !matches!(how, Opening::Primary { fresh: true }) =>
            {
                return Ok(up)
            }
            // An older session's rail: replaced below.
            Some(_) => false,
            None if r.conn.state() == State::Connecting && r.conn.role() == Role::Client => {
                r.waiters.push(waiter.clone());
                true
            }
            None => false,
        },
        None => false,
    };
    if !joined {
        let psk = net.settings.psk.clone().ok_or(NetError::NoKey)?;
        let ep = Endpoint::connect_to_worker(ctx.worker(), &address, net.ep_options())
            .map_err(|source| NetError::Ucx { source })?;
        let cfg = rail_config(ctx, net, psk);
        let mut conn = match how {
            Opening::Primary { .. } => Connection::client(cfg, node, remote, seeds()?),
            Opening::Join(s) => Connection::join_client(cfg, s.peer, s.secret, remote, seeds()?),
        };
        conn.connect(net.now())
            .map_err(|_| NetError::Closed { node })?;
        insert_rail(ctx, net, node, remote_count, remote, conn, ep);
        if let Some(r) = net
            .peers
            .borrow_mut()
            .get_mut(&node)
            .and_then(|p| p.get_mut(remote))
        {
            r.waiters.push(waiter.clone());
        }
        service(net, node, remote);
        net.rearm();
    }
    let limit = net.settings.cfg.handshake_timeout + Duration::from_secs(1);
    let got = future::or(async { waiter.next().await }, async {
        sleep(limit).await;
        None
    })
    .await;
    got.unwrap_or(Err(NetError::TimedOut { what: "handshake" }))
}

/// Makes sure every rail of this shard to the node of `dir` is up with that incarnation,
/// joining `session` where one is missing (see the module docs).
async fn ensure_rails(
    ctx: &Rc<ShardCtx>,
    dir: &Directory,
    session: &SessionRecord,
) -> Result<(), NetError> {
    let Some(rails) = rails_with(ctx, dir.shard_count()) else {
        return Err(NetError::BadShardCount {
            node: dir.node_id,
            count: dir.shard_count(),
        });
    };
    for remote in rails.remotes_of(ctx.id()) {
        let address = dir
            .workers
            .get(remote.index())
            .cloned()
            .ok_or(NetError::BadShardCount {
                node: dir.node_id,
                count: dir.shard_count(),
            })?;
        // The peer records the session when it has checked the primary's `Confirm`, on its
        // shard of the primary rail, while this `Join` may reach another of its shards first:
        // a join refused for an unknown session is tried again a few times before the node
        // pair falls back to a new primary.
        let mut pause = JOIN_RETRY_FIRST;
        loop {
            let r = open_rail(
                ctx,
                (dir.node_id, dir.incarnation, dir.shard_count()),
                remote,
                address.clone(),
                Opening::Join(session.clone()),
            )
            .await;
            match r {
                Err(NetError::Refused {
                    reason: RejectReason::UnknownSession,
                    ..
                }) if pause <= JOIN_RETRY_LAST => {
                    ctx.net().count(|s| s.join_retries += 1);
                    sleep(pause).await;
                    pause *= 2;
                }
                other => {
                    other?;
                    break;
                }
            }
        }
    }
    Ok(())
}

/// First pause before a join refused for an unknown session is tried again (see
/// [`ensure_rails`]); it doubles up to [`JOIN_RETRY_LAST`] (seven tries in about 130 ms).
const JOIN_RETRY_FIRST: Duration = Duration::from_millis(1);
/// Last pause before a join is tried again.
const JOIN_RETRY_LAST: Duration = Duration::from_millis(64);

/// On local shard 0: sets up the node pair with the node of `dir` — the session (a primary
/// handshake on this shard's default rail unless the session table holds one with the node's
/// incarnation) and every local shard's rails. One establishment per node at a time: a second
/// waits for the first's outcome.
pub(super) async fn establish(ctx: &Rc<ShardCtx>, dir: Directory) -> Result<(), NetError> {
    let net = ctx.net();
    let node = dir.node_id;
    loop {
        let mine = Slot::new();
        let running = {
            let mut e = net.establishing.borrow_mut();
            match e.get_mut(&node) {
                Some(waiting) => {
                    waiting.push(mine.clone());
                    true
                }
                None => {
                    e.insert(node, Vec::new());
                    false
                }
            }
        };
        if running {
            match mine.wait().await {
                Some(outcome) => return outcome,
                // The caller establishing it gave up (its deadline dropped its future): this
                // one establishes it now, or waits for another that got there first.
                None => continue,
            }
        }
        let mut leading = Leading {
            net,
            node,
            outcome: None,
        };
        let outcome = establish_now(ctx, &dir).await;
        leading.outcome = Some(outcome.clone());
        return outcome;
    }
}

/// Shard 0's entry for a node pair it is establishing, held by the caller doing it: removed
/// when that caller is done, or dropped (its future cut short by its deadline), so that the
/// tasks waiting on it get the outcome, or `None` and take the establishing over. Without it
/// a connect given up half-way left the entry behind, and every later connect to that node
/// waited on it until its own deadline (the reliability suite's R13: a client never got back
/// to a restarted server).
struct Leading<'a> {
    net: &'a NetState,
    node: NodeId,
    outcome: Option<Result<(), NetError>>,
}

impl Drop for Leading<'_> {
    fn drop(&mut self) {
        let waiting = self
            .net
            .establishing
            .borrow_mut()
            .remove(&self.node)
            .unwrap_or_default();
        for w in waiting {
            w.push(self.outcome.clone());
        }
    }
}

async fn establish_now(ctx: &Rc<ShardCtx>, dir: &Directory) -> Result<(), NetError> {
    let net = ctx.net();
    let node = dir.node_id;
    if net.settings.bans.is_banned(node) {
        return Err(NetError::Refused {
            node,
            reason: RejectReason::Banned,
        });
    }
    let rails = rails_with(ctx, dir.shard_count()).ok_or(NetError::BadShardCount {
        node,
        count: dir.shard_count(),
    })?;
    // One retry: a session this node remembers may be one the peer no longer holds
    // (`UnknownSession`), which a fresh primary replaces.
    for attempt in 0..2 {
        let current = session_of(net, node).filter(|s| s.peer.incarnation == dir.incarnation);
        let session =
            match current {
                Some(s) => s,
                None => {
                    let remote = rails.default_remote(ctx.id());
                    let address = dir.workers.get(remote.index()).cloned().ok_or(
                        NetError::BadShardCount {
                            node,
                            count: dir.shard_count(),
                        },
                    )?;
                    open_rail(
                        ctx,
                        (node, dir.incarnation, dir.shard_count()),
                        remote,
                        address,
                        Opening::Primary { fresh: attempt > 0 },
                    )
                    .await?;
                    session_of(net, node)
                        .filter(|s| s.peer.incarnation == dir.incarnation)
                        .ok_or(NetError::Closed { node })?
                }
            };
        let mut outcome = Ok(());
        for shard in 0..ctx.shard_count() {
            let to = ShardId::new(u16::try_from(shard).unwrap_or(u16::MAX));
            let (d, s) = (dir.clone(), session.clone());
            let r = if to == ctx.id() {
                ensure_rails(ctx, &d, &s).await
            } else {
                ctx.forward(to, move |c| async move { ensure_rails(&c, &d, &s).await })
                    .await
                    .unwrap_or_else(|e| Err(e.into()))
            };
            if r.is_err() {
                outcome = r;
                break;
            }
        }
        match outcome {
            Err(NetError::Refused {
                reason: RejectReason::UnknownSession,
                ..
            }) if attempt == 0 => {
                if let Ok(mut t) = net.settings.sessions.lock() {
                    t.remove(&node);
                }
            }
            other => return other,
        }
    }
    Err(NetError::Closed { node })
}

pub(super) fn ready_remote(conn: &Connection) -> Option<RemoteNode> {
    let peer = conn.peer()?;
    let rail = conn.rail()?;
    matches!(conn.state(), State::Ready).then(|| RemoteNode {
        node_id: peer.node_id,
        incarnation: peer.incarnation,
        shard_count: peer.shard_count,
        owner: rail.local,
        remote_shard: rail.remote,
    })
}

/// The per-shard net task: the timers of the rails and requests (see the module docs).
///
/// One timer serves the rails' deadlines and the requests' ([`handle_timeouts`]). It is
/// re-armed only when the next deadline is earlier than the time it is set for: a deadline
/// that moved later (its request was answered) is waited for by letting the timer fire early
/// and arming it again then, so that answered requests cost no timer operation.
pub(super) async fn timer_loop(ctx: Rc<ShardCtx>) {
    let net = ctx.net().clone();
    let mut timer: Option<Timer> = None;
    loop {
        if net.closed.get() {
            return;
        }
        net.rearm_asked.set(false);
        if let Some(t) = next_timeout(&net) {
            if t < net.timer_at.get() {
                // Not before `t` on the net clock: the timer's instant is taken after `now`.
                timer = Some(Timer::new(t.saturating_duration_since(net.now())));
                net.timer_at.set(t);
            }
        }
        let fired = poll_fn(|cx| {
            if net.closed.get() || net.rearm_asked.get() {
                return Poll::Ready(false);
            }
            *net.timer_waker.borrow_mut() = Some(cx.waker().clone());
            match timer.as_mut().map(|t| Pin::new(t).poll(cx)) {
                Some(Poll::Ready(_)) => Poll::Ready(true),
                _ => Poll::Pending,
            }
        })
        .await;
        if fired {
            timer = None;
            net.timer_at.set(Timestamp::MAX);
            handle_timeouts(&ctx, &net);
        }
    }
}

/// The earliest deadline of this shard: its rails' (pending openings' too) and its pending
/// requests'.
fn next_timeout(net: &NetState) -> Option<Timestamp> {
    let rails = net
        .peers
        .borrow()
        .values()
        .flat_map(|p| {
            let pending = p.pending.iter().map(|q| &q.rail);
            p.rails
                .iter()
                .chain(pending)
                .filter_map(|r| r.conn.poll_timeout())
        })
        .min();
    let requests = net.pending.borrow_mut().poll_timeout();
    match (rails, requests) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Fails the requests whose deadline has passed ([`NetError::TimedOut`], and a cancel frame
/// for an RPC request), and runs the rails' timers that are due.
fn handle_timeouts(ctx: &ShardCtx, net: &NetState) {
    close_banned(net);
    let now = net.now();
    loop {
        // Not borrowed across the cancel: sending does not touch the table, but a waker might
        // run code that does.
        let expired = net.pending.borrow_mut().poll_expired(now);
        let Some((req_id, p)) = expired else { break };
        if p.kind == FrameKind::RpcRequest {
            send_cancel(ctx, (p.node, p.remote), p.id, req_id);
        }
        p.waiter
            .answer(net, Err(NetError::TimedOut { what: "request" }));
    }
    let due: Vec<(NodeId, ShardId)> = net
        .peers
        .borrow()
        .iter()
        .flat_map(|(n, p)| {
            p.rails
                .iter()
                .filter(|r| r.conn.poll_timeout().is_some_and(|t| t <= now))
                .map(|r| (*n, r.remote))
        })
        .collect();
    for (node, remote) in due {
        if let Some(r) = net
            .peers
            .borrow_mut()
            .get_mut(&node)
            .and_then(|p| p.get_mut(remote))
        {
            r.conn_mut().handle_timeout(now);
        }
        service(net, node, remote);
    }
    let due: Vec<(NodeId, u64)> = net
        .peers
        .borrow()
        .iter()
        .flat_map(|(n, p)| {
            p.pending
                .iter()
                .filter(|q| q.rail.conn.poll_timeout().is_some_and(|t| t <= now))
                .map(|q| (*n, q.rail.generation))
        })
        .collect();
    for (node, generation) in due {
        if let Some(q) = net
            .peers
            .borrow_mut()
            .get_mut(&node)
            .and_then(|p| p.pending_mut(generation))
        {
            q.rail.conn_mut().handle_timeout(now);
        }
        service_pending(net, node, generation);
    }
}
