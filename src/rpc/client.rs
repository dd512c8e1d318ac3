//! The calling side: [`Rpc`] and [`ArchivedReply`].

use std::marker::PhantomData;
use std::time::{Duration, Instant};

use rkyv::rancor;
use rkyv::util::AlignedVec;
use rkyv::Archived;
use shardcx_shards::net::{Dest, Payload};
use shardcx_shards::proto::rpc::{decode_error, request_prefix, CallFlags};
use shardcx_shards::proto::{FrameHeader, FrameKind, FunctionId, ReqId};
use shardcx_shards::NetError;

use super::server::{aligned_copy, archived_in_place, with_archived, ARCHIVE_ALIGN};
use super::{Discover, RpcError, RpcFunction, RpcStats, RpcType, Signature};
use crate::node::{connect_lazily, within};
use crate::{Error, Node, Peer};

/// Most times an idempotent call is sent again after its connection failed.
const MAX_RETRIES: u32 = 3;
/// Most the server's deadline is set before the caller's (see [`server_ttl`]).
const MAX_GRACE: Duration = Duration::from_millis(10);

/// This shard's handle for calling remote functions ([`Node::rpc`], [`Rpc::current`]).
/// `!Send`: it belongs to the shard's thread; clone it freely within the shard.
#[derive(Clone)]
pub struct Rpc {
    node: Node,
}

/// A call's reply as its validated archive, in the buffer it was received in (UCX's, for a reply
/// that came eager to the calling shard; copied only where it does not validate in place, a
/// buffer less aligned than the archive's types need; that buffer, a UCX descriptor or one of
/// the shard's reused receive buffers, stays held while this is, so keep replies only as long
/// as needed or copy out what is kept):
/// zero-copy access with [`ArchivedReply::get`]. `!Send`: UCX's buffer belongs to the shard's
/// worker.
pub struct ArchivedReply<R> {
    buf: ReplyBuf,
    _reply: PhantomData<fn() -> R>,
}

enum ReplyBuf {
    Received(Payload),
    Aligned(AlignedVec<ARCHIVE_ALIGN>),
}

/// What identifies the function called, on the wire.
#[derive(Clone, Copy)]
pub(super) struct Target {
    pub(super) id: FunctionId,
    pub(super) schema: u64,
    pub(super) idempotent: bool,
}

impl Node {
    /// This shard's RPC handle.
    pub fn rpc(&self) -> Rpc {
        Rpc { node: self.clone() }
    }

    /// This shard's RPC server counters.
    pub fn rpc_stats(&self) -> RpcStats {
        self.local().rpc.stats()
    }
}

impl Rpc {
    /// The RPC handle of the shard running on this thread, if any.
    pub fn current() -> Option<Rpc> {
        Node::current().map(|node| Rpc { node })
    }

    /// The node this handle calls from.
    pub fn node(&self) -> &Node {
        &self.node
    }

    /// This shard's RPC server counters.
    pub fn stats(&self) -> RpcStats {
        self.node.rpc_stats()
    }

    /// The deadline of calls made without one.
    pub fn default_deadline(&self) -> Duration {
        self.node
            .local()
            .rpc
            .config
            .default_deadline
            .unwrap_or_else(|| self.node.default_deadline())
    }

    /// Calls `F` on `peer` with `args` within the default deadline, and returns its reply.
    pub async fn call<F: RpcFunction>(
        &self,
        peer: Peer,
        args: &F::Args,
    ) -> Result<F::Reply, RpcError> {
        self.call_within::<F>(peer, args, self.default_deadline())
            .await
    }

    /// [`Rpc::call`] with its own deadline.
    pub async fn call_within<F: RpcFunction>(
        &self,
        peer: Peer,
        args: &F::Args,
        timeout: Duration,
    ) -> Result<F::Reply, RpcError> {
        let reply = self
            .exchange(peer, (target::<F>(), F::NAME), args, timeout)
            .await?;
        deserialize_reply::<F::Reply>(reply.as_slice())
    }

    /// [`Rpc::call`], returning the reply's validated archive instead of deserializing it.
    pub async fn call_archived<F: RpcFunction>(
        &self,
        peer: Peer,
        args: &F::Args,
    ) -> Result<ArchivedReply<F::Reply>, RpcError> {
        self.call_archived_within::<F>(peer, args, self.default_deadline())
            .await
    }

    /// [`Rpc::call_archived`] with its own deadline.
    pub async fn call_archived_within<F: RpcFunction>(
        &self,
        peer: Peer,
        args: &F::Args,
        timeout: Duration,
    ) -> Result<ArchivedReply<F::Reply>, RpcError> {
        let bytes = self
            .exchange(peer, (target::<F>(), F::NAME), args, timeout)
            .await?;
        ArchivedReply::new(bytes)
    }

    /// Calls `F`, whose argument is bytes, with the bytes of device buffer `args`, within the
    /// default deadline: the bytes are staged to host memory through the shard's pinned bounce
    /// buffers ([`Node::device_to_vec`]), then sent as [`Rpc::call`] sends them, so the server
    /// sees the same request either way. UCX never sees the device pointer, in any mode.
    ///
    /// Errors: [`RpcError::Net`] with [`Error::Cuda`] (no CUDA on this shard, and why; the
    /// driver's error), then those of [`Rpc::call`].
    pub async fn call_device<F>(
        &self,
        peer: Peer,
        args: &mut crate::DeviceBuffer,
    ) -> Result<F::Reply, RpcError>
    where
        F: RpcFunction<Args = Vec<u8>>,
    {
        self.call_device_within::<F>(peer, args, self.default_deadline())
            .await
    }

    /// [`Rpc::call_device`] with its own deadline (counted from when the bytes are staged).
    pub async fn call_device_within<F>(
        &self,
        peer: Peer,
        args: &mut crate::DeviceBuffer,
        timeout: Duration,
    ) -> Result<F::Reply, RpcError>
    where
        F: RpcFunction<Args = Vec<u8>>,
    {
        let staged = self.node.device_to_vec(args).await?;
        self.call_within::<F>(peer, &staged, timeout).await
    }

    /// Calls `F`, whose reply is bytes, within `timeout`, and lands the reply in the whole of
    /// device buffer `reply`: the reply's archive is read in place and copied to the device
    /// through the shard's pinned bounce buffers ([`Node::copy_to_device`]); resolves once the
    /// device holds it. The deadline covers the call, not the copy.
    ///
    /// Errors: those of [`Rpc::call`], then [`RpcError::Net`] with [`Error::Cuda`] (no CUDA on
    /// this shard, and why; a reply whose length is not the buffer's; the driver's error).
    pub async fn call_into_device_within<F>(
        &self,
        peer: Peer,
        args: &F::Args,
        reply: &mut crate::DeviceBuffer,
        timeout: Duration,
    ) -> Result<(), RpcError>
    where
        F: RpcFunction<Reply = Vec<u8>>,
    {
        let got = self.call_archived_within::<F>(peer, args, timeout).await?;
        self.node
            .copy_to_device(got.get().as_slice(), reply)
            .await?;
        Ok(())
    }

    /// Calls a function by its published signature (from [`Rpc::lookup`] or a registry), for a
    /// client built without the function's marker type. `A` and `R` must be the server's
    /// argument and reply types (or types with the same archived layout): the schema hash
    /// sent is the signature's, so nothing else checks it; other types fail validation
    /// ([`RpcError::BadRequest`], [`RpcError::BadReply`]). `timeout`: `None` for the default.
    pub async fn call_signature<A: RpcType, R: RpcType>(
        &self,
        peer: Peer,
        signature: &Signature,
        args: &A,
        timeout: Option<Duration>,
    ) -> Result<R, RpcError> {
        let t = Target {
            id: FunctionId::new(signature.id),
            schema: signature.schema,
            idempotent: false,
        };
        let timeout = timeout.unwrap_or_else(|| self.default_deadline());
        let reply = self
            .exchange(peer, (t, &signature.name), args, timeout)
            .await?;
        deserialize_reply::<R>(reply.as_slice())
    }

    /// Sends a one-way call of `F` to `peer`: resolves once it is queued on the connection
    /// (within the default deadline). Nothing comes back, not even the server's errors (it
    /// counts them); a one-way call is not deduplicated.
    ///
    /// To a peer whose rail this shard holds the call is sent at once from the shard's request
    /// vector ([`ShardCtx::send_one_way_now`](shardcx_shards::ShardCtx::send_one_way_now)): no
    /// allocation, clock reading or task for a call of at most 1 KiB. A first call that
    /// connects, or one to a rail another shard holds, takes the general path.
    pub async fn notify<F: RpcFunction>(&self, peer: Peer, args: &F::Args) -> Result<(), RpcError> {
        let t = target::<F>();
        let ctx = self.node.shard_ctx();
        let payload = encode_request(t.schema, CallFlags::ONE_WAY, args, ctx.request_buffer())?;
        match ctx.send_one_way_now(peer.dest(), FrameKind::RpcRequest, t.id.get(), payload) {
            Ok(()) => Ok(()),
            // Nothing was sent: the general path connects or forwards.
            Err(NetError::NotConnected { .. } | NetError::OtherShard { .. }) => {
                self.notify_waiting(peer, t, args).await
            }
            Err(e) => Err(RpcError::from_net(Error::Net(e), self.default_deadline())),
        }
    }

    /// [`Rpc::notify`]'s general path: connects on first use and forwards to the shard holding
    /// the rail, within the default deadline.
    async fn notify_waiting<A: RpcType>(
        &self,
        peer: Peer,
        t: Target,
        args: &A,
    ) -> Result<(), RpcError> {
        let timeout = self.default_deadline();
        let start = Instant::now();
        let encode = || encode_request(t.schema, CallFlags::ONE_WAY, args, Vec::new());
        let ctx = self.node.shard_ctx();
        let (node, dest) = (peer.node_id(), peer.dest());
        let mut connected = false;
        let op = async {
            loop {
                let payload = encode()?;
                let sent = ctx
                    .send_frame(
                        dest,
                        FrameKind::RpcRequest,
                        t.id.get(),
                        ReqId::NONE,
                        payload,
                    )
                    .await;
                match sent {
                    Err(NetError::NotConnected { .. }) if !connected => {
                        let left = timeout.saturating_sub(start.elapsed());
                        connect_lazily(&self.node, node, left)
                            .await
                            .map_err(|e| RpcError::from_net(e, timeout))?;
                        connected = true;
                    }
                    other => return other.map_err(|e| RpcError::from_net(Error::Net(e), timeout)),
                }
            }
        };
        within("rpc notify", timeout, async { Ok(op.await) })
            .await
            .map_err(|e| RpcError::from_net(e, timeout))?
    }

    /// The signatures of the functions `peer` serves (built-ins included).
    pub async fn discover(&self, peer: Peer) -> Result<Vec<Signature>, RpcError> {
        self.call::<Discover>(peer, &()).await
    }

    /// The signature of the function named `name` on `peer` ([`RpcError::UnknownName`] if it
    /// serves none).
    pub async fn lookup(&self, peer: Peer, name: &str) -> Result<Signature, RpcError> {
        self.discover(peer)
            .await?
            .into_iter()
            .find(|s| s.name == name)
            .ok_or_else(|| RpcError::UnknownName {
                name: name.to_owned(),
            })
    }

    /// Sends a request and returns the reply's archive (see the module docs for retries). A
    /// failed call is logged at `debug`; with the `trace-messages` feature every call is,
    /// at `trace`, with its round-trip time (off by default: the hot path pays nothing).
    async fn exchange<A: RpcType>(
        &self,
        peer: Peer,
        (t, name): (Target, &str),
        args: &A,
        timeout: Duration,
    ) -> Result<Payload, RpcError> {
        // Timed only for the metrics (its two clock reads cost some 5% of a shared-memory
        // round trip), or for the per-call trace.
        let local = self.node.local();
        let timed = local.serves_metrics() || cfg!(feature = "trace-messages");
        let start = timed.then(Instant::now);
        let r = self.exchange_once(peer, t, args, timeout).await;
        if let (Some(start), true) = (start, local.serves_metrics()) {
            local.rpc.latency.record(t.id.get(), name, start.elapsed());
        }
        if let Err(e) = &r {
            tracing::debug!(function = t.id.get(), node = %peer.node_id(), error = %e,
                "rpc call failed");
        }
        #[cfg(feature = "trace-messages")]
        tracing::trace!(function = t.id.get(), node = %peer.node_id(), ok = r.is_ok(),
            rtt = ?start.map(|s| s.elapsed()), "rpc call");
        r
    }

    async fn exchange_once<A: RpcType>(
        &self,
        peer: Peer,
        t: Target,
        args: &A,
        timeout: Duration,
    ) -> Result<Payload, RpcError> {
        let flags = if t.idempotent {
            CallFlags::IDEMPOTENT
        } else {
            CallFlags::NONE
        };
        let ctx = self.node.shard_ctx();
        let payload = encode_request(t.schema, flags, args, ctx.request_buffer())?;
        let len = (payload.len() - shardcx_shards::proto::REQUEST_PREFIX_LEN) as u64;
        if let Some(max) = self.node.local().rpc.config.max_args_size {
            if len > max {
                return Err(RpcError::TooLarge { len, max });
            }
        }
        // Pinned where it is made: moving the exchange's state into the await (or into the
        // deadline race) copied some kilobytes per call.
        // Whether this shard holds the rail (looked up once per call, not once more per send).
        let here = self.node.owner_of(peer) == self.node.shard();
        let mut exchange =
            std::pin::pin!(self.send_until_answered(peer, t, payload, flags, args, timeout, here));
        // On the owner shard the request's own deadline bounds everything; a forward may wait
        // for a lane permit first, so bound it as a whole.
        let (header, bytes) = if here {
            exchange.as_mut().await?
        } else {
            within("rpc call", timeout, async { Ok(exchange.as_mut().await) })
                .await
                .map_err(|e| RpcError::from_net(e, timeout))??
        };
        reply_payload(&header, bytes, t, len)
    }

    /// Sends the request, connecting on first use, and again for an idempotent function whose
    /// connection failed, while time is left. `here`: whether this shard holds the rail for
    /// `peer` (for the first send; looked up again for the next ones).
    #[allow(clippy::too_many_arguments)] // One private call site, the call's own parts.
    async fn send_until_answered<A: RpcType>(
        &self,
        peer: Peer,
        t: Target,
        payload: Vec<u8>,
        flags: CallFlags,
        args: &A,
        timeout: Duration,
        mut here: bool,
    ) -> Result<(FrameHeader, Payload), RpcError> {
        let start = Instant::now();
        let ctx = self.node.shard_ctx();
        let (node, dest): (_, Dest) = (peer.node_id(), peer.dest());
        if timeout.is_zero() {
            return Err(RpcError::TimedOut { after: timeout });
        }
        let mut payload = Some(payload);
        let (mut connected, mut retries) = (false, 0);
        loop {
            // The first attempt has all the time (no clock reading on the common path).
            let (left, p, since) = match payload.take() {
                // The first attempt counts its time from `start` (no clock reading of its own).
                Some(p) => (timeout, p, Some(start)),
                None => {
                    let left = timeout.saturating_sub(start.elapsed());
                    if left.is_zero() {
                        return Err(RpcError::TimedOut { after: timeout });
                    }
                    (
                        left,
                        encode_request(t.schema, flags, args, ctx.request_buffer())?,
                        None,
                    )
                }
            };
            // On a rail of this shard the reply is read where UCX put it; from another shard it
            // crosses as a vector.
            let got = if here {
                ctx.request_here_since(
                    dest,
                    FrameKind::RpcRequest,
                    t.id.get(),
                    p,
                    (left, server_ttl(left)),
                    since,
                )
                .await
            } else {
                ctx.request_with_ttl(
                    dest,
                    FrameKind::RpcRequest,
                    t.id.get(),
                    p,
                    left,
                    server_ttl(left),
                )
                .await
                .map(|(h, v)| (h, Payload::from(v)))
            };
            let e = match got {
                Ok(answer) => return Ok(answer),
                Err(e) => RpcError::from_net(Error::Net(e), timeout),
            };
            match e {
                // Provably never sent: connect (on first use) and send.
                RpcError::Net(Error::Net(NetError::NotConnected { .. })) if !connected => {
                    let left = timeout.saturating_sub(start.elapsed());
                    match connect_lazily(&self.node, node, left).await {
                        Ok(()) => connected = true,
                        // An idempotent call whose connection failed waits for the peer to
                        // come back while time is left: connects back off (a peer that stays
                        // away ends in `BackingOff` or `TimedOut`).
                        Err(Error::Net(_) | Error::Forward(_)) if t.idempotent && retries > 0 => {}
                        Err(e) => return Err(RpcError::from_net(e, timeout)),
                    }
                }
                e if t.idempotent && e.is_connection_failure() && retries < MAX_RETRIES => {
                    retries += 1;
                    connected = false;
                }
                e => return Err(e),
            }
            // The rails may have changed (a connect, a lost connection).
            here = self.node.owner_of(peer) == self.node.shard();
        }
    }
}

/// A reply frame's payload: the reply's archive for an `RpcResponse`, the server's error for an
/// `RpcError` (`len`: the arguments' length, for [`RpcError::TooLarge`]; 0 when not known).
pub(super) fn reply_payload(
    header: &FrameHeader,
    bytes: Payload,
    t: Target,
    len: u64,
) -> Result<Payload, RpcError> {
    match header.kind {
        FrameKind::RpcResponse => Ok(bytes),
        FrameKind::RpcError => {
            let body = decode_error(bytes.as_slice())
                .map_err(|e| RpcError::BadReply(format!("malformed error reply: {e}")))?;
            Err(RpcError::from_body(&body, t.id, t.schema, len))
        }
        other => Err(RpcError::BadReply(format!("a {other:?} frame answered"))),
    }
}

/// The time the server is given out of `left`: a little less (1/16, at most [`MAX_GRACE`]), so
/// that its `DeadlineExpired` can arrive before the caller's own deadline.
pub(super) fn server_ttl(left: Duration) -> Duration {
    left - (left / 16).min(MAX_GRACE)
}

pub(super) fn target<F: RpcFunction>() -> Target {
    Target {
        id: F::ID,
        schema: F::schema(),
        idempotent: F::IDEMPOTENT,
    }
}

/// A request payload, written into `payload` (empty): the envelope's prefix, then the
/// arguments' archive written straight after it (16-byte aligned in the payload, since the
/// prefix is 16 bytes). For calls, `payload` is the shard's spare request vector
/// ([`ShardCtx::request_buffer`](shardcx_shards::ShardCtx::request_buffer)), which a short
/// request gives back once sent: a stream of calls allocates none for its requests.
pub(super) fn encode_request<A: RpcType>(
    schema: u64,
    flags: CallFlags,
    args: &A,
    mut payload: Vec<u8>,
) -> Result<Vec<u8>, RpcError> {
    // Room for small arguments without a reallocation while rkyv writes them (a spare vector
    // from `request_buffer` comes empty, with the capacity a request before it left).
    payload.reserve(256);
    payload.extend_from_slice(&request_prefix(schema, flags));
    super::archive_into(args, payload)
        .map_err(|e| RpcError::BadRequest(format!("arguments not serialized: {e}")))
}

fn deserialize_reply<R: RpcType>(bytes: &[u8]) -> Result<R, RpcError> {
    with_archived::<R, _>(bytes, |a| rkyv::deserialize::<R, rancor::Error>(a))
        .and_then(|r| r)
        .map_err(|e| RpcError::BadReply(e.to_string()))
}

impl<R: RpcType> ArchivedReply<R> {
    /// The reply in `bytes`, validated: in place when it validates there, else (bytes not
    /// 16-byte aligned) in an aligned copy (see [`archived_in_place`] for why in place is sound).
    pub(super) fn new(bytes: Payload) -> Result<Self, RpcError> {
        let bad = |e: rancor::Error| RpcError::BadReply(e.to_string());
        let buf = match archived_in_place::<R>(bytes.as_slice()).map_err(bad)? {
            Some(_) => ReplyBuf::Received(bytes),
            None => {
                let copy = aligned_copy(bytes.as_slice());
                rkyv::access::<Archived<R>, rancor::Error>(&copy).map_err(bad)?;
                ReplyBuf::Aligned(copy)
            }
        };
        Ok(Self {
            buf,
            _reply: PhantomData,
        })
    }

    /// The reply's archive. Validated again on every call (bytecheck, linear in its size:
    /// without `unsafe`, a validated reference cannot be kept next to its buffer); hold on to
    /// the reference rather than calling this in a loop.
    pub fn get(&self) -> &Archived<R> {
        #[allow(clippy::expect_used)]
        // Invariant: `new` validated these very bytes, which never change afterwards (the
        // buffer is owned here and never handed out mutably).
        rkyv::access::<Archived<R>, rancor::Error>(self.bytes()).expect("validated in new")
    }

    /// The archive's bytes.
    pub fn bytes(&self) -> &[u8] {
        match &self.buf {
            ReplyBuf::Received(v) => v.as_slice(),
            ReplyBuf::Aligned(v) => v,
        }
    }

    /// The reply, deserialized.
    pub fn deserialize(&self) -> Result<R, RpcError> {
        rkyv::deserialize::<R, rancor::Error>(self.get())
            .map_err(|e| RpcError::BadReply(e.to_string()))
    }
}

impl<R> std::fmt::Debug for ArchivedReply<R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let len = match &self.buf {
            ReplyBuf::Received(v) => v.len(),
            ReplyBuf::Aligned(v) => v.len(),
        };
        f.debug_struct("ArchivedReply").field("len", &len).finish()
    }
}
