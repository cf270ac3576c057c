//! A `--mps` run in the report: sections under MPS after the others,
//! labelled in the table, the header and the failures; targets from the
//! runs without MPS.

use super::tests::synthetic;
use super::*;

/// The synthetic run with its ring and sync sections again under MPS,
/// their frame rates `factor` times the others'.
fn with_mps(factor: f64) -> Report {
    let mut r = synthetic();
    let again: Vec<Section> = r
        .sections
        .iter()
        .filter(|s| matches!(s.id, SectionId::Ring | SectionId::Sync))
        .cloned()
        .map(|mut s| {
            s.mps = true;
            for row in &mut s.rows {
                row.value = row.value.map(|v| v * factor);
            }
            s
        })
        .collect();
    r.sections.extend(again);
    r.mps = Some(MpsPass {
        pipe_directory: "/tmp/cuda-ipc-mps-1-2/pipe".into(),
        driver_says_mps: Some(true),
        error: None,
    });
    r.evaluate();
    r
}

#[test]
fn sections_under_mps_are_labelled_in_the_table() {
    let plain = synthetic();
    let r = with_mps(5.0);
    let text = render(&r);
    assert!(text.contains("Streaming ring (") && text.contains("Streaming ring, under MPS ("));
    assert!(
        text.contains("Events against fences, under MPS ("),
        "{text}"
    );
    assert!(text.contains("MPS: every section ran twice"), "{text}");
    assert!(text.contains("/tmp/cuda-ipc-mps-1-2/pipe"), "{text}");
    assert!(text.contains("the driver confirmed"), "{text}");
    // Without --mps, no word of it.
    assert!(!render(&plain).contains("MPS"));
    // The runs without MPS come first and carry the targets.
    let ring = r.section(SectionId::Ring).unwrap();
    let under = r
        .sections
        .iter()
        .find(|s| s.id == SectionId::Ring && s.mps)
        .unwrap();
    assert!(!ring.mps && under.mps);
    assert_eq!(r.targets, plain.targets);
    let first = text.find("Streaming ring (").unwrap();
    assert!(first < text.find("Streaming ring, under MPS").unwrap());
}

#[test]
fn a_driver_that_did_not_use_mps_and_a_failed_pass_are_said() {
    let mut r = with_mps(1.0);
    let m = r.mps.as_mut().unwrap();
    m.driver_says_mps = Some(false);
    m.error = Some("the pass under MPS exited with exit status: 3".into());
    let mut s = Section::new(SectionId::Ring);
    s.mps = true;
    s.error = Some("no report".into());
    s.finish();
    r.sections.push(s);
    let text = render(&r);
    assert!(text.contains("did NOT go through MPS"), "{text}");
    assert!(
        text.contains("MPS: FAILED: the pass under MPS exited"),
        "{text}"
    );
    // The synthetic run's fresh section fails too.
    assert_eq!(r.failed_sections(), vec!["fresh", "ring under MPS"]);
    assert!(
        text.contains("FAILED sections: fresh, ring under MPS"),
        "{text}"
    );
}

#[test]
fn mps_is_in_the_json_only_when_used() {
    let plain: serde_json::Value = serde_json::from_str(&synthetic().to_json()).unwrap();
    assert!(plain.get("mps").is_none());
    assert!(plain["sections"][0].get("mps").is_none());
    let r = with_mps(2.0);
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["mps"]["pipe_directory"], "/tmp/cuda-ipc-mps-1-2/pipe");
    assert_eq!(v["mps"]["driver_says_mps"], true);
    let last = v["sections"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["mps"], true);
    // And it reads back the same (the parent reads the pass's report).
    let back: Report = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(back, r);
}
