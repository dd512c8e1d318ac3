//! The CUDA probe on running shards: every shard probes at start and keeps its mode; a forced
//! mode the machine cannot run fails the start with a typed error; on a shard whose mode is
//! off, device allocation returns the reason.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::rc::Rc;

use shardcx_shards::cuda::{driver, CudaError, CudaMode, ModeRequest, Unavailable};
use shardcx_shards::{BootError, Placement, ShardCtx, ShardsBuilder};

fn builder(request: ModeRequest) -> ShardsBuilder {
    ShardsBuilder::new()
        .shard_count(2)
        .placement(Placement::Unpinned)
        .transports("sm,self")
        .io_memory(1 << 20)
        .cuda(request)
}

/// (mode, off reason, what an allocation of 1 KiB returned) on each shard.
fn modes(
    request: ModeRequest,
) -> Result<Vec<(CudaMode, Option<String>, Result<usize, CudaError>)>, BootError> {
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
    let no_device = match driver() {
        Err(u) => Some(u),
        Ok(d) if d.devices.is_empty() => Some(Unavailable::NoDevice),
        Ok(_) => None,
    };
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
