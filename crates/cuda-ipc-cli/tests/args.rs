//! The command line's options, without a GPU: sizes and offsets checked
//! before the driver is loaded, options that would do nothing refused, and
//! names and units taken in any letter case.

mod common;

use common::{HANDLE, assert_error, code, cuda_ipc, descriptor, stderr};

#[test]
fn open_checks_size_and_offset_before_the_driver() {
    let words = "positive multiple of 4 and --offset";
    let d = descriptor(16);
    let d18 = descriptor(16)
        .replace(r#""len":16"#, r#""len":18"#)
        .replace(r#""dtype":"u32""#, r#""dtype":"u8""#);
    for (args, exit, why) in [
        (vec!["--handle", HANDLE, "--size", "3"], 2, words),
        (vec!["--handle", HANDLE, "--size", "0"], 2, words),
        (
            vec!["--handle", HANDLE, "--size", "4096", "--offset", "3"],
            2,
            words,
        ),
        (
            vec!["--handle", HANDLE, "--size", "4096", "--offset", "4"],
            3,
            "libcuda.so.1",
        ),
        (vec!["--descriptor", &d, "--size", "0"], 2, words),
        (vec!["--descriptor", &d, "--size", "6"], 2, words),
        (vec!["--descriptor", &d, "--offset", "2"], 2, words),
        // The rest of an 18-byte region is not whole words: fine to map,
        // not to check or fill.
        (vec!["--descriptor", &d18], 3, "libcuda.so.1"),
        (
            vec!["--descriptor", &d18, "--expect-u32", "1"],
            2,
            "not a whole number of 32-bit words",
        ),
    ] {
        let mut full = vec!["open"];
        full.extend(args);
        assert_error(&full, &cuda_ipc(&full), exit, why);
    }
}

#[test]
fn options_that_would_do_nothing_are_refused() {
    for (args, why) in [
        (
            &["demo", "--seconds", "2"][..],
            "--seconds applies only with --stream; add --stream, or leave --seconds out",
        ),
        (
            &["demo", "--slots", "3"],
            "--slots applies only with --stream",
        ),
        (
            &["demo", "--frame-size", "4KiB"],
            "--frame-size applies only with --stream",
        ),
        (
            &["demo", "--stream", "--size", "1MiB"],
            "'--stream' cannot be used with '--size <SIZE>'",
        ),
        (
            &["attach", "--list", "--buffer", "buf0"],
            "'--list' cannot be used with '--buffer <BUFFER>'",
        ),
        (
            &["attach", "--list", "--expect-u32", "1"],
            "'--list' cannot be used with '--expect-u32 <EXPECT_U32>'",
        ),
        (
            &["attach", "--list", "--fill-u32", "1"],
            "'--list' cannot be used with '--fill-u32",
        ),
        (
            &["attach", "--list", "--sync", "fence"],
            "'--list' cannot be used with '--sync",
        ),
        (
            &["attach", "--list", "--device", "1"],
            "'--list' cannot be used with '--device",
        ),
    ] {
        assert_error(args, &cuda_ipc(args), 2, why);
    }
    // The same options where they apply get as far as the driver.
    for args in [
        &["demo", "--stream", "--seconds", "2", "--slots", "3"][..],
        &["demo", "--stream", "--frame-size", "4KiB"],
        &["demo", "--size", "1MiB"],
    ] {
        assert_error(args, &cuda_ipc(args), 3, "libcuda.so.1");
    }
}

#[test]
fn names_and_units_take_any_letter_case() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("none.sock");
    let socket = socket.to_str().unwrap();
    for args in [
        &["demo", "--mechanism", "VMM"][..],
        &["demo", "--mechanism", "Auto", "--size", "64mib"],
        &[
            "export",
            "--size",
            "4kib",
            "--fill-u32",
            "1",
            "--mechanism",
            "Legacy",
        ],
        &[
            "serve",
            "--size",
            "1MIB",
            "--fill-u32",
            "1",
            "--mechanism",
            "POOL",
        ],
        &[
            "serve",
            "--size",
            "4096",
            "--fill-u32",
            "1",
            "--release-timeout",
            "2S",
        ],
        &[
            "demo",
            "--stream",
            "--seconds",
            "500MS",
            "--frame-size",
            "4KIB",
        ],
        &["bench", "--mechanisms", "VMM,Legacy", "--sizes", "64mib"],
    ] {
        assert_error(args, &cuda_ipc(args), 3, "libcuda.so.1");
    }
    // --sync is parsed before the socket is looked for: nothing serves there.
    for mode in ["AUTO", "Event", "FENCE", "Host-Fence"] {
        let args = ["attach", "--socket", socket, "--sync", mode];
        assert_error(&args, &cuda_ipc(&args), 4, "nothing serves there");
    }
}

#[test]
fn sync_modes_agree_in_help_and_errors() {
    let o = cuda_ipc(&["attach", "--sync", "fences"]);
    assert_error(
        &["attach"],
        &o,
        2,
        "\"fences\" is not one of auto, event, fence, host-fence",
    );
    let help = cuda_ipc(&["attach", "--help"]);
    assert_eq!(code(&help), 0, "{}", stderr(&help));
    let help = String::from_utf8_lossy(&help.stdout).replace('\n', " ");
    for mode in ["auto", "event", "fence", "host-fence"] {
        assert!(help.contains(mode), "attach --help lacks {mode}: {help}");
    }
    let commands = include_str!("../../../docs/CLI.md");
    assert!(
        commands.contains("--sync auto\\|event\\|fence\\|host-fence"),
        "docs/CLI.md's attach row lists every --sync mode"
    );
}

#[test]
fn a_bad_mechanism_lists_every_choice() {
    let args = ["demo", "--mechanism", "carrier-pigeon"];
    assert_error(
        &args,
        &cuda_ipc(&args),
        2,
        "\"carrier-pigeon\" is not one of auto, legacy, vmm, pool, fabric",
    );
}
