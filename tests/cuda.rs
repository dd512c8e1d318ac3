//! Device buffers as the sources of the facade's sends: tag sends
//! ([`Peer::tag_send_device`]), RPC arguments ([`shardcx::rpc::Rpc::call_device`]) and replies
//! (an RPC handler replying with [`Node::device_to_vec`], a reply landed with
//! [`shardcx::rpc::Rpc::call_into_device_within`]), staged through the shards' pinned bounce
//! buffers; two nodes of one shard each in one process, over tcp on loopback. Every transfer is
//! checked byte for byte, below one 2 MiB staging chunk, over several chunks and empty; the
//! errors are typed ([`Error::Cuda`]): CUDA off on the sending shard, a reply of another
//! length than its device buffer, a device copy failing mid-transfer.
//!
//! Without a GPU but with a C compiler, [`gpu_branches_against_a_fake_driver`] runs the other
//! tests again in a child process that loads the fake `libcuda` of
//! `shards/ucx/tests/fake_cuda` (device memory in host memory, copies done at once, and a copy
//! of [`FAIL_LEN`] bytes failing): this checks the staging bookkeeping and the wire, not CUDA.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use glommio::timer::sleep;
use shardcx::cuda::{driver, CudaError, ModeRequest, StagingCopyError, Unavailable};
use shardcx::rpc::{RpcContext, RpcError};
use shardcx::{AmId, AmMsg, DeviceBuffer, Error, Node, NodeBuilder, NodeId, Peer, TAG_MASK_EXACT};

mod common;
#[path = "../shards/ucx/tests/fake_cuda/mod.rs"]
mod fake_cuda;
use common::serial;
use fake_cuda::{FakeDriver, FAKE_ENV};

/// Longest any one test may run.
const LIMIT: Duration = Duration::from_secs(60);
const KEY: &[u8] = b"facade cuda test key, 16+ bytes";
const A: NodeId = NodeId::new(0xA);
const B: NodeId = NodeId::new(0xB);
/// Lengths every path moves: empty, under one 2 MiB staging chunk, one chunk exactly, and
/// three chunks with a short last one.
const LENS: [usize; 4] = [0, 1000, 2 << 20, (5 << 20) + 12345];
/// The length of device copy the fake driver fails (`FAKE_CUDA_FAIL_COPY_LEN`, set by
/// [`gpu_branches_against_a_fake_driver`]): a transfer of `2 MiB + FAIL_LEN` bytes fails on its
/// second chunk.
const FAIL_LEN: usize = 4099;

/// Active message whose payload node B's handler lands in a device buffer it chooses
/// ([`AmMsg::into_device`]); the header's first byte says how (see [`land`]).
const LAND: AmId = AmId::new(0x0C0D_0002);
/// What [`land`] saw, in order: (header byte, "ok <len> <same bytes>" or "err <error> <len>").
static LANDED: Mutex<Vec<(u8, String)>> = Mutex::new(Vec::new());

shardcx::rpc_function!(
    /// Lands the argument in a device buffer of the server's shard and replies with that
    /// buffer's bytes.
    DeviceEcho: Vec<u8> => Vec<u8>, id = 0x0C0D_0001, name = "test.cuda.echo"
);

/// `len` bytes of a pattern that differs from one length to the next.
fn pattern(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64 * 31 + (i as u64 >> 12) + len as u64) as u8)
        .collect()
}

/// Whether there is a device to make buffers on (a real driver, or the fake one).
fn has_device() -> bool {
    driver().is_ok_and(|d| !d.devices.is_empty())
}

/// A device buffer on the current shard's device holding `bytes`.
fn device_with(node: &Node, bytes: &[u8]) -> DeviceBuffer {
    let mut buf = node.shard_ctx().cuda().alloc(bytes.len()).expect("alloc");
    buf.copy_from_host(0, bytes).expect("fill");
    buf
}

fn node(id: NodeId, cuda: ModeRequest) -> NodeBuilder {
    common::two_shard_node(id, KEY).shards(1).cuda(cuda)
}

async fn wait_for(mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < LIMIT, "timed out waiting");
        sleep(Duration::from_millis(1)).await;
    }
}

/// Runs node B (listening, serving [`DeviceEcho`]) and node A (connecting to it, CUDA mode
/// `a_cuda`), one shard each: A runs `on_a(node, B)` and B runs `on_b(node, A)`, then each
/// serves until the other is done. Returns their results; fails past `LIMIT`.
fn pair<FA, FutA, RA, FB, FutB, RB>(a_cuda: ModeRequest, on_a: FA, on_b: FB) -> (RA, RB)
where
    FA: Fn(Node, Peer) -> FutA + Send + Clone + 'static,
    FutA: Future<Output = RA> + 'static,
    RA: Send + 'static,
    FB: Fn(Node, Peer) -> FutB + Send + Clone + 'static,
    FutB: Future<Output = RB> + 'static,
    RB: Send + 'static,
{
    let _g = serial();
    let addr: Arc<OnceLock<SocketAddr>> = Arc::default();
    let addr_a = addr.clone();
    // Each node serves until both are done (A's large sends are pulled by B after A's send
    // has returned, and B's replies reach A): each flag is set when its side ends, however it
    // ends (a panic drops the guard too).
    let (a_done, b_done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicBool::new(false)),
    );
    let (a_done_b, b_done_a) = (a_done.clone(), b_done.clone());
    let b = std::thread::spawn(move || {
        node(B, ModeRequest::Auto)
            .listen("127.0.0.1:0".parse().unwrap())
            .rpc_async::<DeviceEcho, _, _, _>(|| {
                |ctx: RpcContext, args: Vec<u8>| async move {
                    let node = ctx.node();
                    let mut dev = node
                        .shard_ctx()
                        .cuda()
                        .alloc(args.len())
                        .map_err(|e| e.to_string())?;
                    node.copy_to_device(&args, &mut dev)
                        .await
                        .map_err(|e| e.to_string())?;
                    node.device_to_vec(&mut dev)
                        .await
                        .map_err(|e| e.to_string())
                }
            })
            .on_am(LAND, || land)
            .run(move |node: Node| {
                let (addr, on_b) = (addr.clone(), on_b.clone());
                let (a_done, b_done) = (a_done_b.clone(), b_done.clone());
                async move {
                    let r = {
                        let _done = Done(b_done);
                        if let Some(a) = node.listen_addr() {
                            let _ = addr.set(a);
                        }
                        on_b(node, Peer::new(A)).await
                    };
                    wait_for(|| a_done.load(Ordering::Acquire)).await;
                    r
                }
            })
            .expect("node B")
    });
    let a = std::thread::spawn(move || {
        node(A, a_cuda)
            .run(move |node: Node| {
                let (addr, on_a) = (addr_a.clone(), on_a.clone());
                let (a_done, b_done) = (a_done.clone(), b_done_a.clone());
                async move {
                    let r = {
                        let _done = Done(a_done);
                        wait_for(|| addr.get().is_some()).await;
                        let b = node.connect(*addr.get().unwrap()).await.expect("connect");
                        on_a(node, b).await
                    };
                    wait_for(|| b_done.load(Ordering::Acquire)).await;
                    r
                }
            })
            .expect("node A")
    });
    let from_a = common::within(LIMIT, move || a.join().expect("node A panicked"));
    let from_b = common::within(LIMIT, move || b.join().expect("node B panicked"));
    (
        from_a.into_iter().next().unwrap(),
        from_b.into_iter().next().unwrap(),
    )
}

/// Node B's handler of [`LAND`]: chooses a device buffer for the payload (header byte 0: of
/// its length; 1: one byte longer) and lands the payload there in a task, recording in
/// [`LANDED`] whether the buffer then holds the payload's pattern, or the error and the length
/// of the buffer handed back.
fn land(node: &Node, msg: AmMsg) {
    let len = msg.payload().len();
    let how = msg.header().first().copied().unwrap_or(0);
    let dst = node
        .shard_ctx()
        .cuda()
        .alloc(len + usize::from(how == 1))
        .expect("a device buffer");
    glommio::spawn_local(async move {
        let seen = match msg.into_device(dst).await {
            Ok(mut m) => {
                let same = m.payload().to_vec().unwrap() == pattern(len);
                assert_eq!((m.id(), m.header()), (LAND, &[how][..]));
                format!("ok {len} {same}")
            }
            Err((e, buf)) => format!("err {e} {}", buf.len()),
        };
        LANDED.lock().unwrap().push((how, seen));
    })
    .detach();
}

/// Sets its flag when dropped: one node's end of a [`pair`], however it ends.
struct Done(Arc<AtomicBool>);

impl Drop for Done {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Without a device no device buffer can be made to send from: the allocation says why.
fn no_device_says_why() {
    let reason = driver().err().map_or(Unavailable::NoDevice, |u| u);
    eprintln!("skipped the transfers: no CUDA device ({reason})");
    assert_eq!(
        DeviceBuffer::alloc_on(0, 16).map(|b| b.len()),
        Err(CudaError::Unavailable(reason))
    );
}

/// A tag send from a device buffer arrives as the same bytes a host send would carry, and the
/// receiver lands them in a device buffer of its own, at every length of [`LENS`].
#[test]
fn tag_sends_from_device_buffers() {
    if !has_device() {
        return no_device_says_why();
    }
    let ((), landed) = pair(
        ModeRequest::Auto,
        |node: Node, b: Peer| async move {
            for (i, &len) in LENS.iter().enumerate() {
                let mut dev = device_with(&node, &pattern(len));
                b.tag_send_device(0x700 + i as u64, &mut dev)
                    .await
                    .unwrap_or_else(|e| panic!("tag_send_device of {len} bytes: {e}"));
            }
        },
        |node: Node, a: Peer| async move {
            let mut landed = Vec::new();
            for (i, &len) in LENS.iter().enumerate() {
                let (tag, got) = a.tag_recv(0x700 + i as u64, TAG_MASK_EXACT).await.unwrap();
                assert_eq!(tag, 0x700 + i as u64);
                assert!(got == pattern(len), "{len} bytes: the message differs");
                let mut dev = node.shard_ctx().cuda().alloc(len).unwrap();
                node.copy_to_device(&got, &mut dev).await.unwrap();
                landed.push(dev.to_vec().unwrap() == pattern(len));
            }
            landed
        },
    );
    assert_eq!(landed, vec![true; LENS.len()]);
}

/// An RPC argument sent from a device buffer reaches the server's handler, which lands it in
/// device memory and replies from there; a reply landed in a device buffer holds what the
/// server sent; a reply whose length is not the buffer's is a typed error. Every length of
/// [`LENS`], byte for byte.
#[test]
fn rpc_arguments_and_replies_from_device_buffers() {
    if !has_device() {
        return no_device_says_why();
    }
    let (mismatch, ()) = pair(
        ModeRequest::Auto,
        |node: Node, b: Peer| async move {
            let rpc = node.rpc();
            for &len in &LENS {
                let want = pattern(len);
                let mut args = device_with(&node, &want);
                let reply = rpc
                    .call_device::<DeviceEcho>(b, &mut args)
                    .await
                    .unwrap_or_else(|e| panic!("call_device of {len} bytes: {e}"));
                assert!(reply == want, "{len} bytes: the reply differs");

                let mut into = node.shard_ctx().cuda().alloc(len).unwrap();
                rpc.call_into_device_within::<DeviceEcho>(b, &want, &mut into, LIMIT)
                    .await
                    .unwrap_or_else(|e| panic!("call_into_device of {len} bytes: {e}"));
                assert!(
                    into.to_vec().unwrap() == want,
                    "{len} bytes: the landed reply differs"
                );
            }
            let mut short = node.shard_ctx().cuda().alloc(10).unwrap();
            let e = rpc
                .call_into_device_within::<DeviceEcho>(b, &pattern(11), &mut short, LIMIT)
                .await
                .unwrap_err();
            e.to_string()
        },
        |_: Node, _: Peer| async move {},
    );
    assert_eq!(mismatch, "staging: 11 host bytes for a device buffer of 10");
}

/// What the device sends of a shard whose CUDA mode is off return (with a driver and a device
/// all the same: the buffers are made directly on device 0), and, under the fake driver with
/// [`FAIL_LEN`] set, what a device copy failing mid-transfer returns: typed errors, nothing
/// sent, and the next send works.
#[test]
fn device_sends_fail_with_typed_errors() {
    if !has_device() {
        return no_device_says_why();
    }
    let off = |e: &Error| {
        matches!(
            e,
            Error::Cuda(StagingCopyError::Cuda(CudaError::Unavailable(
                Unavailable::TurnedOff
            )))
        )
    };
    pair(
        ModeRequest::Off,
        move |node: Node, b: Peer| async move {
            // The shard has no device: device 0, opened here, makes the buffer.
            let device = shardcx::CudaDevice::open(0).expect("device 0");
            let mut dev = DeviceBuffer::from_host(&device, &pattern(100)).unwrap();
            let e = b.tag_send_device(0x800, &mut dev).await.unwrap_err();
            assert!(off(&e), "tag_send_device: {e:?}");
            let e = b
                .am_send_device(shardcx::AmId::new(0x800), &[], &mut dev)
                .await;
            assert!(off(e.as_ref().unwrap_err()), "am_send_device: {e:?}");
            match node.rpc().call_device::<DeviceEcho>(b, &mut dev).await {
                Err(RpcError::Net(e)) if off(&e) => {}
                other => panic!("call_device: {other:?}"),
            }
        },
        |_: Node, _: Peer| async move {},
    );
    if std::env::var_os("FAKE_CUDA_FAIL_COPY_LEN").is_none() {
        eprintln!("skipped the failing copy: only the fake driver fails one");
        return;
    }
    let ((), got) = pair(
        ModeRequest::Auto,
        |node: Node, b: Peer| async move {
            let mut dev = device_with(&node, &pattern((2 << 20) + FAIL_LEN));
            let failed = |e: &Error| {
                matches!(
                    e,
                    Error::Cuda(StagingCopyError::Cuda(CudaError::Driver { code: 999, .. }))
                )
            };
            let e = b.tag_send_device(0x900, &mut dev).await.unwrap_err();
            assert!(failed(&e), "tag_send_device: {e:?}");
            match node.rpc().call_device::<DeviceEcho>(b, &mut dev).await {
                Err(RpcError::Net(e)) if failed(&e) => {}
                other => panic!("call_device: {other:?}"),
            }
            // The shard's bounce buffers came back: the next staged send works.
            let mut ok = device_with(&node, &pattern(3 << 20));
            b.tag_send_device(0x901, &mut ok).await.unwrap();
        },
        |_: Node, a: Peer| async move {
            // Nothing of the failed send went out: the first message here is the good one.
            let (tag, got) = a.tag_recv(0x900, 0xFFE).await.unwrap();
            (tag, got == pattern(3 << 20))
        },
    );
    assert_eq!(got, (0x901, true));
}

/// Active-message payloads landed in device buffers their handler chose, eager and by
/// rendezvous (into the shard's pooled buffers first), byte for byte at every length of
/// [`LENS`]; a buffer of another length, and (under the fake driver) a device copy failing
/// mid-transfer, are typed errors that hand the buffer back.
#[test]
fn am_payloads_land_in_device_buffers_the_handler_chooses() {
    if !has_device() {
        return no_device_says_why();
    }
    LANDED.lock().unwrap().clear();
    let failing = std::env::var_os("FAKE_CUDA_FAIL_COPY_LEN").is_some();
    let mut sends: Vec<(u8, usize)> = LENS.iter().map(|&len| (0, len)).collect();
    sends.push((1, 1000));
    if failing {
        sends.push((0, (2 << 20) + FAIL_LEN));
    }
    let expected = sends.len();
    let to_send = sends.clone();
    let ((), (landed, rendezvous)) = pair(
        ModeRequest::Auto,
        move |_: Node, b: Peer| {
            let sends = to_send.clone();
            async move {
                for (how, len) in sends {
                    b.am_send(LAND, &[how], &pattern(len)).await.unwrap();
                }
            }
        },
        move |node: Node, _: Peer| async move {
            wait_for(|| LANDED.lock().unwrap().len() >= expected).await;
            let landed = std::mem::take(&mut *LANDED.lock().unwrap());
            (landed, node.shard_ctx().net_stats().rendezvous)
        },
    );
    let mut want: Vec<(u8, String)> = LENS
        .iter()
        .map(|len| (0, format!("ok {len} true")))
        .collect();
    want.push((
        1,
        "err staging: 1000 host bytes for a device buffer of 1001 1001".into(),
    ));
    if failing {
        want.push((
            0,
            format!(
                "err cuda: cuMemcpyHtoDAsync failed: unknown error (CUresult 999) {}",
                (2 << 20) + FAIL_LEN
            ),
        ));
    }
    // One connection, one shard each: the handler's tasks may end out of order (a longer
    // copy yields more), so compare as sets.
    let (mut landed, mut want) = (landed, want);
    landed.sort();
    want.sort();
    assert_eq!(landed, want);
    // The long payloads came by rendezvous.
    assert!(rendezvous >= 2, "{rendezvous} rendezvous transfers");
}

/// Runs the other tests again against the fake driver (see the module docs).
#[test]
fn gpu_branches_against_a_fake_driver() {
    if std::env::var_os(FAKE_ENV).is_some() || driver().is_ok() {
        return; // The child itself, or a real driver that the tests already ran against.
    }
    let Some(fake) = FakeDriver::build("facade") else {
        return;
    };
    let out = fake.rerun_with(
        &["--skip", "gpu_branches_against_a_fake_driver"],
        shardcx::cuda::CUDA_MODE_ENV,
        &[("FAKE_CUDA_FAIL_COPY_LEN", &FAIL_LEN.to_string())],
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "against the fake driver:\n{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("test result: ok. 4 passed"), "{text}");
}
