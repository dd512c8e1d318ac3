//! The bridge between a shardcx node and one thread that waits for its completions (the
//! asyncio event loop's, for the Python module; a plain thread, for the `thread_pingpong`
//! example that measures the bridge without Python). No pyo3 here: the example includes this
//! file as a module of its own.
//!
//! See the crate docs (`lib.rs`) for the model: commands into per-shard inboxes, events back
//! through a queue and a socket pair, endpoints as channels on node sessions.

use std::cell::RefCell;
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::io::{ErrorKind, Read, Write};
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use futures_lite::FutureExt;
use shardcx::proto::handshake::RejectReason;
use shardcx::proto::{Tag, TagKind};
use shardcx::registry::Signature;
use shardcx::rpc::RpcError;
use shardcx::shards::net::Dest;
use shardcx::shards::{DriverConfig, NetConfig, NetError, Placement};
use shardcx::tag::TagConfig;
use shardcx::{AmId, AmMsg, Error, Node, NodeId, Peer, ShardId, Shutdown};

/// Bits of a wire tag that name the receiving endpoint.
pub(crate) const EP_BITS: u32 = 24;
/// Bits of a wire tag left to the application (`tag=` in Python).
pub(crate) const USER_TAG_BITS: u32 = 48 - EP_BITS;
/// Largest application tag.
pub(crate) const MAX_TAG: u64 = (1 << USER_TAG_BITS) - 1;
/// Largest endpoint id (ids start at 1; a node makes at most this many endpoints).
pub(crate) const MAX_EP: u32 = (1 << EP_BITS) - 1;

/// Active-message ids of the endpoint protocol (below the runtime's reserved range).
pub(crate) const AM_OPEN: AmId = AmId::new(0x5059_0001);
pub(crate) const AM_ACCEPT: AmId = AmId::new(0x5059_0002);
pub(crate) const AM_REFUSE: AmId = AmId::new(0x5059_0003);
pub(crate) const AM_DATA: AmId = AmId::new(0x5059_0004);
pub(crate) const AM_CLOSE: AmId = AmId::new(0x5059_0005);

/// A failure as Python sees it: the name of an exception class of `shardcx` and a message.
#[derive(Debug, Clone)]
pub(crate) struct ErrInfo {
    pub(crate) kind: &'static str,
    pub(crate) msg: String,
}

/// What a finished operation gives back.
pub(crate) enum Value {
    None,
    /// A tag message: its application tag and payload.
    Tagged(u64, Vec<u8>),
    /// A connected node (by [`Cmd::Connect`] with no endpoint): its id.
    Node(u64),
    /// An RPC function's reply.
    Bytes(Vec<u8>),
    /// The functions a node serves: name, id, version, and whether it takes and returns
    /// bytes (`Vec<u8> => Vec<u8>`, callable from Python).
    Functions(Vec<(String, u32, u32, bool)>),
    /// A connected endpoint: local id, remote id, the remote node and the remote shard.
    Endpoint {
        ep: u32,
        remote_ep: u32,
        node: u64,
        remote_shard: u16,
    },
}

/// From the shards to the event loop.
pub(crate) enum Event {
    Started {
        port: Option<u16>,
        node: u64,
    },
    StartFailed(ErrInfo),
    Stopped(Option<ErrInfo>),
    Done {
        op: u64,
        value: Value,
    },
    Failed {
        op: u64,
        err: ErrInfo,
    },
    /// A remote endpoint opened one on this node's listener.
    Accept {
        ep: u32,
        remote_ep: u32,
        shard: u16,
        node: u64,
        remote_shard: u16,
    },
    /// An active message for endpoint `ep`.
    Am {
        ep: u32,
        payload: Vec<u8>,
    },
    /// The remote end closed endpoint `ep`, after sending it `sent` tag messages.
    PeerClosed {
        ep: u32,
        sent: u64,
    },
    /// The connection to `node` ended (reported by each shard that had a rail to it).
    PeerLost {
        node: u64,
        err: ErrInfo,
    },
}

/// From the event loop to one shard.
pub(crate) enum Cmd {
    /// Connects to the node at `addr`, and opens an endpoint on its listener when `endpoint`
    /// (else for RPC: no endpoint, the node's id comes back).
    Connect {
        op: u64,
        addr: SocketAddr,
        timeout: Duration,
        endpoint: bool,
    },
    TagSend {
        op: u64,
        dest: Dest,
        tag: u64,
        data: Vec<u8>,
        timeout: Duration,
    },
    TagRecv {
        op: u64,
        node: NodeId,
        pattern: u64,
        mask: u64,
        timeout: Duration,
    },
    AmSend {
        op: u64,
        dest: Dest,
        remote_ep: u32,
        data: Vec<u8>,
        timeout: Duration,
    },
    Close {
        op: u64,
        dest: Dest,
        remote_ep: u32,
        /// Tag messages the endpoint sent: the peer receives that many before it reports
        /// the close to its pending receives.
        sent: u64,
        timeout: Duration,
    },
    Cancel {
        op: u64,
    },
    /// Calls the RPC function named `name` of `dest` with `data` (see [`rpc_call`]).
    RpcCall {
        op: u64,
        dest: Dest,
        name: String,
        data: Vec<u8>,
        timeout: Duration,
    },
    /// Lists the RPC functions `node` serves.
    RpcFunctions {
        op: u64,
        node: NodeId,
        timeout: Duration,
    },
}

/// A shard's inbox: commands from the loop, and the waker of the shard's serving task.
#[derive(Default)]
pub(crate) struct Inbox {
    state: Mutex<InboxState>,
}

#[derive(Default)]
pub(crate) struct InboxState {
    queue: VecDeque<Cmd>,
    waker: Option<Waker>,
}

/// A one-shot slot filled by any thread (the endpoint handshake's answer may arrive on any
/// shard), awaited on one.
pub(crate) struct Slot<T> {
    state: Mutex<(Option<T>, Option<Waker>)>,
}

/// The answer to an endpoint opening: the remote endpoint id and shard, or why not.
pub(crate) type Accepted = Result<(u32, u16), ErrInfo>;

/// State shared by the shards, the node thread and the Python object.
pub(crate) struct Shared {
    events: Mutex<Vec<Event>>,
    /// Written (one byte) when an event goes into an empty queue.
    notify: UnixStream,
    inboxes: Vec<Inbox>,
    /// Whether a listener takes new endpoints (`OPEN` is refused otherwise).
    accepting: AtomicBool,
    next_ep: AtomicU32,
    /// Endpoints being opened by this node, by local id: where the answer goes.
    opening: Mutex<HashMap<u32, Arc<Slot<Accepted>>>>,
    /// Shards that have started serving their inbox.
    ready: AtomicUsize,
    shutdown: Shutdown,
}

/// A running node and the two ends of its bridge to one waiting thread (see the module docs).
pub(crate) struct Bridge {
    shared: Arc<Shared>,
    /// The waiting thread's end of the notification socket pair.
    reader: UnixStream,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl ErrInfo {
    fn new(kind: &'static str, msg: impl Into<String>) -> Self {
        Self {
            kind,
            msg: msg.into(),
        }
    }

    fn from_error(e: &Error) -> Self {
        let kind = match e {
            Error::TimedOut { .. } => "Timeout",
            Error::Net(n) => net_kind(n),
            Error::BackingOff { .. } => "Unreachable",
            Error::HeaderTooLarge { .. } => "TooLarge",
            _ => "Error",
        };
        Self::new(kind, e.to_string())
    }

    fn from_net(e: &NetError) -> Self {
        Self::new(net_kind(e), e.to_string())
    }

    /// The Python exception for a failed call (`Error` for what has no class of its own).
    pub(crate) fn from_rpc(e: &RpcError) -> Self {
        let kind = match e {
            RpcError::Net(e) => return Self::from_error(e),
            RpcError::UnknownFunction { .. } | RpcError::UnknownName { .. } => "UnknownFunction",
            RpcError::SchemaMismatch { .. } => "SchemaMismatch",
            RpcError::DeadlineExpired | RpcError::TimedOut { .. } => "Timeout",
            RpcError::Cancelled => "Cancelled",
            RpcError::TooLarge { .. } => "TooLarge",
            RpcError::ShuttingDown => "Closed",
            RpcError::Failed(_)
            | RpcError::Panicked(_)
            | RpcError::BadRequest(_)
            | RpcError::BadReply(_)
            | RpcError::TooOld
            | RpcError::Busy
            | RpcError::Remote { .. } => "RemoteError",
            _ => "Error",
        };
        Self::new(kind, e.to_string())
    }
}

/// The Python exception class for a connection error.
pub(crate) fn net_kind(e: &NetError) -> &'static str {
    match e {
        NetError::TimedOut { .. } => "Timeout",
        NetError::Refused {
            reason: RejectReason::BadProof,
            ..
        }
        | NetError::NoKey => "AuthFailed",
        NetError::Refused {
            reason: RejectReason::Shutdown,
            ..
        } => "Closed",
        NetError::Refused { .. } | NetError::Unreachable { .. } => "Unreachable",
        NetError::PeerDead { .. }
        | NetError::Transport { .. }
        | NetError::NotConnected { .. }
        | NetError::Receive { .. } => "ConnectionLost",
        NetError::Closed { .. } | NetError::ShuttingDown => "Closed",
        NetError::TooLarge { .. } | NetError::HeaderTooLarge { .. } => "TooLarge",
        _ => "Error",
    }
}

impl Inbox {
    fn push(&self, cmd: Cmd) {
        let waker = {
            let mut st = lock(&self.state);
            st.queue.push_back(cmd);
            st.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    fn poll_next(&self, cx: &mut Context<'_>) -> Poll<Cmd> {
        let mut st = lock(&self.state);
        match st.queue.pop_front() {
            Some(cmd) => Poll::Ready(cmd),
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl<T> Slot<T> {
    fn new() -> Self {
        Self {
            state: Mutex::new((None, None)),
        }
    }

    fn fill(&self, value: T) {
        let waker = {
            let mut st = lock(&self.state);
            st.0 = Some(value);
            st.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    async fn wait(&self) -> T {
        futures_lite::future::poll_fn(|cx| {
            let mut st = lock(&self.state);
            match st.0.take() {
                Some(v) => Poll::Ready(v),
                None => {
                    st.1 = Some(cx.waker().clone());
                    Poll::Pending
                }
            }
        })
        .await
    }
}

impl Shared {
    fn push(&self, ev: Event) {
        let was_empty = {
            let mut q = lock(&self.events);
            let was_empty = q.is_empty();
            q.push(ev);
            was_empty
        };
        if was_empty {
            // Non-blocking: a full socket already holds a wake-up byte, so WouldBlock is fine.
            // Any other error means the loop's end is gone: nobody is listening any more.
            let _ = (&self.notify).write(&[1]);
        }
    }

    fn alloc_ep(&self) -> Result<u32, ErrInfo> {
        let ep = self.next_ep.fetch_add(1, Ordering::Relaxed);
        if ep == 0 || ep > MAX_EP {
            return Err(ErrInfo::new(
                "Error",
                format!("this node has made its {MAX_EP} endpoints"),
            ));
        }
        Ok(ep)
    }

    fn inbox(&self, shard: usize) -> Result<&Inbox, String> {
        self.inboxes.get(shard).ok_or_else(|| {
            format!(
                "shard {shard} out of range (node has {})",
                self.inboxes.len()
            )
        })
    }
}

/// Locks `m`, also when a thread panicked while holding it (the data are plain queues, valid
/// at every step).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn ep_header(ep: u32) -> [u8; 4] {
    ep.to_le_bytes()
}

pub(crate) fn read_u32(b: &[u8], at: usize) -> Option<u32> {
    let bytes: [u8; 4] = b.get(at..at + 4)?.try_into().ok()?;
    Some(u32::from_le_bytes(bytes))
}

/// The little-endian `u64` at `at` in `b`, if there is one.
pub(crate) fn read_u64(b: &[u8], at: usize) -> Option<u64> {
    let bytes: [u8; 8] = b.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// Runs `fut`, or fails with `Timeout` once `timeout` has passed.
pub(crate) async fn within<T>(
    what: &str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, ErrInfo>>,
) -> Result<T, ErrInfo> {
    fut.or(async {
        glommio::timer::sleep(timeout).await;
        Err(ErrInfo::new(
            "Timeout",
            format!("{what} timed out after {timeout:?}"),
        ))
    })
    .await
}

/// One operation on a shard.
pub(crate) async fn run_op(node: Node, shared: Arc<Shared>, cmd: Cmd) -> Result<Value, ErrInfo> {
    let ctx = node.shard_ctx().clone();
    match cmd {
        Cmd::Connect {
            addr,
            timeout,
            endpoint: true,
            ..
        } => connect(&node, &shared, addr, timeout).await,
        Cmd::Connect { addr, timeout, .. } => {
            let peer = node
                .connect_within(addr, timeout)
                .await
                .map_err(|e| ErrInfo::from_error(&e))?;
            Ok(Value::Node(peer.node_id().get()))
        }
        Cmd::TagSend {
            dest,
            tag,
            data,
            timeout,
            ..
        } => {
            let tag = Tag::new(TagKind::User, node.shard(), tag)
                .map_err(|e| ErrInfo::new("Error", e.to_string()))?;
            within("send", timeout, async {
                ctx.tag_send(dest, tag, data)
                    .await
                    .map_err(|e| ErrInfo::from_net(&e))
            })
            .await?;
            Ok(Value::None)
        }
        Cmd::TagRecv {
            node: peer,
            pattern,
            mask,
            timeout,
            ..
        } => {
            let (tag, data) = Peer::new(peer)
                .tag_recv_within(pattern, mask, timeout)
                .await
                .map_err(|e| ErrInfo::from_error(&e))?;
            Ok(Value::Tagged(tag & MAX_TAG, data))
        }
        Cmd::AmSend {
            dest,
            remote_ep,
            data,
            timeout,
            ..
        } => {
            let peer = peer_of(dest);
            peer.am_send_within(AM_DATA, &ep_header(remote_ep), &data, timeout)
                .await
                .map_err(|e| ErrInfo::from_error(&e))?;
            Ok(Value::None)
        }
        Cmd::Close {
            dest,
            remote_ep,
            sent,
            timeout,
            ..
        } => {
            let peer = peer_of(dest);
            let mut h = [0u8; 12];
            h[..4].copy_from_slice(&remote_ep.to_le_bytes());
            h[4..].copy_from_slice(&sent.to_le_bytes());
            peer.am_send_within(AM_CLOSE, &h, &[], timeout)
                .await
                .map_err(|e| ErrInfo::from_error(&e))?;
            Ok(Value::None)
        }
        Cmd::Cancel { .. } => Ok(Value::None),
        Cmd::RpcCall {
            dest,
            name,
            data,
            timeout,
            ..
        } => rpc_call(&node, dest, &name, &data, timeout)
            .await
            .map(Value::Bytes),
        Cmd::RpcFunctions {
            node: peer,
            timeout,
            ..
        } => {
            let rpc = node.rpc();
            let sigs = within("functions", timeout, async {
                rpc.discover(Peer::new(peer))
                    .await
                    .map_err(|e| ErrInfo::from_rpc(&e))
            })
            .await?;
            Ok(Value::Functions(
                sigs.into_iter()
                    .map(|s| {
                        let bytes = s.schema == bytes_schema(&s.name, s.version);
                        (s.name, s.id, s.version, bytes)
                    })
                    .collect(),
            ))
        }
    }
}

thread_local! {
    /// The signatures this shard looked up, by node and name: one discovery per function
    /// and node, not one per call.
    static SIGNATURES: RefCell<HashMap<(NodeId, String), Signature>> = RefCell::default();
}

/// The schema hash of a function named `name` declared over bytes (`Vec<u8> => Vec<u8>`).
pub(crate) fn bytes_schema(name: &str, version: u32) -> u64 {
    let bytes = std::any::type_name::<Vec<u8>>();
    shardcx::rpc::schema_hash(bytes, bytes, name, version)
}

/// Calls the function named `name` on `dest` with `data`: found by name through the node's
/// built-in discovery (cached per shard), checked to take and return bytes (else
/// `SchemaMismatch`, before anything is sent), and called within `timeout` in all. A cached
/// signature the server no longer knows (it restarted with other functions) is looked up
/// once more.
pub(crate) async fn rpc_call(
    node: &Node,
    dest: Dest,
    name: &str,
    data: &Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, ErrInfo> {
    let rpc = node.rpc();
    let peer = peer_of(dest);
    let key = (dest.node, name.to_owned());
    within("call", timeout, async {
        let start = Instant::now();
        for attempt in 0..2 {
            let cached = SIGNATURES.with(|c| c.borrow().get(&key).cloned());
            let from_cache = cached.is_some();
            let sig = match cached {
                Some(s) => s,
                None => {
                    let s = rpc
                        .lookup(peer, name)
                        .await
                        .map_err(|e| ErrInfo::from_rpc(&e))?;
                    SIGNATURES.with(|c| c.borrow_mut().insert(key.clone(), s.clone()));
                    s
                }
            };
            if sig.schema != bytes_schema(name, sig.version) {
                return Err(ErrInfo::new(
                    "SchemaMismatch",
                    format!(
                        "the function {name:?} (version {}) is not declared over bytes \
                         (Vec<u8> => Vec<u8>): Python cannot call it",
                        sig.version
                    ),
                ));
            }
            let left = timeout.saturating_sub(start.elapsed());
            match rpc
                .call_signature::<Vec<u8>, Vec<u8>>(peer, &sig, data, Some(left))
                .await
            {
                Err(
                    shardcx::rpc::RpcError::UnknownFunction { .. }
                    | shardcx::rpc::RpcError::SchemaMismatch { .. },
                ) if from_cache && attempt == 0 => {
                    SIGNATURES.with(|c| c.borrow_mut().remove(&key));
                }
                other => return other.map_err(|e| ErrInfo::from_rpc(&e)),
            }
        }
        Err(ErrInfo::new(
            "SchemaMismatch",
            format!("the function {name:?} changed while it was called"),
        ))
    })
    .await
}

pub(crate) fn peer_of(dest: Dest) -> Peer {
    let peer = Peer::new(dest.node);
    match dest.shard {
        Some(s) => peer.shard(s),
        None => peer,
    }
}

/// Connects to the node at `addr` and opens an endpoint on its listener.
pub(crate) async fn connect(
    node: &Node,
    shared: &Arc<Shared>,
    addr: SocketAddr,
    timeout: Duration,
) -> Result<Value, ErrInfo> {
    let start = Instant::now();
    let peer = node
        .connect_within(addr, timeout)
        .await
        .map_err(|e| ErrInfo::from_error(&e))?;
    let ep = shared.alloc_ep()?;
    let slot = Arc::new(Slot::new());
    lock(&shared.opening).insert(ep, slot.clone());
    // Whatever happens from here (also the task being dropped), the slot goes away.
    struct Forget<'a>(&'a Shared, u32);
    impl Drop for Forget<'_> {
        fn drop(&mut self) {
            lock(&self.0.opening).remove(&self.1);
        }
    }
    let _forget = Forget(shared, ep);
    let left = timeout.saturating_sub(start.elapsed());
    peer.am_send_within(AM_OPEN, &ep_header(ep), &[], left)
        .await
        .map_err(|e| ErrInfo::from_error(&e))?;
    let left = timeout.saturating_sub(start.elapsed());
    let (remote_ep, remote_shard) =
        within("create_endpoint", left, async { slot.wait().await }).await?;
    Ok(Value::Endpoint {
        ep,
        remote_ep,
        node: peer.node_id().get(),
        remote_shard,
    })
}

/// The endpoint protocol's active-message handlers, installed on every shard.
pub(crate) fn with_handlers(b: shardcx::NodeBuilder, shared: &Arc<Shared>) -> shardcx::NodeBuilder {
    let s = shared.clone();
    let b = b.on_am(AM_OPEN, move || {
        let shared = s.clone();
        move |node: &Node, msg: AmMsg| {
            let Some(remote_ep) = read_u32(msg.header(), 0) else {
                return;
            };
            let from = msg.from();
            let answer = if shared.accepting.load(Ordering::Acquire) {
                shared.alloc_ep().inspect(|&ep| {
                    shared.push(Event::Accept {
                        ep,
                        remote_ep,
                        shard: node.shard().get(),
                        node: from.node_id().get(),
                        remote_shard: from.target_shard().map_or(0, ShardId::get),
                    });
                })
            } else {
                Err(ErrInfo::new("Unreachable", "no listener"))
            };
            let sent = match answer {
                Ok(ep) => {
                    let mut h = [0u8; 8];
                    h[..4].copy_from_slice(&remote_ep.to_le_bytes());
                    h[4..].copy_from_slice(&ep.to_le_bytes());
                    msg.reply(AM_ACCEPT, &h, &[])
                }
                Err(_) => msg.reply(AM_REFUSE, &ep_header(remote_ep), &[]),
            };
            if let Err(e) = sent {
                tracing::warn!(error = %e, "cannot answer an endpoint opening");
            }
        }
    });
    let s = shared.clone();
    let b = b.on_am(AM_ACCEPT, move || {
        let shared = s.clone();
        move |_: &Node, msg: AmMsg| {
            let (Some(ep), Some(remote_ep)) =
                (read_u32(msg.header(), 0), read_u32(msg.header(), 4))
            else {
                return;
            };
            let remote_shard = msg.from().target_shard().map_or(0, ShardId::get);
            if let Some(slot) = lock(&shared.opening).get(&ep) {
                slot.fill(Ok((remote_ep, remote_shard)));
            }
        }
    });
    let s = shared.clone();
    let b = b.on_am(AM_REFUSE, move || {
        let shared = s.clone();
        move |_: &Node, msg: AmMsg| {
            if let Some(slot) =
                read_u32(msg.header(), 0).and_then(|ep| lock(&shared.opening).get(&ep).cloned())
            {
                slot.fill(Err(ErrInfo::new(
                    "Unreachable",
                    format!("node {} has no listener", msg.from().node_id()),
                )));
            }
        }
    });
    let s = shared.clone();
    let b = b.on_am(AM_DATA, move || {
        let shared = s.clone();
        move |_: &Node, msg: AmMsg| {
            if let Some(ep) = read_u32(msg.header(), 0) {
                shared.push(Event::Am {
                    ep,
                    payload: msg.into_payload(),
                });
            }
        }
    });
    let s = shared.clone();
    b.on_am(AM_CLOSE, move || {
        let shared = s.clone();
        move |_: &Node, msg: AmMsg| {
            let sent = read_u64(msg.header(), 4);
            if let (Some(ep), Some(sent)) = (read_u32(msg.header(), 0), sent) {
                shared.push(Event::PeerClosed { ep, sent });
            }
        }
    })
}

/// A shard's serving task: takes commands from its inbox and runs each as a local task, until
/// the node is asked to stop.
pub(crate) async fn serve_shard(node: Node, shared: Arc<Shared>, shard_count: usize) {
    let me = node.shard().index();
    {
        let shared = shared.clone();
        node.shard_ctx().on_peer_lost(move |peer, err| {
            if let Some(peer) = peer {
                shared.push(Event::PeerLost {
                    node: peer.get(),
                    err: ErrInfo::from_net(err),
                });
            }
        });
    }
    if shared.ready.fetch_add(1, Ordering::AcqRel) + 1 == shard_count {
        shared.push(Event::Started {
            port: node.listen_addr().map(|a| a.port()),
            node: node.id().get(),
        });
    }
    let tasks: Rc<RefCell<HashMap<u64, glommio::task::JoinHandle<()>>>> = Rc::default();
    let mut stopped = node.stopped();
    let Some(inbox) = shared.inboxes.get(me) else {
        return;
    };
    loop {
        let next = futures_lite::future::poll_fn(|cx| {
            if let Poll::Ready(cmd) = inbox.poll_next(cx) {
                return Poll::Ready(Some(cmd));
            }
            match Pin::new(&mut stopped).poll(cx) {
                Poll::Ready(()) => Poll::Ready(None),
                Poll::Pending => Poll::Pending,
            }
        })
        .await;
        let Some(cmd) = next else { break };
        let op = match &cmd {
            Cmd::Cancel { op } => {
                if let Some(task) = tasks.borrow_mut().remove(op) {
                    task.cancel();
                }
                continue;
            }
            Cmd::Connect { op, .. }
            | Cmd::TagSend { op, .. }
            | Cmd::TagRecv { op, .. }
            | Cmd::AmSend { op, .. }
            | Cmd::Close { op, .. }
            | Cmd::RpcCall { op, .. }
            | Cmd::RpcFunctions { op, .. } => *op,
        };
        let (node2, shared2, tasks2) = (node.clone(), shared.clone(), tasks.clone());
        let task = glommio::spawn_local(async move {
            let out = AssertUnwindSafe(run_op(node2, shared2.clone(), cmd))
                .catch_unwind()
                .await;
            let ev = match out {
                Ok(Ok(value)) => Event::Done { op, value },
                Ok(Err(err)) => Event::Failed { op, err },
                Err(_) => Event::Failed {
                    op,
                    err: ErrInfo::new("Error", "internal error: the operation panicked"),
                },
            };
            tasks2.borrow_mut().remove(&op);
            shared2.push(ev);
        })
        .detach();
        tasks.borrow_mut().insert(op, task);
    }
    // The inbox (shared with Python's thread, which may drop it last) must not keep this
    // executor's waker: a glommio waker dropped on another thread after its executor ended
    // leaks the executor (see `shards/src/mesh.rs`, the doorbell).
    lock(&inbox.state).waker = None;
    // Operations still running end with the node: they fail as the connections close.
}

/// Settings of a node.
pub(crate) struct Config {
    pub(crate) shards: usize,
    pub(crate) psk: Option<Vec<u8>>,
    pub(crate) transports: Option<String>,
    pub(crate) listen: Option<SocketAddr>,
    pub(crate) pinned: bool,
    pub(crate) max_message_size: u64,
    pub(crate) default_deadline: Duration,
    pub(crate) io_memory: u64,
    /// The drivers' spin window after the last event, before they sleep.
    pub(crate) spin: Duration,
    /// Bounds of the queue of tag messages that arrive before their receive, per peer.
    pub(crate) unexpected: TagConfig,
}

impl Bridge {
    /// Starts a node on a thread of its own (see the module docs).
    pub(crate) fn start(cfg: Config) -> Result<Self, String> {
        let (reader, writer) = UnixStream::pair().map_err(|e| format!("socket pair: {e}"))?;
        for s in [&reader, &writer] {
            s.set_nonblocking(true)
                .map_err(|e| format!("socket pair: {e}"))?;
        }
        let net = NetConfig {
            max_message_size: cfg.max_message_size,
            ..NetConfig::default()
        };
        let mut b = Node::builder()
            .shards(cfg.shards)
            .placement(if cfg.pinned {
                Placement::Pinned
            } else {
                Placement::Unpinned
            })
            .io_memory(cfg.io_memory)
            .with_shards(|s| s.driver(DriverConfig { spin: cfg.spin }))
            .net(net)
            .tag_config(cfg.unexpected)
            .default_deadline(cfg.default_deadline);
        if let Some(key) = &cfg.psk {
            b = b.psk(key);
        }
        if let Some(tls) = &cfg.transports {
            b = b.transports(tls);
        }
        if let Some(addr) = cfg.listen {
            b = b.listen(addr);
        }
        let shared = Arc::new(Shared {
            events: Mutex::new(Vec::new()),
            notify: writer,
            inboxes: (0..cfg.shards).map(|_| Inbox::default()).collect(),
            accepting: AtomicBool::new(false),
            next_ep: AtomicU32::new(1),
            opening: Mutex::new(HashMap::new()),
            ready: AtomicUsize::new(0),
            // The node's switch is the builder's: every clone is the same switch.
            shutdown: b.shutdown_handle(),
        });
        let b = with_handlers(b, &shared);
        let shard_count = cfg.shards;
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name("shardcx-node".into())
            .spawn(move || {
                let s2 = s.clone();
                // A shard that panics makes `run` panic once the others have ended: caught
                // here, so that Python hears of it (its pending calls fail) instead of waiting.
                let out = std::panic::catch_unwind(AssertUnwindSafe(move || {
                    b.run(move |node| {
                        let s = s2.clone();
                        async move { serve_shard(node, s, shard_count).await }
                    })
                }));
                let started = s.ready.load(Ordering::Acquire) == shard_count;
                let ev = match out {
                    Ok(Ok(_)) => Event::Stopped(None),
                    Ok(Err(e)) if !started => Event::StartFailed(ErrInfo::from_error(&e)),
                    Ok(Err(e)) => Event::Stopped(Some(ErrInfo::from_error(&e))),
                    Err(_) => {
                        let err = ErrInfo::new("Error", "internal error: a shard panicked");
                        if started {
                            Event::Stopped(Some(err))
                        } else {
                            Event::StartFailed(err)
                        }
                    }
                };
                s.push(ev);
            })
            .map_err(|e| format!("cannot start the node thread: {e}"))?;
        Ok(Self {
            shared,
            reader,
            thread: Mutex::new(Some(thread)),
        })
    }

    /// Hands `cmd` to shard `shard`.
    pub(crate) fn submit(&self, shard: usize, cmd: Cmd) -> Result<(), String> {
        self.shared.inbox(shard)?.push(cmd);
        Ok(())
    }

    /// The file descriptor that is readable when events wait.
    pub(crate) fn fileno(&self) -> i32 {
        self.reader.as_raw_fd()
    }

    /// Takes every queued event (and the wake-up bytes).
    pub(crate) fn drain(&self) -> Vec<Event> {
        let mut scratch = [0u8; 256];
        loop {
            match (&self.reader).read(&mut scratch) {
                Ok(0) => break,
                Ok(_) => continue,
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(_) => break,
            }
        }
        std::mem::take(&mut *lock(&self.shared.events))
    }

    /// For a thread that blocks until events come (the `thread_pingpong` example), instead
    /// of an event loop that watches [`Bridge::fileno`]: makes [`Bridge::wait`] block, up to
    /// `timeout` per call.
    #[allow(dead_code)] // Used by the thread_pingpong example (it includes this file).
    pub(crate) fn blocking_waits(&self, timeout: Duration) -> std::io::Result<()> {
        self.reader.set_nonblocking(false)?;
        self.reader.set_read_timeout(Some(timeout))
    }

    /// Blocks (after [`Bridge::blocking_waits`]) until a wake-up byte comes or the timeout
    /// passes, then takes the events queued (none after a timeout). Wake-up bytes left
    /// unread only make a later call return early, with no events or with newer ones.
    #[allow(dead_code)] // Used by the thread_pingpong example (it includes this file).
    pub(crate) fn wait(&self) -> Vec<Event> {
        let mut byte = [0u8; 1];
        loop {
            match (&self.reader).read(&mut byte) {
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                _ => break,
            }
        }
        std::mem::take(&mut *lock(&self.shared.events))
    }

    /// Whether new endpoints opened by remote nodes are accepted.
    pub(crate) fn set_accepting(&self, on: bool) {
        self.shared.accepting.store(on, Ordering::Release);
    }

    /// Asks the node to stop.
    pub(crate) fn stop(&self) {
        self.shared.shutdown.trigger();
    }

    /// Waits up to `timeout` for the node's thread to end; whether it did.
    pub(crate) fn join(&self, timeout: Duration) -> bool {
        let start = Instant::now();
        loop {
            let mut slot = lock(&self.thread);
            match slot.as_ref() {
                None => return true,
                Some(t) if t.is_finished() => {
                    if let Some(t) = slot.take() {
                        // The thread's closure catches every error and panic.
                        let _ = t.join();
                    }
                    return true;
                }
                Some(_) => {}
            }
            drop(slot);
            if start.elapsed() >= timeout {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

/// Shard `shard` of node `node`.
pub(crate) fn dest(node: u64, shard: u16) -> Dest {
    Dest::shard(NodeId::new(node), ShardId::new(shard))
}
