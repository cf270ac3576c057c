//! Tests of the PyTorch anchor: parsing the script's lines, running stand-in scripts, the rows and sections they become.

use super::*;

const OUTPUT: &str = r#"
some warning printed by a library
{"kind": "hello", "torch": "2.11.0", "cuda": "13.0", "device": "NVIDIA H200", "python": "3.12.3"}
{"kind": "startup", "consumer_ms": 3100.5}
{"kind": "result", "mode": "fresh", "size": 2097152, "warmup": 5, "samples_ms": [0.41, 0.39, 0.5], "verify_failures": 0}
{"kind": "result", "mode": "repeat", "size": 2097152, "warmup": 5, "samples_ms": [0.2, 0.21], "verify_failures": 1}
{"kind": "done", "elapsed_s": 12.5}
"#;

fn parse_all(text: &str) -> Result<TorchRun, String> {
    let mut run = TorchRun::default();
    for line in text.lines() {
        parse_line(&mut run, line)?;
    }
    Ok(run)
}

#[test]
fn lines_parse() {
    let run = parse_all(OUTPUT).unwrap();
    assert!(run.done);
    assert_eq!(run.startup_ms, Some(3100.5));
    assert_eq!(run.results.len(), 2);
    assert_eq!(run.results[0].mode, "fresh");
    assert_eq!(run.results[0].size, 2 << 20);
    assert_eq!(run.results[0].warmup, 5);
    assert_eq!(run.results[0].samples_ms, vec![0.41, 0.39, 0.5]);
    assert_eq!(run.results[1].verify_failures, 1);
    assert_eq!(run.hello.as_ref().unwrap()["torch"], "2.11.0");
}

#[test]
fn runs_become_sections() {
    let run = parse_all(OUTPUT).unwrap();
    let mut s = to_section(&run);
    s.finish();
    assert_eq!(s.rows.len(), 2);
    assert_eq!(s.rows[0].series, "PyTorch");
    assert_eq!(s.rows[0].variant.as_deref(), Some("fresh"));
    assert!((s.rows[0].p50().unwrap() - 0.41).abs() < 1e-12);
    // a verify failure fails the section
    assert!(s.failed());
    assert!(
        s.notes[0].contains("PyTorch 2.11.0 (CUDA 13.0)"),
        "{:?}",
        s.notes
    );
    assert!(
        s.notes
            .iter()
            .any(|n| n.contains("3100 ms") || n.contains("3101 ms"))
    );
}

#[test]
fn parts_become_the_rows_parts() {
    let run = parse_all(
            r#"{"kind": "result", "mode": "py_set", "size": 4096, "count": 2, "warmup": 0, "samples_ms": [3.0, 5.0], "parts_ms": {"publish": [1.0, 2.0], "consumer": [1.5, 2.5]}}"#,
        )
        .unwrap();
    let r = &run.results[0];
    assert_eq!(r.parts.len(), 2);
    let row = result_row(r);
    assert!(
        (row.parts["publish"].p50 - 1.5).abs() < 1e-12,
        "{:?}",
        row.parts
    );
    assert!(
        (row.parts["consumer"].p50 - 2.0).abs() < 1e-12,
        "{:?}",
        row.parts
    );
    for bad in [r#""parts_ms": [1.0]"#, r#""parts_ms": {"publish": ["x"]}"#] {
        let line = format!(
            r#"{{"kind": "result", "mode": "py_set", "size": 1, "samples_ms": [1.0], {bad}}}"#
        );
        let e = parse_all(&line).map(drop).unwrap_err();
        assert!(e.contains("parts_ms"), "{e}");
    }
}

#[test]
fn skips_and_errors() {
    let run = parse_all(r#"{"kind": "skip", "reason": "No module named 'torch'"}"#).unwrap();
    let s = to_section(&run);
    assert_eq!(s.status, super::super::report::Status::Skipped);
    assert_eq!(s.reason.as_deref(), Some("No module named 'torch'"));
    let run = parse_all(r#"{"kind": "error", "message": "CUDA out of memory"}"#).unwrap();
    assert_eq!(run.error.as_deref(), Some("CUDA out of memory"));
    for bad in [
        r#"{"kind": "result", "mode": "fresh"}"#,
        r#"{"kind": "result", "mode": "fresh", "size": 1, "samples_ms": ["x"]}"#,
        r#"{"kind": "startup""#,
    ] {
        assert!(parse_all(bad).is_err(), "{bad}");
    }
    // unknown kinds are ignored
    assert!(parse_all(r#"{"kind": "future", "x": 1}"#).is_ok());
}

#[test]
fn plan_argument() {
    let plan = |extra: &[&str]| {
        super::super::Plan::from_args(&{
            use clap::Parser;
            #[derive(Parser)]
            struct Cli {
                #[command(flatten)]
                a: super::super::Args,
            }
            let mut argv = vec!["bench", "--sizes", "2MiB,8GiB"];
            argv.extend(extra);
            Cli::parse_from(argv).a
        })
        .unwrap()
    };
    assert_eq!(
        plan_arg(&plan(&["--only", "torch,cached"])),
        "2097152:10:100,8589934592:3:20"
    );
    // With the push section, its block sizes too (its PyTorch column).
    assert_eq!(
        plan_arg(&plan(&[])),
        "16384:10:100,262144:10:100,2097152:10:100,67108864:10:100,8589934592:3:20"
    );
}

#[test]
fn script_is_found_in_the_source_tree() {
    let p = find_script(None).unwrap();
    assert!(p.ends_with("bench/torch_share.py"), "{}", p.display());
    assert!(
        find_script(Some(Path::new("/nonexistent/x.py")))
            .unwrap_err()
            .contains("does not exist")
    );
}

#[test]
fn tails_keep_the_end() {
    assert_eq!(tail("abcdef", 3), "def");
    assert_eq!(tail("ab", 3), "ab");
    assert_eq!(tail("aé", 1), "");
}

/// Numbers the stand-in scripts' folders.
static FAKES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Runs a stand-in script through `run_script`.
fn run_fake(body: &str, timeout: Duration) -> Option<Outcome> {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3 here");
        return None;
    }
    let dir = std::env::temp_dir().join(format!(
        "cuda-ipc-torch-fake-{}-{}",
        std::process::id(),
        FAKES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("fake.py");
    std::fs::write(&script, body).unwrap();
    let args = ["--plan".to_string(), "4096:1:2".into()];
    let out = run_script("python3", &script, 0, &args, timeout);
    std::fs::remove_dir_all(&dir).unwrap();
    Some(out)
}

#[test]
fn a_finished_script_is_read() {
    let body = r#"
import json, sys
assert sys.argv[1:] == ["--device", "0", "--plan", "4096:1:2"], sys.argv
print("a line that is not JSON")
for line in [
    {"kind": "hello", "torch": "9.9", "cuda": "13.0", "device": "fake", "python": "3"},
    {"kind": "result", "mode": "fresh", "size": 4096, "warmup": 1, "samples_ms": [0.5, 0.7], "verify_failures": 0},
    {"kind": "done", "elapsed_s": 0.1},
]:
    print(json.dumps(line))
"#;
    let Some(out) = run_fake(body, Duration::from_secs(60)) else {
        return;
    };
    let Outcome::Ran(run) = out else {
        panic!("expected a run")
    };
    assert_eq!(run.results.len(), 1);
    let mut s = to_section(&run);
    s.finish();
    assert!(!s.failed());
    assert!((s.rows[0].p50().unwrap() - 0.6).abs() < 1e-12);
}

#[test]
fn a_failing_script_fails_with_its_message_and_stderr() {
    let body = r#"
import json, sys
print(json.dumps({"kind": "error", "message": "CUDA out of memory"}))
sys.stderr.write("Traceback: the details\n")
sys.exit(1)
"#;
    let Some(out) = run_fake(body, Duration::from_secs(60)) else {
        return;
    };
    let Outcome::Failed(why, _) = out else {
        panic!("expected a failure")
    };
    assert!(why.contains("CUDA out of memory"), "{why}");
    assert!(why.contains("Traceback: the details"), "{why}");
}

#[test]
fn a_script_that_stops_early_fails() {
    let Some(out) = run_fake("print('{\"kind\": \"hello\"}')\n", Duration::from_secs(60)) else {
        return;
    };
    let Outcome::Failed(why, _) = out else {
        panic!("expected a failure")
    };
    assert!(why.contains("without finishing"), "{why}");
}

#[test]
fn a_stuck_script_is_stopped() {
    let t = std::time::Instant::now();
    let Some(out) = run_fake("import time\ntime.sleep(60)\n", Duration::from_secs(1)) else {
        return;
    };
    assert!(t.elapsed() < Duration::from_secs(20));
    let Outcome::Failed(why, _) = out else {
        panic!("expected a failure")
    };
    assert!(why.contains("did not finish within 1 s"), "{why}");
}

#[test]
fn no_torch_or_no_python_is_a_skip() {
    let body = "print('{\"kind\": \"skip\", \"reason\": \"PyTorch is not importable\"}')\n";
    if let Some(out) = run_fake(body, Duration::from_secs(60)) {
        let Outcome::Ran(run) = out else {
            panic!("expected a run")
        };
        let s = to_section(&run);
        assert_eq!(s.status, super::super::report::Status::Skipped);
    }
    let out = run_script(
        "/nonexistent/python3",
        Path::new("x.py"),
        0,
        &["--plan".into(), "4096:1:1".into()],
        Duration::from_secs(5),
    );
    let Outcome::Skipped(why) = out else {
        panic!("expected a skip")
    };
    assert!(why.contains("/nonexistent/python3 not found"), "{why}");
}

fn quick_plan(extra: &[&str]) -> Plan {
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: super::super::Args,
    }
    let argv = ["bench", "--quick"].iter().chain(extra).copied();
    Plan::from_args(&Cli::parse_from(argv).a).unwrap()
}

#[test]
fn python_results_become_rows_of_ours_from_python() {
    let run = parse_all(
            r#"{"kind": "hello", "cuda_ipc": "0.1.0", "torch": "2.11.0", "device": "NVIDIA H200", "python": "3.12.3"}
{"kind": "startup", "consumer_ms": 2100.0}
{"kind": "result", "mode": "py_fresh", "size": 2097152, "warmup": 3, "samples_ms": [0.09, 0.1, 0.11], "verify_failures": 0}
{"kind": "result", "mode": "py_set", "size": 4294967296, "count": 1000, "warmup": 3, "samples_ms": [1.5, 1.7], "verify_failures": 1}
{"kind": "done", "elapsed_s": 9.0}"#,
        )
        .unwrap();
    assert!(run.done);
    let fresh = result_row(&run.results[0]);
    assert_eq!(fresh.series, PY_SERIES);
    assert_eq!(fresh.variant.as_deref(), Some("fresh"));
    assert_eq!((fresh.size, fresh.count), (Some(2 << 20), None));
    assert!((fresh.p50().unwrap() - 0.1).abs() < 1e-12);
    let set = result_row(&run.results[1]);
    assert_eq!(set.series, PY_SERIES);
    assert_eq!(set.variant.as_deref(), Some("set"));
    assert_eq!((set.count, set.size), (Some(1000), Some(4 << 30)));
    assert!(set.error.as_deref().unwrap().contains("1 samples"));
}

#[test]
fn python_rows_are_skipped_without_an_interpreter() {
    let mut plan = quick_plan(&[]);
    plan.torch = Err("--no-torch".into());
    let (rows, notes, error) = python_rows(&plan);
    assert_eq!(rows.len(), plan.sets.len());
    assert!(rows.iter().all(|r| r.series == PY_SERIES
        && r.variant.as_deref() == Some("set")
        && r.skipped.as_deref().unwrap().contains("--no-torch")));
    assert!(notes.is_empty() && error.is_none());
}

#[test]
fn set_results_become_rows() {
    let run = parse_all(
            r#"{"kind": "result", "mode": "set_bucket", "size": 4294967296, "count": 1000, "warmup": 3, "samples_ms": [6.7, 6.9], "verify_failures": 0, "extra_device_bytes": 4294967296}"#,
        )
        .unwrap();
    let r = &run.results[0];
    assert_eq!((r.count, r.extra_device_bytes), (Some(1000), Some(4 << 30)));
    let row = result_row(r);
    assert_eq!(row.series, "PyTorch");
    assert_eq!(row.variant.as_deref(), Some("bucket"));
    assert_eq!((row.count, row.size), (Some(1000), Some(4 << 30)));
    assert_eq!(row.extra_device_bytes, Some(4 << 30));
    assert!((row.p50().unwrap() - 6.8).abs() < 1e-12);
    // the per-size modes carry neither
    let run = parse_all(OUTPUT).unwrap();
    let row = result_row(&run.results[0]);
    assert_eq!((row.count, row.extra_device_bytes), (None, None));
    assert_eq!(
        sets_arg(&quick_plan(&[])),
        "100:268435456:2:10,1000:268435456:2:10,10000:268435456:2:10"
    );
    assert_eq!(
        sets_arg(&quick_plan(&["--reps", "3", "--warmup", "0"])),
        "100:268435456:0:3,1000:268435456:0:3,10000:268435456:0:3"
    );
}

/// Writes a stand-in script; `None` without python3.
fn fake_script(body: &str) -> Option<(PathBuf, PathBuf)> {
    if Command::new("python3").arg("--version").output().is_err() {
        eprintln!("skipped: no python3 here");
        return None;
    }
    let dir = std::env::temp_dir().join(format!(
        "cuda-ipc-torch-sets-{}-{}",
        std::process::id(),
        FAKES.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("fake.py");
    std::fs::write(&script, body).unwrap();
    Some((dir, script))
}

#[test]
fn set_rows_from_a_stand_in_script() {
    let body = r#"
import json, sys
assert sys.argv[1:] == ["--device", "0", "--sets",
                        "100:268435456:2:10,1000:268435456:2:10,10000:268435456:2:10",
                        "--modes", "set_list,set_bucket"], sys.argv
for line in [
    {"kind": "hello", "torch": "9.9", "cuda": "13.0", "device": "fake", "python": "3"},
    {"kind": "startup", "consumer_ms": 2000.0},
    {"kind": "result", "mode": "set_list", "size": 268435456, "count": 100, "warmup": 2,
     "samples_ms": [11.0, 12.0], "verify_failures": 0, "extra_device_bytes": 0},
    {"kind": "result", "mode": "set_bucket", "size": 268435456, "count": 100, "warmup": 2,
     "samples_ms": [3.5], "verify_failures": 2, "extra_device_bytes": 268435456},
    {"kind": "done", "elapsed_s": 0.1},
]:
    print(json.dumps(line))
"#;
    let Some((dir, script)) = fake_script(body) else {
        return;
    };
    let script_arg = script.display().to_string();
    let plan = quick_plan(&["--python", "python3", "--torch-script", &script_arg]);
    let (rows, notes, error) = set_rows(&plan);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(error, None);
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[0].variant.as_deref(), Some("list"));
    assert!((rows[0].p50().unwrap() - 11.5).abs() < 1e-12);
    assert_eq!(rows[1].extra_device_bytes, Some(256 << 20));
    // values the consumer did not find fail the row
    assert!(rows[1].error.as_deref().unwrap().contains("2 samples"));
    assert!(notes[0].contains("PyTorch 9.9"), "{notes:?}");
}

#[test]
fn set_rows_when_pytorch_does_not_run() {
    let (rows, notes, error) = set_rows(&quick_plan(&["--no-torch"]));
    assert_eq!((rows.len(), notes.len(), error), (6, 0, None));
    assert!(
        rows.iter()
            .all(|r| r.skipped.as_deref() == Some("PyTorch skipped: --no-torch"))
    );
    assert_eq!(
        rows.iter()
            .map(|r| (r.variant.as_deref().unwrap(), r.count.unwrap()))
            .collect::<Vec<_>>(),
        [
            ("list", 100),
            ("bucket", 100),
            ("list", 1000),
            ("bucket", 1000),
            ("list", 10_000),
            ("bucket", 10_000)
        ]
    );
    let body = "print('{\"kind\": \"skip\", \"reason\": \"PyTorch is not importable\"}')\n";
    if let Some((dir, script)) = fake_script(body) {
        let script_arg = script.display().to_string();
        let (rows, _, error) = set_rows(&quick_plan(&["--torch-script", &script_arg]));
        assert_eq!(error, None);
        assert!(rows.iter().all(|r| {
            r.skipped
                .as_deref()
                .is_some_and(|w| w.contains("not importable"))
        }));
        let failing = "import json, sys\nprint(json.dumps({'kind': 'error', 'message': 'CUDA out of memory'}))\nsys.exit(1)\n";
        std::fs::write(&script, failing).unwrap();
        let (rows, _, error) = set_rows(&quick_plan(&["--torch-script", &script_arg]));
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(rows.is_empty());
        assert!(error.unwrap().contains("CUDA out of memory"));
    }
    // an explicit script that is missing is a failure, not a skip
    let (_, _, error) = set_rows(&quick_plan(&[
        "--torch-script",
        "/nonexistent/torch_share.py",
    ]));
    assert!(error.unwrap().contains("does not exist"));
}

/// The script's --help works without torch, and the script compiles.
#[test]
fn script_runs_without_torch() {
    let script = find_script(None).unwrap();
    let Ok(o) = Command::new("python3").arg(&script).arg("--help").output() else {
        eprintln!("skipped: no python3 here");
        return;
    };
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("--plan"));
    // Compiled to a temporary file, so the source tree gets no __pycache__.
    let cfile = std::env::temp_dir().join(format!("torch_share-{}.pyc", std::process::id()));
    let o = Command::new("python3")
            .args([
                "-c",
                "import py_compile, sys; py_compile.compile(sys.argv[1], cfile=sys.argv[2], doraise=True)",
            ])
            .arg(&script)
            .arg(&cfile)
            .output()
            .unwrap();
    let _ = std::fs::remove_file(&cfile);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
