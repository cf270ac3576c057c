//! The file a save writes: a hidden temporary file in the destination's
//! directory, its whole length reserved before a byte is copied, written
//! at offsets by several threads at once, then flushed to the disk and
//! renamed into place. A save that fails or is dropped leaves no file and
//! never a torn one under the destination's name.

use std::ffi::OsString;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use rustix::fs::{AtFlags, FallocateFlags, Mode, OFlags, RenameFlags};
use rustix::io::Errno;

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
}

fn io(path: &Path, what: &str, e: impl Into<std::io::Error>) -> Error {
    Error::io(format!("{what} {}", path.display()), e.into())
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
            OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::CLOEXEC,
            Mode::from_raw_mode(0o644),
        )
        .map_err(|e| io(&parent.join(&temp), "cannot create", e))?;
        let out = Output {
            file: File::from(fd),
            dir,
            temp,
            name,
            path: path.to_path_buf(),
            overwrite,
            finished: false,
        };
        match rustix::fs::fallocate(&out.file, FallocateFlags::empty(), 0, len) {
            Ok(()) => {}
            // A file system that cannot reserve (tmpfs can; some FUSE
            // ones cannot): the length alone, space found as it is written.
            Err(Errno::OPNOTSUPP | Errno::NOSYS) => out
                .file
                .set_len(len)
                .map_err(|e| io(path, "cannot size", e))?,
            Err(Errno::NOSPC) => {
                return Err(Error::io(
                    format!(
                        "no room for {len} bytes beside {} (the file system is full)",
                        path.display()
                    ),
                    Errno::NOSPC.into(),
                ));
            }
            Err(e) => return Err(io(path, "cannot reserve the length of", e)),
        }
        Ok(out)
    }

    /// The destination.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes `bytes` at `offset` (from any thread).
    pub fn write_at(&self, bytes: &[u8], offset: u64) -> Result<()> {
        self.file
            .write_all_at(bytes, offset)
            .map_err(|e| io(&self.path, "cannot write", e))
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
}
