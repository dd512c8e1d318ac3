//! Typed RPC through the facade: a server node and a client node of two shards each in one
//! process, over tcp on loopback. The client calls from both of its shards, so calls go from
//! the shard that owns the server and from the one that forwards to it. Module `large`: large
//! arguments.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

mod caller;
mod large;

use glommio::timer::sleep;
use shardcx::proto::rpc::{decode_error, request_prefix, CallFlags, RpcErrorCode};
use shardcx::proto::{FrameKind, ReqId};
use shardcx::registry::{NodeRecord, Registry};
use shardcx::rpc::{ClusterRegistry, Discover, RpcConfig, RpcContext, RpcError, RpcFunction};
use shardcx::{rpc_function, Node, NodeBuilder, NodeId, Peer, RpcStats};

#[path = "../common/mod.rs"]
mod common;
/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
const KEY: &[u8] = b"facade rpc test key, 16+ bytes";
const CLIENT: NodeId = NodeId::new(0xC1);
const SERVER: NodeId = NodeId::new(0x5E);

#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
enum Kind {
    Plain,
    Count(u32),
    Named { name: String, weight: f64 },
}

#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Person {
    name: String,
    tags: Vec<String>,
    pos: (i32, i32),
    kind: Kind,
    friends: Vec<Friend>,
    note: Option<String>,
}

#[derive(Debug, Clone, PartialEq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
struct Friend {
    name: String,
    since: u64,
    kind: Kind,
}

rpc_function!(Echo: String => String, id = 1, name = "test.echo");
rpc_function!(Sum: Vec<u64> => u64, id = 2, name = "test.sum", idempotent = true);
rpc_function!(Mirror: Person => Person, id = 3, name = "test.mirror");
rpc_function!(Unit: () => (), id = 4, name = "test.unit");
rpc_function!(Rename: Kind => Kind, id = 5, name = "test.rename");
rpc_function!(
    /// Async: sleeps the given milliseconds.
    Nap: u64 => (), id = 6, name = "test.nap");
rpc_function!(
    /// Async: waits for its cancellation, counts it.
    AwaitCancel: () => (), id = 7, name = "test.await_cancel");
rpc_function!(Boom: () => (), id = 8, name = "test.boom");
rpc_function!(Refuse: () => (), id = 9, name = "test.refuse");
rpc_function!(
    /// Counts its runs; returns the count.
    Count: () => u64, id = 10, name = "test.count");
rpc_function!(
    /// Blocks the server shard (a plain handler that sleeps the thread) for the given ms.
    Block: u64 => (), id = 11, name = "test.block");
rpc_function!(
    /// Not served.
    Nobody: () => (), id = 999, name = "test.nobody");
rpc_function!(
    /// Echo's id with other types: a schema mismatch.
    EchoWrong: u64 => u64, id = 1, name = "test.echo");

rpc_function!(
    /// Async, idempotent: the first server stops itself and never answers; the next answers
    /// its generation.
    Flaky: () => u64, id = 12, name = "test.flaky", idempotent = true);
rpc_function!(
    /// The same, not idempotent.
    FlakyOnce: () => u64, id = 13, name = "test.flaky_once");

static COUNT: AtomicU64 = AtomicU64::new(0);
static CANCELS_SEEN: AtomicU64 = AtomicU64::new(0);
static NAPS_DONE: AtomicU64 = AtomicU64::new(0);

/// Two nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    let g = LOCK.lock().unwrap_or_else(|e| e.into_inner());
    COUNT.store(0, Ordering::SeqCst);
    CANCELS_SEEN.store(0, Ordering::SeqCst);
    NAPS_DONE.store(0, Ordering::SeqCst);
    g
}

fn node(id: NodeId) -> NodeBuilder {
    common::two_shard_node(id, KEY)
}

/// The server: every test function registered.
fn server() -> NodeBuilder {
    node(SERVER)
        .rpc::<Echo, _, _>(|| {
            |_: &RpcContext, s: &rkyv::Archived<String>| Ok(s.as_str().to_owned())
        })
        .rpc::<Sum, _, _>(|| {
            |_: &RpcContext, v: &rkyv::Archived<Vec<u64>>| Ok(v.iter().map(|x| x.to_native()).sum())
        })
        .rpc::<Mirror, _, _>(|| {
            |_: &RpcContext, p: &ArchivedPerson| {
                let mut p: Person = rkyv::deserialize::<_, rkyv::rancor::Error>(p).unwrap();
                p.name = p.name.to_uppercase();
                Ok(p)
            }
        })
        .rpc::<Unit, _, _>(|| |_: &RpcContext, _: &rkyv::Archived<()>| Ok(()))
        .rpc_async::<Rename, _, _, _>(|| {
            |_: RpcContext, k: Kind| async move {
                Ok(match k {
                    Kind::Named { name, weight } => Kind::Named {
                        name: format!("{name}!"),
                        weight: weight * 2.0,
                    },
                    Kind::Count(n) => Kind::Count(n + 1),
                    Kind::Plain => Kind::Plain,
                })
            }
        })
        .rpc_async::<Nap, _, _, _>(|| {
            |_: RpcContext, ms: u64| async move {
                sleep(Duration::from_millis(ms)).await;
                Ok(())
            }
        })
        .rpc_async::<AwaitCancel, _, _, _>(|| {
            |ctx: RpcContext, ()| async move {
                ctx.cancelled().await;
                assert!(ctx.is_cancelled());
                CANCELS_SEEN.fetch_add(1, Ordering::SeqCst);
                Ok(())
            }
        })
        .rpc::<Boom, _, _>(|| |_: &RpcContext, _: &rkyv::Archived<()>| panic!("boom on purpose"))
        .rpc::<Refuse, _, _>(
            || |_: &RpcContext, _: &rkyv::Archived<()>| Err("no thanks".to_owned()),
        )
        .rpc::<Count, _, _>(|| {
            |_: &RpcContext, _: &rkyv::Archived<()>| Ok(COUNT.fetch_add(1, Ordering::SeqCst) + 1)
        })
        .rpc::<Block, _, _>(|| {
            |_: &RpcContext, ms: &rkyv::Archived<u64>| {
                std::thread::sleep(Duration::from_millis(ms.to_native()));
                Ok(())
            }
        })
}

/// Runs `server` (listening, registered as service "svc" when `register`) and the client node
/// [`node`]`(CLIENT)`; `body` runs on both client shards with the server as a peer. Returns the
/// client shards' results and the server's counters summed over its shards.
fn pair<T, B, Fut>(server: NodeBuilder, register: bool, body: B) -> (Vec<T>, RpcStats)
where
    T: Send + 'static,
    B: Fn(Node, Peer) -> Fut + Send + Clone + 'static,
    Fut: Future<Output = T> + 'static,
{
    pair_with(server, node(CLIENT), register, body)
}

/// [`pair`] with its own client node.
fn pair_with<T, B, Fut>(
    server: NodeBuilder,
    client: NodeBuilder,
    register: bool,
    body: B,
) -> (Vec<T>, RpcStats)
where
    T: Send + 'static,
    B: Fn(Node, Peer) -> Fut + Send + Clone + 'static,
    Fut: Future<Output = T> + 'static,
{
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let addr_s = addr.clone();
    let stop = server.shutdown_handle();
    let s = std::thread::spawn(move || {
        server
            .listen("127.0.0.1:0".parse().unwrap())
            .run(move |node: Node| {
                let addr = addr_s.clone();
                async move {
                    if node.shard().index() == 0 {
                        if register {
                            let record = NodeRecord {
                                service: "svc".into(),
                                node: node.id(),
                                addr: node.listen_addr().unwrap(),
                                shards: 2,
                                functions: Vec::new(),
                            };
                            ClusterRegistry::new(&node).register(&record).await.unwrap();
                        }
                        let _ = addr.set(node.listen_addr().unwrap());
                    }
                    node.stopped().await;
                    node.rpc_stats()
                }
            })
            .expect("server")
    });
    let c = std::thread::spawn(move || {
        client
            .run(move |node: Node| {
                let (addr, body) = (addr.clone(), body.clone());
                async move {
                    let t0 = Instant::now();
                    while addr.get().is_none() {
                        assert!(t0.elapsed() < LIMIT, "server did not start");
                        sleep(Duration::from_millis(1)).await;
                    }
                    let peer = node.connect(*addr.get().unwrap()).await.expect("connect");
                    body(node, peer).await
                }
            })
            .expect("client")
    });
    let out = within(move || c.join());
    stop.trigger();
    let stats = within(move || s.join()).expect("server panicked");
    let out = match out {
        Ok(out) => out,
        Err(p) => std::panic::resume_unwind(p),
    };
    (out, stats.into_iter().sum())
}

/// Runs `f` on another thread; fails the test if it takes longer than `LIMIT` (with the stacks
/// of the test's threads).
fn within<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    common::within(LIMIT, f)
}

async fn wait_for(what: &str, bound: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < bound, "{what}: not within {bound:?}");
        sleep(Duration::from_millis(1)).await;
    }
}

fn person(i: u32) -> Person {
    Person {
        name: format!("person {i}"),
        tags: vec!["a".into(), String::new(), "ünïcødé".into()],
        pos: (-(i as i32), i as i32 * 7),
        kind: Kind::Named {
            name: "n".into(),
            weight: 0.5,
        },
        friends: vec![
            Friend {
                name: "friend".into(),
                since: u64::from(i),
                kind: Kind::Count(i),
            },
            Friend {
                name: String::new(),
                since: u64::MAX,
                kind: Kind::Plain,
            },
        ],
        note: Some("note".into()),
    }
}

#[test]
fn round_trips_of_assorted_types() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        let long = "x".repeat(20_000); // over the rendezvous threshold both ways
        for s in ["", "hello", "ünïcødé ✓", long.as_str()] {
            assert_eq!(rpc.call::<Echo>(peer, &s.to_owned()).await.unwrap(), s);
        }
        assert_eq!(rpc.call::<Sum>(peer, &vec![]).await.unwrap(), 0);
        assert_eq!(
            rpc.call::<Sum>(peer, &(1..=1000).collect()).await.unwrap(),
            500_500
        );
        let p = person(node.shard().index() as u32);
        let back = rpc.call::<Mirror>(peer, &p).await.unwrap();
        assert_eq!(back.name, p.name.to_uppercase());
        assert_eq!(
            (&back.tags, &back.friends, &back.note),
            (&p.tags, &p.friends, &p.note)
        );
        rpc.call::<Unit>(peer, &()).await.unwrap();
        for (k, want) in [
            (Kind::Plain, Kind::Plain),
            (Kind::Count(41), Kind::Count(42)),
            (
                Kind::Named {
                    name: "k".into(),
                    weight: 1.5,
                },
                Kind::Named {
                    name: "k!".into(),
                    weight: 3.0,
                },
            ),
        ] {
            assert_eq!(rpc.call::<Rename>(peer, &k).await.unwrap(), want);
        }
        // Zero-copy: the validated archive.
        let r = rpc.call_archived::<Mirror>(peer, &p).await.unwrap();
        assert_eq!(r.get().name.as_str(), p.name.to_uppercase());
        assert_eq!(r.get().friends.len(), 2);
        assert_eq!(r.deserialize().unwrap().pos, p.pos);
        node.shard().index()
    });
    assert_eq!(out, [0, 1]);
    // Per client shard: 4 echo, 2 sum, 1 mirror, 1 unit, 3 rename, 1 archived mirror.
    assert_eq!(stats.served, 2 * 12);
    assert_eq!(stats.failed + stats.malformed + stats.panicked, 0);
}

#[test]
fn thousands_of_calls_in_flight_from_both_shards() {
    let _g = serial();
    const CALLS: u64 = 2000;
    let t0 = Instant::now();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let tasks: Vec<_> = (0..CALLS)
            .map(|i| {
                let rpc = node.rpc();
                glommio::spawn_local(async move {
                    let got = rpc.call::<Sum>(peer, &vec![i, 1, 2]).await;
                    (i, got)
                })
            })
            .collect();
        let mut ok = 0;
        for t in tasks {
            let (i, got) = t.await;
            assert_eq!(got.unwrap(), i + 3);
            ok += 1;
        }
        ok
    });
    assert_eq!(out, [CALLS, CALLS]);
    assert_eq!(stats.served, 2 * CALLS);
    assert!(t0.elapsed() < LIMIT);
}

#[test]
fn deadlines_expire_on_the_client_and_on_the_server() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        if node.shard().index() == 0 {
            // Server-side expiry: an async handler that naps past the deadline is dropped at
            // it, and the server says so before the client's own deadline.
            let t0 = Instant::now();
            let e = rpc
                .call_within::<Nap>(peer, &5_000, Duration::from_millis(300))
                .await
                .unwrap_err();
            assert!(matches!(e, RpcError::DeadlineExpired), "{e:?}");
            assert!(
                t0.elapsed() < Duration::from_millis(300),
                "{:?}",
                t0.elapsed()
            );
            // A nap within the deadline is answered.
            rpc.call_within::<Nap>(peer, &10, Duration::from_secs(5))
                .await
                .unwrap();
            NAPS_DONE.store(1, Ordering::SeqCst);
        } else {
            // Client-side expiry: a server shard that cannot answer (blocked for 600 ms),
            // once the naps are done (the block would hold their timers up too).
            wait_for("naps", Duration::from_secs(10), || {
                NAPS_DONE.load(Ordering::SeqCst) == 1
            })
            .await;
            let t0 = Instant::now();
            let e = rpc
                .call_within::<Block>(peer, &600, Duration::from_millis(150))
                .await
                .unwrap_err();
            let took = t0.elapsed();
            assert!(matches!(e, RpcError::TimedOut { .. }), "{e:?}");
            assert!(
                took >= Duration::from_millis(140) && took < Duration::from_millis(400),
                "{took:?}"
            );
            // The plain handler finished past its deadline: counted on the server.
            sleep(Duration::from_millis(700)).await;
        }
    });
    assert_eq!(out.len(), 2);
    // One async nap dropped at its deadline, one blocking handler past its deadline.
    assert_eq!(stats.expired, 2, "{stats:?}");
}

#[test]
fn dropping_a_call_cancels_it_on_the_server() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        // Both shards: the owner of the server, and the one whose call is forwarded.
        let call = rpc.call_within::<AwaitCancel>(peer, &(), Duration::from_secs(20));
        let early = futures_lite::future::or(async { Some(call.await) }, async {
            sleep(Duration::from_millis(200)).await;
            None
        })
        .await;
        assert!(
            early.is_none(),
            "the handler answered before being cancelled"
        );
        let t0 = Instant::now();
        wait_for(
            "handler sees its cancellation",
            Duration::from_secs(3),
            || CANCELS_SEEN.load(Ordering::SeqCst) >= 2,
        )
        .await;
        t0.elapsed()
    });
    assert_eq!(out.len(), 2);
    assert_eq!(CANCELS_SEEN.load(Ordering::SeqCst), 2);
    assert_eq!(stats.cancelled, 2, "{stats:?}");
}

#[test]
fn server_errors_are_typed_and_the_server_goes_on() {
    let _g = serial();
    let small = server().rpc_config(RpcConfig {
        max_args_size: Some(1024),
        ..RpcConfig::default()
    });
    let (out, stats) = pair(small, false, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        let e = rpc.call::<Nobody>(peer, &()).await.unwrap_err();
        assert!(
            matches!(e, RpcError::UnknownFunction { id } if id == Nobody::ID),
            "{e:?}"
        );
        let e = rpc.call::<EchoWrong>(peer, &7).await.unwrap_err();
        match e {
            RpcError::SchemaMismatch { ours, theirs } => {
                assert_eq!((ours, theirs), (EchoWrong::schema(), Echo::schema()));
            }
            other => panic!("{other:?}"),
        }
        let e = rpc.call::<Boom>(peer, &()).await.unwrap_err();
        assert!(
            matches!(&e, RpcError::Panicked(m) if m.contains("boom on purpose")),
            "{e:?}"
        );
        let e = rpc.call::<Refuse>(peer, &()).await.unwrap_err();
        assert!(
            matches!(&e, RpcError::Failed(m) if m == "no thanks"),
            "{e:?}"
        );
        let e = rpc.call::<Echo>(peer, &"y".repeat(4096)).await.unwrap_err();
        assert!(matches!(e, RpcError::TooLarge { max: 1024, .. }), "{e:?}");
        // The server still serves this shard after all of that.
        assert_eq!(
            rpc.call::<Echo>(peer, &"still".into()).await.unwrap(),
            "still"
        );
    });
    assert_eq!(out.len(), 2);
    assert_eq!(
        (
            stats.unknown_function,
            stats.schema_mismatch,
            stats.panicked,
            stats.failed,
            stats.too_large,
            stats.served
        ),
        (2, 2, 2, 2, 2, 2)
    );
}

#[test]
fn malformed_requests_get_bad_request_and_others_are_served() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        let ctx = node.shard_ctx().clone();
        let to = peer.node_id();
        let timeout = Duration::from_secs(5);
        let bad = |payload: Vec<u8>| {
            let ctx = ctx.clone();
            async move {
                let (h, body) = ctx
                    .request(to, FrameKind::RpcRequest, Echo::ID.get(), payload, timeout)
                    .await
                    .unwrap();
                assert_eq!(h.kind, FrameKind::RpcError, "answer {body:?}");
                decode_error(&body).unwrap().code
            }
        };
        // A truncated envelope, unknown flag bits, and a good envelope with a garbage archive.
        assert_eq!(bad(vec![1, 2, 3]).await, RpcErrorCode::BadRequest);
        let mut flags = request_prefix(Echo::schema(), CallFlags::NONE).to_vec();
        flags[8] = 0x80;
        assert_eq!(bad(flags).await, RpcErrorCode::BadRequest);
        let mut garbage = request_prefix(Echo::schema(), CallFlags::NONE).to_vec();
        // (8 bytes of 0xFF would be a valid empty inline string: rkyv pads with 0xFF.) An
        // inline string that is not UTF-8:
        garbage.extend_from_slice(&[0xC3, 0x28, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF]);
        assert_eq!(bad(garbage).await, RpcErrorCode::BadRequest);
        // An out-of-line string pointing outside the archive:
        let mut garbage = request_prefix(Echo::schema(), CallFlags::NONE).to_vec();
        garbage.extend_from_slice(&[0x80, 0x7F, 0x00, 0x00, 0x00, 0x00, 0x00, 0x10]);
        assert_eq!(bad(garbage).await, RpcErrorCode::BadRequest);
        // Typed calls still work.
        let rpc = node.rpc();
        assert_eq!(rpc.call::<Echo>(peer, &"ok".into()).await.unwrap(), "ok");
    });
    assert_eq!(out.len(), 2);
    assert_eq!((stats.malformed, stats.served), (8, 2), "{stats:?}");
}

#[test]
fn a_replayed_request_runs_once() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        if node.shard().index() != 0 {
            return 0;
        }
        let ctx = node.shard_ctx().clone();
        let mut payload = request_prefix(Count::schema(), CallFlags::NONE).to_vec();
        payload.extend_from_slice(&rkyv::to_bytes::<rkyv::rancor::Error>(&()).unwrap());
        // The same request id twice: the copy is answered from the dedup window.
        for _ in 0..2 {
            ctx.send_frame(
                peer.node_id(),
                FrameKind::RpcRequest,
                Count::ID.get(),
                ReqId::new(1_000_000),
                payload.clone(),
            )
            .await
            .unwrap();
        }
        wait_for("first copy ran", Duration::from_secs(5), || {
            COUNT.load(Ordering::SeqCst) >= 1
        })
        .await;
        sleep(Duration::from_millis(200)).await;
        // A fresh call runs: the count is 2, not 3.
        node.rpc().call::<Count>(peer, &()).await.unwrap()
    });
    assert_eq!(out, [2, 0]);
    assert_eq!(COUNT.load(Ordering::SeqCst), 2);
    assert_eq!(stats.replayed, 1, "{stats:?}");
}

#[test]
fn one_way_calls_run_without_an_answer() {
    let _g = serial();
    let (out, stats) = pair(server(), false, |node: Node, peer: Peer| async move {
        // The first connects (the general path); the next go out at once from the shard's
        // request vector (the immediate path), an answered call between them.
        for _ in 0..3 {
            node.rpc().notify::<Count>(peer, &()).await.unwrap();
        }
        node.rpc().call::<Count>(peer, &()).await.unwrap();
        for _ in 0..2 {
            // The shard's request vector, taken here, comes back only from the immediate
            // path (the general one hands its vector to the send).
            let ctx = node.shard_ctx();
            drop(ctx.request_buffer());
            node.rpc().notify::<Count>(peer, &()).await.unwrap();
            assert!(
                ctx.request_buffer().capacity() > 0,
                "a one-way call to a connected peer took the general path"
            );
        }
        wait_for("one-way calls ran", Duration::from_secs(5), || {
            COUNT.load(Ordering::SeqCst) >= 12
        })
        .await;
    });
    assert_eq!(out.len(), 2);
    assert_eq!(COUNT.load(Ordering::SeqCst), 12);
    assert_eq!((stats.one_way, stats.served), (10, 2), "{stats:?}");
}

#[test]
fn discovery_and_calls_by_name() {
    let _g = serial();
    let (out, _) = pair(server(), true, |node: Node, peer: Peer| async move {
        let rpc = node.rpc();
        let sigs = rpc.discover(peer).await.unwrap();
        assert!(sigs.contains(&Echo::signature()));
        assert!(sigs.contains(&Discover::signature()));
        assert_eq!(sigs.len(), 13, "{sigs:?}");
        let sig = rpc.lookup(peer, "test.echo").await.unwrap();
        assert_eq!(sig, Echo::signature());
        // A client without the marker type calls by signature.
        let back: String = rpc
            .call_signature(peer, &sig, &"by name".to_owned(), None)
            .await
            .unwrap();
        assert_eq!(back, "by name");
        let e = rpc.lookup(peer, "test.none").await.unwrap_err();
        assert!(matches!(e, RpcError::UnknownName { .. }), "{e:?}");
        // The embedded registry finds the server by service and by function.
        let reg = ClusterRegistry::new(&node);
        let by_service = reg.lookup("svc").await.unwrap();
        assert_eq!(by_service.len(), 1);
        assert_eq!(by_service[0].node, peer.node_id());
        assert!(by_service[0].function("test.sum").is_some());
        let by_fn = reg.find_function("test.mirror").await.unwrap();
        assert_eq!(by_fn.len(), 1);
        assert!(reg.find_function("test.none").await.unwrap().is_empty());
    });
    assert_eq!(out.len(), 2);
}

#[test]
fn reserved_ids_and_duplicate_names_are_refused() {
    let _g = serial();
    rpc_function!(Reserved: () => (), id = 0xFFFF_0005, name = "mine");
    rpc_function!(Twin: () => (), id = 77, name = "test.echo");
    let e = node(SERVER)
        .rpc::<Reserved, _, _>(|| |_: &RpcContext, _: &rkyv::Archived<()>| Ok(()))
        .run(|_| async {})
        .unwrap_err();
    assert!(
        matches!(e, shardcx::Error::ReservedFunctionId { .. }),
        "{e:?}"
    );
    let e = server()
        .rpc::<Twin, _, _>(|| |_: &RpcContext, _: &rkyv::Archived<()>| Ok(()))
        .run(|_| async {})
        .unwrap_err();
    assert!(
        matches!(e, shardcx::Error::DuplicateFunctionName { .. }),
        "{e:?}"
    );
}

/// A 1-shard server at `addr` serving `Flaky` and `FlakyOnce`: generation 1 stops itself on
/// the first call (its connections close), later ones answer their generation.
fn flaky_server(
    addr: SocketAddr,
    generation: u64,
) -> (
    shardcx::Shutdown,
    std::thread::JoinHandle<Result<(), shardcx::Error>>,
) {
    fn handler(
        generation: u64,
    ) -> impl Fn(RpcContext, ()) -> std::pin::Pin<Box<dyn Future<Output = Result<u64, String>>>>
    {
        move |ctx: RpcContext, ()| {
            Box::pin(async move {
                if generation == 1 {
                    ctx.node().shutdown();
                    std::future::pending::<()>().await;
                }
                Ok(generation)
            })
        }
    }
    let b = node(SERVER)
        .shards(1)
        .listen(addr)
        .drain_deadline(Duration::from_millis(100))
        .rpc_async::<Flaky, _, _, _>(move || handler(generation))
        .rpc_async::<FlakyOnce, _, _, _>(move || handler(generation));
    (b.shutdown_handle(), std::thread::spawn(move || b.serve()))
}

#[test]
fn idempotent_calls_are_sent_again_after_the_connection_fails_and_others_are_not() {
    let _g = serial();
    for idempotent in [true, false] {
        // The second server binds the first one's port: one outside the ephemeral range, so
        // that the client's reconnects cannot take it in between.
        let addr = common::port_outside_ephemeral_range();
        let (_, first) = flaky_server(addr, 1);
        // The second server starts at the same address as soon as the first has stopped (the
        // first one's closed connections linger in TIME_WAIT on this port: a restart must not
        // be refused for them).
        let second = std::thread::spawn(move || {
            first
                .join()
                .expect("first server panicked")
                .expect("first server");
            flaky_server(addr, 2)
        });
        let out = within(move || {
            node(CLIENT)
                .shards(1)
                .peer_addr(SERVER, addr)
                .run(move |node: Node| async move {
                    let peer = Peer::new(SERVER);
                    // Connected on first use (the server may still be starting).
                    let t0 = Instant::now();
                    while node.rpc().discover(peer).await.is_err() {
                        assert!(t0.elapsed() < Duration::from_secs(10), "never connected");
                        sleep(Duration::from_millis(20)).await;
                    }
                    let rpc = node.rpc();
                    let timeout = Duration::from_secs(10);
                    if idempotent {
                        rpc.call_within::<Flaky>(peer, &(), timeout).await
                    } else {
                        rpc.call_within::<FlakyOnce>(peer, &(), timeout).await
                    }
                })
                .expect("client")
                .pop()
                .unwrap()
        });
        let (switch, second) = second.join().expect("restarter panicked");
        switch.trigger();
        within(move || second.join())
            .expect("second server panicked")
            .expect("second server");
        if idempotent {
            // Sent again over a new connection, to the restarted server.
            assert_eq!(out.unwrap(), 2);
        } else {
            let e = out.unwrap_err();
            assert!(e.is_connection_failure(), "{e:?}");
        }
    }
}
