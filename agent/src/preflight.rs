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

/// Runs every check; `cuda` is what opening the CUDA driver gave (its inventory or why not).
pub fn run(
    criu: &Criu,
    runc: &Path,
    cuda: &Result<crate::cuda::CudaInventory, crate::cuda::CudaError>,
) -> Vec<Item> {
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
    items.push(plugins(criu));
    items.push(Item {
        name: "kernel",
        ok: true,
        required: false,
        detail: crate::node_match::kernel_release(),
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
    let kernel_module = std::fs::read_to_string("/proc/driver/nvidia/version")
        .ok()
        .and_then(|text| text.lines().next().map(|l| l.trim().to_owned()));
    items.push(Item {
        name: "cuda driver",
        ok: cuda.is_ok(),
        required: false,
        detail: match cuda {
            Ok(inventory) => {
                let gpus: Vec<String> = inventory
                    .gpus
                    .iter()
                    .map(|g| format!("{} {} ({} MiB)", g.uuid, g.name, g.memory_bytes >> 20))
                    .collect();
                format!(
                    "CUDA {}, {} GPU(s){}{}",
                    inventory.driver_version_text(),
                    gpus.len(),
                    if gpus.is_empty() { "" } else { ": " },
                    gpus.join("; ")
                )
            }
            Err(err) => format!(
                "{err}{} (GPU state cannot be captured on this node)",
                kernel_module
                    .map(|m| format!("; kernel module: {m}"))
                    .unwrap_or_default()
            ),
        },
        advice: "install NVIDIA driver 570 or newer and make libcuda.so.1 visible to the agent (--cuda-library)",
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

/// CRIU's own plugins on this node: never loaded by warmstart's dumps and restores (they
/// name an empty plugin directory of the agent's), but worth a line, since a `criu` run by hand
/// here would let the CUDA plugin drive the GPU state.
fn plugins(criu: &Criu) -> Item {
    use crate::criu::plugins::{CUDA_PLUGIN, default_plugin_dir, installed};
    let mut dirs = vec![default_plugin_dir(criu.path())];
    dirs.extend(std::env::var_os("CRIU_LIBS_DIR").map(std::path::PathBuf::from));
    let found = installed(&dirs);
    let ours = criu.settings_dir().join("plugins");
    let searched = dirs
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let detail = match found.iter().find(|p| p.ends_with(CUDA_PLUGIN)) {
        Some(cuda) => format!(
            "CRIU's CUDA plugin {} is installed and ignored: warmstart drives the GPU state itself and runs CRIU with the empty plugin directory {}{}",
            cuda.display(),
            ours.display(),
            others(&found, cuda)
        ),
        None if found.is_empty() => format!(
            "no CRIU plugin in {searched}; warmstart runs CRIU with the empty plugin directory {}",
            ours.display()
        ),
        None => format!(
            "ignored: {}; warmstart runs CRIU with the empty plugin directory {}",
            found
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
            ours.display()
        ),
    };
    Item {
        name: "criu plugins",
        ok: true,
        required: false,
        detail,
        advice: "",
    }
}

fn others(found: &[std::path::PathBuf], cuda: &Path) -> String {
    let rest: Vec<String> = found
        .iter()
        .filter(|p| p.as_path() != cuda)
        .map(|p| p.display().to_string())
        .collect();
    if rest.is_empty() {
        String::new()
    } else {
        format!(" (also ignored: {})", rest.join(", "))
    }
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
            &Err(crate::cuda::CudaError::Unavailable {
                reason: "libcuda.so.1 not found".to_owned(),
            }),
        );
        let criu = items.iter().find(|i| i.name == "criu").unwrap();
        assert_eq!(criu.verdict(), "FAIL");
        assert!(criu.detail.contains("/nonexistent/criu"), "{}", criu.detail);
        let runc = items.iter().find(|i| i.name == "runc").unwrap();
        assert_eq!(runc.verdict(), "WARN");
        assert!(items.iter().any(|i| i.name == "cgroups" && i.ok));
        let cuda = items.iter().find(|i| i.name == "cuda driver").unwrap();
        assert_eq!(cuda.verdict(), "WARN");
        assert!(
            cuda.detail.contains("libcuda.so.1 not found"),
            "{}",
            cuda.detail
        );
    }

    #[test]
    fn a_cuda_plugin_in_criu_s_default_dir_is_reported_as_ignored() {
        let tmp = tempfile::tempdir().unwrap();
        let default_dir = tmp.path().join("lib/criu");
        std::fs::create_dir_all(&default_dir).unwrap();
        std::fs::write(default_dir.join("cuda_plugin.so"), b"").unwrap();
        std::fs::write(default_dir.join("amdgpu_plugin.so"), b"").unwrap();
        // A `criu` whose help names that directory as its default, as a packaged CRIU does.
        let criu = tmp.path().join("criu");
        std::fs::write(
            &criu,
            format!(
                "#!/bin/sh\necho '  -L|--libdir           path to a plugin directory (by default {}/)'\n",
                default_dir.display()
            ),
        )
        .unwrap();
        std::fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let item = plugins(&Criu::new(&criu).with_settings_dir("/run/ws-test/criu"));
        assert_eq!(item.verdict(), "PASS");
        assert_eq!(
            item.detail,
            format!(
                "CRIU's CUDA plugin {}/cuda_plugin.so is installed and ignored: warmstart drives the GPU state itself and runs CRIU with the empty plugin directory /run/ws-test/criu/plugins (also ignored: {}/amdgpu_plugin.so)",
                default_dir.display(),
                default_dir.display()
            )
        );
    }

    #[test]
    fn the_gpus_and_driver_are_listed() {
        let inventory = crate::cuda::CudaInventory {
            driver_version: 12080,
            gpus: vec![crate::cuda::GpuDevice {
                uuid: "GPU-00000000-0000-0000-0000-000000000001".to_owned(),
                name: "NVIDIA H200".to_owned(),
                memory_bytes: 141 << 30,
                minor: None,
            }],
        };
        let items = run(
            &Criu::new("/nonexistent/criu"),
            Path::new("/nonexistent/runc"),
            &Ok(inventory),
        );
        let cuda = items.iter().find(|i| i.name == "cuda driver").unwrap();
        assert_eq!(cuda.verdict(), "PASS");
        assert_eq!(
            cuda.detail,
            "CUDA 12.8, 1 GPU(s): GPU-00000000-0000-0000-0000-000000000001 NVIDIA H200 (144384 MiB)"
        );
    }
}
