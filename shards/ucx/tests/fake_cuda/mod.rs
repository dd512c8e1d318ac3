//! The tests' fake `libcuda` (`libcuda.c`: device memory in host memory, copies done at once),
//! built with the system C compiler. Shared by the CUDA tests of `shards/ucx`, `shards` and the
//! `shardcx` command (`#[path = ".../fake_cuda/mod.rs"] mod fake_cuda;`).

#![allow(dead_code)] // Each test binary uses the parts it needs.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Set in the child process that runs a test binary again against the fake driver.
pub(crate) const FAKE_ENV: &str = "SHARDCX_TEST_FAKE_CUDA";

/// Longest a run of the tests again may take: past it the child is killed (its output so far
/// comes back with a failed status, so the caller's test fails instead of hanging).
pub(crate) const RERUN_LIMIT: Duration = Duration::from_secs(300);

/// A fresh directory holding the fake `libcuda.so`; removed on drop.
pub(crate) struct FakeDriver {
    dir: PathBuf,
}

impl FakeDriver {
    /// Builds the fake driver (`tag` names its directory); `None`, with the reason printed,
    /// when there is no C compiler (`cc`).
    pub(crate) fn build(tag: &str) -> Option<FakeDriver> {
        let dir =
            std::env::temp_dir().join(format!("shardcx-{tag}-fake-cuda-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let src = dir.join("libcuda.c");
        std::fs::write(&src, include_str!("libcuda.c")).expect("write libcuda.c");
        let driver = FakeDriver { dir };
        let built = Command::new("cc")
            .args(["-shared", "-fPIC", "-O1", "-o"])
            .arg(driver.dir.join("libcuda.so"))
            .arg(&src)
            .status();
        if built.is_ok_and(|s| s.success()) {
            Some(driver)
        } else {
            eprintln!("skipped: no C compiler (cc) to build the fake CUDA driver");
            None
        }
    }

    /// `LD_LIBRARY_PATH` with the fake driver's directory first.
    pub(crate) fn library_path(&self) -> String {
        match std::env::var("LD_LIBRARY_PATH") {
            Ok(old) if !old.is_empty() => format!("{}:{old}", self.dir.display()),
            _ => self.dir.display().to_string(),
        }
    }

    /// Runs this test binary again against the fake driver, with `args` (e.g. `--skip` the
    /// caller), [`FAKE_ENV`] set and no mode override; its output.
    pub(crate) fn rerun(&self, args: &[&str], mode_env: &str) -> Output {
        self.rerun_with(args, mode_env, &[])
    }

    /// [`FakeDriver::rerun`] with more environment variables (`FAKE_CUDA_FAIL_COPY_LEN`, say).
    pub(crate) fn rerun_with(
        &self,
        args: &[&str],
        mode_env: &str,
        envs: &[(&str, &str)],
    ) -> Output {
        let mut child = Command::new(std::env::current_exe().expect("this test binary"))
            .args(args)
            .env("LD_LIBRARY_PATH", self.library_path())
            .env(FAKE_ENV, "1")
            .env_remove(mode_env)
            .envs(envs.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the tests again");
        // Both pipes are read meanwhile, so that a chatty child cannot block on a full one.
        let drain = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut bytes = Vec::new();
                if let Some(mut p) = pipe {
                    let _ = p.read_to_end(&mut bytes);
                }
                bytes
            })
        };
        let stdout = drain(child.stdout.take().map(|p| Box::new(p) as _));
        let stderr = drain(child.stderr.take().map(|p| Box::new(p) as _));
        let start = Instant::now();
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for the tests") {
                break status;
            }
            if start.elapsed() > RERUN_LIMIT {
                eprintln!("the tests against the fake driver ran past {RERUN_LIMIT:?}: killed");
                let _ = child.kill();
                break child.wait().expect("wait for the killed tests");
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        Output {
            status,
            stdout: stdout.join().unwrap_or_default(),
            stderr: stderr.join().unwrap_or_default(),
        }
    }
}

impl Drop for FakeDriver {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
