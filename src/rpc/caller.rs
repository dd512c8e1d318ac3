//! Calls answered into a handler: [`Caller`], made by [`Rpc::caller`].

use std::marker::PhantomData;
use std::rc::{Rc, Weak};
use std::time::Duration;

use shardcx_shards::net::{ReplyHandler, SentRequest};
use shardcx_shards::proto::rpc::CallFlags;
use shardcx_shards::proto::FrameKind;
use shardcx_shards::NetError;

use super::client::{encode_request, reply_payload, server_ttl, target, Target};
use super::{ArchivedReply, Rpc, RpcError, RpcFunction};
use crate::node::connect_lazily;
use crate::{Error, Node, Peer};

/// Calls of `F` to one peer from this shard, each answered into the handler given to
/// [`Rpc::caller`]. Clones share the handler. `!Send`: it belongs to the shard it was made on.
/// Once every clone is dropped, the answers of its calls still pending are dropped (the server
/// is not told; cancel them first to tell it).
///
/// An awaited call ([`Rpc::call`]) is woken by its reply: the reply's dispatch wakes the
/// calling task, the executor runs it, and the task's futures are polled back to where the
/// call was made. On shared memory that wake-up costs about as much as the round trip itself.
/// A [`Caller`] skips it: its calls return once sent, and each call's answer (the reply's
/// validated archive, or the call's error) goes to the handler given to [`Rpc::caller`], run on
/// the calling shard right where the answer is found — by the progress driver right after the
/// reply frame is dispatched, by the net task at the deadline, when the connection fails, or at
/// shutdown. The handler may make the next call itself: a ping-pong, or a window of calls that
/// slides as replies come, runs with no task at all, as an active-message handler that answers
/// inline does.
///
/// ```no_run
/// use std::cell::Cell;
/// use std::rc::{Rc, Weak};
///
/// use shardcx::rpc::{Caller, Rpc, RpcError};
/// use shardcx::{rpc_function, Peer};
///
/// rpc_function!(
///     /// Doubles a number.
///     pub Double: u64 => u64, id = 7, name = "math.double"
/// );
///
/// async fn sum_of_doubles(peer: Peer) -> Result<u64, RpcError> {
///     let rpc = Rpc::current().expect("on a shard");
///     let sum = Rc::new(Cell::new(0));
///     let s = sum.clone();
///     let caller: Caller<Double> = rpc
///         .caller::<Double>(peer, move |_caller, _token, reply| match reply {
///             Ok(r) => s.set(s.get() + r.get().to_native()),
///             Err(e) => eprintln!("a call failed: {e}"),
///         })
///         .await?;
///     for n in 0..16u64 {
///         caller.call(&n, n)?;
///     }
///     // ... the handler runs as the replies come (the shard keeps progressing meanwhile).
///     Ok(sum.get())
/// }
/// ```
///
/// What such calls do not do, as awaited calls do: send again an idempotent function's request
/// whose connection failed (the handler gets the connection's error), connect on a call (a
/// call on a node this shard has no connection to fails with [`NetError::NotConnected`] at
/// once; [`Rpc::caller`] connects when it is made, and awaited calls connect again), reach a
/// peer through another shard (a call to a peer whose rail another shard holds fails with
/// [`NetError::OtherShard`]: make the caller on that shard, or name a remote shard this shard
/// has a rail to), and record the per-function latency metrics.
pub struct Caller<F: RpcFunction>(Rc<Inner<F>>);

struct Inner<F: RpcFunction> {
    node: Node,
    peer: Peer,
    target: Target,
    timeout: Duration,
    handler: ReplyHandler,
    _f: PhantomData<fn() -> F>,
}

impl<F: RpcFunction> Clone for Caller<F> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

/// A call made with [`Caller::call`], for [`Caller::cancel`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallHandle(SentRequest);

impl CallHandle {
    /// The call's request id (fresh on this shard; the server's dedup window knows it by it).
    pub fn req_id(&self) -> shardcx_shards::proto::ReqId {
        self.0.req_id()
    }
}

impl Rpc {
    /// A [`Caller`] of `F` to `peer` whose calls have the default deadline
    /// ([`Rpc::default_deadline`]); see [`Rpc::caller_within`].
    pub async fn caller<F: RpcFunction>(
        &self,
        peer: Peer,
        on_reply: impl Fn(&Caller<F>, u64, Result<ArchivedReply<F::Reply>, RpcError>) + 'static,
    ) -> Result<Caller<F>, RpcError> {
        self.caller_within(peer, self.default_deadline(), on_reply)
            .await
    }

    /// A [`Caller`] of `F` to `peer` from this shard, each call bounded by `timeout`, its
    /// answer given to `on_reply` with the caller (to make the next call with) and the token
    /// the call was made with: the reply's validated archive, in the buffer it was received
    /// in, or the call's error (those of [`Rpc::call`]: the server's, [`RpcError::TimedOut`],
    /// the connection's; [`RpcError::TooLarge`] from the server says `len: 0`). `on_reply`
    /// runs inline on this shard, once per call sent; a panic in it loses only that answer
    /// (counted in the net layer's `handler_panics`).
    ///
    /// Connects to `peer`'s node first when this shard has no connection to it (within
    /// `timeout`). Errors: the connection's; [`NetError::OtherShard`] when another shard of this
    /// node holds the rail to `peer` (no call of this caller could go out from here).
    pub async fn caller_within<F: RpcFunction>(
        &self,
        peer: Peer,
        timeout: Duration,
        on_reply: impl Fn(&Caller<F>, u64, Result<ArchivedReply<F::Reply>, RpcError>) + 'static,
    ) -> Result<Caller<F>, RpcError> {
        let node = self.node().clone();
        let ctx = node.shard_ctx();
        if !ctx.is_connected(peer.node_id()) {
            connect_lazily(&node, peer.node_id(), timeout)
                .await
                .map_err(|e| RpcError::from_net(e, timeout))?;
        }
        let owner = node.owner_of(peer);
        if owner != node.shard() {
            return Err(RpcError::Net(Error::Net(NetError::OtherShard {
                node: peer.node_id(),
                owner,
            })));
        }
        let t = target::<F>();
        let inner = Rc::new_cyclic(|me: &Weak<Inner<F>>| {
            let me = me.clone();
            let handler: ReplyHandler = Rc::new(move |token, answer| {
                // Every clone dropped: nobody to answer.
                let Some(inner) = me.upgrade() else { return };
                let reply = match answer {
                    Ok((header, bytes)) => {
                        reply_payload(&header, bytes, t, 0).and_then(ArchivedReply::new)
                    }
                    Err(e) => Err(RpcError::from_net(Error::Net(e), timeout)),
                };
                on_reply(&Caller(inner), token, reply);
            });
            Inner {
                node,
                peer,
                target: t,
                timeout,
                handler,
                _f: PhantomData,
            }
        });
        Ok(Caller(inner))
    }
}

impl<F: RpcFunction> Caller<F> {
    /// Sends a call of `F` with `args` and returns once it is sent (nothing awaited): its
    /// answer goes to the caller's handler with `token`, never before this returns. Arguments
    /// of up to 1 KiB are encoded in the shard's reused request buffer and sent from it: a
    /// stream of calls allocates nothing for its requests.
    ///
    /// Errors, with nothing sent and the handler not called for this call: the arguments'
    /// ([`RpcError::BadRequest`] when they do not serialize, [`RpcError::TooLarge`] over this
    /// node's [`RpcConfig::max_args_size`](super::RpcConfig::max_args_size) or the message
    /// limit), and the send's ([`NetError::NotConnected`] once the connection is gone,
    /// [`NetError::OtherShard`] when another shard took over the rail, [`NetError::ShuttingDown`],
    /// or the transport's).
    pub fn call(&self, args: &F::Args, token: u64) -> Result<CallHandle, RpcError> {
        let t = self.0.target;
        let flags = if t.idempotent {
            CallFlags::IDEMPOTENT
        } else {
            CallFlags::NONE
        };
        let ctx = self.0.node.shard_ctx();
        let payload = encode_request(t.schema, flags, args, ctx.request_buffer())?;
        let len = (payload.len() - shardcx_shards::proto::REQUEST_PREFIX_LEN) as u64;
        if let Some(max) = self.0.node.local().rpc.config.max_args_size {
            if len > max {
                return Err(RpcError::TooLarge { len, max });
            }
        }
        ctx.request_then(
            self.0.peer.dest(),
            (FrameKind::RpcRequest, t.id.get()),
            payload,
            (self.0.timeout, server_ttl(self.0.timeout)),
            (&self.0.handler, token),
        )
        .map(CallHandle)
        .map_err(|e| RpcError::from_net(Error::Net(e), self.0.timeout))
    }

    /// Gives up a call: its handler is not called for it, and the server is sent a cancel (a
    /// handler still running sees its cancellation). Whether the call was still waiting for
    /// its answer (`false`: answered, failed or cancelled already).
    pub fn cancel(&self, call: CallHandle) -> bool {
        self.0.node.shard_ctx().cancel_request(&call.0)
    }

    /// The peer this caller calls.
    pub fn peer(&self) -> Peer {
        self.0.peer
    }

    /// The deadline of each call.
    pub fn timeout(&self) -> Duration {
        self.0.timeout
    }
}
