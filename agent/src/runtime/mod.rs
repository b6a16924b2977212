//! Container runtime resolvers: turn a container reference (runc id, CRI id, bare PID) into the
//! facts the engine needs: host PID of the container's init, its root filesystem as a host path,
//! the overlay upper directory, the runtime's bind mounts with their host sources, and whether it
//! runs. Namespaces and cgroups are read from `/proc/<pid>` by the callers that need them.

pub mod cri;
pub mod gpus;
pub mod mountinfo;
pub mod pid;
pub mod runc;
pub mod stat;

use std::path::PathBuf;

use thiserror::Error;

/// Which runtime a container was found through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RuntimeKind {
    /// runc state directory.
    Runc,
    /// A CRI runtime (containerd, CRI-O) over its socket.
    Cri,
    /// A bare host PID.
    Pid,
}

impl RuntimeKind {
    /// The URI scheme used in container ids (`runc://…`).
    pub fn scheme(self) -> &'static str {
        match self {
            Self::Runc => "runc",
            Self::Cri => "cri",
            Self::Pid => "pid",
        }
    }
}

/// A mount the runtime set up for the container (OCI spec `mounts`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RuntimeMount {
    /// Mount point inside the container.
    pub destination: String,
    /// Host path (bind mounts) or source name.
    pub source: String,
    /// OCI mount type (`bind`, `tmpfs`, `proc`, …).
    pub kind: String,
    /// Mount options.
    pub options: Vec<String>,
}

impl RuntimeMount {
    /// Whether this is a bind mount of a host path (which CRIU must treat as external).
    pub fn is_bind(&self) -> bool {
        self.kind == "bind" || self.options.iter().any(|o| o == "bind" || o == "rbind")
    }
}

/// What the engine knows about a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerInfo {
    /// Runtime-specific id.
    pub id: String,
    /// The runtime it was found through.
    pub runtime: RuntimeKind,
    /// Host PID of the container's init process.
    pub pid: i32,
    /// Whether the runtime reports it running (and the PID is alive).
    pub running: bool,
    /// The container's root filesystem, as a host path.
    pub rootfs: PathBuf,
    /// The overlay upper directory of the root filesystem, when it is an overlay.
    pub upper_dir: Option<PathBuf>,
    /// The runtime's mounts (bind mounts carry host sources).
    pub mounts: Vec<RuntimeMount>,
    /// Paths the runtime masks (bind mounts of `/dev/null` over files, tmpfs over dirs).
    pub masked_paths: Vec<String>,
    /// The image the container runs, when known.
    pub image: String,
    /// What the runtime says about its devices: its pod, the kubelet's allocation, its CDI
    /// devices (filled for CRI containers).
    pub gpus: gpus::RuntimeGpus,
}

impl ContainerInfo {
    /// `<scheme>://<id>`.
    pub fn uri(&self) -> String {
        format!("{}://{}", self.runtime.scheme(), self.id)
    }

    /// The runtime mount at `destination`, if any.
    pub fn mount_at(&self, destination: &str) -> Option<&RuntimeMount> {
        let want = destination.trim_end_matches('/');
        self.mounts
            .iter()
            .rev()
            .find(|m| m.destination.trim_end_matches('/') == want)
    }
}

/// Why a container could not be resolved.
#[derive(Debug, Error)]
pub enum ResolveError {
    /// The runtime does not know the container.
    #[error("container {id} not found: {detail}")]
    NotFound {
        /// The id as given.
        id: String,
        /// What the runtime said.
        detail: String,
    },
    /// The runtime tool failed.
    #[error("{tool} failed for container {id}: {detail}")]
    Runtime {
        /// The tool or endpoint.
        tool: String,
        /// The id as given.
        id: String,
        /// Its stderr or status.
        detail: String,
    },
    /// The runtime's answer could not be understood.
    #[error("cannot parse {what} of container {id}")]
    Parse {
        /// What was parsed.
        what: &'static str,
        /// The id as given.
        id: String,
        /// The parser error.
        #[source]
        source: serde_json::Error,
    },
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The id is not acceptable.
    #[error("invalid container reference {0:?}")]
    InvalidId(String),
    /// A prefix matches more than one container.
    #[error("container reference {id:?} is ambiguous: it matches {matches:?}")]
    Ambiguous {
        /// The reference as given.
        id: String,
        /// The full ids it matches.
        matches: Vec<String>,
    },
    /// The container's root filesystem was not found as a host path visible to the agent.
    #[error("no host path for the root filesystem of container {id}: {detail}")]
    NoRootfs {
        /// The container id.
        id: String,
        /// Which paths were tried and why they were rejected.
        detail: String,
    },
}
