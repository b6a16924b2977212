//! Upload of a published artifact: small files in one PUT each, larger ones as multipart
//! uploads whose parts go in parallel, each body with its `Content-MD5` for the server to check
//! and each chunk checked against the manifest as it is read; then the manifest, then the
//! completion marker. With a compression level set, each file goes up as zstd frames, one per
//! manifest chunk, and the frame index before the manifest. A multipart upload that fails is
//! aborted; an upload of the same artifact
//! aborts what an interrupted one left; an upload that fails for a transient cause is started
//! again.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt, stream};
use tracing::Instrument;
use warmstart_shared::artifact::{
    CompletionMarker, FileEntry, FileError, MAX_MANIFEST_BYTES, MAX_MARKER_BYTES, Manifest,
    open_published,
};
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use crate::error::{StoreError, io_err};
use crate::frames::{self, FRAME_INDEX, FrameIndex};
use crate::requests::content_md5;
use crate::store::{Progress, Store, blocking, sha256_hex, split_prefix};

/// S3's limit on the parts of one multipart upload.
const MAX_PARTS: u64 = 10_000;

/// What an upload did.
#[derive(Clone, Debug)]
pub struct UploadReport {
    /// The manifest uploaded.
    pub manifest: Manifest,
    /// Artifact file bytes sent.
    pub bytes: u64,
    /// Bytes of the stored files' objects sent: fewer than `bytes` when compressed.
    pub stored_bytes: u64,
    /// The files were stored as zstd frames (the level), `None` when stored as they are.
    pub compression_level: Option<i32>,
    /// Files sent as multipart uploads.
    pub multipart_files: usize,
    /// The same artifact was already complete in the bucket: nothing was sent.
    pub already_present: bool,
}

impl Store {
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
                stored_bytes: 0,
                compression_level: None,
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
        let level = self.config().compression_level;
        let compress = level > 0 && frames::compressible(&local.manifest);
        let index_key = format!("{prefix}{FRAME_INDEX}");
        if frames::compressible(&local.manifest) && !compress {
            // What an earlier, compressed upload of this artifact left would make readers take
            // these plain files for frames.
            self.s3
                .delete_object("delete an earlier frame index", &index_key)
                .await?;
        }
        let mut index = FrameIndex::new(&local.manifest, level);
        let (small, large): (Vec<_>, Vec<_>) = local
            .files
            .iter()
            .cloned()
            .partition(|f| f.entry.size <= part_size);
        let stored = AtomicU64::new(0);
        let sending = Sending {
            chunk_bytes,
            level: compress.then_some(level),
            concurrency,
        };
        let sent = self
            .upload_small_files(small, &prefix, sending, progress, &stored)
            .await?;
        index.files.extend(sent);
        for file in &large {
            let key = format!("{prefix}{}", file.entry.path);
            let span = tracing::info_span!("file", file = %file.entry.path);
            if compress {
                let lengths = self
                    .upload_multipart_frames(file, &key, part_size, chunk_bytes, progress)
                    .instrument(span)
                    .await?;
                stored.fetch_add(lengths.iter().sum(), Ordering::Relaxed);
                index.files.insert(file.entry.path.clone(), lengths);
            } else {
                self.upload_multipart(file, &key, part_size, chunk_bytes, progress)
                    .instrument(span)
                    .await?;
                stored.fetch_add(file.entry.size, Ordering::Relaxed);
            }
        }
        // The frame index before the marker: a reader that sees the marker sees the whole index.
        let index = compress.then_some((index_key.as_str(), &index));
        self.upload_last(&prefix, index, local.manifest_bytes, local.marker_bytes)
            .await?;
        Ok(UploadReport {
            bytes: local.manifest.total_size(),
            stored_bytes: stored.into_inner(),
            compression_level: compress.then_some(level),
            multipart_files: large.len(),
            manifest: local.manifest,
            already_present: false,
        })
    }

    /// Uploads the files small enough for one request each, in parallel (compressed into
    /// frames with `sending.level`); their frame lengths (empty when plain).
    async fn upload_small_files(
        &self,
        small: Vec<LocalFile>,
        prefix: &str,
        sending: Sending,
        progress: &Progress,
        stored: &AtomicU64,
    ) -> Result<Vec<(String, Vec<u64>)>, StoreError> {
        let Sending {
            chunk_bytes,
            level,
            concurrency,
        } = sending;
        stream::iter(small.into_iter().map(|file| {
            let key = format!("{prefix}{}", file.entry.path);
            async move {
                let size = file.entry.size;
                let (body, lengths) = match level {
                    Some(level) => {
                        let (bytes, lengths) =
                            compressed_file(&file, chunk_bytes, level, concurrency).await?;
                        (with_md5(bytes).await?, lengths)
                    }
                    None => (read_part(&file, chunk_bytes, 0, size).await?, Vec::new()),
                };
                let len = body.bytes.len() as u64;
                self.s3
                    .put_object(
                        &format!("upload {}", file.entry.path),
                        &key,
                        body.bytes,
                        &body.md5,
                    )
                    .instrument(tracing::debug_span!("file", file = %file.entry.path))
                    .await?;
                progress.add_both(size, len);
                stored.fetch_add(len, Ordering::Relaxed);
                Ok::<_, StoreError>((file.entry.path.clone(), lengths))
            }
        }))
        .buffer_unordered(concurrency)
        .try_collect()
        .await
    }

    /// Uploads, in this order, the frame index (when compressed), the manifest and the
    /// completion marker.
    async fn upload_last(
        &self,
        prefix: &str,
        index: Option<(&str, &FrameIndex)>,
        manifest_bytes: Bytes,
        marker_bytes: Bytes,
    ) -> Result<(), StoreError> {
        if let Some((key, index)) = index {
            let json = serde_json::to_vec(index).map_err(|e| StoreError::Task(e.to_string()))?;
            let body = with_md5(json.into()).await?;
            self.s3
                .put_object("upload the frame index", key, body.bytes, &body.md5)
                .await?;
        }
        for (what, name, bytes) in [
            ("upload the manifest", FILE_MANIFEST, manifest_bytes),
            ("upload the completion marker", FILE_COMPLETE, marker_bytes),
        ] {
            let body = with_md5(bytes).await?;
            self.s3
                .put_object(what, &format!("{prefix}{name}"), body.bytes, &body.md5)
                .await?;
        }
        Ok(())
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
        let parts = file.entry.size.div_ceil(part_size);
        self.multipart(name, key, async |upload_id| {
            let etags: Vec<String> = stream::iter((0..parts).map(|index| async move {
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
            }))
            .buffered(self.config().concurrency)
            .try_collect()
            .await?;
            Ok(((), etags))
        })
        .await
    }

    /// A multipart upload of `key` (file `name`): started, its parts sent by `send` (given the
    /// upload id; it returns its own result and the parts' ETags in order), completed. Aborted
    /// when anything fails; an abort that fails too is logged (the next upload of the artifact
    /// or the stale-upload sweep aborts it).
    async fn multipart<T>(
        &self,
        name: &str,
        key: &str,
        send: impl AsyncFnOnce(&str) -> Result<(T, Vec<String>), StoreError>,
    ) -> Result<T, StoreError> {
        let upload_id = self
            .s3
            .create_multipart(&format!("start the multipart upload of {name}"), key)
            .await?;
        let result = async {
            let (value, etags) = send(&upload_id).await?;
            self.s3
                .complete_multipart(
                    &format!("complete the multipart upload of {name}"),
                    key,
                    &upload_id,
                    &etags,
                )
                .await?;
            Ok(value)
        }
        .await;
        if result.is_err()
            && let Err(abort) = self
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
        result
    }
}

impl Store {
    /// A file larger than a part, compressed: its chunks read, checked and compressed in
    /// parallel and in order, the frames gathered into parts of at least `part_size` bytes
    /// (the last may be smaller) that go up in parallel. Returns the frames' lengths.
    async fn upload_multipart_frames(
        &self,
        file: &LocalFile,
        key: &str,
        part_size: u64,
        chunk_bytes: u64,
        progress: &Progress,
    ) -> Result<Vec<u64>, StoreError> {
        let name = &file.entry.path;
        let level = self.config().compression_level;
        let concurrency = self.config().concurrency;
        self.multipart(name, key, async |upload_id| {
            let (parts_tx, mut parts_rx) = tokio::sync::mpsc::channel::<Part>(concurrency);
            let produce = async move {
                let mut lengths = Vec::new();
                let mut part = Part::default();
                let mut frames = stream::iter(0..file.entry.size.div_ceil(chunk_bytes))
                    .map(|chunk| compressed_chunk(file, chunk_bytes, chunk, level))
                    .buffered(concurrency);
                while let Some((frame, raw)) = frames.try_next().await? {
                    lengths.push(frame.len() as u64);
                    part.bytes.extend_from_slice(&frame);
                    part.raw += raw;
                    if part.bytes.len() as u64 >= part_size
                        || lengths.len() == frames_total(file, chunk_bytes)
                    {
                        part.number += 1;
                        let next = Part {
                            number: part.number,
                            ..Part::default()
                        };
                        let full = std::mem::replace(&mut part, next);
                        parts_tx.send(full).await.map_err(|_| {
                            StoreError::Task(format!("the upload of {name} stopped"))
                        })?;
                    }
                }
                Ok::<_, StoreError>(lengths)
            };
            let parts = stream::poll_fn(|cx| parts_rx.poll_recv(cx));
            let send = parts
                .map(|part| async move {
                    let body = with_md5(part.bytes.into()).await?;
                    let len = body.bytes.len() as u64;
                    let etag = self
                        .s3
                        .upload_part(
                            &format!("upload part {} of {name} (compressed)", part.number),
                            key,
                            upload_id,
                            part.number,
                            body.bytes,
                            &body.md5,
                        )
                        .await?;
                    progress.add_both(part.raw, len);
                    Ok::<_, StoreError>(etag)
                })
                .buffered(concurrency)
                .try_collect::<Vec<String>>();
            futures::try_join!(produce, send)
        })
        .await
    }
}

/// The chunks of `file`.
fn frames_total(file: &LocalFile, chunk_bytes: u64) -> usize {
    usize::try_from(file.entry.size.div_ceil(chunk_bytes)).unwrap_or(usize::MAX)
}

/// A part of a compressed multipart upload being gathered: its number (from 1), its frames,
/// and the artifact bytes they hold.
#[derive(Debug, Default)]
struct Part {
    number: u16,
    bytes: Vec<u8>,
    raw: u64,
}

/// A whole small file compressed: its frames, concatenated, and their lengths.
async fn compressed_file(
    file: &LocalFile,
    chunk_bytes: u64,
    level: i32,
    concurrency: usize,
) -> Result<(Bytes, Vec<u64>), StoreError> {
    let frames: Vec<(Vec<u8>, u64)> = stream::iter(0..file.entry.size.div_ceil(chunk_bytes))
        .map(|chunk| compressed_chunk(file, chunk_bytes, chunk, level))
        .buffered(concurrency)
        .try_collect()
        .await?;
    let lengths = frames.iter().map(|(f, _)| f.len() as u64).collect();
    Ok((frames.into_iter().flat_map(|(f, _)| f).collect(), lengths))
}

/// Chunk `chunk` of a local file, checked against the manifest (a file changed since
/// publication is never uploaded) and compressed into one frame; the frame and the chunk's
/// length.
async fn compressed_chunk(
    file: &LocalFile,
    chunk_bytes: u64,
    chunk: u64,
    level: i32,
) -> Result<(Vec<u8>, u64), StoreError> {
    let offset = chunk * chunk_bytes;
    let len = chunk_bytes.min(file.entry.size - offset);
    let raw = read_part(file, chunk_bytes, offset, len).await?;
    let path = file.path.clone();
    blocking(move || {
        let frame = frames::compress(&raw.bytes, level).map_err(io_err("compress", &path))?;
        Ok((frame, len))
    })
    .await
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

/// How an upload sends its small files.
#[derive(Clone, Copy, Debug)]
struct Sending {
    chunk_bytes: u64,
    /// The zstd level, when compressed.
    level: Option<i32>,
    concurrency: usize,
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

#[cfg(test)]
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
}
