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

/// Runs `jobs` on `threads` workers, each `work(job) -> digest`; results per file and chunk.
/// Stops at the first error (the others finish the chunk they are on).
fn run(
    files: &[(PathBuf, u64)],
    jobs: &[Job],
    threads: usize,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<Vec<Vec<String>>, ReadError> {
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let error: Mutex<Option<ReadError>> = Mutex::new(None);
    let results: Mutex<Vec<(usize, usize, String)>> = Mutex::new(Vec::with_capacity(jobs.len()));
    let worker = || {
        let mut buf = vec![0u8; 1 << 20];
        let mut open: Option<(usize, File)> = None;
        let mut done = Vec::new();
        while !failed.load(Ordering::Relaxed) {
            let Some(job) = jobs.get(next.fetch_add(1, Ordering::Relaxed)) else {
                break;
            };
            let path = &files[job.file].0;
            let digest = (|| {
                let file = match &open {
                    Some((index, file)) if *index == job.file => file,
                    _ => &open.insert((job.file, File::open(path)?)).1,
                };
                hash_range(file, job.offset, job.len, &mut buf, progress)
            })();
            match digest {
                Ok(digest) => done.push((job.file, job.chunk, digest)),
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
    if let Some(err) = error
        .into_inner()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
    {
        return Err(err);
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
    run(files, &jobs, threads, progress)
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
    Ok(run(files, &jobs, threads, progress)?
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
