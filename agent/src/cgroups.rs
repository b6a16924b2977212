//! cgroup placement of a process, as host directories: used to move the restore helper into
//! the placeholder's cgroups (so the restored tree is accounted and limited with the pod) and
//! to bind the placeholder's own cgroup directories where the dumped container had its cgroup
//! mounts. Handles cgroup v1 (one hierarchy per controller set), v2, and the hybrid layout.

use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::runtime::mountinfo::{self, MountInfo};

/// One hierarchy a process belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupDir {
    /// Controllers as in `/proc/<pid>/cgroup` (`cpu,cpuacct`, `name=systemd`, or empty for v2).
    pub controllers: String,
    /// Where the hierarchy is mounted on the host.
    pub mount_point: PathBuf,
    /// The process's cgroup directory on the host.
    pub dir: PathBuf,
}

/// Why cgroups could not be resolved.
#[derive(Debug, Error)]
pub enum CgroupError {
    /// A proc file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A hierarchy of the process is not mounted on the host.
    #[error("cgroup hierarchy {controllers:?} of pid {pid} is not mounted on this host")]
    Unmounted {
        /// The controllers.
        controllers: String,
        /// The process.
        pid: i32,
    },
    /// The mount table could not be read.
    #[error("cannot read the host mount table")]
    Mounts(#[source] crate::runtime::ResolveError),
}

/// The cgroup directories of `pid` on this host.
///
/// # Errors
/// [`CgroupError`] naming the file or hierarchy.
pub fn of_pid(pid: i32) -> Result<Vec<CgroupDir>, CgroupError> {
    let path = PathBuf::from(format!("/proc/{pid}/cgroup"));
    let text = std::fs::read_to_string(&path).map_err(|source| CgroupError::Read {
        path: path.clone(),
        source,
    })?;
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    let host_mounts = mountinfo::read(me).map_err(CgroupError::Mounts)?;
    resolve(&text, &host_mounts, pid)
}

/// Pure part of [`of_pid`]: `/proc/<pid>/cgroup` text and the host's mount table.
///
/// # Errors
/// [`CgroupError::Unmounted`].
pub fn resolve(text: &str, host: &[MountInfo], pid: i32) -> Result<Vec<CgroupDir>, CgroupError> {
    let mut dirs = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        let mut parts = line.splitn(3, ':');
        let (Some(_), Some(controllers), Some(path)) = (parts.next(), parts.next(), parts.next())
        else {
            continue;
        };
        let mount = host.iter().find(|m| {
            if controllers.is_empty() {
                m.fstype == "cgroup2"
            } else {
                m.fstype == "cgroup" && same_controllers(&m.super_options, controllers)
            }
        });
        let Some(mount) = mount else {
            // A v1 hierarchy nobody mounted (e.g. `net_cls` on some hosts) holds no limits.
            if controllers.is_empty() {
                return Err(CgroupError::Unmounted {
                    controllers: controllers.to_owned(),
                    pid,
                });
            }
            continue;
        };
        let mount_point = PathBuf::from(&mount.mount_point);
        // A hierarchy mounted from a sub-tree (inside a container) has `root` != "/".
        let relative = path
            .strip_prefix(mount.root.trim_end_matches('/'))
            .unwrap_or(path)
            .trim_start_matches('/');
        dirs.push(CgroupDir {
            controllers: controllers.to_owned(),
            dir: mount_point.join(relative),
            mount_point,
        });
    }
    Ok(dirs)
}

fn same_controllers(super_options: &str, controllers: &str) -> bool {
    let mut want: Vec<&str> = controllers.split(',').collect();
    let mut have: Vec<&str> = super_options
        .split(',')
        .filter(|o| {
            *o != "rw"
                && *o != "ro"
                && !o.starts_with("release_agent")
                && *o != "clone_children"
                && *o != "noprefix"
                && *o != "xattr"
                && *o != "nsdelegate"
        })
        .collect();
    want.sort_unstable();
    have.sort_unstable();
    want == have
}

/// The host directory to bind where the dumped container had its cgroup mount at
/// `destination` (e.g. `/sys/fs/cgroup/cpu,cpuacct`): the placeholder's own directory in the
/// hierarchy mounted at the same name on the host.
pub fn dir_for_container_mount<'a>(dirs: &'a [CgroupDir], destination: &str) -> Option<&'a Path> {
    let name = Path::new(destination).file_name()?;
    dirs.iter()
        .find(|d| d.mount_point.file_name() == Some(name))
        .map(|d| d.dir.as_path())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOST: &str = "\
31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw,nsdelegate
";

    #[test]
    fn hybrid_hierarchies_resolve_to_host_directories() {
        let host = mountinfo::parse(HOST, Path::new("h")).unwrap();
        let text = "9:name=systemd:/pod/c1\n4:memory:/pod/c1\n2:cpu,cpuacct:/pod/c1\n7:net_cls:/\n0::/pod/c1\n";
        let dirs = resolve(text, &host, 42).unwrap();
        let dir_of = |c: &str| {
            dirs.iter()
                .find(|d| d.controllers == c)
                .unwrap()
                .dir
                .clone()
        };
        assert_eq!(
            dir_of("memory"),
            PathBuf::from("/sys/fs/cgroup/memory/pod/c1")
        );
        assert_eq!(
            dir_of("cpu,cpuacct"),
            PathBuf::from("/sys/fs/cgroup/cpu,cpuacct/pod/c1")
        );
        assert_eq!(
            dir_of("name=systemd"),
            PathBuf::from("/sys/fs/cgroup/systemd/pod/c1")
        );
        assert_eq!(dir_of(""), PathBuf::from("/sys/fs/cgroup/unified/pod/c1"));
        assert_eq!(dirs.len(), 4, "unmounted v1 hierarchies are skipped");
        assert_eq!(
            dir_for_container_mount(&dirs, "/sys/fs/cgroup/cpu,cpuacct"),
            Some(Path::new("/sys/fs/cgroup/cpu,cpuacct/pod/c1"))
        );
        assert_eq!(
            dir_for_container_mount(&dirs, "/sys/fs/cgroup/systemd"),
            Some(Path::new("/sys/fs/cgroup/systemd/pod/c1"))
        );
        assert_eq!(
            dir_for_container_mount(&dirs, "/sys/fs/cgroup/hugetlb"),
            None
        );
    }

    #[test]
    fn a_missing_v2_hierarchy_is_an_error() {
        let host = mountinfo::parse(
            &HOST.replace("cgroup2 cgroup2", "tmpfs tmpfs"),
            Path::new("h"),
        )
        .unwrap();
        assert!(matches!(
            resolve("0::/x\n", &host, 7),
            Err(CgroupError::Unmounted { pid: 7, .. })
        ));
    }

    #[test]
    fn our_own_cgroups_resolve_to_existing_directories() {
        let me = i32::try_from(std::process::id()).unwrap();
        for d in of_pid(me).unwrap() {
            assert!(d.dir.is_dir(), "{d:?}");
        }
    }
}
