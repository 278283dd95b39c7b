//! Writing files atomically, private keys readable by their owner only.
//!
//! Every file Tether's certificate tooling writes goes through here: the
//! content lands in a temporary file in the same directory (created with its
//! final mode, so a key is never world-readable even for a moment), is
//! flushed to disk, then renamed over the destination, and the directory is
//! flushed too so the rename survives a power loss. A reader sees the old
//! file or the new one, never half of either.

use std::io::Write;
use std::path::Path;

use crate::CertError;

/// Mode of files holding secrets: private keys, the join-token store.
pub const SECRET_MODE: u32 = 0o600;
/// Mode of public files: certificates.
pub const PUBLIC_MODE: u32 = 0o644;

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> CertError + '_ {
    move |source| CertError::File {
        path: path.display().to_string(),
        source,
    }
}

/// Writes `contents` to `path` atomically with the given Unix mode.
pub fn write_atomic(path: &Path, contents: &[u8], mode: u32) -> Result<(), CertError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "file".into());
    let tmp = dir.join(format!(
        ".{name}.tmp-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    let result = (|| {
        let mut f = opts.open(&tmp).map_err(io_err(&tmp))?;
        f.write_all(contents).map_err(io_err(&tmp))?;
        f.sync_all().map_err(io_err(&tmp))?;
        std::fs::rename(&tmp, path).map_err(io_err(path))?;
        // The rename is durable only once the directory is: without this a
        // power loss can bring back the old file after a newer sibling (a
        // renewed key without its certificate).
        #[cfg(unix)]
        std::fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err(&dir))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Writes a private key (mode 0600).
pub fn write_secret(path: &Path, contents: &str) -> Result<(), CertError> {
    write_atomic(path, contents.as_bytes(), SECRET_MODE)
}

/// Writes a certificate (mode 0644).
pub fn write_public(path: &Path, contents: &str) -> Result<(), CertError> {
    write_atomic(path, contents.as_bytes(), PUBLIC_MODE)
}

/// `<path>.next`: where [`replace_pair`] stages a file.
fn staged(path: &Path) -> std::path::PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(".next");
    std::path::PathBuf::from(name)
}

fn rename_durably(from: &Path, to: &Path) -> Result<(), CertError> {
    std::fs::rename(from, to).map_err(io_err(to))?;
    let dir = match to.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    std::fs::File::open(&dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err(&dir))
}

/// Replaces a certificate and its key so that a power loss at any point
/// leaves a matching pair after [`recover_pair`]: both are staged first
/// (`<key>.next`, then `<cert>.next`, each durable), then the key is renamed
/// into place, then the certificate.
pub fn replace_pair(
    cert: &Path,
    cert_pem: &str,
    key: &Path,
    key_pem: &str,
) -> Result<(), CertError> {
    write_atomic(&staged(key), key_pem.as_bytes(), SECRET_MODE)?;
    write_atomic(&staged(cert), cert_pem.as_bytes(), PUBLIC_MODE)?;
    rename_durably(&staged(key), key)?;
    rename_durably(&staged(cert), cert)
}

/// Finishes or undoes a [`replace_pair`] that a crash interrupted; run it
/// before loading the pair. Returns what it did, if anything.
pub fn recover_pair(cert: &Path, key: &Path) -> Result<Option<&'static str>, CertError> {
    let (key_next, cert_next) = (staged(key), staged(cert));
    match (key_next.exists(), cert_next.exists()) {
        // Both staged, neither renamed: finish.
        (true, true) => {
            rename_durably(&key_next, key)?;
            rename_durably(&cert_next, cert)?;
            Ok(Some("finished an interrupted certificate replacement"))
        }
        // The key is in place, the certificate not yet: finish.
        (false, true) => {
            rename_durably(&cert_next, cert)?;
            Ok(Some(
                "finished an interrupted certificate replacement (certificate)",
            ))
        }
        // Only the key was staged: the old pair is intact; drop the half.
        (true, false) => {
            std::fs::remove_file(&key_next).map_err(io_err(&key_next))?;
            Ok(Some("dropped a half-staged certificate replacement"))
        }
        (false, false) => Ok(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn secret_files_are_owner_only_and_replaced_whole() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("k.pem");
        write_secret(&p, "one").unwrap();
        write_secret(&p, "two").unwrap();
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "two");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600);
        }
        // No temporary files left behind.
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn a_pair_replacement_interrupted_anywhere_recovers_a_matching_pair() {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = (dir.path().join("node.crt"), dir.path().join("node.key"));
        let read = |p: &Path| std::fs::read_to_string(p).unwrap();
        let reset = || {
            write_public(&cert, "old-cert").unwrap();
            write_secret(&key, "old-key").unwrap();
            for p in [staged(&cert), staged(&key)] {
                let _ = std::fs::remove_file(p);
            }
        };
        // Uninterrupted.
        reset();
        replace_pair(&cert, "new-cert", &key, "new-key").unwrap();
        assert_eq!(
            (read(&cert), read(&key)),
            ("new-cert".into(), "new-key".into())
        );
        assert_eq!(recover_pair(&cert, &key).unwrap(), None);
        // Crash after staging the key only: the old pair stays.
        reset();
        write_secret(&staged(&key), "new-key").unwrap();
        assert!(recover_pair(&cert, &key).unwrap().is_some());
        assert_eq!(
            (read(&cert), read(&key)),
            ("old-cert".into(), "old-key".into())
        );
        // Crash after staging both: the new pair.
        reset();
        write_secret(&staged(&key), "new-key").unwrap();
        write_public(&staged(&cert), "new-cert").unwrap();
        assert!(recover_pair(&cert, &key).unwrap().is_some());
        assert_eq!(
            (read(&cert), read(&key)),
            ("new-cert".into(), "new-key".into())
        );
        // Crash after the key's rename: the new pair.
        reset();
        write_public(&staged(&cert), "new-cert").unwrap();
        std::fs::write(&key, "new-key").unwrap();
        assert!(recover_pair(&cert, &key).unwrap().is_some());
        assert_eq!(
            (read(&cert), read(&key)),
            ("new-cert".into(), "new-key".into())
        );
        assert!(!staged(&cert).exists() && !staged(&key).exists());
    }
}
