//! The artifact store: a bucket holding artifacts in the directory artifact's layout
//! (`<prefix>/<namespace>/<hash>/<file>`), the completion marker and manifest read from it as
//! hostile input, an artifact checked in it ([`Store::verify`]) and deleted from it, marker
//! first ([`Store::delete`]), and stale multipart uploads swept. Upload and download are in
//! their own modules.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt, stream};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use warmstart_shared::artifact::{
    ArtifactLayout, CompletionMarker, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest,
};
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use crate::client::S3;
use crate::config::StoreConfig;
use crate::error::StoreError;
use crate::frames::{self, FRAME_INDEX, FrameIndex};
use crate::requests::{ListedObject, PendingUpload};

/// Largest manifest chunk a download reads in one request (publication writes 8 MiB chunks):
/// a stored manifest is hostile input, and one huge chunk would be held in memory whole.
const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// Bytes transferred so far, readable by the caller while a transfer runs.
#[derive(Clone, Debug, Default)]
pub struct Progress(Arc<Counters>);

#[derive(Debug, Default)]
struct Counters {
    bytes: AtomicU64,
    stored: AtomicU64,
}

impl Progress {
    /// A counter at 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes transferred so far (artifact file bytes, checked).
    pub fn bytes(&self) -> u64 {
        self.0.bytes.load(Ordering::Relaxed)
    }

    /// Bytes of stored objects sent or received so far for those artifact bytes: fewer than
    /// [`Progress::bytes`] for a compressed artifact.
    pub fn stored_bytes(&self) -> u64 {
        self.0.stored.load(Ordering::Relaxed)
    }

    pub(crate) fn add(&self, n: u64) {
        self.add_both(n, n);
    }

    pub(crate) fn add_both(&self, bytes: u64, stored: u64) {
        self.0.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.0.stored.fetch_add(stored, Ordering::Relaxed);
    }
}

/// An S3-compatible bucket holding artifacts.
#[derive(Clone, Debug)]
pub struct Store {
    pub(crate) s3: S3,
}

pub(crate) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

impl Store {
    /// A store for `config`; the credentials are read from their files now.
    ///
    /// # Errors
    /// [`StoreError::Config`] for a bad setting or unreadable credential file,
    /// [`StoreError::Client`] for an unusable CA bundle.
    pub fn new(config: StoreConfig) -> Result<Self, StoreError> {
        Ok(Self {
            s3: S3::new(config)?,
        })
    }

    /// The settings.
    pub fn config(&self) -> &StoreConfig {
        &self.s3.config
    }

    /// `<prefix>/<namespace>/<hash>/`: every key of the artifact starts with it.
    ///
    /// # Errors
    /// [`StoreError::Name`] for an unsafe namespace or a malformed hash.
    pub fn artifact_prefix(&self, namespace: &str, hash: &str) -> Result<String, StoreError> {
        let layout = ArtifactLayout::new("/", namespace, hash)?;
        Ok(format!(
            "{}{}/",
            self.config().key_root(),
            layout.relative()
        ))
    }

    /// Multipart uploads in progress under the store's prefix.
    ///
    /// # Errors
    /// [`StoreError`] when the listing fails.
    pub async fn pending_uploads(&self) -> Result<Vec<PendingUpload>, StoreError> {
        self.s3.list_multipart(&self.config().key_root()).await
    }

    /// Every object under the store's prefix.
    ///
    /// # Errors
    /// [`StoreError`] when the listing fails.
    pub async fn objects(&self) -> Result<Vec<ListedObject>, StoreError> {
        self.s3.list_objects(&self.config().key_root()).await
    }

    /// Reads the completion marker and the manifest it names, as hostile input.
    pub(crate) async fn read_complete(
        &self,
        prefix: &str,
    ) -> Result<(Manifest, Bytes, Bytes), StoreError> {
        let (namespace, hash) = split_prefix(prefix);
        let marker_key = format!("{prefix}{FILE_COMPLETE}");
        let incomplete = |detail: String| StoreError::Incomplete {
            store: self.s3.store(),
            namespace: namespace.clone(),
            hash: hash.clone(),
            detail,
        };
        let Some(marker) = self
            .s3
            .get_object(
                "read the completion marker",
                &marker_key,
                usize::try_from(MAX_MARKER_BYTES).unwrap_or(usize::MAX),
            )
            .await?
        else {
            let objects = self.s3.list_objects(prefix).await?;
            if objects.is_empty() {
                return Err(StoreError::NotFound {
                    store: self.s3.store(),
                    namespace,
                    hash,
                    key: marker_key,
                });
            }
            return Err(incomplete(format!(
                "{} object(s) but no completion marker: an upload did not finish",
                objects.len()
            )));
        };
        let Some(manifest_bytes) = self
            .s3
            .get_object(
                "read the manifest",
                &format!("{prefix}{FILE_MANIFEST}"),
                usize::try_from(MAX_MANIFEST_BYTES).unwrap_or(usize::MAX),
            )
            .await?
        else {
            return Err(incomplete("a completion marker but no manifest".into()));
        };
        let what = || {
            format!(
                "stored manifest of {namespace}/{hash} in {}",
                self.s3.store()
            )
        };
        let manifest =
            Manifest::from_json(&manifest_bytes).map_err(|source| StoreError::Manifest {
                what: what(),
                source,
            })?;
        CompletionMarker::check(&marker, &manifest).map_err(|source| StoreError::Manifest {
            what: what(),
            source,
        })?;
        if manifest.identity_hash != hash {
            return Err(incomplete(format!(
                "the manifest is that of {}",
                manifest.identity_hash
            )));
        }
        if manifest.chunk_bytes > MAX_CHUNK_BYTES {
            return Err(incomplete(format!(
                "the manifest's chunks of {} bytes are larger than the {MAX_CHUNK_BYTES} bytes read at once",
                manifest.chunk_bytes
            )));
        }
        Ok((manifest, manifest_bytes, marker))
    }

    /// The frame index of the artifact under `prefix` whose manifest is `manifest`, checked
    /// against it; `None` when the artifact is stored uncompressed.
    pub(crate) async fn read_frames(
        &self,
        prefix: &str,
        manifest: &Manifest,
    ) -> Result<Option<FrameIndex>, StoreError> {
        if !frames::compressible(manifest) {
            // Such an artifact is never compressed, and an object of that name is no index.
            return Ok(None);
        }
        let Some(bytes) = self
            .s3
            .get_object(
                "read the frame index",
                &format!("{prefix}{FRAME_INDEX}"),
                usize::try_from(MAX_MANIFEST_BYTES).unwrap_or(usize::MAX),
            )
            .await?
        else {
            return Ok(None);
        };
        let manifest = manifest.clone();
        let parsed = blocking(move || Ok(FrameIndex::parse(&bytes, &manifest))).await?;
        parsed.map(Some).map_err(|detail| {
            let (namespace, hash) = split_prefix(prefix);
            StoreError::FrameIndex {
                store: self.s3.store(),
                namespace,
                hash,
                detail,
            }
        })
    }

    /// Checks that `namespace/hash` is complete in the bucket: the marker names the manifest,
    /// and every listed file is there with its listed size (with its frames' total size, and
    /// the frame index readable, for a compressed artifact). Returns the manifest.
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::Incomplete`] naming what is missing or wrong,
    /// [`StoreError::Manifest`], or a request's error.
    pub async fn verify(&self, namespace: &str, hash: &str) -> Result<Manifest, StoreError> {
        let prefix = self.artifact_prefix(namespace, hash)?;
        let span = tracing::info_span!("s3_verify", namespace, hash, store = %self.s3.store());
        async {
            let (manifest, _, _) = self.read_complete(&prefix).await?;
            let frames = self.read_frames(&prefix, &manifest).await?;
            let stored: std::collections::HashMap<String, u64> = self
                .s3
                .list_objects(&prefix)
                .await?
                .into_iter()
                .map(|o| (o.key, o.size))
                .collect();
            for file in &manifest.files {
                let (expected, says) = match &frames {
                    Some(frames) => (frames.stored_size(&file.path), "its frame index says"),
                    None => (file.size, "the manifest says"),
                };
                let detail = match stored.get(&format!("{prefix}{}", file.path)) {
                    None => format!("{} is missing", file.path),
                    Some(&size) if size != expected => {
                        format!("{} has {size} bytes, {says} {expected}", file.path)
                    }
                    Some(_) => continue,
                };
                return Err(StoreError::Incomplete {
                    store: self.s3.store(),
                    namespace: namespace.to_owned(),
                    hash: hash.to_owned(),
                    detail,
                });
            }
            Ok(manifest)
        }
        .instrument(span)
        .await
    }

    /// Deletes `namespace/hash`: the completion marker first (a reader stops trusting the
    /// artifact at once), then every other object under it, then any multipart upload under
    /// it. Returns the number of objects deleted; an absent artifact is no error.
    ///
    /// # Errors
    /// A request's error; a marker already deleted stays deleted.
    pub async fn delete(&self, namespace: &str, hash: &str) -> Result<usize, StoreError> {
        let prefix = self.artifact_prefix(namespace, hash)?;
        let span = tracing::info_span!("s3_delete", namespace, hash, store = %self.s3.store());
        async {
            let marker = format!("{prefix}{FILE_COMPLETE}");
            self.s3
                .delete_object("delete the completion marker", &marker)
                .await?;
            let objects = self.s3.list_objects(&prefix).await?;
            let count = objects.len();
            stream::iter(objects.into_iter().map(|object| async move {
                self.s3
                    .delete_object(&format!("delete {}", object.key), &object.key)
                    .await
            }))
            .buffer_unordered(self.config().concurrency)
            .try_collect::<Vec<()>>()
            .await?;
            for pending in self.s3.list_multipart(&prefix).await? {
                self.s3
                    .abort_multipart(
                        &format!("abort the upload of {}", pending.key),
                        &pending.key,
                        &pending.upload_id,
                    )
                    .await?;
            }
            Ok(count)
        }
        .instrument(span)
        .await
    }

    /// Aborts the multipart uploads under the store's prefix started more than `older_than`
    /// ago (uploads whose uploader died); returns how many. An upload whose start time the
    /// server does not say is left alone.
    ///
    /// # Errors
    /// A request's error.
    pub async fn sweep_stale_uploads(&self, older_than: Duration) -> Result<usize, StoreError> {
        let now = jiff::Timestamp::now();
        let mut aborted = 0;
        for pending in self.pending_uploads().await? {
            let Ok(started) = pending.initiated.parse::<jiff::Timestamp>() else {
                tracing::warn!(key = %pending.key, initiated = %pending.initiated, "a multipart upload without a readable start time is left alone");
                continue;
            };
            let age = now.duration_since(started);
            if age.is_negative() || age.unsigned_abs() < older_than {
                continue;
            }
            tracing::info!(key = %pending.key, %started, "aborting a stale multipart upload");
            self.s3
                .abort_multipart(
                    &format!("abort the stale upload of {}", pending.key),
                    &pending.key,
                    &pending.upload_id,
                )
                .await?;
            aborted += 1;
        }
        Ok(aborted)
    }
}

/// `(namespace, hash)` from `<root><namespace>/<hash>/`.
pub(crate) fn split_prefix(prefix: &str) -> (String, String) {
    let mut parts = prefix.trim_end_matches('/').rsplit('/');
    let hash = parts.next().unwrap_or_default().to_owned();
    let namespace = parts.next().unwrap_or_default().to_owned();
    (namespace, hash)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_splits_into_namespace_and_hash() {
        assert_eq!(
            split_prefix("a/b/ns/0123456789abcdef/"),
            ("ns".into(), "0123456789abcdef".into())
        );
    }
}
