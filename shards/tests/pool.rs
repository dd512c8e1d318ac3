//! A shard's registered pool: buffers carry the arena's registration, work as operation
//! buffers, and return their block when dropped.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use shardcx_shards::ucx::{AmPayload, AmProto, Endpoint, EpOptions, ErrorMode, IoBuf};
use shardcx_shards::{Placement, ShardCtx, ShardsBuilder};

fn one_shard() -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(1)
        .placement(Placement::Unpinned)
        .transports("sm,self")
        .arena_len(1 << 20)
}

#[test]
fn pool_buffers_are_registered_and_returned() {
    let out = one_shard()
        .run(|ctx: Rc<ShardCtx>| async move {
            let pool = ctx.pool();
            assert!(pool.alloc(0).is_none(), "empty buffers are refused");
            assert!(pool.alloc(64 << 20).is_none(), "larger than the arena");
            let mut a = pool.alloc(1000).expect("1000 B");
            let b = pool.alloc(4096).expect("4 KiB");
            assert_eq!(a.len(), 1000);
            assert!(
                a.mem_handle().is_some(),
                "a pool buffer carries its registration"
            );
            assert!(pool.bytes_in_use() >= 1000 + 4096);
            a.as_mut_slice().unwrap().fill(0xA5);
            assert!(a.as_slice().unwrap().iter().all(|&x| x == 0xA5));
            drop(a);
            drop(b);
            assert_eq!(
                pool.bytes_in_use(),
                0,
                "dropped buffers return their blocks"
            );
            // Exhaust one class; the pool then says so instead of failing elsewhere.
            let mut held = Vec::new();
            while let Some(buf) = pool.alloc(256 << 10) {
                held.push(buf);
                assert!(
                    held.len() <= 4,
                    "1 MiB arena holds at most four 256 KiB blocks"
                );
            }
            assert!(!held.is_empty());
            let n = held.len();
            held.clear();
            assert_eq!(pool.bytes_in_use(), 0);
            n
        })
        .unwrap();
    assert!(out[0] >= 1);
}

#[test]
fn pool_buffer_as_am_payload() {
    let out = one_shard()
        .run(|ctx: Rc<ShardCtx>| async move {
            let got = Rc::new(RefCell::new(None));
            let sink = got.clone();
            ctx.worker()
                .set_am_handler(3, move |_h, p| {
                    if let AmPayload::Data(d) = p {
                        *sink.borrow_mut() = Some(d.as_slice().to_vec());
                    }
                })
                .unwrap();
            let me = ctx.worker().address().unwrap();
            let opts = EpOptions {
                error_mode: ErrorMode::None,
            };
            let ep = Endpoint::connect_to_worker(ctx.worker(), &me, opts).unwrap();
            let mut buf = ctx.pool().alloc(3000).unwrap();
            for (i, x) in buf.as_mut_slice().unwrap().iter_mut().enumerate() {
                *x = (i % 251) as u8;
            }
            let (res, buf) = ep.am_send(3, b"", buf, AmProto::Eager).await;
            res.unwrap();
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while got.borrow().is_none() {
                assert!(
                    std::time::Instant::now() < deadline,
                    "message never arrived"
                );
                ctx.wake_driver();
                glommio::timer::sleep(Duration::from_millis(1)).await;
            }
            let data = got.borrow_mut().take().unwrap();
            assert_eq!(&data[..], buf.as_slice().unwrap());
            drop(buf);
            drop(ep);
            ctx.pool().bytes_in_use()
        })
        .unwrap();
    assert_eq!(out[0], 0);
}
