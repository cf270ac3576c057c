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
    // The push section's block sizes too, for its PyTorch column.
    let mut sizes = plan.sizes.clone();
    if plan.sections.contains(&crate::report::SectionId::Push) {
        sizes.extend(crate::plan::PUSH_SIZES);
    }
    sizes.sort_unstable();
    sizes.dedup();
    sizes
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
mod tests;
