//! The one place where UCX status codes become Rust errors.
//!
//! UCX reports results as `ucs_status_t`, a one-byte signed C enum, either returned directly or
//! smuggled inside a pointer (`ucs_status_ptr_t`). ucx1-sys models `ucs_status_t` as a Rust enum,
//! and a value that is not one of its declared variants is undefined behaviour: a newer libucp
//! may return codes that UCX 1.12's headers do not list. So every status in this crate crosses
//! the FFI boundary as a raw `i8` (see `ffi.rs`) and is matched here, with a catch-all for codes
//! we do not know.

use std::ffi::CStr;

/// A raw UCX status code (`ucs_status_t`) as it came from the library.
pub type RawStatus = i8;

/// Raw value of `UCS_OK`.
pub(crate) const UCS_OK: RawStatus = 0;
/// Raw value of `UCS_INPROGRESS`.
pub(crate) const UCS_INPROGRESS: RawStatus = 1;
/// Raw value of `UCS_ERR_BUSY`, returned by `ucp_worker_arm` when events are pending.
pub(crate) const UCS_ERR_BUSY: RawStatus = -15;
/// Raw value of `UCS_ERR_CANCELED`.
pub(crate) const UCS_ERR_CANCELED: RawStatus = -16;
/// Raw value of `UCS_ERR_LAST`: every error code is above it.
const UCS_ERR_LAST: RawStatus = -100;

/// An error reported by UCX, or by this crate when it refuses a request before calling UCX.
///
/// Variants name the UCX status they stand for; codes this crate does not know (from a newer
/// UCX, say) are kept as [`Error::Other`] with their raw value and UCX's own description.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `UCS_ERR_NO_MESSAGE`.
    #[error("no pending message")]
    NoMessage,
    /// `UCS_ERR_NO_RESOURCE`: resources are temporarily exhausted.
    #[error("no resources are available")]
    NoResource,
    /// `UCS_ERR_IO_ERROR`.
    #[error("input/output error")]
    IoError,
    /// `UCS_ERR_NO_MEMORY`.
    #[error("out of memory")]
    NoMemory,
    /// `UCS_ERR_INVALID_PARAM`.
    #[error("invalid parameter")]
    InvalidParam,
    /// `UCS_ERR_UNREACHABLE`: no transport can reach the destination.
    #[error("destination is unreachable")]
    Unreachable,
    /// `UCS_ERR_INVALID_ADDR`.
    #[error("address not valid")]
    InvalidAddr,
    /// `UCS_ERR_NOT_IMPLEMENTED`.
    #[error("function not implemented")]
    NotImplemented,
    /// `UCS_ERR_MESSAGE_TRUNCATED`: the receive buffer was smaller than the message.
    #[error("message truncated")]
    MessageTruncated,
    /// `UCS_ERR_NO_PROGRESS`.
    #[error("no progress")]
    NoProgress,
    /// `UCS_ERR_BUFFER_TOO_SMALL`.
    #[error("provided buffer is too small")]
    BufferTooSmall,
    /// `UCS_ERR_NO_ELEM`.
    #[error("no such element")]
    NoElem,
    /// `UCS_ERR_SOME_CONNECTS_FAILED`.
    #[error("failed to connect some of the requested endpoints")]
    SomeConnectsFailed,
    /// `UCS_ERR_NO_DEVICE`.
    #[error("no such device")]
    NoDevice,
    /// `UCS_ERR_BUSY`.
    #[error("device is busy")]
    Busy,
    /// `UCS_ERR_CANCELED`: the request was cancelled (dropped future, closed endpoint).
    #[error("request canceled")]
    Canceled,
    /// `UCS_ERR_SHMEM_SEGMENT`.
    #[error("shared memory error")]
    ShmemSegment,
    /// `UCS_ERR_ALREADY_EXISTS`.
    #[error("element already exists")]
    AlreadyExists,
    /// `UCS_ERR_OUT_OF_RANGE`.
    #[error("index out of range")]
    OutOfRange,
    /// `UCS_ERR_TIMED_OUT`.
    #[error("operation timed out")]
    TimedOut,
    /// `UCS_ERR_EXCEEDS_LIMIT`.
    #[error("user-defined limit was reached")]
    ExceedsLimit,
    /// `UCS_ERR_UNSUPPORTED`.
    #[error("unsupported operation")]
    Unsupported,
    /// `UCS_ERR_REJECTED`: the peer rejected the connection.
    #[error("operation rejected by remote peer")]
    Rejected,
    /// `UCS_ERR_NOT_CONNECTED`.
    #[error("endpoint is not connected")]
    NotConnected,
    /// `UCS_ERR_CONNECTION_RESET`: the peer went away.
    #[error("connection reset by remote peer")]
    ConnectionReset,
    /// A link failure (`UCS_ERR_FIRST_LINK_FAILURE ..= UCS_ERR_LAST_LINK_FAILURE`).
    #[error("link failure (ucs status {0})")]
    LinkFailure(RawStatus),
    /// `UCS_ERR_ENDPOINT_TIMEOUT`: the peer stopped answering.
    #[error("endpoint timeout")]
    EndpointTimeout,
    /// Another endpoint failure (`UCS_ERR_FIRST_ENDPOINT_FAILURE ..= UCS_ERR_LAST_ENDPOINT_FAILURE`).
    #[error("endpoint failure (ucs status {0})")]
    EndpointFailure(RawStatus),
    /// A status this crate does not know, with UCX's own description of it.
    #[error("ucx status {code}: {message}")]
    Other {
        /// The raw `ucs_status_t` value.
        code: RawStatus,
        /// What `ucs_status_string` says about it.
        message: String,
    },
    /// The endpoint was closed, or failed earlier, before this operation was posted.
    #[error("endpoint closed")]
    EndpointClosed,
    /// An argument was refused by this crate before it reached UCX.
    #[error("invalid argument: {0}")]
    InvalidArgument(&'static str),
    /// A string given to UCX (a configuration name or value) held a NUL byte.
    #[error("string contains a nul byte")]
    NulByte,
}

/// Where a `ucs_status_ptr_t` left us.
pub(crate) enum StatusPtr {
    /// The operation completed immediately (a NULL pointer, `UCS_OK`).
    Done,
    /// The operation is in flight; the pointer is its request.
    Request(*mut std::ffi::c_void),
    /// The operation failed immediately.
    Failed(Error),
}

impl Error {
    /// Map a raw error status to an error. `UCS_OK` and `UCS_INPROGRESS` are not errors and
    /// should not be passed here; they map to [`Error::Other`] if they are.
    pub fn from_raw(code: RawStatus) -> Self {
        match code {
            -1 => Error::NoMessage,
            -2 => Error::NoResource,
            -3 => Error::IoError,
            -4 => Error::NoMemory,
            -5 => Error::InvalidParam,
            -6 => Error::Unreachable,
            -7 => Error::InvalidAddr,
            -8 => Error::NotImplemented,
            -9 => Error::MessageTruncated,
            -10 => Error::NoProgress,
            -11 => Error::BufferTooSmall,
            -12 => Error::NoElem,
            -13 => Error::SomeConnectsFailed,
            -14 => Error::NoDevice,
            -15 => Error::Busy,
            -16 => Error::Canceled,
            -17 => Error::ShmemSegment,
            -18 => Error::AlreadyExists,
            -19 => Error::OutOfRange,
            -20 => Error::TimedOut,
            -21 => Error::ExceedsLimit,
            -22 => Error::Unsupported,
            -23 => Error::Rejected,
            -24 => Error::NotConnected,
            -25 => Error::ConnectionReset,
            -59..=-40 => Error::LinkFailure(code),
            -80 => Error::EndpointTimeout,
            -89..=-60 => Error::EndpointFailure(code),
            _ => Error::Other {
                code,
                message: status_string(code),
            },
        }
    }

    /// The raw UCX status this error stands for, when it came from UCX.
    pub fn raw(&self) -> Option<RawStatus> {
        Some(match self {
            Error::NoMessage => -1,
            Error::NoResource => -2,
            Error::IoError => -3,
            Error::NoMemory => -4,
            Error::InvalidParam => -5,
            Error::Unreachable => -6,
            Error::InvalidAddr => -7,
            Error::NotImplemented => -8,
            Error::MessageTruncated => -9,
            Error::NoProgress => -10,
            Error::BufferTooSmall => -11,
            Error::NoElem => -12,
            Error::SomeConnectsFailed => -13,
            Error::NoDevice => -14,
            Error::Busy => -15,
            Error::Canceled => -16,
            Error::ShmemSegment => -17,
            Error::AlreadyExists => -18,
            Error::OutOfRange => -19,
            Error::TimedOut => -20,
            Error::ExceedsLimit => -21,
            Error::Unsupported => -22,
            Error::Rejected => -23,
            Error::NotConnected => -24,
            Error::ConnectionReset => -25,
            Error::LinkFailure(c) | Error::EndpointFailure(c) => *c,
            Error::EndpointTimeout => -80,
            Error::Other { code, .. } => *code,
            Error::EndpointClosed | Error::InvalidArgument(_) | Error::NulByte => return None,
        })
    }

    /// Whether this error means the peer or the connection is gone (as opposed to a local,
    /// per-operation problem).
    pub fn is_connection_failure(&self) -> bool {
        matches!(
            self,
            Error::ConnectionReset
                | Error::NotConnected
                | Error::Unreachable
                | Error::EndpointTimeout
                | Error::EndpointFailure(_)
                | Error::LinkFailure(_)
                | Error::IoError
                | Error::EndpointClosed
                | Error::Rejected
        )
    }
}

/// Turn a raw status returned by a UCX call into a result.
pub(crate) fn check(code: RawStatus) -> Result<(), Error> {
    if code == UCS_OK {
        Ok(())
    } else {
        Err(Error::from_raw(code))
    }
}

/// A raw completion status (from a callback or `ucp_request_check_status`) as a result.
pub(crate) fn completion(code: RawStatus) -> Result<(), Error> {
    check(code)
}

/// Decode a `ucs_status_ptr_t` as UCX's `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR` macros do, without
/// ever building a `ucs_status_t` enum value from it.
#[inline(always)]
pub(crate) fn status_ptr(ptr: *mut std::ffi::c_void) -> StatusPtr {
    let raw = ptr as usize;
    // `UCS_PTR_IS_ERR(p)`: (uintptr_t)p >= (uintptr_t)UCS_ERR_LAST, with UCS_ERR_LAST negative.
    let err_floor = UCS_ERR_LAST as isize as usize;
    if raw == 0 {
        StatusPtr::Done
    } else if raw >= err_floor {
        // `UCS_PTR_RAW_STATUS(p)`: (ucs_status_t)(intptr_t)p; the value is in -100..0.
        let code = raw as isize as RawStatus;
        StatusPtr::Failed(Error::from_raw(code))
    } else {
        StatusPtr::Request(ptr)
    }
}

/// UCX's description of a raw status (`ucs_status_string`).
pub fn status_string(code: RawStatus) -> String {
    // SAFETY: `ucs_status_string` (ucs/type/status.h) accepts any status value: unknown codes
    // yield a static "Unknown error" string. It returns a pointer to a static NUL-terminated
    // string, which we copy. It is declared in `ffi` with a raw `i8` argument, so no Rust enum
    // value is invented from `code`.
    let p = unsafe { crate::ffi::ucs_status_string(code) };
    if p.is_null() {
        return format!("unknown status {code}");
    }
    // SAFETY: non-null, NUL-terminated, static storage (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// A shorter name for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_declared_code_round_trips() {
        for code in -100i8..=-1 {
            let e = Error::from_raw(code);
            if let Error::Other { code: c, .. } = &e {
                assert_eq!(*c, code);
            } else {
                assert_eq!(e.raw(), Some(code), "{e:?}");
            }
        }
    }

    #[test]
    fn status_pointers_decode_like_the_c_macros() {
        assert!(matches!(status_ptr(std::ptr::null_mut()), StatusPtr::Done));
        let canceled = (UCS_ERR_CANCELED as isize) as usize as *mut std::ffi::c_void;
        assert!(matches!(
            status_ptr(canceled),
            StatusPtr::Failed(Error::Canceled)
        ));
        // A code newer than UCX 1.12 (say -26) is still an error, kept raw.
        let newer = (-26isize) as usize as *mut std::ffi::c_void;
        match status_ptr(newer) {
            StatusPtr::Failed(Error::Other { code, .. }) => assert_eq!(code, -26),
            _ => panic!("-26 must decode as an unknown error"),
        }
        let mut x = 0u64;
        let p = (&mut x as *mut u64).cast::<std::ffi::c_void>();
        assert!(matches!(status_ptr(p), StatusPtr::Request(q) if q == p));
    }

    #[test]
    fn unknown_codes_keep_ucx_text() {
        let e = Error::from_raw(-30);
        assert!(matches!(e, Error::Other { code: -30, .. }));
        assert!(!e.to_string().is_empty());
    }
}
