//! A run path to the UCX that ucx1-sys built, for the `shardcx` command, the examples, tests
//! and benches (see `build-support/ucx_rpath.rs`).

include!("build-support/ucx_rpath.rs");

fn main() {
    emit_ucx_rpath();
}
