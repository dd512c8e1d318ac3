//! CUDA device memory: the driver probe, the mode a shard runs in, and [`DeviceBuffer`].
//!
//! Built with cudarc's run-time loading (`dynamic-loading`, a fixed CUDA version feature), so
//! building needs no CUDA toolkit, `nvcc` or `libcuda`, and a machine without them runs with
//! CUDA off: every device API returns [`CudaError::Unavailable`] saying why, and nothing
//! panics.
//!
//! ## Modes
//!
//! [`probe`] decides, for one UCX [`Context`](crate::Context), one [`CudaMode`]:
//!
//! - [`CudaMode::Off`]: no `libcuda`, no device, or turned off; the reason is kept.
//! - [`CudaMode::ZeroCopy`]: the loaded UCX moves CUDA memory itself (the
//!   `UCS_MEMORY_TYPE_CUDA` bit of `ucp_context_query`'s memory types: a UCX built with its
//!   `cuda_copy`/`cuda_ipc` transports, such as PyPI's `libucx-cu12` wheels). Device pointers
//!   may then be handed to UCX, with memory-type hints.
//! - [`CudaMode::Staging`]: a device is there but the loaded UCX does not move CUDA memory (the
//!   UCX 1.12 that ucx1-sys bundles has no CUDA transports). A device pointer must then never
//!   reach UCX: UCX would read it as host memory and crash. Device data goes through host
//!   bounce buffers instead.
//!
//! `SHARDCX_CUDA=off|staging|zero-copy|auto` ([`ModeRequest::from_env`]) overrides the choice
//! for tests; asking for a mode the machine cannot run (zero-copy on a UCX without CUDA memory
//! support, staging without a device) is an error ([`CudaError::ZeroCopyUnsupported`],
//! [`CudaError::Unavailable`]), never a crash.
//!
//! ## Driver calls
//!
//! See `driver.rs`: only cudarc's loader is used, every entry point is looked up by this crate
//! (a missing one is [`CudaError::MissingEntryPoint`]) and every `CUresult` is read as a raw
//! integer, since a code unknown to cudarc's generated enum would be undefined behaviour.

mod buffer;
mod driver;
mod pinned;

use std::fmt;

pub use buffer::{CudaDevice, DeviceBuffer};
pub use driver::{driver, DeviceInfo, DriverInfo};
pub use pinned::{PendingCopy, PinnedBuf};

use crate::context::MemoryTypes;

/// The environment variable that overrides the CUDA mode: `off`, `staging`, `zero-copy` or
/// `auto` (the default: probe).
pub const CUDA_MODE_ENV: &str = "SHARDCX_CUDA";

/// Why CUDA cannot be used on this machine.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Unavailable {
    /// No file of the driver library (`libcuda.so`, `libcuda.so.1`, ...) could be loaded.
    #[error("libcuda not found (no NVIDIA driver on this machine)")]
    NoLibrary,
    /// `cuInit` reported no CUDA-capable device, or the driver lists none.
    #[error("no CUDA device")]
    NoDevice,
    /// `cuInit` failed for another reason (a driver/kernel-module mismatch, say).
    #[error("cuInit failed: {0}")]
    InitFailed(String),
    /// The driver loaded but a call made while listing devices failed.
    #[error("the CUDA driver failed: {0}")]
    DriverFailed(String),
    /// CUDA works here but was turned off (`SHARDCX_CUDA=off`).
    #[error("turned off ({CUDA_MODE_ENV}=off)")]
    TurnedOff,
}

/// An error of a CUDA operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CudaError {
    /// CUDA cannot be used here at all.
    #[error("cuda unavailable: {0}")]
    Unavailable(Unavailable),
    /// A driver call failed.
    #[error("cuda: {op} failed: {message}")]
    Driver {
        /// The driver function.
        op: &'static str,
        /// The raw `CUresult`.
        code: i32,
        /// The driver's description of the code.
        message: String,
    },
    /// The loaded driver lacks an entry point this crate calls (a driver older than CUDA 12).
    #[error("cuda: the driver has no entry point {name} (driver too old?)")]
    MissingEntryPoint {
        /// The symbol.
        name: String,
    },
    /// A device ordinal the driver does not list.
    #[error("cuda: no device {ordinal} (the driver lists {count})")]
    NoSuchDevice {
        /// The ordinal asked for.
        ordinal: usize,
        /// How many devices there are.
        count: usize,
    },
    /// A copy's range does not fit the device buffer.
    #[error("cuda: {len} bytes at offset {offset} do not fit a {buffer_len}-byte device buffer")]
    OutOfBounds {
        /// Offset into the device buffer.
        offset: usize,
        /// Bytes to copy.
        len: usize,
        /// The device buffer's length.
        buffer_len: usize,
    },
    /// Zero-copy mode was asked for, but the loaded UCX does not move CUDA memory.
    #[error(
        "cuda: zero-copy asked for ({CUDA_MODE_ENV}=zero-copy) but the loaded UCX does not move \
         CUDA memory (its memory types: {memory_types}); load a UCX built with CUDA, or use \
         staging"
    )]
    ZeroCopyUnsupported {
        /// The memory types the loaded UCX reports.
        memory_types: MemoryTypes,
    },
    /// The `SHARDCX_CUDA` value is not a mode.
    #[error("{CUDA_MODE_ENV}={value:?} is not one of off, staging, zero-copy, auto")]
    InvalidMode {
        /// The value found.
        value: String,
    },
}

/// How a shard moves CUDA device memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaMode {
    /// No CUDA: device buffers cannot be used.
    Off,
    /// Device data goes through pinned host bounce buffers; UCX never sees a device pointer.
    Staging,
    /// UCX moves device memory itself.
    ZeroCopy,
}

/// The mode asked for, before probing (`SHARDCX_CUDA`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ModeRequest {
    /// Probe: zero-copy when UCX moves CUDA memory, staging when only a device is there, else
    /// off.
    #[default]
    Auto,
    /// Off whatever the machine has.
    Off,
    /// Staging even when UCX could move device memory (fails without a device).
    Staging,
    /// Zero-copy (fails on a UCX without CUDA memory support, or without a device).
    ZeroCopy,
}

/// Why there is no device to use with `driver` (the probed driver, or why there is none):
/// its own reason, [`Unavailable::NoDevice`] when it sees no device, `None` when it has one.
pub fn device_unavailable(driver: Result<&DriverInfo, &Unavailable>) -> Option<Unavailable> {
    match driver {
        Err(u) => Some(u.clone()),
        Ok(d) if d.devices.is_empty() => Some(Unavailable::NoDevice),
        Ok(_) => None,
    }
}

/// What [`probe`] found and decided for one UCX context.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaProbe {
    /// The driver and its devices, or why there is none.
    pub driver: Result<DriverInfo, Unavailable>,
    /// The memory types the UCX context supports (`ucp_context_query`), or why they are unknown.
    pub ucx_memory_types: Result<MemoryTypes, String>,
    /// What was asked for.
    pub request: ModeRequest,
    /// The mode decided.
    pub mode: CudaMode,
    /// Why the mode is [`CudaMode::Off`] (`None` otherwise).
    pub off_reason: Option<String>,
}

impl CudaMode {
    /// The mode's name as `SHARDCX_CUDA` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            CudaMode::Off => "off",
            CudaMode::Staging => "staging",
            CudaMode::ZeroCopy => "zero-copy",
        }
    }
}

impl ModeRequest {
    /// The request in [`CUDA_MODE_ENV`]: unset or empty is [`ModeRequest::Auto`]; otherwise one
    /// of `off`, `staging`, `zero-copy`, `auto` (any case, surrounding blanks ignored), and
    /// anything else is [`CudaError::InvalidMode`].
    pub fn from_env() -> Result<Self, CudaError> {
        match std::env::var(CUDA_MODE_ENV) {
            Ok(v) => v.parse(),
            Err(std::env::VarError::NotPresent) => Ok(ModeRequest::Auto),
            Err(std::env::VarError::NotUnicode(v)) => Err(CudaError::InvalidMode {
                value: v.to_string_lossy().into_owned(),
            }),
        }
    }

    /// The request's name as `SHARDCX_CUDA` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            ModeRequest::Auto => "auto",
            ModeRequest::Off => "off",
            ModeRequest::Staging => "staging",
            ModeRequest::ZeroCopy => "zero-copy",
        }
    }

    /// The mode this request gives with `driver` and a UCX whose memory types are
    /// `ucx_memory_types`, and the reason when that is off. Pure: the decision [`probe`] makes,
    /// testable with any inputs.
    pub fn decide(
        self,
        driver: Result<&DriverInfo, &Unavailable>,
        ucx_memory_types: Result<MemoryTypes, &str>,
    ) -> Result<(CudaMode, Option<String>), CudaError> {
        let ucx_moves_cuda = ucx_memory_types.is_ok_and(MemoryTypes::cuda);
        let device = device_unavailable(driver).map_or(Ok(()), Err);
        match self {
            ModeRequest::Off => Ok((CudaMode::Off, Some(Unavailable::TurnedOff.to_string()))),
            ModeRequest::ZeroCopy if !ucx_moves_cuda => Err(CudaError::ZeroCopyUnsupported {
                memory_types: ucx_memory_types.unwrap_or_default(),
            }),
            ModeRequest::ZeroCopy => device
                .map(|()| (CudaMode::ZeroCopy, None))
                .map_err(CudaError::Unavailable),
            ModeRequest::Staging => device
                .map(|()| (CudaMode::Staging, None))
                .map_err(CudaError::Unavailable),
            ModeRequest::Auto => Ok(match device {
                Err(u) => (CudaMode::Off, Some(u.to_string())),
                Ok(()) if ucx_moves_cuda => (CudaMode::ZeroCopy, None),
                Ok(()) => (CudaMode::Staging, None),
            }),
        }
    }
}

impl std::str::FromStr for ModeRequest {
    type Err = CudaError;

    fn from_str(s: &str) -> Result<Self, CudaError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(ModeRequest::Auto),
            "off" => Ok(ModeRequest::Off),
            "staging" => Ok(ModeRequest::Staging),
            "zero-copy" => Ok(ModeRequest::ZeroCopy),
            _ => Err(CudaError::InvalidMode {
                value: s.to_string(),
            }),
        }
    }
}

impl fmt::Display for CudaMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for ModeRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Probes the driver (once per process) and `context`'s memory types, and decides the mode
/// `request` gives. Never panics; `Err` only when `request` forces a mode this machine cannot
/// run.
pub fn probe(context: &crate::Context, request: ModeRequest) -> Result<CudaProbe, CudaError> {
    let driver = driver().cloned();
    let ucx_memory_types = context.memory_types().map_err(|e| e.to_string());
    let (mode, off_reason) = request.decide(
        driver.as_ref(),
        ucx_memory_types.as_ref().copied().map_err(String::as_str),
    )?;
    Ok(CudaProbe {
        driver,
        ucx_memory_types,
        request,
        mode,
        off_reason,
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // A test may panic: a panic is a failure it reports.
mod tests {
    use super::*;

    fn one_gpu() -> DriverInfo {
        DriverInfo {
            version: 12060,
            devices: vec![DeviceInfo {
                ordinal: 0,
                name: "Test GPU".into(),
                total_memory: 80 << 30,
            }],
        }
    }

    const HOST: MemoryTypes = MemoryTypes::from_bits(1);
    const HOST_CUDA: MemoryTypes = MemoryTypes::from_bits(0b11);

    #[test]
    fn parses_every_mode_and_refuses_others() {
        for (s, want) in [
            ("", ModeRequest::Auto),
            ("auto", ModeRequest::Auto),
            ("off", ModeRequest::Off),
            (" OFF ", ModeRequest::Off),
            ("staging", ModeRequest::Staging),
            ("zero-copy", ModeRequest::ZeroCopy),
            ("Zero-Copy", ModeRequest::ZeroCopy),
        ] {
            assert_eq!(s.parse::<ModeRequest>(), Ok(want), "{s:?}");
        }
        for bad in ["on", "cuda", "zero copy", "zerocopy", "stage", "0"] {
            assert_eq!(
                bad.parse::<ModeRequest>(),
                Err(CudaError::InvalidMode { value: bad.into() })
            );
        }
        for m in [
            ModeRequest::Auto,
            ModeRequest::Off,
            ModeRequest::Staging,
            ModeRequest::ZeroCopy,
        ] {
            assert_eq!(m.as_str().parse::<ModeRequest>(), Ok(m));
        }
    }

    #[test]
    fn auto_picks_by_driver_device_and_ucx() {
        let gpu = one_gpu();
        let none = DriverInfo {
            version: 12060,
            devices: vec![],
        };
        let auto = ModeRequest::Auto;
        assert_eq!(
            auto.decide(Ok(&gpu), Ok(HOST_CUDA)),
            Ok((CudaMode::ZeroCopy, None))
        );
        assert_eq!(
            auto.decide(Ok(&gpu), Ok(HOST)),
            Ok((CudaMode::Staging, None))
        );
        assert_eq!(
            auto.decide(Ok(&gpu), Err("query failed")),
            Ok((CudaMode::Staging, None))
        );
        assert_eq!(
            auto.decide(Ok(&none), Ok(HOST_CUDA)),
            Ok((CudaMode::Off, Some("no CUDA device".into())))
        );
        let (mode, reason) = auto.decide(Err(&Unavailable::NoLibrary), Ok(HOST)).unwrap();
        assert_eq!(mode, CudaMode::Off);
        assert!(reason.unwrap().contains("libcuda not found"));
    }

    #[test]
    fn forced_modes_fail_with_typed_errors() {
        let gpu = one_gpu();
        let no_lib = Unavailable::NoLibrary;
        assert_eq!(
            ModeRequest::ZeroCopy.decide(Ok(&gpu), Ok(HOST)),
            Err(CudaError::ZeroCopyUnsupported { memory_types: HOST })
        );
        assert_eq!(
            ModeRequest::ZeroCopy.decide(Err(&no_lib), Ok(HOST_CUDA)),
            Err(CudaError::Unavailable(Unavailable::NoLibrary))
        );
        assert_eq!(
            ModeRequest::ZeroCopy.decide(Ok(&gpu), Ok(HOST_CUDA)),
            Ok((CudaMode::ZeroCopy, None))
        );
        assert_eq!(
            ModeRequest::Staging.decide(Ok(&gpu), Ok(HOST_CUDA)),
            Ok((CudaMode::Staging, None))
        );
        assert_eq!(
            ModeRequest::Staging.decide(Err(&no_lib), Ok(HOST)),
            Err(CudaError::Unavailable(Unavailable::NoLibrary))
        );
        let (mode, reason) = ModeRequest::Off.decide(Ok(&gpu), Ok(HOST_CUDA)).unwrap();
        assert_eq!(mode, CudaMode::Off);
        assert!(reason.unwrap().contains("SHARDCX_CUDA=off"));
    }
}
