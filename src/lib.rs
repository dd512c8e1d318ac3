#![doc = include_str!("../README.md")]

pub mod bench;
pub mod collective;
mod error;
pub mod metrics;
pub mod node;
pub mod registry;
pub mod rma;
pub mod rpc;
pub mod shutdown;
pub mod tag;

pub use error::Error;
pub use node::{
    AmMsg, AmView, DeviceAmMsg, Node, NodeBuilder, OwnedAmMsg, Peer, DEFAULT_DEADLINE,
    FIRST_RESERVED_AM_ID, MAX_AM_HEADER,
};
pub use rma::{Region, RemoteRegion, TrustedDescriptor, TrustedRegion};
pub use rpc::{FunctionId, Rpc, RpcConfig, RpcContext, RpcError, RpcFunction, RpcStats};
pub use shardcx_shards::cuda::{CudaDevice, CudaError, CudaMode, DeviceBuffer};
pub use shardcx_shards::proto::{AmId, NodeId, ShardId};
pub use shardcx_shards::{proto, ucx, SendBuf, SharedElems};
pub use shutdown::{Shutdown, Stopped, DEFAULT_DRAIN_DEADLINE};
pub use tag::{MAX_USER_TAG, TAG_MASK_ANY, TAG_MASK_EXACT};

/// The runtime inside a core: shards, their progress drivers, pools and cross-shard forwarding.
pub use shardcx_shards as shards;
/// CUDA device memory: the probe, the mode each shard runs in (`SHARDCX_CUDA`), device buffers.
pub use shardcx_shards::cuda;

/// Helpers shared by the crate's unit tests.
#[cfg(test)]
pub(crate) mod testing {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::task::{Wake, Waker};

    /// A waker that counts how often it was woken.
    pub(crate) struct CountingWaker(AtomicUsize);

    impl CountingWaker {
        /// A new counter (at 0) and a waker that counts on it.
        pub(crate) fn new() -> (Arc<CountingWaker>, Waker) {
            let c = Arc::new(CountingWaker(AtomicUsize::new(0)));
            (c.clone(), Waker::from(c))
        }

        /// How often its waker was woken.
        pub(crate) fn count(&self) -> usize {
            self.0.load(Ordering::SeqCst)
        }
    }

    impl Wake for CountingWaker {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
}
