//! The reliability suite of `../shared/RELIABILITY.md` (issue 15), across processes in network
//! namespaces made here: `h0` runs the journaling server (`examples/fault_peer.rs serve`), `h1`
//! and `h2` run load clients (`fault_peer load`), all on a bridge in a namespace of its own;
//! faults are injected with `kill -STOP`/`-CONT`, `kill -9` and nftables rules inside `h0`.
//!
//! After each test the oracles are checked: every acknowledged call is in the server's journal,
//! no call is journaled twice, every journaled payload's CRC matched, no call ended later than
//! its deadline + 250 ms, and the control pair (`h2`) saw no failure when the fault was not
//! its own. The figures (detection and recovery times) are printed.
//!
//! Tests here so far: R3 (kill -9 and restart), R4 (partition and heal), R6 (a stopped peer).
//! They need root (network namespaces, nftables): without it each prints `SKIPPED (R0 ...)` with
//! the reason and passes, counted in the output. One test at a time (the 2-core machine).

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::collections::{HashMap, HashSet};
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

mod common;
use common::serial;

/// The example binary (built by `cargo test` for the examples' sake: see `scripts/test`).
fn fault_peer() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    // target/<profile>/deps/reliability-<hash> -> target/<profile>/examples/fault_peer
    exe.parent()
        .and_then(Path::parent)
        .map(|p| p.join("examples").join("fault_peer"))
        .unwrap()
}

fn run(cmd: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd[0])
        .args(&cmd[1..])
        .output()
        .map_err(|e| format!("{}: {e}", cmd.join(" ")))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!(
            "{}: {}",
            cmd.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        ))
    }
}

/// R0, preflight: what the suite needs, or why it cannot run here.
fn preflight() -> Result<(), String> {
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

/// Skips the test (printing why) when the preflight fails.
macro_rules! require_lab {
    ($id:literal) => {
        if cfg!(debug_assertions) {
            eprintln!(
                "SKIPPED ({}): the suite runs once, in release (scripts/test, scripts/faults)",
                $id
            );
            return;
        }
        if let Err(why) = preflight() {
            eprintln!("SKIPPED ({} preflight, R0): {why}", $id);
            return;
        }
    };
}

/// Three hosts on a bridge, each a namespace; removed on drop.
struct Lab {
    tag: String,
    dir: PathBuf,
    children: Vec<Child>,
}

const PORT: u16 = 7100;

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
        };
        let sw = lab.ns("sw");
        run(&["ip", "netns", "add", &sw]).unwrap();
        run(&["ip", "-n", &sw, "link", "add", "br0", "type", "bridge"]).unwrap();
        run(&["ip", "-n", &sw, "link", "set", "br0", "up"]).unwrap();
        for h in 0..3 {
            let ns = lab.ns(&format!("h{h}"));
            let (vh, vs) = (format!("vh{h}-{}", lab.tag), format!("vs{h}-{}", lab.tag));
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

    fn ip(h: usize) -> String {
        format!("10.201.0.{}", h + 1)
    }

    fn server_addr() -> String {
        format!("{}:{PORT}", Lab::ip(0))
    }

    fn journal(&self) -> PathBuf {
        self.dir.join("journal")
    }

    /// Starts the server in `h0`; waits for its `listening` line. Returns its index.
    fn start_server(&mut self) -> usize {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns("h0")])
            .arg(fault_peer())
            .args(["serve", "--listen", &Lab::server_addr(), "--journal"])
            .arg(self.journal())
            .args(["--for", "120"])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let line = lines.next().expect("the server ended").unwrap();
        assert!(line.starts_with("listening "), "{line}");
        self.children.push(child);
        self.children.len() - 1
    }

    /// Starts a load client in host `h` for `secs`, logging acknowledgements to `acked-h<h>`.
    fn start_load(&mut self, h: usize, secs: u64, deadline_ms: u64) -> usize {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(&format!("h{h}"))])
            .arg(fault_peer())
            .args(["load", "--connect", &Lab::server_addr(), "--acked"])
            .arg(self.dir.join(format!("acked-h{h}")))
            .args(["--for", &secs.to_string()])
            .args(["--deadline-ms", &deadline_ms.to_string()])
            .args(["--src", &h.to_string()])
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        self.children.push(child);
        self.children.len() - 1
    }

    fn pid(&self, i: usize) -> String {
        self.children[i].id().to_string()
    }

    fn signal(&self, i: usize, sig: &str) {
        run(&["kill", sig, &self.pid(i)]).unwrap();
    }

    /// Waits (bounded) for a load client's summary line.
    fn summary(&mut self, i: usize, limit: Duration) -> Summary {
        let until = Instant::now() + limit;
        loop {
            if let Some(status) = self.children[i].try_wait().unwrap() {
                assert!(status.success(), "load client failed: {status}");
                break;
            }
            assert!(
                Instant::now() < until,
                "load client still runs after {limit:?}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut out = String::new();
        use std::io::Read;
        self.children[i]
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        Summary(serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{e}: {out}")))
    }

    /// Drops everything from and to host `h` at `h0` (both directions), or heals.
    fn partition(&self, h: usize, on: bool) {
        let ns = self.ns("h0");
        if on {
            let ip = Lab::ip(h);
            for cmd in [
                "add table inet sxfault".to_owned(),
                "add chain inet sxfault in { type filter hook input priority 0 ; }".to_owned(),
                "add chain inet sxfault out { type filter hook output priority 0 ; }".to_owned(),
                format!("add rule inet sxfault in ip saddr {ip} drop"),
                format!("add rule inet sxfault out ip daddr {ip} drop"),
            ] {
                let args: Vec<&str> = cmd.split(' ').collect();
                let mut full = vec!["ip", "netns", "exec", &ns, "nft"];
                full.extend(args);
                run(&full).unwrap();
            }
        } else {
            run(&[
                "ip", "netns", "exec", &ns, "nft", "delete", "table", "inet", "sxfault",
            ])
            .unwrap();
        }
    }

    /// Checks the oracles on the journal and every host's acknowledgements; returns the
    /// acknowledgement times (ms from the client's start) of host `h`.
    fn check_oracles(&self) {
        let journal = std::fs::read_to_string(self.journal()).unwrap_or_default();
        let mut delivered = HashSet::new();
        for line in journal.lines() {
            let f: Vec<&str> = line.split(' ').collect();
            assert_eq!(f.len(), 4, "journal line {line:?}");
            assert_eq!(f[3], "ok", "a payload's CRC did not match: {line}");
            let key = (f[0].to_owned(), f[1].to_owned(), f[2].to_owned());
            assert!(delivered.insert(key), "delivered twice: {line}");
        }
        for h in 1..3 {
            for line in self.acked(h) {
                let key = (line.0.clone(), line.1.clone(), line.2.clone());
                assert!(
                    delivered.contains(&key),
                    "acknowledged but not delivered: {line:?}"
                );
            }
        }
        eprintln!(
            "oracles held: {} calls journaled once each, every acknowledged one among them",
            delivered.len()
        );
    }

    /// Host `h`'s acknowledgements: (src, inc, seq, ms).
    fn acked(&self, h: usize) -> Vec<(String, String, String, u64)> {
        std::fs::read_to_string(self.dir.join(format!("acked-h{h}")))
            .unwrap_or_default()
            .lines()
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
        let _ = std::fs::remove_dir_all(&self.dir);
    }
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
}

/// The first acknowledgement of host `h` at or after `ms`, in ms.
fn first_ack_after(lab: &Lab, h: usize, ms: u64) -> Option<u64> {
    lab.acked(h).iter().map(|a| a.3).filter(|t| *t >= ms).min()
}

/// R6: the server stopped (SIGSTOP) for 10 s under load, then continued. Its death is seen
/// within 1 s (+ slack) by the client, whose calls all end by their deadline; calls succeed
/// again after it continues; nothing acknowledged is lost or delivered twice.
#[test]
fn r6_a_stopped_peer_is_declared_dead_and_comes_back() {
    let _g = serial();
    require_lab!("R6");
    let mut lab = Lab::new();
    let server = lab.start_server();
    let load = lab.start_load(1, 20, 5000);
    std::thread::sleep(Duration::from_secs(3));
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
    let back = first_ack_after(&lab, 1, cont_at).map(|t| t.saturating_sub(cont_at));
    eprintln!("R6: stop seen after {detect} ms (calls have a 5 s deadline); first ack {back:?} ms after SIGCONT");
    assert_eq!(
        s.n("late"),
        0,
        "calls ended after deadline + 250 ms: {}",
        s.0
    );
    assert!(detect <= 1_500, "stop seen only after {detect} ms");
    assert!(
        back.is_some_and(|b| b <= 3_000),
        "no ack within 3 s after SIGCONT: {back:?}"
    );
    assert!(s.n("ok") > 0);
    lab.check_oracles();
}

/// R4: `h1` partitioned from `h0` for 8 s while `h2` (the control pair) keeps calling, then
/// healed. `h1` sees the partition within 1 s (+ slack), its calls end by their deadline, it is
/// back within 3 s of the heal; `h2` sees no failure at all.
#[test]
fn r4_a_partition_is_detected_and_heals_and_the_control_pair_is_untouched() {
    let _g = serial();
    require_lab!("R4");
    let mut lab = Lab::new();
    lab.start_server();
    let load = lab.start_load(1, 16, 5000);
    let control = lab.start_load(2, 16, 5000);
    std::thread::sleep(Duration::from_secs(3));
    let cut_at = unix_ms();
    lab.partition(1, true);
    std::thread::sleep(Duration::from_secs(8));
    let heal_at = unix_ms();
    lab.partition(1, false);
    let s = lab.summary(load, Duration::from_secs(60));
    let c = lab.summary(control, Duration::from_secs(60));
    eprintln!("R4 summary h1: {}\nR4 summary h2 (control): {}", s.0, c.0);
    let (cut_at, heal_at) = (s.rel(cut_at), s.rel(heal_at));
    let first_error = s.0["first_error_ms"]
        .as_u64()
        .expect("no call failed in the partition");
    let detect = first_error.saturating_sub(cut_at);
    let back = first_ack_after(&lab, 1, heal_at).map(|t| t.saturating_sub(heal_at));
    eprintln!("R4: partition seen after {detect} ms; first ack {back:?} ms after the heal");
    assert_eq!(s.n("late"), 0, "{}", s.0);
    assert!(detect <= 1_500, "partition seen only after {detect} ms");
    assert!(
        back.is_some_and(|b| b <= 3_000),
        "no ack within 3 s of the heal: {back:?}"
    );
    assert!(c.failed().is_empty(), "the control pair failed: {}", c.0);
    assert_eq!(c.n("late"), 0);
    assert!(c.n("ok") > 0);
    lab.check_oracles();
}

/// R3: the server killed (-9) under load and restarted at once, three rounds. Each death is seen
/// within 1 s, every call ends by its deadline, the client works again with the new
/// incarnation, and no call is lost or delivered twice across the restarts.
#[test]
fn r3_kill_9_and_restart_loses_and_duplicates_nothing() {
    let _g = serial();
    require_lab!("R3");
    let mut lab = Lab::new();
    let mut server = lab.start_server();
    let load = lab.start_load(1, 16, 2000);
    let mut kills = Vec::new();
    for _ in 0..3 {
        std::thread::sleep(Duration::from_secs(3));
        kills.push(unix_ms());
        lab.signal(server, "-KILL");
        let _ = lab.children[server].wait();
        std::thread::sleep(Duration::from_millis(500));
        server = lab.start_server();
    }
    let s = lab.summary(load, Duration::from_secs(60));
    eprintln!("R3 summary: {}", s.0);
    let kills: Vec<u64> = kills.iter().map(|k| s.rel(*k)).collect();
    assert_eq!(s.n("late"), 0, "{}", s.0);
    let acked = lab.acked(1);
    for (round, k) in kills.iter().enumerate() {
        let back = acked
            .iter()
            .map(|a| a.3)
            .filter(|t| *t > k + 500)
            .min()
            .map(|t| t - k);
        eprintln!(
            "R3 round {round}: first ack {back:?} ms after the kill (restart 500 ms after it)"
        );
        assert!(back.is_some_and(|b| b <= 4_000), "round {round}: {back:?}");
    }
    let first_error = s.0["first_error_ms"].as_u64().expect("no call failed");
    assert!(
        first_error.saturating_sub(kills[0]) <= 1_000 + 500,
        "first death seen after {} ms",
        first_error.saturating_sub(kills[0])
    );
    lab.check_oracles();
}
