//! Download of a stored artifact into a staging directory: the marker and the manifest it
//! names first, then every file in parallel ranged reads, each chunk checked against the
//! manifest before it is written (a compressed artifact's frames read whole and each
//! decompressed into its chunk first); the manifest and the marker are written last, everything
//! fsynced, and [`place`] renames the directory into place. A failed download leaves nothing.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::{StreamExt, TryStreamExt, stream};
use tracing::Instrument;
use warmstart_shared::artifact::{ArtifactDir, FileEntry, Manifest, verify_checksums};
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use crate::error::{BadChunk, BadFrame, StoreError, io_err};
use crate::frames::{self, FrameIndex};
use crate::store::{Progress, Store, blocking, sha256_hex, split_prefix};

/// Ranged reads of a download cover whole chunks, at least this many bytes where chunks are
/// smaller.
const MIN_RANGE: u64 = 4 << 20;

/// Most frames of a compressed file read in one request (each decompressed in turn: a bound on
/// the memory a read of many small frames holds).
const MAX_FRAMES_PER_READ: usize = 8;

/// What creating a download's staging directory is called in errors (and how a failure to
/// create it, which leaves nothing of this download to remove, is told apart).
const STAGING_CREATE: &str = "create the staging directory";

impl Store {
    /// Downloads `namespace/hash` into `staging` (a new directory, created here; its parent
    /// must exist): the marker, the manifest, then every file in parallel ranged reads, each
    /// chunk checked against the manifest as it lands; the manifest and marker are written
    /// last, everything fsynced. Rename it into place with [`place`]. `progress` counts the
    /// checked bytes.
    ///
    /// # Errors
    /// [`StoreError::NotFound`] / [`StoreError::Incomplete`] when the bucket holds no complete
    /// artifact, [`StoreError::ChunkMismatch`] naming the file and chunk that differs
    /// ([`StoreError::Corrupt`] naming the file, for a format-1 manifest), or a
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
        let frames = self
            .read_frames(&prefix, &manifest)
            .instrument(span.clone())
            .await?;
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
        let result = match &frames {
            None => {
                self.download_files(&prefix, &manifest, files, &staging, progress)
                    .instrument(span)
                    .await
            }
            Some(frames) => {
                self.download_frames(&prefix, &manifest, frames, files, &staging, progress)
                    .instrument(span)
                    .await
            }
        };
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
                    StoreError::Corrupt {
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
}

impl Store {
    /// The files of a compressed artifact: ranged reads of whole frames (several small ones
    /// at once), each frame decompressed into its chunk and the chunk checked against the
    /// manifest before it is written.
    async fn download_frames(
        &self,
        prefix: &str,
        manifest: &Manifest,
        frames: &FrameIndex,
        files: Vec<Arc<File>>,
        staging: &Path,
        progress: &Progress,
    ) -> Result<(), StoreError> {
        let (namespace, hash) = split_prefix(prefix);
        let chunk_bytes = manifest.chunk_bytes;
        let mut jobs = Vec::new();
        for (entry, file) in manifest.files.iter().zip(files) {
            let lengths = frames.files.get(&entry.path).cloned().unwrap_or_default();
            let mut chunk = 0;
            let mut stored = 0u64;
            while chunk < lengths.len() {
                let first = chunk;
                let start = stored;
                while chunk < lengths.len()
                    && chunk - first < MAX_FRAMES_PER_READ
                    && (chunk == first || stored - start < MIN_RANGE)
                {
                    stored += lengths[chunk];
                    chunk += 1;
                }
                jobs.push(FrameRead {
                    entry: entry.clone(),
                    file: file.clone(),
                    first,
                    stored_offset: start,
                    lengths: lengths[first..chunk].to_vec(),
                });
            }
        }
        stream::iter(jobs.into_iter().map(|job| {
            let key = format!("{prefix}{}", job.entry.path);
            let (namespace, hash) = (namespace.clone(), hash.clone());
            let path = staging.join(&job.entry.path);
            let span =
                tracing::debug_span!("frames", file = %job.entry.path, first_chunk = job.first);
            async move {
                let stored_len: u64 = job.lengths.iter().sum();
                let op = format!(
                    "read the frames of chunks {}..{} of {} (stored bytes {}..{})",
                    job.first,
                    job.first + job.lengths.len(),
                    job.entry.path,
                    job.stored_offset,
                    job.stored_offset + stored_len
                );
                let body = self
                    .s3
                    .get_range(&op, &key, job.stored_offset, stored_len)
                    .await?;
                let store = self.s3.store();
                let raw = blocking(move || {
                    let mut at = 0usize;
                    let mut raw = 0u64;
                    for (i, len) in job.lengths.iter().enumerate() {
                        let chunk = job.first + i;
                        let len = usize::try_from(*len).unwrap_or(usize::MAX);
                        let frame = &body[at..at + len];
                        let offset = chunk as u64 * chunk_bytes;
                        let expected_len = chunk_bytes.min(job.entry.size - offset);
                        let data =
                            frames::decompress(frame, usize::try_from(expected_len).unwrap_or(0))
                                .map_err(|detail| {
                                let stored_offset = job.stored_offset + at as u64;
                                StoreError::BadFrame(Box::new(BadFrame {
                                    store: store.clone(),
                                    namespace: namespace.clone(),
                                    hash: hash.clone(),
                                    file: job.entry.path.clone(),
                                    chunk,
                                    stored_offset,
                                    stored_end: stored_offset + len as u64,
                                    detail,
                                }))
                            })?;
                        let actual = sha256_hex(&data);
                        let expected = job.entry.chunks.get(chunk).cloned().unwrap_or_default();
                        if actual != expected {
                            return Err(StoreError::ChunkMismatch(Box::new(BadChunk {
                                store,
                                namespace,
                                hash,
                                file: job.entry.path,
                                chunk,
                                offset,
                                expected,
                                actual,
                            })));
                        }
                        job.file
                            .write_all_at(&data, offset)
                            .map_err(io_err("write", &path))?;
                        at += len;
                        raw += expected_len;
                    }
                    Ok(raw)
                })
                .await?;
                progress.add_both(raw, stored_len);
                Ok::<_, StoreError>(())
            }
            .instrument(span)
        }))
        .buffer_unordered(self.config().concurrency)
        .try_collect::<Vec<()>>()
        .await?;
        Ok(())
    }
}

/// One ranged read of a compressed file: consecutive frames from chunk `first`.
struct FrameRead {
    entry: FileEntry,
    file: Arc<File>,
    first: usize,
    stored_offset: u64,
    lengths: Vec<u64>,
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
