//! `Node` and `Peer`: the user's view of a running set of shards and of the nodes it talks to.
//!
//! A node is one set of shards ([`shardcx_shards::ShardsBuilder`]) with an identity, a
//! pre-shared key and, optionally, a listener. [`Node::builder`] configures it;
//! [`NodeBuilder::run`] starts one shard per core and runs the user's closure on every shard,
//! each time with that shard's [`Node`] handle (`!Send`: it belongs to the shard's thread).
//!
//! A [`Peer`] is a remote node as seen from this node: `Send + Copy`, usable from any shard.
//! Operations through it find the calling shard by itself and go out on that shard's own rail
//! to the peer ([`Peer::shard`] names a remote shard: then they go from the local shard that
//! holds the rail to it, over the cross-shard mesh when that is another shard).
//!
//! ## Where a shard's node state lives
//!
//! The facade's per-shard state (deadline, shutdown switch, address book, RPC functions and
//! dedup window) is in the shard's extension slot ([`ShardCtx::ext`]): it lives and dies with
//! the shard, torn down with the rest of the shard's subsystems. A `Peer` holds no shard (it
//! is `Send + Copy`), and [`Node::current`] is a free function, so they find the shard running
//! on the calling thread through a thread-local set when the shard starts: the one way a
//! function given no handle can know its shard. That thread-local holds the shard weakly and
//! nothing else; the state is looked up in the shard's slot.
//!
//! ## Connecting
//!
//! [`Node::connect`] connects to a listener explicitly. A peer whose address the node knows
//! ([`NodeBuilder::peer_addr`], [`Node::add_peer_addr`]) is connected on first use instead: an
//! operation through [`Peer::new`]`(id)` (active message, tag send, put/get) that finds no
//! session connects to the address within its deadline, checks that the node there is `id`
//! ([`Error::WrongPeer`] otherwise), and goes on. That is also how a peer is reached again after
//! its connection ended (it failed, or restarted at the same address): the next operation
//! reconnects. Failed connects back off: the next connect to that peer starts no sooner than
//! [`RECONNECT_BACKOFF_MIN`] later, doubling with each failure in a row up to
//! [`RECONNECT_BACKOFF_MAX`] (less up to a quarter, spread by node id); an operation meanwhile
//! waits for the back-off to end if its deadline allows, else fails at once with
//! [`Error::BackingOff`]. A connect cut short by the operation's own deadline does not count.
//!
//! ## Active messages
//!
//! Handlers are registered by [`AmId`] on the builder, as a `Send` factory called once on every
//! shard ([`NodeBuilder::on_am`]): the handler itself need not be `Send` and may hold the
//! shard's state. A message runs the handler on the shard it arrived on (the shard at the end
//! of the rail it came on: from a peer's shard `i` by default, this node's shard `i mod N`),
//! inline on that shard's progress driver right after UCX delivered it, with the header and
//! the payload ([`AmMsg`], which may be kept; or [`AmView`] with [`NodeBuilder::on_am_view`],
//! lent for the call and read where UCX put it). The handler must not block; it may answer at once
//! ([`AmMsg::reply`], [`Peer::am_send_now`]: no task, no copy when UCX takes the frame in
//! place), keep the message, or spawn local tasks (to answer with [`Peer::am_send`], or to
//! forward work to another shard). A handler that panics loses that message only; the panic
//! is caught and counted ([`shardcx_shards::NetStats::handler_panics`]). Handlers are
//! installed before a shard serves anything, so no message finds a shard without them.
//!
//! On the wire an active message is one application frame of the rail (see
//! `shardcx_shards::net`): its header travels in UCX's AM header after the frame header (at
//! most [`MAX_AM_HEADER`] bytes), its payload as UCX's data.
//!
//! ## Deadlines
//!
//! Every operation has a deadline: [`NodeBuilder::default_deadline`] (5 s unless set), or the
//! one given to the `*_within` form of the call. An operation past its deadline fails with
//! [`Error::TimedOut`]; what it had started (a frame already queued) is not recalled.
//!
//! ## Life of a node
//!
//! [`NodeBuilder::run`] returns once the closure has returned on every shard: a shard whose
//! closure ends first keeps serving (handlers, forwards for the others' peers) until the last
//! one ends; then the node stops accepting, the shards drain the work in flight (bounded by
//! [`NodeBuilder::drain_deadline`]), close their connections (sending `Close`) and stop. A
//! server runs [`NodeBuilder::serve`] (or a closure awaiting [`Node::stopped`]) and is stopped
//! through its [`Shutdown`] switch, from any thread; see [`crate::shutdown`].

use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::net::SocketAddr;
use std::panic::AssertUnwindSafe;
use std::rc::{Rc, Weak};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures_lite::FutureExt;
use glommio::timer::sleep;
use shardcx_shards::net::{Dest, Frame, FrameView};
use shardcx_shards::proto::{AmId, Incarnation, NodeId, ShardId};
use shardcx_shards::{NetConfig, NetError, Placement, RemoteNode, ShardCtx, ShardsBuilder};

use crate::rpc::{Registration, RpcConfig, RpcContext, RpcFunction, RpcSetup, ShardRpc};
use crate::shutdown::{Shutdown, Stopped, DEFAULT_DRAIN_DEADLINE};
use crate::tag::TagConfig;
use crate::Error;

/// Default deadline of every operation.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(5);

/// Longest active-message header: it travels in UCX's AM header, which UCX 1.12 carries in one
/// fragment of its transport.
pub const MAX_AM_HEADER: usize = shardcx_shards::net::MAX_USER_HEADER;

/// Active-message ids from this one up are reserved for the runtime (tag messages and what
/// comes later); [`NodeBuilder::run`] refuses handlers for them.
pub use shardcx_shards::tag::FIRST_RESERVED_AM_ID;

/// How often a shard whose closure has ended looks whether the others' have (a shard that
/// waits there should stay close to idle: this is 50 wake-ups a second, not 500).
const END_POLL: Duration = Duration::from_millis(20);

type Handler = Rc<dyn Fn(&Node, AmMsg)>;
type ViewHandler = Rc<dyn Fn(&Node, &AmView<'_>)>;

/// A shard's handler of one active-message id ([`NodeBuilder::on_am`] or
/// [`NodeBuilder::on_am_view`]).
enum AmHandlerFn {
    Msg(Handler),
    View(ViewHandler),
}

type Factory = Arc<dyn Fn() -> AmHandlerFn + Send + Sync>;

/// Configures and runs a [`Node`]. `Send`: a recipe; the shards are built in their threads.
#[derive(Clone)]
pub struct NodeBuilder {
    shards: ShardsBuilder,
    handlers: Vec<(AmId, Factory)>,
    deadline: Duration,
    book: Vec<(NodeId, SocketAddr)>,
    shutdown: Shutdown,
    tag: TagConfig,
    rpc: RpcSetup,
    metrics: Option<SocketAddr>,
}

/// This shard's handle on the running node. `!Send`: it belongs to the shard's thread; clone
/// it freely within the shard.
#[derive(Clone)]
pub struct Node {
    ctx: Rc<ShardCtx>,
    shared: Rc<ShardLocal>,
}

/// Per-shard facade state.
pub(crate) struct ShardLocal {
    deadline: Duration,
    shutdown: Shutdown,
    /// Where known peers listen, shared by the node's shards (see [`NodeBuilder::peer_addr`]).
    book: AddressBook,
    /// This shard's RPC functions, dedup window and counters.
    pub(crate) rpc: ShardRpc,
    /// The node's metrics board, when it serves metrics ([`NodeBuilder::metrics`]).
    metrics: Option<Arc<crate::metrics::Board>>,
}

impl ShardLocal {
    /// Whether the node serves metrics ([`NodeBuilder::metrics`]).
    pub(crate) fn serves_metrics(&self) -> bool {
        self.metrics.is_some()
    }
}

/// Listen addresses of peers, for connecting on first use, and the back-off state of each.
/// Read only when an operation finds no session, so a lock shared by the shards costs nothing
/// on the fast path.
type AddressBook = Arc<Mutex<HashMap<NodeId, BookEntry>>>;

/// A peer's address, and when the next connect to it may start.
#[derive(Debug, Clone, Copy)]
struct BookEntry {
    addr: SocketAddr,
    /// Connects that failed in a row.
    failures: u32,
    /// No connect starts before this (after a failure).
    retry_at: Option<Instant>,
    /// When the last failure was counted: attempts that started before it and fail too (calls
    /// that connected at once, each for itself) count no more failures.
    failed_at: Option<Instant>,
}

/// First wait after a failed connect on first use; it doubles with every failure in a row.
pub const RECONNECT_BACKOFF_MIN: Duration = Duration::from_millis(50);
/// Longest wait between two connects to one peer.
pub const RECONNECT_BACKOFF_MAX: Duration = Duration::from_secs(2);

impl BookEntry {
    fn new(addr: SocketAddr) -> Self {
        Self {
            addr,
            failures: 0,
            retry_at: None,
            failed_at: None,
        }
    }

    /// Back-off after failure number `failures`: `MIN × 2^(failures-1)`, at most `MAX`, minus
    /// up to a quarter (spread from the node id, so that many nodes do not retry in step).
    fn backoff(&self, node: NodeId) -> Duration {
        let exp = self.failures.saturating_sub(1).min(16);
        let full = RECONNECT_BACKOFF_MIN
            .saturating_mul(1 << exp)
            .min(RECONNECT_BACKOFF_MAX);
        let spread =
            (node.get() ^ u64::from(self.failures)).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 62;
        full - full / 4 * u32::try_from(spread).unwrap_or(0) / 3
    }
}

/// A remote node, or one shard of it: `Send + Copy`, usable from any shard of this node.
///
/// [`Peer::new`] addresses the node: an operation from local shard `i` goes on shard `i`'s own
/// rail to it (to its shard with the same index when both nodes have as many shards), with no
/// hop on either side. [`Peer::shard`] addresses one shard of it: the operation lands there,
/// forwarded first to the local shard that holds the rail to it when the calling shard does
/// not (see `shardcx_shards::net`, "Rails"). A message's [`AmMsg::from`] names the sending
/// shard, so an answer through it goes back on the rail the message came in on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Peer {
    node: NodeId,
    shard: Option<ShardId>,
}

/// An active message received from a peer, handed to its handler on the progress driver right
/// after it arrived. An eager payload in a UCX descriptor is read in place, and keeping the
/// message keeps that descriptor; a short message UCX delivered in its receive buffer (valid
/// during its callback only) is copied into a buffer the shard reuses ([`AmView`] reads it
/// where it is, but cannot be kept). `!Send`: a descriptor belongs to this shard's worker;
/// [`AmMsg::into_owned`] gives a copy that may go to another thread or shard.
pub struct AmMsg {
    from: Peer,
    id: AmId,
    frame: Frame,
    /// The receiving shard: [`AmMsg::reply`] sends from it with no look-up of the current node.
    ctx: Rc<ShardCtx>,
}

/// An active message lent to its handler for the length of the call
/// ([`NodeBuilder::on_am_view`]): header and payload read in place (a short message where UCX
/// received it), nothing to release, nothing kept. It cannot outlive the call: copy what is to
/// be kept ([`AmView::to_owned`]).
pub struct AmView<'a> {
    from: Peer,
    id: AmId,
    frame: FrameView<'a>,
    ctx: &'a Rc<ShardCtx>,
}

/// An active message whose payload was landed in a device buffer the handler chose
/// ([`AmMsg::into_device`]): the header copied out, the payload on the device. `Send`.
#[derive(Debug)]
pub struct DeviceAmMsg {
    from: Peer,
    id: AmId,
    header: Vec<u8>,
    payload: crate::DeviceBuffer,
}

/// An active message copied out of UCX's buffer ([`AmMsg::into_owned`]): `Send`.
#[derive(Debug, Clone)]
pub struct OwnedAmMsg {
    from: Peer,
    id: AmId,
    header: Vec<u8>,
    payload: Vec<u8>,
}

thread_local! {
    /// The shard running on this thread (weak: it must not keep the shard alive), for the
    /// functions given no handle on it (see the module docs), with its node state
    /// (kept in its extension slot; weak here too).
    static CURRENT: RefCell<Option<(Weak<ShardCtx>, Weak<ShardLocal>)>> =
        const { RefCell::new(None) };
}

/// The shard running on this thread, without its node state: one weak reference upgraded
/// instead of [`Node::current`]'s two (the sends that need nothing else).
fn current_ctx() -> Option<Rc<ShardCtx>> {
    CURRENT.with(|c| c.borrow().as_ref()?.0.upgrade())
}

impl Node {
    /// A builder with the defaults of [`ShardsBuilder::new`] (one pinned shard per CPU) and
    /// [`DEFAULT_DEADLINE`].
    pub fn builder() -> NodeBuilder {
        NodeBuilder {
            shards: ShardsBuilder::new(),
            handlers: Vec::new(),
            deadline: DEFAULT_DEADLINE,
            book: Vec::new(),
            shutdown: Shutdown::new(),
            tag: TagConfig::default(),
            rpc: RpcSetup::new(),
            metrics: None,
        }
        .drain_deadline(DEFAULT_DRAIN_DEADLINE)
    }

    /// The node of the shard running on this thread, if any.
    pub fn current() -> Option<Node> {
        // Both weak, both upgraded: no lookup in the extension slot per call (this runs on
        // every `Peer` call).
        CURRENT.with(|c| {
            let c = c.borrow();
            let (ctx, shared) = c.as_ref()?;
            Some(Node {
                ctx: ctx.upgrade()?,
                shared: shared.upgrade()?,
            })
        })
    }

    /// A handle from its parts (the RPC server builds one per call).
    pub(crate) fn from_parts(ctx: Rc<ShardCtx>, shared: Rc<ShardLocal>) -> Node {
        Node { ctx, shared }
    }

    /// The shard's facade state.
    pub(crate) fn local(&self) -> &ShardLocal {
        &self.shared
    }

    /// Peers whose listen address this node knows ([`NodeBuilder::peer_addr`],
    /// [`Node::add_peer_addr`]).
    pub fn known_peers(&self) -> Vec<(Peer, SocketAddr)> {
        self.shared
            .book
            .lock()
            .map(|b| b.iter().map(|(n, e)| (Peer::new(*n), e.addr)).collect())
            .unwrap_or_default()
    }

    /// This node's id.
    pub fn id(&self) -> NodeId {
        self.ctx.node_id()
    }

    /// This node's incarnation (fresh for every run).
    pub fn incarnation(&self) -> Incarnation {
        self.ctx.incarnation()
    }

    /// The shard this handle belongs to.
    pub fn shard(&self) -> ShardId {
        self.ctx.id()
    }

    /// Number of shards of this node.
    pub fn shard_count(&self) -> usize {
        self.ctx.shard_count()
    }

    /// The address the node listens on, if it listens.
    pub fn listen_addr(&self) -> Option<SocketAddr> {
        self.ctx.listen_addr()
    }

    /// The shard's runtime context, for what the facade does not wrap (forwarding, the pool,
    /// the UCX worker).
    pub fn shard_ctx(&self) -> &Rc<ShardCtx> {
        &self.ctx
    }

    /// Copies `src` (a received payload, say) into the whole of device buffer `dst`, of the
    /// same length, through this shard's pinned bounce buffers
    /// ([`ShardCuda::host_to_device`](shardcx_shards::cuda::ShardCuda::host_to_device));
    /// resolves once the device holds the bytes. The receiving half of
    /// [`Peer::am_send_device`]: a handler keeps the message ([`AmMsg::into_owned`]) and a task
    /// lands it.
    ///
    /// Errors: [`Error::Cuda`] (no CUDA on this shard, and why; lengths that differ; the
    /// driver's error).
    pub async fn copy_to_device(
        &self,
        src: &[u8],
        dst: &mut crate::DeviceBuffer,
    ) -> Result<(), Error> {
        Ok(self.ctx.cuda().host_to_device(src, dst).await?)
    }

    /// Copies the whole of device buffer `src` into `dst`, of the same length, through this
    /// shard's pinned bounce buffers ([`Node::copy_to_device`]'s other direction).
    pub async fn copy_from_device(
        &self,
        src: &mut crate::DeviceBuffer,
        dst: &mut [u8],
    ) -> Result<(), Error> {
        Ok(self.ctx.cuda().device_to_host(src, dst).await?)
    }

    /// The bytes of device buffer `src` in a new vector, copied through this shard's pinned
    /// bounce buffers ([`Node::copy_from_device`]): what the device-memory sends
    /// ([`Peer::am_send_device`], [`Peer::tag_send_device`],
    /// [`Rpc::call_device`](crate::rpc::Rpc::call_device)) send, and what an RPC handler
    /// returns to reply with a device buffer's bytes.
    ///
    /// Errors: [`Error::Cuda`] (no CUDA on this shard, and why; the driver's error).
    pub async fn device_to_vec(&self, src: &mut crate::DeviceBuffer) -> Result<Vec<u8>, Error> {
        let mut out = vec![0u8; src.len()];
        self.copy_from_device(src, &mut out).await?;
        Ok(out)
    }

    /// Where the node serves its metrics ([`NodeBuilder::metrics`]), if it does.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.shared.metrics.as_ref().and_then(|b| b.addr())
    }

    /// The default deadline of operations.
    pub fn default_deadline(&self) -> Duration {
        self.shared.deadline
    }

    /// Stops the node (every shard's [`Node::stopped`] resolves; see [`crate::shutdown`]).
    /// Callable from a handler: the node stops once the closures have returned.
    pub fn shutdown(&self) {
        self.shared.shutdown.trigger();
    }

    /// The node's shutdown switch, to stop it from another thread.
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shared.shutdown.clone()
    }

    /// Whether the node has been asked to stop.
    pub fn is_stopping(&self) -> bool {
        self.shared.shutdown.is_triggered()
    }

    /// Resolves once the node has been asked to stop ([`Shutdown::trigger`],
    /// [`Node::shutdown`], or every shard's closure having returned). A serving node's closure
    /// awaits it (see [`NodeBuilder::serve`]).
    pub fn stopped(&self) -> Stopped {
        self.shared.shutdown.wait()
    }

    /// The shard of this node that holds the rail an operation through `peer` goes on: this
    /// shard for a peer that names no shard (every shard has its own rail to every connected
    /// node), else the local shard with a rail to the named shard (this shard when it has one,
    /// or when the peer is not connected yet).
    pub fn owner_of(&self, peer: Peer) -> ShardId {
        match peer.shard {
            None => self.ctx.id(),
            Some(j) => self
                .ctx
                .owner_of_shard(peer.node, j)
                .unwrap_or_else(|| self.ctx.id()),
        }
    }

    /// Records where peer `node` listens, for every shard of this node (see
    /// [`NodeBuilder::peer_addr`]).
    pub fn add_peer_addr(&self, node: NodeId, addr: SocketAddr) {
        if let Ok(mut book) = self.shared.book.lock() {
            book.insert(node, BookEntry::new(addr));
        }
    }

    /// Connects to the node listening at `addr` (one handshake with the pre-shared key per node
    /// pair, then a rail for every shard), within the default deadline. Returns the existing
    /// session if there is one.
    pub async fn connect(&self, addr: SocketAddr) -> Result<Peer, Error> {
        self.connect_within(addr, self.shared.deadline).await
    }

    /// [`Node::connect`] with its own deadline.
    pub async fn connect_within(&self, addr: SocketAddr, timeout: Duration) -> Result<Peer, Error> {
        let remote: Result<RemoteNode, Error> = within("connect", timeout, async {
            Ok(self.ctx.connect(addr).await?)
        })
        .await;
        match &remote {
            Ok(r) => tracing::debug!(%addr, node = %r.node_id, "connected"),
            Err(e) => tracing::info!(%addr, error = %e, "connect failed"),
        }
        Ok(Peer::new(remote?.node_id))
    }
}

impl NodeBuilder {
    /// Number of shards (default: the CPUs available).
    pub fn shards(mut self, n: usize) -> Self {
        self.shards = self.shards.shard_count(n);
        self
    }

    /// Where shard threads run (default pinned, one per CPU).
    pub fn placement(mut self, p: Placement) -> Self {
        self.shards = self.shards.placement(p);
        self
    }

    /// UCX transport list, e.g. `"tcp"` or `"sm,tcp"` (default: `UCX_TLS` or UCX's choice).
    /// Listening and connecting by address need `tcp` (UCX 1.12). With `tcp` in the list the
    /// endpoints use UCX's error mode PEER unless [`NetConfig::error_mode`] says otherwise,
    /// and UCX 1.12 then leaves its shared-memory transports out (they cannot detect a failed
    /// peer): for data over shared memory between nodes of one host, also set
    /// `error_mode: Some(ErrorMode::None)` in [`NodeBuilder::net`], as
    /// `shardcx bench --transport shm` does (heartbeats still detect a dead peer).
    pub fn transports(mut self, tls: &str) -> Self {
        self.shards = self.shards.transports(tls);
        self
    }

    /// This node's id (default: random).
    pub fn node_id(mut self, id: NodeId) -> Self {
        self.shards = self.shards.node_id(id);
        self
    }

    /// The pre-shared key both sides of a connection must hold (16 bytes at least).
    pub fn psk(mut self, key: &[u8]) -> Self {
        self.shards = self.shards.psk(key);
        self
    }

    /// Listen for connections at `addr` (port 0 picks one; see [`Node::listen_addr`]).
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.shards = self.shards.listen(addr);
        self
    }

    /// glommio io memory per shard (default: sized so every shard fits `RLIMIT_MEMLOCK`; set it
    /// when several nodes share a process).
    pub fn io_memory(mut self, bytes: u64) -> Self {
        self.shards = self.shards.io_memory(bytes);
        self
    }

    /// The CUDA mode every shard asks for (default: `SHARDCX_CUDA`, else probe); see
    /// [`crate::cuda`] and the README's "CUDA" section.
    pub fn cuda(mut self, request: crate::cuda::ModeRequest) -> Self {
        self.shards = self.shards.cuda(request);
        self
    }

    /// Connection settings (timeouts, heartbeats).
    pub fn net(mut self, cfg: NetConfig) -> Self {
        self.shards = self.shards.net(cfg);
        self
    }

    /// Where peer `node` listens: an operation through [`Peer::new`]`(node)` that finds no
    /// session connects there first (lazy connect on first use, within the operation's
    /// deadline). See also [`Node::add_peer_addr`].
    pub fn peer_addr(mut self, node: NodeId, addr: SocketAddr) -> Self {
        self.book.retain(|(n, _)| *n != node);
        self.book.push((node, addr));
        self
    }

    /// The deadline of operations called without one.
    pub fn default_deadline(mut self, d: Duration) -> Self {
        self.deadline = d;
        self
    }

    /// The node's shutdown switch: [`Shutdown::trigger`] (from any thread, e.g. on a signal with
    /// [`Shutdown::trigger_on_signals`]) makes every shard's [`Node::stopped`] resolve. Every
    /// call returns the same switch, also after the builder has been consumed by
    /// [`NodeBuilder::run`].
    pub fn shutdown_handle(&self) -> Shutdown {
        self.shutdown.clone()
    }

    /// Longest time each shard waits at shut-down for the work in flight to finish (its
    /// requests' answers, work forwarded between shards) before it closes its connections
    /// anyway (default [`DEFAULT_DRAIN_DEADLINE`]; see [`crate::shutdown`]). A node takes at
    /// most about twice this to drain: once for the requests, once for the mesh.
    pub fn drain_deadline(mut self, d: Duration) -> Self {
        self.shards = self.shards.drain_timeout(d);
        self
    }

    /// Runs the node as a server: every shard serves (handlers, forwarded work) until the
    /// node is asked to stop ([`NodeBuilder::shutdown_handle`], [`Node::shutdown`]), then it
    /// drains and closes (see [`crate::shutdown`]).
    pub fn serve(self) -> Result<(), Error> {
        self.run(|node| async move { node.stopped().await })
            .map(|_| ())
    }

    /// Bounds of the queue of tag messages that arrive before their receive, per remote node
    /// (default: [`TagConfig::default`]); messages over them are dropped and counted.
    pub fn tag_config(mut self, cfg: TagConfig) -> Self {
        self.tag = cfg;
        self
    }

    /// The underlying shard settings, for what the facade does not expose.
    pub fn with_shards(mut self, f: impl FnOnce(ShardsBuilder) -> ShardsBuilder) -> Self {
        self.shards = f(self.shards);
        self
    }

    /// Registers the handler of active message `id`: `factory` runs once on every shard and
    /// returns that shard's handler, which runs for every message `id` that arrives on one of
    /// this shard's rails, inline on its progress driver (see [`AmMsg`]). Replaces an earlier
    /// registration of `id`. Ids from [`FIRST_RESERVED_AM_ID`] up belong to the runtime:
    /// [`NodeBuilder::run`] then fails with [`Error::ReservedAmId`].
    pub fn on_am<F, H>(mut self, id: AmId, factory: F) -> Self
    where
        F: Fn() -> H + Send + Sync + 'static,
        H: Fn(&Node, AmMsg) + 'static,
    {
        self.handlers.retain(|(i, _)| *i != id);
        let factory: Factory = Arc::new(move || AmHandlerFn::Msg(Rc::new(factory())));
        self.handlers.push((id, factory));
        self
    }

    /// [`NodeBuilder::on_am`] for a handler that reads each message in place, for the length
    /// of the call ([`AmView`]): a short message is read where UCX received it, with no copy
    /// and nothing built per message beyond the view, which makes this the cheapest way to
    /// handle (and answer, [`AmView::reply`]) small messages. What the handler keeps beyond
    /// the call it copies ([`AmView::to_owned`], or the slices it needs). Replaces an earlier
    /// registration of `id`, of either kind; same reserved ids.
    pub fn on_am_view<F, H>(mut self, id: AmId, factory: F) -> Self
    where
        F: Fn() -> H + Send + Sync + 'static,
        H: Fn(&Node, &AmView<'_>) + 'static,
    {
        self.handlers.retain(|(i, _)| *i != id);
        let factory: Factory = Arc::new(move || AmHandlerFn::View(Rc::new(factory())));
        self.handlers.push((id, factory));
        self
    }

    /// Registers a plain RPC handler of `F` (see [`crate::rpc`]): `factory` runs once on
    /// every shard and returns that shard's handler, which runs inline on the shard that
    /// received the call, with the argument's validated archive read in place. It must not
    /// block. Replaces an earlier registration of `F::ID`. [`NodeBuilder::run`] fails with
    /// [`Error::ReservedFunctionId`] for ids from [`crate::rpc::FIRST_RESERVED_FUNCTION_ID`] up,
    /// and with [`Error::DuplicateFunctionName`] for a name registered under two ids.
    pub fn rpc<F, M, H>(mut self, factory: M) -> Self
    where
        F: RpcFunction,
        M: Fn() -> H + Send + Sync + 'static,
        H: Fn(&RpcContext, &rkyv::Archived<F::Args>) -> Result<F::Reply, String> + 'static,
    {
        self.rpc.add(Registration::plain::<F, M, H>(factory));
        self
    }

    /// Registers an async RPC handler of `F`, like [`NodeBuilder::rpc`]: each call runs as a
    /// task of the shard that received it, with the arguments deserialized; the task is
    /// dropped when the call's deadline passes, or a little after its caller cancels it
    /// ([`crate::rpc::RpcConfig::cancel_grace`]).
    pub fn rpc_async<F, M, H, Fut>(mut self, factory: M) -> Self
    where
        F: RpcFunction,
        M: Fn() -> H + Send + Sync + 'static,
        H: Fn(RpcContext, F::Args) -> Fut + 'static,
        Fut: Future<Output = Result<F::Reply, String>> + 'static,
    {
        self.rpc
            .add(Registration::asynchronous::<F, M, H, Fut>(factory));
        self
    }

    /// Chooses where rendezvous arguments of `F` land, on every shard and before any call
    /// arrives: [`Node::rpc_args_buffer`] with a `Send + Sync` chooser. Replaces an earlier
    /// chooser of `F`.
    pub fn rpc_args_buffer<F>(
        mut self,
        choose: impl Fn(&Node, Peer, usize) -> Option<crate::rpc::RndvBuf> + Send + Sync + 'static,
    ) -> Self
    where
        F: RpcFunction,
    {
        let id = F::ID.get();
        self.rpc.choosers.retain(|(i, _)| *i != id);
        self.rpc.choosers.push((id, Arc::new(choose)));
        self
    }

    /// RPC settings (dedup window, argument size limit, default deadline).
    pub fn rpc_config(mut self, cfg: RpcConfig) -> Self {
        self.rpc.config = cfg;
        self
    }

    /// Serves the node's metrics in the Prometheus (OpenMetrics) text format at
    /// `http://ADDR/metrics` (port 0 picks one: [`Node::metrics_addr`]), from a small thread
    /// of its own; the shards publish their counters every
    /// [`PUBLISH_INTERVAL`](crate::metrics::PUBLISH_INTERVAL). The families are listed in
    /// [`crate::metrics`]. [`NodeBuilder::run`] fails with [`Error::Metrics`] when the address
    /// cannot be bound.
    pub fn metrics(mut self, addr: SocketAddr) -> Self {
        self.metrics = Some(addr);
        self
    }

    /// Starts the node and runs `f` on every shard with that shard's [`Node`]; returns each
    /// shard's result, in shard order, once every shard has ended (see the module docs).
    pub fn run<F, Fut, T>(self, f: F) -> Result<Vec<T>, Error>
    where
        F: Fn(Node) -> Fut + Send + Clone + 'static,
        Fut: Future<Output = T> + 'static,
        T: Send + 'static,
    {
        let NodeBuilder {
            shards,
            handlers,
            deadline,
            book,
            shutdown,
            tag,
            rpc,
            metrics,
        } = self;
        rpc.check()?;
        let rpc = Arc::new(rpc);
        let book: AddressBook = Arc::new(Mutex::new(
            book.into_iter()
                .map(|(n, a)| (n, BookEntry::new(a)))
                .collect(),
        ));
        if let Some((id, _)) = handlers
            .iter()
            .find(|(id, _)| id.get() >= FIRST_RESERVED_AM_ID)
        {
            return Err(Error::ReservedAmId { id: *id });
        }
        let handlers = Arc::new(handlers);
        // Started before the shards, stopped (joined) after they have all ended.
        let (board, _metrics_server) = match metrics {
            Some(addr) => {
                let board = Arc::new(crate::metrics::Board::default());
                let server = crate::metrics::Server::start(addr, board.clone())?;
                board.set_addr(server.addr());
                (Some(board), Some(server))
            }
            None => (None, None),
        };
        let start_board = board.clone();
        let start_book = book.clone();
        let start_shutdown = shutdown.clone();
        let start_rpc = rpc.clone();
        let shards = shards.on_start(move |ctx| {
            let local = ShardLocal {
                deadline,
                shutdown: start_shutdown.clone(),
                book: start_book.clone(),
                rpc: start_rpc.build(),
                metrics: start_board.clone(),
            };
            install(ctx, local, tag, &handlers)
        });
        let ended = Arc::new(AtomicUsize::new(0));
        let out = shards.run(move |ctx: Rc<ShardCtx>| {
            let board = board.clone();
            let f = f.clone();
            let ended = ended.clone();
            let book = book.clone();
            let shutdown = shutdown.clone();
            let rpc = rpc.clone();
            async move {
                // Made by `install` (from `on_start`) on a shard that started.
                let shared = ctx.ext_or_insert_with(|| ShardLocal {
                    deadline,
                    shutdown: shutdown.clone(),
                    book: book.clone(),
                    rpc: rpc.build(),
                    metrics: board.clone(),
                });
                let node = Node {
                    ctx: ctx.clone(),
                    shared,
                };
                // A closure that panics still counts as ended (then its panic goes on), so the
                // other shards do not wait for it for ever.
                let out = AssertUnwindSafe(f(node)).catch_unwind().await;
                ended.fetch_add(1, Ordering::AcqRel);
                let out = match out {
                    Ok(out) => out,
                    Err(panic) => std::panic::resume_unwind(panic),
                };
                // Keep serving (handlers, forwards of the others' operations) until every
                // shard's closure has ended.
                while ended.load(Ordering::Acquire) < ctx.shard_count() {
                    sleep(END_POLL).await;
                }
                // Every closure has returned: stop accepting now; the shards' run then
                // drains what is in flight, closes and destroys (see `crate::shutdown`).
                shutdown.trigger();
                ctx.stop_accepting().await;
                CURRENT.with(|c| c.borrow_mut().take());
                out
            }
        })?;
        Ok(out)
    }
}

/// On every shard, before it serves: the node state in the shard's extension slot, the
/// thread's current shard, and the AM and RPC handlers.
fn install(ctx: &Rc<ShardCtx>, local: ShardLocal, tag: TagConfig, handlers: &[(AmId, Factory)]) {
    let shared = ctx.ext_or_insert_with(|| local);
    if let Some(board) = &shared.metrics {
        let weak = Rc::downgrade(&shared);
        crate::metrics::spawn_publisher(ctx, board.clone(), move || {
            weak.upgrade()
                .map(|l| (l.rpc.stats(), l.rpc.latency.snapshot()))
                .unwrap_or_default()
        });
    }
    CURRENT.with(|c| *c.borrow_mut() = Some((Rc::downgrade(ctx), Rc::downgrade(&shared))));
    // Checked remote memory: this shard's region table and its put/get handlers.
    shardcx_shards::rma::install(ctx);
    // Tag send/recv: this shard's matching state and its handler.
    shardcx_shards::tag::install_with(ctx, tag);
    // RPC: this shard's functions and the request and cancel frame handlers.
    crate::rpc::install(ctx, &shared);
    // Collectives: this shard's mailbox, its message handler and its loss hook.
    crate::collective::install(ctx);
    for (id, factory) in handlers {
        let id = *id;
        let shared = shared.clone();
        match factory() {
            AmHandlerFn::Msg(handler) => ctx.set_frame_handler_am(id, move |ctx, frame| {
                let node = Node {
                    ctx: ctx.clone(),
                    shared: shared.clone(),
                };
                let from = Peer {
                    node: frame.node(),
                    shard: Some(frame.header().src_shard),
                };
                let ctx = node.ctx.clone();
                handler(
                    &node,
                    AmMsg {
                        from,
                        id,
                        frame,
                        ctx,
                    },
                );
            }),
            AmHandlerFn::View(handler) => ctx.set_frame_view_handler_am(id, move |ctx, frame| {
                let node = Node {
                    ctx: ctx.clone(),
                    shared: shared.clone(),
                };
                let msg = AmView {
                    from: Peer {
                        node: frame.node(),
                        shard: Some(frame.header().src_shard),
                    },
                    id,
                    frame: *frame,
                    ctx,
                };
                handler(&node, &msg);
            }),
        }
    }
}

impl Peer {
    /// The peer for a node id (e.g. learnt from a message or a directory), addressing the node
    /// as a whole (see the type's docs).
    pub fn new(node: NodeId) -> Self {
        Self { node, shard: None }
    }

    /// This peer's shard `shard`: operations through it land on that shard of the node.
    pub fn shard(self, shard: ShardId) -> Self {
        Self {
            shard: Some(shard),
            ..self
        }
    }

    /// The node as a whole (dropping the shard this peer names, if any).
    pub fn node(self) -> Self {
        Self::new(self.node)
    }

    /// The peer's node id.
    pub fn node_id(&self) -> NodeId {
        self.node
    }

    /// The shard this peer names, if it names one.
    pub fn target_shard(&self) -> Option<ShardId> {
        self.shard
    }

    /// Where the runtime sends for this peer.
    pub(crate) fn dest(&self) -> Dest {
        Dest {
            node: self.node,
            shard: self.shard,
        }
    }

    /// Sends active message `id` with `header` and `payload`, from any shard of a running
    /// node, within the default deadline. Resolves once the message is with UCX or queued on
    /// the rail (it then goes out in order with the rail's other frames); when the calling
    /// shard holds the rail and UCX takes the message at once, that is before the first
    /// `.await` returns Pending: no timer, no task switch, no copy.
    ///
    /// Errors: [`Error::NotOnShard`], [`Error::HeaderTooLarge`], [`Error::TimedOut`], and the
    /// connection's ([`shardcx_shards::NetError::NotConnected`] when there is no session and
    /// no known address to connect to).
    pub async fn am_send(&self, id: AmId, header: &[u8], payload: &[u8]) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.shared.deadline;
        self.send_on(&node, id, header, payload, timeout).await
    }

    /// Sends the bytes of device buffer `buf` as active message `id`, from any shard of a
    /// running node whose CUDA mode is not off, within the default deadline: the bytes are
    /// staged to host memory through the shard's pinned bounce buffers
    /// ([`ShardCuda::device_to_host`](shardcx_shards::cuda::ShardCuda::device_to_host): chunks
    /// of 2 MiB, device copies polled, never waited on) and sent as [`Peer::am_send`] sends
    /// host bytes, so the receiver sees the same frame either way (and may land it in device
    /// memory with [`Node::copy_to_device`]). UCX never sees the device pointer, in any mode.
    ///
    /// Errors: [`Error::Cuda`] (no CUDA on this shard, and why; the driver's error), then
    /// those of [`Peer::am_send`].
    pub async fn am_send_device(
        &self,
        id: AmId,
        header: &[u8],
        buf: &mut crate::DeviceBuffer,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        // Refused before anything is staged.
        if header.len() > MAX_AM_HEADER {
            return Err(Error::HeaderTooLarge { len: header.len() });
        }
        let staged = node.device_to_vec(buf).await?;
        let timeout = node.shared.deadline;
        self.send_on(&node, id, header, &staged, timeout).await
    }

    /// [`Peer::am_send`] with its own deadline.
    pub async fn am_send_within(
        &self,
        id: AmId,
        header: &[u8],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.send_on(&node, id, header, payload, timeout).await
    }

    /// Sends active message `id` at once, from the calling shard, on its rail to this peer:
    /// the synchronous send of a handler (an answer, a forward of work) or of a tight loop.
    /// UCX takes the message in place when it can; otherwise it is copied and queued behind
    /// the rail's earlier frames. When UCX's send queue to the peer is full, a send from a
    /// task (not from a handler) first waits for room, progressing UCX, for at most
    /// [`shardcx_shards::NetConfig::send_pace`] (500 µs): a loop that outruns its receiver is
    /// paced at the receiver's speed. Never waits longer and never connects: errors
    /// [`Error::NotOnShard`], [`Error::HeaderTooLarge`], and the connection's
    /// ([`shardcx_shards::NetError::NotConnected`] when this shard has no ready rail to the
    /// peer, [`shardcx_shards::NetError::OtherShard`] when another local shard holds the rail
    /// to the shard this peer names).
    pub fn am_send_now(&self, id: AmId, header: &[u8], payload: &[u8]) -> Result<(), Error> {
        // Not `ok_or(Error::NotOnShard)`: that builds the error on every call and calls its
        // drop glue when the shard is there.
        let Some(ctx) = current_ctx() else {
            return Err(Error::NotOnShard);
        };
        send_now(&ctx, self.dest(), id, header, payload)
    }

    /// Sends active message `id` at once from the calling shard, like [`Peer::am_send_now`],
    /// with the bytes of `buf` sent from where they are: a `Vec<u8>` (moved), an `Rc<[u8]>`
    /// (shared: send one buffer many times, no copy) or a block of the shard's registered pool
    /// ([`shardcx_shards::PoolBuf`]). Large payloads go by rendezvous straight from the
    /// buffer, which is held until UCX is done with it. Same errors as
    /// [`Peer::am_send_now`].
    pub fn am_send_buf(
        &self,
        id: AmId,
        header: &[u8],
        buf: impl Into<crate::SendBuf>,
    ) -> Result<(), Error> {
        let Some(ctx) = current_ctx() else {
            return Err(Error::NotOnShard);
        };
        if header.len() > MAX_AM_HEADER {
            return Err(Error::HeaderTooLarge { len: header.len() });
        }
        match ctx.send_am_buf_now(self.dest(), id, header, buf) {
            Err(NetError::HeaderTooLarge { len, .. }) => Err(Error::HeaderTooLarge { len }),
            other => Ok(other?),
        }
    }

    async fn send_on(
        &self,
        node: &Node,
        id: AmId,
        header: &[u8],
        payload: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        // This shard's rail, UCX taking the frame at once: no timer, no task.
        match send_now(&node.ctx, self.dest(), id, header, payload) {
            Err(Error::Net(NetError::NotConnected { .. } | NetError::OtherShard { .. })) => {}
            done => return done,
        }
        let (peer, dest) = (self.node, self.dest());
        within("am_send", timeout, async {
            lazily(node, peer, timeout, || async {
                Ok(node.ctx.send_am_parts(dest, id, header, payload).await?)
            })
            .await
        })
        .await
    }
}

/// [`Peer::am_send_now`] on `node`'s shard.
pub(crate) fn send_now(
    ctx: &ShardCtx,
    dest: Dest,
    id: AmId,
    header: &[u8],
    payload: &[u8],
) -> Result<(), Error> {
    if header.len() > MAX_AM_HEADER {
        return Err(Error::HeaderTooLarge { len: header.len() });
    }
    match ctx.send_am_now(dest, id, header, payload) {
        Err(NetError::HeaderTooLarge { len, .. }) => Err(Error::HeaderTooLarge { len }),
        other => Ok(other?),
    }
}

/// Runs `op`; if it finds no session with `peer` and this node knows where `peer` listens
/// ([`NodeBuilder::peer_addr`]), connects there (checking that the node found is `peer`) and
/// runs `op` once more. `op` rebuilds its request each time, so nothing is copied in advance.
///
/// Connects back off: after a failed one, the next to that peer (from any shard) starts no
/// sooner than [`BookEntry::backoff`] later. An operation that finds the peer backing off
/// waits for the end of the back-off if its deadline allows, else fails at once with
/// [`Error::BackingOff`].
pub(crate) async fn lazily<T, F, Fut>(
    node: &Node,
    peer: NodeId,
    timeout: Duration,
    op: F,
) -> Result<T, Error>
where
    F: Fn() -> Fut,
    Fut: Future<Output = Result<T, Error>>,
{
    match op().await {
        Err(Error::Net(NetError::NotConnected { .. })) => {
            connect_lazily(node, peer, timeout).await?;
            op().await
        }
        other => other,
    }
}

/// The connect of [`lazily`]: if this node knows where `peer` listens, connects there within
/// `timeout` (waiting for its back-off first, or failing with [`Error::BackingOff`]) and checks
/// that the node found is `peer`. [`Error::Net`] with `NotConnected` when the address is not
/// known.
pub(crate) async fn connect_lazily(
    node: &Node,
    peer: NodeId,
    timeout: Duration,
) -> Result<(), Error> {
    let start = Instant::now();
    let entry = node
        .shared
        .book
        .lock()
        .ok()
        .and_then(|b| b.get(&peer).copied());
    let Some(entry) = entry else {
        return Err(Error::Net(NetError::NotConnected { node: peer }));
    };
    let addr = entry.addr;
    if let Some(at) = entry.retry_at {
        let wait = at.saturating_duration_since(start);
        if wait >= timeout {
            return Err(Error::BackingOff {
                node: peer,
                failures: entry.failures,
                retry_in: wait,
            });
        }
        sleep(wait).await;
    }
    let attempt = Instant::now();
    let connected = node
        .connect_within(addr, timeout.saturating_sub(start.elapsed()))
        .await;
    if !matches!(connected, Err(Error::TimedOut { .. })) {
        node.shard_ctx().count_reconnect(connected.is_ok());
    }
    if let Ok(mut book) = node.shared.book.lock() {
        if let Some(e) = book.get_mut(&peer).filter(|e| e.addr == addr) {
            match &connected {
                Ok(_) => *e = BookEntry::new(addr),
                // The operation's own deadline cut the connect short: that says
                // nothing about the peer.
                Err(Error::TimedOut { .. }) => {}
                // Another attempt that started with this one already failed and counted:
                // one failure per round of attempts, not one per call that waited.
                Err(_) if e.failed_at.is_some_and(|t| t >= attempt) => {}
                Err(err) => {
                    e.failures = e.failures.saturating_add(1);
                    let backoff = e.backoff(peer);
                    let now = Instant::now();
                    e.failed_at = Some(now);
                    e.retry_at = Some(now + backoff);
                    tracing::warn!(node = %peer, %addr, failures = e.failures, retry_in = ?backoff,
                        error = %err, "reconnect failed; backing off");
                }
            }
        }
    }
    let found = connected?;
    if found.node != peer {
        return Err(Error::WrongPeer {
            addr,
            expected: peer,
            found: found.node,
        });
    }
    Ok(())
}

impl AmMsg {
    /// The sending peer, naming the shard it was sent from: an answer through it goes back on
    /// the rail the message came in on.
    pub fn from(&self) -> Peer {
        self.from
    }

    /// The message's id.
    pub fn id(&self) -> AmId {
        self.id
    }

    /// The header.
    pub fn header(&self) -> &[u8] {
        self.frame.user_header()
    }

    /// The payload, read in place.
    pub fn payload(&self) -> &[u8] {
        self.frame.payload()
    }

    /// The payload, owned (moved when it came by rendezvous; copied out of UCX's buffer
    /// otherwise).
    pub fn into_payload(self) -> Vec<u8> {
        self.frame.into_vec()
    }

    /// Answers at once with active message `id`, `header` and `payload`, on the rail this
    /// message came in on ([`Peer::am_send_now`] to [`AmMsg::from`]): from the handler, it costs
    /// no task and, when UCX takes it in place, no copy.
    pub fn reply(&self, id: AmId, header: &[u8], payload: &[u8]) -> Result<(), Error> {
        send_now(&self.ctx, self.from.dest(), id, header, payload)
    }

    /// Lands the payload in device buffer `dst`, which the handler chose (of the payload's
    /// length, on the receiving shard's device). The future owns the message and `dst` (it is
    /// `'static`), so the handler may spawn it
    /// (`glommio::spawn_local(msg.into_device(dst))`), and resolves once the device holds the
    /// payload, with the message's header and `dst` ([`DeviceAmMsg`]).
    ///
    /// Staged, in every CUDA mode: the payload stays where it arrived (a rendezvous payload in
    /// a block of the shard's registered pool or its receive cache, an eager one in UCX's
    /// descriptor or, for a short message, in the shard's reused inline buffer), held until
    /// the copy is done, and is copied to the device through the shard's
    /// pinned bounce buffers on its stream ([`Node::copy_to_device`]), the copies' events
    /// polled between yields, never waited on. UCX never sees the device pointer.
    ///
    /// Errors, with `dst` handed back: [`Error::Cuda`] (no CUDA on this shard, and why; a
    /// buffer on another device; a length other than the payload's; the driver's error).
    pub async fn into_device(
        self,
        mut dst: crate::DeviceBuffer,
    ) -> Result<DeviceAmMsg, (Error, crate::DeviceBuffer)> {
        let landed = self
            .ctx
            .cuda()
            .host_to_device(self.frame.payload(), &mut dst)
            .await;
        match landed {
            Ok(()) => Ok(DeviceAmMsg {
                from: self.from,
                id: self.id,
                header: self.frame.user_header().to_vec(),
                payload: dst,
            }),
            Err(e) => Err((e.into(), dst)),
        }
    }

    /// A copy that may cross threads (header and payload copied out of UCX's buffer, which is
    /// released).
    pub fn into_owned(self) -> OwnedAmMsg {
        OwnedAmMsg {
            from: self.from,
            id: self.id,
            header: self.frame.user_header().to_vec(),
            payload: self.frame.into_vec(),
        }
    }
}

impl<'a> AmView<'a> {
    /// The sending peer, naming the shard it was sent from (see [`AmMsg::from`]).
    pub fn from(&self) -> Peer {
        self.from
    }

    /// The message's id.
    pub fn id(&self) -> AmId {
        self.id
    }

    /// The header, in place.
    pub fn header(&self) -> &'a [u8] {
        self.frame.user_header()
    }

    /// The payload, in place.
    pub fn payload(&self) -> &'a [u8] {
        self.frame.payload()
    }

    /// When the shard took the message from UCX: the clock reading its dispatch took anyway
    /// (one per round of the progress driver, by the first frame that needs it), so that a
    /// handler timing messages reads no clock of its own.
    pub fn arrived(&self) -> std::time::Instant {
        self.frame.arrived()
    }

    /// Answers at once, as [`AmMsg::reply`] does: on the rail the message came in on, with no
    /// task and, when UCX takes it in place, no copy. `header` and `payload` may be the
    /// message's own (an echo).
    pub fn reply(&self, id: AmId, header: &[u8], payload: &[u8]) -> Result<(), Error> {
        send_now(self.ctx, self.from.dest(), id, header, payload)
    }

    /// A copy of the message (header and payload) that may be kept and cross threads.
    pub fn to_owned(&self) -> OwnedAmMsg {
        OwnedAmMsg {
            from: self.from,
            id: self.id,
            header: self.header().to_vec(),
            payload: self.payload().to_vec(),
        }
    }
}

impl std::fmt::Debug for AmView<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmView")
            .field("from", &self.from)
            .field("id", &self.id)
            .field("header", &self.header().len())
            .field("payload", &self.payload().len())
            .finish()
    }
}

impl std::fmt::Debug for AmMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmMsg")
            .field("from", &self.from)
            .field("id", &self.id)
            .field("header", &self.header().len())
            .field("payload", &self.payload().len())
            .finish()
    }
}

impl DeviceAmMsg {
    /// The sending peer (see [`AmMsg::from`]).
    pub fn from(&self) -> Peer {
        self.from
    }

    /// The message's id.
    pub fn id(&self) -> AmId {
        self.id
    }

    /// The header.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// The device buffer holding the payload.
    pub fn payload(&mut self) -> &mut crate::DeviceBuffer {
        &mut self.payload
    }

    /// The device buffer holding the payload, owned.
    pub fn into_payload(self) -> crate::DeviceBuffer {
        self.payload
    }
}

impl OwnedAmMsg {
    /// The sending peer (see [`AmMsg::from`]).
    pub fn from(&self) -> Peer {
        self.from
    }

    /// The message's id.
    pub fn id(&self) -> AmId {
        self.id
    }

    /// The header.
    pub fn header(&self) -> &[u8] {
        &self.header
    }

    /// The payload.
    pub fn payload(&self) -> &[u8] {
        &self.payload
    }

    /// The payload, owned.
    pub fn into_payload(self) -> Vec<u8> {
        self.payload
    }
}

/// Runs `fut` with a deadline: [`Error::TimedOut`] once `timeout` has passed.
pub(crate) async fn within<T>(
    what: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let start = Instant::now();
    futures_lite::future::or(fut, async {
        sleep(timeout.saturating_sub(start.elapsed())).await;
        Err(Error::TimedOut {
            what,
            after: timeout,
        })
    })
    .await
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn peers_name_a_node_or_one_shard_of_it() {
        let p = Peer::new(NodeId::new(3));
        assert_eq!(p.target_shard(), None);
        let s = p.shard(ShardId::new(2));
        assert_eq!(
            (s.node_id(), s.target_shard()),
            (NodeId::new(3), Some(ShardId::new(2)))
        );
        assert_eq!(s.node(), p);
        assert_eq!(s.dest(), Dest::shard(NodeId::new(3), ShardId::new(2)));
        assert_eq!(p.dest(), Dest::from(NodeId::new(3)));
    }
}
