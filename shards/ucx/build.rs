//! A run path to the UCX that ucx1-sys built, for this crate's examples and tests (see
//! `build-support/ucx_rpath.rs` at the top of the repository).

include!("../../build-support/ucx_rpath.rs");

fn main() {
    emit_ucx_rpath();
}
