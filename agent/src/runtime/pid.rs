//! Bare-PID resolver: a process on the host that no runtime tracks. It can be checkpointed;
//! its root filesystem is whatever `/proc/<pid>/root` shows (not a restore target).

use std::path::PathBuf;

use super::{ContainerInfo, ResolveError, RuntimeKind, mountinfo};

/// Resolves a host PID.
///
/// # Errors
/// [`ResolveError::NotFound`] when no such process exists.
pub fn resolve(pid: i32) -> Result<ContainerInfo, ResolveError> {
    if pid <= 1 {
        return Err(ResolveError::InvalidId(pid.to_string()));
    }
    let proc_dir = PathBuf::from(format!("/proc/{pid}"));
    if !proc_dir.exists() {
        return Err(ResolveError::NotFound {
            id: pid.to_string(),
            detail: "no such process".to_owned(),
        });
    }
    let mounts = mountinfo::read(pid)?;
    Ok(ContainerInfo {
        id: pid.to_string(),
        runtime: RuntimeKind::Pid,
        pid,
        running: true,
        rootfs: proc_dir.join("root"),
        upper_dir: mountinfo::overlay_upper_dir(&mounts),
        mounts: Vec::new(),
        masked_paths: Vec::new(),
        image: String::new(),
        gpus: Default::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_own_pid_resolves_and_a_dead_one_does_not() {
        let me = i32::try_from(std::process::id()).unwrap();
        let info = resolve(me).unwrap();
        assert_eq!(info.uri(), format!("pid://{me}"));
        assert!(matches!(
            resolve(i32::MAX),
            Err(ResolveError::NotFound { .. })
        ));
        assert!(matches!(resolve(1), Err(ResolveError::InvalidId(_))));
    }
}
