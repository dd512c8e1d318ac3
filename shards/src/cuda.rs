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
//! [`proto::staging`](crate::proto::staging); [`CudaCopyEngine`] is its copy engine on a GPU
//! (not yet on the data path).

pub use crate::ucx::cuda::{
    device_unavailable, driver, probe, CudaDevice, CudaError, CudaMode, CudaProbe, DeviceBuffer,
    DeviceInfo, DriverInfo, ModeRequest, PendingCopy, PinnedBuf, Unavailable, CUDA_MODE_ENV,
};

use crate::proto::staging::{BufferId, CopyDirection, CopyEngine, CopyOp};

/// What one shard found at start: the probe, and the device it opened when the mode is not
/// off.
#[derive(Debug)]
pub struct ShardCuda {
    probe: CudaProbe,
    device: Option<CudaDevice>,
}

/// The staging pipeline's [`CopyEngine`] on a GPU: copies between one [`DeviceBuffer`] and a set
/// of pinned bounce buffers, queued on the device's stream, their completions seen by polling
/// one event per copy (never blocking).
///
/// The bounce buffers live here between operations: the network borrows one with
/// [`CudaCopyEngine::buffer`] (to send from it or receive into it, by reference) or takes it
/// with [`CudaCopyEngine::take`] and gives it back with [`CudaCopyEngine::put`] (an operation
/// that owns its buffer). Dropping the engine waits for copies still queued (see
/// [`PendingCopy`]).
#[derive(Debug)]
pub struct CudaCopyEngine<'a> {
    device: &'a mut DeviceBuffer,
    slots: Vec<Option<PinnedBuf>>,
    pending: Vec<(u32, BufferId, PendingCopy)>,
}

/// Why [`CudaCopyEngine`] could not queue or finish a copy.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StagingCopyError {
    /// The driver refused or failed the copy.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The scheduler named a bounce buffer that is not in the engine (out of range, or taken
    /// by the network and not put back).
    #[error("staging: bounce buffer {0} is not here")]
    BufferMissing(usize),
}

impl<'a> CudaCopyEngine<'a> {
    /// An engine copying between `device` and `bounce` (buffer `i` is [`BufferId`]`(i)`; each
    /// at least the scheduler's chunk long).
    pub fn new(device: &'a mut DeviceBuffer, bounce: Vec<PinnedBuf>) -> Self {
        Self {
            device,
            slots: bounce.into_iter().map(Some).collect(),
            pending: Vec::new(),
        }
    }

    /// Bounce buffer `id`, when no copy owns it and the network has not taken it.
    pub fn buffer(&mut self, id: BufferId) -> Option<&mut PinnedBuf> {
        self.slots.get_mut(id.0)?.as_mut()
    }

    /// Takes bounce buffer `id` out (for an operation that owns its buffer).
    pub fn take(&mut self, id: BufferId) -> Option<PinnedBuf> {
        self.slots.get_mut(id.0)?.take()
    }

    /// Puts bounce buffer `id` back; hands it back if the slot does not exist or is full.
    pub fn put(&mut self, id: BufferId, buf: PinnedBuf) -> Result<(), PinnedBuf> {
        match self.slots.get_mut(id.0) {
            Some(slot @ None) => {
                *slot = Some(buf);
                Ok(())
            }
            _ => Err(buf),
        }
    }

    /// Copies still queued.
    pub fn in_flight(&self) -> usize {
        self.pending.len()
    }
}

impl CopyEngine for CudaCopyEngine<'_> {
    type Error = StagingCopyError;

    fn start(&mut self, op: CopyOp) -> Result<(), StagingCopyError> {
        let c = op.chunk;
        let buf = self
            .take(c.buffer)
            .ok_or(StagingCopyError::BufferMissing(c.buffer.0))?;
        let queued = match op.direction {
            CopyDirection::DeviceToHost => {
                self.device.copy_to_pinned(c.offset as usize, buf, c.len)
            }
            CopyDirection::HostToDevice => {
                self.device.copy_from_pinned(c.offset as usize, buf, c.len)
            }
        };
        match queued {
            Ok(pending) => {
                self.pending.push((c.index, c.buffer, pending));
                Ok(())
            }
            Err((e, buf)) => {
                // The slot was emptied just above.
                let _ = self.put(c.buffer, buf);
                Err(e.into())
            }
        }
    }

    fn poll_complete(&mut self) -> Option<(u32, Result<(), StagingCopyError>)> {
        let (i, done) = self
            .pending
            .iter_mut()
            .enumerate()
            .find_map(|(i, (_, _, p))| p.poll().map(|r| (i, r)))?;
        let (index, id, _) = self.pending.swap_remove(i);
        let (buf, result) = match done {
            Ok(buf) => (buf, Ok(())),
            Err((e, buf)) => (buf, Err(e.into())),
        };
        // The slot was emptied by `start` and stays empty while the copy runs.
        let _ = self.put(id, buf);
        Some((index, result))
    }
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
                // `open` leaves the device's context current on this thread.
                Some(CudaDevice::open(shard % d.devices.len().max(1))?)
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
        // With a driver and a device: off by request.
        CudaError::Unavailable(
            device_unavailable(self.probe.driver.as_ref()).unwrap_or(Unavailable::TurnedOff),
        )
    }
}
