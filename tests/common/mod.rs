//! Set-up the root crate's test binaries share: the `shardcx` command, a `shardcx node` child
//! process, and in-process node builders. Each test file includes it with `mod common;`.

#![allow(dead_code)] // Each test binary uses the parts it needs.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use shardcx::shards::Placement;

mod stacks;
use shardcx::{Node, NodeBuilder, NodeId};
pub(crate) use stacks::stacks;

/// The `shardcx` command built with these tests.
pub(crate) fn shardcx() -> Command {
    Command::new(env!("CARGO_BIN_EXE_shardcx"))
}

/// A node of two shards on tcp, unpinned, with 1 MiB of io memory per shard (two such nodes fit
/// the 8 MiB locked-memory limit), `id` and key `key`.
pub(crate) fn two_shard_node(id: NodeId, key: &[u8]) -> NodeBuilder {
    Node::builder()
        .shards(2)
        .placement(Placement::Unpinned)
        .transports("tcp")
        .io_memory(1 << 20)
        .node_id(id)
        .psk(key)
}

/// Waits at most `limit` for `child` to exit, reading its piped output meanwhile (so that a
/// chatty child cannot block on a full pipe), and kills it past the limit, failing the test
/// with `what`.
pub(crate) fn output_within(child: Child, limit: Duration, what: &str) -> std::process::Output {
    let child_pid = child.id();
    let pid = child_pid.to_string();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(limit) {
        Ok(out) => out.unwrap(),
        Err(_) => {
            eprintln!(
                "{what} did not finish within {limit:?}; its threads:\n{}",
                stacks(child_pid)
            );
            let _ = Command::new("kill").args(["-KILL", &pid]).status();
            // What it printed before it was killed: where it got to (started, connected, ran
            // the test, or hung on the way out).
            if let Ok(Ok(out)) = rx.recv_timeout(Duration::from_secs(5)) {
                eprintln!(
                    "{what}: its stdout:\n{}\nits stderr:\n{}",
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            panic!("{what} did not finish within {limit:?}");
        }
    }
}

/// How long a test waits for one run of the `shardcx` command (see [`Bounded`]).
pub(crate) const COMMAND_LIMIT: Duration = Duration::from_secs(120);

/// `Command::output` with a bound: a run of the command that outlives [`COMMAND_LIMIT`] has
/// its thread stacks printed, is killed, and fails the test (a `shardcx bench` that a test ran
/// with a wrong key once took 9 minutes to fail, with nothing to say where it waited).
pub(crate) trait Bounded {
    /// Runs the command like `output` (stdin closed, stdout and stderr captured; any other
    /// setting of them is replaced), within [`COMMAND_LIMIT`].
    fn output_bounded(&mut self) -> std::process::Output;
}

impl Bounded for Command {
    fn output_bounded(&mut self) -> std::process::Output {
        let what = format!("{:?}", self);
        // As `Command::output`: no stdin, output captured.
        let child = self
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        output_within(child, COMMAND_LIMIT, &what)
    }
}

/// A loopback address whose port lies outside the kernel's ephemeral range, free when this
/// returns. A test that restarts a server on the same port needs one: a port inside the range
/// can be taken in the meantime by any outgoing connection's local port, including a
/// reconnecting client's own connection to that very port (TCP's self-connect), which holds
/// it (a CI run failed with "Address already in use" restarting a server on port 33755).
pub(crate) fn port_outside_ephemeral_range() -> SocketAddr {
    let range = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .unwrap_or_else(|_| "32768 60999".into());
    let mut bounds = range.split_whitespace().map(|n| n.parse::<u16>().unwrap());
    let (lo, hi) = (bounds.next().unwrap(), bounds.next().unwrap());
    // Below the range first (the usual case: 32768..60999 leaves 1024..32767), then above.
    let candidates = (1024..lo).chain(hi.saturating_add(1)..=u16::MAX);
    let candidates: Vec<u16> = candidates.collect();
    assert!(!candidates.is_empty(), "no port outside {lo}..={hi}");
    // Start at a spot that differs from process to process, so that test binaries running at
    // once seldom try the same ports, and from call to call, so that two calls in a row (the
    // first port released already) get two ports.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let start = (std::process::id() as usize * 7919 + call * 101) % candidates.len();
    for i in 0..candidates.len().min(4096) {
        let port = candidates[(start + i) % candidates.len()];
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return l.local_addr().unwrap();
        }
    }
    panic!("no free port outside the ephemeral range {lo}..={hi}");
}

/// Runs `f` on another thread; fails the test if it takes longer than `limit`, with the
/// stacks of this process's threads on stderr (see [`stacks`]).
pub(crate) fn within<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        // `f` panicked (its message is above): no hang to show stacks of.
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("the test's thread panicked"),
        Err(mpsc::RecvTimeoutError::Timeout) => {
            eprintln!(
                "still running after {limit:?}; the threads of this test process:\n{}",
                stacks(std::process::id())
            );
            panic!("still running after {limit:?}");
        }
    }
}

/// One test at a time in this binary (two nodes of two shards each fill the locked-memory
/// limit).
pub(crate) fn serial() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Waits (at most `limit`, looking every 50 ms) until `ok` holds; returns whether it did.
pub(crate) fn wait_for(limit: Duration, mut ok: impl FnMut() -> bool) -> bool {
    let until = Instant::now() + limit;
    loop {
        if ok() {
            return true;
        }
        if Instant::now() > until {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Longest wait for a line from a node process.
pub(crate) const LINE_LIMIT: Duration = Duration::from_secs(30);

/// A `shardcx node --listen 127.0.0.1:0 --transport tcp --stop-on-stdin-eof` child process:
/// its address (and metrics address, if it serves them) read from its first lines, its
/// standard error kept when asked for. Continued (if stopped) and killed when dropped.
pub(crate) struct NodeProc {
    pub(crate) child: Child,
    pub(crate) addr: SocketAddr,
    pub(crate) metrics: Option<SocketAddr>,
    stdin: Option<ChildStdin>,
    stderr: Option<(Arc<Mutex<String>>, std::thread::JoinHandle<()>)>,
}

impl NodeProc {
    /// Starts a node with `shards` shards and the extra arguments `extra`; waits (at most
    /// [`LINE_LIMIT`]) for its address, its shard count, and its metrics address when
    /// `--metrics` is among `extra`. `keep_stderr`: collect its standard error (else it goes
    /// nowhere).
    pub(crate) fn start(shards: usize, extra: &[&str], keep_stderr: bool) -> NodeProc {
        let mut child = shardcx()
            .args(["node", "--listen", "127.0.0.1:0", "--transport", "tcp"])
            .args(["--shards", &shards.to_string(), "--stop-on-stdin-eof"])
            .args(extra)
            .env_remove("RUST_LOG")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(if keep_stderr {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        let stderr = child.stderr.take().map(|e| {
            let log = Arc::new(Mutex::new(String::new()));
            let sink = log.clone();
            let reader = std::thread::spawn(move || {
                for line in BufReader::new(e).lines().map_while(Result::ok) {
                    let mut l = sink.lock().unwrap();
                    l.push_str(&line);
                    l.push('\n');
                }
            });
            (log, reader)
        });
        let stdin = child.stdin.take();
        let mut node = NodeProc {
            child,
            addr: SocketAddr::from(([127, 0, 0, 1], 0)),
            metrics: None,
            stdin,
            stderr,
        };
        let next = || {
            lines
                .recv_timeout(LINE_LIMIT)
                .unwrap_or_else(|e| panic!("no line from the node within {LINE_LIMIT:?}: {e}"))
        };
        let first = next();
        node.addr = first
            .strip_prefix("listening ")
            .and_then(|a| a.parse().ok())
            .unwrap_or_else(|| panic!("not `listening ADDR`: {first}"));
        assert_eq!(next(), format!("shards {shards}"));
        if extra.contains(&"--metrics") {
            let line = next();
            node.metrics = Some(
                line.strip_prefix("metrics ")
                    .and_then(|a| a.parse().ok())
                    .unwrap_or_else(|| panic!("not `metrics ADDR`: {line}")),
            );
        }
        node
    }

    pub(crate) fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).unwrap()
    }

    /// Sends signal `sig` (`-STOP`, `-CONT`, `-INT`, ...) with `kill`.
    pub(crate) fn signal(&self, sig: &str) {
        let st = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(st.success(), "kill {sig}");
    }

    /// What the node has written to its standard error so far (if kept).
    pub(crate) fn log(&self) -> String {
        self.stderr
            .as_ref()
            .map(|(l, _)| l.lock().unwrap().clone())
            .unwrap_or_default()
    }

    /// Waits at most `limit` for `ok(log)`; whether it came.
    pub(crate) fn wait_for_log(&self, limit: Duration, ok: impl Fn(&str) -> bool) -> bool {
        wait_for(limit, || ok(&self.log()))
    }

    /// Closes its standard input (it then shuts down) and waits at most `limit` for it to
    /// exit; its exit status, and its whole standard error (if kept).
    pub(crate) fn stop(mut self, limit: Duration) -> (std::process::ExitStatus, String) {
        drop(self.stdin.take());
        let until = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < until,
                "the node did not stop within {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        };
        let log = self
            .stderr
            .take()
            .map(|(log, reader)| {
                reader.join().unwrap();
                let text = log.lock().unwrap().clone();
                text
            })
            .unwrap_or_default();
        (status, log)
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            // A stopped node must run again to die.
            let _ = Command::new("kill")
                .args(["-CONT", &self.child.id().to_string()])
                .stderr(Stdio::null())
                .status();
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}
