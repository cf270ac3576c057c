//! A `--mps` run in the report: sections under MPS after the others,
//! labelled in the table, the header and the failures; targets from the
//! runs without MPS.

use super::model::Verdict;
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
    // The targets of the runs without MPS are the plain run's; the pass
    // under MPS adds its own, after them.
    let (mps, others): (Vec<_>, Vec<_>) = r.targets.iter().partition(|t| t.id.starts_with("mps/"));
    assert_eq!(
        others.into_iter().cloned().collect::<Vec<_>>(),
        plain.targets
    );
    assert!(!mps.is_empty() && plain.targets.iter().all(|t| !t.id.starts_with("mps/")));
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

#[test]
fn the_ring_under_mps_is_held_to_its_rate_and_to_the_floor_under_mps() {
    // Under MPS the synthetic ring does 123,456 x 5 = 617,280 frames/s
    // (over 150,000: met) and its floor 232,000 x 5: 1.88x (over 1.25x:
    // missed).
    let r = with_mps(5.0);
    let get = |id: &str| {
        r.targets
            .iter()
            .find(|t| t.id == id)
            .unwrap_or_else(|| panic!("no target {id} in {:#?}", r.targets))
    };
    let rate = get("mps/ring/vmm/4KiB");
    assert_eq!(rate.verdict, Verdict::Pass);
    assert_eq!(rate.measured, Some(617_280.0));
    let floor = get("mps/floor/vmm");
    assert_eq!(floor.verdict, Verdict::Miss);
    assert!((floor.measured.unwrap() - 232_000.0 / 123_456.0).abs() < 1e-9);
    // At the plain run's rates the ring under MPS misses its rate; with
    // the floor under MPS at the ring's rate, the ratio is met.
    let mut slow = with_mps(1.0);
    for s in slow
        .sections
        .iter_mut()
        .filter(|s| s.mps && s.id == SectionId::Sync)
    {
        for row in &mut s.rows {
            if row.series == targets::SYNC_FLOOR_SERIES {
                row.value = Some(123_456.0 * 1.2);
            }
        }
    }
    slow.evaluate();
    let verdict = |id: &str| slow.targets.iter().find(|t| t.id == id).unwrap().verdict;
    assert_eq!(verdict("mps/ring/vmm/4KiB"), Verdict::Miss);
    assert_eq!(verdict("mps/floor/vmm"), Verdict::Pass);
}

#[test]
fn a_run_without_its_pass_under_mps_has_no_mps_targets() {
    let mut r = with_mps(5.0);
    r.sections.retain(|s| !s.mps);
    r.evaluate();
    assert!(r.targets.iter().all(|t| !t.id.starts_with("mps/")));
    // A pass under MPS without its sync section: the ratio is not measured.
    let mut r = with_mps(5.0);
    r.sections.retain(|s| !(s.mps && s.id == SectionId::Sync));
    r.evaluate();
    let floor = r.targets.iter().find(|t| t.id == "mps/floor/vmm").unwrap();
    assert_eq!(floor.verdict, Verdict::NotMeasured);
}
