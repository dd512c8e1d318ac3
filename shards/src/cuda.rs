//! CUDA on a shard: the mode each shard probed at start, and its device.
//!
//! At start every shard probes, on its own thread, right after creating its UCX context and
//! before its worker (see [`crate::ucx::cuda`] for the modes and what they mean): `libcuda`
//! present, a device, and whether its UCX context moves CUDA memory. The request comes from
//! [`ShardsBuilder::cuda`](crate::ShardsBuilder::cuda), else from `SHARDCX_CUDA`, else
//! [`ModeRequest::Auto`]. When the mode is not off the shard opens device `shard % devices` (its
//! primary context and a stream of its own) and makes that context current on its thread
//! before the worker exists, as UCX's CUDA transports require. A forced mode the machine
//! cannot run fails the start with [`BootError::Cuda`](crate::BootError::Cuda); with no
//! driver, an automatic probe says "off" and why, and nothing else changes.
//!
//! What the modes move today: see the README's "CUDA" section. The staging scheduler lives in
//! [`proto::staging`](crate::proto::staging).

pub use crate::ucx::cuda::{
    driver, probe, CudaDevice, CudaError, CudaMode, CudaProbe, DeviceBuffer, DeviceInfo,
    DriverInfo, ModeRequest, Unavailable, CUDA_MODE_ENV,
};

/// What one shard found at start: the probe, and the device it opened when the mode is not
/// off.
#[derive(Debug)]
pub struct ShardCuda {
    probe: CudaProbe,
    device: Option<CudaDevice>,
}

impl ShardCuda {
    /// Probes for the shard `shard` with `context` and, when the mode is not off, opens its
    /// device and makes its context current on the calling thread.
    pub(crate) fn start(
        context: &crate::ucx::Context,
        shard: usize,
        request: ModeRequest,
    ) -> Result<Self, CudaError> {
        let probe = probe(context, request)?;
        let device = match (&probe.mode, &probe.driver) {
            (CudaMode::Off, _) | (_, Err(_)) => None,
            (_, Ok(d)) => {
                let device = CudaDevice::open(shard % d.devices.len().max(1))?;
                device.make_current()?;
                Some(device)
            }
        };
        Ok(Self { probe, device })
    }

    /// The mode this shard runs in.
    pub fn mode(&self) -> CudaMode {
        self.probe.mode
    }

    /// What the probe found (driver, devices, UCX memory types) and why the mode is off.
    pub fn probe(&self) -> &CudaProbe {
        &self.probe
    }

    /// The shard's device, when the mode is not off.
    pub fn device(&self) -> Option<&CudaDevice> {
        self.device.as_ref()
    }

    /// A device buffer of `len` bytes on this shard's device, or why there cannot be one.
    pub fn alloc(&self, len: usize) -> Result<DeviceBuffer, CudaError> {
        match &self.device {
            Some(device) => DeviceBuffer::alloc(device, len),
            None => Err(self.unavailable()),
        }
    }

    /// The error device operations return on a shard whose mode is off.
    fn unavailable(&self) -> CudaError {
        match &self.probe.driver {
            Err(u) => CudaError::Unavailable(u.clone()),
            Ok(d) if d.devices.is_empty() => CudaError::Unavailable(Unavailable::NoDevice),
            // Off by request, with a driver and a device.
            Ok(_) => CudaError::Unavailable(Unavailable::TurnedOff),
        }
    }
}
