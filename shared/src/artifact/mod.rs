//! Artifact layout and manifest (contract): where a checkpoint lives on storage, which names are
//! safe to put in a path, what the manifest records, and how a published artifact is recognised.
//!
//! Layout under the artifact root (`<base>`):
//!
//! ```text
//! <base>/<namespace>/<hash>/                 published artifact (complete, immutable)
//! <base>/<namespace>/<hash>/manifest.json    the manifest (digest over the whole of it)
//! <base>/<namespace>/<hash>/COMPLETE         completion marker, written last
//! <base>/<namespace>/.staging-<hash>-<id>/   a capture in progress; renamed to <hash>/ when done
//! ```
//!
//! Staging directories are siblings of the final directory so the publication is one atomic
//! `rename(2)` on the same filesystem; anything named `.staging-*` may be swept once stale.

use std::collections::BTreeSet;
use std::io;
use std::path::{Component, Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

mod dir;

use crate::identity::is_identity_hash;
use crate::names::{FILE_COMPLETE, FILE_MANIFEST, STAGING_PREFIX};
pub use dir::ArtifactDir;

/// Longest accepted path element (a Kubernetes DNS subdomain is at most 253 characters).
pub const MAX_PATH_ELEMENT_LEN: usize = 253;
/// Manifest format version this code writes.
pub const MANIFEST_FORMAT_VERSION: u32 = 2;
/// The oldest manifest format this build still reads (format 1: one whole-file SHA-256 per
/// file; format 2: per-chunk digests, [`Manifest::chunk_bytes`]).
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// Prefix of every digest in the manifest and the marker.
pub const DIGEST_PREFIX: &str = "sha256:";
/// Largest `manifest.json` read (a format-2 manifest needs about 80 bytes per 8 MiB chunk: this
/// covers artifacts of a few TiB).
pub const MAX_MANIFEST_BYTES: u64 = 32 << 20;
/// Largest `COMPLETE` read.
pub const MAX_MARKER_BYTES: u64 = 4 << 10;
/// Files an artifact may hold unlisted: what CRIU wrote into an artifact's images directory
/// when restores handed it the artifact itself (before restores read through a private view).
/// Nothing reads them: a restore's view holds only listed files.
pub const UNLISTED_RESTORE_OUTPUTS: &[&str] = &["criu/stats-restore"];

/// Why a path or name is refused.
#[derive(Debug, Error)]
pub enum PathError {
    /// An element is not a safe single path component.
    #[error("{what} {value:?} is not a safe path element: {rule}")]
    Element {
        /// What the element names (namespace, hash, file, …).
        what: &'static str,
        /// The element as given.
        value: String,
        /// The rule it breaks.
        rule: &'static str,
    },
    /// The artifact root is not absolute.
    #[error("artifact root {0:?} must be an absolute path")]
    RelativeRoot(PathBuf),
    /// An artifact path is relative or holds `.` or `..`.
    #[error("{0} must be an absolute path without '.' or '..'")]
    NotNormal(PathBuf),
    /// A component on the way to the artifact is a symbolic link.
    #[error("{0} is a symbolic link: artifact paths never follow links")]
    Symlink(PathBuf),
    /// A component on the way to the artifact is not a directory.
    #[error("{0} is not a directory")]
    NotDirectory(PathBuf),
    /// A component could not be inspected.
    #[error("cannot inspect {path}")]
    Inspect {
        /// The component.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// Checks that `value` is one safe path element: non-empty, not `.` or `..`, no `/` or NUL,
/// only `[A-Za-z0-9._-]`, at most [`MAX_PATH_ELEMENT_LEN`] bytes.
///
/// # Errors
/// [`PathError::Element`] naming `what`, the value and the rule.
pub fn validate_path_element(what: &'static str, value: &str) -> Result<(), PathError> {
    let rule = if value.is_empty() {
        Some("it is empty")
    } else if value == "." || value == ".." {
        Some("it is a relative directory reference")
    } else if value.contains('/') {
        Some("it contains '/'")
    } else if value.contains('\0') {
        Some("it contains a NUL byte")
    } else if value.len() > MAX_PATH_ELEMENT_LEN {
        Some("it is longer than 253 bytes")
    } else if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        Some("only A-Z, a-z, 0-9, '.', '_' and '-' are allowed")
    } else {
        None
    };
    match rule {
        Some(rule) => Err(PathError::Element {
            what,
            value: value.to_owned(),
            rule,
        }),
        None => Ok(()),
    }
}

/// Checks a relative file path inside an artifact (`a/b.img`): every element safe.
///
/// # Errors
/// [`PathError::Element`] naming the first bad element.
pub fn validate_relative_file(value: &str) -> Result<(), PathError> {
    if value.is_empty() || value.starts_with('/') {
        return Err(PathError::Element {
            what: "artifact file",
            value: value.to_owned(),
            rule: "it must be a non-empty relative path",
        });
    }
    value
        .split('/')
        .try_for_each(|element| validate_path_element("artifact file element", element))
}

/// The paths of one checkpoint's artifact under an artifact root.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ArtifactLayout {
    root: PathBuf,
    namespace: String,
    hash: String,
}

impl ArtifactLayout {
    /// Validates the root, namespace and identity hash.
    ///
    /// # Errors
    /// [`PathError`] naming the unsafe part.
    pub fn new(root: impl Into<PathBuf>, namespace: &str, hash: &str) -> Result<Self, PathError> {
        let root = root.into();
        if !root.is_absolute() {
            return Err(PathError::RelativeRoot(root));
        }
        if root
            .components()
            .any(|c| matches!(c, Component::ParentDir | Component::CurDir))
        {
            return Err(PathError::Element {
                what: "artifact root",
                value: root.display().to_string(),
                rule: "it must not contain '.' or '..'",
            });
        }
        validate_path_element("namespace", namespace)?;
        validate_path_element("identity hash", hash)?;
        if !is_identity_hash(hash) {
            return Err(PathError::Element {
                what: "identity hash",
                value: hash.to_owned(),
                rule: "it must be 16 lowercase hex characters",
            });
        }
        Ok(Self {
            root,
            namespace: namespace.to_owned(),
            hash: hash.to_owned(),
        })
    }

    /// The artifact root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The namespace.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// The identity hash.
    pub fn hash(&self) -> &str {
        &self.hash
    }

    /// `<namespace>/<hash>`, the location relative to the root.
    pub fn relative(&self) -> String {
        format!("{}/{}", self.namespace, self.hash)
    }

    /// `<root>/<namespace>`.
    pub fn namespace_dir(&self) -> PathBuf {
        self.root.join(&self.namespace)
    }

    /// `<root>/<namespace>/<hash>`: the published artifact.
    pub fn dir(&self) -> PathBuf {
        self.namespace_dir().join(&self.hash)
    }

    /// The manifest of the published artifact.
    pub fn manifest_path(&self) -> PathBuf {
        self.dir().join(FILE_MANIFEST)
    }

    /// The completion marker of the published artifact.
    pub fn marker_path(&self) -> PathBuf {
        self.dir().join(FILE_COMPLETE)
    }

    /// `<root>/<namespace>/.staging-<hash>-<id>` for a capture in progress.
    ///
    /// # Errors
    /// [`PathError::Element`] when `id` is not a safe element.
    pub fn staging_dir(&self, id: &str) -> Result<PathBuf, PathError> {
        validate_path_element("staging id", id)?;
        Ok(self
            .namespace_dir()
            .join(format!("{STAGING_PREFIX}{}-{id}", self.hash)))
    }

    /// The artifact directory resolved with [`resolve_dir`]: `None` when it (or a directory
    /// above it) does not exist, so nothing is published.
    ///
    /// # Errors
    /// As [`resolve_dir`].
    pub fn resolve(&self) -> Result<Option<PathBuf>, PathError> {
        resolve_dir(&self.dir())
    }
}

/// Checks every component of the directory `path`, from `/` down: none may be a symbolic link
/// (artifact paths never follow links, so a planted link cannot redirect a restore or a
/// publication), each must be a directory. Returns `path`, or `None` when some component does
/// not exist. The one resolution rule of artifact paths: the controller, the CLI and the agent
/// all resolve through it.
///
/// # Errors
/// [`PathError::NotNormal`], [`PathError::Symlink`], [`PathError::NotDirectory`] or
/// [`PathError::Inspect`].
pub fn resolve_dir(path: &Path) -> Result<Option<PathBuf>, PathError> {
    use std::path::Component;
    let normal = path.is_absolute()
        && path
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if !normal {
        return Err(PathError::NotNormal(path.to_path_buf()));
    }
    let mut current = PathBuf::from("/");
    for component in path.components() {
        let Component::Normal(part) = component else {
            continue;
        };
        current.push(part);
        match std::fs::symlink_metadata(&current) {
            Ok(meta) if meta.file_type().is_symlink() => return Err(PathError::Symlink(current)),
            Ok(meta) if !meta.is_dir() => return Err(PathError::NotDirectory(current)),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(PathError::Inspect {
                    path: current,
                    source,
                });
            }
        }
    }
    Ok(Some(path.to_path_buf()))
}

/// Where the checkpoint was captured.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SourceInfo {
    /// Source pod name (empty outside Kubernetes).
    pub pod: String,
    /// Source namespace.
    pub namespace: String,
    /// Node the capture ran on.
    pub node: String,
    /// Target container name.
    pub container: String,
    /// Runtime container id (`runc://…`, `containerd://…`, `pid://…`).
    pub container_id: String,
    /// Image reference or image directory of the container.
    #[serde(default)]
    pub image: String,
}

/// CRIU and kernel facts of the dump, and every option it used (restore replays this plan).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CriuInfo {
    /// CRIU version, e.g. `4.2.1`.
    pub version: String,
    /// Kernel release of the source node.
    pub kernel_version: String,
    /// Options of the dump.
    pub options: CriuOptions,
}

/// The CRIU options of a dump.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CriuOptions {
    /// The workload kept running after the dump.
    pub leave_running: bool,
    /// Established TCP connections were dumped.
    pub tcp_established: bool,
    /// File locks were dumped.
    pub file_locks: bool,
    /// Unlinked-but-open files were link-remapped.
    pub link_remap: bool,
    /// External unix sockets allowed.
    pub ext_unix_sk: bool,
    /// The tree was a shell job (inherited terminal).
    pub shell_job: bool,
    /// CRIU's cgroup mode (`--manage-cgroups`), spelled as CRIU spells it.
    pub manage_cgroups_mode: CgroupMode,
    /// How CRIU locked the network during the dump (`--network-lock`); a restore must unlock
    /// the same way. Absent in older manifests: CRIU's default, iptables.
    #[serde(default)]
    pub network_lock: NetworkLock,
    /// External resources by key (`net[<inode>]:<key>`, …).
    #[serde(default)]
    pub external: Vec<String>,
    /// Keys under which external mounts were recorded (`--ext-mount-map <mount point>:<key>`;
    /// warmstart uses the mount point as the key). Absent in older manifests: the external
    /// entries of the mount plan.
    #[serde(default)]
    pub ext_mount_keys: Vec<String>,
    /// Targets of the tree root's fds 0, 1, 2 at dump time (`pipe:[<inode>]`, `/dev/null`, …).
    #[serde(default)]
    pub stdio: Vec<String>,
    /// Log level of the dump.
    pub log_level: i32,
}

/// CRIU's cgroup handling (`--manage-cgroups`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CgroupMode {
    /// Cgroups neither dumped nor restored (warmstart joins the placeholder's by hand).
    #[default]
    Ignore,
    /// Properties restored only for cgroups CRIU creates.
    Soft,
    /// All properties restored.
    Full,
    /// Properties restored, and the tree must be as dumped.
    Strict,
}

/// CRIU's network locking (`--network-lock`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLock {
    /// iptables (CRIU's default).
    #[default]
    Iptables,
    /// nftables.
    Nftables,
    /// No locking.
    Skip,
}

/// How one mount of the container was treated by the dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum MountTreatment {
    /// Bind mount given by the runtime: the restore target must provide it.
    External,
    /// Dumped with its content (tmpfs such as `/dev/shm`).
    Dumped,
    /// Left out of the dump on purpose (reason recorded).
    Skipped,
}

/// One entry of the mount plan.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct MountPlanEntry {
    /// Mount point inside the container.
    pub destination: String,
    /// Filesystem type.
    pub fstype: String,
    /// Source on the source node (informative).
    #[serde(default)]
    pub source: String,
    /// What the dump did with it.
    pub treatment: MountTreatment,
    /// Why, for skipped mounts.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub reason: String,
}

/// GPU state captured with the process.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CudaSection {
    /// CUDA driver API version of the source node (`cuDriverGetVersion` as `major.minor`,
    /// e.g. `12.8`): a restore needs this version or newer.
    pub driver_version: String,
    /// GPUs the CUDA processes held, in the node's ordinal order (a restore pairs them, in
    /// order, with the placeholder's). Manifests without `processes` list the GPUs the
    /// container saw.
    pub gpus: Vec<GpuInfo>,
    /// Host PIDs of the CUDA processes at dump time.
    pub pids: Vec<u32>,
    /// How the state was captured (`driver-api` or `cuda-checkpoint`).
    pub method: String,
    /// Each CUDA process and the GPUs it held: a restore gives each process the pairs of its
    /// own GPUs only (the driver refuses a pair for a GPU the process did not use). Empty in
    /// manifests written before it was recorded.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub processes: Vec<CudaProcess>,
}

/// One CUDA process of a checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CudaProcess {
    /// Host PID at dump time.
    pub pid: u32,
    /// PID in the container's PID namespace (what it is restored as).
    pub ns_pid: u32,
    /// UUIDs of the GPUs it held, in the node's ordinal order.
    pub gpus: Vec<String>,
}

/// One GPU.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuInfo {
    /// `GPU-…` UUID.
    pub uuid: String,
    /// Marketing name, e.g. `NVIDIA H200`.
    pub model: String,
    /// Device memory in bytes (a restore needs a GPU with at least as much); 0 when unknown
    /// (manifests written before it was recorded).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub memory_bytes: u64,
}

/// Where the agent found which GPUs a container was given.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum GpuSource {
    /// The kubelet's PodResources API: the devices a device plugin or DRA driver allocated.
    PodResources,
    /// CDI device names (`nvidia.com/gpu=<uuid|index|all>`) in the container's annotations or
    /// CRI config.
    Cdi,
    /// The container's `NVIDIA_VISIBLE_DEVICES` (UUIDs, ordinals or `all`).
    Env,
    /// No allocation, CDI device or variable, but the container has the NVIDIA device nodes:
    /// every GPU of the node.
    DeviceNodes,
}

impl GpuSource {
    /// How the source is named in messages.
    pub fn describe(self) -> &'static str {
        match self {
            Self::PodResources => "the kubelet's PodResources API",
            Self::Cdi => "the container's CDI devices",
            Self::Env => "the container's NVIDIA_VISIBLE_DEVICES",
            Self::DeviceNodes => "the container's NVIDIA device nodes (every GPU of the node)",
        }
    }
}

impl std::fmt::Display for GpuSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.describe())
    }
}

/// The GPUs a container was given, as the runtime named them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AssignedGpus {
    /// Where they were found.
    pub source: GpuSource,
    /// The extended resource or DRA driver that allocated them (`nvidia.com/gpu`), for
    /// [`GpuSource::PodResources`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub resource: String,
    /// The GPUs as the source names them: device IDs, CDI device names or the variable's
    /// entries (`all` for every GPU of the node).
    pub devices: Vec<String>,
    /// The node's GPUs they are (`GPU-…` UUIDs, in the node's ordinal order), when the node's
    /// CUDA driver was open to tell.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub uuids: Vec<String>,
}

impl AssignedGpus {
    /// How many GPUs, when known (`all` without the driver is not).
    pub fn count(&self) -> Option<usize> {
        if !self.uuids.is_empty() {
            Some(self.uuids.len())
        } else if self
            .devices
            .iter()
            .any(|d| d == "all" || d.ends_with("=all"))
        {
            None
        } else {
            Some(self.devices.len())
        }
    }
}

impl std::fmt::Display for AssignedGpus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} from {}", self.devices.join(","), self.source)?;
        if !self.resource.is_empty() {
            write!(f, " ({})", self.resource)?;
        }
        Ok(())
    }
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One file of the artifact.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FileEntry {
    /// Path relative to the artifact directory.
    pub path: String,
    /// Size in bytes.
    pub size: u64,
    /// Format 1: lowercase hex SHA-256 of the whole content. Empty in format 2.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// Format 2: lowercase hex SHA-256 of each [`Manifest::chunk_bytes`] piece of the content,
    /// in order (the last piece may be shorter; none for an empty file).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<String>,
}

/// The artifact manifest (`manifest.json`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Manifest {
    /// [`MANIFEST_FORMAT_VERSION`].
    pub format_version: u32,
    /// Identity hash of the checkpoint.
    pub identity_hash: String,
    /// RFC 3339 time of the capture.
    pub created_at: String,
    /// Where it was captured.
    pub source: SourceInfo,
    /// CRIU facts and options.
    pub criu: CriuInfo,
    /// The mount plan.
    pub mounts: Vec<MountPlanEntry>,
    /// GPU state, when captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cuda: Option<CudaSection>,
    /// The GPUs the container runtime gave the captured container, and where the agent found
    /// them; absent for a container given no GPU (and in manifests written before it was
    /// recorded).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assigned_gpus: Option<AssignedGpus>,
    /// Seconds per capture phase.
    #[serde(default)]
    pub timings: std::collections::BTreeMap<String, f64>,
    /// Format 2: the size of the pieces each file's [`FileEntry::chunks`] digests cover.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunk_bytes: u64,
    /// Every file of the artifact but the manifest and the marker, sorted by path.
    pub files: Vec<FileEntry>,
    /// `sha256:<hex>` of the manifest's compact JSON text with this field empty; see
    /// [`Manifest::seal`].
    #[serde(default)]
    pub digest: String,
}

/// Why a manifest or marker is refused.
#[derive(Debug, Error)]
pub enum ManifestError {
    /// Not valid manifest JSON.
    #[error("manifest is not valid: {0}")]
    Parse(#[source] serde_json::Error),
    /// A format this code does not read.
    #[error(
        "manifest format version {found} is not supported (this build reads {OLDEST_FORMAT_VERSION} to {MANIFEST_FORMAT_VERSION})"
    )]
    FormatVersion {
        /// The version found.
        found: u32,
    },
    /// `digest` is not the last member of the manifest, where the writer puts it.
    #[error("manifest digest is not the manifest's last member: the manifest was edited")]
    DigestPlacement,
    /// The digest does not match the content: the manifest was edited.
    #[error(
        "manifest digest mismatch: recorded {recorded}, computed {computed} (the manifest was edited)"
    )]
    DigestMismatch {
        /// The digest recorded in the manifest.
        recorded: String,
        /// The digest of the content.
        computed: String,
    },
    /// The identity hash is malformed.
    #[error("manifest identityHash {0:?} is not a 16-character lowercase hex hash")]
    IdentityHash(String),
    /// A file path is unsafe.
    #[error("manifest lists an unsafe file path")]
    FilePath(#[source] PathError),
    /// A file is listed twice, or names the manifest or marker.
    #[error("manifest lists {0:?} more than once or as a reserved name")]
    DuplicateFile(String),
    /// A file checksum is malformed.
    #[error("manifest entry {path:?} has a malformed sha256 {sha256:?}")]
    Checksum {
        /// The file.
        path: String,
        /// The recorded value.
        sha256: String,
    },
    /// A format-2 manifest without a chunk size.
    #[error("manifest format 2 needs a chunkBytes greater than 0")]
    ChunkBytes,
    /// A file's chunk digests do not cover its size.
    #[error("manifest entry {path:?} has {found} chunk digests, its size needs {expected}")]
    ChunkCount {
        /// The file.
        path: String,
        /// What the size and chunkBytes need.
        expected: usize,
        /// What is listed.
        found: usize,
    },
    /// The marker is not valid JSON.
    #[error("completion marker is not valid: {0}")]
    Marker(#[source] serde_json::Error),
    /// The marker belongs to another manifest.
    #[error("completion marker names manifest {marker}, but the manifest digest is {manifest}")]
    MarkerMismatch {
        /// Digest in the marker.
        marker: String,
        /// Digest of the manifest.
        manifest: String,
    },
}

impl Manifest {
    /// The compact JSON text the digest covers: the manifest serialised with `digest` empty.
    fn digest_input(&self) -> Vec<u8> {
        let mut unsealed = self.clone();
        unsealed.digest.clear();
        // Serialising plain data with string keys cannot fail; an empty input never matches.
        serde_json::to_vec(&unsealed).unwrap_or_default()
    }

    /// Sorts the file list and records the digest; call last, before writing.
    ///
    /// # Guarantees
    /// The digest covers the exact text [`Manifest::to_json`] writes, whitespace aside; reading
    /// checks it against that text (see [`Manifest::from_json`]), never against a
    /// re-serialisation of parsed values, so no float, escape or key-order round trip can
    /// change it.
    pub fn seal(&mut self) {
        self.files.sort_by(|a, b| a.path.cmp(&b.path));
        self.digest = digest_of(&self.digest_input());
    }

    /// A file's digests have the shape this manifest's format asks for.
    fn check_digests(&self, file: &FileEntry) -> Result<(), ManifestError> {
        let bad = |sha256: &str| ManifestError::Checksum {
            path: file.path.clone(),
            sha256: sha256.to_owned(),
        };
        if self.format_version == 1 {
            if !is_sha256_hex(&file.sha256) || !file.chunks.is_empty() {
                return Err(bad(&file.sha256));
            }
            return Ok(());
        }
        if !file.sha256.is_empty() {
            return Err(bad(&file.sha256));
        }
        let expected = crate::filehash::chunk_count(file.size, self.chunk_bytes);
        if file.chunks.len() != expected {
            return Err(ManifestError::ChunkCount {
                path: file.path.clone(),
                expected,
                found: file.chunks.len(),
            });
        }
        match file.chunks.iter().find(|c| !is_sha256_hex(c)) {
            Some(chunk) => Err(bad(chunk)),
            None => Ok(()),
        }
    }

    /// Sum of the file sizes.
    pub fn total_size(&self) -> u64 {
        self.files.iter().map(|f| f.size).sum()
    }

    /// The manifest as written to disk (pretty JSON, trailing newline).
    ///
    /// # Errors
    /// Only if serialisation fails, which plain data does not.
    pub fn to_json(&self) -> Result<Vec<u8>, ManifestError> {
        let mut out = serde_json::to_vec_pretty(self).map_err(ManifestError::Parse)?;
        out.push(b'\n');
        Ok(out)
    }

    /// Parses and checks a manifest: format version, digest, identity hash, file paths and
    /// checksums. A manifest that passes is safe to act on (not yet checked against the disk).
    ///
    /// # Errors
    /// [`ManifestError`] naming the first problem.
    pub fn from_json(bytes: &[u8]) -> Result<Self, ManifestError> {
        // Read the version first so a newer format says so instead of "unknown field".
        #[derive(Deserialize)]
        #[serde(rename_all = "camelCase")]
        struct Version {
            format_version: u32,
        }
        let version: Version = serde_json::from_slice(bytes).map_err(ManifestError::Parse)?;
        if !(OLDEST_FORMAT_VERSION..=MANIFEST_FORMAT_VERSION).contains(&version.format_version) {
            return Err(ManifestError::FormatVersion {
                found: version.format_version,
            });
        }
        let manifest: Self = serde_json::from_slice(bytes).map_err(ManifestError::Parse)?;
        let computed = digest_of(&sealed_text_unsealed(bytes, &manifest.digest)?);
        if manifest.digest != computed {
            return Err(ManifestError::DigestMismatch {
                recorded: manifest.digest,
                computed,
            });
        }
        if !is_identity_hash(&manifest.identity_hash) {
            return Err(ManifestError::IdentityHash(manifest.identity_hash));
        }
        if manifest.format_version >= 2 && manifest.chunk_bytes == 0 {
            return Err(ManifestError::ChunkBytes);
        }
        let mut seen = BTreeSet::from([FILE_MANIFEST, FILE_COMPLETE]);
        for file in &manifest.files {
            validate_relative_file(&file.path).map_err(ManifestError::FilePath)?;
            if !seen.insert(file.path.as_str()) {
                return Err(ManifestError::DuplicateFile(file.path.clone()));
            }
            manifest.check_digests(file)?;
        }
        Ok(manifest)
    }
}

fn is_sha256_hex(text: &str) -> bool {
    text.len() == 64 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// `sha256:<hex>` of `bytes`.
fn digest_of(bytes: &[u8]) -> String {
    format!("{DIGEST_PREFIX}{}", hex::encode(Sha256::digest(bytes)))
}

/// The text a manifest's digest covers, taken from the manifest's own bytes: the JSON with the
/// whitespace between tokens removed and the value of `digest` (the last member, where
/// [`Manifest::to_json`] writes it) emptied.
///
/// The digest is defined over text rather than over a re-serialisation of the parsed values
/// because parsing is lossy: a float written in its shortest form may read back one unit off,
/// and would then re-serialise differently.
fn sealed_text_unsealed(bytes: &[u8], recorded: &str) -> Result<Vec<u8>, ManifestError> {
    let mut text = strip_json_whitespace(bytes);
    // `recorded` came out of this JSON, so it serialises (a string cannot fail).
    let member = format!(
        ",\"digest\":{}}}",
        serde_json::to_string(recorded).unwrap_or_default()
    );
    if !text.ends_with(member.as_bytes()) {
        return Err(ManifestError::DigestPlacement);
    }
    text.truncate(text.len() - member.len());
    text.extend_from_slice(b",\"digest\":\"\"}");
    Ok(text)
}

/// `json` without the insignificant whitespace between tokens (RFC 8259 section 2); strings,
/// escapes included, are copied byte for byte.
fn strip_json_whitespace(json: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(json.len());
    let mut in_string = false;
    let mut escaped = false;
    for &b in json {
        if in_string {
            out.push(b);
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
        } else if !matches!(b, b' ' | b'\t' | b'\n' | b'\r') {
            out.push(b);
            in_string = b == b'"';
        }
    }
    out
}

/// The completion marker (`COMPLETE`): written last, names the manifest it completes.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CompletionMarker {
    /// [`MANIFEST_FORMAT_VERSION`].
    pub format_version: u32,
    /// Digest of the manifest this marker completes.
    pub manifest_digest: String,
}

impl CompletionMarker {
    /// The marker for a sealed manifest.
    pub fn for_manifest(manifest: &Manifest) -> Self {
        Self {
            format_version: manifest.format_version,
            manifest_digest: manifest.digest.clone(),
        }
    }

    /// Parses a marker and checks that it completes `manifest`.
    ///
    /// # Errors
    /// [`ManifestError::Marker`] or [`ManifestError::MarkerMismatch`].
    pub fn check(bytes: &[u8], manifest: &Manifest) -> Result<Self, ManifestError> {
        let marker: Self = serde_json::from_slice(bytes).map_err(ManifestError::Marker)?;
        if marker.manifest_digest != manifest.digest {
            return Err(ManifestError::MarkerMismatch {
                marker: marker.manifest_digest,
                manifest: manifest.digest.clone(),
            });
        }
        Ok(marker)
    }
}

/// How thoroughly [`verify_files`] checks the files.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verification {
    /// Presence, type and size (cheap; what the controller does).
    Sizes,
    /// Sizes and a full SHA-256 of every file (what a restore does).
    Checksums,
}

/// A file of the artifact that does not match the manifest.
#[derive(Debug, Error)]
pub enum FileError {
    /// Listed but absent.
    #[error("artifact file {0} is missing")]
    Missing(PathBuf),
    /// A symlink, directory, FIFO or device where a regular file is listed.
    #[error("artifact file {0} is not a regular file")]
    NotRegular(PathBuf),
    /// An entry the manifest does not list (nothing unlisted is ever read or restored).
    #[error(
        "{0} is not listed in the manifest: an artifact holds only the files its manifest lists"
    )]
    Unlisted(PathBuf),
    /// A file read whole is larger than allowed.
    #[error("artifact file {path} has {size} bytes, more than the {cap} bytes allowed")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size (or what was read of it).
        size: u64,
        /// The cap.
        cap: u64,
    },
    /// Size differs.
    #[error("artifact file {path} has {actual} bytes, the manifest says {expected}")]
    Size {
        /// The file.
        path: PathBuf,
        /// From the manifest.
        expected: u64,
        /// On disk.
        actual: u64,
    },
    /// Content differs.
    #[error("artifact file {path} has sha256 {actual}, the manifest says {expected}")]
    Checksum {
        /// The file.
        path: PathBuf,
        /// From the manifest.
        expected: String,
        /// On disk.
        actual: String,
    },
    /// A chunk's content differs (format 2).
    #[error(
        "artifact file {path} differs from the manifest in chunk {chunk} (from byte {offset}): sha256 {actual}, the manifest says {expected}"
    )]
    ChunkChecksum {
        /// The file.
        path: PathBuf,
        /// The chunk's index.
        chunk: usize,
        /// Its first byte.
        offset: u64,
        /// From the manifest.
        expected: String,
        /// On disk.
        actual: String,
    },
    /// Could not be read.
    #[error("cannot read artifact file {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

/// Checks the files of the artifact in `dir` against the manifest. Never follows a symlink in
/// the artifact: every element of every listed path must be a real directory or regular file,
/// and nothing unlisted may be there. Checksums are computed in parallel (every core; chunks of
/// one file at once in format 2).
///
/// # Errors
/// The first [`FileError`] found: structure (presence, type, size) in manifest order first,
/// then unlisted entries, then content.
pub fn verify_files(dir: &Path, manifest: &Manifest, how: Verification) -> Result<(), FileError> {
    let opened = match ArtifactDir::open(dir) {
        Ok(Some(opened)) => opened,
        Ok(None) => return Err(FileError::Missing(dir.to_path_buf())),
        Err(e) => {
            return Err(FileError::Read {
                path: dir.to_path_buf(),
                source: io::Error::other(e),
            });
        }
    };
    verify_structure(&opened, manifest)?;
    if how == Verification::Checksums {
        verify_checksums(
            &opened,
            manifest,
            &|_| true,
            crate::filehash::threads(),
            &|_| {},
        )?;
    }
    Ok(())
}

/// Presence, type (regular, reached through real directories, opened without following a link)
/// and size of every listed file, then that nothing unlisted is there.
///
/// # Errors
/// The first [`FileError`] found, in manifest order, then [`FileError::Unlisted`].
pub fn verify_structure(dir: &ArtifactDir, manifest: &Manifest) -> Result<(), FileError> {
    for entry in &manifest.files {
        let file = dir.open_file(&entry.path)?;
        let path = || dir.path().join(&entry.path);
        let size = file
            .metadata()
            .map_err(|source| FileError::Read {
                path: path(),
                source,
            })?
            .len();
        if size != entry.size {
            return Err(FileError::Size {
                path: path(),
                expected: entry.size,
                actual: size,
            });
        }
    }
    dir.check_listing(manifest)
}

/// Checks the content of the listed files that `include` selects (after
/// [`verify_structure`]), each opened in `dir` without following a link, on `threads` threads
/// ([`crate::filehash::threads`] for every core); `progress` gets bytes hashed, from any thread.
/// In format 2 the first chunk found to differ ends the check at once.
///
/// # Errors
/// A [`FileError`] for a mismatch (format 2: the first chunk found to differ; format 1: the
/// first file in manifest order), or the first unreadable file.
pub fn verify_checksums(
    dir: &ArtifactDir,
    manifest: &Manifest,
    include: &dyn Fn(&FileEntry) -> bool,
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<(), FileError> {
    let entries: Vec<&FileEntry> = manifest.files.iter().filter(|e| include(e)).collect();
    let files: Vec<(PathBuf, u64)> = entries
        .iter()
        .map(|e| (dir.path().join(&e.path), e.size))
        .collect();
    let open = |index: usize| {
        dir.open_file(&entries[index].path).map_err(|e| match e {
            FileError::Read { source, .. } => source,
            other => io::Error::other(other.to_string()),
        })
    };
    let read_error = |e: crate::filehash::ReadError| FileError::Read {
        path: e.path,
        source: e.source,
    };
    if manifest.format_version == 1 {
        let digests = crate::filehash::whole_digests_with(&files, threads, progress, &open)
            .map_err(read_error)?;
        for ((entry, (path, _)), actual) in entries.iter().zip(&files).zip(digests) {
            if actual != entry.sha256 {
                return Err(FileError::Checksum {
                    path: path.clone(),
                    expected: entry.sha256.clone(),
                    actual,
                });
            }
        }
        return Ok(());
    }
    let expected: Vec<&[String]> = entries.iter().map(|e| e.chunks.as_slice()).collect();
    crate::filehash::verify_chunks(
        &files,
        &expected,
        manifest.chunk_bytes,
        threads,
        progress,
        &open,
    )
    .map_err(|e| match e {
        crate::filehash::ChunkCheckError::Read(e) => read_error(e),
        crate::filehash::ChunkCheckError::Mismatch {
            file,
            chunk,
            actual,
        } => FileError::ChunkChecksum {
            path: files[file].0.clone(),
            chunk,
            offset: chunk as u64 * manifest.chunk_bytes,
            expected: entries[file].chunks.get(chunk).cloned().unwrap_or_default(),
            actual,
        },
    })
}

/// Why a published artifact cannot be used.
#[derive(Debug, Error)]
pub enum PublishedError {
    /// The manifest or the completion marker is absent or unreadable: nothing (complete) is
    /// published there.
    #[error("{} is not readable: not a complete artifact", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The artifact directory's path is unsafe (a link, not a directory).
    #[error(transparent)]
    Path(#[from] PathError),
    /// The manifest or the marker is invalid.
    #[error(transparent)]
    Manifest(#[from] ManifestError),
    /// A file does not match the manifest, or the manifest or marker is not a small regular
    /// file.
    #[error(transparent)]
    Files(#[from] FileError),
}

/// A published artifact whose manifest, marker and structure were checked: its directory held
/// open, and the manifest.
#[derive(Debug)]
pub struct Published {
    dir: ArtifactDir,
    manifest: Manifest,
}

impl Published {
    /// The directory, held open.
    pub fn dir(&self) -> &ArtifactDir {
        &self.dir
    }

    /// The checked manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The directory and the manifest.
    pub fn into_parts(self) -> (ArtifactDir, Manifest) {
        (self.dir, self.manifest)
    }
}

/// Opens the published artifact in `dir` as hostile input and checks everything but the
/// checksums: the directory (no link on the way), the completion marker and the manifest (each
/// a regular file opened without following a link, read with a bound), the manifest's format,
/// digest and names, that the marker completes it, and every file's presence, type and size, and
/// that nothing unlisted is there.
///
/// # Errors
/// [`PublishedError`] naming the file and the problem.
pub fn open_published(dir: &Path) -> Result<Published, PublishedError> {
    let opened = ArtifactDir::open(dir)?.ok_or_else(|| PublishedError::Missing {
        path: dir.to_path_buf(),
        source: io::Error::from(io::ErrorKind::NotFound),
    })?;
    let marker = read_small(&opened, FILE_COMPLETE, MAX_MARKER_BYTES)?;
    let manifest = Manifest::from_json(&read_small(&opened, FILE_MANIFEST, MAX_MANIFEST_BYTES)?)?;
    CompletionMarker::check(&marker, &manifest)?;
    verify_structure(&opened, &manifest)?;
    Ok(Published {
        dir: opened,
        manifest,
    })
}

/// Reads the manifest of the artifact in `dir` alone (not the marker, not the files), as
/// hostile input like [`open_published`] does: no link followed, a regular file, bounded.
///
/// # Errors
/// [`PublishedError`] naming the file and the problem.
pub fn read_manifest(dir: &Path) -> Result<Manifest, PublishedError> {
    let opened = ArtifactDir::open(dir)?.ok_or_else(|| PublishedError::Missing {
        path: dir.to_path_buf(),
        source: io::Error::from(io::ErrorKind::NotFound),
    })?;
    let bytes = read_small(&opened, FILE_MANIFEST, MAX_MANIFEST_BYTES)?;
    Ok(Manifest::from_json(&bytes)?)
}

/// A small file of the artifact read whole; absent or unreadable means incomplete.
fn read_small(dir: &ArtifactDir, name: &str, cap: u64) -> Result<Vec<u8>, PublishedError> {
    match dir.read_bounded(name, cap) {
        Ok(bytes) => Ok(bytes),
        Err(FileError::Missing(path)) => Err(PublishedError::Missing {
            path,
            source: io::Error::from(io::ErrorKind::NotFound),
        }),
        Err(FileError::Read { path, source }) => Err(PublishedError::Missing { path, source }),
        Err(other) => Err(PublishedError::Files(other)),
    }
}

/// Reads and checks the published artifact in `dir` ([`open_published`]), then the files'
/// content when `how` says so. What the controller (sizes) and `inspect --verify` (checksums)
/// rely on.
///
/// # Errors
/// [`PublishedError`] naming the file and the problem.
pub fn read_published(dir: &Path, how: Verification) -> Result<Manifest, PublishedError> {
    let published = open_published(dir)?;
    if how == Verification::Checksums {
        verify_checksums(
            published.dir(),
            published.manifest(),
            &|_| true,
            crate::filehash::threads(),
            &|_| {},
        )?;
    }
    Ok(published.manifest)
}

pub use crate::filehash::sha256_file;

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::os::unix::fs::symlink;

    use proptest::prelude::*;

    use super::*;

    const HASH: &str = "96429b2725761a09";

    #[test]
    fn cuda_sections_without_per_process_gpus_still_read() {
        let old: CudaSection = serde_json::from_str(
            r#"{"driverVersion":"12.8","gpus":[],"pids":[7],"method":"driver-api"}"#,
        )
        .unwrap();
        assert!(old.processes.is_empty());
        assert!(!serde_json::to_string(&old).unwrap().contains("processes"));
        let new = CudaSection {
            processes: vec![CudaProcess {
                pid: 7,
                ns_pid: 1,
                gpus: vec!["GPU-a".into()],
            }],
            ..old
        };
        let text = serde_json::to_string(&new).unwrap();
        assert!(
            text.contains(r#""processes":[{"pid":7,"nsPid":1,"gpus":["GPU-a"]}]"#),
            "{text}"
        );
        assert_eq!(serde_json::from_str::<CudaSection>(&text).unwrap(), new);
    }

    #[test]
    fn criu_options_are_typed_and_older_manifests_read_with_criu_defaults() {
        let older = serde_json::json!({
            "leaveRunning": true, "tcpEstablished": false, "fileLocks": true, "linkRemap": true,
            "extUnixSk": true, "shellJob": false, "manageCgroupsMode": "ignore",
            "external": [], "stdio": [], "logLevel": 4
        });
        let options: CriuOptions = serde_json::from_value(older).unwrap();
        assert_eq!(options.manage_cgroups_mode, CgroupMode::Ignore);
        assert_eq!(options.network_lock, NetworkLock::Iptables);
        assert!(options.ext_mount_keys.is_empty());
        let written = serde_json::to_value(CriuOptions {
            manage_cgroups_mode: CgroupMode::Soft,
            network_lock: NetworkLock::Nftables,
            ..options
        })
        .unwrap();
        assert_eq!(written["manageCgroupsMode"], "soft");
        assert_eq!(written["networkLock"], "nftables");
        let bogus = serde_json::json!({
            "leaveRunning": true, "tcpEstablished": false, "fileLocks": true, "linkRemap": true,
            "extUnixSk": true, "shellJob": false, "manageCgroupsMode": "sometimes",
            "logLevel": 4
        });
        let err = serde_json::from_value::<CriuOptions>(bogus).unwrap_err();
        assert!(err.to_string().contains("sometimes"), "{err}");
    }

    /// A format-1 manifest (whole-file digests): what artifacts written before format 2 hold.
    fn manifest() -> Manifest {
        let mut m = Manifest {
            format_version: 1,
            identity_hash: HASH.into(),
            created_at: "2026-12-02T17:00:00Z".into(),
            source: SourceInfo {
                pod: "checkpoint-llama-x1".into(),
                namespace: "default".into(),
                node: "gpu-1".into(),
                container: "main".into(),
                container_id: "runc://abc".into(),
                image: "busybox".into(),
            },
            criu: CriuInfo {
                version: "4.2.1".into(),
                kernel_version: "6.18.0".into(),
                options: CriuOptions {
                    file_locks: true,
                    link_remap: true,
                    manage_cgroups_mode: CgroupMode::Ignore,
                    external: vec!["net[4026531840]:extRootNetNS".into()],
                    stdio: vec!["pipe:[1]".into(), "pipe:[2]".into(), "pipe:[2]".into()],
                    log_level: 4,
                    ..Default::default()
                },
            },
            mounts: vec![
                MountPlanEntry {
                    destination: "/data".into(),
                    fstype: "bind".into(),
                    source: "/host/data".into(),
                    treatment: MountTreatment::External,
                    reason: String::new(),
                },
                MountPlanEntry {
                    destination: "/dev/shm".into(),
                    fstype: "tmpfs".into(),
                    source: "shm".into(),
                    treatment: MountTreatment::Dumped,
                    reason: String::new(),
                },
            ],
            cuda: None,
            assigned_gpus: None,
            timings: [("dump".to_string(), 1.5)].into(),
            chunk_bytes: 0,
            files: vec![],
            digest: String::new(),
        };
        m.seal();
        m
    }

    fn write_artifact(dir: &Path, files: &[(&str, &[u8])]) -> Manifest {
        let mut m = manifest();
        for (path, content) in files {
            let full = dir.join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(&full, content).unwrap();
            m.files.push(FileEntry {
                path: (*path).into(),
                size: content.len() as u64,
                sha256: hex::encode(Sha256::digest(content)),
                chunks: Vec::new(),
            });
        }
        m.seal();
        m
    }

    /// A format-2 artifact: `files` written, digested per `chunk_bytes` piece.
    fn write_chunked(dir: &Path, chunk_bytes: u64, files: &[(&str, &[u8])]) -> Manifest {
        let mut m = manifest();
        m.format_version = 2;
        m.chunk_bytes = chunk_bytes;
        for (path, content) in files {
            let full = dir.join(path);
            std::fs::create_dir_all(full.parent().unwrap()).unwrap();
            std::fs::write(&full, content).unwrap();
            m.files.push(FileEntry {
                path: (*path).into(),
                size: content.len() as u64,
                sha256: String::new(),
                chunks: content
                    .chunks(usize::try_from(chunk_bytes).unwrap())
                    .map(|c| hex::encode(Sha256::digest(c)))
                    .collect(),
            });
        }
        m.seal();
        m
    }

    #[test]
    fn chunked_files_verify_and_a_changed_byte_names_its_chunk() {
        let dir = tempfile::tempdir().unwrap();
        let big: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        let m = write_chunked(
            dir.path(),
            1024,
            &[("criu/pages-1.img", &big), ("empty", b"")],
        );
        let m = Manifest::from_json(&m.to_json().unwrap()).unwrap();
        assert_eq!(m.files[0].chunks.len(), 10);
        verify_files(dir.path(), &m, Verification::Checksums).unwrap();
        let mut changed = big.clone();
        changed[5000] ^= 1;
        std::fs::write(dir.path().join("criu/pages-1.img"), &changed).unwrap();
        verify_files(dir.path(), &m, Verification::Sizes).unwrap();
        let err = verify_files(dir.path(), &m, Verification::Checksums).unwrap_err();
        assert!(
            matches!(
                err,
                FileError::ChunkChecksum {
                    chunk: 4,
                    offset: 4096,
                    ..
                }
            ),
            "{err}"
        );
        assert!(
            err.to_string().contains("chunk 4 (from byte 4096)"),
            "{err}"
        );
        // Only what `include` selects is hashed.
        let opened = ArtifactDir::open(dir.path()).unwrap().unwrap();
        verify_checksums(&opened, &m, &|f| f.path == "empty", 2, &|_| {}).unwrap();
    }

    #[test]
    fn chunk_lists_must_cover_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut m = write_chunked(dir.path(), 1024, &[("a", &[7u8; 3000])]);
        m.files[0].chunks.pop();
        m.seal();
        let err = Manifest::from_json(&m.to_json().unwrap()).unwrap_err();
        assert!(
            matches!(
                err,
                ManifestError::ChunkCount {
                    expected: 3,
                    found: 2,
                    ..
                }
            ),
            "{err}"
        );
        let mut m = write_chunked(dir.path(), 1024, &[("a", &[7u8; 3000])]);
        m.files[0].sha256 = "0".repeat(64);
        m.seal();
        assert!(matches!(
            Manifest::from_json(&m.to_json().unwrap()),
            Err(ManifestError::Checksum { .. })
        ));
    }

    #[test]
    fn the_marker_carries_the_manifests_own_format() {
        let dir = tempfile::tempdir().unwrap();
        let v2 = write_chunked(dir.path(), 1024, &[("a", b"x")]);
        assert_eq!(CompletionMarker::for_manifest(&v2).format_version, 2);
        assert_eq!(
            CompletionMarker::for_manifest(&manifest()).format_version,
            1
        );
    }

    #[test]
    fn path_elements_follow_the_rules() {
        for ok in ["default", "kube-system", "a.b_c-1", HASH] {
            validate_path_element("namespace", ok).unwrap();
        }
        let cases = [
            ("", "empty"),
            (".", "relative directory"),
            ("..", "relative directory"),
            ("a/b", "'/'"),
            ("a\0b", "NUL"),
            ("a b", "only A-Z"),
            ("ünï", "only A-Z"),
            ("a:b", "only A-Z"),
        ];
        for (bad, rule) in cases {
            let err = validate_path_element("namespace", bad)
                .unwrap_err()
                .to_string();
            assert!(err.contains(rule), "{bad:?}: {err}");
            assert!(err.starts_with("namespace "), "{err}");
        }
        let long = "a".repeat(254);
        assert!(
            validate_path_element("namespace", &long)
                .unwrap_err()
                .to_string()
                .contains("longer than 253")
        );
        validate_path_element("namespace", &"a".repeat(253)).unwrap();
    }

    #[test]
    fn relative_file_paths_are_checked_element_by_element() {
        validate_relative_file("criu/pages-1.img").unwrap();
        for bad in ["", "/etc/passwd", "a/../b", "a//b", "a/./b", "criu/"] {
            assert!(validate_relative_file(bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn layout_paths_follow_the_contract() {
        let l = ArtifactLayout::new("/var/lib/warmstart/checkpoints", "default", HASH).unwrap();
        assert_eq!(
            l.dir(),
            Path::new("/var/lib/warmstart/checkpoints/default/96429b2725761a09")
        );
        assert_eq!(l.relative(), "default/96429b2725761a09");
        assert_eq!(l.manifest_path(), l.dir().join("manifest.json"));
        assert_eq!(l.marker_path(), l.dir().join("COMPLETE"));
        assert_eq!(
            l.staging_dir("abc").unwrap(),
            Path::new("/var/lib/warmstart/checkpoints/default/.staging-96429b2725761a09-abc")
        );
        assert!(l.staging_dir("../x").is_err());
    }

    #[test]
    fn layout_rejects_unsafe_roots_namespaces_and_hashes() {
        assert!(matches!(
            ArtifactLayout::new("relative/root", "default", HASH),
            Err(PathError::RelativeRoot(_))
        ));
        assert!(ArtifactLayout::new("/a/../b", "default", HASH).is_err());
        assert!(ArtifactLayout::new("/a", "..", HASH).is_err());
        assert!(ArtifactLayout::new("/a", "default", "../../etc").is_err());
        let err = ArtifactLayout::new("/a", "default", "ABCDEF0123456789").unwrap_err();
        assert!(err.to_string().contains("16 lowercase hex"), "{err}");
    }

    #[test]
    fn resolution_refuses_symlinked_components() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().join("root");
        std::fs::create_dir_all(root.join("real").join(HASH)).unwrap();
        symlink(root.join("real"), root.join("linked")).unwrap();
        let ok = ArtifactLayout::new(&root, "real", HASH).unwrap();
        assert_eq!(ok.resolve().unwrap(), Some(ok.dir()));
        let linked_ns = ArtifactLayout::new(&root, "linked", HASH).unwrap();
        assert!(matches!(linked_ns.resolve(), Err(PathError::Symlink(p)) if p.ends_with("linked")));

        std::fs::create_dir_all(root.join("ns2")).unwrap();
        symlink(root.join("real").join(HASH), root.join("ns2").join(HASH)).unwrap();
        let linked_hash = ArtifactLayout::new(&root, "ns2", HASH).unwrap();
        assert!(matches!(linked_hash.resolve(), Err(PathError::Symlink(_))));

        symlink(&root, tmp.path().join("rootlink")).unwrap();
        let linked_root = ArtifactLayout::new(tmp.path().join("rootlink"), "real", HASH).unwrap();
        assert!(matches!(linked_root.resolve(), Err(PathError::Symlink(_))));

        let missing = ArtifactLayout::new(&root, "absent", HASH).unwrap();
        assert_eq!(missing.resolve().unwrap(), None);

        std::fs::write(root.join("file"), b"x").unwrap();
        let file_ns = ArtifactLayout::new(&root, "file", HASH).unwrap();
        assert!(matches!(file_ns.resolve(), Err(PathError::NotDirectory(_))));
    }

    #[test]
    fn resolve_dir_checks_every_component_from_the_root() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir_all(real.join("a").join("b")).unwrap();
        assert_eq!(
            resolve_dir(&real.join("a/b")).unwrap(),
            Some(real.join("a/b"))
        );
        assert_eq!(resolve_dir(&real.join("a/absent/b")).unwrap(), None);
        // A link far above the artifact is refused as well: the whole path is checked.
        symlink(&real, tmp.path().join("link")).unwrap();
        let err = resolve_dir(&tmp.path().join("link/a/b")).unwrap_err();
        assert!(
            matches!(&err, PathError::Symlink(p) if p.ends_with("link")),
            "{err}"
        );
        assert!(err.to_string().contains("never follow links"), "{err}");
        for bad in ["relative/dir", "/a/../b", "./a"] {
            let err = resolve_dir(Path::new(bad)).unwrap_err();
            assert!(matches!(err, PathError::NotNormal(_)), "{bad}: {err}");
        }
        std::fs::write(real.join("file"), b"x").unwrap();
        assert!(matches!(
            resolve_dir(&real.join("file/below")),
            Err(PathError::NotDirectory(p)) if p.ends_with("file")
        ));
    }

    #[test]
    fn manifest_round_trips_and_keeps_its_digest() {
        let m = manifest();
        assert!(m.digest.starts_with("sha256:"));
        let back = Manifest::from_json(&m.to_json().unwrap()).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn an_edited_manifest_is_refused() {
        let m = manifest();
        let text = String::from_utf8(m.to_json().unwrap()).unwrap();
        let edited = text.replace("gpu-1", "gpu-2");
        let err = Manifest::from_json(edited.as_bytes()).unwrap_err();
        assert!(matches!(err, ManifestError::DigestMismatch { .. }), "{err}");
        assert!(err.to_string().contains("the manifest was edited"));
    }

    #[test]
    fn unsupported_format_versions_and_garbage_are_refused() {
        for version in [0, MANIFEST_FORMAT_VERSION + 1] {
            let mut m = manifest();
            m.format_version = version;
            m.seal();
            let err = Manifest::from_json(&m.to_json().unwrap()).unwrap_err();
            assert!(
                matches!(err, ManifestError::FormatVersion { found } if found == version),
                "{err}"
            );
        }
        let mut m = manifest();
        m.format_version = 2;
        m.seal();
        assert!(matches!(
            Manifest::from_json(&m.to_json().unwrap()),
            Err(ManifestError::ChunkBytes)
        ));
        assert!(matches!(
            Manifest::from_json(b"{"),
            Err(ManifestError::Parse(_))
        ));
        assert!(matches!(
            Manifest::from_json(b"[]"),
            Err(ManifestError::Parse(_))
        ));
        let mut extra: serde_json::Value =
            serde_json::from_slice(&manifest().to_json().unwrap()).unwrap();
        extra["surprise"] = serde_json::json!(1);
        let err = Manifest::from_json(&serde_json::to_vec(&extra).unwrap()).unwrap_err();
        assert!(err.to_string().contains("surprise") || matches!(err, ManifestError::Parse(_)));
    }

    #[test]
    fn unsafe_or_duplicate_file_entries_are_refused() {
        let entry = |path: &str| FileEntry {
            path: path.into(),
            size: 1,
            sha256: "0".repeat(64),
            chunks: Vec::new(),
        };
        for (files, want) in [
            (vec![entry("../escape")], "unsafe"),
            (vec![entry("/abs")], "unsafe"),
            (vec![entry("a"), entry("a")], "more than once"),
            (vec![entry("manifest.json")], "more than once"),
            (
                vec![FileEntry {
                    sha256: "xyz".into(),
                    ..entry("a")
                }],
                "malformed sha256",
            ),
        ] {
            let mut m = manifest();
            m.files = files;
            m.seal();
            let err = Manifest::from_json(&m.to_json().unwrap()).unwrap_err();
            assert!(err.to_string().contains(want), "{err}");
        }
    }

    #[test]
    fn marker_must_name_the_manifest() {
        let m = manifest();
        let marker = serde_json::to_vec(&CompletionMarker::for_manifest(&m)).unwrap();
        CompletionMarker::check(&marker, &m).unwrap();
        let mut other = m.clone();
        other.created_at = "later".into();
        other.seal();
        assert!(matches!(
            CompletionMarker::check(&marker, &other),
            Err(ManifestError::MarkerMismatch { .. })
        ));
        assert!(matches!(
            CompletionMarker::check(b"", &m),
            Err(ManifestError::Marker(_))
        ));
    }

    #[test]
    fn files_are_verified_by_presence_size_and_checksum() {
        let tmp = tempfile::tempdir().unwrap();
        let m = write_artifact(
            tmp.path(),
            &[("pages-1.img", b"hello"), ("criu/core.img", b"abc")],
        );
        assert_eq!(m.total_size(), 8);
        verify_files(tmp.path(), &m, Verification::Checksums).unwrap();

        // Same size, other content: only the checksum pass notices.
        std::fs::write(tmp.path().join("pages-1.img"), b"jello").unwrap();
        verify_files(tmp.path(), &m, Verification::Sizes).unwrap();
        let err = verify_files(tmp.path(), &m, Verification::Checksums).unwrap_err();
        assert!(matches!(err, FileError::Checksum { .. }), "{err}");

        std::fs::write(tmp.path().join("pages-1.img"), b"hello!").unwrap();
        assert!(matches!(
            verify_files(tmp.path(), &m, Verification::Sizes),
            Err(FileError::Size {
                expected: 5,
                actual: 6,
                ..
            })
        ));

        std::fs::remove_file(tmp.path().join("pages-1.img")).unwrap();
        let err = verify_files(tmp.path(), &m, Verification::Sizes).unwrap_err();
        assert!(matches!(err, FileError::Missing(_)));
        assert!(err.to_string().contains("pages-1.img is missing"));
    }

    #[test]
    fn published_artifacts_need_marker_manifest_and_files() {
        let tmp = tempfile::tempdir().unwrap();
        let m = write_artifact(tmp.path(), &[("pages-1.img", b"hello")]);
        std::fs::write(tmp.path().join(FILE_MANIFEST), m.to_json().unwrap()).unwrap();
        let err = read_published(tmp.path(), Verification::Sizes).unwrap_err();
        assert!(
            err.to_string()
                .contains("COMPLETE is not readable: not a complete artifact"),
            "{err}"
        );
        let marker = serde_json::to_vec(&CompletionMarker::for_manifest(&m)).unwrap();
        std::fs::write(tmp.path().join(FILE_COMPLETE), marker).unwrap();
        assert_eq!(
            read_published(tmp.path(), Verification::Checksums).unwrap(),
            m
        );
        std::fs::write(tmp.path().join("pages-1.img"), b"jello").unwrap();
        assert!(read_published(tmp.path(), Verification::Sizes).is_ok());
        assert!(matches!(
            read_published(tmp.path(), Verification::Checksums),
            Err(PublishedError::Files(FileError::Checksum { .. }))
        ));
    }

    #[test]
    fn symlinks_inside_the_artifact_are_not_followed() {
        let tmp = tempfile::tempdir().unwrap();
        let m = write_artifact(tmp.path(), &[("criu/core.img", b"abc")]);
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("core.img"), b"abc").unwrap();
        std::fs::remove_dir_all(tmp.path().join("criu")).unwrap();
        symlink(outside.path(), tmp.path().join("criu")).unwrap();
        assert!(matches!(
            verify_files(tmp.path(), &m, Verification::Checksums),
            Err(FileError::NotRegular(_))
        ));
    }

    /// A complete published artifact in `dir`: `files`, the manifest and the marker.
    fn publish_chunked(dir: &Path, chunk_bytes: u64, files: &[(&str, &[u8])]) -> Manifest {
        let m = write_chunked(dir, chunk_bytes, files);
        std::fs::write(dir.join(FILE_MANIFEST), m.to_json().unwrap()).unwrap();
        let marker = serde_json::to_vec(&CompletionMarker::for_manifest(&m)).unwrap();
        std::fs::write(dir.join(FILE_COMPLETE), marker).unwrap();
        m
    }

    #[test]
    fn an_unlisted_file_or_directory_is_refused_by_name() {
        let tmp = tempfile::tempdir().unwrap();
        let m = publish_chunked(
            tmp.path(),
            1024,
            &[("criu/pages-1.img", b"pages"), ("criu/core-1.img", b"core")],
        );
        read_published(tmp.path(), Verification::Checksums).unwrap();
        for (extra, is_dir) in [
            ("criu/pages-2.img", false),
            ("criu/inventory.img", false),
            ("stats-restore", false),
            ("criu/sub", true),
            ("empty-dir", true),
        ] {
            let path = tmp.path().join(extra);
            if is_dir {
                std::fs::create_dir(&path).unwrap();
            } else {
                std::fs::write(&path, b"unverified").unwrap();
            }
            for how in [Verification::Sizes, Verification::Checksums] {
                let err = read_published(tmp.path(), how).unwrap_err();
                assert!(
                    matches!(&err, PublishedError::Files(FileError::Unlisted(p)) if *p == path),
                    "{extra}: {err}"
                );
                assert!(err.to_string().contains(extra), "{err}");
                assert!(
                    err.to_string().contains("not listed in the manifest"),
                    "{err}"
                );
                let err = verify_files(tmp.path(), &m, how).unwrap_err();
                assert!(matches!(err, FileError::Unlisted(_)), "{err}");
            }
            if is_dir {
                std::fs::remove_dir(&path).unwrap();
            } else {
                std::fs::remove_file(&path).unwrap();
            }
        }
        read_published(tmp.path(), Verification::Checksums).unwrap();
        // What CRIU wrote into artifacts restored before restores used views: never read.
        std::fs::write(tmp.path().join("criu/stats-restore"), b"stats").unwrap();
        read_published(tmp.path(), Verification::Checksums).unwrap();
    }

    #[test]
    fn linked_manifest_marker_and_pages_are_refused() {
        let outside = tempfile::tempdir().unwrap();
        for name in [FILE_MANIFEST, FILE_COMPLETE, "criu/pages-1.img"] {
            let tmp = tempfile::tempdir().unwrap();
            publish_chunked(tmp.path(), 1024, &[("criu/pages-1.img", b"pages")]);
            // The real content moves outside; the artifact keeps a link to it.
            let real = outside.path().join(name.replace('/', "_"));
            std::fs::rename(tmp.path().join(name), &real).unwrap();
            symlink(&real, tmp.path().join(name)).unwrap();
            let err = read_published(tmp.path(), Verification::Checksums).unwrap_err();
            assert!(
                matches!(&err, PublishedError::Files(FileError::NotRegular(p)) if p.ends_with(name)),
                "{name}: {err}"
            );
            assert!(err.to_string().contains("is not a regular file"), "{err}");
        }
    }

    #[test]
    fn a_linked_directory_on_the_way_is_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let real = tmp.path().join("real");
        std::fs::create_dir(&real).unwrap();
        publish_chunked(&real, 1024, &[("criu/pages-1.img", b"pages")]);
        symlink(&real, tmp.path().join("linked")).unwrap();
        let err = read_published(&tmp.path().join("linked"), Verification::Sizes).unwrap_err();
        assert!(
            matches!(&err, PublishedError::Path(PathError::Symlink(p)) if p.ends_with("linked")),
            "{err}"
        );
    }

    #[test]
    fn a_fifo_manifest_is_refused_without_blocking() {
        let tmp = tempfile::tempdir().unwrap();
        publish_chunked(tmp.path(), 1024, &[("criu/pages-1.img", b"pages")]);
        for name in [FILE_MANIFEST, FILE_COMPLETE] {
            let dir = tempfile::tempdir().unwrap();
            publish_chunked(dir.path(), 1024, &[("criu/pages-1.img", b"pages")]);
            std::fs::remove_file(dir.path().join(name)).unwrap();
            nix::unistd::mkfifo(&dir.path().join(name), nix::sys::stat::Mode::S_IRWXU).unwrap();
            let path = dir.path().to_path_buf();
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let _ = tx.send(read_published(&path, Verification::Sizes).map(drop));
            });
            // A reader that opens a FIFO in blocking mode never returns (no writer comes).
            let result = rx
                .recv_timeout(std::time::Duration::from_secs(10))
                .unwrap_or_else(|_| panic!("reading a FIFO {name} blocked"));
            let err = result.unwrap_err();
            assert!(
                matches!(&err, PublishedError::Files(FileError::NotRegular(p)) if p.ends_with(name)),
                "{name}: {err}"
            );
        }
    }

    #[test]
    fn an_oversized_manifest_is_refused_naming_size_and_cap() {
        let tmp = tempfile::tempdir().unwrap();
        publish_chunked(tmp.path(), 1024, &[("criu/pages-1.img", b"pages")]);
        // Sparse: as large as a reader would have to hold, without the disk space.
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(tmp.path().join(FILE_MANIFEST))
            .unwrap();
        file.set_len(MAX_MANIFEST_BYTES + 1).unwrap();
        let err = read_published(tmp.path(), Verification::Sizes).unwrap_err();
        assert!(
            matches!(
                &err,
                PublishedError::Files(FileError::TooLarge { size, cap, .. })
                    if *size == MAX_MANIFEST_BYTES + 1 && *cap == MAX_MANIFEST_BYTES
            ),
            "{err}"
        );
        let text = err.to_string();
        assert!(
            text.contains(FILE_MANIFEST)
                && text.contains(&(MAX_MANIFEST_BYTES + 1).to_string())
                && text.contains(&MAX_MANIFEST_BYTES.to_string()),
            "{text}"
        );
    }

    #[test]
    fn a_mismatching_chunk_ends_the_check_without_hashing_the_rest() {
        let tmp = tempfile::tempdir().unwrap();
        let chunk = 4096u64;
        let big: Vec<u8> = (0..64 * chunk).map(|i| (i % 251) as u8).collect();
        let m = publish_chunked(tmp.path(), chunk, &[("criu/pages-1.img", &big)]);
        let mut changed = big.clone();
        changed[10] ^= 1;
        std::fs::write(tmp.path().join("criu/pages-1.img"), &changed).unwrap();
        let opened = open_published(tmp.path()).unwrap();
        let read = std::sync::atomic::AtomicU64::new(0);
        let err = verify_checksums(opened.dir(), &m, &|_| true, 1, &|n| {
            read.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
        })
        .unwrap_err();
        assert!(
            matches!(
                err,
                FileError::ChunkChecksum {
                    chunk: 0,
                    offset: 0,
                    ..
                }
            ),
            "{err}"
        );
        assert_eq!(
            read.load(std::sync::atomic::Ordering::Relaxed),
            chunk,
            "only the first chunk was read"
        );
        let err = verify_checksums(opened.dir(), &m, &|_| true, 4, &|_| {}).unwrap_err();
        assert!(
            matches!(err, FileError::ChunkChecksum { chunk: 0, .. }),
            "{err}"
        );
    }

    /// Seals, writes, reads and verifies like the agent and the controller do.
    fn write_and_read(m: &Manifest) -> Result<Manifest, ManifestError> {
        let bytes = m.to_json()?;
        let back = Manifest::from_json(&bytes)?;
        let marker = serde_json::to_vec(&CompletionMarker::for_manifest(m)).unwrap();
        CompletionMarker::check(&marker, &back)?;
        Ok(back)
    }

    // Shortest-form floats that serde_json's default parser reads back one unit off;
    // a digest over a re-serialisation of the parsed values refused manifests sealed with them.
    #[test]
    fn timings_that_do_not_round_trip_through_a_float_parser_still_verify() {
        for value in [
            3.528_155_755_000_000_2,
            3.971_470_217_000_000_2,
            1.465_279_820_000_000_1,
        ] {
            let mut m = manifest();
            m.timings = [("dump".to_string(), value), ("publish".to_string(), value)].into();
            m.seal();
            let back = write_and_read(&m).unwrap_or_else(|e| panic!("{value}: {e}"));
            assert_eq!(back.digest, m.digest);
            assert!(same_but_for_float_parsing(&back, &m));
        }
    }

    #[test]
    fn the_digest_covers_the_text_whitespace_aside() {
        let m = manifest();
        let text = String::from_utf8(m.to_json().unwrap()).unwrap();
        assert_eq!(
            strip_json_whitespace(text.as_bytes()),
            serde_json::to_vec(&m).unwrap(),
            "the pretty text is the compact text plus whitespace"
        );
        let reindented = text.replace("\n  ", "\n\t  ").replace(": ", " :  ");
        assert_eq!(Manifest::from_json(reindented.as_bytes()).unwrap(), m);
        // Whitespace inside a string is content.
        let mut spaced = manifest();
        spaced.source.pod = "a b".into();
        spaced.seal();
        let text = String::from_utf8(spaced.to_json().unwrap()).unwrap();
        let err = Manifest::from_json(text.replace("a b", "a  b").as_bytes()).unwrap_err();
        assert!(matches!(err, ManifestError::DigestMismatch { .. }), "{err}");
    }

    #[test]
    fn a_number_written_another_way_is_an_edit() {
        let m = manifest();
        let text = String::from_utf8(m.to_json().unwrap()).unwrap();
        let err = Manifest::from_json(text.replace("1.5", "1.50").as_bytes()).unwrap_err();
        assert!(matches!(err, ManifestError::DigestMismatch { .. }), "{err}");
    }

    #[test]
    fn a_digest_that_is_not_the_last_member_is_refused() {
        let m = manifest();
        let value: serde_json::Value = serde_json::from_slice(&m.to_json().unwrap()).unwrap();
        // serde_json's map sorts keys: `digest` moves up front, everything else is unchanged.
        let moved = serde_json::to_vec_pretty(&value).unwrap();
        let err = Manifest::from_json(&moved).unwrap_err();
        assert!(matches!(err, ManifestError::DigestPlacement), "{err}");
        assert!(err.to_string().contains("was edited"));
        let mut unsealed = m.clone();
        unsealed.digest.clear();
        let err = Manifest::from_json(&unsealed.to_json().unwrap()).unwrap_err();
        assert!(matches!(err, ManifestError::DigestMismatch { .. }), "{err}");
    }

    /// `a == b`, timings but for rounding: serde_json's default float parser may read a
    /// shortest-form float back a few units in the last place off (more for extreme exponents),
    /// which is harmless for a duration and must not matter for the digest.
    fn same_but_for_float_parsing(a: &Manifest, b: &Manifest) -> bool {
        let close = a.timings.len() == b.timings.len()
            && a.timings
                .iter()
                .zip(&b.timings)
                .all(|((ka, va), (kb, vb))| {
                    let diff = (va - vb).abs();
                    ka == kb && (diff <= va.abs().max(vb.abs()) * 1e-12 || diff < 1e-300)
                });
        let mut a = a.clone();
        a.timings.clone_from(&b.timings);
        close && &a == b
    }

    fn free_text() -> impl Strategy<Value = String> {
        prop_oneof![
            any::<String>(),
            "[ \"\\\\/\u{0}-\u{1f}\u{7f}\u{2028}\u{2029}<>&é漢🦀]{0,12}",
        ]
    }

    fn timing() -> impl Strategy<Value = f64> {
        prop_oneof![
            proptest::num::f64::POSITIVE
                | proptest::num::f64::NORMAL
                | proptest::num::f64::SUBNORMAL
                | proptest::num::f64::ZERO,
            (0u64..10_000_000_000_000)
                .prop_map(|ns| std::time::Duration::from_nanos(ns).as_secs_f64()),
        ]
    }

    fn generated_manifest() -> impl Strategy<Value = Manifest> {
        let element = "[a-zA-Z0-9_-][a-zA-Z0-9._-]{0,20}";
        let files = proptest::collection::btree_map(
            proptest::collection::vec(element, 1..4).prop_map(|parts| parts.join("/")),
            (any::<u64>(), "[0-9a-f]{64}"),
            0..12,
        );
        let mounts = proptest::collection::vec(
            (free_text(), free_text(), free_text(), 0..3u8, free_text()),
            0..5,
        );
        let cuda = proptest::option::of((
            free_text(),
            proptest::collection::vec((free_text(), free_text(), any::<u64>()), 0..4),
            proptest::collection::vec(any::<u32>(), 0..4),
        ));
        (
            (
                free_text(),
                free_text(),
                free_text(),
                free_text(),
                free_text(),
            ),
            (
                any::<bool>(),
                any::<bool>(),
                proptest::sample::select(vec![
                    CgroupMode::Ignore,
                    CgroupMode::Soft,
                    CgroupMode::Full,
                    CgroupMode::Strict,
                ]),
                proptest::collection::vec(free_text(), 0..3),
                any::<i32>(),
            ),
            mounts,
            cuda,
            proptest::collection::btree_map(free_text(), timing(), 0..8),
            files,
        )
            .prop_map(|(source, options, mounts, cuda, timings, files)| {
                let mut m = manifest();
                m.created_at = source.0.clone();
                m.source = SourceInfo {
                    pod: source.0,
                    namespace: source.1,
                    node: source.2,
                    container: source.3,
                    container_id: source.4,
                    image: String::new(),
                };
                m.criu.options = CriuOptions {
                    leave_running: options.0,
                    tcp_established: options.1,
                    manage_cgroups_mode: options.2,
                    external: options.3.clone(),
                    stdio: options.3,
                    log_level: options.4,
                    ..Default::default()
                };
                m.mounts = mounts
                    .into_iter()
                    .map(|(destination, fstype, source, t, reason)| MountPlanEntry {
                        destination,
                        fstype,
                        source,
                        treatment: [
                            MountTreatment::External,
                            MountTreatment::Dumped,
                            MountTreatment::Skipped,
                        ][usize::from(t)],
                        reason,
                    })
                    .collect();
                m.cuda = cuda.map(|(driver_version, gpus, pids)| CudaSection {
                    driver_version,
                    gpus: gpus
                        .into_iter()
                        .map(|(uuid, model, memory_bytes)| GpuInfo {
                            uuid,
                            model,
                            memory_bytes,
                        })
                        .collect(),
                    pids,
                    method: "driver-api".into(),
                    processes: Vec::new(),
                });
                m.timings = timings;
                m.files = files
                    .into_iter()
                    .map(|(path, (size, sha256))| FileEntry {
                        path,
                        size,
                        sha256,
                        chunks: Vec::new(),
                    })
                    .collect();
                m.seal();
                m
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn every_sealed_manifest_verifies_after_a_write_and_a_read(m in generated_manifest()) {
            let back = write_and_read(&m).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(&back.digest, &m.digest);
            prop_assert!(same_but_for_float_parsing(&back, &m), "{:?} != {:?}", back, m);
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(500))]

        #[test]
        fn every_edit_of_a_sealed_manifest_is_refused(m in generated_manifest(), pod in free_text()) {
            prop_assume!(pod != m.source.pod);
            let mut edited = m.clone();
            edited.source.pod = pod;
            // The edited content with the old digest: what a hand edit of the file produces.
            let err = Manifest::from_json(&edited.to_json().unwrap()).unwrap_err();
            prop_assert!(matches!(err, ManifestError::DigestMismatch { .. }), "{}", err);
        }
    }

    proptest! {
        #[test]
        fn path_validation_never_panics_and_accepted_elements_are_plain(s in "\\PC{0,300}") {
            if validate_path_element("x", &s).is_ok() {
                prop_assert!(!s.is_empty() && s != "." && s != ".." && s.len() <= 253);
                prop_assert!(s.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b)));
            }
            let _ = validate_relative_file(&s);
        }

        #[test]
        fn manifest_parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Manifest::from_json(&bytes);
        }
    }

    #[test]
    fn the_gpus_a_container_was_given_round_trip_and_older_manifests_read_without_them() {
        let mut m = manifest();
        m.seal();
        let old = serde_json::to_vec(&m).unwrap();
        assert!(!String::from_utf8_lossy(&old).contains("assignedGpus"));
        assert_eq!(Manifest::from_json(&old).unwrap().assigned_gpus, None);
        m.assigned_gpus = Some(AssignedGpus {
            source: GpuSource::PodResources,
            resource: "nvidia.com/gpu".into(),
            devices: vec!["GPU-a".into()],
            uuids: Vec::new(),
        });
        m.seal();
        let text = serde_json::to_string(&m).unwrap();
        assert!(
            text.contains(r#""assignedGpus":{"source":"pod-resources","resource":"nvidia.com/gpu","devices":["GPU-a"]}"#),
            "{text}"
        );
        let read = Manifest::from_json(text.as_bytes()).unwrap();
        let gpus = read.assigned_gpus.unwrap();
        assert_eq!(gpus.count(), Some(1));
        assert_eq!(
            gpus.to_string(),
            "GPU-a from the kubelet's PodResources API (nvidia.com/gpu)"
        );
        let all = AssignedGpus {
            source: GpuSource::Env,
            resource: String::new(),
            devices: vec!["all".into()],
            uuids: Vec::new(),
        };
        assert_eq!(all.count(), None, "all, without the driver, is no count");
    }
}
