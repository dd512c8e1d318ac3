//! Two workers in one process, connected both ways, over a chosen transport.
#![allow(dead_code)]

use shardcx_ucx::{block_on, Config, Context, Endpoint, EpOptions, ErrorMode, Features, Worker};

/// The transports each test runs over: shared memory and TCP on loopback, or only the one
/// named by `SHARDCX_TEST_TLS`.
pub(crate) fn transports() -> Vec<&'static str> {
    match std::env::var("SHARDCX_TEST_TLS").as_deref() {
        Ok("sm") => vec!["sm"],
        Ok("tcp") => vec!["tcp"],
        _ => vec!["sm", "tcp"],
    }
}

pub(crate) struct Pair {
    pub(crate) a_context: Context,
    pub(crate) b_context: Context,
    pub(crate) a: Worker,
    pub(crate) b: Worker,
    /// Endpoint on `a` to `b`.
    pub(crate) ab: Endpoint,
    /// Endpoint on `b` to `a`.
    pub(crate) ba: Endpoint,
}

pub(crate) fn context(tls: &str, features: Features) -> Context {
    let mut cfg = Config::from_env().expect("config");
    cfg.set("TLS", tls).expect("set TLS");
    Context::new(&cfg, features).expect("context")
}

pub(crate) fn pair_with(tls: &str, features: Features) -> Pair {
    let ca = context(tls, features);
    let cb = context(tls, features);
    let a = Worker::new(&ca).expect("worker a");
    let b = Worker::new(&cb).expect("worker b");
    let opts = ep_options(tls);
    let ab =
        Endpoint::connect_to_worker(&a, &b.address().expect("addr b"), opts).expect("connect a->b");
    let ba =
        Endpoint::connect_to_worker(&b, &a.address().expect("addr a"), opts).expect("connect b->a");
    Pair {
        a_context: ca,
        b_context: cb,
        a,
        b,
        ab,
        ba,
    }
}

/// UCX 1.12's shared-memory transports (posix, sysv) have no peer-failure handling, so an
/// endpoint asking for it cannot use them ("no peer failure handler"): shared-memory pairs use
/// error mode NONE.
pub(crate) fn ep_options(tls: &str) -> EpOptions {
    EpOptions {
        error_mode: if tls == "sm" {
            ErrorMode::None
        } else {
            ErrorMode::Peer
        },
    }
}

pub(crate) fn pair(tls: &str) -> Pair {
    pair_with(tls, Features::all())
}

impl Pair {
    pub(crate) fn run<F: std::future::Future>(&self, fut: F) -> F::Output {
        bounded(&[&self.a, &self.b], fut)
    }

    /// Progress both workers until `done` holds (or a million rounds have passed).
    pub(crate) fn spin_until(&self, mut done: impl FnMut() -> bool) {
        for _ in 0..1_000_000 {
            if done() {
                return;
            }
            self.a.progress();
            self.b.progress();
        }
    }

    /// Progress both workers for a while (lets background completions happen).
    pub(crate) fn spin(&self, rounds: usize) {
        for _ in 0..rounds {
            self.a.progress();
            self.b.progress();
        }
    }
}

/// Longest any single test step may take before the test fails instead of hanging.
pub(crate) const STEP_DEADLINE: std::time::Duration = std::time::Duration::from_secs(60);

/// `block_on`, failing the test if `fut` is not done within [`STEP_DEADLINE`] (the driver
/// re-polls at least every few milliseconds, so the check runs even when nothing happens).
pub(crate) fn bounded<F: std::future::Future>(workers: &[&Worker], fut: F) -> F::Output {
    let started = std::time::Instant::now();
    let mut fut = std::pin::pin!(fut);
    block_on(
        workers,
        std::future::poll_fn(|cx| match fut.as_mut().poll(cx) {
            std::task::Poll::Ready(v) => std::task::Poll::Ready(v),
            std::task::Poll::Pending => {
                assert!(
                    started.elapsed() < STEP_DEADLINE,
                    "test step exceeded {STEP_DEADLINE:?}"
                );
                std::task::Poll::Pending
            }
        }),
    )
}

/// A deterministic byte pattern for content checks.
pub(crate) fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}
