use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};

use proptest::prelude::*;

use super::*;

fn me() -> u32 {
    std::process::id()
}

/// A kept book, and a descriptor of its file (what the store holds).
fn kept() -> (Readers, OwnedFd) {
    let mut r = Readers::new();
    let fd = r.create().unwrap().try_clone_to_owned().unwrap();
    (r, fd)
}

fn file(fd: &OwnedFd) -> Vec<Orphan> {
    decode(&read_all(fd.as_fd()).unwrap()).unwrap()
}

/// What the next serving process finds in the file.
fn next_process(fd: &OwnedFd) -> Readers {
    let mut next = Readers::new();
    next.adopt(fd.try_clone().unwrap()).unwrap();
    next
}

/// Two set names whose filter bits do not overlap.
const A: &str = "model";
const B: &str = "draft";

#[test]
fn names_have_two_bits_that_stay_the_same_in_every_build() {
    assert_eq!(
        name_bits(A) & name_bits(B),
        0,
        "the tests' names must not overlap"
    );
    for n in [A, B, "", "x", "a/very/long/name"] {
        let bits = name_bits(n);
        assert!((1..=2).contains(&bits.count_ones()), "{n}: {bits:#x}");
    }
    // FNV-1a: a build that hashed otherwise would not read its
    // predecessor's book.
    assert_eq!(name_bits("model"), (1 << 58) | 1);
}

#[test]
fn start_times_tell_a_running_process_from_one_gone() {
    let t = start_time(me()).unwrap();
    assert!(t > 0);
    assert_eq!(start_time(me()), Some(t));
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    assert_eq!(start_time(pid), None);
}

#[test]
fn a_lease_is_written_before_anything_else_and_freed_with_the_last() {
    let (mut r, fd) = kept();
    assert!(file(&fd).is_empty());
    r.lease(true, A, me(), 5);
    let slots = file(&fd);
    assert_eq!(slots.len(), 1);
    assert_eq!((slots[0].pid, slots[0].uid), (me(), 5));
    assert_eq!(slots[0].start, start_time(me()).unwrap());
    assert_eq!(slots[0].filter, name_bits(A));
    // Chunks and staging entries are not sets; a pid not seen is not
    // written.
    r.lease(true, ".cuda-ipc/chunk/1/0", me(), 5);
    r.lease(true, B, 0, 5);
    assert_eq!(file(&fd), slots);
    // Two leases on one set: the filter stays until both end.
    r.lease(true, A, me(), 5);
    r.lease(true, B, me(), 5);
    assert_eq!(file(&fd)[0].filter, name_bits(A) | name_bits(B));
    r.lease(false, B, me(), 5);
    r.lease(false, A, me(), 5);
    assert_eq!(file(&fd)[0].filter, name_bits(A));
    r.lease(false, A, me(), 5);
    assert!(file(&fd).is_empty(), "{:?}", file(&fd));
    // An end never granted changes nothing.
    r.lease(false, A, me(), 5);
    assert!(file(&fd).is_empty());
}

#[test]
fn leases_granted_before_the_file_came_are_written_when_it_comes() {
    let mut r = Readers::new();
    r.lease(true, A, me(), 5);
    assert!(!r.is_kept());
    let fd = r.create().unwrap().try_clone_to_owned().unwrap();
    assert_eq!(file(&fd).len(), 1);
}

#[test]
fn the_next_process_waits_for_a_reader_of_before_until_it_says_it_reconnected() {
    let (mut r, fd) = kept();
    r.lease(true, A, me(), 5);
    r.lease(true, B, me(), 5);
    drop(r); // the serving process dies

    let mut next = next_process(&fd);
    let nobody_aside = |_: u32, _: u32| false;
    let orphan = vec![Holder { pid: me(), uid: 5 }];
    assert_eq!(next.orphans_of(A, nobody_aside), orphan);
    assert_eq!(next.orphans_of(B, nobody_aside), orphan);
    assert_eq!(name_bits("other") & (name_bits(A) | name_bits(B)), 0);
    assert!(next.orphans_of("other", nobody_aside).is_empty());
    // Aside now (its kept `aside` call, made again first): not waited for.
    assert!(
        next.orphans_of(A, |pid, uid| (pid, uid) == (me(), 5))
            .is_empty()
    );
    // Its lease on A taken back: waited for as any reader (not as an
    // orphan); B still as one.
    next.lease(true, A, me(), 5);
    assert!(next.orphans_of(A, nobody_aside).is_empty());
    assert_eq!(next.orphans_of(B, nobody_aside), orphan);
    // It says it took back all but B.
    next.reconnected(me(), 5, &[B.to_owned()]);
    assert_eq!(next.orphans_of(B, nobody_aside), orphan);
    next.lease(false, A, me(), 5);
    assert!(next.orphans_of(A, nobody_aside).is_empty());
    // And then B too: no orphan, in memory or in the file.
    next.reconnected(me(), 5, &[]);
    assert!(next.orphans_of(B, nobody_aside).is_empty());
    assert!(next.orphans().is_empty());
    assert!(file(&fd).is_empty());
    // Another uid's word is not this one's.
    let (mut r, fd) = kept();
    r.lease(true, A, me(), 5);
    let mut next = next_process(&fd);
    next.reconnected(me(), 6, &[]);
    assert_eq!(next.orphans_of(A, nobody_aside), orphan);
}

#[test]
fn a_reader_aside_from_all_it_leased_is_not_waited_for_after_a_restart() {
    let (mut r, fd) = kept();
    r.lease(true, A, me(), 5);
    r.lease(true, B, me(), 5);
    let aside = |sets: &[&str]| {
        HashMap::from([((me(), 5), sets.iter().map(|s| (*s).to_owned()).collect())])
    };
    // Aside from A only: it may still map B awake, and the filter cannot
    // tell which: waited for on both.
    r.set_aside(&aside(&[A]));
    let mut next = next_process(&fd);
    assert_eq!(next.orphans_of(A, |_, _| false).len(), 1);
    // Aside from both: asleep, not waited for.
    r.set_aside(&aside(&[A, B]));
    let mut next = next_process(&fd);
    assert!(next.orphans_of(A, |_, _| false).is_empty());
    assert!(next.orphans_of(B, |_, _| false).is_empty());
    // Back from A (written before `back` answers): waited for again.
    r.set_aside(&aside(&[B]));
    let mut next = next_process(&fd);
    assert_eq!(next.orphans_of(A, |_, _| false).len(), 1);
    r.set_aside(&HashMap::new());
    assert_eq!(file(&fd)[0].aside, 0);
}

#[test]
fn readers_that_exited_are_forgotten() {
    let (mut r, fd) = kept();
    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    r.lease(true, A, pid, 5);
    r.lease(true, A, me(), 5);
    let mut next = next_process(&fd);
    assert_eq!(next.orphans().len(), 2);
    child.kill().unwrap();
    child.wait().unwrap();
    assert_eq!(
        next.orphans_of(A, |_, _| false),
        [Holder { pid: me(), uid: 5 }]
    );
    assert_eq!(next.orphans().len(), 1);
    assert_eq!(file(&fd).len(), 1, "its slot is freed in the file too");
    // One found gone at start is not adopted at all.
    let (mut r, fd) = kept();
    r.lease(true, A, pid, 5);
    assert!(next_process(&fd).orphans().is_empty());
    assert!(file(&fd).is_empty());
}

#[test]
fn the_next_process_writes_its_own_readers_beside_the_orphans() {
    let (mut r, fd) = kept();
    r.lease(true, A, me(), 5);
    let mut next = next_process(&fd);
    next.lease(true, B, me(), 7);
    let slots = file(&fd);
    assert_eq!(slots.len(), 2);
    assert_ne!(slots[0].slot, slots[1].slot);
    // A third process finds both.
    assert_eq!(next_process(&fd).orphans().len(), 2);
}

#[test]
fn a_file_of_another_shape_is_refused_by_name() {
    let (_r, fd) = kept();
    let good = read_all(fd.as_fd()).unwrap();
    assert!(decode(&good).unwrap().is_empty());
    assert!(decode(&good[..100]).unwrap_err().contains("bytes long"));
    let mut bad = good.clone();
    bad[0] ^= 1;
    assert!(decode(&bad).unwrap_err().contains("not a readers' book"));
    let mut bad = good.clone();
    bad[16] = 9;
    assert!(decode(&bad).unwrap_err().contains("format 9"));
    let mut r = Readers::new();
    let not_a_book = crate::keep::store::sealed("x", b"nope").unwrap();
    assert!(r.adopt(not_a_book).is_err());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Whatever a file holds, reading it never panics, and every slot
    /// with an owner comes back.
    #[test]
    fn any_file_decodes_or_is_refused(
        slots in proptest::collection::vec((0usize..SLOTS, any::<[u8; SLOT]>()), 0..16),
        header in any::<bool>(),
        cut in proptest::option::of(0usize..FILE_BYTES),
    ) {
        let (_r, fd) = kept();
        let mut bytes = read_all(fd.as_fd()).unwrap();
        if !header {
            bytes[20] ^= 0xff;
        }
        for (slot, b) in &slots {
            let at = HEADER + slot * SLOT;
            bytes[at..at + SLOT].copy_from_slice(b);
        }
        if let Some(cut) = cut {
            bytes.truncate(cut);
        }
        match decode(&bytes) {
            Ok(orphans) => {
                prop_assert!(header && cut.is_none());
                let owned: std::collections::BTreeSet<usize> = slots
                    .iter()
                    .map(|(s, _)| *s)
                    .filter(|s| bytes[HEADER + s * SLOT..HEADER + s * SLOT + 4] != [0; 4])
                    .collect();
                let got: std::collections::BTreeSet<usize> = orphans.iter().map(|o| o.slot).collect();
                prop_assert_eq!(got, owned);
            }
            Err(e) => prop_assert!(!e.is_empty()),
        }
    }
}

/// One step of a serving process's life, as the book hears of it.
#[derive(Clone, Debug)]
enum Step {
    Grant(u32, usize),
    End(u32, usize),
    /// Which sets each process (uid) is aside from now.
    Aside(Vec<(u32, usize)>),
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u32..4, 0usize..3).prop_map(|(u, s)| Step::Grant(u, s)),
        (0u32..4, 0usize..3).prop_map(|(u, s)| Step::End(u, s)),
        proptest::collection::vec((0u32..4, 0usize..3), 0..4).prop_map(Step::Aside),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    /// Whatever leases were granted, ended and stepped aside from, the
    /// next serving process waits, for each set, for exactly the processes
    /// that held a lease on it at the crash and were not aside from all
    /// they held (the sets' filter bits do not overlap here). Processes
    /// are this one under four uids (running, so never forgotten).
    #[test]
    fn the_next_process_waits_for_exactly_the_readers_that_may_map_each_set(
        steps in proptest::collection::vec(step(), 0..40),
    ) {
        const SETS: [&str; 3] = [A, B, "other"];
        let (mut r, fd) = kept();
        let mut held: HashMap<(u32, usize), u32> = HashMap::new();
        let mut aside: HashMap<u32, Vec<usize>> = HashMap::new();
        for s in steps {
            match s {
                Step::Grant(u, set) => {
                    r.lease(true, SETS[set], me(), u);
                    *held.entry((u, set)).or_default() += 1;
                }
                Step::End(u, set) => {
                    r.lease(false, SETS[set], me(), u);
                    if let Some(n) = held.get_mut(&(u, set)) {
                        *n -= 1;
                        if *n == 0 {
                            held.remove(&(u, set));
                        }
                    }
                }
                Step::Aside(marks) => {
                    aside.clear();
                    let mut by: HashMap<(u32, u32), Vec<String>> = HashMap::new();
                    for (u, set) in marks {
                        aside.entry(u).or_default().push(set);
                        by.entry((me(), u)).or_default().push(SETS[set].to_owned());
                    }
                    r.set_aside(&by);
                }
            }
        }
        drop(r);
        let mut next = next_process(&fd);
        for (k, set) in SETS.iter().enumerate() {
            let mut want: Vec<u32> = (0..4)
                .filter(|&u| held.contains_key(&(u, k)))
                .filter(|&u| {
                    let mine: Vec<usize> = (0..3).filter(|&s| held.contains_key(&(u, s))).collect();
                    !mine.iter().all(|s| aside.get(&u).is_some_and(|a| a.contains(s)))
                })
                .collect();
            want.sort_unstable();
            let mut got: Vec<u32> = next.orphans_of(set, |_, _| false).iter().map(|h| h.uid).collect();
            got.sort_unstable();
            prop_assert_eq!(got, want, "set {}", set);
        }
    }
}
