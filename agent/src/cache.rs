//! The node-local artifact cache: artifacts fetched from elsewhere (object storage) kept on the
//! node's disk under a size limit, evicted least recently used first and never while a restore
//! reads them; each fetched once per node however many restores ask for it at once.
//!
//! Layout under the cache directory:
//!
//! ```text
//! <cache>/<namespace>/<hash>/              a complete artifact, as published (manifest, marker)
//! <cache>/.staging/<namespace>.<hash>.<n>/ a download in progress, flock-ed by its writer
//! <cache>/.locks/<namespace>.<hash>        the fetch lock: one download of an artifact at a time
//! ```
//!
//! A download lands in staging, is checked (the manifest, every listed file with its size: the
//! source checks each chunk's digest as it lands) and renamed into place only when complete, so a
//! partial download is never used; staging nobody holds (a crash) is removed when the cache is
//! opened. A reader holds a shared `flock` on the artifact's directory for as long as it reads
//! ([`Held`]); eviction takes an exclusive one without waiting and passes over what it cannot
//! lock. Last use is the directory's modification time, set at each hold.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use futures::future::BoxFuture;
use nix::fcntl::{AT_FDCWD, Flock, FlockArg, RenameFlags, renameat2};
use thiserror::Error;
use warmstart_shared::artifact::{Verification, read_published, validate_path_element};

use crate::progress::Meter;

/// Where the cache's artifacts come from: a store that writes one complete artifact (files,
/// manifest, marker) into a directory, every chunk checked against the manifest as it lands.
pub trait Source: Send + Sync {
    /// The bytes the artifact takes (its manifest's total size), to make room before fetching.
    fn size(&self) -> BoxFuture<'_, Result<u64, FetchError>>;

    /// Writes the artifact into `into` (an empty directory), counting bytes into `meter`.
    fn fetch<'a>(
        &'a self,
        into: &'a Path,
        meter: Arc<Meter>,
    ) -> BoxFuture<'a, Result<(), FetchError>>;
}

/// Why a source could not give its artifact (the source's own error).
pub type FetchError = Box<dyn std::error::Error + Send + Sync>;

/// Why the cache could not give an artifact.
#[derive(Debug, Error)]
pub enum CacheError {
    /// A namespace or hash is no safe path element.
    #[error(transparent)]
    Name(#[from] warmstart_shared::artifact::PathError),
    /// A file operation of the cache.
    #[error("{op} {path}")]
    Io {
        /// What.
        op: &'static str,
        /// Where.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The source failed; nothing of the download is kept.
    #[error("cannot fetch artifact {namespace}/{hash} into the cache")]
    Fetch {
        /// The namespace.
        namespace: String,
        /// The hash.
        hash: String,
        /// The source's error.
        #[source]
        source: FetchError,
    },
    /// What the source wrote is not the complete artifact; nothing of it is used.
    #[error("the fetched artifact {namespace}/{hash} is unusable: {reason}")]
    Invalid {
        /// The namespace.
        namespace: String,
        /// The hash.
        hash: String,
        /// Why.
        reason: String,
    },
    /// The artifact does not fit in the cache's limit, even after evicting what no restore
    /// reads.
    #[error(
        "the cache {dir} cannot take {needed} bytes: its limit is {limit} bytes and {in_use} bytes are artifacts restores are reading"
    )]
    Full {
        /// The cache directory.
        dir: PathBuf,
        /// The artifact's bytes.
        needed: u64,
        /// The limit.
        limit: u64,
        /// Bytes that could not be evicted.
        in_use: u64,
    },
    /// An older copy of the artifact (another capture under the same identity) is being read by
    /// a restore and cannot make way yet.
    #[error(
        "an older copy of the artifact at {dir} is in use by a restore; the new one cannot replace it yet"
    )]
    Busy {
        /// The cached copy.
        dir: PathBuf,
    },
    /// The cache's disk has not the room for the artifact, even with every artifact no restore
    /// reads evicted: nothing was downloaded.
    #[error(
        "the disk of the cache {dir} has {free} bytes free, and artifact {namespace}/{hash} needs {needed}: nothing fetched ({in_use} bytes of the cache are read by restores)"
    )]
    NoRoom {
        /// The cache directory.
        dir: PathBuf,
        /// The namespace.
        namespace: String,
        /// The hash.
        hash: String,
        /// The artifact's bytes.
        needed: u64,
        /// Bytes free on the disk after eviction.
        free: u64,
        /// Bytes of cached artifacts restores read.
        in_use: u64,
    },
    /// The disk filled up during the download: it was discarded, and every artifact no restore
    /// reads was evicted.
    #[error(
        "the disk of the cache {dir} filled up fetching artifact {namespace}/{hash} ({needed} bytes): the download was discarded and {evicted} unused artifact(s) evicted"
    )]
    DiskFull {
        /// The cache directory.
        dir: PathBuf,
        /// The namespace.
        namespace: String,
        /// The hash.
        hash: String,
        /// The artifact's bytes.
        needed: u64,
        /// Artifacts evicted.
        evicted: usize,
    },
}

fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

const STAGING: &str = ".staging";
const LOCKS: &str = ".locks";

/// One artifact's fetch in this process: whoever holds `lock` fetches; `meter` is its progress,
/// for everyone waiting.
#[derive(Debug, Default)]
struct Fetching {
    lock: tokio::sync::Mutex<()>,
    meter: Arc<Meter>,
}

/// The node's artifact cache. Its file work (manifests read, room made, downloads checked and
/// placed, artifacts evicted) runs on the blocking pool, never on the async executor.
#[derive(Debug)]
pub struct Cache(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    limit: u64,
    fetching: Mutex<HashMap<String, Arc<Fetching>>>,
    staged: AtomicU64,
}

impl Cache {
    /// Opens (creating) the cache at `dir` with a limit of `limit` bytes; removes what a crash
    /// left: staging nobody holds, and entries that are not complete artifacts. Blocking: call
    /// it where the agent starts, or off the executor.
    ///
    /// # Errors
    /// [`CacheError::Io`] when the directory cannot be made.
    pub fn open(dir: &Path, limit: u64) -> Result<Self, CacheError> {
        Inner::open(dir, limit).map(|inner| Self(Arc::new(inner)))
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.0.dir
    }

    /// Bytes of the complete artifacts in the cache (reads every manifest: off the executor).
    pub fn bytes(&self) -> u64 {
        self.0.bytes()
    }

    /// The progress of the fetch of `namespace`/`hash` running in this process, if any.
    pub fn fetching(&self, namespace: &str, hash: &str) -> Option<Arc<Meter>> {
        self.0.fetching(namespace, hash)
    }

    /// The artifact `namespace`/`hash` whose manifest has the digest `digest`, held: from the
    /// cache when it is there, else fetched from `source` once (concurrent callers wait for that
    /// fetch, whose progress [`Cache::fetching`] gives), after making room. A cached copy with
    /// another digest (the checkpoint was captured again under the same identity) is replaced.
    ///
    /// # Errors
    /// [`CacheError`]; nothing partial is ever kept or given.
    pub async fn get(
        &self,
        namespace: &str,
        hash: &str,
        digest: &str,
        source: &dyn Source,
    ) -> Result<Held, CacheError> {
        self.0.get(namespace, hash, digest, source).await
    }
}

/// Runs `f` on the blocking pool.
async fn blocking<T: Send + 'static>(
    dir: &Path,
    f: impl FnOnce() -> Result<T, CacheError> + Send + 'static,
) -> Result<T, CacheError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| CacheError::Io {
            op: "run file work for",
            path: dir.to_path_buf(),
            source: io::Error::other(e),
        })?
}

/// A cached artifact, held: it is not evicted while this value lives.
#[derive(Debug)]
pub struct Held {
    dir: PathBuf,
    fetched: bool,
    _lock: Flock<File>,
}

impl Held {
    /// Whether this call fetched it (else it was in the cache already).
    pub fn fetched(&self) -> bool {
        self.fetched
    }

    /// The artifact's directory (the layout of a published artifact).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

/// A complete artifact in the cache, as eviction sees it.
#[derive(Debug)]
struct Entry {
    dir: PathBuf,
    bytes: u64,
    used: SystemTime,
}

impl Inner {
    fn open(dir: &Path, limit: u64) -> Result<Self, CacheError> {
        for sub in [dir.to_path_buf(), dir.join(STAGING), dir.join(LOCKS)] {
            std::fs::create_dir_all(&sub).map_err(io_err("create", &sub))?;
            // The cached artifacts are workloads' memory (secrets included): only the agent's
            // user enters the cache, whatever the modes below it.
            std::fs::set_permissions(&sub, std::fs::Permissions::from_mode(0o700))
                .map_err(io_err("restrict", &sub))?;
        }
        let cache = Self {
            dir: dir.to_path_buf(),
            limit,
            fetching: Mutex::default(),
            staged: AtomicU64::new(0),
        };
        cache.sweep();
        Ok(cache)
    }

    fn bytes(&self) -> u64 {
        self.entries().iter().map(|e| e.bytes).sum()
    }

    fn fetching(&self, namespace: &str, hash: &str) -> Option<Arc<Meter>> {
        self.fetching
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key(namespace, hash))
            .map(|f| f.meter.clone())
    }

    async fn get(
        self: &Arc<Self>,
        namespace: &str,
        hash: &str,
        digest: &str,
        source: &dyn Source,
    ) -> Result<Held, CacheError> {
        let want = Want {
            hash: hash.to_owned(),
            digest: digest.to_owned(),
        };
        validate_path_element("namespace", namespace)?;
        validate_path_element("hash", hash)?;
        let final_dir = self.dir.join(namespace).join(hash);
        if let Some(held) = self.hold(&final_dir, &want).await? {
            return Ok(held);
        }
        let name = key(namespace, hash);
        let fetching = self
            .fetching
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .entry(name.clone())
            .or_default()
            .clone();
        let result = {
            let _ours = fetching.lock.lock().await;
            // Fetched while this caller waited, in this process or another.
            match self.hold(&final_dir, &want).await? {
                Some(held) => Ok(held),
                None => {
                    let node_lock = self.node_lock(&name).await?;
                    let fetched = match self.hold(&final_dir, &want).await? {
                        Some(held) => Ok(held),
                        None => {
                            self.fetch(namespace, &want, &final_dir, source, &fetching.meter)
                                .await
                        }
                    };
                    drop(node_lock);
                    fetched
                }
            }
        };
        let mut map = self.fetching.lock().unwrap_or_else(PoisonError::into_inner);
        if Arc::strong_count(&fetching) == 2 {
            map.remove(&name);
        }
        result
    }

    /// [`hold_complete`] on the blocking pool.
    async fn hold(&self, dir: &Path, want: &Want) -> Result<Option<Held>, CacheError> {
        let (path, want) = (dir.to_path_buf(), want.clone());
        blocking(dir, move || Ok(hold_complete(&path, &want))).await
    }

    /// The node-wide fetch lock of an artifact (another process of this node may fetch it).
    async fn node_lock(&self, name: &str) -> Result<Flock<File>, CacheError> {
        let path = self.dir.join(LOCKS).join(name);
        tokio::task::spawn_blocking(move || {
            let file = File::options()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .map_err(io_err("open", &path))?;
            Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| CacheError::Io {
                op: "lock",
                path: path.clone(),
                source: e.into(),
            })
        })
        .await
        .map_err(|e| CacheError::Io {
            op: "lock",
            path: self.dir.join(LOCKS),
            source: io::Error::other(e),
        })?
    }

    async fn fetch(
        self: &Arc<Self>,
        namespace: &str,
        want: &Want,
        final_dir: &Path,
        source: &dyn Source,
        meter: &Arc<Meter>,
    ) -> Result<Held, CacheError> {
        let hash = want.hash.as_str();
        let fetch_err = |source| CacheError::Fetch {
            namespace: namespace.to_owned(),
            hash: hash.to_owned(),
            source,
        };
        let needed = source.size().await.map_err(fetch_err)?;
        let staging = {
            let (this, ns, h) = (self.clone(), namespace.to_owned(), hash.to_owned());
            blocking(&self.dir, move || {
                this.make_room(needed)?;
                this.make_disk_room(&ns, &h, needed)?;
                Staging::create(&this.dir.join(STAGING), &key(&ns, &h))
            })
            .await?
        };
        self.staged.fetch_add(needed, Ordering::Relaxed);
        meter.set_total(needed);
        let fetched = source.fetch(staging.path(), meter.clone()).await;
        self.staged.fetch_sub(needed, Ordering::Relaxed);
        if let Err(err) = fetched {
            let disk_full = is_disk_full(err.as_ref());
            let this = self.clone();
            let evicted = blocking(&self.dir, move || {
                drop(staging);
                Ok(disk_full.then(|| this.evict_unused()))
            })
            .await?;
            if let Some(evicted) = evicted {
                return Err(CacheError::DiskFull {
                    dir: self.dir.clone(),
                    namespace: namespace.to_owned(),
                    hash: hash.to_owned(),
                    needed,
                    evicted,
                });
            }
            return Err(fetch_err(err));
        }
        let (ns, want, final_dir) = (namespace.to_owned(), want.clone(), final_dir.to_path_buf());
        let mut held = blocking(&self.dir, move || {
            place_fetched(staging, &ns, &want, &final_dir)
        })
        .await?;
        held.fetched = true;
        Ok(held)
    }

    /// Evicts least recently used artifacts no restore reads until `needed` more bytes fit.
    fn make_room(&self, needed: u64) -> Result<(), CacheError> {
        let mut entries = self.entries();
        entries.sort_by_key(|e| e.used);
        let staged = self.staged.load(Ordering::Relaxed);
        let mut used: u64 = entries.iter().map(|e| e.bytes).sum::<u64>() + staged;
        let mut in_use = staged;
        for entry in entries {
            if used.saturating_add(needed) <= self.limit {
                return Ok(());
            }
            if evict(&entry.dir) {
                tracing::info!(artifact = %entry.dir.display(), bytes = entry.bytes, "evicted from the cache");
                used -= entry.bytes;
            } else {
                in_use += entry.bytes;
            }
        }
        if used.saturating_add(needed) <= self.limit {
            Ok(())
        } else {
            Err(CacheError::Full {
                dir: self.dir.clone(),
                needed,
                limit: self.limit,
                in_use,
            })
        }
    }

    /// Evicts least recently used artifacts no restore reads until the disk has `needed` bytes
    /// free besides what running downloads still have to write, so that a download the disk
    /// cannot hold is refused before it starts rather than failing at the end.
    fn make_disk_room(&self, namespace: &str, hash: &str, needed: u64) -> Result<(), CacheError> {
        let staged = self.staged.load(Ordering::Relaxed);
        let wanted = needed.saturating_add(staged);
        let free = || disk_free(&self.dir).map_err(io_err("statvfs", &self.dir));
        if free()? >= wanted {
            return Ok(());
        }
        let mut entries = self.entries();
        entries.sort_by_key(|e| e.used);
        let mut in_use = 0;
        for entry in entries {
            if free()? >= wanted {
                return Ok(());
            }
            if evict(&entry.dir) {
                tracing::info!(artifact = %entry.dir.display(), bytes = entry.bytes, "evicted from the cache for disk room");
            } else {
                in_use += entry.bytes;
            }
        }
        let free = free()?;
        if free >= wanted {
            return Ok(());
        }
        Err(CacheError::NoRoom {
            dir: self.dir.clone(),
            namespace: namespace.to_owned(),
            hash: hash.to_owned(),
            needed,
            free: free.saturating_sub(staged),
            in_use,
        })
    }

    /// Evicts every artifact no restore reads; how many.
    fn evict_unused(&self) -> usize {
        self.entries().iter().filter(|e| evict(&e.dir)).count()
    }

    /// The complete artifacts in the cache.
    fn entries(&self) -> Vec<Entry> {
        let mut out = Vec::new();
        for namespace in read_dirs(&self.dir) {
            for dir in read_dirs(&namespace) {
                let Ok(manifest) = read_published(&dir, Verification::Sizes) else {
                    continue;
                };
                let used = std::fs::metadata(&dir)
                    .and_then(|m| m.modified())
                    .unwrap_or(SystemTime::UNIX_EPOCH);
                out.push(Entry {
                    bytes: manifest.total_size(),
                    dir,
                    used,
                });
            }
        }
        out
    }

    /// Removes what a crash left: staging nobody holds, and entries that are no complete
    /// artifact (nobody holding them).
    fn sweep(&self) {
        for dir in read_dirs(&self.dir.join(STAGING)) {
            if evict(&dir) {
                tracing::warn!(staging = %dir.display(), "removed a download a crash left unfinished");
            }
        }
        for namespace in read_dirs(&self.dir) {
            for dir in read_dirs(&namespace) {
                if read_published(&dir, Verification::Sizes).is_err() && evict(&dir) {
                    tracing::warn!(artifact = %dir.display(), "removed an incomplete artifact from the cache");
                }
            }
            // Evictions a crash cut short.
            let Ok(entries) = std::fs::read_dir(&namespace) else {
                continue;
            };
            for entry in entries.flatten() {
                if entry.file_name().to_string_lossy().starts_with(".evicted-") {
                    let _ = std::fs::remove_dir_all(entry.path());
                }
            }
        }
    }
}

fn key(namespace: &str, hash: &str) -> String {
    format!("{namespace}.{hash}")
}

/// The directories in `dir` but the cache's own (`.staging`, `.locks`).
fn read_dirs(dir: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .filter(|e| !e.file_name().to_string_lossy().starts_with('.'))
        .map(|e| e.path())
        .collect()
}

/// The artifact a caller wants.
#[derive(Clone, Debug)]
struct Want {
    hash: String,
    digest: String,
}

/// Checks a finished download (its manifest is the wanted one, every file its size), puts it in
/// place of any older copy no restore reads, and holds it. Blocking.
fn place_fetched(
    staging: Staging,
    namespace: &str,
    want: &Want,
    final_dir: &Path,
) -> Result<Held, CacheError> {
    let hash = want.hash.as_str();
    let invalid = |reason: String| CacheError::Invalid {
        namespace: namespace.to_owned(),
        hash: hash.to_owned(),
        reason,
    };
    let manifest = read_published(staging.path(), Verification::Sizes)
        .map_err(|e| invalid(crate::report::error_chain(&e)))?;
    if manifest.identity_hash != hash || manifest.digest != want.digest {
        return Err(invalid(format!(
            "its manifest is of checkpoint {} with digest {}, not {hash} with {}",
            manifest.identity_hash, manifest.digest, want.digest
        )));
    }
    // An older copy (another capture under the same identity) makes way, unless it is read.
    if final_dir.exists() && !evict(final_dir) {
        return Err(CacheError::Busy {
            dir: final_dir.to_path_buf(),
        });
    }
    staging.place(final_dir)?;
    hold_complete(final_dir, want)
        .ok_or_else(|| invalid("it could not be read back after it was placed".to_owned()))
}

/// Holds the artifact at `dir` when it is complete and the one wanted, marking it used.
fn hold_complete(dir: &Path, want: &Want) -> Option<Held> {
    let file = File::open(dir).ok()?;
    let lock = Flock::lock(file, FlockArg::LockSharedNonblock).ok()?;
    let manifest = read_published(dir, Verification::Sizes).ok()?;
    if manifest.identity_hash != want.hash || manifest.digest != want.digest {
        return None;
    }
    let _ = lock.set_modified(SystemTime::now());
    Some(Held {
        dir: dir.to_path_buf(),
        fetched: false,
        _lock: lock,
    })
}

/// Removes `dir` unless someone holds it; whether it was removed.
fn evict(dir: &Path) -> bool {
    let Ok(file) = File::open(dir) else {
        return false;
    };
    let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
        return false;
    };
    // Out of its namespace first, so no reader finds it half removed.
    let doomed = dir.with_file_name(format!(
        ".evicted-{}",
        dir.file_name()
            .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
    ));
    let removed = std::fs::rename(dir, &doomed).and_then(|()| std::fs::remove_dir_all(&doomed));
    drop(lock);
    if let Err(e) = &removed {
        tracing::warn!(artifact = %dir.display(), error = %e, "cannot evict from the cache");
    }
    removed.is_ok()
}

/// Whether a source's error says the disk is full.
/// Bytes an unprivileged writer may still write on the filesystem of `dir`.
fn disk_free(dir: &Path) -> io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).map_err(io::Error::from)?;
    Ok(stat.blocks_available().saturating_mul(stat.fragment_size()))
}

fn is_disk_full(err: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(err);
    while let Some(e) = current {
        if let Some(io) = e.downcast_ref::<io::Error>()
            && (io.kind() == io::ErrorKind::StorageFull
                || io.raw_os_error() == Some(nix::libc::ENOSPC))
        {
            return true;
        }
        current = e.source();
    }
    false
}

/// An artifact on the shared artifact volume as a [`Source`]: its listed files copied (no link
/// followed), then the manifest and the marker, and the copy verified in full (every chunk's
/// checksum) before the cache places it. For a volume slower than the node's disk (network
/// storage), the second restore of an artifact on a node reads local disk.
#[derive(Clone, Debug)]
pub struct VolumeSource {
    artifact: PathBuf,
}

impl VolumeSource {
    /// The published artifact at `artifact`.
    pub fn new(artifact: PathBuf) -> Self {
        Self { artifact }
    }
}

impl Source for VolumeSource {
    fn size(&self) -> BoxFuture<'_, Result<u64, FetchError>> {
        let artifact = self.artifact.clone();
        Box::pin(async move {
            let manifest =
                tokio::task::spawn_blocking(move || read_published(&artifact, Verification::Sizes))
                    .await??;
            Ok(manifest.total_size())
        })
    }

    fn fetch<'a>(
        &'a self,
        into: &'a Path,
        meter: Arc<Meter>,
    ) -> BoxFuture<'a, Result<(), FetchError>> {
        let (from, to) = (self.artifact.clone(), into.to_path_buf());
        Box::pin(async move {
            tokio::task::spawn_blocking(move || copy_artifact(&from, &to, &meter)).await?
        })
    }
}

/// Copies the published artifact `from` into `to` and verifies the copy in full.
fn copy_artifact(from: &Path, to: &Path, meter: &Meter) -> Result<(), FetchError> {
    use std::os::unix::fs::OpenOptionsExt;
    let manifest = read_published(from, Verification::Sizes)?;
    let no_follow = |path: &Path| {
        File::options()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(path)
    };
    let files = manifest.files.iter().map(|f| f.path.as_str());
    let marker = [
        warmstart_shared::names::FILE_MANIFEST,
        warmstart_shared::names::FILE_COMPLETE,
    ];
    for name in files.chain(marker) {
        let (source, target) = (from.join(name), to.join(name));
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let mut reader = no_follow(&source)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", source.display())))?;
        let mut writer = File::create(&target)?;
        copy_counted(&mut reader, &mut writer, meter)
            .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", target.display())))?;
    }
    read_published(to, Verification::Checksums)?;
    Ok(())
}

/// Copies `reader` to `writer` in 1 MiB pieces, counting them into `meter`.
fn copy_counted(reader: &mut File, writer: &mut File, meter: &Meter) -> io::Result<()> {
    use std::io::{Read, Write};
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = match reader.read(&mut buf) {
            Ok(0) => return Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        writer.write_all(&buf[..n])?;
        meter.add(n as u64);
    }
}

/// A download's staging directory, locked by this process while it lives; removed when
/// dropped unless placed.
#[derive(Debug)]
struct Staging {
    path: PathBuf,
    lock: Option<Flock<File>>,
}

impl Staging {
    fn create(dir: &Path, name: &str) -> Result<Self, CacheError> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let path = dir.join(format!(
            "{name}.{}.{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&path).map_err(io_err("create", &path))?;
        let lock = File::open(&path)
            .ok()
            .and_then(|f| Flock::lock(f, FlockArg::LockExclusiveNonblock).ok());
        Ok(Self { path, lock })
    }

    fn path(&self) -> &Path {
        &self.path
    }

    /// Renames the staging to `final_dir` (which must not exist) and makes that durable.
    fn place(mut self, final_dir: &Path) -> Result<(), CacheError> {
        let parent = final_dir.parent().unwrap_or(final_dir);
        std::fs::create_dir_all(parent).map_err(io_err("create", parent))?;
        crate::publish::fsync_tree(&self.path).map_err(|e| CacheError::Io {
            op: "fsync",
            path: self.path.clone(),
            source: io::Error::other(e),
        })?;
        renameat2(
            AT_FDCWD,
            &self.path,
            AT_FDCWD,
            final_dir,
            RenameFlags::RENAME_NOREPLACE,
        )
        .map_err(|e| CacheError::Io {
            op: "rename into place",
            path: final_dir.to_path_buf(),
            source: e.into(),
        })?;
        File::open(parent)
            .and_then(|d| d.sync_all())
            .map_err(io_err("fsync", parent))?;
        self.lock = None;
        self.path = PathBuf::new();
        Ok(())
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if self.path.as_os_str().is_empty() {
            return;
        }
        match std::fs::remove_dir_all(&self.path) {
            // A source that failed may have removed it itself.
            Err(e) if e.kind() != io::ErrorKind::NotFound => {
                tracing::warn!(staging = %self.path.display(), error = %e, "cannot remove a discarded download");
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;
    use std::time::Duration;

    use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo};

    use super::*;

    const NS: &str = "models";
    const PAGES: usize = 8192;

    /// A published artifact of `hash` (one page image of [`PAGES`] bytes) at `dir`.
    fn published(dir: &Path, hash: &str) -> PathBuf {
        let out = dir.join(hash);
        let staging = crate::publish::Staging::create(&out).unwrap();
        std::fs::create_dir(staging.path().join("criu")).unwrap();
        std::fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; PAGES]).unwrap();
        let manifest = Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: hash.into(),
            created_at: "2026-12-05T00:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo::default(),
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: 0,
            files: vec![],
            digest: String::new(),
        };
        staging.publish(manifest, &Meter::default()).unwrap();
        out
    }

    /// Only the agent's user enters the cache: a cached page image is a workload's memory.
    /// Shown with a process of another user (nobody), which can neither list the cache nor
    /// read a file in it whatever the file's own mode.
    #[test]
    fn only_the_agent_enters_the_cache() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
        let _cache = Cache::open(&dir, 1 << 20).unwrap();
        for sub in [dir.clone(), dir.join(STAGING), dir.join(LOCKS)] {
            let mode = std::fs::metadata(&sub).unwrap().permissions().mode() & 0o7777;
            assert_eq!(mode, 0o700, "{}", sub.display());
        }
        let planted = dir.join(NS).join("pages-1.img");
        std::fs::create_dir_all(planted.parent().unwrap()).unwrap();
        std::fs::write(&planted, b"secret").unwrap();
        std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o644)).unwrap();
        if !nix::unistd::Uid::effective().is_root() {
            return;
        }
        // `nobody` reads it, as a local user of the node would.
        let out = std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups", "cat"])
            .arg(&planted)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("Permission denied"),
            "{out:?}"
        );
    }

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Fault {
        None,
        /// Fails after writing half the page image.
        FailMidway,
        /// Writes a page image one byte short and says it is done.
        Truncate,
    }

    /// A source copying a published artifact file by file, slowly when asked, with a fault.
    #[derive(Debug)]
    struct Copying {
        from: PathBuf,
        fault: Fault,
        pause: Duration,
        calls: AtomicUsize,
    }

    impl Copying {
        fn new(from: PathBuf) -> Self {
            Self {
                from,
                fault: Fault::None,
                pause: Duration::ZERO,
                calls: AtomicUsize::new(0),
            }
        }

        fn with(mut self, fault: Fault) -> Self {
            self.fault = fault;
            self
        }

        fn calls(&self) -> usize {
            self.calls.load(Ordering::SeqCst)
        }

        fn digest(&self) -> String {
            digest(&self.from)
        }
    }

    fn digest(artifact: &Path) -> String {
        read_published(artifact, Verification::Sizes)
            .unwrap()
            .digest
    }

    impl Source for Copying {
        fn size(&self) -> BoxFuture<'_, Result<u64, FetchError>> {
            Box::pin(
                async move { Ok(read_published(&self.from, Verification::Sizes)?.total_size()) },
            )
        }

        fn fetch<'a>(
            &'a self,
            into: &'a Path,
            meter: Arc<Meter>,
        ) -> BoxFuture<'a, Result<(), FetchError>> {
            Box::pin(async move {
                self.calls.fetch_add(1, Ordering::SeqCst);
                std::fs::create_dir(into.join("criu"))?;
                let pages = std::fs::read(self.from.join("criu/pages-1.img"))?;
                for half in pages.chunks(PAGES / 2) {
                    tokio::time::sleep(self.pause).await;
                    meter.add(half.len() as u64);
                }
                match self.fault {
                    Fault::FailMidway => {
                        std::fs::write(into.join("criu/pages-1.img"), &pages[..PAGES / 2])?;
                        return Err("the server went away".into());
                    }
                    Fault::Truncate => {
                        std::fs::write(into.join("criu/pages-1.img"), &pages[1..])?;
                    }
                    Fault::None => std::fs::write(into.join("criu/pages-1.img"), &pages)?,
                }
                for file in ["manifest.json", "COMPLETE"] {
                    std::fs::copy(self.from.join(file), into.join(file))?;
                }
                Ok(())
            })
        }
    }

    struct Fixture {
        tmp: tempfile::TempDir,
        cache: Cache,
    }

    impl Fixture {
        fn new(limit_artifacts: u64) -> Self {
            let tmp = tempfile::tempdir().unwrap();
            std::fs::create_dir(tmp.path().join("store")).unwrap();
            let cache =
                Cache::open(&tmp.path().join("cache"), limit_artifacts * PAGES as u64).unwrap();
            Self { tmp, cache }
        }

        fn source(&self, hash: &str) -> Copying {
            let store = self.tmp.path().join("store");
            let dir = store.join(hash);
            Copying::new(if dir.exists() {
                dir
            } else {
                published(&store, hash)
            })
        }

        fn cached(&self, hash: &str) -> bool {
            self.cache.dir().join(NS).join(hash).exists()
        }

        fn staging_left(&self) -> usize {
            std::fs::read_dir(self.cache.dir().join(STAGING))
                .unwrap()
                .count()
        }
    }

    #[tokio::test]
    async fn an_artifact_is_fetched_once_then_read_from_the_cache() {
        let f = Fixture::new(4);
        let source = f.source("aaaaaaaaaaaaaaaa");
        let held = f
            .cache
            .get(NS, "aaaaaaaaaaaaaaaa", &source.digest(), &source)
            .await
            .unwrap();
        assert_eq!(held.dir(), f.cache.dir().join(NS).join("aaaaaaaaaaaaaaaa"));
        let manifest = read_published(held.dir(), Verification::Checksums).unwrap();
        assert_eq!(manifest.identity_hash, "aaaaaaaaaaaaaaaa");
        drop(held);
        let again = f
            .cache
            .get(NS, "aaaaaaaaaaaaaaaa", &source.digest(), &source)
            .await
            .unwrap();
        assert_eq!(
            source.calls(),
            1,
            "the second restore reads the node's disk"
        );
        assert_eq!(f.cache.bytes(), PAGES as u64);
        drop(again);
        assert_eq!(f.staging_left(), 0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn restores_asking_at_once_share_one_fetch_and_see_its_progress() {
        let f = Arc::new(Fixture::new(4));
        let mut source = f.source("bbbbbbbbbbbbbbbb");
        source.pause = Duration::from_millis(300);
        let source = Arc::new(source);
        let mut tasks = tokio::task::JoinSet::new();
        for _ in 0..8 {
            let (f, source) = (f.clone(), source.clone());
            tasks.spawn(async move {
                let held = f
                    .cache
                    .get(NS, "bbbbbbbbbbbbbbbb", &source.digest(), source.as_ref())
                    .await
                    .unwrap();
                held.dir().to_path_buf()
            });
        }
        // While it runs, those waiting see how far the one fetch is.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let seen = loop {
            let total = f
                .cache
                .fetching(NS, "bbbbbbbbbbbbbbbb")
                .map_or(0, |meter| meter.get().1);
            if total > 0 {
                break total;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no fetch was seen running"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        };
        assert_eq!(seen, PAGES as u64);
        let mut dirs = Vec::new();
        while let Some(dir) = tasks.join_next().await {
            dirs.push(dir.unwrap());
        }
        assert_eq!(source.calls(), 1, "one download for eight restores");
        assert!(
            dirs.iter()
                .all(|d| *d == f.cache.dir().join(NS).join("bbbbbbbbbbbbbbbb"))
        );
        assert!(f.cache.fetching(NS, "bbbbbbbbbbbbbbbb").is_none());
    }

    #[tokio::test]
    async fn the_least_recently_used_artifact_is_evicted_to_make_room() {
        let f = Fixture::new(3);
        for hash in ["aaaaaaaaaaaaaaaa", "bbbbbbbbbbbbbbbb", "cccccccccccccccc"] {
            drop(
                f.cache
                    .get(NS, hash, &f.source(hash).digest(), &f.source(hash))
                    .await
                    .unwrap(),
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Used again: now the most recent.
        drop(
            f.cache
                .get(
                    NS,
                    "aaaaaaaaaaaaaaaa",
                    &f.source("aaaaaaaaaaaaaaaa").digest(),
                    &f.source("aaaaaaaaaaaaaaaa"),
                )
                .await
                .unwrap(),
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
        drop(
            f.cache
                .get(
                    NS,
                    "dddddddddddddddd",
                    &f.source("dddddddddddddddd").digest(),
                    &f.source("dddddddddddddddd"),
                )
                .await
                .unwrap(),
        );
        assert!(
            !f.cached("bbbbbbbbbbbbbbbb"),
            "the least recently used goes"
        );
        for hash in ["aaaaaaaaaaaaaaaa", "cccccccccccccccc", "dddddddddddddddd"] {
            assert!(f.cached(hash), "{hash} stays");
        }
        assert_eq!(f.cache.bytes(), 3 * PAGES as u64);
    }

    #[tokio::test]
    async fn an_artifact_being_read_is_never_evicted_and_a_full_cache_says_why() {
        let f = Fixture::new(2);
        let a = f
            .cache
            .get(
                NS,
                "aaaaaaaaaaaaaaaa",
                &f.source("aaaaaaaaaaaaaaaa").digest(),
                &f.source("aaaaaaaaaaaaaaaa"),
            )
            .await
            .unwrap();
        let b = f
            .cache
            .get(
                NS,
                "bbbbbbbbbbbbbbbb",
                &f.source("bbbbbbbbbbbbbbbb").digest(),
                &f.source("bbbbbbbbbbbbbbbb"),
            )
            .await
            .unwrap();
        let source = f.source("cccccccccccccccc");
        let err = f
            .cache
            .get(NS, "cccccccccccccccc", &source.digest(), &source)
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(matches!(err, CacheError::Full { .. }), "{err:?}");
        assert!(
            message.contains(&format!("cannot take {PAGES} bytes"))
                && message.contains(&format!(
                    "{} bytes are artifacts restores are reading",
                    2 * PAGES
                )),
            "{message}"
        );
        assert_eq!(
            source.calls(),
            0,
            "nothing is downloaded that cannot be kept"
        );
        assert!(
            f.cached("aaaaaaaaaaaaaaaa")
                && f.cached("bbbbbbbbbbbbbbbb")
                && !f.cached("cccccccccccccccc")
        );
        assert_eq!(f.staging_left(), 0);
        // Once one is no longer read, it makes room.
        drop(a);
        drop(
            f.cache
                .get(NS, "cccccccccccccccc", &source.digest(), &source)
                .await
                .unwrap(),
        );
        assert!(
            !f.cached("aaaaaaaaaaaaaaaa")
                && f.cached("bbbbbbbbbbbbbbbb")
                && f.cached("cccccccccccccccc")
        );
        drop(b);
    }

    #[tokio::test]
    async fn a_failed_or_incomplete_download_is_never_used_and_is_fetched_again() {
        let f = Fixture::new(4);
        let failing = f.source("aaaaaaaaaaaaaaaa").with(Fault::FailMidway);
        let err = f
            .cache
            .get(NS, "aaaaaaaaaaaaaaaa", &failing.digest(), &failing)
            .await
            .unwrap_err();
        assert!(matches!(err, CacheError::Fetch { .. }), "{err:?}");
        assert!(
            crate::report::error_chain(&err).contains("the server went away"),
            "{err}"
        );
        assert!(!f.cached("aaaaaaaaaaaaaaaa"));
        assert_eq!(f.staging_left(), 0, "the partial download is discarded");

        let truncating = f.source("aaaaaaaaaaaaaaaa").with(Fault::Truncate);
        let err = f
            .cache
            .get(NS, "aaaaaaaaaaaaaaaa", &truncating.digest(), &truncating)
            .await
            .unwrap_err();
        assert!(matches!(err, CacheError::Invalid { .. }), "{err:?}");
        assert!(err.to_string().contains("pages-1.img"), "{err}");
        assert!(!f.cached("aaaaaaaaaaaaaaaa"));
        assert_eq!(f.staging_left(), 0);

        let good = f.source("aaaaaaaaaaaaaaaa");
        drop(
            f.cache
                .get(NS, "aaaaaaaaaaaaaaaa", &good.digest(), &good)
                .await
                .unwrap(),
        );
        assert_eq!(good.calls(), 1);
    }

    #[tokio::test]
    async fn a_checkpoint_captured_again_replaces_its_cached_copy_once_no_restore_reads_it() {
        let f = Fixture::new(4);
        let hash = "aaaaaaaaaaaaaaaa";
        let first = f.source(hash);
        let old = f
            .cache
            .get(NS, hash, &first.digest(), &first)
            .await
            .unwrap();
        // Captured again under the same identity: same hash, another manifest.
        let again = tempfile::tempdir().unwrap();
        std::thread::sleep(Duration::from_millis(5));
        let recaptured = {
            let dir = published(again.path(), hash);
            let mut manifest = read_published(&dir, Verification::Sizes).unwrap();
            manifest.created_at = "2026-12-06T00:00:00Z".into();
            std::fs::remove_dir_all(&dir).unwrap();
            let staging = crate::publish::Staging::create(&dir).unwrap();
            std::fs::create_dir(staging.path().join("criu")).unwrap();
            std::fs::write(staging.path().join("criu/pages-1.img"), vec![9u8; PAGES]).unwrap();
            manifest.files.clear();
            manifest.digest.clear();
            staging.publish(manifest, &Meter::default()).unwrap();
            Copying::new(dir)
        };
        assert_ne!(recaptured.digest(), first.digest());
        let err = f
            .cache
            .get(NS, hash, &recaptured.digest(), &recaptured)
            .await
            .unwrap_err();
        assert!(matches!(err, CacheError::Busy { .. }), "{err:?}");
        assert_eq!(
            read_published(old.dir(), Verification::Checksums)
                .unwrap()
                .digest,
            first.digest(),
            "the copy a restore reads is left as it is"
        );
        drop(old);
        let new = f
            .cache
            .get(NS, hash, &recaptured.digest(), &recaptured)
            .await
            .unwrap();
        assert_eq!(
            read_published(new.dir(), Verification::Checksums)
                .unwrap()
                .digest,
            recaptured.digest()
        );
        assert_eq!(f.staging_left(), 0);
    }

    #[tokio::test]
    async fn what_a_crash_left_is_removed_when_the_cache_opens_but_a_live_download_is_not() {
        let f = Fixture::new(4);
        drop(
            f.cache
                .get(
                    NS,
                    "aaaaaaaaaaaaaaaa",
                    &f.source("aaaaaaaaaaaaaaaa").digest(),
                    &f.source("aaaaaaaaaaaaaaaa"),
                )
                .await
                .unwrap(),
        );
        let dir = f.cache.dir().to_path_buf();
        // A download a crash cut short, one still running elsewhere, and an entry without its
        // completion marker.
        let dead = dir.join(STAGING).join("models.bbbbbbbbbbbbbbbb.1.0");
        std::fs::create_dir_all(dead.join("criu")).unwrap();
        std::fs::write(dead.join("criu/pages-1.img"), b"partial").unwrap();
        let live = Staging::create(&dir.join(STAGING), "models.cccccccccccccccc").unwrap();
        let unmarked = dir.join(NS).join("dddddddddddddddd");
        std::fs::create_dir_all(&unmarked).unwrap();
        std::fs::write(unmarked.join("manifest.json"), b"{}").unwrap();

        let reopened = Cache::open(&dir, 4 * PAGES as u64).unwrap();
        assert!(!dead.exists(), "the crash's download is removed");
        assert!(
            live.path().exists(),
            "a download someone holds is left alone"
        );
        assert!(!unmarked.exists(), "an incomplete entry is removed");
        assert!(f.cached("aaaaaaaaaaaaaaaa"), "complete artifacts stay");
        assert_eq!(reopened.bytes(), PAGES as u64);
    }

    /// A tmpfs of `bytes` mounted at `dir`, unmounted when dropped.
    struct Tmpfs(PathBuf);

    impl Tmpfs {
        fn mount(dir: &Path, bytes: u64) -> Self {
            std::fs::create_dir_all(dir).unwrap();
            nix::mount::mount(
                Some("tmpfs"),
                dir,
                Some("tmpfs"),
                nix::mount::MsFlags::empty(),
                Some(format!("size={bytes}").as_str()),
            )
            .unwrap();
            Self(dir.to_path_buf())
        }
    }

    impl Drop for Tmpfs {
        fn drop(&mut self) {
            let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
        }
    }

    #[tokio::test]
    async fn a_full_disk_discards_the_download_and_evicts_what_no_restore_reads() {
        if !crate::testing::root("mounts a small tmpfs to fill") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = tmp.path().join("store");
        std::fs::create_dir(&store).unwrap();
        let disk = Tmpfs::mount(&tmp.path().join("disk"), 64 << 10);
        // The limit says the disk has room; the disk says otherwise.
        let cache = Cache::open(&disk.0.join("cache"), 1 << 30).unwrap();
        let small = Copying::new(published(&store, "aaaaaaaaaaaaaaaa"));
        drop(
            cache
                .get(NS, "aaaaaaaaaaaaaaaa", &small.digest(), &small)
                .await
                .unwrap(),
        );
        let big = {
            let out = store.join("bbbbbbbbbbbbbbbb");
            let staging = crate::publish::Staging::create(&out).unwrap();
            std::fs::create_dir(staging.path().join("criu")).unwrap();
            std::fs::write(
                staging.path().join("criu/pages-1.img"),
                vec![1u8; 128 << 10],
            )
            .unwrap();
            let mut manifest = read_published(&small.from, Verification::Sizes).unwrap();
            manifest.identity_hash = "bbbbbbbbbbbbbbbb".into();
            manifest.files.clear();
            manifest.digest.clear();
            staging.publish(manifest, &Meter::default()).unwrap();
            BigCopy(out, AtomicUsize::new(0), false)
        };
        // Known too big for the disk from its size: unused artifacts make way, then it is
        // refused before any byte is fetched.
        let err = cache
            .get(NS, "bbbbbbbbbbbbbbbb", &big.digest(), &big)
            .await
            .unwrap_err();
        assert!(
            matches!(err, CacheError::NoRoom { in_use: 0, .. }),
            "{err:?}"
        );
        assert!(
            err.to_string()
                .contains("artifact models/bbbbbbbbbbbbbbbb needs"),
            "{err}"
        );
        assert_eq!(big.1.load(Ordering::Relaxed), 0, "nothing was fetched");
        assert!(
            !cache.dir().join(NS).join("aaaaaaaaaaaaaaaa").exists(),
            "unused artifacts made way"
        );

        // The disk filling up during a download all the same (its size understated, or
        // something else writing to the disk): the download is discarded and unused artifacts
        // evicted.
        drop(
            cache
                .get(NS, "aaaaaaaaaaaaaaaa", &small.digest(), &small)
                .await
                .unwrap(),
        );
        let understated = BigCopy(big.0.clone(), AtomicUsize::new(0), true);
        let err = cache
            .get(NS, "bbbbbbbbbbbbbbbb", &understated.digest(), &understated)
            .await
            .unwrap_err();
        let message = err.to_string();
        assert!(
            matches!(err, CacheError::DiskFull { evicted: 1, .. }),
            "{err:?}"
        );
        assert!(
            message.contains("filled up fetching artifact models/bbbbbbbbbbbbbbbb"),
            "{message}"
        );
        assert!(!cache.dir().join(NS).join("bbbbbbbbbbbbbbbb").exists());
        assert!(
            !cache.dir().join(NS).join("aaaaaaaaaaaaaaaa").exists(),
            "unused artifacts are evicted"
        );
        assert_eq!(
            std::fs::read_dir(cache.dir().join(STAGING))
                .unwrap()
                .count(),
            0
        );
        // The cache still works.
        drop(
            cache
                .get(NS, "aaaaaaaaaaaaaaaa", &small.digest(), &small)
                .await
                .unwrap(),
        );
        drop(disk);
    }

    /// Copies a published artifact whole, as a store writing what it is given would; counts
    /// its fetches; with `true`, says it is 1 KiB.
    struct BigCopy(PathBuf, AtomicUsize, bool);

    impl BigCopy {
        fn digest(&self) -> String {
            digest(&self.0)
        }
    }

    impl Source for BigCopy {
        fn size(&self) -> BoxFuture<'_, Result<u64, FetchError>> {
            Box::pin(async move {
                if self.2 {
                    return Ok(1024);
                }
                Ok(read_published(&self.0, Verification::Sizes)?.total_size())
            })
        }

        fn fetch<'a>(
            &'a self,
            into: &'a Path,
            _meter: Arc<Meter>,
        ) -> BoxFuture<'a, Result<(), FetchError>> {
            Box::pin(async move {
                self.1.fetch_add(1, Ordering::Relaxed);
                std::fs::create_dir(into.join("criu"))?;
                for file in ["criu/pages-1.img", "manifest.json", "COMPLETE"] {
                    std::fs::copy(self.0.join(file), into.join(file))?;
                }
                Ok(())
            })
        }
    }
}
