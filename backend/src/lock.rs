//! An exclusive advisory lock on a data directory, so that two processes never
//! append to the same log (each would overwrite the other's records).
//!
//! `flock(LOCK_EX | LOCK_NB)` on `<dir>/LOCK`, held as long as the returned
//! [`DirLock`] lives; the kernel drops it when the process exits, however it
//! exits, so a crash never leaves a stale lock. The holder's pid is written
//! into the file so the refusal can name it.

use crate::StoreError;
use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Name of the lock file inside the data directory.
pub const LOCK_FILE: &str = "LOCK";

/// A held lock on a data directory. Released on drop.
#[derive(Debug)]
pub struct DirLock {
    _file: File,
    path: PathBuf,
}

impl DirLock {
    /// Takes the lock on `dir` (which must exist), or fails with
    /// [`crate::log::LogError::Locked`] naming the process that holds it.
    pub fn acquire(dir: &Path) -> Result<DirLock, StoreError> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(|e| StoreError::io(format!("opening {}", path.display()), e))?;
        // SAFETY: the fd is valid for the duration of the call.
        let rc = unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
        if rc != 0 {
            let err = std::io::Error::last_os_error();
            if err.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut text = String::new();
                let _ = file.read_to_string(&mut text);
                return Err(crate::log::LogError::Locked {
                    dir: dir.to_path_buf(),
                    holder: text.trim().parse().ok(),
                }
                .into());
            }
            return Err(StoreError::io(format!("locking {}", path.display()), err));
        }
        // Best effort: the pid only improves the error message of a second
        // process; the lock itself is what protects the directory.
        let pid = std::process::id();
        let _ = file
            .set_len(0)
            .and_then(|()| file.seek(SeekFrom::Start(0)))
            .and_then(|_| file.write_all(format!("{pid}\n").as_bytes()));
        Ok(DirLock { _file: file, path })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn second_lock_is_refused_with_the_holders_pid() {
        let dir = tempfile::tempdir().unwrap();
        let first = DirLock::acquire(dir.path()).unwrap();
        match DirLock::acquire(dir.path()) {
            Err(e) => match crate::log::LogError::of(&e) {
                Some(crate::log::LogError::Locked { holder, .. }) => {
                    assert_eq!(*holder, Some(std::process::id()))
                }
                _ => panic!("second lock: {e:?}"),
            },
            Ok(l) => panic!("second lock: {l:?}"),
        }
        drop(first);
        DirLock::acquire(dir.path()).unwrap();
    }

    #[test]
    fn free_bytes_reports_the_filesystem() {
        let dir = tempfile::tempdir().unwrap();
        assert!(crate::free_bytes(dir.path()).unwrap() > 0);
        assert!(crate::free_bytes(&dir.path().join("missing")).is_err());
    }
}
