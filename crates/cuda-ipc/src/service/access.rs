//! Whether the caller of a load could read the checkpoint itself.
//!
//! The service opens checkpoints as its own uid; without this check a
//! caller of another allowed uid could have it load (and then read as a
//! set) a file only the service's uid may read. The check reads each
//! file's owner and mode (`stat`, following links, as the open did): a
//! caller that is the service's own uid may load anything the service can
//! read; any other caller only files it owns with the owner's read bit, or
//! files anyone may read. Group permissions are not trusted (the service
//! does not know the caller's groups), and the directories on the path are
//! not checked: a file anyone may read inside a directory the caller
//! cannot enter passes. A guard against mistakes and casual misuse, not a
//! sandbox: allow only uids you trust (`--allow-uid`).

use std::os::unix::fs::MetadataExt;
use std::path::Path;

/// Checks that `caller` may have the service (running as `service_uid`)
/// load `files`.
///
/// # Errors
/// A sentence naming the first file the caller may not read, its owner and
/// mode, and what to do.
pub(crate) fn check_readable_by<'a>(
    caller: u32,
    service_uid: u32,
    files: impl IntoIterator<Item = &'a Path>,
) -> Result<(), String> {
    if caller == service_uid {
        return Ok(());
    }
    for file in files {
        let meta = std::fs::metadata(file)
            .map_err(|e| format!("cannot read the mode of {}: {e}", file.display()))?;
        let mode = meta.mode();
        let own = meta.uid() == caller && mode & 0o400 != 0;
        if !own && mode & 0o004 == 0 {
            return Err(format!(
                "uid {caller} may not have the service load {}: it is owned by uid {} with mode \
                 {:04o}, and the service loads for another uid only files that uid owns (and may \
                 read) or that anyone may read; make it readable (chmod o+r), or load it as uid \
                 {service_uid}",
                file.display(),
                meta.uid(),
                mode & 0o7777
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;

    use super::check_readable_by;

    #[test]
    fn other_uids_load_only_their_own_or_public_files() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.safetensors");
        std::fs::write(&file, b"x").unwrap();
        let owner = std::fs::metadata(&file)
            .map(|m| std::os::unix::fs::MetadataExt::uid(&m))
            .unwrap();
        let other = owner.wrapping_add(1);
        let service = owner.wrapping_add(2);
        let set_mode = |mode: u32| {
            std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        };
        let check = |caller: u32| check_readable_by(caller, service, [file.as_path()]);

        set_mode(0o600);
        assert!(check(owner).is_ok(), "its owner");
        let e = check(other).unwrap_err();
        assert!(
            e.contains(&format!("uid {other}")) && e.contains("0600"),
            "{e}"
        );
        assert!(check(service).is_ok(), "the service's own uid");
        set_mode(0o640);
        assert!(check(other).is_err(), "group permissions are not trusted");
        set_mode(0o644);
        assert!(check(other).is_ok(), "anyone may read it");
        set_mode(0o044);
        assert!(check(owner).is_ok(), "readable by anyone, its owner too");
        set_mode(0o200);
        assert!(check(owner).is_err(), "not even its owner may read it");
        let missing = dir.path().join("missing");
        assert!(check_readable_by(other, service, [missing.as_path()]).is_err());
    }
}
