//! `cuda-ipc bench`: hand-off latency and bandwidth against the driver's
//! floor and PyTorch, in one run.
//!
//! This process is the producer. Each section starts its consumer
//! processes once (this executable's hidden `__bench-worker` subcommand)
//! and talks to them in JSON lines over their standard input and output;
//! the buffers themselves travel over the library's channel (a
//! [`Publisher`]) or, for the driver floor, by raw driver calls. Latencies
//! are one way: a CLOCK_MONOTONIC reading in the producer before the call
//! and one in the consumer after its wait completed (the clock is shared by
//! every process of one machine).
//!
//! Sections (see `docs/PERFORMANCE.md` for what each number includes):
//! fresh hand-off, cached hand-off, driver floor, bandwidth through a
//! mapping, across two GPUs (with `--devices A,B`), streaming ring, scale,
//! PyTorch anchor. A failing section is
//! reported in the table and the others still run; the exit code is then 4.
//!
//! This crate is a library so that the `cuda-ipc` command stays one
//! executable: its `bench` subcommand parses [`Args`] and calls [`run`], and
//! its hidden `__bench-worker` subcommand parses [`WorkerArgs`] and calls
//! [`worker`]. The driver floor it measures against is the library's
//! [`cuda_ipc::floor`]; this crate has no `unsafe` and makes no driver call
//! of its own.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cuda_ipc::device::DeviceUuid;
use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig};
use cuda_ipc::{Device, Error, Mechanism};

mod plot;
mod proto;
mod report;
mod sections;
mod stats;
mod torch;
mod worker;

pub use worker::{WorkerArgs, worker};

use report::{DeviceInfo, PeerInfo, Report, Section, SectionId};

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A short run (under 2 minutes on an H200): sizes 2MiB and 64MiB,
    /// about 30 samples each, 1 s per ring size, 1 and 2 consumers.
    #[arg(long)]
    pub quick: bool,
    /// Mechanisms to measure, comma-separated (legacy, vmm, pool).
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_mechanism,
        default_value = "legacy,vmm,pool"
    )]
    pub mechanisms: Vec<Mechanism>,
    /// Hand-off sizes, comma-separated, with units (default: 2MiB,64MiB
    /// with --quick, else 2MiB,64MiB,1GiB,8GiB).
    #[arg(long, value_delimiter = ',', value_parser = parse_size)]
    pub sizes: Option<Vec<u64>>,
    /// Device ordinal (default 0): the producer's and the consumers' GPU.
    #[arg(long)]
    pub device: Option<usize>,
    /// Two device ordinals, producer first (for example 0,1): also measure
    /// hand-offs to a consumer on the second GPU and copies between the two
    /// (the peer section). The other sections run on the first.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<usize>>,
    /// Skip the PyTorch anchor.
    #[arg(long)]
    pub no_torch: bool,
    /// The Python interpreter for the PyTorch anchor.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// The PyTorch anchor script (default: bench/torch_share.py next to
    /// this executable, in its parent folder, or in the source tree).
    #[arg(long)]
    pub torch_script: Option<PathBuf>,
    /// Write every measurement, raw samples included, as JSON to this file.
    #[arg(long)]
    pub json_out: Option<PathBuf>,
    /// Draw hand-off latency against size (log-log) as SVG to this file.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Run only these sections, comma-separated (fresh, cached, floor,
    /// bandwidth, peer, ring, scale, torch).
    #[arg(long, value_delimiter = ',', value_parser = SectionId::parse)]
    pub only: Option<Vec<SectionId>>,
    /// Samples kept per measurement (overrides the defaults: 30 quick, 100
    /// full, fewer above 1 GiB).
    #[arg(long)]
    pub reps: Option<usize>,
    /// Warm-up samples thrown away per measurement (default: 5 quick, 10 full).
    #[arg(long)]
    pub warmup: Option<usize>,
}

/// Parses a mechanism the bench measures.
fn parse_mechanism(s: &str) -> Result<Mechanism, String> {
    match s.trim() {
        "legacy" => Ok(Mechanism::Legacy),
        "vmm" => Ok(Mechanism::Vmm),
        "pool" => Ok(Mechanism::Pool),
        other => Err(format!(
            "{other:?} is not a mechanism the bench measures; choose from legacy, vmm, pool"
        )),
    }
}

/// Parses a hand-off size: at least 4 KiB, a multiple of 4 bytes.
fn parse_size(s: &str) -> Result<u64, String> {
    let n = s
        .trim()
        .parse::<cuda_ipc::units::ByteSize>()
        .map_err(|e| e.to_string())?
        .0;
    if n < 4096 || !n.is_multiple_of(4) {
        return Err(format!(
            "{s:?} ({n} bytes): a hand-off size must be at least 4KiB and a multiple of 4 bytes \
             (the buffers hold 32-bit values)"
        ));
    }
    Ok(n)
}

/// Warm-up and kept samples.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reps {
    /// Thrown away first.
    pub warmup: usize,
    /// Kept.
    pub reps: usize,
}

impl Reps {
    fn total(self) -> usize {
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
}

/// The sections to run, in order.
fn pick_sections(args: &Args, peer: Option<usize>) -> Result<Vec<SectionId>, String> {
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

impl Plan {
    /// The plan for `args`.
    pub fn from_args(args: &Args) -> Result<Plan, String> {
        let quick = args.quick;
        let mut mechanisms = Vec::new();
        for m in &args.mechanisms {
            if !mechanisms.contains(m) {
                mechanisms.push(*m);
            }
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
        sizes.dedup();
        if sizes.is_empty() {
            return Err("--sizes names no size".into());
        }
        let (device, peer) = pick_devices(args)?;
        let sections = pick_sections(args, peer)?;
        let pick = |default: Reps| Reps {
            warmup: args.warmup.unwrap_or(default.warmup),
            reps: args.reps.unwrap_or(default.reps).max(1),
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
        let torch = if args.no_torch {
            Err("--no-torch".to_string())
        } else {
            Ok((args.python.clone(), args.torch_script.clone()))
        };
        Ok(Plan {
            quick,
            mechanisms,
            sizes,
            sections,
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
        })
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
    fn steps(&self) -> u64 {
        let m = self.mechanisms.len() as u64;
        let s = self.sizes.len() as u64;
        let floors = self
            .mechanisms
            .iter()
            .filter(|m| matches!(m, Mechanism::Legacy | Mechanism::Vmm))
            .count() as u64;
        self.sections
            .iter()
            .map(|id| match id {
                SectionId::Fresh | SectionId::Cached => m * s,
                SectionId::Floor => 1 + floors * s,
                SectionId::Bandwidth => m,
                SectionId::Peer => 2 * m * s + m + floors * s,
                SectionId::Ring => self.ring.len() as u64,
                SectionId::Scale => self.consumers.len() as u64 + 1,
                SectionId::Torch => 1,
            })
            .sum()
    }
}

/// A progress bar on standard error; where standard error is not a
/// terminal, one line per step instead.
pub struct Progress {
    bar: indicatif::ProgressBar,
    started: Instant,
}

impl Progress {
    fn new(steps: u64) -> Progress {
        let bar = indicatif::ProgressBar::with_draw_target(
            Some(steps),
            indicatif::ProgressDrawTarget::stderr(),
        );
        if let Ok(style) = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30}] {pos}/{len} {msg}",
        ) {
            bar.set_style(style.progress_chars("=> "));
        }
        Progress {
            bar,
            started: Instant::now(),
        }
    }

    /// Starts a step.
    pub fn step(&self, what: &str) {
        if self.bar.is_hidden() {
            eprintln!(
                "bench [{:6.1} s] {what}",
                self.started.elapsed().as_secs_f64()
            );
        } else {
            self.bar.set_message(what.to_string());
        }
    }

    /// Ends a step.
    pub fn done(&self) {
        self.bar.inc(1);
    }

    /// A line that stays (a warning).
    pub fn note(&self, text: &str) {
        if self.bar.is_hidden() {
            eprintln!("bench: {text}");
        } else {
            self.bar.println(text);
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

/// Raises the soft limit on open files to the hard limit: a producer with
/// a thousand published VMM buffers holds a thousand file descriptors.
pub fn raise_open_files_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let l = getrlimit(Resource::Nofile);
    if l.current < l.maximum {
        let _ = setrlimit(
            Resource::Nofile,
            rustix::process::Rlimit {
                current: l.maximum,
                maximum: l.maximum,
            },
        );
    }
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// How the caller names the link between two GPUs (NVLink, PCIe, ...), for
/// the peer section's header; the `cuda-ipc` command asks NVML.
pub type DescribeLink<'a> = &'a dyn Fn(DeviceUuid, DeviceUuid) -> String;

/// The producer's device and, with `--devices`, the second one and the
/// link between them (a second GPU that is not there: exit 3, like the first).
fn describe_devices(
    plan: &Plan,
    caps: &cuda_ipc::device::Capabilities,
    driver: &str,
    describe_link: DescribeLink<'_>,
) -> Result<(DeviceInfo, Option<PeerInfo>), Error> {
    let info = |c: &cuda_ipc::device::Capabilities| DeviceInfo {
        ordinal: c.ordinal,
        name: c.name.clone(),
        uuid: c.uuid.to_string(),
        driver: driver.to_string(),
    };
    let peer = match plan.peer {
        Some(peer) => {
            let other = cuda_ipc::device::Capabilities::query(peer)?;
            Some(PeerInfo {
                device: info(&other),
                link: describe_link(caps.uuid, other.uuid),
                // The consumer, on `peer`, maps the producer's memory.
                access_supported: cuda_ipc::device::peer_link(peer, plan.device)?.access_supported,
            })
        }
        None => None,
    };
    Ok((info(caps), peer))
}

/// Runs the benchmark: checks the arguments (an error of kind
/// `InvalidInput` before the driver is loaded), runs every section with
/// this process as the producer, prints the table on standard output and
/// writes `--json-out` and `--plot`. A failed section is an error (of kind
/// `Failed`) after everything is printed and written.
pub fn run(args: &Args, describe_link: DescribeLink<'_>) -> Result<(), Error> {
    let plan = Plan::from_args(args).map_err(|reason| Error::InvalidArgument {
        what: "bench arguments",
        reason,
    })?;
    raise_open_files_limit();
    let started = Instant::now();
    let mut report = Report {
        schema: 1,
        tool: format!("cuda-ipc bench {}", env!("CARGO_PKG_VERSION")),
        command: std::env::args().collect(),
        quick: plan.quick,
        device: None,
        peer: None,
        mechanisms: plan
            .mechanisms
            .iter()
            .map(|m| m.name().to_string())
            .collect(),
        sizes: plan.sizes.clone(),
        started_unix_s: unix_now(),
        elapsed_s: 0.0,
        sections: Vec::new(),
        targets: Vec::new(),
    };

    // No driver or no device: exit 3 before anything else.
    let device = Device::open(plan.device)?;
    let caps = device.capabilities()?;
    let driver = cuda_ipc::driver::load()?;
    let (info, peer) = describe_devices(&plan, &caps, &driver.to_string(), describe_link)?;
    report.device = Some(info);
    report.peer = peer;
    let publisher = Publisher::bind(
        &device,
        Endpoint::Name(format!("bench-{}", std::process::id())),
        PublisherConfig::default(),
    )
    .map_err(|e| proto::failure("bench: starting the publisher (the channel socket)", e))?;
    let progress = Progress::new(plan.steps());
    let ctx = sections::Ctx {
        device: &device,
        caps: &caps,
        plan: &plan,
        publisher: &publisher,
        progress: &progress,
        peer: report.peer.clone(),
    };
    for id in &plan.sections {
        let t = Instant::now();
        // A bug in one section must not cost the others: a panic becomes
        // the section's error (its message is also on standard error).
        let run_section = || match id {
            SectionId::Fresh => sections::fresh(&ctx),
            SectionId::Cached => sections::cached(&ctx),
            SectionId::Floor => sections::floor(&ctx),
            SectionId::Bandwidth => sections::bandwidth(&ctx),
            SectionId::Peer => sections::peer(&ctx),
            SectionId::Ring => sections::ring(&ctx),
            SectionId::Scale => sections::scale(&ctx),
            SectionId::Torch => torch::section(&plan, &progress),
        };
        let mut section = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run_section))
            .unwrap_or_else(|panic| {
                let why = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_string()))
                    .unwrap_or_else(|| "unknown".into());
                let mut s = Section::new(*id);
                s.error = Some(format!("the bench panicked (a bug): {why}"));
                s
            });
        section.seconds = t.elapsed().as_secs_f64();
        section.finish();
        if let Some(why) = &section.reason
            && section.failed()
        {
            progress.note(&format!("{} FAILED: {why}", id.title()));
        }
        report.sections.push(section);
    }
    if args.no_torch
        && args
            .only
            .as_ref()
            .is_none_or(|o| o.contains(&SectionId::Torch))
    {
        report
            .sections
            .push(Section::skipped(SectionId::Torch, "--no-torch"));
    }
    progress.finish();
    drop(publisher);
    report.elapsed_s = started.elapsed().as_secs_f64();
    report.evaluate();
    print!("{}", report::render(&report));
    write_outputs(&report, args)
}

/// Writes the JSON and the plot if asked, and turns failed sections into
/// the run's error (exit code 4) after everything is printed.
fn write_outputs(report: &Report, args: &Args) -> Result<(), Error> {
    let mut problems = Vec::new();
    if let Some(path) = &args.json_out {
        if let Err(e) = std::fs::write(path, report.to_json()) {
            problems.push(format!("writing {}: {e}", path.display()));
        } else {
            println!("measurements written to {}", path.display());
        }
    }
    if let Some(path) = &args.plot {
        match plot::write(report, path) {
            Ok(()) => println!("plot written to {}", path.display()),
            Err(e) => problems.push(e),
        }
    }
    let failed = report.failed_sections();
    if !failed.is_empty() {
        problems.insert(
            0,
            format!(
                "{} section(s) failed: {} (see the table above)",
                failed.len(),
                failed.join(", ")
            ),
        );
    }
    if problems.is_empty() {
        Ok(())
    } else {
        // A run-time failure: exit code 4.
        Err(Error::Io {
            context: "bench".into(),
            source: std::io::Error::other(problems.join("; ")),
        })
    }
}

#[cfg(test)]
mod tests {
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
        let p = plan(&["--sizes", "64MiB,2MiB,1GiB,2MiB"]);
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
        assert_eq!(f.steps(), 12 + 12 + (1 + 8) + 3 + 3 + 5 + 1);
    }

    #[test]
    fn options_override_the_plan() {
        let p = plan(&[
            "--quick",
            "--mechanisms",
            "vmm,legacy,vmm",
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
                .contains("invalid digit")
        );
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
}
