//! Fuzzes the RMA payload decoders and the region table's checks. Corpus: `corpus/rma/`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let _ = shardcx_proto::fuzzing::rma(data);
});
