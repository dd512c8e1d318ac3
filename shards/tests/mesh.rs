//! Tier 3: cross-shard forwarding over the mesh's lanes.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test/example may panic: a panic is a failure it reports.

use std::rc::Rc;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use shardcx_shards::proto::ids::ShardId;
use shardcx_shards::{
    BootError, DriverConfig, ForwardError, MeshConfig, MeshStats, Placement, ShardCtx,
    ShardsBuilder,
};

/// Longest any one test's shard set may run.
const LIMIT: Duration = Duration::from_secs(60);

fn builder(shards: usize) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(shards)
        .placement(Placement::Unpinned)
        .transports("sm,self")
}

/// Run `f` on another thread and fail the test if it takes longer than `limit`.
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("shards still running after {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the shard set panicked"),
    }
}

fn sid(i: usize) -> ShardId {
    ShardId::new(u16::try_from(i).unwrap())
}

/// A content check: a value that depends on the request and on the shard that served it.
fn mix(x: u64, shard: ShardId) -> u64 {
    x.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ u64::from(shard.get())
}

/// `n` forwards from this shard to `to`, `width` at a time; returns how many were checked.
async fn fan_out(ctx: &Rc<ShardCtx>, to: ShardId, n: u64, width: u64) -> u64 {
    let mut tasks = Vec::new();
    for w in 0..width {
        let ctx = ctx.clone();
        tasks.push(glommio::spawn_local(async move {
            let mut ok = 0;
            let mut i = w;
            while i < n {
                let payload = vec![(i % 251) as u8; (i % 64) as usize];
                let got = ctx
                    .forward(to, move |c| async move {
                        (
                            c.id(),
                            mix(i, c.id()),
                            payload.iter().map(|&b| u64::from(b)).sum::<u64>(),
                        )
                    })
                    .await
                    .unwrap();
                assert_eq!(got.0, to, "served by the wrong shard");
                assert_eq!(got.1, mix(i, to));
                assert_eq!(got.2, (i % 251) * (i % 64));
                ok += 1;
                i += width;
            }
            ok
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await;
    }
    total
}

#[test]
fn two_shards_forward_and_resolve() {
    let out = within(LIMIT, || {
        builder(2).run(|ctx: Rc<ShardCtx>| async move {
            let me = ctx.id();
            let other = sid(1 - me.index());
            let (who, depth, v) = ctx
                .forward(other, move |c| async move {
                    (c.id(), c.forward_depth(), u32::from(me.get()) + 40)
                })
                .await
                .unwrap();
            assert_eq!((who, depth, v), (other, 1, u32::from(me.get()) + 40));
            // To itself: runs here, at this depth.
            let (who, depth) = ctx
                .forward(me, |c| async move { (c.id(), c.forward_depth()) })
                .await
                .unwrap();
            assert_eq!((who, depth), (me, 0));
            let e = ctx.forward(sid(7), |_| async {}).await.unwrap_err();
            assert!(
                matches!(e, ForwardError::NoSuchShard { shard_count: 2, .. }),
                "{e}"
            );
            me
        })
    })
    .unwrap();
    assert_eq!(out, vec![sid(0), sid(1)]);
}

#[test]
fn ten_thousand_across_all_pairs() {
    const TOTAL: u64 = 10_000;
    for shards in [2usize, 3] {
        let pairs = (shards * (shards - 1)) as u64;
        let per_pair = TOTAL.div_ceil(pairs);
        let out = within(LIMIT, move || {
            builder(shards).run(move |ctx: Rc<ShardCtx>| async move {
                let mut tasks = Vec::new();
                for to in (0..shards).filter(|&j| j != ctx.id().index()) {
                    let ctx = ctx.clone();
                    tasks.push(glommio::spawn_local(async move {
                        fan_out(&ctx, sid(to), per_pair, 32).await
                    }));
                }
                let mut n = 0;
                for t in tasks {
                    n += t.await;
                }
                n
            })
        })
        .unwrap();
        let total: u64 = out.iter().sum();
        assert_eq!(total, per_pair * pairs, "{shards} shards");
        assert!(total >= TOTAL);
    }
}

/// Every shard forwards to every other, many at once, through lanes of capacity 2: the
/// requests form cycles (A → B while B → A) and, with `nested`, every job forwards again to the
/// next shard (which is back to the caller with 2 shards).
fn cycles(shards: usize, per_pair: u64, nested: bool) {
    let out = within(LIMIT, move || {
        builder(shards)
            .lane_capacity(2)
            .run(move |ctx: Rc<ShardCtx>| async move {
                let me = ctx.id().index();
                let mut tasks = Vec::new();
                for to in (0..shards).filter(|&j| j != me) {
                    for i in 0..per_pair {
                        let ctx = ctx.clone();
                        tasks.push(glommio::spawn_local(async move {
                            ctx.forward(sid(to), move |c| async move {
                                let here = c.id();
                                if nested {
                                    let next = sid((here.index() + 1) % shards);
                                    let (there, depth) = c
                                        .forward(
                                            next,
                                            |c| async move { (c.id(), c.forward_depth()) },
                                        )
                                        .await
                                        .unwrap();
                                    assert_eq!(there, next);
                                    assert_eq!(depth, 2);
                                }
                                mix(i, here)
                            })
                            .await
                            .unwrap()
                                == mix(i, sid(to))
                        }));
                    }
                }
                let mut ok = 0u64;
                for t in tasks {
                    ok += u64::from(t.await);
                }
                ok
            })
    })
    .unwrap();
    let want = per_pair * (shards as u64 - 1);
    assert!(out.iter().all(|&n| n == want), "{out:?}");
}

#[test]
fn cycles_under_tiny_lanes_two_shards() {
    cycles(2, 2000, false);
}

#[test]
fn cycles_under_tiny_lanes_three_shards() {
    cycles(3, 1000, false);
}

#[test]
fn nested_cycles_under_tiny_lanes_back_to_caller() {
    cycles(2, 1000, true);
}

#[test]
fn nested_cycles_under_tiny_lanes_to_third_shard() {
    cycles(3, 500, true);
}

#[test]
fn more_shards_than_cores() {
    // 5 shards on this 2-core machine, tiny lanes, nested cycles.
    cycles(5, 200, true);
}

#[test]
fn nesting_depth_and_limit() {
    let out = within(LIMIT, || {
        builder(3)
            .mesh(MeshConfig {
                lane_capacity: 4,
                max_depth: 2,
                ..MeshConfig::default()
            })
            .run(|ctx: Rc<ShardCtx>| async move {
                if ctx.id().index() != 0 {
                    return None;
                }
                // 0 → 1 (depth 1) → 2 (depth 2) → 0 refused: depth 2 is the limit.
                let r = ctx
                    .forward(sid(1), |c| async move {
                        let d1 = c.forward_depth();
                        let inner = c
                            .forward(sid(2), |c| async move {
                                let d2 = c.forward_depth();
                                let again = c.forward(sid(0), |_| async {}).await;
                                // A forward to itself needs no lane and no permit.
                                let local = c.forward(sid(2), |c| async move { c.id() }).await;
                                (d2, again, local)
                            })
                            .await
                            .unwrap();
                        (d1, inner)
                    })
                    .await
                    .unwrap();
                Some(r)
            })
    })
    .unwrap();
    let (d1, (d2, again, local)) = out[0].clone().unwrap();
    assert_eq!((d1, d2), (1, 2));
    assert!(
        matches!(again, Err(ForwardError::TooDeep { depth: 2, .. })),
        "{again:?}"
    );
    assert_eq!(local, Ok(sid(2)));
}

#[test]
fn finished_shard_keeps_serving() {
    let out = within(LIMIT, || {
        builder(3).run(|ctx: Rc<ShardCtx>| async move {
            match ctx.id().index() {
                // Shards 0 and 2 end at once; shard 1 forwards to them afterwards, and their
                // jobs forward between themselves.
                0 | 2 => 0,
                _ => {
                    glommio::timer::sleep(Duration::from_millis(100)).await;
                    let mut n = 0;
                    for i in 0..200u64 {
                        let to = sid(if i % 2 == 0 { 0 } else { 2 });
                        let back = ctx
                            .forward(to, move |c| async move {
                                let other = sid(2 - c.id().index());
                                c.forward(other, move |c| async move { mix(i, c.id()) })
                                    .await
                                    .unwrap()
                            })
                            .await
                            .unwrap();
                        assert_eq!(back, mix(i, sid(2 - to.index())));
                        n += 1;
                    }
                    n
                }
            }
        })
    })
    .unwrap();
    assert_eq!(out, vec![0, 200, 0]);
}

#[test]
fn tasks_left_behind_are_refused() {
    let seen = Arc::new(Mutex::new(None));
    let seen2 = seen.clone();
    within(LIMIT, move || {
        builder(2).run(move |ctx: Rc<ShardCtx>| {
            let seen = seen2.clone();
            async move {
                if ctx.id().index() == 0 {
                    let c = ctx.clone();
                    glommio::spawn_local(async move {
                        glommio::timer::sleep(Duration::from_millis(50)).await;
                        let r = c.forward(sid(1), |_| async {}).await;
                        *seen.lock().unwrap() = Some(r);
                    })
                    .detach();
                } else {
                    // Keeps the set alive while shard 0's leftover task runs.
                    glommio::timer::sleep(Duration::from_millis(300)).await;
                }
            }
        })
    })
    .unwrap();
    let r = seen
        .lock()
        .unwrap()
        .take()
        .expect("the leftover task never ran");
    assert!(matches!(r, Err(ForwardError::ShuttingDown { .. })), "{r:?}");
}

#[test]
fn job_panic_is_typed_and_target_survives() {
    let out = within(LIMIT, || {
        builder(2).run(|ctx: Rc<ShardCtx>| async move {
            if ctx.id().index() != 0 {
                return None;
            }
            let e = ctx
                .forward(sid(1), |_| async {
                    if true {
                        panic!("boom in a job");
                    }
                })
                .await
                .unwrap_err();
            let after = ctx.forward(sid(1), |c| async move { c.id() }).await;
            Some((e, after))
        })
    })
    .unwrap();
    let (e, after) = out[0].clone().unwrap();
    assert!(
        matches!(&e, ForwardError::JobPanicked { shard, message } if *shard == sid(1) && message.contains("boom")),
        "{e:?}"
    );
    assert_eq!(after, Ok(sid(1)));
}

#[test]
fn stopped_shard_fails_pending_and_new_forwards() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let seen2 = seen.clone();
    let r = within(LIMIT, move || {
        builder(2).run(move |ctx: Rc<ShardCtx>| {
            let seen = seen2.clone();
            async move {
                if ctx.id().index() == 0 {
                    glommio::timer::sleep(Duration::from_millis(100)).await;
                    panic!("shard 0 fails on purpose");
                }
                // A job that shard 0 will never answer, then one sent after it has gone.
                let pending = ctx
                    .forward(sid(0), |_| async {
                        glommio::timer::sleep(Duration::from_secs(30)).await;
                    })
                    .await;
                seen.lock().unwrap().push(pending);
                let later = ctx.forward(sid(0), |_| async {}).await;
                seen.lock().unwrap().push(later);
            }
        })
    });
    assert!(matches!(r, Err(BootError::Panicked { shard: 0 })), "{r:?}");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2);
    for r in seen.iter() {
        assert!(matches!(r, Err(ForwardError::ShardStopped { .. })), "{r:?}");
    }
}

#[test]
fn dropped_callers_give_permits_back() {
    let out = within(LIMIT, || {
        builder(2)
            .lane_capacity(2)
            .run(|ctx: Rc<ShardCtx>| async move {
                if ctx.id().index() != 0 {
                    return 0;
                }
                // Give up on 20 slow jobs (more than the lane holds: some give up while
                // waiting for a permit, some after sending).
                for _ in 0..20 {
                    let slow = ctx.forward(sid(1), |_| async {
                        glommio::timer::sleep(Duration::from_millis(20)).await;
                    });
                    let gave_up = futures_lite::future::or(async { slow.await.is_err() }, async {
                        glommio::timer::sleep(Duration::from_millis(1)).await;
                        true
                    });
                    assert!(gave_up.await);
                }
                // Their permits come back as their jobs end.
                let mut n = 0;
                for i in 0..100 {
                    let v = ctx
                        .forward(sid(1), move |_| async move { i })
                        .await
                        .unwrap();
                    assert_eq!(v, i);
                    n += 1;
                }
                n
            })
    })
    .unwrap();
    assert_eq!(out, vec![100, 0]);
}

#[test]
fn sleeping_driver_does_not_delay_forwards() {
    let out = within(LIMIT, || {
        builder(2).run(|ctx: Rc<ShardCtx>| async move {
            if ctx.id().index() != 0 {
                return None;
            }
            let mut worst = Duration::ZERO;
            let mut all = Vec::new();
            for _ in 0..10 {
                // Both shards idle long enough for their drivers (and executors) to sleep.
                glommio::timer::sleep(Duration::from_millis(100)).await;
                let t0 = Instant::now();
                let slept = ctx
                    .forward(sid(1), |c| async move { c.driver_sleeps() })
                    .await
                    .unwrap();
                let dt = t0.elapsed();
                assert!(slept > 0, "the target's driver never slept");
                worst = worst.max(dt);
                all.push(dt);
            }
            all.sort();
            let there = ctx
                .forward(sid(1), |c| async move { c.mesh_stats() })
                .await
                .unwrap();
            Some((all[all.len() / 2], worst, there))
        })
    })
    .unwrap();
    let (median, worst, there) = out[0].unwrap();
    eprintln!("forward to a sleeping shard: median {median:?}, worst {worst:?}; {there:?}");
    // The driver sleeps up to 50 ms at a time; a forward waiting for it would show that.
    assert!(median < Duration::from_millis(5), "median {median:?}");
    assert!(worst < Duration::from_millis(40), "worst {worst:?}");
    // Taken by the inbox task, woken by the sender: the driver slept. (It may take one that
    // arrives as its sleep times out, but not all ten.)
    assert!(there.taken_by_task > 0, "{there:?}");
}

/// A forward to a shard whose driver spins is taken by that driver, within a progress round,
/// and so is its completion on the calling shard (the mesh's former lanes were looked at only
/// at the progress queue's preempt).
#[test]
fn spinning_drivers_take_forwards_themselves() {
    const N: u64 = 2_000;
    let out = within(LIMIT, || {
        builder(2)
            // A spin window no run reaches: both drivers spin from start to end.
            .driver(DriverConfig {
                spin: Duration::from_secs(3600),
            })
            .run(|ctx: Rc<ShardCtx>| async move {
                if ctx.id().index() != 0 {
                    return None;
                }
                let mut all = Vec::with_capacity(N as usize);
                for i in 0..N {
                    let t0 = Instant::now();
                    let v = ctx
                        .forward(sid(1), move |c| async move { mix(i, c.id()) })
                        .await
                        .unwrap();
                    all.push(t0.elapsed());
                    assert_eq!(v, mix(i, sid(1)));
                }
                all.sort();
                let there = ctx
                    .forward(sid(1), |c| async move { c.mesh_stats() })
                    .await
                    .unwrap();
                Some((ctx.mesh_stats(), there, all[all.len() / 2]))
            })
    })
    .unwrap();
    let (here, there, median): (MeshStats, MeshStats, Duration) = out[0].unwrap();
    eprintln!("forward to a spinning shard: median {median:?}; here {here:?}, there {there:?}");
    // Requests are taken on shard 1, completions on shard 0. The inbox task takes only what
    // arrives while glommio looks at other threads' wake-ups (at a preempt, every 500 µs) or
    // after the OS has descheduled the thread there: a few, on a loaded machine. Not timed:
    // the counters say who took them.
    assert!(there.taken_by_driver > N / 2, "there {there:?}");
    assert!(here.taken_by_driver > N / 2, "here {here:?}");
    assert!(there.taken_by_driver + there.taken_by_task >= N);
}

#[test]
fn settings_and_errors_are_send() {
    fn send<T: Send + 'static>() {}
    fn sync<T: Sync>() {}
    send::<MeshConfig>();
    send::<MeshStats>();
    sync::<MeshStats>();
    send::<ForwardError>();
    sync::<ForwardError>();
    send::<ShardsBuilder>();
}
