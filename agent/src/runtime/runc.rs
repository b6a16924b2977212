//! runc resolver: reads `runc --root <root> state <id>` and the bundle's OCI `config.json`.
//! Used by the local CLI and the tests; in a cluster the CRI resolver is used instead.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde::Deserialize;

use super::{ContainerInfo, ResolveError, RuntimeKind, RuntimeMount, mountinfo};

/// Default runc state root.
pub const DEFAULT_RUNC_ROOT: &str = "/run/runc";

/// Resolves containers managed by runc under one state root.
#[derive(Clone, Debug)]
pub struct RuncResolver {
    runc: PathBuf,
    root: PathBuf,
}

#[derive(Deserialize)]
struct State {
    pid: i32,
    status: String,
    bundle: PathBuf,
    rootfs: PathBuf,
}

/// The parts of an OCI runtime spec the engine reads.
#[derive(Debug, Default, Deserialize)]
pub struct OciSpec {
    /// Mounts.
    #[serde(default)]
    pub mounts: Vec<OciMount>,
    /// Linux section.
    #[serde(default)]
    pub linux: OciLinux,
}

/// An OCI mount.
#[derive(Debug, Deserialize)]
pub struct OciMount {
    /// Mount point in the container.
    pub destination: String,
    /// Source.
    #[serde(default)]
    pub source: String,
    /// Type.
    #[serde(rename = "type", default)]
    pub kind: String,
    /// Options.
    #[serde(default)]
    pub options: Vec<String>,
}

/// The Linux section of an OCI spec.
#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct OciLinux {
    /// Paths masked by the runtime.
    #[serde(default)]
    pub masked_paths: Vec<String>,
}

impl OciSpec {
    /// The spec's mounts as runtime mounts.
    pub fn runtime_mounts(&self) -> Vec<RuntimeMount> {
        self.mounts
            .iter()
            .map(|m| RuntimeMount {
                destination: m.destination.clone(),
                source: m.source.clone(),
                kind: m.kind.clone(),
                options: m.options.clone(),
            })
            .collect()
    }
}

impl RuncResolver {
    /// A resolver for `runc` binary `runc` and state root `root`.
    pub fn new(runc: impl Into<PathBuf>, root: impl Into<PathBuf>) -> Self {
        Self {
            runc: runc.into(),
            root: root.into(),
        }
    }

    /// The state root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Resolves a container id.
    ///
    /// # Errors
    /// [`ResolveError`] naming the container and what runc said.
    pub fn resolve(&self, id: &str) -> Result<ContainerInfo, ResolveError> {
        if id.is_empty() || id.contains('/') || id.starts_with('-') {
            return Err(ResolveError::InvalidId(id.to_owned()));
        }
        let out = Command::new(&self.runc)
            .arg("--root")
            .arg(&self.root)
            .args(["state", id])
            .output()
            .map_err(|e| ResolveError::Runtime {
                tool: self.runc.display().to_string(),
                id: id.to_owned(),
                detail: e.to_string(),
            })?;
        if !out.status.success() {
            let detail = runc_message(&String::from_utf8_lossy(&out.stderr));
            return Err(
                if detail.contains("does not exist") || detail.contains("not found") {
                    ResolveError::NotFound {
                        id: id.to_owned(),
                        detail,
                    }
                } else {
                    ResolveError::Runtime {
                        tool: "runc state".to_owned(),
                        id: id.to_owned(),
                        detail,
                    }
                },
            );
        }
        let state: State =
            serde_json::from_slice(&out.stdout).map_err(|source| ResolveError::Parse {
                what: "runc state",
                id: id.to_owned(),
                source,
            })?;
        let spec = read_spec(&state.bundle.join("config.json"), id)?;
        let running =
            state.status == "running" && Path::new(&format!("/proc/{}", state.pid)).exists();
        let upper_dir = if running {
            mountinfo::overlay_upper_dir(&mountinfo::read(state.pid)?)
        } else {
            None
        };
        Ok(ContainerInfo {
            id: id.to_owned(),
            runtime: RuntimeKind::Runc,
            pid: state.pid,
            running,
            rootfs: state.rootfs,
            upper_dir,
            mounts: spec.runtime_mounts(),
            masked_paths: spec.linux.masked_paths,
            image: String::new(),
            gpus: Default::default(),
        })
    }
}

/// runc logs `time=… level=error msg="…"`: keep the message.
fn runc_message(stderr: &str) -> String {
    let line = stderr.trim();
    line.split_once("msg=\"")
        .and_then(|(_, rest)| rest.rsplit_once('"'))
        .map_or_else(|| line.to_owned(), |(msg, _)| msg.to_owned())
}

/// Reads an OCI `config.json`.
///
/// # Errors
/// [`ResolveError::Read`] or [`ResolveError::Parse`].
pub fn read_spec(path: &Path, id: &str) -> Result<OciSpec, ResolveError> {
    let bytes = std::fs::read(path).map_err(|source| ResolveError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    serde_json::from_slice(&bytes).map_err(|source| ResolveError::Parse {
        what: "OCI config.json",
        id: id.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_containers_are_not_found() {
        let tmp = tempfile::tempdir().unwrap();
        let r = RuncResolver::new("runc", tmp.path());
        let err = r.resolve("no-such-container").unwrap_err();
        assert!(matches!(err, ResolveError::NotFound { .. }), "{err}");
        assert!(err.to_string().contains("no-such-container"));
    }

    #[test]
    fn runc_log_lines_are_reduced_to_their_message() {
        assert_eq!(
            runc_message("time=\"2026\" level=error msg=\"container does not exist\"\n"),
            "container does not exist"
        );
        assert_eq!(runc_message("plain failure\n"), "plain failure");
    }

    #[test]
    fn unsafe_ids_are_refused_before_running_runc() {
        let r = RuncResolver::new("/nonexistent/runc", "/tmp");
        for id in ["", "../x", "--help"] {
            assert!(matches!(r.resolve(id), Err(ResolveError::InvalidId(_))));
        }
    }

    #[test]
    fn spec_mounts_and_masked_paths_are_read() {
        let spec: OciSpec = serde_json::from_str(
            r#"{"mounts":[{"destination":"/data","type":"bind","source":"/h","options":["rbind"]},
                          {"destination":"/dev/shm","type":"tmpfs","source":"shm"}],
                "linux":{"maskedPaths":["/proc/kcore"]}}"#,
        )
        .unwrap();
        let mounts = spec.runtime_mounts();
        assert!(mounts[0].is_bind());
        assert!(!mounts[1].is_bind());
        assert_eq!(spec.linux.masked_paths, ["/proc/kcore"]);
    }
}
