//! Fuzzes recovery's torn-tail/corruption classifier over a whole segment:
//! any bytes, never a panic, always progress.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    weir_backend::log::fuzzing::recover_tail(data);
});
