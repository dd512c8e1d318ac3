//! Active-message ping-pong between two workers on two pinned threads, over shared memory and
//! TCP on loopback, with hdrhistogram percentiles of the round-trip time.
//!
//! ```text
//! cargo run --release -p shardcx-ucx --example am_pingpong -- [--tls sm,tcp] [--sizes 8,4096,1048576] [--iters N]
//! ```
//!
//! Each thread owns its own UCX context and worker (as shardcx's shards do); the workers
//! connect by worker address. The client sends a message, the server echoes it back, and the
//! client records the round trip. Large messages go by rendezvous and land in a buffer the
//! receiving handler chose.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::rc::Rc;
use std::sync::mpsc;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardcx_ucx::{
    block_on_with, AmPayload, AmProto, Config, Context, Endpoint, EpOptions, ErrorMode, Features,
    Worker, WorkerAddress,
};

const PING: u16 = 1;
const STOP: u16 = 2;

#[derive(Default)]
struct Inbox {
    queue: RefCell<VecDeque<(u16, AmPayload)>>,
    waker: RefCell<Option<Waker>>,
}

impl Inbox {
    fn install(self: &Rc<Self>, worker: &Worker, id: u16) {
        let me = self.clone();
        worker
            .set_am_handler(id, move |_hdr, payload| {
                me.queue.borrow_mut().push_back((id, payload));
                if let Some(w) = me.waker.borrow_mut().take() {
                    w.wake();
                }
            })
            .expect("install handler");
    }

    async fn next(&self) -> (u16, AmPayload) {
        poll_fn(|cx| match self.queue.borrow_mut().pop_front() {
            Some(m) => Poll::Ready(m),
            None => {
                *self.waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await
    }
}

/// Receive one payload into `buf` (resized to fit), eager or rendezvous.
async fn take(worker: &Worker, payload: AmPayload, mut buf: Vec<u8>) -> Vec<u8> {
    match payload {
        AmPayload::Data(d) => {
            buf.clear();
            buf.extend_from_slice(d.as_slice());
            buf
        }
        AmPayload::Rendezvous(r) => {
            buf.resize(r.len(), 0);
            let (res, buf) = worker.am_recv_data(r, buf).await;
            res.expect("rendezvous receive");
            buf
        }
    }
}

/// The driver's spin window: `SHARDCX_SPIN_US` microseconds, or the driver's default.
fn spin() -> Duration {
    std::env::var("SHARDCX_SPIN_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .map(Duration::from_micros)
        .unwrap_or(shardcx_ucx::DEFAULT_SPIN)
}

fn setup(tls: &str) -> (Context, Worker) {
    let mut cfg = Config::from_env().expect("UCX config");
    cfg.set("TLS", tls).expect("UCX_TLS");
    let mut features = Features::messaging();
    features.wakeup = std::env::var_os("NO_WAKEUP").is_none();
    let ctx = Context::new(&cfg, features).expect("UCX context");
    let worker = Worker::new(&ctx).expect("UCX worker");
    (ctx, worker)
}

/// The cores this process may use, read once before any thread is pinned:
/// `core_affinity::get_core_ids` lists only the calling thread's CPUs, so after the main thread
/// pinned itself for the first transport, a later run would see one core and put both sides on
/// it (two spinning threads on one core: a round trip of two spin windows, 2 ms).
static CORES: std::sync::OnceLock<Vec<core_affinity::CoreId>> = std::sync::OnceLock::new();

fn pin(core: usize) {
    let cores = CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default());
    if let Some(id) = cores.get(core % cores.len().max(1)) {
        core_affinity::set_for_current(*id);
    }
}

fn opts(tls: &str) -> EpOptions {
    // UCX 1.12's shared-memory transports cannot detect peer failure.
    EpOptions {
        error_mode: if tls.contains("tcp") {
            ErrorMode::Peer
        } else {
            ErrorMode::None
        },
    }
}

fn server(
    tls: String,
    to_client: mpsc::Sender<WorkerAddress>,
    from_client: mpsc::Receiver<WorkerAddress>,
) {
    pin(1);
    let (_ctx, worker) = setup(&tls);
    to_client
        .send(worker.address().expect("address"))
        .expect("send address");
    let peer = from_client.recv().expect("client address");
    let ep = Endpoint::connect_to_worker(&worker, &peer, opts(&tls)).expect("connect");
    let inbox = Rc::new(Inbox::default());
    inbox.install(&worker, PING);
    inbox.install(&worker, STOP);
    block_on_with(&[&worker], spin(), async {
        let mut buf = Vec::new();
        loop {
            let (id, payload) = inbox.next().await;
            if id == STOP {
                break;
            }
            buf = take(&worker, payload, buf).await;
            let (res, back) = ep.am_send(PING, b"", buf, AmProto::Auto).await;
            res.expect("echo");
            buf = back;
        }
        ep.flush().await.expect("flush");
    });
}

struct Row {
    size: usize,
    iters: usize,
    hist: Histogram<u64>,
    elapsed: Duration,
}

fn client(tls: &str, sizes: &[usize], iters: usize) -> Vec<Row> {
    let (to_server, from_client) = mpsc::channel();
    let (to_client, from_server) = mpsc::channel();
    let tls_s = tls.to_string();
    let handle = std::thread::spawn(move || server(tls_s, to_client, from_client));
    pin(0);
    let (_ctx, worker) = setup(tls);
    let peer = from_server.recv().expect("server address");
    to_server
        .send(worker.address().expect("address"))
        .expect("send address");
    let ep = Endpoint::connect_to_worker(&worker, &peer, opts(tls)).expect("connect");
    let inbox = Rc::new(Inbox::default());
    inbox.install(&worker, PING);
    let rows = block_on_with(&[&worker], spin(), async {
        let mut rows = Vec::new();
        for &size in sizes {
            let n = if size >= 1 << 20 {
                (iters / 20).max(20)
            } else {
                iters
            };
            let warmup = (n / 10).max(10);
            let mut hist =
                Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
            let mut out = vec![0xA5u8; size];
            let mut back = Vec::with_capacity(size);
            let mut started = Instant::now();
            for i in 0..warmup + n {
                if i == warmup {
                    started = Instant::now();
                }
                let t0 = Instant::now();
                let (res, sent) = ep.am_send(PING, b"", out, AmProto::Auto).await;
                res.expect("ping");
                out = sent;
                let (_, payload) = inbox.next().await;
                back = take(&worker, payload, back).await;
                if i >= warmup {
                    hist.record(t0.elapsed().as_nanos() as u64).expect("record");
                }
            }
            assert_eq!(back.len(), size, "echo length");
            assert!(back.iter().all(|&b| b == 0xA5), "echo content");
            rows.push(Row {
                size,
                iters: n,
                hist,
                elapsed: started.elapsed(),
            });
        }
        let (res, _) = ep.am_send(STOP, b"", Vec::new(), AmProto::Auto).await;
        res.expect("stop");
        ep.flush().await.expect("flush");
        rows
    });
    handle.join().expect("server thread");
    rows
}

fn main() {
    CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default());
    let mut tls_list = vec!["sm".to_string(), "tcp".to_string()];
    let mut sizes = vec![8usize, 64, 4096, 65536, 1 << 20, 16 << 20];
    let mut iters = 20_000usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_default();
        match a.as_str() {
            "--tls" => tls_list = v.split(',').map(str::to_string).collect(),
            "--sizes" => sizes = v.split(',').filter_map(|s| s.parse().ok()).collect(),
            "--iters" => iters = v.parse().unwrap_or(iters),
            _ => {
                eprintln!("usage: am_pingpong [--tls sm,tcp] [--sizes 8,4096] [--iters N]");
                std::process::exit(2);
            }
        }
    }
    println!("{}", shardcx_ucx::version());
    println!(
        "{:<5} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "tls", "size", "iters", "p50 us", "p99 us", "p99.9 us", "max us", "round/s", "MB/s"
    );
    for tls in &tls_list {
        for r in client(tls, &sizes, iters) {
            let us = |q: f64| r.hist.value_at_quantile(q) as f64 / 1000.0;
            let rate = r.iters as f64 / r.elapsed.as_secs_f64();
            // Bytes moved per second, both directions counted.
            let mbs = rate * 2.0 * r.size as f64 / 1e6;
            println!(
                "{:<5} {:>10} {:>8} {:>10.2} {:>10.2} {:>10.2} {:>10.2} {:>12.0} {:>10.1}",
                tls,
                r.size,
                r.iters,
                us(0.5),
                us(0.99),
                us(0.999),
                r.hist.max() as f64 / 1000.0,
                rate,
                mbs
            );
        }
    }
    println!("latency columns are round-trip times (ucx_perftest prints half a round trip)");
}
