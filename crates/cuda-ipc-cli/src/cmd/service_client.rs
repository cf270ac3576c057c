//! `cuda-ipc load`, `ls`, `stats` and `drop`: clients of the weight service
//! (`serve --service`). They call the service's admin methods over its
//! socket (`cuda_ipc::service::admin`) and never load the CUDA driver.

use std::path::PathBuf;
use std::time::Duration;

use cuda_ipc::Error;
use cuda_ipc::channel::{ChannelError, Client, ClientConfig};
use cuda_ipc::checkpoint::{PlanOptions, TpRule, TpShard};
use cuda_ipc::service::admin::{self, DropRequest, LoadRequest, LsRequest, Request, StatsRequest};
use cuda_ipc::service::catalog::holders_text;

use super::serve::{Side, socket_path};
use crate::Outcome;
use crate::out::{errln, outln};

/// Where the service is and how to trust it: shared by every client command.
#[derive(clap::Args, Debug)]
pub struct ServiceOpts {
    /// The service's socket: the NAME given to `serve --service` (in the
    /// private socket directory) or a path (containing a /).
    #[arg(long, default_value = "cuda-ipc")]
    pub service: String,
    /// Accept a service running as this user id too (repeatable); by
    /// default only one running as our own.
    #[arg(long = "allow-uid", value_parser = super::parse_uid, allow_negative_numbers = true)]
    pub allow_uid: Vec<u32>,
    /// Print the service's answer as one JSON line instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `load`.
#[derive(clap::Args, Debug)]
pub struct LoadArgs {
    #[command(flatten)]
    pub opts: ServiceOpts,
    /// The set name the checkpoint is held under.
    #[arg(long, default_value = "model")]
    pub set: String,
    /// The safetensors checkpoint: a .safetensors file, a sharded
    /// checkpoint's model.safetensors.index.json, or a model directory. The
    /// service opens it itself, as its own user: that user must be able to
    /// read it, and a caller of another user may load only files it owns
    /// or anyone may read.
    pub path: PathBuf,
    /// Streams the copies run on (1 to 1024; default: the loader's, 8).
    #[arg(long, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub streams: Option<usize>,
    /// The size of each page-locked staging buffer (default: the loader's, 2MiB).
    #[arg(long, value_parser = super::parse_size, allow_negative_numbers = true)]
    pub staging: Option<u64>,
    /// How long to wait for the load (10m, 90s; a number alone counts
    /// seconds). The service finishes a load this gives up on: `ls` shows it.
    #[arg(long, value_parser = super::parse_duration, default_value = "10m", allow_negative_numbers = true)]
    pub timeout: Duration,
    /// Load tensor-parallel rank R's shard of N (`--tp 3/8`) into the set
    /// SET.tpR-of-N: each tensor split as the rules say (docs/SERVICE.md,
    /// "Tensor parallel").
    #[arg(long, value_name = "R/N", value_parser = super::parse_tp)]
    pub tp: Option<(u32, u32)>,
    /// A rule before the built-in ones (repeatable, first match wins):
    /// tensors whose name contains PATTERN are split along dimension DIM,
    /// or replicated (PATTERN=replicate).
    #[arg(long = "tp-rule", value_name = "PATTERN=DIM", requires = "tp", value_parser = super::parse_tp_rule)]
    pub tp_rules: Vec<TpRule>,
}

/// Arguments of `ls` and `stats`.
#[derive(clap::Args, Debug)]
pub struct ListArgs {
    #[command(flatten)]
    pub opts: ServiceOpts,
}

/// Arguments of `drop`.
#[derive(clap::Args, Debug)]
pub struct DropArgs {
    #[command(flatten)]
    pub opts: ServiceOpts,
    /// The set to drop.
    pub set: String,
    /// Drop it even while readers hold leases on it (they keep what they
    /// mapped; the memory goes back when they let go).
    #[arg(long)]
    pub force: bool,
}

/// How long an answer other than a load's may take.
const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The service's socket path: a missing socket says how to start one.
pub fn service_path(opts: &ServiceOpts) -> Result<PathBuf, Error> {
    match socket_path(&opts.service, Side::Attach) {
        Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            Err(Error::Io {
                context: format!(
                    "no service {} is running (no socket there); start one with `cuda-ipc \
                     serve --service {}`",
                    cuda_ipc::units::shorten(&opts.service, 80),
                    opts.service.chars().take(80).collect::<String>()
                ),
                source,
            })
        }
        other => other,
    }
}

/// Connects to the service (no driver).
fn connect(opts: &ServiceOpts) -> Result<Client, Error> {
    let path = service_path(opts)?;
    let mut config = ClientConfig::default();
    config
        .allowed_server_uids
        .extend_from_slice(&opts.allow_uid);
    Ok(Client::connect(path, config)?)
}

/// Calls a method and decodes its answer. The service's refusals of the
/// request itself (`bad_request`, `checkpoint`) are bad input (exit 2).
fn call<R: Request>(client: &Client, request: &R, timeout: Duration) -> Result<R::Answer, Error> {
    let answer = match client.call_within(R::METHOD, &admin::encode(request), timeout) {
        Ok(a) => a,
        Err(ChannelError::Remote { code, message })
            if code == "bad_request" || code == "checkpoint" =>
        {
            return Err(Error::InvalidArgument {
                what: "the service refused the request",
                reason: message,
            });
        }
        Err(e) => return Err(e.into()),
    };
    admin::decode(R::METHOD, &answer).map_err(|reason| {
        Error::from(ChannelError::Protocol {
            reason: format!("the service's answer: {reason}"),
        })
    })
}

/// The load request, checked before anything is sent: the set name, the
/// path (made absolute; it must exist) and the copy options are bad input
/// (exit 2).
pub fn load_request(args: &LoadArgs) -> Result<LoadRequest, Error> {
    let bad = |what: &'static str, reason: String| Error::InvalidArgument { what, reason };
    admin::validate_set_name(&args.set).map_err(|r| bad("--set", r))?;
    let path = std::fs::canonicalize(&args.path).map_err(|e| {
        bad(
            "checkpoint",
            format!(
                "{}: {e}",
                cuda_ipc::units::shorten(&args.path.to_string_lossy(), 80)
            ),
        )
    })?;
    let mut options = PlanOptions::default();
    if let Some(s) = args.streams {
        options = options.with_streams(s);
    }
    if let Some(s) = args.staging {
        options = options.with_piece_size(s);
    }
    options
        .validate()
        .map_err(|e| bad("--streams or --staging", e.to_string()))?;
    let shard = match args.tp {
        Some((rank, world)) => Some(
            TpShard::new(rank, world, args.tp_rules.clone())
                .map_err(|e| bad("--tp or --tp-rule", e.to_string()))?,
        ),
        None => None,
    };
    let request = LoadRequest::new(&args.set, path.to_string_lossy())
        .with_copies(args.streams, args.staging)
        .with_tp(shard.as_ref());
    // A shard's set name must be a set name too.
    request.target().map_err(|r| bad("--set with --tp", r))?;
    request.validate().map_err(|r| bad("checkpoint", r))?;
    Ok(request)
}

/// A spinner on standard error while the service loads (drawn only on a
/// terminal).
fn spinner(message: String) -> indicatif::ProgressBar {
    let bar =
        indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template("{spinner} {msg} {elapsed}") {
        bar.set_style(style);
    }
    bar.set_message(message);
    bar.enable_steady_tick(Duration::from_millis(100));
    bar
}

/// `load --service NAME --set SET PATH`.
pub fn load(args: &LoadArgs) -> Result<Outcome, Error> {
    let request = load_request(args)?;
    let client = connect(&args.opts)?;
    let bar = spinner(format!(
        "the service is loading {} into set {}",
        request.path,
        request
            .target()
            .map_or_else(|_| request.set.clone(), |t| t.0)
    ));
    let answer = call(&client, &request, args.timeout);
    bar.finish_and_clear();
    let a = answer?;
    if args.opts.json {
        outln!("{}", admin::encode(&a))?;
        return Ok(Outcome::Ok);
    }
    outln!(
        "loaded set {} (version {}): {} tensors, {} ({} held) from {} file(s) in {:.3} s \
         ({:.2} GB/s, {} streams)",
        a.set,
        a.version,
        a.tensors,
        super::human(a.bytes),
        super::human(a.allocated),
        a.files,
        a.load_s,
        a.gb_per_s,
        a.streams
    )?;
    Ok(Outcome::Ok)
}

/// `ls --service NAME`.
pub fn ls(args: &ListArgs) -> Result<Outcome, Error> {
    let client = connect(&args.opts)?;
    let a = call(&client, &LsRequest {}, CALL_TIMEOUT)?;
    if args.opts.json {
        outln!("{}", admin::encode(&a))?;
        return Ok(Outcome::Ok);
    }
    if a.sets.is_empty() {
        errln!("cuda-ipc: the service holds no set; load one with `cuda-ipc load`");
        return Ok(Outcome::Ok);
    }
    outln!(
        "{:<24} {:>12} {:>8} {:>8} {:>8} {:>7}  {:<28} READERS",
        "SET",
        "BYTES",
        "TENSORS",
        "VERSION",
        "OWNER",
        "LEASES",
        "STATE"
    )?;
    for s in &a.sets {
        let mut readers = if s.leases.is_empty() {
            "-".to_owned()
        } else {
            holders_text(&s.leases)
        };
        if !s.not_reconnected.is_empty() {
            readers = format!(
                "{readers}; not connected again since the restart: {}",
                holders_text(&s.not_reconnected)
            );
        }
        let state = match (&s.writer, s.restarts) {
            (Some(w), _) => format!("writing v{} (pid {}, uid {})", w.version, w.pid, w.uid),
            (None, 0) => "committed".to_owned(),
            (None, 1) => "committed, kept 1 restart".to_owned(),
            (None, n) => format!("committed, kept {n} restarts"),
        };
        outln!(
            "{:<24} {:>12} {:>8} {:>8} {:>8} {:>7}  {state:<28} {readers}",
            s.name,
            super::human(s.bytes),
            s.tensors,
            s.version,
            s.owner_uid,
            s.leases.len()
        )?;
    }
    Ok(Outcome::Ok)
}

/// A quota for people.
fn quota_text(q: Option<u64>) -> String {
    q.map_or_else(|| "no limit".to_owned(), super::human)
}

/// `stats --service NAME`.
pub fn stats(args: &ListArgs) -> Result<Outcome, Error> {
    let client = connect(&args.opts)?;
    let a = call(&client, &StatsRequest {}, CALL_TIMEOUT)?;
    if args.opts.json {
        outln!("{}", admin::encode(&a))?;
        return Ok(Outcome::Ok);
    }
    outln!(
        "service pid {} (uid {}){}: {} set(s), {} held, {} reader lease(s), {} load(s) in \
         progress; default quota {} (uids other than the service's)",
        a.pid,
        a.service_uid,
        if a.stopping { ", stopping" } else { "" },
        a.sets,
        super::human(a.total_bytes),
        a.leases,
        a.loads_in_progress,
        quota_text(a.default_quota)
    )?;
    if let (Some(free), Some(total)) = (a.device_free, a.device_total) {
        outln!(
            "device memory: {} free of {}",
            super::human(free),
            super::human(total)
        )?;
    }
    for u in &a.uids {
        outln!(
            "uid {:>6}: {} used{}{} of {} in {} set(s)",
            u.uid,
            super::human(u.used),
            if u.held > 0 {
                format!(
                    " ({} of it old versions its readers keep)",
                    super::human(u.held)
                )
            } else {
                String::new()
            },
            if u.reserved > 0 {
                format!(" (+{} loading)", super::human(u.reserved))
            } else {
                String::new()
            },
            quota_text(u.quota),
            u.sets
        )?;
    }
    Ok(Outcome::Ok)
}

/// `drop --service NAME SET [--force]`.
pub fn drop_set(args: &DropArgs) -> Result<Outcome, Error> {
    admin::validate_set_name(&args.set).map_err(|reason| Error::InvalidArgument {
        what: "SET",
        reason,
    })?;
    let client = connect(&args.opts)?;
    let a = call(
        &client,
        &DropRequest::new(&args.set, args.force),
        CALL_TIMEOUT,
    )?;
    if args.opts.json {
        outln!("{}", admin::encode(&a))?;
        return Ok(Outcome::Ok);
    }
    outln!("dropped set {} ({})", a.set, super::human(a.bytes))?;
    if !a.held_by.is_empty() {
        errln!(
            "cuda-ipc: readers still held it: {}; their mappings stay valid, and its memory goes \
             back when they let go",
            holders_text(&a.held_by)
        );
    }
    Ok(Outcome::Ok)
}
