//! The arguments of `demo` and of its hidden consumer process, shared by
//! the demo and its `--stream` mode.

use cuda_ipc_bench::namespaces::Namespace;

/// Arguments of `demo`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// How much memory to share (4096, 64MiB, 1GiB, ...).
    #[arg(long, value_parser = super::parse_size, default_value = "64MiB", allow_negative_numbers = true)]
    pub size: u64,
    /// How to share: auto, legacy, vmm, pool or fabric.
    #[arg(long, value_parser = super::parse_mechanism, default_value = "auto")]
    pub mechanism: super::MechanismArg,
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
    /// Stream frames through a ring of buffers instead (a video or
    /// inference pipeline) and report frames per second and latency
    /// (--frame-size, --slots and --seconds shape it; --size does not apply).
    #[arg(long, conflicts_with = "size")]
    pub stream: bool,
    /// Hand off a set of this many buffers (--size bytes in all, sizes from
    /// a fixed seed) from an arena in one entry; a consumer process attaches
    /// it and checks every buffer.
    #[arg(long, value_parser = super::parse_count, allow_negative_numbers = true, conflicts_with = "stream")]
    pub set: Option<usize>,
    /// With --stream: the size of one frame.
    #[arg(long, value_parser = super::parse_size, default_value = "1MiB", allow_negative_numbers = true)]
    pub frame_size: u64,
    /// With --stream: how many buffers the ring has.
    #[arg(long, default_value_t = 8, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub slots: usize,
    /// With --stream: the consumer checks every value of every N-th frame
    /// (1: every frame; each check is a kernel and a read-back in the
    /// consumer, which without MPS time-slices the GPU with the producer).
    #[arg(long, default_value_t = 1, value_parser = parse_check_every, requires = "stream")]
    pub check_every: u64,
    /// With --stream: how long to stream (10s, 500ms, 1m; a number alone
    /// counts seconds).
    #[arg(long, value_parser = super::parse_duration, default_value = "5s", allow_negative_numbers = true)]
    pub seconds: std::time::Duration,
    /// Run the consumer process in new Linux namespaces, as a container
    /// would, through util-linux unshare; comma-separated: pid (with its own
    /// /proc), ipc, mount, user (ours mapped to root), shm (a private
    /// /dev/shm: fences instead of events). The buffer then travels over
    /// the channel (a Unix socket). Needs root.
    #[arg(long, value_delimiter = ',', value_parser = Namespace::parse)]
    pub consumer_namespaces: Vec<Namespace>,
    /// With --stream: run the producer and the consumer under a private MPS
    /// control daemon (nvidia-cuda-mps-control with its own pipe and log
    /// folders in a fresh temporary folder, for these two processes only),
    /// stopped at the end. Changes no GPU setting.
    #[arg(long)]
    pub mps: bool,
    /// (internal) This process is a client of the private daemon of `--mps`.
    #[arg(long, hide = true)]
    pub under_mps: bool,
}

/// Arguments of the hidden consumer.
#[derive(clap::Args, Debug)]
pub struct ConsumerArgs {
    /// Device ordinal.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
    /// Stream mode: subscribe to the ring at this socket.
    #[arg(long)]
    pub stream_socket: Option<std::path::PathBuf>,
    /// Stream mode: check every N-th frame (and every paced one).
    #[arg(long, default_value_t = 1, value_parser = parse_check_every)]
    pub check_every: u64,
    /// Attach the demo's buffer from the publisher at this socket (the
    /// demo with --consumer-namespaces).
    #[arg(long, conflicts_with = "stream_socket")]
    pub socket: Option<std::path::PathBuf>,
}

/// Parses `--check-every`: a whole number of frames, at least 1.
fn parse_check_every(s: &str) -> Result<u64, String> {
    match s.trim().parse::<u64>() {
        Ok(0) => Err("0: give 1 to check every frame, or N to check every N-th".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{s:?} is not a whole number of frames")),
    }
}

#[cfg(test)]
mod tests {
    use super::parse_check_every;

    #[test]
    fn check_every_is_a_positive_count() {
        assert_eq!(parse_check_every(" 1024 "), Ok(1024));
        assert_eq!(parse_check_every("1"), Ok(1));
        assert!(parse_check_every("0").unwrap_err().contains("give 1"));
        assert!(parse_check_every("-3").unwrap_err().contains("\"-3\""));
        assert!(parse_check_every("every").is_err());
    }
}
