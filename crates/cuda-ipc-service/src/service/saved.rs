//! A service's sets saved as safetensors files, and a service started
//! again from them (`cuda-ipc save`, `serve --service --restore DIR`).
//!
//! [`save`] runs in the saver's process, as a reader: it attaches the set
//! read-only (a lease holds that version still; readers and a writer of
//! the next version go on meanwhile) and writes it with
//! [`crate::saver::save_set`], under the saver's own uid and permissions.
//! The header's `__metadata__` names the set ([`SET_KEY`]) and its version
//! ([`VERSION_KEY`]); the file is an ordinary safetensors checkpoint.
//!
//! [`Service::load_saved`] loads every `*.safetensors` file of a directory
//! as the set its metadata names (or, lacking it, its file name without
//! the extension), at the version saved where the name's versions allow.
//! Each set belongs to its file's owner, loaded as that uid would load it
//! (the same access rule and quota as a `load` call): a file cannot give
//! anyone a set they could not have loaded themselves. A set the service
//! holds already (kept through a restart, which is newer than any file)
//! is left as it is.

use std::path::{Path, PathBuf};

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::exchange::Subscriber;
use crate::saver::{SaveOptions, SaveReport, save_set};

use super::admin::{LoadAnswer, LoadRequest, LsRequest};
use super::writer::call;
use super::{Service, locked};
use crate::device::Device;

/// The metadata key that names the set a file was saved from.
pub const SET_KEY: &str = "cuda_ipc.set";
/// The metadata key of the version saved.
pub const VERSION_KEY: &str = "cuda_ipc.version";

/// The file name a set is saved under in a directory: its name with every
/// character but ASCII letters, digits, `-`, `_` and `.` made `_` (and a
/// leading `.` too), then `.safetensors`. Two names may share one; the
/// file's metadata keeps the set's own.
pub fn file_name_for(set: &str) -> String {
    let mut name: String = set
        .chars()
        .map(|c| match c {
            'a'..='z' | 'A'..='Z' | '0'..='9' | '-' | '_' | '.' => c,
            _ => '_',
        })
        .collect();
    if name.starts_with('.') {
        name.replace_range(..1, "_");
    }
    name + ".safetensors"
}

/// What [`save`] did.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Saved {
    /// The set's name.
    pub set: String,
    /// The version saved.
    pub version: u64,
    /// What the save did (its `path` is the file written).
    pub report: SaveReport,
}

impl Saved {
    /// What the save did, as `cuda-ipc save --json` prints it and Python's
    /// `save` returns it.
    pub fn to_json(&self) -> serde_json::Value {
        let r = &self.report;
        serde_json::json!({
            "set": self.set,
            "version": self.version,
            "path": r.path,
            "tensors": r.tensors,
            "aliases_left_out": r.aliases,
            "bytes": r.payload_bytes,
            "file_bytes": r.file_bytes,
            "streams": r.streams,
            "save_s": r.elapsed.as_secs_f64(),
            "reserve_s": r.reserve.as_secs_f64(),
            "copy_s": r.copy.as_secs_f64(),
            "flush_s": r.flush.as_secs_f64(),
            "written": if r.mapped { "mapped" } else { "pwrite" },
            "gb_per_s": r.gb_per_s(),
        })
    }
}

/// The version of `set` the service serves now.
fn current_version(subscriber: &Subscriber, set: &str) -> Result<u64> {
    call(subscriber, &LsRequest::default())?
        .sets
        .into_iter()
        .find(|s| s.name == set)
        .map(|s| s.version)
        .ok_or_else(|| {
            Error::arg(
                "set",
                format!("the service holds no set {set:?} (`cuda-ipc ls` lists them)"),
            )
        })
}

/// How many times [`save`] attaches again when a commit lands between its
/// look at the version and its attach.
const ATTACH_TRIES: usize = 5;

/// Saves the current version of the service's set `set` as a safetensors
/// file at `dest` (a directory: the file [`file_name_for`] in it), from
/// this process, through `subscriber` (connected to the service on
/// `device`). See the module docs.
///
/// # Errors
/// The service holds no such set; it commits new versions faster than
/// one can be attached (5 times); the attach's and
/// [`save_set`]'s errors.
pub fn save(
    subscriber: &Subscriber,
    device: &Device,
    set: &str,
    dest: &Path,
    options: &SaveOptions,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<Saved> {
    let path: PathBuf = if dest.is_dir() {
        dest.join(file_name_for(set))
    } else {
        dest.to_path_buf()
    };
    for _ in 0..ATTACH_TRIES {
        let before = current_version(subscriber, set)?;
        let attached = subscriber.attach_set(set)?;
        // Versions only grow: the same one on both sides of the attach is
        // the one attached.
        if current_version(subscriber, set)? != before {
            subscriber.release_set(attached)?;
            continue;
        }
        let options = options
            .clone()
            .with_metadata(SET_KEY, set)
            .with_metadata(VERSION_KEY, before.to_string());
        let saved = save_set(device, &attached, &path, &options, progress);
        subscriber.release_set(attached)?;
        return Ok(Saved {
            set: set.to_owned(),
            version: before,
            report: saved?,
        });
    }
    Err(Error::arg(
        "set",
        format!(
            "{set:?} took a new version at each of {ATTACH_TRIES} attaches; save it when its \
             writer pauses"
        ),
    ))
}

/// One file of [`Service::load_saved`] and what became of it.
#[derive(Debug)]
#[non_exhaustive]
pub struct SavedLoad {
    /// The file.
    pub path: PathBuf,
    /// The set it names.
    pub set: String,
    /// Loaded (the service's answer), left (the service holds the set
    /// already: `Ok(None)`), or why not.
    pub outcome: std::result::Result<Option<LoadAnswer>, String>,
}

impl Service {
    /// Loads every `*.safetensors` file in `dir` (not its subdirectories;
    /// names starting with `.` are skipped, as a save's unfinished files
    /// are) as the set its metadata names, in file-name order. See the
    /// module docs. A file that cannot be loaded is reported in its
    /// [`SavedLoad`] and the others still are.
    ///
    /// # Errors
    /// `dir` cannot be listed.
    pub fn load_saved(&self, dir: &Path) -> Result<Vec<SavedLoad>> {
        let listing = std::fs::read_dir(dir).map_err(|e| {
            Error::io(
                format!("cannot list the saved sets in {}", dir.display()),
                e,
            )
        })?;
        let mut files: Vec<PathBuf> = listing
            .filter_map(std::result::Result::ok)
            .map(|e| e.path())
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    && p.file_name()
                        .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
            })
            .collect();
        files.sort();
        Ok(files.into_iter().map(|p| self.load_one_saved(p)).collect())
    }

    fn load_one_saved(&self, path: PathBuf) -> SavedLoad {
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        let header = std::fs::symlink_metadata(&path)
            .map_err(|e| format!("cannot look at it: {e}"))
            .and_then(|meta| {
                let ckpt = Checkpoint::open(&path).map_err(|e| e.to_string())?;
                Ok((meta, ckpt.files().first().map(|f| f.metadata().clone())))
            });
        let (meta, metadata) = match header {
            Ok(h) => h,
            Err(reason) => {
                return SavedLoad {
                    path,
                    set: stem,
                    outcome: Err(reason),
                };
            }
        };
        let metadata = metadata.unwrap_or_default();
        let set = metadata.get(SET_KEY).cloned().unwrap_or(stem);
        let outcome = self.load_saved_as(&path, &set, &meta, metadata.get(VERSION_KEY));
        SavedLoad { path, set, outcome }
    }

    fn load_saved_as(
        &self,
        path: &Path,
        set: &str,
        meta: &std::fs::Metadata,
        version: Option<&String>,
    ) -> std::result::Result<Option<LoadAnswer>, String> {
        use std::os::unix::fs::MetadataExt;
        let inner = &self.inner;
        if locked(&inner.catalog).get(set).is_some() {
            return Ok(None);
        }
        if let Some(v) = version {
            let v: u64 = v
                .parse()
                .map_err(|_| format!("its {VERSION_KEY} {v:?} is not a version number"))?;
            locked(&inner.catalog).continue_versions(set, v.saturating_sub(1));
        }
        let absolute = std::path::absolute(path).map_err(|e| e.to_string())?;
        let request = LoadRequest::new(set, absolute.to_string_lossy());
        super::dispatch::Ops::load(&**inner, meta.uid(), &request)
            .map(Some)
            .map_err(|e| format!("{} ({})", e.message, e.code))
    }
}
