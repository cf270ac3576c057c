//! `cuda-ipc save`: a service's set written as a safetensors checkpoint,
//! from this process (a reader of the set), while the service goes on
//! serving it (`cuda_ipc::service::save`).

use std::path::PathBuf;

use cuda_ipc::exchange::{Endpoint, Subscriber, SubscriberConfig};
use cuda_ipc::saver::SaveOptions;
use cuda_ipc::service::admin;
use cuda_ipc::{Access, Device, Error};

use super::service_client::{ServiceOpts, service_path};
use crate::Outcome;
use crate::out::{errln, outln};

/// Arguments of `save`.
#[derive(clap::Args, Debug)]
pub struct SaveArgs {
    #[command(flatten)]
    pub opts: ServiceOpts,
    /// The set to save (its current version).
    #[arg(long, default_value = "model")]
    pub set: String,
    /// Where: a .safetensors file, or a directory (the file is then named
    /// after the set, as `serve --service --restore DIR` reads it back).
    pub path: PathBuf,
    /// Replace the file if it exists.
    #[arg(long)]
    pub force: bool,
    /// Streams the copies run on, each with a writing thread (1 to 64).
    #[arg(long, default_value_t = SaveOptions::default().streams, value_parser = super::parse_count, allow_negative_numbers = true)]
    pub streams: usize,
    /// The size of each page-locked staging buffer (64KiB to 1GiB).
    #[arg(long, default_value = "16MiB", value_parser = super::parse_size, allow_negative_numbers = true)]
    pub staging: u64,
    /// The device the service serves on.
    #[arg(long, default_value_t = 0, value_parser = super::parse_device, allow_negative_numbers = true)]
    pub device: usize,
}

/// `save`.
pub fn save(args: &SaveArgs) -> Result<Outcome, Error> {
    admin::validate_set_name(&args.set).map_err(|reason| Error::InvalidArgument {
        what: "--set",
        reason,
    })?;
    let options = SaveOptions::default()
        .with_streams(args.streams)
        .with_piece_size(args.staging)
        .with_overwrite(args.force);
    options.validate().map_err(|e| Error::InvalidArgument {
        what: "--streams or --staging",
        reason: e.to_string(),
    })?;
    let path = service_path(&args.opts)?;
    let device = Device::open(args.device)?;
    let config = SubscriberConfig::default()
        .with_allow_uids(args.opts.allow_uid.iter().copied())
        .with_access(Access::ReadOnly);
    let subscriber = Subscriber::connect(&device, Endpoint::Path(path), config)?;
    let bar = super::checkpoint::progress_bar("saving");
    let saved = cuda_ipc::service::save(
        &subscriber,
        &device,
        &args.set,
        &args.path,
        &options,
        &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
    );
    bar.finish_and_clear();
    let saved = saved?;
    let r = &saved.report;
    if args.opts.json {
        outln!("{}", saved.to_json())?;
    } else {
        outln!(
            "saved {} version {} to {}: {} tensors, {} in {:.2} s ({:.1} GB/s)",
            saved.set,
            saved.version,
            r.path.display(),
            r.tensors,
            super::human(r.payload_bytes),
            r.elapsed.as_secs_f64(),
            r.gb_per_s()
        )?;
    }
    if r.aliases > 0 {
        errln!(
            "cuda-ipc: {} tied tensor(s) left out (safetensors files hold each tensor's bytes \
             once; a model ties them again when it loads)",
            r.aliases
        );
    }
    Ok(Outcome::Ok)
}
