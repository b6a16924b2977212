//! Whether this node can serve checkpoints and restores now: the agent's preflight in cluster
//! mode (CRIU and the kernel's support for it, cgroups, iptables, the kubelet root, the CRI
//! socket answering, containerd's state directory, the CUDA driver where required), run before
//! the node is labelled and again every `--readiness-check-seconds`, and what it shows: the
//! verdict, and the Node condition `WarmstartAgentReady` that carries it.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde_json::{Value, json};

use crate::criu::Criu;
use crate::preflight::Item;
use crate::runtime::cri::{CriClient, CriOptions};
use crate::seams::cuda::CudaSlot;

/// The Node condition the agent keeps.
pub const CONDITION: &str = "WarmstartAgentReady";

/// What must work on this node.
#[derive(Clone, Debug)]
pub struct Requirements {
    /// The CRIU binary.
    pub criu: PathBuf,
    /// The kubelet's root directory.
    pub kubelet_root: PathBuf,
    /// The CRI socket and how to reach it, when pods run through CRI.
    pub cri: Option<(PathBuf, CriOptions)>,
    /// The CUDA driver, when this node must have one.
    pub cuda: Option<CudaSlot>,
}

/// The outcome of one preflight.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Every required item passed.
    pub ready: bool,
    /// `PreflightPassed` or `PreflightFailed`.
    pub reason: &'static str,
    /// What failed and what to do, or what was checked.
    pub message: String,
}

/// Runs the preflight (off the executor where it blocks).
pub async fn probe(req: &Requirements) -> Vec<Item> {
    let criu = Criu::new(&req.criu);
    let kubelet_root = req.kubelet_root.clone();
    let state_dir = req
        .cri
        .as_ref()
        .map(|(_, o)| o.containerd_state_dir.clone());
    let cuda = req.cuda.clone();
    let mut items = crate::engine::blocking(move || {
        // The node-wide items of `warmstart-agent check` that a cluster node needs; runc is
        // the local mode's, and the CUDA driver is checked below, through the agent's own slot.
        let none = Err(crate::cuda::CudaError::Unavailable {
            reason: "checked separately".to_owned(),
        });
        let mut items: Vec<Item> = crate::preflight::run(&criu, Path::new("runc"), &none)
            .into_iter()
            .filter(|i| i.required)
            .collect();
        items.push(directory(
            "kubelet root",
            &kubelet_root,
            "set --kubelet-root / WARMSTART_KUBELET_ROOT to the kubelet's --root-dir and mount it",
        ));
        if let Some(dir) = state_dir {
            items.push(directory(
                "containerd state",
                &dir,
                "set --containerd-state-dir / WARMSTART_CONTAINERD_STATE_DIR to containerd's state directory and mount it",
            ));
        }
        if let Some(slot) = cuda {
            let driver = slot.get();
            items.push(Item {
                name: "cuda driver",
                ok: driver.is_ok(),
                required: true,
                detail: match &driver {
                    Ok(d) => {
                        let inventory = d.inventory();
                        format!(
                            "CUDA {}, {} GPU(s)",
                            inventory.driver_version_text(),
                            inventory.gpus.len()
                        )
                    }
                    Err(e) => crate::report::error_chain(e),
                },
                advice: "make libcuda.so.1 visible to the agent (the nvidia runtime class, or --cuda-library), or set --require-cuda=false on a node without GPUs",
            });
        }
        items
    })
    .await;
    if let Some((socket, options)) = &req.cri {
        items.push(cri_item(socket, options).await);
    }
    items.push(pod_resources_item(&req.kubelet_root).await);
    items
}

/// Whether the kubelet's PodResources API answers (`List`). Not required: without it a
/// container's GPUs are told from its CDI devices and `NVIDIA_VISIBLE_DEVICES` alone, and a
/// container given GPUs only through the kubelet is refused, saying so.
async fn pod_resources_item(kubelet_root: &Path) -> Item {
    let socket = crate::podresources::socket_under(kubelet_root);
    let (ok, detail) = match crate::podresources::pods_listed(&socket).await {
        Ok(pods) => (true, format!("{}: {pods} pod(s) listed", socket.display())),
        Err(e) => (false, crate::report::error_chain(&e)),
    };
    Item {
        name: "pod resources",
        ok,
        required: false,
        detail,
        advice: "GPUs are then told from CDI devices and NVIDIA_VISIBLE_DEVICES alone: mount the kubelet root with its pod-resources directory (deploy/agent/daemonset.yaml does)",
    }
}

fn directory(name: &'static str, path: &Path, advice: &'static str) -> Item {
    let (ok, detail) = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => (true, path.display().to_string()),
        Ok(_) => (false, format!("{} is not a directory", path.display())),
        Err(e) => (false, format!("{}: {e}", path.display())),
    };
    Item {
        name,
        ok,
        required: true,
        detail,
        advice,
    }
}

async fn cri_item(socket: &Path, options: &CriOptions) -> Item {
    let answer = async {
        let client = CriClient::connect(socket, options.clone()).await?;
        client.version().await
    };
    let (ok, detail) =
        match tokio::time::timeout(options.timeout + Duration::from_secs(1), answer).await {
            Ok(Ok(v)) => (
                true,
                format!(
                    "{}: {} {}",
                    socket.display(),
                    v.runtime_name,
                    v.runtime_version
                ),
            ),
            Ok(Err(e)) => (
                false,
                format!("{}: {}", socket.display(), crate::report::error_chain(&e)),
            ),
            Err(_) => (
                false,
                format!(
                    "{}: no answer within {:?}",
                    socket.display(),
                    options.timeout
                ),
            ),
        };
    Item {
        name: "cri socket",
        ok,
        required: true,
        detail,
        advice: "set --cri-socket / WARMSTART_CRI_SOCKET to the container runtime's socket (containerd: /run/containerd/containerd.sock, CRI-O: /var/run/crio/crio.sock) and mount it",
    }
}

/// The verdict of a preflight: ready when every required item passed; the message names each
/// failed item with what was found and what to do.
pub fn verdict(items: &[Item]) -> Verdict {
    let failed: Vec<String> = items
        .iter()
        .filter(|i| i.required && !i.ok)
        .map(|i| format!("{}: {} ({})", i.name, i.detail, i.advice))
        .collect();
    if failed.is_empty() {
        let checked: Vec<&str> = items.iter().map(|i| i.name).collect();
        let optional: Vec<String> = items
            .iter()
            .filter(|i| !i.ok)
            .map(|i| format!("{}: {} ({})", i.name, i.detail, i.advice))
            .collect();
        let mut message = format!("checked {}", checked.join(", "));
        if !optional.is_empty() {
            message.push_str(&format!(
                "; not required, not working: {}",
                optional.join("; ")
            ));
        }
        Verdict {
            ready: true,
            reason: "PreflightPassed",
            message,
        }
    } else {
        Verdict {
            ready: false,
            reason: "PreflightFailed",
            message: failed.join("; "),
        }
    }
}

/// The strategic-merge patch of `nodes/status` that sets [`CONDITION`] to `verdict` (the list
/// merges by type, so kubelet's own conditions stay). `transition` is when the status last
/// changed, `now` this heartbeat (RFC 3339).
pub fn condition_patch(verdict: &Verdict, transition: &str, now: &str) -> Value {
    json!({"status": {"conditions": [{
        "type": CONDITION,
        "status": if verdict.ready { "True" } else { "False" },
        "reason": verdict.reason,
        "message": crate::report::truncate(&verdict.message, 1000),
        "lastHeartbeatTime": now,
        "lastTransitionTime": transition,
    }]}})
}

/// The condition patch for an agent that stops: not ready, saying so.
pub fn stopped() -> Verdict {
    Verdict {
        ready: false,
        reason: "AgentStopped",
        message: "the warmstart agent on this node stopped".to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(name: &'static str, ok: bool, required: bool) -> Item {
        Item {
            name,
            ok,
            required,
            detail: format!("{name} detail"),
            advice: "do this",
        }
    }

    #[test]
    fn a_failed_required_item_makes_the_node_not_ready_and_says_what_to_do() {
        let v = verdict(&[
            item("criu", true, true),
            item("cri socket", false, true),
            item("seccomp", false, false),
        ]);
        assert!(!v.ready);
        assert_eq!(v.reason, "PreflightFailed");
        assert_eq!(v.message, "cri socket: cri socket detail (do this)");
        let v = verdict(&[item("criu", true, true), item("seccomp", false, false)]);
        assert!(v.ready, "{v:?}");
        assert_eq!(
            v.message,
            "checked criu, seccomp; not required, not working: seccomp: seccomp detail (do this)"
        );
        let v = verdict(&[item("criu", true, true), item("seccomp", true, false)]);
        assert_eq!(v.message, "checked criu, seccomp");
    }

    #[test]
    fn the_condition_patch_carries_the_verdict() {
        let v = verdict(&[item("kubelet root", false, true)]);
        let patch = condition_patch(&v, "2026-12-05T10:00:00Z", "2026-12-05T10:01:00Z");
        let c = &patch["status"]["conditions"][0];
        assert_eq!(c["type"], CONDITION);
        assert_eq!(c["status"], "False");
        assert_eq!(c["reason"], "PreflightFailed");
        assert_eq!(c["lastTransitionTime"], "2026-12-05T10:00:00Z");
        assert!(c["message"].as_str().unwrap().contains("kubelet root"));
    }

    #[tokio::test]
    async fn a_missing_kubelet_root_and_a_dead_cri_socket_fail_the_preflight() {
        let dir = tempfile::tempdir().unwrap();
        let req = Requirements {
            criu: PathBuf::from("/nonexistent/criu"),
            kubelet_root: dir.path().join("no-kubelet"),
            cri: Some((
                dir.path().join("no.sock"),
                CriOptions {
                    containerd_state_dir: dir.path().to_owned(),
                    timeout: Duration::from_millis(500),
                    ..CriOptions::default()
                },
            )),
            cuda: None,
        };
        let items = probe(&req).await;
        let failed: Vec<&str> = items.iter().filter(|i| !i.ok).map(|i| i.name).collect();
        for name in ["criu", "kubelet root", "cri socket"] {
            assert!(failed.contains(&name), "{name} not failed: {items:#?}");
        }
        let cri = items.iter().find(|i| i.name == "cri socket").unwrap();
        assert!(cri.detail.contains("no.sock"), "{}", cri.detail);
        assert!(
            items.iter().any(|i| i.name == "containerd state" && i.ok),
            "{items:#?}"
        );
        let v = verdict(&items);
        assert!(!v.ready);
        assert!(v.message.contains("no-kubelet"), "{}", v.message);
        // The kubelet's PodResources socket is asked too, but is no requirement.
        let pod_resources = items.iter().find(|i| i.name == "pod resources").unwrap();
        assert!(!pod_resources.ok && !pod_resources.required);
        assert!(
            pod_resources
                .detail
                .contains("no-kubelet/pod-resources/kubelet.sock"),
            "{}",
            pod_resources.detail
        );
        assert!(!v.message.contains("pod resources"), "{}", v.message);
    }
}
