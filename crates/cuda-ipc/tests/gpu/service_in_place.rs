//! Writes in place across processes: a writer child writes the current
//! version's own memory while a reader child has stepped aside (asleep,
//! its set still attached), and the reader comes back at the same
//! addresses to the new bytes; a reader that does not step aside makes the
//! write refused before a byte is written; new attaches are refused while
//! it writes; the service allocates nothing for it; a writer killed in the
//! middle leaves the set torn (attaches and the reader's return refused)
//! until a double-buffered write commits a whole version. A reader that
//! steps aside ahead of an update waits for it (`come_back_next`) even
//! before its writer starts.

#![allow(unsafe_code)]

use std::path::Path;
use std::time::Duration;

use cuda_ipc::Device;
use cuda_ipc::Error;
use cuda_ipc::channel::ChannelError;
use cuda_ipc::exchange::{Subscriber, SubscriberConfig};
use cuda_ipc::kernels::{self, Speed};
use cuda_ipc::service::admin::SetState;
use cuda_ipc::service::{Service, Writer, come_back, come_back_next, step_aside};
use serde_json::{Value, json};

use super::common::{Parent, Peer, role};
use super::service_write::{
    SET, check, commit, connect, pattern_of, service_with_version_one, spawn, writer,
};
use crate::{assert_ok, test_name};

const WAIT_ENV: &str = "CUDA_IPC_TEST_IN_PLACE_WAIT_MS";

/// An in-place writer child: opens in place (waiting as long as it is
/// told), fills every tensor with its seed's pattern, says so, and commits
/// when the parent says `commit` (or is killed before).
pub(super) fn placer() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let seed: u32 = std::env::var("CUDA_IPC_TEST_WRITE_SEED")
        .unwrap()
        .parse()
        .unwrap();
    let wait: u64 = std::env::var(WAIT_ENV).unwrap().parse().unwrap();
    let w = match Writer::open_in_place(&sub, SET, Duration::from_millis(wait)) {
        Ok(w) => w,
        Err(e) => return parent.send(&json!({"bad": e.to_string(), "code": code(&e)})),
    };
    for i in 0..w.staging().len() {
        let view = w.staging().view::<u32>(i).unwrap();
        let pattern = pattern_of(seed, &w.staging().entries()[i].name);
        kernels::fill_u32(&view, pattern, Speed::Full).unwrap();
    }
    device.synchronize().unwrap();
    parent.send(&json!({
        "bad": null,
        "version": w.opened().version,
        "in_place": w.opened().in_place,
        "bytes": w.opened().bytes,
    }));
    if parent.recv() != Some(json!("commit")) {
        return;
    }
    match w.commit() {
        Ok(a) => parent.send(&json!({"bad": null, "version": a.version, "told": a.readers_told})),
        Err(e) => parent.send(&json!({"bad": e.to_string()})),
    }
    let _ = parent.recv();
}

pub(super) fn code(e: &Error) -> Value {
    match e {
        Error::Channel(ChannelError::Remote { code, .. }) => json!(code),
        _ => Value::Null,
    }
}

/// A reader child that keeps its set attached across in-place writes:
/// `aside` sleeps its mappings and steps aside; `back` comes back and
/// checks the same addresses hold the seed's version; `check` checks now.
fn stepper() {
    let parent = Parent::new();
    let device = Device::open(0).unwrap();
    let sub = connect(&device);
    let set = sub.attach_set(SET).unwrap();
    let places = set.entry_places().unwrap();
    parent.send(&json!({"bad": null, "pid": std::process::id()}));
    while let Some(ask) = parent.recv() {
        let answer = match ask["do"].as_str().unwrap() {
            "aside" => {
                // SAFETY: nothing of this process touches the set's memory
                // until `come_back` has woken it (the loop below runs no
                // work on it in between).
                let slept = unsafe { sub.sleep_unchecked() }.unwrap();
                match step_aside(&sub, SET) {
                    Ok(a) => json!({"bad": null, "slept": slept.mappings, "version": a.version}),
                    Err(e) => json!({"bad": e.to_string()}),
                }
            }
            "back" | "back_next" => match if ask["do"] == "back" {
                come_back(&sub, SET, Duration::from_secs(30))
            } else {
                come_back_next(&sub, SET, Duration::from_secs(30))
            } {
                Ok(b) => {
                    let same = set.entry_places().unwrap() == places;
                    let seed = ask["seed"].as_u64().unwrap() as u32;
                    json!({"bad": check(&set, seed), "version": b.version, "same_addresses": same})
                }
                Err(e) => json!({"bad": e.to_string(), "code": code(&e), "asleep": sub.asleep()}),
            },
            _ => json!({"bad": check(&set, ask["seed"].as_u64().unwrap() as u32)}),
        };
        parent.send(&answer);
    }
}

pub(super) fn spawn_placer(test: &str, socket: &Path, seed: u32, wait_ms: u64) -> Peer {
    Peer::spawn_with(test, "placer", |c| {
        c.env("CUDA_IPC_TEST_WRITE_SOCKET", socket)
            .env("CUDA_IPC_TEST_WRITE_SEED", seed.to_string())
            .env(WAIT_ENV, wait_ms.to_string());
    })
}

fn ask(peer: &mut Peer, v: &Value) -> Value {
    peer.send(v);
    peer.recv()
}

/// The code of the refusal of an attach of the set now.
fn attach_refusal(sub: &Subscriber) -> Option<String> {
    match sub.attach_set(SET) {
        Ok(s) => {
            sub.release_set(s).unwrap();
            None
        }
        Err(Error::Channel(ChannelError::Remote { code, .. })) => Some(code),
        Err(e) => panic!("an attach failed otherwise: {e}"),
    }
}

fn state(service: &Service) -> (u64, SetState) {
    let row = service
        .ls()
        .sets
        .into_iter()
        .find(|s| s.name == SET)
        .unwrap();
    (row.version, row.state)
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn a_write_in_place_waits_for_readers_to_step_aside_and_they_come_back_at_the_same_addresses() {
    match role().as_deref() {
        Some("writer") => return writer(),
        Some("placer") => return placer(),
        Some("stepper") => return stepper(),
        _ => {}
    }
    let test = test_name!(
        "a_write_in_place_waits_for_readers_to_step_aside_and_they_come_back_at_the_same_addresses"
    );
    let (_dir, socket, device, service) = service_with_version_one(&test);
    let one_version = service.stats().uids[0].used;
    let here = Subscriber::connect(&device, socket.as_path(), SubscriberConfig::default()).unwrap();

    let mut reader = Peer::spawn_with(&test, "stepper", |c| {
        c.env("CUDA_IPC_TEST_WRITE_SOCKET", &socket);
    });
    let hello = reader.recv();
    assert_ok!(&hello, "the reader");
    let reader_pid = hello["pid"].as_u64().unwrap();
    assert_ok!(
        &ask(&mut reader, &json!({"do": "check", "seed": 1})),
        "version 1"
    );

    // A reader that does not step aside: refused in time, nothing written.
    let refused = spawn_placer(&test, &socket, 2, 300).recv();
    assert_eq!(refused["code"], "readers_not_aside", "{refused}");
    let why = refused["bad"].as_str().unwrap();
    assert!(why.contains(&format!("pid {reader_pid}")), "{why}");
    assert_eq!(state(&service), (1, SetState::Committed));
    assert_eq!(attach_refusal(&here), None, "attaches are allowed again");
    assert_ok!(
        &ask(&mut reader, &json!({"do": "check", "seed": 1})),
        "unchanged"
    );

    // Stepped aside: the write opens, in place, with no new memory.
    let aside = ask(&mut reader, &json!({"do": "aside"}));
    assert_ok!(&aside, "the reader steps aside");
    assert!(aside["slept"].as_u64().unwrap() >= 1, "{aside}");
    let mut placer = spawn_placer(&test, &socket, 2, 10_000);
    let opened = placer.recv();
    assert_ok!(&opened, "the in-place writer");
    assert_eq!(
        (opened["in_place"].clone(), opened["bytes"].clone()),
        (json!(true), json!(0))
    );
    assert_eq!(opened["version"], 2);
    let stats = service.stats();
    assert_eq!(
        (stats.uids[0].used, stats.uids[0].reserved),
        (one_version, 0)
    );
    assert_eq!(state(&service), (1, SetState::Writing));
    assert_eq!(attach_refusal(&here).as_deref(), Some("writing_in_place"));
    // The reader waits in `back` until the commit, then reads version 2
    // at the addresses it had.
    reader.send(&json!({"do": "back", "seed": 2}));
    std::thread::sleep(Duration::from_millis(100));
    let done = commit(&mut placer, "the in-place commit");
    assert_eq!(
        (done["version"].clone(), done["told"].clone()),
        (json!(2), json!(1))
    );
    let back = reader.recv();
    assert_ok!(&back, "the reader came back to version 2");
    assert_eq!(
        (back["version"].clone(), back["same_addresses"].clone()),
        (json!(2), json!(true))
    );
    drop(placer);
    assert_eq!(state(&service), (2, SetState::Committed));
    assert_eq!(attach_refusal(&here), None);
    assert_eq!(service.stats().uids[0].used, one_version, "still one copy");

    // A reader that steps aside ahead of the next update waits for it,
    // even before its writer has started.
    assert_ok!(&ask(&mut reader, &json!({"do": "aside"})), "aside ahead");
    reader.send(&json!({"do": "back_next", "seed": 5}));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        reader.try_recv_within(Duration::from_millis(10)).is_none(),
        "it waits for the write"
    );
    let mut placer = spawn_placer(&test, &socket, 5, 10_000);
    assert_ok!(&placer.recv(), "the writer of the expected update");
    assert_eq!(commit(&mut placer, "version 3 in place")["version"], 3);
    let back = reader.recv();
    assert_ok!(&back, "the reader came back to version 3");
    assert_eq!(
        (back["version"].clone(), back["same_addresses"].clone()),
        (json!(3), json!(true))
    );
    drop(placer);

    comes_back_late(&test, &socket, &mut reader);
    torn_then_whole_again(&test, &socket, &service, &here, &mut reader);
    drop(reader);
    drop(here);
    service.shutdown(Duration::from_secs(5));
}

/// A writer killed in the middle of an in-place write leaves the set torn;
/// a double-buffered write makes it whole again.
fn torn_then_whole_again(
    test: &str,
    socket: &Path,
    service: &Service,
    here: &Subscriber,
    reader: &mut Peer,
) {
    // A writer killed in the middle leaves the set torn.
    assert_ok!(&ask(reader, &json!({"do": "aside"})), "aside again");
    let placer = spawn_placer(test, socket, 3, 10_000);
    assert_ok!(&placer.recv(), "the third in-place writer");
    placer.kill();
    let mut waited = 0;
    while state(service).1 != SetState::Torn {
        waited += 1;
        assert!(waited < 1000, "the killed writer's session ends");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(state(service).0, 4);
    assert_eq!(attach_refusal(here).as_deref(), Some("torn"));
    let back = ask(reader, &json!({"do": "back", "seed": 3}));
    assert_eq!(
        (back["code"].clone(), back["asleep"].clone()),
        (json!("torn"), json!(true)),
        "{back}"
    );

    // A whole version, double-buffered, heals it.
    let mut healer = spawn(test, "writer", socket, 4);
    assert_ok!(&healer.recv(), "the healing writer");
    commit(&mut healer, "version 5, whole");
    drop(healer);
    assert_eq!(state(service), (5, SetState::Committed));
    assert_eq!(attach_refusal(here), None);
    let fresh = here.attach_set(SET).unwrap();
    assert!(
        check(&fresh, 4).is_null(),
        "a new reader reads the whole version"
    );
    here.release_set(fresh).unwrap();
}

/// A reader whose return comes after the commit finds the version it
/// stepped aside from, not the one after.
fn comes_back_late(test: &str, socket: &Path, reader: &mut Peer) {
    assert_ok!(&ask(reader, &json!({"do": "aside"})), "aside, back late");
    let mut placer = spawn_placer(test, socket, 6, 10_000);
    assert_ok!(&placer.recv(), "the writer the reader comes back late from");
    assert_eq!(commit(&mut placer, "version 4 in place")["version"], 4);
    drop(placer);
    let back = ask(reader, &json!({"do": "back_next", "seed": 6}));
    assert_ok!(&back, "the reader came back late to version 4");
    assert_eq!(
        (back["version"].clone(), back["same_addresses"].clone()),
        (json!(4), json!(true))
    );
}
