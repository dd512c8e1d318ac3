//! Remote memory through [`Node`] and [`Peer`], in checked mode.
//!
//! A shard registers a region of its own memory ([`Node::register_region`]) and gets a
//! [`Region`] handle (`!Send`: the memory stays on that shard). The region's
//! [`RemoteRegion`] descriptor ([`Region::descriptor`]) is `Send + Copy` and encodes to bytes
//! ([`RemoteRegion::to_bytes`]), so the application can hand it to the nodes that will use it,
//! e.g. in an active message. Those call [`Peer::put`] and [`Peer::get`] from any of their
//! shards.
//!
//! Every access travels as a request to the node holding the region, where the shard holding
//! the memory checks it (region, grantee, generation, permission, overflow-safe bounds) before
//! copying; no UCX remote key is ever handed out, and `UCP_FEATURE_RMA` stays off (see
//! `shardcx_shards::rma` for the path of a request and the limits). The initiator checks
//! permission and bounds against the descriptor first, so an access the descriptor already
//! forbids fails without a round trip.
//!
//! [`Region::revoke`] invalidates every descriptor handed out (they are refused with
//! [`RmaErrorCode::StaleGeneration`]) and returns the new one; [`Region::deregister`] (or
//! dropping the handle) removes the region and gives its memory back.
//!
//! ## Errors
//!
//! A refusal is [`Error::Rma`] with [`RmaOpError::Invalid`] (by the initiator's check) or
//! [`RmaOpError::Refused`] (by the holder), both with [`RmaOpError::code`]; the memory is then
//! unchanged. An operation past its deadline is [`Error::TimedOut`] (a put may or may not have
//! been applied), and connection failures are [`Error::Net`].
//!
//! ```no_run
//! # use shardcx::{Node, Peer, rma::{Permissions, RemoteRegion}};
//! # async fn demo(node: Node, peer: Peer, theirs: RemoteRegion) -> Result<(), shardcx::Error> {
//! // On the node that holds the memory:
//! let region = node.register_region(vec![0; 4096], Permissions::READ_WRITE, Some(peer))?;
//! let bytes = region.descriptor().to_bytes(); // hand these to `peer`
//! // On the peer, with a descriptor it received:
//! peer.put(&theirs, 0, b"hello").await?;
//! assert_eq!(peer.get(&theirs, 0, 5).await?, b"hello");
//! # Ok(()) }
//! ```

use std::cell::Cell;
use std::fmt;
use std::rc::{Rc, Weak};
use std::time::Duration;

use shardcx_shards::{NetError, ShardCtx};

pub use shardcx_shards::proto::region::{Access, Permissions, RmaErrorCode};
pub use shardcx_shards::proto::RegionId;
pub use shardcx_shards::rma::{DescriptorError, RemoteRegion, RmaOpError, RmaStats};

use crate::node::{lazily, within};
use crate::{Error, Node, Peer};

/// A region of this shard's memory that remote nodes may access. `!Send`: it belongs to the
/// shard that registered it. Dropping it deregisters the region (and frees the memory).
pub struct Region {
    ctx: Weak<ShardCtx>,
    desc: Cell<RemoteRegion>,
    live: Cell<bool>,
}

impl Node {
    /// Registers `memory` as a region held by this shard, which remote nodes may access as
    /// `permissions` allow; with a `grantee`, only that peer may. Hand the region's
    /// [`Region::descriptor`] to the peers that will use it.
    ///
    /// Errors: [`Error::Rma`] ([`RmaOpError::NotInstalled`] when the node was started without
    /// remote memory, [`RmaOpError::TooManyRegions`], [`RmaOpError::Region`]).
    pub fn register_region(
        &self,
        memory: Vec<u8>,
        permissions: Permissions,
        grantee: Option<Peer>,
    ) -> Result<Region, Error> {
        let ctx = self.shard_ctx();
        let desc = ctx
            .register_region(memory, permissions, grantee.map(|p| p.node_id()))
            .map_err(|(e, _memory)| Error::Rma(e))?;
        Ok(Region {
            ctx: Rc::downgrade(ctx),
            desc: Cell::new(desc),
            live: Cell::new(true),
        })
    }

    /// This shard's remote-memory counters (accesses served, refused, forwarded...).
    pub fn rma_stats(&self) -> RmaStats {
        self.shard_ctx().rma_stats()
    }
}

impl Region {
    /// The current descriptor (the one returned by the last [`Region::revoke`]).
    pub fn descriptor(&self) -> RemoteRegion {
        self.desc.get()
    }

    /// The region's id.
    pub fn id(&self) -> RegionId {
        self.desc.get().id()
    }

    /// The region's length in bytes.
    pub fn len(&self) -> usize {
        // The memory is a `Vec<u8>` of this length.
        usize::try_from(self.desc.get().len()).unwrap_or(usize::MAX)
    }

    /// Whether the region is empty.
    pub fn is_empty(&self) -> bool {
        self.desc.get().is_empty()
    }

    /// Revokes every descriptor handed out so far (remote accesses with them are refused with
    /// [`RmaErrorCode::StaleGeneration`]) and returns the new descriptor, to hand out again.
    pub fn revoke(&self) -> Result<RemoteRegion, Error> {
        let ctx = self.ctx()?;
        let d = ctx.revoke_region(self.id())?;
        self.desc.set(d);
        Ok(d)
    }

    /// Removes the region and gives its memory back; every descriptor of it is refused from
    /// then on ([`RmaErrorCode::UnknownRegion`]).
    pub fn deregister(self) -> Result<Vec<u8>, Error> {
        let ctx = self.ctx()?;
        self.live.set(false);
        Ok(ctx.deregister_region(self.id())?)
    }

    /// Runs `f` on the region's memory. No remote access happens while `f` runs; `f` must not
    /// call region operations of this shard.
    pub fn read<R>(&self, f: impl FnOnce(&[u8]) -> R) -> Result<R, Error> {
        Ok(self.ctx()?.with_region(self.id(), f)?)
    }

    /// Runs `f` on the region's memory, to write it locally. As [`Region::read`].
    pub fn write<R>(&self, f: impl FnOnce(&mut [u8]) -> R) -> Result<R, Error> {
        Ok(self.ctx()?.with_region_mut(self.id(), f)?)
    }

    /// A copy of the region's memory.
    pub fn to_vec(&self) -> Result<Vec<u8>, Error> {
        self.read(<[u8]>::to_vec)
    }

    fn ctx(&self) -> Result<Rc<ShardCtx>, Error> {
        self.ctx.upgrade().ok_or(Error::NotOnShard)
    }
}

impl Peer {
    /// Writes `data` at `offset` of `region` (a descriptor of this peer's), from any shard of a
    /// running node, within the default deadline. Resolves once the peer has applied it.
    ///
    /// Errors: [`Error::Rma`] (refused: [`RmaOpError::code`] says why, and the memory is
    /// unchanged; or [`RmaOpError::WrongNode`] when `region` is not this peer's),
    /// [`Error::TimedOut`] (the put may or may not have been applied), [`Error::Net`],
    /// [`Error::NotOnShard`].
    pub async fn put(&self, region: &RemoteRegion, offset: u64, data: &[u8]) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.default_deadline();
        self.put_on(&node, region, offset, data, timeout).await
    }

    /// [`Peer::put`] with its own deadline.
    pub async fn put_within(
        &self,
        region: &RemoteRegion,
        offset: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.put_on(&node, region, offset, data, timeout).await
    }

    /// Reads `len` bytes at `offset` of `region` (a descriptor of this peer's), from any shard
    /// of a running node, within the default deadline. Errors as [`Peer::put`], and
    /// [`RmaOpError::TooLarge`] for a read over the message size limit.
    pub async fn get(
        &self,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.default_deadline();
        self.get_on(&node, region, offset, len, timeout).await
    }

    /// [`Peer::get`] with its own deadline.
    pub async fn get_within(
        &self,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.get_on(&node, region, offset, len, timeout).await
    }

    async fn put_on(
        &self,
        node: &Node,
        region: &RemoteRegion,
        offset: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        self.owns(region)?;
        let ctx = node.shard_ctx();
        within(
            "put",
            timeout,
            lazily(node, self.node_id(), timeout, || async {
                ctx.rma_put(region, offset, data, timeout)
                    .await
                    .map_err(|e| facade_error(e, "put", timeout))
            }),
        )
        .await
    }

    async fn get_on(
        &self,
        node: &Node,
        region: &RemoteRegion,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, Error> {
        self.owns(region)?;
        let ctx = node.shard_ctx();
        within(
            "get",
            timeout,
            lazily(node, self.node_id(), timeout, || async {
                ctx.rma_get(region, offset, len, timeout)
                    .await
                    .map_err(|e| facade_error(e, "get", timeout))
            }),
        )
        .await
    }

    fn owns(&self, region: &RemoteRegion) -> Result<(), Error> {
        if region.node() == self.node_id() {
            Ok(())
        } else {
            Err(Error::Rma(RmaOpError::WrongNode {
                node: self.node_id(),
                region_node: region.node(),
            }))
        }
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        if self.live.get() {
            // The shard (and with it the region) may be gone already; then nothing is left.
            if let Some(ctx) = self.ctx.upgrade() {
                let _ = ctx.deregister_region(self.id());
            }
        }
    }
}

impl fmt::Debug for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Region")
            .field("descriptor", &self.desc.get())
            .field("live", &self.live.get())
            .finish()
    }
}

/// A remote-memory error as the facade's: timeouts and connection errors as for every other
/// operation, the rest as [`Error::Rma`].
fn facade_error(e: RmaOpError, what: &'static str, timeout: Duration) -> Error {
    match e {
        RmaOpError::Net(NetError::TimedOut { .. }) => Error::TimedOut {
            what,
            after: timeout,
        },
        RmaOpError::Net(n) => Error::Net(n),
        other => Error::Rma(other),
    }
}
