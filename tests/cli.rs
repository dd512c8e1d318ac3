//! The `shardcx` binary: `info`, a tiny `bench` with `--json` (which starts its own local peer
//! process), `node` start and stop, and clear errors on bad input.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)] // A test may panic: a panic is a failure it reports.

use std::process::Stdio;
use std::time::{Duration, Instant};

mod common;
use common::{output_within, shardcx, Bounded, NodeProc};
#[path = "../shards/ucx/tests/fake_cuda/mod.rs"]
mod fake_cuda;
use fake_cuda::FakeDriver;

#[test]
fn info_reports_ucx_memlock_cores_and_cuda() {
    let out = shardcx()
        .arg("info")
        .env_remove(shardcx::cuda::CUDA_MODE_ENV)
        .output_bounded();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "info failed: {out:?}");
    for want in [
        "UCX loaded:",
        "UCX built with:",
        "io_uring:",
        "locked memory:",
        "cores:",
        "CUDA driver:",
        "UCX memory types: ",
        "CUDA:             ",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    // The command probes as this process does: with no driver, CUDA is off and the line says
    // why; with one, it names the driver's CUDA version and every device.
    let cuda = text.lines().find(|l| l.starts_with("CUDA:")).unwrap();
    let driver = text
        .lines()
        .find(|l| l.starts_with("CUDA driver:"))
        .unwrap();
    match shardcx::cuda::driver() {
        Err(reason) => {
            assert_eq!(cuda, format!("CUDA:             off: {reason}"));
            assert_eq!(driver, format!("CUDA driver:      none: {reason}"));
        }
        Ok(d) => {
            let (major, minor) = d.version_pair();
            assert!(
                driver.contains(&format!("CUDA {major}.{minor}")),
                "{driver}"
            );
            for dev in &d.devices {
                assert!(
                    text.contains(&dev.name),
                    "{} missing from:\n{text}",
                    dev.name
                );
            }
            if d.devices.is_empty() {
                assert_eq!(cuda, "CUDA:             off: no CUDA device");
            } else {
                assert!(
                    cuda == "CUDA:             staging" || cuda == "CUDA:             zero-copy",
                    "{cuda}"
                );
            }
        }
    }
    // The command runs with this test's library path, so it loads the same UCX as this process.
    let v = shardcx::ucx::version();
    let loaded = text.lines().find(|l| l.starts_with("UCX loaded:")).unwrap();
    let (major, minor, release) = v.loaded;
    assert!(
        loaded.contains(&format!(" {major}.{minor}.{release} ")),
        "{loaded:?} does not name UCX {major}.{minor}.{release}"
    );
    if let Some(path) = &v.library_path {
        assert!(
            loaded.ends_with(&format!(" from {path}")),
            "{loaded:?}: not {path}"
        );
    }
}

#[test]
fn a_tiny_bench_writes_the_documented_json() {
    let dir = std::env::temp_dir().join(format!("shardcx-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (json, svg) = (dir.join("b.json"), dir.join("b.svg"));
    let out = shardcx()
        .args([
            "bench",
            "--test",
            "am-lat,am-rate,tag-lat,rpc-lat,rpc-lat-inline,rpc-rate,rpc-rate-inline,rpc-notify,put-bw,hop",
            "--size",
            "8,4k",
        ])
        .args([
            "--iters", "50", "--warmup", "5", "--window", "4", "--shards", "1,2",
        ])
        .args(["--transport", "tcp", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&svg)
        .output_bounded();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("am-lat: latency in µs (round trip)"),
        "{stdout}"
    );
    assert!(
        stdout.contains("skipped: needs --shards 2 or more"),
        "{stdout}"
    );
    let j = std::fs::read_to_string(&json).unwrap();
    // 9 tests at 2 sizes and 2 shard counts, hop once (2 shards).
    assert_eq!(j.matches("\"test\": ").count(), 9 * 2 * 2 + 1, "{j}");
    for field in [
        "\"test\": \"am-lat\"",
        "\"test\": \"hop\"",
        "\"test\": \"rpc-lat\"",
        "\"test\": \"rpc-rate\"",
        "\"test\": \"rpc-lat-inline\"",
        "\"test\": \"rpc-rate-inline\"",
        "\"test\": \"rpc-notify\"",
        "\"size\": 4096",
        "\"shards\": 2",
        "\"transport\": \"tcp\"",
        "\"iters\": 100",
        "\"p50_us\": ",
        "\"p99_us\": ",
        "\"p999_us\": ",
        "\"max_us\": ",
        "\"msgs_per_s\": ",
        "\"mb_per_s\": ",
        "\"route\": \"rail\"",
    ] {
        assert!(j.contains(field), "{field} missing from {j}");
    }
    // Each client shard used its own rail to the server node: only the hop test crossed
    // shards.
    for line in j.lines().filter(|l| l.contains("\"test\": ")) {
        let hop = line.contains("\"test\": \"hop\"");
        assert_eq!(line.contains("\"route\": \"hop\""), hop, "{line}");
    }
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(
        svg.starts_with("<svg") && svg.contains("<polyline"),
        "{svg}"
    );
    assert!(svg.contains("am-lat tcp ×2") && svg.contains("message size (bytes)"));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--plot FILE.png` draws a bitmap (text with the compiled-in font, so no system fonts are
/// needed); another extension is a usage error before anything runs.
#[test]
fn plot_writes_png_by_extension_and_refuses_others() {
    let dir = std::env::temp_dir().join(format!("shardcx-cli-png-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let png = dir.join("b.png");
    let out = shardcx()
        .args([
            "bench", "--test", "am-lat", "--size", "8,4k", "--iters", "50",
        ])
        .args(["--warmup", "5", "--transport", "tcp", "--plot"])
        .arg(&png)
        .output_bounded();
    assert!(out.status.success(), "bench failed: {out:?}");
    let bytes = std::fs::read(&png).unwrap();
    assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    // A blank picture of that size is a few KiB; axes, labels and lines make tens.
    assert!(bytes.len() > 20_000, "{} bytes", bytes.len());
    let started = Instant::now();
    let out = shardcx()
        .args(["bench", "--plot"])
        .arg(dir.join("b.jpg"))
        .output_bounded();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains(".svg or .png"), "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it ran the suite first"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_node_prints_its_address_and_stops_when_asked() {
    // `start` checks `listening ADDR` (an address) and `shards 2`.
    let node = NodeProc::start(2, &[], false);
    let (status, _) = node.stop(Duration::from_secs(15));
    assert!(status.success(), "{status}");
}

/// Outside cargo, from another directory, with no library path: the build's run path finds
/// the UCX that ucx1-sys built, and `info` says so; `info --json` says the same as one object.
#[test]
fn the_binary_runs_anywhere_and_says_which_ucx_it_loaded() {
    let out = shardcx()
        .arg("info")
        .env_remove("LD_LIBRARY_PATH")
        .current_dir(std::env::temp_dir())
        .output_bounded();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "info failed: {out:?}");
    let found = text
        .lines()
        .find(|l| l.starts_with("UCX found by:"))
        .unwrap();
    assert!(found.contains("this build's run path"), "{found:?}");
    let out = shardcx()
        .args(["info", "--json"])
        .env_remove("LD_LIBRARY_PATH")
        .output_bounded();
    assert!(out.status.success(), "info --json failed: {out:?}");
    let j: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(j["shardcx"], env!("CARGO_PKG_VERSION"));
    assert!(
        j["ucx"]["library"].as_str().unwrap().contains("libucp.so"),
        "{j}"
    );
    assert!(
        j["ucx"]["source"].as_str().unwrap().contains("run path"),
        "{j}"
    );
    assert!(!j["cpus"].as_array().unwrap().is_empty(), "{j}");
    assert!(j["ucx"]["transports"].as_array().is_some(), "{j}");
}

/// `SHARDCX_CUDA` reaches `info`: off is off with that reason, a bad value and a forced mode the
/// machine cannot run are reported (as errors in the CUDA line, not a failed command or a panic),
/// and `info --json` carries the same.
#[test]
fn info_follows_the_cuda_override() {
    let run = |value: &str, json: bool| {
        let out = shardcx()
            .arg("info")
            .args(json.then_some("--json"))
            .env(shardcx::cuda::CUDA_MODE_ENV, value)
            .output_bounded();
        assert!(out.status.success(), "SHARDCX_CUDA={value}: {out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let cuda_line = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("CUDA:"))
            .unwrap()
            .to_string()
    };
    assert_eq!(
        cuda_line(&run("off", false)),
        "CUDA:             off: turned off (SHARDCX_CUDA=off)"
    );
    let bad = cuda_line(&run("sometimes", false));
    assert!(bad.starts_with("CUDA:             ERROR: "), "{bad}");
    assert!(bad.contains("\"sometimes\" is not one of"), "{bad}");
    let j: serde_json::Value = serde_json::from_str(&run("off", true)).unwrap();
    assert_eq!(j["cuda"]["mode"], "off", "{j}");
    assert_eq!(j["cuda"]["request"], "off", "{j}");
    assert!(j["cuda"]["ucx_memory_types"].as_array().is_some(), "{j}");
    // Zero-copy on a UCX that does not move CUDA memory (the bundled 1.12) is refused.
    let ucx_cuda = j["cuda"]["ucx_moves_cuda"].as_bool().unwrap();
    let zero_copy = run("zero-copy", true);
    let j: serde_json::Value = serde_json::from_str(&zero_copy).unwrap();
    if ucx_cuda {
        assert!(
            j["cuda"]["error"].is_null() || shardcx::cuda::driver().is_err(),
            "{j}"
        );
    } else {
        assert!(j["cuda"]["mode"].is_null(), "{j}");
        let err = j["cuda"]["error"].as_str().unwrap();
        assert!(err.contains("does not move CUDA memory"), "{err}");
    }
}

/// With a CUDA driver and a device (the fake `libcuda` of `shards/ucx/tests/fake_cuda`, built
/// with the system C compiler, where there is no real one), `info` names the driver's CUDA
/// version and each device with its memory, and the mode (staging: the bundled UCX does not
/// move CUDA memory).
#[test]
fn info_names_the_driver_and_devices_of_a_fake_driver() {
    if shardcx::cuda::driver().is_ok() {
        eprintln!("skipped: a real CUDA driver is here (info_reports_ucx_memlock_cores_and_cuda checked it)");
        return;
    }
    let Some(fake) = FakeDriver::build("cli") else {
        return;
    };
    let path = fake.library_path();
    let run = |devices: &str, json: bool| {
        let out = shardcx()
            .arg("info")
            .args(json.then_some("--json"))
            .env("LD_LIBRARY_PATH", &path)
            .env("FAKE_CUDA_DEVICES", devices)
            .env_remove(shardcx::cuda::CUDA_MODE_ENV)
            .output_bounded();
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    let text = run("2", false);
    let j: serde_json::Value = serde_json::from_str(&run("2", true)).unwrap();
    let none = run("0", false);
    for want in [
        "CUDA driver:      CUDA 12.6 (12060)\n",
        "CUDA device 0:    Fake GPU 0, 8.0 GiB\n",
        "CUDA device 1:    Fake GPU 1, 8.0 GiB\n",
        "CUDA:             staging\n",
    ] {
        assert!(text.contains(want), "{want:?} missing from:\n{text}");
    }
    assert_eq!(j["cuda"]["mode"], "staging", "{j}");
    assert_eq!(j["cuda"]["driver"]["cuda_version"], "12.6", "{j}");
    assert_eq!(j["cuda"]["devices"][1]["name"], "Fake GPU 1", "{j}");
    assert_eq!(j["cuda"]["devices"][1]["memory_bytes"], 8u64 << 30, "{j}");
    assert!(none.contains("CUDA devices:     none\n"), "{none}");
    assert!(
        none.contains("CUDA:             off: no CUDA device\n"),
        "{none}"
    );
}

/// `bench --memory cuda` with a CUDA driver and a device (the fake `libcuda` where there is no
/// real one: device memory in host memory, so this checks the staging bookkeeping, not CUDA):
/// the five device tests run at a size under one 2 MiB staging chunk and at one over it
/// (several chunks), every device buffer checked by the bench itself, the table and the JSON
/// say memory cuda and the mode, and a test that moves no device memory is skipped, saying so.
#[test]
fn a_cuda_bench_runs_with_device_buffers() {
    let fake = match shardcx::cuda::driver() {
        Ok(d) if !d.devices.is_empty() => None,
        Ok(_) => {
            eprintln!("skipped: a CUDA driver without a device");
            return;
        }
        Err(_) => match FakeDriver::build("cli-bench") {
            Some(f) => Some(f),
            None => return,
        },
    };
    let dir = std::env::temp_dir().join(format!("shardcx-cli-cuda-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("b.json");
    let mut cmd = shardcx();
    cmd.args(["bench", "--memory", "cuda", "--quiet"])
        .args(["--test", "am-lat,am-bw,rpc-lat,put-bw,get-bw,tag-lat"])
        .args([
            "--size", "8,3m", "--iters", "12", "--warmup", "2", "--window", "4",
        ])
        .args(["--transport", "tcp", "--json"])
        .arg(&json)
        .env_remove(shardcx::cuda::CUDA_MODE_ENV);
    if let Some(f) = &fake {
        cmd.env("LD_LIBRARY_PATH", f.library_path());
    }
    let out = cmd.output_bounded();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mode = if fake.is_some() { "staging" } else { "" };
    for test in ["am-lat", "am-bw", "rpc-lat", "put-bw", "get-bw"] {
        let heading = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{test}: ")))
            .unwrap_or_else(|| panic!("no {test} table in:\n{stdout}"));
        assert!(
            heading.contains(&format!("memory cuda (CUDA mode {mode}")),
            "{heading}"
        );
    }
    assert!(
        stdout.contains("skipped: --memory cuda: only am-lat, am-bw, rpc-lat, put-bw and get-bw"),
        "{stdout}"
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let all = j.as_array().unwrap();
    // Five tests at two sizes; tag-lat, skipped, is not in the file.
    assert_eq!(all.len(), 5 * 2, "{j}");
    for m in all {
        assert_eq!(m["memory"], "cuda", "{m}");
        let got = m["cuda_mode"].as_str().unwrap();
        assert!(got.starts_with(mode) && got != "off", "{m}");
        assert!(m["msgs_per_s"].as_f64().unwrap() > 0.0, "{m}");
    }
    assert!(all.iter().any(|m| m["size"] == 3u64 << 20), "{j}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `bench --memory cuda` where CUDA is off fails at once, with status 1 and the reason (no
/// driver here, or turned off where there is one; the fake driver with no device), no panic.
#[test]
fn a_cuda_bench_without_cuda_says_why() {
    let run = |envs: &[(&str, &str)]| {
        let mut cmd = shardcx();
        cmd.args([
            "bench", "--memory", "cuda", "--test", "am-lat", "--iters", "5",
        ])
        .args(["--transport", "tcp", "--quiet"])
        .env_remove(shardcx::cuda::CUDA_MODE_ENV);
        for (k, v) in envs {
            cmd.env(k, v);
        }
        let started = Instant::now();
        let out = cmd.output_bounded();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        assert!(!stderr.contains("panicked"), "{stderr}");
        assert!(started.elapsed() < Duration::from_secs(30), "{stderr}");
        stderr
    };
    let (envs, reason) = match shardcx::cuda::driver() {
        Err(reason) => (vec![], reason.to_string()),
        Ok(_) => (
            vec![(shardcx::cuda::CUDA_MODE_ENV, "off")],
            "turned off (SHARDCX_CUDA=off)".to_string(),
        ),
    };
    let stderr = run(&envs);
    let want = format!("shardcx: error: --memory cuda: CUDA is off on this node: {reason}\n");
    assert!(stderr.contains(&want), "{want:?} missing from:\n{stderr}");
    if shardcx::cuda::driver().is_err() {
        if let Some(fake) = FakeDriver::build("cli-bench-off") {
            let path = fake.library_path();
            let stderr = run(&[
                ("LD_LIBRARY_PATH", path.as_str()),
                ("FAKE_CUDA_DEVICES", "0"),
            ]);
            assert!(
                stderr.contains(
                    "shardcx: error: --memory cuda: CUDA is off on this node: no CUDA device\n"
                ),
                "{stderr}"
            );
        }
    }
}

/// `bench --test allreduce` (and another collective) runs a world of two nodes in the process
/// and prints, per size, the slowest rank's percentiles, the algorithm, bus bandwidth, and the
/// allreduce cost-model fit from its two sizes; the JSON has one object per (collective, size).
#[test]
fn a_tiny_collective_bench_prints_its_table() {
    let dir = std::env::temp_dir().join(format!("shardcx-cli-coll-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("c.json");
    let child = shardcx()
        .args([
            "bench",
            "--test",
            "allreduce,allgather",
            "--size",
            "8,65536",
        ])
        .args([
            "--iters",
            "30",
            "--warmup",
            "3",
            "--transport",
            "tcp",
            "--json",
        ])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(child, Duration::from_secs(120), "collective bench");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("allreduce: 2 nodes in this process, f32 sum"),
        "{stdout}"
    );
    assert!(stdout.contains("busbw"), "{stdout}");
    // Two ranks: recursive doubling at both sizes (the ring needs more than two).
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(" tcp ") && l.contains("2x1"))
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(
        rows.iter().take(2).all(|r| r.contains("RecursiveDoubling")),
        "{stdout}"
    );
    assert!(rows.iter().all(|r| r.contains(" 30 ")), "{stdout}");
    assert!(
        stdout.contains("allreduce cost model, 2 ranks (tcp)") && stdout.contains("α = "),
        "{stdout}"
    );
    let j = std::fs::read_to_string(&json).unwrap();
    assert_eq!(j.matches("\"test\": ").count(), 4, "{j}");
    for field in [
        "\"test\": \"allreduce\"",
        "\"test\": \"allgather\"",
        "\"bytes\": 65536",
        "\"ranks\": 2",
        "\"algorithm\": \"RecursiveDoubling\"",
        "\"busbw_gb_s\": ",
        "\"per_rank\": [{\"rank\": 0, \"iters\": 30",
    ] {
        assert!(j.contains(field), "{field} missing from {j}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--save-costs FILE` writes the allreduce fit; `--costs FILE` has the cost model choose
/// the algorithms (a reduce-scatter of two ranks: the ring at 8 bytes, where the fixed
/// threshold takes reduce + scatter); a file that is not a costs file fails the command before
/// anything runs, and `--costs` without a collective is a usage error.
#[test]
fn the_collective_bench_saves_and_uses_measured_costs() {
    let dir = std::env::temp_dir().join(format!("shardcx-costs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let costs = dir.join("costs.json");
    let run = |args: &[&str]| {
        let child = shardcx()
            .args([
                "bench",
                "--iters",
                "30",
                "--warmup",
                "3",
                "--transport",
                "tcp",
            ])
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let out = output_within(child, Duration::from_secs(120), "collective bench");
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let path = costs.to_str().unwrap();
    let (code, stdout, stderr) = run(&[
        "--test",
        "allreduce",
        "--size",
        "8,64k",
        "--save-costs",
        path,
    ]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    let saved = shardcx::collective::Costs::load(&costs).expect("a costs file");
    assert!(saved.alpha_us() > 0.0, "{saved:?}");
    let (code, stdout, stderr) = run(&["--test", "reduce-scatter", "--size", "8", "--costs", path]);
    assert_eq!(code, Some(0), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("choose their algorithms by the cost model"),
        "{stdout}"
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("2x1") && l.contains(" Ring ")),
        "{stdout}"
    );
    let (code, stdout, _) = run(&["--test", "reduce-scatter", "--size", "8"]);
    assert_eq!(code, Some(0));
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("2x1") && l.contains("ReduceThenScatter")),
        "{stdout}"
    );
    std::fs::write(&costs, "{\"alpha_us\": -1, \"beta_ns_per_byte\": 1}").unwrap();
    let (code, _, stderr) = run(&["--test", "allreduce", "--size", "8", "--costs", path]);
    assert_eq!(code, Some(1), "{stderr}");
    assert!(
        stderr.contains("--costs") && stderr.contains("alpha_us"),
        "{stderr}"
    );
    let (code, _, stderr) = run(&["--test", "am-lat", "--costs", path]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("for the collectives"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--duration` bounds a collective run in time on every rank alike (rank 0 decides when to
/// stop), and the algorithm shown is the timed calls' (not the broadcast that stops them).
#[test]
fn a_collective_bench_with_a_duration_stops_in_time() {
    let started = Instant::now();
    let child = shardcx()
        .args(["bench", "--test", "barrier,allgather", "--size", "8"])
        .args(["--duration", "0.3", "--transport", "tcp", "--quiet"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(
        child,
        Duration::from_secs(120),
        "collective bench --duration",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "bench failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |name: &str| {
        stdout
            .lines()
            .any(|l| l.contains("2x1") && l.contains(name))
    };
    assert!(row("Dissemination") && row("Bruck"), "{stdout}");
    // Two sizes of 0.3 s, the warm-ups and two nodes' start: seconds, not the deadline.
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
}

/// Help per subcommand, and completions a shell can load.
#[test]
fn help_and_completions() {
    for (args, want) in [
        (&["--help"][..], "Commands:"),
        (&["help", "bench"][..], "--connect <ADDR>"),
        (&["node", "--help"][..], "--listen <ADDR>"),
        (&["completions", "bash"][..], "complete -F _shardcx"),
        (&["completions", "zsh"][..], "#compdef shardcx"),
        (&["--version"][..], env!("CARGO_PKG_VERSION")),
    ] {
        let out = shardcx().args(args).output_bounded();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}: {out:?}");
        assert!(
            text.contains(want),
            "{args:?}: {want:?} missing from\n{text}"
        );
    }
}

#[test]
fn bad_input_is_a_clear_error_not_a_panic() {
    for (args, want) in [
        (&["bench", "--test", "nope"][..], "unknown test"),
        (&["bench", "--size", "1x"][..], "cannot read size"),
        (&["bench", "--iters", "0"][..], "at least 1"),
        (&["bench", "--cores", "999"][..], "not available"),
        (&["bench", "--transport", "rdma"][..], "unknown transport"),
        (
            &["bench", "--memory", "gpu"][..],
            "unknown memory \"gpu\" (host, cuda)",
        ),
        (
            &["bench", "--memory", "cuda", "--vs-perftest"][..],
            "--vs-perftest: compares host memory only",
        ),
        (
            &["bench", "--test", "allreduce", "--connect", "127.0.0.1:1"][..],
            "run both of their nodes in this process",
        ),
        (&["bench", "--iters"][..], "a value is required"),
        (
            &["bench", "--itres", "3"][..],
            "a similar argument exists: '--iters'",
        ),
        (
            &["node", "--listen", "nowhere"][..],
            "invalid socket address",
        ),
        (&["frobnicate"][..], "unrecognized subcommand"),
        (&[][..], "Usage: shardcx <COMMAND>"),
    ] {
        let out = shardcx().args(args).output_bounded();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
    let out = shardcx()
        .args(["bench", "--psk-file", "/nonexistent/key"])
        .output_bounded();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read the key file"));
}

/// A node logs through `tracing` to stderr: the sessions clients make (with the shard that
/// holds them), a client that fails the handshake, and nothing in colour when stderr is not a
/// terminal.
#[test]
fn a_node_logs_sessions_and_refused_handshakes() {
    let node = NodeProc::start(2, &[], true);
    let addr = node.addr.to_string();
    let bench = |extra: &[&str]| {
        shardcx()
            .args(["bench", "--connect", &addr, "--transport", "tcp"])
            .args(["--test", "am-lat", "--iters", "50", "--warmup", "5"])
            .args(extra)
            .output_bounded()
    };
    assert!(bench(&[]).status.success());
    let key = std::env::temp_dir().join(format!("shardcx-wrong-key-{}", std::process::id()));
    std::fs::write(&key, "not the node's key, 16+ bytes\n").unwrap();
    let refused = bench(&["--psk-file", key.to_str().unwrap()]);
    let _ = std::fs::remove_file(&key);
    assert!(!refused.status.success());
    // Garbage on the listener's port: refused, and reported (rate-limited) within a second.
    {
        use std::io::Write as _;
        let mut s = std::net::TcpStream::connect(node.addr).unwrap();
        let _ = s.write_all(&[0x5a; 64]);
    }
    node.wait_for_log(Duration::from_secs(10), |l| {
        l.contains("BadProof") && l.contains("bootstraps_refused=1")
    });
    let (status, log) = node.stop(Duration::from_secs(15));
    assert!(status.success(), "{status}");
    assert!(
        log.lines()
            .any(|l| l.contains(" INFO shard{id=") && l.contains("session up: authenticated")),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains(" WARN shard{id=")
            && l.contains("rail failed")
            && l.contains("BadProof")),
        "{log}"
    );
    assert!(
        log.lines().any(|l| l.contains(" WARN shard{id=0}")
            && l.contains("frames dropped or refused")
            && l.contains("bootstraps_refused=1")),
        "{log}"
    );
    assert!(
        !log.contains('\u{1b}'),
        "colour codes in a log that is not a terminal:\n{log}"
    );
}

/// `--vs-perftest`: a tiny am-lat and am-rate run beside ucx_perftest (from the loaded UCX's
/// build, else PATH) puts perftest's figures and the ratio in the table and the JSON, within a
/// bounded time; with `--connect` it is a usage error.
#[test]
fn vs_perftest_puts_perftest_figures_in_the_table_and_the_json() {
    let out = shardcx()
        .args(["bench", "--vs-perftest", "--connect", "127.0.0.1:1"])
        .output_bounded();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot be used with"), "{err}");

    let lib = shardcx::ucx::version()
        .library_path
        .map(std::path::PathBuf::from);
    let beside = lib.and_then(|l| Some(l.parent()?.join("../bin/ucx_perftest")));
    if !beside.as_ref().is_some_and(|p| p.is_file()) {
        eprintln!("SKIPPED: no ucx_perftest beside the loaded UCX ({beside:?})");
        return;
    }
    let dir = std::env::temp_dir().join(format!("shardcx-cli-vs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("vs.json");
    let child = shardcx()
        .args([
            "bench",
            "--vs-perftest",
            "--test",
            "am-lat,am-rate",
            "--size",
            "8",
        ])
        .args(["--iters", "200", "--warmup", "20", "--window", "8"])
        .args(["--transport", "tcp", "--quiet", "--json"])
        .arg(&json)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(child, Duration::from_secs(120), "bench --vs-perftest");
    let status = out.status;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(status.success(), "bench failed:\n{stdout}\n{stderr}");
    for want in [
        "ucx_perftest ucp_am_lat on client shard 0's row",
        "ucx_perftest ucp_am_bw on client shard 0's row",
    ] {
        assert!(stdout.contains(want), "{want:?} missing from\n{stdout}");
    }
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.trim_end().ends_with("perftest  ratio"))
            .count(),
        2,
        "{stdout}"
    );
    let j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let rows = j.as_array().unwrap();
    assert_eq!(rows.len(), 2, "{j}");
    for (row, (test, metric)) in rows
        .iter()
        .zip([("ucp_am_lat", "p50_us"), ("ucp_am_bw", "msgs_per_s")])
    {
        let p = &row["perftest"];
        assert_eq!(p["test"], test, "{j}");
        assert_eq!(p["metric"], metric, "{j}");
        assert!(p.get("error").is_none(), "perftest failed: {p}\n{stderr}");
        assert!(p[metric].as_f64().unwrap() > 0.0, "{p}");
        assert!(p["ratio"].as_f64().unwrap() > 0.0, "{p}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The README shows `shardcx --help` and `shardcx bench -h` as the binary prints them.
#[test]
fn the_readme_shows_the_current_help() {
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    for args in [&["--help"][..], &["bench", "-h"]] {
        // clap shows an environment fallback's value when set.
        let out = shardcx()
            .args(args)
            .env_remove("SHARDCX_PSK_FILE")
            .output_bounded();
        assert!(out.status.success());
        let text = String::from_utf8(out.stdout).unwrap();
        let shown = format!("$ shardcx {}\n{text}", args.join(" "));
        assert!(
            readme.contains(&shown),
            "README.md does not show the current `shardcx {}`; paste:\n{shown}",
            args.join(" ")
        );
    }
}

/// `shardcx node` on a port already taken fails at once with the reason, whatever its shard
/// count (the other shards do not go on serving without the listener).
#[test]
fn node_on_a_taken_port_fails_promptly() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let child = shardcx()
        .args([
            "node",
            "--listen",
            &addr,
            "--shards",
            "2",
            "--transport",
            "tcp",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(
        child,
        Duration::from_secs(30),
        "shardcx node on a taken port",
    );
    let status = out.status;
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("cannot listen") && err.contains("in use"),
        "{err}"
    );
    drop(taken);
}

/// The UCX of PyPI's `libucx-cu12` wheel (`scripts/setup --ucx-wheel`, into
/// `target/ucx-wheel`): with its `lib/` on `LD_LIBRARY_PATH`, `info` says that UCX is loaded
/// and how it was found, and a short bench of every messaging kind runs on it, over shared
/// memory and tcp, unchanged. `scripts/test` installs the wheel and sets
/// `SHARDCX_REQUIRE_UCX_WHEEL`, so that a missing wheel fails there; elsewhere it is skipped.
#[test]
fn the_wheels_ucx_runs_the_same_binary() {
    // target/<profile>/shardcx -> target/ucx-wheel/lib
    let bin = std::path::Path::new(env!("CARGO_BIN_EXE_shardcx"));
    let lib = bin
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("ucx-wheel/lib");
    if !lib.join("libucp.so.0").exists() {
        assert!(
            std::env::var_os("SHARDCX_REQUIRE_UCX_WHEEL").is_none(),
            "no wheel UCX in {}: run scripts/setup --ucx-wheel",
            lib.display()
        );
        eprintln!(
            "skipped: no wheel UCX in {} (scripts/setup --ucx-wheel)",
            lib.display()
        );
        return;
    }
    let out = shardcx()
        .arg("info")
        .env("LD_LIBRARY_PATH", &lib)
        .output_bounded();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "info failed: {out:?}");
    let loaded = text.lines().find(|l| l.starts_with("UCX loaded:")).unwrap();
    assert!(
        loaded.contains(&lib.join("libucp.so.0").display().to_string()),
        "{loaded}"
    );
    assert!(
        !loaded.contains(" 1.12."),
        "the wheel's UCX is 1.2x: {loaded}"
    );
    let found = text
        .lines()
        .find(|l| l.starts_with("UCX found by:"))
        .unwrap();
    assert!(found.contains("LD_LIBRARY_PATH"), "{found}");

    let child = shardcx()
        .args(["bench", "--quiet", "--transport", "shm,tcp"])
        .args(["--test", "am-lat,am-bw,tag-lat,rpc-lat,rpc-rate,put-bw"])
        // 256 KiB, not more: it goes by rendezvous, and a debug build's RPC server validates
        // a window of 64 calls of 1 MiB for longer than the heartbeat timeout.
        .args(["--size", "8,256k", "--iters", "100", "--warmup", "10"])
        .env("LD_LIBRARY_PATH", &lib)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let out = output_within(child, Duration::from_secs(120), "bench on the wheel's UCX");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "bench failed: {out:?}");
    // Every test, both sizes and both transports made a row.
    let rows = table
        .lines()
        .filter(|l| {
            let mut w = l.split_whitespace();
            matches!(
                (w.next(), w.next()),
                (Some("8" | "256K"), Some("shm" | "tcp"))
            )
        })
        .count();
    assert_eq!(rows, 6 * 2 * 2, "{table}");
}
