// Shared by the build scripts of `shardcx` and `shardcx-ucx` (`include!`d): give the package's
// binaries, examples, tests and benches a run path to the UCX that ucx1-sys built, so that they
// start outside cargo, from any directory, with no `LD_LIBRARY_PATH`.
//
// ucx1-sys declares no `links` key: its output directory is not passed to dependents, and
// cargo may run this script before ucx1-sys's has run. So the run path names a fixed place,
// `target/<profile>/ucx-lib`, a symbolic link this script points at the newest
// `target/<profile>/build/ucx1-sys-*/out/lib` (several are the same UCX source and build,
// made for other feature sets). When UCX is not built yet, the script asks cargo to run it
// again on the next build (it watches the link's library, which does not exist yet).
// `SHARDCX_UCX_LIB_DIR` at build time names another UCX lib directory instead.
//
// The run path is a DT_RUNPATH (the linker's default): `LD_LIBRARY_PATH` still comes first, so
// a user can point the binary at another UCX (`shardcx info` says which one it loaded, and
// why).

use std::path::{Path, PathBuf};

/// The lib directory of the newest ucx1-sys build in `build` (`target/<profile>/build`).
fn newest_ucx_lib_dir(build: &Path) -> Option<PathBuf> {
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for entry in std::fs::read_dir(build).ok()?.flatten() {
        if !entry.file_name().to_string_lossy().starts_with("ucx1-sys-") {
            continue;
        }
        let lib = entry.path().join("out").join("lib");
        let Ok(modified) = std::fs::metadata(lib.join("libucp.so")).and_then(|m| m.modified())
        else {
            continue;
        };
        if best.as_ref().is_none_or(|(t, _)| modified > *t) {
            best = Some((modified, lib));
        }
    }
    best.map(|(_, lib)| lib)
}

/// Points `link` at `target`, replacing what is there (atomically: two build scripts may do
/// this at once).
fn point_link(link: &Path, target: &Path) -> std::io::Result<()> {
    if std::fs::read_link(link).is_ok_and(|t| t == target) {
        return Ok(());
    }
    let tmp = link.with_extension(format!("tmp{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, link)
}

fn emit_ucx_rpath() {
    println!("cargo:rerun-if-env-changed=SHARDCX_UCX_LIB_DIR");
    let Some(out_dir) = std::env::var_os("OUT_DIR").map(PathBuf::from) else {
        return;
    };
    // OUT_DIR is target/<profile>/build/<package>-<hash>/out.
    let Some(build) = out_dir.parent().and_then(Path::parent) else {
        return;
    };
    let Some(profile_dir) = build.parent() else {
        return;
    };
    let link = profile_dir.join("ucx-lib");
    let chosen = match std::env::var_os("SHARDCX_UCX_LIB_DIR") {
        Some(dir) => Some(PathBuf::from(dir)),
        None => newest_ucx_lib_dir(build),
    };
    match chosen {
        Some(lib) => {
            if let Err(e) = point_link(&link, &lib) {
                println!(
                    "cargo:warning=cannot link {} to {}: {e}; binaries will need \
                     LD_LIBRARY_PATH={}",
                    link.display(),
                    lib.display(),
                    lib.display()
                );
            }
            // Run again (and re-link) when UCX is rebuilt.
            println!("cargo:rerun-if-changed={}", lib.join("libucp.so").display());
        }
        // Not built yet (cargo ran this first, on a fresh tree): this path does not exist, so
        // cargo runs this script again on the next build, which makes the link.
        None => {
            println!("cargo:rerun-if-changed={}", link.join("libucp.so").display());
            println!(
                "cargo:warning=UCX was not built yet when this build script ran: build once \
                 more (`cargo build`) so that binaries started outside cargo find it through \
                 {}",
                link.display()
            );
        }
    }
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", link.display());
    println!("cargo:rustc-env=SHARDCX_UCX_RPATH={}", link.display());
}
