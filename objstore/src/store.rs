//! The artifact store: a published artifact uploaded to, checked in, downloaded from and deleted
//! from a bucket, in the directory artifact's layout (`<prefix>/<namespace>/<hash>/<file>`).
//!
//! The completion marker is uploaded last and deleted first, so a reader that finds it finds a
//! whole artifact. Files larger than a part go up as multipart uploads whose parts are sent in
//! parallel, each with its `Content-MD5` for the server to check; an upload that fails is
//! aborted (and a later upload of the same artifact aborts what an interrupted one left). A
//! download reads the marker, then the manifest it names, then every file in parallel ranged
//! reads, each chunk checked against the manifest's digest before it is written into a staging
//! directory, which only then holds a manifest and a marker.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt, stream};
use sha2::{Digest, Sha256};
use tracing::Instrument;
use warmstart_shared::artifact::{
    ArtifactDir, ArtifactLayout, CompletionMarker, FileEntry, FileError, MAX_MANIFEST_BYTES,
    MAX_MARKER_BYTES, Manifest, open_published, verify_checksums,
};
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use crate::client::S3;
use crate::config::StoreConfig;
use crate::error::{BadChunk, StoreError, io_err};
use crate::requests::{ListedObject, PendingUpload, content_md5};

/// S3's limit on the parts of one multipart upload.
const MAX_PARTS: u64 = 10_000;
/// Ranged reads of a download cover whole chunks, at least this many bytes where chunks are
/// smaller.
const MIN_RANGE: u64 = 4 << 20;
/// Largest manifest chunk a download reads in one request (publication writes 8 MiB chunks):
/// a stored manifest is hostile input, and one huge chunk would be held in memory whole.
const MAX_CHUNK_BYTES: u64 = 1 << 30;
/// What creating a download's staging directory is called in errors (and how a failure to
/// create it, which leaves nothing of this download to remove, is told apart).
const STAGING_CREATE: &str = "create the staging directory";

/// Bytes transferred so far, readable by the caller while a transfer runs.
#[derive(Clone, Debug, Default)]
pub struct Progress(Arc<AtomicU64>);

impl Progress {
    /// A counter at 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// Bytes transferred so far (artifact file bytes, checked).
    pub fn bytes(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }

    fn add(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }
}

/// What an upload did.
#[derive(Clone, Debug)]
pub struct UploadReport {
    /// The manifest uploaded.
    pub manifest: Manifest,
    /// Artifact file bytes sent.
    pub bytes: u64,
    /// Files sent as multipart uploads.
    pub multipart_files: usize,
    /// The same artifact was already complete in the bucket: nothing was sent.
    pub already_present: bool,
}

/// An S3-compatible bucket holding artifacts.
#[derive(Clone, Debug)]
pub struct Store {
    s3: S3,
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, StoreError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| StoreError::Task(e.to_string()))?
}

fn sha256_hex(bytes: &[u8]) -> String {
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

    /// Uploads the published artifact in `dir` (checked as [`open_published`] does) as
    /// `namespace/hash`: every listed file, then the manifest, then the completion marker.
    /// Multipart uploads an earlier, interrupted upload of this artifact left are aborted
    /// first. An artifact already complete in the bucket with the same manifest is left as it
    /// is. Each request is retried where that can help; an upload that fails all the same for
    /// a transient cause ([`StoreError::is_transient`]) is started again
    /// ([`StoreConfig::upload_retries`] times, with its own backoff; `progress` then counts the
    /// bytes sent again too).
    ///
    /// # Errors
    /// [`StoreError`] naming the file or part and the server's answer; the bucket then holds no
    /// completion marker for the artifact, and no multipart upload of this call (unless the
    /// server could not be reached to abort it: the next upload or
    /// [`Store::sweep_stale_uploads`] does).
    pub async fn upload(
        &self,
        dir: &Path,
        namespace: &str,
        hash: &str,
        progress: &Progress,
    ) -> Result<UploadReport, StoreError> {
        let prefix = self.artifact_prefix(namespace, hash)?;
        let span = tracing::info_span!("s3_upload", namespace, hash, store = %self.s3.store());
        let mut backoff = self.config().upload_retry_backoff;
        // The first failure says where the upload was cut off (file and part); a later attempt
        // that fails the same way usually fails on its first request.
        let mut first: Option<StoreError> = None;
        for attempt in 0..=self.config().upload_retries {
            if attempt > 0 {
                tokio::time::sleep(backoff).await;
                backoff = backoff.saturating_mul(2).min(Duration::from_secs(120));
            }
            let result = self
                .upload_inner(dir.to_path_buf(), prefix.clone(), hash.to_owned(), progress)
                .instrument(span.clone())
                .await;
            match result {
                Err(error) if error.is_transient() => {
                    tracing::warn!(parent: &span, %error, attempt, "the upload failed");
                    first.get_or_insert(error);
                }
                result => return result,
            }
        }
        Err(first.unwrap_or_else(|| StoreError::Task("no upload attempt was made".into())))
    }

    async fn upload_inner(
        &self,
        dir: PathBuf,
        prefix: String,
        hash: String,
        progress: &Progress,
    ) -> Result<UploadReport, StoreError> {
        let local = blocking(move || open_local(dir)).await?;
        if local.manifest.identity_hash != hash {
            return Err(StoreError::LocalChanged {
                path: local.dir.join(FILE_MANIFEST),
                detail: format!(
                    "it is the manifest of {}, not of {hash}",
                    local.manifest.identity_hash
                ),
            });
        }
        if self.prepare_upload(&prefix, &local.manifest).await? {
            return Ok(UploadReport {
                manifest: local.manifest,
                bytes: 0,
                multipart_files: 0,
                already_present: true,
            });
        }
        let part_size = part_size(
            self.config().part_size,
            local.manifest.chunk_bytes,
            local
                .manifest
                .files
                .iter()
                .map(|f| f.size)
                .max()
                .unwrap_or(0),
        );
        let chunk_bytes = if local.manifest.format_version >= 2 {
            local.manifest.chunk_bytes
        } else {
            0
        };
        let concurrency = self.config().concurrency;
        let (small, large): (Vec<_>, Vec<_>) = local
            .files
            .iter()
            .cloned()
            .partition(|f| f.entry.size <= part_size);
        stream::iter(small.into_iter().map(|file| {
            let key = format!("{prefix}{}", file.entry.path);
            async move {
                let size = file.entry.size;
                let body = read_part(&file, chunk_bytes, 0, size).await?;
                self.s3
                    .put_object(
                        &format!("upload {}", file.entry.path),
                        &key,
                        body.bytes,
                        &body.md5,
                    )
                    .instrument(tracing::debug_span!("file", file = %file.entry.path))
                    .await?;
                progress.add(size);
                Ok::<_, StoreError>(())
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect::<Vec<()>>()
        .await?;
        for file in &large {
            let key = format!("{prefix}{}", file.entry.path);
            self.upload_multipart(file, &key, part_size, chunk_bytes, progress)
                .instrument(tracing::info_span!("file", file = %file.entry.path))
                .await?;
        }
        for (what, name, bytes) in [
            ("upload the manifest", FILE_MANIFEST, local.manifest_bytes),
            (
                "upload the completion marker",
                FILE_COMPLETE,
                local.marker_bytes,
            ),
        ] {
            let body = with_md5(bytes).await?;
            self.s3
                .put_object(what, &format!("{prefix}{name}"), body.bytes, &body.md5)
                .await?;
        }
        Ok(UploadReport {
            bytes: local.manifest.total_size(),
            multipart_files: large.len(),
            manifest: local.manifest,
            already_present: false,
        })
    }

    /// Before an upload: aborts the multipart uploads an interrupted upload of this artifact
    /// left (an artifact has one uploader at a time, as it has one publisher), and finds
    /// whether the artifact is already complete in the bucket (`true`: nothing to send; a
    /// marker of another manifest there is an error).
    async fn prepare_upload(&self, prefix: &str, manifest: &Manifest) -> Result<bool, StoreError> {
        for pending in self.s3.list_multipart(prefix).await? {
            tracing::info!(key = %pending.key, "aborting a multipart upload an earlier attempt left");
            self.s3
                .abort_multipart(
                    &format!("abort the earlier upload of {}", pending.key),
                    &pending.key,
                    &pending.upload_id,
                )
                .await?;
        }
        let marker_key = format!("{prefix}{FILE_COMPLETE}");
        if let Some(existing) = self
            .s3
            .get_object(
                "read the stored completion marker",
                &marker_key,
                usize::try_from(MAX_MARKER_BYTES).unwrap_or(usize::MAX),
            )
            .await?
        {
            let remote = serde_json::from_slice::<CompletionMarker>(&existing)
                .map(|m| m.manifest_digest)
                .unwrap_or_else(|_| "(unreadable marker)".into());
            if remote == manifest.digest {
                tracing::info!("the artifact is already complete in the bucket");
                return Ok(true);
            }
            let (namespace, hash) = split_prefix(prefix);
            return Err(StoreError::Exists {
                store: self.s3.store(),
                namespace,
                hash,
                remote,
                local: manifest.digest.clone(),
            });
        }
        Ok(false)
    }

    async fn upload_multipart(
        &self,
        file: &LocalFile,
        key: &str,
        part_size: u64,
        chunk_bytes: u64,
        progress: &Progress,
    ) -> Result<(), StoreError> {
        let name = &file.entry.path;
        let upload_id = self
            .s3
            .create_multipart(&format!("start the multipart upload of {name}"), key)
            .await?;
        let parts = file.entry.size.div_ceil(part_size);
        let result = async {
            let etags: Vec<String> = stream::iter((0..parts).map(|index| {
                let upload_id = &upload_id;
                async move {
                    let offset = index * part_size;
                    let len = part_size.min(file.entry.size - offset);
                    let body = read_part(file, chunk_bytes, offset, len).await?;
                    let number = u16::try_from(index + 1).unwrap_or(u16::MAX);
                    let etag = self
                        .s3
                        .upload_part(
                            &format!("upload part {} of {parts} of {name}", index + 1),
                            key,
                            upload_id,
                            number,
                            body.bytes,
                            &body.md5,
                        )
                        .await?;
                    progress.add(len);
                    Ok::<_, StoreError>(etag)
                }
            }))
            .buffered(self.config().concurrency)
            .try_collect()
            .await?;
            self.s3
                .complete_multipart(
                    &format!("complete the multipart upload of {name}"),
                    key,
                    &upload_id,
                    &etags,
                )
                .await
        }
        .await;
        if let Err(error) = result {
            if let Err(abort) = self
                .s3
                .abort_multipart(
                    &format!("abort the multipart upload of {name}"),
                    key,
                    &upload_id,
                )
                .await
            {
                tracing::warn!(%abort, "a failed multipart upload could not be aborted: the next upload of this artifact or the stale-upload sweep aborts it");
            }
            return Err(error);
        }
        Ok(())
    }

    /// Reads the completion marker and the manifest it names, as hostile input.
    async fn read_complete(&self, prefix: &str) -> Result<(Manifest, Bytes, Bytes), StoreError> {
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

    /// Checks that `namespace/hash` is complete in the bucket: the marker names the manifest,
    /// and every listed file is there with its listed size. Returns the manifest.
    ///
    /// # Errors
    /// [`StoreError::NotFound`], [`StoreError::Incomplete`] naming what is missing or wrong,
    /// [`StoreError::Manifest`], or a request's error.
    pub async fn verify(&self, namespace: &str, hash: &str) -> Result<Manifest, StoreError> {
        let prefix = self.artifact_prefix(namespace, hash)?;
        let span = tracing::info_span!("s3_verify", namespace, hash, store = %self.s3.store());
        async {
            let (manifest, _, _) = self.read_complete(&prefix).await?;
            let stored: std::collections::HashMap<String, u64> = self
                .s3
                .list_objects(&prefix)
                .await?
                .into_iter()
                .map(|o| (o.key, o.size))
                .collect();
            for file in &manifest.files {
                let detail = match stored.get(&format!("{prefix}{}", file.path)) {
                    None => format!("{} is missing", file.path),
                    Some(&size) if size != file.size => format!(
                        "{} has {size} bytes, the manifest says {}",
                        file.path, file.size
                    ),
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

    /// Downloads `namespace/hash` into `staging` (a new directory, created here; its parent
    /// must exist): the marker, the manifest, then every file in parallel ranged reads, each
    /// chunk checked against the manifest as it lands; the manifest and marker are written
    /// last, everything fsynced. Rename it into place with [`place`]. `progress` counts the
    /// checked bytes.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] / [`StoreError::Incomplete`] when the bucket holds no complete
    /// artifact, [`StoreError::ChunkMismatch`] naming the file and chunk that differs, or a
    /// request's or the disk's error. After an error `staging` is removed: nothing of a failed
    /// download is left to be used.
    pub async fn download(
        &self,
        namespace: &str,
        hash: &str,
        staging: &Path,
        progress: &Progress,
    ) -> Result<Manifest, StoreError> {
        let prefix = self.artifact_prefix(namespace, hash)?;
        let span = tracing::info_span!("s3_download", namespace, hash, store = %self.s3.store());
        let (manifest, manifest_bytes, marker) =
            self.read_complete(&prefix).instrument(span.clone()).await?;
        let staging = staging.to_path_buf();
        let created = {
            let staging = staging.clone();
            let manifest = manifest.clone();
            blocking(move || create_staging(&staging, &manifest)).await
        };
        let files = match created {
            Ok(files) => files,
            // Not ours: an existing directory is left alone.
            Err(
                e @ StoreError::Io {
                    op: STAGING_CREATE, ..
                },
            ) => return Err(e),
            Err(e) => {
                remove_staging(staging).await;
                return Err(e);
            }
        };
        let result = self
            .download_files(&prefix, &manifest, files, &staging, progress)
            .instrument(span)
            .await;
        let result = match result {
            Ok(()) => {
                let staging = staging.clone();
                blocking(move || finish_staging(&staging, &manifest_bytes, &marker)).await
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(()) => Ok(manifest),
            Err(e) => {
                remove_staging(staging).await;
                Err(e)
            }
        }
    }

    async fn download_files(
        &self,
        prefix: &str,
        manifest: &Manifest,
        files: Vec<Arc<File>>,
        staging: &Path,
        progress: &Progress,
    ) -> Result<(), StoreError> {
        let (namespace, hash) = split_prefix(prefix);
        let chunked = manifest.format_version >= 2;
        let range = if chunked {
            manifest.chunk_bytes * MIN_RANGE.div_ceil(manifest.chunk_bytes).max(1)
        } else {
            self.config().part_size
        };
        // Owned jobs: a stream over borrowed entries makes the future not `Send`.
        let mut jobs = Vec::new();
        for (entry, file) in manifest.files.iter().zip(files) {
            for index in 0..entry.size.div_ceil(range) {
                jobs.push((entry.clone(), file.clone(), index * range));
            }
        }
        stream::iter(jobs.into_iter().map(|(entry, file, offset)| {
            let len = range.min(entry.size - offset);
            let key = format!("{prefix}{}", entry.path);
            let (namespace, hash) = (namespace.clone(), hash.clone());
            let path = staging.join(&entry.path);
            let span = tracing::debug_span!("range", file = %entry.path, offset);
            async move {
                let op = format!("read bytes {offset}..{} of {}", offset + len, entry.path);
                let body = self.s3.get_range(&op, &key, offset, len).await?;
                let store = self.s3.store();
                let chunk_bytes = manifest.chunk_bytes;
                blocking(move || {
                    if chunked {
                        let mut at = 0u64;
                        for piece in body.chunks(usize::try_from(chunk_bytes).unwrap_or(usize::MAX))
                        {
                            let chunk =
                                usize::try_from((offset + at) / chunk_bytes).unwrap_or(usize::MAX);
                            let actual = sha256_hex(piece);
                            let expected = entry.chunks.get(chunk).cloned().unwrap_or_default();
                            if actual != expected {
                                return Err(StoreError::ChunkMismatch(Box::new(BadChunk {
                                    store,
                                    namespace,
                                    hash,
                                    file: entry.path,
                                    chunk,
                                    offset: offset + at,
                                    expected,
                                    actual,
                                })));
                            }
                            at += piece.len() as u64;
                        }
                    }
                    file.write_all_at(&body, offset)
                        .map_err(io_err("write", path))
                })
                .await?;
                progress.add(len);
                Ok::<_, StoreError>(())
            }
            .instrument(span)
        }))
        .buffer_unordered(self.config().concurrency)
        .try_collect::<Vec<()>>()
        .await?;
        if !chunked {
            let staging = staging.to_path_buf();
            let manifest = manifest.clone();
            let store = self.s3.store();
            blocking(move || {
                let dir =
                    ArtifactDir::open(&staging)
                        .ok()
                        .flatten()
                        .ok_or_else(|| StoreError::Io {
                            op: "open",
                            path: staging.clone(),
                            source: std::io::Error::from(std::io::ErrorKind::NotFound),
                        })?;
                verify_checksums(&dir, &manifest, &|_| true, 2, &|_| {}).map_err(|e| {
                    StoreError::Incomplete {
                        store,
                        namespace,
                        hash,
                        detail: e.to_string(),
                    }
                })
            })
            .await?;
        }
        Ok(())
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
fn split_prefix(prefix: &str) -> (String, String) {
    let mut parts = prefix.trim_end_matches('/').rsplit('/');
    let hash = parts.next().unwrap_or_default().to_owned();
    let namespace = parts.next().unwrap_or_default().to_owned();
    (namespace, hash)
}

/// The part size used for a file: the setting, raised so no file needs more than S3's 10,000
/// parts, rounded up to whole manifest chunks (so each part's chunks can be checked as it is
/// read).
fn part_size(setting: u64, chunk_bytes: u64, largest: u64) -> u64 {
    let size = setting.max(largest.div_ceil(MAX_PARTS));
    if chunk_bytes == 0 {
        size
    } else {
        size.div_ceil(chunk_bytes) * chunk_bytes
    }
}

/// One file of the local artifact, opened without following a link.
#[derive(Clone, Debug)]
struct LocalFile {
    entry: FileEntry,
    path: PathBuf,
    file: Arc<File>,
}

#[derive(Debug)]
struct LocalArtifact {
    dir: PathBuf,
    manifest: Manifest,
    manifest_bytes: Bytes,
    marker_bytes: Bytes,
    files: Vec<LocalFile>,
}

fn open_local(dir: PathBuf) -> Result<LocalArtifact, StoreError> {
    let published = open_published(&dir).map_err(|source| StoreError::Published {
        dir: dir.clone(),
        source,
    })?;
    let file_error = |source: FileError| StoreError::Published {
        dir: dir.clone(),
        source: source.into(),
    };
    let manifest_bytes = published
        .dir()
        .read_bounded(FILE_MANIFEST, MAX_MANIFEST_BYTES)
        .map_err(file_error)?;
    let marker_bytes = published
        .dir()
        .read_bounded(FILE_COMPLETE, MAX_MARKER_BYTES)
        .map_err(file_error)?;
    let files = published
        .manifest()
        .files
        .iter()
        .map(|entry| {
            Ok(LocalFile {
                entry: entry.clone(),
                path: dir.join(&entry.path),
                file: Arc::new(published.dir().open_file(&entry.path).map_err(file_error)?),
            })
        })
        .collect::<Result<_, StoreError>>()?;
    Ok(LocalArtifact {
        manifest: published.manifest().clone(),
        dir,
        manifest_bytes: manifest_bytes.into(),
        marker_bytes: marker_bytes.into(),
        files,
    })
}

/// A body to send and its `Content-MD5`.
#[derive(Debug)]
struct Body {
    bytes: Bytes,
    md5: String,
}

/// `bytes` with its `Content-MD5`, computed off the async executor.
async fn with_md5(bytes: Bytes) -> Result<Body, StoreError> {
    blocking(move || {
        Ok(Body {
            md5: content_md5(&bytes),
            bytes,
        })
    })
    .await
}

/// Bytes `offset..offset + len` of a local file and their `Content-MD5`, each whole chunk in
/// them checked against the manifest (format 2, `chunk_bytes` > 0): a file changed since
/// publication is never uploaded.
async fn read_part(
    file: &LocalFile,
    chunk_bytes: u64,
    offset: u64,
    len: u64,
) -> Result<Body, StoreError> {
    let file = file.clone();
    blocking(move || {
        let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX)];
        file.file
            .read_exact_at(&mut buf, offset)
            .map_err(io_err("read", &file.path))?;
        if chunk_bytes > 0 {
            let step = usize::try_from(chunk_bytes).unwrap_or(usize::MAX);
            for (i, piece) in buf.chunks(step).enumerate() {
                let chunk = usize::try_from(offset / chunk_bytes).unwrap_or(usize::MAX) + i;
                let actual = sha256_hex(piece);
                if file.entry.chunks.get(chunk) != Some(&actual) {
                    return Err(StoreError::LocalChanged {
                        path: file.path.clone(),
                        detail: format!("chunk {chunk} has sha256 {actual}"),
                    });
                }
            }
        }
        Ok(Body {
            md5: content_md5(&buf),
            bytes: Bytes::from(buf),
        })
    })
    .await
}

/// Creates `staging` (it must not exist) and every listed file in it, at its full size.
fn create_staging(staging: &Path, manifest: &Manifest) -> Result<Vec<Arc<File>>, StoreError> {
    std::fs::create_dir(staging).map_err(io_err(STAGING_CREATE, staging))?;
    manifest
        .files
        .iter()
        .map(|entry| {
            let path = staging.join(&entry.path);
            if let Some(parent) = path.parent() {
                std::fs::create_dir_all(parent).map_err(io_err("create directory", parent))?;
            }
            let file = File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .open(&path)
                .map_err(io_err("create", &path))?;
            file.set_len(entry.size).map_err(io_err("size", &path))?;
            Ok(Arc::new(file))
        })
        .collect()
}

/// Fsyncs every file and directory of a downloaded `staging`, then writes the manifest and the
/// marker (each fsynced, the marker last).
fn finish_staging(staging: &Path, manifest: &[u8], marker: &[u8]) -> Result<(), StoreError> {
    fn sync_tree(path: &Path) -> Result<(), StoreError> {
        for entry in std::fs::read_dir(path).map_err(io_err("list", path))? {
            let entry = entry.map_err(io_err("list", path))?;
            let child = entry.path();
            if entry
                .file_type()
                .map_err(io_err("inspect", &child))?
                .is_dir()
            {
                sync_tree(&child)?;
            } else {
                File::open(&child)
                    .and_then(|f| f.sync_all())
                    .map_err(io_err("fsync", &child))?;
            }
        }
        File::open(path)
            .and_then(|f| f.sync_all())
            .map_err(io_err("fsync", path))
    }
    sync_tree(staging)?;
    for (name, bytes) in [(FILE_MANIFEST, manifest), (FILE_COMPLETE, marker)] {
        let path = staging.join(name);
        let mut file = File::options()
            .write(true)
            .create_new(true)
            .open(&path)
            .map_err(io_err("create", &path))?;
        std::io::Write::write_all(&mut file, bytes).map_err(io_err("write", &path))?;
        file.sync_all().map_err(io_err("fsync", &path))?;
        File::open(staging)
            .and_then(|f| f.sync_all())
            .map_err(io_err("fsync", staging))?;
    }
    Ok(())
}

async fn remove_staging(staging: PathBuf) {
    let shown = staging.clone();
    let removed = tokio::task::spawn_blocking(move || std::fs::remove_dir_all(&staging)).await;
    if !matches!(removed, Ok(Ok(()))) {
        tracing::warn!(staging = %shown.display(), "a failed download's staging directory could not be removed");
    }
}

/// Renames a complete downloaded `staging` directory to `final_dir` (which must not exist), in
/// one `renameat2(RENAME_NOREPLACE)` on the same filesystem, and fsyncs the parent so the
/// rename survives a crash. Blocking: call it off the async executor.
///
/// # Errors
/// [`StoreError::Io`]: `final_dir` exists, or the rename or fsync failed.
pub fn place(staging: &Path, final_dir: &Path) -> Result<(), StoreError> {
    use nix::fcntl::{AT_FDCWD, RenameFlags, renameat2};
    renameat2(
        AT_FDCWD,
        staging,
        AT_FDCWD,
        final_dir,
        RenameFlags::RENAME_NOREPLACE,
    )
    .map_err(|errno| StoreError::Io {
        op: "rename the downloaded artifact to",
        path: final_dir.to_path_buf(),
        source: errno.into(),
    })?;
    let parent = final_dir.parent().unwrap_or(Path::new("/"));
    File::open(parent)
        .and_then(|f| f.sync_all())
        .map_err(io_err("fsync", parent))
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn parts_cover_whole_chunks_and_never_exceed_the_part_limit() {
        assert_eq!(part_size(16 << 20, 8 << 20, 1 << 30), 16 << 20);
        assert_eq!(part_size(5 << 20, 8 << 20, 1 << 30), 8 << 20);
        assert_eq!(part_size(5 << 20, 0, 1 << 20), 5 << 20);
        let huge = 200u64 << 30;
        let size = part_size(16 << 20, 8 << 20, huge);
        assert!(huge.div_ceil(size) <= MAX_PARTS && size.is_multiple_of(8 << 20));
    }

    #[test]
    fn a_prefix_splits_into_namespace_and_hash() {
        assert_eq!(
            split_prefix("a/b/ns/0123456789abcdef/"),
            ("ns".into(), "0123456789abcdef".into())
        );
    }

    #[test]
    fn place_refuses_to_replace_an_artifact() {
        let tmp = tempfile::tempdir().unwrap();
        let staging = tmp.path().join("staging");
        let final_dir = tmp.path().join("final");
        std::fs::create_dir(&staging).unwrap();
        std::fs::create_dir(&final_dir).unwrap();
        let err = place(&staging, &final_dir).unwrap_err();
        assert!(err.to_string().contains("final"), "{err}");
        assert!(staging.is_dir());
        std::fs::remove_dir(&final_dir).unwrap();
        place(&staging, &final_dir).unwrap();
        assert!(final_dir.is_dir() && !staging.exists());
    }
}
