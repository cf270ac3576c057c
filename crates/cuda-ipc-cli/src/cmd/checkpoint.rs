//! `cuda-ipc serve --checkpoint` and `cuda-ipc attach --set --checkpoint`:
//! a safetensors checkpoint loaded onto the device and published as one
//! set, and a consumer that compares the set with the file byte for byte.

use std::path::Path;
use std::time::Instant;

use cuda_ipc::checkpoint::{Checkpoint, Plan, PlanOptions, TpShard, shard_name};
use cuda_ipc::exchange::{Endpoint, Publisher, Subscriber};
use cuda_ipc::loader::{LoadedCheckpoint, load_plan_until};
use cuda_ipc::set::SetEntry;
use cuda_ipc::set::names::EntryRole;
use cuda_ipc::units::shorten;
use cuda_ipc::{Device, DeviceMemory, Error};
use serde_json::json;

use super::serve::{
    AttachArgs, ServeArgs, Side, access_word, publisher_config, socket_path, subscriber_config,
};
use crate::Outcome;
use crate::out::{errln, outln};

/// The checkpoint, its plan (of rank R's shard, with `--tp R/N`) and the
/// set name it is published under, checked before the driver is touched:
/// a bad path, a file that is not a checkpoint, an empty checkpoint, bad
/// load options, a bad shard or rule, or a bad set name is bad input
/// (exit 2).
pub fn open_checked(args: &ServeArgs, path: &Path) -> Result<(Checkpoint, Plan, String), Error> {
    check_set_name(&args.name)?;
    let options = PlanOptions::default()
        .with_streams(args.streams)
        .with_piece_size(args.staging);
    options.validate().map_err(|e| Error::InvalidArgument {
        what: "--streams or --staging",
        reason: e.to_string(),
    })?;
    let bad_tp = |e: cuda_ipc::Error| Error::InvalidArgument {
        what: "--tp or --tp-rule",
        reason: e.to_string(),
    };
    let shard = args
        .tp
        .map(|(rank, world)| TpShard::new(rank, world, args.tp_rules.clone()))
        .transpose()
        .map_err(bad_tp)?;
    let ckpt = open_nonempty(path)?;
    let Some(shard) = shard else {
        let plan = ckpt.plan(&options)?;
        return Ok((ckpt, plan, args.name.clone()));
    };
    let name = shard_name(&args.name, shard.rank(), shard.world()).map_err(bad_tp)?;
    check_set_name(&name)?;
    let plan = ckpt.plan_shard(&options, &shard).map_err(bad_tp)?;
    Ok((ckpt, plan, name))
}

/// The checkpoint at `path`, refused if it cannot be one set (no tensor,
/// or an empty one: [`cuda_ipc::loader::check_publishable`]).
fn open_nonempty(path: &Path) -> Result<Checkpoint, Error> {
    let ckpt = Checkpoint::open(path)?;
    cuda_ipc::loader::check_publishable(&ckpt)?;
    Ok(ckpt)
}

/// A set name the publisher will accept (and that `attach --list` shows).
fn check_set_name(name: &str) -> Result<(), Error> {
    let reason = match cuda_ipc::channel::validate_entry_name(name) {
        Err(cuda_ipc::channel::ChannelError::InvalidName { reason, .. }) => reason,
        Err(e) => e.to_string(),
        Ok(()) if name.starts_with(cuda_ipc::exchange::HIDDEN_ENTRY_PREFIX) => format!(
            "names starting with {:?} are the publisher's own",
            cuda_ipc::exchange::HIDDEN_ENTRY_PREFIX
        ),
        Ok(()) => return Ok(()),
    };
    Err(Error::InvalidArgument {
        what: "--name",
        reason: format!("{}: {reason}", shorten(name, 40)),
    })
}

/// A progress bar on standard error (drawn only on a terminal), its line
/// starting with `verb` (`loading`, `saving`).
pub fn progress_bar(verb: &str) -> indicatif::ProgressBar {
    let bar =
        indicatif::ProgressBar::with_draw_target(Some(0), indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template(&format!(
        "{verb} {{bar:40}} {{binary_bytes}}/{{binary_total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
    )) {
        bar.set_style(style);
    }
    bar
}

/// `serve --checkpoint PATH`.
pub fn serve(args: &ServeArgs, path: &Path) -> Result<Outcome, Error> {
    let (ckpt, plan, name) = open_checked(args, path)?;
    let socket = socket_path(&args.socket, Side::Serve)?;
    let config = publisher_config(args)?;
    let device = Device::open(args.device)?;
    let publisher = Publisher::bind(&device, Endpoint::Path(socket), config)?;
    let bar = progress_bar("loading");
    let never = std::sync::atomic::AtomicBool::new(false);
    let loaded = load_plan_until(
        &publisher,
        &ckpt,
        &plan,
        &mut |done, total| {
            bar.set_length(total);
            bar.set_position(done);
        },
        &never,
    );
    bar.finish_and_clear();
    let loaded = loaded?;
    loaded.publish(&publisher, &name)?;
    report(args, &name, &publisher, &ckpt, &loaded)?;
    super::wait_for_stdin_end()?;
    publisher.unpublish_set(&name, Some(args.release_timeout))?;
    drop(loaded);
    publisher.trim()?;
    Ok(Outcome::Ok)
}

/// The JSON line on standard output (what was published, for scripts)
/// and a sentence on standard error.
fn report(
    args: &ServeArgs,
    name: &str,
    publisher: &Publisher,
    ckpt: &Checkpoint,
    loaded: &LoadedCheckpoint,
) -> Result<(), Error> {
    let r = loaded.report();
    let line = json!({
        "socket": publisher.path(),
        "set": name,
        "tp": args.tp.map(|(rank, world)| json!({"rank": rank, "world": world})),
        "checkpoint": ckpt.path(),
        "files": r.files,
        "tensors": r.tensors,
        "bytes": r.payload_bytes,
        "allocated": r.allocated_bytes,
        "streams": r.streams,
        "pieces": r.pieces,
        "load_s": r.elapsed.as_secs_f64(),
        "gb_per_s": r.gb_per_s(),
        "mechanism": publisher.arena()?.backing().mechanism().name(),
        "read_only": publisher.read_only_readers(),
        "pid": std::process::id(),
    });
    outln!("{line}")?;
    errln!(
        "cuda-ipc: loaded {} tensors ({}) from {} file(s) in {:.3} s ({:.2} GB/s, {} streams); \
         published set {}{}",
        r.tensors,
        super::human(r.payload_bytes),
        r.files,
        r.elapsed.as_secs_f64(),
        r.gb_per_s(),
        r.streams,
        name,
        if publisher.read_only_readers() {
            " (readers map it read-only)"
        } else {
            ""
        }
    );
    Ok(())
}

/// `attach --set NAME --checkpoint PATH`: every tensor of the set against
/// the file, byte for byte, and the same names, dtypes and shapes.
pub fn attach(args: &AttachArgs, set: &str, path: &Path) -> Result<Outcome, Error> {
    let ckpt = open_nonempty(path)?;
    let socket = socket_path(&args.socket, Side::Attach)?;
    let device = Device::open(args.device)?;
    let config = subscriber_config(args);
    let subscriber = Subscriber::connect(&device, Endpoint::Path(socket), config)?;
    let started = Instant::now();
    let attached = subscriber.attach_set(set)?;
    // Every view of the set shares the stream that waited on the event.
    if let Some(first) = (0..attached.len()).find(|&i| attached.entries()[i].len > 0) {
        attached.view::<u8>(first)?.synchronize()?;
    }
    let ms = super::ms_since(started);
    let t = Instant::now();
    let verdict = compare(&attached, &ckpt);
    let check_ms = super::ms_since(t);
    let bytes = attached.record().total_bytes();
    let n = attached.len();
    let access = access_word(attached.read_only());
    subscriber.release_set(attached)?;
    if let Some(why) = verdict? {
        errln!("cuda-ipc: mismatch: set {set}: {why}");
        return Ok(Outcome::Mismatch);
    }
    outln!(
        "attached set {set}: {n} tensors, {} ({access}) in {ms:.3} ms; every byte matches {} (checked in {check_ms:.3} ms)",
        super::human(bytes),
        ckpt.path().display()
    )?;
    Ok(Outcome::Ok)
}

/// The first difference between the set and the checkpoint, if any.
fn compare(
    set: &cuda_ipc::exchange::SetAttachment,
    ckpt: &Checkpoint,
) -> Result<Option<String>, Error> {
    compare_entries(set.entries(), |j| set.view::<u8>(j)?.to_vec(), ckpt)
}

/// The first difference between the set of `entries`, whose bytes
/// `bytes(index)` reads, and the checkpoint, if any.
fn compare_entries(
    entries: &[SetEntry],
    bytes: impl Fn(usize) -> Result<Vec<u8>, Error>,
    ckpt: &Checkpoint,
) -> Result<Option<String>, Error> {
    if entries.len() != ckpt.tensors().len() {
        return Ok(Some(format!(
            "{} tensors, the checkpoint has {}",
            entries.len(),
            ckpt.tensors().len()
        )));
    }
    for (i, entry) in entries.iter().enumerate() {
        // A tied or empty tensor travels under a reserved name
        // (`cuda_ipc::set::names`): its key, and where its bytes are.
        let role = entry.role();
        let name = shorten(role.key(), 80);
        let Some(t) = ckpt.tensor(role.key()) else {
            return Ok(Some(format!("{name} is not in the checkpoint")));
        };
        let (source, dtype, shape) = match role {
            EntryRole::Tensor { .. } => (Some(i), entry.dtype, entry.shape.to_vec()),
            EntryRole::Alias { index, .. } => {
                let tied = entries
                    .get(index)
                    .filter(|e| index < i && matches!(e.role(), EntryRole::Tensor { .. }));
                let Some(tied) = tied else {
                    return Ok(Some(format!(
                        "{name} is tied to entry {index}, which is not an ordinary entry before it"
                    )));
                };
                (Some(index), tied.dtype, tied.shape.to_vec())
            }
            EntryRole::Empty { shape, .. } => (None, entry.dtype, shape),
        };
        if t.dtype != dtype || t.shape != shape {
            return Ok(Some(format!(
                "{name} is {dtype} {shape:?}, the checkpoint's is {} {:?}",
                t.dtype, t.shape
            )));
        }
        let want = ckpt.bytes(t)?;
        let got: Vec<u8> = match source {
            Some(j) if !want.is_empty() => bytes(j)?,
            _ => Vec::new(),
        };
        if let Some(at) = got.iter().zip(&want).position(|(a, b)| a != b) {
            return Ok(Some(format!(
                "byte {at} of {name} is {:#04x}, the file's is {:#04x}",
                got[at], want[at]
            )));
        }
        if got.len() != want.len() {
            return Ok(Some(format!(
                "{name} has {} bytes, the file's {}",
                got.len(),
                want.len()
            )));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use cuda_ipc::descriptor::Dtype;
    use cuda_ipc::set::SetEntry;
    use cuda_ipc::set::names::{alias_entry_name, empty_entry_name};

    use super::{Checkpoint, compare_entries};

    /// A safetensors file of `w` (f32 [2, 2]: bytes 0..16) and `e` (an
    /// empty f32 [0, 3]), written by hand.
    fn checkpoint(dir: &std::path::Path) -> Checkpoint {
        let header = serde_json::json!({
            "w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
            "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [16, 16]},
        })
        .to_string();
        let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend(0u8..16);
        let path = dir.join("model.safetensors");
        std::fs::write(&path, bytes).unwrap();
        Checkpoint::open(&path).unwrap()
    }

    fn entry(name: String, dtype: Dtype, shape: Vec<u64>, len: u64) -> SetEntry {
        SetEntry::new(name, dtype, shape, 1, 0, len)
    }

    #[test]
    fn tied_and_empty_entries_are_read_as_their_tensors() {
        let dir = tempfile::tempdir().unwrap();
        let ckpt = checkpoint(dir.path());
        let good: Vec<u8> = (0u8..16).collect();
        let entries = vec![
            entry("w".into(), Dtype::F32, vec![2, 2], 16),
            entry(
                empty_entry_name("e", &[0, 3]).unwrap(),
                Dtype::F32,
                vec![1],
                4,
            ),
        ];
        let read = |j: usize| -> Result<Vec<u8>, cuda_ipc::Error> {
            assert_eq!(j, 0, "only the ordinary entry has bytes to read");
            Ok(good.clone())
        };
        assert_eq!(compare_entries(&entries, read, &ckpt).unwrap(), None);

        // A byte that differs is named.
        let mut bad = good.clone();
        bad[5] ^= 1;
        let why = compare_entries(&entries, |_| Ok(bad.clone()), &ckpt)
            .unwrap()
            .unwrap();
        assert!(why.contains("byte 5 of \"w\""), "{why}");

        // The empty tensor's shape is the one its name carries.
        let wrong = vec![
            entries[0].clone(),
            entry(
                empty_entry_name("e", &[0, 4]).unwrap(),
                Dtype::F32,
                vec![1],
                4,
            ),
        ];
        let why = compare_entries(&wrong, |_| Ok(good.clone()), &ckpt)
            .unwrap()
            .unwrap();
        assert!(why.contains("\"e\" is f32 [0, 4]"), "{why}");
    }

    #[test]
    fn a_tied_entry_reads_the_bytes_of_the_entry_it_names() {
        let dir = tempfile::tempdir().unwrap();
        // The checkpoint has w and e; a set that ties e to w is compared
        // as w's dtype, shape and bytes, which e's are not.
        let ckpt = checkpoint(dir.path());
        let entries = vec![
            entry("w".into(), Dtype::F32, vec![2, 2], 16),
            entry(alias_entry_name(0, "e"), Dtype::U8, vec![1], 1),
        ];
        let read = |_: usize| -> Result<Vec<u8>, cuda_ipc::Error> { Ok((0u8..16).collect()) };
        let why = compare_entries(&entries, read, &ckpt).unwrap().unwrap();
        assert!(
            why.contains("\"e\" is f32 [2, 2], the checkpoint's is f32 [0, 3]"),
            "{why}"
        );
        // An alias of an entry after it, or of itself, is refused.
        let entries = vec![
            entry(alias_entry_name(1, "w"), Dtype::U8, vec![1], 1),
            entry("e".into(), Dtype::F32, vec![0, 3], 0),
        ];
        let why = compare_entries(&entries, read, &ckpt).unwrap().unwrap();
        assert!(why.contains("\"w\" is tied to entry 1"), "{why}");
    }
}
