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

// The sync section's runs, counted in the plan's progress steps.
/// Frames per synchronize in the batched rows.
pub const SYNC_BATCH: u64 = 8;
/// The ways a consumer waits, as `SyncMode` names.
pub const MODES: [&str; 3] = ["event", "fence", "host-fence"];
/// The ring runs: sync mode and frames per synchronize.
pub const RING_RUNS: [(&str, u64); 5] = [
    ("event", 1),
    ("fence", 1),
    ("event", SYNC_BATCH),
    ("fence", SYNC_BATCH),
    ("host-fence", 1),
];
/// Progress steps: the cached rows, the ring runs, the two floors.
pub const SYNC_STEPS: u64 = MODES.len() as u64 + RING_RUNS.len() as u64 + 2;

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

/// The push section's block sizes: KV blocks of 16 to 256 KiB, and of 2
/// and 64 MiB.
pub const PUSH_SIZES: [u64; 4] = [16 << 10, 256 << 10, 2 << 20, 64 << 20];
/// The push section's rows per size: pushed asleep, pushed spinning, pulled.
pub const PUSH_MODES: u64 = 3;

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
                SectionId::Push => PUSH_MODES * PUSH_SIZES.len() as u64,
                // ours and its update per set, then the scripts of PyTorch,
                // ours from Python and the first attach
                SectionId::Sets => 2 * self.sets.len() as u64 + 3,
                SectionId::Floor => 1 + crate::report::WAKE_ROWS + floors * s,
                SectionId::Bandwidth => m,
                SectionId::Peer => 2 * m * s + m + floors * s,
                SectionId::Ring => self.ring.len() as u64,
                SectionId::Sync => SYNC_STEPS,
                SectionId::Scale => self.consumers.len() as u64 + 1,
                SectionId::Torch => 1,
            })
            .sum()
    }
}

#[cfg(test)]
mod tests;
