//! A run path to the UCX that ucx1-sys built, so that the extension module finds `libucp` when
//! Python loads it, with no `LD_LIBRARY_PATH` (the root crate's `build-support/ucx_rpath.rs`:
//! it names `<target>/release/ucx-lib`).

include!("../build-support/ucx_rpath.rs");

fn main() {
    emit_ucx_rpath();
}
