//! Fuzz target `hex_handle`: see `cuda_ipc_fuzz::hex_handle` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::hex_handle(data));
