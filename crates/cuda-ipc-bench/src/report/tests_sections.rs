//! The targets and tables of the arena, cached, set and wake-up sections,
//! checked on the synthetic run of `tests.rs`.

use super::format::fmt_ms;
use super::model::Verdict;
use super::tests::{lat, synthetic, verdict};
use super::*;

#[test]
fn arena_targets() {
    let r = synthetic();
    // legacy 2 MiB: 0.021 ms (pass); PyTorch 0.55 / 0.021 = 26x (pass)
    assert_eq!(verdict(&r, "arena/legacy/2MiB"), Verdict::Pass);
    assert_eq!(verdict(&r, "arena-torch/legacy/2MiB"), Verdict::Pass);
    // legacy 64 MiB: 0.041 ms (miss); PyTorch 0.65 / 0.041 = 15.9x (pass)
    assert_eq!(verdict(&r, "arena/legacy/64MiB"), Verdict::Miss);
    assert_eq!(verdict(&r, "arena-torch/legacy/64MiB"), Verdict::Pass);
    // vmm: not in the arena section (not run for it), so not measured
    assert!(r.targets.iter().all(|t| !t.id.starts_with("arena/vmm")));
    // pool: the device lacks it, so no target
    assert!(r.targets.iter().all(|t| !t.id.starts_with("arena/pool")));
    // the cached target is 0.008 ms below 1 GiB, every mechanism
    assert_eq!(verdict(&r, "cached/legacy/2MiB"), Verdict::Pass);
    let t = r
        .targets
        .iter()
        .find(|t| t.id == "cached/vmm/2MiB")
        .unwrap();
    assert_eq!(
        (t.verdict, t.target.as_str()),
        (Verdict::Miss, "<= 0.008 ms")
    );
}

#[test]
fn cached_targets_are_larger_from_a_gibibyte() {
    let mut r = synthetic();
    let cached = r
        .sections
        .iter_mut()
        .find(|s| s.id == SectionId::Cached)
        .unwrap();
    cached
        .rows
        .push(lat("legacy", 1 << 30, &[0.009, 0.009, 0.009]));
    cached
        .rows
        .push(lat("vmm", 8 << 30, &[0.011, 0.011, 0.011]));
    cached
        .rows
        .push(lat("vmm", (1 << 30) - 4096, &[0.009, 0.009]));
    r.evaluate();
    let target = |id: &str| {
        let t = r.targets.iter().find(|t| t.id == id).unwrap();
        (t.verdict, t.target.clone())
    };
    // 0.009 ms: over 0.008 below 1 GiB, within 0.010 from 1 GiB up
    assert_eq!(
        target("cached/legacy/1GiB"),
        (Verdict::Pass, "<= 0.010 ms".into())
    );
    assert_eq!(
        target("cached/vmm/8GiB"),
        (Verdict::Miss, "<= 0.010 ms".into())
    );
    let below = r
        .targets
        .iter()
        .find(|t| {
            t.id.starts_with("cached/vmm/")
                && t.id != "cached/vmm/8GiB"
                && t.id != "cached/vmm/2MiB"
        })
        .unwrap();
    assert_eq!(
        (below.verdict, below.target.as_str()),
        (Verdict::Miss, "<= 0.008 ms")
    );
}

#[test]
fn set_targets() {
    let mut r = synthetic();
    assert_eq!(verdict(&r, "sets/100"), Verdict::Pass);
    assert_eq!(verdict(&r, "sets/1000"), Verdict::Pass);
    // 56 / 0.8 = 70x (pass); 6.7 / 0.8 = 8.4x (pass)
    assert_eq!(verdict(&r, "sets-list/1000"), Verdict::Pass);
    assert_eq!(verdict(&r, "sets-bucket/1000"), Verdict::Pass);
    let t = r.targets.iter().find(|t| t.id == "sets-list/1000").unwrap();
    assert!((t.measured.unwrap() - 70.0).abs() < 1e-9);
    assert_eq!(verdict(&r, "sets-memory/1000"), Verdict::Pass);
    assert_eq!(verdict(&r, "sets-update/100"), Verdict::Pass);
    assert_eq!(verdict(&r, "sets-update/1000"), Verdict::Miss);
    // ours slower and with extra memory: misses
    let i = r
        .sections
        .iter()
        .position(|s| s.id == SectionId::Sets)
        .unwrap();
    r.sections[i].rows[2] = Row::new("ours", "ms")
        .variant("set")
        .count(1000)
        .size(256 << 20)
        .samples(2, vec![2.0])
        .extra_device_bytes(2 << 20);
    r.evaluate();
    assert_eq!(verdict(&r, "sets/1000"), Verdict::Miss);
    assert_eq!(verdict(&r, "sets-bucket/1000"), Verdict::Miss);
    assert_eq!(verdict(&r, "sets-list/1000"), Verdict::Miss);
    assert_eq!(verdict(&r, "sets-memory/1000"), Verdict::Miss);
    // ours skipped (no mechanism): every set target is listed, not measured
    for row in &mut r.sections[i].rows {
        if row.series == "ours" {
            *row = Row::new("ours", "ms")
                .variant(row.variant.clone().unwrap())
                .count(row.count.unwrap())
                .size(256 << 20)
                .skip("no mechanism");
        }
    }
    r.evaluate();
    for id in [
        "sets/100",
        "sets/1000",
        "sets-list/1000",
        "sets-bucket/1000",
        "sets-memory/1000",
        "sets-update/100",
        "sets-update/1000",
    ] {
        assert_eq!(verdict(&r, id), Verdict::NotMeasured, "{id}");
    }
    // PyTorch skipped: its ratios say so
    r.sections[i] = synthetic().sections[i].clone();
    r.sections[i].rows.retain(|row| row.series == "ours");
    let t = r
        .sections
        .iter()
        .position(|s| s.id == SectionId::Torch)
        .unwrap();
    r.sections[t] = Section::skipped(SectionId::Torch, "--no-torch");
    r.evaluate();
    let t = r
        .targets
        .iter()
        .find(|t| t.id == "sets-bucket/1000")
        .unwrap();
    assert_eq!(
        (t.verdict, t.shown.as_str()),
        (Verdict::NotMeasured, "PyTorch skipped")
    );
}

#[test]
fn arena_and_set_tables() {
    let r = synthetic();
    let text = render(&r);
    let arena: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("Fresh hand-off from an arena"))
        .take(6)
        .collect();
    // legacy 2 MiB: per-buffer 0.11 / 0.021, PyTorch 0.55 / 0.021
    assert!(
        arena[2].trim_start().starts_with("legacy")
            && arena[2].contains("PASS")
            && arena[2].contains("5.24x")
            && arena[2].contains("26.19x"),
        "{arena:?}"
    );
    assert!(arena[3].contains("MISS"), "{arena:?}");
    assert!(
        arena[4].contains("pool 2MiB: skipped: pool sharing is off here"),
        "{arena:?}"
    );
    let sets: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("Weight sets"))
        .take(10)
        .collect();
    assert!(
        sets[1].contains("contender") && sets[1].contains("extra"),
        "{sets:?}"
    );
    // per count: ours set, ours update, PyTorch list, PyTorch bucket
    assert!(
        sets[2].trim_start().starts_with("ours set") && sets[2].contains("PASS"),
        "{sets:?}"
    );
    assert!(sets[3].trim_start().starts_with("ours update"), "{sets:?}");
    // 11.0 / 0.31 and 3.6 / 0.31, the bucket's extra 256 MiB
    assert!(
        sets[4].trim_start().starts_with("PyTorch list") && sets[4].ends_with("35.48x"),
        "{sets:?}"
    );
    assert!(
        sets[5].trim_start().starts_with("PyTorch bucket")
            && sets[5].contains("256MiB")
            && sets[5].ends_with("11.61x"),
        "{sets:?}"
    );
    assert!(
        sets[6].trim_start().starts_with("ours set") && sets[6].contains("1000"),
        "{sets:?}"
    );
    assert!(sets[7].contains("MISS"), "update 1000: {sets:?}");
    assert!(text.contains("* the sets"), "{text}");
}

#[test]
fn clocked_phases_print_under_the_table_largest_first() {
    let text = render(&synthetic());
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("largest phases"))
        .collect();
    // Only the arena's 64 MiB row was clocked; its six largest phases, the
    // plain parts ("consumer") left out.
    assert_eq!(
        lines,
        [
            "  legacy 64MiB: largest phases, p50 ms: attach: request 0.0300, attach: synchronize \
          0.0060, publish: event 0.0040, attach: wait 0.0030, attach: record 0.0020, publish: \
          record 0.0010"
        ],
        "{text}"
    );
}

#[test]
fn a_skipped_sets_section_has_no_table_and_no_targets() {
    let mut r = synthetic();
    let i = r
        .sections
        .iter()
        .position(|s| s.id == SectionId::Sets)
        .unwrap();
    r.sections[i] = Section::skipped(SectionId::Sets, "not asked for");
    r.evaluate();
    assert!(r.targets.iter().all(|t| !t.id.starts_with("sets")));
    let text = render(&r);
    assert!(
        text.contains("Weight sets (0.0 s)  [skipped: not asked for]"),
        "{text}"
    );
    assert!(!text.contains("contender"), "{text}");
}

#[test]
fn the_wake_up_floor_has_its_own_table_and_a_line_under_the_targets() {
    let mut r = synthetic();
    let floor = r
        .sections
        .iter_mut()
        .find(|s| s.id == SectionId::Floor)
        .unwrap();
    floor.rows.push(
        Row::new(WAKE_SERIES, "ms")
            .variant("asleep, 10 ms idle")
            .failed("sample 3: the consumer died"),
    );
    r.evaluate();
    let text = render(&r);
    let floor_at = text.find("Driver floor").expect("the floor section");
    let table = &text[floor_at..];
    assert!(table.contains("wake-up"), "{table}");
    assert!(table.contains("wake asleep, 1 ms idle"), "{table}");
    assert!(table.contains("the consumer died"), "{table}");
    let line = targets::wake_floor_line(&r).expect("a line");
    assert_eq!(
        line,
        format!(
            "Wake-up floor here (driver floor section, a notice through shared memory, no GPU \
             work), p50: asleep, 1 ms idle {} ms; spinning, 1 ms idle {} ms. Every update, ring \
             frame and attach's answer to a waiting consumer pays at least one.",
            fmt_ms(0.03),
            fmt_ms(0.0004)
        )
    );
    let targets_at = text.rfind("Targets").unwrap();
    assert!(text[targets_at..].contains(&line), "{text}");
    // The run's idle states follow the line, when it kept them.
    assert!(!text.contains("Idle processors here"), "{text}");
    let idle = crate::idle::IdleStates {
        virtualised: Some(true),
        driver: Some("none".into()),
        ..Default::default()
    };
    r.idle = Some(idle.clone());
    let text = render(&r);
    let after = format!("{line}\nIdle processors here: {}.\n", idle.describe());
    assert!(text.contains(&after), "{text}");
    // The floor's mechanism rows keep their own table, without the wake rows.
    let first_table = &table[..table.find("wake-up").unwrap()];
    assert!(!first_table.contains("wake asleep"), "{first_table}");

    // Without wake rows (an older run's JSON), no line.
    for s in &mut r.sections {
        s.rows.retain(|row| row.series != WAKE_SERIES);
    }
    assert_eq!(targets::wake_floor_line(&r), None);
    assert!(!render(&r).contains("Wake-up floor"));
    assert!(!render(&r).contains("Idle processors here"));
}
