//! Sessions: the connection state of each peer on its owner shard, the handshake, the timers
//! that drive it, and what happens when a connection ends.

use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::Poll;
use std::time::Duration;

use futures_lite::future;
use glommio::timer::{sleep, Timer};

use super::outbound::{self, Outbound};
use super::request::send_cancel;
use super::{frame_am_header, NetError, NetState, Queue, RemoteNode};
use crate::boot::ShardCtx;
use crate::proto::conn::FailReason;
use crate::proto::handshake::{HandshakeError, HandshakeMessage, RejectReason};
use crate::proto::{
    Connection, Event, FrameHeader, FrameKind, NodeId, ReqId, Seeds, ShardMap, State, Timestamp,
};
use crate::ucx::{Endpoint, WorkerAddress};

type Waiter = Rc<Queue<Result<RemoteNode, NetError>>>;

/// A peer's connection on its owner shard.
pub(super) struct Peer {
    pub(super) conn: Connection,
    /// Frames for the connection's sender task, in order.
    pub(super) out: Rc<Queue<Outbound>>,
    /// The sender task's endpoint, for sends in place; it goes when the sender ends.
    pub(super) ep: Weak<Endpoint>,
    pub(super) generation: u64,
    waiters: Vec<Waiter>,
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.out.close();
    }
}

/// A frame from a node without a connection: if it is a well-formed hello from that node, to
/// this shard as its owner, with a worker address, make the reverse endpoint and a server
/// connection. Otherwise count the frame as dropped.
pub(super) fn accept_hello(
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
    net.rearm();
    true
}

/// Makes the connection's sender task and records the peer.
fn insert_peer(ctx: &Rc<ShardCtx>, net: &NetState, node: NodeId, conn: Connection, ep: Endpoint) {
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

/// Drains a connection's outputs after an input: frames to its sender, events to waiters; and
/// removes it once failed or closed.
pub(super) fn service(net: &NetState, node: NodeId) {
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
        p.out.push(Outbound::Control(header, payload));
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
    let due = p.conn.poll_timeout();
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
    if !gone && due.is_some_and(|t| t < net.timer_at.get()) {
        net.rearm();
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

/// Runs the hooks of [`ShardCtx::on_peer_lost`] (`None`: every node).
pub(super) fn run_lost_hooks(net: &NetState, node: Option<NodeId>, err: &NetError) {
    // Cloned: a hook may register another.
    let hooks = net.lost_hooks.borrow().clone();
    for hook in hooks {
        hook(node, err);
    }
}

/// Closes every connection of this shard at shut-down (a `Close` goes out where a session is
/// up) and removes them.
pub(super) fn close_all(net: &NetState) {
    let now = net.now();
    let nodes: Vec<NodeId> = net.peers.borrow().keys().copied().collect();
    for node in nodes {
        if let Some(p) = net.peers.borrow_mut().get_mut(&node) {
            p.conn.close(now);
        }
        service(net, node);
        net.peers.borrow_mut().remove(&node);
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

pub(super) fn local_map(ctx: &ShardCtx) -> ShardMap {
    #[allow(clippy::expect_used)]
    // Invariant: `ShardsBuilder::run` refuses shard counts outside 1..=MAX_SHARDS.
    ShardMap::new(shard_count_u16(ctx)).expect("shard count checked at boot")
}

fn shard_count_u16(ctx: &ShardCtx) -> u16 {
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

/// Opens (or joins) the session with `node` on this shard, its owner.
pub(super) async fn open(
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

pub(super) fn ready_remote(conn: &Connection) -> Option<RemoteNode> {
    let peer = conn.peer()?;
    matches!(conn.state(), State::Ready).then(|| RemoteNode {
        node_id: peer.node_id,
        incarnation: peer.incarnation,
        shard_count: peer.shard_count,
        owner: conn.config().local_shard,
        remote_shard: conn.remote_shard(),
    })
}

/// The per-shard net task: the timers of the connections and requests (see the module docs).
///
/// One timer serves the connections' deadlines and the requests' ([`handle_timeouts`]). It is
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
        // Not borrowed across the cancel: sending does not touch the table, but a waker might
        // run code that does.
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
