//! The mount plan: which of a container's mounts CRIU must treat as external (runtime bind
//! mounts, cgroup mounts, `/dev/null` masks) and which it dumps with the process (tmpfs such as
//! `/dev/shm`, proc, sysfs, devpts, mqueue). The plan is recorded in the manifest so the restore
//! replays the dump-time decisions, and so a placeholder that lacks a mount is refused by name.

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
