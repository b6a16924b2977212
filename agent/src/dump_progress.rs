//! Progress of a CRIU dump while it runs: the bytes of image files written so far against the
//! tree's resident memory (what the page images will roughly hold), logged every few seconds,
//! so a dump of a 70 GB worker is not silent for minutes.

use std::path::{Path, PathBuf};

use crate::progress::{Operation, Reporter, Watch};

/// Watches the dump of the tree below `pid` into `images` until dropped: the bytes of image
/// files written so far against the tree's resident memory, measured now (the tree is held
/// still by the dump).
pub fn watch(reporter: &Reporter, images: PathBuf, pid: i32) -> Watch {
    let total = tree_resident_bytes(pid);
    reporter.watch(Operation::Checkpoint, "dumping", move || {
        (dir_bytes(&images), total)
    })
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
                .fold(0, u64::saturating_add)
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
            Some(kib.saturating_mul(1024))
        })
        .fold(0, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
