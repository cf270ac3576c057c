//! The first attach of a model in a new process, rows of the sets section:
//! runs `bench/first_attach.py` (next to the PyTorch anchor's script),
//! whose fresh Python processes each connect to a running publisher and
//! attach a Qwen2-shaped bfloat16 model of 4.4 GB (`Subscriber` +
//! `attach_state_dict`), and which loads the same tensors with
//! safetensors' `load_file` from the page cache in the same run. Its lines
//! are those of [`crate::torch`]: `result` lines of the modes
//! `py_first_attach` and `safetensors_load` (that one with `"skipped"`
//! where safetensors is not importable), and `note` lines.

use std::time::Duration;

use crate::Plan;
use crate::report::Row;
use crate::report::targets::{FIRST_ATTACH, LOAD_FILE, PY_SERIES, SAFETENSORS_SERIES};
use crate::torch::{Outcome, TorchRun, result_row, run_script, sibling_script};

/// The script, in the folder of the PyTorch anchor's.
pub const SCRIPT: &str = "first_attach.py";
/// The keys of the model's state dict (the script's table; a test compares).
pub const MODEL_KEYS: u64 = 291;
/// The model's bytes in bfloat16, its tied tensor counted once.
pub const MODEL_BYTES: u64 = 4_372_385_792;

/// The script's arguments for `plan`.
pub fn args(plan: &Plan) -> Vec<String> {
    let r = plan.first_attach;
    vec![
        "--reps".into(),
        format!("{}:{}", r.warmup, r.reps),
        "--loads".into(),
        plan.first_attach_loads.to_string(),
    ]
}

/// The two rows, skipped saying `why`.
fn skipped(why: &str) -> Vec<Row> {
    [(PY_SERIES, FIRST_ATTACH), (SAFETENSORS_SERIES, LOAD_FILE)]
        .into_iter()
        .map(|(series, variant)| {
            Row::new(series, "ms")
                .variant(variant)
                .count(MODEL_KEYS)
                .size(MODEL_BYTES)
                .skip(format!("first attach skipped: {why}"))
        })
        .collect()
}

/// The notes of a run: the versions, then the script's own (the model and
/// where its shapes came from).
fn notes(run: &TorchRun) -> Vec<String> {
    let versions = run.hello.as_ref().map(|h| {
        let get = |k: &str| h[k].as_str().unwrap_or("not importable").to_string();
        format!(
            "first attach (bench/first_attach.py): cuda_ipc {}, PyTorch {}, transformers {}, \
             safetensors {}.",
            get("cuda_ipc"),
            get("torch"),
            get("transformers"),
            get("safetensors")
        )
    });
    versions.into_iter().chain(run.notes.clone()).collect()
}

/// The first attach's rows (ours from Python and safetensors' load), their
/// notes and the script's error if it failed. Skipped rows say why when it
/// did not run (--no-torch, no script, no wheel, no torch).
pub fn rows(plan: &Plan) -> (Vec<Row>, Vec<String>, Option<String>) {
    let (python, script) = match sibling_script(plan, SCRIPT) {
        Ok(x) => x,
        Err(why) => return (skipped(&why), Vec::new(), None),
    };
    let timeout = Duration::from_secs(if plan.quick { 180 } else { 300 });
    let (run, error) = match run_script(python, &script, plan.device, &args(plan), timeout) {
        Outcome::Ran(run) => match &run.skip {
            Some(why) => return (skipped(why), Vec::new(), None),
            None => (run, None),
        },
        Outcome::Skipped(why) => return (skipped(&why), Vec::new(), None),
        Outcome::Failed(why, run) => (run, Some(why)),
    };
    let rows = run.results.iter().map(result_row).collect();
    (rows, notes(&run), error)
}

#[cfg(test)]
mod tests {
    use std::process::Command;

    use super::*;
    use crate::torch::find_script;

    fn plan(extra: &[&str]) -> Plan {
        use clap::Parser;
        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            a: crate::Args,
        }
        let argv = ["bench"].iter().chain(extra).copied();
        Plan::from_args(&Cli::parse_from(argv).a).unwrap()
    }

    #[test]
    fn arguments_of_quick_and_full_runs() {
        assert_eq!(args(&plan(&["--quick"])), ["--reps", "1:5", "--loads", "3"]);
        // --reps does not multiply the processes
        assert_eq!(
            args(&plan(&["--reps", "50"])),
            ["--reps", "1:10", "--loads", "5"]
        );
    }

    #[test]
    fn without_an_interpreter_both_rows_are_skipped_saying_why() {
        let (rows, notes, error) = rows(&plan(&["--quick", "--no-torch"]));
        assert!(notes.is_empty() && error.is_none());
        let got: Vec<_> = rows
            .iter()
            .map(|r| (r.series.as_str(), r.variant.as_deref().unwrap(), r.count))
            .collect();
        assert_eq!(
            got,
            [
                (PY_SERIES, FIRST_ATTACH, Some(MODEL_KEYS)),
                (SAFETENSORS_SERIES, LOAD_FILE, Some(MODEL_KEYS))
            ]
        );
        assert!(rows.iter().all(|r| r.skipped.as_deref()
            == Some("first attach skipped: --no-torch")
            && r.size == Some(MODEL_BYTES)));
    }

    /// The script's table gives the model these constants describe; its
    /// own tests pass (neither needs torch).
    #[test]
    fn the_scripts_model_is_the_one_described_here() {
        let script = find_script(None).unwrap().with_file_name(SCRIPT);
        let Ok(out) = Command::new("python3")
            .arg("-B")
            .arg(&script)
            .arg("--print-model")
            .output()
        else {
            eprintln!("skipped: no python3 here");
            return;
        };
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(v["keys"], MODEL_KEYS);
        assert_eq!(v["bytes"], MODEL_BYTES);
        assert_eq!(v["ties"]["lm_head.weight"], "model.embed_tokens.weight");
    }

    #[test]
    fn results_of_a_stand_in_script_become_rows_and_notes() {
        if Command::new("python3").arg("--version").output().is_err() {
            eprintln!("skipped: no python3 here");
            return;
        }
        let dir =
            std::env::temp_dir().join(format!("cuda-ipc-first-attach-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let torch_script = dir.join("torch_share.py");
        std::fs::write(&torch_script, "").unwrap();
        std::fs::write(
            dir.join(SCRIPT),
            r#"
import json, sys
assert sys.argv[1:] == ["--device", "0", "--reps", "1:5", "--loads", "3"], sys.argv
for line in [
    {"kind": "hello", "cuda_ipc": "0.1.0", "torch": "2.11.0", "transformers": None,
     "safetensors": "0.8.0", "device": "fake", "python": "3"},
    {"kind": "note", "text": "first attach: a Qwen2-shaped model, shapes from the table"},
    {"kind": "result", "mode": "py_first_attach", "size": 4372385792, "count": 291, "warmup": 1,
     "samples_ms": [2.5, 2.7, 3.5], "verify_failures": 0,
     "parts_ms": {"connect": [0.4, 0.5, 0.6], "attach": [2.1, 2.2, 2.9],
                  "startup": [2500.0, 2600.0, 2700.0], "start_to_usable": [2502.5, 2602.7, 2703.5]}},
    {"kind": "result", "mode": "safetensors_load", "size": 4372385792, "count": 291, "warmup": 0,
     "samples_ms": [1300.0, 1400.0], "verify_failures": 1, "parts_ms": {}},
    {"kind": "done", "elapsed_s": 0.1},
]:
    print(json.dumps(line))
"#,
        )
        .unwrap();
        let t = torch_script.display().to_string();
        let (rows, notes, error) = rows(&plan(&["--quick", "--torch-script", &t]));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(error, None);
        assert_eq!(rows.len(), 2);
        let (ours, load) = (&rows[0], &rows[1]);
        assert_eq!(
            (ours.series.as_str(), ours.variant.as_deref()),
            (PY_SERIES, Some(FIRST_ATTACH))
        );
        assert!((ours.p50().unwrap() - 2.7).abs() < 1e-12);
        assert!((ours.part_p50("start_to_usable").unwrap() - 2602.7).abs() < 1e-9);
        assert_eq!((ours.count, ours.size), (Some(291), Some(MODEL_BYTES)));
        assert_eq!(load.series, SAFETENSORS_SERIES);
        // a load whose values differ fails its row
        assert!(load.error.as_deref().unwrap().contains("1 samples"));
        assert!(
            notes[0].contains("transformers not importable")
                && notes[0].contains("safetensors 0.8.0"),
            "{notes:?}"
        );
        assert!(notes[1].contains("shapes from the table"), "{notes:?}");
    }

    #[test]
    fn a_skipped_load_is_a_skipped_row() {
        let mut run = TorchRun::default();
        crate::torch::parse_line(
            &mut run,
            r#"{"kind": "result", "mode": "safetensors_load", "size": 1, "count": 291, "samples_ms": [], "skipped": "safetensors is not importable"}"#,
        )
        .unwrap();
        let row = result_row(&run.results[0]);
        assert_eq!(row.series, SAFETENSORS_SERIES);
        assert_eq!(
            row.skipped.as_deref(),
            Some("safetensors is not importable")
        );
        assert!(row.error.is_none());
    }
}
