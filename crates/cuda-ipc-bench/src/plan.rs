//! The plan of a run: every count, size and section, decided from the
//! arguments before the GPU is touched.

use std::path::PathBuf;
use std::time::Duration;

use cuda_ipc::Mechanism;

use crate::args::Args;
use crate::namespaces::{ConsumerNamespaces, Namespace};
use crate::report::{SectionId, human};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// The tensors of the weight sets.
pub const SET_COUNTS: [u64; 3] = [100, 1000, 10_000];
/// Their total size in a full run.
pub const SET_TOTAL: u64 = 4 * GIB;
/// Their total size with `--quick`.
pub const SET_TOTAL_QUICK: u64 = 256 * MIB;

/// Warm-up and kept samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reps {
    /// Thrown away first.
    pub warmup: usize,
    /// Kept.
    pub reps: usize,
}

impl Reps {
    pub(crate) fn total(self) -> usize {
        self.warmup + self.reps
    }
}

/// Everything a run does, decided from the arguments before the GPU is touched.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    /// `--quick`.
    pub quick: bool,
    /// The mechanisms, in the order given.
    pub mechanisms: Vec<Mechanism>,
    /// The hand-off sizes, ascending.
    pub sizes: Vec<u64>,
    /// The sections to run, in order.
    pub sections: Vec<SectionId>,
    /// The sizes of the arena section: the hand-off sizes up to 1 GiB.
    pub arena_sizes: Vec<u64>,
    /// The weight sets of the sets section: (tensors, total bytes).
    pub sets: Vec<(u64, u64)>,
    /// Samples per weight-set measurement.
    pub set_reps: Reps,
    /// Fresh processes of the first attach of a model (sets section).
    pub first_attach: Reps,
    /// safetensors loads of the model, in the first kept processes.
    pub first_attach_loads: usize,
    /// Samples up to 1 GiB.
    pub reps_small: Reps,
    /// Samples above 1 GiB.
    pub reps_large: Reps,
    /// The size of the bandwidth copies.
    pub bandwidth_size: u64,
    /// Copies per kind.
    pub bandwidth_reps: Reps,
    /// Ring frame sizes and slot counts.
    pub ring: Vec<(u64, usize)>,
    /// How long the ring runs flat out per size.
    pub ring_load: Duration,
    /// Frames sent one at a time after that, for unloaded latency.
    pub ring_paced: usize,
    /// Consumer counts for the scale section.
    pub consumers: Vec<usize>,
    /// Entries published at once for the scale section.
    pub live_entries: usize,
    /// The scale section's buffer size.
    pub scale_size: u64,
    /// Samples per scale measurement.
    pub scale_reps: Reps,
    /// The PyTorch anchor's interpreter and script, unless skipped (then why).
    pub torch: Result<(String, Option<PathBuf>), String>,
    /// The device ordinal.
    pub device: usize,
    /// The second GPU's ordinal, for the peer section (`--devices A,B`).
    pub peer: Option<usize>,
    /// The namespaces every consumer runs in (`--consumer-namespaces`).
    pub namespaces: ConsumerNamespaces,
}

/// Why PyTorch's rows cannot run with consumers in other namespaces.
const TORCH_IN_NAMESPACES: &str = "PyTorch's consumers are its own torch.multiprocessing children, \
     which --consumer-namespaces cannot move into other namespaces";

/// The sections to run, in order.
fn pick_sections(args: &Args, peer: Option<usize>) -> Result<Vec<SectionId>, String> {
    if let Some(only) = &args.only
        && let Some(twice) = only
            .iter()
            .enumerate()
            .find_map(|(i, s)| only[..i].contains(s).then_some(s))
    {
        return Err(format!(
            "--only names {} twice; give each section once",
            twice.name()
        ));
    }
    let mut sections: Vec<SectionId> = match &args.only {
        Some(only) => SectionId::ALL
            .into_iter()
            .filter(|s| only.contains(s))
            .collect(),
        None => SectionId::ALL.to_vec(),
    };
    if peer.is_none() {
        if sections.contains(&SectionId::Peer) && args.only.is_some() {
            return Err(
                "the peer section needs two GPUs: add --devices A,B (for example 0,1)".into(),
            );
        }
        sections.retain(|s| *s != SectionId::Peer);
    }
    if args.no_torch {
        sections.retain(|s| *s != SectionId::Torch);
    }
    if sections.is_empty() {
        return Err("no section left to run (--only and --no-torch)".into());
    }
    Ok(sections)
}

/// The arena section's sizes: the hand-off sizes up to 1 GiB (`sizes` is
/// sorted and not empty). None is an error only when `--only` names the section.
fn pick_arena_sizes(args: &Args, sizes: &[u64]) -> Result<Vec<u64>, String> {
    let arena_sizes: Vec<u64> = sizes.iter().copied().filter(|s| *s <= GIB).collect();
    if arena_sizes.is_empty()
        && args
            .only
            .as_ref()
            .is_some_and(|o| o.contains(&SectionId::Arena))
    {
        return Err(format!(
            "the arena section measures sizes up to 1GiB and --sizes names none \
             (the smallest is {}); add one",
            human(sizes[0])
        ));
    }
    Ok(arena_sizes)
}

/// The producer's device and the peer section's, from `--device` and `--devices`.
fn pick_devices(args: &Args) -> Result<(usize, Option<usize>), String> {
    let Some(list) = &args.devices else {
        return Ok((args.device.unwrap_or(0), None));
    };
    let [a, b] = list[..] else {
        return Err(format!(
            "--devices takes two device ordinals, producer first (for example 0,1), not {}",
            list.len()
        ));
    };
    if a == b {
        return Err(format!(
            "--devices {a},{b}: the two GPUs must differ (for one GPU, use --device {a})"
        ));
    }
    if let Some(d) = args.device.filter(|d| *d != a) {
        return Err(format!(
            "--device {d} and --devices {a},{b} disagree: the producer's GPU is the first of \
             --devices; drop --device"
        ));
    }
    Ok((a, Some(b)))
}

/// The PyTorch anchor's interpreter and script, or why it does not run.
fn pick_torch(
    args: &Args,
    namespaces: &ConsumerNamespaces,
) -> Result<(String, Option<PathBuf>), String> {
    if args.no_torch {
        Err("--no-torch".to_string())
    } else if !namespaces.is_empty() {
        Err(TORCH_IN_NAMESPACES.to_string())
    } else {
        Ok((args.python.clone(), args.torch_script.clone()))
    }
}

/// The fresh processes of the first attach and the safetensors loads among
/// them; not `--reps`, as each sample is a new process (a few seconds).
fn first_attach_reps(quick: bool) -> (Reps, usize) {
    let reps = if quick { 5 } else { 10 };
    (Reps { warmup: 1, reps }, if quick { 3 } else { 5 })
}

impl Plan {
    /// The plan for `args`.
    pub fn from_args(args: &Args) -> Result<Plan, String> {
        let quick = args.quick;
        let mut mechanisms = Vec::new();
        for m in &args.mechanisms {
            if mechanisms.contains(m) {
                return Err(format!(
                    "--mechanisms names {m} twice; give each mechanism once"
                ));
            }
            mechanisms.push(*m);
        }
        if mechanisms.is_empty() {
            return Err("--mechanisms names no mechanism".into());
        }
        let mut sizes = args.sizes.clone().unwrap_or_else(|| {
            if quick {
                vec![2 * MIB, 64 * MIB]
            } else {
                vec![2 * MIB, 64 * MIB, GIB, 8 * GIB]
            }
        });
        sizes.sort_unstable();
        if let Some(twice) = sizes.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "--sizes names {} ({} bytes) twice; give each size once",
                human(twice[0]),
                twice[0]
            ));
        }
        if sizes.is_empty() {
            return Err("--sizes names no size".into());
        }
        let (device, peer) = pick_devices(args)?;
        let sections = pick_sections(args, peer)?;
        let pick = |default: Reps| Reps {
            warmup: args.warmup.unwrap_or(default.warmup),
            reps: args.reps.unwrap_or(default.reps),
        };
        let (small, large) = if quick {
            (
                Reps {
                    warmup: 5,
                    reps: 30,
                },
                Reps {
                    warmup: 2,
                    reps: 10,
                },
            )
        } else {
            (
                Reps {
                    warmup: 10,
                    reps: 100,
                },
                Reps {
                    warmup: 3,
                    reps: 20,
                },
            )
        };
        let namespaces = ConsumerNamespaces::new(&args.consumer_namespaces)?;
        let torch = pick_torch(args, &namespaces);
        let arena_sizes = pick_arena_sizes(args, &sizes)?;
        let set_total = if quick { SET_TOTAL_QUICK } else { SET_TOTAL };
        Ok(Plan {
            quick,
            mechanisms,
            sizes,
            sections,
            arena_sizes,
            sets: SET_COUNTS.iter().map(|n| (*n, set_total)).collect(),
            set_reps: pick(Reps {
                warmup: if quick { 2 } else { 3 },
                reps: if quick { 10 } else { 20 },
            }),
            first_attach: first_attach_reps(quick).0,
            first_attach_loads: first_attach_reps(quick).1,
            reps_small: pick(small),
            reps_large: pick(large),
            bandwidth_size: if quick { 256 * MIB } else { GIB },
            bandwidth_reps: Reps {
                warmup: 3,
                reps: if quick { 10 } else { 20 },
            },
            ring: vec![(4096, 64), (MIB, 32), (64 * MIB, 8)],
            ring_load: Duration::from_secs(if quick { 1 } else { 2 }),
            ring_paced: if quick { 100 } else { 300 },
            consumers: if quick { vec![1, 2] } else { vec![1, 2, 4, 8] },
            live_entries: if quick { 100 } else { 1000 },
            scale_size: 2 * MIB,
            scale_reps: pick(Reps {
                warmup: 5,
                reps: if quick { 30 } else { 50 },
            }),
            torch,
            device,
            peer,
            namespaces,
        })
    }

    /// Why section `id` cannot run with the consumers in [`Plan::namespaces`],
    /// if it cannot. With a private `/dev/shm` interprocess events cannot be
    /// opened: the driver floor opens one directly (the peer section's
    /// floor rows too), and the sync section has a consumer that waits on
    /// events only. Sections through the exchange fall back to fences.
    pub fn namespace_skip(&self, id: SectionId) -> Option<String> {
        let shm = self.namespaces.contains(Namespace::Shm);
        let why = match id {
            SectionId::Floor | SectionId::Peer if shm => {
                "the driver floor's consumer opens an interprocess event, which a private \
                 /dev/shm (--consumer-namespaces shm) cannot open"
            }
            SectionId::Sync if shm => {
                "its events consumer waits on interprocess events, which a private /dev/shm \
                 (--consumer-namespaces shm) cannot open"
            }
            _ => return None,
        };
        Some(why.to_string())
    }

    /// Warm-up and kept samples for a hand-off of `size` bytes.
    pub fn reps(&self, size: u64) -> Reps {
        if size > GIB {
            self.reps_large
        } else {
            self.reps_small
        }
    }

    /// How many progress steps the run has (one per row).
    pub(crate) fn steps(&self) -> u64 {
        let m = self.mechanisms.len() as u64;
        let s = self.sizes.len() as u64;
        let floors = self
            .mechanisms
            .iter()
            .filter(|m| matches!(m, Mechanism::Legacy | Mechanism::Vmm))
            .count() as u64;
        self.sections
            .iter()
            .filter(|id| self.namespace_skip(**id).is_none())
            .map(|id| match id {
                SectionId::Fresh | SectionId::Cached => m * s,
                SectionId::Arena => m * self.arena_sizes.len() as u64,
                // ours and its update per set, then the scripts of PyTorch,
                // ours from Python and the first attach
                SectionId::Sets => 2 * self.sets.len() as u64 + 3,
                SectionId::Floor => 1 + floors * s,
                SectionId::Bandwidth => m,
                SectionId::Peer => 2 * m * s + m + floors * s,
                SectionId::Ring => self.ring.len() as u64,
                SectionId::Sync => crate::sections::SYNC_STEPS,
                SectionId::Scale => self.consumers.len() as u64 + 1,
                SectionId::Torch => 1,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sections::SYNC_STEPS;
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
        // fresh, arena (sizes up to 1 GiB), cached, floor, bandwidth, ring,
        // sync, scale, sets (ours and its update per set, then PyTorch,
        // ours from Python and the first attach), torch
        assert_eq!(f.steps(), 12 + 9 + 12 + (1 + 8) + 3 + 3 + 10 + 5 + 9 + 1);
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
        let e =
            Plan::from_args(&parse(&["--only", "arena", "--sizes", "8GiB"]).unwrap()).unwrap_err();
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
        assert_eq!(p.steps(), q.steps() - (1 + 2 * 2) - SYNC_STEPS);
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
        let e = Plan::from_args(&parse(&["--consumer-namespaces", "ipc,pid,ipc"]).unwrap())
            .unwrap_err();
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
}
