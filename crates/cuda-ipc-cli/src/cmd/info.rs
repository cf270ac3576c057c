//! `cuda-ipc info`: the driver, the devices, which sharing mechanisms the
//! driver claims and which actually work (tried between two processes), and
//! what in this environment gets in the way, with the fix.

use std::process::Stdio;
use std::time::{Duration, Instant};

use cuda_ipc::device::{Capabilities, ComputeMode, SystemInfo};
use cuda_ipc::kernels::{self, Pattern, Speed};
use cuda_ipc::share::{self, SharedBuffer};
use cuda_ipc::{Descriptor, Device, DeviceMemory, Dtype, Error, Mechanism};
use serde_json::{Value, json};

use crate::Outcome;
use crate::out::outln;
use cuda_ipc_bench::lines::{self, LineReader};

/// Arguments of `info`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// Print one JSON document instead of text.
    #[arg(long)]
    pub json: bool,
    /// Only read attributes; do not try the mechanisms between two processes.
    #[arg(long)]
    pub no_probe: bool,
}

/// Arguments of the hidden probe child.
#[derive(clap::Args, Debug)]
pub struct ProbeOpenArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
}

const PROBE_BYTES: u64 = 2 << 20;
const PROBE_PATTERN: Pattern = Pattern::ramp(0x1234_5678, 1);

pub fn run(args: &Args) -> Result<Outcome, Error> {
    let env = environment();
    let system = match SystemInfo::query() {
        Ok(s) => s,
        Err(e) => {
            if args.json {
                outln!("{}", json!({ "error": e.to_string(), "environment": env }))?;
            } else {
                // The error itself is printed once, on standard error, by main.
                outln!("CUDA driver: not usable (the error follows on standard error)")?;
                print_environment(&env)?;
            }
            return Err(e);
        }
    };
    let mut devices = Vec::new();
    for caps in &system.devices {
        let probes = if args.no_probe {
            Value::Null
        } else {
            probe_device(caps)
        };
        devices.push((caps, probes));
    }
    let peers = peer_links(&system.devices);
    if args.json {
        let list: Vec<Value> = devices
            .iter()
            .map(|(caps, probes)| {
                let mut v = serde_json::to_value(caps).unwrap_or(Value::Null);
                v["probes"] = probes.clone();
                v["advice"] = json!(device_advice(caps));
                v
            })
            .collect();
        outln!(
            "{}",
            json!({ "driver_version": system.driver_version.to_string(), "devices": list, "peers": peers, "environment": env })
        )?;
    } else {
        outln!(
            "CUDA driver: {} (libcuda.so.1 loaded)",
            system.driver_version
        )?;
        if devices.is_empty() {
            outln!("  no devices")?;
        }
        for (caps, probes) in &devices {
            print_device(caps, probes)?;
        }
        for p in &peers {
            let link = p["link_text"].as_str().unwrap_or("?");
            if let Some(e) = p["error"].as_str() {
                outln!("peer {} -> {}: {link}; {e}", p["from"], p["to"])?;
                continue;
            }
            outln!(
                "peer {} -> {}: {link}; peer access {}, native atomics {}, performance rank {}",
                p["from"],
                p["to"],
                yes(p["access_supported"] == true),
                yes(p["native_atomics"] == true),
                p["performance_rank"]
            )?;
        }
        print_environment(&env)?;
    }
    Ok(Outcome::Ok)
}

fn yes(b: bool) -> &'static str {
    if b { "yes" } else { "no" }
}

fn print_device(caps: &Capabilities, probes: &Value) -> Result<(), Error> {
    outln!(
        "device {}: {}  {}  PCI {}  compute capability {}.{}  {}  compute mode {:?}",
        caps.ordinal,
        caps.name,
        caps.uuid,
        caps.pci_bus_id,
        caps.compute_capability.0,
        caps.compute_capability.1,
        super::human(caps.total_memory),
        caps.compute_mode
    )?;
    let rows = [
        (Mechanism::Legacy, "legacy IPC handles", caps.legacy_ipc),
        (
            Mechanism::Vmm,
            "VMM file descriptors",
            caps.vmm && caps.posix_fd,
        ),
        (
            Mechanism::Pool,
            "memory pools (fd)",
            caps.memory_pools && caps.mempool_handle_types & 1 != 0,
        ),
        (Mechanism::Fabric, "fabric handles", caps.fabric),
    ];
    outln!(
        "  {:<22} {:<8} tried between two processes",
        "mechanism",
        "claimed"
    )?;
    for (m, label, claimed) in rows {
        let tried = match probes.get(m.name()) {
            None => "not tried".to_string(),
            Some(p) if p["works"] == true => format!(
                "works (export {:.3} ms, open in another process {:.3} ms, data checked)",
                p["export_ms"].as_f64().unwrap_or(f64::NAN),
                p["open_ms"].as_f64().unwrap_or(f64::NAN)
            ),
            Some(p) => format!("fails: {}", p["error"].as_str().unwrap_or("?")),
        };
        outln!("  {label:<22} {:<8} {tried}", yes(claimed))?;
    }
    outln!(
        "  unified addressing {}, IPC events {}, VMM {}, memory pools {}",
        yes(caps.unified_addressing),
        yes(caps.ipc_events),
        yes(caps.vmm),
        yes(caps.memory_pools)
    )?;
    match caps.mps {
        Some(true) => outln!(
            "  MPS: this process's contexts on this device go through an MPS server (the driver says so)"
        )?,
        Some(false) => outln!("  MPS: not in use for this process (the driver says so)")?,
        None => {}
    }
    for advice in device_advice(caps) {
        outln!("  note: {advice}")?;
    }
    Ok(())
}

/// How every ordered pair of devices reaches the other (legacy opens with
/// `LAZY_ENABLE_PEER_ACCESS` and VMM access descriptors need peer access),
/// and what the link is (NVLink or PCIe, from NVML).
fn peer_links(devices: &[Capabilities]) -> Vec<Value> {
    let mut out = Vec::new();
    if devices.len() < 2 {
        return out;
    }
    let topology = crate::link::Topology::open();
    for a in devices {
        for b in devices.iter().filter(|b| b.ordinal != a.ordinal) {
            let link = match &topology {
                Ok(t) => t.between(a.uuid, b.uuid),
                Err(why) => crate::link::Link::Unknown { why: why.clone() },
            };
            let (from, to) = (a.ordinal, b.ordinal);
            let mut v =
                json!({ "from": from, "to": to, "link": link, "link_text": link.to_string() });
            match cuda_ipc::device::peer_link(from, to) {
                Ok(l) => {
                    v["access_supported"] = l.access_supported.into();
                    v["native_atomics"] = l.native_atomics.into();
                    v["performance_rank"] = l.performance_rank.into();
                }
                Err(e) => v["error"] = e.to_string().into(),
            }
            out.push(v);
        }
    }
    out
}

fn device_advice(caps: &Capabilities) -> Vec<String> {
    let mut out = Vec::new();
    match caps.compute_mode {
        ComputeMode::Default => {}
        ComputeMode::ExclusiveProcess => out.push(
            "exclusive-process compute mode: only one process may use this GPU, so a consumer cannot map the producer's \
             memory. An administrator can run `nvidia-smi -i N -c DEFAULT`."
                .into(),
        ),
        ComputeMode::Prohibited => out.push(
            "prohibited compute mode: no process may use this GPU. An administrator can run `nvidia-smi -i N -c DEFAULT`."
                .into(),
        ),
        ComputeMode::Other(v) => out.push(format!("unknown compute mode {v}")),
    }
    if !caps.unified_addressing {
        out.push("no unified addressing: legacy IPC is impossible on this device".into());
    }
    out
}

/// Exports a small buffer with every mechanism and has a child process open
/// and check each one. Returns `{mechanism: {works, export_ms, open_ms, error}}`.
fn probe_device(caps: &Capabilities) -> Value {
    let mut results = serde_json::Map::new();
    let device = match Device::open(caps.ordinal) {
        Ok(d) => d,
        Err(e) => {
            for m in Mechanism::ALL {
                results.insert(
                    m.name().into(),
                    json!({ "works": false, "error": e.to_string() }),
                );
            }
            return Value::Object(results);
        }
    };
    let mut exports = Vec::new();
    for m in [
        Mechanism::Legacy,
        Mechanism::Vmm,
        Mechanism::Pool,
        Mechanism::Fabric,
    ] {
        let started = Instant::now();
        match export_probe(&device, m) {
            Ok((buffer, export)) => {
                let ms = super::ms_since(started);
                exports.push((m, ms, buffer, export));
            }
            Err(e) => {
                results.insert(
                    m.name().into(),
                    json!({ "works": false, "error": e.to_string() }),
                );
            }
        }
    }
    let descriptors: Vec<&Descriptor> = exports.iter().map(|(_, _, _, e)| &e.descriptor).collect();
    let answers = open_in_child(caps.ordinal, &descriptors);
    for ((m, export_ms, _, _), answer) in exports.iter().zip(answers) {
        let entry = match answer {
            Ok(v) if v["ok"] == true => {
                json!({ "works": true, "export_ms": export_ms, "open_ms": v["open_ms"] })
            }
            Ok(v) => json!({ "works": false, "error": v["error"] }),
            Err(e) => json!({ "works": false, "error": e.to_string() }),
        };
        results.insert(m.name().into(), entry);
    }
    Value::Object(results)
}

fn export_probe(device: &Device, m: Mechanism) -> Result<(SharedBuffer, share::Export), Error> {
    let buffer = SharedBuffer::alloc(device, PROBE_BYTES as usize, Some(m))?;
    kernels::fill_u32(&buffer, PROBE_PATTERN, Speed::Full)?;
    buffer.synchronize()?;
    let export = buffer.export_region(0, PROBE_BYTES, Dtype::U32, None)?;
    Ok((buffer, export))
}

/// Starts `cuda-ipc __probe-open`, sends it each descriptor and collects one
/// answer per descriptor (in order).
fn open_in_child(device: usize, descriptors: &[&Descriptor]) -> Vec<Result<Value, Error>> {
    let fail = |e: Error| {
        let text = e.to_string();
        descriptors
            .iter()
            .map(|_| {
                Err(Error::InvalidArgument {
                    what: "probe",
                    reason: text.clone(),
                })
            })
            .collect()
    };
    let device_arg = device.to_string();
    let mut child = match super::spawn_self(
        "probe",
        &["__probe-open", "--device", &device_arg],
        Stdio::piped(),
    ) {
        Ok(c) => c,
        Err(e) => return fail(e),
    };
    // The child fetches fd exports from us with pidfd_getfd: it alone may,
    // until it is done (if this fails, its answers say why it could not).
    let fetcher = share::allow_fd_fetching_by(child.id());
    let mut stdin = child.stdin.take().expect("piped");
    let reader = LineReader::new(child.stdout.take().expect("piped"), "probe process");
    let mut answers = Vec::new();
    for d in descriptors {
        let r = lines::send(&mut stdin, &d.to_value())
            .and_then(|()| reader.next(Duration::from_secs(60)));
        answers.push(r);
    }
    drop(stdin);
    let _ = child.wait();
    drop(fetcher);
    answers
}

/// The probe child: opens each descriptor from stdin, checks the pattern,
/// answers one JSON line each.
pub fn probe_open(args: &ProbeOpenArgs) -> Result<Outcome, Error> {
    let device = Device::open(args.device)?;
    let mut stdin = std::io::stdin().lock();
    loop {
        let line = match lines::read_line(&mut stdin, super::open::MAX_DESCRIPTOR_LINE) {
            Ok(Some(line)) => line,
            Ok(None) => break,
            Err(e) => {
                return Err(Error::Io {
                    context: "reading a probe descriptor".into(),
                    source: e.into(),
                });
            }
        };
        let answer = (|| -> Result<Value, Error> {
            let d = Descriptor::from_json(&line)?;
            let started = Instant::now();
            let buffer = share::open::<u32>(&device, &d, Vec::new())?;
            let open_ms = super::ms_since(started);
            match kernels::check_u32(&buffer, PROBE_PATTERN)? {
                None => Ok(json!({ "ok": true, "open_ms": open_ms })),
                Some(i) => Ok(
                    json!({ "ok": false, "error": format!("opened, but word {i} differs from what the exporter wrote") }),
                ),
            }
        })();
        let v = answer.unwrap_or_else(|e| json!({ "ok": false, "error": e.to_string() }));
        outln!("{v}")?;
    }
    Ok(Outcome::Ok)
}

/// The idle time before each notice of the wake-up probe (about 50 ms in
/// all).
const WAKE_IDLE: std::time::Duration = std::time::Duration::from_millis(1);

/// What in this environment affects sharing, each with its consequence.
fn environment() -> Value {
    let read = |p: &str| {
        std::fs::read_to_string(p)
            .ok()
            .map(|s| s.trim().to_string())
    };
    let mut notes: Vec<String> = Vec::new();
    let os_release = read("/proc/sys/kernel/osrelease").unwrap_or_default();
    let wsl = os_release.to_lowercase().contains("microsoft") || os_release.contains("WSL");
    if wsl {
        notes.push("running under WSL: CUDA IPC (legacy handles, VMM and pool file descriptors) is not supported there".into());
    }
    let ptrace_scope =
        read("/proc/sys/kernel/yama/ptrace_scope").and_then(|s| s.parse::<u32>().ok());
    notes.push(match ptrace_scope {
        None | Some(0) => "pidfd_getfd (used by `open` for vmm/pool descriptors) works between processes of the same user".into(),
        Some(1) => "kernel.yama.ptrace_scope=1: pidfd_getfd works from an ancestor, or when the exporter allows it (`cuda-ipc export` does); otherwise pass descriptors over the channel".into(),
        Some(2) => "kernel.yama.ptrace_scope=2: pidfd_getfd needs CAP_SYS_PTRACE; pass file descriptors over the channel (serve/attach)".into(),
        Some(n) => format!("kernel.yama.ptrace_scope={n}: pidfd_getfd is disabled; pass file descriptors over the channel (serve/attach)"),
    });
    let hints = cuda_ipc::container::ContainerHints::read();
    let container_reasons = hints.reasons();
    let container = !container_reasons.is_empty();
    let pidfd_getfd = cuda_ipc::container::pidfd_getfd_allowed();
    if let Err(why) = &pidfd_getfd {
        notes.push(format!(
            "pidfd_getfd is not allowed here ({why}): `open --descriptor` of vmm and pool exports \
             cannot fetch the exporter's descriptors; pass them over the channel (serve/attach)"
        ));
    }
    let namespaces = cuda_ipc::container::namespaces();
    let own: Vec<&str> = namespaces
        .iter()
        .filter(|n| n.differs == Some(true))
        .map(|n| n.kind)
        .collect();
    if container || own.contains(&"pid") {
        notes.push(
            "this looks like a container: processes in other containers live in other PID namespaces, so a \
             descriptor's pid does not name them and pidfd_getfd cannot reach them; share a Unix socket directory \
             and use the channel (serve/attach), which carries the file descriptors itself (vmm and pool work \
             without hostPID, hostIPC or ptrace rights)"
                .into(),
        );
    }
    if own.contains(&"mnt") || container {
        notes.push(
            "interprocess events need the exporter's /dev/shm: with a /dev/shm of its own a consumer cannot open \
             them (CUDA_ERROR_MAP_FAILED) and synchronises with GPU-side fences instead"
                .into(),
        );
    }
    let mps = cuda_ipc_bench::mps::detect();
    let wake = match cuda_ipc_bench::wake_probe(WAKE_IDLE, cuda_ipc_bench::WAKE_PROBE_SAMPLES) {
        Ok(p) => json!(p),
        Err(e) => json!({ "error": e.to_string() }),
    };
    let idle = cuda_ipc_bench::idle::IdleStates::read();
    json!({
        "mps": mps,
        "mps_text": mps.describe(),
        "wake": wake,
        "idle_text": idle.describe(),
        "idle": idle,
        "uid": rustix::process::getuid().as_raw(),
        "pid": std::process::id(),
        "wsl": wsl,
        "container": container,
        "container_reasons": container_reasons,
        "pidfd_getfd": match &pidfd_getfd {
            Ok(()) => json!({ "allowed": true }),
            Err(why) => json!({ "allowed": false, "why": why }),
        },
        "namespaces": namespaces,
        "namespaces_not_initial": own,
        "ptrace_scope": ptrace_scope,
        "notes": notes,
    })
}

fn print_environment(env: &Value) -> Result<(), Error> {
    outln!("environment:")?;
    let allowed = env["pidfd_getfd"]["allowed"] == true;
    outln!(
        "  pidfd_getfd allowed here: {}{}",
        yes(allowed),
        env["pidfd_getfd"]["why"]
            .as_str()
            .map(|w| format!(" ({w})"))
            .unwrap_or_default()
    )?;
    let reasons: Vec<&str> = env["container_reasons"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if reasons.is_empty() {
        outln!("  container: no sign of one")?;
    } else {
        outln!("  container: looks like one ({})", reasons.join("; "))?;
    }
    let namespaces: Vec<String> = env["namespaces"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|n| {
                    let state = match n["differs"].as_bool() {
                        Some(true) => "own",
                        Some(false) => "init's",
                        None => "unknown",
                    };
                    format!("{} {state}", n["kind"].as_str().unwrap_or("?"))
                })
                .collect()
        })
        .unwrap_or_default();
    outln!("  namespaces: {}", namespaces.join(", "))?;
    outln!("  MPS: {}", env["mps_text"].as_str().unwrap_or("?"))?;
    let wake = &env["wake"];
    match (
        wake["asleep_p50_ms"].as_f64(),
        wake["spinning_p50_ms"].as_f64(),
    ) {
        (Some(asleep), Some(spinning)) => outln!(
            "  wake-up: a notice through shared memory reaches a thread asleep for {} ms in \
             {asleep:.4} ms (p50 of {}), one spinning in {spinning:.4} ms: every update or ring frame \
             to a consumer that waits asleep pays at least the first here (`cuda-ipc bench` \
             measures it between two processes, in its driver floor section)",
            wake["idle_ms"].as_f64().unwrap_or(f64::NAN),
            wake["samples"]
        )?,
        _ => outln!(
            "  wake-up: not measured ({})",
            wake["error"].as_str().unwrap_or("?")
        )?,
    }
    outln!(
        "  idle processors: {}",
        env["idle_text"].as_str().unwrap_or("?")
    )?;
    outln!(
        "  what MPS changes: {} (`cuda-ipc bench --mps` and `demo --stream --mps` measure it \
         with a private daemon)",
        cuda_ipc_bench::mps::WHAT_IT_CHANGES
    )?;
    if let Some(notes) = env["notes"].as_array() {
        for n in notes {
            outln!("  {}", n.as_str().unwrap_or_default())?;
        }
    }
    Ok(())
}
