//! Digests of artifact files, computed in parallel: per-chunk SHA-256 digests (manifest format
//! 2: every file is cut into `chunkBytes` pieces, each hashed on its own, so one large page
//! image is hashed by every core at once) and whole-file SHA-256 digests (format 1, parallel
//! across files only). Reads use `pread`, so workers share no file offset. `sha2` picks the
//! CPU's SHA extensions (SHA-NI) at run time where they exist.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use sha2::{Digest, Sha256};

/// The chunk size this build writes: small enough that a 1 GiB page image keeps 16 cores busy,
/// large enough that the manifest stays small (128 digests per GiB).
pub const CHUNK_BYTES: u64 = 8 << 20;

/// How many threads hash: every core the process may use.
pub fn threads() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZero::get)
}

/// A file that could not be read.
#[derive(Debug, thiserror::Error)]
#[error("cannot read {}", path.display())]
pub struct ReadError {
    /// The file.
    pub path: PathBuf,
    /// The I/O error.
    #[source]
    pub source: io::Error,
}

/// Number of chunks of a file of `size` bytes.
pub fn chunk_count(size: u64, chunk_bytes: u64) -> usize {
    usize::try_from(size.div_ceil(chunk_bytes.max(1))).unwrap_or(usize::MAX)
}

struct Job {
    file: usize,
    chunk: usize,
    offset: u64,
    len: u64,
}

/// Opens file `index` of a list for reading: by path ([`open_path`]) or, for a reader that must
/// not follow links, relative to a directory it opened itself.
pub type Opener<'a> = dyn Fn(usize) -> io::Result<File> + Sync + 'a;

/// Why a check of chunk digests against expected ones failed.
#[derive(Debug, thiserror::Error)]
pub enum ChunkCheckError {
    /// A file could not be read.
    #[error(transparent)]
    Read(#[from] ReadError),
    /// A chunk's digest differs from the expected one (reported as soon as it is found).
    #[error("chunk {chunk} of file {file} has sha256 {actual}")]
    Mismatch {
        /// Index of the file in the list.
        file: usize,
        /// Index of the chunk.
        chunk: usize,
        /// The digest found.
        actual: String,
    },
}

/// Runs `jobs` on `threads` workers, each hashing its range of a file opened with `open`;
/// results per file and chunk. With `expected` (per file, per chunk), a digest that differs
/// stops every worker at once: no further chunk is started. Stops at the first error too (the
/// others finish the chunk they are on).
fn run(
    files: &[(PathBuf, u64)],
    jobs: &[Job],
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
    open: &Opener<'_>,
    expected: Option<&[&[String]]>,
) -> Result<Vec<Vec<String>>, ChunkCheckError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<ReadError>> = Mutex::new(None);
    let mismatches: Mutex<Vec<(usize, usize, String)>> = Mutex::new(Vec::new());
    let results: Mutex<Vec<(usize, usize, String)>> = Mutex::new(Vec::with_capacity(jobs.len()));
    let worker = || {
        let mut buf = vec![0u8; 1 << 20];
        let mut opened: Option<(usize, File)> = None;
        let mut done = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let path = &files[job.file].0;
            let digest = (|| {
                let file = match &opened {
                    Some((index, file)) if *index == job.file => file,
                    _ => &opened.insert((job.file, open(job.file)?)).1,
                };
                hash_range(file, job.offset, job.len, &mut buf, progress)
            })();
            match digest {
                Ok(digest) => {
                    let want = expected
                        .and_then(|e| e.get(job.file))
                        .and_then(|chunks| chunks.get(job.chunk));
                    if want.is_some_and(|want| *want != digest) {
                        failed.store(true, Ordering::Relaxed);
                        mismatches
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .push((job.file, job.chunk, digest));
                        break;
                    }
                    done.push((job.file, job.chunk, digest));
                }
                Err(source) => {
                    failed.store(true, Ordering::Relaxed);
                    let mut slot = error
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner);
                    slot.get_or_insert(ReadError {
                        path: path.clone(),
                        source,
                    });
                    break;
                }
            }
        }
        results
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .extend(done);
    };
    let threads = threads.clamp(1, jobs.len().max(1));
    std::thread::scope(|scope| {
        for _ in 1..threads {
            scope.spawn(worker);
        }
        worker();
    });
    let mut mismatches = mismatches
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    mismatches.sort_unstable_by_key(|(file, chunk, _)| (*file, *chunk));
    if let Some((file, chunk, actual)) = mismatches.into_iter().next() {
        return Err(ChunkCheckError::Mismatch {
            file,
            chunk,
            actual,
        });
    }
    if let Some(err) = error
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(err.into());
    }
    let mut out: Vec<Vec<String>> = files.iter().map(|_| Vec::new()).collect();
    let mut results = results
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    results.sort_unstable_by_key(|(file, chunk, _)| (*file, *chunk));
    for (file, _, digest) in results {
        out[file].push(digest);
    }
    Ok(out)
}

/// An [`Opener`] of `files` by path (the writer's side: staged files it wrote itself).
fn open_path(files: &[(PathBuf, u64)]) -> impl Fn(usize) -> io::Result<File> + Sync + '_ {
    |index| File::open(&files[index].0)
}

/// Only reads can fail when nothing is expected.
fn read_only(err: ChunkCheckError) -> ReadError {
    match err {
        ChunkCheckError::Read(err) => err,
        ChunkCheckError::Mismatch { file, chunk, .. } => ReadError {
            path: PathBuf::new(),
            source: io::Error::other(format!("unexpected mismatch in chunk {chunk} of {file}")),
        },
    }
}

/// SHA-256 of `len` bytes of `file` from `offset`; a file shorter than that is an error
/// (it changed under us).
fn hash_range(
    file: &File,
    offset: u64,
    len: u64,
    buf: &mut [u8],
    progress: &(dyn Fn(u64) + Sync),
) -> io::Result<String> {
    let mut hasher = Sha256::new();
    let mut done = 0u64;
    while done < len {
        let want = usize::try_from((len - done).min(buf.len() as u64)).unwrap_or(buf.len());
        let n = file.read_at(&mut buf[..want], offset + done)?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("ends at {} bytes, {} expected", offset + done, offset + len),
            ));
        }
        hasher.update(&buf[..n]);
        done += n as u64;
        progress(n as u64);
    }
    Ok(hex::encode(hasher.finalize()))
}

fn chunk_jobs(files: &[(PathBuf, u64)], chunk_bytes: u64) -> Vec<Job> {
    let chunk_bytes = chunk_bytes.max(1);
    let mut jobs = Vec::new();
    for (file, (_, size)) in files.iter().enumerate() {
        for chunk in 0..chunk_count(*size, chunk_bytes) {
            let offset = chunk as u64 * chunk_bytes;
            jobs.push(Job {
                file,
                chunk,
                offset,
                len: (*size - offset).min(chunk_bytes),
            });
        }
    }
    jobs
}

/// The chunk digests of each of `files` (path, size), `chunk_bytes` per chunk (the last one
/// shorter), computed by `threads` workers; in `files` order.
///
/// # Errors
/// The first file that could not be read.
pub fn chunk_digests(
    files: &[(PathBuf, u64)],
    chunk_bytes: u64,
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<Vec<String>>, ReadError> {
    let jobs = chunk_jobs(files, chunk_bytes);
    run(files, &jobs, threads, progress, &open_path(files), None).map_err(read_only)
}

/// Checks the chunks of each of `files` (path, size; opened with `open`) against `expected`
/// (per file, per chunk), `threads` workers hashing. The first chunk found to differ stops the
/// check: no chunk is started after it, so a damaged file is reported without hashing the rest.
///
/// # Errors
/// [`ChunkCheckError::Mismatch`] (the lowest file and chunk among those found to differ) or
/// [`ChunkCheckError::Read`].
pub fn verify_chunks(
    files: &[(PathBuf, u64)],
    expected: &[&[String]],
    chunk_bytes: u64,
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
    open: &Opener<'_>,
) -> Result<(), ChunkCheckError> {
    let jobs = chunk_jobs(files, chunk_bytes);
    run(files, &jobs, threads, progress, open, Some(expected)).map(drop)
}

/// The whole-file SHA-256 of each of `files` (path, size), files hashed in parallel; in
/// `files` order.
///
/// # Errors
/// The first file that could not be read.
pub fn whole_digests(
    files: &[(PathBuf, u64)],
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<String>, ReadError> {
    whole_digests_with(files, threads, progress, &open_path(files))
}

/// [`whole_digests`] of files opened with `open`.
///
/// # Errors
/// The first file that could not be read.
pub fn whole_digests_with(
    files: &[(PathBuf, u64)],
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
    open: &Opener<'_>,
) -> Result<Vec<String>, ReadError> {
    // Largest first, so one big file does not start last.
    let mut order: Vec<usize> = (0..files.len()).collect();
    order.sort_by_key(|i| std::cmp::Reverse(files[*i].1));
    let jobs: Vec<Job> = order
        .into_iter()
        .map(|file| Job {
            file,
            chunk: 0,
            offset: 0,
            len: files[file].1,
        })
        .collect();
    Ok(run(files, &jobs, threads, progress, open, None)
        .map_err(read_only)?
        .into_iter()
        .map(|mut digests| digests.pop().unwrap_or_default())
        .collect())
}

/// Whole-file SHA-256 of one file, streamed.
///
/// # Errors
/// The I/O error of opening or reading.
pub fn sha256_file(path: &Path) -> io::Result<String> {
    let file = File::open(path)?;
    let size = file.metadata()?.len();
    let mut buf = vec![0u8; 1 << 20];
    hash_range(&file, 0, size, &mut buf, &|_| {})
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicU64;

    use super::*;

    fn files(sizes: &[u64]) -> (tempfile::TempDir, Vec<(PathBuf, u64)>) {
        let dir = tempfile::tempdir().unwrap();
        let files = sizes
            .iter()
            .enumerate()
            .map(|(i, size)| {
                let path = dir.path().join(format!("f{i}"));
                let content: Vec<u8> = (0..*size)
                    .map(|b| u8::try_from((b * 7 + i as u64) % 256).unwrap())
                    .collect();
                std::fs::write(&path, content).unwrap();
                (path, *size)
            })
            .collect();
        (dir, files)
    }

    #[test]
    fn chunk_digests_are_the_digests_of_each_piece_whatever_the_thread_count() {
        let (_dir, files) = files(&[0, 1, 1000, 4096, 10_000]);
        let expected: Vec<Vec<String>> = files
            .iter()
            .map(|(path, _)| {
                std::fs::read(path)
                    .unwrap()
                    .chunks(1000)
                    .map(|c| hex::encode(Sha256::digest(c)))
                    .collect()
            })
            .collect();
        for threads in [1, 2, 3, 16] {
            let seen = AtomicU64::new(0);
            let got = chunk_digests(&files, 1000, threads, &|n| {
                seen.fetch_add(n, Ordering::Relaxed);
            })
            .unwrap();
            assert_eq!(got, expected, "{threads} threads");
            assert_eq!(seen.load(Ordering::Relaxed), 15_097);
        }
        assert_eq!(chunk_count(0, 1000), 0);
        assert_eq!(chunk_count(1000, 1000), 1);
        assert_eq!(chunk_count(1001, 1000), 2);
    }

    #[test]
    fn whole_digests_match_a_plain_sha256() {
        let (_dir, files) = files(&[5, 3_000_000, 0]);
        let got = whole_digests(&files, 2, &|_| {}).unwrap();
        for ((path, _), digest) in files.iter().zip(&got) {
            assert_eq!(
                *digest,
                hex::encode(Sha256::digest(std::fs::read(path).unwrap()))
            );
            assert_eq!(*digest, sha256_file(path).unwrap());
        }
    }

    #[test]
    fn a_missing_or_shrunk_file_is_named() {
        let (dir, mut files) = files(&[100, 100]);
        files[1].1 = 200;
        let err = chunk_digests(&files, 64, 2, &|_| {}).unwrap_err();
        assert_eq!(err.path, files[1].0);
        assert_eq!(err.source.kind(), io::ErrorKind::UnexpectedEof);
        files.push((dir.path().join("absent"), 1));
        files[1].1 = 100;
        let err = whole_digests(&files, 2, &|_| {}).unwrap_err();
        assert_eq!(err.path, dir.path().join("absent"));
    }
}
