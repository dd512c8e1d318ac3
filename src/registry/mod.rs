//! Service discovery: where nodes listen and which RPC functions they serve.
//!
//! A [`Registry`] stores one [`NodeRecord`] per node (its service name, address, shard count
//! and the [`Signature`]s of its functions) and answers look-ups by service name and by
//! function name. Two backends:
//!
//! - the embedded default, [`crate::rpc::ClusterRegistry`]: no extra service; records are the
//!   signatures each node publishes over RPC ([`crate::rpc::Rpc::discover`]), gathered from
//!   the peers this node knows;
//! - [`RedisRegistry`], for deployments with many nodes: records are kept in a Redis server,
//!   with a time-to-live that the node refreshes.

mod record;
pub mod redis;
mod resp;

use std::net::SocketAddr;

use shardcx_shards::proto::NodeId;

pub use redis::{RedisConfig, RedisRegistry, Registration};

/// One published RPC function: what a client needs to call it and to check it is the same
/// function it was built against.
#[derive(Debug, Clone, PartialEq, Eq, Hash, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub struct Signature {
    /// The function's id (`FunctionId`), unique within a node.
    pub id: u32,
    /// Its name, unique within a node (e.g. `"kv.get"`).
    pub name: String,
    /// Hash of its argument and reply types (checked on every call).
    pub schema: u64,
    /// Its version, set by the function's author.
    pub version: u32,
}

/// What a node publishes about itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRecord {
    /// The service the node belongs to (several nodes may serve one service).
    pub service: String,
    /// The node.
    pub node: NodeId,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its shard count.
    pub shards: u16,
    /// The functions it serves.
    pub functions: Vec<Signature>,
}

impl NodeRecord {
    /// The signature of the function named `name`, if the node serves it.
    pub fn function(&self, name: &str) -> Option<&Signature> {
        self.functions.iter().find(|f| f.name == name)
    }
}

/// Why a registry operation failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RegistryError {
    /// The registry's backend could not be reached or failed (connection refused, closed,
    /// an I/O error).
    #[error("registry backend unavailable: {0}")]
    Unavailable(String),
    /// The backend answered something this client cannot understand, or refused the
    /// operation.
    #[error("registry protocol error: {0}")]
    Protocol(String),
    /// The operation did not complete within its deadline.
    #[error("registry operation timed out after {0:?}")]
    TimedOut(std::time::Duration),
    /// An argument or setting the registry cannot use (a malformed Redis URL, a zero ttl, a
    /// refresh period not shorter than the ttl).
    #[error("invalid registry argument: {0}")]
    Invalid(String),
    /// Asking a peer over RPC failed (the embedded registry).
    #[error("asking node {node} failed: {message}")]
    Peer {
        /// The peer.
        node: NodeId,
        /// The RPC error, as text.
        message: String,
    },
}

/// A place where nodes publish their [`NodeRecord`] and clients find them. Its futures run on
/// a shard (they are not `Send`).
#[allow(async_fn_in_trait)]
pub trait Registry {
    /// Publishes `record`, replacing the node's previous one.
    async fn register(&self, record: &NodeRecord) -> Result<(), RegistryError>;
    /// Removes the record of `node` (no error if there is none).
    async fn deregister(&self, service: &str, node: NodeId) -> Result<(), RegistryError>;
    /// The nodes registered under `service`.
    async fn lookup(&self, service: &str) -> Result<Vec<NodeRecord>, RegistryError>;
    /// The nodes, of any service, that serve a function named `function`.
    async fn find_function(&self, function: &str) -> Result<Vec<NodeRecord>, RegistryError>;
}
