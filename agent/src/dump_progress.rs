//! Progress of a CRIU dump while it runs: the bytes of image files written so far against the
//! tree's resident memory (what the page images will roughly hold), logged every few seconds,
//! so a dump of a 70 GB worker is not silent for minutes.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use warmstart_shared::v1alpha1::human_size;

/// How often a line is logged.
pub const EVERY: Duration = Duration::from_secs(5);

/// Watches a dump's images directory until dropped.
#[derive(Debug)]
pub struct DumpWatch {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl DumpWatch {
    /// Starts watching `images`, the dump of the tree below `pid`, logging every `every`.
    pub fn start(images: PathBuf, pid: i32, every: Duration) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let span = tracing::Span::current();
        let thread = std::thread::Builder::new()
            .name("dump-progress".to_owned())
            .spawn(move || {
                let _entered = span.enter();
                let total = tree_resident_bytes(pid);
                let started = Instant::now();
                let tick = Duration::from_millis(100).min(every);
                let mut next = started + every;
                while !flag.load(Ordering::Relaxed) {
                    std::thread::sleep(tick);
                    if Instant::now() < next {
                        continue;
                    }
                    next += every;
                    let done = dir_bytes(&images);
                    tracing::info!(
                        done_bytes = done,
                        total_bytes = total,
                        "{}",
                        line(done, total, started.elapsed())
                    );
                }
            })
            .ok();
        Self { stop, thread }
    }
}

impl Drop for DumpWatch {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// `dumping 41.2 GiB/70.0 GiB at 1.9 GiB/s`.
pub fn line(done: u64, total: u64, elapsed: Duration) -> String {
    let secs = elapsed.as_secs_f64().max(1e-3);
    #[allow(
        clippy::cast_precision_loss,
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss
    )]
    let rate = (done as f64 / secs) as u64;
    format!(
        "dumping {}/{} at {}/s",
        human_size(done),
        human_size(total),
        human_size(rate)
    )
}

/// The sizes of the files directly in `dir` (CRIU writes its images flat), links not followed.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .map(|entries| {
            entries
                .flatten()
                .filter_map(|e| e.metadata().ok())
                .filter(std::fs::Metadata::is_file)
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}

/// The resident memory of `pid` and every process below it (`VmRSS`).
pub fn tree_resident_bytes(pid: i32) -> u64 {
    crate::runtime::stat::descendants(pid)
        .into_iter()
        .filter_map(|p| std::fs::read_to_string(format!("/proc/{p}/status")).ok())
        .filter_map(|status| {
            let kib = status
                .lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))?
                .split_whitespace()
                .next()?
                .parse::<u64>()
                .ok()?;
            Some(kib * 1024)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_says_how_far_of_how_much_at_what_rate() {
        assert_eq!(
            line(41 << 30, 70 << 30, Duration::from_secs(20)),
            "dumping 41.0 GiB/70.0 GiB at 2.0 GiB/s"
        );
        assert_eq!(line(0, 0, Duration::ZERO), "dumping 0 B/0 B at 0 B/s");
    }

    #[test]
    fn the_bytes_written_so_far_are_the_files_in_the_images_directory() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("pages-1.img"), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.path().join("core-1.img"), vec![0u8; 100]).unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert_eq!(dir_bytes(dir.path()), 4196);
        assert_eq!(dir_bytes(&dir.path().join("missing")), 0);
    }

    #[test]
    fn this_process_has_resident_memory() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(tree_resident_bytes(me) > 1 << 20);
    }

    #[test]
    fn a_watch_logs_while_the_dump_runs_and_stops_when_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let me = i32::try_from(std::process::id()).unwrap();
        let watch = DumpWatch::start(dir.path().to_owned(), me, Duration::from_millis(50));
        std::thread::sleep(Duration::from_millis(200));
        let started = Instant::now();
        drop(watch);
        assert!(
            started.elapsed() < Duration::from_secs(1),
            "the watch stops at once"
        );
    }
}
