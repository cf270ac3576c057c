//! A checkpoint's files, opened and read through their descriptors.
//!
//! Every file (and a directory that is searched) is first opened with
//! `O_PATH`: no byte is read, a FIFO does not block, a device is not opened
//! (its driver is never called). What that descriptor names is then
//! decided on `fstat` of it, never on the path: the caller's [`ReadPolicy`]
//! says whether it may be read, from its owner and mode (first, so that
//! nothing more is said of what it refuses), and it must be a regular file
//! (or a directory, where one is expected). Only then is the same file
//! opened for reading, through
//! `/proc/self/fd` (the inode the decision was made on, whatever the path
//! names by now), and checked to be the same inode. Links are followed,
//! as Hugging Face's cache needs (its snapshots are links to its blobs): a
//! link flipped while a checkpoint opens changes which file is opened, and
//! that file is the one decided on.
//!
//! Bytes are read with `pread` into the caller's buffers, never mapped: a
//! file truncated while it is read is an error naming it, not a `SIGBUS`.
//! Every read is bounded by what `fstat` said when the file was opened.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::Path;

use rustix::fs::{FileType, Mode, OFlags};

use super::err;
use crate::error::{Error, Result};

/// What `fstat` says of a checkpoint's file or directory, opened but not
/// yet read: what a [`ReadPolicy`] decides on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct FileMeta {
    /// The owner's user id.
    pub uid: u32,
    /// The owner's group id.
    pub gid: u32,
    /// The permission bits (`0o7777` of `st_mode`).
    pub mode: u32,
    /// The length in bytes (`st_size`).
    pub len: u64,
    /// Whether it is a directory.
    pub is_dir: bool,
}

/// What may be read while a checkpoint opens
/// ([`Checkpoint::open_with`](super::Checkpoint::open_with)): a service
/// that opens checkpoints for other users says no to what they could not
/// read themselves, and to more bytes than they may hold.
pub trait ReadPolicy {
    /// Whether `path` may be read (for a directory: searched and listed),
    /// decided on `meta`, the `fstat` of the descriptor that will be read.
    /// Called before any byte of it is read.
    ///
    /// # Errors
    /// Any refusal; the open stops with it.
    fn may_read(&self, path: &Path, meta: &FileMeta) -> Result<()>;

    /// Whether a checkpoint whose files hold `bytes` bytes after their
    /// headers (its tensors' bytes, once the headers are checked) may be
    /// opened. Called once every file's header length has been read, before
    /// any header is read or parsed.
    ///
    /// # Errors
    /// Any refusal; the open stops with it.
    fn may_load(&self, bytes: u64) -> Result<()>;
}

/// The policy of [`Checkpoint::open`](super::Checkpoint::open): whatever
/// this process may read.
#[derive(Clone, Copy, Debug, Default)]
pub struct AnyReadable;

impl ReadPolicy for AnyReadable {
    fn may_read(&self, _: &Path, _: &FileMeta) -> Result<()> {
        Ok(())
    }

    fn may_load(&self, _: u64) -> Result<()> {
        Ok(())
    }
}

/// What a checkpoint file is to its reader, for error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Kind {
    /// A `.safetensors` file.
    Tensors,
    /// A sharded checkpoint's index.
    Index,
}

impl Kind {
    fn noun(self) -> &'static str {
        match self {
            Kind::Tensors => "a safetensors file",
            Kind::Index => "a checkpoint index",
        }
    }
}

/// A descriptor opened with `O_PATH` and what `fstat` said of it.
pub(super) struct PathFd {
    fd: OwnedFd,
    meta: FileMeta,
    /// Whether it is a regular file.
    regular: bool,
    dev: u64,
    ino: u64,
}

impl PathFd {
    /// What `fstat` said.
    pub(super) fn meta(&self) -> &FileMeta {
        &self.meta
    }

    /// Opens `name` under this directory with `O_PATH` (following links).
    pub(super) fn open_under(&self, name: &Path, shown: &Path) -> Result<PathFd> {
        let fd = rustix::fs::openat(
            self.fd.as_fd(),
            name,
            OFlags::PATH | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io_err(shown, &e.into()))?;
        PathFd::from_fd(fd, shown)
    }

    /// Whether `name` names anything under this directory (following
    /// links: a dangling link does not).
    pub(super) fn exists_under(&self, name: &Path) -> bool {
        rustix::fs::statat(self.fd.as_fd(), name, rustix::fs::AtFlags::empty()).is_ok()
    }

    fn from_fd(fd: OwnedFd, shown: &Path) -> Result<PathFd> {
        let st = rustix::fs::fstat(&fd).map_err(|e| io_err(shown, &e.into()))?;
        let file_type = FileType::from_raw_mode(st.st_mode);
        Ok(PathFd {
            fd,
            meta: FileMeta {
                uid: st.st_uid,
                gid: st.st_gid,
                mode: st.st_mode & 0o7777,
                len: u64::try_from(st.st_size).unwrap_or(0),
                is_dir: file_type == FileType::Directory,
            },
            regular: file_type == FileType::RegularFile,
            #[allow(clippy::useless_conversion)] // `st_dev`'s type differs by target
            dev: u64::from(st.st_dev),
            #[allow(clippy::useless_conversion)]
            ino: u64::from(st.st_ino),
        })
    }

    /// The same inode, opened for reading (through `/proc/self/fd`), after
    /// checking that `fstat` of the new descriptor names it too.
    fn reopen(&self, shown: &Path) -> Result<File> {
        use std::os::fd::AsRawFd;
        let proc_path = format!("/proc/self/fd/{}", self.fd.as_raw_fd());
        let file = File::open(&proc_path).map_err(|e| {
            let hint = if e.kind() == std::io::ErrorKind::NotFound {
                " (is /proc mounted? a checkpoint is read through /proc/self/fd)"
            } else {
                ""
            };
            err(
                shown,
                "file",
                format!("cannot be opened for reading ({e}){hint}"),
            )
        })?;
        let st = rustix::fs::fstat(&file).map_err(|e| io_err(shown, &e.into()))?;
        #[allow(clippy::useless_conversion)]
        let same = u64::from(st.st_dev) == self.dev && u64::from(st.st_ino) == self.ino;
        if !same {
            return Err(err(
                shown,
                "file",
                "reopened through /proc/self/fd as another file: /proc is not the kernel's; \
                 not read",
            ));
        }
        Ok(file)
    }
}

/// Opens `path` with `O_PATH` (following links): nothing is read.
pub(super) fn open_path(path: &Path) -> Result<PathFd> {
    let fd = rustix::fs::open(path, OFlags::PATH | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| io_err(path, &e.into()))?;
    PathFd::from_fd(fd, path)
}

/// The directory that holds `path` (`.` for a bare name), opened with
/// `O_PATH`.
pub(super) fn open_parent(path: &Path) -> Result<PathFd> {
    let parent = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let dir = open_path(parent)?;
    if !dir.meta.is_dir {
        return Err(err(parent, "directory", "not a directory"));
    }
    Ok(dir)
}

/// The names in directory `dir` (decided on by `policy` first), read
/// through its descriptor.
pub(super) fn list_dir(dir: &PathFd, shown: &Path, policy: &dyn ReadPolicy) -> Result<Vec<String>> {
    use std::os::fd::AsRawFd;
    policy.may_read(shown, &dir.meta)?;
    let proc_path = format!("/proc/self/fd/{}", dir.fd.as_raw_fd());
    let entries = std::fs::read_dir(&proc_path).map_err(|e| io_err(shown, &e))?;
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| io_err(shown, &e))?;
        names.push(entry.file_name().to_string_lossy().into_owned());
    }
    Ok(names)
}

/// A regular file opened for reading after `policy` allowed it, and its
/// length when it was opened.
#[derive(Debug)]
pub(super) struct ReadFile {
    file: File,
    len: u64,
}

impl ReadFile {
    /// Decides on `fd` (a regular file, allowed by `policy`) and opens it
    /// for reading. `kind` names what it should be in errors.
    pub(super) fn open(
        fd: &PathFd,
        shown: &Path,
        kind: Kind,
        policy: &dyn ReadPolicy,
    ) -> Result<ReadFile> {
        // The policy first: what a caller may not read is not described.
        policy.may_read(shown, &fd.meta)?;
        if !fd.regular {
            let what = if fd.meta.is_dir {
                "a directory"
            } else {
                "a device, pipe or socket"
            };
            return Err(err(
                shown,
                "file",
                format!(
                    "not a regular file ({what}): not {}; it was not opened for reading",
                    kind.noun()
                ),
            ));
        }
        let file = fd.reopen(shown)?;
        Ok(ReadFile {
            file,
            len: fd.meta.len,
        })
    }

    /// The file's length when it was opened.
    pub(super) fn len(&self) -> u64 {
        self.len
    }

    /// Fills `buf` from `offset`, which with `buf`'s length lies inside
    /// the length the file had when it was opened.
    ///
    /// # Errors
    /// [`Error::OutOfBounds`] for a range past that length; an
    /// [`Error::Checkpoint`] naming the file when it has become shorter
    /// (truncated while it was read) or the read failed.
    pub(super) fn read_at(&self, shown: &Path, offset: u64, buf: &mut [u8]) -> Result<()> {
        Error::check_range(offset, buf.len() as u64, self.len)?;
        self.file.read_exact_at(buf, offset).map_err(|e| {
            if e.kind() == std::io::ErrorKind::UnexpectedEof {
                err(
                    shown,
                    "file",
                    format!(
                        "ended before byte {} of the {} it held when it was opened: it was \
                         truncated or rewritten while it was read; write checkpoints to a new \
                         file and rename it, then load again",
                        offset + buf.len() as u64,
                        self.len
                    ),
                )
            } else {
                err(shown, "file", format!("cannot be read ({e})"))
            }
        })
    }
}

/// An I/O error on `path`, for people.
pub(super) fn io_err(path: &Path, e: &std::io::Error) -> Error {
    let what = match e.kind() {
        std::io::ErrorKind::NotFound => "no such file or directory".to_string(),
        std::io::ErrorKind::PermissionDenied => {
            "permission denied: the file must be readable by this process's user".to_string()
        }
        _ => format!("cannot be read ({e})"),
    };
    err(path, "file", what)
}
