//! `cuda-ipc`: share CUDA device memory between processes from the command
//! line. A thin front over the `cuda-ipc` library.
//!
//! Exit codes (scripts rely on them): [`EXIT_CODES`], printed by `--help`
//! and tabled in README.md (a test keeps the three in agreement). Every
//! error is one sentence on standard error after `cuda-ipc: error: `; with
//! `--json`, the service clients also print it as JSON on standard output.

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use cuda_ipc::ErrorKind;

mod cmd;
mod link;
mod out;

/// mimalloc for this program and its bench workers (the same executable):
/// the library leaves the allocator to the program. A set's record makes two
/// small allocations per tensor to build, decode and check; with mimalloc
/// the bench's 1,000-tensor set hand-off measured a fifth faster than with
/// glibc's malloc.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Share CUDA device memory between processes without copying.
#[derive(Parser, Debug)]
#[command(name = "cuda-ipc", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the driver, the devices and which sharing mechanisms work here.
    Info(cmd::info::Args),
    /// Run a producer and a consumer process that share a buffer, and check
    /// the data both ways.
    Demo(cmd::demo_args::Args),
    /// Allocate and fill a buffer, print its descriptor, and keep it alive
    /// until standard input ends.
    Export(cmd::export::Args),
    /// Map memory another process exported, check it, and optionally fill it.
    Open(cmd::open::Args),
    /// Publish buffers by name on a Unix socket until standard input ends.
    Serve(cmd::serve::ServeArgs),
    /// Attach to a buffer a `serve` (or any publisher) publishes, check it, optionally fill it.
    Attach(cmd::serve::AttachArgs),
    /// Have a service (`serve --service`) load a safetensors checkpoint as a set.
    Load(cmd::service_client::LoadArgs),
    /// List the sets a service holds: bytes, tensors, version, owner, readers.
    Ls(cmd::service_client::ListArgs),
    /// Show a service's use per uid against its quotas, and the device's memory.
    Stats(cmd::service_client::ListArgs),
    /// Drop a set a service holds (its owner's uid or the service's).
    Drop(cmd::service_client::DropArgs),
    /// Save a service's set as a safetensors checkpoint, while it serves on.
    Save(cmd::save::SaveArgs),
    /// Measure hand-off latency and bandwidth against the driver's floor and PyTorch.
    Bench(cuda_ipc_bench::Args),
    /// (internal) The consumer side of `demo`.
    #[command(name = "__demo-consumer", hide = true)]
    DemoConsumer(cmd::demo_args::ConsumerArgs),
    /// (internal) Opens a legacy handle for `info`'s probe.
    #[command(name = "__probe-open", hide = true)]
    ProbeOpen(cmd::info::ProbeOpenArgs),
    /// (internal) A consumer process of `bench`.
    #[command(name = "__bench-worker", hide = true)]
    BenchWorker(cuda_ipc_bench::WorkerArgs),
}

/// The outcome of a command that ran to completion.
pub enum Outcome {
    /// Everything checked out.
    Ok,
    /// The data did not match.
    Mismatch,
    /// A child process that ran the command exited with this code (it
    /// reported its own errors).
    Exit(u8),
}

/// Exit code for a data mismatch.
pub const EXIT_MISMATCH: u8 = 1;
/// Exit code for bad input or usage.
pub const EXIT_USAGE: u8 = 2;
/// Exit code for a missing driver or device, or an unsupported feature.
pub const EXIT_UNAVAILABLE: u8 = 3;
/// Exit code for other run-time failures.
pub const EXIT_FAILED: u8 = 4;

/// Every exit code and what it means: the one table that `--help` prints
/// and README.md shows.
pub const EXIT_CODES: [(u8, &str); 5] = [
    (0, "success"),
    (
        EXIT_MISMATCH,
        "the data differs from what was expected (the message names the first difference)",
    ),
    (
        EXIT_USAGE,
        "bad input: an argument, a descriptor, a checkpoint path or a socket name (checked before the driver is loaded)",
    ),
    (
        EXIT_UNAVAILABLE,
        "not possible on this machine: no driver, no device, or a mechanism or program it lacks",
    ),
    (
        EXIT_FAILED,
        "failed at run time: nothing serves the socket, a peer went away, a driver or system call failed, or a second signal stopped a service",
    ),
];

/// [`EXIT_CODES`] as the text under every `--help`.
pub fn exit_codes_help() -> String {
    let rows = EXIT_CODES.map(|(code, meaning)| format!("  {code}  {meaning}"));
    format!("Exit codes:\n{}", rows.join("\n"))
}

/// The exit code for a library error.
pub fn exit_code(e: &cuda_ipc::Error) -> u8 {
    match e.kind() {
        ErrorKind::Unavailable => EXIT_UNAVAILABLE,
        ErrorKind::InvalidInput => EXIT_USAGE,
        _ => EXIT_FAILED,
    }
}

/// Options that do something only with another one (see [`out::OnlyWith`]).
const ONLY_WITH: &[out::OnlyWith] = &[
    ("demo", "seconds", "stream"),
    ("demo", "slots", "stream"),
    ("demo", "frame_size", "stream"),
    ("demo", "mps", "stream"),
    ("serve", "name", "checkpoint"),
    ("serve", "streams", "checkpoint"),
    ("serve", "staging", "checkpoint"),
    ("serve", "tp", "checkpoint"),
    ("serve", "tp_rules", "tp"),
    ("serve", "quota", "service"),
    ("serve", "quota_uid", "service"),
    ("serve", "restore", "service"),
    ("serve", "grace", "service"),
];

fn main() -> ExitCode {
    let cli: Cli = match out::parse_args(ONLY_WITH) {
        Ok(cli) => cli,
        Err(code) => return code,
    };
    init_tracing();
    let json = match &cli.command {
        Command::Ls(a) | Command::Stats(a) => a.opts.json,
        Command::Load(a) => a.opts.json,
        Command::Drop(a) => a.opts.json,
        Command::Save(a) => a.opts.json,
        _ => false,
    };
    let result = match cli.command {
        Command::Info(a) => cmd::info::run(&a),
        Command::Demo(a) if a.stream => cmd::stream::run(&a),
        Command::Demo(a) => cmd::demo::run(&a),
        Command::Export(a) => cmd::export::run(&a),
        Command::Open(a) => cmd::open::run(&a),
        Command::Bench(a) => {
            cuda_ipc_bench::run(&a, &|a, b| link::between(a, b).to_string()).map(|()| Outcome::Ok)
        }
        Command::Serve(a) => match (&a.service, &a.checkpoint) {
            (Some(name), _) => cmd::service::serve(&a, name),
            (None, Some(path)) => cmd::checkpoint::serve(&a, path),
            (None, None) => cmd::serve::serve(&a),
        },
        Command::Load(a) => cmd::service_client::load(&a),
        Command::Ls(a) => cmd::service_client::ls(&a),
        Command::Stats(a) => cmd::service_client::stats(&a),
        Command::Drop(a) => cmd::service_client::drop_set(&a),
        Command::Save(a) => cmd::save::save(&a),
        Command::Attach(a) => match (&a.set, &a.checkpoint) {
            (Some(set), Some(path)) => cmd::checkpoint::attach(&a, set, path),
            _ => cmd::serve::attach(&a),
        },
        Command::DemoConsumer(a) => cmd::demo::consumer(&a),
        Command::ProbeOpen(a) => cmd::info::probe_open(&a),
        Command::BenchWorker(a) => cuda_ipc_bench::worker(&a).map(|()| Outcome::Ok),
    };
    match result {
        Ok(Outcome::Ok) => ExitCode::SUCCESS,
        Ok(Outcome::Mismatch) => ExitCode::from(EXIT_MISMATCH),
        Ok(Outcome::Exit(code)) => ExitCode::from(code),
        Err(e) => {
            let code = exit_code(&e);
            out::report(&e);
            if json {
                out::report_json(&e, code);
            }
            ExitCode::from(code)
        }
    }
}

/// Logging is off unless `CUDA_IPC_LOG` is set (for example `CUDA_IPC_LOG=debug`).
fn init_tracing() {
    if let Ok(filter) = std::env::var("CUDA_IPC_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    }
}

#[cfg(test)]
mod tests {
    use super::{EXIT_CODES, exit_codes_help};

    /// README.md's table of exit codes is [`EXIT_CODES`], word for word.
    #[test]
    fn the_readme_tables_the_exit_codes_of_the_code() {
        let readme = include_str!("../../../README.md");
        let rows: Vec<(u8, String)> = readme
            .lines()
            .skip_while(|l| !l.starts_with("| exit | meaning |"))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(|l| {
                let cells: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
                (cells[0].parse().expect("an exit code"), cells[1].to_owned())
            })
            .collect();
        let want: Vec<(u8, String)> = EXIT_CODES.iter().map(|&(c, m)| (c, m.to_owned())).collect();
        assert_eq!(rows, want, "README.md's exit codes differ from EXIT_CODES");
    }

    #[test]
    fn the_help_text_lists_every_code_once() {
        let text = exit_codes_help();
        for (code, meaning) in EXIT_CODES {
            assert_eq!(text.matches(&format!("  {code}  {meaning}")).count(), 1);
        }
    }
}
