//! The dependency arrows of DESIGN.md, checked with `cargo tree`:
//! `shardcx` → `shardcx-shards` → (`shardcx-proto`, `shardcx-ucx`) → ucx1-sys.

use std::process::Command;

fn tree(package: &str, extra: &[&str]) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
            "-f",
            "{p}",
            "-p",
            package,
        ])
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| l.split_whitespace().next().unwrap_or("").to_string())
        .filter(|n| !n.is_empty())
        .collect()
}

fn assert_absent(package: &str, deps: &[String], forbidden: &[&str]) {
    for f in forbidden {
        assert!(
            !deps.iter().any(|d| d == f),
            "{package} must not depend on {f}: {deps:?}"
        );
    }
}

#[test]
fn proto_depends_on_no_runtime_and_no_ucx() {
    let deps = tree("shardcx-proto", &[]);
    assert!(deps.iter().any(|d| d == "shardcx-proto"));
    assert_absent(
        "shardcx-proto",
        &deps,
        &["glommio", "ucx1-sys", "cudarc", "shardcx-ucx", "libc"],
    );
}

#[test]
fn ucx_depends_on_no_runtime_and_not_on_proto() {
    let deps = tree("shardcx-ucx", &[]);
    assert!(deps.iter().any(|d| d == "ucx1-sys"));
    assert_absent(
        "shardcx-ucx",
        &deps,
        &["glommio", "shardcx-proto", "shardcx-shards"],
    );
}

#[test]
fn facade_reaches_ucx_only_through_shards() {
    let direct = tree("shardcx", &["--depth", "1"]);
    assert!(direct.iter().any(|d| d == "shardcx-shards"));
    assert_absent("shardcx (direct)", &direct, &["ucx1-sys", "shardcx-ucx"]);
    let shards = tree("shardcx-shards", &["--depth", "1"]);
    assert!(shards.iter().any(|d| d == "shardcx-proto"));
    assert!(shards.iter().any(|d| d == "shardcx-ucx"));
    assert_absent("shardcx-shards (direct)", &shards, &["ucx1-sys"]);
}

#[test]
fn unsafe_code_lives_only_in_shards_ucx() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut offenders = Vec::new();
    let mut stack = vec![
        root.join("src"),
        root.join("shards"),
        root.join("examples"),
        root.join("benches"),
    ];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.starts_with(root.join("shards/ucx")) || p.ends_with("target") {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                let text = std::fs::read_to_string(&p).unwrap_or_default();
                if text.lines().any(|l| {
                    let l = l.trim_start();
                    !l.starts_with("//")
                        && (l.contains("unsafe {")
                            || l.contains("unsafe fn")
                            || l.contains("unsafe impl"))
                }) {
                    offenders.push(p.display().to_string());
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "unsafe code outside shards/ucx: {offenders:?}"
    );
}
