//! Fuzz target `descriptor`: see `cuda_ipc_fuzz::descriptor` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::descriptor(data));
