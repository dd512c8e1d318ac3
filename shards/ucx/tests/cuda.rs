//! CUDA: the probe, the mode override and every device API, on whatever machine runs the test.
//!
//! Without a driver (CI, this project's build machine) every device API must return
//! `CudaError::Unavailable` with the driver's reason and the probe must say "off" with that
//! reason; with a GPU the same tests move real bytes through device memory instead.
//!
//! Where there is no GPU but a C compiler, [`gpu_branches_against_a_fake_driver`] also runs
//! every other test of this file again in a child process that loads `tests/fake_cuda`'s fake
//! `libcuda` (device memory in host memory, copies done at once): the GPU branches then run
//! too, checking their bookkeeping (not CUDA itself) on every machine.

use shardcx_ucx::cuda::{
    self, CudaDevice, CudaError, CudaMode, DeviceBuffer, ModeRequest, PendingCopy, PinnedBuf,
    Unavailable,
};
use shardcx_ucx::{Context, Features};

#[path = "fake_cuda/mod.rs"]
mod fake_cuda;
use fake_cuda::{FakeDriver, FAKE_ENV};

fn context() -> Context {
    let mut config = shardcx_ucx::Config::from_env().expect("config");
    config.set("TLS", "tcp").expect("tls");
    Context::new(&config, Features::messaging()).expect("context")
}

/// The driver's reason to be unavailable here, or `None` on a machine with a CUDA device.
fn unavailable() -> Option<Unavailable> {
    cuda::device_unavailable(cuda::driver().as_ref().map(|d| *d))
}

#[test]
fn ucx_reports_its_memory_types() {
    let types = context().memory_types().expect("ucp_context_query");
    assert!(types.host(), "{types} ({:#x})", types.bits());
    assert!(types.to_string().contains("host"), "{types}");
    // UCX 1.12 as ucx1-sys builds it has no CUDA transports.
    let v = shardcx_ucx::version();
    if v.loaded.0 == 1 && v.loaded.1 == 12 && v.matches() {
        assert!(!types.cuda(), "the bundled UCX 1.12 reports CUDA: {types}");
    }
}

#[test]
fn auto_probe_is_off_with_the_driver_reason_or_picks_a_mode() {
    let ctx = context();
    let probe = cuda::probe(&ctx, ModeRequest::Auto).expect("auto never fails");
    let ucx_cuda = probe.ucx_memory_types.as_ref().is_ok_and(|t| t.cuda());
    match unavailable() {
        Some(reason) => {
            assert_eq!(probe.mode, CudaMode::Off);
            assert_eq!(probe.off_reason, Some(reason.to_string()));
            assert!(!reason.to_string().is_empty());
        }
        None if ucx_cuda => assert_eq!(probe.mode, CudaMode::ZeroCopy),
        None => assert_eq!(probe.mode, CudaMode::Staging),
    }
    let off = cuda::probe(&ctx, ModeRequest::Off).expect("off never fails");
    assert_eq!(off.mode, CudaMode::Off);
    assert!(off
        .off_reason
        .expect("a reason")
        .contains("SHARDCX_CUDA=off"));
}

#[test]
fn forced_modes_this_machine_cannot_run_are_typed_errors() {
    let ctx = context();
    let types = ctx.memory_types().expect("memory types");
    let zero_copy = cuda::probe(&ctx, ModeRequest::ZeroCopy);
    if !types.cuda() {
        assert_eq!(
            zero_copy,
            Err(CudaError::ZeroCopyUnsupported {
                memory_types: types
            })
        );
        let msg = zero_copy.expect_err("refused").to_string();
        assert!(msg.contains("does not move CUDA memory"), "{msg}");
    }
    let staging = cuda::probe(&ctx, ModeRequest::Staging);
    match unavailable() {
        Some(reason) => assert_eq!(staging, Err(CudaError::Unavailable(reason))),
        None => assert_eq!(staging.expect("staging").mode, CudaMode::Staging),
    }
}

#[test]
fn device_apis_return_typed_errors_or_move_bytes() {
    if std::env::var_os(FAKE_ENV).is_some() {
        let d = cuda::driver().expect("the fake driver loads");
        assert_eq!(d.devices[0].name, "Fake GPU 0", "{d:?}");
    }
    match unavailable() {
        Some(reason) => {
            let want = CudaError::Unavailable(reason);
            assert_eq!(CudaDevice::open(0).map(|_| ()), Err(want.clone()));
            assert_eq!(
                DeviceBuffer::alloc_on(0, 4096).map(|_| ()),
                Err(want.clone())
            );
            assert_eq!(DeviceBuffer::alloc_on(3, 0).map(|_| ()), Err(want.clone()));
            assert!(want.to_string().starts_with("cuda unavailable: "), "{want}");
            // No device value can exist here, so nothing else can be reached: every other
            // operation (copies, pinned buffers, events) hangs off a `CudaDevice`.
        }
        None => {
            let count = cuda::driver().expect("driver").devices.len();
            assert_eq!(
                CudaDevice::open(count).map(|_| ()),
                Err(CudaError::NoSuchDevice {
                    ordinal: count,
                    count
                })
            );
            let device = CudaDevice::open(0).expect("device 0");
            device.make_current().expect("current");
            let data: Vec<u8> = (0..(3 << 20) + 5).map(|i| (i * 7 + 1) as u8).collect();
            let mut buf = DeviceBuffer::from_host(&device, &data).expect("from_host");
            assert_eq!(buf.len(), data.len());
            assert!(buf.is_ready().expect("query"));
            assert_eq!(buf.to_vec().expect("to_vec"), data);
            let mut part = vec![0u8; 100];
            buf.copy_to_host(1000, &mut part).expect("part");
            assert_eq!(part, data[1000..1100]);
            buf.copy_from_host(10, &[0xAB; 5]).expect("patch");
            let back = buf.to_vec().expect("to_vec");
            assert_eq!(&back[10..15], &[0xAB; 5]);
            assert_eq!(back[15..], data[15..]);
            let oob = buf.copy_to_host(data.len() - 1, &mut [0u8; 2]);
            assert!(matches!(oob, Err(CudaError::OutOfBounds { .. })), "{oob:?}");
            let empty = DeviceBuffer::alloc(&device, 0).expect("empty");
            assert!(empty.is_empty());

            // Asynchronous copies through pinned memory, polled, never blocking.
            let wait = |mut p: PendingCopy| loop {
                if let Some(r) = p.poll() {
                    assert!(p.is_done());
                    return r.map_err(|(e, _)| e).expect("copy");
                }
                std::thread::yield_now();
            };
            let pinned = PinnedBuf::alloc(&device, 1 << 20).expect("pinned");
            assert!(pinned.as_slice().iter().all(|&b| b == 0));
            let pinned = wait(buf.copy_to_pinned(2048, pinned, 1 << 20).expect("queued"));
            assert_eq!(pinned.as_slice(), &back[2048..2048 + (1 << 20)]);
            let mut pinned = pinned;
            pinned.as_mut_slice().fill(0x5A);
            let pinned = wait(buf.copy_from_pinned(0, pinned, 4096).expect("queued"));
            assert!(buf.is_ready().expect("query"));
            assert_eq!(
                &buf.to_vec().expect("to_vec")[..4097],
                &[&[0x5A; 4096][..], &back[4096..4097]].concat()[..]
            );
            // Out of range on either side: refused, the pinned buffer handed back.
            let (e, pinned) = buf
                .copy_to_pinned(0, pinned, (1 << 20) + 1)
                .expect_err("too long");
            assert!(matches!(e, CudaError::OutOfBounds { .. }), "{e}");
            let (e, _pinned) = buf
                .copy_from_pinned(data.len() - 10, pinned, 11)
                .expect_err("oob");
            assert!(matches!(e, CudaError::OutOfBounds { .. }), "{e}");
        }
    }
}

#[test]
fn the_override_is_read_from_the_environment() {
    // The only test of this binary that touches SHARDCX_CUDA.
    for (value, want) in [
        ("off", Ok(ModeRequest::Off)),
        ("staging", Ok(ModeRequest::Staging)),
        ("zero-copy", Ok(ModeRequest::ZeroCopy)),
        ("auto", Ok(ModeRequest::Auto)),
        (
            "fast",
            Err(CudaError::InvalidMode {
                value: "fast".into(),
            }),
        ),
    ] {
        std::env::set_var(cuda::CUDA_MODE_ENV, value);
        assert_eq!(ModeRequest::from_env(), want, "{value}");
    }
    std::env::remove_var(cuda::CUDA_MODE_ENV);
    assert_eq!(ModeRequest::from_env(), Ok(ModeRequest::Auto));
}

/// Runs the other tests again against the fake driver (see the module docs).
#[test]
fn gpu_branches_against_a_fake_driver() {
    if std::env::var_os(FAKE_ENV).is_some() {
        return; // The child itself.
    }
    if cuda::driver().is_ok() {
        eprintln!("skipped: a real CUDA driver is here, the tests ran against it");
        return;
    }
    let Some(fake) = FakeDriver::build("ucx") else {
        return;
    };
    let out = fake.rerun(
        &[
            "--skip",
            "gpu_branches_against_a_fake_driver",
            "--test-threads",
            "1",
        ],
        cuda::CUDA_MODE_ENV,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "against the fake driver:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("test result: ok. 6 passed"), "{text}");
}

/// Compile-time checks: device handles may move to another shard, a buffer is not shared.
#[test]
fn auto_traits() {
    trait AmbiguousIfSync<A> {
        fn some_item() {}
    }
    impl<T: ?Sized> AmbiguousIfSync<()> for T {}
    impl<T: ?Sized + Sync> AmbiguousIfSync<u8> for T {}
    // Compiles only if DeviceBuffer is NOT Sync.
    let _ = <DeviceBuffer as AmbiguousIfSync<_>>::some_item;
    fn send<T: Send>() {}
    fn send_sync<T: Send + Sync>() {}
    send::<DeviceBuffer>();
    send::<PinnedBuf>();
    send::<PendingCopy>();
    send_sync::<CudaDevice>();
    send_sync::<CudaError>();
    send_sync::<cuda::CudaProbe>();
}
