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
use super::outbound::{self, Outbound};
use super::request::send_cancel;
use super::{frame_am_header, NetError, NetState, Queue, RemoteNode, Slot};
use crate::boot::ShardCtx;
use crate::proto::conn::FailReason;
use crate::proto::handshake::{
    accept_join, HandshakeError, HandshakeMessage, PeerInfo, RejectReason, Role,
};
use crate::proto::{
    Connection, Event, FrameHeader, FrameKind, NodeId, Rail, Rails, ReqId, Seeds, SessionSecret,
    ShardId, State, Timestamp,
};
use crate::ucx::{Endpoint, WorkerAddress};

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
}

/// One rail's connection on this shard.
pub(super) struct RailConn {
    /// The remote shard at the other end.
    pub(super) remote: ShardId,
    pub(super) conn: Connection,
    /// Frames for the rail's sender task, in order.
    pub(super) out: Rc<Queue<Outbound>>,
    /// The sender task's endpoint, for sends in place; it goes when the sender ends.
    pub(super) ep: Weak<Endpoint>,
    pub(super) generation: u64,
    waiters: Vec<Waiter>,
}

impl std::fmt::Debug for SessionRecord {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionRecord")
            .field("peer", &self.peer)
            .finish_non_exhaustive()
    }
}

impl Drop for RailConn {
    fn drop(&mut self) {
        self.out.close();
    }
}

impl PeerRails {
    pub(super) fn get(&self, remote: ShardId) -> Option<&RailConn> {
        self.rails.iter().find(|r| r.remote == remote)
    }

    pub(super) fn get_mut(&mut self, remote: ShardId) -> Option<&mut RailConn> {
        self.rails.iter_mut().find(|r| r.remote == remote)
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
    addr: &[u8],
    header: &FrameHeader,
    payload: &[u8],
) -> bool {
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
    let (from, count) = match &msg {
        HandshakeMessage::Hello(h) => (h.node_id, h.shard_count),
        HandshakeMessage::Join(j) => (j.node_id, j.shard_count),
        _ => return false,
    };
    if from != node || addr.is_empty() {
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
    let cfg = net
        .settings
        .cfg
        .conn_config(&net.settings, psk, shard_count_u16(ctx), ctx.id());
    let address = WorkerAddress::from_bytes(addr.to_vec());
    let Ok(ep) = Endpoint::connect_to_worker(ctx.worker(), &address, net.ep_options()) else {
        net.count(|s| s.dropped_malformed += 1);
        return false;
    };
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

/// Rails of this shard opened by a peer's `Hello` whose handshake is not complete.
fn half_open(net: &NetState) -> usize {
    net.peers
        .borrow()
        .values()
        .flat_map(|p| p.rails.iter())
        .filter(|r| r.conn.role() == Role::Server && r.conn.state() == State::Connecting)
        .count()
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
    let generation = net.generation.get() + 1;
    net.generation.set(generation);
    let out = Queue::new();
    let live = net.live_senders.clone();
    live.set(live.get() + 1);
    // The sender holds the only strong reference: the endpoint goes when the sender ends.
    let ep = Rc::new(ep);
    let weak_ep = Rc::downgrade(&ep);
    let send = outbound::sender(
        Rc::downgrade(ctx),
        ep,
        out.clone(),
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
        out,
        ep: weak_ep,
        generation,
        waiters: Vec::new(),
    };
    let old = {
        let mut peers = net.peers.borrow_mut();
        let p = peers.entry(node).or_insert_with(|| PeerRails {
            remote_count,
            rails: Vec::new(),
        });
        p.remote_count = remote_count;
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
        let (header, payload) = if matches!(t.header.kind, FrameKind::Hello | FrameKind::Join) {
            let mut payload = net.my_address.clone();
            payload.extend_from_slice(&frame);
            let len = u32::try_from(net.my_address.len()).unwrap_or(u32::MAX);
            (frame_am_header(net.settings.node_id, len), payload)
        } else {
            (frame_am_header(net.settings.node_id, 0), frame)
        };
        r.out.push(Outbound::Control(header, payload));
    }
    let (mut handshakes, mut joins, mut expired) = (0, 0, 0);
    // Why the requests pending on this rail are lost, if they are.
    let mut lost = None;
    while let Some(ev) = r.conn.poll_event() {
        match ev {
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
                let err = fail_error(node, reason);
                tracing::warn!(node = %node, remote_shard = remote.get(), error = %err, "rail failed");
                for w in r.waiters.drain(..) {
                    w.push(Err(err.clone()));
                }
                lost.get_or_insert(err);
            }
            // Requests sent to the old incarnation are void.
            Event::PeerRestarted { .. } => {
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
        if p.rails.is_empty() {
            peers.remove(&node);
        }
        old
    } else {
        None
    };
    drop(peers);
    if handshakes + joins + expired > 0 {
        net.count(|s| {
            s.handshakes += handshakes;
            s.joins += joins;
            s.handshakes_expired += expired;
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

/// Fails every request pending on this shard on the rail to `(node, remote)` with `err`.
fn fail_pending(net: &NetState, node: NodeId, remote: ShardId, err: &NetError) {
    let mut pending = net.pending.borrow_mut();
    let ids: Vec<ReqId> = pending
        .iter()
        .filter(|(_, p)| p.node == node && p.remote == remote)
        .map(|(id, _)| id)
        .collect();
    for id in ids {
        if let Some(p) = pending.cancel(id) {
            p.waiter.push(Err(err.clone()));
        }
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
pub(super) fn close_all(net: &NetState) {
    let now = net.now();
    let rails: Vec<(NodeId, ShardId)> = net
        .peers
        .borrow()
        .iter()
        .flat_map(|(n, p)| p.rails.iter().map(|r| (*n, r.remote)))
        .collect();
    for (node, remote) in rails {
        if let Some(r) = net
            .peers
            .borrow_mut()
            .get_mut(&node)
            .and_then(|p| p.get_mut(remote))
        {
            r.conn.close(now);
        }
        service(net, node, remote);
    }
    net.peers.borrow_mut().clear();
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
        let cfg = net
            .settings
            .cfg
            .conn_config(&net.settings, psk, shard_count_u16(ctx), ctx.id());
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
        return mine.wait().await;
    }
    let outcome = establish_now(ctx, &dir).await;
    let waiting = net
        .establishing
        .borrow_mut()
        .remove(&node)
        .unwrap_or_default();
    for w in waiting {
        w.push(outcome.clone());
    }
    outcome
}

async fn establish_now(ctx: &Rc<ShardCtx>, dir: &Directory) -> Result<(), NetError> {
    let net = ctx.net();
    let node = dir.node_id;
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

/// The earliest deadline of this shard: its rails' and its pending requests'.
fn next_timeout(net: &NetState) -> Option<Timestamp> {
    let rails = net
        .peers
        .borrow()
        .values()
        .flat_map(|p| p.rails.iter().filter_map(|r| r.conn.poll_timeout()))
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
    let now = net.now();
    loop {
        // Not borrowed across the cancel: sending does not touch the table, but a waker might
        // run code that does.
        let expired = net.pending.borrow_mut().poll_expired(now);
        let Some((req_id, p)) = expired else { break };
        if p.kind == FrameKind::RpcRequest {
            send_cancel(ctx, (p.node, p.remote), p.id, req_id);
        }
        p.waiter.push(Err(NetError::TimedOut { what: "request" }));
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
            r.conn.handle_timeout(now);
        }
        service(net, node, remote);
    }
}
