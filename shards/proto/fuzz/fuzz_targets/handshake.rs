//! Fuzzes the handshake message decoder and state machines. Corpus: `corpus/handshake/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardcx_proto::fuzzing::handshake(data);
});
