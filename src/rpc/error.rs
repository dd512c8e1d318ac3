//! [`RpcError`]: why a call failed.

use std::time::Duration;

use shardcx_shards::proto::rpc::{ErrorBody, RpcErrorCode};
use shardcx_shards::proto::FunctionId;
use shardcx_shards::NetError;

use crate::Error;

/// Why a call failed: on the server (the [`RpcErrorCode`]s), on the way ([`RpcError::Net`]),
/// or on the client.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The server has no function with this id.
    #[error("function {id} is unknown to the server")]
    UnknownFunction {
        /// The id called.
        id: FunctionId,
    },
    /// No function of this name is published by the node ([`crate::rpc::Rpc::lookup`]).
    #[error("no function named {name:?}")]
    UnknownName {
        /// The name looked up.
        name: String,
    },
    /// The server's function has another schema hash (other types, or another version).
    #[error("schema mismatch: ours {ours:#018x}, the server's {theirs:#018x}")]
    SchemaMismatch {
        /// The caller's hash.
        ours: u64,
        /// The server's hash.
        theirs: u64,
    },
    /// The server saw the call's deadline pass before the handler finished (the handler may
    /// have had effects).
    #[error("deadline expired on the server")]
    DeadlineExpired,
    /// No answer came within the call's deadline (the call may or may not have run).
    #[error("rpc call timed out after {after:?}")]
    TimedOut {
        /// The call's deadline.
        after: Duration,
    },
    /// The server answered that the call was cancelled.
    #[error("call cancelled")]
    Cancelled,
    /// The server refused the request as malformed (bad envelope, or arguments that fail
    /// validation).
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The reply failed validation (or an error reply was malformed).
    #[error("bad reply: {0}")]
    BadReply(String),
    /// The arguments are over a limit: this node's (before sending) or the server's.
    #[error("arguments of {len} bytes are over the limit of {max}")]
    TooLarge {
        /// Their length in bytes (0 when the server did not say).
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The handler returned an error.
    #[error("call failed: {0}")]
    Failed(String),
    /// The handler panicked (the server goes on serving).
    #[error("handler panicked: {0}")]
    Panicked(String),
    /// The request is older than the server's dedup window can vouch for: not run.
    #[error("request too old for the server's dedup window: not run")]
    TooOld,
    /// The server is shutting down.
    #[error("server shutting down")]
    ShuttingDown,
    /// The server is at its limit; the call was not run.
    #[error("server busy")]
    Busy,
    /// An error code this build does not know.
    #[error("server error {code}: {message}")]
    Remote {
        /// The wire code.
        code: u16,
        /// The server's message.
        message: String,
    },
    /// The call did not reach the server, or its connection failed (not connected, peer dead,
    /// closed, backing off, not on a shard...).
    #[error(transparent)]
    Net(#[from] Error),
}

impl RpcError {
    /// The error for a decoded error reply to a call of `id` whose schema hash was `ours` and
    /// whose arguments were `len` bytes long.
    pub(crate) fn from_body(body: &ErrorBody<'_>, id: FunctionId, ours: u64, len: u64) -> Self {
        let message = body.message.to_owned();
        match body.code {
            RpcErrorCode::UnknownFunction => RpcError::UnknownFunction { id },
            RpcErrorCode::SchemaMismatch => RpcError::SchemaMismatch {
                ours,
                theirs: body.detail,
            },
            RpcErrorCode::DeadlineExpired => RpcError::DeadlineExpired,
            RpcErrorCode::BadRequest => RpcError::BadRequest(message),
            RpcErrorCode::TooLarge => RpcError::TooLarge {
                len,
                max: body.detail,
            },
            RpcErrorCode::Cancelled => RpcError::Cancelled,
            RpcErrorCode::Failed => RpcError::Failed(message),
            RpcErrorCode::TooOld => RpcError::TooOld,
            RpcErrorCode::ShuttingDown => RpcError::ShuttingDown,
            RpcErrorCode::Panicked => RpcError::Panicked(message),
            RpcErrorCode::Busy => RpcError::Busy,
            other => RpcError::Remote {
                code: other.as_u16(),
                message,
            },
        }
    }

    /// The error for a failure of the net layer or the facade while calling.
    pub(crate) fn from_net(e: Error, timeout: Duration) -> Self {
        match e {
            Error::TimedOut { .. } | Error::Net(NetError::TimedOut { what: "request" }) => {
                RpcError::TimedOut { after: timeout }
            }
            Error::Net(NetError::TooLarge { len, max }) => RpcError::TooLarge { len, max },
            other => RpcError::Net(other),
        }
    }

    /// Whether the connection failed under the call (it may have run): the case an idempotent
    /// function is retried in.
    pub fn is_connection_failure(&self) -> bool {
        matches!(
            self,
            RpcError::Net(Error::Net(
                NetError::PeerDead { .. } | NetError::Closed { .. } | NetError::Transport { .. }
            ))
        )
    }

    /// The server's code for this error, when it came from the server.
    pub fn code(&self) -> Option<RpcErrorCode> {
        Some(match self {
            RpcError::UnknownFunction { .. } => RpcErrorCode::UnknownFunction,
            RpcError::SchemaMismatch { .. } => RpcErrorCode::SchemaMismatch,
            RpcError::DeadlineExpired => RpcErrorCode::DeadlineExpired,
            RpcError::BadRequest(_) => RpcErrorCode::BadRequest,
            RpcError::TooLarge { .. } => RpcErrorCode::TooLarge,
            RpcError::Cancelled => RpcErrorCode::Cancelled,
            RpcError::Failed(_) => RpcErrorCode::Failed,
            RpcError::TooOld => RpcErrorCode::TooOld,
            RpcError::ShuttingDown => RpcErrorCode::ShuttingDown,
            RpcError::Panicked(_) => RpcErrorCode::Panicked,
            RpcError::Busy => RpcErrorCode::Busy,
            _ => return None,
        })
    }
}
