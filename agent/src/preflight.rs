//! `warmstart-agent check`: can this node checkpoint and restore? One line per item, with
//! advice when it fails; required items decide the exit code.

use std::path::Path;
use std::process::Command;

use crate::criu::Criu;

/// Result of one check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// What was checked.
    pub name: &'static str,
    /// Whether it passed.
    pub ok: bool,
    /// Whether a failure makes the node unusable.
    pub required: bool,
    /// What was found.
    pub detail: String,
    /// What to do when it failed.
    pub advice: &'static str,
}

impl Item {
    /// `PASS`, `FAIL` or `WARN` (a failed optional item).
    pub fn verdict(&self) -> &'static str {
        match (self.ok, self.required) {
            (true, _) => "PASS",
            (false, true) => "FAIL",
            (false, false) => "WARN",
        }
    }
}

/// Runs every check.
pub fn run(criu: &Criu, runc: &Path) -> Vec<Item> {
    let mut items = Vec::new();
    let version = criu.version();
    items.push(Item {
        name: "criu",
        ok: version.as_ref().is_ok_and(|v| v.major >= 4),
        required: true,
        detail: match &version {
            Ok(v) => format!("{} version {v}", criu.path().display()),
            Err(e) => crate::report::error_chain(e),
        },
        advice: "install CRIU 4.x (`make setup`) or point --criu / WARMSTART_CRIU at it",
    });
    let check = criu.check();
    items.push(Item {
        name: "criu check",
        ok: check.is_ok(),
        required: true,
        detail: match &check {
            Ok(()) => "kernel supports what CRIU needs".to_owned(),
            Err(e) => crate::report::error_chain(e),
        },
        advice: "run `criu check --all` as root to see which kernel feature is missing",
    });
    items.push(Item {
        name: "kernel",
        ok: true,
        required: false,
        detail: crate::checkpoint::kernel_release(),
        advice: "",
    });
    let cgroup = cgroup_mode();
    items.push(Item {
        name: "cgroups",
        ok: cgroup != "unknown",
        required: true,
        detail: cgroup.to_owned(),
        advice: "mount cgroup v2 at /sys/fs/cgroup, or the v1 hierarchies",
    });
    items.push(tool(
        "runc",
        runc,
        &["--version"],
        false,
        "install runc (only the local runc mode needs it)",
    ));
    items.push(tool(
        "iptables",
        Path::new("iptables"),
        &["--version"],
        true,
        "install iptables: CRIU locks the network with it during a dump",
    ));
    let nvidia = std::fs::read_to_string("/proc/driver/nvidia/version");
    items.push(Item {
        name: "cuda driver",
        ok: nvidia.is_ok(),
        required: false,
        detail: match &nvidia {
            Ok(text) => text.lines().next().unwrap_or_default().trim().to_owned(),
            Err(_) => {
                "no NVIDIA driver loaded (GPU state cannot be captured on this node)".to_owned()
            }
        },
        advice: "install NVIDIA driver 570 or newer for GPU checkpoints",
    });
    let seccomp = std::fs::read_to_string("/proc/sys/kernel/seccomp/actions_avail");
    items.push(Item {
        name: "seccomp",
        ok: seccomp.as_ref().is_ok_and(|a| a.contains("errno")),
        required: false,
        detail: seccomp.map_or_else(
            |_| "not available".to_owned(),
            |a| format!("actions: {}", a.trim()),
        ),
        advice: "enable seccomp: pods use a profile that blocks io_uring",
    });
    items
}

fn tool(
    name: &'static str,
    path: &Path,
    args: &[&str],
    required: bool,
    advice: &'static str,
) -> Item {
    let out = Command::new(path).args(args).output();
    let (ok, detail) = match out {
        Ok(o) if o.status.success() => (
            true,
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .unwrap_or_default()
                .trim()
                .to_owned(),
        ),
        Ok(o) => (false, String::from_utf8_lossy(&o.stderr).trim().to_owned()),
        Err(e) => (false, format!("{}: {e}", path.display())),
    };
    Item {
        name,
        ok,
        required,
        detail,
        advice,
    }
}

fn cgroup_mode() -> &'static str {
    let unified = Path::new("/sys/fs/cgroup/cgroup.controllers").exists();
    let hybrid = Path::new("/sys/fs/cgroup/unified").is_dir();
    let v1 =
        Path::new("/sys/fs/cgroup/memory").is_dir() || Path::new("/sys/fs/cgroup/cpu").exists();
    match (unified, hybrid, v1) {
        (true, _, _) => "v2 (unified)",
        (false, true, true) => "v1 (hybrid, v2 at /sys/fs/cgroup/unified)",
        (false, false, true) => "v1",
        _ => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_criu_fails_the_required_items_with_advice() {
        let items = run(
            &Criu::new("/nonexistent/criu"),
            Path::new("/nonexistent/runc"),
        );
        let criu = items.iter().find(|i| i.name == "criu").unwrap();
        assert_eq!(criu.verdict(), "FAIL");
        assert!(criu.detail.contains("/nonexistent/criu"), "{}", criu.detail);
        let runc = items.iter().find(|i| i.name == "runc").unwrap();
        assert_eq!(runc.verdict(), "WARN");
        assert!(items.iter().any(|i| i.name == "cgroups" && i.ok));
    }
}
