//! Why the driver did not load, as a new user sees it: a machine without
//! libcuda is told that it is missing, and a stray file at its name (not a
//! library) is named as such. The driver is enabled here (no
//! `CUDA_IPC_DISABLE_DRIVER`) and the loader path is a temporary directory.

mod common;

use std::process::{Command, Output, Stdio};

use common::{assert_error, assert_no_panic, stderr};

/// `cuda-ipc info --no-probe` with the driver enabled and `dir` first on
/// the loader path.
fn info_with_loader_path(dir: &std::path::Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_cuda-ipc"))
        .args(["info", "--no-probe"])
        .env_remove("CUDA_IPC_DISABLE_DRIVER")
        .env("LD_LIBRARY_PATH", dir)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

#[test]
fn a_file_that_is_not_a_library_at_libcuda_s_name_is_not_loadable() {
    let dir = tempfile::tempdir().unwrap();
    let stray = dir.path().join("libcuda.so.1");
    std::fs::write(&stray, b"not an ELF file").unwrap();
    // The directory comes first on the loader path, so this holds on GPU hosts too.
    let o = info_with_loader_path(dir.path());
    assert_error(&["info"], &o, 3, "not a loadable library");
    let e = stderr(&o);
    assert!(
        e.contains(&stray.display().to_string()),
        "names the file: {e}"
    );
    assert!(e.contains("remove the stray file"), "{e}");
    assert!(!e.contains("was found on the loader path"), "{e}");
}

#[test]
fn a_machine_without_libcuda_is_not_told_about_a_stray_file() {
    let dir = tempfile::tempdir().unwrap();
    let o = info_with_loader_path(dir.path());
    assert_no_panic(&o);
    let e = stderr(&o);
    assert!(!e.contains("not a loadable library"), "{e}");
    if e.contains("could not be loaded") {
        assert_error(
            &["info"],
            &o,
            3,
            "no library named libcuda.so.1 (or libcuda.so) was found on the loader path",
        );
    } else {
        eprintln!(
            "libcuda loads on this machine: only the absence of the stray-file message is checked"
        );
    }
}
