//! Write sessions: the transitions one by one, and as properties of any
//! sequence of opens, commits, aborts, disconnections, drops and readers
//! letting go.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::super::{Loaded, Quotas, UidUsage};
use super::*;

const SERVICE: u32 = 500;

fn w(pid: u32, uid: u32, connection: u64) -> WriterId {
    WriterId {
        pid,
        uid,
        connection,
    }
}

fn staged(bytes: u64) -> Staged {
    Staged {
        bytes,
        payload_bytes: bytes / 2,
        tensors: 2,
    }
}

fn with_model(quota: u64) -> Catalog {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited().with_default(Some(quota)));
    let t = c.admit(1000, "model", 400).unwrap();
    c.commit_at(t, Loaded::new(300, 3, "/m"), 1);
    c
}

#[test]
fn an_in_place_write_reserves_nothing_retires_nothing_and_an_abort_tears_the_set() {
    // A quota the set fills: a second copy would not fit; in place does.
    let mut c = with_model(400);
    assert!(
        c.open_write(w(7, 1000, 1), "model", ".s/1".into(), staged(400), false)
            .is_err()
    );
    let s = c
        .open_write_in_place(w(7, 1000, 1), "model", ".s/1".into(), (3, 300))
        .unwrap()
        .clone();
    assert!(s.in_place);
    assert_eq!((s.version, s.bytes), (2, 0));
    assert_eq!(c.usage()[0].reserved, 0);
    // One writer at a time, in place or not.
    assert!(matches!(
        c.open_write_in_place(w(8, 1000, 2), "model", ".s/2".into(), (3, 300)),
        Err(CatalogError::Writing { pid: 7, .. })
    ));
    let done = c.commit_write_at(1, "model", 9).unwrap();
    assert_eq!((done.info.version, done.info.bytes), (2, 400));
    assert!(done.retired.is_none(), "the same memory: nothing retires");
    assert!(c.retired().is_empty());
    assert_eq!(
        done.info.loaded_from,
        "written in place by pid 7 (uid 1000)"
    );

    // An abort in place leaves the set torn, at its version, until a
    // write commits; a plain abort does not.
    c.open_write_in_place(w(7, 1000, 1), "model", ".s/3".into(), (3, 300))
        .unwrap();
    let aborted = c.abort_write(1, "model").unwrap();
    assert!(aborted.in_place);
    c.mark_torn("model");
    assert!(c.is_torn("model"));
    assert_eq!(c.get("model").unwrap().version, 2);
    c.open_write_in_place(w(7, 1000, 1), "model", ".s/4".into(), (3, 300))
        .unwrap();
    c.commit_write_at(1, "model", 10).unwrap();
    assert!(!c.is_torn("model"));
    assert_eq!(
        c.get("model").unwrap().version,
        3,
        "an aborted write's version is given again"
    );
    // A torn set dropped is forgotten; an unknown set is never torn.
    c.mark_torn("model");
    c.remove("model");
    assert!(!c.is_torn("model"));
    c.mark_torn("nothing");
    assert!(!c.is_torn("nothing"));
    // A new set cannot be written in place.
    assert!(matches!(
        c.open_write_in_place(w(7, 1000, 1), "fresh", ".s/5".into(), (1, 1)),
        Err(CatalogError::NotFound { .. })
    ));
}

#[test]
fn a_write_opens_commits_as_the_next_version_and_retires_the_old_one() {
    let mut c = with_model(1000);
    let s = c
        .open_write(w(7, 1000, 1), "model", ".s/1".into(), staged(400), false)
        .unwrap()
        .clone();
    assert_eq!((s.version, s.owner_uid, s.bytes), (2, 1000, 400));
    // Readers still see version 1; the staging bytes are reserved.
    assert_eq!(c.get("model").unwrap().version, 1);
    assert_eq!(
        c.usage(),
        [UidUsage {
            uid: 1000,
            used: 400,
            held: 0,
            reserved: 400,
            quota: Some(1000),
            sets: 1
        }]
    );
    let done = c.commit_write_at(1, "model", 9).unwrap();
    assert_eq!(done.info.version, 2);
    assert_eq!(done.info.loaded_from, "written by pid 7 (uid 1000)");
    assert_eq!(done.info.created_unix, 9);
    let retired = done.retired.unwrap();
    assert_eq!((retired.version, retired.bytes), (1, 400));
    assert_eq!(c.get("model").unwrap().version, 2);
    assert!(c.writing("model").is_none());
    // The retired version counts until its readers let go.
    assert_eq!(c.usage()[0].used, 800);
    assert_eq!(c.usage()[0].reserved, 0);
    assert!(c.release_retired("model", 1).is_some());
    assert!(c.release_retired("model", 1).is_none());
    assert_eq!(c.usage()[0].used, 400);
}

#[test]
fn a_second_writer_is_refused_naming_the_first() {
    let mut c = with_model(10_000);
    c.open_write(w(7, 1000, 1), "model", ".s/1".into(), staged(400), false)
        .unwrap();
    for (who, what) in [(w(8, 1000, 2), "another"), (w(7, 1000, 1), "the same")] {
        let e = c
            .open_write(who, "model", ".s/2".into(), staged(400), false)
            .unwrap_err();
        assert_eq!(e.code(), "writing", "{what}");
        assert!(e.to_string().contains("pid 7 (uid 1000)"), "{e}");
    }
    // Loads and drops of it are refused too, naming the writer; a forced
    // drop goes through (the service then aborts the session).
    assert_eq!(c.admit(1000, "model", 1).unwrap_err().code(), "exists");
    let e = c.check_drop(1000, "model", &[], false).unwrap_err();
    assert_eq!(e.code(), "writing");
    assert!(c.check_drop(1000, "model", &[], true).is_ok());
    // Commit and abort belong to the writer's connection.
    let e = c.commit_write(2, "model").unwrap_err();
    assert_eq!(e.code(), "not_writing");
    assert!(e.to_string().contains("pid 7 (uid 1000)"), "{e}");
    assert_eq!(c.abort_write(2, "model").unwrap_err().code(), "not_writing");
    assert_eq!(c.get("model").unwrap().version, 1);
    let s = c.abort_write(1, "model").unwrap();
    assert_eq!(s.version, 2);
    assert_eq!(c.usage()[0].reserved, 0);
    // The version an aborted session would have had is given again.
    let s = c
        .open_write(w(8, 1000, 2), "model", ".s/3".into(), staged(400), false)
        .unwrap();
    assert_eq!(s.version, 2);
}

#[test]
fn new_sets_other_uids_quotas_and_stopping_are_checked() {
    let mut c = with_model(1000);
    let e = c
        .open_write(w(7, 1001, 1), "model", ".s".into(), staged(1), false)
        .unwrap_err();
    assert_eq!(e.code(), "not_owner");
    assert!(e.to_string().contains("may write it"), "{e}");
    // The service's uid may write anyone's set; its bytes count for the owner.
    let s = c
        .open_write(w(7, SERVICE, 1), "model", ".s".into(), staged(400), false)
        .unwrap();
    assert_eq!(s.owner_uid, 1000);
    assert_eq!(c.writer_gone(1).len(), 1);
    let e = c
        .open_write(w(7, 1000, 1), "new", ".s".into(), staged(1), false)
        .unwrap_err();
    assert_eq!(e.code(), "not_found");
    let e = c
        .open_write(w(7, 1000, 1), "model", ".s".into(), staged(1), true)
        .unwrap_err();
    assert_eq!(e.code(), "exists");
    let e = c
        .open_write(w(7, 1000, 1), "model", ".s".into(), staged(601), false)
        .unwrap_err();
    assert_eq!(e.code(), "over_quota");
    assert!(e.to_string().contains("asks for 601"), "{e}");
    let s = c
        .open_write(w(7, 1001, 4), "new", ".s/n".into(), staged(600), true)
        .unwrap();
    assert_eq!((s.owner_uid, s.version, s.creates), (1001, 1, true));
    assert_eq!(c.admit(1001, "new", 1).unwrap_err().code(), "writing");
    let done = c.commit_write(4, "new").unwrap();
    assert!(done.retired.is_none());
    assert_eq!((done.info.owner_uid, done.info.version), (1001, 1));
    c.stop();
    let e = c
        .open_write(w(7, 1000, 1), "model", ".s".into(), staged(1), false)
        .unwrap_err();
    assert_eq!(e.code(), "stopping");
}

#[test]
fn a_connection_and_a_uid_hold_a_bounded_number_of_sessions() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited());
    let open = |c: &mut Catalog, writer: WriterId, i: usize| {
        c.open_write(writer, &format!("s{i}"), format!("e{i}"), staged(256), true)
            .map(|_| ())
    };
    for i in 0..MAX_WRITES_PER_CONNECTION {
        open(&mut c, w(1, 7, 1), i).unwrap();
    }
    let e = open(&mut c, w(1, 7, 1), 1000).unwrap_err();
    assert_eq!(e.code(), "too_many_writes");
    assert!(
        e.to_string().contains("this connection already holds 16"),
        "{e}"
    );
    assert!(c.writing("s1000").is_none());
    // Other connections of the uid, up to the uid's limit.
    let mut i = MAX_WRITES_PER_CONNECTION;
    let mut conn = 2;
    while i < MAX_WRITES_PER_UID {
        if open(&mut c, w(1, 7, conn), i).is_err() {
            conn += 1;
            continue;
        }
        i += 1;
    }
    let e = open(&mut c, w(1, 7, conn + 1), 2000).unwrap_err();
    assert_eq!(e.code(), "too_many_writes");
    assert!(e.to_string().contains("uid 7 already holds 64"), "{e}");
    // Another uid is not held back; an abort makes room.
    open(&mut c, w(2, 8, 99), 3000).unwrap();
    c.abort_write(1, "s0").unwrap();
    open(&mut c, w(1, 7, 1), 4000).unwrap();
}

#[test]
fn a_closed_connection_ends_only_its_own_sessions() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited());
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        c.open_write(
            w(1, 1, 1 + (i as u64 / 2)),
            name,
            format!(".s/{name}"),
            staged(10),
            true,
        )
        .unwrap();
    }
    let mut gone: Vec<String> = c.writer_gone(1).into_iter().map(|s| s.set).collect();
    gone.sort();
    assert_eq!(gone, ["a", "b"]);
    assert!(c.writer_gone(1).is_empty());
    assert_eq!(c.write_sessions().count(), 1);
    assert!(c.sets().next().is_none());
}

/// One step of a random history.
#[derive(Clone, Debug)]
enum Op {
    Open {
        conn: u64,
        uid: u32,
        name: u8,
        bytes: u64,
        creates: bool,
    },
    Commit {
        conn: u64,
        name: u8,
    },
    Abort {
        conn: u64,
        name: u8,
    },
    Close(u64),
    Drop {
        name: u8,
        force: bool,
    },
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let conn = 1u64..4;
    let name = 0u8..3;
    prop_oneof![
        (
            conn.clone(),
            prop::sample::select(vec![1u32, 2, SERVICE]),
            name.clone(),
            0u64..500,
            any::<bool>()
        )
            .prop_map(|(conn, uid, name, bytes, creates)| Op::Open {
                conn,
                uid,
                name,
                bytes,
                creates
            }),
        (conn.clone(), name.clone()).prop_map(|(conn, name)| Op::Commit { conn, name }),
        (conn.clone(), name.clone()).prop_map(|(conn, name)| Op::Abort { conn, name }),
        conn.prop_map(Op::Close),
        (name, any::<bool>()).prop_map(|(name, force)| Op::Drop { name, force }),
        (0usize..4).prop_map(Op::Release),
    ]
}

/// The owner writes version after version while a reader of another uid
/// keeps each old one: the old versions count against the reader, the
/// owner's quota holds only its current version and its write.
#[test]
fn old_versions_count_against_the_readers_that_keep_them_not_the_owner() {
    let mut c = with_model(1000); // uid 1000's "model", 400 bytes, version 1
    let reader = Holder { pid: 42, uid: 2000 };
    for round in 1..=4u64 {
        c.open_write(
            w(7, 1000, 1),
            "model",
            format!(".s/{round}"),
            staged(400),
            false,
        )
        .unwrap_or_else(|e| panic!("write {round}: {e}"));
        let done = c.commit_write_at(1, "model", round).unwrap();
        let old = done.retired.unwrap();
        // The service saw the reader's lease on the replaced version.
        c.set_retired_holders("model", old.version, &[reader, reader]);
        let usage = c.usage();
        let of = |uid: u32| usage.iter().find(|u| u.uid == uid).copied().unwrap();
        assert_eq!((of(1000).used, of(1000).held), (400, 0), "round {round}");
        assert_eq!(
            (of(2000).used, of(2000).held),
            (400 * round, 400 * round),
            "round {round}"
        );
        assert_eq!(c.total_bytes(), 400 * (round + 1));
    }
    // The reader's quota (the default, 1000) is what its holds now cost.
    assert_eq!(c.admit(2000, "mine", 1).unwrap_err().code(), "over_quota");
    // It lets go of two: they leave the books, and its quota has room.
    c.release_retired("model", 1).unwrap();
    c.release_retired("model", 2).unwrap();
    assert!(c.admit(2000, "mine", 100).is_ok());
    // A version whose holders are not known yet counts against its owner.
    assert!(c.retired().iter().all(|r| r.holders == [2000]));
    c.set_retired_holders("model", 3, &[]);
    assert!(c.retired()[0].charged_to(1000));
}

proptest! {
    /// Whatever happens: at most one writer per set; a set's current
    /// version changes only by a commit of its writer (and then goes up);
    /// quotas count every live version (current, retired, staging) and no
    /// uid passes its quota; a refusal changes nothing.
    #[test]
    fn one_writer_per_set_versions_change_only_by_commit_and_quotas_count_every_version(
        ops in prop::collection::vec(op(), 1..80)
    ) {
        let quotas = Quotas::unlimited().with_default(Some(1000)).with_uid(2, 600);
        let mut c = Catalog::new(SERVICE, quotas);
        // The model: set -> (owner, bytes, version); sessions: set -> (conn, owner, bytes).
        let mut sets: BTreeMap<String, (u32, u64, u64)> = BTreeMap::new();
        let mut sessions: BTreeMap<String, (u64, u32, u64)> = BTreeMap::new();
        let mut retired: Vec<(String, u64, u32, u64)> = Vec::new();
        for op in ops {
            let before: Vec<(String, u64)> = c.sets().map(|s| (s.name.clone(), s.version)).collect();
            let mut committed = None;
            match op {
                Op::Open { conn, uid, name, bytes, creates } => {
                    let name = format!("s{name}");
                    let usage = c.usage();
                    let r = c.open_write(w(conn as u32, uid, conn), &name, format!(".s/{conn}"), staged(bytes), creates).cloned();
                    if let Ok(s) = r {
                        prop_assert!(!sessions.contains_key(&name));
                        prop_assert_eq!(creates, !sets.contains_key(&name));
                        sessions.insert(name, (conn, s.owner_uid, bytes));
                    } else {
                        prop_assert_eq!(c.usage(), usage);
                    }
                }
                Op::Commit { conn, name } => {
                    let name = format!("s{name}");
                    let holds = sessions.get(&name).is_some_and(|s| s.0 == conn);
                    match c.commit_write(conn, &name) {
                        Ok(done) => {
                            prop_assert!(holds);
                            let (_, owner, bytes) = sessions.remove(&name).unwrap();
                            if let Some((o, b, v)) = sets.get(&name) {
                                prop_assert!(done.info.version > *v);
                                retired.push((name.clone(), *v, *o, *b));
                            }
                            sets.insert(name.clone(), (owner, bytes, done.info.version));
                            committed = Some(name);
                        }
                        Err(e) => prop_assert!(!holds, "{e}"),
                    }
                }
                Op::Abort { conn, name } => {
                    let name = format!("s{name}");
                    let holds = sessions.get(&name).is_some_and(|s| s.0 == conn);
                    prop_assert_eq!(c.abort_write(conn, &name).is_ok(), holds);
                    if holds {
                        sessions.remove(&name);
                    }
                }
                Op::Close(conn) => {
                    let gone = c.writer_gone(conn);
                    for s in &gone {
                        prop_assert_eq!(sessions.remove(&s.set).map(|s| s.0), Some(conn));
                    }
                    prop_assert!(sessions.values().all(|s| s.0 != conn));
                }
                Op::Drop { name, force } => {
                    let name = format!("s{name}");
                    if c.check_drop(SERVICE, &name, &[], force).is_ok() {
                        prop_assert!(force || !sessions.contains_key(&name));
                        if c.abort_any(&name).is_some() {
                            sessions.remove(&name);
                        }
                        c.drop_set(&name, &[]);
                        sets.remove(&name);
                    }
                }
                Op::Release(i) if i < retired.len() => {
                    let (name, version, ..) = retired.remove(i);
                    prop_assert!(c.release_retired(&name, version).is_some());
                }
                Op::Release(_) => {}
            }
            // Versions change only by a commit.
            for (name, version) in before {
                if committed.as_deref() != Some(name.as_str())
                    && let Some(s) = c.get(&name)
                {
                    prop_assert_eq!(s.version, version);
                }
            }
            // One writer per set, as the model says.
            let open: BTreeMap<String, u64> = c.write_sessions().map(|s| (s.set.clone(), s.writer.connection)).collect();
            let model: BTreeMap<String, u64> = sessions.iter().map(|(n, s)| (n.clone(), s.0)).collect();
            prop_assert_eq!(open, model);
            // Quotas count every live version, and hold.
            for u in c.usage() {
                let used: u64 = sets.values().filter(|s| s.0 == u.uid).map(|s| s.1)
                    .chain(retired.iter().filter(|r| r.2 == u.uid).map(|r| r.3)).sum();
                let reserved: u64 = sessions.values().filter(|s| s.1 == u.uid).map(|s| s.2).sum();
                prop_assert_eq!((u.used, u.reserved), (used, reserved));
                prop_assert!(u.quota.is_none_or(|q| u.used + u.reserved <= q), "{u:?}");
            }
        }
    }
}
