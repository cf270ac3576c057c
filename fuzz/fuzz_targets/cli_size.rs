//! Fuzz target `cli_size`: see `cuda_ipc_fuzz::cli_size` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::cli_size(data));
