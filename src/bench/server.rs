//! The serving side of a benchmark: a main node and its bench peers (see [`crate::bench`]).
//!
//! [`serve`] starts the `K` bench peers first (1-shard nodes on ports of their own, ids from
//! [`super::peer_ids`], peer `j` pinned to the `j`-th server CPU), then the main node at the
//! listen address, which knows their addresses and answers [`super::PEERS`]. Every node has the
//! same handlers: echo ([`super::ECHO`]), sink with acknowledgements ([`super::SINK`]), tag
//! ping-pong streams ([`super::TAG_START`]), one remote-memory region per shard
//! ([`super::REGION`]), and the plain RPC handlers of [`super::RpcEcho`] (the argument's bytes
//! back) and [`super::RpcSink`] (the argument's length). Everything runs until the [`Shutdown`] switch is triggered; then each
//! node drains and closes as any node does (see [`crate::shutdown`]).

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use shardcx_shards::proto::NodeId;
use shardcx_shards::{Placement, ShardsBuilder};

use super::{
    net_config, parse_header, peer_ids, pin_current, BenchError, RpcEcho, RpcSink, Transport, ACK,
    ECHO, ECHO_REPLY, FLAG_ACK, PEERS, PEERS_REPLY, REGION, REGION_REPLY, SINK, TAG_START,
};
use crate::rma::Permissions;
use crate::rpc::RpcContext;
use crate::{AmMsg, Error, Node, NodeBuilder, Peer, Region, Shutdown};

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
/// How long [`serve`] waits for its nodes to start.
const START_LIMIT: Duration = Duration::from_secs(30);
/// io memory per node shard when the memlock limit allows it.
const IO_MEMORY: u64 = 1 << 20;

/// Settings of [`serve`].
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The main node's listen address (port 0 picks one).
    pub listen: SocketAddr,
    /// Shards of the main node.
    pub shards: usize,
    /// Bench peers (1-shard nodes) beside it.
    pub peers: usize,
    /// UCX transports of every node.
    pub transport: Transport,
    /// The pre-shared key (16 bytes at least).
    pub psk: Vec<u8>,
    /// CPUs for the bench peers (peer `j` on `cores[j % len]`); `None` leaves them unpinned.
    pub cores: Option<Vec<usize>>,
}

/// Where a started server listens.
#[derive(Debug, Clone)]
pub struct Serving {
    /// The main node.
    pub addr: SocketAddr,
    /// The bench peers, in order.
    pub peers: Vec<(NodeId, SocketAddr)>,
}

thread_local! {
    /// This shard's region for put/get tests (grown on request, never shrunk).
    static REGION_OF_SHARD: RefCell<Option<Region>> = const { RefCell::new(None) };
}

/// Runs the benchmark server until `stop` is triggered: calls `ready` once every node
/// listens, then returns when every node has shut down.
pub fn serve(
    cfg: &ServeConfig,
    stop: &Shutdown,
    ready: impl FnOnce(&Serving),
) -> Result<(), BenchError> {
    if cfg.shards == 0 || cfg.peers == 0 {
        return Err(BenchError::Config(
            "a server needs at least one shard and one bench peer".into(),
        ));
    }
    let io = io_memory(cfg.shards + cfg.peers)?;
    let ids = peer_ids(cfg.peers)?;
    let mut threads: Vec<JoinHandle<Result<(), Error>>> = Vec::new();
    let (tx, rx) = mpsc::channel::<(usize, SocketAddr)>();
    let peer_listen = SocketAddr::new(cfg.listen.ip(), 0);
    for (j, id) in ids.iter().enumerate() {
        let cpu = cfg
            .cores
            .as_ref()
            .and_then(|c| c.get(j % c.len().max(1)).copied());
        let builder = node(cfg, 1, io).node_id(*id).listen(peer_listen);
        threads.push(start(builder, j, cpu, tx.clone(), stop.clone())?);
    }
    let peers = match collect(&rx, cfg.peers, &threads) {
        Ok(addrs) => ids.into_iter().zip(addrs).collect::<Vec<_>>(),
        Err(e) => return Err(abort(stop, threads, e)),
    };
    let list = Arc::new(encode_peers(&peers));
    let builder = node(cfg, cfg.shards, io)
        .listen(cfg.listen)
        .on_am(PEERS, move || {
            let list = list.clone();
            move |_node: &Node, msg: AmMsg| reply(msg, PEERS_REPLY, list.to_vec())
        });
    threads.push(start(builder, 0, None, tx, stop.clone())?);
    let addr = match collect(&rx, 1, &threads) {
        Ok(a) => a[0],
        Err(e) => return Err(abort(stop, threads, e)),
    };
    ready(&Serving { addr, peers });
    let mut first = None;
    for t in threads {
        let r = t
            .join()
            .map_err(|_| BenchError::Protocol("a server node panicked".into()))
            .and_then(|r| r.map_err(BenchError::from));
        if let (Err(e), None) = (r, &first) {
            first = Some(e);
        }
    }
    first.map_or(Ok(()), Err)
}

/// io memory per node shard, so that `shards` of them fit the memlock limit (at most
/// [`IO_MEMORY`]).
fn io_memory(shards: usize) -> Result<u64, BenchError> {
    ShardsBuilder::new()
        .shard_count(shards)
        .io_memory_for(shardcx_shards::memlock_limit())
        .map(|per| per.min(IO_MEMORY))
        .map_err(|e| {
            BenchError::Config(format!(
                "{e}; a server's shards are its main node's plus one per bench peer"
            ))
        })
}

/// A node with the benchmark handlers.
fn node(cfg: &ServeConfig, shards: usize, io: u64) -> NodeBuilder {
    let mut b = Node::builder()
        .shards(shards)
        .placement(Placement::Unpinned)
        .psk(&cfg.psk)
        .io_memory(io)
        .net(net_config(cfg.transport));
    if let Some(tls) = cfg.transport.tls() {
        b = b.transports(tls);
    }
    handlers(b)
}

/// The handlers every benchmark node serves.
pub(crate) fn handlers(b: NodeBuilder) -> NodeBuilder {
    // Plain RPC handlers: inline on the receiving shard, arguments read in place.
    b.rpc::<RpcEcho, _, _>(|| {
        |_ctx: &RpcContext, args: &rkyv::Archived<Vec<u8>>| Ok(args.as_slice().to_vec())
    })
    .rpc::<RpcSink, _, _>(|| {
        |_ctx: &RpcContext, args: &rkyv::Archived<Vec<u8>>| Ok(args.len() as u64)
    })
    .on_am(ECHO, || {
        |_node: &Node, msg: AmMsg| {
            glommio::spawn_local(async move {
                // A client that has gone away: nothing to answer.
                let _ = msg
                    .from()
                    .am_send(ECHO_REPLY, msg.header(), msg.payload())
                    .await;
            })
            .detach();
        }
    })
    .on_am(SINK, || {
        |_node: &Node, msg: AmMsg| {
            if parse_header(msg.header()).is_some_and(|(_, _, flags)| flags & FLAG_ACK != 0) {
                reply(msg, ACK, Vec::new());
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
            let Some((_, size, _)) = parse_header(msg.header()) else {
                return;
            };
            let desc = region_of_at_least(node, size);
            reply(
                msg,
                REGION_REPLY,
                desc.map(|d| d.to_bytes().to_vec()).unwrap_or_default(),
            );
        }
    })
}

/// Answers `msg` with active message `id`: its own header, and `payload`.
fn reply(msg: AmMsg, id: crate::AmId, payload: Vec<u8>) {
    glommio::spawn_local(async move {
        let _ = msg.from().am_send(id, msg.header(), &payload).await;
    })
    .detach();
}

/// This shard's region, at least `size` bytes (an empty answer when it cannot be made).
fn region_of_at_least(node: &Node, size: u64) -> Option<crate::RemoteRegion> {
    let size = usize::try_from(size)
        .ok()
        .filter(|&s| s as u64 <= super::MAX_MESSAGE)?;
    REGION_OF_SHARD.with(|r| {
        let mut r = r.borrow_mut();
        if let Some(region) = r.as_ref().filter(|region| region.len() >= size) {
            return Some(region.descriptor());
        }
        r.take();
        let region = node
            .register_region(vec![0; size.max(1)], Permissions::READ_WRITE, None)
            .ok()?;
        let d = region.descriptor();
        *r = Some(region);
        Some(d)
    })
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

/// Starts `builder` on a thread of its own; its shard 0 sends `(index, listen address)`.
fn start(
    builder: NodeBuilder,
    index: usize,
    cpu: Option<usize>,
    tx: mpsc::Sender<(usize, SocketAddr)>,
    stop: Shutdown,
) -> Result<JoinHandle<Result<(), Error>>, BenchError> {
    std::thread::Builder::new()
        .name(format!("bench-node-{index}"))
        .spawn(move || {
            builder
                .run(move |node: Node| {
                    let (tx, stop) = (tx.clone(), stop.clone());
                    async move {
                        if let Some(cpu) = cpu {
                            pin_current(cpu);
                        }
                        if node.shard().index() == 0 {
                            if let Some(a) = node.listen_addr() {
                                let _ = tx.send((index, a));
                            }
                        }
                        stop.wait().await;
                        REGION_OF_SHARD.with(|r| r.borrow_mut().take());
                    }
                })
                .map(|_| ())
        })
        .map_err(|source| BenchError::Io {
            what: "cannot start a node thread".into(),
            source,
        })
}

/// The listen addresses of `n` nodes, in index order, or why they did not all start.
fn collect(
    rx: &mpsc::Receiver<(usize, SocketAddr)>,
    n: usize,
    threads: &[JoinHandle<Result<(), Error>>],
) -> Result<Vec<SocketAddr>, BenchError> {
    let mut addrs = vec![None; n];
    let deadline = std::time::Instant::now() + START_LIMIT;
    while addrs.iter().any(Option::is_none) {
        match rx.recv_timeout(Duration::from_millis(50)) {
            Ok((i, a)) => {
                if let Some(slot) = addrs.get_mut(i) {
                    *slot = Some(a);
                }
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if threads.iter().any(JoinHandle::is_finished) {
                    return Err(BenchError::Protocol("a server node failed to start".into()));
                }
                if std::time::Instant::now() > deadline {
                    return Err(BenchError::Protocol(format!(
                        "server nodes did not start within {START_LIMIT:?}"
                    )));
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(BenchError::Protocol("a server node failed to start".into()));
            }
        }
    }
    Ok(addrs.into_iter().flatten().collect())
}

/// Stops the nodes started so far and returns the most telling error: a node's own, if one
/// failed, else `e`.
fn abort(
    stop: &Shutdown,
    threads: Vec<JoinHandle<Result<(), Error>>>,
    e: BenchError,
) -> BenchError {
    stop.trigger();
    let mut found = None;
    for t in threads {
        if let Ok(Err(err)) = t.join() {
            found.get_or_insert(BenchError::Node(err));
        }
    }
    found.unwrap_or(e)
}

/// The payload of [`PEERS_REPLY`]: count (u16), then per peer its id (u64) and its address
/// (u8 length, UTF-8), little-endian.
fn encode_peers(peers: &[(NodeId, SocketAddr)]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&(peers.len().min(usize::from(u16::MAX)) as u16).to_le_bytes());
    for (id, addr) in peers.iter().take(usize::from(u16::MAX)) {
        let a = addr.to_string();
        out.extend_from_slice(&id.get().to_le_bytes());
        // A socket address is at most 47 characters.
        out.push(a.len().min(255) as u8);
        out.extend_from_slice(&a.as_bytes()[..a.len().min(255)]);
    }
    out
}

/// Reads a [`PEERS_REPLY`] payload.
pub(crate) fn decode_peers(b: &[u8]) -> Option<Vec<(NodeId, SocketAddr)>> {
    let n = u16::from_le_bytes(b.get(..2)?.try_into().ok()?);
    let mut at = 2;
    let mut out = Vec::new();
    for _ in 0..n {
        let id = u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?);
        let len = usize::from(*b.get(at + 8)?);
        let s = std::str::from_utf8(b.get(at + 9..at + 9 + len)?).ok()?;
        out.push((NodeId::new(id), s.parse().ok()?));
        at += 9 + len;
    }
    (at == b.len()).then_some(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn peer_lists_round_trip_and_refuse_junk() {
        let peers = vec![
            (NodeId::new(1), "127.0.0.1:4000".parse().unwrap()),
            (NodeId::new(u64::MAX), "[::1]:65535".parse().unwrap()),
        ];
        let b = encode_peers(&peers);
        assert_eq!(decode_peers(&b).unwrap(), peers);
        for cut in 0..b.len() {
            assert!(decode_peers(&b[..cut]).is_none(), "cut {cut}");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(decode_peers(&long).is_none());
    }
}
