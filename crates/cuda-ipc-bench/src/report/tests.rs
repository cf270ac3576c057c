//! The report's model, its general targets, the table and the JSON,
//! checked on a synthetic run (`synthetic`, which the other test modules
//! of the report share).

use super::format::fmt_ms;
use super::model::Verdict;
use super::*;

pub(super) fn lat(series: &str, size: u64, samples: &[f64]) -> Row {
    Row::new(series, "ms")
        .size(size)
        .samples(5, samples.to_vec())
}

/// A report with every section filled with synthetic numbers.
#[allow(clippy::too_many_lines)] // one report with every section
pub(crate) fn synthetic() -> Report {
    let mib2 = 2 << 20;
    let mib64 = 64 << 20;
    let mut fresh = Section::new(SectionId::Fresh);
    fresh.rows = vec![
        lat("legacy", mib2, &[0.10, 0.11, 0.12]).part("publish", &[0.01, 0.01, 0.01]),
        lat("legacy", mib64, &[0.12, 0.13, 0.14]),
        lat("vmm", mib2, &[0.30, 0.31, 0.32]),
        lat("vmm", mib64, &[0.30, 0.31, 0.32]),
        Row::new("pool", "ms")
            .size(mib2)
            .failed("allocating 2MiB: out of memory"),
    ];
    let mut arena = Section::new(SectionId::Arena);
    arena.rows = vec![
        lat("legacy", mib2, &[0.020, 0.021, 0.022]),
        [
            ("publish: event", 0.004),
            ("publish: record", 0.001),
            ("attach: request", 0.030),
            ("attach: synchronize", 0.006),
            ("attach: record", 0.002),
            ("attach: view", 0.0005),
            ("attach: wait", 0.003),
        ]
        .iter()
        .fold(
            lat("legacy", mib64, &[0.040, 0.041, 0.042]).part("consumer", &[0.9]),
            |row, (name, ms)| row.part(name, &[*ms]),
        ),
        Row::new("pool", "ms")
            .size(mib2)
            .skip("pool sharing is off here"),
    ];
    let mut push = Section::new(SectionId::Push);
    push.rows = vec![
        lat("push, asleep", 16 << 10, &[0.009, 0.010, 0.011]),
        lat("push, spinning", 16 << 10, &[0.004, 0.006, 0.007]),
        lat("pull, asleep", 16 << 10, &[0.040, 0.041, 0.042]),
    ];
    let mut sets = Section::new(SectionId::Sets);
    let set = |series: &str, variant: &str, count: u64, samples: &[f64]| {
        Row::new(series, "ms")
            .variant(variant)
            .count(count)
            .size(256 << 20)
            .samples(2, samples.to_vec())
    };
    sets.rows = vec![
        set("ours", "set", 100, &[0.30, 0.31, 0.32]).extra_device_bytes(0),
        set("ours", "update", 100, &[0.02, 0.02]),
        set("ours", "set", 1000, &[0.8, 0.8]).extra_device_bytes(0),
        set("ours", "update", 1000, &[0.05, 0.05]),
        set("PyTorch", "list", 100, &[11.0, 11.0]).extra_device_bytes(0),
        set("PyTorch", "bucket", 100, &[3.6, 3.6]).extra_device_bytes(256 << 20),
        set("PyTorch", "list", 1000, &[56.0, 56.0]).extra_device_bytes(0),
        set("PyTorch", "bucket", 1000, &[6.7, 6.7]).extra_device_bytes(256 << 20),
    ];
    sets.notes.push("the sets".into());
    let mut cached = Section::new(SectionId::Cached);
    cached.rows = vec![
        lat("legacy", mib2, &[0.007, 0.008, 0.010]),
        lat("vmm", mib2, &[0.025, 0.026, 0.027]),
    ];
    let mut floor = Section::new(SectionId::Floor);
    floor.rows = vec![
        lat("legacy floor", mib2, &[0.08, 0.09, 0.10]).part("export", &[0.005]),
        lat("legacy floor", mib64, &[0.10, 0.10, 0.10]),
        lat("vmm floor", mib2, &[0.25, 0.25, 0.25]),
        lat("vmm floor", mib64, &[0.15, 0.15, 0.15]),
        Row::new("pipe", "ms").samples(0, vec![0.02, 0.02]),
        Row::new(WAKE_SERIES, "ms")
            .variant("asleep, 1 ms idle")
            .samples(0, vec![0.03, 0.03])
            .part("write", &[0.002, 0.002]),
        Row::new(WAKE_SERIES, "ms")
            .variant("spinning, 1 ms idle")
            .samples(0, vec![0.0004, 0.0004]),
    ];
    let mut bw = Section::new(SectionId::Bandwidth);
    let gbs = |m: &str, v: &str, x: f64| {
        Row::new(m, "GB/s")
            .variant(v)
            .size(256 << 20)
            .samples(3, vec![x, x, x])
    };
    bw.rows = vec![
        gbs("legacy", "from_mapping", 4200.0),
        gbs("legacy", "local", 4250.0),
        gbs("legacy", "into_mapping", 4240.0),
        gbs("vmm", "from_mapping", 3000.0),
        gbs("vmm", "local", 4250.0),
        gbs("vmm", "into_mapping", 4240.0),
    ];
    let mut peer = Section::new(SectionId::Peer);
    peer.rows = vec![
        lat("legacy", mib2, &[0.20, 0.22, 0.24]),
        lat("vmm", mib2, &[0.62, 0.62, 0.62]),
        lat("legacy floor", mib2, &[0.10, 0.11, 0.12]),
        lat("legacy", mib2, &[0.027, 0.027, 0.027]).variant("cached"),
        Row::new("vmm floor", "ms")
            .size(mib2)
            .skip("no floor today"),
        gbs("legacy", "from_mapping", 700.0),
        gbs("legacy", "memcpy_peer", 710.0),
        gbs("legacy", "local", 4250.0),
        gbs("legacy", "into_mapping", 690.0),
        gbs("vmm", "from_mapping", 500.0),
        gbs("vmm", "memcpy_peer", 710.0),
        gbs("vmm", "local", 4250.0),
        gbs("vmm", "into_mapping", 690.0),
        Row::new("pool", "GB/s")
            .variant("from_mapping")
            .skip("pool sharing is off here"),
    ];
    let mut ring = Section::new(SectionId::Ring);
    let mut r4k = Row::new("vmm", "ms")
        .variant("load")
        .size(4096)
        .count(64)
        .samples(0, vec![0.2, 0.3]);
    r4k.value = Some(123_456.0);
    let mut r1m = Row::new("vmm", "ms")
        .variant("load")
        .size(1 << 20)
        .count(32)
        .samples(0, vec![0.4]);
    r1m.value = Some(50_000.0);
    ring.rows = vec![
        r4k,
        Row::new("vmm", "ms")
            .variant("paced")
            .size(4096)
            .samples(0, vec![0.05]),
        r1m,
    ];
    let mut sync = Section::new(SectionId::Sync);
    let fps = |series: &str, v: f64| {
        let mut row = Row::new(series, "ms")
            .variant("load")
            .size(4096)
            .samples(0, vec![0.04, 0.05]);
        row.value = Some(v);
        row
    };
    let mut floor_row = Row::new("floor: fill + signal", "ms").size(4096);
    floor_row.value = Some(232_000.0);
    sync.rows = vec![
        lat("event", mib2, &[0.02, 0.02]).variant("cached"),
        lat("fence", mib2, &[0.02, 0.02]).variant("cached"),
        fps("fence", 22_800.0),
        Row::new("fence", "ms")
            .variant("paced")
            .size(4096)
            .samples(0, vec![0.29, 0.31, 0.33]),
        fps("fence, batch 8", 260_000.0),
        fps("host-fence", 240_000.0),
        Row::new("host-fence", "ms")
            .variant("paced")
            .size(4096)
            .samples(0, vec![0.012, 0.015]),
        floor_row,
    ];
    let mut scale = Section::new(SectionId::Scale);
    let mut slope = Row::new("vmm", "ms/consumer").variant("slope");
    slope.value = Some(0.0123);
    scale.rows = vec![
        Row::new("vmm", "ms")
            .variant("consumers")
            .count(1)
            .size(mib2)
            .samples(5, vec![0.3]),
        Row::new("vmm", "ms")
            .variant("consumers")
            .count(2)
            .size(mib2)
            .samples(5, vec![0.32]),
        slope,
        Row::new("vmm", "ms")
            .variant("live_entries")
            .count(100)
            .size(mib2)
            .samples(5, vec![0.35]),
    ];
    let mut torch = Section::new(SectionId::Torch);
    torch.rows = vec![
        Row::new("PyTorch", "ms")
            .variant("fresh")
            .size(mib2)
            .samples(5, vec![0.5, 0.6]),
        Row::new("PyTorch", "ms")
            .variant("fresh")
            .size(mib64)
            .samples(5, vec![0.6, 0.7]),
        Row::new("PyTorch", "ms")
            .variant("repeat")
            .size(mib2)
            .samples(5, vec![0.2]),
        Row::new("PyTorch", "ms")
            .variant("fresh")
            .size(16 << 10)
            .samples(5, vec![0.25]),
    ];
    torch.notes.push("PyTorch 2.11.0".into());
    let mut r = Report {
        schema: 1,
        tool: "cuda-ipc bench 0.1.0".into(),
        command: vec!["cuda-ipc".into(), "bench".into(), "--quick".into()],
        quick: true,
        device: Some(DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H200".into(),
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            driver: "13.0".into(),
        }),
        peer: Some(PeerInfo {
            device: DeviceInfo {
                ordinal: 1,
                name: "NVIDIA H200".into(),
                uuid: "GPU-11111111-0000-0000-0000-000000000000".into(),
                driver: "13.0".into(),
            },
            link: "NVLink (18 active links)".into(),
            access_supported: true,
        }),
        mechanisms: vec!["legacy".into(), "vmm".into(), "pool".into()],
        sizes: vec![mib2, mib64],
        consumer_namespaces: Vec::new(),
        consumer_command: String::new(),
        started_unix_s: 0.0,
        elapsed_s: 42.0,
        mps: None,
        awake_us: 0,
        idle: None,
        sections: vec![
            fresh, arena, push, cached, floor, bw, peer, ring, sync, scale, sets, torch,
        ],
        targets: Vec::new(),
    };
    for s in &mut r.sections {
        s.finish();
    }
    r.evaluate();
    r
}

pub(super) fn verdict(r: &Report, id: &str) -> Verdict {
    r.targets
        .iter()
        .find(|t| t.id == id)
        .unwrap_or_else(|| panic!("no target {id} in {:#?}", r.targets))
        .verdict
}

#[test]
fn targets_pass_and_miss() {
    let r = synthetic();
    assert_eq!(verdict(&r, "cached/legacy/2MiB"), Verdict::Pass);
    assert_eq!(verdict(&r, "cached/vmm/2MiB"), Verdict::Miss);
    // legacy 2 MiB: 0.11 / 0.09 = 1.22 (pass); 64 MiB: 0.13 / 0.10 = 1.3 (pass)
    assert_eq!(verdict(&r, "floor/legacy/2MiB"), Verdict::Pass);
    // vmm 64 MiB: 0.31 / 0.15 = 2.07 (miss)
    assert_eq!(verdict(&r, "floor/vmm/64MiB"), Verdict::Miss);
    assert_eq!(verdict(&r, "bandwidth/legacy"), Verdict::Pass);
    assert_eq!(verdict(&r, "bandwidth/vmm"), Verdict::Miss);
    // pool's bandwidth was never measured
    assert_eq!(verdict(&r, "bandwidth/pool"), Verdict::NotMeasured);
    // peer copies: legacy 700 / 710 = 0.986 (pass), vmm 500 / 710 (miss);
    // pool's were skipped, so no target
    assert_eq!(verdict(&r, "peer/legacy"), Verdict::Pass);
    assert_eq!(verdict(&r, "peer/vmm"), Verdict::Miss);
    assert!(r.targets.iter().all(|t| t.id != "peer/pool"));
    assert_eq!(verdict(&r, "ring/vmm/4KiB"), Verdict::Pass);
    // sync: fences 22,800/s (miss), floor 232,000 / 22,800 = 10x (miss);
    // batched 260,000/s (pass), 232,000 / 260,000 = 0.89x (pass); paced 0.31 ms (miss)
    assert_eq!(verdict(&r, "sync/ring/fence/4KiB"), Verdict::Miss);
    assert_eq!(verdict(&r, "sync/floor/fence"), Verdict::Miss);
    assert_eq!(verdict(&r, "sync/ring/fence, batch 8/4KiB"), Verdict::Pass);
    assert_eq!(verdict(&r, "sync/floor/fence, batch 8"), Verdict::Pass);
    assert_eq!(verdict(&r, "sync/unloaded/fence"), Verdict::Miss);
    // host-fence: 240,000/s (miss), 232,000 / 240,000 = 0.97x (pass), paced 0.0135 ms (pass)
    assert_eq!(verdict(&r, "sync/ring/host-fence/4KiB"), Verdict::Miss);
    assert_eq!(verdict(&r, "sync/floor/host-fence"), Verdict::Pass);
    assert_eq!(verdict(&r, "sync/unloaded/host-fence"), Verdict::Pass);
    // PyTorch 64 MiB p50 0.65 / legacy 0.13 = 5x (pass), / vmm 0.31 = 2.1x (miss)
    assert_eq!(verdict(&r, "torch/legacy/64MiB"), Verdict::Pass);
    assert_eq!(verdict(&r, "torch/vmm/64MiB"), Verdict::Miss);
    assert_eq!(verdict(&r, "runtime"), Verdict::Pass);
    let t = r
        .targets
        .iter()
        .find(|t| t.id == "torch/legacy/64MiB")
        .unwrap();
    assert!((t.measured.unwrap() - 0.65 / 0.13).abs() < 1e-9);
}

#[test]
fn failed_rows_fail_their_section() {
    let r = synthetic();
    assert_eq!(r.failed_sections(), vec!["fresh"]);
    let s = r.section(SectionId::Fresh).unwrap();
    assert_eq!(s.status, Status::Failed);
    let why = s.reason.as_deref().unwrap();
    assert!(
        why.contains("pool 2MiB") && why.contains("out of memory"),
        "{why}"
    );
}

#[test]
fn torch_skipped_is_not_measured() {
    let mut r = synthetic();
    let i = r
        .sections
        .iter()
        .position(|s| s.id == SectionId::Torch)
        .unwrap();
    r.sections[i] = Section::skipped(SectionId::Torch, "no module named torch");
    r.evaluate();
    let t = r
        .targets
        .iter()
        .find(|t| t.id == "torch/legacy/64MiB")
        .unwrap();
    assert_eq!(t.verdict, Verdict::NotMeasured);
    assert_eq!(t.shown, "PyTorch skipped");
    let text = render(&r);
    assert!(text.contains("[skipped: no module named torch]"), "{text}");
}

#[test]
fn table_shows_every_section_and_verdict() {
    let r = synthetic();
    let text = render(&r);
    for s in SectionId::ALL {
        assert!(text.contains(s.title()), "{}: {text}", s.title());
    }
    assert!(text.contains("PASS") && text.contains("MISS"), "{text}");
    assert!(
        text.contains("pool 2MiB: FAILED: allocating 2MiB: out of memory"),
        "{text}"
    );
    assert!(text.contains("FAILED sections: fresh"), "{text}");
    // ours/floor for legacy 2 MiB: 0.11 / 0.09
    assert!(text.contains("1.22x"), "{text}");
    // the ring's frames per second
    assert!(text.contains("123456"), "{text}");
    assert!(text.contains("0.0123 ms per extra consumer"), "{text}");
    // the second GPU and the peer section: across/same for legacy 2 MiB
    // is 0.22 / 0.11, the copy ratio 700 / 710
    assert!(
        text.contains("second GPU: NVIDIA H200 (device 1,")
            && text.contains("link NVLink (18 active links); peer access yes"),
        "{text}"
    );
    let peer: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("Across two GPUs"))
        .take(12)
        .collect();
    // legacy 2 MiB: ours / peer floor = 0.22 / 0.11, across / same the same
    assert!(
        peer[2].trim_start().starts_with("legacy") && peer[2].matches("2.00x").count() == 2,
        "{peer:?}"
    );
    assert!(
        peer[4].contains("vmm floor 2MiB: skipped: no floor today"),
        "{peer:?}"
    );
    // cached across GPUs: 0.027 against 0.008 on one GPU
    assert!(
        peer[6].trim_start().starts_with("legacy") && peer[6].ends_with("3.38x"),
        "{peer:?}"
    );
    assert!(
        peer[8].trim_start().starts_with("legacy") && peer[8].ends_with("0.986"),
        "{peer:?}"
    );
    assert!(
        peer[10].contains("pool copies: skipped: pool sharing is off here"),
        "{peer:?}"
    );
    // cached: legacy passes, vmm misses in the table's own column
    let cached: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.contains("Cached hand-off"))
        .take(4)
        .collect();
    assert!(
        cached[2].trim_start().starts_with("legacy") && cached[2].contains("PASS"),
        "{cached:?}"
    );
    assert!(
        cached[3].trim_start().starts_with("vmm") && cached[3].contains("MISS"),
        "{cached:?}"
    );
}

#[test]
fn json_has_the_documented_shape() {
    let r = synthetic();
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["schema"], 1);
    assert_eq!(v["quick"], true);
    assert_eq!(v["device"]["name"], "NVIDIA H200");
    assert_eq!(v["sizes"][1], 64 << 20);
    // consumers in the producer's namespaces: an empty list, no command
    assert_eq!(v["consumer_namespaces"], serde_json::json!([]));
    assert!(v.get("consumer_command").is_none());
    let sections = v["sections"].as_array().unwrap();
    assert_eq!(sections.len(), 12);
    assert_eq!(v["peer"]["device"]["ordinal"], 1);
    assert_eq!(v["peer"]["link"], "NVLink (18 active links)");
    assert_eq!(sections[6]["id"], "peer");
    assert_eq!(sections[6]["rows"][6]["variant"], "memcpy_peer");
    assert_eq!(sections[1]["id"], "arena");
    assert_eq!(sections[10]["id"], "sets");
    let bucket = &sections[10]["rows"][7];
    assert_eq!(
        (&bucket["series"], &bucket["variant"], &bucket["count"]),
        (
            &serde_json::json!("PyTorch"),
            &serde_json::json!("bucket"),
            &serde_json::json!(1000)
        )
    );
    assert_eq!(bucket["extra_device_bytes"], 256 << 20);
    assert_eq!(sections[10]["rows"][0]["extra_device_bytes"], 0);
    assert!(sections[10]["rows"][1].get("extra_device_bytes").is_none());
    assert_eq!(sections[0]["id"], "fresh");
    assert_eq!(sections[0]["status"], "failed");
    assert!(sections[0]["error"].is_null());
    assert!(
        sections[0]["reason"]
            .as_str()
            .unwrap()
            .contains("out of memory")
    );
    assert_eq!(sections[3]["status"], "ok");
    let row = &sections[0]["rows"][0];
    assert_eq!(row["series"], "legacy");
    assert_eq!(row["size"], 2 << 20);
    assert_eq!(row["unit"], "ms");
    assert_eq!(row["warmup"], 5);
    assert_eq!(row["samples"].as_array().unwrap().len(), 3);
    assert!((row["stats"]["p50"].as_f64().unwrap() - 0.11).abs() < 1e-12);
    assert!(row["stats"]["p90"].is_number() && row["stats"]["p99"].is_number());
    assert!(row["parts"]["publish"]["p50"].is_number());
    assert_eq!(
        sections[0]["rows"][4]["error"],
        "allocating 2MiB: out of memory"
    );
    let t = v["targets"].as_array().unwrap();
    assert!(
        t.iter()
            .any(|t| t["id"] == "cached/vmm/2MiB" && t["verdict"] == "miss")
    );
    assert!(t.iter().any(|t| t["verdict"] == "pass"));
    let skipped = serde_json::to_value(Section::skipped(SectionId::Torch, "why")).unwrap();
    assert_eq!(skipped["status"], "skipped");
    assert_eq!(skipped["reason"], "why");
    // and it reads back
    let back: Report = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(back, r);
}

#[test]
fn the_consumers_namespaces_are_in_the_header_and_the_json() {
    let mut r = synthetic();
    assert!(!render(&r).contains("new namespaces"));
    r.consumer_namespaces = vec!["pid".into(), "ipc".into()];
    r.consumer_command = "unshare --pid --fork --kill-child --mount-proc --ipc -- CONSUMER".into();
    let text = render(&r);
    assert_eq!(
        text.lines().nth(1),
        Some(
            "consumers in new namespaces: pid, ipc \
             (unshare --pid --fork --kill-child --mount-proc --ipc -- CONSUMER)"
        ),
        "{text}"
    );
    assert_eq!(
        text.matches("consumers in new namespaces").count(),
        1,
        "{text}"
    );
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["consumer_namespaces"], serde_json::json!(["pid", "ipc"]));
    assert_eq!(v["consumer_command"], r.consumer_command.as_str());
    let back: Report = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(back, r);
    // a report written before the field existed still reads
    let mut old: serde_json::Value = serde_json::from_str(&synthetic().to_json()).unwrap();
    old.as_object_mut().unwrap().remove("consumer_namespaces");
    let back: Report = serde_json::from_value(old).unwrap();
    assert!(back.consumer_namespaces.is_empty());
}

#[test]
fn a_run_with_its_processes_kept_awake_says_so() {
    let mut r = synthetic();
    assert!(!render(&r).contains("awake"));
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert!(v.get("awake_us").is_none(), "{v}");
    r.awake_us = 20_000;
    let text = render(&r);
    let line = text
        .lines()
        .find(|l| l.starts_with("awake: "))
        .unwrap_or_else(|| panic!("no awake line in {text}"));
    assert!(line.contains("up to 20000 us"), "{line}");
    assert!(line.contains("CUDA_IPC_BENCH_AWAKE_US"), "{line}");
    let back: Report = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(back.awake_us, 20_000);
}

#[test]
#[ignore = "prints the synthetic table to look at"]
fn print_table() {
    println!("{}", render(&synthetic()));
}

#[test]
fn section_names_parse() {
    for s in SectionId::ALL {
        assert_eq!(SectionId::parse(s.name()).unwrap(), s);
    }
    assert!(
        SectionId::parse("nope")
            .unwrap_err()
            .contains("fresh, arena, push, cached")
    );
}

#[test]
fn ms_formatting() {
    assert_eq!(fmt_ms(0.0153), "0.0153");
    assert_eq!(fmt_ms(1.5), "1.500");
    assert_eq!(fmt_ms(3100.0), "3100.0");
    assert_eq!(fmt_ms(f64::NAN), "-");
}

#[test]
fn push_rows_are_checked_against_their_limits_and_the_wake_floor() {
    let r = synthetic();
    assert_eq!(verdict(&r, "push/push, asleep/16KiB"), Verdict::Pass);
    assert_eq!(verdict(&r, "push/push, spinning/16KiB"), Verdict::Miss);
    assert!(
        r.targets.iter().all(|t| !t.id.starts_with("push/pull")),
        "the pull rows have no target"
    );
    let floor = super::targets::wake_floor_ms(&r);
    let wake = r
        .targets
        .iter()
        .find(|t| t.id == "push-wake/16KiB")
        .unwrap();
    match floor {
        Some(f) => assert_eq!(wake.verdict == Verdict::Pass, 0.010 / f <= 2.0, "{wake:?}"),
        None => assert_eq!(wake.verdict, Verdict::NotMeasured),
    }
    let text = render(&r);
    assert!(
        text.contains("KV blocks pushed") && text.contains("push, spinning"),
        "{text}"
    );
    // PyTorch's fresh hand-off of the same block size beside each row: 0.25
    // ms against ours 0.010 ms is 25x.
    assert!(text.contains("PyTorch fresh p50"), "{text}");
    let line = text
        .lines()
        .find(|l| l.contains("push, asleep") && l.contains("16KiB"))
        .unwrap();
    assert!(line.contains("0.2500") && line.contains("25.00x"), "{line}");
}
