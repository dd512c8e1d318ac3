//! The stacks of a process's threads, for a test that gives up on a hang. Shared by the root
//! crate's tests (`tests/common`) and the shards crate's (`shards/tests/common`, by path).

use std::process::{Command, Stdio};

/// The stack of every thread of process `pid`, by gdb when it is installed (else why not), for
/// a test that gives up on a hang: what each thread was waiting for. gdb stops the process for
/// the time it reads the stacks (at most a minute), then lets it go on.
pub(crate) fn stacks(pid: u32) -> String {
    let out = Command::new("timeout")
        .args(["60", "gdb", "-p", &pid.to_string(), "-batch", "-nx"])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt 40"])
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
