//! Inbound: what UCX delivers. Application frames with eager data are dispatched inside UCX's
//! receive callback; the rest is recorded by the callbacks and dispatched by the progress
//! driver right after `progress` returns (see the module docs of [`crate::net`], "The hot
//! path").

use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::rc::Rc;
use std::time::Instant;

use futures_lite::future;
use glommio::timer::sleep;

use super::buffers::{recv_vec, RecycledBuf};
use super::request::{is_reply_kind, is_request_kind, reply_fits};
use super::session::{self, accept_opening};
use super::{
    parse_am_header, Arrival, ControlHead, InlineRail, NetError, NetState, DATA_AM, FRAME_AM,
    MAX_ADDR_LEN, MAX_USER_HEADER,
};
use crate::boot::ShardCtx;
use crate::driver::{DispatchHook, Dispatched, DISPATCH_BUDGET};
use crate::pool::PoolBuf;
use crate::proto::conn::{DropReason, Received};
use crate::proto::handshake::{HandshakeMessage, Role};
use crate::proto::wire::decode_frame;
use crate::proto::{
    AmId, FrameHeader, FrameKind, Incarnation, Limits, NodeId, ShardId, State, Timestamp, WireError,
};
use crate::ucx::{AlignedBuf, AmData, AmIncoming, AmPayload, AmRndv, IoBufMut};

/// A handler of application frames (an AM id's, or a request kind's).
pub(super) type FrameHandler = Rc<dyn Fn(&Rc<ShardCtx>, Frame)>;
/// A handler of an AM id's frames read in place, for the length of the call ([`FrameView`]).
pub(super) type ViewHandler = Rc<dyn Fn(&Rc<ShardCtx>, &FrameView<'_>)>;

/// A handler of an AM id's frames lent when they are read in UCX's callback, owned otherwise
/// ([`Incoming`]).
pub(super) type EitherHandler = Rc<dyn Fn(&Rc<ShardCtx>, Incoming<'_>)>;

/// The handler of an AM id or a request kind: one that owns each frame, one that reads it
/// in place, or one that takes either.
#[derive(Clone)]
pub(super) enum AnyHandler {
    Frame(FrameHandler),
    View(ViewHandler),
    Either(EitherHandler),
}

/// The frame handlers of the kinds that take one ([`ShardCtx::set_frame_handler`]: RPC
/// requests and cancels, checked puts and gets), a slot per kind: found on a frame's path with
/// a match, not a hash.
#[derive(Default)]
pub(super) struct KindHandlers([Option<AnyHandler>; 4]);

impl KindHandlers {
    /// The slot of `kind`, if it takes a handler.
    #[inline(always)]
    fn slot(kind: FrameKind) -> Option<usize> {
        match kind {
            FrameKind::RpcRequest => Some(0),
            FrameKind::RpcCancel => Some(1),
            FrameKind::RmaPut => Some(2),
            FrameKind::RmaGet => Some(3),
            _ => None,
        }
    }

    /// The handler of `kind`.
    #[inline(always)]
    fn get(&self, kind: FrameKind) -> Option<&AnyHandler> {
        Self::slot(kind).and_then(|i| self.0[i].as_ref())
    }

    /// Sets the handler of `kind`; false (nothing set) for a kind that takes none.
    fn set(&mut self, kind: FrameKind, handler: AnyHandler) -> bool {
        match Self::slot(kind) {
            Some(i) => {
                self.0[i] = Some(handler);
                true
            }
            None => false,
        }
    }
}

/// A frame as a [`ShardCtx::set_frame_either_handler_am`] handler gets it: lent for the call
/// when it is read where UCX received it (a short message, in UCX's callback: nothing copied
/// and no [`Frame`] built), owned otherwise (a rendezvous payload in the buffer it landed in,
/// one recorded for the driver's dispatch), so that the handler may keep it without a copy.
pub enum Incoming<'a> {
    /// Read in place, for the length of the call.
    Lent(&'a FrameView<'a>),
    /// The handler's to keep.
    Owned(Frame),
}
/// A rendezvous handler: chooses the buffer, pulls, hands over (see [`rndv_handler`]).
pub(super) type RndvHandler = Rc<dyn Fn(&Rc<ShardCtx>, NodeId, FrameHeader, AmRndv)>;

/// User headers up to this many bytes are kept inline in a recorded input.
const INLINE_USER: usize = 40;

/// The user header of an application frame, copied out of UCX's AM header (which is valid only
/// during its callback).
#[derive(Clone)]
pub(crate) enum UserHeader {
    Inline([u8; INLINE_USER], u8),
    Heap(Box<[u8]>),
}

/// The payload of a frame received by this shard: a UCX descriptor read in place (eager data),
/// or the buffer rendezvous data was pulled into (a block of the shard's pool or a recycled
/// vector of its receive cache, see [`super::buffers`]; a vector for frames made locally).
/// `!Send`: a descriptor belongs to its worker; [`Payload::into_vec`] for another thread.
pub struct Payload(PayloadInner);

enum PayloadInner {
    Empty,
    Desc(AmData),
    Vec(Vec<u8>),
    /// The first `.1` bytes of a pool block (of a region no remote key was packed for).
    Pool(PoolBuf, usize),
    Recycled(RecycledBuf),
    /// Eager data UCX delivered in place (a short message), copied into the shard's reused
    /// buffer for a frame dispatched inside UCX's callback (see [`InlineBytes`]).
    Shared(Rc<Vec<u8>>),
}

/// An application frame from a connected node, handed to its handler by the progress driver:
/// the frame header, the application's user header, and the payload, owned. Reading it in
/// place and dropping it (or answering inline) costs no copy; keeping it keeps UCX's
/// descriptor until it is dropped.
pub struct Frame {
    node: NodeId,
    header: FrameHeader,
    user: UserHeader,
    payload: Payload,
    /// When the driver took the frame's batch, on the net layer's clock
    /// ([`super::timestamp_of`]).
    arrived: Timestamp,
}

/// An application frame lent to its handler for the length of the call
/// ([`ShardCtx::set_frame_view_handler_am`]): header, user header and payload read where they
/// are, which for a short message dispatched inside UCX's callback is UCX's own receive buffer
/// (no copy, nothing to release). What the handler wants to keep, it copies.
#[derive(Clone, Copy)]
pub struct FrameView<'a> {
    node: NodeId,
    header: &'a FrameHeader,
    user: &'a [u8],
    payload: &'a [u8],
    arrived: Timestamp,
}

impl<'a> FrameView<'a> {
    /// The sending node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The frame header (kind, `id`, the sending shard...).
    pub fn header(&self) -> &'a FrameHeader {
        self.header
    }

    /// The application's user header.
    pub fn user_header(&self) -> &'a [u8] {
        self.user
    }

    /// The payload's bytes.
    pub fn payload(&self) -> &'a [u8] {
        self.payload
    }

    /// When the driver took the frame's batch (see [`Frame::arrived`]).
    pub fn arrived(&self) -> Instant {
        super::instant_of(self.arrived)
    }

    /// [`FrameView::arrived`] on the net layer's clock (see [`Frame::arrived_at`]).
    pub fn arrived_at(&self) -> Timestamp {
        self.arrived
    }
}

impl std::fmt::Debug for FrameView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FrameView")
            .field("node", &self.node)
            .field("header", self.header)
            .field("user_header", &self.user.len())
            .field("payload", &self.payload.len())
            .finish()
    }
}

/// An input recorded for the driver's dispatch, in arrival order.
pub(super) enum Inbound {
    /// A [`DATA_AM`] message (header decoded in the callback).
    Data {
        node: NodeId,
        header: FrameHeader,
        user: UserHeader,
        data: AmPayload,
    },
    /// A [`FRAME_AM`] message: a control frame (and, for a hello, the sender's address).
    Control {
        head: ControlHead,
        bytes: Vec<u8>,
    },
    TooLarge,
    Malformed,
    /// A frame dispatched inside UCX's callback left its rail's connection with work (frames
    /// to send, events): done here, outside the callback ([`session::service`]).
    Service {
        node: NodeId,
        remote: ShardId,
    },
    /// A rail's sender found its endpoint failed (pushed by the sender task).
    TransportError {
        node: NodeId,
        remote: ShardId,
        generation: u64,
    },
}

impl UserHeader {
    fn copy(bytes: &[u8]) -> UserHeader {
        if bytes.len() <= INLINE_USER {
            let mut a = [0u8; INLINE_USER];
            a[..bytes.len()].copy_from_slice(bytes);
            // At most INLINE_USER (40): fits a u8.
            UserHeader::Inline(a, bytes.len() as u8)
        } else {
            UserHeader::Heap(bytes.into())
        }
    }

    fn as_slice(&self) -> &[u8] {
        match self {
            UserHeader::Inline(a, n) => &a[..usize::from(*n)],
            UserHeader::Heap(b) => b,
        }
    }
}

impl Payload {
    /// An empty payload.
    pub fn empty() -> Payload {
        Payload(PayloadInner::Empty)
    }

    fn desc(d: AmData) -> Payload {
        if d.is_empty() {
            Payload::empty()
        } else {
            Payload(PayloadInner::Desc(d))
        }
    }

    /// The bytes.
    #[inline]
    pub fn as_slice(&self) -> &[u8] {
        match &self.0 {
            PayloadInner::Empty => &[],
            PayloadInner::Desc(d) => d.as_slice(),
            PayloadInner::Vec(v) => v,
            // Pool blocks are handed over only while their region is not exported
            // (`Payload::from_rndv`), and the shard's pool arena never is.
            PayloadInner::Pool(b, len) => b.as_slice().map_or(&[], |b| &b[..*len]),
            PayloadInner::Recycled(r) => r.as_slice(),
            PayloadInner::Shared(b) => b,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.as_slice().len()
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes as a vector: moved when they are one already (rendezvous data), copied out of
    /// UCX's descriptor otherwise (which is then released).
    pub fn into_vec(self) -> Vec<u8> {
        match self.0 {
            PayloadInner::Empty => Vec::new(),
            PayloadInner::Desc(d) => d.as_slice().to_vec(),
            PayloadInner::Vec(v) => v,
            PayloadInner::Pool(b, len) => b.as_slice().map_or_else(Vec::new, |b| b[..len].to_vec()),
            PayloadInner::Recycled(r) => r.into_vec(),
            PayloadInner::Shared(b) => Rc::try_unwrap(b).unwrap_or_else(|b| b.to_vec()),
        }
    }

    /// The first `len` bytes of a rendezvous buffer, read in place (a copy only for a pool
    /// block whose region was exported, and for aligned host memory).
    pub(crate) fn from_rndv(buf: RndvBuf, len: usize) -> Payload {
        match buf {
            RndvBuf::Pool(b) if b.as_slice().is_some() => {
                let len = len.min(b.len());
                Payload(PayloadInner::Pool(b, len))
            }
            RndvBuf::Recycled(r) => Payload(PayloadInner::Recycled(r)),
            RndvBuf::Vec(mut v) => {
                v.truncate(len);
                Payload(PayloadInner::Vec(v))
            }
            other => {
                let mut v = vec![0u8; len];
                match &other {
                    RndvBuf::Pool(b) => {
                        let _ = b.read_at(0, &mut v[..len.min(b.len())]);
                    }
                    _ => {
                        if let Some(bytes) = other.bytes() {
                            let n = len.min(bytes.len());
                            v[..n].copy_from_slice(&bytes[..n]);
                        }
                    }
                }
                Payload(PayloadInner::Vec(v))
            }
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Payload {
        Payload(PayloadInner::Vec(v))
    }
}

impl std::fmt::Debug for Payload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Payload({} bytes)", self.len())
    }
}

impl Frame {
    /// A frame made here rather than received (tests, and local delivery).
    pub fn new(node: NodeId, header: FrameHeader, user: &[u8], payload: Payload) -> Frame {
        Frame {
            node,
            header,
            user: UserHeader::copy(user),
            payload,
            arrived: super::timestamp_of(Instant::now()),
        }
    }

    /// When the driver took the frame's batch (the one clock reading of that batch): the time
    /// a deadline carried in `ttl_ns` counts from.
    pub fn arrived(&self) -> Instant {
        super::instant_of(self.arrived)
    }

    /// [`Frame::arrived`] on the net layer's clock ([`super::timestamp_of`]): nanoseconds,
    /// the same on every shard of the process, with no conversion.
    pub fn arrived_at(&self) -> Timestamp {
        self.arrived
    }

    /// The sending node.
    pub fn node(&self) -> NodeId {
        self.node
    }

    /// The frame header (kind, `id`, `req_id`, `ttl_ns`, the sending shard...).
    pub fn header(&self) -> &FrameHeader {
        &self.header
    }

    /// The application's user header (the AM header of an active message; empty for other
    /// kinds).
    pub fn user_header(&self) -> &[u8] {
        self.user.as_slice()
    }

    /// The payload's bytes.
    pub fn payload(&self) -> &[u8] {
        self.payload.as_slice()
    }

    /// The payload, owned.
    pub fn into_payload(self) -> Payload {
        self.payload
    }

    /// The payload as a vector (see [`Payload::into_vec`]).
    pub fn into_vec(self) -> Vec<u8> {
        self.payload.into_vec()
    }

    /// The frame lent as a [`FrameView`].
    pub fn view(&self) -> FrameView<'_> {
        FrameView {
            node: self.node,
            header: &self.header,
            user: self.user.as_slice(),
            payload: self.payload.as_slice(),
            arrived: self.arrived,
        }
    }
}

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("node", &self.node)
            .field("header", &self.header)
            .field("user_header", &self.user.as_slice().len())
            .field("payload", &self.payload)
            .finish()
    }
}

/// Parses the UCX AM header of a [`DATA_AM`] message whose payload UCX delivered with `len`
/// bytes: the sender, the frame header (from the data header, checked against `limits`) and
/// the user header.
fn parse_data_header<'a>(
    h: &'a [u8],
    len: usize,
    limits: &Limits,
) -> Result<(NodeId, FrameHeader, &'a [u8]), WireError> {
    let (node, header, at) = FrameHeader::decode_data(h, len as u64, limits)?;
    let user = &h[at..];
    if user.len() > MAX_USER_HEADER {
        return Err(WireError::Truncated {
            what: "data AM header (user header over MAX_USER_HEADER)",
            needed: at + MAX_USER_HEADER,
            got: h.len(),
        });
    }
    Ok((node, header, user))
}

impl NetState {
    /// A payload of eager bytes UCX delivered in place, for a frame dispatched inside its
    /// callback: copied into one of the shard's reused buffers. They are tried oldest first
    /// (frames kept past their dispatch, replies waiting for their callers' tasks, are let go
    /// of in about the order they came), so while at most [`INLINE_BUFFERS`] frames are kept
    /// at once, none allocates; a buffer that grew past [`MAX_INLINE_BUFFER`] is not kept.
    fn inline_payload(&self, bytes: &[u8]) -> Payload {
        if bytes.is_empty() {
            return Payload::empty();
        }
        let mut ring = self.inline_bytes.borrow_mut();
        let reused = match ring.pop_front() {
            Some(mut b) => match Rc::get_mut(&mut b) {
                Some(v) => {
                    v.clear();
                    v.extend_from_slice(bytes);
                    Some(b)
                }
                None => {
                    // Still kept by its frame: tried again after the others.
                    ring.push_back(b);
                    None
                }
            },
            None => None,
        };
        let buf = match reused {
            Some(b) => b,
            None if ring.len() >= INLINE_BUFFERS => {
                // Every buffer is kept: this copy is the frame's own.
                return Payload(PayloadInner::Shared(Rc::new(bytes.to_vec())));
            }
            None => Rc::new(bytes.to_vec()),
        };
        if buf.capacity() <= MAX_INLINE_BUFFER {
            ring.push_back(buf.clone());
        }
        Payload(PayloadInner::Shared(buf))
    }
}

/// The most buffers a shard keeps for eager payloads copied out of UCX's callback
/// ([`NetState::inline_payload`]): a window of this many answers awaited together (RPC replies
/// read by their callers' tasks) is received with no allocation.
const INLINE_BUFFERS: usize = 128;

/// A buffer for eager payloads larger than this (a raised rendezvous threshold) is used once
/// and not kept.
const MAX_INLINE_BUFFER: usize = 16 << 10;

/// Registers the shard's UCX AM handlers. Control frames are recorded for the driver's
/// dispatch; application frames with eager data are dispatched inside the callback when
/// nothing is recorded before them (see "The hot path" in the module docs of [`crate::net`]).
pub(super) fn register(ctx: &Rc<ShardCtx>) -> Result<(), crate::BootError> {
    let shard = ctx.id().index();
    let ucx = |source| crate::BootError::Ucx { shard, source };
    let net = ctx.net();
    let inbox = net.inbox.clone();
    // Largest control frame that can be valid: a hello's address and a handshake frame.
    let cap = MAX_ADDR_LEN + 4096;
    ctx.worker()
        .set_am_handler(FRAME_AM, move |header, payload| {
            let item = match (parse_am_header(header), payload) {
                // Refused before it is copied out of UCX's buffer.
                (Some(_), AmPayload::Data(d)) if d.len() > cap => Inbound::TooLarge,
                (Some(head), AmPayload::Data(d)) => Inbound::Control {
                    head,
                    bytes: d.into_vec(),
                },
                _ => Inbound::Malformed,
            };
            inbox.borrow_mut().push_back(item);
        })
        .map_err(ucx)?;
    let weak = Rc::downgrade(ctx);
    let limits = net.limits;
    ctx.worker()
        .set_am_handler_inline(DATA_AM, move |h, incoming| {
            let Some(ctx) = weak.upgrade() else { return };
            let net = ctx.net();
            let item = match parse_data_header(h, incoming.len(), &limits) {
                Ok((_, header, _)) if header.kind.is_control() => Inbound::Malformed,
                Ok((node, header, user)) => {
                    // In order: only while nothing is recorded before it; not inside another
                    // frame's dispatch; and only inside the driver's `progress`, where no
                    // caller up the stack holds the shard's state (a transport that delivered
                    // a message from inside a send would call this with the sender's borrows
                    // held).
                    // And at most a budget of them per `progress` call (see `inline_left`).
                    let inline = ctx.worker().in_progress()
                        && !net.dispatching.get()
                        && net.inline_left.get() > 0
                        && net.inbox.borrow().is_empty();
                    match incoming {
                        AmIncoming::Bytes(b) if inline => {
                            // Bytes in place own nothing: forgotten rather than dropped, which
                            // spares an out-of-line call of the enum's drop glue per message.
                            std::mem::forget(incoming);
                            return dispatch_inline(&ctx, net, node, header, user, Eager::Bytes(b));
                        }
                        AmIncoming::Data(d) if inline => {
                            return dispatch_inline(&ctx, net, node, header, user, Eager::Desc(d));
                        }
                        // Rendezvous data, or a frame behind recorded ones: recorded (eager
                        // bytes copied out of UCX's buffer, descriptors kept).
                        incoming => Inbound::Data {
                            node,
                            header,
                            user: UserHeader::copy(user),
                            data: incoming.keep(),
                        },
                    }
                }
                Err(WireError::MessageTooLarge { .. }) => Inbound::TooLarge,
                Err(_) => Inbound::Malformed,
            };
            net.inbox.borrow_mut().push_back(item);
        })
        .map_err(ucx)?;
    Ok(())
}

/// An application frame with eager data, dispatched inside UCX's callback (see "The hot path"
/// in the module docs of [`crate::net`]): the rail's connection checks it, and its handler
/// runs here. What the connection has to do besides (frames to send, events) is recorded for
/// the driver's dispatch, outside the callback.
fn dispatch_inline(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    node: NodeId,
    header: FrameHeader,
    user: &[u8],
    eager: Eager<'_>,
) {
    // Cleared at the end, and by the driver's dispatch hook after the `progress` (it reports
    // the event) should this end early (a panic outside the handler, caught further up in UCX's callback wrapper).
    net.dispatching.set(true);
    let left = net.inline_left.get().saturating_sub(1);
    net.inline_left.set(left);
    let (now, _) = net.batch_now(ctx.progress_rounds());
    if let Some(rail) = accepted(net, node, &header, now, true) {
        // The handler, looked up once: one that reads frames in place gets UCX's bytes as
        // they are; one that owns them gets the frame, without `dispatch` looking it up again.
        let handler = match header.kind {
            FrameKind::Am => net.handlers.get(AmId::new(header.id)),
            // Replies go to their pending requests; expired requests are dropped (`dispatch`).
            k if is_reply_kind(k) || (is_request_kind(k) && header.ttl_ns == 0) => None,
            k => net.frame_handlers.borrow().get(k).cloned(),
        };
        let _rail = net.set_inline_rail(rail);
        match handler {
            // A reply: to its pending request, with no frame built (replies carry no user
            // header its waiter reads).
            None if is_reply_kind(header.kind) => {
                let payload = match eager {
                    Eager::Bytes(b) => net.inline_payload(b),
                    Eager::Desc(d) => Payload::desc(d),
                };
                net.count(|s| s.dispatched_in_callback += 1);
                answer_pending(net, node, header, payload);
            }
            Some(AnyHandler::View(h)) => {
                call_view(ctx, &h, &eager.view(node, &header, user, now), true)
            }
            Some(AnyHandler::Either(h)) => {
                let lent = eager.view(node, &header, user, now);
                call_either(ctx, &h, Incoming::Lent(&lent), true)
            }
            owner => {
                let payload = match eager {
                    Eager::Bytes(b) => net.inline_payload(b),
                    Eager::Desc(d) => Payload::desc(d),
                };
                let frame = Frame {
                    node,
                    header,
                    user: UserHeader::copy(user),
                    payload,
                    arrived: now,
                };
                match owner {
                    Some(AnyHandler::Frame(h)) => call(ctx, &h, frame, true),
                    // Replies, expired requests, frames nobody handles: counted there.
                    _ => {
                        net.count(|s| s.dispatched_in_callback += 1);
                        dispatch(ctx, frame)
                    }
                }
            }
        }
    }
    // Handlers that take long must not keep the shard's timers and heartbeats waiting: once
    // glommio's preempt timer says so, the rest of this `progress` is recorded for the driver's
    // dispatch, which yields between its items. Not looked at after the first frame of a
    // `progress` (the driver yields after the round anyway): a round trip's one frame pays
    // nothing for it. (Looking on every 8th frame only, which spared a flood about 15
    // instructions a frame, let 8 slow handlers run back to back: `net_frames`'
    // `slow_handlers_leave_room_for_heartbeats` then saw a peer declared dead.)
    if left < DISPATCH_BUDGET - 1 && preempt_due() {
        net.inline_left.set(0);
        net.count(|s| s.dispatch_preempted += 1);
    }
    net.dispatching.set(false);
}

/// The eager data of a frame dispatched inside UCX's callback: a short message's bytes where
/// the transport put them (valid during the callback only), or UCX's descriptor.
enum Eager<'a> {
    Bytes(&'a [u8]),
    Desc(AmData),
}

impl Eager<'_> {
    /// The frame lent to a handler, with this as its payload.
    #[inline(always)]
    fn view<'a>(
        &'a self,
        node: NodeId,
        header: &'a FrameHeader,
        user: &'a [u8],
        arrived: Timestamp,
    ) -> FrameView<'a> {
        FrameView {
            node,
            header,
            user,
            payload: match self {
                Eager::Bytes(b) => b,
                Eager::Desc(d) => d.as_slice(),
            },
            arrived,
        }
    }
}

/// Whether the shard's executor wants the thread back for its timers and I/O (glommio's
/// preempt timer, [`crate::PREEMPT_TIMER`], has fired since this task queue started to run): a
/// dispatch stops there and leaves the rest recorded. Called on a shard's thread.
pub fn preempt_due() -> bool {
    glommio::executor().need_preempt()
}

/// The driver's dispatch hook of shard `ctx` (see [`crate::driver::DispatchHook`]): one look
/// at the recorded inputs when nothing came, else [`drain`]; with the round's clock reading,
/// if a frame took one.
pub(crate) fn dispatch_hook(ctx: &Rc<ShardCtx>) -> DispatchHook {
    let weak = Rc::downgrade(ctx);
    let net = ctx.net().clone();
    Rc::new(move |budget, round| {
        // No frame is being dispatched once `progress` has returned; the next `progress`
        // may dispatch a budget of them in UCX's callback again.
        net.dispatching.set(false);
        // Frames dispatched inside the `progress` that just returned took from its budget.
        let inline = net.inline_left.get() < budget;
        net.inline_left.set(budget);
        if net.inbox.borrow().is_empty() {
            return Dispatched {
                at: net.batch_taken(round),
                app: inline,
                ..Dispatched::default()
            };
        }
        match weak.upgrade() {
            Some(ctx) => {
                let mut done = drain(&ctx, budget, round);
                done.app |= inline;
                done
            }
            None => Dispatched::default(),
        }
    })
}

/// Handles at most `budget` recorded inputs, in order; the clock is read once for them all
/// and for the frames dispatched inline in the same round (what it dates is the connections'
/// liveness, whose timers count in heartbeat intervals, and the start of a request's
/// deadline). Each frame reaches its handler before the next input is handled: a `Close` (or
/// an endpoint error) that follows data frames must not fail the requests and receives those
/// frames answer. Out of line: the hook's look at an empty inbox stays small, and the cost of
/// a drain shows apart in a profile (`scripts/count-instructions`).
#[inline(never)]
pub(super) fn drain(ctx: &Rc<ShardCtx>, budget: usize, round: u64) -> Dispatched {
    let net = ctx.net();
    let mut n = 0;
    let mut liveness = 0;
    let mut backlog = false;
    let mut preempted = false;
    while n < budget {
        let item = net.inbox.borrow_mut().pop_front();
        let Some(item) = item else { break };
        n += 1;
        liveness += usize::from(handle(ctx, net, item, net.batch_now(round).0));
        // Slow handlers: at least two inputs per round, then the timers' turn when due (see
        // `preempt_due`).
        if n > 1 && preempt_due() {
            preempted = true;
            break;
        }
    }
    // Inputs left: the budget ran out (a flood) or a slow handler's preemption, counted apart.
    if n > 0 && !net.inbox.borrow().is_empty() {
        backlog = true;
        if preempted {
            net.count(|s| s.dispatch_preempted += 1);
        } else if n == budget {
            net.count(|s| s.dispatch_budget_hits += 1);
        }
    }
    Dispatched {
        handled: n,
        app: n > liveness,
        backlog,
        at: net.batch_taken(round),
    }
}

/// Feeds an application frame's header to the connection of its rail (from `node`'s shard
/// `header.src_shard`; dropped as unauthenticated without one) and, if its handler gets it,
/// the rail (for the handler's answer: see [`NetState::set_inline_rail`]). A frame on the rail
/// the last one came in on is checked by the rail's lane instead, while its connection is
/// ready ([`NetState::admitted`]: a few comparisons, no lookup). The connection's
/// follow-up work, if the frame left it some, is done now, or recorded for the driver when the
/// frame is being dispatched inside UCX's callback (`in_callback`).
#[inline]
fn accepted(
    net: &NetState,
    node: NodeId,
    header: &FrameHeader,
    now: Timestamp,
    in_callback: bool,
) -> Option<Arrival> {
    // The rail the last frame came in on, while its connection is ready: no lookup.
    if net.admitted(node, header, now) {
        return Some(Arrival::Lane);
    }
    accepted_looked_up(net, node, header, now, in_callback)
}

/// [`accepted`] past the rail the last frame came in on: the rail looked up in the peer
/// table, and the frame fed to its connection.
#[inline(never)]
fn accepted_looked_up(
    net: &NetState,
    node: NodeId,
    header: &FrameHeader,
    now: Timestamp,
    in_callback: bool,
) -> Option<Arrival> {
    let remote = header.src_shard;
    let (received, tx) = match net
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.get_mut(remote))
    {
        Some(r) => {
            let received = r.data_frame(now, header);
            if matches!(received, Received::Deliver) {
                net.remember_rx_rail(node, remote, &r.tx);
            }
            (received, Some(&r.tx).cloned())
        }
        None => (Received::Dropped(DropReason::NotReady), None),
    };
    if !matches!(received, Received::Deliver) {
        if in_callback {
            net.inbox
                .borrow_mut()
                .push_back(Inbound::Service { node, remote });
        } else {
            session::service(net, node, remote);
        }
    }
    if count_received(net, header, received) {
        tx.map(|tx| Arrival::Rail(InlineRail { node, remote, tx }))
    } else {
        None
    }
}

/// Handles one recorded input; true if it was a liveness frame (see `Dispatched::app`).
fn handle(ctx: &Rc<ShardCtx>, net: &NetState, item: Inbound, now: Timestamp) -> bool {
    match item {
        Inbound::Data {
            node,
            header,
            user,
            data,
        } => {
            if let Some(rail) = accepted(net, node, &header, now, false) {
                match data {
                    AmPayload::Data(d) => {
                        let frame = Frame {
                            node,
                            header,
                            user,
                            payload: Payload::desc(d),
                            arrived: now,
                        };
                        let _rail = net.set_inline_rail(rail);
                        dispatch(ctx, frame);
                    }
                    AmPayload::Rendezvous(r) => deliver_rndv(ctx, node, header, user, r),
                }
            }
        }
        Inbound::Control { head, bytes } => return handle_control(ctx, net, head, &bytes, now),
        Inbound::Service { node, remote } => session::service(net, node, remote),
        Inbound::Malformed => net.count(|s| s.dropped_malformed += 1),
        Inbound::TooLarge => net.count(|s| s.dropped_too_large += 1),
        Inbound::TransportError {
            node,
            remote,
            generation,
        } => {
            let beside = {
                let mut peers = net.peers.borrow_mut();
                let p = peers.get_mut(&node);
                match p {
                    Some(p) => match p.get_mut(remote) {
                        Some(r) if r.generation == generation => {
                            r.conn_mut().handle_transport_error(now);
                            false
                        }
                        _ => p.pending_mut(generation).is_some_and(|q| {
                            q.rail.conn_mut().handle_transport_error(now);
                            true
                        }),
                    },
                    None => false,
                }
            };
            if beside {
                session::service_pending(net, node, generation);
            } else {
                session::service(net, node, remote);
            }
        }
    }
    false
}

/// A [`FRAME_AM`] message: a control frame of a rail, or a `Hello` or `Join` that opens one
/// (the routing rule is in the `session` module's docs, "Openings beside a ready rail").
///
/// The rest of a pending opening's handshake goes to it: a `Hello` from the worker and
/// incarnation it was opened for, a `Confirm` whose header carries that incarnation. Anything
/// else goes to the rail. A `Hello` that a ready rail declines ([`DropReason::Opening`]) gets
/// a pending opening of its own. An opening on a rail that is not ready goes to that rail's
/// connection when it can take it (a server answers a new `Hello`; a join server a new
/// `Join`), else it replaces it (a `Join` from a peer whose earlier rail this shard still holds
/// as a primary; an opening from another incarnation than the rail's peer, whose answer must
/// go to that incarnation's worker). True if the frame was a heartbeat or an ack of one.
fn handle_control(
    ctx: &Rc<ShardCtx>,
    net: &NetState,
    head: ControlHead,
    bytes: &[u8],
    now: Timestamp,
) -> bool {
    let ControlHead {
        node,
        addr_len,
        mode,
    } = head;
    let (Some(addr), Some(frame)) = (bytes.get(..addr_len), bytes.get(addr_len..)) else {
        net.count(|s| s.dropped_malformed += 1);
        return false;
    };
    let from = session::Opener { addr, mode };
    let (header, payload) = match decode_frame(frame, &net.limits) {
        Ok(hp) => hp,
        Err(e) => {
            count_bad_frame(net, &e);
            return false;
        }
    };
    // Heartbeats and their acks (see `Dispatched::app`).
    let liveness = header.kind.is_liveness();
    let remote = header.src_shard;
    let opening_from = match header.kind {
        FrameKind::Hello | FrameKind::Join => opening_incarnation(header.kind, payload),
        _ => None,
    };
    let pending = net.peers.borrow().get(&node).and_then(|p| {
        let q = match header.kind {
            FrameKind::Hello => opening_from
                .and_then(|inc| p.pending_from(remote, inc))
                .filter(|q| q.is_from(addr)),
            FrameKind::Confirm => p.pending_from(remote, header.incarnation),
            _ => None,
        };
        q.map(|q| q.rail.generation)
    });
    if let Some(generation) = pending {
        feed_pending(net, node, generation, (&header, payload), now);
        return liveness;
    }
    let fits = net
        .peers
        .borrow()
        .get(&node)
        .and_then(|p| p.get(remote))
        .map(|r| {
            let restarted = opening_from
                .zip(r.conn().peer())
                .is_some_and(|(inc, peer)| inc != peer.incarnation);
            match header.kind {
                // A ready rail's connection declines it, or drops it as stale (see below).
                FrameKind::Hello if r.conn().state() == State::Ready => true,
                _ if restarted => false,
                FrameKind::Join => r.conn().role() == Role::Server && r.conn().is_join(),
                _ => true,
            }
        });
    let takes = match fits {
        Some(true) => true,
        Some(false) | None => {
            header.kind.is_handshake()
                && matches!(header.kind, FrameKind::Hello | FrameKind::Join)
                && accept_opening(ctx, net, node, from, &header, payload)
        }
    };
    if !takes {
        if fits.is_none() && !matches!(header.kind, FrameKind::Hello | FrameKind::Join) {
            net.count(|s| s.dropped_unauthenticated += 1);
        }
        return liveness;
    }
    let (received, ready) = match net
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.get_mut(remote))
    {
        Some(r) => {
            let received = r.conn_mut().handle_frame(now, &header, payload);
            (received, r.conn().peer().copied())
        }
        None => return liveness,
    };
    if let (Received::Dropped(DropReason::Opening), Some(ready)) = (received, ready) {
        // Not a dropped frame: it is answered beside the rail, which goes on as it was.
        if let Some(generation) =
            session::open_beside(ctx, net, node, from, &header, payload, ready)
        {
            feed_pending(net, node, generation, (&header, payload), now);
        }
        return liveness;
    }
    session::service(net, node, remote);
    if count_received(net, &header, received) {
        // Application frames travel as DATA_AM only.
        net.count(|s| s.dropped_malformed += 1);
    }
    liveness
}

/// Hands a handshake frame to the pending opening of `node` whose sender has `generation`.
fn feed_pending(
    net: &NetState,
    node: NodeId,
    generation: u64,
    (header, payload): (&FrameHeader, &[u8]),
    now: Timestamp,
) {
    let received = match net
        .peers
        .borrow_mut()
        .get_mut(&node)
        .and_then(|p| p.pending_mut(generation))
    {
        Some(q) => q.rail.conn_mut().handle_frame(now, header, payload),
        None => return,
    };
    session::service_pending(net, node, generation);
    count_received(net, header, received);
}

/// The incarnation a `Hello` or `Join` says it comes from (`None` if it does not decode).
fn opening_incarnation(kind: FrameKind, payload: &[u8]) -> Option<Incarnation> {
    match HandshakeMessage::decode(kind, payload).ok()? {
        HandshakeMessage::Hello(h) => Some(h.incarnation),
        HandshakeMessage::Join(j) => Some(j.incarnation),
        _ => None,
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

/// Whether some handler or pending request on this shard takes `header` from `node`; counts
/// the frame as dropped when none does.
fn wanted(net: &NetState, node: NodeId, header: &FrameHeader) -> bool {
    let want = match header.kind {
        FrameKind::Am => {
            let id = AmId::new(header.id);
            net.handlers.contains(id) || net.rndv_handlers.borrow().contains_key(&id)
        }
        k if is_reply_kind(k) => {
            let fits = net.pending.borrow().get(header.req_id).is_some_and(|p| {
                p.node == node && p.remote == header.src_shard && reply_fits(p.kind, k)
            });
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
            net.frame_handlers.borrow().get(k).is_some()
                || net.frame_rndv_handlers.borrow().contains_key(&k)
        }
    };
    if !want {
        net.count(|s| s.dropped_no_handler += 1);
    }
    want
}

/// Calls `handler` with `frame`, on the driver's stack: a panic loses this frame only, and
/// is counted ([`super::NetStats::handler_panics`]). `inline`: dispatched in UCX's callback
/// (counted with the frame, in one look at the counters).
#[inline(always)]
fn call(ctx: &Rc<ShardCtx>, handler: &FrameHandler, frame: Frame, inline: bool) {
    let net = ctx.net();
    net.count(|s| s.delivered_frame(&frame.header, inline));
    if std::panic::catch_unwind(AssertUnwindSafe(|| handler(ctx, frame))).is_err() {
        net.count(|s| s.handler_panics += 1);
    }
}

/// [`call`] for a handler that reads the frame in place.
#[inline(always)]
fn call_view(ctx: &Rc<ShardCtx>, handler: &ViewHandler, frame: &FrameView<'_>, inline: bool) {
    let net = ctx.net();
    net.count(|s| s.delivered_frame(frame.header, inline));
    if std::panic::catch_unwind(AssertUnwindSafe(|| handler(ctx, frame))).is_err() {
        net.count(|s| s.handler_panics += 1);
    }
}

/// [`call`] for a handler that takes a frame lent or owned.
#[inline(always)]
fn call_either(ctx: &Rc<ShardCtx>, handler: &EitherHandler, frame: Incoming<'_>, inline: bool) {
    let net = ctx.net();
    let header = match &frame {
        Incoming::Lent(v) => v.header,
        Incoming::Owned(f) => &f.header,
    };
    net.count(|s| s.delivered_frame(header, inline));
    if std::panic::catch_unwind(AssertUnwindSafe(|| handler(ctx, frame))).is_err() {
        net.count(|s| s.handler_panics += 1);
    }
}

/// Hands an application frame (its whole payload here) to its handler or pending request.
#[inline(always)]
pub(super) fn dispatch(ctx: &Rc<ShardCtx>, frame: Frame) {
    let net = ctx.net();
    let header = frame.header;
    match header.kind {
        FrameKind::Am => {
            let h = net.handlers.get(AmId::new(header.id));
            match h {
                Some(AnyHandler::Frame(h)) => call(ctx, &h, frame, false),
                Some(AnyHandler::View(h)) => call_view(ctx, &h, &frame.view(), false),
                Some(AnyHandler::Either(h)) => call_either(ctx, &h, Incoming::Owned(frame), false),
                // None, or only a rendezvous handler: it cannot take eager data.
                None => net.count(|s| s.dropped_no_handler += 1),
            }
        }
        k if is_reply_kind(k) => answer_pending(net, frame.node, header, frame.payload),
        k => {
            if is_request_kind(k) && header.ttl_ns == 0 {
                net.count(|s| s.dropped_expired += 1);
                return;
            }
            let h = net.frame_handlers.borrow().get(k).cloned();
            match h {
                Some(AnyHandler::Frame(h)) => call(ctx, &h, frame, false),
                Some(AnyHandler::View(h)) => call_view(ctx, &h, &frame.view(), false),
                Some(AnyHandler::Either(h)) => call_either(ctx, &h, Incoming::Owned(frame), false),
                None => net.count(|s| s.dropped_no_handler += 1),
            }
        }
    }
}

/// A reply frame from `node`: to the pending request it answers (its request id, sent to
/// that node's shard `header.src_shard`, of a kind the reply fits), whose waiter gets it;
/// counted as unmatched otherwise (a request answered, given up or expired already).
fn answer_pending(net: &NetState, node: NodeId, header: FrameHeader, payload: Payload) {
    let p = {
        let mut pending = net.pending.borrow_mut();
        let fits = pending.get(header.req_id).is_some_and(|p| {
            p.node == node && p.remote == header.src_shard && reply_fits(p.kind, header.kind)
        });
        if fits {
            pending.complete(header.req_id)
        } else {
            None
        }
    };
    match p {
        Some(p) => {
            net.count(|s| {
                s.delivered += 1;
                s.traffic(&header, true);
            });
            p.waiter.answer(net, Ok((header, payload)));
        }
        None => net.count(|s| s.dropped_unmatched += 1),
    }
}

/// An application frame whose payload came by rendezvous: to the AM id's (or request kind's)
/// rendezvous handler, which picks the buffer, or pulled into a vector (its length is checked
/// against the limit already) for [`dispatch`]. Data nobody wants is declined without
/// allocating.
fn deliver_rndv(
    ctx: &Rc<ShardCtx>,
    node: NodeId,
    header: FrameHeader,
    user: UserHeader,
    rndv: AmRndv,
) {
    let net = ctx.net();
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
        net.count(|s| {
            s.delivered += 1;
            s.traffic(&header, true);
        });
        h(ctx, node, header, rndv);
        return;
    }
    let len = rndv.len();
    let pull = WaitingPull {
        node,
        header,
        user,
        rndv,
    };
    if net
        .pulls
        .borrow_mut()
        .enter((node, header.src_shard), len, pull)
    {
        net.count(|s| s.rndv_pulls_waited += 1);
    }
    start_ready_pulls(ctx);
}

/// A rendezvous frame whose data goes into a buffer of the runtime, waiting for its rail's
/// earlier pulls ([`super::NetConfig::rndv_pull_budget`]).
pub(super) struct WaitingPull {
    node: NodeId,
    header: FrameHeader,
    user: UserHeader,
    rndv: AmRndv,
}

/// Starts the pulls the shard's gates let in ([`super::buffers::PullGates`]), unless a
/// caller up the stack is doing so already (a pull that ended at once, inside one started
/// here, lets the next in: it is started by this loop, not by a nested one).
fn start_ready_pulls(ctx: &Rc<ShardCtx>) {
    let net = ctx.net();
    if !net.pulls.borrow_mut().claim() {
        return;
    }
    // Should a handler's panic come through (dispatch catches them), the next caller starts
    // what is left.
    struct Unclaim<'a>(&'a NetState);
    impl Drop for Unclaim<'_> {
        fn drop(&mut self) {
            self.0.pulls.borrow_mut().unclaim();
        }
    }
    let _unclaim = Unclaim(net);
    loop {
        let next = net.pulls.borrow_mut().take_ready();
        let Some(p) = next else {
            break;
        };
        start_pull(ctx, p);
    }
}

/// Pulls `p`'s data into a buffer of the shard's ([`ShardCtx::rndv_buffer`], taken now, when
/// the pull may start: the one the handler of the peer's previous frame just dropped) and
/// dispatches the frame; then lets the rail's next pull in.
fn start_pull(ctx: &Rc<ShardCtx>, p: WaitingPull) {
    let WaitingPull {
        node,
        header,
        user,
        rndv,
    } = p;
    let len = rndv.len();
    let rail = (node, header.src_shard);
    let c = ctx.clone();
    let buf = ctx.rndv_buffer(len);
    start_now(async move {
        match buf.pull(&c, node, rndv).await {
            Ok(buf) => dispatch(
                &c,
                Frame {
                    node,
                    header,
                    user,
                    payload: Payload::from_rndv(buf, len),
                    arrived: super::timestamp_of(Instant::now()),
                },
            ),
            Err(_) => c.net().count(|s| s.declined += 1),
        }
        // After the handler: a buffer it dropped is the one the next pull takes.
        c.net().pulls.borrow_mut().leave(rail, len);
        start_ready_pulls(&c);
    });
}

/// Runs `fut` (a rendezvous pull and what follows it) as far as it goes now, on the driver's
/// stack, and the rest in a task: the pull's receive is posted to UCX at once (its first
/// poll), not when a task spawned for it first runs, after the driver yields; a pull UCX
/// completes at once (a shared-memory get) is handed over with no task at all. The first poll
/// has no waker to keep: every later one, the task's, registers its own.
fn start_now(fut: impl Future<Output = ()> + 'static) {
    let mut fut = Box::pin(fut);
    let first = fut
        .as_mut()
        .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
    if first.is_pending() {
        glommio::spawn_local(fut).detach();
    }
}

/// Pulls rendezvous data from `node` into `buf`, within [`NetConfig::rndv_timeout`].
///
/// [`NetConfig::rndv_timeout`]: super::NetConfig::rndv_timeout
pub(super) async fn pull<B: IoBufMut>(
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
    /// A vector.
    Vec(Vec<u8>),
    /// A recycled vector of the shard's receive cache ([`ShardCtx::rndv_buffer`]).
    Recycled(RecycledBuf),
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
            RndvBuf::Recycled(r) => Some(r.as_slice()),
        }
    }

    /// The buffer's length in bytes.
    pub fn len(&self) -> usize {
        match self {
            RndvBuf::Pool(b) => b.len(),
            RndvBuf::Host(b) => b.len(),
            RndvBuf::Vec(v) => v.len(),
            RndvBuf::Recycled(r) => r.as_slice().len(),
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
            RndvBuf::Recycled(mut r) => {
                let len = rndv.len();
                let v = pull(ctx, node, rndv, r.take_vec()).await?;
                r.restore(v, len);
                Ok(RndvBuf::Recycled(r))
            }
        }
    }
}

impl ShardCtx {
    /// A buffer for `len` bytes of rendezvous data: a block of this shard's registered pool
    /// when one of its size class is free, else a vector of the shard's receive cache (see
    /// [`super::buffers`]), allocated only when none of its size class is idle. This is where
    /// rendezvous data goes when no handler chose a buffer; a chooser may return it too.
    pub fn rndv_buffer(&self, len: usize) -> RndvBuf {
        let net = self.net();
        if let Some(b) = self.pool().alloc(len).filter(|b| !b.region().is_exported()) {
            net.count(|s| s.rndv_pooled += 1);
            return RndvBuf::Pool(b);
        }
        self.rndv_recycled(len)
    }

    /// A vector of this shard's receive cache for `len` bytes of rendezvous data (see
    /// [`ShardCtx::rndv_buffer`]), leaving the pool to handlers that ask for it.
    pub fn rndv_recycled(&self, len: usize) -> RndvBuf {
        let net = self.net();
        let (v, recycled) = recv_vec(&net.recv_cache, len);
        net.count(|s| {
            if recycled {
                s.rndv_recycled += 1
            } else {
                s.rndv_allocated += 1
            }
        });
        // The pull says how much data there is; until then the buffer shows all of it.
        let n = v.len();
        RndvBuf::Recycled(RecycledBuf::new(v, n, &net.recv_cache))
    }
}

impl ShardCtx {
    /// Registers, on this shard, the handler of application frames with `id` from connected
    /// nodes (replacing any previous one), with a copy of each payload as a vector. It runs on
    /// the progress driver, right after the frame arrived; it must not block, and may spawn
    /// tasks (e.g. to answer with [`ShardCtx::send_am`]). Register it on every shard that may
    /// own a peer. [`ShardCtx::set_frame_handler_am`] hands over the frame itself, with no copy.
    pub fn set_net_handler<F>(&self, id: AmId, handler: F)
    where
        F: Fn(&Rc<ShardCtx>, NodeId, Vec<u8>) + 'static,
    {
        self.set_frame_handler_am(id, move |ctx, frame: Frame| {
            let node = frame.node();
            handler(ctx, node, frame.into_vec())
        });
    }

    /// Registers, on this shard, the handler of application frames with `id` from connected
    /// nodes (replacing any previous one): it gets the [`Frame`], whose payload is UCX's
    /// descriptor for eager data (read in place, no copy) or a vector for rendezvous data
    /// without a rendezvous handler. It runs inline on the progress driver right after the
    /// frame arrived: it must not block; it may answer at once ([`ShardCtx::send_frame_now`]),
    /// keep the frame (the descriptor is released when it is dropped), or spawn tasks. A panic
    /// in it loses that frame only and is counted ([`super::NetStats::handler_panics`]).
    pub fn set_frame_handler_am<F>(&self, id: AmId, handler: F)
    where
        F: Fn(&Rc<ShardCtx>, Frame) + 'static,
    {
        self.net()
            .handlers
            .insert(id, AnyHandler::Frame(Rc::new(handler)));
    }

    /// [`ShardCtx::set_frame_handler_am`] for a handler that reads each frame in place for the
    /// length of the call ([`FrameView`], replacing any previous handler of `id`): a short
    /// message dispatched inside UCX's callback is read in UCX's receive buffer, with no copy
    /// and no [`Frame`] built. It runs where a frame handler would, under the same rules;
    /// what it wants to keep beyond the call, it copies.
    pub fn set_frame_view_handler_am<F>(&self, id: AmId, handler: F)
    where
        F: Fn(&Rc<ShardCtx>, &FrameView<'_>) + 'static,
    {
        self.net()
            .handlers
            .insert(id, AnyHandler::View(Rc::new(handler)));
    }

    /// [`ShardCtx::set_frame_handler_am`] for a handler that takes each frame lent where it
    /// was received ([`Incoming::Lent`], as [`ShardCtx::set_frame_view_handler_am`]'s) or
    /// owned ([`Incoming::Owned`], as [`ShardCtx::set_frame_handler_am`]'s), whichever costs
    /// nothing: lent when a short message is read in UCX's callback, owned when the frame was
    /// made anyway (a rendezvous payload in the buffer it landed in, a frame recorded for the
    /// driver's dispatch). For a handler that keeps large payloads where they landed and
    /// copies short ones (replacing any previous handler of `id`).
    pub fn set_frame_either_handler_am<F>(&self, id: AmId, handler: F)
    where
        F: Fn(&Rc<ShardCtx>, Incoming<'_>) + 'static,
    {
        self.net()
            .handlers
            .insert(id, AnyHandler::Either(Rc::new(handler)));
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
    ///
    /// [`NetConfig::rndv_threshold`]: super::NetConfig::rndv_threshold
    /// [`NetConfig::max_message_size`]: super::NetConfig::max_message_size
    /// [`NetConfig::rndv_timeout`]: super::NetConfig::rndv_timeout
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
    /// counted in [`super::NetStats::dropped_expired`]) and a copy of the payload (pulled into
    /// a vector when it came by rendezvous). It runs inline on the progress driver, must not
    /// block, and may spawn tasks, e.g. to answer with [`ShardCtx::reply`]. Register it on
    /// every shard that may own a peer; a request with no handler is dropped (and its sender
    /// times out). [`ShardCtx::set_frame_handler_inline`] hands over the frame, with no copy.
    pub fn set_frame_handler<F>(&self, kind: FrameKind, handler: F) -> Result<(), NetError>
    where
        F: Fn(&Rc<ShardCtx>, NodeId, &FrameHeader, Vec<u8>) + 'static,
    {
        self.set_frame_handler_inline(kind, move |ctx, frame: Frame| {
            let (node, header) = (frame.node(), *frame.header());
            handler(ctx, node, &header, frame.into_vec())
        })
    }

    /// [`ShardCtx::set_frame_handler`] with the [`Frame`] itself: the payload is read in place
    /// (UCX's descriptor) and released when the frame is dropped; answer inline with
    /// [`ShardCtx::reply_now`].
    pub fn set_frame_handler_inline<F>(&self, kind: FrameKind, handler: F) -> Result<(), NetError>
    where
        F: Fn(&Rc<ShardCtx>, Frame) + 'static,
    {
        self.set_kind_handler(kind, AnyHandler::Frame(Rc::new(handler)))
    }

    /// [`ShardCtx::set_frame_handler_inline`] for a handler that reads each frame in place for
    /// the length of the call ([`FrameView`]; see [`ShardCtx::set_frame_view_handler_am`]).
    pub fn set_frame_view_handler<F>(&self, kind: FrameKind, handler: F) -> Result<(), NetError>
    where
        F: Fn(&Rc<ShardCtx>, &FrameView<'_>) + 'static,
    {
        self.set_kind_handler(kind, AnyHandler::View(Rc::new(handler)))
    }

    fn set_kind_handler(&self, kind: FrameKind, handler: AnyHandler) -> Result<(), NetError> {
        if self.net().frame_handlers.borrow_mut().set(kind, handler) {
            Ok(())
        } else {
            Err(NetError::BadKind {
                kind,
                op: "register a frame handler",
            })
        }
    }

    /// Registers, on this shard, the rendezvous handler of incoming request frames of `kind`
    /// ([`FrameKind::RpcRequest`], [`FrameKind::RmaPut`] or [`FrameKind::RmaGet`]; others are
    /// refused with [`NetError::BadKind`]), replacing any previous one: for a frame whose
    /// payload came by rendezvous, `choose` picks the buffer the data is pulled into before any
    /// byte is received, and `on_data` gets it once the data is in it. The counterpart of
    /// [`ShardCtx::set_net_handler_rndv`] for requests; the buffer is a [`RndvBuf`], so that
    /// one handler may choose a different kind of memory per frame (e.g. per RPC function).
    ///
    /// `choose` runs on the progress driver after the frame's checks (size limit, connection,
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
    ///
    /// [`NetConfig::rndv_timeout`]: super::NetConfig::rndv_timeout
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
}

/// A rendezvous handler: `choose` picks the buffer on the progress driver (`None` declines the
/// data); `pull` then pulls the data into it (posted at once, on the driver's stack: see
/// `start_now`) and `on_data` gets the result, from the dispatch itself when UCX completed the
/// pull at once, else from a task.
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
        start_now(async move {
            let res = pull(c.clone(), node, rndv, buf).await;
            if res.is_err() {
                c.net().count(|s| s.declined += 1);
            }
            on_data(&c, node, &header, res);
        });
    })
}
