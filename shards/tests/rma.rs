//! Tier 3: checked remote memory on the shards' own API, installed from
//! `ShardsBuilder::on_start`, between two nodes of two shards each in one process over tcp;
//! and trusted-mode regions on one node (the facade's `tests/rma.rs` runs trusted put/get
//! between nodes).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx_shards::proto::region::{Permissions, RmaErrorCode};
use shardcx_shards::proto::{NodeId, ShardId};
use shardcx_shards::rma::{self, RemoteRegion, RmaOpError};
use shardcx_shards::{Placement, ShardCtx, ShardsBuilder};

const LIMIT: Duration = Duration::from_secs(60);
const KEY: &[u8] = b"sixteen byte key, and some more";
const A: NodeId = NodeId::new(0xA);
const B: NodeId = NodeId::new(0xB);
const T: Duration = Duration::from_secs(5);

/// Two nodes of two shards each must fit the 8 MiB locked-memory limit: one test at a time.
fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

fn node(id: NodeId) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(KEY)
}

/// Node B registers a region on each shard (a write-only one on shard 1), serves until A says
/// it is done, then deregisters and reports what its memory holds.
#[test]
fn shard_api_round_trip_and_deregistration() {
    let _g = serial();
    let (tx, rx) = mpsc::channel::<(ShardId, Option<std::net::SocketAddr>, RemoteRegion)>();
    let tx = Arc::new(Mutex::new(tx));
    let done = Arc::new(AtomicUsize::new(0));
    let done_b = done.clone();
    let b = std::thread::spawn(move || {
        node(B)
            .listen("127.0.0.1:0".parse().unwrap())
            .on_start(rma::install)
            .run(move |ctx: Rc<ShardCtx>| {
                let (tx, done) = (tx.clone(), done_b.clone());
                async move {
                    let perms = if ctx.id() == ShardId::new(1) {
                        Permissions::WRITE
                    } else {
                        Permissions::READ_WRITE
                    };
                    let d = ctx.register_region(vec![0; 128], perms, Some(A)).unwrap();
                    assert_eq!(ctx.region(d.id()), Some(d));
                    assert_eq!(ctx.region_count(), 1);
                    ctx.with_region_mut(d.id(), |m| m[..4].copy_from_slice(b"init"))
                        .unwrap();
                    // Reentrant calls are refused, not a panic.
                    let inner = ctx
                        .with_region(d.id(), |_| ctx.revoke_region(d.id()))
                        .unwrap();
                    assert!(
                        matches!(inner, Err(RmaOpError::Reentrant { .. })),
                        "{inner:?}"
                    );
                    tx.lock()
                        .unwrap()
                        .send((ctx.id(), ctx.listen_addr(), d))
                        .unwrap();
                    let deadline = Instant::now() + LIMIT;
                    while done.load(Ordering::Acquire) < 2 && Instant::now() < deadline {
                        sleep(Duration::from_millis(2)).await;
                    }
                    let mem = ctx.deregister_region(d.id()).unwrap();
                    assert_eq!(ctx.region_count(), 0);
                    assert!(ctx.region(d.id()).is_none());
                    (mem, ctx.rma_stats())
                }
            })
            .unwrap()
    });
    let mut addr = None;
    let mut regions = vec![None, None];
    for _ in 0..2 {
        let (shard, a, d) = rx.recv_timeout(LIMIT).expect("B did not start");
        addr = addr.or(a);
        regions[shard.index()] = Some(d);
    }
    let addr = addr.unwrap();
    let regions: Vec<RemoteRegion> = regions.into_iter().map(Option::unwrap).collect();
    let (atx, arx) = mpsc::channel();
    std::thread::spawn(move || {
        // A installs nothing: its regions are refused, its requests still work.
        let r = node(A).run(move |ctx: Rc<ShardCtx>| {
            let (regions, done) = (regions.clone(), done.clone());
            async move {
                let r = ctx.register_region(vec![1], Permissions::READ, None);
                assert!(matches!(r, Err((RmaOpError::NotInstalled { .. }, ref m)) if m == &[1]));
                ctx.connect(addr).await.expect("connect");
                let me = ctx.id().index() as u64;
                let rw = &regions[0];
                let data = [me as u8 + 1; 16];
                ctx.rma_put(rw, 16 + 16 * me, &data, T).await.unwrap();
                let back = ctx.rma_get(rw, 16 + 16 * me, 16, T).await.unwrap();
                assert_eq!(back, data);
                assert_eq!(ctx.rma_get(rw, 0, 4, T).await.unwrap(), b"init");
                // Write-only: puts go, gets are refused before sending.
                let wo = &regions[1];
                ctx.rma_put(wo, 100 + me, b"w", T).await.unwrap();
                let r = ctx.rma_get(wo, 0, 1, T).await;
                assert_eq!(
                    r.as_ref().unwrap_err().code(),
                    Some(RmaErrorCode::NotPermitted),
                    "{r:?}"
                );
                assert!(matches!(r, Err(RmaOpError::Invalid { .. })));
                // A get past the region's end is refused before sending.
                let r = ctx.rma_get(rw, 0, u64::MAX / 2, T).await;
                assert!(matches!(r, Err(RmaOpError::Invalid { .. })), "{r:?}");
                done.fetch_add(1, Ordering::AcqRel);
                // Once B has deregistered, its descriptors name nothing.
                let deadline = Instant::now() + Duration::from_secs(20);
                loop {
                    match ctx.rma_get(rw, 0, 1, T).await {
                        Ok(_) if Instant::now() < deadline => sleep(Duration::from_millis(5)).await,
                        Err(RmaOpError::Refused { code, .. }) => {
                            assert_eq!(code, RmaErrorCode::UnknownRegion);
                            break;
                        }
                        // B may have closed the connection by now.
                        Err(RmaOpError::Net(_)) => break,
                        other => panic!("{other:?}"),
                    }
                }
            }
        });
        let _ = atx.send(r);
    });
    arx.recv_timeout(LIMIT)
        .expect("A still running")
        .expect("A failed");
    let out = b.join().expect("B panicked");
    // Shard 0's region: "init", then each A shard's 16 bytes; shard 1's: the two puts.
    let (mem0, s0) = &out[0];
    assert_eq!(&mem0[..4], b"init");
    assert_eq!(&mem0[16..32], &[1; 16]);
    assert_eq!(&mem0[32..48], &[2; 16]);
    let (mem1, s1) = &out[1];
    assert_eq!(&mem1[100..102], b"ww");
    assert!(s0.puts == 2 && s1.puts == 2, "{s0:?} {s1:?}");
    assert_eq!(s0.refused + s1.refused + s0.malformed + s1.malformed, 0);
}

/// Trusted mode on the shards' own API, one node: off unless `UCP_FEATURE_RMA` is asked for;
/// on, a region maps zeroed memory, its descriptor survives encoding, its bounds hold locally,
/// and an access to a node with no session fails with a typed error before UCX is touched.
#[test]
fn trusted_regions_on_one_node() {
    use shardcx_shards::proto::region::Access;
    use shardcx_shards::rma_trusted::{host_id, TrustedDescriptor};
    use shardcx_shards::ucx::Features;
    let _g = serial();
    // Off: the default features.
    let off = node(A)
        .run(|ctx: Rc<ShardCtx>| async move {
            assert!(!ctx.trusted_rma_enabled());
            let r = ctx.register_trusted_region(64, Permissions::READ_WRITE);
            matches!(r, Err(RmaOpError::TrustedOff { shard }) if shard == ctx.id())
        })
        .unwrap();
    assert_eq!(off, vec![true, true]);
    // On.
    let rma = Features {
        rma: true,
        ..Features::messaging()
    };
    let out = node(B)
        .features(rma)
        .run(|ctx: Rc<ShardCtx>| async move {
            assert!(ctx.trusted_rma_enabled());
            let r = ctx
                .register_trusted_region(10_000, Permissions::READ)
                .unwrap();
            assert_eq!(r.to_vec(), vec![0; 10_000]);
            r.write_at(9_990, b"0123456789").unwrap();
            let mut back = [0u8; 10];
            r.read_at(9_990, &mut back).unwrap();
            assert_eq!(&back, b"0123456789");
            assert!(matches!(
                r.write_at(9_991, b"0123456789"),
                Err(RmaOpError::Invalid { .. })
            ));
            assert!(matches!(
                r.read_at(u64::MAX, &mut back),
                Err(RmaOpError::Invalid { .. })
            ));
            let d = r.descriptor().clone();
            assert_eq!((d.node(), d.shard(), d.len()), (B, ctx.id(), 10_000));
            assert_eq!((d.incarnation(), d.host()), (ctx.incarnation(), host_id()));
            assert_eq!(TrustedDescriptor::from_bytes(&d.to_bytes()), Ok(d.clone()));
            // The holder's own permissions are the initiator's check.
            let e = ctx.trusted_put(&d, 0, b"x", T).await.unwrap_err();
            assert_eq!(e.code(), Some(RmaErrorCode::NotPermitted), "{e:?}");
            assert!(d.check(0, 1, Access::Read).is_ok());
            // No session with the holder (itself): typed, before any UCX call.
            let e = ctx.trusted_get(&d, 0, 1, T).await.unwrap_err();
            assert!(
                matches!(
                    e,
                    RmaOpError::Net(shardcx_shards::NetError::NotConnected { .. })
                ),
                "{e:?}"
            );
            // An empty region is refused by UCX, as a typed error.
            let e = ctx
                .register_trusted_region(0, Permissions::READ)
                .unwrap_err();
            assert!(matches!(e, RmaOpError::Ucx { .. }), "{e:?}");
            ctx.trusted_rma_stats()
        })
        .unwrap();
    for s in out {
        assert_eq!(
            (s.regions, s.puts, s.gets, s.endpoints),
            (1, 0, 0, 0),
            "{s:?}"
        );
    }
}
