//! [`ClusterRegistry`]: the embedded registry, built on the built-in [`Describe`] function.

use std::net::SocketAddr;
use std::time::Duration;

use shardcx_shards::proto::{NodeId, ShardId};

use super::{Describe, NodeInfo, RpcError};
use crate::registry::{NodeRecord, Registry, RegistryError};
use crate::{Node, Peer};

/// The embedded [`Registry`]: no service to run; every node describes itself over RPC (the
/// built-in [`Describe`]) and a look-up asks the peers this node knows.
///
/// What it can do:
/// - [`Registry::register`] publishes *this* node's record: the service name it gives is what
///   this node's `Describe` answers from then on (its functions, address and shard count are
///   always the node's own). A record for another node is refused
///   ([`RegistryError::Protocol`]).
/// - [`Registry::lookup`] and [`Registry::find_function`] ask every known peer, in turn, each
///   within the registry's per-peer deadline: the peers with a listen address in this node's
///   address book ([`crate::NodeBuilder::peer_addr`]; connected on first use) and those with a
///   session on any shard. This node's own record is included when it listens. A node that
///   registered no service has the service `""`. Peers that do not answer, or that have no
///   address (neither listening nor in the address book), are left out.
///
/// What it cannot do: find nodes this node has never heard of (there is no gossip: a node
/// learns peers only from its configuration and its connections), remove another node's
/// record ([`Registry::deregister`] of another node is refused), or keep records of nodes that
/// are down (they simply stop answering). Each look-up costs one round trip per known peer.
/// For many nodes, or discovery by name of nodes not yet known, use the Redis registry.
#[derive(Clone)]
pub struct ClusterRegistry {
    node: Node,
    per_peer: Duration,
}

impl ClusterRegistry {
    /// The embedded registry as seen from `node`'s shard; each peer is given the node's
    /// default RPC deadline to answer.
    pub fn new(node: &Node) -> Self {
        let per_peer = node.rpc().default_deadline();
        Self {
            node: node.clone(),
            per_peer,
        }
    }

    /// The same, giving each peer `per_peer` to answer.
    pub fn with_deadline(node: &Node, per_peer: Duration) -> Self {
        Self {
            node: node.clone(),
            per_peer,
        }
    }

    /// This node's published service name, if it registered.
    pub fn service(&self) -> Option<String> {
        self.node
            .local()
            .rpc
            .service
            .lock()
            .ok()
            .and_then(|s| s.clone())
    }

    /// Every peer this node knows: its address book, and the sessions of all its shards.
    async fn known(&self) -> Vec<(Peer, Option<SocketAddr>)> {
        let mut out: Vec<(Peer, Option<SocketAddr>)> = self
            .node
            .known_peers()
            .into_iter()
            .map(|(p, a)| (p, Some(a)))
            .collect();
        let ctx = self.node.shard_ctx();
        for i in 0..self.node.shard_count() {
            let shard = ShardId::new(u16::try_from(i).unwrap_or(u16::MAX));
            let nodes = ctx
                .forward(shard, |c| async move {
                    c.connected_nodes()
                        .into_iter()
                        .map(|r| r.node_id)
                        .collect::<Vec<NodeId>>()
                })
                .await
                .unwrap_or_default();
            for n in nodes {
                if !out.iter().any(|(p, _)| p.node_id() == n) {
                    out.push((Peer::new(n), None));
                }
            }
        }
        out
    }

    /// The records of every known node (and this one, if it listens) that `keep` accepts.
    async fn gather(&self, keep: impl Fn(&NodeRecord) -> bool) -> Vec<NodeRecord> {
        let mut out = Vec::new();
        if let Some(me) = self.own_record() {
            if keep(&me) {
                out.push(me);
            }
        }
        let rpc = self.node.rpc();
        for (peer, book_addr) in self.known().await {
            let info: Result<NodeInfo, RpcError> =
                rpc.call_within::<Describe>(peer, &(), self.per_peer).await;
            let Ok(info) = info else { continue };
            if let Some(record) = record_of(peer.node_id(), info, book_addr) {
                if keep(&record) {
                    out.push(record);
                }
            }
        }
        out
    }

    fn own_record(&self) -> Option<NodeRecord> {
        let service = self.service().unwrap_or_default();
        let addr = self.node.listen_addr()?;
        Some(NodeRecord {
            service,
            node: self.node.id(),
            addr,
            shards: u16::try_from(self.node.shard_count()).unwrap_or(u16::MAX),
            functions: self.node.local().rpc.signatures().to_vec(),
        })
    }
}

/// A record from a peer's description (service `""` when it registered none): `None` when it
/// has no address.
fn record_of(node: NodeId, info: NodeInfo, book_addr: Option<SocketAddr>) -> Option<NodeRecord> {
    let service = info.service.unwrap_or_default();
    // The book's address is how this node reaches the peer; else the peer's own (which may be
    // a wildcard address).
    let addr = book_addr.or_else(|| info.addr.as_deref().and_then(|a| a.parse().ok()))?;
    Some(NodeRecord {
        service,
        node,
        addr,
        shards: info.shards,
        functions: info.functions,
    })
}

impl Registry for ClusterRegistry {
    async fn register(&self, record: &NodeRecord) -> Result<(), RegistryError> {
        if record.node != self.node.id() {
            return Err(RegistryError::Protocol(format!(
                "the embedded registry publishes only this node's record (node {}), not node {}'s",
                self.node.id(),
                record.node
            )));
        }
        let mut service = self
            .node
            .local()
            .rpc
            .service
            .lock()
            .map_err(|_| RegistryError::Unavailable("service name lock poisoned".to_owned()))?;
        *service = Some(record.service.clone());
        Ok(())
    }

    async fn deregister(&self, service: &str, node: NodeId) -> Result<(), RegistryError> {
        if node != self.node.id() {
            return Err(RegistryError::Protocol(format!(
                "the embedded registry cannot remove node {node}'s record"
            )));
        }
        let mut current = self
            .node
            .local()
            .rpc
            .service
            .lock()
            .map_err(|_| RegistryError::Unavailable("service name lock poisoned".to_owned()))?;
        if current.as_deref() == Some(service) {
            *current = None;
        }
        Ok(())
    }

    async fn lookup(&self, service: &str) -> Result<Vec<NodeRecord>, RegistryError> {
        Ok(self.gather(|r| r.service == service).await)
    }

    async fn find_function(&self, function: &str) -> Result<Vec<NodeRecord>, RegistryError> {
        Ok(self.gather(|r| r.function(function).is_some()).await)
    }
}
