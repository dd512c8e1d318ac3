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
//! [`proto::staging`](crate::proto::staging); [`CudaCopyEngine`] is its copy engine on a GPU.
//!
//! ## Staged copies on a shard
//!
//! [`ShardCuda::device_to_host`] and [`ShardCuda::host_to_device`] move a device buffer's bytes
//! to or from host memory the way the staging path does: in chunks of
//! [`StagingConfig::chunk`] through the shard's pinned bounce buffers (allocated on first use
//! and kept: a set of [`StagingConfig::bounce_buffers`]; a copy takes as many as it has chunks,
//! up to a set, so that short copies running at once share the set, and a buffer is allocated
//! only when the kept ones are all taken), several chunks in flight, the device copies queued on the shard's stream and
//! their events polled between yields to the shard's other tasks (the progress driver among
//! them), never waited on. They are what a device buffer sent as an active message
//! (`Peer::am_send_device` in `shardcx`) and a payload landed in device memory go through, in
//! every CUDA mode: the bytes on the wire are the same as for host memory.

pub use crate::ucx::cuda::{
    device_unavailable, driver, probe, CudaDevice, CudaError, CudaMode, CudaProbe, DeviceBuffer,
    DeviceInfo, DriverInfo, ModeRequest, PendingCopy, PinnedBuf, Unavailable, CUDA_MODE_ENV,
};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use crate::proto::staging::{
    BufferId, CopyDirection, CopyEngine, CopyOp, Direction, PumpError, Staging, StagingConfig,
    StagingError, State,
};

/// What one shard found at start: the probe, and the device it opened when the mode is not
/// off.
#[derive(Debug)]
pub struct ShardCuda {
    probe: CudaProbe,
    device: Option<CudaDevice>,
    /// The staged copies' bounce buffers while no copy runs (see "Staged copies on a shard").
    /// A mutex (never contended: one shard's thread) keeps `ShardCuda` `Sync`.
    bounce: Mutex<Vec<PinnedBuf>>,
    /// Bounce buffers allocated so far ([`ShardCuda::bounce_allocations`]).
    bounce_allocations: AtomicU64,
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
    /// The scheduler refused a report (a bug in the caller of the scheduler).
    #[error(transparent)]
    Scheduler(#[from] StagingError),
    /// The host range and the device buffer differ in length.
    #[error("staging: {host} host bytes for a device buffer of {device}")]
    LengthMismatch {
        /// Bytes of the host range.
        host: usize,
        /// Bytes of the device buffer.
        device: usize,
    },
    /// The device buffer is on another device than the shard's (its stream and bounce buffers
    /// belong to the shard's device).
    #[error("staging: the buffer is on device {buffer}, the shard's device is {shard}")]
    OtherDevice {
        /// The buffer's device.
        buffer: usize,
        /// The shard's device.
        shard: usize,
    },
}

impl From<PumpError<StagingCopyError>> for StagingCopyError {
    fn from(e: PumpError<StagingCopyError>) -> Self {
        match e {
            PumpError::Copy { source, .. } => source,
            PumpError::Staging(s) => StagingCopyError::Scheduler(s),
        }
    }
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
        Ok(Self {
            probe,
            device,
            bounce: Mutex::new(Vec::new()),
            bounce_allocations: AtomicU64::new(0),
        })
    }

    /// The shape of this shard's staged copies: [`StagingConfig::default`] (2 MiB chunks, 4
    /// bounce buffers: 8 MiB of pinned memory per shard, allocated on first use).
    pub fn staging_config(&self) -> StagingConfig {
        StagingConfig::default()
    }

    /// Pinned bounce buffers this shard has allocated so far (`cuMemHostAlloc` of a chunk
    /// each): a set, once, while copies do not run at once (see "Staged copies on a shard").
    pub fn bounce_allocations(&self) -> u64 {
        self.bounce_allocations.load(Ordering::Relaxed)
    }

    /// Copies the whole of `src` into `dst` (of the same length) through the shard's bounce
    /// buffers (see "Staged copies on a shard"); resolves once every byte is in `dst`.
    pub async fn device_to_host(
        &self,
        src: &mut DeviceBuffer,
        dst: &mut [u8],
    ) -> Result<(), StagingCopyError> {
        if src.len() != dst.len() {
            return Err(StagingCopyError::LengthMismatch {
                host: dst.len(),
                device: src.len(),
            });
        }
        self.staged(Direction::Send, src, |c, bounce| {
            let at = c.offset as usize;
            dst[at..at + c.len].copy_from_slice(&bounce.as_slice()[..c.len]);
        })
        .await
    }

    /// Copies `src` into the whole of `dst` (of the same length) through the shard's bounce
    /// buffers (see "Staged copies on a shard"); resolves once the device copies are done.
    pub async fn host_to_device(
        &self,
        src: &[u8],
        dst: &mut DeviceBuffer,
    ) -> Result<(), StagingCopyError> {
        if src.len() != dst.len() {
            return Err(StagingCopyError::LengthMismatch {
                host: src.len(),
                device: dst.len(),
            });
        }
        self.staged(Direction::Recv, dst, |c, bounce| {
            let at = c.offset as usize;
            bounce.as_mut_slice()[..c.len].copy_from_slice(&src[at..at + c.len]);
        })
        .await
    }

    /// One staged transfer of the whole of `device`: the scheduler, this shard's bounce
    /// buffers in a [`CudaCopyEngine`], and `host` moving each chunk between its bounce buffer
    /// and host memory (the "network" of the scheduler).
    async fn staged(
        &self,
        direction: Direction,
        device: &mut DeviceBuffer,
        mut host: impl FnMut(crate::proto::staging::Chunk, &mut PinnedBuf),
    ) -> Result<(), StagingCopyError> {
        let set = self.staging_config();
        let len = device.len() as u64;
        // No more chunks are in flight than the transfer has: it takes no more bounce buffers
        // (at least one), and short copies running at once share the kept set.
        let chunks = usize::try_from(len.div_ceil(set.chunk as u64)).unwrap_or(usize::MAX);
        let cfg = StagingConfig {
            bounce_buffers: set.bounce_buffers.min(chunks.max(1)),
            ..set
        };
        let bounce = self.take_bounce(device, cfg)?;
        let mut engine = CudaCopyEngine::new(device, bounce);
        let result = async {
            let mut s = Staging::new(direction, len, cfg)?;
            let mut first: Option<StagingCopyError> = None;
            while !s.state().is_final() {
                if let Err(e) = s.pump(&mut engine) {
                    first.get_or_insert(e.into());
                }
                loop {
                    let chunk = match direction {
                        Direction::Send => s.poll_send(),
                        Direction::Recv => s.poll_recv(),
                    };
                    let Some(c) = chunk else { break };
                    let Some(buf) = engine.buffer(c.buffer) else {
                        first.get_or_insert(StagingCopyError::BufferMissing(c.buffer.0));
                        s.cancel();
                        break;
                    };
                    host(c, buf);
                    match direction {
                        Direction::Send => s.handle_sent(c.index, true)?,
                        Direction::Recv => s.handle_received(c.index, true)?,
                    }
                }
                if engine.in_flight() > 0 {
                    // The copies run on the device: let the shard's other tasks run meanwhile.
                    futures_lite::future::yield_now().await;
                }
            }
            match (s.state(), first) {
                (State::Done, _) => Ok(()),
                (_, Some(e)) => Err(e),
                (state, None) => Err(StagingCopyError::Scheduler(StagingError::Config(
                    match state {
                        State::Cancelled => "the staged copy was cancelled",
                        _ => "the staged copy failed",
                    },
                ))),
            }
        }
        .await;
        // Nothing is in flight once the state is final: the buffers go back for the next copy.
        let mut back = Vec::with_capacity(cfg.bounce_buffers);
        for i in 0..cfg.bounce_buffers {
            back.extend(engine.take(BufferId(i)));
        }
        drop(engine);
        self.give_back(back);
        result
    }

    /// `cfg`'s count of this shard's bounce buffers (kept ones first, then new ones of `cfg`'s
    /// chunk size), or why there are none.
    fn take_bounce(
        &self,
        device: &DeviceBuffer,
        cfg: StagingConfig,
    ) -> Result<Vec<PinnedBuf>, StagingCopyError> {
        let Some(shard_device) = &self.device else {
            return Err(self.unavailable().into());
        };
        if device.device().ordinal() != shard_device.ordinal() {
            return Err(StagingCopyError::OtherDevice {
                buffer: device.device().ordinal(),
                shard: shard_device.ordinal(),
            });
        }
        // Copies running at once on this shard each get buffers of their own: the cache holds
        // one set.
        let mut bufs: Vec<PinnedBuf> = {
            let mut cache = self.cache();
            let n = cache.len().min(cfg.bounce_buffers);
            cache.drain(..n).collect()
        };
        while bufs.len() < cfg.bounce_buffers {
            match PinnedBuf::alloc(shard_device, cfg.chunk) {
                Ok(b) => {
                    self.bounce_allocations.fetch_add(1, Ordering::Relaxed);
                    bufs.push(b);
                }
                Err(e) => {
                    self.give_back(bufs);
                    return Err(e.into());
                }
            }
        }
        Ok(bufs)
    }

    /// The cached bounce buffers (a panic while they were held leaves them usable: they are
    /// only memory).
    fn cache(&self) -> MutexGuard<'_, Vec<PinnedBuf>> {
        self.bounce.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps bounce buffers for the next copy, up to one set; frees the rest.
    fn give_back(&self, bufs: Vec<PinnedBuf>) {
        let keep = self.staging_config().bounce_buffers;
        let mut cache = self.cache();
        for b in bufs {
            if cache.len() < keep {
                cache.push(b);
            }
        }
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
