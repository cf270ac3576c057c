//! Fuzz target `torch_record`: see `cuda_ipc_fuzz::torch_record` for the properties checked.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| cuda_ipc_fuzz::torch_record(data));
