//! An upgrade refuses no attach, on a real device: the test process is the
//! keeper (as in `survive.rs`) and asks it for an upgrade three times (what
//! `kill -HUP KEEPER` does: the serving process is killed and the build
//! started again, taking the descriptors back). Meanwhile a child attaches
//! the set over and over, on one long-lived subscriber and on a fresh one
//! each time, checking every byte: not one attach fails, and each thread
//! goes on after every upgrade.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use cuda_ipc::Device;
use serde_json::json;

use super::common::{Parent, Peer, role};
use super::service_write::{SET, check, connect, writer};
use super::survive::{Kept, next_ready, served};
use crate::{assert_ok, test_name};

/// How many upgrades the test asks for.
const UPGRADES: usize = 3;

/// What one attaching thread did.
#[derive(Default)]
struct Tally {
    attaches: AtomicU64,
    errors: std::sync::Mutex<Vec<String>>,
}

impl Tally {
    fn note(&self, r: Result<serde_json::Value, String>) {
        match r {
            Ok(v) if v.is_null() => {
                self.attaches.fetch_add(1, Ordering::SeqCst);
            }
            Ok(bad) => self.errors.lock().unwrap().push(bad.to_string()),
            Err(e) => self.errors.lock().unwrap().push(e),
        }
    }
}

/// The child: two threads attaching version 1 until the parent says
/// `stop`, one through a subscriber it keeps, one through a new subscriber
/// each time; then the tallies.
fn attacher() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let kept = Arc::new(Tally::default());
    let fresh = Arc::new(Tally::default());
    let threads = [
        {
            let (device, stop, tally) = (device.clone(), stop.clone(), kept.clone());
            std::thread::spawn(move || {
                let sub = connect(&device);
                while !stop.load(Ordering::SeqCst) {
                    tally.note(
                        sub.attach_set(SET)
                            .map_err(|e| format!("kept subscriber: {e} ({e:?})"))
                            .map(|set| {
                                let bad = check(&set, 1);
                                let _ = sub.release_set(set);
                                bad
                            }),
                    );
                }
            })
        },
        {
            let (device, stop, tally) = (device.clone(), stop.clone(), fresh.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::SeqCst) {
                    let sub = connect(&device);
                    let t = Instant::now();
                    tally.note(
                        sub.attach_set(SET)
                            .map_err(|e| {
                                format!("fresh subscriber: {e} ({e:?}), after {:?}", t.elapsed())
                            })
                            .map(|set| check(&set, 1)),
                    );
                }
            })
        },
    ];
    // Both threads attached once before the parent starts.
    let started = Instant::now();
    while (kept.attaches.load(Ordering::SeqCst) == 0 || fresh.attaches.load(Ordering::SeqCst) == 0)
        && started.elapsed() < Duration::from_secs(30)
    {
        std::thread::sleep(Duration::from_millis(5));
    }
    parent.send(&json!({"bad": null}));
    while let Some(ask) = parent.recv() {
        let counts = json!({
            "kept": kept.attaches.load(Ordering::SeqCst),
            "fresh": fresh.attaches.load(Ordering::SeqCst),
        });
        if ask == json!("stop") {
            stop.store(true, Ordering::SeqCst);
            for t in threads {
                t.join().unwrap();
            }
            let mut errors = kept.errors.lock().unwrap().clone();
            errors.extend(fresh.errors.lock().unwrap().iter().cloned());
            return parent.send(&json!({"bad": null, "counts": counts, "errors": errors}));
        }
        parent.send(&json!({"bad": null, "counts": counts}));
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn an_upgrade_refuses_no_attach() {
    match role().as_deref() {
        Some("served") => return served(),
        Some("writer") => return writer(),
        Some("attacher") => return attacher(),
        _ => {}
    }
    let test = test_name!("an_upgrade_refuses_no_attach");
    let kept = Kept::start(&test, false);
    let socket = kept.socket.clone();
    let mut serving = kept.serving;
    let spawn = |role: &str| super::service_write::spawn(&test, role, &socket, 1);
    let mut w = spawn("writer");
    assert_ok!(&w.recv(), "the writer of version 1");
    w.send(&json!("commit"));
    assert_ok!(&w.recv(), "its commit");
    drop(w);

    let mut a = spawn("attacher");
    assert_ok!(&a.recv(), "both threads attach");
    let counts = |a: &mut Peer| {
        a.send(&json!("counts"));
        let c = a.recv();
        assert_ok!(&c, "the counts");
        (
            c["counts"]["kept"].as_u64().unwrap(),
            c["counts"]["fresh"].as_u64().unwrap(),
        )
    };
    for round in 0..UPGRADES {
        kept.upgrade.store(true, Ordering::SeqCst);
        (serving, _) = next_ready(&kept.events, serving);
        // Each thread attaches again on the new process (more than the
        // one attach in flight when it came).
        let after = counts(&mut a);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let now = counts(&mut a);
            if now.0 > after.0 + 2 && now.1 > after.1 + 2 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "upgrade {round}: the attaches stopped at {now:?}"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    a.send(&json!("stop"));
    let done = a.recv();
    assert_ok!(&done, "the tallies");
    assert_eq!(done["errors"], json!([]), "{done}");
    eprintln!("{UPGRADES} upgrades: {}", done["counts"]);
    drop(a);
    let _ = serving;
    kept.stop.stop();
}
