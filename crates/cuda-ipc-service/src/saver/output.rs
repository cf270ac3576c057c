//! The file a save writes: a hidden temporary file in the destination's
//! directory, its whole length reserved before a byte is copied, written
//! at offsets by several threads at once, then flushed to the disk and
//! renamed into place. A save that fails or is dropped leaves no file and
//! never a torn one under the destination's name.
//!
//! # Written through a shared mapping
//! `pwrite` to one file holds the file's lock for each call, so several
//! threads' writes go one at a time (and, on tmpfs, each allocates and
//! clears its pages under it). The file is instead mapped shared and each
//! thread copies its pieces into the mapping: the pages are allocated by
//! the threads' own page faults, in parallel. Each piece's pages are first
//! made present with `MADV_POPULATE_WRITE`, which fails cleanly (no
//! `SIGBUS`) where the file system has no room, so on tmpfs the length is
//! not reserved with `fallocate` (which clears every page on one thread);
//! elsewhere it is (cheap: no page is written). Where the file cannot be
//! mapped shared, or the kernel lacks `MADV_POPULATE_WRITE` (before 5.14),
//! the pieces go by `pwrite`. The temporary file's name is hidden and its
//! owner's alone: another process of the same user that truncates it
//! during the save kills the saving process with `SIGBUS`.
// `unsafe`: the shared mapping and the copies into it, with SAFETY notes.
#![allow(unsafe_code)]

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

use rustix::fs::{AtFlags, FallocateFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;
use rustix::mm::{Advice, MapFlags, ProtFlags};

use crate::error::{Error, Result};

/// The temporary file of a save in progress (see the module docs).
#[derive(Debug)]
pub(crate) struct Output {
    dir: File,
    temp: OsString,
    name: OsString,
    path: PathBuf,
    file: File,
    overwrite: bool,
    finished: bool,
    /// The whole file mapped shared, where it could be (see the module
    /// docs).
    mapped: Option<Mapped>,
}

/// A shared read-write mapping of the whole temporary file.
#[derive(Debug)]
struct Mapped {
    ptr: *mut u8,
    len: usize,
    /// Set once `MADV_POPULATE_WRITE` is refused as unknown: `pwrite`
    /// from then on.
    no_populate: AtomicBool,
}

// SAFETY: the mapping is plain memory shared by the threads of one save;
// each writes only its own pieces' bytes (`write_at` callers write
// disjoint ranges), and the mapping is unmapped only when the `Output`
// drops, after every thread has ended.
unsafe impl Send for Mapped {}
// SAFETY: as for `Send`.
unsafe impl Sync for Mapped {}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr+len` is this mapping, and nothing uses it any
        // more (it drops with its `Output`). An unmap error leaves the
        // mapping until the process ends; nothing else is lost.
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// Whether `file` is on tmpfs (whose `fallocate` clears every page on one
/// thread).
// `f_type`'s integer type differs between architectures.
#[allow(clippy::useless_conversion)]
fn on_tmpfs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    rustix::fs::fstatfs(file).is_ok_and(|s| i64::from(s.f_type) == TMPFS_MAGIC)
}

fn io(path: &Path, what: &str, e: impl Into<std::io::Error>) -> Error {
    Error::io(format!("{what} {}", path.display()), e.into())
}

fn no_room(len: u64, path: &Path, e: Errno) -> Error {
    Error::io(
        format!(
            "no room for {len} bytes beside {} (the file system is full, or its size limit \
             reached); free some room or save elsewhere",
            path.display()
        ),
        e.into(),
    )
}

impl Output {
    /// Creates the temporary file for `path` and reserves `len` bytes.
    ///
    /// # Errors
    /// `path` names no file (it ends in `/` or `..`), its directory is
    /// missing, `path` exists and `overwrite` is off (checked here, before
    /// the copy, and again, atomically, at the rename), the file system
    /// has no room for `len` bytes; each naming the path.
    pub fn create(path: &Path, len: u64, overwrite: bool) -> Result<Output> {
        let name = path
            .file_name()
            .filter(|_| !path.as_os_str().as_bytes().ends_with(b"/"))
            .ok_or_else(|| {
                Error::arg(
                    "save",
                    format!(
                        "{} names no file; give a file path such as DIR/model.safetensors",
                        path.display()
                    ),
                )
            })?
            .to_os_string();
        let parent = match path.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        let dir = rustix::fs::open(
            parent,
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| io(parent, "cannot open the directory", e))?;
        let dir = File::from(dir);
        match rustix::fs::statat(&dir, &*name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) if rustix::fs::FileType::from_raw_mode(st.st_mode).is_dir() => {
                return Err(Error::arg(
                    "save",
                    format!("{} is a directory; give a file path in it", path.display()),
                ));
            }
            Ok(_) if !overwrite => {
                return Err(Error::arg(
                    "save",
                    format!(
                        "{} exists; choose another path, or overwrite it (--force, overwrite=True)",
                        path.display()
                    ),
                ));
            }
            Ok(_) | Err(Errno::NOENT) => {}
            Err(e) => return Err(io(path, "cannot look at", e)),
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let mut temp = OsString::from(".");
        temp.push(&name);
        temp.push(format!(".partial-{}-{nanos:x}", std::process::id()));
        let fd = rustix::fs::openat(
            &dir,
            &*temp,
            OFlags::RDWR | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .map_err(|e| io(&parent.join(&temp), "cannot create", e))?;
        let mut out = Output {
            file: File::from(fd),
            dir,
            temp,
            name,
            path: path.to_path_buf(),
            overwrite,
            finished: false,
            mapped: None,
        };
        let tmpfs = on_tmpfs(&out.file);
        if tmpfs {
            out.file
                .set_len(len)
                .map_err(|e| io(path, "cannot size", e))?;
        } else {
            out.reserve(len)?;
        }
        out.mapped = out.map(len);
        if tmpfs && out.mapped.is_none() {
            out.reserve(len)?;
        }
        Ok(out)
    }

    /// Maps the file shared, or `None` where it cannot be (then `pwrite`).
    fn map(&self, len: u64) -> Option<Mapped> {
        let len = usize::try_from(len).ok().filter(|&n| n > 0)?;
        // SAFETY: a new shared mapping of a file this process just created
        // under a hidden name; no existing memory is touched.
        let ptr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::SHARED,
                &self.file,
                0,
            )
        }
        .inspect_err(|e| tracing::debug!(error = %e, "the save's file cannot be mapped: pwrite"))
        .ok()?;
        Some(Mapped {
            ptr: ptr.cast(),
            len,
            no_populate: AtomicBool::new(false),
        })
    }

    /// Reserves the file's `len` bytes on its file system.
    fn reserve(&self, len: u64) -> Result<()> {
        let path = &self.path;
        if len == 0 {
            return Ok(()); // fallocate refuses a length of 0
        }
        match rustix::fs::fallocate(&self.file, FallocateFlags::empty(), 0, len) {
            Ok(()) => {}
            // A file system that cannot reserve (tmpfs can; some FUSE
            // ones cannot): the length alone, space found as it is written.
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => self
                .file
                .set_len(len)
                .map_err(|e| io(path, "cannot size", e))?,
            Err(Errno::NOSPC) => return Err(no_room(len, path, Errno::NOSPC)),
            Err(e) => return Err(io(path, "cannot reserve the length of", e)),
        }
        Ok(())
    }

    /// The destination.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` at `offset` (from any thread; the ranges of
    /// concurrent calls must not overlap).
    pub fn write_at(&self, bytes: &[u8], offset: u64) -> Result<()> {
        if let Some(m) = &self.mapped
            && !m.no_populate.load(Ordering::Relaxed)
        {
            let end = offset
                .checked_add(bytes.len() as u64)
                .and_then(|e| usize::try_from(e).ok())
                .filter(|&e| e <= m.len)
                .ok_or(Error::OutOfBounds {
                    offset,
                    len: bytes.len() as u64,
                    size: m.len as u64,
                })?;
            let start = end - bytes.len();
            if bytes.is_empty() {
                return Ok(());
            }
            // Page-aligned for madvise: a page shared with a neighbouring
            // piece is populated twice, which changes nothing.
            let page = rustix::param::page_size();
            let from = start / page * page;
            // SAFETY: `from..end` lies in the mapping (checked above);
            // populating writes no byte.
            let populated = unsafe {
                rustix::mm::madvise(
                    m.ptr.add(from).cast(),
                    end - from,
                    Advice::LinuxPopulateWrite,
                )
            };
            match populated {
                Ok(()) => {
                    // SAFETY: `start..end` lies in the mapping, whose pages
                    // are now present (no fault can fail); no other thread
                    // writes this range (the caller's contract) and nothing
                    // reads it until `finish`.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            bytes.as_ptr(),
                            m.ptr.add(start),
                            bytes.len(),
                        );
                    }
                    // The pages wholly written are unmapped here, on this
                    // thread (their bytes stay in the file's pages, dirty:
                    // the flush writes them): unmapping the whole file at
                    // the end would tear them all down on one thread.
                    let (lo, hi) = (start.div_ceil(page) * page, end / page * page);
                    if hi > lo {
                        // SAFETY: `lo..hi` lies in the mapping, inside this
                        // call's own range, which nothing reads through the
                        // mapping again. A failure only leaves the pages
                        // mapped until the end.
                        let _ = unsafe {
                            rustix::mm::madvise(
                                m.ptr.add(lo).cast(),
                                hi - lo,
                                Advice::LinuxDontNeed,
                            )
                        };
                    }
                    return Ok(());
                }
                // A kernel before 5.14: `pwrite`, here and from now on.
                Err(Errno::INVAL) => m.no_populate.store(true, Ordering::Relaxed),
                Err(e @ (Errno::FAULT | Errno::NOMEM | Errno::NOSPC)) => {
                    return Err(no_room(self.mapped_len(), &self.path, e));
                }
                Err(e) => return Err(io(&self.path, "cannot write", e)),
            }
        }
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| io(&self.path, "cannot write", e))
    }

    fn mapped_len(&self) -> u64 {
        self.mapped.as_ref().map_or(0, |m| m.len as u64)
    }

    /// Whether the pieces go through a shared mapping (see the module
    /// docs), not `pwrite`.
    pub fn is_mapped(&self) -> bool {
        self.mapped
            .as_ref()
            .is_some_and(|m| !m.no_populate.load(Ordering::Relaxed))
    }

    /// Flushes the file to the disk and renames it to the destination
    /// (refusing to replace one that appeared meanwhile unless
    /// overwriting), then flushes the directory.
    pub fn finish(mut self) -> Result<()> {
        self.file
            .sync_all()
            .map_err(|e| io(&self.path, "cannot flush", e))?;
        let flags = if self.overwrite {
            RenameFlags::empty()
        } else {
            RenameFlags::NOREPLACE
        };
        match rustix::fs::renameat_with(&self.dir, &*self.temp, &self.dir, &*self.name, flags) {
            Ok(()) => {}
            // A file system without RENAME_NOREPLACE: a hard link, which
            // never replaces, then the temporary name goes.
            Err(Errno::INVAL) if !self.overwrite => {
                rustix::fs::linkat(
                    &self.dir,
                    &*self.temp,
                    &self.dir,
                    &*self.name,
                    AtFlags::empty(),
                )
                .map_err(|e| self.rename_error(e))?;
                let _ = rustix::fs::unlinkat(&self.dir, &*self.temp, AtFlags::empty());
            }
            Err(e) => return Err(self.rename_error(e)),
        }
        self.finished = true;
        rustix::fs::fsync(&self.dir).map_err(|e| io(&self.path, "cannot flush the directory of", e))
    }

    fn rename_error(&self, e: Errno) -> Error {
        if e == Errno::EXIST {
            Error::arg(
                "save",
                format!(
                    "{} appeared while saving; it is left as it is (choose another path, or \
                     overwrite)",
                    self.path.display()
                ),
            )
        } else {
            io(&self.path, "cannot rename the saved file to", e)
        }
    }
}

impl Drop for Output {
    fn drop(&mut self) {
        if !self.finished {
            let _ = rustix::fs::unlinkat(&self.dir, &*self.temp, AtFlags::empty());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names_in(dir: &Path) -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_finished_file_appears_whole_and_a_dropped_one_not_at_all() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        let out = Output::create(&path, 8, false).unwrap();
        out.write_at(b"5678", 4).unwrap();
        out.write_at(b"1234", 0).unwrap();
        assert_eq!(names_in(dir.path()).len(), 1);
        assert!(!path.exists(), "nothing under the name before finish");
        out.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"12345678");
        assert_eq!(names_in(dir.path()), ["m.safetensors"]);

        let other = dir.path().join("n.safetensors");
        drop(Output::create(&other, 8, false).unwrap());
        assert_eq!(names_in(dir.path()), ["m.safetensors"]);
    }

    #[test]
    fn an_existing_file_is_kept_unless_overwriting() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.safetensors");
        std::fs::write(&path, b"old").unwrap();
        let e = Output::create(&path, 3, false).unwrap_err();
        assert!(e.to_string().contains("exists"), "{e}");
        // One that appears during the save is not replaced either.
        let late = dir.path().join("late");
        let out = Output::create(&late, 3, false).unwrap();
        out.write_at(b"new", 0).unwrap();
        std::fs::write(&late, b"theirs").unwrap();
        let e = out.finish().unwrap_err();
        assert!(e.to_string().contains("appeared"), "{e}");
        assert_eq!(std::fs::read(&late).unwrap(), b"theirs");
        assert_eq!(names_in(dir.path()), ["late", "m.safetensors"]);
        // Overwriting replaces.
        let out = Output::create(&path, 3, true).unwrap();
        out.write_at(b"new", 0).unwrap();
        out.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"new");
    }

    #[test]
    fn bad_destinations_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let e = Output::create(dir.path(), 1, true).unwrap_err();
        assert!(e.to_string().contains("is a directory"), "{e}");
        let slash = PathBuf::from(format!("{}/", dir.path().join("x").display()));
        let e = Output::create(&slash, 1, true).unwrap_err();
        assert!(e.to_string().contains("names no file"), "{e}");
        let e = Output::create(&dir.path().join("no/such/m"), 1, true).unwrap_err();
        assert!(e.to_string().contains("no/such"), "{e}");
    }

    /// Threads writing disjoint pieces of `piece` bytes at once, through
    /// the mapping, in a file of `dir`: the file holds every byte (pieces
    /// of several pages are unmapped as they are written; their bytes must
    /// still reach the file).
    fn threads_write_every_byte(dir: &Path, piece: usize) -> bool {
        let path = dir.join(format!("t{piece}.safetensors"));
        let len = 16 * 4096 + 1234;
        let want: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        let out = Output::create(&path, len as u64, false).unwrap();
        let mapped = out.is_mapped();
        std::thread::scope(|s| {
            for t in 0..4 {
                let (out, want) = (&out, &want);
                s.spawn(move || {
                    // Not page-aligned, dealt in turn.
                    for at in (t * piece..len).step_by(4 * piece) {
                        let end = (at + piece).min(len);
                        out.write_at(&want[at..end], at as u64).unwrap();
                    }
                });
            }
        });
        out.finish().unwrap();
        assert_eq!(
            std::fs::read(&path).unwrap(),
            want,
            "pieces of {piece} bytes"
        );
        mapped
    }

    #[test]
    fn pieces_written_by_several_threads_through_the_mapping_are_all_there() {
        // Pieces within a page, and pieces of several pages (unmapped as
        // they are written).
        let pieces = [1000, 3 * 4096 + 100];
        let dir = tempfile::tempdir().unwrap();
        for piece in pieces {
            assert!(
                threads_write_every_byte(dir.path(), piece),
                "a local file is mapped"
            );
        }
        let shm = Path::new("/dev/shm");
        match std::fs::File::open(shm) {
            Ok(f) if on_tmpfs(&f) => {
                let dir = tempfile::tempdir_in(shm).unwrap();
                for piece in pieces {
                    assert!(
                        threads_write_every_byte(dir.path(), piece),
                        "tmpfs is mapped"
                    );
                }
            }
            _ => eprintln!("skipped the tmpfs half: /dev/shm is not a tmpfs here"),
        }
    }

    #[test]
    fn an_empty_file_is_written_without_a_mapping() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("e");
        let out = Output::create(&path, 0, false).unwrap();
        assert!(!out.is_mapped());
        out.write_at(b"", 0).unwrap();
        out.finish().unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"");
    }
}
