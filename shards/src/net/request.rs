//! Requests: sent from the shard that holds the rail, answered by a reply frame on the same
//! rail, bounded by a deadline, and cancelled when their caller gives up.
//!
//! [`ShardCtx::request`] runs on the shard that holds the rail to the destination: the calling
//! shard for its default rail, else the local shard holding the rail to the named remote shard
//! (forwarded there, and its result forwarded back). Each shard keeps one [`PendingTable`] of
//! requests for all its rails, so request ids are never reused on a rail, even across sessions.
//! The request's deadline (`now + timeout`) travels as the frame's `ttl_ns`. The request ends
//! with the first of: a matching reply; its deadline ([`NetError::TimedOut`]); the failure or
//! close of the connection, which fails every request pending for that node with the
//! connection's error ([`NetError::PeerDead`], [`NetError::Transport`], [`NetError::Closed`]);
//! a restart of the peer (its old incarnation's requests fail with [`NetError::Closed`]); this
//! node's shutdown, which first waits for pending requests' answers for at most the mesh's
//! drain timeout ([`NetError::ShuttingDown`] after it). A dropped request future removes its
//! entry, also when the caller is on another shard: the forwarded job on the rail's shard races the
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
//! [`PendingTable`]: crate::proto::PendingTable

use std::future::{poll_fn, Future};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::future;
use glommio::timer::sleep;

use super::inbound::Payload;
use super::outbound::{send, send_on_rail, send_routed, Body, FrameSpec};
use super::{Dest, NetError, Route, Slot, MAX_REQUEST_TIMEOUT};
use crate::boot::ShardCtx;
use crate::proto::wire::{ttl_from_deadline, NO_DEADLINE_TTL};
use crate::proto::{FrameHeader, FrameKind, NodeId, ReqId, ShardId};

/// What a request resolves with on its owner shard.
pub(super) type Reply = Result<(FrameHeader, Payload), NetError>;

/// A request in flight on the shard that owns its node.
pub(crate) struct Pending {
    pub(super) node: NodeId,
    /// The remote shard of the rail it went out on (its reply must come back on it).
    pub(super) remote: ShardId,
    pub(super) kind: FrameKind,
    /// The frame's `id` (for the [`FrameKind::RpcCancel`] sent when it times out).
    pub(super) id: u32,
    pub(super) waiter: Waiter,
}

/// The handler of requests sent with [`ShardCtx::request_then`]: called on the sending shard
/// with the token the request was sent with and its answer (the reply's header and payload, or
/// the request's error). Registered once and shared by every request that names it: a request
/// sent this way allocates nothing.
pub type ReplyHandler = Rc<dyn Fn(u64, Result<(FrameHeader, Payload), NetError>)>;

/// Who gets a pending request's answer.
pub(crate) enum Waiter {
    /// The task of [`ShardCtx::request`] and the like, woken.
    Task(Rc<Slot<Reply>>),
    /// The handler of [`ShardCtx::request_then`], called at once with the request's token.
    Handler(ReplyHandler, u64),
}

impl Waiter {
    /// Gives the request's answer to its waiter. Called with no borrow of the net state held:
    /// a handler may send (another request, too). A handler that panics loses only this
    /// answer, counted in [`NetStats::handler_panics`](super::NetStats::handler_panics).
    pub(super) fn answer(self, net: &super::NetState, reply: Reply) {
        match self {
            Waiter::Task(slot) => slot.push(reply),
            Waiter::Handler(handler, token) => {
                let called = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    handler(token, reply);
                }));
                if called.is_err() {
                    net.count(|s| s.handler_panics += 1);
                }
            }
        }
    }
}

/// Kinds a [`ShardCtx::request`] may send.
pub(super) fn is_request_kind(k: FrameKind) -> bool {
    matches!(
        k,
        FrameKind::RpcRequest | FrameKind::RmaPut | FrameKind::RmaGet
    )
}

/// Kinds that answer a request (they complete a pending entry).
pub(super) fn is_reply_kind(k: FrameKind) -> bool {
    matches!(
        k,
        FrameKind::RpcResponse | FrameKind::RpcError | FrameKind::RmaReply
    )
}

/// Whether `reply` answers a request of kind `request`.
pub(super) fn reply_fits(request: FrameKind, reply: FrameKind) -> bool {
    matches!(
        (request, reply),
        (
            FrameKind::RpcRequest,
            FrameKind::RpcResponse | FrameKind::RpcError
        ) | (FrameKind::RmaPut | FrameKind::RmaGet, FrameKind::RmaReply)
    )
}

/// Cancels a pending request when its future ends or is dropped (no-op once completed). An
/// RPC request that was still pending (its caller gave up: dropped, or timed out) is followed
/// by an [`FrameKind::RpcCancel`] frame with its `id` and `req_id`, so that the server can stop
/// working on it.
struct PendingGuard<'a> {
    ctx: &'a ShardCtx,
    rail: (NodeId, ShardId),
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
            send_cancel(self.ctx, self.rail, self.spec.id, self.spec.req_id);
        }
    }
}

/// Sends the [`FrameKind::RpcCancel`] of an RPC request given up (dropped or timed out).
pub(super) fn send_cancel(ctx: &ShardCtx, rail: (NodeId, ShardId), id: u32, req_id: ReqId) {
    let cancel = FrameSpec {
        kind: FrameKind::RpcCancel,
        id,
        req_id,
        ttl_ns: NO_DEADLINE_TTL,
    };
    // Best effort: a connection that has gone has taken the request with it.
    if send(ctx, rail, cancel, &[], Body::Borrowed(&[])).is_ok() {
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

/// Sends a request on this shard's rail to `(node, remote)` and waits for the reply, at most
/// `timeout` from `start` (the caller's clock reading when it has one, else now); the frame's
/// `ttl_ns` is `ttl` (at most `timeout`).
///
/// The deadline has no timer of its own: the net task's timer, armed for the shard's earliest
/// deadline, fails the request at its deadline, as precisely as a timer of its
/// own would (glommio's timers, and the executor's wake-up). Only when the net task has ended
/// (after shut-down) does a request wait with a timer of its own.
async fn request_local(
    ctx: &Rc<ShardCtx>,
    (node, remote): (NodeId, ShardId),
    (kind, id): (FrameKind, u32),
    payload: Vec<u8>,
    (timeout, ttl): (Duration, Duration),
    start: Option<Instant>,
) -> Reply {
    if !is_request_kind(kind) {
        return Err(NetError::BadKind {
            kind,
            op: "send a request",
        });
    }
    let net = ctx.net();
    let timeout = timeout.min(MAX_REQUEST_TIMEOUT);
    let now = start.map_or_else(|| net.now(), super::timestamp_of);
    let deadline = now.saturating_add(timeout);
    // An answered request's waiter when there is one: no allocation per request.
    let waiter = net
        .spare_waiters
        .borrow_mut()
        .pop()
        .unwrap_or_else(Slot::new);
    let spec = enter_pending(
        net,
        (node, remote),
        (kind, id),
        (now, deadline, ttl.min(timeout)),
        Waiter::Task(waiter.clone()),
    );
    let mut guard = PendingGuard {
        ctx,
        rail: (node, remote),
        spec: FrameSpec {
            ttl_ns: NO_DEADLINE_TTL,
            ..spec
        },
        armed: true,
    };
    send_encoded(ctx, payload, |body| {
        send(ctx, (node, remote), spec, &[], body)
    })?;
    if net.closed.get() {
        let got = future::or(async { Some(waiter.wait().await) }, async {
            sleep(deadline.saturating_duration_since(net.now())).await;
            None
        })
        .await;
        return got.unwrap_or(Err(NetError::TimedOut { what: "request" }));
    }
    if deadline < net.timer_at.get() {
        // Due before the net task's timer: it re-arms on this wake-up.
        net.rearm();
    }
    let answer = waiter.wait().await;
    // Every answer is given after its entry left the table (reply, expiry, failure, drain).
    guard.armed = false;
    // Nothing else holds the waiter once its entry is gone: kept for a next request.
    if Rc::strong_count(&waiter) == 1 {
        let mut spare = net.spare_waiters.borrow_mut();
        if spare.len() < SPARE_WAITERS {
            waiter.reset();
            spare.push(waiter);
        }
    }
    answer
}

/// Enters a request to `rail` in the shard's pending table, due at `deadline`, and returns the
/// frame to send it with: a fresh request id, `ttl` (from `now`) announced to the receiver.
fn enter_pending(
    net: &super::NetState,
    (node, remote): (NodeId, ShardId),
    (kind, id): (FrameKind, u32),
    (now, deadline, ttl): (crate::proto::Timestamp, crate::proto::Timestamp, Duration),
    waiter: Waiter,
) -> FrameSpec {
    let req_id = net.pending.borrow_mut().insert(
        deadline,
        Pending {
            node,
            remote,
            kind,
            id,
            waiter,
        },
    );
    FrameSpec {
        kind,
        id,
        req_id,
        ttl_ns: ttl_from_deadline(now, now.saturating_add(ttl)),
    }
}

/// Sends an encoded request `payload` with `send`: one of at most [`RECYCLED_REQUEST`] bytes from
/// its vector in place (copied when UCX cannot take it at once), the vector then kept for the
/// next request's encoding ([`ShardCtx::request_buffer`]), sent or not; a longer one handed over
/// whole (not copied when UCX keeps it).
fn send_encoded(
    ctx: &ShardCtx,
    payload: Vec<u8>,
    send: impl FnOnce(Body<'_>) -> Result<(), NetError>,
) -> Result<(), NetError> {
    if payload.len() <= RECYCLED_REQUEST {
        let sent = send(Body::Borrowed(&payload));
        // Kept unless it is smaller than the spare (a request forwarded from another shard,
        // made as a small vector, does not displace this shard's encoding buffer).
        ctx.net().spare_request.give(payload);
        sent
    } else {
        send(Body::Buf(payload.into()))
    }
}

/// The most answered requests' waiters a shard keeps for the next requests (a window of this
/// many calls in flight together allocates no waiter).
pub(super) const SPARE_WAITERS: usize = 256;

/// Requests up to this long are sent from their vector in place, and the vector is kept for the
/// next request's encoding ([`ShardCtx::request_buffer`]): no allocation per request. Longer
/// ones are handed to the sender (not copied when UCX keeps them).
pub(super) const RECYCLED_REQUEST: usize = 1024;

impl ShardCtx {
    /// An empty vector to encode a request's payload into, for [`ShardCtx::request`] and the
    /// like on this shard: the one a short request sent here left (with its capacity), else a
    /// new one (no capacity: the encoder reserves what it needs). Requests of at most 1 KiB give
    /// their vector back once sent, so a stream of calls allocates none.
    pub fn request_buffer(&self) -> Vec<u8> {
        self.net().spare_request.take()
    }

    /// Sends a one-way request frame of `kind` (no request id: nothing answers it) with `id`
    /// and `payload`, encoded in [`ShardCtx::request_buffer`]'s vector, to `dest` at once from
    /// this shard, as [`ShardCtx::send_frame_now`] does: a payload of at most 1 KiB goes from
    /// the vector in place and the vector is kept for the next request's encoding (sent or
    /// not), so a stream of them allocates nothing; a longer one is handed over whole. With
    /// the errors of [`ShardCtx::send_frame_now`], before anything is sent (the vector is
    /// gone then: encode again for [`ShardCtx::send_frame`]).
    pub fn send_one_way_now(
        &self,
        dest: impl Into<Dest>,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
    ) -> Result<(), NetError> {
        let dest = dest.into();
        let spec = FrameSpec {
            kind,
            id,
            req_id: ReqId::NONE,
            ttl_ns: NO_DEADLINE_TTL,
        };
        send_encoded(self, payload, |body| {
            send_routed(self, dest, spec, &[], body)
        })
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
        node: impl Into<Dest>,
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
    ///
    /// [`NetStats::cancels_sent`]: super::NetStats::cancels_sent
    pub async fn request_with_ttl(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
        timeout: Duration,
        ttl: Duration,
    ) -> Result<(FrameHeader, Vec<u8>), NetError> {
        self.check_len(&payload)?;
        let dest = dest.into();
        let node = dest.node;
        match self.route(dest)? {
            Route::Here(remote) => request_local(
                self,
                (node, remote),
                (kind, id),
                payload,
                (timeout, ttl),
                None,
            )
            .await
            .map(|(h, p)| (h, p.into_vec())),
            Route::There(owner) => {
                let cancel = Arc::new(ForwardCancel::default());
                let mut on_drop = CancelOnDrop(Some(cancel.clone()));
                let got = self
                    .forward(owner, move |c| async move {
                        let Route::Here(remote) = c.route(dest)? else {
                            return Err(NetError::NotConnected { node });
                        };
                        future::or(
                            async {
                                request_local(
                                    &c,
                                    (node, remote),
                                    (kind, id),
                                    payload,
                                    (timeout, ttl),
                                    None,
                                )
                                .await
                                .map(|(h, p)| (h, p.into_vec()))
                            },
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
    }

    /// [`ShardCtx::request`] from this shard only, resolving with the reply's [`Payload`] as it
    /// arrived (UCX's descriptor for eager replies: no copy). `dest` must be reachable on a
    /// rail of this shard ([`NetError::OtherShard`] otherwise).
    pub async fn request_here(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
        (timeout, ttl): (Duration, Duration),
    ) -> Result<(FrameHeader, Payload), NetError> {
        self.request_here_since(dest, kind, id, payload, (timeout, ttl), None)
            .await
    }

    /// [`ShardCtx::request_here`] whose `timeout` counts from `start`, a clock reading the
    /// caller took anyway (the request then reads no clock of its own).
    pub async fn request_here_since(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        kind: FrameKind,
        id: u32,
        payload: Vec<u8>,
        (timeout, ttl): (Duration, Duration),
        start: Option<Instant>,
    ) -> Result<(FrameHeader, Payload), NetError> {
        self.check_len(&payload)?;
        let dest = dest.into();
        match self.route(dest)? {
            Route::Here(remote) => {
                request_local(
                    self,
                    (dest.node, remote),
                    (kind, id),
                    payload,
                    (timeout, ttl),
                    start,
                )
                .await
            }
            Route::There(owner) => Err(NetError::OtherShard {
                node: dest.node,
                owner,
            }),
        }
    }
}

/// A request sent with [`ShardCtx::request_then`], for [`ShardCtx::cancel_request`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SentRequest {
    rail: (NodeId, ShardId),
    kind: FrameKind,
    id: u32,
    req_id: ReqId,
}

impl SentRequest {
    /// The request id it went out with (fresh on this shard, never reused on its rail).
    pub fn req_id(&self) -> ReqId {
        self.req_id
    }

    /// The node and remote shard of the rail it went out on.
    pub fn rail(&self) -> (NodeId, ShardId) {
        self.rail
    }
}

impl ShardCtx {
    /// Sends a request as [`ShardCtx::request_here`] does, on a rail of this shard, and returns
    /// at once: its answer goes to `handler`, called with `token` on this shard, inline where
    /// the answer is found — by the progress driver right after the reply's dispatch, by the
    /// net task when the deadline passes ([`NetError::TimedOut`]), when the rail fails or
    /// closes, or at shutdown — exactly once per request sent, and never before this returns.
    /// No task is woken and, with a short payload, nothing is allocated: the handler may send
    /// the next request itself (a ping-pong or a sliding window of calls driven from replies).
    ///
    /// The deadline counts from the shard's batch clock ([`timeout`] at most
    /// [`MAX_REQUEST_TIMEOUT`]): called from a handler that runs inside UCX's callback (a
    /// reply's, say), from the reading its batch of frames took, which is as old as the
    /// batch's handlers have run (a batch stops once glommio's preempt timer fires, about
    /// [`crate::PREEMPT_TIMER`], more only behind a handler that itself runs long), so the
    /// deadline comes that much sooner; elsewhere from a fresh reading. A timeout shorter than
    /// that can fail at once with [`NetError::TimedOut`]. `ttl` is what the frame announces to
    /// the receiver. Errors,
    /// before anything is sent and with the handler not called: those of
    /// [`ShardCtx::request_here`] ([`NetError::OtherShard`] when another shard holds the rail),
    /// [`NetError::BadKind`] for a kind that is not a request, [`NetError::ShuttingDown`] once
    /// this node's net task has ended, and the send's own.
    ///
    /// [`timeout`]: Duration
    pub fn request_then(
        self: &Rc<Self>,
        dest: impl Into<Dest>,
        (kind, id): (FrameKind, u32),
        payload: Vec<u8>,
        (timeout, ttl): (Duration, Duration),
        (handler, token): (&ReplyHandler, u64),
    ) -> Result<SentRequest, NetError> {
        if !is_request_kind(kind) {
            return Err(NetError::BadKind {
                kind,
                op: "send a request",
            });
        }
        self.check_len(&payload)?;
        let dest = dest.into();
        let node = dest.node;
        let net = self.net();
        // The rail found by the route (no second lookup to send on it), or looked up.
        let (remote, tx) = match net.cached_route(dest) {
            Some((remote, tx)) => (remote, Some(tx)),
            None => match self.route(dest)? {
                Route::Here(remote) => (remote, None),
                Route::There(owner) => return Err(NetError::OtherShard { node, owner }),
            },
        };
        if net.closed.get() {
            return Err(NetError::ShuttingDown);
        }
        let timeout = timeout.min(MAX_REQUEST_TIMEOUT);
        let now = net.request_now(self.progress_rounds());
        let deadline = now.saturating_add(timeout);
        let spec = enter_pending(
            net,
            (node, remote),
            (kind, id),
            (now, deadline, ttl.min(timeout)),
            Waiter::Handler(handler.clone(), token),
        );
        let req_id = spec.req_id;
        let sent = send_encoded(self, payload, |body| match &tx {
            Some(tx) => send_on_rail(self, (node, remote), tx, spec, &[], body),
            None => send(self, (node, remote), spec, &[], body),
        });
        if let Err(e) = sent {
            // Never sent: nothing to cancel on the receiver, and the handler is not called.
            net.pending.borrow_mut().cancel(req_id);
            return Err(e);
        }
        if deadline < net.timer_at.get() {
            net.rearm();
        }
        Ok(SentRequest {
            rail: (node, remote),
            kind,
            id,
            req_id,
        })
    }

    /// Gives up a request sent with [`ShardCtx::request_then`]: its handler is not called for
    /// it, and an [`FrameKind::RpcRequest`] is followed by an [`FrameKind::RpcCancel`] frame.
    /// Whether it was still pending (`false`: answered, failed or given up already).
    pub fn cancel_request(&self, sent: &SentRequest) -> bool {
        let net = self.net();
        let was_pending = {
            let mut pending = net.pending.borrow_mut();
            let ours = pending.get(sent.req_id).is_some_and(|p| {
                (p.node, p.remote) == sent.rail && matches!(p.waiter, Waiter::Handler(..))
            });
            ours && pending.cancel(sent.req_id).is_some()
        };
        if was_pending && sent.kind == FrameKind::RpcRequest {
            send_cancel(self, sent.rail, sent.id, sent.req_id);
        }
        was_pending
    }
}

/// The frame that answers `request` with `kind`: its `id` and `req_id`, no deadline
/// ([`NetError::BadKind`] when `kind` does not answer that request's kind).
pub(super) fn reply_spec(request: &FrameHeader, kind: FrameKind) -> Result<FrameSpec, NetError> {
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
