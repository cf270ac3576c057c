//! A reader that holds a set through crashes of the serving process, on a
//! real device: the test process is the keeper (as in `survive.rs`), a
//! reader child keeps one `Subscriber` and one attached set the whole time.
//! After a SIGKILL of the serving process it reads the same bytes at the
//! same addresses; the new process does not know it (`ls` shows no reader)
//! until its next call, a wait for an update, connects again and takes
//! its lease back with no mapping opened again (`ls` shows it again); an
//! in-place writer then waits for it to step aside again, and it comes back
//! to the new bytes. Killed while it is aside, it is aside on the new
//! process as soon as it connects again (a writer in place then opens at
//! once), also when it connects again only at its `come_back`, and comes
//! back to the write done there; attaching again maps nothing new.

#![allow(unsafe_code)]

use std::path::Path;
use std::time::Duration;

use cuda_ipc::Device;
use cuda_ipc::Error;
use cuda_ipc::channel::ChannelError;
use cuda_ipc::service::{come_back, step_aside};
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use super::service_in_place::{code, placer, spawn_placer};
use super::service_write::{SET, check, connect, writer};
use super::survive::{Kept, ls, next_ready, served, wait_gone};
use crate::{assert_ok, test_name};

/// The reader child: one subscriber (the default configuration: it
/// reconnects because the service says it restarts) and one set attached
/// once, checked, waited on, stepped aside and back as the parent asks.
fn holder() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let set = sub.attach_set(SET).unwrap();
    let places = set.entry_places().unwrap();
    parent.send(&json!({
        "bad": check(&set, 1),
        "pid": std::process::id(),
        "reconnects": sub.reconnects(),
    }));
    while let Some(ask) = parent.recv() {
        let seed = ask["seed"].as_u64().unwrap_or(0) as u32;
        let same = |s: &cuda_ipc::exchange::SetAttachment| s.entry_places().unwrap() == places;
        let answer = match ask["do"].as_str().unwrap() {
            "check" => json!({
                "bad": check(&set, seed),
                "alive": sub.is_alive(),
                "same_addresses": same(&set),
            }),
            "wait" => {
                // No update comes: the wait connects again, takes the
                // lease back, and runs out of time.
                let opens = sub.opens();
                match sub.wait_set_update(&set, Duration::from_millis(300)) {
                    Err(Error::Channel(ChannelError::Timeout { .. })) => json!({
                        "bad": check(&set, seed),
                        "alive": sub.is_alive(),
                        "opened": sub.opens() - opens,
                        "same_addresses": same(&set),
                    }),
                    other => json!({"bad": format!("the wait gave {other:?}")}),
                }
            }
            "attach" => {
                let opens = sub.opens();
                match sub.attach_set(SET) {
                    Ok(again) => {
                        let answer = json!({
                            "bad": check(&again, seed),
                            "same_addresses": same(&again),
                            "opened": sub.opens() - opens,
                        });
                        sub.release_set(again).unwrap();
                        answer
                    }
                    Err(e) => json!({"bad": e.to_string()}),
                }
            }
            "reconnect" => match reconnect_once_gone(&sub) {
                Ok(r) => json!({
                    "bad": null,
                    "connected": r.connected,
                    "retaken": r.retaken,
                    "old_versions": r.old_versions,
                    "chunks": r.chunks,
                    "asleep": sub.asleep(),
                }),
                Err(e) => json!({"bad": e.to_string()}),
            },
            "aside" => {
                // SAFETY: nothing of this process touches the set's memory
                // until `come_back` has woken it (this loop runs no work
                // on it in between).
                let slept = unsafe { sub.sleep_unchecked() }.unwrap();
                match step_aside(&sub, SET) {
                    Ok(a) => json!({"bad": null, "slept": slept.mappings, "version": a.version}),
                    Err(e) => json!({"bad": e.to_string()}),
                }
            }
            _ => match come_back(&sub, SET, Duration::from_secs(30)) {
                Ok(b) => json!({
                    "bad": check(&set, seed),
                    "version": b.version,
                    "same_addresses": same(&set),
                    "alive": sub.is_alive(),
                }),
                Err(e) => json!({"bad": e.to_string(), "code": code(&e), "asleep": sub.asleep()}),
            },
        };
        parent.send(&answer);
    }
}

/// Connects again once the killed process's end of the connection is
/// closed (its last thread may hold it a moment after it shows as dead).
fn reconnect_once_gone(
    sub: &cuda_ipc::exchange::Subscriber,
) -> cuda_ipc::Result<cuda_ipc::exchange::Reconnected> {
    let started = std::time::Instant::now();
    while sub.is_alive() && started.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(5));
    }
    sub.reconnect()
}

fn ask(peer: &mut Peer, v: &Value) -> Value {
    peer.send(v);
    peer.recv()
}

/// The pids of one list of holders of `SET` that `ls` shows.
fn ls_pids(
    socket: &Path,
    list: fn(&cuda_ipc::service::admin::SetRow) -> &[cuda_ipc::service::Holder],
) -> Vec<u32> {
    ls(socket)
        .unwrap()
        .sets
        .iter()
        .find(|s| s.name == SET)
        .map(|s| list(s).iter().map(|h| h.pid).collect())
        .unwrap_or_default()
}

/// The pids of the readers `ls` shows on the set.
fn readers(socket: &Path) -> Vec<u32> {
    ls_pids(socket, |s| &s.leases)
}

/// The pids `ls` shows as readers of `SET` before a restart that have not
/// connected again.
fn not_reconnected(socket: &Path) -> Vec<u32> {
    ls_pids(socket, |s| &s.not_reconnected)
}

fn kill(pid: u32) {
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(pid as i32).unwrap(),
        rustix::process::Signal::KILL,
    )
    .unwrap();
    wait_gone(pid);
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_reader_keeps_its_set_through_a_crash_and_takes_its_lease_back() {
    match role().as_deref() {
        Some("served") => return served(),
        Some("writer") => return writer(),
        Some("placer") => return placer(),
        Some("holder") => return holder(),
        _ => {}
    }
    let test = test_name!("a_reader_keeps_its_set_through_a_crash_and_takes_its_lease_back");
    let kept = Kept::start(&test, false);
    let socket = kept.socket.clone();
    let mut serving = kept.serving;
    let spawn = |role: &str, seed: u32| super::service_write::spawn(&test, role, &socket, seed);

    // Version 1.
    let mut w = spawn("writer", 1);
    assert_ok!(&w.recv(), "the writer of version 1");
    w.send(&json!("commit"));
    assert_ok!(&w.recv(), "its commit");
    drop(w);
    let mut holder = spawn("holder", 1);
    let hello = holder.recv();
    assert_ok!(&hello, "the reader attaches version 1");
    assert_eq!(
        hello["reconnects"], true,
        "a service under a keeper says so"
    );
    let pid = u32::try_from(hello["pid"].as_u64().unwrap()).unwrap();
    assert!(readers(&socket).contains(&pid));

    // The serving process dies: the reader computes on, on what it mapped
    // (its connection ends once the last thread of the killed process is
    // gone, which may be after its main thread shows as a zombie).
    kill(serving);
    let started = std::time::Instant::now();
    loop {
        let read = ask(&mut holder, &json!({"do": "check", "seed": 1}));
        assert_ok!(&read, "read while no process serves");
        if read["alive"] == false {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the reader's connection outlives the killed process: {read}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    (serving, _) = next_ready(&kept.events, serving);
    assert!(
        !readers(&socket).contains(&pid),
        "the new process knows the reader before it connected again"
    );
    // It does know that the reader of before may map the set (the book the
    // keeper kept): `ls` says so, and a write in place waits for it and,
    // before its next call, is refused, naming it; nothing is written.
    assert_eq!(not_reconnected(&socket), [pid]);
    let refused = spawn_placer(&test, &socket, 2, 300).recv();
    assert_eq!(refused["code"], "readers_not_aside", "{refused}");
    let why = refused["bad"].as_str().unwrap();
    assert!(
        why.contains(&format!("pid {pid}")) && why.contains("did not connect again"),
        "{why}"
    );
    assert_ok!(
        &ask(&mut holder, &json!({"do": "check", "seed": 1})),
        "version 1's bytes, unwritten"
    );

    // Its next call connects again and takes its lease back: same
    // addresses, nothing mapped again, and `ls` shows it (the new process
    // knew no lease of it before: the lease is the new process's; lease
    // ids are not compared, as the new process may hand out the same
    // number again).
    let waited = ask(&mut holder, &json!({"do": "wait", "seed": 1}));
    assert_ok!(&waited, "the wait after the restart");
    assert_eq!(waited["alive"], true, "{waited}");
    assert_eq!(waited["opened"], 0, "{waited}");
    assert_eq!(waited["same_addresses"], true, "{waited}");
    assert!(readers(&socket).contains(&pid), "ls shows the reader again");
    assert!(
        not_reconnected(&socket).is_empty(),
        "and as connected again"
    );

    // An in-place writer waits for it to step aside again.
    let refused = spawn_placer(&test, &socket, 2, 300).recv();
    assert_eq!(refused["code"], "readers_not_aside", "{refused}");
    let why = refused["bad"].as_str().unwrap();
    assert!(why.contains(&format!("pid {pid}")), "{why}");
    assert_ok!(&ask(&mut holder, &json!({"do": "aside"})), "stepping aside");
    let mut placer = spawn_placer(&test, &socket, 2, 10_000);
    assert_ok!(&placer.recv(), "the write in place, the reader aside");
    placer.send(&json!("commit"));
    assert_ok!(&placer.recv(), "its commit");
    drop(placer);
    let back = ask(&mut holder, &json!({"do": "back", "seed": 2}));
    assert_ok!(&back, "back to version 2");
    assert_eq!(back["same_addresses"], true, "{back}");

    serving = aside_through_restarts(&test, &kept, serving, &mut holder, pid);
    assert!(readers(&socket).contains(&pid), "ls shows the reader");
    let again = ask(&mut holder, &json!({"do": "attach", "seed": 4}));
    assert_ok!(&again, "attaching again");
    assert_eq!(again["opened"], 0, "{again}");
    assert_eq!(again["same_addresses"], true, "{again}");

    drop(holder);
    let _ = serving;
    kept.stop.stop();
}

/// Two more kills while `holder` (pid `pid`) is aside from the set at
/// version 2; returns the serving process after them.
fn aside_through_restarts(
    test: &str,
    kept: &Kept,
    mut serving: u32,
    holder: &mut Peer,
    pid: u32,
) -> u32 {
    let socket = kept.socket.as_path();
    // Killed again while the reader is aside: connecting again, it is
    // aside on the new process before its lease is back, so a writer in
    // place opens at once; it comes back to what that writer wrote.
    assert_ok!(&ask(holder, &json!({"do": "aside"})), "aside again");
    kill(serving);
    (serving, _) = next_ready(&kept.events, serving);
    let again = ask(holder, &json!({"do": "reconnect"}));
    assert_ok!(&again, "reconnecting while aside");
    assert_eq!(again["connected"], true, "{again}");
    assert_eq!(again["retaken"], json!([SET]), "{again}");
    assert_eq!(again["asleep"], true, "{again}");
    assert!(again["chunks"].as_u64().unwrap() >= 1, "{again}");
    assert!(readers(socket).contains(&pid), "ls shows the reader aside");
    let mut placer = spawn_placer(test, socket, 3, 300);
    assert_ok!(&placer.recv(), "the write in place finds the reader aside");
    placer.send(&json!("commit"));
    assert_ok!(&placer.recv(), "its commit");
    drop(placer);
    let back = ask(holder, &json!({"do": "back", "seed": 3}));
    assert_ok!(&back, "back to version 3");
    assert_eq!(back["same_addresses"], true, "{back}");

    // Killed while aside, and a writer in place on the new process before
    // the reader's next call (nobody to wait for: the book says it is
    // asleep, aside from all it leased): the
    // reader's return connects again, steps aside there first, and waits
    // for that write.
    assert_ok!(&ask(holder, &json!({"do": "aside"})), "aside once more");
    kill(serving);
    (serving, _) = next_ready(&kept.events, serving);
    let mut placer = spawn_placer(test, socket, 4, 10_000);
    assert_ok!(&placer.recv(), "a write in place after the restart");
    holder.send(&json!({"do": "back", "seed": 4}));
    std::thread::sleep(Duration::from_millis(300));
    placer.send(&json!("commit"));
    assert_ok!(&placer.recv(), "its commit");
    drop(placer);
    let back = holder.recv();
    assert_ok!(&back, "back to version 4 across the restart");
    assert_eq!(back["same_addresses"], true, "{back}");
    assert_eq!(back["alive"], true, "{back}");
    serving
}
