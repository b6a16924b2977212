//! A pod's signal and control directories on the node: emptyDir volumes below the kubelet root
//! that the pod's workload writes. They are opened below the kubelet root (the agent's
//! configuration) without following any link, and their files read as hostile
//! ([`crate::podfiles`]): a link, FIFO or device where `ready` or `.done` should be is no
//! signal, so the agent never stats a path the workload names.

use std::path::{Path, PathBuf};

use warmstart_shared::names;

use crate::podfiles::{PodDir, PodFileError};

/// The signal directory of pod `uid` as a path (for inotify and messages).
pub fn signal_path(kubelet_root: &Path, uid: &str) -> PathBuf {
    kubelet_root.join(signal_below(uid))
}

/// The control directory of `container` in pod `uid` as a path (for messages).
pub fn control_path(kubelet_root: &Path, uid: &str, container: &str) -> PathBuf {
    kubelet_root.join(control_below(uid, container))
}

fn signal_below(uid: &str) -> PathBuf {
    names::empty_dir_on_host(Path::new(""), uid, names::VOLUME_SIGNAL)
}

fn control_below(uid: &str, container: &str) -> PathBuf {
    names::empty_dir_on_host(Path::new(""), uid, names::VOLUME_CONTROL).join(container)
}

/// Opens the signal directory of pod `uid`.
///
/// # Errors
/// [`PodFileError`]: missing (`NotFound`: the kubelet has not set the volume up yet), or a
/// component below the kubelet root that is a link or no directory.
pub fn signal_dir(kubelet_root: &Path, uid: &str) -> Result<PodDir, PodFileError> {
    PodDir::open_below(kubelet_root, &signal_below(uid))
}

/// Opens the control directory of `container` in pod `uid`.
///
/// # Errors
/// As [`signal_dir`].
pub fn control_dir(
    kubelet_root: &Path,
    uid: &str,
    container: &str,
) -> Result<PodDir, PodFileError> {
    PodDir::open_below(kubelet_root, &control_below(uid, container))
}

/// What a checkpoint source's signal directory says.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SourceSignals {
    /// `ready` is there (a regular file).
    pub ready: bool,
    /// `<hash>.done` is there (a regular file): the checkpoint of `hash` was answered.
    pub done: bool,
}

/// Reads the signal directory of pod `uid` (nothing when it is missing or unusable; an
/// unusable one is logged).
pub fn source_signals(kubelet_root: &Path, uid: &str, hash: &str) -> SourceSignals {
    let dir = match signal_dir(kubelet_root, uid) {
        Ok(dir) => dir,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return SourceSignals::default(),
        Err(e) => {
            tracing::warn!(pod.uid = uid, error = %e, "signal directory unusable");
            return SourceSignals::default();
        }
    };
    let file = |name: &str| match dir.entry_kind(name) {
        Ok(Some("a regular file")) => true,
        Ok(None) => false,
        Ok(Some(kind)) => {
            tracing::warn!(pod.uid = uid, file = %dir.path().join(name).display(), kind, "not a regular file: no signal");
            false
        }
        Err(e) => {
            tracing::warn!(pod.uid = uid, error = %e, "cannot look at a signal file");
            false
        }
    };
    SourceSignals {
        ready: file(names::FILE_READY),
        done: !hash.is_empty() && file(&names::done_file_name(hash)),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::symlink;

    use nix::sys::stat::Mode;

    use super::*;

    const UID: &str = "0b5c2e6a-uid";
    const HASH: &str = "abc123";

    fn kubelet() -> (tempfile::TempDir, PathBuf) {
        let root = tempfile::tempdir().unwrap();
        let signal = signal_path(root.path(), UID);
        std::fs::create_dir_all(&signal).unwrap();
        std::fs::write(root.path().join("host-file"), b"x").unwrap();
        (root, signal)
    }

    #[test]
    fn regular_files_are_signals() {
        let (root, signal) = kubelet();
        assert_eq!(
            source_signals(root.path(), UID, HASH),
            SourceSignals::default()
        );
        std::fs::write(signal.join(names::FILE_READY), b"").unwrap();
        std::fs::write(signal.join(names::done_file_name(HASH)), b"{}").unwrap();
        assert_eq!(
            source_signals(root.path(), UID, HASH),
            SourceSignals {
                ready: true,
                done: true
            }
        );
        assert!(!source_signals(root.path(), UID, "").done);
    }

    /// A link the workload made to a host path is no signal: following it would tell the
    /// workload (by whether its pod is checkpointed) whether that host path exists.
    #[test]
    fn a_link_is_no_ready_and_no_done() {
        let (root, signal) = kubelet();
        let host = root.path().join("host-file");
        symlink(&host, signal.join(names::FILE_READY)).unwrap();
        symlink(&host, signal.join(names::done_file_name(HASH))).unwrap();
        assert_eq!(
            source_signals(root.path(), UID, HASH),
            SourceSignals::default()
        );
    }

    #[test]
    fn a_fifo_is_no_ready_and_no_done() {
        let (root, signal) = kubelet();
        for name in [names::FILE_READY.to_owned(), names::done_file_name(HASH)] {
            nix::unistd::mkfifo(&signal.join(name), Mode::from_bits_truncate(0o600)).unwrap();
        }
        let kubelet_root = root.path().to_path_buf();
        let signals =
            crate::podfiles::tests::promptly(move || source_signals(&kubelet_root, UID, HASH));
        assert_eq!(signals, SourceSignals::default());
    }

    #[test]
    fn a_linked_signal_directory_is_not_read() {
        let (root, signal) = kubelet();
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::fs::write(elsewhere.join(names::FILE_READY), b"").unwrap();
        std::fs::remove_dir(&signal).unwrap();
        symlink(&elsewhere, &signal).unwrap();
        assert!(!source_signals(root.path(), UID, HASH).ready);
        let err = signal_dir(root.path(), UID).unwrap_err();
        assert!(err.to_string().contains("symbolic link"), "{err}");
    }

    #[test]
    fn a_linked_control_directory_is_refused() {
        let (root, _) = kubelet();
        let control = control_path(root.path(), UID, "worker");
        std::fs::create_dir_all(control.parent().unwrap()).unwrap();
        let elsewhere = root.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, &control).unwrap();
        let err = control_dir(root.path(), UID, "worker").unwrap_err();
        assert!(
            err.to_string().contains("worker is a symbolic link"),
            "{err}"
        );
        // The same directory, real, opens.
        std::fs::remove_file(&control).unwrap();
        std::fs::create_dir(&control).unwrap();
        assert_eq!(
            control_dir(root.path(), UID, "worker").unwrap().path(),
            control
        );
    }
}
