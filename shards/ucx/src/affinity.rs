//! UCX's shared "async" thread must not inherit a pinned thread's CPU affinity.
//!
//! UCX runs one process-wide helper thread, named `async`, for asynchronous events (the TCP
//! transport's connection and socket events, the connection manager of listeners and
//! socket-address endpoints, keepalive). UCX 1.12 starts it from whichever thread first needs it
//! (`ucs_async_thread_start`, while a worker, listener or endpoint is created) and stops it when
//! its last user goes away, so a later run in the same process starts a new one. A new thread
//! inherits its creator's CPU affinity: when the creator is a shard pinned to core 0, the async
//! thread is pinned to core 0 too, and runs only when that shard's thread lets it, which a
//! spinning shard does not. Connection set-up and failure detection then wait on the shard.
//!
//! [`release_async_thread`] gives every thread named `async` the CPU set of the process's main
//! thread; [`set_async_thread_cpus`] gives it a chosen set (the shard runtime passes the CPUs it
//! was started with). [`Worker::new`](crate::Worker::new), [`Listener::bind`](crate::Listener::bind)
//! and the [`Endpoint`](crate::Endpoint) constructors call [`release_async_thread`] after UCX
//! returns, so plain callers need not. The thread is found by name through `/proc/self/task`, as
//! UCX does not expose its id; a thread of the application also named `async` is moved too.
//!
//! A pitfall seen while measuring this, for anyone pinning threads: `core_affinity::get_core_ids`
//! lists only the CPUs the *calling* thread may use. Once a program's main thread is pinned,
//! threads it spawns inherit the pin and see one core; "pin to core 1" then lands on core 0.

use std::io;
use std::mem::MaybeUninit;

/// The name UCX gives its async thread (`ucs_pthread_create(..., "async")` in
/// `ucs/async/thread.c`).
const ASYNC_THREAD_NAME: &str = "async";

fn get_affinity(tid: libc::pid_t) -> io::Result<libc::cpu_set_t> {
    let mut set = MaybeUninit::<libc::cpu_set_t>::zeroed();
    // SAFETY: sched_getaffinity(2) writes at most `cpusetsize` bytes into the set, which is a
    // valid, zero-initialised `cpu_set_t` of exactly that size; it does not keep the pointer.
    let rc = unsafe {
        libc::sched_getaffinity(
            tid,
            std::mem::size_of::<libc::cpu_set_t>(),
            set.as_mut_ptr(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: zero-initialised above (a valid, empty set) and filled by the kernel on success.
    Ok(unsafe { set.assume_init() })
}

fn set_affinity(tid: libc::pid_t, set: &libc::cpu_set_t) -> io::Result<()> {
    // SAFETY: sched_setaffinity(2) only reads `cpusetsize` bytes from a valid `cpu_set_t`.
    let rc = unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// The CPUs thread `tid` of this process may run on (`tid` 0: the calling thread).
pub fn thread_cpus(tid: i32) -> io::Result<Vec<usize>> {
    let set = get_affinity(tid)?;
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET(3) reads bit `c` of a valid set; `c` is below the set's size in bits.
    Ok((0..max)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect())
}

/// Thread ids of this process whose name is `name`.
pub fn threads_named(name: &str) -> io::Result<Vec<i32>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir("/proc/self/task")? {
        let entry = entry?;
        let Some(tid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        // A thread may exit between the listing and the read.
        let Ok(comm) = std::fs::read_to_string(entry.path().join("comm")) else {
            continue;
        };
        if comm.trim_end() == name {
            out.push(tid);
        }
    }
    Ok(out)
}

/// Give UCX's async thread(s) the CPU set of the process's main thread, when it differs.
/// Returns how many threads were changed. See the module docs for why.
pub fn release_async_thread() -> io::Result<usize> {
    // The main thread's id is the process id.
    let main = get_affinity(std::process::id() as libc::pid_t)?;
    move_async_thread(&main)
}

/// Give UCX's async thread(s) exactly the CPUs `cpus` (for a runtime that pins its own threads
/// and knows which CPUs it was given, the main thread's set being no guide when the main
/// thread is pinned too). Returns how many threads were changed; CPUs beyond the kernel's set
/// size are ignored, and an empty list changes nothing.
pub fn set_async_thread_cpus(cpus: &[usize]) -> io::Result<usize> {
    let max = 8 * std::mem::size_of::<libc::cpu_set_t>();
    let set = MaybeUninit::<libc::cpu_set_t>::zeroed();
    // SAFETY: an all-zero `cpu_set_t` is the valid empty set.
    let mut set = unsafe { set.assume_init() };
    let mut any = false;
    for &c in cpus.iter().filter(|&&c| c < max) {
        // SAFETY: CPU_SET(3) sets bit `c` of a valid set; `c` is below the set's size in bits.
        unsafe { libc::CPU_SET(c, &mut set) };
        any = true;
    }
    if !any {
        return Ok(0);
    }
    move_async_thread(&set)
}

fn move_async_thread(wanted: &libc::cpu_set_t) -> io::Result<usize> {
    let mut changed = 0;
    for tid in threads_named(ASYNC_THREAD_NAME)? {
        let Ok(now) = get_affinity(tid) else {
            continue; // exited meanwhile
        };
        // SAFETY: CPU_EQUAL(3) compares two valid, fully initialised sets.
        if !unsafe { libc::CPU_EQUAL(&now, wanted) } {
            set_affinity(tid, wanted)?;
            changed += 1;
        }
    }
    Ok(changed)
}

/// Called after UCX may have started its async thread; a failure only costs latency.
pub(crate) fn after_ucx_start() {
    let _ = release_async_thread();
}
