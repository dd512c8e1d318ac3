//! Fuzzes the handshake message decoder and state machines, rail joins included (a join server
//! and a join client, with an oracle for what they may accept). Corpus: `corpus/handshake/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardcx_proto::fuzzing::handshake(data);
});
