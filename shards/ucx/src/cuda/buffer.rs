//! [`CudaDevice`] (a device's primary context and a stream of its own) and [`DeviceBuffer`]
//! (a `cuMemAlloc` range with the event of the work that last wrote it).

use std::cell::Cell;
use std::ffi::{c_int, c_void};
use std::marker::PhantomData;
use std::sync::Arc;

use cudarc::driver::sys;

use super::driver::{self as drv, check, CUDA_ERROR_NOT_READY, CUDA_SUCCESS};
use super::{CudaError, DeviceInfo, Unavailable};

/// A CUDA device opened for one user (a shard): its primary context, retained, and a stream of
/// its own for copies. Cloning shares both.
///
/// Each call that needs the context makes it current on the calling thread first, so a
/// `CudaDevice` may be used from any thread; a shard also makes it current on its own thread
/// before creating its UCX worker ([`CudaDevice::make_current`]), as UCX's CUDA transports
/// expect.
#[derive(Clone)]
pub struct CudaDevice {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    info: DeviceInfo,
    device: sys::CUdevice,
    context: sys::CUcontext,
    stream: sys::CUstream,
}

/// Device memory from `cuMemAlloc` (never a stream-ordered pool: UCX's CUDA transports cannot
/// register those), on one device, with the event recorded on the stream of the work that last
/// wrote or read it.
///
/// A shard waits for that work by polling [`DeviceBuffer::is_ready`] from its progress loop,
/// never by blocking; the host copy helpers ([`DeviceBuffer::copy_from_host`],
/// [`DeviceBuffer::copy_to_host`]) are the exception and block the calling thread until their
/// copy is done. A device buffer is not an [`IoBuf`](crate::IoBuf): its pointer must reach UCX
/// only in zero-copy mode (see the module docs).
///
/// `Send` (it may move to another shard: the driver API is thread-safe and every call makes the
/// context current first) but not `Sync` (recording its event is a mutation).
pub struct DeviceBuffer {
    ptr: sys::CUdeviceptr,
    len: usize,
    event: sys::CUevent,
    device: CudaDevice,
    _not_sync: PhantomData<Cell<()>>,
}

impl CudaDevice {
    /// Opens device `ordinal`: retains its primary context and creates a non-blocking stream.
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        let driver = drv::driver().map_err(|u| CudaError::Unavailable(u.clone()))?;
        let Some(info) = driver.devices.get(ordinal).cloned() else {
            return Err(if driver.devices.is_empty() {
                CudaError::Unavailable(Unavailable::NoDevice)
            } else {
                CudaError::NoSuchDevice {
                    ordinal,
                    count: driver.devices.len(),
                }
            });
        };
        let device = drv::device_handle(ordinal as c_int)?;
        let retain = drv::cu_primary_ctx_retain()?;
        let release = drv::cu_primary_ctx_release()?;
        let mut context: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: cuda.h (`cuDevicePrimaryCtxRetain`): writes the device's primary context and
        // takes a reference on it, released below or by `DeviceInner::drop`.
        check("cuDevicePrimaryCtxRetain", unsafe {
            retain(&mut context, device)
        })?;
        let stream = make_current(context).and_then(|()| {
            let create = drv::cu_stream_create()?;
            let mut stream: sys::CUstream = std::ptr::null_mut();
            // SAFETY: cuda.h (`cuStreamCreate`): creates a stream in the current context (made
            // current just above) and writes its handle.
            check("cuStreamCreate", unsafe {
                create(&mut stream, drv::CU_STREAM_NON_BLOCKING)
            })?;
            Ok(stream)
        });
        match stream {
            Ok(stream) => Ok(Self {
                inner: Arc::new(DeviceInner {
                    info,
                    device,
                    context,
                    stream,
                }),
            }),
            Err(e) => {
                // SAFETY: cuda.h (`cuDevicePrimaryCtxRelease`): drops the reference retained
                // above, once; nothing made in that context survives (the stream failed).
                let _ = unsafe { release(device) };
                Err(e)
            }
        }
    }

    /// The device's ordinal, name and memory.
    pub fn info(&self) -> &DeviceInfo {
        &self.inner.info
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.inner.info.ordinal
    }

    /// Makes the device's primary context current on the calling thread (`cuCtxSetCurrent`).
    pub fn make_current(&self) -> Result<(), CudaError> {
        make_current(self.inner.context)
    }

    /// The stream this device value queues its copies on.
    pub(super) fn stream(&self) -> sys::CUstream {
        self.inner.stream
    }

    /// Waits, blocking the thread, until `event` has completed.
    fn wait(&self, event: sys::CUevent) -> Result<(), CudaError> {
        let sync = drv::cu_event_synchronize()?;
        // SAFETY: cuda.h (`cuEventSynchronize`): `event` is a live event of this device's
        // context (owned by a `DeviceBuffer` that borrows this device).
        check("cuEventSynchronize", unsafe { sync(event) })
    }
}

fn make_current(context: sys::CUcontext) -> Result<(), CudaError> {
    let set = drv::cu_ctx_set_current()?;
    // SAFETY: cuda.h (`cuCtxSetCurrent`): binds a live context (retained by the caller) to the
    // calling thread, replacing whatever was current there.
    check("cuCtxSetCurrent", unsafe { set(context) })
}

impl DeviceBuffer {
    /// `len` bytes of device memory on `device` (`cuMemAlloc`), uninitialised.
    pub fn alloc(device: &CudaDevice, len: usize) -> Result<Self, CudaError> {
        device.make_current()?;
        let create = drv::cu_event_create()?;
        let alloc = drv::cu_mem_alloc()?;
        let mut event: sys::CUevent = std::ptr::null_mut();
        // SAFETY: cuda.h (`cuEventCreate`): creates an event in the current context (made current
        // above) and writes its handle; destroyed in `Drop`.
        check("cuEventCreate", unsafe {
            create(&mut event, drv::CU_EVENT_DISABLE_TIMING)
        })?;
        let mut ptr: sys::CUdeviceptr = 0;
        // `cuMemAlloc` refuses zero bytes; an empty buffer allocates one and reports 0.
        // SAFETY: cuda.h (`cuMemAlloc_v2`): allocates in the current context and writes the
        // device address; freed with `cuMemFree` in `Drop`.
        let rc = unsafe { alloc(&mut ptr, len.max(1)) };
        let buffer = Self {
            ptr,
            len,
            event,
            device: device.clone(),
            _not_sync: PhantomData,
        };
        if let Err(e) = check("cuMemAlloc", rc) {
            // Drop frees the event; `ptr` is 0, which `Drop` skips.
            let mut buffer = buffer;
            buffer.ptr = 0;
            return Err(e);
        }
        Ok(buffer)
    }

    /// `len` bytes on device `ordinal` (opened for this buffer alone: prefer
    /// [`DeviceBuffer::alloc`] with a shard's [`CudaDevice`]).
    pub fn alloc_on(ordinal: usize, len: usize) -> Result<Self, CudaError> {
        Self::alloc(&CudaDevice::open(ordinal)?, len)
    }

    /// A device buffer on `device` holding a copy of `src` (blocks until copied).
    pub fn from_host(device: &CudaDevice, src: &[u8]) -> Result<Self, CudaError> {
        let mut buffer = Self::alloc(device, src.len())?;
        buffer.copy_from_host(0, src)?;
        Ok(buffer)
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device the memory is on.
    pub fn device(&self) -> &CudaDevice {
        &self.device
    }

    /// The device address of the first byte (a `CUdeviceptr`), for a UCX that moves CUDA
    /// memory or for kernels.
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }

    /// Whether the work last recorded on the buffer's event has completed (`cuEventQuery`):
    /// what a progress loop polls instead of blocking.
    pub fn is_ready(&self) -> Result<bool, CudaError> {
        let query = drv::cu_event_query()?;
        // SAFETY: cuda.h (`cuEventQuery`): `self.event` is a live event; querying never blocks.
        match unsafe { query(self.event) } {
            CUDA_SUCCESS => Ok(true),
            CUDA_ERROR_NOT_READY => Ok(false),
            rc => check("cuEventQuery", rc).map(|()| false),
        }
    }

    /// Copies `src` into the buffer at `offset`, blocking until the copy is done.
    pub fn copy_from_host(&mut self, offset: usize, src: &[u8]) -> Result<(), CudaError> {
        self.check_range(offset, src.len())?;
        self.device.make_current()?;
        let copy = drv::cu_memcpy_htod_async()?;
        // SAFETY: cuda.h (`cuMemcpyHtoDAsync_v2`): the destination range lies inside this
        // allocation (checked above), the source is `src.len()` readable bytes; `src` stays
        // borrowed until `record_and_wait` below has waited for the copy to finish.
        check("cuMemcpyHtoDAsync", unsafe {
            copy(
                self.ptr + offset as u64,
                src.as_ptr().cast::<c_void>(),
                src.len(),
                self.device.inner.stream,
            )
        })?;
        self.record_and_wait()
    }

    /// Copies `dst.len()` bytes from the buffer at `offset` into `dst`, blocking until done.
    pub fn copy_to_host(&mut self, offset: usize, dst: &mut [u8]) -> Result<(), CudaError> {
        self.check_range(offset, dst.len())?;
        self.device.make_current()?;
        let copy = drv::cu_memcpy_dtoh_async()?;
        // SAFETY: cuda.h (`cuMemcpyDtoHAsync_v2`): the source range lies inside this
        // allocation (checked above), `dst` is `dst.len()` writable bytes borrowed mutably until
        // `record_and_wait` below has waited for the copy to finish.
        check("cuMemcpyDtoHAsync", unsafe {
            copy(
                dst.as_mut_ptr().cast::<c_void>(),
                self.ptr + offset as u64,
                dst.len(),
                self.device.inner.stream,
            )
        })?;
        self.record_and_wait()
    }

    /// The buffer's bytes, copied to a new vector (blocks until copied).
    pub fn to_vec(&mut self) -> Result<Vec<u8>, CudaError> {
        let mut out = vec![0; self.len];
        self.copy_to_host(0, &mut out)?;
        Ok(out)
    }

    /// Records the buffer's event after everything queued so far on its device's stream, so
    /// that [`DeviceBuffer::is_ready`] turns true when that work is done.
    pub fn record(&mut self) -> Result<(), CudaError> {
        let record = drv::cu_event_record()?;
        // SAFETY: cuda.h (`cuEventRecord`): the event and the stream belong to the same
        // context (both made on this buffer's device), and both are live.
        check("cuEventRecord", unsafe {
            record(self.event, self.device.inner.stream)
        })
    }

    fn record_and_wait(&mut self) -> Result<(), CudaError> {
        self.record()?;
        self.device.wait(self.event)
    }

    /// The stream of this buffer's device.
    pub(super) fn stream(&self) -> sys::CUstream {
        self.device.stream()
    }

    pub(super) fn check_range(&self, offset: usize, len: usize) -> Result<(), CudaError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.len => Ok(()),
            _ => Err(CudaError::OutOfBounds {
                offset,
                len,
                buffer_len: self.len,
            }),
        }
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("ordinal", &self.inner.info.ordinal)
            .field("name", &self.inner.info.name)
            .finish()
    }
}

impl std::fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("device", &self.device.ordinal())
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.len)
            .finish()
    }
}

impl Drop for DeviceInner {
    fn drop(&mut self) {
        // Teardown errors have no one to go to; the driver reclaims everything at exit anyway.
        if make_current(self.context).is_ok() {
            if let Ok(destroy) = drv::cu_stream_destroy() {
                // SAFETY: cuda.h (`cuStreamDestroy_v2`): destroys a stream this value created;
                // every `DeviceBuffer` holds an `Arc` to this value, so none can still use it
                // (work still queued completes before the stream's resources go).
                let _ = unsafe { destroy(self.stream) };
            }
        }
        if let Ok(release) = drv::cu_primary_ctx_release() {
            // SAFETY: cuda.h (`cuDevicePrimaryCtxRelease_v2`): drops the one reference
            // `CudaDevice::open` retained.
            let _ = unsafe { release(self.device) };
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.device.make_current().is_err() {
            return;
        }
        // Work that uses the memory must finish before it is freed: wait for the last event.
        let _ = self.device.wait(self.event);
        if self.ptr != 0 {
            if let Ok(free) = drv::cu_mem_free() {
                // SAFETY: cuda.h (`cuMemFree_v2`): frees memory this value allocated with
                // `cuMemAlloc`, once; the wait above let queued copies finish first.
                let _ = unsafe { free(self.ptr) };
            }
        }
        if let Ok(destroy) = drv::cu_event_destroy() {
            // SAFETY: cuda.h (`cuEventDestroy_v2`): destroys the event this value created,
            // once.
            let _ = unsafe { destroy(self.event) };
        }
    }
}

// SAFETY: the handles in `DeviceInner` are process-wide driver objects: the CUDA driver API is
// thread-safe, a primary context may be made current on any thread (every use here does so
// first), and a stream may be used from any thread of the process. `DeviceInner` has no
// interior state of its own beyond these immutable handles.
unsafe impl Send for DeviceInner {}
// SAFETY: as above; every method takes `&self` and only passes the immutable handles to the
// thread-safe driver.
unsafe impl Sync for DeviceInner {}
// SAFETY: a `DeviceBuffer` owns its allocation and event exclusively; both are process-wide
// driver objects usable from any thread once the context is current, which every method makes
// it first. It stays `!Sync` through `_not_sync`: recording its event mutates it.
unsafe impl Send for DeviceBuffer {}
