//! The serving side: registrations, the per-shard function table, dedup window and counters,
//! and the handling of request and cancel frames.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::future::{poll_fn, Future};
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use futures_lite::FutureExt;
use glommio::timer::sleep;
use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::Archived;
use shardcx_shards::net::{instant_of, timestamp_of, RndvBuf};
use shardcx_shards::proto::request::DedupHasher;
use shardcx_shards::proto::rpc::{decode_request, encode_error, CallFlags, RpcErrorCode};
use shardcx_shards::proto::wire::NO_DEADLINE_TTL;
use shardcx_shards::proto::{
    DedupKey, DedupVerdict, DedupWindow, FrameHeader, FrameKind, FunctionId, NodeId, ReqId,
    Timestamp, REQUEST_PREFIX_LEN,
};
use shardcx_shards::{NetError, ShardCtx, SpareVec};

use super::{Describe, Discover, NodeInfo, RpcFunction, RpcType, Signature};
use crate::node::ShardLocal;
use crate::{Error, Node, Peer};

/// Settings of RPC on a node ([`crate::NodeBuilder::rpc_config`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcConfig {
    /// Requests each shard's dedup window remembers (default 16384).
    pub dedup_entries: usize,
    /// How long the window remembers a request (default 30 s). A copy arriving later is
    /// refused ([`super::RpcError::TooOld`]).
    pub dedup_max_age: Duration,
    /// Replies up to this many bytes are kept in the window for resending to copies of their
    /// request (default 4096); a copy of a request with a longer reply gets `TooOld`. Bounds the
    /// window's memory to about `dedup_entries × dedup_reply_bytes`.
    pub dedup_reply_bytes: usize,
    /// Largest argument archive served, in bytes (default: none beyond the net layer's
    /// `max_message_size`); larger ones are refused with [`super::RpcError::TooLarge`].
    pub max_args_size: Option<u64>,
    /// Deadline of calls made without one (default: the node's,
    /// [`crate::NodeBuilder::default_deadline`]).
    pub default_deadline: Option<Duration>,
    /// How long an async handler may go on after its call was cancelled before it is dropped
    /// (default 50 ms): time to notice [`RpcContext::cancelled`] and clean up.
    pub cancel_grace: Duration,
}

/// Counters of one shard's RPC server ([`crate::Node::rpc_stats`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RpcStats {
    /// Calls answered with a reply.
    pub served: u64,
    /// Calls whose handler returned an error.
    pub failed: u64,
    /// Calls whose handler panicked.
    pub panicked: u64,
    /// Requests for a function id this node does not serve.
    pub unknown_function: u64,
    /// Requests whose schema hash differs from the function's.
    pub schema_mismatch: u64,
    /// Requests with a malformed envelope or arguments that failed validation.
    pub malformed: u64,
    /// Requests whose arguments are over [`RpcConfig::max_args_size`].
    pub too_large: u64,
    /// Requests refused as older than the dedup window can vouch for.
    pub too_old: u64,
    /// Calls whose deadline passed on this server (answered `DeadlineExpired`).
    pub expired: u64,
    /// Calls cancelled by their caller while running here.
    pub cancelled: u64,
    /// Copies of finished requests answered from the dedup window (not run again).
    pub replayed: u64,
    /// Copies of requests still running, dropped.
    pub duplicates_dropped: u64,
    /// One-way calls run.
    pub one_way: u64,
}

impl std::ops::AddAssign for RpcStats {
    fn add_assign(&mut self, o: RpcStats) {
        let RpcStats {
            served,
            failed,
            panicked,
            unknown_function,
            schema_mismatch,
            malformed,
            too_large,
            too_old,
            expired,
            cancelled,
            replayed,
            duplicates_dropped,
            one_way,
        } = o;
        self.served += served;
        self.failed += failed;
        self.panicked += panicked;
        self.unknown_function += unknown_function;
        self.schema_mismatch += schema_mismatch;
        self.malformed += malformed;
        self.too_large += too_large;
        self.too_old += too_old;
        self.expired += expired;
        self.cancelled += cancelled;
        self.replayed += replayed;
        self.duplicates_dropped += duplicates_dropped;
        self.one_way += one_way;
    }
}

/// The node's counters from its shards' (e.g. the results of a [`crate::NodeBuilder::run`]
/// whose closures return [`crate::Node::rpc_stats`]).
impl std::iter::Sum for RpcStats {
    fn sum<I: Iterator<Item = RpcStats>>(iter: I) -> RpcStats {
        iter.fold(RpcStats::default(), |mut t, s| {
            t += s;
            t
        })
    }
}

/// What a handler's run came to: the reply's archive, or an error reply.
type Outcome = Result<Vec<u8>, Failure>;

/// An error reply.
pub(crate) struct Failure {
    code: RpcErrorCode,
    detail: u64,
    message: String,
}

type PlainFn = dyn Fn(&RpcContext, &[u8]) -> Outcome;
type AsyncFn = dyn Fn(RpcContext, &[u8]) -> Result<Pin<Box<dyn Future<Output = Outcome>>>, Failure>;

/// A registered handler, its types erased: from argument bytes to reply bytes.
#[derive(Clone)]
pub(crate) enum ErasedHandler {
    Plain(Rc<PlainFn>),
    Async(Rc<AsyncFn>),
}

type Factory = Arc<dyn Fn() -> ErasedHandler + Send + Sync>;

/// One function registered on the builder.
#[derive(Clone)]
pub(crate) struct Registration {
    pub(crate) signature: Signature,
    factory: Factory,
}

/// RPC settings and registrations of a node builder. `Send`.
#[derive(Clone)]
pub(crate) struct RpcSetup {
    pub(crate) functions: Vec<Registration>,
    pub(crate) config: RpcConfig,
    /// The service name published by [`Describe`] (set by [`super::ClusterRegistry`]).
    pub(crate) service: Arc<Mutex<Option<String>>>,
    /// Rendezvous argument choosers given to the builder, by function id.
    pub(crate) choosers: Vec<(u32, SharedChooser)>,
}

/// A chooser given to [`crate::NodeBuilder::rpc_args_buffer`], shared by the shards.
pub(crate) type SharedChooser = Arc<dyn Fn(&Node, Peer, usize) -> Option<RndvBuf> + Send + Sync>;

/// One shard's RPC state (in its [`ShardLocal`]).
pub(crate) struct ShardRpc {
    pub(crate) config: RpcConfig,
    pub(crate) service: Arc<Mutex<Option<String>>>,
    /// By function id (from the network: keyed like the dedup window's tables, not SipHash,
    /// which cost some 80 instructions per call).
    functions: RefCell<HashMap<u32, Served, DedupHasher>>,
    signatures: Rc<Vec<Signature>>,
    dedup: RefCell<DedupWindow<Option<CachedReply>>>,
    /// The vector the next plain handler's reply is encoded into: the last reply's, once it
    /// was sent and, if small, copied into the dedup window (see [`CachedReply`]), so a call
    /// with a small reply allocates no archive of its own.
    spare_reply: SpareVec,
    /// Calls of async handlers running, for cancel frames.
    running: RefCell<HashMap<DedupKey, Rc<CancelState>>>,
    /// Choosers of the buffer that rendezvous arguments land in, by function id
    /// ([`Node::rpc_args_buffer`]).
    choosers: RefCell<HashMap<u32, Rc<ArgsChooser>>>,
    stats: Cell<RpcStats>,
    /// Round trips of the calls this shard makes, per function.
    pub(crate) latency: super::latency::Latencies,
}

/// Picks the buffer of a function's rendezvous arguments: gets this shard's node, the caller
/// and the bytes to receive.
type ArgsChooser = dyn Fn(&Node, Peer, usize) -> Option<RndvBuf>;

/// Where a call's request bytes (envelope and argument archive) were received
/// ([`RpcContext::args_location`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ArgsLocation {
    /// In the frame itself (at most the sender's rendezvous threshold, 8 KiB by default).
    Inline,
    /// By rendezvous into a vector: the function has no chooser
    /// ([`Node::rpc_args_buffer`]), so a recycled vector of the shard's receive cache
    /// (`ShardCtx::rndv_recycled`: allocated once per size class, reused without zeroing),
    /// or the chooser returned a vector.
    Vec,
    /// By rendezvous into a block of the shard's registered pool, as its chooser asked.
    Pool,
    /// By rendezvous into aligned host memory, as its chooser asked.
    Host,
}

/// A function as a shard serves it.
struct Served {
    schema: u64,
    handler: ErasedHandler,
}

/// A finished request's answer, kept for copies of the request.
struct CachedReply {
    kind: FrameKind,
    payload: ReplyBytes,
}

/// Replies up to this many bytes are kept in the dedup window's entry itself.
const INLINE_REPLY: usize = 48;

/// A kept reply's bytes: in the entry when small (the reply's vector then goes back to the
/// shard for the next reply, see [`ShardRpc::spare_reply`]), else the reply's vector.
enum ReplyBytes {
    Inline([u8; INLINE_REPLY], u8),
    Heap(Vec<u8>),
}

impl ReplyBytes {
    fn as_slice(&self) -> &[u8] {
        match self {
            ReplyBytes::Inline(a, n) => &a[..usize::from(*n)],
            ReplyBytes::Heap(v) => v,
        }
    }
}

/// Spare reply vectors larger than this are dropped rather than kept for the next reply.
const MAX_SPARE_REPLY: usize = 4096;

impl ShardRpc {
    /// What the dedup window keeps of a reply sent (`bytes`): small ones copied, their vector
    /// recycled.
    fn keep_reply(&self, bytes: Vec<u8>) -> ReplyBytes {
        keep_reply(&self.spare_reply, bytes)
    }
}

/// See [`ShardRpc::keep_reply`].
fn keep_reply(spare: &SpareVec, bytes: Vec<u8>) -> ReplyBytes {
    if bytes.len() <= INLINE_REPLY {
        let mut a = [0u8; INLINE_REPLY];
        a[..bytes.len()].copy_from_slice(&bytes);
        // At most INLINE_REPLY (48): fits a u8.
        let n = bytes.len() as u8;
        spare.give(bytes);
        ReplyBytes::Inline(a, n)
    } else {
        ReplyBytes::Heap(bytes)
    }
}

/// A running call's cancellation: set by a cancel frame, seen by the handler.
#[derive(Default)]
struct CancelState {
    cancelled: Cell<bool>,
    wakers: RefCell<Vec<Waker>>,
}

/// What a handler knows about its call. Cheap to clone; `!Send` (it holds the shard's
/// [`Node`]).
#[derive(Clone)]
pub struct RpcContext {
    node: Node,
    caller: Peer,
    function: FunctionId,
    req_id: ReqId,
    /// On the net layer's clock (a nanosecond count: no `Instant` arithmetic per call, only
    /// when a handler asks).
    deadline: Option<Timestamp>,
    cancel: Option<Rc<CancelState>>,
    location: ArgsLocation,
    /// The caller wants no reply: a plain handler's reply is not encoded.
    one_way: bool,
}

impl Default for RpcConfig {
    fn default() -> Self {
        Self {
            dedup_entries: 16 * 1024,
            dedup_max_age: Duration::from_secs(30),
            dedup_reply_bytes: 4096,
            max_args_size: None,
            default_deadline: None,
            cancel_grace: Duration::from_millis(50),
        }
    }
}

impl Failure {
    fn new(code: RpcErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            detail: 0,
            message: message.into(),
        }
    }

    fn encode(&self) -> Vec<u8> {
        encode_error(self.code, self.detail, &self.message)
    }
}

impl Registration {
    /// A plain handler for `F`, from its per-shard factory.
    pub(crate) fn plain<F, M, H>(factory: M) -> Self
    where
        F: RpcFunction,
        M: Fn() -> H + Send + Sync + 'static,
        H: Fn(&RpcContext, &Archived<F::Args>) -> Result<F::Reply, String> + 'static,
    {
        let factory: Factory = Arc::new(move || plain_handler::<F, _>(factory()));
        Self {
            signature: F::signature(),
            factory,
        }
    }

    /// An async handler for `F`, from its per-shard factory.
    pub(crate) fn asynchronous<F, M, H, Fut>(factory: M) -> Self
    where
        F: RpcFunction,
        M: Fn() -> H + Send + Sync + 'static,
        H: Fn(RpcContext, F::Args) -> Fut + 'static,
        Fut: Future<Output = Result<F::Reply, String>> + 'static,
    {
        let factory: Factory = Arc::new(move || {
            let h = Rc::new(factory());
            ErasedHandler::Async(Rc::new(move |ctx: RpcContext, args: &[u8]| {
                let args = with_archived::<F::Args, _>(args, |a| {
                    rkyv::deserialize::<F::Args, rancor::Error>(a)
                })
                .and_then(|r| r)
                .map_err(|e| Failure::new(RpcErrorCode::BadRequest, e.to_string()))?;
                let fut = h(ctx, args);
                Ok(Box::pin(async move {
                    let reply = fut
                        .await
                        .map_err(|m| Failure::new(RpcErrorCode::Failed, m))?;
                    encode_reply(&reply, Vec::with_capacity(64))
                }) as Pin<Box<dyn Future<Output = Outcome>>>)
            }))
        });
        Self {
            signature: F::signature(),
            factory,
        }
    }
}

impl RpcSetup {
    pub(crate) fn new() -> Self {
        Self {
            functions: Vec::new(),
            config: RpcConfig::default(),
            service: Arc::new(Mutex::new(None)),
            choosers: Vec::new(),
        }
    }

    /// Adds `r`, replacing an earlier registration of its id.
    pub(crate) fn add(&mut self, r: Registration) {
        self.functions.retain(|f| f.signature.id != r.signature.id);
        self.functions.push(r);
    }

    /// Refuses reserved ids and a name registered under two ids.
    pub(crate) fn check(&self) -> Result<(), Error> {
        for (i, f) in self.functions.iter().enumerate() {
            if f.signature.id >= super::FIRST_RESERVED_FUNCTION_ID {
                return Err(Error::ReservedFunctionId {
                    id: FunctionId::new(f.signature.id),
                });
            }
            if self.functions[..i]
                .iter()
                .any(|g| g.signature.name == f.signature.name)
            {
                return Err(Error::DuplicateFunctionName {
                    name: f.signature.name.clone(),
                });
            }
        }
        Ok(())
    }

    /// This shard's RPC state: every registered function's handler (from its factory) and the
    /// built-ins.
    pub(crate) fn build(&self) -> ShardRpc {
        let mut functions = HashMap::with_hasher(DedupHasher::random());
        let mut signatures = Vec::new();
        for r in &self.functions {
            functions.insert(
                r.signature.id,
                Served {
                    schema: r.signature.schema,
                    handler: (r.factory)(),
                },
            );
            signatures.push(r.signature.clone());
        }
        signatures.push(Discover::signature());
        signatures.push(Describe::signature());
        signatures.sort_by_key(|s| s.id);
        let c = &self.config;
        ShardRpc {
            config: c.clone(),
            service: self.service.clone(),
            functions: RefCell::new(functions),
            signatures: Rc::new(signatures),
            dedup: RefCell::new(DedupWindow::new(c.dedup_entries, c.dedup_max_age)),
            spare_reply: SpareVec::new(64, MAX_SPARE_REPLY),
            running: RefCell::new(HashMap::new()),
            choosers: RefCell::new(
                self.choosers
                    .iter()
                    .map(|(id, c)| {
                        let c = c.clone();
                        let local: Rc<ArgsChooser> =
                            Rc::new(move |n: &Node, p: Peer, len: usize| c(n, p, len));
                        (*id, local)
                    })
                    .collect(),
            ),
            stats: Cell::new(RpcStats::default()),
            latency: super::latency::Latencies::default(),
        }
    }
}

impl ShardRpc {
    /// This shard's counters.
    pub(crate) fn stats(&self) -> RpcStats {
        self.stats.get()
    }

    /// The signatures this node serves, built-ins included, by id.
    pub(crate) fn signatures(&self) -> &[Signature] {
        &self.signatures
    }

    fn count(&self, f: impl FnOnce(&mut RpcStats)) {
        let mut s = self.stats.get();
        f(&mut s);
        self.stats.set(s);
    }

    /// Counts a failure by its code.
    fn count_failure(&self, code: RpcErrorCode) {
        self.count(|s| match code {
            RpcErrorCode::Failed => s.failed += 1,
            RpcErrorCode::Panicked => s.panicked += 1,
            RpcErrorCode::UnknownFunction => s.unknown_function += 1,
            RpcErrorCode::SchemaMismatch => s.schema_mismatch += 1,
            RpcErrorCode::BadRequest => s.malformed += 1,
            RpcErrorCode::TooLarge => s.too_large += 1,
            RpcErrorCode::TooOld => s.too_old += 1,
            RpcErrorCode::DeadlineExpired => s.expired += 1,
            RpcErrorCode::Cancelled => s.cancelled += 1,
            _ => {}
        });
    }
}

impl RpcContext {
    /// The calling node.
    pub fn caller(&self) -> Peer {
        self.caller
    }

    /// This node (the shard running the handler).
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// The function called.
    pub fn function(&self) -> FunctionId {
        self.function
    }

    /// The call's request id on its connection ([`ReqId::NONE`] for a one-way call).
    pub fn req_id(&self) -> ReqId {
        self.req_id
    }

    /// When the caller stops waiting (`None`: no deadline, e.g. a one-way call).
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline.map(instant_of)
    }

    /// Time left before the deadline (zero once passed; `None`: no deadline).
    pub fn remaining(&self) -> Option<Duration> {
        self.deadline()
            .map(|d| d.saturating_duration_since(Instant::now()))
    }

    /// Where the call's arguments were received: in the frame, or by rendezvous into the
    /// buffer its function's chooser picked ([`Node::rpc_args_buffer`]). A plain handler reads
    /// the archive in place there (when 16-byte aligned, as pool blocks, aligned host buffers
    /// and vectors from the allocator are).
    pub fn args_location(&self) -> ArgsLocation {
        self.location
    }

    /// Whether the caller has cancelled the call (always `false` in a plain handler, which
    /// runs in one go).
    pub fn is_cancelled(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.cancelled.get())
    }

    /// Resolves when the caller cancels the call (never in a plain handler, or for a one-way
    /// call). An async handler may race its work with it.
    pub async fn cancelled(&self) {
        match &self.cancel {
            Some(c) => c.wait().await,
            None => std::future::pending().await,
        }
    }
}

impl CancelState {
    fn cancel(&self) {
        self.cancelled.set(true);
        for w in self.wakers.borrow_mut().drain(..) {
            w.wake();
        }
    }

    fn wait(&self) -> impl Future<Output = ()> + '_ {
        poll_fn(move |cx| {
            if self.cancelled.get() {
                Poll::Ready(())
            } else {
                let mut w = self.wakers.borrow_mut();
                if !w.iter().any(|x| x.will_wake(cx.waker())) {
                    w.push(cx.waker().clone());
                }
                Poll::Pending
            }
        })
    }
}

/// A plain handler for `F`, its types erased.
fn plain_handler<F, H>(h: H) -> ErasedHandler
where
    F: RpcFunction,
    H: Fn(&RpcContext, &Archived<F::Args>) -> Result<F::Reply, String> + 'static,
{
    ErasedHandler::Plain(Rc::new(move |ctx: &RpcContext, args: &[u8]| {
        let reply = with_archived::<F::Args, _>(args, |a| h(ctx, a))
            .map_err(|e| Failure::new(RpcErrorCode::BadRequest, e.to_string()))?
            .map_err(|m| Failure::new(RpcErrorCode::Failed, m))?;
        if ctx.one_way {
            // Nobody reads it: not encoded (nor allocated).
            return Ok(Vec::new());
        }
        encode_reply(&reply, ctx.node.local().rpc.spare_reply.take())
    }))
}

/// Runs `f` on the validated archive of a `T` in `bytes`: in place when it validates there,
/// else (when `bytes` is not 16-byte aligned) from an aligned copy (see [`archived_in_place`]).
pub(crate) fn with_archived<T: RpcType, R>(
    bytes: &[u8],
    f: impl FnOnce(&Archived<T>) -> R,
) -> Result<R, rancor::Error> {
    match archived_in_place::<T>(bytes)? {
        Some(a) => Ok(f(a)),
        None => with_archived_copy::<T, R>(bytes, f),
    }
}

/// The validated archive of a `T` where it lies in `bytes`; `None` when it does not validate
/// there and `bytes` is not 16-byte aligned (validate an aligned copy instead); the error when
/// it does not validate in 16-byte-aligned bytes.
///
/// Archives are written for a 16-byte-aligned start, but received bytes are not always there
/// (most requests that UCX's shared-memory transport delivered in place were not: 78 in 100
/// calls of `with_archived` took the copy before this, in the call tree of
/// `scripts/count-instructions --test rpc-notify --keep DIR`). rkyv's validation checks every
/// pointer of the archive against its type's alignment (`UnalignedPointer` otherwise), so an
/// archive whose types need no more than the buffer's alignment (most: byte vectors, strings,
/// 4- and 8-byte numbers) validates and is read in place, soundly; one that needs more fails
/// there and is copied. Only a misaligned archive that fails is validated twice.
pub(crate) fn archived_in_place<T: RpcType>(
    bytes: &[u8],
) -> Result<Option<&Archived<T>>, rancor::Error> {
    match rkyv::access::<Archived<T>, rancor::Error>(bytes) {
        Ok(a) => Ok(Some(a)),
        Err(e) if (bytes.as_ptr() as usize) % ARCHIVE_ALIGN == 0 => Err(e),
        Err(_) => Ok(None),
    }
}

/// [`with_archived`] from an aligned copy of `bytes`, out of line.
#[inline(never)]
fn with_archived_copy<T: RpcType, R>(
    bytes: &[u8],
    f: impl FnOnce(&Archived<T>) -> R,
) -> Result<R, rancor::Error> {
    // A reused buffer of this thread's: no allocation per call once it has grown.
    let mut copy = ALIGNED_SCRATCH.take().unwrap_or_default();
    copy.clear();
    copy.extend_from_slice(bytes);
    let out = rkyv::access::<Archived<T>, rancor::Error>(&copy).map(f);
    if copy.capacity() <= MAX_ALIGNED_SCRATCH {
        ALIGNED_SCRATCH.set(Some(copy));
    }
    out
}

thread_local! {
    /// The aligned copy [`with_archived`] reads a misaligned archive from (taken while in use:
    /// a nested call makes its own).
    static ALIGNED_SCRATCH: std::cell::Cell<Option<AlignedVec<ARCHIVE_ALIGN>>> =
        const { std::cell::Cell::new(None) };
}

/// Aligned copies larger than this are not kept for the next call.
const MAX_ALIGNED_SCRATCH: usize = 64 << 10;

/// Alignment at which archives are read in place.
pub(crate) const ARCHIVE_ALIGN: usize = 16;

/// `bytes` in a 16-byte-aligned buffer.
pub(crate) fn aligned_copy(bytes: &[u8]) -> AlignedVec<ARCHIVE_ALIGN> {
    let mut v = AlignedVec::<ARCHIVE_ALIGN>::with_capacity(bytes.len());
    v.extend_from_slice(bytes);
    v
}

/// The archive of a reply, written into `into` (empty, with room for a small archive).
fn encode_reply<T: RpcType>(reply: &T, into: Vec<u8>) -> Outcome {
    super::archive_into(reply, into)
        .map_err(|e| Failure::new(RpcErrorCode::Failed, format!("reply not serialized: {e}")))
}

/// On every shard, before it serves: the built-ins, and the handlers of request and cancel
/// frames.
pub(crate) fn install(ctx: &Rc<ShardCtx>, shared: &Rc<ShardLocal>) {
    let rpc = &shared.rpc;
    {
        let mut functions = rpc.functions.borrow_mut();
        let signatures = rpc.signatures.clone();
        functions.insert(
            Discover::ID.get(),
            Served {
                schema: Discover::schema(),
                handler: plain_handler::<Discover, _>(move |_: &RpcContext, _: &Archived<()>| {
                    Ok(signatures.to_vec())
                }),
            },
        );
        functions.insert(
            Describe::ID.get(),
            Served {
                schema: Describe::schema(),
                handler: plain_handler::<Describe, _>(|c: &RpcContext, _: &Archived<()>| {
                    Ok(describe(c.node()))
                }),
            },
        );
    }
    let on_request = shared.clone();
    // Registering for these two kinds cannot fail (BadKind is for other kinds). The request's
    // arguments are read where UCX put them (16-byte aligned, as the envelope's prefix is 16
    // bytes): no copy.
    let _ = ctx.set_frame_view_handler(FrameKind::RpcRequest, move |ctx, frame| {
        on_request_frame(
            ctx,
            &on_request,
            (frame.node(), frame.header(), frame.arrived_at()),
            frame.payload(),
            ArgsLocation::Inline,
        );
    });
    let (choose, on_data) = (shared.clone(), shared.clone());
    // Registering for RpcRequest cannot fail (BadKind is for other kinds).
    let _ = ctx.set_frame_handler_rndv(
        FrameKind::RpcRequest,
        move |ctx, from, header| choose_args_buffer(ctx, &choose, from, header),
        move |ctx, from, header, got| on_rndv_request(ctx, &on_data, from, header, got),
    );
    let on_cancel = shared.clone();
    let _ = ctx.set_frame_handler(FrameKind::RpcCancel, move |_ctx, from, header, _payload| {
        let key = DedupKey {
            node: from,
            incarnation: header.incarnation,
            shard: header.src_shard,
            req_id: header.req_id,
        };
        let running = on_cancel.rpc.running.borrow().get(&key).cloned();
        if let Some(c) = running {
            c.cancel();
        }
    });
}

/// This node's [`NodeInfo`].
fn describe(node: &Node) -> NodeInfo {
    let rpc = &node.local().rpc;
    NodeInfo {
        service: rpc.service.lock().ok().and_then(|s| s.clone()),
        addr: node.listen_addr().map(|a| a.to_string()),
        shards: u16::try_from(node.shard_count()).unwrap_or(u16::MAX),
        functions: rpc.signatures.to_vec(),
    }
}

/// Answers a request with `kind` and `payload`, from the owner shard (where frame handlers
/// run); a request of a one-way call is not answered.
fn answer(ctx: &ShardCtx, node: NodeId, header: &FrameHeader, kind: FrameKind, payload: &[u8]) {
    if header.req_id != ReqId::NONE {
        // The connection may have gone meanwhile: then nobody is waiting.
        let _ = ctx.reply_now(node, header, kind, payload);
    }
}

/// Refuses a request before it runs (nothing recorded in the dedup window).
fn refuse(ctx: &ShardCtx, rpc: &ShardRpc, node: NodeId, header: &FrameHeader, f: Failure) {
    rpc.count_failure(f.code);
    strike_if_malformed(ctx, node, f.code);
    answer(ctx, node, header, FrameKind::RpcError, &f.encode());
}

/// A request refused because it does not decode (its envelope or its arguments) counts against
/// its sender: one that keeps sending them is dropped (`NetConfig::strike_limit`, see
/// [`ShardCtx::strike`]).
fn strike_if_malformed(ctx: &ShardCtx, from: NodeId, code: RpcErrorCode) {
    if code == RpcErrorCode::BadRequest {
        ctx.strike(from);
    }
}

/// Before the rendezvous data of a request is pulled: refuses an unknown function and
/// arguments over [`RpcConfig::max_args_size`] without receiving them, then asks the
/// function's chooser for the buffer (a recycled vector when it has none); a chooser that
/// declines gets the caller [`super::RpcError::Busy`].
fn choose_args_buffer(
    ctx: &Rc<ShardCtx>,
    shared: &Rc<ShardLocal>,
    from: NodeId,
    header: &FrameHeader,
) -> Option<RndvBuf> {
    let rpc = &shared.rpc;
    if !rpc.functions.borrow().contains_key(&header.id) {
        let f = Failure::new(
            RpcErrorCode::UnknownFunction,
            format!("no function {}", header.id),
        );
        refuse(ctx, rpc, from, header, f);
        return None;
    }
    let len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
    if let Some(max) = rpc.config.max_args_size {
        let args = header.payload_len.saturating_sub(REQUEST_PREFIX_LEN as u64);
        if args > max {
            let f = Failure {
                code: RpcErrorCode::TooLarge,
                detail: max,
                message: format!("arguments of {args} bytes, limit {max}"),
            };
            refuse(ctx, rpc, from, header, f);
            return None;
        }
    }
    let chooser = rpc.choosers.borrow().get(&header.id).cloned();
    let Some(chooser) = chooser else {
        // A recycled vector of the shard's receive cache: no allocation, no zeroing, once
        // warm.
        return Some(ctx.rndv_recycled(len));
    };
    let node = Node::from_parts(ctx.clone(), shared.clone());
    let buf = std::panic::catch_unwind(AssertUnwindSafe(|| chooser(&node, Peer::new(from), len)))
        .unwrap_or(None);
    if buf.is_none() {
        let f = Failure::new(
            RpcErrorCode::Busy,
            format!("no buffer for {len} bytes of arguments"),
        );
        refuse(ctx, rpc, from, header, f);
    }
    buf
}

/// Rendezvous arguments received (or not) into the buffer [`choose_args_buffer`] picked.
fn on_rndv_request(
    ctx: &Rc<ShardCtx>,
    shared: &Rc<ShardLocal>,
    from: NodeId,
    header: &FrameHeader,
    got: Result<RndvBuf, NetError>,
) {
    let rpc = &shared.rpc;
    let len = usize::try_from(header.payload_len).unwrap_or(usize::MAX);
    let buf = match got {
        Ok(buf) if buf.len() >= len => buf,
        Ok(buf) => {
            let f = Failure::new(
                RpcErrorCode::Failed,
                format!("argument buffer of {} bytes for {len}", buf.len()),
            );
            return refuse(ctx, rpc, from, header, f);
        }
        Err(e) => {
            let f = Failure::new(RpcErrorCode::Failed, format!("arguments not received: {e}"));
            return refuse(ctx, rpc, from, header, f);
        }
    };
    let location = match &buf {
        RndvBuf::Pool(_) => ArgsLocation::Pool,
        RndvBuf::Host(_) => ArgsLocation::Host,
        _ => ArgsLocation::Vec,
    };
    match buf.bytes() {
        Some(_) => {
            let payload = Received { buf, len };
            on_request_frame(
                ctx,
                shared,
                (from, header, timestamp_of(Instant::now())),
                payload,
                location,
            );
        }
        // A pool block whose memory a remote key was packed for: read through a copy.
        None => {
            let mut copy = vec![0; len];
            let read = match &buf {
                RndvBuf::Pool(b) => b.read_at(0, &mut copy).is_ok(),
                _ => false,
            };
            if !read {
                let f = Failure::new(RpcErrorCode::Failed, "argument buffer not readable");
                return refuse(ctx, rpc, from, header, f);
            }
            on_request_frame(
                ctx,
                shared,
                (from, header, timestamp_of(Instant::now())),
                copy,
                location,
            );
        }
    }
}

/// Rendezvous data: the first `len` bytes of `buf` (readable, checked by [`on_rndv_request`]).
struct Received {
    buf: RndvBuf,
    len: usize,
}

impl AsRef<[u8]> for Received {
    fn as_ref(&self) -> &[u8] {
        self.buf
            .bytes()
            .and_then(|b| b.get(..self.len))
            .unwrap_or_default()
    }
}

/// Handles one request frame on the shard that owns its sender (see the module docs for the
/// order of the checks).
fn on_request_frame<P: AsRef<[u8]>>(
    ctx: &Rc<ShardCtx>,
    shared: &Rc<ShardLocal>,
    (from, header, arrived): (NodeId, &FrameHeader, Timestamp),
    payload: P,
    location: ArgsLocation,
) {
    let rpc = &shared.rpc;
    let bytes = payload.as_ref();
    let env = match decode_request(bytes) {
        Ok(e) => e,
        Err(e) => {
            let f = Failure::new(RpcErrorCode::BadRequest, format!("bad envelope: {e}"));
            return refuse(ctx, rpc, from, header, f);
        }
    };
    let one_way = env.flags.contains(CallFlags::ONE_WAY) || header.req_id == ReqId::NONE;
    let (schema, handler) = match rpc.functions.borrow().get(&header.id) {
        Some(s) => (s.schema, s.handler.clone()),
        None => {
            let f = Failure::new(
                RpcErrorCode::UnknownFunction,
                format!("no function {}", header.id),
            );
            return refuse(ctx, rpc, from, header, f);
        }
    };
    if env.schema != schema {
        let f = Failure {
            code: RpcErrorCode::SchemaMismatch,
            detail: schema,
            message: format!(
                "function {}: caller's schema {:#018x}, server's {schema:#018x}",
                header.id, env.schema
            ),
        };
        return refuse(ctx, rpc, from, header, f);
    }
    if let Some(max) = rpc.config.max_args_size {
        let len = env.args.len() as u64;
        if len > max {
            let f = Failure {
                code: RpcErrorCode::TooLarge,
                detail: max,
                message: format!("arguments of {len} bytes, limit {max}"),
            };
            return refuse(ctx, rpc, from, header, f);
        }
    }
    let key = DedupKey {
        node: from,
        incarnation: header.incarnation,
        shard: header.src_shard,
        req_id: header.req_id,
    };
    if !one_way {
        let replay = match rpc.dedup.borrow_mut().check_and_insert(arrived, key) {
            DedupVerdict::Fresh => None,
            DedupVerdict::InProgress => {
                rpc.count(|s| s.duplicates_dropped += 1);
                return;
            }
            DedupVerdict::Done(Some(cached)) => {
                Some((cached.kind, cached.payload.as_slice().to_vec()))
            }
            DedupVerdict::Done(None) => Some((
                FrameKind::RpcError,
                Failure::new(RpcErrorCode::TooOld, "reply no longer kept").encode(),
            )),
            DedupVerdict::TooOld => {
                let f = Failure::new(RpcErrorCode::TooOld, "request older than the window");
                return refuse(ctx, rpc, from, header, f);
            }
        };
        if let Some((kind, bytes)) = replay {
            rpc.count(|s| s.replayed += 1);
            return answer(ctx, from, header, kind, &bytes);
        }
    }
    let deadline = (header.ttl_ns != NO_DEADLINE_TTL && !one_way)
        .then(|| arrived.saturating_add(Duration::from_nanos(header.ttl_ns)));
    let node = Node::from_parts(ctx.clone(), shared.clone());
    let mut call = RpcContext {
        node,
        caller: Peer::new(from).shard(header.src_shard),
        function: FunctionId::new(header.id),
        req_id: header.req_id,
        deadline,
        cancel: None,
        location,
        one_way,
    };
    let args = &bytes[REQUEST_PREFIX_LEN..];
    match handler {
        ErasedHandler::Plain(h) => {
            let out = std::panic::catch_unwind(AssertUnwindSafe(|| h(&call, args)))
                .unwrap_or_else(|p| Err(panicked(p.as_ref())));
            // A plain handler runs inline and should not block; one that did is caught here
            // (with a clock reading only when the deadline is near: see `finished_past`).
            let out = match (out, deadline) {
                (Ok(_), Some(d)) if finished_past(d, header.ttl_ns) => Err(Failure::new(
                    RpcErrorCode::DeadlineExpired,
                    "handler finished past the deadline",
                )),
                (out, _) => out,
            };
            finish(ctx, rpc, from, header, key, one_way, out);
        }
        ErasedHandler::Async(h) => {
            let cancel = Rc::new(CancelState::default());
            if !one_way {
                call.cancel = Some(cancel.clone());
            }
            let fut = match std::panic::catch_unwind(AssertUnwindSafe(|| h(call, args))) {
                Ok(Ok(fut)) => fut,
                Ok(Err(f)) => return finish(ctx, rpc, from, header, key, one_way, Err(f)),
                Err(p) => {
                    return finish(
                        ctx,
                        rpc,
                        from,
                        header,
                        key,
                        one_way,
                        Err(panicked(p.as_ref())),
                    )
                }
            };
            // The payload's bytes are no longer needed: the handler has its arguments.
            drop(payload);
            if !one_way {
                rpc.running.borrow_mut().insert(key, cancel.clone());
            }
            let (ctx, shared, header) = (ctx.clone(), shared.clone(), *header);
            let grace = rpc.config.cancel_grace;
            glommio::spawn_local(async move {
                let out = run_async(fut, &cancel, deadline.map(instant_of), grace).await;
                let rpc = &shared.rpc;
                if !one_way {
                    rpc.running.borrow_mut().remove(&key);
                }
                finish(&ctx, rpc, from, &header, key, one_way, out);
            })
            .detach();
        }
    }
}

/// Whether a plain handler of a call whose deadline `deadline` is `ttl_ns` after its frame's
/// arrival (the batch's clock reading) finished past it. The clock is read only when the
/// deadline is within two preempt-timer periods of the arrival, or when glommio's preempt
/// timer has fired: that timer was armed when the shard's task queue started to run, before
/// the arrival was read, so while it has not fired less than one period has passed since the
/// arrival (the plain path then reads the clock once per batch, not once per call).
fn finished_past(deadline: Timestamp, ttl_ns: u64) -> bool {
    let margin = 2 * shardcx_shards::PREEMPT_TIMER.as_nanos();
    if u128::from(ttl_ns) > margin && !shardcx_shards::net::preempt_due() {
        return false;
    }
    timestamp_of(Instant::now()) > deadline
}

/// Runs an async handler's future until it ends, its deadline passes, or its call is cancelled
/// (and the grace after that has passed), catching a panic.
async fn run_async(
    fut: Pin<Box<dyn Future<Output = Outcome>>>,
    cancel: &CancelState,
    deadline: Option<Instant>,
    grace: Duration,
) -> Outcome {
    let handler = async {
        let out = AssertUnwindSafe(fut)
            .catch_unwind()
            .await
            .unwrap_or_else(|p| Err(panicked(p.as_ref())));
        // A handler that ends after its call was cancelled answers to nobody.
        if cancel.cancelled.get() {
            Err(Failure::new(
                RpcErrorCode::Cancelled,
                "cancelled by the caller",
            ))
        } else {
            out
        }
    };
    let cancelled = async {
        cancel.wait().await;
        sleep(grace).await;
        Err(Failure::new(
            RpcErrorCode::Cancelled,
            "cancelled by the caller",
        ))
    };
    let expired = async {
        match deadline {
            Some(d) => sleep(d.saturating_duration_since(Instant::now())).await,
            None => std::future::pending::<()>().await,
        }
        Err(Failure::new(
            RpcErrorCode::DeadlineExpired,
            "deadline passed while the handler ran",
        ))
    };
    futures_lite::future::or(handler, futures_lite::future::or(cancelled, expired)).await
}

/// The failure of a panicked handler.
fn panicked(payload: &(dyn std::any::Any + Send)) -> Failure {
    let what = payload
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(non-string panic payload)".to_owned());
    Failure::new(RpcErrorCode::Panicked, what)
}

/// Answers a call that ran (or tried to), counts it, and records its answer in the dedup
/// window.
fn finish(
    ctx: &ShardCtx,
    rpc: &ShardRpc,
    from: NodeId,
    header: &FrameHeader,
    key: DedupKey,
    one_way: bool,
    out: Outcome,
) {
    let (kind, bytes) = match out {
        Ok(bytes) => {
            rpc.count(|s| {
                if one_way {
                    s.one_way += 1;
                } else {
                    s.served += 1;
                }
            });
            (FrameKind::RpcResponse, bytes)
        }
        Err(f) => {
            rpc.count_failure(f.code);
            strike_if_malformed(ctx, from, f.code);
            (FrameKind::RpcError, f.encode())
        }
    };
    if one_way {
        rpc.spare_reply.give(bytes);
        return;
    }
    answer(ctx, from, header, kind, &bytes);
    let keep = if bytes.len() <= rpc.config.dedup_reply_bytes {
        Some(CachedReply {
            kind,
            payload: rpc.keep_reply(bytes),
        })
    } else {
        rpc.spare_reply.give(bytes);
        None
    };
    rpc.dedup.borrow_mut().complete(key, keep);
}

impl Node {
    /// Chooses, on this shard, where rendezvous arguments of `F` land (calls whose request is
    /// longer than the caller's rendezvous threshold, 8 KiB by default): before the data is
    /// pulled, `choose` gets this node, the caller and the number of bytes to receive (the
    /// request envelope, 16 bytes, then the argument archive) and returns a buffer of at least
    /// that many bytes: a block of the shard's registered pool
    /// (`RndvBuf::Pool(node.shard_ctx().pool().alloc(len)?)`), aligned host memory
    /// (`RndvBuf::Host`), or a vector. Returning `None` declines the call: the caller gets
    /// [`super::RpcError::Busy`] and nothing is received. The handler then reads the arguments
    /// there as usual (in place, validated); [`RpcContext::args_location`] says where they
    /// landed. Replaces an earlier chooser of `F` on this shard.
    ///
    /// Unknown functions and arguments over [`RpcConfig::max_args_size`] are refused before
    /// the chooser runs, without receiving the data. Calls that arrive before this is called
    /// (or for functions without a chooser) are received into a vector. Call it on every shard,
    /// e.g. at the start of [`crate::NodeBuilder::run`]'s closure, or give the chooser to the
    /// builder instead ([`crate::NodeBuilder::rpc_args_buffer`]: installed before any call).
    pub fn rpc_args_buffer<F: RpcFunction>(
        &self,
        choose: impl Fn(&Node, Peer, usize) -> Option<RndvBuf> + 'static,
    ) {
        self.local()
            .rpc
            .choosers
            .borrow_mut()
            .insert(F::ID.get(), Rc::new(choose));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `value`'s archive placed 8 bytes past a 16-byte boundary (as UCX's shared-memory
    /// transport can deliver it), in a buffer that keeps it there.
    fn misaligned_archive<T: RpcType>(value: &T) -> (AlignedVec<ARCHIVE_ALIGN>, usize) {
        let archive = super::super::archive_into(value, Vec::new()).expect("archived");
        let mut buf = AlignedVec::<ARCHIVE_ALIGN>::new();
        buf.extend_from_slice(&[0u8; 8]);
        buf.extend_from_slice(&archive);
        (buf, archive.len())
    }

    #[test]
    fn archives_are_read_in_place_where_they_validate_and_copied_where_they_do_not() {
        // A byte vector needs 4-byte alignment at most: read where it lies.
        let (buf, len) = misaligned_archive(&vec![7u8; 40]);
        let bytes = &buf[8..8 + len];
        assert_eq!(bytes.as_ptr() as usize % ARCHIVE_ALIGN, 8);
        let range = bytes.as_ptr_range();
        let got = with_archived::<Vec<u8>, _>(bytes, |a| (a.as_ptr(), a.to_vec())).expect("valid");
        assert!(range.contains(&got.0), "read in place");
        assert_eq!(got.1, vec![7u8; 40]);
        // A u128 needs 16: it does not validate there, and is read from an aligned copy.
        assert_eq!(std::mem::align_of::<Archived<u128>>(), 16);
        let v = 0x0102_0304_0506_0708_090a_0b0c_0d0e_0f10u128;
        let (buf, len) = misaligned_archive(&v);
        let bytes = &buf[8..8 + len];
        assert!(rkyv::access::<Archived<u128>, rancor::Error>(bytes).is_err());
        let range = bytes.as_ptr_range();
        let got = with_archived::<u128, _>(bytes, |a| {
            (std::ptr::from_ref(a).cast::<u8>(), a.to_native())
        })
        .expect("valid");
        assert!(!range.contains(&got.0), "copied");
        assert_eq!(got.1, v);
        // Bytes that are no archive fail both ways, with an error.
        let (buf, _) = misaligned_archive(&0u8);
        assert!(with_archived::<Vec<u8>, _>(&buf[8..9], |_| ()).is_err());
    }

    #[test]
    fn kept_replies_read_back_and_small_ones_give_their_vector_back() {
        let spare = SpareVec::new(64, MAX_SPARE_REPLY);
        for len in [0, 1, INLINE_REPLY - 1, INLINE_REPLY, INLINE_REPLY + 1, 4000] {
            let mut v = spare.take();
            assert!(v.is_empty() && v.capacity() >= 64, "len {len}");
            v.extend((0..len).map(|i| (i * 7 + len) as u8));
            let expected = v.clone();
            let ptr = v.as_ptr();
            let kept = keep_reply(&spare, v);
            assert_eq!(kept.as_slice(), &expected[..], "len {len}");
            match kept {
                ReplyBytes::Inline(..) => {
                    assert!(len <= INLINE_REPLY);
                    // The same vector comes back for the next reply, cleared.
                    let next = spare.take();
                    assert_eq!((next.as_ptr(), next.len()), (ptr, 0), "len {len}");
                    spare.give(next);
                }
                ReplyBytes::Heap(v) => {
                    assert!(len > INLINE_REPLY);
                    assert_eq!(v.as_ptr(), ptr, "a large reply is kept without a copy");
                }
            }
        }
        // A large spare vector is not kept.
        let _ = spare.take();
        spare.give(Vec::with_capacity(MAX_SPARE_REPLY + 1));
        assert_eq!(spare.capacity(), 0);
    }
}
