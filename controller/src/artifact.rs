//! The controller's side of artifact storage: verifying a published artifact before a
//! Checkpoint turns Ready (marker, manifest digest, file sizes, identity hash), removing it when
//! a Checkpoint with `deletionPolicy: Delete` goes away, and sweeping staging directories left
//! by crashed captures. Every path is an [`ArtifactLayout`] path under the artifact root; no
//! symlink is ever followed. Blocking file I/O: call from a blocking thread.

use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use thiserror::Error;
use warmstart_shared::artifact::{
    ArtifactLayout, Manifest, PathError, PublishedError, Verification, read_published,
    validate_path_element,
};
use warmstart_shared::names::STAGING_PREFIX;
use warmstart_shared::v1alpha1::{ArtifactStatus, GpuStatus};

/// Why an artifact is not acceptable.
#[derive(Debug, Error)]
pub enum ArtifactError {
    /// The location is not a safe path under the root.
    #[error("artifact location is unsafe")]
    Path(#[from] PathError),
    /// Nothing is published at the location.
    #[error("no artifact at {0}")]
    Missing(PathBuf),
    /// The artifact is incomplete or invalid.
    #[error("artifact at {path} is invalid")]
    Invalid {
        /// The artifact directory.
        path: PathBuf,
        /// What is wrong.
        #[source]
        source: PublishedError,
    },
    /// The artifact belongs to another identity.
    #[error("artifact at {path} holds identity hash {found}, expected {expected}")]
    IdentityMismatch {
        /// The artifact directory.
        path: PathBuf,
        /// The Checkpoint's hash.
        expected: String,
        /// The manifest's hash.
        found: String,
    },
    /// Removal failed.
    #[error("cannot remove {path}")]
    Remove {
        /// What was being removed.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
}

impl ArtifactError {
    /// A short, stable label for metrics.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Self::Path(_) => "artifact_path",
            Self::Missing(_) => "artifact_missing",
            Self::Invalid { .. } => "artifact_invalid",
            Self::IdentityMismatch { .. } => "artifact_identity",
            Self::Remove { .. } => "artifact_remove",
        }
    }
}

/// A verified artifact and what the Checkpoint's status reports about it.
#[derive(Clone, Debug)]
pub struct Verified {
    /// The artifact directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

impl Verified {
    /// `status.artifact`.
    pub fn status(&self) -> ArtifactStatus {
        status_of(&self.manifest)
    }
}

/// The most timings a manifest gives a Checkpoint's status.
pub const MAX_STATUS_TIMINGS: usize = 32;
/// The most GPUs a manifest gives a Checkpoint's status.
pub const MAX_STATUS_GPUS: usize = 64;
/// The most characters of one text field (a name, a version) a manifest gives a Checkpoint's
/// status; a longer one is cut and ends in `…`.
pub const MAX_STATUS_TEXT: usize = 256;

/// `text`, cut to [`MAX_STATUS_TEXT`] characters.
fn bounded_text(text: &str) -> String {
    match text.char_indices().nth(MAX_STATUS_TEXT) {
        Some((end, _)) => format!("{}…", &text[..end]),
        None => text.to_owned(),
    }
}

/// `status.artifact` of a verified artifact's manifest, wherever it was verified. A manifest
/// is written by a node or read from a bucket: what it says is bounded here (see the `MAX_STATUS_*`
/// constants), so the Checkpoint stays far below the API server's object size limit whatever
/// it says.
pub fn status_of(m: &Manifest) -> ArtifactStatus {
    ArtifactStatus {
        size_bytes: m.total_size(),
        size: Some(warmstart_shared::v1alpha1::human_size(m.total_size())),
        manifest_digest: m.digest.clone(),
        criu_version: bounded_text(&m.criu.version),
        kernel_version: bounded_text(&m.criu.kernel_version),
        gpu: m.cuda.as_ref().map(|c| GpuStatus {
            models: c
                .gpus
                .iter()
                .take(MAX_STATUS_GPUS)
                .map(|g| bounded_text(&g.model))
                .collect(),
            uuids: c
                .gpus
                .iter()
                .take(MAX_STATUS_GPUS)
                .map(|g| bounded_text(&g.uuid))
                .collect(),
            driver_version: bounded_text(&c.driver_version),
        }),
        container: Some(bounded_text(&m.source.container)).filter(|c| !c.is_empty()),
    }
}

/// `status.timings` of a verified artifact's manifest: its first [`MAX_STATUS_TIMINGS`] steps,
/// names bounded as [`status_of`] bounds text.
pub fn status_timings(m: &Manifest) -> std::collections::BTreeMap<String, f64> {
    m.timings
        .iter()
        .take(MAX_STATUS_TIMINGS)
        .map(|(step, seconds)| (bounded_text(step), *seconds))
        .collect()
}

/// Verifies the artifact of `namespace`/`hash` under `root`: no symlinked component, completion
/// marker present and naming the manifest, manifest digest, every file's size, identity hash.
///
/// # Errors
/// [`ArtifactError`] saying what is missing or wrong.
pub fn verify(root: &Path, namespace: &str, hash: &str) -> Result<Verified, ArtifactError> {
    let layout = ArtifactLayout::new(root, namespace, hash)?;
    let dir = layout
        .resolve()?
        .ok_or_else(|| ArtifactError::Missing(layout.dir()))?;
    let manifest =
        read_published(&dir, Verification::Sizes).map_err(|source| ArtifactError::Invalid {
            path: dir.clone(),
            source,
        })?;
    if manifest.identity_hash != hash {
        return Err(ArtifactError::IdentityMismatch {
            path: dir,
            expected: hash.to_owned(),
            found: manifest.identity_hash,
        });
    }
    Ok(Verified { dir, manifest })
}

/// Removes the artifact of `namespace`/`hash`. Idempotent: a missing artifact is success.
/// Refuses symlinked components (nothing outside the root is ever removed).
///
/// # Errors
/// [`ArtifactError::Path`] or [`ArtifactError::Remove`].
pub fn remove(root: &Path, namespace: &str, hash: &str) -> Result<bool, ArtifactError> {
    let layout = ArtifactLayout::new(root, namespace, hash)?;
    let Some(dir) = layout.resolve()? else {
        return Ok(false);
    };
    // `remove_dir_all` removes symlinks inside the tree as links, never their targets.
    match std::fs::remove_dir_all(&dir) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ArtifactError::Remove { path: dir, source }),
    }
}

/// Removes staging directories (`<root>/<namespace>/.staging-*`) not modified for `max_age`.
/// Idempotent and safe against concurrent removal. Returns what it removed.
///
/// # Errors
/// [`ArtifactError::Remove`] for the first directory that could not be removed.
pub fn sweep_staging(root: &Path, max_age: Duration) -> Result<Vec<PathBuf>, ArtifactError> {
    let now = SystemTime::now();
    let mut removed = Vec::new();
    let Ok(namespaces) = std::fs::read_dir(root) else {
        return Ok(removed);
    };
    for ns in namespaces.flatten() {
        let ns_name = ns.file_name().to_string_lossy().into_owned();
        // Only real directories with valid names: never follow a link out of the root.
        if validate_path_element("namespace", &ns_name).is_err()
            || !ns.file_type().is_ok_and(|t| t.is_dir())
        {
            continue;
        }
        let Ok(entries) = std::fs::read_dir(ns.path()) else {
            continue;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if !name.starts_with(STAGING_PREFIX) || !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let stale = entry
                .metadata()
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| now.duration_since(t).ok())
                .is_some_and(|age| age >= max_age);
            if !stale {
                continue;
            }
            let path = entry.path();
            match std::fs::remove_dir_all(&path) {
                Ok(()) => removed.push(path),
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(source) => return Err(ArtifactError::Remove { path, source }),
            }
        }
    }
    Ok(removed)
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use sha2::{Digest, Sha256};
    use warmstart_shared::artifact::{
        CompletionMarker, CriuInfo, FileEntry, FileError, MANIFEST_FORMAT_VERSION, SourceInfo,
    };
    use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

    use super::*;

    const HASH: &str = "96429b2725761a09";

    /// Writes a published artifact as the agent does.
    fn publish(root: &Path, ns: &str, hash: &str, content: &[u8]) -> PathBuf {
        let dir = root.join(ns).join(hash);
        std::fs::create_dir_all(dir.join("criu")).unwrap();
        std::fs::write(dir.join("criu/pages-1.img"), content).unwrap();
        let mut m = Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: hash.into(),
            created_at: "2026-12-02T17:00:00Z".into(),
            source: SourceInfo {
                container: "main".into(),
                ..SourceInfo::default()
            },
            criu: CriuInfo {
                version: "4.2.1".into(),
                kernel_version: "6.18.0".into(),
                ..Default::default()
            },
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: [("dump".to_owned(), 2.0)].into(),
            chunk_bytes: 4096,
            files: vec![FileEntry {
                path: "criu/pages-1.img".into(),
                size: content.len() as u64,
                sha256: String::new(),
                chunks: content
                    .chunks(4096)
                    .map(|c| hex::encode(Sha256::digest(c)))
                    .collect(),
            }],
            digest: String::new(),
        };
        m.seal();
        std::fs::write(dir.join(FILE_MANIFEST), m.to_json().unwrap()).unwrap();
        std::fs::write(
            dir.join(FILE_COMPLETE),
            serde_json::to_vec(&CompletionMarker::for_manifest(&m)).unwrap(),
        )
        .unwrap();
        dir
    }

    #[test]
    fn a_published_artifact_verifies_and_reports_its_status() {
        let root = tempfile::tempdir().unwrap();
        publish(root.path(), "default", HASH, b"pages");
        let v = verify(root.path(), "default", HASH).unwrap();
        let status = v.status();
        assert_eq!(status.size_bytes, 5);
        assert_eq!(status.criu_version, "4.2.1");
        assert!(status.manifest_digest.starts_with("sha256:"));
        assert_eq!(
            status.container.as_deref(),
            Some("main"),
            "what was captured is recorded for the webhook"
        );
        assert_eq!(v.manifest.timings["dump"], 2.0);
    }

    /// A forged manifest (a node's or a bucket's) with thousands of timings and GPUs and
    /// megabytes of text gives a status of bounded size.
    #[test]
    fn what_a_manifest_gives_the_status_is_bounded() {
        let long = "x".repeat(1 << 20);
        let mut m = Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: HASH.into(),
            created_at: "2026-12-05T00:00:00Z".into(),
            source: SourceInfo {
                container: long.clone(),
                ..Default::default()
            },
            criu: CriuInfo {
                version: long.clone(),
                kernel_version: "6.1".into(),
                ..Default::default()
            },
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: 0,
            files: vec![],
            digest: String::new(),
        };
        let name = "y".repeat(1 << 10);
        for n in 0..10_000 {
            m.timings.insert(format!("{n:05}-{name}"), 1.0);
        }
        m.cuda = Some(warmstart_shared::artifact::CudaSection {
            driver_version: long.clone(),
            gpus: (0..10_000)
                .map(|n| warmstart_shared::artifact::GpuInfo {
                    uuid: format!("GPU-{n}-{name}"),
                    model: name.clone(),
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        });
        let json = serde_json::to_string(&status_of(&m)).unwrap()
            + &serde_json::to_string(&status_timings(&m)).unwrap();
        assert!(json.len() < 64 << 10, "{} bytes", json.len());
        let status = status_of(&m);
        assert_eq!(status.criu_version.chars().count(), MAX_STATUS_TEXT + 1);
        assert!(status.criu_version.ends_with('…'));
        assert_eq!(status.kernel_version, "6.1", "short text is kept as it is");
        assert_eq!(status_timings(&m).len(), MAX_STATUS_TIMINGS);
        let gpu = status.gpu.unwrap();
        assert_eq!(
            (gpu.models.len(), gpu.uuids.len()),
            (MAX_STATUS_GPUS, MAX_STATUS_GPUS)
        );
    }

    #[test]
    fn missing_incomplete_tampered_and_foreign_artifacts_are_refused() {
        let root = tempfile::tempdir().unwrap();
        assert!(matches!(
            verify(root.path(), "default", HASH),
            Err(ArtifactError::Missing(_))
        ));

        let dir = publish(root.path(), "default", HASH, b"pages");
        std::fs::remove_file(dir.join(FILE_COMPLETE)).unwrap();
        let err = verify(root.path(), "default", HASH).unwrap_err();
        assert!(
            matches!(&err, ArtifactError::Invalid { source: PublishedError::Missing { path, .. }, .. }
                if path.ends_with(FILE_COMPLETE)),
            "{err:?}"
        );

        let dir = publish(root.path(), "ns2", HASH, b"pages");
        let text = std::fs::read_to_string(dir.join(FILE_MANIFEST)).unwrap();
        std::fs::write(dir.join(FILE_MANIFEST), text.replace("6.18.0", "6.18.1")).unwrap();
        let err = verify(root.path(), "ns2", HASH).unwrap_err();
        assert!(matches!(&err, ArtifactError::Invalid { .. }));
        assert_eq!(err.metric_label(), "artifact_invalid");

        let dir = publish(root.path(), "ns3", HASH, b"pages");
        std::fs::write(dir.join("criu/pages-1.img"), b"page").unwrap();
        assert!(matches!(
            verify(root.path(), "ns3", HASH),
            Err(ArtifactError::Invalid { .. })
        ));

        // Published under one hash, claiming another.
        let other = "0123456789abcdef";
        let dir = publish(root.path(), "ns4", other, b"pages");
        std::fs::rename(&dir, root.path().join("ns4").join(HASH)).unwrap();
        assert!(matches!(
            verify(root.path(), "ns4", HASH),
            Err(ArtifactError::IdentityMismatch { .. })
        ));
    }

    #[test]
    fn unlisted_linked_and_fifo_files_are_refused_by_name() {
        let root = tempfile::tempdir().unwrap();
        // An image no manifest lists: CRIU would read it unverified.
        let dir = publish(root.path(), "default", HASH, b"pages");
        let extra = dir.join("criu/pages-2.img");
        std::fs::write(&extra, b"unverified").unwrap();
        let err = verify(root.path(), "default", HASH).unwrap_err();
        assert!(
            matches!(&err, ArtifactError::Invalid { source: PublishedError::Files(FileError::Unlisted(p)), .. } if *p == extra),
            "{err:?}"
        );
        let chain = crate::errors::error_chain(&err);
        assert!(
            chain.contains("criu/pages-2.img is not listed in the manifest"),
            "{chain}"
        );

        // The manifest as a link to a copy outside, or as a FIFO (which would block a reader).
        let dir = publish(root.path(), "ns2", HASH, b"pages");
        let outside = tempfile::tempdir().unwrap();
        std::fs::rename(dir.join(FILE_MANIFEST), outside.path().join("m")).unwrap();
        symlink(outside.path().join("m"), dir.join(FILE_MANIFEST)).unwrap();
        let err = verify(root.path(), "ns2", HASH).unwrap_err();
        assert!(
            matches!(&err, ArtifactError::Invalid { source: PublishedError::Files(FileError::NotRegular(p)), .. } if p.ends_with(FILE_MANIFEST)),
            "{err:?}"
        );
        std::fs::remove_file(dir.join(FILE_MANIFEST)).unwrap();
        let made = std::process::Command::new("mkfifo")
            .arg(dir.join(FILE_MANIFEST))
            .status()
            .unwrap();
        assert!(made.success());
        let err = verify(root.path(), "ns2", HASH).unwrap_err();
        assert!(
            matches!(
                &err,
                ArtifactError::Invalid {
                    source: PublishedError::Files(FileError::NotRegular(_)),
                    ..
                }
            ),
            "{err:?}"
        );
    }

    #[test]
    fn removal_is_idempotent_and_never_follows_links() {
        let root = tempfile::tempdir().unwrap();
        let dir = publish(root.path(), "default", HASH, b"pages");
        assert!(remove(root.path(), "default", HASH).unwrap());
        assert!(!dir.exists());
        assert!(
            !remove(root.path(), "default", HASH).unwrap(),
            "already gone is fine"
        );

        let outside = tempfile::tempdir().unwrap();
        let victim = publish(outside.path(), "x", HASH, b"keep");
        symlink(outside.path().join("x"), root.path().join("linked")).unwrap();
        assert!(matches!(
            remove(root.path(), "linked", HASH),
            Err(ArtifactError::Path(_))
        ));
        assert!(victim.exists());
        assert!(matches!(
            remove(root.path(), "..", HASH),
            Err(ArtifactError::Path(_))
        ));
    }

    #[test]
    fn only_stale_staging_directories_are_swept() {
        let root = tempfile::tempdir().unwrap();
        let ns = root.path().join("default");
        std::fs::create_dir_all(ns.join(".staging-abc-1")).unwrap();
        std::fs::create_dir_all(ns.join(HASH)).unwrap();
        assert!(
            sweep_staging(root.path(), Duration::from_secs(3600))
                .unwrap()
                .is_empty()
        );
        let removed = sweep_staging(root.path(), Duration::ZERO).unwrap();
        assert_eq!(removed, vec![ns.join(".staging-abc-1")]);
        assert!(
            ns.join(HASH).exists(),
            "published artifacts are never swept"
        );
        assert!(
            sweep_staging(root.path(), Duration::ZERO)
                .unwrap()
                .is_empty()
        );
        assert!(
            sweep_staging(&root.path().join("absent"), Duration::ZERO)
                .unwrap()
                .is_empty()
        );
    }
}
