//! One table of exit codes and one error style: README.md's table is what
//! `--help` prints, and each code is what the command really returns for a
//! case of its kind, with the error on standard error after
//! `cuda-ipc: error: ` (and, with `--json`, as JSON on standard output).

mod common;

use common::{assert_error, code, cuda_ipc, stderr};

/// README.md's exit-code table: `(code, meaning)` rows.
fn readme_table() -> Vec<(i32, String)> {
    let readme = include_str!("../../../README.md");
    let rows: Vec<(i32, String)> = readme
        .lines()
        .skip_while(|l| !l.starts_with("| exit | meaning |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            (cells[0].parse().expect("an exit code"), cells[1].to_owned())
        })
        .collect();
    assert_eq!(
        rows.iter().map(|r| r.0).collect::<Vec<_>>(),
        [0, 1, 2, 3, 4],
        "README.md has no table of the five exit codes"
    );
    rows
}

#[test]
fn help_prints_the_readme_table() {
    let table = readme_table();
    for args in [&["--help"][..], &["demo", "--help"], &["ls", "--help"]] {
        let o = cuda_ipc(args);
        assert_eq!(code(&o), 0, "{args:?}: {}", stderr(&o));
        let help = String::from_utf8_lossy(&o.stdout);
        assert!(help.contains("Exit codes:"), "{args:?}: {help}");
        // Words only: clap wraps the help to the terminal's width when a
        // crate of the workspace turns its `wrap_help` feature on.
        let words = |t: &str| t.split_whitespace().collect::<Vec<_>>().join(" ");
        let help_words = words(&help);
        for (exit, meaning) in &table {
            assert!(
                help_words.contains(&words(&format!("{exit} {meaning}"))),
                "{args:?} does not print exit code {exit} as README.md does: {help}"
            );
        }
    }
}

#[test]
fn a_usage_mistake_is_exit_2_in_the_common_style() {
    let args = ["demo", "--no-such-option"];
    assert_error(&args, &cuda_ipc(&args), 2, "--no-such-option");
    let args = ["demo", "--size", "12 parsecs"];
    assert_error(&args, &cuda_ipc(&args), 2, "12 parsecs");
}

#[test]
fn no_driver_is_exit_3_and_says_why_without_advising_an_install() {
    // The common runner sets CUDA_IPC_DISABLE_DRIVER.
    let args = ["demo"];
    let o = cuda_ipc(&args);
    assert_error(&args, &o, 3, "CUDA_IPC_DISABLE_DRIVER is set");
    assert!(
        !stderr(&o).contains("Install the NVIDIA driver"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn nothing_serving_the_socket_is_exit_4_and_json_with_json() {
    let dir = std::env::temp_dir().join(format!("cuda-ipc-exit-codes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let socket = dir.join("nobody.sock");
    let socket = socket.to_str().unwrap();
    for sub in ["ls", "stats"] {
        let args = [sub, "--service", socket];
        assert_error(&args, &cuda_ipc(&args), 4, "no service");
        let args = [sub, "--service", socket, "--json"];
        let o = cuda_ipc(&args);
        assert_error(&args, &o, 4, "no service");
        let out: serde_json::Value = serde_json::from_slice(&o.stdout)
            .unwrap_or_else(|e| panic!("{args:?}: stdout is not JSON ({e}): {:?}", o.stdout));
        assert_eq!(out["exit_code"], 4, "{out}");
        assert!(
            out["error"]
                .as_str()
                .is_some_and(|e| e.contains("no service")),
            "{out}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
