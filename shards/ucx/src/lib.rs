//! # shardcx-ucx: a safe, cancel-safe layer over UCX
//!
//! This crate turns [ucx1-sys](https://docs.rs/ucx1-sys) into safe Rust: RAII owners for every
//! UCX handle, one mapping from UCX status codes to a typed [`Error`], and operations as
//! futures that **own their buffers**. It is the only crate of shardcx that contains `unsafe`
//! code; every unsafe block carries a `// SAFETY:` comment citing the UCX contract it relies
//! on. It knows nothing of glommio or of shardcx's protocol: completions wake plain
//! [`std::task::Waker`]s.
//!
//! ## The model
//!
//! - [`Context`] (`ucp_context_h`) → [`Worker`] (`ucp_worker_h`) → [`Endpoint`] (`ucp_ep_h`),
//!   [`Listener`] (`ucp_listener_h`); [`MemHandle`] (`ucp_mem_h`) and [`RemoteKey`]
//!   (`ucp_rkey_h`). Children hold a reference-counted pointer to their parent, so destruction
//!   always runs in UCX's required order: remote keys, endpoints, listeners, worker, memory
//!   handles, context.
//! - Nothing happens unless [`Worker::progress`] is called. Callbacks run inside it and only
//!   record results and wake wakers. [`Worker::arm`] and [`Worker::event_fd`] let a caller
//!   sleep when idle; [`block_on`] is a small driver doing exactly that.
//! - Operations ([`Endpoint::am_send`], [`Endpoint::tag_send`], [`Worker::tag_recv`],
//!   [`Endpoint::put`], [`Endpoint::get`], [`Worker::am_recv_data`], flushes) take buffers by
//!   value and resolve to `(Result<T>, buffer)`. A future posts its operation on first poll.
//!   **Dropping it cancels the request** (`ucp_request_cancel`) and parks its buffers with the
//!   worker until UCX reports completion; only then are they freed. See [`IoBuf`] for what a
//!   buffer must guarantee. Buffers include `Vec<u8>`, `Box<[u8]>`, [`AlignedBuf`] and
//!   [`MemSlice`], an exclusive lease on part of a registered region (for memory pools).
//! - UCX 1.12 cannot be given a buffer's registration per operation (`UCP_OP_ATTR_FIELD_MEMH`
//!   arrived in later releases): registered buffers still go through UCX's registration cache,
//!   which finds the region's existing registration.
//! - Active messages arrive through a handler ([`Worker::set_am_handler`]) that sees the header
//!   and either keeps the eager data ([`AmData`], a UCX descriptor kept past the callback) or
//!   pulls rendezvous data into a buffer it chooses ([`AmRndv`] + [`Worker::am_recv_data`]).
//!
//! - CUDA ([`cuda`]): the driver, loaded at run time through cudarc (no toolkit or `libcuda`
//!   at build time), a probe that decides a [`cuda::CudaMode`] per context (off, staging,
//!   zero-copy, from the driver, its devices and [`Context::memory_types`]),
//!   [`cuda::DeviceBuffer`] (`cuMemAlloc` with the event of its last work) and
//!   [`cuda::PinnedBuf`] (pinned host memory, an [`IoBuf`]). A device pointer is never an
//!   [`IoBuf`]: it must reach UCX only in zero-copy mode, which nothing does yet.
//!
//! ## Status codes and enums
//!
//! ucx1-sys 0.1 turns almost every C enum into a Rust enum, and a value outside its variants is
//! undefined behaviour. This crate never lets one form: it re-declares every status-returning
//! function with a raw `i8` result, writes callbacks with raw `i8` statuses, builds parameter
//! structs field by field with declared variants only, and maps statuses in one place
//! ([`Error::from_raw`]), keeping unknown codes from newer UCX releases as [`Error::Other`].
//!
//! ## Send and Sync
//!
//! Workers are created with `UCS_THREAD_MODE_SINGLE`. [`Context`], [`Worker`], [`Endpoint`],
//! [`Listener`], [`MemHandle`], [`RemoteKey`] and the operation futures are built on `Rc` and
//! are neither `Send` nor `Sync`: each belongs to the thread that made it. [`WorkerAddress`]
//! and [`PackedRkey`] are plain bytes and may travel between threads. The CUDA handles are
//! process-wide driver objects: [`cuda::CudaDevice`] is `Send + Sync`, [`cuda::DeviceBuffer`],
//! [`cuda::PinnedBuf`] and [`cuda::PendingCopy`] are `Send` (each states why).
//!
//! ## What the machine needs
//!
//! ucx1-sys builds UCX 1.12 from source (autoconf, automake, libtool, libclang for bindgen) and
//! links `libucp` dynamically. [`version()`] reports which library was loaded at run time. No
//! RDMA hardware is needed: UCX runs over shared memory (`posix`, `sysv`, `cma`) and `tcp` on
//! loopback. Connecting by socket address needs `tcp` (UCX 1.12's connection manager runs over
//! it); with shared memory only, connect by [`WorkerAddress`]. CUDA needs nothing at build time;
//! at run time an NVIDIA driver (`libcuda`, CUDA 12 or later) and a device, else every device
//! API returns [`cuda::CudaError::Unavailable`].

mod affinity;
mod am;
mod buf;
mod context;
pub mod cuda;
mod driver;
mod endpoint;
mod ffi;
mod listener;
mod nudge;
mod request;
mod rma;
mod status;
mod tag;
mod version;
mod worker;

pub use affinity::{release_async_thread, set_async_thread_cpus, thread_cpus, threads_named};
pub use am::{
    AmData, AmIdRaw, AmIncoming, AmPayload, AmPayloadBufs, AmProto, AmRecvData, AmRndv, AmSend,
};
pub use buf::{AlignedBuf, IoBuf, IoBufMut, MemoryType, SendBuf, SharedElems};
pub use context::{Config, Context, Features, MemoryTypes};
pub use driver::{block_on, block_on_with, DEFAULT_SPIN};
pub use endpoint::{Close, CloseMode, Endpoint, EpFailed, EpOptions, ErrorMode};
pub use listener::{Accept, ConnRequest, Listener};
pub use nudge::{Nudger, NUDGE_SIGNAL};
pub use request::callback_panics;
pub use rma::{Get, MemHandle, MemSlice, PackedRkey, Put, RemoteKey};
pub use status::{status_string, Error, RawStatus, Result};
pub use tag::{TagRecv, TagRecvInfo, TagSend};
pub use version::{version, VersionInfo};
pub use worker::{Armed, Flush, WakeupFd, Worker, WorkerAddress, AM_ALIGNMENT};
