//! The serving side of a benchmark: one node of `M` shards (see [`crate::bench`]).
//!
//! [`serve`] starts the node at the listen address, shard `j` pinned to the `j`-th server CPU.
//! Every shard has the same handlers, and each answers on the rail the message came in on, so
//! client shard `i` is served by server shard `i mod M` alone: echo ([`super::ECHO`], answered
//! inline on the progress driver with [`AmView::reply`]), sink with acknowledgements
//! ([`super::SINK`], the acknowledgement inline too), tag ping-pong streams
//! ([`super::TAG_START`]), one remote-memory region per shard, checked or trusted
//! ([`super::REGION`]), and the plain RPC handlers of [`super::RpcEcho`] (the argument's bytes
//! back) and [`super::RpcSink`] (the argument's length). Everything runs until the
//! [`Shutdown`] switch is triggered; then the node drains and closes as any node does (see
//! [`crate::shutdown`]).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use shardcx_shards::{NetError, Placement, ShardsBuilder};

use super::{
    net_config, parse_header, pin_current, BenchError, RpcEcho, RpcSink, Transport, ACK, ECHO,
    ECHO_REPLY, FLAG_ACK, FLAG_TRUSTED, REGION, REGION_REPLY, SINK, TAG_START,
};
use crate::rma::{Permissions, TrustedRegion};
use crate::rpc::RpcContext;
use crate::{AmId, AmMsg, AmView, Error, Node, NodeBuilder, Peer, Region, Shutdown};

/// Tag bits of a ping (see [`crate::bench::client`]): `PING | stream`.
pub(crate) const TAG_PING: u64 = 1 << 12;
/// Tag bits of a pong: `PONG | stream`.
pub(crate) const TAG_PONG: u64 = 2 << 12;
/// Tag bits of the end of a stream: `STOP | stream`.
pub(crate) const TAG_STOP: u64 = 3 << 12;
/// The stream bits of a tag.
pub(crate) const TAG_STREAM: u64 = 0xFFF;

/// How long a tag stream waits for its next ping before it ends by itself.
const TAG_IDLE: Duration = Duration::from_secs(30);
/// How long [`serve`] waits for its node to start.
const START_LIMIT: Duration = Duration::from_secs(30);
/// io memory per node shard when the memlock limit allows it.
const IO_MEMORY: u64 = 1 << 20;

/// Settings of [`serve`].
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The node's listen address (port 0 picks one).
    pub listen: SocketAddr,
    /// Shards of the node.
    pub shards: usize,
    /// UCX transports of the node.
    pub transport: Transport,
    /// The pre-shared key (16 bytes at least).
    pub psk: Vec<u8>,
    /// CPUs for the shards (shard `j` on `cores[j % len]`); `None` leaves them unpinned.
    pub cores: Option<Vec<usize>>,
    /// Trusted-mode remote memory ([`NodeBuilder::trusted_rma`]), for `put-trusted-bw`.
    pub trusted_rma: bool,
    /// Serve Prometheus metrics here ([`NodeBuilder::metrics`]); port 0 picks one.
    pub metrics: Option<SocketAddr>,
}

/// Where a started server listens.
#[derive(Debug, Clone)]
pub struct Serving {
    /// The node's address.
    pub addr: SocketAddr,
    /// Its shard count.
    pub shards: usize,
    /// Where it serves its metrics, if it does.
    pub metrics: Option<SocketAddr>,
}

thread_local! {
    /// This shard's region for put/get tests (grown on request, never shrunk).
    static REGION_OF_SHARD: RefCell<Option<Region>> = const { RefCell::new(None) };
    /// This shard's trusted-mode region for `put-trusted-bw` (grown on request).
    static TRUSTED_OF_SHARD: RefCell<Option<TrustedRegion>> = const { RefCell::new(None) };
}

/// Runs the benchmark server until `stop` is triggered: calls `ready` once the node listens,
/// then returns when it has shut down.
pub fn serve(
    cfg: &ServeConfig,
    stop: &Shutdown,
    ready: impl FnOnce(&Serving),
) -> Result<(), BenchError> {
    if cfg.shards == 0 {
        return Err(BenchError::Config(
            "a server needs at least one shard".into(),
        ));
    }
    let io = io_memory(cfg.shards)?;
    let (tx, rx) = mpsc::channel::<(SocketAddr, Option<SocketAddr>)>();
    let thread = start(node(cfg, io), cfg.cores.clone(), tx, stop.clone())?;
    let deadline = Instant::now() + START_LIMIT;
    let addr = loop {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok(a) => break Some(a),
            // The node ended before it listened (it failed to start).
            Err(mpsc::RecvTimeoutError::Disconnected) => break None,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if thread.is_finished() || Instant::now() > deadline {
                    break None;
                }
            }
        }
    };
    let Some((addr, metrics)) = addr else {
        let late = !thread.is_finished();
        stop.trigger();
        return Err(match thread.join() {
            Ok(Err(e)) => BenchError::Node(e),
            _ if late => BenchError::Protocol(format!(
                "the server node did not start within {START_LIMIT:?}"
            )),
            Ok(Ok(())) => BenchError::Protocol("the server node stopped before it listened".into()),
            Err(_) => BenchError::Protocol("the server node panicked".into()),
        });
    };
    ready(&Serving {
        addr,
        shards: cfg.shards,
        metrics,
    });
    thread
        .join()
        .map_err(|_| BenchError::Protocol("the server node panicked".into()))?
        .map_err(BenchError::from)
}

/// io memory per node shard, so that `shards` of them fit the memlock limit (at most
/// [`IO_MEMORY`]).
fn io_memory(shards: usize) -> Result<u64, BenchError> {
    ShardsBuilder::new()
        .shard_count(shards)
        .io_memory_for(shardcx_shards::memlock_limit())
        .map(|per| per.min(IO_MEMORY))
        .map_err(|e| BenchError::Config(e.to_string()))
}

/// The server node, with the benchmark handlers.
fn node(cfg: &ServeConfig, io: u64) -> NodeBuilder {
    let mut b = Node::builder()
        .shards(cfg.shards)
        .placement(Placement::Unpinned)
        .psk(&cfg.psk)
        .io_memory(io)
        .net(net_config(cfg.transport))
        .listen(cfg.listen);
    if let Some(tls) = cfg.transport.tls() {
        b = b.transports(tls);
    }
    if cfg.trusted_rma {
        b = b.trusted_rma();
    }
    if let Some(addr) = cfg.metrics {
        b = b.metrics(addr);
    }
    handlers(b)
}

/// The handlers every benchmark server shard serves.
pub(crate) fn handlers(b: NodeBuilder) -> NodeBuilder {
    // Plain RPC handlers: inline on the receiving shard, arguments read in place.
    b.rpc::<RpcEcho, _, _>(|| {
        |_ctx: &RpcContext, args: &rkyv::Archived<Vec<u8>>| Ok(args.as_slice().to_vec())
    })
    .rpc::<RpcSink, _, _>(|| {
        |_ctx: &RpcContext, args: &rkyv::Archived<Vec<u8>>| Ok(args.len() as u64)
    })
    // The echo and the acknowledgement go out inline, on the driver's stack, as
    // ucx_perftest's answers do.
    // Both read the message in place ([`AmView`]): no copy, nothing built per message.
    .on_am_view(ECHO, || {
        |_node: &Node, msg: &AmView<'_>| answer_inline(msg, ECHO_REPLY, true)
    })
    .on_am_view(SINK, || {
        |_node: &Node, msg: &AmView<'_>| {
            if parse_header(msg.header()).is_some_and(|(_, _, flags)| flags & FLAG_ACK != 0) {
                answer_inline(msg, ACK, false);
            }
        }
    })
    .on_am(TAG_START, || {
        |_node: &Node, msg: AmMsg| {
            if let Some((origin, _, _)) = parse_header(msg.header()) {
                let stream = u64::from(origin.get()) & TAG_STREAM;
                glommio::spawn_local(tag_stream(msg.from(), stream)).detach();
            }
        }
    })
    .on_am(REGION, || {
        |node: &Node, msg: AmMsg| {
            let Some((_, size, flags)) = parse_header(msg.header()) else {
                return;
            };
            let answer = if flags & FLAG_TRUSTED != 0 {
                trusted_region_of_at_least(node, size)
            } else {
                region_of_at_least(node, size)
            };
            let payload = match answer {
                Ok(desc) => [&[0u8][..], &desc].concat(),
                Err(why) => [&[1u8][..], why.as_bytes()].concat(),
            };
            reply_later(msg, REGION_REPLY, payload);
        }
    })
}

/// Answers `msg` with active message `id` and its own header (and its payload when `echo`),
/// at once from the handler ([`AmView::reply`]). Only when the reply fails in a way a later
/// send can fix (the rail is not ready on this shard, or another shard holds it) is it sent,
/// copied, from a task with [`Peer::am_send`]; otherwise the client has gone, and nothing is
/// answered.
fn answer_inline(msg: &AmView<'_>, id: AmId, echo: bool) {
    let payload: &[u8] = if echo { msg.payload() } else { &[] };
    if let Err(Error::Net(NetError::NotConnected { .. } | NetError::OtherShard { .. })) =
        msg.reply(id, msg.header(), payload)
    {
        let (from, header, payload) = (msg.from(), msg.header().to_vec(), payload.to_vec());
        glommio::spawn_local(async move {
            let _ = from.am_send(id, &header, &payload).await;
        })
        .detach();
    }
}

/// Answers `msg` with active message `id`: its own header, and `payload`, from a task.
fn reply_later(msg: AmMsg, id: AmId, payload: Vec<u8>) {
    glommio::spawn_local(async move {
        let _ = msg.from().am_send(id, msg.header(), &payload).await;
    })
    .detach();
}

/// The descriptor of this shard's checked-mode region of at least `size` bytes, or why it
/// cannot be made.
fn region_of_at_least(node: &Node, size: u64) -> Result<Vec<u8>, String> {
    let size = fits(size)?;
    REGION_OF_SHARD.with(|r| {
        let mut r = r.borrow_mut();
        if let Some(region) = r.as_ref().filter(|region| region.len() >= size) {
            return Ok(region.descriptor().to_bytes().to_vec());
        }
        r.take();
        let region = node
            .register_region(vec![0; size.max(1)], Permissions::READ_WRITE, None)
            .map_err(|e| format!("cannot register a region of {size} bytes: {e}"))?;
        let d = region.descriptor().to_bytes().to_vec();
        *r = Some(region);
        Ok(d)
    })
}

/// The descriptor of this shard's trusted-mode region of at least `size` bytes, or why it
/// cannot be made (trusted mode off: `shardcx node --trusted-rma`).
fn trusted_region_of_at_least(node: &Node, size: u64) -> Result<Vec<u8>, String> {
    let size = fits(size)?;
    if !node.trusted_rma_enabled() {
        return Err("trusted mode is off on the server (start it with --trusted-rma)".into());
    }
    TRUSTED_OF_SHARD.with(|r| {
        let mut r = r.borrow_mut();
        if let Some(region) = r.as_ref().filter(|region| region.len() >= size) {
            return Ok(region.descriptor().to_bytes());
        }
        // Clients of the old region are the bench's own, which ask before each test: none
        // writes it any more.
        r.take();
        let region = node
            .register_trusted_region(size.max(1), Permissions::READ_WRITE)
            .map_err(|e| format!("cannot map a trusted region of {size} bytes: {e}"))?;
        let d = region.descriptor().to_bytes();
        *r = Some(region);
        Ok(d)
    })
}

/// `size` as a region length, if it is within the message limit.
fn fits(size: u64) -> Result<usize, String> {
    usize::try_from(size)
        .ok()
        .filter(|&s| s as u64 <= super::MAX_MESSAGE)
        .ok_or_else(|| format!("a region of {size} bytes is over the bench's limit"))
}

/// Answers the pings of tag stream `stream` from `client` until its stop (or [`TAG_IDLE`]).
async fn tag_stream(client: Peer, stream: u64) {
    loop {
        match client.tag_recv_within(stream, TAG_STREAM, TAG_IDLE).await {
            Ok((t, data)) if t == TAG_PING | stream => {
                if client.tag_send(TAG_PONG | stream, &data).await.is_err() {
                    return;
                }
            }
            // The stop, a tag that is not ours, a timeout or a failure: the stream ends.
            _ => return,
        }
    }
}

/// Starts `builder` on a thread of its own, shard `j` pinned to `cores[j % len]`; its shard
/// 0 sends the listen address.
fn start(
    builder: NodeBuilder,
    cores: Option<Vec<usize>>,
    tx: mpsc::Sender<(SocketAddr, Option<SocketAddr>)>,
    stop: Shutdown,
) -> Result<JoinHandle<Result<(), Error>>, BenchError> {
    std::thread::Builder::new()
        .name("bench-node".into())
        .spawn(move || {
            builder
                .run(move |node: Node| {
                    let (tx, stop, cores) = (tx.clone(), stop.clone(), cores.clone());
                    async move {
                        if let Some(c) = cores.as_ref().filter(|c| !c.is_empty()) {
                            pin_current(c[node.shard().index() % c.len()]);
                        }
                        if node.shard().index() == 0 {
                            if let Some(a) = node.listen_addr() {
                                let _ = tx.send((a, node.metrics_addr()));
                            }
                        }
                        stop.wait().await;
                        REGION_OF_SHARD.with(|r| r.borrow_mut().take());
                        TRUSTED_OF_SHARD.with(|r| r.borrow_mut().take());
                    }
                })
                .map(|_| ())
        })
        .map_err(|source| BenchError::Io {
            what: "cannot start the server node's thread".into(),
            source,
        })
}
