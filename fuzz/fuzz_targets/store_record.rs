//! Fuzzes the log record decoder: any bytes, never a panic.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    weir_backend::log::fuzzing::decode_record(data);
});
