//! Tests of the plan: what the arguments decide, and what they refuse.

use super::*;
use clap::Parser;

#[derive(Parser, Debug)]
struct Cli {
    #[command(flatten)]
    args: Args,
}

fn parse(argv: &[&str]) -> Result<Args, String> {
    Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
        .map(|c| c.args)
        .map_err(|e| e.to_string())
}

fn plan(argv: &[&str]) -> Plan {
    Plan::from_args(&parse(argv).unwrap()).unwrap()
}

#[test]
fn sizes_parse_with_units_and_sort() {
    let p = plan(&["--sizes", "64MiB,2MiB,1GiB"]);
    assert_eq!(p.sizes, vec![2 * MIB, 64 * MIB, GIB]);
    let p = plan(&["--sizes", "4096", "--quick"]);
    assert_eq!(p.sizes, vec![4096]);
    let p = plan(&["--sizes", "8GiB, 1 GiB"]);
    assert_eq!(p.sizes, vec![GIB, 8 * GIB]);
    for bad in ["1KiB", "4097", "1.5GiB", "lots", "0", ""] {
        let e = parse(&["--sizes", bad]).unwrap_err();
        assert!(e.contains("size"), "{bad}: {e}");
    }
    assert!(
        parse(&["--sizes", "4097"])
            .unwrap_err()
            .contains("multiple of 4")
    );
}

#[test]
fn quick_and_full_defaults() {
    let q = plan(&["--quick"]);
    assert_eq!(q.sizes, vec![2 * MIB, 64 * MIB]);
    assert_eq!(
        q.reps(64 * MIB),
        Reps {
            warmup: 5,
            reps: 30
        }
    );
    assert_eq!(q.consumers, vec![1, 2]);
    assert_eq!(q.live_entries, 100);
    assert_eq!(q.bandwidth_size, 256 * MIB);
    assert_eq!(q.ring_load, Duration::from_secs(1));
    let f = plan(&[]);
    assert_eq!(f.sizes, vec![2 * MIB, 64 * MIB, GIB, 8 * GIB]);
    assert_eq!(
        f.reps(GIB),
        Reps {
            warmup: 10,
            reps: 100
        }
    );
    assert_eq!(
        f.reps(8 * GIB),
        Reps {
            warmup: 3,
            reps: 20
        }
    );
    assert_eq!(f.consumers, vec![1, 2, 4, 8]);
    assert_eq!(f.live_entries, 1000);
    assert_eq!(f.bandwidth_size, GIB);
    // without --devices, every section but the peer one
    let mut all = SectionId::ALL.to_vec();
    all.retain(|s| *s != SectionId::Peer);
    assert_eq!(f.sections, all);
    assert_eq!((f.device, f.peer), (0, None));
    assert_eq!(
        f.mechanisms,
        vec![Mechanism::Legacy, Mechanism::Vmm, Mechanism::Pool]
    );
    assert_eq!(f.torch, Ok(("python3".to_string(), None)));
    // one step per row
    // fresh, arena (sizes up to 1 GiB), push (three ways at four block
    // sizes), cached, floor (the pipe, four wake-up rows, then two
    // mechanisms at four sizes), bandwidth, ring, sync, scale, sets (ours
    // and its update per set, then PyTorch, ours from Python and the first
    // attach), torch
    assert_eq!(
        f.steps(),
        12 + 9 + 12 + 12 + (1 + 4 + 8) + 3 + 3 + 10 + 5 + 9 + 1
    );
    assert_eq!(f.arena_sizes, vec![2 * MIB, 64 * MIB, GIB]);
    assert_eq!(
        f.sets,
        vec![(100, 4 * GIB), (1000, 4 * GIB), (10_000, 4 * GIB)]
    );
    assert_eq!(
        (f.first_attach, f.first_attach_loads),
        (
            Reps {
                warmup: 1,
                reps: 10
            },
            5
        )
    );
    assert_eq!(
        f.set_reps,
        Reps {
            warmup: 3,
            reps: 20
        }
    );
    assert_eq!(q.arena_sizes, vec![2 * MIB, 64 * MIB]);
    assert_eq!(
        q.sets,
        vec![(100, 256 * MIB), (1000, 256 * MIB), (10_000, 256 * MIB)]
    );
    assert_eq!(
        (q.first_attach, q.first_attach_loads),
        (Reps { warmup: 1, reps: 5 }, 3)
    );
    assert_eq!(
        q.set_reps,
        Reps {
            warmup: 2,
            reps: 10
        }
    );
}

#[test]
fn options_override_the_plan() {
    let p = plan(&[
        "--quick",
        "--mechanisms",
        "vmm,legacy",
        "--reps",
        "7",
        "--warmup",
        "1",
        "--only",
        "fresh,torch",
        "--no-torch",
        "--device",
        "3",
    ]);
    assert_eq!(p.mechanisms, vec![Mechanism::Vmm, Mechanism::Legacy]);
    assert_eq!(p.reps(2 * MIB), Reps { warmup: 1, reps: 7 });
    assert_eq!(p.reps(8 * GIB), Reps { warmup: 1, reps: 7 });
    assert_eq!(p.sections, vec![SectionId::Fresh]);
    assert_eq!(p.torch, Err("--no-torch".to_string()));
    assert_eq!(p.device, 3);
    let p = plan(&["--python", "/opt/py/bin/python", "--torch-script", "x.py"]);
    assert_eq!(
        p.torch,
        Ok((
            "/opt/py/bin/python".to_string(),
            Some(PathBuf::from("x.py"))
        ))
    );
}

#[test]
fn devices_add_the_peer_section() {
    let p = plan(&["--devices", "0,1"]);
    assert_eq!((p.device, p.peer), (0, Some(1)));
    assert_eq!(p.sections, SectionId::ALL.to_vec());
    let q = plan(&["--quick", "--devices", "2,1"]);
    assert_eq!((q.device, q.peer), (2, Some(1)));
    // one fresh and one cached row per mechanism and size, one floor
    // row per floor mechanism and size, one copy step per mechanism
    assert_eq!(
        q.steps() - plan(&["--quick", "--device", "2"]).steps(),
        2 * 3 * 2 + 2 * 2 + 3
    );
    let p = plan(&["--devices", "1,0", "--device", "1", "--only", "peer"]);
    assert_eq!(
        (p.device, p.peer, p.sections),
        (1, Some(0), vec![SectionId::Peer])
    );
}

#[test]
fn bad_devices_say_why() {
    let why = |argv: &[&str]| Plan::from_args(&parse(argv).unwrap()).unwrap_err();
    assert!(why(&["--devices", "0"]).contains("two device ordinals"));
    assert!(why(&["--devices", "0,1,2"]).contains("not 3"));
    assert!(why(&["--devices", "1,1"]).contains("must differ"));
    assert!(why(&["--devices", "0,1", "--device", "1"]).contains("disagree"));
    assert!(why(&["--only", "peer"]).contains("--devices A,B"));
    assert!(
        parse(&["--devices", "0,x"])
            .unwrap_err()
            .contains("\"x\" is not a device ordinal")
    );
}

#[test]
fn arena_and_sets_sections() {
    let p = plan(&["--only", "sets,arena", "--reps", "4"]);
    assert_eq!(p.sections, vec![SectionId::Arena, SectionId::Sets]);
    assert_eq!(p.set_reps, Reps { warmup: 3, reps: 4 });
    // arena: 3 mechanisms x 3 sizes; sets: ours and update x 3 sets, 3 scripts
    assert_eq!(p.steps(), 3 * 3 + 2 * 3 + 3);
    let p = plan(&[
        "--only",
        "arena",
        "--sizes",
        "4KiB,8GiB",
        "--mechanisms",
        "vmm",
    ]);
    assert_eq!(p.arena_sizes, vec![4096]);
    let e = Plan::from_args(&parse(&["--only", "arena", "--sizes", "8GiB"]).unwrap()).unwrap_err();
    assert!(e.contains("up to 1GiB") && e.contains("8GiB"), "{e}");
    // without --only, a run of large sizes only just has no arena rows
    assert!(plan(&["--sizes", "8GiB"]).arena_sizes.is_empty());
    // the PyTorch rows of the sets section go with --no-torch
    let p = plan(&["--only", "sets", "--no-torch"]);
    assert_eq!(p.sections, vec![SectionId::Sets]);
    assert_eq!(p.torch, Err("--no-torch".to_string()));
}

#[test]
fn bad_arguments_say_why() {
    assert!(
        parse(&["--mechanisms", "fabric"])
            .unwrap_err()
            .contains("legacy, vmm, pool")
    );
    assert!(
        parse(&["--only", "everything"])
            .unwrap_err()
            .contains("not a section")
    );
    let a = parse(&["--only", "torch", "--no-torch"]).unwrap();
    assert!(Plan::from_args(&a).unwrap_err().contains("no section"));
}

#[test]
fn duplicates_are_errors_naming_the_duplicate() {
    let why = |argv: &[&str]| Plan::from_args(&parse(argv).unwrap()).unwrap_err();
    let e = why(&["--mechanisms", "vmm,legacy,vmm"]);
    assert!(e.contains("--mechanisms names vmm twice"), "{e}");
    let e = why(&["--mechanisms", "VMM,vmm"]);
    assert!(e.contains("vmm twice"), "{e}");
    // the same size in two spellings is still the same size
    let e = why(&["--sizes", "64MiB,2MiB,2097152"]);
    assert!(
        e.contains("--sizes names 2MiB (2097152 bytes) twice"),
        "{e}"
    );
    let e = why(&["--only", "fresh,ring,fresh"]);
    assert!(e.contains("--only names fresh twice"), "{e}");
}

#[test]
fn reps_zero_is_an_error_not_one() {
    let e = parse(&["--reps", "0"]).unwrap_err();
    assert!(e.contains("at least 1 sample"), "{e}");
    let e = parse(&["--reps", "-3"]).unwrap_err();
    assert!(e.contains("not a whole number"), "{e}");
    assert_eq!(plan(&["--reps", "1"]).reps(2 * MIB).reps, 1);
    let e = parse(&["--warmup", "-1"]).unwrap_err();
    assert!(e.contains("not a whole number"), "{e}");
    let e = parse(&["--device", "-1"]).unwrap_err();
    assert!(e.contains("\"-1\" is not a device ordinal"), "{e}");
    // no warm-up is a valid choice
    assert_eq!(plan(&["--warmup", "0"]).reps(2 * MIB).warmup, 0);
}

#[test]
fn consumer_namespaces_skip_what_cannot_work_there() {
    let p = plan(&["--quick"]);
    assert!(p.namespaces.is_empty());
    assert!(
        SectionId::ALL
            .iter()
            .all(|id| p.namespace_skip(*id).is_none())
    );
    let p = plan(&["--quick", "--consumer-namespaces", "pid,ipc"]);
    assert_eq!(p.namespaces.names(), ["pid", "ipc"]);
    // PyTorch's own children cannot be moved: its rows say why
    assert!(
        p.torch
            .as_ref()
            .unwrap_err()
            .contains("torch.multiprocessing"),
        "{:?}",
        p.torch
    );
    assert!(
        SectionId::ALL
            .iter()
            .all(|id| p.namespace_skip(*id).is_none())
    );
    assert_eq!(p.steps(), plan(&["--quick"]).steps());
    // --no-torch says so first
    let p = plan(&["--consumer-namespaces", "ipc", "--no-torch"]);
    assert_eq!(p.torch, Err("--no-torch".to_string()));
    // a private /dev/shm: no interprocess events
    let p = plan(&["--quick", "--consumer-namespaces", "shm,pid"]);
    for id in [SectionId::Floor, SectionId::Peer, SectionId::Sync] {
        let why = p.namespace_skip(id).unwrap();
        assert!(why.contains("private /dev/shm"), "{why}");
    }
    for id in [SectionId::Fresh, SectionId::Cached, SectionId::Ring] {
        assert_eq!(p.namespace_skip(id), None);
    }
    // no progress steps for the skipped sections
    let q = plan(&["--quick"]);
    assert_eq!(p.steps(), q.steps() - (1 + 4 + 2 * 2) - SYNC_STEPS);
    let p = plan(&["--only", "fresh,cached", "--consumer-namespaces", "user"]);
    assert_eq!(p.sections, vec![SectionId::Fresh, SectionId::Cached]);
}

#[test]
fn bad_consumer_namespaces_say_why() {
    let e = parse(&["--consumer-namespaces", "pid,net"]).unwrap_err();
    assert!(
        e.contains("\"net\" is not a namespace")
            && e.contains("choose from pid, ipc, mount, user, shm"),
        "{e}"
    );
    let e =
        Plan::from_args(&parse(&["--consumer-namespaces", "ipc,pid,ipc"]).unwrap()).unwrap_err();
    assert!(e.contains("--consumer-namespaces names ipc twice"), "{e}");
}

#[test]
fn names_are_case_insensitive() {
    let p = plan(&["--mechanisms", "VMM,Legacy,pool", "--only", "Fresh,FLOOR"]);
    assert_eq!(
        p.mechanisms,
        vec![Mechanism::Vmm, Mechanism::Legacy, Mechanism::Pool]
    );
    assert_eq!(p.sections, vec![SectionId::Fresh, SectionId::Floor]);
    let e = parse(&["--mechanisms", "Fabric"]).unwrap_err();
    assert!(e.contains("\"Fabric\" is not a mechanism"), "{e}");
}
