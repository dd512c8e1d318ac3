//! Remote memory through [`Node`] and [`Peer`]: checked mode (the default), and trusted mode
//! (native UCX RMA, only when enabled with [`NodeBuilder::trusted_rma`]).
//!
//! ## Checked mode
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
//! copying; no UCX remote key is ever handed out, and `UCP_FEATURE_RMA` stays off unless trusted
//! mode is enabled (see `shardcx_shards::rma` for the path of a request and the limits). The
//! initiator checks
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
//!
//! ## Trusted mode: native RMA, and no protection for the target
//!
//! **Over TCP and shared memory UCX does not enforce remote keys: a peer holding any remote key
//! of a process can read and write anywhere in that process, and unmapping revokes nothing.**
//! Trusted mode hands such keys out, so enable it only between processes that trust each other
//! completely. It is off unless [`NodeBuilder::trusted_rma`] turns `UCP_FEATURE_RMA` on;
//! without it every trusted call fails with [`Error::Rma`]([`RmaOpError::TrustedOff`]), and
//! nothing reaches UCX. Both the node holding memory and the nodes accessing it need it.
//!
//! [`Node::register_trusted_region`] maps zeroed memory with UCX on the calling shard and packs
//! its remote key; the [`TrustedRegion`] (`!Send`) owns the mapping, and its
//! [`TrustedDescriptor`] (`Send + Sync`, [`TrustedDescriptor::to_bytes`]) carries the node, its
//! incarnation, the shard, base address, length, permissions, packed key and the shard's worker
//! address, for the application to hand to peers. [`Peer::put_trusted`] and
//! [`Peer::get_trusted`] (and their `_within` forms) run on the calling shard (each has its
//! own rail to the peer and its own RMA endpoints), which checks that a session with the peer is
//! ready and
//! of the descriptor's incarnation, unpacks the key once per (endpoint, region) and caches it,
//! and issues `ucp_put_nbx` + flush or `ucp_get_nbx` within the deadline. The only checks are
//! the initiator's own: permission and overflow-safe bounds against the descriptor, before
//! anything is sent ([`RmaOpError::Invalid`]). The target checks nothing, and runs no code for
//! an access.
//!
//! Trusted operations run over shared memory (a peer on the same machine, with shared-memory
//! transports in the node's list, e.g. `transports("sm,tcp")`) or RDMA; a peer that only tcp
//! reaches is refused with [`RmaOpError::TrustedTransport`] (UCX 1.12 only emulates RMA over
//! tcp; during development, before tcp was refused, that was no faster than checked mode, and
//! its tcp transport crashed the target with these endpoints). See `shardcx_shards::rma_trusted`
//! for the endpoints, the key cache and its
//! invalidation when a connection ends.
//!
//! ```no_run
//! # use shardcx::{Node, Peer, rma::{Permissions, TrustedDescriptor}};
//! # fn build() -> Result<(), shardcx::Error> {
//! Node::builder().trusted_rma() // on every node that holds or accesses trusted regions
//! # ; Ok(()) }
//! # async fn demo(node: Node, peer: Peer, theirs: TrustedDescriptor) -> Result<(), shardcx::Error> {
//! // On the node that holds the memory:
//! let region = node.register_trusted_region(4096, Permissions::READ_WRITE)?;
//! let bytes = region.descriptor().to_bytes(); // hand these to trusted peers only
//! // On the peer, with a descriptor it received (TrustedDescriptor::from_bytes):
//! peer.put_trusted(&theirs, 0, b"hello").await?;
//! assert_eq!(peer.get_trusted(&theirs, 0, 5).await?, b"hello");
//! # Ok(()) }
//! ```

use std::cell::Cell;
use std::fmt;
use std::future::Future;
use std::rc::{Rc, Weak};
use std::time::Duration;

use shardcx_shards::proto::NodeId;
use shardcx_shards::{NetError, ShardCtx};

pub use shardcx_shards::proto::region::{Access, Permissions, RmaErrorCode};
pub use shardcx_shards::proto::RegionId;
pub use shardcx_shards::rma::{DescriptorError, RemoteRegion, RmaOpError, RmaStats};
pub use shardcx_shards::rma_trusted::{TrustedDescriptor, TrustedRegion, TrustedStats};

use shardcx_shards::ucx::Features;

use crate::node::{lazily, within};
use crate::{Error, Node, NodeBuilder, Peer};

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

impl NodeBuilder {
    /// Turns trusted-mode remote memory on: every shard's UCX context gets `UCP_FEATURE_RMA`
    /// (its features become [`Features::messaging`] plus RMA, replacing features set earlier
    /// through [`NodeBuilder::with_shards`]). **Any peer that gets a trusted descriptor of this
    /// node can then write anywhere in this process** (see the module docs); checked-mode
    /// put/get work as before.
    pub fn trusted_rma(self) -> Self {
        self.with_shards(|s| {
            s.features(Features {
                rma: true,
                ..Features::messaging()
            })
        })
    }
}

impl Node {
    /// Whether trusted mode is on ([`NodeBuilder::trusted_rma`]).
    pub fn trusted_rma_enabled(&self) -> bool {
        self.shard_ctx().trusted_rma_enabled()
    }

    /// Maps `len` zeroed bytes with UCX on this shard for trusted-mode access by peers, which
    /// their initiators will limit to `permissions` (nothing on this side enforces them). Hand
    /// the region's [`TrustedRegion::descriptor`] to trusted peers only; drop the region only
    /// once none of them will use it any more.
    ///
    /// Errors: [`Error::Rma`] with [`RmaOpError::TrustedOff`] when trusted mode is off,
    /// [`RmaOpError::Ucx`] when UCX cannot map the memory (or `len` is zero).
    pub fn register_trusted_region(
        &self,
        len: usize,
        permissions: Permissions,
    ) -> Result<TrustedRegion, Error> {
        Ok(self.shard_ctx().register_trusted_region(len, permissions)?)
    }

    /// This shard's trusted-mode counters (operations it ran, keys unpacked and found in the
    /// cache, invalidations).
    pub fn trusted_rma_stats(&self) -> TrustedStats {
        self.shard_ctx().trusted_rma_stats()
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
        self.put_within(region, offset, data, default_deadline()?)
            .await
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
        let ctx = node.shard_ctx();
        self.remote_op(&node, region.node(), "put", timeout, || {
            ctx.rma_put(region, offset, data, timeout)
        })
        .await
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
        self.get_within(region, offset, len, default_deadline()?)
            .await
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
        let ctx = node.shard_ctx();
        self.remote_op(&node, region.node(), "get", timeout, || {
            ctx.rma_get(region, offset, len, timeout)
        })
        .await
    }

    /// Writes `data` at `offset` of the trusted region `region` (a descriptor of this peer's)
    /// with native RMA, from any shard of a running node, within the default deadline.
    /// Resolves once the data is remotely complete.
    ///
    /// Errors: [`Error::Rma`] ([`RmaOpError::TrustedOff`] when this node's trusted mode is off;
    /// [`RmaOpError::Invalid`] for an access the descriptor forbids or out of its bounds,
    /// nothing sent; [`RmaOpError::WrongNode`]; [`RmaOpError::StaleIncarnation`] for a
    /// descriptor of an earlier run of the peer; [`RmaOpError::TrustedTransport`] when only tcp
    /// reaches the peer; [`RmaOpError::Ucx`]), [`Error::TimedOut`] (the
    /// put may or may not have been applied), [`Error::Net`], [`Error::NotOnShard`].
    pub async fn put_trusted(
        &self,
        region: &TrustedDescriptor,
        offset: u64,
        data: &[u8],
    ) -> Result<(), Error> {
        self.put_trusted_within(region, offset, data, default_deadline()?)
            .await
    }

    /// [`Peer::put_trusted`] with its own deadline.
    pub async fn put_trusted_within(
        &self,
        region: &TrustedDescriptor,
        offset: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let ctx = node.shard_ctx();
        self.remote_op(&node, region.node(), "put", timeout, || {
            ctx.trusted_put(region, offset, data, timeout)
        })
        .await
    }

    /// Reads `len` bytes at `offset` of the trusted region `region` (a descriptor of this
    /// peer's) with native RMA, from any shard, within the default deadline. Errors as
    /// [`Peer::put_trusted`], and [`RmaOpError::TooLarge`] when no buffer of `len` bytes can be
    /// allocated.
    pub async fn get_trusted(
        &self,
        region: &TrustedDescriptor,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, Error> {
        self.get_trusted_within(region, offset, len, default_deadline()?)
            .await
    }

    /// [`Peer::get_trusted`] with its own deadline.
    pub async fn get_trusted_within(
        &self,
        region: &TrustedDescriptor,
        offset: u64,
        len: u64,
        timeout: Duration,
    ) -> Result<Vec<u8>, Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let ctx = node.shard_ctx();
        self.remote_op(&node, region.node(), "get", timeout, || {
            ctx.trusted_get(region, offset, len, timeout)
        })
        .await
    }

    /// Runs `op`, a put or a get (`what`) on a region of `region_node`'s, from `node`'s shard
    /// within `timeout`: [`RmaOpError::WrongNode`] unless `region_node` is this peer; when
    /// there is no session, connects and runs `op` again (`lazily`).
    async fn remote_op<T, F, Fut>(
        &self,
        node: &Node,
        region_node: NodeId,
        what: &'static str,
        timeout: Duration,
        op: F,
    ) -> Result<T, Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, RmaOpError>>,
    {
        self.holds(region_node)?;
        within(
            what,
            timeout,
            lazily(node, self.node_id(), timeout, || async {
                op().await.map_err(|e| facade_error(e, what, timeout))
            }),
        )
        .await
    }

    /// [`RmaOpError::WrongNode`] unless `region_node` is this peer.
    fn holds(&self, region_node: NodeId) -> Result<(), Error> {
        if region_node == self.node_id() {
            Ok(())
        } else {
            Err(Error::Rma(RmaOpError::WrongNode {
                node: self.node_id(),
                region_node,
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

/// The default deadline of the running node's operations.
fn default_deadline() -> Result<Duration, Error> {
    Ok(Node::current().ok_or(Error::NotOnShard)?.default_deadline())
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
