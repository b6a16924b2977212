//! The mount plan: which of a container's mounts CRIU must treat as external (runtime bind
//! mounts, cgroup mounts, `/dev/null` masks) and which it dumps with the process (tmpfs such as
//! `/dev/shm`, proc, sysfs, devpts, mqueue). The plan is recorded in the manifest so the restore
//! replays the dump-time decisions, and so a placeholder that lacks a mount is refused by name.
//! Also the GPU device nodes of a restored tree's `/dev` ([`install_gpu_nodes`]).

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use nix::dir::Dir;
use nix::fcntl::{AtFlags, OFlag, OpenHow, ResolveFlag, openat2};
use nix::sys::stat::{FchmodatFlags, Mode, SFlag, fchmodat, fstatat, mknodat};
use nix::unistd::{UnlinkatFlags, unlinkat};
use warmstart_shared::artifact::{MountPlanEntry, MountTreatment};

use crate::runtime::ContainerInfo;
use crate::runtime::mountinfo::MountInfo;

/// Source recorded for masked files: the runtime binds `/dev/null` over them.
pub const DEV_NULL: &str = "/dev/null";

/// Builds the plan from the container's mount table (as its init sees it) and the runtime's view.
pub fn plan(container: &ContainerInfo, table: &[MountInfo]) -> Vec<MountPlanEntry> {
    table
        .iter()
        .filter(|m| m.mount_point != "/")
        .map(|m| {
            let (treatment, source, reason) = classify(container, m);
            MountPlanEntry {
                destination: m.mount_point.clone(),
                fstype: m.fstype.clone(),
                source,
                treatment,
                reason,
            }
        })
        .collect()
}

fn classify(container: &ContainerInfo, m: &MountInfo) -> (MountTreatment, String, String) {
    if let Some(runtime) = container.mount_at(&m.mount_point).filter(|r| r.is_bind()) {
        return (
            MountTreatment::External,
            runtime.source.clone(),
            String::new(),
        );
    }
    if m.fstype == "cgroup" || m.fstype == "cgroup2" {
        // cgroup v1 hierarchies "don't have a proper root mount" for CRIU: the restore binds
        // the placeholder's own cgroup directories instead.
        return (MountTreatment::External, m.root.clone(), String::new());
    }
    if container.masked_paths.iter().any(|p| p == &m.mount_point) && m.root.ends_with("/null") {
        return (MountTreatment::External, DEV_NULL.to_owned(), String::new());
    }
    (MountTreatment::Dumped, m.source.clone(), String::new())
}

/// The external mounts of a plan.
pub fn externals(plan: &[MountPlanEntry]) -> impl Iterator<Item = &MountPlanEntry> {
    plan.iter()
        .filter(|e| e.treatment == MountTreatment::External)
}

/// The major number of the NVIDIA character devices (`/dev/nvidiactl`, `/dev/nvidia<minor>`).
pub const NVIDIA_MAJOR: u64 = 195;

/// Why the GPU device nodes of a restored tree could not be put in place.
#[derive(Debug, thiserror::Error)]
#[error("cannot put the placeholder's GPU device nodes into {what}: {source}")]
pub struct GpuNodesError {
    /// Which directory or node.
    pub what: String,
    /// The system error.
    #[source]
    pub source: nix::Error,
}

/// One device node: name in `/dev`, permission bits, device number.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceNode {
    /// Its name in `/dev` (`nvidia1`).
    pub name: String,
    /// Permission bits.
    pub mode: u32,
    /// Device number.
    pub rdev: u64,
}

/// Opens `/dev` of the mount namespace and root of host process `pid`, never following a
/// link the process may have planted.
fn open_dev_of(pid: u32) -> Result<OwnedFd, GpuNodesError> {
    let fail = |what: String| move |source| GpuNodesError { what, source };
    let root = nix::fcntl::open(
        format!("/proc/{pid}/root").as_str(),
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(fail(format!("/proc/{pid}/root")))?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC | OFlag::O_NOFOLLOW)
        .resolve(
            ResolveFlag::RESOLVE_BENEATH
                | ResolveFlag::RESOLVE_NO_SYMLINKS
                | ResolveFlag::RESOLVE_NO_MAGICLINKS,
        );
    openat2(&root, "dev", how).map_err(fail(format!("/proc/{pid}/root/dev")))
}

/// The NVIDIA character devices (`nvidia*` of major [`NVIDIA_MAJOR`]) of a `/dev`.
pub fn gpu_nodes(dev: BorrowedFd<'_>) -> Result<Vec<DeviceNode>, GpuNodesError> {
    let fail = |what: &str| {
        let what = what.to_owned();
        move |source| GpuNodesError { what, source }
    };
    let dup = dev.try_clone_to_owned().map_err(|e| GpuNodesError {
        what: "/dev".to_owned(),
        source: nix::Error::from_raw(e.raw_os_error().unwrap_or(0)),
    })?;
    let mut dir = Dir::from_fd(dup).map_err(fail("/dev"))?;
    let mut nodes = Vec::new();
    for entry in dir.iter() {
        let entry = entry.map_err(fail("/dev"))?;
        let Ok(name) = entry.file_name().to_str() else {
            continue;
        };
        if !name.starts_with("nvidia") {
            continue;
        }
        let st = fstatat(dev, name, AtFlags::AT_SYMLINK_NOFOLLOW).map_err(fail(name))?;
        let is_char =
            SFlag::from_bits_truncate(st.st_mode & SFlag::S_IFMT.bits()) == SFlag::S_IFCHR;
        if is_char && nix::sys::stat::major(st.st_rdev) == NVIDIA_MAJOR {
            nodes.push(DeviceNode {
                name: name.to_owned(),
                mode: st.st_mode & 0o7777,
                rdev: st.st_rdev,
            });
        }
    }
    nodes.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(nodes)
}

/// Makes the NVIDIA device nodes of `to` those of `from` (both a `/dev`): removes the ones
/// `from` lacks or has with another device number, creates the missing ones. Returns what
/// changed (`+nvidia1`, `-nvidia0`).
///
/// # Errors
/// [`GpuNodesError`] naming the node.
pub fn copy_gpu_nodes(
    from: BorrowedFd<'_>,
    to: BorrowedFd<'_>,
) -> Result<Vec<String>, GpuNodesError> {
    let wanted = gpu_nodes(from)?;
    let present = gpu_nodes(to)?;
    let mut changes = Vec::new();
    for node in &present {
        if !wanted
            .iter()
            .any(|w| w.name == node.name && w.rdev == node.rdev)
        {
            unlinkat(to, node.name.as_str(), UnlinkatFlags::NoRemoveDir).map_err(|source| {
                GpuNodesError {
                    what: node.name.clone(),
                    source,
                }
            })?;
            changes.push(format!("-{}", node.name));
        }
    }
    for node in &wanted {
        if present
            .iter()
            .any(|p| p.name == node.name && p.rdev == node.rdev)
        {
            continue;
        }
        let fail = |source| GpuNodesError {
            what: node.name.clone(),
            source,
        };
        let mode = Mode::from_bits_truncate(node.mode);
        mknodat(to, node.name.as_str(), SFlag::S_IFCHR, mode, node.rdev).map_err(fail)?;
        // mknod applies the umask: set the placeholder's bits exactly.
        fchmodat(to, node.name.as_str(), mode, FchmodatFlags::NoFollowSymlink).map_err(fail)?;
        changes.push(format!("+{}", node.name));
    }
    Ok(changes)
}

/// Puts the NVIDIA device nodes of the placeholder (host PID `placeholder`) into `/dev` of the
/// mount namespace of restored process `restored`. CRIU restores a container's `/dev` as it
/// was at the checkpoint, with the source GPUs' nodes; the driver reopens the GPUs' nodes in
/// the process's own namespace when it restores the GPU state, and those must be the
/// placeholder's (the GPUs it was given).
///
/// # Errors
/// [`GpuNodesError`].
pub fn install_gpu_nodes(placeholder: u32, restored: u32) -> Result<Vec<String>, GpuNodesError> {
    let from = open_dev_of(placeholder)?;
    let to = open_dev_of(restored)?;
    copy_gpu_nodes(from.as_fd(), to.as_fd())
}

#[cfg(test)]
mod gpu_node_tests {
    use super::*;

    fn node(dir: &std::path::Path, name: &str, minor: u64) {
        nix::sys::stat::mknod(
            &dir.join(name),
            SFlag::S_IFCHR,
            Mode::from_bits_truncate(0o666),
            nix::sys::stat::makedev(NVIDIA_MAJOR, minor),
        )
        .unwrap();
        // What the runtime gives (mknod alone would apply the umask).
        std::fs::set_permissions(
            dir.join(name),
            std::os::unix::fs::PermissionsExt::from_mode(0o666),
        )
        .unwrap();
    }

    fn open(dir: &std::path::Path) -> OwnedFd {
        nix::fcntl::open(dir, OFlag::O_RDONLY | OFlag::O_DIRECTORY, Mode::empty()).unwrap()
    }

    #[test]
    fn the_restored_dev_gets_the_placeholders_gpu_nodes_and_loses_the_checkpoints() {
        let tmp = tempfile::tempdir().unwrap();
        let (placeholder, restored) = (tmp.path().join("ph"), tmp.path().join("restored"));
        std::fs::create_dir(&placeholder).unwrap();
        std::fs::create_dir(&restored).unwrap();
        node(&placeholder, "nvidiactl", 255);
        node(&placeholder, "nvidia1", 1);
        node(&restored, "nvidiactl", 255);
        node(&restored, "nvidia0", 0);
        // Not NVIDIA devices: left alone.
        std::fs::write(restored.join("nvidia-notes"), b"").unwrap();
        node(&restored, "null-ish", 3);
        let changes = copy_gpu_nodes(open(&placeholder).as_fd(), open(&restored).as_fd()).unwrap();
        assert_eq!(changes, ["-nvidia0", "+nvidia1"]);
        let names: Vec<String> = gpu_nodes(open(&restored).as_fd())
            .unwrap()
            .into_iter()
            .map(|n| n.name)
            .collect();
        assert_eq!(names, ["nvidia1", "nvidiactl"]);
        assert!(restored.join("nvidia-notes").exists());
        assert!(restored.join("null-ish").exists());
        use std::os::unix::fs::MetadataExt;
        assert_eq!(
            std::fs::symlink_metadata(restored.join("nvidia1"))
                .unwrap()
                .mode()
                & 0o777,
            0o666
        );
        // Nothing to do the second time.
        assert!(
            copy_gpu_nodes(open(&placeholder).as_fd(), open(&restored).as_fd())
                .unwrap()
                .is_empty()
        );
    }
}

#[cfg(test)]
mod tests {
    use std::path::{Path, PathBuf};

    use super::*;
    use crate::runtime::{RuntimeKind, RuntimeMount, mountinfo};

    const TABLE: &str = "\
1 0 0:1 / / rw - overlay overlay rw,upperdir=/u
2 1 0:2 / /proc rw - proc proc rw
3 1 0:3 / /dev rw - tmpfs tmpfs rw
4 3 0:4 / /dev/shm rw - tmpfs shm rw
5 1 8:1 /srv/data /data rw - ext4 /dev/vda rw
6 1 0:5 / /sys/fs/cgroup ro - tmpfs tmpfs ro
7 6 0:6 /user.slice/c1 /sys/fs/cgroup/cpu,cpuacct ro - cgroup cgroup ro,cpu,cpuacct
8 2 0:3 /null /proc/kcore rw - tmpfs tmpfs rw
";

    fn container() -> ContainerInfo {
        ContainerInfo {
            id: "c1".into(),
            runtime: RuntimeKind::Runc,
            pid: 1,
            running: true,
            rootfs: PathBuf::from("/r"),
            upper_dir: None,
            mounts: vec![RuntimeMount {
                destination: "/data".into(),
                source: "/srv/data".into(),
                kind: "bind".into(),
                options: vec!["rbind".into()],
            }],
            masked_paths: vec!["/proc/kcore".into()],
            image: String::new(),
            gpus: Default::default(),
        }
    }

    #[test]
    fn binds_cgroups_and_masks_are_external_the_rest_dumped() {
        let table = mountinfo::parse(TABLE, Path::new("t")).unwrap();
        let plan = plan(&container(), &table);
        let by_dest = |d: &str| plan.iter().find(|e| e.destination == d).unwrap();
        assert_eq!(plan.len(), 7, "the root is not part of the plan");
        assert_eq!(by_dest("/data").treatment, MountTreatment::External);
        assert_eq!(by_dest("/data").source, "/srv/data");
        assert_eq!(
            by_dest("/sys/fs/cgroup/cpu,cpuacct").treatment,
            MountTreatment::External
        );
        assert_eq!(by_dest("/proc/kcore").treatment, MountTreatment::External);
        assert_eq!(by_dest("/proc/kcore").source, DEV_NULL);
        for dumped in ["/proc", "/dev", "/dev/shm", "/sys/fs/cgroup"] {
            assert_eq!(
                by_dest(dumped).treatment,
                MountTreatment::Dumped,
                "{dumped}"
            );
        }
        assert_eq!(externals(&plan).count(), 3);
    }
}
