//! `cuda-ipc serve --service`: the weight service (issue 26), a
//! long-running process that owns what it loads and serves it as read-only
//! sets until SIGTERM or SIGINT; and its clients `load`, `ls`, `stats` and
//! `drop` (see `service_client.rs`).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cuda_ipc::exchange::Endpoint;
use cuda_ipc::keep::Store;
use cuda_ipc::keep::store::NOTIFY_SOCKET;
use cuda_ipc::service::{Quotas, Service, ServiceConfig, ShutdownReport};
use cuda_ipc::{Device, Error};
use serde_json::json;

use super::QuotaArg;
use super::serve::{ServeArgs, Side, socket_path};
use crate::Outcome;
use crate::out::{errln, outln};

/// The overrides of `--quota-uid`, checked before the driver: a uid given
/// twice is bad input (exit 2).
fn quota_overrides(args: &ServeArgs) -> Result<BTreeMap<u32, u64>, Error> {
    let mut per_uid = BTreeMap::new();
    for &(uid, bytes) in &args.quota_uid {
        if per_uid.insert(uid, bytes).is_some() {
            return Err(Error::InvalidArgument {
                what: "--quota-uid",
                reason: format!("uid {uid} is given twice; give each uid once"),
            });
        }
    }
    Ok(per_uid)
}

/// The quotas of `--quota` (by default a quarter of the device's memory:
/// [`Quotas::for_device`]) and the `--quota-uid` overrides.
fn quotas(args: &ServeArgs, per_uid: BTreeMap<u32, u64>, device: &Device) -> Result<Quotas, Error> {
    let base = match args.quota {
        Some(QuotaArg::Bytes(b)) => Quotas::unlimited().with_default(Some(b)),
        Some(QuotaArg::Unlimited) => Quotas::unlimited(),
        None => Quotas::for_device(device.memory_info()?.1),
    };
    Ok(per_uid
        .into_iter()
        .fold(base, |q, (uid, bytes)| q.with_uid(uid, bytes)))
}

/// Sets a flag on SIGTERM and SIGINT, so that the service stops cleanly; a
/// second one, while it stops, ends the process at once (exit 4, as any
/// run-time failure: readers may still have held leases).
fn stop_flag() -> Result<Arc<AtomicBool>, Error> {
    let flag = Arc::new(AtomicBool::new(false));
    for signal in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        let io = |e| Error::Io {
            context: format!("cannot handle signal {signal}"),
            source: e,
        };
        // The exit first: it checks the flag before the second handler sets it.
        signal_hook::flag::register_conditional_shutdown(
            signal,
            i32::from(crate::EXIT_FAILED),
            Arc::clone(&flag),
        )
        .map_err(io)?;
        signal_hook::flag::register(signal, Arc::clone(&flag)).map_err(io)?;
    }
    Ok(flag)
}

/// `serve --service [NAME]`: a keeper that runs the serving process
/// (`keeper.rs`), or the serving process itself (under a keeper or
/// systemd, whose `$NOTIFY_SOCKET` it finds, or with `--no-keeper`).
pub fn serve(args: &ServeArgs, name: &str) -> Result<Outcome, Error> {
    let path = socket_path(name, Side::Serve)?;
    let overrides = quota_overrides(args)?;
    if let Some(dir) = &args.restore
        && !dir.is_dir()
    {
        return Err(Error::InvalidArgument {
            what: "--restore",
            reason: format!(
                "{} is not a directory; give the directory `cuda-ipc save` wrote to",
                dir.display()
            ),
        });
    }
    let under_store = std::env::var_os(NOTIFY_SOCKET).is_some_and(|s| !s.is_empty());
    if !under_store && !args.no_keeper {
        return super::keeper::keep(&path, args.standby);
    }
    // The device first: a standby opens it, then waits in `Store::from_env`
    // for the descriptors of the process it takes over from.
    let stop = stop_flag()?;
    let began = std::time::Instant::now();
    let device = Device::open(args.device)?;
    let device_open = began.elapsed();
    let store = if under_store {
        Store::from_env().map_err(|e| Error::Io {
            context: "cannot take over what the keeper holds".into(),
            source: e,
        })?
    } else {
        Store::none()
    };
    let quotas = quotas(args, overrides, &device)?;
    let config = ServiceConfig::default()
        .with_quotas(quotas.clone())
        .with_allow_uids(args.allow_uid.iter().copied());
    let starting = std::time::Instant::now();
    let (service, restored) = Service::start_kept(&device, Endpoint::Path(path), config, store)?;
    let started = starting.elapsed();
    let from_disk = match &args.restore {
        Some(dir) => restore_saved(&service, dir)?,
        None => Vec::new(),
    };
    let per_uid: serde_json::Map<String, serde_json::Value> = quotas
        .per_uid
        .iter()
        .map(|(uid, b)| (uid.to_string(), json!(b)))
        .collect();
    let line = json!({
        "socket": service.path(),
        "service": true,
        "quota": quotas.default,
        "quota_uid": per_uid,
        "grace_s": args.grace.as_secs_f64(),
        "read_only": true,
        "pid": std::process::id(),
        "kept": under_store,
        "device_open_ms": device_open.as_secs_f64() * 1e3,
        "start_ms": started.as_secs_f64() * 1e3,
        "restored": restored.sets.iter().map(|(s, v)| json!({"set": s, "version": v})).collect::<Vec<_>>(),
        "restored_from_disk": from_disk,
    });
    outln!("{line}")?;
    if !restored.sets.is_empty() {
        errln!(
            "cuda-ipc: serving again {} set(s) kept through a restart ({}), not read from disk",
            restored.sets.len(),
            super::human(restored.chunk_bytes)
        );
    }
    errln!(
        "cuda-ipc: service serving on {} (pid {}); load with `cuda-ipc load --service {name} \
         --set NAME PATH`; stop with SIGTERM (kill {}) or Ctrl-C",
        service.path().display(),
        std::process::id(),
        std::process::id()
    );
    while !stop.load(Ordering::SeqCst) {
        if service.wait_for_shutdown_call(Duration::from_millis(100)) {
            break;
        }
    }
    let leases = service.stats().leases;
    errln!(
        "cuda-ipc: stopping: no more loads; waiting up to {:.1} s for {leases} reader lease(s) \
         (a second SIGTERM or Ctrl-C exits at once)",
        args.grace.as_secs_f64()
    );
    let report = service.shutdown(args.grace);
    print_report(&report)?;
    Ok(Outcome::Ok)
}

/// `--restore DIR`: every saved set of `dir` loaded, each file's outcome
/// said on standard error and returned for the JSON line.
fn restore_saved(
    service: &Service,
    dir: &std::path::Path,
) -> Result<Vec<serde_json::Value>, Error> {
    let mut rows = Vec::new();
    for f in service.load_saved(dir)? {
        let path = f.path.display();
        match &f.outcome {
            Ok(Some(a)) => {
                errln!(
                    "cuda-ipc: restored set {} version {} from {path} ({} in {:.2} s)",
                    a.set,
                    a.version,
                    super::human(a.bytes),
                    a.load_s
                );
                rows.push(json!({"path": f.path, "set": a.set, "version": a.version,
                                 "bytes": a.bytes, "load_s": a.load_s}));
            }
            Ok(None) => {
                errln!(
                    "cuda-ipc: the service holds set {} already (kept through a restart, or \
                     from an earlier file); {path} is not read",
                    f.set
                );
                rows.push(json!({"path": f.path, "set": f.set, "held_already": true}));
            }
            Err(reason) => {
                errln!(
                    "cuda-ipc: cannot restore set {} from {path}: {reason}",
                    f.set
                );
                rows.push(json!({"path": f.path, "set": f.set, "error": reason}));
            }
        }
    }
    Ok(rows)
}

/// What the service dropped, as a JSON line on standard output and
/// sentences on standard error.
fn print_report(r: &ShutdownReport) -> Result<(), Error> {
    let dropped: Vec<serde_json::Value> = r
        .dropped
        .iter()
        .map(|s| {
            json!({"set": s.name, "bytes": s.bytes, "version": s.version, "owner_uid": s.owner_uid})
        })
        .collect();
    let held: Vec<serde_json::Value> = r
        .held_at_timeout
        .iter()
        .map(|(set, h)| json!({"set": set, "pid": h.pid, "uid": h.uid}))
        .collect();
    outln!(
        "{}",
        json!({
            "stopped": true,
            "dropped": dropped,
            "held_at_timeout": held,
            "waited_s": r.waited.as_secs_f64(),
        })
    )?;
    for (set, h) in &r.held_at_timeout {
        errln!("cuda-ipc: reader {h} still held set {set} when the grace ran out");
    }
    for s in &r.dropped {
        errln!(
            "cuda-ipc: dropped set {} (version {}, {}, uid {})",
            s.name,
            s.version,
            super::human(s.bytes),
            s.owner_uid
        );
    }
    errln!(
        "cuda-ipc: service stopped after waiting {:.3} s for readers; dropped {} set(s)",
        r.waited.as_secs_f64(),
        r.dropped.len()
    );
    Ok(())
}
