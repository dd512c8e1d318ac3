//! The reliability suite of `../shared/RELIABILITY.md` (issue 15), across processes in network
//! namespaces made here: `h0` runs the journaling server (`examples/fault_peer serve`), `h1`
//! and `h2` run load clients (`fault_peer load`) and the suite's other clients (`hostile`,
//! `deadlines`, `attack`, `probe`, `rma-attack`, `rma-load`), all on a bridge in a namespace of
//! its own; faults are injected with `kill -STOP`/`-CONT`, `kill -9`, nftables rules (drop,
//! random loss) and a `tbf` qdisc inside `h0`.
//!
//! After each test the oracles are checked: every acknowledged call is in the server's journal,
//! no call is journaled twice, every journaled payload's CRC matched, no call ended later than
//! its deadline + 250 ms, no child wrote `panicked at`, `Assertion`, `was not returned to
//! mpool` or `destroying inuse` on its stderr, and once the clients are gone the server's gauges
//! are back to baseline (no rail, no pending request, no forward in flight) and its fds within
//! 2 of what it had before the test. The figures (detection and recovery times, fds) are
//! printed, and each test prints one `TABLE|` row (`scripts/faults` gathers them).
//!
//! Random choices (fault times, garbage, payload lengths, deadlines) come from one seed,
//! printed by each test: `SHARDCX_FAULT_SEED=N` (`scripts/faults --seed N`) replays it.
//! `SHARDCX_FAULT_KEEP=1` keeps each lab's files (journal, acknowledgements, every child's
//! stderr) in `/tmp/shardcx-lab-*` for a look afterwards.
//!
//! The lab needs root (network namespaces, nftables): without it each test prints
//! `SKIPPED (R0 ...)` with the reason and passes, counted in its row. The suite runs in release
//! only (once in CI, in `scripts/test`'s release run), one test at a time (a 2-core machine).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Display;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod common;
use common::{serial, wait_for};

/// The example binary (built by `cargo test` for the examples' sake: see `scripts/test`).
fn fault_peer() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/reliability-<hash> -> target/<profile>/examples/fault_peer
    exe.parent()
        .and_then(Path::parent)
        .map(|p| p.join("examples").join("fault_peer"))
        .unwrap()
}

/// Runs a command; its stdout, or why it failed.
fn output(cmd: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("{}: {e}", cmd.join(" ")))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    } else {
        Err(format!(
            "{}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

fn run(cmd: &[&str]) -> Result<(), String> {
    output(cmd).map(|_| ())
}

/// The seed of this run: `SHARDCX_FAULT_SEED`, else drawn from the clock.
fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        std::env::var("SHARDCX_FAULT_SEED")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(1, |d| d.subsec_nanos() as u64 % 1_000_000)
            })
    })
}

/// The seed's draws (xorshift64*), one stream per test.
struct Rng(u64);

impl Rng {
    fn new(test: &str) -> Rng {
        let salt = test
            .bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31) + u64::from(b));
        Rng((seed() ^ salt.wrapping_mul(0x9E37_79B9_7F4A_7C15)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A duration in `[lo, hi)` milliseconds.
    fn ms(&mut self, lo: u64, hi: u64) -> Duration {
        Duration::from_millis(lo + self.next() % (hi - lo))
    }
}

/// One row of the suite's table, printed when the test ends: held, FAILED (the test panicked)
/// or skipped, with the figures gathered.
struct Row {
    id: &'static str,
    what: &'static str,
    figures: Vec<String>,
    skipped: Option<String>,
}

impl Row {
    fn new(id: &'static str, what: &'static str) -> Row {
        eprintln!(
            "{id}: seed {} (replay: scripts/faults --seed {} --only {id})",
            seed(),
            seed()
        );
        Row {
            id,
            what,
            figures: Vec::new(),
            skipped: None,
        }
    }

    /// Adds a figure to the row (and prints it now).
    fn fig(&mut self, f: impl Display) {
        eprintln!("{}: {f}", self.id);
        self.figures.push(f.to_string());
    }
}

impl Drop for Row {
    fn drop(&mut self) {
        let verdict = match (&self.skipped, std::thread::panicking()) {
            (Some(why), _) => format!("skipped: {why}"),
            (None, true) => "FAILED".to_owned(),
            (None, false) => "held".to_owned(),
        };
        eprintln!(
            "TABLE| {} | {} | {} | {} | seed {}",
            self.id,
            verdict,
            self.what,
            self.figures.join("; "),
            seed()
        );
    }
}

/// R0, preflight: what the lab needs, or why it cannot run here.
fn preflight() -> Result<(), String> {
    if cfg!(debug_assertions) {
        return Err("the suite runs once, in release (scripts/test, scripts/faults)".into());
    }
    if !fault_peer().is_file() {
        return Err(format!(
            "{} is not built (cargo build --examples)",
            fault_peer().display()
        ));
    }
    let probe = format!("sxpre{}", std::process::id());
    run(&["ip", "netns", "add", &probe]).map_err(|e| format!("no network namespaces: {e}"))?;
    let nft = run(&["ip", "netns", "exec", &probe, "nft", "list", "ruleset"]);
    let _ = run(&["ip", "netns", "del", &probe]);
    nft.map_err(|e| format!("no nftables: {e}"))
}

/// Whether a `tbf` qdisc can be set here (the bandwidth cap of R5).
fn has_tbf() -> Result<(), String> {
    let probe = format!("sxtbf{}", std::process::id());
    run(&["ip", "netns", "add", &probe]).map_err(|e| format!("no network namespaces: {e}"))?;
    let r = run(&[
        "ip", "netns", "exec", &probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate",
        "8mbit", "burst", "32kbit", "latency", "400ms",
    ]);
    let _ = run(&["ip", "netns", "del", &probe]);
    r.map_err(|e| format!("no tbf qdisc: {e}"))
}

/// Skips the test (printing why, in its row) when the preflight fails.
macro_rules! require_lab {
    ($row:expr) => {
        if let Err(why) = preflight() {
            eprintln!("SKIPPED ({} preflight, R0): {why}", $row.id);
            $row.skipped = Some(why);
            return;
        }
    };
}

/// Three hosts on a bridge, each a namespace; removed on drop with every process started here.
struct Lab {
    tag: String,
    dir: PathBuf,
    children: Vec<Child>,
    /// The current server's index in `children`.
    server: Option<usize>,
    /// Servers started so far (each has its own stderr file).
    starts: usize,
    /// The server's fds and gauges before the test's load.
    baseline: Option<Baseline>,
}

/// A server's resources at rest.
#[derive(Clone, Copy, Debug)]
struct Baseline {
    fds: usize,
    rss_kib: u64,
}

const PORT: u16 = 7100;
/// Where the server serves its metrics, inside `h0`.
const METRICS: &str = "127.0.0.1:9100";
/// Strings that must not appear on any child's stderr (oracle 6).
const BAD_STDERR: [&str; 4] = [
    "panicked at",
    "Assertion",
    "was not returned to mpool",
    "destroying inuse",
];

impl Lab {
    fn new() -> Lab {
        let tag = format!("{}", std::process::id() % 100_000);
        let dir = std::env::temp_dir().join(format!("shardcx-lab-{tag}"));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let lab = Lab {
            tag,
            dir,
            children: Vec::new(),
            server: None,
            starts: 0,
            baseline: None,
        };
        // Left over by a run that was killed: gone first.
        for n in ["h0", "h1", "h2", "sw"] {
            let _ = run(&["ip", "netns", "del", &lab.ns(n)]);
        }
        let sw = lab.ns("sw");
        run(&["ip", "netns", "add", &sw]).unwrap();
        run(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"]).unwrap();
        run(&["ip", "-n", &sw, "link", "set", "br0", "up"]).unwrap();
        for h in 0..3 {
            let ns = lab.ns(&format!("h{h}"));
            let (vh, vs) = (lab.veth(h), format!("vs{h}-{}", lab.tag));
            run(&["ip", "netns", "add", &ns]).unwrap();
            run(&[
                "ip", "link", "add", &vh, "type", "veth", "peer", "name", &vs,
            ])
            .unwrap();
            run(&["ip", "link", "set", &vh, "netns", &ns]).unwrap();
            run(&["ip", "link", "set", &vs, "netns", &sw]).unwrap();
            run(&["ip", "-n", &sw, "link", "set", &vs, "master", "br0", "up"]).unwrap();
            let addr = format!("{}/24", Lab::ip(h));
            run(&["ip", "-n", &ns, "addr", "add", &addr, "dev", &vh]).unwrap();
            run(&["ip", "-n", &ns, "link", "set", &vh, "up"]).unwrap();
            run(&["ip", "-n", &ns, "link", "set", "lo", "up"]).unwrap();
        }
        lab
    }

    fn ns(&self, name: &str) -> String {
        format!("sx{name}-{}", self.tag)
    }

    /// Host `h`'s end of its link.
    fn veth(&self, h: usize) -> String {
        format!("vh{h}-{}", self.tag)
    }

    fn ip(h: usize) -> String {
        format!("10.201.0.{}", h + 1)
    }

    fn server_addr() -> String {
        format!("{}:{PORT}", Lab::ip(0))
    }

    fn journal(&self) -> PathBuf {
        self.dir.join("journal")
    }

    /// Starts `fault_peer ARGS` in host `h`, its stdout piped, its stderr to `NAME.err`.
    fn spawn(&mut self, h: usize, name: &str, args: &[String]) -> usize {
        let err = std::fs::File::create(self.dir.join(format!("{name}.err"))).unwrap();
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(&format!("h{h}"))])
            .arg(fault_peer())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(err)
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    /// Starts the server in `h0` with `extra` arguments; waits for its `listening` line.
    fn start_server_with(&mut self, extra: &[&str]) -> usize {
        self.starts += 1;
        let mut args = strings(&["serve", "--listen", &Lab::server_addr(), "--journal"]);
        args.push(self.journal().display().to_string());
        args.extend(strings(&["--for", "300", "--metrics", METRICS]));
        args.extend(strings(extra));
        let i = self.spawn(0, &format!("server-{}", self.starts), &args);
        let mut lines = BufReader::new(self.children[i].stdout.take().unwrap()).lines();
        let line = lines.next().expect("the server ended").unwrap();
        assert!(line.starts_with("listening "), "{line}");
        self.server = Some(i);
        i
    }

    fn start_server(&mut self) -> usize {
        self.start_server_with(&[])
    }

    /// Starts a load client in host `h` for `secs`, logging acknowledgements to `acked-NAME`,
    /// with `extra` arguments.
    fn start_load_with(&mut self, h: usize, name: &str, secs: u64, extra: &[&str]) -> usize {
        let mut args = strings(&["load", "--connect", &Lab::server_addr(), "--acked"]);
        args.push(self.dir.join(format!("acked-{name}")).display().to_string());
        args.extend(strings(&[
            "--for",
            &secs.to_string(),
            "--src",
            &h.to_string(),
        ]));
        args.extend(strings(extra));
        self.spawn(h, name, &args)
    }

    /// Starts a load client in host `h` for `secs`, logging acknowledgements to `acked-h<h>`.
    fn start_load(&mut self, h: usize, secs: u64, deadline_ms: u64) -> usize {
        let d = deadline_ms.to_string();
        self.start_load_with(h, &format!("h{h}"), secs, &["--deadline-ms", &d])
    }

    fn pid(&self, i: usize) -> u32 {
        self.children[i].id()
    }

    fn signal(&self, i: usize, sig: &str) {
        run(&["kill", sig, &self.pid(i).to_string()]).unwrap();
    }

    /// Waits (bounded) for child `i` to exit successfully; its last stdout line as JSON.
    fn json(&mut self, i: usize, limit: Duration) -> serde_json::Value {
        let until = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.children[i].try_wait().unwrap() {
                break status;
            }
            if Instant::now() > until {
                // What it hung on, before it goes.
                eprintln!(
                    "child {i} still runs after {limit:?}; its threads:\n{}",
                    common::stacks(self.children[i].id())
                );
                let _ = self.children[i].kill();
                panic!("child {i} still runs after {limit:?}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let mut out = String::new();
        if let Some(mut o) = self.children[i].stdout.take() {
            o.read_to_string(&mut out).unwrap();
        }
        assert!(status.success(), "child {i} failed ({status}): {out}");
        let last = out.lines().last().unwrap_or_default();
        serde_json::from_str(last).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    /// Waits (bounded) for a load client's summary line.
    fn summary(&mut self, i: usize, limit: Duration) -> Summary {
        Summary(self.json(i, limit))
    }

    /// Runs nft commands in `h0` (each a string of words).
    fn nft(&self, cmds: &[String]) {
        let ns = self.ns("h0");
        for cmd in cmds {
            let mut full = vec!["ip", "netns", "exec", &ns, "nft"];
            full.extend(cmd.split(' '));
            run(&full).unwrap();
        }
    }

    /// Filter chains in a table of `h0`, input and output, each with `rule`.
    fn nft_table(&self, table: &str, rule_in: &str, rule_out: &str) {
        self.nft(&[
            format!("add table inet {table}"),
            format!("add chain inet {table} in {{ type filter hook input priority 0 ; }}"),
            format!("add chain inet {table} out {{ type filter hook output priority 0 ; }}"),
            format!("add rule inet {table} in {rule_in}"),
            format!("add rule inet {table} out {rule_out}"),
        ]);
    }

    /// Drops everything from and to host `h` at `h0` (both directions), or heals.
    fn partition(&self, h: usize, on: bool) {
        if on {
            let ip = Lab::ip(h);
            self.nft_table(
                "sxfault",
                &format!("ip saddr {ip} drop"),
                &format!("ip daddr {ip} drop"),
            );
        } else {
            self.nft(&["delete table inet sxfault".to_owned()]);
        }
    }

    /// Drops `percent` % of `h0`'s packets at random, each way (0: none).
    fn loss(&self, percent: u32) {
        let _ = run(&[
            "ip",
            "netns",
            "exec",
            &self.ns("h0"),
            "nft",
            "delete",
            "table",
            "inet",
            "sxloss",
        ]);
        if percent > 0 {
            let rule = format!("numgen random mod 100 < {percent} drop");
            self.nft_table("sxloss", &rule, &rule);
        }
    }

    /// The server's open fds.
    fn server_fds(&self) -> usize {
        fds(self.pid(self.server.unwrap()))
    }

    /// The server's resident memory.
    fn server_rss_kib(&self) -> u64 {
        rss_kib(self.pid(self.server.unwrap()))
    }

    /// The server's metrics, summed over shards: `family{label}` and `family` -> value.
    fn gauges(&self) -> HashMap<String, f64> {
        let text = output(&[
            "ip",
            "netns",
            "exec",
            &self.ns("h0"),
            fault_peer().to_str().unwrap(),
            "scrape",
            "--at",
            METRICS,
        ])
        .unwrap();
        parse_metrics(&text)
    }

    /// Records the server's resources at rest (its fds once steady), before any load.
    fn take_baseline(&mut self, row: &mut Row) {
        let pid = self.pid(self.server.unwrap());
        let fds = settled(|| fds(pid));
        // The metrics are published every 250 ms: the first scrape may come before them.
        wait_for(Duration::from_secs(3), || {
            self.gauges().contains_key("shardcx_rails")
        });
        let b = Baseline {
            fds,
            rss_kib: rss_kib(pid),
        };
        row.fig(format!(
            "server at rest: {} fds, {} MiB",
            b.fds,
            b.rss_kib >> 10
        ));
        self.baseline = Some(b);
    }

    /// Oracle 5, once every client is gone: within `limit` the server has no rail, no pending
    /// request, no forward in flight, and its fds are within 2 of the baseline.
    fn check_baseline(&self, row: &mut Row, limit: Duration) {
        let b = self.baseline.expect("no baseline taken");
        let busy = |g: &HashMap<String, f64>| {
            [
                "shardcx_rails",
                "shardcx_pending_requests",
                "shardcx_lane_in_flight",
                "shardcx_backlog_bytes",
            ]
            .iter()
            .map(|k| g.get(*k).copied().unwrap_or(0.0))
            .sum::<f64>()
        };
        let start = Instant::now();
        let back = wait_for(limit, || {
            self.server_fds() <= b.fds + 2 && busy(&self.gauges()) == 0.0
        });
        let (fds, g) = (self.server_fds(), self.gauges());
        row.fig(format!(
            "back to baseline in {} ms: fds {} -> {fds}, {} MiB",
            start.elapsed().as_millis(),
            b.fds,
            self.server_rss_kib() >> 10
        ));
        let show = |k: &str| g.get(k).copied().unwrap_or(0.0);
        assert!(
            back,
            "not back to baseline {limit:?} after the clients left: fds {} -> {fds}, rails {}, \
             pending {}, lane in flight {}",
            b.fds,
            show("shardcx_rails"),
            show("shardcx_pending_requests"),
            show("shardcx_lane_in_flight")
        );
    }

    /// R5 and R6: the most bytes a load process's rails held for the server that UCX had not
    /// completed (each bounded by `NetConfig::max_backlog_bytes`, the default here), and the
    /// server's shards' peaks (summed), as figures.
    fn check_backlog(&self, row: &mut Row, loads: &[(&str, &Summary)]) {
        let limit = shardcx::shards::NetConfig::default().max_backlog_bytes;
        let mut parts = Vec::new();
        for (who, s) in loads {
            let peak = s.0["backlog_peak_bytes"]
                .as_u64()
                .expect("the load reports backlog_peak_bytes");
            assert!(
                peak <= limit,
                "{who}: backlog of {peak} bytes, limit {limit}"
            );
            parts.push(format!("{who} {} KiB", peak >> 10));
        }
        let server = self
            .gauges()
            .get("shardcx_backlog_peak_bytes")
            .copied()
            .unwrap_or(0.0);
        row.fig(format!(
            "backlog peak per rail: {}; server {} KiB (its shards' peaks summed); limit {} MiB",
            parts.join(", "),
            server as u64 >> 10,
            limit >> 20
        ));
    }

    /// Oracles 1, 2, 4 and 6: the journal against every `acked-*` file (and `extra`
    /// acknowledged keys), CRCs, duplicates, and every child's stderr.
    fn check_oracles(&self, row: &mut Row, extra: &[(String, String, String)]) {
        let journal = std::fs::read_to_string(self.journal()).unwrap_or_default();
        let mut delivered = HashSet::new();
        for line in journal.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 4, "journal line {line:?}");
            assert_eq!(f[3], "ok", "a payload's CRC did not match: {line}");
            let key = (f[0].to_owned(), f[1].to_owned(), f[2].to_owned());
            assert!(delivered.insert(key), "delivered twice: {line}");
        }
        let mut acked = 0;
        for a in self.all_acked().iter().chain(extra) {
            acked += 1;
            assert!(
                delivered.contains(a),
                "acknowledged but not delivered: {a:?}"
            );
        }
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "err") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for bad in BAD_STDERR {
                    assert!(
                        !text.contains(bad),
                        "{bad:?} on the stderr of {}:\n{text}",
                        path.display()
                    );
                }
            }
        }
        row.fig(format!(
            "{} delivered once each, {acked} acknowledged all among them",
            delivered.len()
        ));
    }

    /// Every acknowledgement of every load client: (src, inc, seq).
    fn all_acked(&self) -> Vec<(String, String, String)> {
        let mut all = Vec::new();
        for entry in std::fs::read_dir(&self.dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if let Some(host) = name.strip_prefix("acked-") {
                all.extend(self.acked(host).into_iter().map(|a| (a.0, a.1, a.2)));
            }
        }
        all
    }

    /// Load client `name`'s acknowledgements: (src, inc, seq, ms). Only whole lines: the
    /// client may be writing one as this reads, or be stopped (SIGSTOP) in the middle of it.
    fn acked(&self, name: &str) -> Vec<(String, String, String, u64)> {
        let text =
            std::fs::read_to_string(self.dir.join(format!("acked-{name}"))).unwrap_or_default();
        whole_lines(&text)
            .map(|l| {
                let f: Vec<&str> = l.split(' ').collect();
                (
                    f[0].to_owned(),
                    f[1].to_owned(),
                    f[2].to_owned(),
                    f[3].parse().unwrap(),
                )
            })
            .collect()
    }
}

impl Drop for Lab {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for n in ["h0", "h1", "h2", "sw"] {
            let _ = run(&["ip", "netns", "del", &self.ns(n)]);
        }
        if std::thread::panicking() {
            // What the children said, for the failure's report.
            for entry in std::fs::read_dir(&self.dir).into_iter().flatten() {
                let path = entry.unwrap().path();
                if path.extension().is_some_and(|e| e == "err") {
                    let text = std::fs::read_to_string(&path).unwrap_or_default();
                    // Stall reports first, wherever they are in the log: a shard whose driver
                    // was not polled (and what its thread did meanwhile) explains a peer
                    // declared dead or a late call, and its report is logged when the stall
                    // ends, often before the last lines.
                    let stalls: Vec<&str> = text
                        .lines()
                        .filter(|l| l.contains("was not polled for"))
                        .take(10)
                        .collect();
                    if !stalls.is_empty() {
                        eprintln!("--- {} (stall reports)", path.display());
                        for l in &stalls {
                            eprintln!("{l}");
                        }
                    }
                    let tail: Vec<&str> = text.lines().rev().take(20).collect();
                    if !tail.is_empty() {
                        eprintln!("--- {} (last lines)", path.display());
                        for l in tail.iter().rev() {
                            eprintln!("{l}");
                        }
                    }
                }
            }
        }
        if std::env::var_os("SHARDCX_FAULT_KEEP").is_some() {
            eprintln!("lab files kept in {}", self.dir.display());
        } else {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The `\n`-terminated lines of `text`: a last line still being written is left out.
fn whole_lines(text: &str) -> impl Iterator<Item = &str> {
    let end = text.rfind('\n').map_or(0, |i| i + 1);
    text[..end].lines()
}

fn strings(a: &[&str]) -> Vec<String> {
    a.iter().map(|s| (*s).to_owned()).collect()
}

/// Open fds of a process (0 once it is gone).
fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

/// A process's resident memory in KiB (0 once it is gone).
fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

/// `f()` once it gave the same value twice 300 ms apart (at most 5 s).
fn settled(f: impl Fn() -> usize) -> usize {
    let until = Instant::now() + Duration::from_secs(5);
    let mut last = f();
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = f();
        if now == last || Instant::now() > until {
            return now;
        }
        last = now;
    }
}

/// Prometheus text, summed over shards: `family` and `family{label=value}` (for each label
/// other than `shard`) -> value.
fn parse_metrics(text: &str) -> HashMap<String, f64> {
    let mut m = HashMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(v) = value.parse::<f64>() else {
            continue;
        };
        let (family, labels) = series.split_once('{').unwrap_or((series, ""));
        *m.entry(family.to_owned()).or_default() += v;
        for label in labels.trim_end_matches('}').split(',') {
            if !label.is_empty() && !label.starts_with("shard=") {
                *m.entry(format!("{family}{{{}}}", label.replace('"', "")))
                    .or_default() += v;
            }
        }
    }
    m
}

/// Now, in ms of the wall clock (the load clients' times are converted with it).
fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// A load client's JSON summary.
struct Summary(serde_json::Value);

impl Summary {
    /// `at` (wall clock, ms) on the client's clock: ms from its start.
    fn rel(&self, at: u64) -> u64 {
        at.saturating_sub(self.n("start_unix_ms"))
    }

    fn n(&self, k: &str) -> u64 {
        self.0[k].as_u64().unwrap_or(0)
    }

    fn failed(&self) -> HashMap<String, u64> {
        self.0["failed"]
            .as_object()
            .map(|m| {
                m.iter()
                    .map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(0)))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Oracle 3: no call ended later than its deadline + 250 ms.
    fn assert_none_late(&self, who: &str) {
        assert_eq!(
            self.n("late"),
            0,
            "{who}: calls ended after deadline + 250 ms: {}",
            self.0
        );
    }
}

/// The first acknowledgement of load `name` at or after `ms`, in ms.
fn first_ack_after(lab: &Lab, name: &str, ms: u64) -> Option<u64> {
    lab.acked(name)
        .iter()
        .map(|a| a.3)
        .filter(|t| *t >= ms)
        .min()
}

/// The longest time in ms without an acknowledgement of load `name`, from its first until
/// `until` ms (on its clock).
fn longest_gap(lab: &Lab, name: &str, until: u64) -> u64 {
    let mut t: Vec<u64> = lab.acked(name).iter().map(|a| a.3).collect();
    t.sort_unstable();
    t.push(until.max(t.last().copied().unwrap_or(0)));
    t.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(until)
}

/// Acknowledgements of load `name` in `[from, to)` ms.
fn acks_between(lab: &Lab, name: &str, from: u64, to: u64) -> usize {
    lab.acked(name)
        .iter()
        .filter(|a| (from..to).contains(&a.3))
        .count()
}

/// R0: what this machine offers the suite (each missing piece is a printed, counted skip of
/// what needs it), then a fault-free run: two load clients for 3 s, every call answered, the
/// oracles and the baseline hold. Every other test is only as good as this one.
#[test]
fn r0_preflight_and_a_fault_free_baseline() {
    let _g = serial();
    let mut row = Row::new("R0", "preflight and a fault-free baseline");
    if cfg!(debug_assertions) {
        row.skipped = Some("the suite runs once, in release".into());
        return;
    }
    let mut missing = Vec::new();
    let memlock = output(&["sh", "-c", "ulimit -l"]).unwrap_or_default();
    row.fig(format!("memlock {}", memlock.trim()));
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    row.fig(format!(
        "{cores} cores, load {}",
        load.split(' ').next().unwrap_or("?")
    ));
    match output(&[env!("CARGO_BIN_EXE_shardcx"), "info"]) {
        Ok(info) => {
            for l in info.lines().filter(|l| l.starts_with("UCX")) {
                row.fig(l.trim());
            }
        }
        Err(e) => missing.push(format!("shardcx info: {e}")),
    }
    if let Err(e) = has_tbf() {
        missing.push(format!("{e}: R5's bandwidth phase is skipped"));
    }
    missing.push("no RDMA device: every test runs over tcp".into());
    missing.push("no tc netem: loss by nftables numgen, no delay or reordering".into());
    for m in &missing {
        row.fig(format!("missing: {m}"));
    }
    require_lab!(row);
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let a = lab.start_load(1, 3, 2000);
    let b = lab.start_load(2, 3, 2000);
    for (name, i) in [("h1", a), ("h2", b)] {
        let s = lab.summary(i, Duration::from_secs(30));
        s.assert_none_late(name);
        assert!(
            s.failed().is_empty(),
            "{name} failed without a fault: {}",
            s.0
        );
        assert!(s.n("ok") > 0, "{name}: no call answered: {}", s.0);
        row.fig(format!("{name}: {} calls, all answered", s.n("ok")));
    }
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R6: the server stopped (SIGSTOP) for 10 s under load, then continued. Its death is seen
/// within 1 s (+ slack) by the client, whose calls all end by their deadline; calls succeed
/// again after it continues; nothing acknowledged is lost or delivered twice.
#[test]
fn r6_a_stopped_peer_is_declared_dead_and_comes_back() {
    let _g = serial();
    let mut row = Row::new("R6", "SIGSTOP 10 s under load");
    require_lab!(row);
    let mut rng = Rng::new("R6");
    let mut lab = Lab::new();
    let server = lab.start_server();
    lab.take_baseline(&mut row);
    let load = lab.start_load(1, 20, 5000);
    std::thread::sleep(rng.ms(2500, 3500));
    let stop_at = unix_ms();
    lab.signal(server, "-STOP");
    std::thread::sleep(Duration::from_secs(10));
    let cont_at = unix_ms();
    lab.signal(server, "-CONT");
    let s = lab.summary(load, Duration::from_secs(60));
    eprintln!("R6 summary: {}", s.0);
    let (stop_at, cont_at) = (s.rel(stop_at), s.rel(cont_at));
    let first_error = s.0["first_error_ms"]
        .as_u64()
        .expect("no call failed while stopped");
    let detect = first_error.saturating_sub(stop_at);
    let back = first_ack_after(&lab, "h1", cont_at).map(|t| t.saturating_sub(cont_at));
    row.fig(format!(
        "stop seen after {detect} ms (5 s deadlines); first ack {back:?} ms after SIGCONT"
    ));
    s.assert_none_late("h1");
    assert!(detect <= 1_500, "stop seen only after {detect} ms");
    assert!(
        back.is_some_and(|b| b <= 3_000),
        "no ack within 3 s after SIGCONT: {back:?}"
    );
    assert!(s.n("ok") > 0);
    lab.check_backlog(&mut row, &[("h1", &s)]);
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R4: `h1` partitioned from `h0` for 8 s while `h2` (the control pair) keeps calling, then
/// healed; three rounds. Each time `h1` sees the partition within 1 s (+ slack), its calls end
/// by their deadline, it is back within 3 s of the heal in one session (the server counts one
/// handshake or join per rail of the client per heal, no more); `h2` sees no failure at all.
#[test]
fn r4_a_partition_is_detected_and_heals_and_the_control_pair_is_untouched() {
    let _g = serial();
    let mut row = Row::new(
        "R4",
        "partition h1-h0 8 s and heal, 3 rounds; control pair h2",
    );
    require_lab!(row);
    let mut rng = Rng::new("R4");
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let load = lab.start_load(1, 40, 5000);
    let control = lab.start_load(2, 40, 5000);
    std::thread::sleep(Duration::from_secs(2));
    // A reconnect makes a new session (a handshake) or joins the one both nodes remember
    // (a rail join on every rail): the server's counts of both.
    let handshakes = |lab: &Lab| {
        let g = lab.gauges();
        let n = |k: &str| g.get(k).copied().unwrap_or(0.0);
        (n("shardcx_handshakes_total"), n("shardcx_rail_joins_total"))
    };
    let before = handshakes(&lab);
    // The rails of one client (both have the same), which each heal must bring back.
    let rails = lab.gauges().get("shardcx_rails").copied().unwrap_or(0.0) / 2.0;
    let mut rounds = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(rng.ms(2000, 3000));
        let cut_at = unix_ms();
        lab.partition(1, true);
        // The nft commands take some tens of milliseconds: the partition is whole from here.
        let cut_done = unix_ms();
        std::thread::sleep(Duration::from_secs(8));
        let heal_at = unix_ms();
        lab.partition(1, false);
        rounds.push((cut_at, cut_done, heal_at));
    }
    let s = lab.summary(load, Duration::from_secs(60));
    let c = lab.summary(control, Duration::from_secs(60));
    // The shards publish every 250 ms: well after the last session is up.
    let after = handshakes(&lab);
    let (new_sessions, joins) = (after.0 - before.0, after.1 - before.1);
    eprintln!("R4 summary h1: {}\nR4 summary h2 (control): {}", s.0, c.0);
    let errors: Vec<u64> = s.0["errors"]
        .as_array()
        .map(|e| e.iter().filter_map(|x| x[0].as_u64()).collect())
        .unwrap_or_default();
    let mut figures = Vec::new();
    for (round, (cut_at, cut_done, heal_at)) in rounds.iter().enumerate() {
        let applying = cut_done - cut_at;
        let (cut_at, heal_at) = (s.rel(*cut_at), s.rel(*heal_at));
        let detect = errors
            .iter()
            .filter(|t| **t >= cut_at)
            .min()
            .map(|t| t - cut_at);
        let back = first_ack_after(&lab, "h1", heal_at).map(|t| t.saturating_sub(heal_at));
        figures.push(format!(
            "seen {detect:?} ({} once the rules were in place), back {back:?}",
            detect.map_or("-".into(), |d| format!("{} ms", d.saturating_sub(applying)))
        ));
        assert!(
            detect.is_some_and(|d| d <= 1_500),
            "round {round}: partition seen after {detect:?} ms"
        );
        assert!(
            back.is_some_and(|b| b <= 3_000),
            "round {round}: no ack within 3 s of the heal: {back:?}"
        );
    }
    row.fig(format!(
        "rounds (ms): {}; {new_sessions} new sessions, {joins} rails joined; control: {} ok, 0 failed",
        figures.join(", "),
        c.n("ok")
    ));
    s.assert_none_late("h1");
    // Each heal: the session resumed (a join on every rail) or made anew (a handshake, then
    // joins on the other rails); never more.
    assert!(rails >= 1.0, "no rail before the partition");
    assert!(
        new_sessions <= 3.0,
        "{new_sessions} new sessions for 3 heals"
    );
    assert_eq!(
        new_sessions + joins,
        3.0 * rails,
        "each heal brings back the client's {rails} rails, no more"
    );
    assert!(c.failed().is_empty(), "the control pair failed: {}", c.0);
    c.assert_none_late("h2");
    assert!(c.n("ok") > 0);
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R3: the server killed (-9) under load and restarted at once, five rounds. Each death is
/// seen within 1 s, calls in flight at a kill and calls while the server is down fail at once
/// (none after more than 1.5 s: none waits for its 2 s deadline), the clients work again with
/// the new incarnation within 4 s, and no call is lost or delivered twice across the restarts.
#[test]
fn r3_kill_9_and_restart_loses_and_duplicates_nothing() {
    let _g = serial();
    let mut row = Row::new("R3", "kill -9 and restart under load, 5 rounds");
    require_lab!(row);
    let mut rng = Rng::new("R3");
    let mut lab = Lab::new();
    let mut server = lab.start_server();
    // Every start of the server is alike: the first one's rest is the baseline.
    lab.take_baseline(&mut row);
    let load = lab.start_load(1, 18, 2000);
    // Rendezvous-sized payloads beside the eager ones.
    let large = lab.start_load_with(2, "h2", 18, &["--size", "32k", "--window", "2"]);
    let mut kills = Vec::new();
    for _ in 0..5 {
        std::thread::sleep(rng.ms(2000, 3000));
        kills.push(unix_ms());
        lab.signal(server, "-KILL");
        let _ = lab.children[server].wait();
        std::thread::sleep(Duration::from_millis(500));
        server = lab.start_server();
    }
    let s = lab.summary(load, Duration::from_secs(60));
    let l = lab.summary(large, Duration::from_secs(60));
    eprintln!("R3 summary: {}\nR3 summary (32 KiB): {}", s.0, l.0);
    s.assert_none_late("h1");
    l.assert_none_late("h2");
    let mut backs = Vec::new();
    for (name, sum) in [("h1", &s), ("h2", &l)] {
        let acked = lab.acked(name);
        for (round, k) in kills.iter().map(|k| sum.rel(*k)).enumerate() {
            let back = acked
                .iter()
                .map(|a| a.3)
                .filter(|t| *t > k + 500)
                .min()
                .map(|t| t - k);
            backs.push(back.unwrap_or(u64::MAX));
            assert!(
                back.is_some_and(|b| b <= 4_000),
                "{name} round {round}: {back:?}"
            );
        }
    }
    let kills: Vec<u64> = kills.iter().map(|k| s.rel(*k)).collect();
    // Calls in flight at a kill fail at once (the kernel resets the connection: a transport
    // error), and calls while it is down are refused at once: none waits for its deadline.
    for (name, sum) in [("h1", &s), ("h2", &l)] {
        let slow: Vec<&serde_json::Value> = sum.0["errors"]
            .as_array()
            .map(|e| e.iter().filter(|x| x[2].as_u64() > Some(1_500)).collect())
            .unwrap_or_default();
        assert!(
            slow.is_empty(),
            "{name}: calls that failed only after 1.5 s: {slow:?}"
        );
    }
    let first_error = s.0["first_error_ms"].as_u64().expect("no call failed");
    let detect = first_error.saturating_sub(kills[0]);
    row.fig(format!(
        "first death seen after {detect} ms; first ack after each kill (restart at +500 ms), h1 then h2: {backs:?} ms; failures {:?}",
        s.failed()
    ));
    assert!(detect <= 1_000 + 500, "first death seen after {detect} ms");
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R2: an authenticated peer (`fault_peer hostile` in `h1`) sends malformed requests (random
/// bytes, truncated requests, a wrong schema hash or reserved flag, random archives after a
/// valid prefix), calls to a function the server lacks, arguments over the server's limit,
/// payloads over its frame limit, and stray replies and cancels, while `h2` (the control pair)
/// keeps calling. Each malformed request is refused with a typed error reply (an oversized
/// frame is dropped unread: its call times out), no handler runs for any (the journal holds
/// only the load's calls and the hostile's one valid call), the hostile peer is still served
/// when it behaves, the control pair sees no failure, and the server counts what it dropped.
#[test]
fn r2_malformed_frames_are_refused_with_typed_errors_and_harm_no_one() {
    let _g = serial();
    let mut row = Row::new(
        "R2",
        "malformed and oversized frames from an authenticated peer",
    );
    require_lab!(row);
    let mut rng = Rng::new("R2");
    let mut lab = Lab::new();
    lab.start_server_with(&["--max-args", "64k", "--max-message", "1m"]);
    lab.take_baseline(&mut row);
    let control = lab.start_load(2, 10, 3000);
    std::thread::sleep(Duration::from_secs(1));
    let args = strings(&[
        "hostile",
        "--connect",
        &Lab::server_addr(),
        "--seed",
        &rng.next().to_string(),
        "--rounds",
        "25",
        "--max-args",
        "64k",
        "--max-message",
        "1m",
        "--persist",
        "300",
    ]);
    let h = lab.spawn(1, "hostile", &args);
    let out = lab.json(h, Duration::from_secs(60));
    let c = lab.summary(control, Duration::from_secs(60));
    // The shards publish every 250 ms: scraped once the control load is done, well after.
    let g = lab.gauges();
    eprintln!("R2 hostile: {out}\nR2 control: {}", c.0);
    let classes = out["classes"].as_object().unwrap();
    let expect: [(&str, &[&str]); 8] = [
        ("random", &["SchemaMismatch", "BadRequest"]),
        ("truncated", &["BadRequest"]),
        ("bad-prefix", &["SchemaMismatch", "BadRequest"]),
        ("bad-archive", &["BadRequest"]),
        ("unknown-function", &["UnknownFunction"]),
        ("over-args", &["TooLarge"]),
        ("over-frame", &["Net.TimedOut"]),
        // Every class above was sent: none missing from the output.
        ("", &[]),
    ];
    for (class, allowed) in expect.iter().filter(|(c, _)| !c.is_empty()) {
        let got = classes
            .get(*class)
            .and_then(|v| v.as_object())
            .unwrap_or_else(|| panic!("class {class} missing: {out}"));
        for (outcome, n) in got {
            assert!(
                allowed.contains(&outcome.as_str()),
                "{class}: {n} ended {outcome}, not one of {allowed:?}: {out}"
            );
        }
        row.fig(format!("{class}: {}", serde_json::Value::from(got.clone())));
    }
    assert_eq!(out["valid"], "ok", "the hostile peer is not served: {out}");
    // Then it keeps sending malformed requests: dropped at the server's strike limit (100
    // within 10 s, counting the classes above), its last request unanswered (the rails
    // closed), and a call after it, which connects again, refused as banned.
    let persist = &out["persist"];
    let sent = persist["sent"].as_u64().unwrap_or(0);
    let ended = persist["ended"].as_str().unwrap_or("");
    let after = persist["after"].as_str().unwrap_or("");
    row.fig(format!(
        "persistent peer dropped after {sent} more malformed requests (last: {ended}); then: {after}"
    ));
    assert!(
        ended.starts_with("Net.") && (1..=100).contains(&sent),
        "the persistent peer was not dropped: {persist}"
    );
    assert!(
        after.contains("Banned"),
        "the dropped peer was not refused: {persist}"
    );
    // No handler ran for a malformed request: only the load's and the one valid call are in
    // the journal (an archive of random bytes that validated would carry a random source).
    let journal = std::fs::read_to_string(lab.journal()).unwrap_or_default();
    let sources: HashSet<&str> = journal
        .lines()
        .filter_map(|l| l.split(' ').next())
        .collect();
    assert!(
        sources.iter().all(|s| ["200", "7700"].contains(s)),
        "a handler ran for a malformed call: sources {sources:?}"
    );
    let dropped = |r: &str| {
        g.get(&format!("shardcx_frames_dropped_total{{reason={r}}}"))
            .copied()
    };
    let mut counted: Vec<String> = g
        .iter()
        .filter(|(k, v)| k.starts_with("shardcx_frames_dropped_total{") && **v > 0.0)
        .map(|(k, v)| format!("{} {v}", &k["shardcx_frames_dropped_total".len()..]))
        .collect();
    counted.sort();
    row.fig(format!("server dropped: {}", counted.join(", ")));
    assert!(
        dropped("too_large").unwrap_or(0.0) >= 1.0,
        "no oversized frame counted: {g:?}"
    );
    // The stray replies (three kinds of 25): dropped and counted.
    assert!(
        dropped("unmatched_reply").unwrap_or(0.0) >= 75.0,
        "stray replies not counted: {counted:?}"
    );
    let total = |k: &str| g.get(k).copied().unwrap_or(0.0);
    assert!(
        total("shardcx_peers_dropped_total") >= 1.0 && total("shardcx_refused_banned_total") >= 1.0,
        "the drop and the refusal are not counted: {g:?}"
    );
    assert!(c.failed().is_empty(), "the control pair failed: {}", c.0);
    c.assert_none_late("h2");
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R5: 1 % then 5 % of `h0`'s packets dropped at random (nftables), then no loss but a 8 Mbit/s
/// cap (`tbf`), 6 s each, with eager calls from `h1` and 32 KiB (rendezvous) calls from `h2`.
/// No corruption, nothing lost or delivered twice, nothing later than its deadline, and calls
/// answered in every phase.
#[test]
fn r5_loss_and_a_bandwidth_cap_corrupt_lose_and_hang_nothing() {
    let _g = serial();
    let mut row = Row::new("R5", "1% then 5% loss, then an 8 Mbit/s cap, mixed load");
    require_lab!(row);
    let tbf = has_tbf();
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let small = lab.start_load_with(1, "h1", 22, &["--deadline-ms", "3000"]);
    let large = lab.start_load_with(
        2,
        "h2",
        22,
        &["--deadline-ms", "3000", "--size", "32k", "--window", "2"],
    );
    std::thread::sleep(Duration::from_secs(2));
    let mut phases = Vec::new();
    for (name, percent) in [("1% loss", 1), ("5% loss", 5)] {
        let at = unix_ms();
        lab.loss(percent);
        std::thread::sleep(Duration::from_secs(6));
        phases.push((name, at, unix_ms()));
    }
    lab.loss(0);
    // Both ways: h0's end (its replies) and the switch's end toward h0 (the requests).
    let links = [
        (lab.ns("h0"), lab.veth(0)),
        (lab.ns("sw"), format!("vs0-{}", lab.tag)),
    ];
    match &tbf {
        Ok(()) => {
            let at = unix_ms();
            for (ns, dev) in &links {
                run(&[
                    "ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
                    "rate", "8mbit", "burst", "32kbit", "latency", "400ms",
                ])
                .unwrap();
            }
            std::thread::sleep(Duration::from_secs(6));
            phases.push(("8 Mbit/s", at, unix_ms()));
            for (ns, dev) in &links {
                run(&[
                    "ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root",
                ])
                .unwrap();
            }
        }
        Err(why) => row.fig(format!("bandwidth phase skipped: {why}")),
    }
    let s = lab.summary(small, Duration::from_secs(60));
    let l = lab.summary(large, Duration::from_secs(60));
    eprintln!("R5 summary h1: {}\nR5 summary h2 (32 KiB): {}", s.0, l.0);
    for (who, sum) in [("h1", &s), ("h2", &l)] {
        sum.assert_none_late(who);
        assert!(
            !sum.failed().contains_key("BadCrc"),
            "{who}: a reply carried a wrong CRC: {}",
            sum.0
        );
        let mut per_phase = Vec::new();
        for (name, from, to) in &phases {
            let n = acks_between(&lab, who, sum.rel(*from), sum.rel(*to));
            assert!(n > 0, "{who}: no call answered during {name}");
            per_phase.push(format!("{name} {n}"));
        }
        row.fig(format!(
            "{who}: acks {}; failed {:?}",
            per_phase.join(", "),
            sum.failed()
        ));
    }
    lab.check_backlog(&mut row, &[("h1", &s), ("h2", &l)]);
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R9: deadlines and cancellation at every phase (`fault_peer deadlines` in `h1` against the
/// server's `fault.slow`): deadline 0 is refused before anything is sent; 1 ms ends by 1 ms +
/// 250 ms; `Duration::MAX` overflows nothing and is answered; a call dropped before it is
/// polled, given up while the handler sleeps, or whose deadline passes in the handler is never
/// journaled (the cancel or the deadline reaches the server, which drops the handler); a call
/// answered then dropped is; 200 calls at once with deadlines drawn from the seed end once
/// each, none late; nothing is left pending on the caller.
#[test]
fn r9_deadlines_and_cancellation_at_every_phase() {
    let _g = serial();
    let mut row = Row::new(
        "R9",
        "deadlines 0, 1 ms, MAX; cancel before send, in handler, after reply",
    );
    require_lab!(row);
    let mut rng = Rng::new("R9");
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let args = strings(&[
        "deadlines",
        "--connect",
        &Lab::server_addr(),
        "--seed",
        &rng.next().to_string(),
    ]);
    let d = lab.spawn(1, "deadlines", &args);
    let out = lab.json(d, Duration::from_secs(60));
    eprintln!("R9: {out}");
    let cases = out["cases"].as_object().unwrap();
    let outcomes = |c: &str| -> BTreeMap<String, u64> {
        serde_json::from_value(cases[c]["outcomes"].clone()).unwrap_or_default()
    };
    for (name, c) in cases {
        let over = c["max_over_ms"].as_u64().unwrap();
        assert!(
            over <= 250,
            "{name}: a call ended {over} ms after its deadline: {c}"
        );
        row.fig(format!("{name}: {}", c["outcomes"]));
    }
    assert_eq!(
        outcomes("zero").into_keys().collect::<Vec<_>>(),
        ["TimedOut"],
        "deadline 0"
    );
    assert_eq!(
        outcomes("max").into_keys().collect::<Vec<_>>(),
        ["Ok"],
        "Duration::MAX"
    );
    assert!(
        outcomes("one-ms")
            .keys()
            .all(|k| ["Ok", "TimedOut"].contains(&k.as_str())),
        "1 ms: {:?}",
        outcomes("one-ms")
    );
    assert_eq!(
        outcomes("cancelled-in-handler")
            .into_keys()
            .collect::<Vec<_>>(),
        ["GivenUp"]
    );
    assert!(
        outcomes("deadline-in-handler")
            .keys()
            .all(|k| ["TimedOut", "DeadlineExpired"].contains(&k.as_str())),
        "{:?}",
        outcomes("deadline-in-handler")
    );
    assert_eq!(
        outcomes("after-reply").into_keys().collect::<Vec<_>>(),
        ["Ok"]
    );
    assert_eq!(out["mixed_completions"], 200, "each of 200 calls ends once");
    assert_eq!(
        out["pending_after"], 0,
        "requests left pending on the caller"
    );
    assert!(
        out["cancels_sent"].as_u64().unwrap() >= 5,
        "no cancel sent for the calls given up"
    );
    // What must and must not have reached a handler.
    let src = "900".to_owned();
    let inc = out["inc"].to_string();
    let journal = std::fs::read_to_string(lab.journal()).unwrap_or_default();
    let journaled: HashSet<String> = journal
        .lines()
        .filter(|l| l.starts_with("900 "))
        .filter_map(|l| l.split(' ').nth(2).map(str::to_owned))
        .collect();
    let mut acked = Vec::new();
    for (name, c) in cases {
        for s in c["never"].as_array().unwrap() {
            assert!(
                !journaled.contains(&s.to_string()),
                "{name}: call {s} reached a handler"
            );
        }
        for s in c["acked"].as_array().unwrap() {
            acked.push((src.clone(), inc.clone(), s.to_string()));
        }
    }
    lab.check_oracles(&mut row, &acked);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R7: 200 raw TCP connections to the listener's port from `h1` (silent, dripping a byte every
/// 100 ms, or 64 KiB of garbage; reopened when the listener closes them) for 8 s, and 20 shardcx
/// client shards in `h1` (4 processes of 5) that connect and are then stopped (SIGSTOP).
/// Meanwhile `h2` fetches the directory 20 times and connects and calls once: p99 ≤ 500 ms,
/// no failure. The stopped clients' rails are freed by the heartbeats (the server's rail gauge
/// falls to 0 within 3 s of the stop), the listener closes half-open connections (counted),
/// and once the attackers are gone the server's fds are back to baseline within 5 s.
#[test]
fn r7_a_connection_flood_and_stopped_clients_keep_no_one_out_and_leak_nothing() {
    let _g = serial();
    let mut row = Row::new("R7", "200 raw TCP attackers, 20 stopped client shards");
    require_lab!(row);
    let mut rng = Rng::new("R7");
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let mut stopped = Vec::new();
    for p in 0..4 {
        stopped.push(lab.start_load_with(
            1,
            &format!("h1-{p}"),
            30,
            &["--shards", "5", "--window", "1", "--pause-ms", "20"],
        ));
    }
    // Every shard connected and calling (each logs its acknowledgements).
    let connected = wait_for(Duration::from_secs(15), || {
        (0..4).all(|p| {
            let acked = lab.acked(&format!("h1-{p}"));
            (0..5).all(|s| acked.iter().any(|a| a.0 == format!("1{s:02}")))
        })
    });
    assert!(connected, "not every client shard connected within 15 s");
    // The gauges are published every 250 ms: the 20 client rails (at least) show up soon.
    let rails = || lab.gauges().get("shardcx_rails").copied().unwrap_or(0.0);
    assert!(
        wait_for(Duration::from_secs(3), || rails() >= 20.0),
        "the server shows {} rails for 20 connected client shards",
        rails()
    );
    let rails_before = rails();
    let stop_at = Instant::now();
    for &c in &stopped {
        lab.signal(c, "-STOP");
    }
    let freed = wait_for(Duration::from_secs(3), || {
        lab.gauges().get("shardcx_rails").copied().unwrap_or(1.0) == 0.0
    });
    row.fig(format!(
        "{rails_before} rails of stopped clients freed in {} ms",
        stop_at.elapsed().as_millis()
    ));
    assert!(
        freed,
        "the stopped clients' rails are still held 3 s after the stop"
    );
    let attack = lab.spawn(
        1,
        "attack",
        &strings(&[
            "attack",
            "--connect",
            &Lab::server_addr(),
            "--raw",
            "200",
            "--for",
            "8",
            "--seed",
            &rng.next().to_string(),
        ]),
    );
    std::thread::sleep(Duration::from_secs(2));
    let probe = lab.spawn(
        2,
        "probe",
        &strings(&["probe", "--connect", &Lab::server_addr(), "--count", "20"]),
    );
    let p = lab.json(probe, Duration::from_secs(60));
    let a = lab.json(attack, Duration::from_secs(60));
    let left_at = Instant::now();
    for c in stopped {
        lab.signal(c, "-KILL");
    }
    eprintln!("R7 probe: {p}\nR7 attack: {a}");
    let mut lat: Vec<u64> = serde_json::from_value(p["lat_ms"].clone()).unwrap();
    lat.sort_unstable();
    let p99 = lat
        .get((lat.len() * 99).div_ceil(100).saturating_sub(1))
        .copied();
    row.fig(format!(
        "attack: {}; directory fetches p99 {p99:?} ms, failures {}; full connect {}",
        a, p["failures"], p["full"]
    ));
    assert_eq!(
        p["failures"],
        serde_json::json!({}),
        "legitimate fetches failed: {p}"
    );
    assert!(
        p99.is_some_and(|t| t <= 500),
        "directory fetch p99 {p99:?} ms"
    );
    assert_eq!(
        p["full"]["call"], "ok",
        "the legitimate client was not served: {p}"
    );
    assert!(
        p["full"]["connect_ms"].as_u64().is_some_and(|t| t <= 500),
        "legitimate connect took over 500 ms: {p}"
    );
    let g = lab.gauges();
    let refused: f64 = ["timed_out", "refused", "over_cap"]
        .iter()
        .map(|o| {
            g.get(&format!("shardcx_bootstraps_total{{outcome={o}}}"))
                .copied()
                .unwrap_or(0.0)
        })
        .sum();
    row.fig(format!("listener closed {refused} attacking connections"));
    assert!(
        refused > 0.0,
        "no attacking connection closed by the listener"
    );
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
    row.fig(format!(
        "checked {} ms after the attackers left",
        left_at.elapsed().as_millis()
    ));
}

/// R10: the server stopped (SIGTERM, a drain deadline of 2 s) while 2 × 500 calls and 100
/// remote-memory puts and gets (to regions on both server shards) are in flight and `h1` is
/// partitioned from it. The server exits within the drain deadline + 1 s; `h2`'s calls and
/// remote-memory operations after the stop fail at once (refused or connection lost, never a
/// timeout), and its gets read what the server holds; every call of both ends by its
/// deadline; nothing acknowledged is lost.
#[test]
fn r10_shutdown_under_load_with_a_partitioned_peer_drains_in_time() {
    let _g = serial();
    let mut row = Row::new(
        "R10",
        "SIGTERM with 1,000 calls and 100 RMA in flight and a partitioned peer",
    );
    require_lab!(row);
    let mut rng = Rng::new("R10");
    let mut lab = Lab::new();
    let dir = lab.dir.display().to_string();
    let server = lab.start_server_with(&["--drain-ms", "2000", "--rma", &dir]);
    assert!(
        wait_for(Duration::from_secs(10), || (0..2)
            .all(|s| lab.dir.join(format!("regions-{s}.json")).is_file())),
        "the server's shards did not write their regions"
    );
    let loads = [
        lab.start_load_with(1, "h1", 9, &["--window", "500", "--deadline-ms", "4000"]),
        lab.start_load_with(2, "h2", 9, &["--window", "500", "--deadline-ms", "4000"]),
    ];
    // 2 x 50 puts and gets in flight, from h2 (not partitioned).
    let rma_args = strings(&[
        "rma-load",
        "--connect",
        &Lab::server_addr(),
        "--regions",
        &dir,
        "--window",
        "50",
        "--for",
        "9",
        "--deadline-ms",
        "4000",
    ]);
    let rma = lab.spawn(2, "rma-load", &rma_args);
    std::thread::sleep(rng.ms(2500, 3500));
    lab.partition(1, true);
    std::thread::sleep(Duration::from_millis(300));
    let term_at = unix_ms();
    let t0 = Instant::now();
    lab.signal(server, "-TERM");
    let exited = wait_for(Duration::from_secs(10), || {
        lab.children[server].try_wait().unwrap().is_some()
    });
    let took = t0.elapsed();
    let status = lab.children[server].try_wait().unwrap();
    row.fig(format!(
        "server exited {} ms after SIGTERM: {status:?}",
        took.as_millis()
    ));
    assert!(exited, "the server still runs 10 s after SIGTERM");
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    assert!(took <= Duration::from_millis(3_000), "exit took {took:?}");
    let s = lab.summary(loads[0], Duration::from_secs(60));
    let c = lab.summary(loads[1], Duration::from_secs(60));
    eprintln!("R10 h1 (partitioned): {}\nR10 h2: {}", s.0, c.0);
    s.assert_none_late("h1");
    c.assert_none_late("h2");
    let first = c.0["first_error_ms"].as_u64().expect("h2 saw no failure");
    row.fig(format!(
        "h2: first failure {} ms after SIGTERM, failed {:?}; h1 (partitioned): failed {:?}",
        first as i64 - c.rel(term_at) as i64,
        c.failed(),
        s.failed()
    ));
    assert!(
        c.failed().keys().all(|k| !k.contains("TimedOut")),
        "a call to the stopping server waited for its deadline: {}",
        c.0
    );
    // The remote-memory operations in flight: each ended, none by its deadline, none late.
    let m = lab.summary(rma, Duration::from_secs(60));
    eprintln!("R10 rma (h2): {}", m.0);
    m.assert_none_late("rma-load");
    let first = m.0["first_error_ms"]
        .as_u64()
        .expect("the RMA load saw no failure");
    row.fig(format!(
        "RMA (100 in flight): {} ok, first failure {} ms after SIGTERM, failed {:?} (regions \
         deregistered as the server's shards end: refused), worst {} ms past a deadline",
        m.n("ok"),
        first as i64 - m.rel(term_at) as i64,
        m.failed(),
        m.n("max_over_ms")
    ));
    assert!(m.n("ok") > 0, "no RMA operation succeeded: {}", m.0);
    assert!(
        m.failed()
            .keys()
            .all(|k| !k.contains("TimedOut") && k != "BadData"),
        "an RMA operation waited for its deadline or read wrong bytes: {}",
        m.0
    );
    lab.check_oracles(&mut row, &[]);
}

/// R12: remote memory under attack across processes. The server holds, on each of its two
/// shards, regions read-write, read-only, write-only, granted to another node, revoked once,
/// deregistered, and a scratch region (`serve --rma`); an attacker in `h1`, a node not in
/// trusted mode, tries out-of-bounds accesses (refused by its own check, and by the holder for
/// a descriptor that lies about the length), `offset + len` overflowing u64 (raw requests past
/// its own check), the wrong permission, a region granted to someone else, the old descriptor
/// after a revoke and after a deregistration, forged generations, ids, shards and nodes,
/// random descriptors, random raw payloads, a get over the message limit, and trusted (native)
/// RMA. Each is refused with its typed error well before its 2 s deadline; the valid accesses
/// work; the server has no `UCP_FEATURE_RMA`; every region's CRC-32 is unchanged at the end
/// (scratch's is exactly what the valid put made it); a control load sees no failure; the
/// server's gauges and fds come back to rest.
#[test]
fn r12_remote_memory_attacks_are_refused_and_leave_memory_unchanged() {
    /// Which outcomes a class of attacks may end with.
    type Allowed<'a> = dyn Fn(&str) -> bool + 'a;
    const SHARDS: usize = 2;
    let _g = serial();
    let mut row = Row::new(
        "R12",
        "remote memory: bounds, overflow, permission, revoke, forged descriptors, trusted off",
    );
    require_lab!(row);
    let mut rng = Rng::new("R12");
    let mut lab = Lab::new();
    let dir = lab.dir.display().to_string();
    let server = lab.start_server_with(&["--rma", &dir, "--shards", &SHARDS.to_string()]);
    let lab_dir = lab.dir.clone();
    let files = |prefix: &str| -> Vec<serde_json::Value> {
        (0..SHARDS)
            .filter_map(|s| {
                std::fs::read_to_string(lab_dir.join(format!("{prefix}-{s}.json"))).ok()
            })
            .map(|t| serde_json::from_str(&t).unwrap())
            .collect()
    };
    assert!(
        wait_for(Duration::from_secs(10), || files("regions").len() == SHARDS),
        "the server's shards did not write their regions"
    );
    let start = files("regions");
    for f in &start {
        assert_eq!(f["trusted_rma"], false, "trusted mode on by default: {f}");
        assert_eq!(
            f["rma_feature"], false,
            "UCP_FEATURE_RMA on by default: {f}"
        );
    }
    lab.take_baseline(&mut row);
    let control = lab.start_load(2, 8, 3000);
    let args = strings(&[
        "rma-attack",
        "--connect",
        &Lab::server_addr(),
        "--regions",
        &dir,
        "--server-shards",
        &SHARDS.to_string(),
        "--seed",
        &rng.next().to_string(),
        "--rounds",
        "50",
    ]);
    let t0 = Instant::now();
    let a = lab.spawn(1, "rma-attack", &args);
    let out = lab.json(a, Duration::from_secs(60));
    let took = t0.elapsed();
    eprintln!("R12 attack: {out}");
    let classes = out["classes"].as_object().unwrap();
    // What each class may end with: its typed refusal, never Ok, never a timeout.
    let refused = |o: &str| o.starts_with("Refused.") || o.starts_with("Invalid.");
    let expect: [(&str, &Allowed<'_>); 15] = [
        ("oob", &|o| o == "Invalid.OutOfBounds"),
        ("oob-forged-length", &|o| o == "Refused.OutOfBounds"),
        ("overflow-raw", &|o| o == "Refused.OutOfBounds"),
        ("too-large", &|o| o == "TooLarge"),
        ("wrong-permission", &|o| {
            o == "Invalid.NotPermitted" || o == "Refused.NotPermitted"
        }),
        ("not-grantee", &|o| o == "Refused.NotGrantee"),
        ("after-revoke", &|o| o == "Refused.StaleGeneration"),
        // The deregistered region's slot is taken by the next one: a stale generation.
        ("after-deregister", &|o| {
            o == "Refused.StaleGeneration" || o == "Refused.UnknownRegion"
        }),
        ("forged-generation", &|o| o == "Refused.StaleGeneration"),
        ("forged-id", &|o| o == "Refused.UnknownRegion"),
        ("forged-node", &|o| o == "WrongNode"),
        ("random-descriptor", &|o| o == "Descriptor" || refused(o)),
        ("malformed-raw", &|o| o.starts_with("Refused.")),
        ("trusted-off", &|o| o == "TrustedOff"),
        ("valid", &|o| o == "Ok"),
    ];
    let mut refusals = 0;
    for (class, allowed) in expect {
        let got = classes
            .get(class)
            .and_then(|v| v.as_object())
            .unwrap_or_else(|| panic!("class {class} missing: {out}"));
        for (outcome, n) in got {
            assert!(allowed(outcome), "{class}: {n} ended {outcome}: {out}");
            if class != "valid" {
                refusals += n.as_u64().unwrap();
            }
        }
    }
    assert_eq!(classes.len(), expect.len(), "a class not checked: {out}");
    let max_ms = out["max_ms"].as_u64().unwrap();
    row.fig(format!(
        "{} refused of {} accesses in {} classes (longest {max_ms} ms, attack {} ms in all)",
        refusals,
        out["ops"],
        expect.len() - 1,
        took.as_millis()
    ));
    // Nothing hung: every refusal came long before its 2 s deadline.
    assert!(max_ms < 1000, "an access took {max_ms} ms: {out}");
    assert_eq!(
        out["valid_reads"],
        3 * SHARDS as u64,
        "valid accesses failed: {out}"
    );
    assert_eq!(out["trusted_enabled"], false, "{out}");
    assert_eq!(out["rma_feature"], false, "{out}");
    assert_eq!(out["trusted_ops"], 0, "a trusted operation ran: {out}");
    let c = lab.summary(control, Duration::from_secs(60));
    assert!(c.failed().is_empty(), "the control pair failed: {}", c.0);
    c.assert_none_late("h2");
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
    // The target memory afterwards: written at the server's exit.
    lab.signal(server, "-TERM");
    assert!(
        wait_for(Duration::from_secs(10), || files("final").len() == SHARDS),
        "the server did not write its regions' final checksums"
    );
    let end = files("final");
    let scratch = out["scratch_crc"].as_array().unwrap();
    let (mut same, mut refused_there) = (0, 0);
    for (s, (a, b)) in start.iter().zip(&end).enumerate() {
        for (name, crc) in a["crc"].as_object().unwrap() {
            let now = &b["crc"][name];
            if name == "scratch" {
                assert_eq!(
                    now, &scratch[s],
                    "shard {s}: scratch is not what the valid put made it"
                );
            } else {
                assert_eq!(now, crc, "shard {s}: region {name} changed");
                same += 1;
            }
        }
        refused_there +=
            b["stats"]["refused"].as_u64().unwrap() + b["stats"]["malformed"].as_u64().unwrap();
        assert_eq!(b["stats"]["expired"], 0, "shard {s}: {b}");
    }
    row.fig(format!(
        "{same} regions' CRC-32 unchanged, scratch as written; the server refused {refused_there} \
         (the rest by the attacker's own checks); trusted mode off on both"
    ));
}

/// R13: a 60 s soak at 1 % loss with the server killed (-9) and restarted every 15 s, eager and
/// rendezvous load. The clients' fds and memory stay flat after warm-up (the least of the
/// samples over the last 7 s against a sample at 11 s), nothing is late, lost or duplicated,
/// and the last server is back to baseline once the clients leave.
#[test]
fn r13_a_soak_with_restarts_and_loss_stays_flat() {
    let _g = serial();
    let mut row = Row::new("R13", "60 s soak, kill -9 every 15 s, 1% loss");
    require_lab!(row);
    let mut rng = Rng::new("R13");
    let mut lab = Lab::new();
    let mut server = lab.start_server();
    lab.take_baseline(&mut row);
    let loads = [
        lab.start_load_with(1, "h1", 60, &["--deadline-ms", "2000"]),
        lab.start_load_with(
            2,
            "h2",
            60,
            &["--deadline-ms", "2000", "--size", "32k", "--window", "1"],
        ),
    ];
    lab.loss(1);
    let start = Instant::now();
    let sample = |lab: &Lab| -> Vec<(usize, u64)> {
        loads
            .iter()
            .map(|&i| (fds(lab.pid(i)), rss_kib(lab.pid(i))))
            .collect()
    };
    let mut warm = None;
    for round in 1..=3u32 {
        let at = Duration::from_secs(15 * u64::from(round)) + rng.ms(0, 1000);
        if round == 1 {
            std::thread::sleep(Duration::from_secs(11).saturating_sub(start.elapsed()));
            warm = Some(sample(&lab));
        }
        std::thread::sleep(at.saturating_sub(start.elapsed()));
        lab.signal(server, "-KILL");
        let _ = lab.children[server].wait();
        std::thread::sleep(Duration::from_millis(300));
        server = lab.start_server();
    }
    // The end figure is the least of samples taken every 250 ms from 50 s to 57 s: a leak stays
    // in every one of them, while a rail the 1 % loss had declared dead and that is being
    // connected again holds a few fds for a moment (CI: h2 at 22 -> 28 in one sample, taken as
    // the server declared it dead at 57.4 s).
    std::thread::sleep(Duration::from_secs(50).saturating_sub(start.elapsed()));
    let mut end = sample(&lab);
    while start.elapsed() < Duration::from_secs(57) {
        std::thread::sleep(Duration::from_millis(250));
        for (least, now) in end.iter_mut().zip(sample(&lab)) {
            *least = ((least.0).min(now.0), (least.1).min(now.1));
        }
    }
    let warm = warm.unwrap();
    lab.loss(0);
    for (k, (name, &i)) in ["h1", "h2"].iter().zip(&loads).enumerate() {
        let s = lab.summary(i, Duration::from_secs(60));
        eprintln!("R13 {name}: {}", s.0);
        s.assert_none_late(name);
        row.fig(format!(
            "{name}: {} ok, failed {:?}; fds {} -> {}, {} -> {} MiB",
            s.n("ok"),
            s.failed(),
            warm[k].0,
            end[k].0,
            warm[k].1 >> 10,
            end[k].1 >> 10
        ));
        assert!(s.n("ok") > 0);
        // Until 2 s before the load ends (its last calls may still be under way).
        let gap = longest_gap(&lab, name, 58_000);
        row.fig(format!("{name}: longest time without an answer {gap} ms"));
        assert!(
            gap <= 5_000,
            "{name}: {gap} ms without an answer (restarts are 300 ms): {}",
            s.0
        );
        assert!(end[k].0 > 0, "{name} ended before its 60 s: {}", s.0);
        assert!(
            end[k].0 <= warm[k].0 + 2,
            "{name}: fds grew {} -> {}",
            warm[k].0,
            end[k].0
        );
        assert!(
            end[k].1 <= warm[k].1 + (16 << 10),
            "{name}: memory grew {} -> {} KiB",
            warm[k].1,
            end[k].1
        );
    }
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R13b (the defect R13 found): UCX's `tcp` transport connected with a blocking `connect(2)` on
/// the shard's thread, so a lost SYN held the client's shard (its timers, heartbeats and
/// deadlines) for a second or more. Here every SYN to the server's UCX ports (not its listener)
/// is dropped for 2.5 s while a load with 500 ms deadlines starts: no stall of the client's
/// shard is reported, no call ends late, and calls are answered. (With `UCX_TCP_CONN_NB=n` in
/// the environment, UCX's old default, this fails: "not polled for 2976 ms or more ... S in
/// connect (wait_woken) x29".)
#[test]
fn r13b_a_lost_syn_does_not_stall_the_shard() {
    let _g = serial();
    let mut row = Row::new("R13b", "SYNs to UCX's ports dropped for 2.5 s at start");
    require_lab!(row);
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let drop_syn = format!("tcp dport != {PORT} tcp flags & (syn | ack) == syn drop");
    lab.nft_table("sxsyn", &drop_syn, "accept");
    let load = lab.start_load(1, 6, 500);
    std::thread::sleep(Duration::from_millis(2500));
    lab.nft(&["delete table inet sxsyn".to_owned()]);
    let s = lab.summary(load, Duration::from_secs(60));
    eprintln!("R13b h1: {}", s.0);
    let err = std::fs::read_to_string(lab.dir.join("h1.err")).unwrap_or_default();
    let stalls: Vec<&str> = err.lines().filter(|l| l.contains("not polled")).collect();
    row.fig(format!(
        "{} ok, failed {:?}, late {}, {} stall report(s)",
        s.n("ok"),
        s.failed(),
        s.n("late"),
        stalls.len()
    ));
    s.assert_none_late("h1");
    assert!(stalls.is_empty(), "the client's shard stalled: {stalls:?}");
    assert!(s.n("ok") > 0, "no call answered once SYNs passed: {}", s.0);
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
}

/// R8: 64 client shards (4 processes of 16, two hosts) connect at once and make 100 calls
/// each, then all close. Every shard connects within 10 s (a failed connect may be tried again
/// within them: counted and printed), no call fails, and the server's rails, fds and memory
/// come back to baseline. (RELIABILITY.md asks 512 endpoints: 512 shards,
/// each its own UCX context and thread, do not fit this 2-core machine beside two other
/// engineers; the count is `R8_SHARDS` per process.)
#[test]
fn r8_many_endpoints_connect_at_once_and_leave_nothing_behind() {
    const R8_SHARDS: usize = 16;
    let _g = serial();
    let mut row = Row::new("R8", "4 x 16 client shards at once, 100 calls each");
    require_lab!(row);
    let mut lab = Lab::new();
    lab.start_server();
    lab.take_baseline(&mut row);
    let shards = R8_SHARDS.to_string();
    let procs: Vec<(String, usize)> = (0..4)
        .map(|p| {
            let name = format!("h{}-{p}", 1 + p % 2);
            let extra = [
                "--shards",
                &shards,
                "--window",
                "1",
                "--calls",
                "100",
                "--pause-ms",
                "0",
                "--deadline-ms",
                "5000",
            ];
            let i = lab.start_load_with(1 + p % 2, &name, 60, &extra);
            (name, i)
        })
        .collect();
    let (mut slowest, mut retries) = (0, 0);
    for (name, i) in &procs {
        let s = lab.summary(*i, Duration::from_secs(90));
        let acked = lab.acked(name);
        // Each shard's first acknowledgement: when it was connected, at the latest.
        let mut first: HashMap<String, u64> = HashMap::new();
        for a in &acked {
            let t = first.entry(a.0.clone()).or_insert(a.3);
            *t = (*t).min(a.3);
        }
        assert_eq!(
            first.len(),
            R8_SHARDS,
            "{name}: not every shard was answered: {}",
            s.0
        );
        slowest = slowest.max(first.values().copied().max().unwrap_or(0));
        retries += s.n("connect_retries");
        assert!(s.failed().is_empty(), "{name}: spurious failures: {}", s.0);
        assert_eq!(s.n("ok"), 100 * R8_SHARDS as u64, "{name}: {}", s.0);
    }
    row.fig(format!(
        "{} shards: the slowest's first answer {slowest} ms after its process started; \
         {retries} connects tried again",
        4 * R8_SHARDS
    ));
    assert!(
        slowest <= 10_000,
        "a shard connected only after {slowest} ms"
    );
    lab.check_oracles(&mut row, &[]);
    lab.check_baseline(&mut row, Duration::from_secs(5));
    let b = lab.baseline.unwrap();
    let rss = lab.server_rss_kib();
    assert!(
        rss <= b.rss_kib + (64 << 10),
        "server memory {} -> {} MiB",
        b.rss_kib >> 10,
        rss >> 10
    );
}

/// R8b: 512 endpoints held to one node at once. The server has 16 shards; 4 client processes
/// (two in `h1`, two in `h2`) run 8 one-shard nodes each, and between a one-shard node and a
/// 16-shard one there are 16 rails (one UCX endpoint each way per rail), so the server holds
/// 32 × 16 = 512 rails. Every node spreads its calls over the server's 16 shards for 15 s.
/// All 512 are ready at once within 10 s and stay so for at least 3 s; no call fails; every
/// server shard served calls; once the clients are gone the rails and fds are back. Three
/// waves: the server's memory after the third is within 12 MiB (24 KiB per endpoint) of after
/// the second (the first ones set the allocator's high-water mark), and within 64 MiB of its
/// rest.
#[test]
fn r8b_512_endpoints_held_at_once_and_given_back() {
    const SERVER_SHARDS: usize = 16;
    let _g = serial();
    let mut row = Row::new(
        "R8b",
        "512 endpoints held at once (32 client nodes x 16 server shards)",
    );
    require_lab!(row);
    let mut lab = Lab::new();
    lab.start_server_with(&["--shards", &SERVER_SHARDS.to_string()]);
    lab.take_baseline(&mut row);
    let b = lab.baseline.unwrap();
    let mut after = Vec::new();
    for wave in 1..=3 {
        r8b_wave(&mut lab, &mut row, wave);
        after.push(lab.server_rss_kib());
    }
    row.fig(format!(
        "server memory {} MiB at rest, after each wave {:?} MiB",
        b.rss_kib >> 10,
        after.iter().map(|k| k >> 10).collect::<Vec<_>>()
    ));
    // The first two waves raise the allocator's high-water mark; the third may add what the
    // allocator and the dedup windows (30 s of answered calls) keep, not a leak per endpoint.
    // Seen from the second wave to the third: +3 MiB and +5 MiB (quiet machine, two runs of
    // 2026-11-27), so the bound leaves room for the allocator (16 shard threads' arenas).
    assert!(
        after[2] <= after[1] + (12 << 10),
        "server memory grew from wave to wave: {after:?} KiB"
    );
    assert!(
        after[2] <= b.rss_kib + (64 << 10),
        "server memory {} -> {} MiB",
        b.rss_kib >> 10,
        after[2] >> 10
    );
}

/// One wave of R8b: the loads, the rails sampled, the checks, the server back to baseline.
fn r8b_wave(lab: &mut Lab, row: &mut Row, wave: usize) {
    const SERVER_SHARDS: usize = 16;
    const PROCS: usize = 4;
    const NODES: usize = 8;
    const ENDPOINTS: usize = SERVER_SHARDS * PROCS * NODES;
    const LOAD_SECS: u64 = 15;
    let t0 = Instant::now();
    let procs: Vec<(String, usize)> = (0..PROCS)
        .map(|p| {
            let name = format!("w{wave}-h{}-{p}", 1 + p % 2);
            let extra = [
                "--nodes",
                &NODES.to_string(),
                "--target-shards",
                &SERVER_SHARDS.to_string(),
                "--window",
                "1",
                "--pause-ms",
                "100",
                "--deadline-ms",
                "5000",
            ];
            let i = lab.start_load_with(1 + p % 2, &name, LOAD_SECS, &extra);
            (name, i)
        })
        .collect();
    // The server's ready rails, sampled until the loads end.
    let ready = |lab: &Lab| {
        lab.gauges()
            .get("shardcx_rails{state=ready}")
            .copied()
            .unwrap_or(0.0) as usize
    };
    let (mut peak, mut all_at, mut held_from, mut held_for) = (0, None, None, Duration::ZERO);
    let (mut fds_peak, mut rss_peak) = (0, 0);
    while t0.elapsed() < Duration::from_secs(LOAD_SECS + 2) {
        let n = ready(lab);
        peak = peak.max(n);
        fds_peak = fds_peak.max(lab.server_fds());
        rss_peak = rss_peak.max(lab.server_rss_kib());
        if n >= ENDPOINTS {
            all_at.get_or_insert(t0.elapsed());
            let from = *held_from.get_or_insert(t0.elapsed());
            held_for = held_for.max(t0.elapsed() - from);
        } else {
            held_from = None;
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let b = lab.baseline.unwrap();
    row.fig(format!(
        "wave {wave}: {peak} rails ready at the peak, all {ENDPOINTS} after {} ms, held together {} ms; \
         server fds {} -> {fds_peak} and {} MiB at the peak",
        all_at.map_or(-1, |d| d.as_millis() as i64),
        held_for.as_millis(),
        b.fds,
        rss_peak >> 10
    ));
    // Calls served per server shard, from its counters (every rail carried calls).
    let text = output(&[
        "ip",
        "netns",
        "exec",
        &lab.ns("h0"),
        fault_peer().to_str().unwrap(),
        "scrape",
        "--at",
        METRICS,
    ])
    .unwrap();
    let mut per_shard: BTreeMap<String, f64> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("shardcx_messages_in_total{") {
            if rest.contains("kind=\"rpc\"") {
                let shard = rest.split('"').nth(1).unwrap_or("?").to_owned();
                let v: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
                *per_shard.entry(shard).or_default() += v;
            }
        }
    }
    let (mut total_ok, mut retries) = (0, 0);
    for (name, i) in &procs {
        let s = lab.summary(*i, Duration::from_secs(60));
        assert!(s.failed().is_empty(), "{name}: failed calls: {}", s.0);
        s.assert_none_late(name);
        total_ok += s.n("ok");
        retries += s.n("connect_retries");
        // Every node of the process answered.
        let nodes: HashSet<String> = lab.acked(name).into_iter().map(|a| a.0).collect();
        assert_eq!(
            nodes.len(),
            NODES,
            "{name}: not every node was answered: {}",
            s.0
        );
    }
    let least = per_shard.values().copied().fold(f64::MAX, f64::min);
    row.fig(format!(
        "wave {wave}: {total_ok} calls answered, none failed ({retries} connects tried again); \
         each of the {} server shards served at least {least} calls",
        per_shard.len()
    ));
    assert!(
        peak >= ENDPOINTS,
        "the server never held {ENDPOINTS} rails at once (peak {peak})"
    );
    assert!(
        all_at.is_some_and(|d| d <= Duration::from_secs(10)),
        "all {ENDPOINTS} rails ready only after {all_at:?}"
    );
    assert!(
        held_for >= Duration::from_secs(3),
        "{ENDPOINTS} rails held together only {held_for:?}"
    );
    assert_eq!(per_shard.len(), SERVER_SHARDS, "{per_shard:?}");
    assert!(least >= (PROCS * NODES) as f64, "{per_shard:?}");
    lab.check_oracles(row, &[]);
    lab.check_baseline(row, Duration::from_secs(10));
}

/// R11: cross-shard forwarding cycles in one process (3 shards, every shard forwarding to every
/// other, each job forwarding once more to the next shard) through lanes of capacity 1 and
/// 1,024: no deadlock (completions grow every second, watched from outside), nesting depth 2
/// and never more, every answer from the right shard.
#[test]
fn r11_forwarding_cycles_on_tiny_and_large_lanes_always_progress() {
    use shardcx::shards::{Placement, ShardCtx, ShardsBuilder};
    use shardcx::ShardId;
    use std::rc::Rc;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::Arc;
    let _g = serial();
    let mut row = Row::new("R11", "forwarding cycles, lanes of capacity 1 and 1,024");
    if cfg!(debug_assertions) {
        row.skipped = Some("the suite runs once, in release".into());
        return;
    }
    const SHARDS: usize = 3;
    const PER_PAIR: u64 = 3000;
    for capacity in [1, 1024] {
        let done = Arc::new(AtomicU64::new(0));
        let d = done.clone();
        let set = std::thread::spawn(move || {
            ShardsBuilder::new()
                .shard_count(SHARDS)
                .placement(Placement::Unpinned)
                .transports("sm,self")
                .lane_capacity(capacity)
                .run(move |ctx: Rc<ShardCtx>| {
                    let done = d.clone();
                    async move {
                        let me = ctx.id().index();
                        let sid = |i: usize| ShardId::new(i as u16);
                        let mut tasks = Vec::new();
                        for to in (0..SHARDS).filter(|&j| j != me) {
                            for i in 0..PER_PAIR {
                                let (ctx, done) = (ctx.clone(), done.clone());
                                tasks.push(glommio::spawn_local(async move {
                                    let r = ctx
                                        .forward(sid(to), move |c| async move {
                                            let next = sid((c.id().index() + 1) % SHARDS);
                                            let (there, depth) = c
                                                .forward(next, |c| async move {
                                                    (c.id(), c.forward_depth())
                                                })
                                                .await
                                                .map_err(|e| e.to_string())?;
                                            if there != next || depth != 2 {
                                                return Err(format!(
                                                    "answered by {there:?} at depth {depth}"
                                                ));
                                            }
                                            Ok(i ^ c.id().index() as u64)
                                        })
                                        .await;
                                    done.fetch_add(1, Ordering::Relaxed);
                                    match r {
                                        Ok(Ok(v)) if v == i ^ to as u64 => Ok(()),
                                        Ok(Ok(v)) => Err(format!("wrong answer {v}")),
                                        Ok(Err(e)) => Err(e),
                                        Err(e) => Err(e.to_string()),
                                    }
                                }));
                            }
                        }
                        let mut errors = Vec::new();
                        for t in tasks {
                            if let Err(e) = t.await {
                                errors.push(e);
                            }
                        }
                        errors
                    }
                })
        });
        let total = (SHARDS * (SHARDS - 1)) as u64 * PER_PAIR;
        let t0 = Instant::now();
        let (mut last, mut last_change, mut worst_gap) = (0, Instant::now(), Duration::ZERO);
        while !set.is_finished() {
            std::thread::sleep(Duration::from_millis(100));
            let now = done.load(Ordering::Relaxed);
            if now != last {
                (last, last_change) = (now, Instant::now());
            }
            worst_gap = worst_gap.max(last_change.elapsed());
            assert!(
                last_change.elapsed() < Duration::from_secs(1) || now == total,
                "capacity {capacity}: no forward completed for 1 s ({now} of {total} done)"
            );
            assert!(
                t0.elapsed() < Duration::from_secs(60),
                "capacity {capacity}: over 60 s"
            );
        }
        let errors: Vec<String> = set
            .join()
            .expect("the shard set panicked")
            .expect("the shards did not start")
            .into_iter()
            .flatten()
            .collect();
        row.fig(format!(
            "capacity {capacity}: {total} nested forwards in {} ms, longest pause {} ms",
            t0.elapsed().as_millis(),
            worst_gap.as_millis()
        ));
        assert!(
            errors.is_empty(),
            "capacity {capacity}: {:?}",
            &errors[..errors.len().min(5)]
        );
        assert_eq!(done.load(Ordering::Relaxed), total);
    }
}

/// R1: the fuzz smoke. Each decoder's fuzz entry point (`shardcx::proto::fuzzing`: frames,
/// handshakes, RMA, RPC) replays its committed corpus (`shards/proto/fuzz/corpus`), then runs on
/// inputs mutated from it with the seed (bit flips, random bytes, cuts, growth, splices, lengths
/// set to edge values) for 2 s or 200,000 inputs each. A panic (a broken decoder contract) fails
/// with the input in hex; so does any input that takes more than 1 s. (A libFuzzer run needs
/// nightly and cargo-fuzz: `shards/proto/fuzz/README.md`; this smoke runs on stable.)
#[test]
fn r1_fuzz_smoke_corpora_replayed_and_mutated() {
    type Target = fn(&[u8]) -> bool;
    // Alone: its CPU would slow the lab's processes on a small machine.
    let _g = serial();
    let mut row = Row::new(
        "R1",
        "corpora replayed, then seeded mutations of each decoder",
    );
    if cfg!(debug_assertions) {
        row.skipped = Some("the suite runs once, in release".into());
        return;
    }
    use shardcx::proto::fuzzing;
    let targets: [(&str, Target); 4] = [
        ("frame", fuzzing::frame),
        ("handshake", fuzzing::handshake),
        ("rma", fuzzing::rma),
        ("rpc", fuzzing::rpc),
    ];
    let corpora = Path::new(env!("CARGO_MANIFEST_DIR")).join("shards/proto/fuzz/corpus");
    for (name, target) in targets {
        let mut rng = Rng::new(name);
        let mut corpus: Vec<Vec<u8>> = std::fs::read_dir(corpora.join(name))
            .unwrap_or_else(|e| panic!("corpus {name}: {e}"))
            .map(|e| std::fs::read(e.unwrap().path()).unwrap())
            .collect();
        assert!(!corpus.is_empty(), "corpus {name} is empty");
        corpus.sort();
        let run_one = |input: &[u8]| {
            let t0 = Instant::now();
            let r = std::panic::catch_unwind(|| target(input));
            let took = t0.elapsed();
            let hex: String = input.iter().map(|b| format!("{b:02x}")).collect();
            let decoded = r.unwrap_or_else(|_| {
                panic!(
                    "{name}: the decoder's contract broke on input {hex} (seed {})",
                    seed()
                )
            });
            assert!(
                took <= Duration::from_secs(1),
                "{name}: input {hex} took {took:?} (seed {})",
                seed()
            );
            decoded
        };
        let replayed = corpus.iter().filter(|c| run_one(c)).count();
        let t0 = Instant::now();
        let (mut runs, mut decoded) = (0u64, 0u64);
        while t0.elapsed() < Duration::from_secs(2) && runs < 200_000 {
            let mut input = corpus[(rng.next() % corpus.len() as u64) as usize].clone();
            for _ in 0..1 + rng.next() % 4 {
                mutate(&mut input, &corpus, &mut rng);
            }
            decoded += u64::from(run_one(&input));
            runs += 1;
        }
        row.fig(format!(
            "{name}: {} seeds ({replayed} decode), {runs} mutants ({decoded} decode)",
            corpus.len()
        ));
    }
}

/// One mutation of `input`: a bit flipped, a byte set, a cut, random bytes added, a splice
/// with another corpus entry, or a 32-bit word set to an edge value.
fn mutate(input: &mut Vec<u8>, corpus: &[Vec<u8>], rng: &mut Rng) {
    let at = |rng: &mut Rng, len: usize| (rng.next() % len.max(1) as u64) as usize;
    match rng.next() % 6 {
        0 if !input.is_empty() => {
            let i = at(rng, input.len());
            input[i] ^= 1 << (rng.next() % 8);
        }
        1 if !input.is_empty() => {
            let i = at(rng, input.len());
            input[i] = rng.next() as u8;
        }
        2 => {
            let n = at(rng, input.len() + 1);
            input.truncate(n);
        }
        3 => {
            for _ in 0..1 + rng.next() % 32 {
                input.push(rng.next() as u8);
            }
        }
        4 => {
            let other = &corpus[at(rng, corpus.len())];
            let (cut, from) = (at(rng, input.len() + 1), at(rng, other.len() + 1));
            input.truncate(cut);
            input.extend_from_slice(&other[from..]);
        }
        _ if input.len() >= 4 => {
            let edges = [
                0u32,
                1,
                0x7fff_ffff,
                0x8000_0000,
                u32::MAX,
                input.len() as u32 + 1,
            ];
            let v = edges[at(rng, edges.len())];
            let i = at(rng, input.len() - 3);
            input[i..i + 4].copy_from_slice(&v.to_le_bytes());
        }
        _ => input.push(rng.next() as u8),
    }
}
