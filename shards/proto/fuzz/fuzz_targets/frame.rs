//! Fuzzes the frame header and frame decoders. Corpus: `corpus/frame/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardcx_proto::fuzzing::frame(data);
});
