//! Large RPC payloads, measured both ways: carried in the call by rendezvous, or moved by a
//! checked get/put on a region exchanged in the call. Two nodes (one shard each) in this
//! process, over loopback.
//!
//! ```text
//! cargo run --release --example rpc_large
//! cargo run --release --example rpc_large -- --sizes 64k,1m,4m --iters 200 --tls tcp
//! ```
//!
//! Ways, per size:
//!
//! - `arg`: the data is the call's argument (`Vec<u8>`; over 8 KiB it travels by UCX
//!   rendezvous, pulled by the server's net task into a fresh vector); a plain handler
//!   checksums the archived bytes in place and returns the checksum.
//! - `arg-pool`, `arg-host`: as `arg`, but the server chose the buffer the argument is pulled
//!   into (`Node::rpc_args_buffer`): a block of its shard's registered pool (4 MiB arena; the
//!   largest block is 4 MiB, so larger requests fall back to host memory, and the `in` column
//!   says so), or 64-byte-aligned host memory; the handler reads the archive in place there.
//! - `arg-get`: the client registers a region holding the data (`Node::register_region`,
//!   granted to the server only); the call carries the region's descriptor and the length; an
//!   async handler pulls the data with a checked `get` from the caller and returns its checksum.
//! - `reply`: the server returns the data as the reply (`Vec<u8>`, rendezvous); the client
//!   reads the archived reply in place (`call_archived`).
//! - `reply-put`: the client registers a writable region and sends its descriptor; the server
//!   puts the data into it with a checked `put` and returns the checksum.
//!
//! Every call is checked: the checksum the server returns (or the data the client received)
//! must match what was sent; the data changes at every call. Timed: the call, from the client's
//! side, including the server's checksum (`arg`, `arg-get`); the client's own checks of
//! received data (`reply`, `reply-put`) are outside the timing. The `checksum` row is the cost
//! of the checksum alone on this machine, for reference. Calls go one at a time; `MB/s` is
//! bytes over the sum of the call times (1 MB = 10^6 bytes).
//!
//! Options: `--sizes LIST` (default `64k,1m,4m`; suffixes k, m; each at most 15 MiB),
//! `--iters N` timed calls per size and way (default 200, after 10 untimed ones), `--secs S`
//! at most this long per size and way (default 10), `--tls LIST` UCX transports (default
//! `tcp`; connecting needs tcp in UCX 1.12).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use hdrhistogram::Histogram;
use shardcx::bench::format_size;
use shardcx::rma::{Permissions, RemoteRegion};
use shardcx::rpc::{ArgsLocation, RndvBuf, Rpc, RpcContext};
use shardcx::shards::ucx::AlignedBuf;
use shardcx::shards::Placement;
use shardcx::{rpc_function, Node, NodeBuilder, NodeId, Peer};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"rpc_large example pre-shared key";
const SERVER: NodeId = NodeId::new(2);
const CLIENT: NodeId = NodeId::new(1);
/// Untimed calls before each measurement.
const WARMUP: u32 = 10;
/// Largest size accepted (under the net layer's 16 MiB message limit, with room for the
/// envelope).
const MAX_SIZE: usize = 15 << 20;

/// A region descriptor ([`RemoteRegion::to_bytes`]) and a length.
#[derive(Debug, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct RegionRef {
    /// The descriptor's bytes.
    pub desc: Vec<u8>,
    /// Bytes to move.
    pub len: u64,
}

rpc_function!(
    /// Checksums its argument.
    pub SumArg: Vec<u8> => u64, id = 1, name = "large.sum_arg");
rpc_function!(
    /// Checksums its argument, received by rendezvous into the server's pool (or aligned host
    /// memory when no pool block is large enough); returns where it landed too.
    pub SumArgPool: Vec<u8> => (u64, u8), id = 5, name = "large.sum_arg_pool");
rpc_function!(
    /// Checksums its argument, received by rendezvous into aligned host memory.
    pub SumArgHost: Vec<u8> => (u64, u8), id = 6, name = "large.sum_arg_host");
rpc_function!(
    /// Gets the caller's region and checksums it.
    pub SumRegion: RegionRef => u64, id = 2, name = "large.sum_region");
rpc_function!(
    /// Returns `len` bytes of the server's data (its first 8 bytes replaced by `seed`).
    pub Fetch: (u64, u64) => Vec<u8>, id = 3, name = "large.fetch");
rpc_function!(
    /// Puts the server's data into the caller's region; returns its checksum.
    pub PutRegion: RegionRef => u64, id = 4, name = "large.put_region");

struct Opts {
    sizes: Vec<usize>,
    iters: u32,
    secs: Duration,
    tls: String,
}

/// Large RPC arguments and replies: in the call, into a buffer the server chose, by get, by put.
#[derive(clap::Parser)]
#[command(name = "rpc_large")]
struct Args {
    /// Sizes, 8 B to 15 MiB, e.g. 64k,1m,4m.
    #[arg(long, value_name = "LIST", value_delimiter = ',', default_value = "64k,1m,4m",
          value_parser = cli::size)]
    sizes: Vec<usize>,
    /// Calls per size and way (at most).
    #[arg(long, value_name = "N", default_value_t = 200)]
    iters: u32,
    /// Seconds per size and way (at most).
    #[arg(long, value_name = "S", default_value = "10", value_parser = cli::seconds)]
    secs: Duration,
    /// UCX transports.
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    tls: String,
}

fn opts() -> Opts {
    let a = <Args as clap::Parser>::parse();
    if a.sizes.iter().any(|s| !(8..=MAX_SIZE).contains(s)) || a.iters == 0 {
        <Args as clap::CommandFactory>::command()
            .error(
                clap::error::ErrorKind::ValueValidation,
                "sizes must be within 8 B..=15 MiB, --iters at least 1",
            )
            .exit();
    }
    Opts {
        sizes: a.sizes,
        iters: a.iters,
        secs: a.secs,
        tls: a.tls,
    }
}

/// A checksum fast enough not to hide the transfer (8 bytes a step; tail bytes one by one).
fn checksum(bytes: &[u8]) -> u64 {
    let mut chunks = bytes.chunks_exact(8);
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    for c in &mut chunks {
        let w = u64::from_le_bytes(c.try_into().unwrap());
        h = (h.rotate_left(5) ^ w).wrapping_mul(0x100_0000_01b3);
    }
    for &b in chunks.remainder() {
        h = (h.rotate_left(5) ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
    }
    h
}

/// Data of `len` bytes, a pattern.
fn pattern(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8).collect()
}

fn node(o: &Opts, id: NodeId) -> NodeBuilder {
    Node::builder()
        .shards(1)
        .placement(Placement::Unpinned)
        .transports(&o.tls)
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
        .default_deadline(Duration::from_secs(10))
        .with_shards(|s| s.arena_len(4 << 20))
}

thread_local! {
    /// The server's data (the largest size).
    static DATA: RefCell<Rc<Vec<u8>>> = RefCell::new(Rc::new(Vec::new()));
}

fn server_data() -> Rc<Vec<u8>> {
    DATA.with(|d| d.borrow().clone())
}

/// Where arguments landed, as a number for the reply ([`LOCATIONS`] names them).
fn location(l: ArgsLocation) -> u8 {
    match l {
        ArgsLocation::Inline => 0,
        ArgsLocation::Vec => 1,
        ArgsLocation::Pool => 2,
        ArgsLocation::Host => 3,
        _ => 4,
    }
}

/// Names of [`location`]'s numbers.
const LOCATIONS: [&str; 5] = ["frame", "vec", "pool", "host", "?"];

/// Aligned host memory for `len` bytes.
fn host(len: usize) -> Option<RndvBuf> {
    AlignedBuf::zeroed(len, 64).ok().map(RndvBuf::Host)
}

/// The server's choosers, on each shard.
fn choosers(node: &Node) {
    node.rpc_args_buffer::<SumArgPool>(|node: &Node, _: Peer, len: usize| {
        match node.shard_ctx().pool().alloc(len) {
            Some(b) => Some(RndvBuf::Pool(b)),
            None => host(len),
        }
    });
    node.rpc_args_buffer::<SumArgHost>(|_: &Node, _: Peer, len: usize| host(len));
}

fn region_of(r: &RegionRef) -> Result<RemoteRegion, String> {
    RemoteRegion::from_bytes(&r.desc).map_err(|e| format!("bad descriptor: {e}"))
}

fn server(o: &Opts) -> NodeBuilder {
    node(o, SERVER)
        .rpc::<SumArg, _, _>(|| {
            |_: &RpcContext, v: &rkyv::Archived<Vec<u8>>| Ok(checksum(v.as_slice()))
        })
        .rpc::<SumArgPool, _, _>(|| {
            |ctx: &RpcContext, v: &rkyv::Archived<Vec<u8>>| {
                Ok((checksum(v.as_slice()), location(ctx.args_location())))
            }
        })
        .rpc::<SumArgHost, _, _>(|| {
            |ctx: &RpcContext, v: &rkyv::Archived<Vec<u8>>| {
                Ok((checksum(v.as_slice()), location(ctx.args_location())))
            }
        })
        .rpc_async::<SumRegion, _, _, _>(|| {
            |ctx: RpcContext, r: RegionRef| async move {
                let region = region_of(&r)?;
                let data = ctx
                    .caller()
                    .get(&region, 0, r.len)
                    .await
                    .map_err(|e| format!("get: {e}"))?;
                Ok(checksum(&data))
            }
        })
        .rpc::<Fetch, _, _>(|| {
            |_: &RpcContext, a: &rkyv::Archived<(u64, u64)>| {
                let (len, seed) = (a.0.to_native(), a.1.to_native());
                let data = server_data();
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| (8..=data.len()).contains(&l))
                    .ok_or_else(|| format!("length {len} out of range"))?;
                let mut out = data[..len].to_vec();
                out[..8].copy_from_slice(&seed.to_le_bytes());
                Ok(out)
            }
        })
        .rpc_async::<PutRegion, _, _, _>(|| {
            |ctx: RpcContext, r: RegionRef| async move {
                let region = region_of(&r)?;
                let data = server_data();
                let len = usize::try_from(r.len)
                    .ok()
                    .filter(|&l| l <= data.len())
                    .ok_or_else(|| format!("length {} out of range", r.len))?;
                ctx.caller()
                    .put(&region, 0, &data[..len])
                    .await
                    .map_err(|e| format!("put: {e}"))?;
                Ok(checksum(&data[..len]))
            }
        })
}

/// One measured size and way.
struct Row {
    way: &'static str,
    size: usize,
    /// Where the server received the data (the last call's answer), when it says.
    at: Option<u8>,
    hist: Histogram<u64>,
    total: Duration,
}

fn hist() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 60_000_000_000, 3).unwrap()
}

/// Runs `call` (which returns its own timed duration) up to `iters` times after a warm-up,
/// for at most `secs`.
async fn measure<F, Fut>(o: &Opts, way: &'static str, size: usize, mut call: F) -> Row
where
    F: FnMut(u64) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    for i in 0..WARMUP {
        call(u64::from(i) + 1).await;
    }
    let (mut h, mut total) = (hist(), Duration::ZERO);
    let start = Instant::now();
    for i in 0..o.iters {
        let t = call(u64::from(i + WARMUP) + 1).await;
        h.record(t.as_nanos() as u64).unwrap();
        total += t;
        if start.elapsed() > o.secs {
            break;
        }
    }
    Row {
        way,
        size,
        at: None,
        hist: h,
        total,
    }
}

/// Marks `data` with `seed` (its first 8 bytes).
fn mark(data: &mut [u8], seed: u64) {
    data[..8].copy_from_slice(&seed.to_le_bytes());
}

async fn client_body(o: &Opts, node: Node, peer: Peer) -> Vec<Row> {
    let rpc = Rpc::current().expect("on a shard");
    let mut rows = Vec::new();
    for &size in &o.sizes {
        // The checksum alone.
        let mut data = pattern(size);
        rows.push(
            measure(o, "checksum", size, |seed| {
                mark(&mut data, seed);
                let t0 = Instant::now();
                std::hint::black_box(checksum(std::hint::black_box(&data)));
                std::future::ready(t0.elapsed())
            })
            .await,
        );

        // arg: the data in the call.
        let data = RefCell::new(pattern(size));
        rows.push(
            measure(o, "arg", size, |seed| {
                let (rpc, data) = (&rpc, &data);
                async move {
                    mark(&mut data.borrow_mut(), seed);
                    let want = checksum(&data.borrow());
                    let args = data.borrow().clone();
                    let t0 = Instant::now();
                    let got = rpc.call::<SumArg>(peer, &args).await.expect("SumArg");
                    let t = t0.elapsed();
                    assert_eq!(got, want, "SumArg checksum");
                    t
                }
            })
            .await,
        );

        // arg-pool, arg-host: the data in the call, into the buffer the server chose.
        for way in ["arg-pool", "arg-host"] {
            let at = std::cell::Cell::new(None);
            let mut row = measure(o, way, size, |seed| {
                let (rpc, data, at) = (&rpc, &data, &at);
                async move {
                    mark(&mut data.borrow_mut(), seed);
                    let want = checksum(&data.borrow());
                    let args = data.borrow().clone();
                    let t0 = Instant::now();
                    let (got, where_) = if way == "arg-pool" {
                        rpc.call::<SumArgPool>(peer, &args).await
                    } else {
                        rpc.call::<SumArgHost>(peer, &args).await
                    }
                    .expect(way);
                    let t = t0.elapsed();
                    assert_eq!(got, want, "{way} checksum");
                    at.set(Some(where_));
                    t
                }
            })
            .await;
            row.at = at.get();
            rows.push(row);
        }

        // arg-get: the data in a region of the client, pulled by the server.
        let region = node
            .register_region(pattern(size), Permissions::READ, Some(peer))
            .expect("register region");
        let args = RegionRef {
            desc: region.descriptor().to_bytes().to_vec(),
            len: size as u64,
        };
        rows.push(
            measure(o, "arg-get", size, |seed| {
                let (rpc, region, args) = (&rpc, &region, &args);
                async move {
                    let want = region
                        .write(|m| {
                            mark(m, seed);
                            checksum(m)
                        })
                        .expect("write region");
                    let t0 = Instant::now();
                    let got = rpc.call::<SumRegion>(peer, args).await.expect("SumRegion");
                    let t = t0.elapsed();
                    assert_eq!(got, want, "SumRegion checksum");
                    t
                }
            })
            .await,
        );
        drop(region);

        // reply: the data as the reply.
        let mut expected = pattern(size);
        rows.push(
            measure(o, "reply", size, |seed| {
                let rpc = &rpc;
                mark(&mut expected, seed);
                let want = checksum(&expected);
                async move {
                    let t0 = Instant::now();
                    let got = rpc
                        .call_archived::<Fetch>(peer, &(size as u64, seed))
                        .await
                        .expect("Fetch");
                    let t = t0.elapsed();
                    assert_eq!(got.get().len(), size, "Fetch length");
                    assert_eq!(checksum(got.get().as_slice()), want, "Fetch data");
                    t
                }
            })
            .await,
        );

        // reply-put: the server puts the data into a region of the client.
        let region = node
            .register_region(vec![0; size], Permissions::WRITE, Some(peer))
            .expect("register region");
        let args = RegionRef {
            desc: region.descriptor().to_bytes().to_vec(),
            len: size as u64,
        };
        let want = checksum(&pattern(size));
        rows.push(
            measure(o, "reply-put", size, |_| {
                let (rpc, region, args) = (&rpc, &region, &args);
                async move {
                    // Cleared first, so that a put that did not happen fails the check.
                    region.write(|m| m.fill(0)).expect("clear region");
                    let t0 = Instant::now();
                    let got = rpc.call::<PutRegion>(peer, args).await.expect("PutRegion");
                    let t = t0.elapsed();
                    assert_eq!(got, want, "PutRegion checksum");
                    let here = region.read(checksum).expect("read region");
                    assert_eq!(here, want, "PutRegion data");
                    t
                }
            })
            .await,
        );
    }
    rows
}

fn main() {
    let o = opts();
    let largest = o.sizes.iter().copied().max().unwrap_or(0);
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let server_node = server(&o);
    let stop = server_node.shutdown_handle();
    let rows = std::thread::scope(|s| {
        let addr_s = addr.clone();
        s.spawn(move || {
            server_node
                .listen("127.0.0.1:0".parse().unwrap())
                .run(move |node: Node| {
                    let addr = addr_s.clone();
                    async move {
                        choosers(&node);
                        DATA.with(|d| *d.borrow_mut() = Rc::new(pattern(largest)));
                        let _ = addr.set(node.listen_addr().unwrap());
                        node.stopped().await;
                    }
                })
                .expect("server node");
        });
        let shared = Arc::new(o);
        let rows = node(&shared, CLIENT)
            .run(move |node: Node| {
                let (addr, o) = (addr.clone(), shared.clone());
                async move {
                    let t0 = Instant::now();
                    while addr.get().is_none() {
                        assert!(t0.elapsed() < Duration::from_secs(30), "no server");
                        sleep(Duration::from_millis(1)).await;
                    }
                    let peer = node.connect(*addr.get().unwrap()).await.expect("connect");
                    client_body(&o, node, peer).await
                }
            })
            .expect("client node");
        stop.trigger();
        rows
    });
    println!(
        "{:<10} {:>6} {:>6} {:>10} {:>10} {:>10} {:>6}",
        "way", "size", "calls", "p50 us", "p99 us", "MB/s", "in"
    );
    for r in rows.into_iter().flatten() {
        let us = |q: f64| r.hist.value_at_quantile(q) as f64 / 1000.0;
        let mbps = (r.size as f64 * r.hist.len() as f64) / r.total.as_secs_f64().max(1e-9) / 1e6;
        let at = r.at.map_or("", |a| LOCATIONS[usize::from(a).min(4)]);
        println!(
            "{:<10} {:>6} {:>6} {:>10.1} {:>10.1} {:>10.0} {:>6}",
            r.way,
            format_size(r.size),
            r.hist.len(),
            us(0.5),
            us(0.99),
            mbps,
            at
        );
    }
}
