//! Ending a thread's blocking system call from another thread, until the thread says it is up.
//!
//! glommio 0.9's `LocalExecutor::run` can park in `io_uring_enter` before it has run the task it
//! was given: it installs its preempt timer, and if the timer has fired by the time it looks at
//! its task queues (the thread was descheduled for longer than the timer in between, as happens
//! on a loaded machine), it runs nothing and parks with no I/O and no timer registered. Nothing
//! ends that park: the shard's main task, which would register timers and start the thread
//! that watches the executor, never runs. (The shard runtime's docs, `driver.rs`, tell the
//! whole story.) A signal does: `io_uring_enter` returns `EINTR`, which glommio takes as a
//! spurious wake-up, and the executor goes round its loop again.
//!
//! A [`Nudger`] is made on the thread to watch (an executor's thread, before `run`). It starts
//! a helper thread that sends the watched thread [`NUDGE_SIGNAL`] every `every` until
//! [`Nudger::done`] is called (or the nudger dropped) on the watched thread; the first poll of
//! the executor's main task does that. On a healthy start, the helper waits once and exits
//! without sending anything.
//!
//! The signal is `SIGURG`, whose default action is to ignore it (a signal that arrives where
//! no handler was installed does nothing). A signal whose action is "ignore" does not end a
//! system call, so the first nudger installs a handler that does nothing, without
//! `SA_RESTART` (so the wait ends with `EINTR` instead of being restarted); a handler already
//! installed by the application is left in place. `SIGURG` is otherwise sent only by the
//! kernel for TCP urgent data on a socket whose owner was set with `F_SETOWN`.
//!
//! The signal goes by `tgkill(2)` to the thread's kernel id within this process, not by
//! `pthread_kill`, whose thread handle is undefined behaviour to use once the thread is gone:
//! at worst (a nudger leaked with `mem::forget` on a thread that then exited, and its id
//! reused by a new thread of this process), a thread of this process gets a spurious `EINTR`.

use std::io;
use std::marker::PhantomData;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};
use std::time::Duration;

/// The signal a [`Nudger`] sends.
pub const NUDGE_SIGNAL: i32 = libc::SIGURG;

/// What the watched thread and the helper share.
struct Shared {
    /// Set by the watched thread once it is up (or gone): the helper stops.
    done: Mutex<bool>,
    cv: Condvar,
    /// Signals sent.
    sent: AtomicU64,
}

/// Nudges the thread that made it with [`NUDGE_SIGNAL`] every `every` until [`Nudger::done`]
/// (see the module docs). Not `Send`: it is done, or dropped, on the thread it watches.
pub struct Nudger {
    shared: Arc<Shared>,
    _not_send: PhantomData<*const ()>,
}

impl Nudger {
    /// Watch the calling thread: from `every` on, and every `every` after, send it
    /// [`NUDGE_SIGNAL`] until [`Nudger::done`]. The helper thread is named `name`.
    pub fn start(every: Duration, name: &str) -> io::Result<Nudger> {
        install_handler()?;
        // SAFETY: getpid(2) and gettid(2) cannot fail and take no arguments.
        let (pid, tid) = unsafe { (libc::getpid(), libc::gettid()) };
        let shared = Arc::new(Shared {
            done: Mutex::new(false),
            cv: Condvar::new(),
            sent: AtomicU64::new(0),
        });
        let helper = shared.clone();
        std::thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || nudge_until_done(&helper, every, pid, tid))?;
        Ok(Nudger {
            shared,
            _not_send: PhantomData,
        })
    }

    /// The watched thread is up: no more signals. The helper exits.
    pub fn done(&self) {
        let mut done = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
        *done = true;
        self.shared.cv.notify_all();
    }

    /// Signals sent so far.
    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::Relaxed)
    }
}

impl Drop for Nudger {
    fn drop(&mut self) {
        self.done();
    }
}

fn nudge_until_done(shared: &Shared, every: Duration, pid: libc::pid_t, tid: libc::pid_t) {
    let mut done = shared.done.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let (guard, _) = shared
            .cv
            .wait_timeout_while(done, every, |d| !*d)
            .unwrap_or_else(|e| e.into_inner());
        done = guard;
        if *done {
            return;
        }
        // Sent with the lock held: the watched thread cannot be done (and so, short of a
        // leaked nudger, gone) while this runs.
        // SAFETY: tgkill(2) takes plain integers and touches no memory of ours; `pid` is this
        // process and `tid` a thread of it that has not said it is done (see the module docs
        // for a leaked nudger). The signal's handler, installed by `install_handler` before
        // this thread started, does nothing.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                libc::c_long::from(pid),
                libc::c_long::from(tid),
                libc::c_long::from(NUDGE_SIGNAL),
            )
        };
        if rc != 0 {
            // The thread is gone (ESRCH): nothing left to nudge.
            return;
        }
        shared.sent.fetch_add(1, Ordering::Relaxed);
    }
}

extern "C" fn on_nudge(_signal: libc::c_int) {}

/// Install [`on_nudge`] for [`NUDGE_SIGNAL`] unless the application has a handler of its own
/// (once per process).
fn install_handler() -> io::Result<()> {
    static INSTALLED: OnceLock<Result<(), i32>> = OnceLock::new();
    let installed = INSTALLED.get_or_init(|| {
        try_install_handler().map_err(|e| e.raw_os_error().unwrap_or(libc::EINVAL))
    });
    installed.map_err(io::Error::from_raw_os_error)
}

fn try_install_handler() -> io::Result<()> {
    let mut old = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: sigaction(2) with a null new action only writes the current action into `old`,
    // a valid, zeroed `struct sigaction`.
    let rc = unsafe { libc::sigaction(NUDGE_SIGNAL, std::ptr::null(), old.as_mut_ptr()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zeroed (valid for this plain C struct) and filled by the kernel on success.
    let old = unsafe { old.assume_init() };
    if old.sa_sigaction != libc::SIG_DFL && old.sa_sigaction != libc::SIG_IGN {
        // The application handles the signal; its handler ends the wait as well (unless it
        // asked for SA_RESTART, which it chose).
        return Ok(());
    }
    let mut new = std::mem::MaybeUninit::<libc::sigaction>::zeroed();
    // SAFETY: zeroed is a valid `struct sigaction` (empty mask, no flags); the handler field
    // is set to a function of the `void (*)(int)` type sigaction(2) expects without
    // SA_SIGINFO, and sigemptyset(3) initialises the mask in place.
    let rc = unsafe {
        let new = new.as_mut_ptr();
        (*new).sa_sigaction = on_nudge as extern "C" fn(libc::c_int) as libc::sighandler_t;
        (*new).sa_flags = 0;
        libc::sigemptyset(&mut (*new).sa_mask);
        libc::sigaction(NUDGE_SIGNAL, new, std::ptr::null_mut())
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // Tests may unwrap: a panic is a test failure.
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn a_thread_blocked_in_a_system_call_is_interrupted_until_done() {
        // A thread blocked in read(2) on a pipe nobody writes: only a signal ends the wait.
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let mut fds = [0; 2];
            // SAFETY: pipe(2) writes two fds into the two-element array.
            assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
            let nudger = Nudger::start(Duration::from_millis(20), "nudge-test").unwrap();
            let start = Instant::now();
            let mut byte = 0u8;
            // SAFETY: read(2) into one valid byte from an open fd.
            let rc = unsafe { libc::read(fds[0], (&mut byte as *mut u8).cast(), 1) };
            let err = io::Error::last_os_error();
            nudger.done();
            let sent = nudger.sent();
            // SAFETY: closing the two fds pipe(2) opened, once each.
            unsafe {
                libc::close(fds[0]);
                libc::close(fds[1]);
            }
            tx.send((rc, err.raw_os_error(), start.elapsed(), sent))
                .unwrap();
        });
        let (rc, errno, waited, sent) = rx.recv_timeout(Duration::from_secs(10)).unwrap();
        t.join().unwrap();
        assert_eq!(rc, -1);
        assert_eq!(errno, Some(libc::EINTR));
        assert!(waited >= Duration::from_millis(15), "{waited:?}");
        assert!(sent >= 1);
    }

    #[test]
    fn a_nudger_done_at_once_sends_nothing() {
        let nudger = Nudger::start(Duration::from_millis(10), "nudge-test").unwrap();
        nudger.done();
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(nudger.sent(), 0);
    }
}
