//! Fuzzes the RPC envelope decoders (request prefix, error body) and rkyv validation of request
//! arguments as `fuzzing::Sample`. Corpus: `corpus/rpc/` (RPC payloads, not whole frames).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardcx_proto::fuzzing::rpc(data);
});
