//! Watching checkpoint source pods' signal directories with inotify: a `ready` file appearing
//! in `<kubelet-root>/pods/<uid>/volumes/kubernetes.io~empty-dir/warmstart-signal/` wakes the
//! agent for that pod. An event is only a hint (the agent validates before acting); a queue
//! overflow asks for a full resync.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::sync::mpsc::UnboundedSender;
use warmstart_shared::names::FILE_READY;

/// What the watcher reports.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Wake {
    /// Something happened in this pod's signal directory.
    Pod(String),
    /// Events were lost: look at every pod.
    Resync,
}

/// The inotify instance and which pod each watch belongs to.
#[derive(Debug, Clone)]
pub struct SignalWatcher {
    inotify: Arc<Inotify>,
    watches: Arc<Mutex<Watches>>,
}

#[derive(Debug, Default)]
struct Watches {
    by_wd: HashMap<WatchDescriptor, String>,
    by_pod: HashMap<String, WatchDescriptor>,
}

impl SignalWatcher {
    /// Starts the watcher: its events go to `tx` from a dedicated thread.
    ///
    /// # Errors
    /// When inotify cannot be initialised or the thread not started.
    pub fn start(tx: UnboundedSender<Wake>) -> std::io::Result<Self> {
        let inotify = Arc::new(Inotify::init(InitFlags::IN_CLOEXEC).map_err(std::io::Error::from)?);
        let watcher = Self {
            inotify,
            watches: Arc::default(),
        };
        let reader = watcher.clone();
        std::thread::Builder::new()
            .name("signal-watch".into())
            .spawn(move || reader.read_loop(&tx))?;
        Ok(watcher)
    }

    /// Watches `dir` for pod `uid` (once; later calls for the same pod do nothing).
    ///
    /// # Errors
    /// When the directory cannot be watched (missing: the pod's volumes are not set up yet).
    pub fn watch(&self, uid: &str, dir: &Path) -> nix::Result<()> {
        let mut w = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        if w.by_pod.contains_key(uid) {
            return Ok(());
        }
        // IN_DONT_FOLLOW: a workload could replace its emptyDir's content, never the directory
        // itself, but the agent never follows a link out of a pod's volumes.
        let wd = self.inotify.add_watch(
            dir,
            AddWatchFlags::IN_CREATE
                | AddWatchFlags::IN_MOVED_TO
                | AddWatchFlags::IN_DONT_FOLLOW
                | AddWatchFlags::IN_ONLYDIR,
        )?;
        w.by_wd.insert(wd, uid.to_owned());
        w.by_pod.insert(uid.to_owned(), wd);
        Ok(())
    }

    /// Stops watching pod `uid`.
    pub fn forget(&self, uid: &str) {
        let mut w = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(wd) = w.by_pod.remove(uid) {
            w.by_wd.remove(&wd);
            // The directory may already be gone (the watch is then removed by the kernel).
            let _ = self.inotify.rm_watch(wd);
        }
    }

    /// The pods watched now.
    pub fn watched(&self) -> Vec<String> {
        let w = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
        w.by_pod.keys().cloned().collect()
    }

    fn read_loop(&self, tx: &UnboundedSender<Wake>) {
        loop {
            let events = match self.inotify.read_events() {
                Ok(events) => events,
                Err(nix::errno::Errno::EINTR) => continue,
                Err(e) => {
                    tracing::error!(error = %e, "inotify read failed; resync only from now on");
                    let _ = tx.send(Wake::Resync);
                    return;
                }
            };
            for event in events {
                if event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    tracing::warn!("inotify queue overflow: resyncing every pod");
                    if tx.send(Wake::Resync).is_err() {
                        return;
                    }
                    continue;
                }
                let mut w = self.watches.lock().unwrap_or_else(PoisonError::into_inner);
                if event.mask.contains(AddWatchFlags::IN_IGNORED) {
                    if let Some(uid) = w.by_wd.remove(&event.wd) {
                        w.by_pod.remove(&uid);
                    }
                    continue;
                }
                let Some(uid) = w.by_wd.get(&event.wd).cloned() else {
                    continue;
                };
                drop(w);
                if event.name.as_deref().is_some_and(|n| n == FILE_READY)
                    && tx.send(Wake::Pod(uid)).is_err()
                {
                    return;
                }
            }
        }
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::time::Duration;

    use tokio::sync::mpsc;

    use super::*;

    async fn next(rx: &mut mpsc::UnboundedReceiver<Wake>) -> Option<Wake> {
        tokio::time::timeout(Duration::from_secs(10), rx.recv())
            .await
            .ok()
            .flatten()
    }

    #[tokio::test]
    async fn a_ready_file_wakes_its_pod_and_nothing_else_does() {
        let tmp = tempfile::tempdir().unwrap();
        let (a, b) = (tmp.path().join("a"), tmp.path().join("b"));
        std::fs::create_dir(&a).unwrap();
        std::fs::create_dir(&b).unwrap();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let w = SignalWatcher::start(tx).unwrap();
        w.watch("uid-a", &a).unwrap();
        w.watch("uid-b", &b).unwrap();
        w.watch("uid-b", &b).unwrap();
        std::fs::write(a.join("other"), b"x").unwrap();
        std::fs::write(b.join(FILE_READY), b"").unwrap();
        assert_eq!(next(&mut rx).await, Some(Wake::Pod("uid-b".into())));
        // Written by rename, as careful writers do.
        std::fs::write(a.join(".ready.tmp"), b"").unwrap();
        std::fs::rename(a.join(".ready.tmp"), a.join(FILE_READY)).unwrap();
        assert_eq!(next(&mut rx).await, Some(Wake::Pod("uid-a".into())));
        w.forget("uid-a");
        std::fs::remove_file(a.join(FILE_READY)).unwrap();
        std::fs::write(a.join(FILE_READY), b"").unwrap();
        std::fs::write(b.join("x"), b"").unwrap();
        std::fs::remove_file(b.join(FILE_READY)).unwrap();
        std::fs::write(b.join(FILE_READY), b"").unwrap();
        // Only b's: a is forgotten, "x" is not a ready file.
        assert_eq!(next(&mut rx).await, Some(Wake::Pod("uid-b".into())));
        assert_eq!(w.watched(), vec!["uid-b".to_owned()]);
        assert!(
            tokio::time::timeout(Duration::from_millis(300), rx.recv())
                .await
                .is_err(),
            "one wake-up per ready file"
        );
    }

    #[tokio::test]
    async fn a_removed_directory_drops_its_watch() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("a");
        std::fs::create_dir(&dir).unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let w = SignalWatcher::start(tx).unwrap();
        w.watch("uid-a", &dir).unwrap();
        std::fs::remove_dir(&dir).unwrap();
        for _ in 0..100 {
            if w.watched().is_empty() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        panic!("watch of a removed directory kept: {:?}", w.watched());
    }

    #[test]
    fn a_missing_directory_cannot_be_watched() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let w = SignalWatcher::start(tx).unwrap();
        assert!(w.watch("uid", Path::new("/nonexistent/signal")).is_err());
        assert!(w.watched().is_empty());
    }
}
