//! Active-message ping-pong between two workers on two pinned threads, over shared memory and
//! TCP on loopback, with hdrhistogram percentiles of the round-trip time.
//!
//! ```text
//! cargo run --release -p shardcx-ucx --example am_pingpong -- [--tls sm,tcp] [--sizes 8,4096,1048576] [--iters N]
//! ```
//!
//! Each thread owns its own UCX context and worker (as shardcx's shards do); the workers
//! connect by worker address. The client sends a message, the server echoes it back, and the
//! client records the round trip. Both sides run the hot path of a shard, with nothing else in
//! between, as `ucx_perftest` runs UCX's: an inline handler ([`Worker::set_am_handler_inline`])
//! reads a short message where the transport put it, during `progress` (no UCX descriptor, no
//! copy), and the server answers from inside it with [`Endpoint::am_send_now`] (no request, no
//! callback, no allocation). Messages UCX delivers in a descriptor or by rendezvous are kept
//! and handled after `progress` returns; messages too long for UCX's short path go the owned
//! way ([`Endpoint::am_send`]); rendezvous data lands in a buffer the receiving side chose.
//!
//! `--recorded` runs the other way of the UCX layer instead: handlers with persistent data
//! ([`Worker::set_am_handler_persistent`]) only record each message (UCX copies a short one
//! into a descriptor of its pool), and the loop handles it after `progress` returns.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use hdrhistogram::Histogram;
use shardcx_ucx::{
    block_on_with, AmIncoming, AmPayload, AmProto, Config, Context, Endpoint, EpOptions, Error,
    ErrorMode, Features, Worker, WorkerAddress,
};

const PING: u16 = 1;
const STOP: u16 = 2;

/// What the handlers left for the loop: messages kept to handle after `progress` returns, and
/// the number of short messages handled inline (each by `on_bytes`).
#[derive(Default)]
struct Inbox {
    kept: RefCell<VecDeque<(u16, AmPayload)>>,
    inline: std::cell::Cell<u64>,
}

/// Installs the handler of `id`: inline (short messages go to `on_bytes` during `progress`,
/// which returns false to have one kept instead), or recording every message (`recorded`).
fn install(
    worker: &Worker,
    inbox: &Rc<Inbox>,
    id: u16,
    recorded: bool,
    on_bytes: impl Fn(&[u8]) -> bool + 'static,
) {
    let q = inbox.clone();
    if recorded {
        worker
            .set_am_handler_persistent(id, move |_hdr, payload| {
                q.kept.borrow_mut().push_back((id, payload))
            })
            .expect("install handler");
        return;
    }
    worker
        .set_am_handler_inline(id, move |_hdr, incoming| {
            if let AmIncoming::Bytes(b) = incoming {
                if on_bytes(b) {
                    q.inline.set(q.inline.get() + 1);
                    return;
                }
            }
            q.kept.borrow_mut().push_back((id, incoming.keep()));
        })
        .expect("install handler");
}

/// What [`next`] found.
enum Next {
    /// Short messages were handled inline.
    Inline,
    /// A kept message.
    Kept(u16, AmPayload),
}

/// Progress until a message is kept or handled inline.
fn next(worker: &Worker, inbox: &Inbox) -> Next {
    loop {
        if let Some((id, p)) = inbox.kept.borrow_mut().pop_front() {
            return Next::Kept(id, p);
        }
        if inbox.inline.replace(0) > 0 {
            return Next::Inline;
        }
        worker.progress();
    }
}

/// Sends `payload` on `ep`: inline when UCX takes it at once, else from an owned copy.
fn send(worker: &Worker, ep: &Endpoint, id: u16, payload: &[u8]) {
    match ep.am_send_now(id, b"", payload) {
        Ok(()) => {}
        Err(Error::NoResource) => {
            let (res, _) = block_on_with(
                &[worker],
                spin(),
                ep.am_send(id, b"", payload.to_vec(), AmProto::Auto),
            );
            res.expect("send");
        }
        Err(e) => panic!("send: {e}"),
    }
}

/// Calls `f` with the bytes of `payload`: eager data in place, rendezvous data pulled into
/// `buf` (resized to fit).
fn with_bytes<R>(
    worker: &Worker,
    payload: AmPayload,
    buf: &mut Vec<u8>,
    f: impl FnOnce(&[u8]) -> R,
) -> R {
    match payload {
        AmPayload::Data(d) => f(d.as_slice()),
        AmPayload::Rendezvous(r) => {
            let mut b = std::mem::take(buf);
            b.resize(r.len(), 0);
            let (res, b) = block_on_with(&[worker], spin(), worker.am_recv_data(r, b));
            res.expect("rendezvous receive");
            *buf = b;
            f(buf)
        }
    }
}

/// The spin window of the slow paths' driver: `SHARDCX_SPIN_US` microseconds, or the driver's
/// default.
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
    recorded: bool,
    to_client: mpsc::Sender<WorkerAddress>,
    from_client: mpsc::Receiver<WorkerAddress>,
) {
    pin(1);
    let (_ctx, worker) = setup(&tls);
    to_client
        .send(worker.address().expect("address"))
        .expect("send address");
    let peer = from_client.recv().expect("client address");
    let ep = Rc::new(Endpoint::connect_to_worker(&worker, &peer, opts(&tls)).expect("connect"));
    let inbox = Rc::new(Inbox::default());
    // The echo of a short message is sent from inside the handler when UCX takes it at once.
    let echo = ep.clone();
    install(&worker, &inbox, PING, recorded, move |b| {
        echo.am_send_now(PING, b"", b).is_ok()
    });
    install(&worker, &inbox, STOP, recorded, |_| false);
    let mut buf = Vec::new();
    loop {
        let Next::Kept(id, payload) = next(&worker, &inbox) else {
            continue;
        };
        if id == STOP {
            break;
        }
        with_bytes(&worker, payload, &mut buf, |b| send(&worker, &ep, PING, b));
    }
    block_on_with(&[&worker], spin(), ep.flush()).expect("flush");
}

struct Row {
    size: usize,
    iters: usize,
    hist: Histogram<u64>,
    elapsed: Duration,
}

fn client(tls: &str, sizes: &[usize], iters: usize, recorded: bool) -> Vec<Row> {
    let (to_server, from_client) = mpsc::channel();
    let (to_client, from_server) = mpsc::channel();
    let tls_s = tls.to_string();
    let handle = std::thread::spawn(move || server(tls_s, recorded, to_client, from_client));
    pin(0);
    let (_ctx, worker) = setup(tls);
    let peer = from_server.recv().expect("server address");
    to_server
        .send(worker.address().expect("address"))
        .expect("send address");
    let ep = Endpoint::connect_to_worker(&worker, &peer, opts(tls)).expect("connect");
    let inbox = Rc::new(Inbox::default());
    // The echo's length, and whether its content is right, read inline (the content only
    // while `check` is set: once per size, as below).
    let echoed: Rc<RefCell<(usize, bool)>> = Rc::default();
    let check = Rc::new(std::cell::Cell::new(true));
    let (seen, checking) = (echoed.clone(), check.clone());
    install(&worker, &inbox, PING, recorded, move |b| {
        *seen.borrow_mut() = (b.len(), !checking.get() || b.iter().all(|&x| x == 0xA5));
        true
    });
    let mut rows = Vec::new();
    let mut back = Vec::new();
    for &size in sizes {
        let n = if size >= 1 << 20 {
            (iters / 20).max(20)
        } else {
            iters
        };
        let warmup = (n / 10).max(10);
        let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3).expect("histogram");
        let out = vec![0xA5u8; size];
        let mut started = Instant::now();
        let mut checked = false;
        // One clock reading per round trip, as `ucx_perftest` takes: a round trip is the time
        // from the end of the previous one (the loop's own few instructions included).
        let mut t0 = Instant::now();
        for i in 0..warmup + n {
            if i == warmup {
                started = t0;
            }
            check.set(!checked);
            send(&worker, &ep, PING, &out);
            let ok = match next(&worker, &inbox) {
                Next::Kept(_, payload) => with_bytes(&worker, payload, &mut back, |b| {
                    // Checked once per size (and the length every time): the check is not
                    // timed work of UCX.
                    b.len() == size && (checked || b.iter().all(|&x| x == 0xA5))
                }),
                Next::Inline => {
                    let (len, content) = *echoed.borrow();
                    len == size && content
                }
            };
            let t1 = Instant::now();
            if i >= warmup {
                hist.record((t1 - t0).as_nanos() as u64).expect("record");
            }
            t0 = t1;
            assert!(ok, "echo of {size} bytes came back wrong");
            checked = true;
        }
        rows.push(Row {
            size,
            iters: n,
            hist,
            elapsed: started.elapsed(),
        });
    }
    send(&worker, &ep, STOP, b"");
    block_on_with(&[&worker], spin(), ep.flush()).expect("flush");
    handle.join().expect("server thread");
    rows
}

/// Active-message ping-pong between two workers on two pinned threads.
#[derive(clap::Parser)]
#[command(name = "am_pingpong")]
struct Args {
    /// UCX transports, each run in turn (sm, tcp, or any UCX_TLS value).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "sm,tcp"
    )]
    tls: Vec<String>,
    /// Message sizes in bytes.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "8,64,4096,65536,1048576,16777216"
    )]
    sizes: Vec<usize>,
    /// Round trips per size.
    #[arg(long, value_name = "N", default_value_t = 20_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    iters: u64,
    /// Record every message with persistent data and handle it after `progress` returns,
    /// instead of reading short ones inline.
    #[arg(long)]
    recorded: bool,
}

fn main() {
    CORES.get_or_init(|| core_affinity::get_core_ids().unwrap_or_default());
    let a = <Args as clap::Parser>::parse();
    let (tls_list, sizes, iters) = (
        a.tls,
        a.sizes,
        usize::try_from(a.iters).unwrap_or(usize::MAX),
    );
    println!("{}", shardcx_ucx::version());
    println!(
        "{:<5} {:>10} {:>8} {:>10} {:>10} {:>10} {:>10} {:>12} {:>10}",
        "tls", "size", "iters", "p50 us", "p99 us", "p99.9 us", "max us", "round/s", "MB/s"
    );
    for tls in &tls_list {
        for r in client(tls, &sizes, iters, a.recorded) {
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
