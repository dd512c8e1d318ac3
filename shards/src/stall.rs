//! Stall reports: what a shard's thread was doing while its driver was not polled.
//!
//! The driver's watchdog (see "The watchdog" in [`crate::driver`]) looks every
//! [`crate::driver::WATCH_SLICE`] whether the driver was polled since its last look. When it was
//! not for [`STALL_REPORT`] or longer, the shard did nothing else either: no timer fired, no
//! heartbeat went out, no deadline ended a call. Such a stall is logged (a `tracing` warning)
//! once it ends, with what the watchdog saw of the shard's thread at each look, read from
//! `/proc` (no signal, no ptrace): the scheduler state, the system call it was in, the kernel
//! function it waited in, and how its time split between running on a CPU and waiting for one.
//! That tells a blocking call (state `S`, say `connect`) from a busy task (CPU time grew by the
//! stall's length) from a starved thread (run-queue wait grew instead).
//!
//! [`StallStats`] counts them; `ShardCtx::driver_stalls` reads it.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The shortest stall that is reported and counted. A stall is measured from the last look that
/// found the driver polled to the first that finds it polled again (or a watch request from it),
/// so it can read up to one [`crate::driver::WATCH_SLICE`] short: a stall of 350 ms or more is
/// always reported.
pub const STALL_REPORT: Duration = Duration::from_millis(250);

/// At most this many distinct thread states are kept per stall (the rest are counted).
const MAX_STATES: usize = 6;

/// Stalls of one shard's driver (shared between the shard and its waker thread).
#[derive(Debug, Default)]
pub struct StallStats {
    /// Stalls of [`STALL_REPORT`] or longer, ended.
    pub stalls: AtomicU64,
    /// The longest of them, in milliseconds.
    pub longest_ms: AtomicU64,
}

/// The kernel's id of the calling thread, from `/proc/thread-self` ("PID/task/TID").
pub(crate) fn current_tid() -> Option<u32> {
    let link = std::fs::read_link("/proc/thread-self").ok()?;
    link.file_name()?.to_str()?.parse().ok()
}

/// One look at a thread in `/proc`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Seen {
    /// Scheduler state (`R`, `S`, `D`, ...).
    state: char,
    /// The system call it is in, by name where known, `running` when in user space.
    syscall: String,
    /// The kernel function it waits in (`0` or empty when running).
    wchan: String,
}

impl Seen {
    fn read(tid: u32) -> Option<Seen> {
        let base = format!("/proc/self/task/{tid}");
        let stat = std::fs::read_to_string(format!("{base}/stat")).ok()?;
        // "TID (comm) S ...": the comm may hold spaces and parentheses, the state follows the
        // last ')'.
        let state = stat[stat.rfind(')')? + 1..].trim_start().chars().next()?;
        let syscall = std::fs::read_to_string(format!("{base}/syscall"))
            .ok()
            .and_then(|s| s.split_whitespace().next().map(syscall_name))
            .unwrap_or_else(|| "?".into());
        let wchan = std::fs::read_to_string(format!("{base}/wchan")).unwrap_or_default();
        Some(Seen {
            state,
            syscall,
            wchan: wchan.trim().to_string(),
        })
    }
}

/// Nanoseconds on a CPU and waiting on a run queue (`/proc/.../schedstat`).
fn sched(tid: u32) -> Option<(u64, u64)> {
    let s = std::fs::read_to_string(format!("/proc/self/task/{tid}/schedstat")).ok()?;
    let mut it = s.split_whitespace().map(|v| v.parse::<u64>().ok());
    Some((it.next()??, it.next()??))
}

/// A system call's name from the number `/proc/.../syscall` gives (x86_64 numbers; others
/// stay numbers), or `running`.
fn syscall_name(raw: &str) -> String {
    let Ok(n) = raw.parse::<u32>() else {
        return raw.to_string();
    };
    #[cfg(target_arch = "x86_64")]
    let name = match n {
        0 => Some("read"),
        1 => Some("write"),
        7 => Some("poll"),
        23 => Some("select"),
        35 => Some("nanosleep"),
        42 => Some("connect"),
        43 => Some("accept"),
        44 => Some("sendto"),
        45 => Some("recvfrom"),
        46 => Some("sendmsg"),
        47 => Some("recvmsg"),
        202 => Some("futex"),
        230 => Some("clock_nanosleep"),
        232 => Some("epoll_wait"),
        270 => Some("pselect6"),
        271 => Some("ppoll"),
        281 => Some("epoll_pwait"),
        426 => Some("io_uring_enter"),
        _ => None,
    };
    #[cfg(not(target_arch = "x86_64"))]
    let name: Option<&str> = None;
    match name {
        Some(s) => s.to_string(),
        None => format!("syscall {n}"),
    }
}

/// The watchdog's view of one stall, from the first look that found no poll.
#[derive(Debug)]
struct Open {
    /// When the driver was last known polled (the look before the first stalled one).
    since: Instant,
    /// Scheduler figures at the first stalled look.
    sched: Option<(u64, u64)>,
    /// Distinct states seen, with how many looks saw each.
    states: Vec<(Seen, u32)>,
    /// Looks whose state did not fit in `states`.
    other: u32,
}

/// What the waker thread keeps between looks.
#[derive(Debug)]
pub(crate) struct StallWatch {
    shard: usize,
    tid: Option<u32>,
    /// The driver's poll count at the last look.
    polls: u64,
    /// When a look last found it changed.
    last_polled: Instant,
    open: Option<Open>,
}

impl StallWatch {
    pub(crate) fn new(shard: usize, tid: Option<u32>) -> Self {
        Self {
            shard,
            tid,
            polls: 0,
            last_polled: Instant::now(),
            open: None,
        }
    }

    /// One look at the driver's poll count `polls`: whether it was polled since the last
    /// look. If so, a stall that was open ends (and is reported if long enough); if not, what
    /// the shard's thread is doing is recorded.
    pub(crate) fn look(&mut self, polls: u64, stats: &StallStats) -> bool {
        if polls == self.polls {
            self.not_polled();
            return false;
        }
        self.polls = polls;
        self.polled(stats);
        true
    }

    /// A look found the driver polled since the last one: a stall that was open ends (and
    /// is reported if long enough).
    pub(crate) fn polled(&mut self, stats: &StallStats) {
        let now = Instant::now();
        if let Some(open) = self.open.take() {
            self.end(open, now, stats);
        }
        self.last_polled = now;
    }

    /// A look found no poll since the last one.
    fn not_polled(&mut self) {
        let Some(tid) = self.tid else {
            return;
        };
        let since = self.last_polled;
        let open = self.open.get_or_insert_with(|| Open {
            since,
            sched: sched(tid),
            states: Vec::new(),
            other: 0,
        });
        let Some(seen) = Seen::read(tid) else {
            return;
        };
        if let Some(entry) = open.states.iter_mut().find(|(s, _)| *s == seen) {
            entry.1 += 1;
        } else if open.states.len() < MAX_STATES {
            open.states.push((seen, 1));
        } else {
            open.other += 1;
        }
    }

    fn end(&self, open: Open, now: Instant, stats: &StallStats) {
        let took = now.duration_since(open.since);
        if took < STALL_REPORT {
            return;
        }
        let ms = took.as_millis() as u64;
        stats.stalls.fetch_add(1, Ordering::Relaxed);
        stats.longest_ms.fetch_max(ms, Ordering::Relaxed);
        let mut seen = String::new();
        for (s, n) in &open.states {
            let _ = write!(seen, "{} in {}", s.state, s.syscall);
            if !s.wchan.is_empty() && s.wchan != "0" {
                let _ = write!(seen, " ({})", s.wchan);
            }
            let _ = write!(seen, " x{n}; ");
        }
        if open.other > 0 {
            let _ = write!(seen, "{} other looks; ", open.other);
        }
        let split = match (open.sched, self.tid.and_then(sched)) {
            (Some((cpu0, wait0)), Some((cpu1, wait1))) => format!(
                "on a CPU {} ms, waiting for one {} ms",
                cpu1.saturating_sub(cpu0) / 1_000_000,
                wait1.saturating_sub(wait0) / 1_000_000
            ),
            _ => "scheduler figures unavailable".into(),
        };
        tracing::warn!(
            shard = self.shard,
            stalled_ms = ms,
            "the shard's driver was not polled for {ms} ms or more (its timers, heartbeats and deadlines \
             waited too); the thread was seen: {}since the first look: {split}",
            seen
        );
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;

    #[test]
    fn a_blocked_thread_is_seen_in_its_system_call_and_the_stall_is_counted() {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            tx.send(current_tid()).unwrap();
            std::thread::sleep(Duration::from_millis(400));
        });
        let tid = rx.recv().unwrap();
        assert!(tid.is_some(), "no /proc/thread-self");
        let stats = StallStats::default();
        let mut w = StallWatch::new(3, tid);
        for _ in 0..3 {
            std::thread::sleep(Duration::from_millis(100));
            w.not_polled();
        }
        let open = w.open.as_ref().expect("a stall is open");
        assert!(
            open.states.iter().any(|(s, _)| s.state == 'S'
                && (cfg!(not(target_arch = "x86_64")) || s.syscall.contains("sleep"))),
            "{:?}",
            open.states
        );
        t.join().unwrap();
        w.polled(&stats);
        assert_eq!(stats.stalls.load(Ordering::Relaxed), 1);
        assert!(stats.longest_ms.load(Ordering::Relaxed) >= 300);
        // A short gap is not a stall.
        w.not_polled();
        w.polled(&stats);
        assert_eq!(stats.stalls.load(Ordering::Relaxed), 1);
    }
}
