//! Whether the caller of a load could read the checkpoint itself, decided
//! on the descriptors the service reads.
//!
//! The service opens checkpoints as its own uid; without this rule a
//! caller of another allowed uid could have it load (and then read as a
//! set) a file only the service's uid may read. The rule: a caller that is
//! the service's own uid may load anything the service can read; any other
//! caller only files it owns with the owner's read bit, or files anyone may
//! read (and a directory that is searched for the checkpoint, likewise).
//! Group permissions are not trusted (the service does not know the
//! caller's groups).
//!
//! **When and on what.** The checkpoint is opened through
//! [`Checkpoint::open_with`] with the rule as its
//! [`ReadPolicy`]: each file is opened with `O_PATH` (nothing read, a
//! FIFO or device never opened), the rule is applied to `fstat` of that
//! descriptor, and only then is the same inode opened for reading. A link
//! flipped between a secret and the caller's own file changes which file
//! is opened, never which file was checked. A refused file is not read at
//! all, so no error says anything of its contents (a damaged header's
//! tensor names); the refusal names its path, owner and mode, which
//! anyone who may search its directory can see.
//!
//! **Not covered.** The directories on the path are not checked: a file
//! anyone may read inside a directory the caller cannot enter passes. A
//! guard against mistakes and casual misuse, not a sandbox: allow only
//! uids you trust (`--allow-uid`).
//!
//! **Size.** The same policy asks the caller's quota about the
//! checkpoint's bytes once every file's header length is known and before
//! any header is parsed (see the catalog's "Admission").

use std::cell::RefCell;
use std::path::Path;
use std::sync::Mutex;

use super::catalog::Catalog;
use crate::channel::CallError;
use crate::checkpoint::{Checkpoint, FileMeta, ReadPolicy};
use crate::error::{Error, Result};

/// Whether `caller` may have the service (running as `service_uid`) read
/// `file`, whose descriptor's `fstat` is `meta`.
///
/// # Errors
/// A sentence naming the file, its owner and mode, and what to do.
pub(super) fn may_read_as(
    caller: u32,
    service_uid: u32,
    file: &Path,
    meta: &FileMeta,
) -> std::result::Result<(), String> {
    if caller == service_uid {
        return Ok(());
    }
    let own = meta.uid == caller && meta.mode & 0o400 != 0;
    if own || meta.mode & 0o004 != 0 {
        return Ok(());
    }
    let (what, verb, fix) = if meta.is_dir {
        ("directory", "search", "chmod o+r")
    } else {
        ("file", "load", "chmod o+r")
    };
    Err(format!(
        "uid {caller} may not have the service {verb} {}: the {what} is owned by uid {} with \
         mode {:04o}, and the service reads for another uid only what that uid owns (and may \
         read) or what anyone may read; make it readable ({fix}), or load it as uid \
         {service_uid}",
        file.display(),
        meta.uid,
        meta.mode & 0o7777
    ))
}

/// The rule and the quota as a [`ReadPolicy`]; remembers its refusal, so
/// that the caller hears it with its own code.
struct CallerPolicy<'a> {
    caller: u32,
    service_uid: u32,
    quota: &'a dyn Fn(u64) -> std::result::Result<(), CallError>,
    refusal: RefCell<Option<CallError>>,
}

impl CallerPolicy<'_> {
    fn refuse(&self, file: &Path, e: CallError) -> Error {
        let out = Error::Checkpoint {
            file: file.to_path_buf(),
            field: e.code.clone(),
            reason: e.message.clone(),
        };
        *self.refusal.borrow_mut() = Some(e);
        out
    }
}

impl ReadPolicy for CallerPolicy<'_> {
    fn may_read(&self, path: &Path, meta: &FileMeta) -> Result<()> {
        may_read_as(self.caller, self.service_uid, path, meta)
            .map_err(|m| self.refuse(path, CallError::new("not_readable", m)))
    }

    fn may_load(&self, bytes: u64) -> Result<()> {
        (self.quota)(bytes).map_err(|e| self.refuse(Path::new(""), e))
    }
}

/// Opens the checkpoint at `path` for `caller` (see the module docs);
/// `quota(bytes)` is asked before any header is parsed.
///
/// # Errors
/// `not_readable` for a file or directory the caller may not read, the
/// quota's refusal, `checkpoint` for the checkpoint's own errors.
pub(super) fn open_for(
    caller: u32,
    service_uid: u32,
    path: &Path,
    quota: &dyn Fn(u64) -> std::result::Result<(), CallError>,
) -> std::result::Result<Checkpoint, CallError> {
    let policy = CallerPolicy {
        caller,
        service_uid,
        quota,
        refusal: RefCell::new(None),
    };
    Checkpoint::open_with(path, &policy).map_err(|e| {
        policy
            .refusal
            .take()
            .unwrap_or_else(|| CallError::new("checkpoint", e.to_string()))
    })
}

/// The size check of a load of set `set` for `uid`: the catalog's
/// admission ([`Catalog::check_admit`]: the service stopping, the name
/// taken, the quota), asked before any header is parsed.
pub(super) fn room_for<'a>(
    catalog: &'a Mutex<Catalog>,
    uid: u32,
    set: &'a str,
) -> impl Fn(u64) -> std::result::Result<(), CallError> + 'a {
    move |bytes| {
        super::locked(catalog)
            .check_admit(uid, set, bytes)
            .map_err(|e| super::refused(&e))
    }
}

#[cfg(test)]
#[path = "access_tests.rs"]
mod tests;
