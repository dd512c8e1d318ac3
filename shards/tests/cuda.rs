//! The CUDA probe on running shards: every shard probes at start and keeps its mode; a forced
//! mode the machine cannot run fails the start with a typed error; on a shard whose mode is
//! off, device allocation returns the reason.
//!
//! Without a GPU but with a C compiler, [`gpu_branches_against_a_fake_driver`] runs the other
//! tests again in a child process that loads the fake `libcuda` of
//! `shards/ucx/tests/fake_cuda` (device memory in host memory, copies done at once), so that
//! their GPU branches (the per-shard device, staged transfers through `CudaCopyEngine`) run too.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::rc::Rc;

use shardcx_shards::cuda::{
    device_unavailable, driver, CudaCopyEngine, CudaDevice, CudaError, CudaMode, DeviceBuffer,
    ModeRequest, PinnedBuf,
};
use shardcx_shards::proto::staging::{Direction, Staging, StagingConfig, State};
use shardcx_shards::{BootError, Placement, ShardCtx, ShardsBuilder};

#[path = "../ucx/tests/fake_cuda/mod.rs"]
mod fake_cuda;
use fake_cuda::{FakeDriver, FAKE_ENV};

fn builder(request: ModeRequest) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("sm,self")
        .io_memory(1 << 20)
        .cuda(request)
}

/// What one shard saw: its mode, why it is off, what an allocation of 1 KiB returned.
type Seen = (CudaMode, Option<String>, Result<usize, CudaError>);

/// What each shard saw.
fn modes(request: ModeRequest) -> Result<Vec<Seen>, BootError> {
    builder(request).run(|ctx: Rc<ShardCtx>| async move {
        let cuda = ctx.cuda();
        assert_eq!(cuda.device().is_some(), cuda.mode() != CudaMode::Off);
        (
            cuda.mode(),
            cuda.probe().off_reason.clone(),
            cuda.alloc(1024).map(|b| b.len()),
        )
    })
}

#[test]
fn every_shard_probes_and_an_off_shard_refuses_device_memory() {
    let got = modes(ModeRequest::Auto).expect("auto always starts");
    assert_eq!(got.len(), 2);
    let no_device = device_unavailable(driver().as_ref().map(|d| *d));
    for (mode, reason, alloc) in got {
        match &no_device {
            Some(u) => {
                assert_eq!(mode, CudaMode::Off);
                assert_eq!(reason, Some(u.to_string()));
                assert_eq!(alloc, Err(CudaError::Unavailable(u.clone())));
            }
            None => {
                assert_ne!(mode, CudaMode::Off);
                assert_eq!(alloc, Ok(1024));
            }
        }
    }
    for (mode, reason, alloc) in modes(ModeRequest::Off).expect("off always starts") {
        assert_eq!(mode, CudaMode::Off);
        assert!(reason.unwrap().contains("SHARDCX_CUDA=off"));
        assert!(matches!(alloc, Err(CudaError::Unavailable(_))), "{alloc:?}");
    }
}

#[test]
fn a_forced_mode_this_machine_cannot_run_fails_the_start() {
    if driver().is_ok_and(|d| !d.devices.is_empty()) {
        // Staging runs wherever there is a device; zero-copy depends on the UCX loaded, which
        // tests/cuda.rs of shardcx-ucx checks.
        let got = modes(ModeRequest::Staging).expect("staging with a device");
        assert!(got.iter().all(|(m, _, _)| *m == CudaMode::Staging));
        return;
    }
    for request in [ModeRequest::Staging, ModeRequest::ZeroCopy] {
        match modes(request) {
            Err(BootError::Cuda { source, .. }) => {
                assert!(
                    matches!(
                        source,
                        CudaError::Unavailable(_) | CudaError::ZeroCopyUnsupported { .. }
                    ),
                    "{request}: {source:?}"
                );
            }
            other => panic!("{request}: expected a CUDA boot error, got {other:?}"),
        }
    }
}

/// The staging scheduler driving real CUDA copies: a device buffer out through pinned bounce
/// buffers to a "wire" vector, and back into a second device buffer, in both directions with
/// several chunks in flight. Needs a GPU; says so and returns where there is none.
#[test]
fn staged_transfers_through_pinned_bounce_buffers() {
    if std::env::var_os(FAKE_ENV).is_some() {
        assert!(
            driver().is_ok(),
            "the fake driver loads: {:?}",
            driver().err()
        );
    }
    if !driver().is_ok_and(|d| !d.devices.is_empty()) {
        eprintln!("skipped: no CUDA device ({:?})", driver().err());
        return;
    }
    let device = CudaDevice::open(0).expect("device 0");
    let cfg = StagingConfig {
        chunk: 1 << 20,
        bounce_buffers: 3,
    };
    let len = (5 << 20) + 12345;
    let data: Vec<u8> = (0..len).map(|i| (i * 13 + (i >> 20)) as u8).collect();
    let bounce = || {
        (0..cfg.bounce_buffers)
            .map(|_| PinnedBuf::alloc(&device, cfg.chunk).expect("pinned"))
            .collect::<Vec<_>>()
    };

    // Device -> bounce -> wire.
    let mut src = DeviceBuffer::from_host(&device, &data).expect("source");
    let mut wire = vec![0u8; len];
    let mut engine = CudaCopyEngine::new(&mut src, bounce());
    let mut s = Staging::new(Direction::Send, len as u64, cfg).expect("staging");
    while !s.state().is_final() {
        s.pump(&mut engine).expect("copies");
        while let Some(c) = s.poll_send() {
            let buf = engine.buffer(c.buffer).expect("the network's buffer");
            wire[c.offset as usize..c.offset as usize + c.len]
                .copy_from_slice(&buf.as_slice()[..c.len]);
            s.handle_sent(c.index, true).expect("sent");
        }
    }
    assert_eq!(s.state(), State::Done);
    assert_eq!(engine.in_flight(), 0);
    drop(engine);
    assert!(wire == data, "the wire differs from the device buffer");

    // Wire -> bounce -> device.
    let mut dst = DeviceBuffer::alloc(&device, len).expect("destination");
    let mut engine = CudaCopyEngine::new(&mut dst, bounce());
    let mut s = Staging::new(Direction::Recv, len as u64, cfg).expect("staging");
    while !s.state().is_final() {
        s.pump(&mut engine).expect("copies");
        while let Some(c) = s.poll_recv() {
            let buf = engine.buffer(c.buffer).expect("the network's buffer");
            buf.as_mut_slice()[..c.len]
                .copy_from_slice(&wire[c.offset as usize..c.offset as usize + c.len]);
            s.handle_received(c.index, true).expect("received");
        }
    }
    assert_eq!(s.state(), State::Done);
    drop(engine);
    assert!(
        dst.to_vec().expect("read back") == data,
        "the device buffer differs"
    );
}

/// The staged copies of a running shard (`ShardCuda::host_to_device`, `device_to_host`): a
/// length over several chunks both ways, an empty buffer, two copies at once (each gets its own
/// bounce buffers), and lengths that differ as a typed error. Needs a GPU (or the fake driver);
/// without one, no device buffer can be made to copy (the allocation says why).
#[test]
fn staged_copies_on_a_shard() {
    let has_device = driver().is_ok_and(|d| !d.devices.is_empty());
    let request = if has_device {
        ModeRequest::Staging
    } else {
        ModeRequest::Auto
    };
    let out = builder(request)
        .shard_count(1)
        .run(move |ctx: Rc<ShardCtx>| async move {
            let cuda = ctx.cuda();
            if !has_device {
                // No device buffer can exist to copy to or from: the allocation says why.
                return format!("{:?}", cuda.alloc(4).map(|b| b.len()));
            }
            let len = (5 << 20) + 12345;
            let data: Vec<u8> = (0..len).map(|i| (i * 7 + (i >> 16)) as u8).collect();
            let mut dev = cuda.alloc(len).unwrap();
            cuda.host_to_device(&data, &mut dev).await.unwrap();
            let mut back = vec![0u8; len];
            cuda.device_to_host(&mut dev, &mut back).await.unwrap();
            assert!(back == data, "the round trip through the device differs");

            let mut empty = cuda.alloc(0).unwrap();
            cuda.host_to_device(&[], &mut empty).await.unwrap();
            cuda.device_to_host(&mut empty, &mut []).await.unwrap();

            // Two at once on one shard.
            let (mut a, mut b) = (cuda.alloc(3 << 20).unwrap(), cuda.alloc(3 << 20).unwrap());
            let (da, db) = (vec![0xA5u8; 3 << 20], vec![0x5Au8; 3 << 20]);
            let (ra, rb) = futures_lite::future::zip(
                cuda.host_to_device(&da, &mut a),
                cuda.host_to_device(&db, &mut b),
            )
            .await;
            ra.unwrap();
            rb.unwrap();
            assert_eq!(a.to_vec().unwrap(), da);
            assert_eq!(b.to_vec().unwrap(), db);

            let err = cuda
                .host_to_device(&data[..10], &mut dev)
                .await
                .unwrap_err();
            format!("{err}")
        })
        .expect("the shard starts");
    if has_device {
        let want = format!("10 host bytes for a device buffer of {}", (5 << 20) + 12345);
        assert!(out[0].contains(&want), "{out:?}");
    } else {
        assert!(out[0].starts_with("Err(Unavailable("), "{out:?}");
    }
}

/// Short staged copies running at once on a shard share its kept bounce buffers: each takes
/// as many as it has chunks (one here), so after the first round no buffer is allocated again;
/// a long copy (three chunks) takes three of the kept four; more copies at once than kept
/// buffers allocate only what is missing, and the shard keeps one set. Every copy's bytes are
/// checked. Needs a GPU (or the fake driver).
#[test]
fn short_copies_at_once_share_the_kept_bounce_buffers() {
    if !driver().is_ok_and(|d| !d.devices.is_empty()) {
        eprintln!("skipped: no CUDA device ({:?})", driver().err());
        return;
    }
    let out = builder(ModeRequest::Staging)
        .shard_count(1)
        .run(|ctx: Rc<ShardCtx>| async move {
            let cuda = ctx.cuda();
            let set = cuda.staging_config().bounce_buffers as u64;
            // `n` copies of `len` bytes at once, each checked; the allocations after them.
            let at_once = |n: usize, len: usize| async move {
                let mut bufs: Vec<DeviceBuffer> =
                    (0..n).map(|_| cuda.alloc(len).unwrap()).collect();
                let data: Vec<Vec<u8>> = (0..n).map(|k| vec![k as u8 ^ 0x5A; len]).collect();
                let copies: Vec<_> = bufs
                    .iter_mut()
                    .zip(&data)
                    .map(|(b, d)| Box::pin(cuda.host_to_device(d, b)))
                    .collect();
                for r in join(copies).await {
                    r.unwrap();
                }
                for (b, d) in bufs.iter_mut().zip(&data) {
                    assert!(b.to_vec().unwrap() == *d, "a copy of {len} bytes differs");
                }
                cuda.bounce_allocations()
            };
            let first = at_once(set as usize, 1000).await;
            let again = at_once(set as usize, 1000).await;
            let long = at_once(1, (5 << 20) + 1).await;
            let more = at_once(2 * set as usize, 1000).await;
            let after = at_once(set as usize, 1000).await;
            (set, first, again, long, more, after)
        })
        .expect("the shard starts");
    let (set, first, again, long, more, after) = out[0];
    assert_eq!((first, again, long), (set, set, set), "{out:?}");
    assert_eq!((more, after), (2 * set, 2 * set), "{out:?}");
}

/// Polls `futures` together on this task until every one is ready; their outputs in order.
async fn join<F: std::future::Future + Unpin>(mut futures: Vec<F>) -> Vec<F::Output> {
    let mut out: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (f, slot) in futures.iter_mut().zip(out.iter_mut()) {
            if slot.is_none() {
                if let std::task::Poll::Ready(v) = std::pin::Pin::new(f).poll(cx) {
                    *slot = Some(v);
                }
            }
        }
        if out.iter().all(Option::is_some) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
    .await;
    out.into_iter().flatten().collect()
}

/// Runs the other tests again against the fake driver (see the module docs).
#[test]
fn gpu_branches_against_a_fake_driver() {
    if std::env::var_os(FAKE_ENV).is_some() || driver().is_ok() {
        return; // The child itself, or a real driver that the tests already ran against.
    }
    let Some(fake) = FakeDriver::build("shards") else {
        return;
    };
    let out = fake.rerun(
        &["--skip", "gpu_branches_against_a_fake_driver"],
        shardcx_shards::cuda::CUDA_MODE_ENV,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "against the fake driver:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("test result: ok. 5 passed"), "{text}");
}
