//! A small sharded key-value service over typed RPC: `kv.put`, `kv.get` and `kv.scan`,
//! declared with `rpc_function!`, their arguments and replies rkyv archives.
//!
//! ```text
//! cargo run --release --example rpc_kv                                 # server and client here
//! cargo run --release --example rpc_kv -- --listen 127.0.0.1:13340     # server, until Ctrl-C
//! cargo run --release --example rpc_kv -- --connect 127.0.0.1:13340    # client workload
//! ```
//!
//! Options: `--shards N` server shards (default 2), `--keys N` keys of the workload (default
//! 10000), `--tls LIST` UCX transports (default `tcp`: listening and connecting need tcp in
//! UCX 1.12), `--spin-us N` the shards' spin window before they sleep (`DriverConfig::spin`;
//! default the runtime's, 1 ms). The key is fixed: it is an example.
//!
//! ## Where a key lives
//!
//! Each key has a *home shard* on the server, `fnv1a(key) % shards`, and the **client** routes
//! every call to it: connections are shard-addressed rails, and `peer.shard(home)` reaches the
//! server's shard `home` directly, with no cross-shard hop on the server (as a shard-aware
//! driver does). The client learns the server's shard count once, from the built-in
//! `shardcx.describe` function ([`shardcx::rpc::Describe`]). Each server shard serves only its
//! own keys, from a `BTreeMap` of its own kept in the shard's extension slot
//! (`ShardCtx::ext_or_insert_with`: nothing shared, nothing locked, nothing forwarded). A call
//! for a key whose home is another shard is a routing bug: it is refused with an error naming
//! the key's home (`misrouted: ...`) and counted, and the server prints its count when it
//! stops. The client sends one such call on purpose and checks the refusal; run here, with
//! the server in this process, the example fails if the server counted any other.
//!
//! A scan asks every shard directly (one call per shard, all in flight at once) for its first
//! `limit` keys with the prefix; the client merges them in key order and keeps the first
//! `limit`.
//!
//! ## Figures on a small machine
//!
//! Run here, the example has three shard threads (two server shards, one client shard). A
//! shard keeps polling for its spin window after its last message, and with keys spread over
//! both server shards both keep polling; on a machine with fewer cores than that (the 2-core
//! VM this was written on), a call then often waits for another shard's window to end before
//! its shard gets a core, and the gets' latency is about the spin window (1 ms) instead of
//! tens of microseconds. It does not arise with `--spin-us 0` (shards sleep at once, and each
//! call pays for waking its shard: about 0.1 ms there), with `--shards 1`, or where every
//! shard has a core of its own.
//!
//! ## The client's workload
//!
//! It prints the server's functions (`Rpc::discover`) and checks that `kv.get` found by name
//! (`Rpc::lookup`) has the schema this build has; asks the server's shard count
//! (`shardcx.describe`); puts `--keys` keys (32 calls in flight),
//! gets each back one call at a time (latency percentiles, calls/s) and checks its value; gets
//! missing keys, overwrites one, runs scans checked against a local model, checks that an
//! over-large scan is refused with the server's error and (with several server shards) that a
//! misrouted get is refused. It exits 0 only if every check passed,
//! and fails with a message on the first call that errors or on [`WORKLOAD_LIMIT`].

#![allow(clippy::unwrap_used, clippy::expect_used)] // An example may panic on its own set-up.

use std::cell::{Cell, OnceCell, RefCell};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardcx::rpc::{Describe, RpcContext, RpcError, RpcFunction};
use shardcx::shards::DriverConfig;
use shardcx::{rpc_function, Node, NodeBuilder, Peer, Rpc, ShardId};

#[path = "common/cli.rs"]
mod cli;

const PSK: &[u8] = b"rpc_kv example pre-shared key";
/// Deadline of every call.
const CALL_TIMEOUT: Duration = Duration::from_secs(5);
/// The whole client workload must finish within this.
const WORKLOAD_LIMIT: Duration = Duration::from_secs(120);
/// Largest `limit` of a scan.
const MAX_SCAN: u32 = 10_000;
/// Puts in flight during the put phase.
const PUT_WINDOW: usize = 32;

/// Arguments of `kv.put`.
#[derive(Debug, Clone, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct PutArgs {
    /// The key.
    pub key: String,
    /// Its new value.
    pub value: Vec<u8>,
}

/// Arguments of `kv.scan`.
#[derive(Debug, Clone, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct ScanArgs {
    /// Keys that start with this.
    pub prefix: String,
    /// At most this many entries (at most [`MAX_SCAN`]).
    pub limit: u32,
}

rpc_function!(
    /// Stores a value; answers whether the key had one already.
    pub Put: PutArgs => bool, id = 1, name = "kv.put"
);
rpc_function!(
    /// The value of a key, if any.
    pub Get: String => Option<Vec<u8>>, id = 2, name = "kv.get", idempotent = true
);
rpc_function!(
    /// The first `limit` entries of the called shard whose key starts with `prefix`, in key
    /// order.
    pub Scan: ScanArgs => Vec<(String, Vec<u8>)>, id = 3, name = "kv.scan", idempotent = true
);

/// One server shard's part of the store, in the shard's extension slot.
#[derive(Default)]
struct Store {
    /// The keys whose home is this shard.
    keys: RefCell<BTreeMap<String, Vec<u8>>>,
    /// Calls refused because their key's home is another shard.
    misrouted: Cell<u64>,
}

/// A key's home shard: 64-bit FNV-1a of its bytes, modulo the shard count (stable across
/// runs, unlike std's randomly keyed hasher).
fn home(key: &str, shards: usize) -> ShardId {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    // Shard counts fit u16.
    ShardId::new((h % shards.max(1) as u64) as u16)
}

/// A handler's handle on its shard's store: looked up in the shard's extension slot on the
/// handler's first call, kept from then on (no look-up per call).
#[derive(Default)]
struct StoreHandle(OnceCell<Rc<Store>>);

/// This shard's store (made on first use).
fn store(node: &Node) -> Rc<Store> {
    node.shard_ctx().ext_or_insert_with(Store::default)
}

impl StoreHandle {
    fn get(&self, node: &Node) -> &Store {
        self.0.get_or_init(|| store(node))
    }
}

/// `Ok` when `key`'s home is this shard; else the refusal, counted.
fn check_home(node: &Node, store: &Store, key: &str) -> Result<(), String> {
    let (here, shards) = (node.shard(), node.shard_count());
    let at = home(key, shards);
    if at == here {
        return Ok(());
    }
    store.misrouted.set(store.misrouted.get() + 1);
    Err(format!(
        "misrouted: key {key:?} lives on shard {at} of {shards}, not on shard {here}"
    ))
}

/// The first `limit` entries of this shard with `prefix`.
fn scan_here(store: &Store, prefix: &str, limit: usize) -> Vec<(String, Vec<u8>)> {
    store
        .keys
        .borrow()
        .range(prefix.to_owned()..)
        .take_while(|(k, _)| k.starts_with(prefix))
        .take(limit)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect()
}

/// What both nodes are built with (from the options).
struct Setup {
    /// UCX transports.
    tls: String,
    /// The drivers' spin window (`None`: the runtime's default).
    spin: Option<Duration>,
}

/// A node builder with this example's settings: `shards` shards, 1 MiB of io memory each (two
/// nodes may share this process and the 8 MiB memlock limit).
fn builder(shards: usize, setup: &Setup) -> NodeBuilder {
    let spin = setup.spin;
    Node::builder()
        .shards(shards)
        .placement(shardcx::shards::Placement::Unpinned)
        .transports(&setup.tls)
        .psk(PSK)
        .io_memory(1 << 20)
        .default_deadline(CALL_TIMEOUT)
        .with_shards(|b| match spin {
            Some(spin) => b.driver(DriverConfig { spin }),
            None => b,
        })
}

/// The server: the three functions, on every shard, each serving this shard's keys only.
/// Plain handlers: with nothing to forward, a call runs inline on the shard it reached, its
/// arguments read in place, and is answered there (no task, no copy of the arguments).
fn server(shards: usize, setup: &Setup, listen: SocketAddr) -> NodeBuilder {
    builder(shards, setup)
        .listen(listen)
        .rpc::<Put, _, _>(|| {
            let store = StoreHandle::default();
            move |ctx: &RpcContext, args: &ArchivedPutArgs| {
                let store = store.get(ctx.node());
                let key = args.key.as_str();
                check_home(ctx.node(), store, key)?;
                let value = args.value.to_vec();
                let existed = store.keys.borrow_mut().insert(key.to_owned(), value);
                Ok(existed.is_some())
            }
        })
        .rpc::<Get, _, _>(|| {
            let store = StoreHandle::default();
            move |ctx: &RpcContext, key: &rkyv::Archived<String>| {
                let store = store.get(ctx.node());
                check_home(ctx.node(), store, key.as_str())?;
                let value = store.keys.borrow().get(key.as_str()).cloned();
                Ok(value)
            }
        })
        .rpc::<Scan, _, _>(|| {
            let store = StoreHandle::default();
            move |ctx: &RpcContext, args: &ArchivedScanArgs| {
                let limit = args.limit.to_native();
                if limit > MAX_SCAN {
                    return Err(format!("scan limit {limit} over {MAX_SCAN}"));
                }
                let store = store.get(ctx.node());
                Ok(scan_here(store, args.prefix.as_str(), limit as usize))
            }
        })
}

/// Runs the server `b` on a thread of its own until its shutdown switch is triggered; its
/// listen address comes back on `bound` once it listens. Returns the misrouted calls its
/// shards refused.
fn serve(
    b: NodeBuilder,
    bound: mpsc::Sender<SocketAddr>,
) -> std::thread::JoinHandle<Result<u64, String>> {
    std::thread::spawn(move || serve_here(b, bound))
}

fn serve_here(b: NodeBuilder, bound: mpsc::Sender<SocketAddr>) -> Result<u64, String> {
    let misrouted = b
        .run(move |node: Node| {
            let bound = bound.clone();
            async move {
                if node.shard().index() == 0 {
                    if let Some(a) = node.listen_addr() {
                        let _ = bound.send(a);
                    }
                }
                node.stopped().await;
                store(&node).misrouted.get()
            }
        })
        .map_err(|e| format!("server node: {e}"))?
        .into_iter()
        .sum();
    println!("rpc_kv: the server refused {misrouted} misrouted call(s)");
    Ok(misrouted)
}

/// What the client measured.
struct Figures {
    puts_per_s: f64,
    gets_per_s: f64,
    get_hist: Histogram<u64>,
    checks: u64,
    /// Calls sent to the wrong shard on purpose.
    misrouted: u64,
}

/// The value of key number `i`: 1 to 64 bytes.
fn value_of(i: usize) -> Vec<u8> {
    let len = 1 + (i * 7919) % 64;
    (0..len).map(|k| (i.wrapping_mul(31) + k) as u8).collect()
}

/// Key number `i` of run `run`.
fn key_of(run: &str, i: usize) -> String {
    format!("{run}key{i:05}")
}

fn call_failed(what: &str) -> impl Fn(RpcError) -> String + '_ {
    move |e| format!("{what}: {e}")
}

/// The server's shard `index`.
fn shard_of(peer: Peer, index: u16) -> Peer {
    peer.shard(ShardId::new(index))
}

/// A scan of the whole store: every server shard asked at once, the parts merged in key
/// order.
async fn scan_all(
    rpc: &Rpc,
    peer: Peer,
    shards: u16,
    args: &ScanArgs,
) -> Result<Vec<(String, Vec<u8>)>, RpcError> {
    let calls: Vec<_> = (0..shards)
        .map(|s| {
            let (rpc, args) = (rpc.clone(), args.clone());
            glommio::spawn_local(async move {
                rpc.call_within::<Scan>(shard_of(peer, s), &args, CALL_TIMEOUT)
                    .await
            })
        })
        .collect();
    let mut all = Vec::new();
    for call in calls {
        all.extend(call.await?);
    }
    all.sort_unstable_by(|a, b| a.0.cmp(&b.0));
    all.truncate(args.limit as usize);
    Ok(all)
}

/// The client workload against the server at `addr` (one client shard).
fn client(addr: SocketAddr, keys: usize, setup: &Setup) -> Result<Figures, String> {
    let out = builder(1, setup)
        .run(move |node: Node| async move {
            let work = workload(node, addr, keys);
            let limit = async {
                glommio::timer::sleep(WORKLOAD_LIMIT).await;
                Err(format!(
                    "the workload did not finish within {WORKLOAD_LIMIT:?}"
                ))
            };
            futures_lite::future::or(work, limit).await
        })
        .map_err(|e| format!("client node: {e}"))?;
    out.into_iter()
        .next()
        .unwrap_or_else(|| Err("the client node ran no shard".into()))
}

async fn workload(node: Node, addr: SocketAddr, keys: usize) -> Result<Figures, String> {
    let peer = node
        .connect_within(addr, CALL_TIMEOUT)
        .await
        .map_err(|e| format!("connect to {addr}: {e}"))?;
    let rpc = node.rpc();
    let mut checks = 0u64;
    // Every key of this run starts with the client's node id (fresh each start), so the
    // workload can run again and again against one server.
    let run = format!("{:016x}/", node.id().get());

    // Discovery: what the server serves, and `kv.get` by name.
    let sigs = rpc.discover(peer).await.map_err(call_failed("discover"))?;
    println!("server {addr} serves:");
    for s in &sigs {
        println!(
            "  {:>10}  {:<20} schema {:016x}  version {}",
            s.id, s.name, s.schema, s.version
        );
    }
    let get = rpc
        .lookup(peer, Get::NAME)
        .await
        .map_err(call_failed("lookup kv.get"))?;
    if get != Get::signature() {
        return Err(format!(
            "kv.get on the server is {get:?}, this build has {:?}",
            Get::signature()
        ));
    }
    checks += 1;

    // The server's shard count, for routing each key to its home shard.
    let info = rpc
        .call_within::<Describe>(peer, &(), CALL_TIMEOUT)
        .await
        .map_err(call_failed("describe"))?;
    let shards = info.shards;
    if shards == 0 {
        return Err("the server says it has no shard".into());
    }
    println!("server {addr} has {shards} shard(s): each key goes to its home shard");
    let route = move |key: &str| shard_of(peer, home(key, usize::from(shards)).get());

    // Puts, `PUT_WINDOW` in flight: task `w` puts keys w, w + PUT_WINDOW, ...
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..PUT_WINDOW)
        .map(|w| {
            let (rpc, run) = (rpc.clone(), run.clone());
            glommio::spawn_local(async move {
                for i in (w..keys).step_by(PUT_WINDOW) {
                    let args = PutArgs {
                        key: key_of(&run, i),
                        value: value_of(i),
                    };
                    let existed = rpc
                        .call_within::<Put>(route(&args.key), &args, CALL_TIMEOUT)
                        .await
                        .map_err(|e| format!("put {}: {e}", args.key))?;
                    if existed {
                        return Err(format!("put {}: the key existed already", args.key));
                    }
                }
                Ok::<u64, String>(((w..keys).step_by(PUT_WINDOW)).len() as u64)
            })
        })
        .collect();
    for t in tasks {
        checks += t.await?;
    }
    let puts_per_s = keys as f64 / t0.elapsed().as_secs_f64();

    // Gets, one at a time, every value checked.
    let mut get_hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).unwrap();
    let t0 = Instant::now();
    for i in 0..keys {
        let key = key_of(&run, i);
        let start = Instant::now();
        let got = rpc
            .call_within::<Get>(route(&key), &key, CALL_TIMEOUT)
            .await
            .map_err(|e| format!("get {key}: {e}"))?;
        get_hist.saturating_record(start.elapsed().as_nanos() as u64);
        if got.as_deref() != Some(&value_of(i)[..]) {
            return Err(format!("get {key}: {got:?}, expected {:?}", value_of(i)));
        }
        checks += 1;
    }
    let gets_per_s = keys as f64 / t0.elapsed().as_secs_f64();

    // Missing keys.
    for suffix in ["", "key", "nokey", "key999999"] {
        let key = format!("{run}{suffix}");
        let got = rpc
            .call_within::<Get>(route(&key), &key, CALL_TIMEOUT)
            .await
            .map_err(|e| format!("get {key:?}: {e}"))?;
        if got.is_some() {
            return Err(format!("get {key:?}: {got:?}, expected none"));
        }
        checks += 1;
    }

    // An overwrite.
    let mut model: BTreeMap<String, Vec<u8>> =
        (0..keys).map(|i| (key_of(&run, i), value_of(i))).collect();
    if keys > 0 {
        let args = PutArgs {
            key: key_of(&run, 0),
            value: b"overwritten".to_vec(),
        };
        let existed = rpc
            .call_within::<Put>(route(&args.key), &args, CALL_TIMEOUT)
            .await
            .map_err(call_failed("overwrite"))?;
        let got = rpc
            .call_within::<Get>(route(&args.key), &args.key, CALL_TIMEOUT)
            .await
            .map_err(call_failed("get after overwrite"))?;
        if !existed || got.as_deref() != Some(&b"overwritten"[..]) {
            return Err(format!(
                "overwrite of {}: existed {existed}, then {got:?}",
                args.key
            ));
        }
        model.insert(args.key, args.value);
        checks += 1;
    }

    // Scans, checked against the model.
    for (suffix, limit) in [
        ("key000", 1000),
        ("key0012", 5),
        ("key1", 25),
        ("key", 3),
        ("", 10),
        ("zzz", 10),
        ("key00", 0),
    ] {
        let prefix = format!("{run}{suffix}");
        let prefix = prefix.as_str();
        let args = ScanArgs {
            prefix: prefix.to_owned(),
            limit,
        };
        let got = scan_all(&rpc, peer, shards, &args)
            .await
            .map_err(|e| format!("scan {prefix:?}: {e}"))?;
        let want: Vec<(String, Vec<u8>)> = model
            .range(prefix.to_owned()..)
            .take_while(|(k, _)| k.starts_with(prefix))
            .take(limit as usize)
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        if got != want {
            return Err(format!(
                "scan {prefix:?} limit {limit}: {} entries (first {:?}), expected {} (first {:?})",
                got.len(),
                got.first().map(|e| &e.0),
                want.len(),
                want.first().map(|e| &e.0)
            ));
        }
        checks += 1;
    }

    // A scan over the limit: the handler's error, typed.
    let too_many = ScanArgs {
        prefix: String::new(),
        limit: MAX_SCAN + 1,
    };
    match scan_all(&rpc, peer, shards, &too_many).await {
        Err(RpcError::Failed(msg)) if msg.contains("over") => checks += 1,
        other => {
            return Err(format!(
                "a scan over the limit answered {other:?}, expected a failure"
            ))
        }
    }

    // A get sent to a shard that is not its key's home: refused, not served.
    let mut misrouted = 0;
    if shards > 1 && keys > 0 {
        let key = key_of(&run, 0);
        let at = home(&key, usize::from(shards)).get();
        let wrong = shard_of(peer, (at + 1) % shards);
        match rpc.call_within::<Get>(wrong, &key, CALL_TIMEOUT).await {
            Err(RpcError::Failed(msg)) if msg.starts_with("misrouted") => checks += 1,
            other => {
                return Err(format!(
                    "a get sent to the wrong shard answered {other:?}, expected a refusal"
                ))
            }
        }
        misrouted += 1;
    }

    Ok(Figures {
        puts_per_s,
        gets_per_s,
        get_hist,
        checks,
        misrouted,
    })
}

struct Opts {
    listen: Option<SocketAddr>,
    connect: Option<SocketAddr>,
    shards: usize,
    keys: usize,
    setup: Setup,
}

/// A sharded key-value service over typed RPC.
#[derive(clap::Parser)]
#[command(name = "rpc_kv")]
struct Args {
    #[command(flatten)]
    role: cli::Role,
    /// Server shards.
    #[arg(long, value_name = "N", default_value = "2", value_parser = cli::positive)]
    shards: usize,
    /// Keys of the workload.
    #[arg(long, value_name = "N", default_value_t = 10_000)]
    keys: usize,
    /// UCX transports (listening and connecting need tcp in UCX 1.12).
    #[arg(long, value_name = "LIST", default_value = "tcp")]
    tls: String,
    /// The shards' spin window before they sleep, in microseconds (default: the runtime's).
    #[arg(long, value_name = "N")]
    spin_us: Option<u64>,
}

fn opts() -> Opts {
    let a = <Args as clap::Parser>::parse();
    Opts {
        listen: a.role.listen,
        connect: a.role.connect,
        shards: a.shards,
        keys: a.keys,
        setup: Setup {
            tls: a.tls,
            spin: a.spin_us.map(Duration::from_micros),
        },
    }
}

fn report(f: &Figures, keys: usize) {
    let us = |q: f64| f.get_hist.value_at_quantile(q) as f64 / 1000.0;
    println!(
        "{keys} puts ({PUT_WINDOW} in flight): {:.0} calls/s",
        f.puts_per_s
    );
    println!(
        "{keys} gets (one at a time): {:.0} calls/s, latency p50 {:.1} us, p99 {:.1} us, max {:.1} us",
        f.gets_per_s,
        us(0.5),
        us(0.99),
        f.get_hist.max() as f64 / 1000.0
    );
    println!("rpc_kv: all {} checks passed", f.checks);
}

fn main() {
    let o = opts();
    let result = match (o.listen, o.connect) {
        (Some(addr), None) => {
            let b = server(o.shards, &o.setup, addr);
            if let Err(e) = b.shutdown_handle().trigger_on_signals() {
                eprintln!("rpc_kv: cannot install the signal handlers: {e}");
                std::process::exit(1);
            }
            let (tx, rx) = mpsc::channel();
            let server = serve(b, tx);
            if let Ok(a) = rx.recv_timeout(Duration::from_secs(30)) {
                println!(
                    "rpc_kv: {} shard(s) listening on {a}; Ctrl-C stops",
                    o.shards
                );
            }
            server
                .join()
                .unwrap_or_else(|_| Err("the server panicked".into()))
                .map(drop)
        }
        (None, Some(addr)) => client(addr, o.keys, &o.setup).map(|f| report(&f, o.keys)),
        (None, None) => {
            let b = server(o.shards, &o.setup, "127.0.0.1:0".parse().unwrap());
            let stop = b.shutdown_handle();
            let (tx, rx) = mpsc::channel();
            let server = serve(b, tx);
            let r = match rx.recv_timeout(Duration::from_secs(30)) {
                Ok(addr) => client(addr, o.keys, &o.setup),
                Err(_) => Err("the server did not start within 30 s".into()),
            };
            stop.trigger();
            let s = server
                .join()
                .unwrap_or_else(|_| Err("the server panicked".into()));
            // Every call but the client's deliberate ones went to its key's home shard.
            match (r, s) {
                (Ok(f), Ok(refused)) if refused == f.misrouted => {
                    report(&f, o.keys);
                    Ok(())
                }
                (Ok(f), Ok(refused)) => Err(format!(
                    "the server refused {refused} misrouted call(s), the client sent {} on purpose",
                    f.misrouted
                )),
                (r, s) => r.and(s).map(drop),
            }
        }
        (Some(_), Some(_)) => unreachable!("clap refuses --listen with --connect"),
    };
    if let Err(e) = result {
        eprintln!("rpc_kv failed: {e}");
        std::process::exit(1);
    }
}
