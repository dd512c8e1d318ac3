//! The CUDA driver API, called through cudarc's run-time loader with raw result codes.
//!
//! cudarc loads `libcuda` with `dlopen` the first time one of its functions is called, and
//! panics when the library or a symbol is missing; its bindings also type every result as the
//! Rust enum `CUresult`, generated from one CUDA release's headers, so a code from a newer driver
//! that the enum does not list would be undefined behaviour (the same trap as ucx1-sys's
//! `ucs_status_t`, see DESIGN.md). So this module takes from cudarc only the loader
//! ([`sys::is_culib_present`], [`sys::culib`]) and the handle types, looks each entry point up
//! itself (a missing one is a typed error, not a panic), declares every result as a raw `c_int`,
//! and maps results in one place ([`check`]).

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::OnceLock;

use cudarc::driver::sys;

use super::{CudaError, Unavailable};

/// A raw `CUresult` as the driver returned it.
pub(crate) type RawResult = c_int;
/// `CUDA_SUCCESS`.
pub(crate) const CUDA_SUCCESS: RawResult = 0;
/// `CUDA_ERROR_NOT_READY`: an event or stream still has work pending.
pub(crate) const CUDA_ERROR_NOT_READY: RawResult = 600;
/// `CUDA_ERROR_NO_DEVICE`: `cuInit` found no CUDA-capable device.
const CUDA_ERROR_NO_DEVICE: RawResult = 100;
/// `CU_STREAM_NON_BLOCKING`: the stream does not synchronise with the legacy default stream.
pub(crate) const CU_STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: an event for completion only, the cheapest kind to query.
pub(crate) const CU_EVENT_DISABLE_TIMING: c_uint = 0x2;

/// Whether `libcuda` can be loaded, asked once per process.
fn library_present() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    *PRESENT.get_or_init(|| {
        // SAFETY: cudarc (`is_culib_present`): tries `dlopen` on each candidate file name of the
        // driver library and closes what it opened; loading libcuda runs no code of ours, and
        // the driver's initialisers are safe to run in any process.
        unsafe { sys::is_culib_present() }
    })
}

/// The address of the driver entry point `name` (NUL-terminated), as a function of type `F`.
///
/// # Safety
///
/// `F` must be the C signature of `name` in the CUDA driver API (with `c_int` for `CUresult`).
unsafe fn symbol<F: Copy>(name: &'static [u8]) -> Result<F, CudaError> {
    if !library_present() {
        return Err(CudaError::Unavailable(Unavailable::NoLibrary));
    }
    // SAFETY: cudarc (`culib`): returns the process-wide library handle, loading it on first
    // use; it panics only when no candidate loads, and `library_present` just loaded one.
    let lib = unsafe { sys::culib() };
    // SAFETY: libloading (`Library::get`): `name` is NUL-terminated and the caller promises that
    // `F` is the symbol's true type; the library stays loaded for the life of the process (cudarc
    // keeps it in a static), so the copied function pointer never dangles.
    match unsafe { lib.get::<F>(name) } {
        Ok(f) => Ok(*f),
        Err(_) => Err(CudaError::MissingEntryPoint {
            name: String::from_utf8_lossy(name.strip_suffix(b"\0").unwrap_or(name)).into_owned(),
        }),
    }
}

/// Declares a cached driver entry point: `fn name() -> Result<unsafe extern "C" fn(..) -> c_int>`.
macro_rules! entry_points {
    ($($fn_name:ident = $sym:literal : fn($($arg:ty),*);)*) => {$(
        pub(crate) fn $fn_name() -> Result<unsafe extern "C" fn($($arg),*) -> RawResult, CudaError> {
            type F = unsafe extern "C" fn($($arg),*) -> RawResult;
            static CELL: OnceLock<F> = OnceLock::new();
            if let Some(f) = CELL.get() {
                return Ok(*f);
            }
            // SAFETY: `F` is the driver's C signature for this symbol, as declared in `cuda.h`
            // (CUDA 12), with the `CUresult` return type read as the C `int` it is.
            let f = unsafe { symbol::<F>(concat!($sym, "\0").as_bytes()) }?;
            Ok(*CELL.get_or_init(|| f))
        }
    )*};
}

entry_points! {
    cu_init = "cuInit": fn(c_uint);
    cu_driver_get_version = "cuDriverGetVersion": fn(*mut c_int);
    cu_device_get_count = "cuDeviceGetCount": fn(*mut c_int);
    cu_device_get = "cuDeviceGet": fn(*mut sys::CUdevice, c_int);
    cu_device_get_name = "cuDeviceGetName": fn(*mut c_char, c_int, sys::CUdevice);
    cu_device_total_mem = "cuDeviceTotalMem_v2": fn(*mut usize, sys::CUdevice);
    cu_get_error_string = "cuGetErrorString": fn(RawResult, *mut *const c_char);
    cu_primary_ctx_retain = "cuDevicePrimaryCtxRetain": fn(*mut sys::CUcontext, sys::CUdevice);
    cu_primary_ctx_release = "cuDevicePrimaryCtxRelease_v2": fn(sys::CUdevice);
    cu_ctx_set_current = "cuCtxSetCurrent": fn(sys::CUcontext);
    cu_stream_create = "cuStreamCreate": fn(*mut sys::CUstream, c_uint);
    cu_stream_destroy = "cuStreamDestroy_v2": fn(sys::CUstream);
    cu_event_create = "cuEventCreate": fn(*mut sys::CUevent, c_uint);
    cu_event_destroy = "cuEventDestroy_v2": fn(sys::CUevent);
    cu_event_record = "cuEventRecord": fn(sys::CUevent, sys::CUstream);
    cu_event_query = "cuEventQuery": fn(sys::CUevent);
    cu_event_synchronize = "cuEventSynchronize": fn(sys::CUevent);
    cu_mem_alloc = "cuMemAlloc_v2": fn(*mut sys::CUdeviceptr, usize);
    cu_mem_free = "cuMemFree_v2": fn(sys::CUdeviceptr);
    cu_stream_synchronize = "cuStreamSynchronize": fn(sys::CUstream);
    cu_mem_host_alloc = "cuMemHostAlloc": fn(*mut *mut c_void, usize, c_uint);
    cu_mem_free_host = "cuMemFreeHost": fn(*mut c_void);
    cu_memcpy_htod_async = "cuMemcpyHtoDAsync_v2":
        fn(sys::CUdeviceptr, *const c_void, usize, sys::CUstream);
    cu_memcpy_dtoh_async = "cuMemcpyDtoHAsync_v2":
        fn(*mut c_void, sys::CUdeviceptr, usize, sys::CUstream);
}

/// The driver's description of `code`, or the bare number when it has none.
pub(crate) fn describe(code: RawResult) -> String {
    let Ok(f) = cu_get_error_string() else {
        return format!("CUresult {code}");
    };
    let mut text: *const c_char = std::ptr::null();
    // SAFETY: cuda.h (`cuGetErrorString`): writes a pointer to a static NUL-terminated string
    // for a known code, or returns `CUDA_ERROR_INVALID_VALUE` for an unknown one; any int is
    // accepted.
    let rc = unsafe { f(code, &mut text) };
    if rc != CUDA_SUCCESS || text.is_null() {
        return format!("CUresult {code}");
    }
    // SAFETY: on success `text` points to a static NUL-terminated string owned by the driver.
    let s = unsafe { CStr::from_ptr(text) }.to_string_lossy();
    format!("{s} (CUresult {code})")
}

/// `Ok` for `CUDA_SUCCESS`, else the driver's error for operation `op`.
pub(crate) fn check(op: &'static str, code: RawResult) -> Result<(), CudaError> {
    if code == CUDA_SUCCESS {
        Ok(())
    } else {
        Err(CudaError::Driver {
            op,
            code,
            message: describe(code),
        })
    }
}

/// What the driver said about itself and its devices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DriverInfo {
    /// The CUDA version the driver supports, as `cuDriverGetVersion` reports it
    /// (`1000 * major + 10 * minor`: 12060 is 12.6).
    pub version: i32,
    /// The devices the driver lists, in ordinal order.
    pub devices: Vec<DeviceInfo>,
}

/// One CUDA device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// The device's ordinal (`cuDeviceGet`'s index).
    pub ordinal: usize,
    /// The device's name (`cuDeviceGetName`).
    pub name: String,
    /// The device's memory in bytes (`cuDeviceTotalMem`).
    pub total_memory: u64,
}

impl DriverInfo {
    /// The driver's CUDA version as `(major, minor)`.
    pub fn version_pair(&self) -> (i32, i32) {
        (self.version / 1000, (self.version % 1000) / 10)
    }
}

/// Loads and initialises the driver once per process and lists its devices; every later call
/// returns the same answer. Never panics: a missing library, a failed `cuInit` or an absent
/// entry point is an [`Unavailable`] reason.
pub fn driver() -> Result<&'static DriverInfo, Unavailable> {
    static DRIVER: OnceLock<Result<DriverInfo, Unavailable>> = OnceLock::new();
    DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn load() -> Result<DriverInfo, Unavailable> {
    let unavailable = |e: CudaError| match e {
        CudaError::Unavailable(u) => u,
        other => Unavailable::DriverFailed(other.to_string()),
    };
    let init = cu_init().map_err(unavailable)?;
    // SAFETY: cuda.h (`cuInit`): flags must be 0; may be called more than once, from any thread.
    let rc = unsafe { init(0) };
    if rc == CUDA_ERROR_NO_DEVICE {
        return Err(Unavailable::NoDevice);
    }
    if rc != CUDA_SUCCESS {
        return Err(Unavailable::InitFailed(describe(rc)));
    }
    let mut version: c_int = 0;
    let f = cu_driver_get_version().map_err(unavailable)?;
    // SAFETY: cuda.h (`cuDriverGetVersion`): writes one int through a valid pointer.
    check("cuDriverGetVersion", unsafe { f(&mut version) }).map_err(unavailable)?;
    let mut count: c_int = 0;
    let f = cu_device_get_count().map_err(unavailable)?;
    // SAFETY: cuda.h (`cuDeviceGetCount`): writes one int; the driver is initialised above.
    check("cuDeviceGetCount", unsafe { f(&mut count) }).map_err(unavailable)?;
    let mut devices = Vec::new();
    for ordinal in 0..count.max(0) {
        let device = device_handle(ordinal).map_err(unavailable)?;
        let mut name = [0 as c_char; 256];
        let f = cu_device_get_name().map_err(unavailable)?;
        // SAFETY: cuda.h (`cuDeviceGetName`): writes at most `len` bytes, NUL-terminated, into
        // `name`, which holds 256; `device` came from `cuDeviceGet`.
        check("cuDeviceGetName", unsafe {
            f(name.as_mut_ptr(), name.len() as c_int, device)
        })
        .map_err(unavailable)?;
        // The driver NUL-terminates; the last byte is forced to 0 all the same.
        name[255] = 0;
        // SAFETY: `name` is a NUL-terminated array that lives to the end of this block.
        let name = unsafe { CStr::from_ptr(name.as_ptr()) }
            .to_string_lossy()
            .into_owned();
        let mut bytes: usize = 0;
        let f = cu_device_total_mem().map_err(unavailable)?;
        // SAFETY: cuda.h (`cuDeviceTotalMem_v2`): writes one size_t; `device` is valid.
        check("cuDeviceTotalMem", unsafe { f(&mut bytes, device) }).map_err(unavailable)?;
        devices.push(DeviceInfo {
            ordinal: ordinal as usize,
            name,
            total_memory: bytes as u64,
        });
    }
    Ok(DriverInfo {
        version: version as i32,
        devices,
    })
}

/// The driver's handle of device `ordinal`.
pub(crate) fn device_handle(ordinal: c_int) -> Result<sys::CUdevice, CudaError> {
    let mut device: sys::CUdevice = 0;
    let f = cu_device_get()?;
    // SAFETY: cuda.h (`cuDeviceGet`): writes one device handle; an ordinal out of range is
    // `CUDA_ERROR_INVALID_DEVICE`, which `check` turns into an error.
    check("cuDeviceGet", unsafe { f(&mut device, ordinal) })?;
    Ok(device)
}
