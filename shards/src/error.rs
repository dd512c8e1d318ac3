//! Errors of booting and running shards, of forwarding work between them, and of connections
//! between nodes.

use std::net::SocketAddr;

use thiserror::Error;

use crate::proto::handshake::{HandshakeError, RejectReason};
use crate::proto::ids::{NodeId, ShardId};

/// Why shards could not start or run.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum BootError {
    /// The executors' io memory does not fit the locked-memory limit.
    #[error(
        "locked memory too small: RLIMIT_MEMLOCK is {limit} bytes, {shard_count} shards need \
         {need} bytes (raise it with `ulimit -l` or use fewer shards)"
    )]
    MemlockTooSmall {
        /// The limit read from `/proc/self/limits`, in bytes.
        limit: u64,
        /// Bytes needed for all shards.
        need: u64,
        /// Number of shards asked for.
        shard_count: usize,
    },
    /// A glommio executor could not be created (io_uring missing or refused, a bad CPU).
    #[error("shard {shard}: cannot create its executor (is io_uring available?): {reason}")]
    Executor {
        /// The shard's index.
        shard: usize,
        /// glommio's error, as text (glommio's error type is not `Send`).
        reason: String,
    },
    /// UCX refused to create a shard's context, worker or memory.
    #[error("shard {shard}: ucx: {source}")]
    Ucx {
        /// The shard's index.
        shard: usize,
        /// The UCX error.
        #[source]
        source: crate::ucx::Error,
    },
    /// The memory pool's geometry was refused.
    #[error("shard {shard}: memory pool: {source}")]
    Pool {
        /// The shard's index.
        shard: usize,
        /// The pool error.
        #[source]
        source: crate::proto::pool::PoolError,
    },
    /// The progress driver's waker could not be set up.
    #[error("shard {shard}: progress driver: {source}")]
    Driver {
        /// The shard's index.
        shard: usize,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The node's listener could not be set up.
    #[error("shard {shard}: cannot listen: {reason}")]
    Listen {
        /// The shard's index.
        shard: usize,
        /// What went wrong, as text.
        reason: String,
    },
    /// The CUDA mode asked for (`SHARDCX_CUDA` or [`ShardsBuilder::cuda`]) cannot run here, or
    /// the shard's device could not be opened.
    ///
    /// [`ShardsBuilder::cuda`]: crate::ShardsBuilder::cuda
    #[error("shard {shard}: {source}")]
    Cuda {
        /// The shard's index.
        shard: usize,
        /// The CUDA error.
        #[source]
        source: crate::ucx::cuda::CudaError,
    },
    /// A setting was invalid.
    #[error("invalid setting: {0}")]
    Config(&'static str),
    /// A shard's thread panicked.
    #[error("shard {shard} panicked")]
    Panicked {
        /// The shard's index.
        shard: usize,
    },
}

/// Why a forwarded call ([`crate::ShardCtx::forward`]) failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ForwardError {
    /// The target is not a shard of this set.
    #[error("forward from shard {from} to shard {to}: no such shard ({shard_count} shards)")]
    NoSuchShard {
        /// The calling shard.
        from: ShardId,
        /// The shard asked for.
        to: ShardId,
        /// Number of shards in the set.
        shard_count: usize,
    },
    /// The target shard has failed or left the set (its lanes are closed); the job may or may
    /// not have run.
    #[error("forward from shard {from} to shard {to}: target shard stopped")]
    ShardStopped {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
    },
    /// The calling shard's user future has ended: tasks it left behind may not start new
    /// forwards (forwarded jobs still may).
    #[error("forward from shard {from} to shard {to}: shard {from} is shutting down")]
    ShuttingDown {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
    },
    /// The call comes from a job nested as deep as the mesh allows.
    #[error("forward from shard {from} to shard {to}: nesting depth {depth} is the limit")]
    TooDeep {
        /// The calling shard.
        from: ShardId,
        /// The target shard.
        to: ShardId,
        /// The caller's nesting depth.
        depth: usize,
    },
    /// The job panicked on the target shard (the target keeps running).
    #[error("forwarded job panicked on shard {shard}: {message}")]
    JobPanicked {
        /// The shard the job ran on.
        shard: ShardId,
        /// The panic message, when it was a string.
        message: String,
    },
}

/// Why a connection between nodes, or a frame to a remote node, failed.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum NetError {
    /// The peer refused the handshake, or proved a different key (`BadProof`).
    #[error("node {node} refused the connection: {reason:?}")]
    Refused {
        /// The remote node.
        node: NodeId,
        /// The reject reason (proto's).
        reason: RejectReason,
    },
    /// The handshake failed for another reason (version, shard count, wrong node...).
    #[error("handshake with node {node} failed: {source}")]
    Handshake {
        /// The remote node.
        node: NodeId,
        /// proto's handshake error.
        #[source]
        source: HandshakeError,
    },
    /// A deadline passed (`what` is `"bootstrap"`, `"handshake"`, `"request"`,
    /// `"rendezvous"`, `"tag receive"`, or `"put"`/`"get"` for trusted remote memory).
    #[error("{what} timed out")]
    TimedOut {
        /// The step that timed out.
        what: &'static str,
    },
    /// Nothing answers at the address, or the bootstrap connection broke before the directory
    /// came.
    #[error("cannot reach {addr}: {kind}")]
    Unreachable {
        /// The address dialled.
        addr: SocketAddr,
        /// What the socket said.
        kind: std::io::ErrorKind,
    },
    /// The peer stopped answering heartbeats.
    #[error("node {node} is dead")]
    PeerDead {
        /// The remote node.
        node: NodeId,
    },
    /// The endpoint to the peer failed.
    #[error("transport to node {node} failed")]
    Transport {
        /// The remote node.
        node: NodeId,
    },
    /// The rail to the node holds [`crate::NetConfig::max_backlog_bytes`] of frames that UCX
    /// has not completed (the peer is slow, stopped or cut off): the send was refused before
    /// anything was queued or sent. Try again once earlier sends complete.
    #[error("the rail to node {node} holds {held} bytes not yet sent (limit {limit})")]
    Backlogged {
        /// The remote node.
        node: NodeId,
        /// The bytes the rail held.
        held: u64,
        /// The limit ([`crate::NetConfig::max_backlog_bytes`]).
        limit: u64,
    },
    /// The connection closed (locally or by the peer) before the operation completed.
    #[error("connection to node {node} closed")]
    Closed {
        /// The remote node.
        node: NodeId,
    },
    /// There is no ready connection to the node.
    #[error("not connected to node {node}")]
    NotConnected {
        /// The remote node.
        node: NodeId,
    },
    /// The node was built without a pre-shared key, so it cannot connect.
    #[error("no pre-shared key configured")]
    NoKey,
    /// The address is this node's own listener.
    #[error("cannot connect a node to itself")]
    SelfConnect,
    /// The listener sent a malformed directory.
    #[error("malformed directory from {addr}")]
    BadDirectory {
        /// The address dialled.
        addr: SocketAddr,
    },
    /// The frame could not be encoded (e.g. too large).
    #[error("frame: {source}")]
    Wire {
        /// The wire error.
        #[source]
        source: crate::proto::WireError,
    },
    /// The payload is larger than [`crate::NetConfig::max_message_size`]; refused before
    /// anything was allocated or sent.
    #[error("message of {len} bytes exceeds the maximum of {max}")]
    TooLarge {
        /// The payload's length.
        len: u64,
        /// The limit.
        max: u64,
    },
    /// The application's header is longer than a frame carries (see
    /// [`crate::net::MAX_USER_HEADER`]); refused before anything was sent.
    #[error("header of {len} bytes exceeds the maximum of {max}")]
    HeaderTooLarge {
        /// The header's length.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A node announced a shard count this node cannot pair rails with (outside
    /// `1..=MAX_SHARDS`, or a directory without a worker for one of its shards).
    #[error("node {node} has an unusable shard count {count}")]
    BadShardCount {
        /// The remote node.
        node: NodeId,
        /// The shard count it announced.
        count: u16,
    },
    /// Another local shard holds the rail: a synchronous send must be made there (or use the
    /// asynchronous form, which forwards).
    #[error("the rail to node {node} is held by local shard {owner}")]
    OtherShard {
        /// The remote node.
        node: NodeId,
        /// The local shard that holds the rail.
        owner: ShardId,
    },
    /// No rail of this node leads to that shard of the remote node (it has fewer shards).
    #[error("node {node} has no shard {shard}")]
    NoSuchShard {
        /// The remote node.
        node: NodeId,
        /// The shard asked for.
        shard: ShardId,
    },
    /// The frame kind cannot be used for this operation (e.g. a control kind, or a reply kind
    /// that does not answer the request's kind).
    #[error("frame kind {kind:?} cannot be used to {op}")]
    BadKind {
        /// The kind given.
        kind: crate::proto::FrameKind,
        /// The operation.
        op: &'static str,
    },
    /// The buffer chosen for rendezvous data is smaller than the data.
    #[error("rendezvous buffer of {got} bytes is too small for {need} bytes")]
    BufferTooSmall {
        /// Bytes of data.
        need: usize,
        /// Bytes of the buffer.
        got: usize,
    },
    /// Pulling rendezvous data from the node failed.
    #[error("receiving rendezvous data from node {node}: {source}")]
    Receive {
        /// The sending node.
        node: NodeId,
        /// The UCX error.
        #[source]
        source: crate::ucx::Error,
    },
    /// UCX refused to create an endpoint.
    #[error("ucx: {source}")]
    Ucx {
        /// The UCX error.
        #[source]
        source: crate::ucx::Error,
    },
    /// The OS random source could not be read.
    #[error("cannot read /dev/urandom: {reason}")]
    Random {
        /// The I/O error, as text.
        reason: String,
    },
    /// The shard is shutting down.
    #[error("shard is shutting down")]
    ShuttingDown,
    /// Forwarding to the owner shard failed.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}
