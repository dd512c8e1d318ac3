//! `shardcx._shardcx`: the Rust half of the Python package `shardcx`.
//!
//! ## The model
//!
//! A [`Runtime`] is one shardcx [`Node`]: its shards run on threads of their own, started by
//! [`NodeBuilder::run`] on a thread that this module spawns. Python never waits on them. The
//! two directions between the asyncio event loop and the shards are:
//!
//! - **loop → shard**: every call (`tag_send`, `tag_recv`, `connect`, ...) is a [`Cmd`] pushed
//!   into the inbox of one shard (a mutex-guarded queue with a waker: glommio wakes a task
//!   from a foreign thread, also a shard sleeping in its driver). The call returns at once;
//!   the shard spawns the operation as a local task. Each operation has an id chosen by the
//!   Python side (`op`).
//! - **shard → loop**: a finished operation, an accepted endpoint, an active message or a lost
//!   peer is an [`Event`] pushed into one queue shared by the shards. The first event into an
//!   empty queue writes one byte to a socket pair; the event loop watches the other end
//!   (`loop.add_reader(runtime.fileno(), ...)`) and calls [`Runtime::drain`], which reads the
//!   bytes and takes every queued event, on the loop's thread. The shards never take the GIL.
//!
//! ## Buffers and cancellation
//!
//! Data sent is copied out of the caller's buffer on the loop thread, when the call is made;
//! data received lands in a vector owned by the shard and is copied into the caller's buffer
//! on the loop thread, after completion ([`Received::copy_into`]). So no Python memory is ever
//! lent to UCX: a cancelled asyncio task sends [`Cmd::Cancel`], the shard drops the operation's
//! task (the Rust operations park their buffers until UCX is done, see DESIGN.md, "Operations
//! own their buffers"), and a late event for a cancelled operation is ignored by the loop.
//!
//! ## Endpoints on node sessions
//!
//! shardcx connects *nodes* (one authenticated session per node pair, one rail per shard);
//! Python's endpoints are channels on a session. `connect` connects the nodes and sends an
//! `OPEN` active message carrying the new endpoint's id; the listening node's handler (inline
//! on the shard it arrived on) allocates its own endpoint id, tells Python (`accept` event) and
//! answers `ACCEPT` with both ids. Each endpoint lives on one shard of its node and addresses
//! the remote endpoint's shard explicitly, so its tag messages are matched where they arrive
//! and stay in order. A tag on the wire is 48 user bits: the receiving endpoint's id (upper
//! [`EP_BITS`]) and the application's tag (lower [`USER_TAG_BITS`]).
//!
//! Nothing here panics across into Python: errors are [`ErrInfo`] (a Python exception class
//! name and a message), and a panic inside a shard's operation task is caught by glommio's task
//! and reported as a failed operation.

#![forbid(unsafe_code)]

mod bridge;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;
use shardcx::tag::TagConfig;
use shardcx::NodeId;

use bridge::{dest, Bridge, Cmd, Config, ErrInfo, Event, Value, EP_BITS, MAX_TAG, USER_TAG_BITS};

/// Longest deadline Python may give (the tag receive's own cap).
const MAX_DEADLINE: Duration = shardcx::shards::tag::MAX_RECV_TIMEOUT;

/// A running shardcx node, driven from one asyncio event loop (see the module docs).
#[pyclass(module = "shardcx._shardcx", frozen)]
struct Runtime {
    bridge: Bridge,
}

/// Bytes received (a tag message or an active message), held until the loop copies them.
#[pyclass(module = "shardcx._shardcx", frozen)]
struct Received {
    tag: u64,
    data: Vec<u8>,
}

/// A deadline given in seconds by Python.
fn deadline(seconds: f64) -> PyResult<Duration> {
    if !(seconds.is_finite() && seconds >= 0.0) {
        return Err(PyValueError::new_err(format!(
            "deadline must be a non-negative number of seconds, not {seconds}"
        )));
    }
    Ok(Duration::from_secs_f64(seconds).min(MAX_DEADLINE))
}

/// The bytes of a buffer-protocol object (C-contiguous bytes: the Python side casts
/// `memoryview`s to format `B`), with room for the tag trailer the runtime appends.
fn copy_out(py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<Vec<u8>> {
    let buf = PyBuffer::<u8>::get(data)?;
    let len = buf.len_bytes();
    let mut v = Vec::with_capacity(len + shardcx::shards::tag::TAG_TRAILER_LEN);
    v.resize(len, 0);
    buf.copy_to_slice(py, &mut v)?;
    Ok(v)
}

/// `host:port` of a peer (`host` an IP address: the Python side resolves names).
fn socket_addr(host: &str, port: u16) -> PyResult<SocketAddr> {
    let ip: IpAddr = host
        .parse()
        .map_err(|_| PyValueError::new_err(format!("{host:?} is not an IP address")))?;
    Ok(SocketAddr::new(ip, port))
}

fn err_tuple(py: Python<'_>, name: &str, id: u64, err: ErrInfo) -> PyResult<Py<PyAny>> {
    Ok((name, id, err.kind, err.msg)
        .into_pyobject(py)?
        .into_any()
        .unbind())
}

impl Runtime {
    fn submit(&self, shard: usize, cmd: Cmd) -> PyResult<()> {
        self.bridge
            .submit(shard, cmd)
            .map_err(PyValueError::new_err)
    }
}

#[pymethods]
impl Runtime {
    /// Starts a node (see the Python class `shardcx.Node`, which calls this).
    #[new]
    #[pyo3(signature = (shards, psk, transports, listen, pinned, max_message_size, default_deadline, io_memory, spin, unexpected_count, unexpected_bytes))]
    #[allow(clippy::too_many_arguments)] // One keyword per setting, as Python passes them.
    fn py_new(
        shards: usize,
        psk: Option<Vec<u8>>,
        transports: Option<String>,
        listen: Option<(String, u16)>,
        pinned: bool,
        max_message_size: u64,
        default_deadline: f64,
        io_memory: u64,
        spin: f64,
        unexpected_count: usize,
        unexpected_bytes: usize,
    ) -> PyResult<Self> {
        if shards == 0 {
            return Err(PyValueError::new_err("shards must be at least 1"));
        }
        let listen = match listen {
            Some((host, port)) => {
                let ip: IpAddr = host.parse().map_err(|_| {
                    PyValueError::new_err(format!("listen host {host:?} is not an IP address"))
                })?;
                Some(SocketAddr::new(ip, port))
            }
            None => None,
        };
        let bridge = Bridge::start(Config {
            shards,
            psk,
            transports,
            listen,
            pinned,
            max_message_size,
            default_deadline: deadline(default_deadline)?,
            io_memory,
            spin: deadline(spin)?,
            unexpected: TagConfig {
                max_unexpected_count: unexpected_count,
                max_unexpected_bytes: unexpected_bytes,
            },
        })
        .map_err(PyRuntimeError::new_err)?;
        Ok(Self { bridge })
    }

    /// The file descriptor the event loop watches (readable when events wait).
    fn fileno(&self) -> i32 {
        self.bridge.fileno()
    }

    /// Takes every queued event, as tuples whose first item names the kind.
    fn drain(&self, py: Python<'_>) -> PyResult<Vec<Py<PyAny>>> {
        let events = self.bridge.drain();
        let mut out = Vec::with_capacity(events.len());
        for ev in events {
            let item: Py<PyAny> = match ev {
                Event::Started { port, node } => ("started", port, node)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind(),
                Event::StartFailed(err) => err_tuple(py, "start_failed", 0, err)?,
                Event::Stopped(None) => ("stopped",).into_pyobject(py)?.into_any().unbind(),
                Event::Stopped(Some(err)) => err_tuple(py, "stopped", 0, err)?,
                Event::Done { op, value } => {
                    let v: Py<PyAny> = match value {
                        Value::None => py.None(),
                        Value::Node(node) => node.into_pyobject(py)?.into_any().unbind(),
                        Value::Bytes(data) => Py::new(py, Received { tag: 0, data })?.into_any(),
                        Value::Functions(list) => list.into_pyobject(py)?.into_any().unbind(),
                        Value::Tagged(tag, data) => Py::new(py, Received { tag, data })?.into_any(),
                        Value::Endpoint {
                            ep,
                            remote_ep,
                            node,
                            remote_shard,
                        } => (ep, remote_ep, node, remote_shard)
                            .into_pyobject(py)?
                            .into_any()
                            .unbind(),
                    };
                    ("done", op, v).into_pyobject(py)?.into_any().unbind()
                }
                Event::Failed { op, err } => err_tuple(py, "failed", op, err)?,
                Event::Accept {
                    ep,
                    remote_ep,
                    shard,
                    node,
                    remote_shard,
                } => ("accept", ep, remote_ep, shard, node, remote_shard)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind(),
                Event::Am { ep, payload } => {
                    let r = Py::new(
                        py,
                        Received {
                            tag: 0,
                            data: payload,
                        },
                    )?;
                    ("am", ep, r).into_pyobject(py)?.into_any().unbind()
                }
                Event::PeerClosed { ep, sent } => ("peer_closed", ep, sent)
                    .into_pyobject(py)?
                    .into_any()
                    .unbind(),
                Event::PeerLost { node, err } => err_tuple(py, "peer_lost", node, err)?,
            };
            out.push(item);
        }
        Ok(out)
    }

    /// Connects (on `shard`) to the node listening at `host:port` (an IP address). With
    /// `endpoint`, opens an endpoint there and completes with `(ep, remote_ep, node,
    /// remote_shard)`; without, completes with the node's id (for RPC calls).
    fn connect(
        &self,
        op: u64,
        shard: usize,
        host: &str,
        port: u16,
        timeout: f64,
        endpoint: bool,
    ) -> PyResult<()> {
        self.submit(
            shard,
            Cmd::Connect {
                op,
                addr: socket_addr(host, port)?,
                timeout: deadline(timeout)?,
                endpoint,
            },
        )
    }

    /// Sends the bytes of `data` as a tag message with the 48-bit wire `tag` to shard
    /// `dest_shard` of `node`, from `shard`.
    #[allow(clippy::too_many_arguments)] // The operation's full address, as Python keeps it.
    fn tag_send(
        &self,
        py: Python<'_>,
        op: u64,
        shard: usize,
        node: u64,
        dest_shard: u16,
        tag: u64,
        data: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<()> {
        let data = copy_out(py, data)?;
        self.submit(
            shard,
            Cmd::TagSend {
                op,
                dest: dest(node, dest_shard),
                tag,
                data,
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Receives on `shard` the earliest tag message from `node` whose 48-bit wire tag matches
    /// `pattern` under `mask`. Completes with a `Received`.
    fn tag_recv(
        &self,
        op: u64,
        shard: usize,
        node: u64,
        pattern: u64,
        mask: u64,
        timeout: f64,
    ) -> PyResult<()> {
        self.submit(
            shard,
            Cmd::TagRecv {
                op,
                node: NodeId::new(node),
                pattern,
                mask,
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Sends the bytes of `data` as an active message to endpoint `remote_ep`.
    #[allow(clippy::too_many_arguments)] // The operation's full address, as Python keeps it.
    fn am_send(
        &self,
        py: Python<'_>,
        op: u64,
        shard: usize,
        node: u64,
        dest_shard: u16,
        remote_ep: u32,
        data: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<()> {
        let data = copy_out(py, data)?;
        self.submit(
            shard,
            Cmd::AmSend {
                op,
                dest: dest(node, dest_shard),
                remote_ep,
                data,
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Tells endpoint `remote_ep` that its peer closed after sending it `sent` tag messages.
    #[allow(clippy::too_many_arguments)] // The operation's full address, as Python keeps it.
    fn close_ep(
        &self,
        op: u64,
        shard: usize,
        node: u64,
        dest_shard: u16,
        remote_ep: u32,
        sent: u64,
        timeout: f64,
    ) -> PyResult<()> {
        self.submit(
            shard,
            Cmd::Close {
                op,
                dest: dest(node, dest_shard),
                remote_ep,
                sent,
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Calls, from `shard`, the RPC function named `name` of `node` (on its shard
    /// `dest_shard`, or the calling shard's default rail when `None`) with the bytes of
    /// `data`. Completes with a `Received` holding the reply.
    #[allow(clippy::too_many_arguments)] // The call's full address, as Python keeps it.
    #[pyo3(signature = (op, shard, node, dest_shard, name, data, timeout))]
    fn rpc_call(
        &self,
        py: Python<'_>,
        op: u64,
        shard: usize,
        node: u64,
        dest_shard: Option<u16>,
        name: String,
        data: &Bound<'_, PyAny>,
        timeout: f64,
    ) -> PyResult<()> {
        let data = copy_out(py, data)?;
        let dest = match dest_shard {
            Some(s) => dest(node, s),
            None => shardcx::shards::net::Dest::from(NodeId::new(node)),
        };
        self.submit(
            shard,
            Cmd::RpcCall {
                op,
                dest,
                name,
                data,
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Lists, from `shard`, the RPC functions `node` serves. Completes with a list of
    /// `(name, id, version, takes_bytes)`.
    fn rpc_functions(&self, op: u64, shard: usize, node: u64, timeout: f64) -> PyResult<()> {
        self.submit(
            shard,
            Cmd::RpcFunctions {
                op,
                node: NodeId::new(node),
                timeout: deadline(timeout)?,
            },
        )
    }

    /// Cancels operation `op` on `shard` (nothing happens when it has finished).
    fn cancel(&self, shard: usize, op: u64) -> PyResult<()> {
        self.submit(shard, Cmd::Cancel { op })
    }

    /// Whether new endpoints opened by remote nodes are accepted.
    fn set_accepting(&self, on: bool) {
        self.bridge.set_accepting(on);
    }

    /// Asks the node to stop (it drains, closes its connections and ends; a `stopped` event
    /// follows).
    fn stop(&self) {
        self.bridge.stop();
    }

    /// Waits (without the GIL) up to `timeout` seconds for the node's thread to end; returns
    /// whether it did.
    fn join(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        let timeout = deadline(timeout)?;
        Ok(py.detach(|| self.bridge.join(timeout)))
    }
}

#[pymethods]
impl Received {
    /// The message's application tag (0 for active messages).
    #[getter]
    fn tag(&self) -> u64 {
        self.tag
    }

    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// Copies the message into `buf` (a writable, C-contiguous byte buffer of exactly the
    /// message's length: the Python side slices the caller's buffer).
    fn copy_into(&self, py: Python<'_>, buf: &Bound<'_, PyAny>) -> PyResult<()> {
        let target = PyBuffer::<u8>::get(buf)?;
        target.copy_from_slice(py, &self.data)
    }

    /// The message as `bytes`.
    fn to_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.data)
    }
}

/// The Rust half of `shardcx` (use the package `shardcx`, not this module).
#[pymodule]
fn _shardcx(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Runtime>()?;
    m.add_class::<Received>()?;
    m.add("MAX_TAG", MAX_TAG)?;
    m.add("EP_BITS", EP_BITS)?;
    m.add("USER_TAG_BITS", USER_TAG_BITS)?;
    m.add("TAG_TRAILER_LEN", shardcx::shards::tag::TAG_TRAILER_LEN)?;
    m.add("DEFAULT_DEADLINE", shardcx::DEFAULT_DEADLINE.as_secs_f64())?;
    Ok(())
}
