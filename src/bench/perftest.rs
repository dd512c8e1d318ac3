//! `shardcx bench --vs-perftest`: UCX's own `ucx_perftest`, run on the same transport, pinning,
//! sizes and iteration counts as the matching shardcx tests, for a ratio shardcx/perftest.
//!
//! The mapping and the way perftest is started follow `scripts/compare-perftest`:
//!
//! | shardcx | ucx_perftest | compared on |
//! | --- | --- | --- |
//! | `am-lat` | `ucp_am_lat` | p50 round trip (perftest prints half a round trip: doubled) |
//! | `am-rate` | `ucp_am_bw` | messages per second |
//! | `am-bw` | `ucp_am_bw` | MB/s (perftest's MiB/s converted to 10^6 bytes/s) |
//! | `tag-lat` | `tag_lat` | p50 round trip (doubled) |
//! | `put-bw` | `ucp_put_bw` | MB/s |
//!
//! Other tests have no counterpart. The server (`ucx_perftest -p PORT`) is pinned (`-c`) like
//! the local peer's shard 0 and the client (`ucx_perftest 127.0.0.1 -p PORT -t TEST -s SIZE -n
//! ITERS -w WARMUP`) like client shard 0, with `UCX_TLS` as shardcx sets it (`sm,tcp` for
//! `shm`, `tcp` for `tcp`, left alone for `auto`). The client's `Final:` line has the figures.
//! A perftest that fails or runs past its time limit is killed (the server too) and its row
//! says why; it never stops the bench.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Figures, Test, Transport};

/// How long a client that cannot reach its server yet (connection refused) keeps trying.
const CONNECT_FOR: Duration = Duration::from_secs(10);
/// How long the server may take to exit after its client did.
const SERVER_EXIT: Duration = Duration::from_secs(5);
/// How often a running perftest is looked at.
const POLL: Duration = Duration::from_millis(10);

/// What a shardcx test is compared on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    /// Median round trip, microseconds (lower is better).
    P50Us,
    /// Messages per second (higher is better).
    MsgsPerS,
    /// 10^6 bytes per second (higher is better).
    MbPerS,
}

/// A shardcx test's `ucx_perftest` counterpart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counterpart {
    /// perftest's test name (`-t`).
    pub test: &'static str,
    /// What the two are compared on.
    pub metric: Metric,
}

/// What one `ucx_perftest` run measured (the client's `Final:` line).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PerftestFigures {
    /// Median latency in microseconds: a round trip (perftest's figure doubled) for the
    /// latency tests, perftest's own per-message figure otherwise.
    pub p50_us: f64,
    /// Messages per second, overall.
    pub msgs_per_s: f64,
    /// 10^6 bytes per second, overall (perftest prints MiB/s).
    pub mb_per_s: f64,
}

/// The perftest side of one (test, size, transport).
#[derive(Debug, Clone, PartialEq)]
pub struct Perftest {
    /// Which perftest test ran, and what the comparison uses.
    pub counterpart: Counterpart,
    /// Iterations asked for (`-n`): client shard 0's measured messages.
    pub iters: u64,
    /// Its figures, or why there are none.
    pub outcome: Result<PerftestFigures, String>,
}

/// The `ucx_perftest` to run.
#[derive(Debug, Clone)]
pub struct Binary {
    /// The program.
    pub path: PathBuf,
    /// The UCX lib directory it is started with (`LD_LIBRARY_PATH`), when it is the one of the
    /// loaded UCX's build.
    pub lib_dir: Option<PathBuf>,
    /// Why it is not the loaded UCX's own, when it is not.
    pub warning: Option<String>,
}

/// One perftest run: what [`run`] needs.
#[derive(Debug, Clone)]
pub struct RunConfig<'a> {
    /// The program.
    pub binary: &'a Binary,
    /// Transport, as for shardcx.
    pub transport: Transport,
    /// CPU of the server (the local peer's shard 0's), if pinned.
    pub server_cpu: Option<usize>,
    /// CPU of the client (client shard 0's), if pinned.
    pub client_cpu: Option<usize>,
    /// perftest's test and metric.
    pub counterpart: Counterpart,
    /// Message size, bytes.
    pub size: usize,
    /// Measured iterations (`-n`).
    pub iters: u64,
    /// Warm-up iterations (`-w`).
    pub warmup: u64,
    /// Time limit of the client; the server gets a few seconds more to exit.
    pub timeout: Duration,
}

/// A child process whose output is read on threads (so that a full pipe never stalls it).
struct Watched {
    child: Child,
    stdout: Option<JoinHandle<String>>,
    stderr: Option<JoinHandle<String>>,
}

impl Metric {
    /// The metric's field name in JSON.
    pub fn name(self) -> &'static str {
        match self {
            Metric::P50Us => "p50_us",
            Metric::MsgsPerS => "msgs_per_s",
            Metric::MbPerS => "mb_per_s",
        }
    }

    /// Its unit, for table headings.
    pub fn unit(self) -> &'static str {
        match self {
            Metric::P50Us => "p50 round trip, µs",
            Metric::MsgsPerS => "msgs/s",
            Metric::MbPerS => "MB/s",
        }
    }

    /// shardcx's value.
    pub fn of(self, f: &Figures) -> f64 {
        match self {
            Metric::P50Us => f.quantile_us(0.5),
            Metric::MsgsPerS => f.msgs_per_s(),
            Metric::MbPerS => f.mb_per_s(),
        }
    }

    /// perftest's value.
    pub fn of_perftest(self, f: &PerftestFigures) -> f64 {
        match self {
            Metric::P50Us => f.p50_us,
            Metric::MsgsPerS => f.msgs_per_s,
            Metric::MbPerS => f.mb_per_s,
        }
    }
}

impl Perftest {
    /// shardcx's figure over perftest's, on the counterpart's metric (`None` when perftest has
    /// no figure, or a zero one).
    pub fn ratio(&self, shardcx: &Figures) -> Option<f64> {
        let theirs = self
            .counterpart
            .metric
            .of_perftest(self.outcome.as_ref().ok()?);
        (theirs > 0.0).then(|| self.counterpart.metric.of(shardcx) / theirs)
    }
}

impl Watched {
    fn spawn(cmd: &mut Command) -> std::io::Result<Self> {
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let read = |r: Option<Box<dyn Read + Send>>| {
            r.map(|mut r| {
                std::thread::spawn(move || {
                    let mut s = String::new();
                    let _ = r.read_to_string(&mut s);
                    s
                })
            })
        };
        let stdout = read(child.stdout.take().map(|o| Box::new(o) as _));
        let stderr = read(child.stderr.take().map(|e| Box::new(e) as _));
        Ok(Self {
            child,
            stdout,
            stderr,
        })
    }

    /// Waits until `deadline` for the process to exit; kills it after that (`None`).
    fn wait_until(&mut self, deadline: Instant) -> Option<ExitStatus> {
        loop {
            match self.child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(POLL),
                _ => {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    return None;
                }
            }
        }
    }

    /// Its output, once it has exited (or been killed): stdout and stderr.
    fn output(&mut self) -> (String, String) {
        let join =
            |h: Option<JoinHandle<String>>| h.and_then(|h| h.join().ok()).unwrap_or_default();
        (join(self.stdout.take()), join(self.stderr.take()))
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        // No perftest outlives its run, whatever happened.
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The perftest counterpart of `test`, if it has one (see the module docs).
pub fn counterpart(test: Test) -> Option<Counterpart> {
    let (name, metric) = match test {
        Test::AmLat => ("ucp_am_lat", Metric::P50Us),
        Test::AmRate => ("ucp_am_bw", Metric::MsgsPerS),
        Test::AmBw => ("ucp_am_bw", Metric::MbPerS),
        Test::TagLat => ("tag_lat", Metric::P50Us),
        Test::PutBw => ("ucp_put_bw", Metric::MbPerS),
        Test::RpcLat
        | Test::RpcLatInline
        | Test::RpcRate
        | Test::RpcRateInline
        | Test::RpcNotify
        | Test::GetBw
        | Test::PutTrustedBw
        | Test::Hop => return None,
    };
    Some(Counterpart { test: name, metric })
}

/// Finds `ucx_perftest`: `../bin/ucx_perftest` beside the loaded `libucp` (`library`, from
/// [`crate::ucx::version`]), else the first on `PATH` (with a warning: another UCX build, so
/// not like for like), else an error that says where it looked.
pub fn find(library: Option<&str>) -> Result<Binary, String> {
    let lib_dir = library
        .map(Path::new)
        .and_then(Path::parent)
        .map(Path::to_path_buf);
    if let Some(dir) = &lib_dir {
        let own = dir.join("../bin/ucx_perftest");
        if own.is_file() {
            return Ok(Binary {
                path: own,
                lib_dir: lib_dir.clone(),
                warning: None,
            });
        }
    }
    let beside = match &lib_dir {
        Some(dir) => format!("no ucx_perftest in {}", dir.join("../bin").display()),
        None => "the loaded libucp's file is unknown".to_string(),
    };
    let on_path = std::env::var_os("PATH").and_then(|p| {
        std::env::split_paths(&p)
            .map(|d| d.join("ucx_perftest"))
            .find(|f| f.is_file())
    });
    match on_path {
        Some(path) => Ok(Binary {
            warning: Some(format!(
                "{beside} (the loaded UCX's build); using {}, from another UCX build: the \
                 comparison is not like for like",
                path.display()
            )),
            path,
            lib_dir: None,
        }),
        None => Err(format!("--vs-perftest: {beside}, and none on PATH")),
    }
}

/// Runs one perftest server and client (see the module docs) and reads the client's figures.
pub fn run(cfg: &RunConfig<'_>) -> Result<PerftestFigures, String> {
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .map_err(|e| format!("no free port for ucx_perftest: {e}"))?
        .port()
        .to_string();
    let command = |cpu: Option<usize>| {
        let mut c = Command::new(&cfg.binary.path);
        c.args(["-p", &port]);
        if let Some(cpu) = cpu {
            c.args(["-c", &cpu.to_string()]);
        }
        if let Some(tls) = cfg.transport.tls() {
            c.env("UCX_TLS", tls);
        }
        if let Some(dir) = &cfg.binary.lib_dir {
            let mut paths = vec![dir.clone()];
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                paths.extend(std::env::split_paths(&old));
            }
            if let Ok(joined) = std::env::join_paths(paths) {
                c.env("LD_LIBRARY_PATH", joined);
            }
        }
        c
    };
    let mut server = Watched::spawn(&mut command(cfg.server_cpu))
        .map_err(|e| format!("cannot start {}: {e}", cfg.binary.path.display()))?;
    let started = Instant::now();
    let deadline = started + cfg.timeout;
    let client = loop {
        let mut c = command(cfg.client_cpu);
        c.arg("127.0.0.1")
            .args(["-t", cfg.counterpart.test])
            .args(["-s", &cfg.size.to_string()])
            .args(["-n", &cfg.iters.to_string()])
            .args(["-w", &cfg.warmup.to_string()]);
        let mut client = Watched::spawn(&mut c)
            .map_err(|e| format!("cannot start {}: {e}", cfg.binary.path.display()))?;
        let status = client.wait_until(deadline);
        let (out, err) = client.output();
        // The server may not listen yet: try again while it runs (UCX logs to stdout).
        let refused = err.contains("Connection refused") || out.contains("Connection refused");
        let server_alive = matches!(server.child.try_wait(), Ok(None));
        if refused && server_alive && started.elapsed() < CONNECT_FOR {
            std::thread::sleep(Duration::from_millis(50));
            continue;
        }
        break (status, out, err);
    };
    let (status, out, err) = client;
    // A server whose client failed waits for another one for good: it is killed at once.
    let server_for = match status {
        Some(s) if s.success() => SERVER_EXIT,
        _ => Duration::ZERO,
    };
    let server_status = server.wait_until(Instant::now() + server_for);
    let (server_out, server_err) = server.output();
    let Some(status) = status else {
        return Err(format!(
            "ucx_perftest -t {} timed out after {:.0?} (killed)",
            cfg.counterpart.test, cfg.timeout
        ));
    };
    if let Some(f) = parse_final(&out, cfg.counterpart.metric == Metric::P50Us) {
        if status.success() {
            return Ok(f);
        }
    }
    // UCX logs to stdout, perftest's own complaints go to stderr.
    let why = [&out, &err, &server_out, &server_err]
        .into_iter()
        .find_map(|s| last_error(s))
        .unwrap_or_else(|| match last_line(&err).or_else(|| last_line(&out)) {
            Some(line) => format!("no figures ({status}): {line}"),
            None => format!("no figures ({status})"),
        });
    let server_note = if server_status.is_none() && !server_for.is_zero() {
        " (its server did not stop: killed)"
    } else {
        ""
    };
    Err(format!(
        "ucx_perftest -t {} failed: {why}{server_note}",
        cfg.counterpart.test
    ))
}

/// The figures of perftest's `Final:` line: iterations, then latency (typical, average,
/// overall; µs), bandwidth (average, overall; MiB/s), message rate (average, overall).
/// `round_trip`: a latency test, whose latency (half a round trip) is doubled.
pub fn parse_final(stdout: &str, round_trip: bool) -> Option<PerftestFigures> {
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("Final:"))?;
    let v: Vec<f64> = line
        .split_whitespace()
        .map(str::parse)
        .collect::<Result<_, _>>()
        .ok()?;
    let [_iters, typical, _avg, _overall, _bw_avg, bw_overall, _rate_avg, rate_overall] =
        v.as_slice()
    else {
        return None;
    };
    Some(PerftestFigures {
        p50_us: if round_trip { 2.0 * typical } else { *typical },
        msgs_per_s: *rate_overall,
        mb_per_s: bw_overall * 1.048576,
    })
}

/// The last line with something on it.
fn last_line(s: &str) -> Option<&str> {
    s.lines().rev().map(str::trim).find(|l| !l.is_empty())
}

/// The last UCX error line of perftest's stderr, without its time and place prefix.
fn last_error(stderr: &str) -> Option<String> {
    let line = stderr.lines().rev().find(|l| l.contains("ERROR"))?;
    let msg = line.split_once("ERROR ").map_or(line, |(_, m)| m);
    Some(msg.trim().to_string())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    const OUT: &str = "\
+--------------+--------------+------------------------------+---------------------+-----------------------+
|    Stage     | # iterations | 50.0%ile | average | overall |  average |  overall |  average  |  overall  |
+--------------+--------------+----------+---------+---------+----------+----------+-----------+-----------+
Final:                  1000      6.575    37.380    37.380        0.20       0.20       26753       26753
";

    #[test]
    fn reads_the_final_line_and_doubles_latency_for_round_trips() {
        let lat = parse_final(OUT, true).unwrap();
        assert_eq!(lat.p50_us, 13.15);
        assert_eq!(lat.msgs_per_s, 26753.0);
        assert!((lat.mb_per_s - 0.2 * 1.048576).abs() < 1e-9);
        assert_eq!(parse_final(OUT, false).unwrap().p50_us, 6.575);
        assert_eq!(parse_final("no figures here", true), None);
        assert_eq!(parse_final("Final: 1 2 3", true), None);
        assert_eq!(parse_final("Final: 1 2 3 4 5 6 7 x", true), None);
    }

    #[test]
    fn maps_the_tests_that_have_a_counterpart() {
        assert_eq!(counterpart(Test::AmLat).unwrap().test, "ucp_am_lat");
        assert_eq!(counterpart(Test::AmRate).unwrap().metric, Metric::MsgsPerS);
        assert_eq!(counterpart(Test::AmBw).unwrap().metric, Metric::MbPerS);
        assert_eq!(counterpart(Test::TagLat).unwrap().test, "tag_lat");
        assert_eq!(counterpart(Test::PutBw).unwrap().test, "ucp_put_bw");
        for t in [Test::RpcLat, Test::GetBw, Test::Hop, Test::PutTrustedBw] {
            assert_eq!(counterpart(t), None, "{t}");
        }
    }

    #[test]
    fn the_ratio_is_shardcx_over_perftest_on_the_metric() {
        let mut f = Figures::new(8);
        f.hist.record(10_000).unwrap();
        f.msgs = 1000;
        f.elapsed = Duration::from_millis(10);
        let p = |metric, outcome| Perftest {
            counterpart: Counterpart {
                test: "ucp_am_lat",
                metric,
            },
            iters: 1000,
            outcome,
        };
        let figs = PerftestFigures {
            p50_us: 5.0,
            msgs_per_s: 200_000.0,
            mb_per_s: 1.6,
        };
        let r = p(Metric::P50Us, Ok(figs)).ratio(&f).unwrap();
        assert!((r - 10.0 / 5.0).abs() < 0.01, "{r}");
        let r = p(Metric::MsgsPerS, Ok(figs)).ratio(&f).unwrap();
        assert!((r - 0.5).abs() < 1e-9, "{r}");
        assert_eq!(p(Metric::MbPerS, Err("failed".into())).ratio(&f), None);
    }

    #[test]
    fn error_lines_lose_their_prefix() {
        let err = "[1795551568.199833] [vm:12109:0]        perftest.c:404  UCX  ERROR client \
                   failed. connect() failed: Connection refused\n";
        assert_eq!(
            last_error(err).unwrap(),
            "client failed. connect() failed: Connection refused"
        );
        assert_eq!(last_error("all fine\n"), None);
    }

    /// A stand-in `ucx_perftest`: a shell script (server and client alike).
    fn fake(dir: &Path, name: &str, script: &str) -> Binary {
        use std::os::unix::fs::PermissionsExt;
        let path = dir.join(name);
        std::fs::write(&path, format!("#!/bin/sh\n{script}\n")).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        Binary {
            path,
            lib_dir: None,
            warning: None,
        }
    }

    #[test]
    fn a_perftest_that_hangs_or_fails_is_reported_not_waited_for() {
        let dir =
            std::env::temp_dir().join(format!("shardcx-fake-perftest-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cfg = |binary| RunConfig {
            binary,
            transport: Transport::Tcp,
            server_cpu: None,
            client_cpu: None,
            counterpart: counterpart(Test::AmLat).unwrap(),
            size: 8,
            iters: 10,
            warmup: 1,
            timeout: Duration::from_millis(300),
        };
        let started = Instant::now();
        let hangs = fake(&dir, "hangs", "exec sleep 30");
        let e = run(&cfg(&hangs)).unwrap_err();
        assert!(e.contains("timed out after 300ms (killed)"), "{e}");
        let fails = fake(
            &dir,
            "fails",
            "echo '[1.2] [vm:1:0] perftest.c:1 UCX ERROR no such transport'; exit 1",
        );
        let e = run(&cfg(&fails)).unwrap_err();
        assert!(e.ends_with("failed: no such transport"), "{e}");
        let works = fake(
            &dir,
            "works",
            "[ $# -gt 2 ] || exit 0; echo 'Final: 10 1.5 2 2 0.1 0.1 5 5'",
        );
        let f = run(&cfg(&works)).unwrap();
        assert_eq!(f.p50_us, 3.0);
        // Killed, not waited for (the hanging server included).
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "{:?}",
            started.elapsed()
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn finds_the_loaded_ucx_perftest_or_says_where_it_looked() {
        let dir = std::env::temp_dir().join(format!("shardcx-perftest-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("lib")).unwrap();
        std::fs::create_dir_all(dir.join("bin")).unwrap();
        let lib = dir.join("lib/libucp.so.0");
        let own = dir.join("bin/ucx_perftest");
        std::fs::write(&own, "").unwrap();
        let b = find(lib.to_str()).unwrap();
        assert_eq!(b.path, dir.join("lib/../bin/ucx_perftest"));
        assert_eq!(b.lib_dir.as_deref(), Some(dir.join("lib").as_path()));
        assert!(b.warning.is_none());
        std::fs::remove_file(&own).unwrap();
        // Without one beside the library: PATH's, with a warning, or an error naming both.
        match find(lib.to_str()) {
            Ok(b) => assert!(b.warning.unwrap().contains("not like for like")),
            Err(e) => assert!(e.contains("none on PATH") && e.contains("bin"), "{e}"),
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
