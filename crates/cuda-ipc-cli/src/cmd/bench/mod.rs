//! `cuda-ipc bench`: hand-off latency and bandwidth against the driver's
//! floor and PyTorch, in one run.

use cuda_ipc::Error;

use crate::Outcome;

/// Arguments of `bench`.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// A short run.
    #[arg(long)]
    pub quick: bool,
}

pub fn run(_args: &Args) -> Result<Outcome, Error> {
    Err(Error::Unsupported {
        what: "bench",
        why: "not written yet".into(),
    })
}
