//! The stacks of a process's threads, for a test that gives up on a hang. Shared by the root
//! crate's tests (`tests/common`) and the shards crate's (`shards/tests/common`, by path).

use std::process::{Command, Stdio};

/// The stack of every thread of process `pid`, by gdb when it is installed (else why not), for
/// a test that gives up on a hang: what each thread was waiting for. gdb stops the process for
/// the time it reads the stacks (at most a minute), then lets it go on. A gdb killed at the
/// time limit would leave a process it attached to stopped for good (the test, when `pid` is
/// its own, and with it the whole run): the shell that runs gdb sends `pid` a `SIGCONT`
/// whatever became of gdb, and gdb is asked to stop with `SIGINT` first (it then detaches).
pub(crate) fn stacks(pid: u32) -> String {
    let script = format!(
        "timeout -s INT -k 5 60 gdb -p {pid} -batch -nx -ex 'set pagination off' \
         -ex 'thread apply all bt 40'; kill -CONT {pid}"
    );
    let out = Command::new("sh")
        .args(["-c", &script])
        .stdin(Stdio::null())
        .output();
    match out {
        Ok(o) if !o.stdout.is_empty() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .filter(|l| !l.starts_with("[New LWP") && !l.starts_with("[Thread debugging"))
            .collect::<Vec<_>>()
            .join("\n"),
        Ok(o) => format!(
            "(no stacks: gdb said {})",
            String::from_utf8_lossy(&o.stderr).trim()
        ),
        Err(e) => format!("(no stacks: cannot run gdb: {e})"),
    }
}
