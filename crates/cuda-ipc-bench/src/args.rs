//! The arguments of `cuda-ipc bench` and the checks that need no GPU:
//! each value on its own as clap parses it, and the output paths before the
//! run starts.

use std::path::{Path, PathBuf};

use cuda_ipc::Mechanism;

use crate::namespaces::Namespace;
use crate::report::SectionId;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A short run (under 2 minutes on an H200): sizes 2MiB and 64MiB,
    /// about 30 samples each, 1 s per ring size, 1 and 2 consumers, weight
    /// sets of 256MiB instead of 4GiB.
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
    #[arg(long, value_parser = parse_ordinal, allow_negative_numbers = true)]
    pub device: Option<usize>,
    /// Two device ordinals, producer first (for example 0,1): also measure
    /// hand-offs to a consumer on the second GPU and copies between the two
    /// (the peer section). The other sections run on the first.
    #[arg(
        long,
        value_delimiter = ',',
        value_parser = parse_ordinal,
        allow_negative_numbers = true
    )]
    pub devices: Option<Vec<usize>>,
    /// Skip the PyTorch anchor (and PyTorch's rows of the sets section).
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
    /// Run only these sections, comma-separated (fresh, arena, cached,
    /// floor, bandwidth, peer, ring, sync, scale, sets, torch).
    #[arg(long, value_delimiter = ',', value_parser = SectionId::parse)]
    pub only: Option<Vec<SectionId>>,
    /// Samples kept per measurement, at least 1 (overrides the defaults: 30
    /// quick, 100 full, fewer above 1 GiB).
    #[arg(long, value_parser = parse_reps, allow_negative_numbers = true)]
    pub reps: Option<usize>,
    /// Warm-up samples thrown away per measurement (default: 5 quick, 10 full).
    #[arg(long, value_parser = parse_count, allow_negative_numbers = true)]
    pub warmup: Option<usize>,
    /// Run every consumer process in new Linux namespaces, as a container
    /// would, through util-linux unshare; comma-separated: pid (with its own
    /// /proc), ipc, mount, user (ours mapped to root), shm (a private
    /// /dev/shm: fences instead of events). Needs root. Sections that
    /// cannot work there are skipped, saying why.
    #[arg(long, value_delimiter = ',', value_parser = Namespace::parse)]
    pub consumer_namespaces: Vec<Namespace>,
    /// Run the sections twice: without MPS, then under a private MPS
    /// control daemon (nvidia-cuda-mps-control with its own pipe and log
    /// folders in a fresh temporary folder, for this run's processes only,
    /// stopped at the end); the report shows both. Changes no GPU setting.
    /// With --only ring,sync it compares hand-offs between two busy processes.
    #[arg(long)]
    pub mps: bool,
    /// (internal) This process is the pass under MPS of a `--mps` run:
    /// write the report as JSON to this file and print no table.
    #[arg(long, hide = true)]
    pub mps_pass: Option<PathBuf>,
}

/// Checks `--mps` against the other arguments.
pub(crate) fn check_mps(args: &Args) -> Result<(), String> {
    if args.mps && !args.consumer_namespaces.is_empty() {
        return Err(
            "--mps and --consumer-namespaces do not go together: an MPS client must reach the \
             control daemon's pipe folder and share its IPC namespace, which new namespaces take \
             away; measure them in two runs"
                .into(),
        );
    }
    Ok(())
}

/// Parses a mechanism the bench measures.
fn parse_mechanism(s: &str) -> Result<Mechanism, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "legacy" => Ok(Mechanism::Legacy),
        "vmm" => Ok(Mechanism::Vmm),
        "pool" => Ok(Mechanism::Pool),
        _ => Err(format!(
            "{:?} is not a mechanism the bench measures; choose from legacy, vmm, pool",
            s.trim()
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

/// Parses `--reps`: a whole number of kept samples, at least 1.
fn parse_reps(s: &str) -> Result<usize, String> {
    match parse_count(s)? {
        0 => Err("at least 1 sample must be kept per measurement".into()),
        n => Ok(n),
    }
}

/// Parses a whole number of samples (`--warmup`, `--reps`).
fn parse_count(s: &str) -> Result<usize, String> {
    s.trim()
        .parse::<usize>()
        .map_err(|_| format!("{s:?} is not a whole number of samples"))
}

/// Parses a device ordinal (`--device`, `--devices`).
fn parse_ordinal(s: &str) -> Result<usize, String> {
    s.trim().parse::<usize>().map_err(|_| {
        format!("{s:?} is not a device ordinal (0, 1, ...; `cuda-ipc info` lists them)")
    })
}

/// Checks the paths before the run: `--json-out` and `--plot` can be
/// written (a folder that exists, a name that is not a folder, write
/// permission, not both to one file), and a `--torch-script` the run will
/// use is a file.
pub(crate) fn check_paths(args: &Args) -> Result<(), String> {
    let torch_runs = !args.no_torch
        && args
            .only
            .as_ref()
            .is_none_or(|o| o.contains(&SectionId::Torch) || o.contains(&SectionId::Sets));
    if let Some(script) = args.torch_script.as_deref().filter(|_| torch_runs)
        && !script.is_file()
    {
        return Err(format!(
            "--torch-script {} is not a file (the PyTorch anchor, bench/torch_share.py); \
             fix the path, or drop it to use the bundled script",
            script.display()
        ));
    }
    if let Some(path) = &args.json_out {
        check_output("--json-out", path)?;
    }
    if let Some(path) = &args.plot {
        check_output("--plot", path)?;
    }
    if let (Some(a), Some(b)) = (&args.json_out, &args.plot)
        && a == b
    {
        return Err(format!(
            "--json-out and --plot both name {}: give each its own file",
            a.display()
        ));
    }
    Ok(())
}

/// Checks that the file `path` (given as `flag`) can be created or replaced.
fn check_output(flag: &str, path: &Path) -> Result<(), String> {
    use rustix::fs::{Access, access};
    let shown = path.display();
    if path.as_os_str().is_empty() {
        return Err(format!("{flag} names no file"));
    }
    match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(format!(
                "{flag} {shown} is a folder; name a file in it (for example {})",
                path.join(if flag == "--plot" {
                    "bench.svg"
                } else {
                    "bench.json"
                })
                .display()
            ));
        }
        Ok(_) => {
            return access(path, Access::WRITE_OK).map_err(|e| {
                format!("{flag} {shown} cannot be written ({e}): check its permissions")
            });
        }
        // Missing, or under something that is not a folder: the parent says which.
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) => {}
        Err(e) => return Err(format!("{flag} {shown}: {e}")),
    }
    let folder = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(folder) {
        Ok(m) if m.is_dir() => access(folder, Access::WRITE_OK | Access::EXEC_OK).map_err(|e| {
            format!(
                "{flag} {shown}: cannot create files in {} ({e}): check its permissions",
                folder.display()
            )
        }),
        Ok(_) => Err(format!(
            "{flag} {shown}: {} is not a folder",
            folder.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(format!(
            "{flag} {shown}: the folder {} does not exist; create it first",
            folder.display()
        )),
        Err(e) => Err(format!("{flag} {shown}: {}: {e}", folder.display())),
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

    fn outputs(argv: &[&str]) -> Result<(), String> {
        let cli = Cli::try_parse_from(std::iter::once("bench").chain(argv.iter().copied()))
            .map_err(|e| e.to_string())?;
        check_paths(&cli.args)
    }

    #[test]
    fn output_paths_are_checked_up_front() {
        let dir = std::env::temp_dir().join(format!("cuda-ipc-bench-args-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let json = dir.join("run.json");
        let svg = dir.join("run.svg");
        let (json_s, svg_s) = (json.to_str().unwrap(), svg.to_str().unwrap());
        // new files in a folder that exists, and an existing file
        assert_eq!(outputs(&["--json-out", json_s, "--plot", svg_s]), Ok(()));
        std::fs::write(&json, "old").unwrap();
        assert_eq!(outputs(&["--json-out", json_s]), Ok(()));
        // nothing was created or changed by the check
        assert!(!svg.exists());
        assert_eq!(std::fs::read_to_string(&json).unwrap(), "old");

        let missing = dir.join("no-such-folder/run.json");
        let e = outputs(&["--json-out", missing.to_str().unwrap()]).unwrap_err();
        assert!(e.starts_with("--json-out "), "{e}");
        assert!(e.contains("does not exist; create it first"), "{e}");

        let e = outputs(&["--plot", dir.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("is a folder") && e.contains("bench.svg"), "{e}");

        let under_file = json.join("x.svg");
        let e = outputs(&["--plot", under_file.to_str().unwrap()]).unwrap_err();
        assert!(e.contains("is not a folder"), "{e}");

        let e = outputs(&["--json-out", json_s, "--plot", json_s]).unwrap_err();
        assert!(e.contains("both name"), "{e}");

        let e = outputs(&["--json-out", ""]).unwrap_err();
        assert!(
            e.contains("names no file") || e.contains("a value is required"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
