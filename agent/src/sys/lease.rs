//! Whether anyone holds a file open for writing, asked of the kernel through a read lease
//! (`fcntl(F_SETLEASE, F_RDLCK)` is refused with `EAGAIN` while any descriptor or shared
//! writable mapping of the file is open for writing, in any process).

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Whether `file` (opened read-only, owned by this process's user or with `CAP_LEASE`) is open
/// for writing anywhere. Takes a read lease and gives it back at once.
///
/// # Errors
/// The errno of `fcntl` when the filesystem has no leases (then nothing can be concluded).
pub fn open_for_writing(file: &File) -> io::Result<bool> {
    let fd = file.as_raw_fd();
    // SAFETY: `fd` is a descriptor `file` owns for the whole call; F_SETLEASE takes an int
    // argument and touches no memory of this process.
    let taken = unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_RDLCK) };
    if taken == -1 {
        let err = io::Error::last_os_error();
        return match err.raw_os_error() {
            Some(libc::EAGAIN) => Ok(true),
            _ => Err(err),
        };
    }
    // SAFETY: as above.
    let released = unsafe { libc::fcntl(fd, libc::F_SETLEASE, libc::F_UNLCK) };
    if released == -1 {
        return Err(io::Error::last_os_error());
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use std::fs::OpenOptions;

    use super::*;

    #[test]
    fn a_writer_anywhere_is_seen_and_readers_are_not() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, b"x").unwrap();
        let reader = File::open(&path).unwrap();
        let other_reader = File::open(&path).unwrap();
        assert!(!open_for_writing(&reader).unwrap());
        let writer = OpenOptions::new().append(true).open(&path).unwrap();
        assert!(open_for_writing(&reader).unwrap());
        drop(writer);
        assert!(!open_for_writing(&reader).unwrap());
        drop(other_reader);
    }
}
