//! Tag send/recv through a [`Peer`]: ucx-py-style messages matched by a 48-bit user tag.
//!
//! [`Peer::tag_send`] sends bytes with a user tag to a peer; [`Peer::tag_recv`] receives from
//! that peer the earliest message whose user tag matches `(user_tag, user_mask)`
//! (`(tag ^ user_tag) & user_mask == 0`; [`TAG_MASK_EXACT`] and [`TAG_MASK_ANY`] are the two
//! ends). Both work from any shard of a running node and have a deadline (the node's default,
//! or the one given to the `*_within` form).
//!
//! Matching is per peer and in arrival order: a receive for one peer never takes another
//! peer's message, and messages with one tag sent from one shard are received in the order
//! sent. Messages that arrive before their receive wait in a bounded queue (over its bounds
//! they are dropped and counted); large ones come by rendezvous, straight into the receive's
//! buffer when it is already posted. The runtime side, with the wire format and the limits, is
//! [`shardcx_shards::tag`]; its handlers are installed on every shard when the node starts.

use std::future::Future;
use std::time::Duration;

use shardcx_shards::proto::wire::TagLayout;
use shardcx_shards::proto::{ShardId, Tag, TagKind, TagMask};
use shardcx_shards::tag::TAG_TRAILER_LEN;
use shardcx_shards::NetError;

pub use shardcx_shards::tag::{TagConfig, TagStats};

use crate::node::{lazily, within};
use crate::{Error, Node, Peer};

/// Largest user tag: tags have 48 user bits.
pub const MAX_USER_TAG: u64 = TagLayout::USER_MASK;
/// The user mask that matches one tag exactly.
pub const TAG_MASK_EXACT: u64 = TagLayout::USER_MASK;
/// The user mask that matches any tag.
pub const TAG_MASK_ANY: u64 = 0;

impl Peer {
    /// Sends `data` with `user_tag` (at most [`MAX_USER_TAG`]) to this peer, from any shard of
    /// a running node, within the default deadline. Resolves once the message is queued on the
    /// owner shard's endpoint (in order with this shard's other messages to the peer).
    ///
    /// Errors: [`Error::NotOnShard`], [`Error::TimedOut`], [`Error::Net`] with
    /// [`NetError::Wire`] for a tag over 48 bits, [`NetError::NotConnected`] when there is no
    /// session, [`NetError::TooLarge`] over the size limit (which counts 8 bytes of tag).
    pub async fn tag_send(&self, user_tag: u64, data: &[u8]) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.default_deadline();
        self.tag_send_on(&node, user_tag, data, timeout).await
    }

    /// Sends the bytes of device buffer `buf` with `user_tag` to this peer, from any shard of a
    /// running node whose CUDA mode is not off, within the default deadline: the bytes are
    /// staged to host memory through the shard's pinned bounce buffers
    /// ([`Node::device_to_vec`]), then sent as [`Peer::tag_send`] sends host bytes, so the
    /// receiver sees the same message either way (and may land it in device memory with
    /// [`Node::copy_to_device`]). UCX never sees the device pointer, in any mode. The deadline
    /// counts from when the bytes are staged.
    ///
    /// Errors: [`Error::Cuda`] (no CUDA on this shard, and why; the driver's error), then
    /// those of [`Peer::tag_send`].
    pub async fn tag_send_device(
        &self,
        user_tag: u64,
        buf: &mut crate::DeviceBuffer,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.default_deadline();
        self.tag_send_device_on(&node, user_tag, buf, timeout).await
    }

    /// [`Peer::tag_send_device`] with its own deadline.
    pub async fn tag_send_device_within(
        &self,
        user_tag: u64,
        buf: &mut crate::DeviceBuffer,
        timeout: Duration,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.tag_send_device_on(&node, user_tag, buf, timeout).await
    }

    /// [`Peer::tag_send`] with its own deadline.
    pub async fn tag_send_within(
        &self,
        user_tag: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.tag_send_on(&node, user_tag, data, timeout).await
    }

    /// Receives from this peer the earliest message whose user tag matches `user_tag` under
    /// `user_mask`, from any shard of a running node, within the default deadline. Resolves
    /// with the message's user tag and payload.
    ///
    /// A receive that ends at its deadline ([`Error::TimedOut`]) or is dropped does not take a
    /// later message. Errors also: [`Error::NotOnShard`], [`Error::Net`] when a large
    /// message's transfer failed ([`NetError::Receive`]) or forwarding failed.
    pub async fn tag_recv(&self, user_tag: u64, user_mask: u64) -> Result<(u64, Vec<u8>), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        let timeout = node.default_deadline();
        self.tag_recv_on(&node, user_tag, user_mask, timeout).await
    }

    /// [`Peer::tag_recv`] with its own deadline.
    pub async fn tag_recv_within(
        &self,
        user_tag: u64,
        user_mask: u64,
        timeout: Duration,
    ) -> Result<(u64, Vec<u8>), Error> {
        let node = Node::current().ok_or(Error::NotOnShard)?;
        self.tag_recv_on(&node, user_tag, user_mask, timeout).await
    }

    async fn tag_send_on(
        &self,
        node: &Node,
        user_tag: u64,
        data: &[u8],
        timeout: Duration,
    ) -> Result<(), Error> {
        let tag = user(user_tag)?;
        let (ctx, peer) = (node.shard_ctx(), self.node_id());
        deadline(
            "tag_send",
            timeout,
            lazily(node, peer, timeout, || async {
                // Room for the tag trailer, so that it is not a second allocation.
                let mut bytes = Vec::with_capacity(data.len() + TAG_TRAILER_LEN);
                bytes.extend_from_slice(data);
                // On the rail to the peer's shard when it names one (`peer.shard(j)`).
                Ok(ctx.tag_send(self.dest(), tag, bytes).await?)
            }),
        )
        .await
    }

    async fn tag_send_device_on(
        &self,
        node: &Node,
        user_tag: u64,
        buf: &mut crate::DeviceBuffer,
        timeout: Duration,
    ) -> Result<(), Error> {
        // A bad tag is refused before anything is copied.
        user(user_tag)?;
        let staged = node.device_to_vec(buf).await?;
        self.tag_send_on(node, user_tag, &staged, timeout).await
    }

    async fn tag_recv_on(
        &self,
        node: &Node,
        user_tag: u64,
        user_mask: u64,
        timeout: Duration,
    ) -> Result<(u64, Vec<u8>), Error> {
        // Bits above the 48 user bits cannot match anything: refuse them.
        let pattern = user(user_tag & user_mask)?;
        let mask = TagMask::from_raw(TagLayout::KIND_MASK | (user_mask & TagLayout::USER_MASK));
        let (ctx, peer) = (node.shard_ctx(), self.node_id());
        // The receive keeps its own deadline (one timer, only while it waits).
        let (tag, data) = match ctx.tag_recv(peer, pattern, mask, timeout).await {
            Ok(got) => got,
            Err(NetError::TimedOut { .. }) => {
                return Err(Error::TimedOut {
                    what: "tag_recv",
                    after: timeout,
                })
            }
            Err(e) => return Err(e.into()),
        };
        Ok((tag.user(), data))
    }
}

/// A user tag (the runtime sets the kind and the source shard).
fn user(user_tag: u64) -> Result<Tag, Error> {
    Tag::new(TagKind::User, ShardId::new(0), user_tag)
        .map_err(|source| Error::Net(NetError::Wire { source }))
}

/// Runs `fut` with a deadline a little after the operation's own, which it reports itself.
async fn deadline<T>(
    what: &'static str,
    timeout: Duration,
    fut: impl Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    match within(what, timeout + Duration::from_millis(5), fut).await {
        Err(Error::TimedOut { what, .. }) => Err(Error::TimedOut {
            what,
            after: timeout,
        }),
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_tags_fit_48_bits() {
        assert!(user(MAX_USER_TAG).is_ok());
        assert!(matches!(
            user(MAX_USER_TAG + 1),
            Err(Error::Net(NetError::Wire { .. }))
        ));
        assert_eq!(TAG_MASK_EXACT, (1 << 48) - 1);
    }
}
