//! A device buffer out, a device buffer back, checked: CUDA memory through an active-message
//! echo between two nodes on loopback.
//!
//! ```text
//! cargo run --release --example gpu_echo                     # both nodes in this process
//! cargo run --release --example gpu_echo -- --sizes 8,1M,8M  # payload sizes
//! ```
//!
//! For each size, the client shard fills a [`DeviceBuffer`] on its own device (the one its
//! shard opened at start) with a pattern, sends it to the server node, whose handler echoes it
//! back, lands the reply in a second device buffer and checks it byte for byte against the
//! pattern.
//!
//! **Staged through host memory, by the runtime.** The device buffer is sent with
//! [`Peer::am_send_device`](shardcx::Peer::am_send_device), which stages its bytes to host
//! memory through the shard's pinned bounce buffers (chunks of 2 MiB, the device copies' events
//! polled, never waited on) and sends them as any active message; the client's reply handler
//! chooses a device buffer for the reply's payload and lands it there with
//! [`AmMsg::into_device`] (the same pipeline the other way, from where the payload arrived),
//! and the buffer is read back with [`Node::copy_from_device`] to be checked. It is correct in every CUDA mode (UCX
//! never sees a device pointer); a zero-copy send, UCX reading device memory itself where its
//! CUDA transports are loaded, is not there yet.
//!
//! Where there is no GPU (no `libcuda`, no device, or `SHARDCX_CUDA=off`) it prints
//! `gpu_echo: no GPU here: skipped (REASON)` and exits 0.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // An example may panic: a panic is a failure it reports.

use std::cell::RefCell;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalSender};
use glommio::timer::sleep;
use shardcx::cuda::ModeRequest;
use shardcx::{AmId, AmMsg, DeviceAmMsg, DeviceBuffer, Node, NodeId};

#[path = "common/cli.rs"]
mod cli;

const KEY: &[u8] = b"gpu_echo example pre-shared key";
const ECHO: AmId = AmId::new(1);
const REPLY: AmId = AmId::new(2);

/// A device buffer out, a device buffer back, checked (staged through host memory).
#[derive(clap::Parser)]
#[command(name = "gpu_echo")]
struct Args {
    /// Payload sizes (B, K, M suffixes), each sent once per round.
    #[arg(long, value_delimiter = ',', default_value = "8,4K,1M,8M", value_parser = cli::size)]
    sizes: Vec<usize>,
    /// Rounds per size.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// UCX transports (tcp is needed to connect by address in UCX 1.12).
    #[arg(long, default_value = "tcp")]
    tls: String,
}

/// Why this machine cannot run the example, or `None` when it can.
fn no_gpu_reason() -> Option<String> {
    match ModeRequest::from_env() {
        Err(e) => return Some(e.to_string()),
        Ok(ModeRequest::Off) => return Some(format!("{}=off", shardcx::cuda::CUDA_MODE_ENV)),
        Ok(_) => {}
    }
    shardcx::cuda::device_unavailable(shardcx::cuda::driver().as_ref().map(|d| *d))
        .map(|u| u.to_string())
}

fn node(tls: &str, id: u64) -> shardcx::NodeBuilder {
    Node::builder()
        .shards(1)
        .placement(shardcx::shards::Placement::Unpinned)
        .transports(tls)
        .node_id(NodeId::new(id))
        .psk(KEY)
        // Two nodes share this process: 1 MiB of io memory per shard fits 8 MiB memlock.
        .io_memory(1 << 20)
}

/// The server: echo every message back, header and payload unchanged.
fn serve(
    tls: &str,
    bound: mpsc::Sender<SocketAddr>,
    stop: Arc<AtomicBool>,
) -> Result<(), shardcx::Error> {
    node(tls, 2)
        .listen("127.0.0.1:0".parse().unwrap())
        .on_am(ECHO, || {
            |_node: &Node, msg: AmMsg| {
                if let Err(e) = msg.reply(REPLY, msg.header(), msg.payload()) {
                    eprintln!("gpu_echo server: reply failed: {e}");
                }
            }
        })
        .run(move |node: Node| {
            let (bound, stop) = (bound.clone(), stop.clone());
            async move {
                let _ = bound.send(node.listen_addr().unwrap());
                while !stop.load(Ordering::Acquire) {
                    sleep(Duration::from_millis(10)).await;
                }
            }
        })
        .map(drop)
}

thread_local! {
    /// Replies for the client loop, landed in device memory (or why they could not be).
    static REPLIES: RefCell<Option<LocalSender<Result<DeviceAmMsg, String>>>> =
        const { RefCell::new(None) };
}

/// Hands a reply to the client loop.
fn send_reply(reply: Result<DeviceAmMsg, String>) {
    REPLIES.with(|r| {
        if let Some(tx) = r.borrow().as_ref() {
            let _ = tx.try_send(reply);
        }
    });
}

/// Bytes that say where they are and which round they belong to.
fn pattern(len: usize, round: u32) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32).wrapping_mul(2654435761).wrapping_add(round) as u8 ^ (i >> 12) as u8)
        .collect()
}

/// The client: for each size and round, device → host → echo → host → device, checked.
fn client(args: &Args, addr: SocketAddr) -> Vec<String> {
    let (sizes, rounds) = (args.sizes.clone(), args.rounds);
    let mut out = node(&args.tls, 1)
        .on_am(REPLY, || {
            |node: &Node, msg: AmMsg| {
                // Device buffer back: the handler chooses where the reply's payload lands.
                let landing = match node.shard_ctx().cuda().alloc(msg.payload().len()) {
                    Ok(back) => Some(msg.into_device(back)),
                    Err(e) => {
                        send_reply(Err(format!("no device buffer for the reply: {e}")));
                        None
                    }
                };
                if let Some(landing) = landing {
                    glommio::spawn_local(async move {
                        send_reply(landing.await.map_err(|(e, _)| e.to_string()));
                    })
                    .detach();
                }
            }
        })
        .run(move |node: Node| {
            let sizes = sizes.clone();
            async move {
                let cuda = node.shard_ctx().cuda();
                let mode = cuda.mode();
                let device = cuda.device().map(|d| d.info().clone());
                let (tx, rx) = local_channel::new_unbounded();
                REPLIES.with(|r| *r.borrow_mut() = Some(tx));
                let peer = node.connect(addr).await.expect("connect");
                let mut lines = vec![format!(
                    "client shard {}: CUDA mode {mode}, device {}",
                    node.shard(),
                    device.map_or("none".into(), |d| format!("{} ({})", d.ordinal, d.name)),
                )];
                for &len in &sizes {
                    let t0 = Instant::now();
                    for round in 0..rounds {
                        let want = pattern(len, round);
                        // Device buffer out: filled from the host, sent from the device.
                        let mut out_buf = cuda.alloc(len).expect("device buffer");
                        node.copy_to_device(&want, &mut out_buf)
                            .await
                            .expect("host to device");
                        let header = round.to_le_bytes();
                        peer.am_send_device(ECHO, &header, &mut out_buf)
                            .await
                            .expect("send from the device");
                        let reply = futures_lite::future::or(async { rx.recv().await }, async {
                            sleep(Duration::from_secs(10)).await;
                            None
                        })
                        .await
                        .expect("no reply within 10 s");
                        let mut reply = reply.expect("the reply in device memory");
                        assert_eq!(reply.header(), &header[..], "reply header");
                        // Device buffer back: the reply's payload, landed by the handler.
                        let back: &mut DeviceBuffer = reply.payload();
                        let mut got = vec![0u8; len];
                        node.copy_from_device(back, &mut got)
                            .await
                            .expect("device to host");
                        assert!(got == want, "{len} B, round {round}: the echo differs");
                    }
                    let per = t0.elapsed() / rounds.max(1);
                    lines.push(format!(
                        "{len:>10} B: {rounds} round(s) checked byte for byte, {:.1} ms each \
                         (device→host→echo→host→device)",
                        per.as_secs_f64() * 1e3
                    ));
                }
                REPLIES.with(|r| r.borrow_mut().take());
                lines
            }
        })
        .expect("client node");
    out.pop().unwrap_or_default()
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    if let Some(reason) = no_gpu_reason() {
        println!("gpu_echo: no GPU here: skipped ({reason})");
        return;
    }
    let (bound_tx, bound_rx) = mpsc::channel();
    let stop = Arc::new(AtomicBool::new(false));
    let server = {
        let (tls, stop) = (args.tls.clone(), stop.clone());
        std::thread::spawn(move || serve(&tls, bound_tx, stop))
    };
    let Ok(addr) = bound_rx.recv_timeout(Duration::from_secs(30)) else {
        // The server never listened: say why (a forced CUDA mode this machine cannot run,
        // say) and fail.
        match server.join() {
            Ok(Err(e)) => eprintln!("gpu_echo: the server node did not start: {e}"),
            _ => eprintln!("gpu_echo: the server node did not start"),
        }
        std::process::exit(1);
    };
    let lines = client(&args, addr);
    stop.store(true, Ordering::Release);
    server.join().expect("server thread").expect("server node");
    for l in lines {
        println!("{l}");
    }
    println!("gpu_echo: every echo matched (staged through host memory)");
}
