//! Sleep and wake under updates, as RL engines do it, across processes: a
//! reader child sleeps, a writer commits a new version, the reader wakes
//! and reads it, cycle after cycle (`CUDA_IPC_SLEEP_CYCLES`, default
//! 10,000), alternating writes in place (the reader steps aside and comes
//! back to the same addresses) and double-buffered ones (it wakes, attaches
//! the new version and lets the old one go). Every version is checked by
//! content; the reader's descriptors, threads and address mappings, its
//! resident memory (within 16 MiB) are the same at the end as after the
//! first cycle, and the service holds one version's bytes.

#![allow(unsafe_code)]

use std::time::Duration;

use cuda_ipc::Device;
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::service::{Writer, come_back_next, step_aside};
use serde_json::{Value, json};

use super::common::{Parent, open_fds, role};
use super::service_write::{
    SET, check, connect, pattern_of, service_with_version_one, spawn, writer,
};
use crate::{assert_ok, test_name};

const WAIT: Duration = Duration::from_secs(60);

fn cycles() -> u64 {
    std::env::var("CUDA_IPC_SLEEP_CYCLES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000)
}

/// The seed cycle `c` writes (version 1 holds seed 1).
fn seed(c: u64) -> u32 {
    (c % 400) as u32 + 2
}

/// What this process holds that a cycle must give back.
fn resources() -> Value {
    let count = |dir: &str| std::fs::read_dir(dir).map_or(0, Iterator::count);
    let maps = std::fs::read_to_string("/proc/self/maps").map_or(0, |m| m.lines().count());
    let rss_pages: u64 = std::fs::read_to_string("/proc/self/statm")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1).and_then(|v| v.parse().ok()))
        .unwrap_or(0);
    json!({
        "fds": open_fds(),
        "threads": count("/proc/self/task"),
        "maps": maps,
        "rss": rss_pages * 4096,
    })
}

/// The reader child: every cycle, sleep; in place, step aside and come
/// back to the same addresses; double-buffered, wake, attach the new
/// version and release the old one; check the version by content.
fn sleeper() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let mut set = sub.attach_set(SET).unwrap();
    parent.send(&json!({"bad": null}));
    let n = cycles();
    let mut before = Value::Null;
    for c in 0..n {
        // SAFETY: no work of this process touches the set until the wake
        // below (the checks run after it).
        unsafe { sub.sleep_unchecked() }.unwrap();
        if c % 2 == 0 {
            let places = set.entry_places().unwrap();
            step_aside(&sub, SET).unwrap_or_else(|e| panic!("cycle {c}: {e}"));
            come_back_next(&sub, SET, WAIT).unwrap_or_else(|e| panic!("cycle {c}: {e}"));
            assert_eq!(
                set.entry_places().unwrap(),
                places,
                "cycle {c}: the same addresses"
            );
        } else {
            sub.wait_set_update(&set, WAIT)
                .unwrap_or_else(|e| panic!("cycle {c}: {e}"));
            sub.wake().unwrap();
            let newer = sub.attach_set(SET).unwrap();
            let old = std::mem::replace(&mut set, newer);
            sub.release_set(old).unwrap();
        }
        let bad = check(&set, seed(c));
        if !bad.is_null() {
            return parent.send(&json!({"bad": format!("cycle {c}: {bad}")}));
        }
        if c == 0 {
            before = resources();
        }
        // In step with the writer: it starts the next version once this
        // one is read (an in-place write would refuse the attach of a
        // reader still moving to the version before).
        parent.send(&json!({"bad": null, "cycle": c}));
    }
    parent.send(&json!({"bad": null, "before": before, "after": resources()}));
    let _ = parent.recv();
    sub.release_set(set).unwrap();
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn sleep_and_wake_under_updates_in_place_and_double_buffered() {
    match role().as_deref() {
        Some("writer") => return writer(),
        Some("sleeper") => return sleeper(),
        _ => {}
    }
    let test = test_name!("sleep_and_wake_under_updates_in_place_and_double_buffered");
    let (_dir, socket, device, service) = service_with_version_one(&test);
    let one_version = service.stats().uids[0].used;
    let mut reader = spawn(&test, "sleeper", &socket, 0);
    assert_ok!(&reader.recv(), "the reader attaches version 1");
    let here = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();
    let n = cycles();
    for c in 0..n {
        let w = if c % 2 == 0 {
            Writer::open_in_place(&here, SET, WAIT)
        } else {
            Writer::open(&here, SET, None)
        }
        .unwrap_or_else(|e| panic!("cycle {c}: {e}"));
        for i in 0..w.staging().len() {
            let view = w.staging().view::<u32>(i).unwrap();
            let pattern = pattern_of(seed(c), &w.staging().entries()[i].name);
            kernels::fill_u32(&view, pattern, Speed::Full).unwrap();
        }
        w.commit().unwrap_or_else(|e| panic!("cycle {c}: {e}"));
        let read = reader
            .try_recv_within(Duration::from_secs(60))
            .unwrap_or_else(|| panic!("cycle {c}: no word from the reader within 60 s"));
        assert_ok!(&read, "the reader in cycle {c}");
        assert_eq!(read["cycle"], c);
    }
    let done = reader.recv_within(Duration::from_secs(600));
    assert_ok!(&done, "the reader through {n} cycles");
    for key in ["fds", "threads", "maps"] {
        assert_eq!(
            done["before"][key], done["after"][key],
            "the reader's {key}: {done}"
        );
    }
    let grew = done["after"]["rss"].as_i64().unwrap() - done["before"]["rss"].as_i64().unwrap();
    assert!(
        grew < 16 << 20,
        "the reader's resident memory grew {grew} bytes"
    );
    reader.send(&json!("done"));
    assert!(reader.finish(), "the reader exits cleanly");
    // Every old version gone with the reader's last release: one version.
    let stats = service.stats();
    assert_eq!(
        (stats.uids[0].used, stats.uids[0].reserved),
        (one_version, 0),
        "the service's bytes"
    );
    drop(here);
    service.shutdown(Duration::from_secs(5));
}
