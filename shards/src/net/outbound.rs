//! Outbound: application frames handed to UCX in place when it can take them at once, or
//! queued for the connection's sender task, which posts them in order (see the module docs of
//! [`crate::net`], "The hot path").

use std::collections::VecDeque;
use std::future::{poll_fn, Future};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::task::{Poll, Waker};
use std::time::Duration;

use futures_lite::future;
use glommio::timer::sleep;

use super::inbound::Inbound;
use super::session::RailTx;
use super::{
    Dest, NetError, NetState, Queue, Route, AM_HEADER_LEN, DATA_AM, DATA_HEADER_LEN, FRAME_AM,
    MAX_USER_HEADER,
};
use crate::boot::ShardCtx;
use crate::proto::wire::{DataTemplate, NO_DEADLINE_TTL};
use crate::proto::{AmId, FrameFlags, FrameHeader, FrameKind, NodeId, ReqId, ShardId};
use crate::ucx::{AmProto, AmSend, Endpoint, SendBuf};

/// Sends a sender task keeps in flight at most; it takes no more frames from its queue until
/// the oldest completes.
const MAX_IN_FLIGHT: usize = 1024;

/// User headers up to this many bytes are built on the stack with the frame header.
const STACK_USER: usize = 64;

/// A frame for a connection's sender task.
pub(super) enum Outbound {
    /// A control frame ([`FRAME_AM`]): routing header and payload (address and frame), and
    /// whether it is a heartbeat or an ack of one (sent, it keeps no driver spinning: see
    /// [`crate::ShardCtx::nudge_driver`]).
    Control([u8; AM_HEADER_LEN], Vec<u8>, bool),
    /// An application frame ([`DATA_AM`]): its UCX AM header (routing, frame header, user
    /// header) and payload; by rendezvous when `rndv`.
    Data {
        header: Vec<u8>,
        payload: SendBuf,
        rndv: bool,
        /// Its bytes in the rail's [`Backlog`].
        bytes: u64,
    },
    /// A send already posted to UCX by [`send`] (the queue was empty), not complete yet: the
    /// sender tracks its completion as for a send of its own (`rndv`: a rendezvous).
    Posted {
        send: AmSend<SendBuf>,
        rndv: bool,
        /// Its bytes in the rail's [`Backlog`].
        bytes: u64,
    },
    /// A send in place failed at once: the sender reports the transport error and stops, as
    /// after a send of its own failed.
    Failed,
}

/// The bytes of application frames a rail holds that UCX has not completed (see
/// [`super::NetConfig::max_backlog_bytes`]): reserved by [`send`] when it queues or posts a
/// frame, released by the rail's sender when UCX completes it (or it is dropped).
#[derive(Default)]
pub(super) struct Backlog {
    bytes: std::cell::Cell<u64>,
}

impl Backlog {
    /// The bytes held now.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes.get()
    }

    /// Takes `bytes` more, unless the rail holds some already and would go over `limit`
    /// (a frame is always taken by an empty rail, however large). Returns the bytes held
    /// before, as the refusal's figure.
    fn reserve(&self, bytes: u64, limit: u64) -> Result<u64, u64> {
        let held = self.bytes.get();
        if held > 0 && held.saturating_add(bytes) > limit {
            return Err(held);
        }
        self.bytes.set(held + bytes);
        Ok(held + bytes)
    }

    fn release(&self, bytes: u64) {
        self.bytes.set(self.bytes.get().saturating_sub(bytes));
    }
}

/// The parts of an application frame's header that the caller chooses.
#[derive(Clone, Copy)]
pub(super) struct FrameSpec {
    pub(super) kind: FrameKind,
    pub(super) id: u32,
    pub(super) req_id: ReqId,
    pub(super) ttl_ns: u64,
}

impl FrameSpec {
    /// An application active message `id`: no request, no deadline.
    fn am(id: AmId) -> FrameSpec {
        FrameSpec {
            kind: FrameKind::Am,
            id: id.get(),
            req_id: ReqId::NONE,
            ttl_ns: NO_DEADLINE_TTL,
        }
    }
}

/// A frame's payload: owned (a vector, shared bytes or a pool block: moved into a queued or
/// posted send as it is, never copied) or borrowed (copied only if UCX cannot take the frame
/// in place).
pub(super) enum Body<'a> {
    Buf(SendBuf),
    Borrowed(&'a [u8]),
}

/// A [`DATA_AM`] header: built on the stack for short user headers.
enum AmHeader {
    Stack([u8; DATA_HEADER_LEN + STACK_USER], usize),
    Heap(Vec<u8>),
}

impl Body<'_> {
    /// The bytes, when they can be read in place (see [`SendBuf::as_slice`]).
    #[inline]
    fn as_slice(&self) -> Option<&[u8]> {
        match self {
            Body::Buf(b) => b.as_slice(),
            Body::Borrowed(b) => Some(b),
        }
    }

    fn len(&self) -> usize {
        match self {
            Body::Buf(b) => b.len(),
            Body::Borrowed(b) => b.len(),
        }
    }

    fn into_send_buf(self) -> SendBuf {
        match self {
            Body::Buf(b) => b,
            Body::Borrowed(b) => SendBuf::Vec(b.to_vec()),
        }
    }
}

impl AmHeader {
    /// The header of a frame on the rail whose data header is `t`.
    #[inline]
    fn new(t: &DataTemplate, spec: &FrameSpec, flags: FrameFlags, user: &[u8]) -> AmHeader {
        if user.len() <= STACK_USER {
            let mut a = [0u8; DATA_HEADER_LEN + STACK_USER];
            let n = t.write(
                &mut a,
                (spec.kind, spec.id, flags),
                spec.req_id,
                spec.ttl_ns,
            );
            a[n..n + user.len()].copy_from_slice(user);
            AmHeader::Stack(a, n + user.len())
        } else {
            let mut a = [0u8; DATA_HEADER_LEN];
            let n = t.write(
                &mut a,
                (spec.kind, spec.id, flags),
                spec.req_id,
                spec.ttl_ns,
            );
            let mut v = Vec::with_capacity(n + user.len());
            v.extend_from_slice(&a[..n]);
            v.extend_from_slice(user);
            AmHeader::Heap(v)
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            AmHeader::Stack(a, n) => &a[..*n],
            AmHeader::Heap(v) => v,
        }
    }

    fn into_vec(self) -> Vec<u8> {
        match self {
            AmHeader::Stack(a, n) => a[..n].to_vec(),
            AmHeader::Heap(v) => v,
        }
    }
}

/// Control kinds (handshake, heartbeats, close) are the connection's own: refused for
/// applications ([`NetError::BadKind`]).
pub(super) fn check_kind(kind: FrameKind) -> Result<(), NetError> {
    if kind.is_control() {
        return Err(NetError::BadKind {
            kind,
            op: "send an application frame",
        });
    }
    Ok(())
}

/// The size checks every send makes first: the payload against
/// [`super::NetConfig::max_message_size`], the user header against [`MAX_USER_HEADER`] and what
/// the worker's UCX carries in one AM header. ([`fits_in_place`] makes the same tests to let
/// a frame take the fast path of [`known_rail`] and [`send_on_rail`]: a check added here
/// belongs there too.)
#[inline]
pub(super) fn check_sizes(net: &NetState, user: usize, payload: usize) -> Result<(), NetError> {
    let max = net.settings.cfg.max_message_size;
    if payload as u64 > max {
        return Err(NetError::TooLarge {
            len: payload as u64,
            max,
        });
    }
    let room = net
        .max_am_header
        .saturating_sub(DATA_HEADER_LEN)
        .min(MAX_USER_HEADER);
    if user > room {
        return Err(NetError::HeaderTooLarge {
            len: user,
            max: room,
        });
    }
    Ok(())
}

/// Sends an application frame on this shard's rail to `(node, remote)`. When nothing queued
/// must go first: in place when the payload is at most the rendezvous threshold and UCX
/// completes the send at once (its short path), else posted to UCX here from an owned buffer
/// (a borrowed payload is copied then), the rail's sender only tracking its completion.
/// Otherwise queued for the rail's sender task. Sizes are checked first, and control kinds
/// refused.
///
/// Frames leave in order: the sender posts a frame in the same poll in which it takes it from
/// the queue, so an empty queue means every earlier frame is already with UCX, which keeps the
/// order of sends posted on one endpoint.
///
/// From the handler of a frame that came in on that rail (its answer), the rail is the one
/// the dispatch handed over ([`NetState::inline_rail`]): no lookup.
#[inline]
pub(super) fn send(
    ctx: &ShardCtx,
    (node, remote): (NodeId, ShardId),
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    if let Some(tx) = known_rail(ctx, Dest::shard(node, remote), &spec, user, body.len()) {
        return send_on(ctx, node, &tx, spec, user, body);
    }
    send_looked_up(ctx, (node, remote), spec, user, body)
}

/// [`send`] on `tx`, the rail to `(node, remote)` that its caller has just found without a
/// lookup ([`NetState::cached_route`]): not looked for again. A frame that does not pass the
/// checks of [`known_rail`] goes through [`send`], which says why.
#[inline]
pub(super) fn send_on_rail(
    ctx: &ShardCtx,
    (node, remote): (NodeId, ShardId),
    tx: &Rc<RailTx>,
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    if fits_in_place(ctx.net(), &spec, user, body.len()) && tx.template().is_some() {
        return send_on(ctx, node, tx, spec, user, body);
    }
    send(ctx, (node, remote), spec, user, body)
}

/// Whether a frame passes the checks of [`check_sizes`] and [`check_kind`] (what may go on a
/// rail known without a lookup).
#[inline(always)]
fn fits_in_place(net: &NetState, spec: &FrameSpec, user: &[u8], len: usize) -> bool {
    !(spec.kind.is_control()
        || user.len() > MAX_USER_HEADER
        || user.len() + DATA_HEADER_LEN > net.max_am_header
        || len as u64 > net.settings.cfg.max_message_size)
}

/// [`send`] past the rails known without a lookup: the rail looked up.
#[inline(never)]
fn send_looked_up(
    ctx: &ShardCtx,
    (node, remote): (NodeId, ShardId),
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    let net = ctx.net();
    check_sizes(net, user.len(), body.len())?;
    check_kind(spec.kind)?;
    let dest = Dest::shard(node, remote);
    let tx = {
        let peers = net.peers.borrow();
        let p = peers.get(&node).ok_or(NetError::NotConnected { node })?;
        let rail = p.get(remote).ok_or(NetError::NotConnected { node })?;
        net.remember_route(dest, remote, &rail.tx);
        rail.tx.clone()
    };
    send_on(ctx, node, &tx, spec, user, body)
}

/// The rail to `dest` when it is known without a lookup, for a frame that passes the checks
/// of [`check_sizes`] and [`check_kind`] (anything else goes the general way, which says why):
/// the rail of the frame whose handler runs (its answer: [`NetState::inline_rail`]), or the
/// one the last send or route looked up ([`NetState::route_cache`]).
#[inline(always)]
fn known_rail(
    ctx: &ShardCtx,
    dest: Dest,
    spec: &FrameSpec,
    user: &[u8],
    len: usize,
) -> Option<Rc<RailTx>> {
    let net = ctx.net();
    if !fits_in_place(net, spec, user, len) {
        return None;
    }
    if let Some(remote) = dest.shard {
        if let Some(tx) = net.inline_rail_to(dest.node, remote) {
            return Some(tx);
        }
    }
    net.cached_route(dest).map(|(_, tx)| tx)
}

/// [`send`] to `dest` routed from this shard: the rail this shard holds to the remote shard
/// `dest` names (or its default one), known without a lookup ([`known_rail`]) or found with
/// one; [`NetError::OtherShard`] when another local shard holds that rail.
#[inline]
pub(super) fn send_routed(
    ctx: &ShardCtx,
    dest: Dest,
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    if let Some(tx) = known_rail(ctx, dest, &spec, user, body.len()) {
        return send_on(ctx, dest.node, &tx, spec, user, body);
    }
    route_and_send(ctx, dest, spec, user, body)
}

/// [`send_routed`] past the rails known without a lookup: routed and looked up.
#[inline(never)]
fn route_and_send(
    ctx: &ShardCtx,
    dest: Dest,
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    let net = ctx.net();
    let node = dest.node;
    check_sizes(net, user.len(), body.len())?;
    check_kind(spec.kind)?;
    let tx = {
        let peers = net.peers.borrow();
        let p = peers.get(&node).ok_or(NetError::NotConnected { node })?;
        match ctx.route_in(p, dest)? {
            Route::Here(remote) => {
                let rail = p.get(remote).ok_or(NetError::NotConnected { node })?;
                net.remember_route(dest, remote, &rail.tx);
                rail.tx.clone()
            }
            Route::There(owner) => return Err(NetError::OtherShard { node, owner }),
        }
    };
    send_on(ctx, node, &tx, spec, user, body)
}

/// Sends on rail `p` to `node` (see [`send`]): a short borrowed payload in place if it can,
/// else (or for an owned one) [`send_later`].
#[inline]
fn send_on(
    ctx: &ShardCtx,
    node: NodeId,
    p: &RailTx,
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
) -> Result<(), NetError> {
    // An owned buffer whose bytes can be read in place (a vector, shared bytes, a host pool
    // block) goes the same way: UCX copies a short message at once, and the buffer is free.
    let tried = match body.as_slice() {
        Some(bytes) => match send_now_on(ctx, node, p, &spec, user, bytes) {
            Now::Done(r) => return r,
            Now::Later { tried } => tried,
        },
        None => false,
    };
    send_later(ctx, node, p, spec, user, body, tried)
}

/// `dst.copy_from_slice(src)` for the short user headers of the hot path: up to 16 bytes in
/// two overlapping fixed-size moves, instead of a call into the C library's `memcpy` (the call
/// and about 17 instructions of glibc's per copy, in the `--top` list of
/// `scripts/count-instructions`; these are a handful).
#[inline(always)]
fn copy_short(dst: &mut [u8], src: &[u8]) {
    let n = src.len();
    debug_assert_eq!(dst.len(), n);
    if (8..=16).contains(&n) {
        dst[..8].copy_from_slice(&src[..8]);
        dst[n - 8..].copy_from_slice(&src[n - 8..]);
    } else if (4..8).contains(&n) {
        dst[..4].copy_from_slice(&src[..4]);
        dst[n - 4..].copy_from_slice(&src[n - 4..]);
    } else {
        dst.copy_from_slice(src);
    }
}

/// What [`send_now_on`] did.
enum Now {
    /// Sent in place, or failed for good.
    Done(Result<(), NetError>),
    /// To post or queue; `tried`: not to be asked in place again (UCX could not take it, or
    /// it is too long for a send from inside a callback).
    Later { tried: bool },
}

/// The path of an inline answer: a frame whose borrowed payload and user header are short,
/// handed to UCX in place when nothing is queued before it on rail `p` (no copy on our side,
/// no allocation; the header written from the rail's template on the stack).
#[inline(always)]
fn send_now_on(
    ctx: &ShardCtx,
    node: NodeId,
    p: &RailTx,
    spec: &FrameSpec,
    user: &[u8],
    payload: &[u8],
) -> Now {
    let net = ctx.net();
    let later = Now::Later { tried: false };
    if payload.len() > net.settings.cfg.rndv_threshold || user.len() > STACK_USER {
        return later;
    }
    let Some(t) = p.template() else {
        return Now::Done(Err(NetError::NotConnected { node }));
    };
    if !p.out.is_idle() {
        return later;
    }
    let Some(ep) = p.ep.upgrade() else {
        return later;
    };
    let mut a = [0u8; DATA_HEADER_LEN + STACK_USER];
    let n = t.write(
        &mut a,
        (spec.kind, spec.id, FrameFlags::EMPTY),
        spec.req_id,
        spec.ttl_ns,
    );
    let end = n + user.len();
    copy_short(&mut a[n..end], user);
    match in_place(ctx, p, &ep, &a[..end], payload) {
        Ok(()) => {
            net.count(|s| {
                s.sent_in_place += 1;
                s.traffic_of(spec.kind, spec.id, payload.len() as u64, false);
            });
            Now::Done(Ok(()))
        }
        Err(crate::ucx::Error::NoResource) => Now::Later { tried: true },
        Err(_) => {
            p.out.push(Outbound::Failed);
            Now::Done(Err(NetError::Transport { node }))
        }
    }
}

/// Hands a [`DATA_AM`] frame to UCX in place ([`Endpoint::am_send_now`]) on rail `p`. When
/// UCX's send queue to the peer is full ([`crate::ucx::Error::NoResource`]: a shared-memory
/// FIFO, a socket's buffer), a send made from a task waits for room ([`send_paced`]) instead
/// of leaving the frame to be posted or queued behind the full queue.
#[inline(always)]
fn in_place(
    ctx: &ShardCtx,
    p: &RailTx,
    ep: &Endpoint,
    header: &[u8],
    payload: &[u8],
) -> Result<(), crate::ucx::Error> {
    match ep.am_send_now(DATA_AM, header, payload) {
        Err(crate::ucx::Error::NoResource) => send_paced(ctx, p, ep, header, payload),
        done => done,
    }
}

/// Progress rounds of [`send_paced`] between two looks at its clock.
const PACE_LOOK: u32 = 16;

/// After a wait of [`send_paced`] gave up, the rail's sends do not wait again for this many
/// times [`super::NetConfig::send_pace`].
const PACE_BACKOFF: u32 = 20;

/// A producer that outruns its receiver is paced, as `ucx_perftest`'s sender is: a frame that
/// found UCX's send queue full is offered again after each `progress` of the shard's worker
/// (which moves the queue on), for at most [`super::NetConfig::send_pace`]. Without it, every
/// frame after the first that found the queue full was posted with a request of its own or
/// copied into the rail's queue until the producer yielded: a loop of 8192 sends of 64 bytes
/// on shared memory ran at 2.2–2.5 M/s that way, against 3.7–3.8 M/s paced
/// (`scripts/compare-perftest --tls sm --tests am-rate --window 8192`; README, "A producer
/// that outruns its receiver").
///
/// Only from a task: not from what the driver runs (a handler, inline in UCX's callback,
/// where the worker cannot be progressed, or from the driver's dispatch of recorded frames; a
/// send the mesh forwarded to this shard), which must not hold up the shard's other traffic
/// for one peer: the frame is posted or queued at once. Frames that UCX delivers during these
/// `progress` calls are recorded for the driver, in order, as behind any recorded input
/// (`NetState::dispatching` is set meanwhile): no handler runs inside a task's send. The
/// driver is woken for them. glommio's preempt timer is not looked at: the task
/// keeps the thread whether it waits here or queues its frames, until it yields. A wait that
/// gives up (a stalled peer) keeps the rail's sends from waiting for [`PACE_BACKOFF`] times
/// the span ([`RailTx::pace_after`]).
#[inline(never)]
fn send_paced(
    ctx: &ShardCtx,
    p: &RailTx,
    ep: &Endpoint,
    header: &[u8],
    payload: &[u8],
) -> Result<(), crate::ucx::Error> {
    let net = ctx.net();
    let span = net.settings.cfg.send_pace;
    let worker = ctx.worker();
    if span.is_zero() || ctx.driver_polling() || worker.in_progress() || net.dispatching.get() {
        return Err(crate::ucx::Error::NoResource);
    }
    let start = std::time::Instant::now();
    if p.pace_after.get().is_some_and(|t| start < t) {
        return Err(crate::ucx::Error::NoResource);
    }
    net.dispatching.set(true);
    let mut rounds = 0u32;
    let sent = loop {
        worker.progress();
        match ep.am_send_now(DATA_AM, header, payload) {
            Err(crate::ucx::Error::NoResource) => {}
            done => break done,
        }
        rounds += 1;
        if rounds % PACE_LOOK == 0 && start.elapsed() >= span {
            break Err(crate::ucx::Error::NoResource);
        }
    };
    net.dispatching.set(false);
    let gave_up = matches!(sent, Err(crate::ucx::Error::NoResource));
    if gave_up {
        p.pace_after.set(Some(start + span * PACE_BACKOFF));
    }
    net.count(|s| match (&sent, gave_up) {
        (Ok(()), _) => s.sends_paced += 1,
        (_, true) => s.pace_timeouts += 1,
        _ => {}
    });
    if !net.inbox.borrow().is_empty() {
        ctx.wake_driver();
    }
    sent
}

/// Sends on rail `p` to `node` from an owned buffer (a borrowed payload is copied): posted to
/// UCX at once when nothing is queued before it (in place first, unless `tried`), else queued
/// for the rail's sender (see [`send`]).
#[inline(never)]
fn send_later(
    ctx: &ShardCtx,
    node: NodeId,
    p: &RailTx,
    spec: FrameSpec,
    user: &[u8],
    body: Body<'_>,
    tried: bool,
) -> Result<(), NetError> {
    let net = ctx.net();
    let len = body.len();
    let rndv = len > net.settings.cfg.rndv_threshold;
    let flags = if rndv {
        FrameFlags::RNDV
    } else {
        FrameFlags::EMPTY
    };
    let template = p.template().ok_or(NetError::NotConnected { node })?;
    let am = AmHeader::new(&template, &spec, flags, user);
    // Nothing queued before this frame: hand it to UCX here, in order, with no task switch;
    // in place when UCX takes it at once, else posted from an owned buffer.
    let idle_ep = p.out.is_idle().then(|| p.ep.upgrade()).flatten();
    if let Some(ep) = idle_ep {
        if let (false, false, Some(bytes)) = (tried, rndv, body.as_slice()) {
            match in_place(ctx, p, &ep, am.as_slice(), bytes) {
                Ok(()) => {
                    net.count(|s| {
                        s.sent_in_place += 1;
                        s.traffic_of(spec.kind, spec.id, len as u64, false);
                    });
                    return Ok(());
                }
                Err(crate::ucx::Error::NoResource) => {}
                Err(_) => {
                    p.out.push(Outbound::Failed);
                    return Err(NetError::Transport { node });
                }
            }
        }
        let proto = if rndv {
            AmProto::Rendezvous
        } else {
            AmProto::Eager
        };
        let bytes = reserve(net, node, p, am.as_slice().len() + len)?;
        let mut send = ep.am_send(DATA_AM, am.as_slice(), body.into_send_buf(), proto);
        // The first poll posts the send (the waker is the sender's from its first poll on).
        let first = Pin::new(&mut send).poll(&mut std::task::Context::from_waker(Waker::noop()));
        net.count(|s| {
            s.sent_posted += 1;
            s.traffic_of(spec.kind, spec.id, len as u64, false);
        });
        if first.is_ready() {
            p.backlog.release(bytes);
        }
        return match first {
            Poll::Ready((Ok(()), _)) => Ok(()),
            Poll::Ready((Err(_), _)) => {
                p.out.push(Outbound::Failed);
                Err(NetError::Transport { node })
            }
            Poll::Pending if p.out.push(Outbound::Posted { send, rndv, bytes }) => {
                ctx.wake_driver();
                Ok(())
            }
            // Closed meanwhile: dropping the send parks its buffer with UCX.
            Poll::Pending => {
                p.backlog.release(bytes);
                Err(NetError::NotConnected { node })
            }
        };
    }
    let bytes = reserve(net, node, p, am.as_slice().len() + len)?;
    let item = Outbound::Data {
        header: am.into_vec(),
        payload: body.into_send_buf(),
        rndv,
        bytes,
    };
    if p.out.push(item) {
        net.count(|s| {
            s.sent_queued += 1;
            s.traffic_of(spec.kind, spec.id, len as u64, false);
        });
        // The sender is runnable now: the driver yields to it at its next round.
        ctx.wake_driver();
        Ok(())
    } else {
        p.backlog.release(bytes);
        Err(NetError::NotConnected { node })
    }
}

/// Reserves `bytes` of rail `p`'s backlog for a frame about to be queued or posted, or
/// refuses it ([`NetError::Backlogged`], counted); returns the bytes reserved.
fn reserve(net: &NetState, node: NodeId, p: &RailTx, bytes: usize) -> Result<u64, NetError> {
    let bytes = bytes as u64;
    let limit = net.settings.cfg.max_backlog_bytes;
    match p.backlog.reserve(bytes, limit) {
        Ok(held) => {
            if held > net.backlog_peak.get() {
                net.backlog_peak.set(held);
                net.count(|s| s.backlog_peak_bytes = held);
            }
            Ok(bytes)
        }
        Err(held) => {
            net.count(|s| s.sends_backlogged += 1);
            Err(NetError::Backlogged { node, held, limit })
        }
    }
}

/// Owns a connection's endpoint: sends its queued frames in order; reports the endpoint's
/// failure.
///
/// A frame is posted as soon as it is taken from the queue; an eager send UCX does not complete
/// at once stays in flight (its buffer with it) while later frames are posted, up to
/// [`MAX_IN_FLIGHT`]. A rendezvous frame's completion (the peer has pulled the data) is awaited
/// by a task of its own, within [`super::NetConfig::rndv_timeout`], so that heartbeats and
/// small frames are not held up behind a large transfer. Those tasks count as live senders, so
/// that shutdown waits for them within the linger time.
pub(super) async fn sender(
    ctx: Weak<ShardCtx>,
    ep: Rc<Endpoint>,
    (out, backlog): (Rc<Queue<Outbound>>, Rc<Backlog>),
    (node, remote, generation): (NodeId, ShardId, u64),
    live: Rc<std::cell::Cell<usize>>,
    (linger, rndv_timeout): (Duration, Duration),
) {
    enum Next {
        Frame(Option<Outbound>),
        Failed,
    }
    let report = |ctx: &Weak<ShardCtx>| {
        if let Some(c) = ctx.upgrade() {
            c.net()
                .inbox
                .borrow_mut()
                .push_back(Inbound::TransportError {
                    node,
                    remote,
                    generation,
                });
            c.wake_driver();
        }
    };
    let mut in_flight: VecDeque<(AmSend<SendBuf>, u64)> = VecDeque::new();
    let mut failed = ep.failed();
    loop {
        let next = poll_fn(|cx| {
            while let Some((f, bytes)) = in_flight.front_mut() {
                match Pin::new(f).poll(cx) {
                    Poll::Ready((Ok(()), _)) => {
                        backlog.release(*bytes);
                        in_flight.pop_front();
                    }
                    Poll::Ready((Err(_), _)) => return Poll::Ready(Next::Failed),
                    Poll::Pending => break,
                }
            }
            if in_flight.len() < MAX_IN_FLIGHT {
                if let Poll::Ready(item) = out.poll_next(cx) {
                    return Poll::Ready(Next::Frame(item));
                }
            }
            if Pin::new(&mut failed).poll(cx).is_ready() {
                return Poll::Ready(Next::Failed);
            }
            Poll::Pending
        })
        .await;
        let (mut send, rndv, posted, bytes, liveness) = match next {
            Next::Frame(Some(Outbound::Control(header, payload, liveness))) => (
                ep.am_send(FRAME_AM, &header, SendBuf::Vec(payload), AmProto::Eager),
                false,
                false,
                0,
                liveness,
            ),
            Next::Frame(Some(Outbound::Posted { send, rndv, bytes })) => {
                (send, rndv, true, bytes, false)
            }
            Next::Frame(Some(Outbound::Data {
                header,
                payload,
                rndv,
                bytes,
            })) => {
                let proto = if rndv {
                    AmProto::Rendezvous
                } else {
                    AmProto::Eager
                };
                (
                    ep.am_send(DATA_AM, &header, payload, proto),
                    rndv,
                    false,
                    bytes,
                    false,
                )
            }
            Next::Frame(Some(Outbound::Failed)) | Next::Failed => {
                report(&ctx);
                break;
            }
            Next::Frame(None) => break,
        };
        // The first poll posts the send, so frames leave in queue order (a send posted by
        // `send` is in flight already).
        let first = if posted {
            None
        } else {
            let first = future::poll_once(&mut send).await;
            match ctx.upgrade() {
                Some(c) if liveness => c.nudge_driver(),
                Some(c) => c.wake_driver(),
                None => {}
            }
            first
        };
        match first {
            Some((Ok(()), _)) => backlog.release(bytes),
            Some((Err(_), _)) => {
                backlog.release(bytes);
                report(&ctx);
                break;
            }
            None if !rndv => in_flight.push_back((send, bytes)),
            None => {
                let ctx = ctx.clone();
                let live = live.clone();
                let backlog = backlog.clone();
                live.set(live.get() + 1);
                // Counted until the peer has pulled the data (see `super::shutdown`).
                let pulling = ctx.upgrade().map(|c| c.net().rndv_in_flight.clone());
                if let Some(n) = &pulling {
                    n.set(n.get() + 1);
                }
                glommio::spawn_local(async move {
                    // Dropping the send on timeout cancels it; UCX keeps the buffer parked
                    // until it lets go of it.
                    let done = future::or(async { send.await.0.is_ok() }, async {
                        sleep(rndv_timeout).await;
                        false
                    })
                    .await;
                    backlog.release(bytes);
                    if !done {
                        if let Some(c) = ctx.upgrade() {
                            c.net()
                                .inbox
                                .borrow_mut()
                                .push_back(Inbound::TransportError {
                                    node,
                                    remote,
                                    generation,
                                });
                            c.wake_driver();
                        }
                    }
                    if let Some(n) = pulling {
                        n.set(n.get() - 1);
                    }
                    live.set(live.get() - 1);
                })
                .detach();
            }
        }
    }
    // Frames left in the queue (the sender failed) go with it: their bytes leave the backlog.
    while let Some(item) = out.try_next() {
        if let Outbound::Data { bytes, .. } | Outbound::Posted { bytes, .. } = item {
            backlog.release(bytes);
        }
    }
    // Let the last frames (a reject, a close) leave before the endpoint goes.
    let _ = future::or(
        async {
            for (f, bytes) in in_flight {
                let _ = f.await;
                backlog.release(bytes);
            }
            ep.flush().await
        },
        async {
            sleep(linger).await;
            Ok(())
        },
    )
    .await;
}

impl<T> Queue<T> {
    /// The next item, or `None` once closed and empty; registers the waker otherwise.
    pub(crate) fn poll_next(&self, cx: &mut std::task::Context<'_>) -> Poll<Option<T>> {
        if let Some(item) = self.try_next() {
            Poll::Ready(Some(item))
        } else if self.closed.get() {
            Poll::Ready(None)
        } else {
            *self.waker.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    }
}

impl ShardCtx {
    /// Sends application frame `kind` (with `id`, `req_id`, no deadline, the application's
    /// `user_header` and `payload`) to `dest` at once, from this shard: on its default rail to
    /// the node, or its rail to the named shard. This is the inline answer of a handler: UCX
    /// takes the frame in place when it can (no copy, no allocation, no task); otherwise it is
    /// copied and queued for the rail's sender, behind anything queued before it. Returns once
    /// the frame is with UCX or queued. Errors before anything is sent:
    /// [`NetError::NotConnected`] (no ready rail), [`NetError::OtherShard`] (another local
    /// shard holds the rail to that remote shard: send from there, or with the async
    /// [`ShardCtx::send_frame`]), [`NetError::TooLarge`], [`NetError::HeaderTooLarge`],
    /// [`NetError::BadKind`] (control kinds).
    pub fn send_frame_now(
        &self,
        dest: impl Into<Dest>,
        kind: FrameKind,
        (id, req_id): (u32, ReqId),
        user_header: &[u8],
        payload: &[u8],
    ) -> Result<(), NetError> {
        let dest = dest.into();
        let spec = FrameSpec {
            kind,
            id,
            req_id,
            ttl_ns: NO_DEADLINE_TTL,
        };
        send_routed(self, dest, spec, user_header, Body::Borrowed(payload))
    }

    /// [`ShardCtx::send_frame_now`] of an active message `id`.
    pub fn send_am_now(
        &self,
        dest: impl Into<Dest>,
        id: AmId,
        user_header: &[u8],
        payload: &[u8],
    ) -> Result<(), NetError> {
        self.send_frame_now(
            dest,
            FrameKind::Am,
            (id.get(), ReqId::NONE),
            user_header,
            payload,
        )
    }

    /// Sends active message `id` with `user_header` and the bytes of `buf` to `dest` at once,
    /// from this shard, without copying them: a vector is moved, shared bytes (an
    /// `Rc<[u8]>`) and pool blocks ([`crate::PoolBuf`]) are sent from where they are, so a
    /// loop can send one buffer many times, and rendezvous payloads (over
    /// [`super::NetConfig::rndv_threshold`]) are read by UCX straight from it (a pool block's
    /// registration is found in UCX's cache: UCX 1.12 takes no memory handle per operation).
    /// The buffer is held until UCX is done with it. Otherwise as
    /// [`ShardCtx::send_frame_now`], with the same errors.
    pub fn send_am_buf_now(
        &self,
        dest: impl Into<Dest>,
        id: AmId,
        user_header: &[u8],
        buf: impl Into<SendBuf>,
    ) -> Result<(), NetError> {
        let dest = dest.into();
        let buf = buf.into();
        send_routed(self, dest, FrameSpec::am(id), user_header, Body::Buf(buf))
    }

    /// Sends application frame `id` with `payload` to `dest` from any shard (forwarded to the
    /// local shard that holds the rail when that is another). Resolves once the frame is with
    /// UCX or queued on the rail. Payloads over [`super::NetConfig::rndv_threshold`] go by
    /// rendezvous (see [`ShardCtx::set_net_handler_rndv`]); over
    /// [`super::NetConfig::max_message_size`] they are refused with [`NetError::TooLarge`].
    pub async fn send_am(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        id: AmId,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let spec = FrameSpec::am(id);
        self.send_spec(dest.into(), spec, Vec::new(), payload).await
    }

    /// Sends active message `id` with the application's `user_header` and `payload` to `dest`,
    /// from any shard: at once when this shard holds the rail (see
    /// [`ShardCtx::send_frame_now`]), forwarded with a copy of both otherwise.
    pub async fn send_am_parts(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        id: AmId,
        user_header: &[u8],
        payload: &[u8],
    ) -> Result<(), NetError> {
        let dest = dest.into();
        check_sizes(self.net(), user_header.len(), payload.len())?;
        let spec = FrameSpec::am(id);
        match self.route(dest)? {
            Route::Here(remote) => send(
                self,
                (dest.node, remote),
                spec,
                user_header,
                Body::Borrowed(payload),
            ),
            Route::There(_) => {
                self.send_spec(dest, spec, user_header.to_vec(), payload.to_vec())
                    .await
            }
        }
    }

    /// Sends one application frame of `kind` with `id` and `req_id` (no deadline) to `dest`,
    /// from any shard (forwarded to the local shard that holds the rail when that is another).
    /// Resolves once the frame is with UCX or queued on the rail. Payloads over
    /// [`super::NetConfig::rndv_threshold`] go by rendezvous; over
    /// [`super::NetConfig::max_message_size`] they are refused ([`NetError::TooLarge`]).
    /// Control kinds are refused ([`NetError::BadKind`]).
    pub async fn send_frame(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
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
        self.send_spec(dest.into(), spec, Vec::new(), payload).await
    }

    /// [`NetError::TooLarge`] for a payload over [`super::NetConfig::max_message_size`].
    pub(super) fn check_len(&self, payload: &[u8]) -> Result<(), NetError> {
        check_sizes(self.net(), 0, payload.len())
    }

    /// Sends `spec` with `user` and `payload` to `dest`, from this shard or the one that holds
    /// the rail.
    pub(super) async fn send_spec(
        self: &Rc<Self>,
        dest: Dest,
        spec: FrameSpec,
        user: Vec<u8>,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        // Refused here, before the payload crosses to another shard.
        check_sizes(self.net(), user.len(), payload.len())?;
        check_kind(spec.kind)?;
        let node = dest.node;
        match self.route(dest)? {
            Route::Here(remote) => {
                send(self, (node, remote), spec, &user, Body::Buf(payload.into()))
            }
            Route::There(owner) => {
                self.forward(owner, move |c| async move {
                    match c.route(dest)? {
                        Route::Here(remote) => {
                            send(&c, (node, remote), spec, &user, Body::Buf(payload.into()))
                        }
                        Route::There(_) => Err(NetError::NotConnected { node }),
                    }
                })
                .await?
            }
        }
    }

    /// Answers `request` like [`ShardCtx::reply`], at once and without a task, on the rail it
    /// came in on (frame handlers run on that rail's shard): UCX takes the reply in place when
    /// it can, else the payload is copied and queued (see [`ShardCtx::send_frame_now`]).
    /// Errors: [`NetError::BadKind`], [`NetError::TooLarge`], and [`NetError::NotConnected`]
    /// when that rail is not ready on this shard.
    pub fn reply_now(
        &self,
        node: NodeId,
        request: &FrameHeader,
        kind: FrameKind,
        payload: &[u8],
    ) -> Result<(), NetError> {
        let spec = super::request::reply_spec(request, kind)?;
        send(
            self,
            (node, request.src_shard),
            spec,
            &[],
            Body::Borrowed(payload),
        )
    }

    /// Answers `request` (a frame header given to a [`ShardCtx::set_frame_handler`] handler)
    /// from `node` with a reply of `kind`, from any shard, on the rail the request came in on:
    /// [`FrameKind::RpcResponse`] or [`FrameKind::RpcError`] for an [`FrameKind::RpcRequest`],
    /// [`FrameKind::RmaReply`] for [`FrameKind::RmaPut`] and [`FrameKind::RmaGet`] (else
    /// [`NetError::BadKind`]). The reply carries the request's `id` and `req_id`.
    pub async fn reply(
        self: &Rc<Self>,
        node: NodeId,
        request: &FrameHeader,
        kind: FrameKind,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let spec = super::request::reply_spec(request, kind)?;
        self.send_spec(
            Dest::shard(node, request.src_shard),
            spec,
            Vec::new(),
            payload,
        )
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::copy_short;

    #[test]
    fn copy_short_copies_every_length_exactly() {
        let src: Vec<u8> = (1..=40).collect();
        for n in 0..=src.len() {
            let mut dst = vec![0xEEu8; n + 2];
            copy_short(&mut dst[1..=n], &src[..n]);
            assert_eq!(&dst[1..=n], &src[..n], "length {n}");
            assert_eq!(
                (dst[0], dst[n + 1]),
                (0xEE, 0xEE),
                "length {n}: wrote outside"
            );
        }
    }
}
