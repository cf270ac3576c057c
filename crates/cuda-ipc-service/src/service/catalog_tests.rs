//! The catalog's rules, one by one, and as properties of any sequence of
//! loads, failures and drops.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;

const SERVICE: u32 = 500;

fn loaded() -> Loaded {
    Loaded::new(90, 3, "/m/model.safetensors")
}

#[test]
fn a_load_is_admitted_reserved_and_committed() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited().with_default(Some(1000)));
    let t = c.admit(1000, "model", 400).unwrap();
    assert_eq!((t.name(), t.bytes()), ("model", 400));
    assert_eq!(c.loads_in_progress(), 1);
    assert_eq!(
        c.usage(),
        [UidUsage {
            uid: 1000,
            used: 0,
            held: 0,
            reserved: 400,
            quota: Some(1000),
            sets: 0
        }]
    );
    let set = c.commit_at(t, loaded(), 77).clone();
    assert_eq!(
        set,
        SetInfo {
            name: "model".into(),
            owner_uid: 1000,
            bytes: 400,
            payload_bytes: 90,
            tensors: 3,
            version: 1,
            loaded_from: "/m/model.safetensors".into(),
            created_unix: 77,
        }
    );
    assert_eq!(c.loads_in_progress(), 0);
    assert_eq!(c.total_bytes(), 400);
    assert_eq!(c.usage()[0].used, 400);
    assert_eq!(c.usage()[0].sets, 1);
}

#[test]
fn a_load_over_quota_is_refused_naming_used_reserved_quota_and_asked() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited().with_default(Some(1000)));
    let t = c.admit(1000, "a", 600).unwrap();
    let _ = c.commit(t, loaded());
    let pending = c.admit(1000, "b", 300).unwrap();
    let e = c.admit(1000, "c", 101).unwrap_err();
    assert_eq!(
        e,
        CatalogError::OverQuota {
            uid: 1000,
            used: 600,
            reserved: 300,
            quota: 1000,
            asked: 101
        }
    );
    assert_eq!(e.code(), "over_quota");
    let text = e.to_string();
    for part in ["uid 1000", "101", "600", "300", "1000", "cuda-ipc drop"] {
        assert!(text.contains(part), "{text}");
    }
    // Exactly the quota fits; another uid has its own.
    let fits = c.admit(1000, "c", 100).unwrap();
    assert!(c.admit(1001, "d", 1000).is_ok());
    // A failed load gives its bytes back.
    c.cancel(pending);
    c.cancel(fits);
    assert!(c.admit(1000, "e", 400).is_ok());
}

#[test]
fn overrides_replace_the_default_and_none_means_no_limit() {
    let q = Quotas::unlimited()
        .with_default(Some(10))
        .with_uid(7, 1 << 40);
    assert_eq!(q.of(7, SERVICE), Some(1 << 40));
    assert_eq!(q.of(8, SERVICE), Some(10));
    // The service's own uid has no limit unless it has an override.
    assert_eq!(q.of(SERVICE, SERVICE), None);
    assert_eq!(q.clone().with_uid(SERVICE, 5).of(SERVICE, SERVICE), Some(5));
    let mut c = Catalog::new(SERVICE, q);
    assert!(c.admit(7, "big", 1 << 39).is_ok());
    assert!(c.admit(8, "small", 11).is_err());
    let mut free = Catalog::new(SERVICE, Quotas::unlimited());
    assert!(free.admit(8, "huge", u64::MAX).is_ok());
    // Sums saturate instead of wrapping past a quota.
    let mut c = Catalog::new(SERVICE, Quotas::unlimited().with_uid(9, u64::MAX - 1));
    let _ = c.admit(9, "a", u64::MAX - 1).unwrap();
    assert!(matches!(
        c.admit(9, "b", 2),
        Err(CatalogError::OverQuota { .. })
    ));
    // Uids with an override are listed even without sets.
    assert_eq!(c.usage().len(), 1);
}

#[test]
fn names_are_held_once_and_versions_count_up_across_drops() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited());
    let t = c.admit(1, "m", 10).unwrap();
    assert_eq!(
        c.admit(2, "m", 10).unwrap_err(),
        CatalogError::Loading {
            name: "m".into(),
            uid: 1
        }
    );
    assert_eq!(c.commit(t, loaded()).version, 1);
    let e = c.admit(2, "m", 10).unwrap_err();
    assert_eq!(e.code(), "exists");
    assert!(e.to_string().contains("version 1"), "{e}");
    assert!(c.remove("m").is_some());
    let t = c.admit(2, "m", 10).unwrap();
    assert_eq!(c.commit(t, loaded()).version, 2);
    assert_eq!(c.get("m").unwrap().owner_uid, 2);
}

#[test]
fn drops_need_the_owner_or_the_service_and_no_leases_unless_forced() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited());
    let t = c.admit(1000, "m", 10).unwrap();
    let _ = c.commit(t, loaded());
    let e = c.check_drop(1001, "m", &[], false).unwrap_err();
    assert_eq!(e.code(), "not_owner");
    assert!(e.to_string().contains("uid 1000"), "{e}");
    assert!(c.check_drop(1000, "m", &[], false).is_ok());
    assert!(c.check_drop(SERVICE, "m", &[], false).is_ok());

    let holders = [
        Holder { pid: 42, uid: 1002 },
        Holder { pid: 41, uid: 1001 },
        Holder { pid: 42, uid: 1002 },
    ];
    let e = c.check_drop(1000, "m", &holders, false).unwrap_err();
    assert_eq!(
        e,
        CatalogError::Leased {
            name: "m".into(),
            holders: vec![Holder { pid: 41, uid: 1001 }, Holder { pid: 42, uid: 1002 }],
        }
    );
    let text = e.to_string();
    assert!(
        text.contains("pid 41 (uid 1001), pid 42 (uid 1002)") && text.contains("--force"),
        "{text}"
    );
    assert!(c.check_drop(1000, "m", &holders, true).is_ok());
    // Ownership is checked before leases, and force does not bypass it.
    assert_eq!(
        c.check_drop(1001, "m", &holders, true).unwrap_err().code(),
        "not_owner"
    );
    assert_eq!(
        c.check_drop(1000, "x", &[], true).unwrap_err().code(),
        "not_found"
    );
}

#[test]
fn a_stopping_catalog_admits_nothing_but_lets_admitted_loads_commit() {
    let mut c = Catalog::new(SERVICE, Quotas::unlimited());
    let t = c.admit(1, "m", 10).unwrap();
    c.stop();
    assert!(c.is_stopping());
    assert_eq!(c.admit(1, "n", 1).unwrap_err(), CatalogError::Stopping);
    let _ = c.commit(t, loaded());
    assert_eq!(c.sets().count(), 1);
}

#[test]
fn long_holder_lists_are_cut() {
    let many: Vec<Holder> = (0..20).map(|pid| Holder { pid, uid: 1 }).collect();
    let text = holders_text(&many);
    assert!(text.ends_with("and 12 more"), "{text}");
}

/// One step of a random history.
#[derive(Clone, Debug)]
enum Op {
    Admit {
        uid: u32,
        name: u8,
        bytes: u64,
    },
    Commit(usize),
    Cancel(usize),
    Drop {
        caller: u32,
        name: u8,
        leased: bool,
        force: bool,
    },
    /// The readers of a dropped set let go.
    Release(usize),
}

fn op() -> impl Strategy<Value = Op> {
    let uid = prop::sample::select(vec![1u32, 2, 3, SERVICE]);
    prop_oneof![
        (uid.clone(), 0u8..6, 0u64..700).prop_map(|(uid, name, bytes)| Op::Admit {
            uid,
            name,
            bytes
        }),
        (0usize..4).prop_map(Op::Commit),
        (0usize..4).prop_map(Op::Cancel),
        (0usize..4).prop_map(Op::Release),
        (uid, 0u8..6, any::<bool>(), any::<bool>()).prop_map(|(caller, name, leased, force)| {
            Op::Drop {
                caller,
                name,
                leased,
                force,
            }
        }),
    ]
}

/// A forced drop while readers hold the set: its bytes stay counted,
/// against them, until they let go; `usage` and `total_bytes` say so.
#[test]
fn a_forced_drop_counts_until_the_memory_is_free() {
    // A 64-byte quota, 48-byte sets: one at a time.
    let mut c = Catalog::new(SERVICE, Quotas::unlimited().with_default(Some(64)));
    let reader = Holder { pid: 9, uid: 1 };
    for (round, name) in ["a", "b", "c"].into_iter().enumerate() {
        let t = c
            .admit(1, name, 48)
            .unwrap_or_else(|e| panic!("load {name}: {e}"));
        c.commit_at(t, loaded(), 1);
        c.check_drop(1, name, &[reader], true).unwrap();
        let info = c.drop_set(name, &[reader]).unwrap();
        assert_eq!(info.bytes, 48);
        assert!(c.get(name).is_none(), "forgotten as a set");
        let u = c.usage();
        assert_eq!(
            (u[0].uid, u[0].used, u[0].held, u[0].sets),
            (1, 48, 48, 0),
            "{u:?}"
        );
        assert_eq!(c.total_bytes(), 48);
        // While its reader keeps it, another does not fit.
        assert_eq!(
            c.admit(1, "next", 48).unwrap_err().code(),
            "over_quota",
            "round {round}"
        );
        // The reader lets go: the memory is free, and so is the quota.
        let r = c.release_retired(name, 1).unwrap();
        assert!(r.dropped);
        assert_eq!((c.usage().len(), c.total_bytes()), (0, 0));
    }
    // A drop nobody holds leaves nothing behind.
    let t = c.admit(1, "d", 48).unwrap();
    c.commit_at(t, loaded(), 1);
    c.drop_set("d", &[]).unwrap();
    assert!(c.retired().is_empty());
    // Another uid's reader pays for what it keeps, not the owner.
    let t = c.admit(1, "e", 48).unwrap();
    c.commit_at(t, loaded(), 1);
    c.drop_set("e", &[Holder { pid: 5, uid: 2 }]).unwrap();
    let u = c.usage();
    assert_eq!((u[0].uid, u[0].used), (2, 48), "{u:?}");
    assert!(c.admit(1, "f", 48).is_ok());
}

/// Without a quota given, each uid but the service's own may hold a
/// quarter of the device: a tenant cannot take it from the others.
#[test]
fn other_uids_have_a_default_quota_and_the_services_own_has_none() {
    let device: u64 = 80 << 30;
    let default = super::super::ServiceConfig::default().quotas;
    let q = quotas_or_default(default, || Ok(device)).unwrap();
    assert_eq!(q.default, Some(20 << 30));
    let mut c = Catalog::new(SERVICE, q);
    let e = c.admit(65534, "sparse", 64 << 30).unwrap_err();
    assert_eq!(e.code(), "over_quota", "{e}");
    assert!(c.admit(65534, "fits", 20 << 30).is_ok());
    assert!(c.admit(SERVICE, "root", 64 << 30).is_ok());
    let u = c.usage();
    assert_eq!(u.iter().find(|u| u.uid == SERVICE).unwrap().quota, None);
    // Quotas given are kept as they are; the device is not asked.
    let given = Quotas::unlimited();
    let kept = quotas_or_default(Some(given.clone()), || panic!("asked")).unwrap();
    assert_eq!(kept, given);
}

proptest! {
    /// Whatever happens, no uid ever loads past its quota (what its
    /// readers keep of dropped sets counts, but can pass it: a reader of
    /// uid 3 keeps what it holds), the usage adds up to the sets and the
    /// dropped sets still held (charged to their reader's uid), a refusal
    /// changes nothing, and a drop happens exactly when the rules allow it.
    #[test]
    fn quotas_hold_and_the_books_balance(ops in prop::collection::vec(op(), 1..60)) {
        let quotas = Quotas::unlimited().with_default(Some(1000)).with_uid(2, 300);
        let mut c = Catalog::new(SERVICE, quotas.clone());
        let mut tickets: Vec<Ticket> = Vec::new();
        // The model: name -> (owner, bytes); dropped sets uid 3 holds.
        let mut sets: BTreeMap<String, (u32, u64)> = BTreeMap::new();
        let mut held: Vec<u64> = Vec::new();
        for op in ops {
            match op {
                Op::Admit { uid, name, bytes } => {
                    let name = format!("s{name}");
                    let before = c.usage();
                    let used: u64 = before.iter().filter(|u| u.uid == uid)
                        .map(|u| u.used + u.reserved).sum();
                    let taken = sets.contains_key(&name)
                        || tickets.iter().any(|t| t.name() == name);
                    let fits = quotas.of(uid, SERVICE).is_none_or(|q| used + bytes <= q);
                    match c.admit(uid, &name, bytes) {
                        Ok(t) => {
                            prop_assert!(!taken && fits);
                            tickets.push(t);
                        }
                        Err(e) => {
                            prop_assert!(taken || !fits, "{e}");
                            prop_assert_eq!(c.usage(), before);
                        }
                    }
                }
                Op::Commit(i) if i < tickets.len() => {
                    let t = tickets.remove(i);
                    let (name, uid, bytes) = (t.name().to_owned(), t.uid, t.bytes());
                    let info = c.commit(t, loaded()).clone();
                    prop_assert_eq!((info.owner_uid, info.bytes), (uid, bytes));
                    sets.insert(name, (uid, bytes));
                }
                Op::Cancel(i) if i < tickets.len() => c.cancel(tickets.remove(i)),
                Op::Drop { caller, name, leased, force } => {
                    let name = format!("s{name}");
                    let holders = if leased { vec![Holder { pid: 9, uid: 3 }] } else { vec![] };
                    let allowed = sets.get(&name).is_some_and(|(owner, _)| {
                        (caller == *owner || caller == SERVICE) && (!leased || force)
                    });
                    let checked = c.check_drop(caller, &name, &holders, force).is_ok();
                    prop_assert_eq!(checked, allowed);
                    if checked {
                        prop_assert!(c.drop_set(&name, &holders).is_some());
                        let (_, bytes) = sets.remove(&name).unwrap();
                        if leased {
                            held.push(bytes);
                        }
                    }
                }
                Op::Release(i) if i < held.len() => {
                    let r = c.retired()[i].clone();
                    prop_assert_eq!(c.release_retired(&r.set, r.version), Some(r));
                    held.remove(i);
                }
                Op::Commit(_) | Op::Cancel(_) | Op::Release(_) => {}
            }
            for u in c.usage() {
                let keeps: u64 = if u.uid == 3 { held.iter().sum() } else { 0 };
                prop_assert!(
                    u.quota.is_none_or(|q| u.used - u.held + u.reserved <= q),
                    "{u:?}"
                );
                let model: u64 = sets.values().filter(|(o, _)| *o == u.uid).map(|(_, b)| b).sum();
                prop_assert_eq!((u.used, u.held), (model + keeps, keeps));
            }
            let total = sets.values().map(|(_, b)| b).sum::<u64>() + held.iter().sum::<u64>();
            prop_assert_eq!(c.total_bytes(), total);
            prop_assert_eq!(c.loads_in_progress(), tickets.len());
        }
    }
}
