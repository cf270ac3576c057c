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
//! fresh hand-off, fresh hand-off from an arena, cached hand-off, driver
//! floor, bandwidth through a mapping, across two GPUs (with `--devices
//! A,B`), streaming ring, events against fences, scale, weight sets,
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

use std::time::Instant;

use cuda_ipc::device::DeviceUuid;
use cuda_ipc::exchange::{Endpoint, Publisher, PublisherConfig};
use cuda_ipc::{Device, Error};

mod args;
mod first_attach;
pub mod idle;
pub mod lines;
pub mod mps;
pub mod namespaces;
mod plan;
mod plot;
mod progress;
mod proto;
mod report;
mod sections;
mod stats;
mod torch;
mod weights;
mod worker;

pub use args::Args;
pub use sections::{WAKE_PROBE_SAMPLES, WakeProbe, wake_probe};
pub use worker::{WorkerArgs, worker};

use plan::{Plan, Reps};
use progress::Progress;
use report::{DeviceInfo, PeerInfo, Report, Section, SectionId};

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
            // Every device's attributes, without a context on the peer.
            let mut devices = cuda_ipc::device::SystemInfo::query()?.devices;
            let count = devices.len();
            if peer >= count {
                return Err(cuda_ipc::Error::NoDevice {
                    ordinal: peer,
                    count,
                });
            }
            let other = devices.swap_remove(peer);
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

/// The report of a run of `plan`, before anything is measured.
fn new_report(plan: &Plan) -> Report {
    Report {
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
        consumer_namespaces: plan
            .namespaces
            .names()
            .into_iter()
            .map(str::to_string)
            .collect(),
        consumer_command: plan.namespaces.shown(),
        started_unix_s: unix_now(),
        elapsed_s: 0.0,
        sections: Vec::new(),
        mps: None,
        awake_us: lines::awake_spin().as_micros() as u64,
        idle: Some(idle::IdleStates::read()),
        targets: Vec::new(),
    }
}

/// Runs the benchmark: checks the arguments (an error of kind
/// `InvalidInput` before the driver is loaded), runs every section with
/// this process as the producer, prints the table on standard output and
/// writes `--json-out` and `--plot`. A failed section is an error (of kind
/// `Failed`) after everything is printed and written.
pub fn run(args: &Args, describe_link: DescribeLink<'_>) -> Result<(), Error> {
    // Everything that can be checked without a GPU is checked first: bad
    // input is exit 2 at once, not after the driver loads or the run ends.
    let plan = Plan::from_args(args)
        .and_then(|plan| args::check_paths(args).map(|()| plan))
        .and_then(|plan| args::check_mps(args).map(|()| plan))
        .and_then(|plan| {
            worker::parse_pad(std::env::var_os(worker::PAD_VAR).as_deref()).map(|_| plan)
        })
        .and_then(|plan| {
            lines::parse_awake(std::env::var_os(lines::AWAKE_VAR).as_deref()).map(|_| plan)
        })
        .map_err(|reason| Error::InvalidArgument {
            what: "bench arguments",
            reason,
        })?;
    // Consumers in new namespaces that cannot be started: exit 3 now.
    plan.namespaces.check_allowed()?;
    // The private MPS daemon before anything is measured: a missing
    // program is exit 3 at once. Dropping it (any return, a panic) stops it.
    let mut daemon = match (args.mps, &args.mps_pass) {
        (true, None) => Some(mps::PrivateDaemon::start()?),
        _ => None,
    };
    raise_open_files_limit();
    let started = Instant::now();
    let mut report = new_report(&plan);

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
    run_sections(&ctx, &mut report);
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
    if let Some(path) = &args.mps_pass {
        // The pass under MPS of a `--mps` run: its parent prints.
        report.mps = Some(report::MpsPass {
            pipe_directory: std::env::var(mps::PIPE_VAR).unwrap_or_default(),
            driver_says_mps: caps.mps,
            error: None,
        });
        return std::fs::write(path, report.to_json()).map_err(|e| Error::Io {
            context: format!("writing {}", path.display()),
            source: e,
        });
    }
    if let Some(d) = &mut daemon {
        report.mps = Some(mps_pass(d, &plan, &mut report.sections));
        if let Err(e) = d.stop()
            && let Some(m) = &mut report.mps
        {
            m.error
                .get_or_insert(format!("stopping the private MPS daemon: {e}"));
        }
    }
    report.elapsed_s = started.elapsed().as_secs_f64();
    report.evaluate();
    print!("{}", report::render(&report));
    write_outputs(&report, args)
}

/// Runs every section of the plan in this process, in order.
fn run_sections(ctx: &sections::Ctx<'_>, report: &mut Report) {
    let (plan, progress) = (ctx.plan, ctx.progress);
    for id in &plan.sections {
        if let Some(why) = plan.namespace_skip(*id) {
            progress.note(&format!("{} skipped: {why}", id.title()));
            report.sections.push(Section::skipped(*id, why));
            continue;
        }
        let t = Instant::now();
        // A bug in one section must not cost the others: a panic becomes
        // the section's error (its message is also on standard error).
        let run_section = || match id {
            SectionId::Fresh => sections::fresh(ctx),
            SectionId::Arena => sections::arena(ctx),
            SectionId::Push => sections::push(ctx),
            SectionId::Cached => sections::cached(ctx),
            SectionId::Floor => sections::floor(ctx),
            SectionId::Bandwidth => sections::bandwidth(ctx),
            SectionId::Peer => sections::peer(ctx),
            SectionId::Ring => sections::ring(ctx),
            SectionId::Sync => sections::sync(ctx),
            SectionId::Scale => sections::scale(ctx),
            SectionId::Sets => sections::sets(ctx),
            SectionId::Torch => torch::section(plan, progress),
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
}

/// The pass under MPS: this executable again, with the same arguments,
/// as a client of `daemon`; its sections are appended to `sections`,
/// marked, or failed sections saying why there are none.
fn mps_pass(
    daemon: &mps::PrivateDaemon,
    plan: &Plan,
    sections: &mut Vec<Section>,
) -> report::MpsPass {
    let mut pass = report::MpsPass {
        pipe_directory: daemon.pipe_directory().display().to_string(),
        driver_says_mps: None,
        error: None,
    };
    eprintln!(
        "bench: the same sections again under a private MPS control daemon ({})",
        pass.pipe_directory
    );
    let out = daemon.folder().join("pass.json");
    let ran = std::env::current_exe()
        .map_err(|e| format!("finding our own executable: {e}"))
        .and_then(|exe| {
            daemon
                .command(exe)
                .args(std::env::args_os().skip(1))
                .arg("--mps-pass")
                .arg(&out)
                .stdin(std::process::Stdio::null())
                .status()
                .map_err(|e| format!("starting it: {e}"))
        })
        .and_then(|status| {
            let text = std::fs::read_to_string(&out).map_err(|_| {
                format!("it exited with {status} before writing its report (its error is above)")
            })?;
            serde_json::from_str::<Report>(&text).map_err(|e| format!("its report: {e}"))
        });
    match ran {
        Ok(under) => {
            pass.driver_says_mps = under.mps.and_then(|m| m.driver_says_mps);
            if pass.driver_says_mps == Some(false) {
                pass.error = Some(
                    "the driver says the pass's processes did not go through MPS: its rows are \
                     not MPS figures"
                        .into(),
                );
            }
            for mut s in under.sections {
                if plan.sections.contains(&s.id) {
                    s.mps = true;
                    sections.push(s);
                }
            }
        }
        Err(why) => {
            let why = format!("the pass under MPS failed: {why}");
            for id in &plan.sections {
                let mut s = Section::new(*id);
                s.mps = true;
                s.error = Some(why.clone());
                s.finish();
                sections.push(s);
            }
            pass.error = Some(why);
        }
    }
    pass
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
