//! [`PinnedBuf`] (page-locked host memory from `cuMemHostAlloc`) and [`PendingCopy`] (an
//! asynchronous copy between a [`DeviceBuffer`](super::DeviceBuffer) and a pinned buffer).

use std::ffi::{c_uint, c_void};
use std::ptr::NonNull;

use cudarc::driver::sys;

use super::driver::{self as drv, check, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use super::{CudaDevice, CudaError};
use crate::buf::{IoBuf, IoBufMut};

/// `CU_MEMHOSTALLOC_PORTABLE`: the memory is pinned for every context, not only the one current
/// at allocation. Not `CU_MEMHOSTALLOC_WRITECOMBINED`: the CPU (and UCX) read bounce buffers,
/// and write-combined memory is very slow to read from the host.
const CU_MEMHOSTALLOC_PORTABLE: c_uint = 0x1;

/// Page-locked ("pinned") host memory from `cuMemHostAlloc`: what the device copies to and from
/// asynchronously, at full speed. A staging path's bounce buffer.
///
/// Ordinary host memory as far as UCX is concerned, so it is an [`IoBuf`]/[`IoBufMut`] and may
/// be sent or received into in every CUDA mode. `Send` (host memory, freed through the
/// thread-safe driver), not `Sync`.
pub struct PinnedBuf {
    ptr: NonNull<u8>,
    len: usize,
    device: CudaDevice,
}

/// A copy queued on a device's stream between a device buffer and a [`PinnedBuf`], which it
/// owns until the copy is done. Poll it with [`PendingCopy::poll`] (never blocks); dropping it
/// before it is done blocks until the copy has finished, so that the pinned memory is never
/// freed under the device's DMA.
pub struct PendingCopy {
    buf: Option<PinnedBuf>,
    event: sys::CUevent,
    /// Keeps the context that owns `event` alive until the event is destroyed.
    _device: CudaDevice,
}

impl PinnedBuf {
    /// `len` bytes of pinned host memory (zeroed), usable by every context of the process.
    pub fn alloc(device: &CudaDevice, len: usize) -> Result<Self, CudaError> {
        device.make_current()?;
        let alloc = drv::cu_mem_host_alloc()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: cuda.h (`cuMemHostAlloc`): allocates `len` (at least 1) bytes of page-locked
        // host memory and writes its address; freed with `cuMemFreeHost` in `Drop`.
        check("cuMemHostAlloc", unsafe {
            alloc(&mut p, len.max(1), CU_MEMHOSTALLOC_PORTABLE)
        })?;
        let ptr = NonNull::new(p.cast::<u8>()).ok_or(CudaError::Driver {
            op: "cuMemHostAlloc",
            code: CUDA_SUCCESS,
            message: "returned a null pointer".into(),
        })?;
        // SAFETY: `ptr` points to `len.max(1)` bytes just allocated and owned by nobody else.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len.max(1)) };
        Ok(Self {
            ptr,
            len,
            device: device.clone(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes (zeroed at allocation) owned by this
        // value; no copy can be writing them: a queued copy owns the value (`PendingCopy`).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn check_len(&self, len: usize) -> Result<(), CudaError> {
        if len <= self.len {
            Ok(())
        } else {
            Err(CudaError::OutOfBounds {
                offset: 0,
                len,
                buffer_len: self.len,
            })
        }
    }
}

impl super::DeviceBuffer {
    /// Queues a copy of `len` bytes at `offset` of this buffer into the start of `dst`, on the
    /// device's stream, and returns it pending; the buffer's own event is recorded after it (so
    /// dropping this device buffer waits for the copy). On error `dst` comes back with it.
    pub fn copy_to_pinned(
        &mut self,
        offset: usize,
        dst: PinnedBuf,
        len: usize,
    ) -> Result<PendingCopy, (CudaError, PinnedBuf)> {
        if let Err(e) = self
            .check_range(offset, len)
            .and_then(|()| dst.check_len(len))
        {
            return Err((e, dst));
        }
        let queued = self.device().make_current().and_then(|()| {
            let copy = drv::cu_memcpy_dtoh_async()?;
            // SAFETY: cuda.h (`cuMemcpyDtoHAsync_v2`): the source range lies inside this
            // allocation and the destination is `len` bytes of pinned memory (both checked
            // above); `dst` is moved into the returned `PendingCopy`, which keeps it alive and
            // unreadable until the copy's event has completed.
            check("cuMemcpyDtoHAsync", unsafe {
                copy(
                    dst.ptr.as_ptr().cast::<c_void>(),
                    self.device_ptr() + offset as u64,
                    len,
                    self.stream(),
                )
            })
        });
        self.after_queued(queued, dst)
    }

    /// Queues a copy of the first `len` bytes of `src` into this buffer at `offset`, on the
    /// device's stream, and returns it pending (see [`DeviceBuffer::copy_to_pinned`]).
    ///
    /// [`DeviceBuffer::copy_to_pinned`]: super::DeviceBuffer::copy_to_pinned
    pub fn copy_from_pinned(
        &mut self,
        offset: usize,
        src: PinnedBuf,
        len: usize,
    ) -> Result<PendingCopy, (CudaError, PinnedBuf)> {
        if let Err(e) = self
            .check_range(offset, len)
            .and_then(|()| src.check_len(len))
        {
            return Err((e, src));
        }
        let queued = self.device().make_current().and_then(|()| {
            let copy = drv::cu_memcpy_htod_async()?;
            // SAFETY: cuda.h (`cuMemcpyHtoDAsync_v2`): the destination range lies inside this
            // allocation and the source is `len` bytes of pinned memory (both checked above);
            // `src` is moved into the returned `PendingCopy`, which keeps it alive and
            // unwritable until the copy's event has completed.
            check("cuMemcpyHtoDAsync", unsafe {
                copy(
                    self.device_ptr() + offset as u64,
                    src.ptr.as_ptr().cast::<c_void>(),
                    len,
                    self.stream(),
                )
            })
        });
        self.after_queued(queued, src)
    }

    /// After a copy was (or failed to be) queued: an event for it, and this buffer's event
    /// recorded after it too.
    fn after_queued(
        &mut self,
        queued: Result<(), CudaError>,
        buf: PinnedBuf,
    ) -> Result<PendingCopy, (CudaError, PinnedBuf)> {
        if let Err(e) = queued {
            return Err((e, buf));
        }
        let mut event: sys::CUevent = std::ptr::null_mut();
        let recorded = (|| {
            let create = drv::cu_event_create()?;
            let record = drv::cu_event_record()?;
            // SAFETY: cuda.h (`cuEventCreate`): creates an event in the current context (made
            // current before the copy) and writes its handle; destroyed by `PendingCopy`.
            check("cuEventCreate", unsafe {
                create(&mut event, drv::CU_EVENT_DISABLE_TIMING)
            })?;
            // SAFETY: cuda.h (`cuEventRecord`): a live event and the live stream of the same
            // context; the event completes when the copy queued before it has.
            check("cuEventRecord", unsafe { record(event, self.stream()) })?;
            self.record()
        })();
        match recorded {
            Ok(()) => Ok(PendingCopy {
                buf: Some(buf),
                event,
                _device: self.device().clone(),
            }),
            Err(e) => {
                // The copy is queued but its end cannot be seen through an event: wait for the
                // whole stream before `buf` goes back to the caller. If even that fails, the
                // context itself has failed, and a failed context runs no more copies.
                let _ = self.device().synchronize_stream();
                if !event.is_null() {
                    if let Ok(destroy) = drv::cu_event_destroy() {
                        // SAFETY: cuda.h (`cuEventDestroy_v2`): the event created above, once.
                        let _ = unsafe { destroy(event) };
                    }
                }
                Err((e, buf))
            }
        }
    }
}

impl PendingCopy {
    /// The pinned buffer once the copy is done (`Some(Ok)`), `None` while it runs, or the
    /// driver's error with the buffer (the copy's result is then unknown; the buffer comes back
    /// only after a wait for the whole stream, as a copy whose event could not be recorded does, since
    /// not every failed query means a failed context that runs no more copies).
    pub fn poll(&mut self) -> Option<Result<PinnedBuf, (CudaError, PinnedBuf)>> {
        let failed = match drv::cu_event_query() {
            Ok(query) => {
                // SAFETY: cuda.h (`cuEventQuery`): a live event (recorded after the copy);
                // never blocks.
                match unsafe { query(self.event) } {
                    CUDA_ERROR_NOT_READY => return None,
                    CUDA_SUCCESS => return self.buf.take().map(Ok),
                    rc => check("cuEventQuery", rc).err()?,
                }
            }
            Err(e) => e,
        };
        let _ = self._device.synchronize_stream();
        self.buf.take().map(|b| Err((failed, b)))
    }

    /// Whether the copy is done (`poll` has nothing more to give once it has returned the
    /// buffer).
    pub fn is_done(&self) -> bool {
        self.buf.is_none()
    }
}

impl CudaDevice {
    /// Blocks until everything queued on this device's stream is done.
    fn synchronize_stream(&self) -> Result<(), CudaError> {
        let sync = drv::cu_stream_synchronize()?;
        // SAFETY: cuda.h (`cuStreamSynchronize`): waits for a live stream of this device.
        check("cuStreamSynchronize", unsafe { sync(self.stream()) })
    }
}

impl std::fmt::Debug for PinnedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PinnedBuf")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl std::fmt::Debug for PendingCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingCopy")
            .field("done", &self.is_done())
            .finish()
    }
}

impl Drop for PinnedBuf {
    fn drop(&mut self) {
        if self.device.make_current().is_err() {
            return;
        }
        if let Ok(free) = drv::cu_mem_free_host() {
            // SAFETY: cuda.h (`cuMemFreeHost`): frees memory this value got from
            // `cuMemHostAlloc`, once; no copy uses it (a queued copy owns the value through a
            // `PendingCopy`, whose drop waits for the copy first).
            let _ = unsafe { free(self.ptr.as_ptr().cast::<c_void>()) };
        }
    }
}

impl Drop for PendingCopy {
    fn drop(&mut self) {
        if !self.event.is_null() {
            if self.buf.is_some() {
                let waited = drv::cu_event_synchronize().and_then(|sync| {
                    // SAFETY: cuda.h (`cuEventSynchronize`): waits for a live event, recorded
                    // after the copy, so the pinned buffer is free of DMA once it returns.
                    check("cuEventSynchronize", unsafe { sync(self.event) })
                });
                if waited.is_err() {
                    // The buffer is freed below: the whole stream first.
                    let _ = self._device.synchronize_stream();
                }
            }
            if let Ok(destroy) = drv::cu_event_destroy() {
                // SAFETY: cuda.h (`cuEventDestroy_v2`): destroys the event this value created,
                // once.
                let _ = unsafe { destroy(self.event) };
            }
        }
        // `buf` (if still here) is dropped after the wait above.
    }
}

// SAFETY: a `PinnedBuf` owns its host memory exclusively (no aliasing handle exists), and the
// driver call that frees it is thread-safe and made with the (portable) context current.
unsafe impl Send for PinnedBuf {}
// SAFETY: a `PendingCopy` owns its event and buffer exclusively; querying, waiting for and
// destroying an event are thread-safe driver calls.
unsafe impl Send for PendingCopy {}

// SAFETY: the bytes live in pinned host memory owned by the value, at an address that does not
// change when the value moves, valid until it is dropped; an operation that owns the value is
// the only one that can reach them.
unsafe impl IoBuf for PinnedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
}

// SAFETY: as for `IoBuf`; all `len` bytes are initialised (zeroed at allocation) and writable.
unsafe impl IoBufMut for PinnedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}
