//! RPC wire envelope: the payloads of the four RPC frame kinds.
//!
//! An RPC travels in frames of kind [`FrameKind::RpcRequest`], [`FrameKind::RpcResponse`],
//! [`FrameKind::RpcError`] and [`FrameKind::RpcCancel`]. The frame header (see [`crate::wire`])
//! carries everything that routes the call: `id` is the [`FunctionId`], `req_id` the request
//! ([`ReqId::NONE`] for a one-way call), `incarnation` the sender's incarnation and `ttl_ns` the
//! remaining deadline budget. This module defines what follows the header. All integers are
//! little-endian.
//!
//! # RpcRequest
//!
//! ```text
//! offset size field
//!  0     8    schema         hash of the function's argument and reply types
//!  8     4    flags          CallFlags (ONE_WAY = 1, IDEMPOTENT = 2); other bits must be zero
//! 12     4    reserved       must be zero
//! 16     n    args           the rkyv archive of the arguments (may be empty)
//! ```
//!
//! The prefix is [`REQUEST_PREFIX_LEN`] = 16 bytes, so when the payload starts at a multiple of
//! 16 (as [`crate::wire::payload_offset`] guarantees in a header-and-payload buffer) the archive
//! starts 16-aligned and rkyv can validate it in place.
//!
//! # RpcResponse
//!
//! The payload is the rkyv archive of the reply, with no prefix.
//!
//! # RpcError
//!
//! ```text
//! offset size field
//!  0     2    code           RpcErrorCode
//!  2     2    reserved       must be zero
//!  4     4    message_len    bytes of message, at most MAX_ERROR_MESSAGE = 4096
//!  8     8    detail         code-specific (below), else 0
//! 16     m    message        UTF-8, exactly message_len bytes; nothing follows
//! ```
//!
//! `detail` is the server's schema hash for [`RpcErrorCode::SchemaMismatch`], the server's size
//! limit for [`RpcErrorCode::TooLarge`], and 0 for every other code unless documented there.
//!
//! # RpcCancel
//!
//! The payload is empty; the header's `id` is the [`FunctionId`] and `req_id` the request to
//! cancel.
//!
//! # Decoding
//!
//! [`decode_request`], [`decode_error`] and [`decode_cancel`] accept any byte string and return
//! a value borrowing from it or an [`RpcWireError`]; they check every length before slicing,
//! never panic and never allocate. [`decode_request`] checks, in order: the prefix length, the
//! reserved word, the flag bits. [`decode_error`] checks: the fixed part's length, the reserved
//! word, the code, `message_len` against [`MAX_ERROR_MESSAGE`], `message_len` against the
//! payload, trailing bytes, and UTF-8. The argument archive itself is not checked here (this
//! crate does not know its type): the receiver validates it with `rkyv::access` before use.
//!
//! [`FrameKind::RpcRequest`]: crate::FrameKind::RpcRequest
//! [`FrameKind::RpcResponse`]: crate::FrameKind::RpcResponse
//! [`FrameKind::RpcError`]: crate::FrameKind::RpcError
//! [`FrameKind::RpcCancel`]: crate::FrameKind::RpcCancel
//! [`FunctionId`]: crate::FunctionId
//! [`ReqId::NONE`]: crate::ReqId::NONE

use std::fmt;
use std::ops::BitOr;
use thiserror::Error;

/// Length of the [`RpcRequest`](crate::FrameKind::RpcRequest) payload prefix (schema hash, flags,
/// reserved) before the argument archive.
pub const REQUEST_PREFIX_LEN: usize = 16;
/// Length of the fixed part of an [`RpcError`](crate::FrameKind::RpcError) payload, before the
/// message.
pub const ERROR_HEADER_LEN: usize = 16;
/// Longest error message carried, in bytes; longer messages are cut by [`encode_error`] and
/// refused by [`decode_error`].
pub const MAX_ERROR_MESSAGE: usize = 4096;

/// Per-call flags in a request prefix (a `u32` bit set; undefined bits must be zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Hash)]
pub struct CallFlags(u32);

/// A decoded [`RpcRequest`](crate::FrameKind::RpcRequest) payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RequestEnvelope<'a> {
    /// The schema hash the caller computed for the function's types.
    pub schema: u64,
    /// The call's flags.
    pub flags: CallFlags,
    /// The rkyv archive of the arguments, not yet validated.
    pub args: &'a [u8],
}

/// Why a call failed, as carried in an [`RpcError`](crate::FrameKind::RpcError) payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
#[non_exhaustive]
pub enum RpcErrorCode {
    /// No function is registered under the header's id.
    UnknownFunction = 1,
    /// The caller's schema hash differs from the server's; `detail` is the server's hash.
    SchemaMismatch = 2,
    /// The deadline expired before the handler ran or finished.
    DeadlineExpired = 3,
    /// The request is malformed (bad envelope, or arguments that fail validation).
    BadRequest = 4,
    /// The request or reply exceeds a size limit; `detail` is the server's limit in bytes.
    TooLarge = 5,
    /// The call was cancelled by the caller.
    Cancelled = 6,
    /// The handler returned an error; the message says why.
    Failed = 7,
    /// The request is older than the dedup window can vouch for, so it was not executed
    /// (at-most-once).
    TooOld = 8,
    /// The server is shutting down and accepts no new calls.
    ShuttingDown = 9,
    /// The handler panicked.
    Panicked = 10,
    /// The server is at its concurrency limit; the request was not executed.
    Busy = 11,
}

/// A decoded [`RpcError`](crate::FrameKind::RpcError) payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ErrorBody<'a> {
    /// What went wrong.
    pub code: RpcErrorCode,
    /// Code-specific detail (see [`RpcErrorCode`]); 0 when none.
    pub detail: u64,
    /// Human-readable message, at most [`MAX_ERROR_MESSAGE`] bytes.
    pub message: &'a str,
}

/// A malformed RPC payload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Error)]
#[non_exhaustive]
pub enum RpcWireError {
    /// The payload is shorter than its fixed part, or than its announced message.
    #[error("truncated rpc payload: need {need} bytes, got {got}")]
    Truncated {
        /// Bytes required.
        need: usize,
        /// Bytes available.
        got: usize,
    },
    /// The request's flags have undefined bits set (the whole flag word is given).
    #[error("unknown rpc call flags {0:#x}")]
    UnknownFlags(u32),
    /// A reserved field is not zero.
    #[error("reserved rpc field is not zero")]
    ReservedNonZero,
    /// The error code is not one this build knows.
    #[error("unknown rpc error code {0}")]
    UnknownCode(u16),
    /// The error message length exceeds [`MAX_ERROR_MESSAGE`].
    #[error("rpc error message of {0} bytes exceeds the limit")]
    MessageTooLong(u32),
    /// The error message is not valid UTF-8.
    #[error("rpc error message is not utf-8")]
    BadUtf8,
    /// Bytes follow the end of a payload that must end there.
    #[error("rpc payload has {0} trailing bytes")]
    TrailingBytes(usize),
}

impl CallFlags {
    /// No flags.
    pub const NONE: CallFlags = CallFlags(0);
    /// The caller expects no reply (the header's `req_id` is [`crate::ReqId::NONE`]).
    pub const ONE_WAY: CallFlags = CallFlags(1);
    /// The function is declared idempotent: the caller may retry it.
    pub const IDEMPOTENT: CallFlags = CallFlags(2);
    /// Every defined bit.
    pub const ALL: CallFlags = CallFlags(Self::ONE_WAY.0 | Self::IDEMPOTENT.0);

    /// The raw bits.
    pub const fn bits(self) -> u32 {
        self.0
    }

    /// The flags for `bits`, or `None` if an undefined bit is set.
    pub const fn from_bits(bits: u32) -> Option<CallFlags> {
        if bits & !Self::ALL.0 == 0 {
            Some(CallFlags(bits))
        } else {
            None
        }
    }

    /// Whether every bit of `other` is set in `self`.
    pub const fn contains(self, other: CallFlags) -> bool {
        self.0 & other.0 == other.0
    }
}

impl RpcErrorCode {
    /// Every code, in code order.
    pub const ALL: [RpcErrorCode; 11] = [
        RpcErrorCode::UnknownFunction,
        RpcErrorCode::SchemaMismatch,
        RpcErrorCode::DeadlineExpired,
        RpcErrorCode::BadRequest,
        RpcErrorCode::TooLarge,
        RpcErrorCode::Cancelled,
        RpcErrorCode::Failed,
        RpcErrorCode::TooOld,
        RpcErrorCode::ShuttingDown,
        RpcErrorCode::Panicked,
        RpcErrorCode::Busy,
    ];

    /// The code for a wire value, if any.
    pub fn from_u16(code: u16) -> Option<RpcErrorCode> {
        RpcErrorCode::ALL
            .iter()
            .copied()
            .find(|c| *c as u16 == code)
    }

    /// The wire value.
    pub const fn as_u16(self) -> u16 {
        self as u16
    }
}

impl BitOr for CallFlags {
    type Output = CallFlags;

    fn bitor(self, rhs: CallFlags) -> CallFlags {
        CallFlags(self.0 | rhs.0)
    }
}

impl fmt::Display for RpcErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RpcErrorCode::UnknownFunction => "unknown function",
            RpcErrorCode::SchemaMismatch => "schema mismatch",
            RpcErrorCode::DeadlineExpired => "deadline expired",
            RpcErrorCode::BadRequest => "bad request",
            RpcErrorCode::TooLarge => "too large",
            RpcErrorCode::Cancelled => "cancelled",
            RpcErrorCode::Failed => "failed",
            RpcErrorCode::TooOld => "request too old",
            RpcErrorCode::ShuttingDown => "shutting down",
            RpcErrorCode::Panicked => "handler panicked",
            RpcErrorCode::Busy => "busy",
        })
    }
}

/// The 16-byte request prefix for `schema` and `flags` (reserved word zero). Write it, then the
/// argument archive, to build a request payload without [`encode_request`]'s copy.
pub fn request_prefix(schema: u64, flags: CallFlags) -> [u8; REQUEST_PREFIX_LEN] {
    let mut p = [0u8; REQUEST_PREFIX_LEN];
    p[0..8].copy_from_slice(&schema.to_le_bytes());
    p[8..12].copy_from_slice(&flags.bits().to_le_bytes());
    p
}

/// A whole request payload: [`request_prefix`] followed by `args`.
pub fn encode_request(schema: u64, flags: CallFlags, args: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(REQUEST_PREFIX_LEN + args.len());
    v.extend_from_slice(&request_prefix(schema, flags));
    v.extend_from_slice(args);
    v
}

/// Decodes a request payload. The returned `args` borrow from `payload` (starting at offset
/// [`REQUEST_PREFIX_LEN`]) and are not validated.
pub fn decode_request(payload: &[u8]) -> Result<RequestEnvelope<'_>, RpcWireError> {
    let Some((prefix, args)) = payload.split_first_chunk::<REQUEST_PREFIX_LEN>() else {
        return Err(RpcWireError::Truncated {
            need: REQUEST_PREFIX_LEN,
            got: payload.len(),
        });
    };
    let (schema, rest) = split_u64(prefix);
    let (bits, rest) = split_u32(rest);
    let (reserved, _) = split_u32(rest);
    if reserved != 0 {
        return Err(RpcWireError::ReservedNonZero);
    }
    let flags = CallFlags::from_bits(bits).ok_or(RpcWireError::UnknownFlags(bits))?;
    Ok(RequestEnvelope {
        schema,
        flags,
        args,
    })
}

/// Cuts `message` to at most [`MAX_ERROR_MESSAGE`] bytes, at a char boundary.
pub fn truncate_message(message: &str) -> &str {
    if message.len() <= MAX_ERROR_MESSAGE {
        return message;
    }
    // A char is at most 4 bytes, so a boundary lies within 3 bytes below the limit; index 0 is
    // always a boundary, so the search cannot come up empty.
    let end = (0..=MAX_ERROR_MESSAGE)
        .rev()
        .find(|&i| message.is_char_boundary(i))
        .unwrap_or(0);
    &message[..end]
}

/// A whole error payload. A message longer than [`MAX_ERROR_MESSAGE`] is cut at the last char
/// boundary within the limit ([`truncate_message`]).
pub fn encode_error(code: RpcErrorCode, detail: u64, message: &str) -> Vec<u8> {
    let message = truncate_message(message);
    let mut v = Vec::with_capacity(ERROR_HEADER_LEN + message.len());
    v.extend_from_slice(&code.as_u16().to_le_bytes());
    v.extend_from_slice(&0u16.to_le_bytes());
    // The message was cut to MAX_ERROR_MESSAGE (4096) bytes, which fits a u32.
    v.extend_from_slice(&(message.len() as u32).to_le_bytes());
    v.extend_from_slice(&detail.to_le_bytes());
    v.extend_from_slice(message.as_bytes());
    v
}

/// Decodes an error payload. The message borrows from `payload`.
pub fn decode_error(payload: &[u8]) -> Result<ErrorBody<'_>, RpcWireError> {
    let Some((fixed, rest)) = payload.split_first_chunk::<ERROR_HEADER_LEN>() else {
        return Err(RpcWireError::Truncated {
            need: ERROR_HEADER_LEN,
            got: payload.len(),
        });
    };
    let (code, tail) = split_u16(fixed);
    let (reserved, tail) = split_u16(tail);
    let (message_len, tail) = split_u32(tail);
    let (detail, _) = split_u64(tail);
    if reserved != 0 {
        return Err(RpcWireError::ReservedNonZero);
    }
    let code = RpcErrorCode::from_u16(code).ok_or(RpcWireError::UnknownCode(code))?;
    let len = message_len as usize;
    if len > MAX_ERROR_MESSAGE {
        return Err(RpcWireError::MessageTooLong(message_len));
    }
    let Some(message) = rest.get(..len) else {
        return Err(RpcWireError::Truncated {
            need: ERROR_HEADER_LEN + len,
            got: payload.len(),
        });
    };
    if rest.len() > len {
        return Err(RpcWireError::TrailingBytes(rest.len() - len));
    }
    let message = std::str::from_utf8(message).map_err(|_| RpcWireError::BadUtf8)?;
    Ok(ErrorBody {
        code,
        detail,
        message,
    })
}

/// Checks a cancel payload, which must be empty.
pub fn decode_cancel(payload: &[u8]) -> Result<(), RpcWireError> {
    if payload.is_empty() {
        Ok(())
    } else {
        Err(RpcWireError::TrailingBytes(payload.len()))
    }
}

// Little-endian readers that split a value off the front of a slice. They are called only on the
// fixed-size parts checked above, so the short-input arm (which reads 0) is never taken; it exists
// so that no path can panic.
fn split_u16(b: &[u8]) -> (u16, &[u8]) {
    match b.split_first_chunk::<2>() {
        Some((head, tail)) => (u16::from_le_bytes(*head), tail),
        None => (0, b),
    }
}

fn split_u32(b: &[u8]) -> (u32, &[u8]) {
    match b.split_first_chunk::<4>() {
        Some((head, tail)) => (u32::from_le_bytes(*head), tail),
        None => (0, b),
    }
}

fn split_u64(b: &[u8]) -> (u64, &[u8]) {
    match b.split_first_chunk::<8>() {
        Some((head, tail)) => (u64::from_le_bytes(*head), tail),
        None => (0, b),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn call_flags() {
        let both = CallFlags::ONE_WAY | CallFlags::IDEMPOTENT;
        assert_eq!(both.bits(), 3);
        assert!(both.contains(CallFlags::ONE_WAY));
        assert!(both.contains(CallFlags::IDEMPOTENT));
        assert!(!CallFlags::ONE_WAY.contains(CallFlags::IDEMPOTENT));
        assert!(CallFlags::default().contains(CallFlags::NONE));
        assert_eq!(CallFlags::from_bits(3), Some(both));
        assert_eq!(CallFlags::from_bits(0), Some(CallFlags::NONE));
        assert_eq!(CallFlags::from_bits(4), None);
        assert_eq!(CallFlags::from_bits(u32::MAX), None);
    }

    #[test]
    fn request_layout() {
        let p = encode_request(0x0102_0304_0506_0708, CallFlags::IDEMPOTENT, b"args");
        assert_eq!(
            p,
            [
                &[8, 7, 6, 5, 4, 3, 2, 1][..],
                &[2, 0, 0, 0],
                &[0, 0, 0, 0],
                b"args"
            ]
            .concat()
        );
        assert_eq!(
            p[..REQUEST_PREFIX_LEN],
            request_prefix(0x0102_0304_0506_0708, CallFlags::IDEMPOTENT)
        );
        let env = decode_request(&p).unwrap();
        assert_eq!(
            env,
            RequestEnvelope {
                schema: 0x0102_0304_0506_0708,
                flags: CallFlags::IDEMPOTENT,
                args: b"args",
            }
        );
    }

    #[test]
    fn request_empty_args() {
        let p = encode_request(9, CallFlags::ONE_WAY, &[]);
        assert_eq!(p.len(), REQUEST_PREFIX_LEN);
        let env = decode_request(&p).unwrap();
        assert_eq!(env.args, &[] as &[u8]);
        assert_eq!(env.flags, CallFlags::ONE_WAY);
    }

    #[test]
    fn request_errors() {
        let p = encode_request(1, CallFlags::NONE, b"x");
        for n in 0..REQUEST_PREFIX_LEN {
            assert_eq!(
                decode_request(&p[..n]),
                Err(RpcWireError::Truncated { need: 16, got: n })
            );
        }
        let mut bad = p.clone();
        bad[8] = 4;
        assert_eq!(decode_request(&bad), Err(RpcWireError::UnknownFlags(4)));
        let mut bad = p.clone();
        bad[11] = 0x80;
        assert_eq!(
            decode_request(&bad),
            Err(RpcWireError::UnknownFlags(0x8000_0000))
        );
        for i in 12..16 {
            let mut bad = p.clone();
            bad[i] = 1;
            assert_eq!(decode_request(&bad), Err(RpcWireError::ReservedNonZero));
        }
    }

    #[test]
    fn error_layout() {
        let p = encode_error(RpcErrorCode::SchemaMismatch, 0xdead_beef, "héllo");
        assert_eq!(&p[0..2], &[2, 0]);
        assert_eq!(&p[2..4], &[0, 0]);
        assert_eq!(&p[4..8], &6u32.to_le_bytes());
        assert_eq!(&p[8..16], &0xdead_beefu64.to_le_bytes());
        assert_eq!(&p[16..], "héllo".as_bytes());
        assert_eq!(
            decode_error(&p).unwrap(),
            ErrorBody {
                code: RpcErrorCode::SchemaMismatch,
                detail: 0xdead_beef,
                message: "héllo",
            }
        );
        let empty = encode_error(RpcErrorCode::Busy, 0, "");
        assert_eq!(empty.len(), ERROR_HEADER_LEN);
        assert_eq!(decode_error(&empty).unwrap().message, "");
    }

    #[test]
    fn error_message_cut_at_char_boundary() {
        // 4095 ASCII bytes then a 3-byte char: the char would end at 4098, so it is dropped.
        let long = format!("{}€tail", "a".repeat(MAX_ERROR_MESSAGE - 1));
        let p = encode_error(RpcErrorCode::Failed, 0, &long);
        let body = decode_error(&p).unwrap();
        assert_eq!(body.message.len(), MAX_ERROR_MESSAGE - 1);
        assert!(long.starts_with(body.message));
        let exact = "b".repeat(MAX_ERROR_MESSAGE);
        let body_p = encode_error(RpcErrorCode::Failed, 0, &exact);
        assert_eq!(decode_error(&body_p).unwrap().message, exact);
        let multi = "€".repeat(2000);
        let cut = truncate_message(&multi);
        assert_eq!(cut.len(), 4095);
        assert!(cut.chars().all(|c| c == '€'));
    }

    #[test]
    fn error_errors() {
        let p = encode_error(RpcErrorCode::Failed, 7, "oops");
        for n in 0..ERROR_HEADER_LEN {
            assert_eq!(
                decode_error(&p[..n]),
                Err(RpcWireError::Truncated { need: 16, got: n })
            );
        }
        assert_eq!(
            decode_error(&p[..p.len() - 1]),
            Err(RpcWireError::Truncated { need: 20, got: 19 })
        );
        let mut bad = p.clone();
        bad.push(0);
        assert_eq!(decode_error(&bad), Err(RpcWireError::TrailingBytes(1)));
        let mut bad = p.clone();
        bad[3] = 1;
        assert_eq!(decode_error(&bad), Err(RpcWireError::ReservedNonZero));
        for code in [0u16, 12, 0xffff] {
            let mut bad = p.clone();
            bad[0..2].copy_from_slice(&code.to_le_bytes());
            assert_eq!(decode_error(&bad), Err(RpcWireError::UnknownCode(code)));
        }
        let mut bad = p.clone();
        bad[4..8].copy_from_slice(&(MAX_ERROR_MESSAGE as u32 + 1).to_le_bytes());
        assert_eq!(decode_error(&bad), Err(RpcWireError::MessageTooLong(4097)));
        let mut bad = p.clone();
        bad[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            decode_error(&bad),
            Err(RpcWireError::MessageTooLong(u32::MAX))
        );
        let mut bad = p.clone();
        bad[16] = 0xff;
        assert_eq!(decode_error(&bad), Err(RpcWireError::BadUtf8));
    }

    #[test]
    fn error_codes() {
        for (i, code) in RpcErrorCode::ALL.iter().enumerate() {
            assert_eq!(code.as_u16() as usize, i + 1);
            assert_eq!(RpcErrorCode::from_u16(code.as_u16()), Some(*code));
            assert!(!code.to_string().is_empty());
            let p = encode_error(*code, 0, "");
            assert_eq!(decode_error(&p).unwrap().code, *code);
        }
        assert_eq!(RpcErrorCode::from_u16(0), None);
        assert_eq!(RpcErrorCode::from_u16(12), None);
    }

    #[test]
    fn cancel() {
        assert_eq!(decode_cancel(&[]), Ok(()));
        assert_eq!(decode_cancel(&[0]), Err(RpcWireError::TrailingBytes(1)));
    }
}
