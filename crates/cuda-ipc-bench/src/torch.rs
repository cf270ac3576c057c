//! The PyTorch anchor: runs `bench/torch_share.py`, which measures
//! torch.multiprocessing's hand-off of CUDA tensors the way this bench
//! measures ours, and reads the JSON lines it prints.
//!
//! The script's lines (one JSON object each, on standard output):
//! - `{"kind": "hello", "torch": "2.11.0", "cuda": "13.0", "device": "NVIDIA H200", "python": "3.12.3"}`
//! - `{"kind": "skip", "reason": "..."}`: no torch, or no CUDA in torch (not a failure)
//! - `{"kind": "startup", "consumer_ms": 3100.0}`: the consumer's start, CUDA included
//! - `{"kind": "result", "mode": "fresh"|"repeat", "size": N, "warmup": W, "samples_ms": [...], "verify_failures": 0}`
//! - `{"kind": "result", "mode": "set_list"|"set_bucket", "size": TOTAL, "count": TENSORS, "warmup": W, "samples_ms": [...], "verify_failures": 0, "extra_device_bytes": B}`
//! - `{"kind": "note", "text": "..."}`: a note for the report
//! - `{"kind": "error", "message": "..."}`
//! - `{"kind": "done", "elapsed_s": 12.3}`
//!
//! Other lines (not starting with `{`) are ignored.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use serde_json::Value;

use super::report::{Row, Section, SectionId};
use super::{Plan, Progress};
use crate::report::targets::{FIRST_ATTACH, LOAD_FILE, PY_SERIES, SAFETENSORS_SERIES};

/// What the script reported.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TorchRun {
    /// Versions and device, from the hello line.
    pub hello: Option<Value>,
    /// Why the script did not measure (not a failure).
    pub skip: Option<String>,
    /// The consumer's start-up, ms.
    pub startup_ms: Option<f64>,
    /// The measurements.
    pub results: Vec<TorchResult>,
    /// The script's own error.
    pub error: Option<String>,
    /// Whether the script said it was done.
    pub done: bool,
    /// Notes for the report (`note` lines).
    pub notes: Vec<String>,
}

/// One measurement of the script.
#[derive(Clone, Debug, PartialEq)]
pub struct TorchResult {
    /// "fresh", "repeat", "set_list" or "set_bucket".
    pub mode: String,
    /// Bytes (of the whole set for the set modes).
    pub size: u64,
    /// The tensors of a weight set.
    pub count: Option<u64>,
    /// Device memory the hand-off needed beyond the tensors (set modes).
    pub extra_device_bytes: Option<u64>,
    /// Samples thrown away.
    pub warmup: usize,
    /// Kept samples, ms.
    pub samples_ms: Vec<f64>,
    /// Samples whose values did not match.
    pub verify_failures: u64,
    /// Parts of each kept sample, ms, by name (`"parts_ms": {"publish":
    /// [...], "consumer": [...]}`), where the script measures them.
    pub parts: Vec<(String, Vec<f64>)>,
    /// Why the script did not measure this one (`"skipped": "..."`).
    pub skipped: Option<String>,
}

/// The numbers of `v`, a JSON list.
fn numbers(v: &Value) -> Option<Vec<f64>> {
    v.as_array()?.iter().map(Value::as_f64).collect()
}

/// Adds one line of the script's output to `run`.
pub fn parse_line(run: &mut TorchRun, line: &str) -> Result<(), String> {
    let line = line.trim();
    if !line.starts_with('{') {
        return Ok(());
    }
    let v: Value =
        serde_json::from_str(line).map_err(|e| format!("a line that is not JSON ({e}): {line}"))?;
    let need = |k: &str| {
        v.get(k)
            .cloned()
            .ok_or_else(|| format!("a {:?} line without {k:?}: {line}", v["kind"]))
    };
    match v["kind"].as_str().unwrap_or("") {
        "hello" => run.hello = Some(v.clone()),
        "skip" => run.skip = Some(need("reason")?.as_str().unwrap_or("").to_string()),
        "startup" => run.startup_ms = need("consumer_ms")?.as_f64(),
        "result" => {
            let samples_ms = numbers(&need("samples_ms")?)
                .ok_or_else(|| format!("samples_ms is not a list of numbers: {line}"))?;
            let parts = match v.get("parts_ms") {
                None => Vec::new(),
                Some(p) => p
                    .as_object()
                    .and_then(|m| {
                        m.iter()
                            .map(|(k, s)| Some((k.clone(), numbers(s)?)))
                            .collect::<Option<Vec<_>>>()
                    })
                    .ok_or_else(|| {
                        format!("parts_ms is not an object of lists of numbers: {line}")
                    })?,
            };
            run.results.push(TorchResult {
                mode: need("mode")?.as_str().unwrap_or("").to_string(),
                size: need("size")?
                    .as_u64()
                    .ok_or_else(|| format!("size is not a byte count: {line}"))?,
                count: v["count"].as_u64(),
                extra_device_bytes: v["extra_device_bytes"].as_u64(),
                warmup: v["warmup"].as_u64().unwrap_or(0) as usize,
                samples_ms,
                verify_failures: v["verify_failures"].as_u64().unwrap_or(0),
                parts,
                skipped: v["skipped"].as_str().map(str::to_string),
            });
        }
        "error" => {
            run.error = Some(need("message")?.as_str().unwrap_or("").to_string());
        }
        "note" => run
            .notes
            .push(need("text")?.as_str().unwrap_or("").to_string()),
        "done" => run.done = true,
        _ => {}
    }
    Ok(())
}

/// Where the script is: the explicit path, else `bench/torch_share.py`
/// next to this executable (the GPU bundle puts it there), in the
/// executable's parent folder, in the source tree, or under the current
/// folder. `Err` lists where it looked.
pub fn find_script(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(format!("--torch-script {} does not exist", p.display()))
        };
    }
    let mut candidates = Vec::new();
    if let Ok(exe) = std::env::current_exe()
        && let Some(dir) = exe.parent()
    {
        candidates.push(dir.join("bench/torch_share.py"));
        if let Some(up) = dir.parent() {
            candidates.push(up.join("bench/torch_share.py"));
        }
    }
    candidates.push(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../bench/torch_share.py"));
    candidates.push(PathBuf::from("bench/torch_share.py"));
    candidates
        .iter()
        .find(|p| p.is_file())
        .cloned()
        .ok_or_else(|| {
            format!(
                "bench/torch_share.py not found (looked at {}); pass --torch-script",
                candidates
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })
}

/// The `--plan` argument: `size:warmup:reps,...`.
pub fn plan_arg(plan: &Plan) -> String {
    plan.sizes
        .iter()
        .map(|&s| {
            let r = plan.reps(s);
            format!("{s}:{}:{}", r.warmup, r.reps)
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// The `--sets` argument: `count:total:warmup:reps,...`.
pub fn sets_arg(plan: &Plan) -> String {
    plan.sets
        .iter()
        .map(|(count, total)| {
            let r = plan.set_reps;
            format!("{count}:{total}:{}:{}", r.warmup, r.reps)
        })
        .collect::<Vec<_>>()
        .join(",")
}

/// Keeps the last `cap` bytes of text.
fn tail(s: &str, cap: usize) -> &str {
    if s.len() <= cap {
        return s;
    }
    let mut i = s.len() - cap;
    while !s.is_char_boundary(i) {
        i += 1;
    }
    &s[i..]
}

/// The outcome of running the script.
pub enum Outcome {
    /// It ran (the run may still carry an error).
    Ran(TorchRun),
    /// It could not run for a reason that is not a failure of the bench
    /// (no interpreter, no script).
    Skipped(String),
    /// It failed.
    Failed(String, TorchRun),
}

/// Runs the script with `--device device` and `args`, and collects its
/// lines, within `timeout`.
pub fn run_script(
    python: &str,
    script: &Path,
    device: usize,
    args: &[String],
    timeout: Duration,
) -> Outcome {
    let mut child = match Command::new(python)
        .arg("-u")
        .arg(script)
        .args(["--device", &device.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
    {
        Ok(c) => c,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Outcome::Skipped(format!("{python} not found ({e}); pass --python"));
        }
        Err(e) => return Outcome::Failed(format!("starting {python}: {e}"), TorchRun::default()),
    };
    let (tx, rx) = mpsc::channel();
    let stdout = child.stdout.take().expect("piped");
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut stderr = child.stderr.take().expect("piped");
    let (err_tx, err_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut s = String::new();
        let _ = stderr.read_to_string(&mut s);
        let _ = err_tx.send(s);
    });
    let deadline = Instant::now() + timeout;
    let mut run = TorchRun::default();
    let mut problem = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                if let Err(e) = parse_line(&mut run, &line) {
                    problem.get_or_insert(e);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                // Our own child, by its handle.
                let _ = child.kill();
                problem = Some(format!(
                    "the script did not finish within {} s and was stopped",
                    timeout.as_secs()
                ));
                break;
            }
        }
    }
    let status = child.wait();
    // A child of the script (its consumer) may hold standard error open
    // after the script is gone: wait a little, not for ever.
    let err_text = err_rx
        .recv_timeout(Duration::from_secs(5))
        .unwrap_or_else(|_| "(not available: a child of the script still holds it open)".into());
    let err_tail = tail(err_text.trim(), 2000);
    if let Some(p) = problem {
        return Outcome::Failed(format!("{p}; its standard error ends: {err_tail}"), run);
    }
    if run.skip.is_some() {
        return Outcome::Ran(run);
    }
    match status {
        Ok(s) if s.success() && run.done => Outcome::Ran(run),
        Ok(s) => {
            let why = run
                .error
                .clone()
                .unwrap_or_else(|| format!("the script exited ({s}) without finishing"));
            Outcome::Failed(format!("{why}; its standard error ends: {err_tail}"), run)
        }
        Err(e) => Outcome::Failed(format!("waiting for the script: {e}"), run),
    }
}

/// The row of one result: series "PyTorch", the mode as variant (the set
/// modes as "list" and "bucket", with the count and the extra memory);
/// the modes of the scripts of ours from Python in [`PY_SERIES`], and
/// safetensors' load in [`SAFETENSORS_SERIES`].
pub fn result_row(r: &TorchResult) -> Row {
    let (series, variant) = match r.mode.as_str() {
        "set_list" => ("PyTorch", "list"),
        "set_bucket" => ("PyTorch", "bucket"),
        "py_set" => (PY_SERIES, "set"),
        "py_update" => (PY_SERIES, "update"),
        "py_fresh" => (PY_SERIES, "fresh"),
        "py_first_attach" => (PY_SERIES, FIRST_ATTACH),
        "safetensors_load" => (SAFETENSORS_SERIES, LOAD_FILE),
        other => ("PyTorch", other),
    };
    let mut row = Row::new(series, "ms")
        .variant(variant)
        .size(r.size)
        .samples(r.warmup, r.samples_ms.clone());
    if let Some(n) = r.count {
        row = row.count(n);
    }
    if let Some(b) = r.extra_device_bytes {
        row = row.extra_device_bytes(b);
    }
    for (name, samples) in &r.parts {
        row = row.part(name, samples);
    }
    if let Some(why) = &r.skipped {
        return row.skip(why.clone());
    }
    if r.verify_failures > 0 {
        row.failed(format!(
            "{} samples read values other than the producer wrote",
            r.verify_failures
        ))
    } else {
        row
    }
}

/// The versions line of the hello message.
fn versions_note(run: &TorchRun) -> Option<String> {
    let h = run.hello.as_ref()?;
    let get = |k: &str| h[k].as_str().unwrap_or("?").to_string();
    Some(format!(
        "PyTorch {} (CUDA {}), Python {}, on {}; torch.multiprocessing queues with the spawn \
         start method.",
        get("torch"),
        get("cuda"),
        get("python"),
        get("device")
    ))
}

/// Rows and notes from what the script reported.
pub fn to_section(run: &TorchRun) -> Section {
    if let Some(why) = &run.skip {
        return Section::skipped(SectionId::Torch, why.clone());
    }
    let mut s = Section::new(SectionId::Torch);
    s.rows.extend(run.results.iter().map(result_row));
    s.notes.extend(versions_note(run));
    if let Some(ms) = run.startup_ms {
        s.notes.push(format!(
            "The consumer's start (Python, import torch, CUDA) took {ms:.0} ms, not counted."
        ));
    }
    s.notes.push(
        "fresh: the producer makes a new tensor each sample (torch.full, finished), the clock \
         runs from just before Queue.put to the consumer's after Queue.get returned and \
         torch.cuda.current_stream().synchronize(); the consumer then checks 2 values, drops the \
         tensor and answers. repeat: the same tensor, refilled, put again each sample (PyTorch \
         reuses the consumer's opened handle)."
            .into(),
    );
    s
}

/// What running the anchor for a section gave.
pub enum Anchor {
    /// Not run, not a failure (--no-torch, no interpreter, no script, no
    /// torch or no CUDA in it).
    Skipped(String),
    /// It ran to the end.
    Ran(TorchRun),
    /// It failed; what it reported before is kept.
    Failed(String, TorchRun),
}

/// Runs the anchor script of `plan` with `args`, within `timeout`.
pub fn run_anchor(plan: &Plan, args: &[String], timeout: Duration) -> Anchor {
    let (python, script) = match &plan.torch {
        Err(why) => return Anchor::Skipped(why.clone()),
        Ok(t) => t,
    };
    let script = match find_script(script.as_deref()) {
        Ok(s) => s,
        // An explicit path that is missing is a failure; a bundled script
        // that is missing, a skip.
        Err(why) if script.is_some() => return Anchor::Failed(why, TorchRun::default()),
        Err(why) => return Anchor::Skipped(why),
    };
    match run_script(python, &script, plan.device, args, timeout) {
        Outcome::Ran(run) => match &run.skip {
            Some(why) => Anchor::Skipped(why.clone()),
            None => Anchor::Ran(run),
        },
        Outcome::Skipped(why) => Anchor::Skipped(why),
        Outcome::Failed(why, run) => Anchor::Failed(why, run),
    }
}

/// Section 7: the PyTorch anchor.
pub fn section(plan: &Plan, progress: &Progress) -> Section {
    progress.step("PyTorch anchor (bench/torch_share.py)");
    let timeout = Duration::from_secs(if plan.quick { 120 } else { 240 });
    let s = match run_anchor(plan, &["--plan".into(), plan_arg(plan)], timeout) {
        Anchor::Skipped(why) => Section::skipped(SectionId::Torch, why),
        Anchor::Ran(run) => to_section(&run),
        Anchor::Failed(why, run) => {
            let mut s = to_section(&run);
            s.status = super::report::Status::Ok;
            s.error = Some(why);
            s
        }
    };
    progress.done();
    s
}

/// PyTorch's weight-set rows (its list of tensors and its flattened
/// bucket, per set of `plan`), the notes that go with them, and the
/// script's error if it failed. Skipped rows say why when it did not run.
pub fn set_rows(plan: &Plan) -> (Vec<Row>, Vec<String>, Option<String>) {
    let args = [
        "--sets".to_string(),
        sets_arg(plan),
        "--modes".into(),
        "set_list,set_bucket".into(),
    ];
    let timeout = Duration::from_secs(if plan.quick { 120 } else { 300 });
    let skipped = |why: &str| -> Vec<Row> {
        plan.sets
            .iter()
            .flat_map(|(count, total)| {
                ["list", "bucket"].map(|v| {
                    Row::new("PyTorch", "ms")
                        .variant(v)
                        .count(*count)
                        .size(*total)
                        .skip(format!("PyTorch skipped: {why}"))
                })
            })
            .collect()
    };
    let (run, error) = match run_anchor(plan, &args, timeout) {
        Anchor::Skipped(why) => return (skipped(&why), Vec::new(), None),
        Anchor::Ran(run) => (run, None),
        Anchor::Failed(why, run) => (run, Some(why)),
    };
    let rows = run
        .results
        .iter()
        .filter(|r| r.count.is_some())
        .map(result_row)
        .collect();
    let notes = versions_note(&run).into_iter().collect();
    (rows, notes, error)
}

/// The script of the Python rows, next to the PyTorch anchor's.
pub const PY_SCRIPT: &str = "cuda_ipc_share.py";

/// Ours from Python (`bench/cuda_ipc_share.py`, the installed `cuda_ipc`
/// wheel): a fresh attach of an arena buffer at each size of the plan and
/// each weight set of the plan through publish_state_dict /
/// attach_state_dict; the notes that go with them and the script's error.
/// Skipped rows say why when it did not run (no wheel, no torch).
pub fn python_rows(plan: &Plan) -> (Vec<Row>, Vec<String>, Option<String>) {
    let skipped = |why: &str| -> Vec<Row> {
        plan.sets
            .iter()
            .map(|(count, total)| {
                Row::new(PY_SERIES, "ms")
                    .variant("set")
                    .count(*count)
                    .size(*total)
                    .skip(format!("ours from Python skipped: {why}"))
            })
            .collect()
    };
    let (python, script) = match sibling_script(plan, PY_SCRIPT) {
        Ok(x) => x,
        Err(why) => return (skipped(&why), Vec::new(), None),
    };
    let args = [
        "--plan".to_string(),
        plan_arg(plan),
        "--sets".into(),
        sets_arg(plan),
    ];
    let timeout = Duration::from_secs(if plan.quick { 120 } else { 300 });
    let (run, error) = match run_script(python, &script, plan.device, &args, timeout) {
        Outcome::Ran(run) => match &run.skip {
            Some(why) => return (skipped(why), Vec::new(), None),
            None => (run, None),
        },
        Outcome::Skipped(why) => return (skipped(&why), Vec::new(), None),
        Outcome::Failed(why, run) => (run, Some(why)),
    };
    let rows = run.results.iter().map(result_row).collect();
    (rows, python_notes(&run), error)
}

/// The notes of a run of a script of ours from Python: its versions line,
/// then its own notes.
pub fn python_notes(run: &TorchRun) -> Vec<String> {
    let versions = run.hello.as_ref().map(|h| {
        let get = |k: &str| h[k].as_str().unwrap_or("?").to_string();
        format!(
            "ours from Python: cuda_ipc {} with PyTorch {}, Python {}, on {}.",
            get("cuda_ipc"),
            get("torch"),
            get("python"),
            get("device")
        )
    });
    versions.into_iter().chain(run.notes.clone()).collect()
}

/// The interpreter and the script `name` of the folder of the PyTorch
/// anchor's script (`bench/`), or why they cannot run (a skip: --no-torch,
/// no such script).
pub fn sibling_script<'a>(plan: &'a Plan, name: &str) -> Result<(&'a str, PathBuf), String> {
    let (python, script) = plan.torch.as_ref().map_err(Clone::clone)?;
    let script = find_script(script.as_deref())?.with_file_name(name);
    if script.is_file() {
        Ok((python.as_str(), script))
    } else {
        Err(format!("{} not found", script.display()))
    }
}

#[cfg(test)]
mod tests {
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
        let args = super::super::Plan::from_args(&{
            use clap::Parser;
            #[derive(Parser)]
            struct Cli {
                #[command(flatten)]
                a: super::super::Args,
            }
            Cli::parse_from(["bench", "--sizes", "2MiB,8GiB"]).a
        })
        .unwrap();
        assert_eq!(plan_arg(&args), "2097152:10:100,8589934592:3:20");
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
        let Some(out) = run_fake("print('{\"kind\": \"hello\"}')\n", Duration::from_secs(60))
        else {
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
}
