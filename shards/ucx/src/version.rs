//! Which UCX this process runs.
//!
//! ucx1-sys builds its bundled UCX (1.12) and links `libucp` dynamically. Under
//! `cargo run/test/bench` the loader finds that build first, because cargo puts its directory
//! on `LD_LIBRARY_PATH`; a binary started outside cargo may load whatever `libucp.so.0` the
//! system has instead (Debian's 1.13, say). [`version`] reports both, and the path of the
//! library actually loaded.

use std::ffi::{c_char, c_uint, CStr};

use ucx1_sys as sys;

/// The UCX version the bindings were generated from, and the one loaded at run time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VersionInfo {
    /// `(major, minor)` of the headers this crate was compiled against.
    pub built: (u32, u32),
    /// `(major, minor, release)` reported by the loaded library (`ucp_get_version`).
    pub loaded: (u32, u32, u32),
    /// UCX's own version string (`ucp_get_version_string`).
    pub loaded_string: String,
    /// File the loaded `libucp` came from, when the loader can say.
    pub library_path: Option<String>,
}

impl VersionInfo {
    /// Whether the loaded library has the major and minor version the bindings were built
    /// from.
    pub fn matches(&self) -> bool {
        (self.loaded.0, self.loaded.1) == self.built
    }

    /// Whether the loaded library can serve this build: same major version, same or newer
    /// minor version (UCX keeps its ABI backward compatible within a major version).
    pub fn compatible(&self) -> bool {
        self.loaded.0 == self.built.0 && self.loaded.1 >= self.built.1
    }
}

impl std::fmt::Display for VersionInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "UCX {}.{}.{} loaded from {}, built against {}.{}",
            self.loaded.0,
            self.loaded.1,
            self.loaded.2,
            self.library_path.as_deref().unwrap_or("an unknown file"),
            self.built.0,
            self.built.1
        )
    }
}

/// Report the UCX version built against and loaded.
pub fn version() -> VersionInfo {
    let (mut major, mut minor, mut release): (c_uint, c_uint, c_uint) = (0, 0, 0);
    // SAFETY: ucp.h (`ucp_get_version`): writes three unsigned integers through valid pointers.
    unsafe { sys::ucp_get_version(&mut major, &mut minor, &mut release) };
    // SAFETY: ucp.h (`ucp_get_version_string`): returns a static NUL-terminated string.
    let s = unsafe { sys::ucp_get_version_string() };
    let loaded_string = if s.is_null() {
        String::new()
    } else {
        // SAFETY: non-null static NUL-terminated string (see above).
        unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
    };
    VersionInfo {
        built: (sys::UCP_API_MAJOR, sys::UCP_API_MINOR),
        loaded: (major, minor, release),
        loaded_string,
        library_path: library_path(),
    }
}

fn library_path() -> Option<String> {
    // SAFETY: `Dl_info` is plain data (pointers and integers); zero is a valid value.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let addr = sys::ucp_get_version as *const libc::c_void;
    // SAFETY: dladdr(3) reads the address and fills `info`; it returns 0 when the address is
    // not in a loaded object. The strings it returns belong to the loader and outlive us.
    let found = unsafe { libc::dladdr(addr, &mut info) };
    if found == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: non-null NUL-terminated path owned by the dynamic loader (see above).
    let path = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    std::fs::canonicalize(&*path)
        .map(|p| p.display().to_string())
        .ok()
        .or_else(|| Some(path.into_owned()))
}

/// Run a UCX `*_print_info(…, FILE*)` function and return what it printed.
pub(crate) fn capture(print: impl FnOnce(*mut sys::FILE)) -> String {
    let mut buf: *mut c_char = std::ptr::null_mut();
    let mut len: libc::size_t = 0;
    // SAFETY: open_memstream(3): `buf` and `len` outlive the stream; after `fclose` they hold
    // a malloc'd buffer of `len` bytes plus a NUL, which we free.
    let file = unsafe { libc::open_memstream(&mut buf, &mut len) };
    if file.is_null() {
        return String::new();
    }
    print(file.cast::<sys::FILE>());
    // SAFETY: `file` is the open stream from above, closed once.
    unsafe { libc::fclose(file) };
    if buf.is_null() {
        return String::new();
    }
    // SAFETY: after fclose, `buf` points to `len` bytes written by the stream.
    let bytes = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), len) };
    let text = String::from_utf8_lossy(bytes).into_owned();
    // SAFETY: `buf` was allocated by the stream with malloc and is freed once.
    unsafe { libc::free(buf.cast()) };
    text
}
