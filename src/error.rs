//! The facade's error type.

use std::time::Duration;

use shardcx_shards::{BootError, ForwardError, NetError};

/// Why a node could not run, or an operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The shards could not start or run.
    #[error(transparent)]
    Boot(#[from] BootError),
    /// A connection, or a frame to a remote node, failed.
    #[error(transparent)]
    Net(#[from] NetError),
    /// Forwarding to the owner shard failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
    /// A remote-memory operation, or a region's registration, failed (refused by the
    /// descriptor or by the node holding the region, a malformed reply, ...). Its timeouts are
    /// [`Error::TimedOut`] and its connection errors [`Error::Net`].
    #[error(transparent)]
    Rma(#[from] shardcx_shards::RmaOpError),
    /// A staged copy of device memory failed: no CUDA on this shard (the reason), a buffer on
    /// another device, lengths that differ, or the driver's error.
    #[error(transparent)]
    Cuda(#[from] shardcx_shards::cuda::StagingCopyError),
    /// The operation's deadline passed before it completed.
    #[error("{what} timed out after {after:?}")]
    TimedOut {
        /// The operation.
        what: &'static str,
        /// Its deadline, from the call.
        after: Duration,
    },
    /// The node listening at a peer's recorded address is another node.
    #[error("{addr} is node {found}, not node {expected}")]
    WrongPeer {
        /// The address recorded for the peer.
        addr: std::net::SocketAddr,
        /// The peer the operation was for.
        expected: shardcx_shards::proto::NodeId,
        /// The node that answered there.
        found: shardcx_shards::proto::NodeId,
    },
    /// Connecting to the peer on first use failed recently, and the operation's deadline ends
    /// before the next attempt may start (see [`crate::node::RECONNECT_BACKOFF_MIN`]).
    #[error("connecting to node {node} failed {failures} time(s) in a row; next attempt in {retry_in:?}")]
    BackingOff {
        /// The peer.
        node: shardcx_shards::proto::NodeId,
        /// Connects to it that failed in a row.
        failures: u32,
        /// When the next connect may start.
        retry_in: Duration,
    },
    /// The metrics endpoint ([`crate::NodeBuilder::metrics`]) could not start.
    #[error(transparent)]
    Metrics(#[from] crate::metrics::MetricsError),
    /// The call was made outside a shard thread of a running [`crate::Node`].
    #[error("not called on a shard of a running node")]
    NotOnShard,
    /// A handler was registered for an active-message id the runtime reserves.
    #[error("active-message id {id} is reserved for the runtime")]
    ReservedAmId {
        /// The id.
        id: shardcx_shards::proto::AmId,
    },
    /// An active-message header longer than [`crate::MAX_AM_HEADER`].
    #[error("active-message header of {len} bytes is over the limit")]
    HeaderTooLarge {
        /// The header's length.
        len: usize,
    },
    /// An RPC handler was registered for a function id the runtime reserves
    /// ([`crate::rpc::FIRST_RESERVED_FUNCTION_ID`] and up).
    #[error("rpc function id {id} is reserved for the runtime")]
    ReservedFunctionId {
        /// The id.
        id: shardcx_shards::proto::FunctionId,
    },
    /// Two RPC functions with different ids were registered under one name.
    #[error("rpc function name {name:?} is registered under two ids")]
    DuplicateFunctionName {
        /// The name.
        name: String,
    },
}
