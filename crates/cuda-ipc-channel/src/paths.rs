//! Where sockets live: a private per-user directory and validated names.

use std::path::{Path, PathBuf};

use rustix::fs::{FileType, Mode};
use rustix::io::Errno;

use super::{ChannelError, own_uid};

/// The longest socket name [`default_socket_path`] accepts.
pub const MAX_SOCKET_NAME_LEN: usize = 64;

/// The directory for channel sockets: `$XDG_RUNTIME_DIR/cuda-ipc` when
/// `XDG_RUNTIME_DIR` names an existing absolute directory, else
/// `/tmp/cuda-ipc-<uid>`.
///
/// The directory is created with mode `0700` if missing, and checked with
/// [`ensure_private_dir`]: it is refused (with
/// [`ChannelError::InsecureDirectory`]) unless it is a real directory (not a
/// symbolic link) owned by us and closed to group and others. A directory
/// that someone else made in `/tmp` could otherwise let them replace our
/// sockets with theirs.
pub fn default_socket_dir() -> Result<PathBuf, ChannelError> {
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(base) if Path::new(&base).is_absolute() && Path::new(&base).is_dir() => {
            Path::new(&base).join("cuda-ipc")
        }
        _ => PathBuf::from(format!("/tmp/cuda-ipc-{}", own_uid())),
    };
    ensure_private_dir(&dir)?;
    Ok(dir)
}

/// The socket path for a channel name: `<default_socket_dir()>/<name>.sock`.
///
/// The name must pass [`validate_socket_name`].
pub fn default_socket_path(name: &str) -> Result<PathBuf, ChannelError> {
    validate_socket_name(name)?;
    Ok(default_socket_dir()?.join(format!("{name}.sock")))
}

/// Checks a channel name: 1 to [`MAX_SOCKET_NAME_LEN`] characters from
/// `A-Z a-z 0-9 . _ -`, not starting with a dot.
pub fn validate_socket_name(name: &str) -> Result<(), ChannelError> {
    let invalid = |reason: String| ChannelError::InvalidName {
        name: name.to_owned(),
        reason,
    };
    if name.is_empty() {
        return Err(invalid("a channel name must not be empty".into()));
    }
    if name.len() > MAX_SOCKET_NAME_LEN {
        return Err(invalid(format!(
            "a channel name has at most {MAX_SOCKET_NAME_LEN} characters, this one has {}",
            name.len()
        )));
    }
    if let Some(c) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(invalid(format!(
            "{c:?} is not allowed; use only letters, digits, '.', '_' and '-'"
        )));
    }
    if name.starts_with('.') {
        return Err(invalid("a channel name must not start with '.'".into()));
    }
    Ok(())
}

/// Creates `dir` with mode `0700` if it does not exist (its parent must),
/// then checks that it is private: a directory, not a symbolic link, owned
/// by our effective user id, with no permission bits for group or others.
///
/// An existing directory is never changed; a bad one is refused with
/// [`ChannelError::InsecureDirectory`], whose message says how to fix it.
pub fn ensure_private_dir(dir: &Path) -> Result<(), ChannelError> {
    let created = match rustix::fs::mkdir(dir, Mode::from_raw_mode(0o700)) {
        Ok(()) => true,
        Err(Errno::EXIST) => false,
        Err(e) => {
            return Err(ChannelError::io(
                format!("cannot create the socket directory {}", dir.display()),
                e,
            ));
        }
    };
    if created {
        // The umask may have removed bits we need; set exactly 0700.
        rustix::fs::chmod(dir, Mode::from_raw_mode(0o700)).map_err(|e| {
            ChannelError::io(format!("cannot set the mode of {}", dir.display()), e)
        })?;
    }
    let insecure = |reason: String| ChannelError::InsecureDirectory {
        path: dir.to_owned(),
        reason,
    };
    let st = rustix::fs::lstat(dir).map_err(|e| {
        ChannelError::io(
            format!("cannot inspect the socket directory {}", dir.display()),
            e,
        )
    })?;
    let file_type = FileType::from_raw_mode(st.st_mode);
    if file_type != FileType::Directory {
        return Err(insecure(format!(
            "it is {} rather than a directory; remove it, or choose another directory \
             (set XDG_RUNTIME_DIR or pass an explicit socket path)",
            match file_type {
                FileType::Symlink => "a symbolic link",
                _ => "a file",
            }
        )));
    }
    let uid = own_uid();
    if st.st_uid != uid {
        return Err(insecure(format!(
            "it is owned by uid {}, not by this user (uid {uid}), so its owner could replace \
             our sockets; remove it, or choose another directory",
            st.st_uid
        )));
    }
    let mode = st.st_mode & 0o7777;
    if mode & 0o077 != 0 {
        return Err(insecure(format!(
            "its mode is {mode:04o}, which lets other users in; run `chmod 700 {}`",
            dir.display()
        )));
    }
    if mode & 0o700 != 0o700 {
        return Err(insecure(format!(
            "its mode is {mode:04o}, which does not let its owner use it; run `chmod 700 {}`",
            dir.display()
        )));
    }
    Ok(())
}
