//! The artifact store against a real S3 server (SeaweedFS on loopback, `make s3-build`): an
//! artifact published as the agent publishes it goes up and comes back byte for byte, and each
//! fault (the server stopped mid-upload and mid-download, a corrupted object, a wrong secret, a
//! missing bucket) gives a clear error and leaves nothing half-written to be used.

#![allow(clippy::unwrap_used, clippy::tests_outside_test_module)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use warmstart_agent::publish::Staging;
use warmstart_e2e::s3_server::S3Server;
use warmstart_objstore::{Progress, Store, StoreConfig, StoreError, place};
use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo};

const NS: &str = "team-a";
const HASH: &str = "0123456789abcdef";
/// The chunk size publication uses (8 MiB).
const CHUNK: usize = 8 << 20;

/// Bytes that differ in every chunk and from file to file.
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    let mut state = u64::from(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        out.extend_from_slice(&state.to_le_bytes());
    }
    out.truncate(len);
    out
}

/// Publishes an artifact for `HASH` under `root/NS` exactly as the agent does: `pages` as the
/// page image (several parts and chunks), small CRIU images, a log and an empty file.
fn publish_pages(root: &Path, pages: &[u8]) -> PathBuf {
    let out = root.join(NS).join(HASH);
    let staging = Staging::create(&out).unwrap();
    let criu = staging.path().join("criu");
    std::fs::create_dir(&criu).unwrap();
    std::fs::write(criu.join("pages-1.img"), pages).unwrap();
    std::fs::write(criu.join("inventory.img"), pattern(4096, 2)).unwrap();
    std::fs::write(criu.join("dump.log"), b"(00.000001) dump finished\n").unwrap();
    std::fs::write(criu.join("empty.img"), b"").unwrap();
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        identity_hash: HASH.into(),
        created_at: "2026-12-05T22:00:00Z".into(),
        source: SourceInfo::default(),
        criu: CriuInfo {
            version: "4.2.1".into(),
            kernel_version: "6.18.0".into(),
            ..Default::default()
        },
        mounts: vec![],
        cuda: None,
        assigned_gpus: None,
        timings: [("dump".to_owned(), 1.25)].into(),
        chunk_bytes: 0,
        files: vec![],
        digest: String::new(),
    };
    staging
        .publish(manifest, &warmstart_agent::progress::Meter::default())
        .unwrap();
    out
}

struct Setup {
    server: S3Server,
    store: Store,
    local: PathBuf,
    tmp: tempfile::TempDir,
}

fn setup(pages: usize) -> Setup {
    setup_pages(&pattern(pages, 1))
}

fn setup_pages(pages: &[u8]) -> Setup {
    let server = S3Server::start("artifacts").unwrap();
    let store = Store::new(server.store_config()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let local = publish_pages(&tmp.path().join("pvc"), pages);
    Setup {
        server,
        store,
        local,
        tmp,
    }
}

fn key(file: &str) -> String {
    format!("warm/{NS}/{HASH}/{file}")
}

/// Every file of two artifact directories, byte for byte.
fn assert_same_tree(a: &Path, b: &Path) {
    let manifest = warmstart_shared::artifact::read_manifest(a).unwrap();
    for name in manifest
        .files
        .iter()
        .map(|f| f.path.as_str())
        .chain(["manifest.json", "COMPLETE"])
    {
        assert!(
            std::fs::read(a.join(name)).unwrap() == std::fs::read(b.join(name)).unwrap(),
            "{name} differs"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_artifact_round_trips_byte_for_byte_through_multipart_uploads() {
    let s = setup(2 * CHUNK + 12345);
    let progress = Progress::new();
    let report = s.store.upload(&s.local, NS, HASH, &progress).await.unwrap();
    assert!(!report.already_present);
    assert_eq!(report.multipart_files, 1, "the page image goes up in parts");
    assert_eq!(progress.bytes(), report.manifest.total_size());
    assert!(s.store.pending_uploads().await.unwrap().is_empty());
    let mut keys: Vec<String> = s
        .store
        .objects()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    keys.sort();
    let mut expected: Vec<String> = report
        .manifest
        .files
        .iter()
        .map(|f| key(&f.path))
        .chain([key("COMPLETE"), key("manifest.json")])
        .collect();
    expected.sort();
    assert_eq!(keys, expected);

    let verified = s.store.verify(NS, HASH).await.unwrap();
    assert_eq!(verified.digest, report.manifest.digest);
    // A lost object, or one of another size, makes it incomplete.
    let inventory = std::fs::read(s.local.join("criu/inventory.img")).unwrap();
    s.server.delete_object(&key("criu/inventory.img")).unwrap();
    let err = s.store.verify(NS, HASH).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Incomplete { detail, .. } if detail == "criu/inventory.img is missing"),
        "{err}"
    );
    s.server
        .put_object(&key("criu/inventory.img"), &inventory[1..])
        .unwrap();
    let err = s.store.verify(NS, HASH).await.unwrap_err();
    assert!(
        matches!(&err, StoreError::Incomplete { detail, .. }
            if detail == "criu/inventory.img has 4095 bytes, the manifest says 4096"),
        "{err}"
    );
    s.server
        .put_object(&key("criu/inventory.img"), &inventory)
        .unwrap();
    s.store.verify(NS, HASH).await.unwrap();

    // A second upload of the same artifact sends nothing.
    let again = s
        .store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    assert!(again.already_present && again.bytes == 0);

    let cache = s.tmp.path().join("cache");
    std::fs::create_dir(&cache).unwrap();
    let staging = cache.join(".download");
    let progress = Progress::new();
    let manifest = s
        .store
        .download(NS, HASH, &staging, &progress)
        .await
        .unwrap();
    assert_eq!(manifest.digest, report.manifest.digest);
    assert_eq!(progress.bytes(), manifest.total_size());
    let final_dir = cache.join(HASH);
    place(&staging, &final_dir).unwrap();
    assert_same_tree(&s.local, &final_dir);
    // What came down is a published artifact by the same rules as one on the volume.
    warmstart_shared::artifact::read_published(
        &final_dir,
        warmstart_shared::artifact::Verification::Checksums,
    )
    .unwrap();

    // Deleted: the marker first, then the rest; a reader finds nothing.
    let deleted = s.store.delete(NS, HASH).await.unwrap();
    assert_eq!(deleted, expected.len() - 1, "every object but the marker");
    assert!(s.store.objects().await.unwrap().is_empty());
    let err = s.store.verify(NS, HASH).await.unwrap_err();
    assert!(matches!(err, StoreError::NotFound { .. }), "{err}");
}

#[test]
fn a_dropped_server_leaves_no_process_socket_or_directory() {
    let server = S3Server::start("artifacts").unwrap();
    let pid = nix::unistd::Pid::from_raw(i32::try_from(server.pid().unwrap()).unwrap());
    let dir = server.dir().to_path_buf();
    let sockets = server.socket_paths();
    assert!(sockets.iter().any(|s| s.exists()), "{sockets:?}");
    drop(server);
    // Reaped, so the PID names no process (not even a zombie).
    assert_eq!(
        nix::sys::signal::kill(pid, None),
        Err(nix::errno::Errno::ESRCH)
    );
    assert!(!dir.exists());
    assert!(sockets.iter().all(|s| !s.exists()), "{sockets:?}");
}

#[test]
fn the_server_refuses_a_body_whose_checksum_is_wrong() {
    let server = S3Server::start("artifacts").unwrap();
    // MD5("hello"), and one of another body.
    let right = "XUFAKrxLKna5cZ2REBfFkg==";
    let wrong = "1B2M2Y8AsgTpgAmY7PhCfg==";
    let (status, body) = server.put_with_md5("k", b"hello", right).unwrap();
    assert_eq!(status, 200, "{body}");
    let (status, body) = server.put_with_md5("k", b"hello", wrong).unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("BadDigest"), "{body}");
    // The same check on a part of a multipart upload.
    let (_, status, body) = server.part_with_md5("big", b"hello", right).unwrap();
    assert_eq!(status, 200, "{body}");
    let (_, status, body) = server.part_with_md5("big", b"hello", wrong).unwrap();
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("BadDigest"), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upload_cut_off_by_the_server_stopping_leaves_no_marker_and_a_retry_completes_it() {
    let mut s = setup(12 * CHUNK);
    let mut config = s.server.store_config();
    config.concurrency = 1;
    let store = Store::new(config).unwrap();
    let progress = Progress::new();
    let upload = {
        let (store, local, progress) = (store.clone(), s.local.clone(), progress.clone());
        tokio::spawn(async move { store.upload(&local, NS, HASH, &progress).await })
    };
    // Past the small files: into the page image.
    wait_for_progress(&progress, CHUNK as u64).await;
    s.server.stop();
    let err = upload.await.unwrap().unwrap_err();
    eprintln!("{err}");
    let text = err.to_string();
    assert!(
        matches!(err, StoreError::Transport { .. }) && text.contains("criu/pages-1.img"),
        "{text}"
    );
    assert!(text.contains("part"), "{text}");
    s.server.restart().unwrap();
    let keys: Vec<String> = store
        .objects()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert!(!keys.contains(&key("COMPLETE")), "{keys:?}");
    let err = store
        .download(NS, HASH, &s.tmp.path().join("dl"), &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(
            err,
            StoreError::Incomplete { .. } | StoreError::NotFound { .. }
        ),
        "{err}"
    );
    assert!(!s.tmp.path().join("dl").exists());
    // The upload that was cut off could not abort its multipart upload (the server was gone):
    // the next upload of the artifact does.
    let left = store.pending_uploads().await.unwrap();
    assert!(
        left.len() == 1 && left[0].key == key("criu/pages-1.img"),
        "{left:?}"
    );
    let report = store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    assert_eq!(report.multipart_files, 1);
    assert!(store.pending_uploads().await.unwrap().is_empty());
    store.verify(NS, HASH).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_upload_outlasts_a_server_restart_by_starting_again() {
    let mut s = setup(12 * CHUNK);
    let mut config = s.server.store_config();
    config.concurrency = 1;
    // Requests give up within a tenth of a second, before the server is back; the whole
    // upload is started again for over two minutes.
    config.retries = 1;
    config.retry_backoff = Duration::from_millis(100);
    config.upload_retries = 8;
    config.upload_retry_backoff = Duration::from_millis(500);
    let store = Store::new(config).unwrap();
    let progress = Progress::new();
    let upload = {
        let (store, local, progress) = (store.clone(), s.local.clone(), progress.clone());
        tokio::spawn(async move { store.upload(&local, NS, HASH, &progress).await })
    };
    wait_for_progress(&progress, CHUNK as u64).await;
    s.server.stop();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !upload.is_finished(),
        "the upload is waiting to start again"
    );
    s.server.restart().unwrap();
    let report = upload.await.unwrap().unwrap();
    assert_eq!(report.multipart_files, 1);
    assert!(
        progress.bytes() > report.manifest.total_size(),
        "part of it was sent twice"
    );
    assert!(store.pending_uploads().await.unwrap().is_empty());
    let staging = s.tmp.path().join(".download");
    store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap();
    assert_same_tree(&s.local, &staging);
}

async fn wait_for_progress(progress: &Progress, at_least: u64) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while progress.bytes() < at_least {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no progress in 60 s"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_download_cut_off_by_the_server_stopping_fails_and_leaves_nothing() {
    let mut s = setup(12 * CHUNK);
    s.store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    let mut config = s.server.store_config();
    config.concurrency = 1;
    let store = Store::new(config).unwrap();
    let staging = s.tmp.path().join(".download");
    let progress = Progress::new();
    let download = {
        let (store, staging, progress) = (store.clone(), staging.clone(), progress.clone());
        tokio::spawn(async move { store.download(NS, HASH, &staging, &progress).await })
    };
    // Past the small files: into the page image.
    wait_for_progress(&progress, CHUNK as u64).await;
    s.server.stop();
    let err = download.await.unwrap().unwrap_err();
    eprintln!("{err}");
    let total = 12 * CHUNK as u64;
    assert!(
        progress.bytes() < total,
        "the download finished before the stop"
    );
    assert!(
        matches!(err, StoreError::Transport { .. }) && err.to_string().contains("pages-1.img"),
        "{err}"
    );
    assert!(
        !staging.exists(),
        "a failed download leaves no staging directory"
    );
    // Once the server is back, the same download completes.
    s.server.restart().unwrap();
    store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap();
    assert_same_tree(&s.local, &staging);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_object_fails_the_download_naming_file_and_chunk() {
    let s = setup(3 * CHUNK);
    s.store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    let mut pages = std::fs::read(s.local.join("criu/pages-1.img")).unwrap();
    pages[CHUNK + 100] ^= 0xff;
    s.server
        .put_object(&key("criu/pages-1.img"), &pages)
        .unwrap();
    // Same size: the cheap check cannot see it.
    s.store.verify(NS, HASH).await.unwrap();
    let staging = s.tmp.path().join(".download");
    let err = s
        .store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::ChunkMismatch(bad)
            if bad.file == "criu/pages-1.img" && bad.chunk == 1 && bad.offset == CHUNK as u64),
        "{err}"
    );
    let text = err.to_string();
    assert!(
        text.contains("criu/pages-1.img") && text.contains("chunk 1"),
        "{text}"
    );
    assert!(!staging.exists(), "nothing of a failed download is left");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_secret_is_access_denied_naming_endpoint_and_bucket_never_the_secret() {
    let s = setup(4096);
    let mut config: StoreConfig = s.server.store_config();
    config.secret_access_key_file = s.server.wrong_secret_key_file();
    let store = Store::new(config).unwrap();
    let err = store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(err.is_access_denied(), "{err}");
    let text = format!("{err} {err:?}");
    assert!(
        text.contains(s.server.endpoint().as_str().trim_end_matches('/'))
            && text.contains("bucket artifacts")
            && text.contains("access denied"),
        "{text}"
    );
    assert!(
        !text.contains(s.server.secret()) && !text.contains("not-the-secret"),
        "{text}"
    );
    let err = store.verify(NS, HASH).await.unwrap_err();
    assert!(err.is_access_denied(), "{err}");
    assert!(
        s.store.objects().await.unwrap().is_empty(),
        "nothing was written"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missing_bucket_is_named() {
    let s = setup(4096);
    let mut config = s.server.store_config();
    config.bucket = "no-such-bucket".into();
    let store = Store::new(config).unwrap();
    let err = store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::NoSuchBucket { bucket, .. } if bucket == "no-such-bucket"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("\"no-such-bucket\" does not exist"),
        "{err}"
    );
    let err = store
        .download(NS, HASH, &s.tmp.path().join("dl"), &Progress::new())
        .await
        .unwrap_err();
    assert!(matches!(&err, StoreError::NoSuchBucket { .. }), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_artifact_without_its_marker_is_incomplete_and_stale_uploads_are_swept() {
    let s = setup(4096);
    s.store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    // What a reader sees while an upload is under way (or after one died): no marker.
    s.server.put_object(&key("COMPLETE"), b"").unwrap();
    let err = s.store.verify(NS, HASH).await.unwrap_err();
    assert!(
        matches!(err, StoreError::Manifest { .. }),
        "an empty marker: {err}"
    );
    let deleted = s.store.delete(NS, HASH).await.unwrap();
    assert!(deleted > 0);
    s.server
        .put_object(&key("criu/pages-1.img"), b"half")
        .unwrap();
    let err = s
        .store
        .download(NS, HASH, &s.tmp.path().join("dl"), &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::Incomplete { detail, .. } if detail.contains("no completion marker")),
        "{err}"
    );
    assert!(!s.tmp.path().join("dl").exists());

    // A multipart upload whose uploader died.
    let (_, status, body) = s
        .server
        .part_with_md5(
            &key("criu/pages-2.img"),
            b"hello",
            "XUFAKrxLKna5cZ2REBfFkg==",
        )
        .unwrap();
    assert_eq!(status, 200, "{body}");
    assert_eq!(s.store.pending_uploads().await.unwrap().len(), 1);
    assert_eq!(
        s.store
            .sweep_stale_uploads(Duration::from_secs(3600))
            .await
            .unwrap(),
        0,
        "a young upload is left alone"
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(
        s.store
            .sweep_stale_uploads(Duration::from_secs(1))
            .await
            .unwrap(),
        1
    );
    assert!(s.store.pending_uploads().await.unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_changed_after_publication_is_not_uploaded_and_its_multipart_upload_is_aborted() {
    let s = setup(3 * CHUNK);
    let path = s.local.join("criu/pages-1.img");
    // Root writes the read-only file: what a bad disk or a stray writer does.
    let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, b"changed", 2 * CHUNK as u64 + 5).unwrap();
    let err = s
        .store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::LocalChanged { path: p, detail }
            if *p == path && detail.contains("chunk 2")),
        "{err}"
    );
    assert!(
        s.store.pending_uploads().await.unwrap().is_empty(),
        "the failed multipart upload was aborted"
    );
    let keys: Vec<String> = s
        .store
        .objects()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert!(!keys.contains(&key("COMPLETE")), "{keys:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_manifest_with_huge_chunks_is_refused_before_anything_is_read() {
    let s = setup(4096);
    let mut manifest = warmstart_shared::artifact::read_manifest(&s.local).unwrap();
    manifest.chunk_bytes = 4 << 30;
    for file in &mut manifest.files {
        file.chunks.truncate(usize::from(file.size > 0));
    }
    manifest.seal();
    let marker = warmstart_shared::artifact::CompletionMarker::for_manifest(&manifest);
    s.server
        .put_object(&key("manifest.json"), &manifest.to_json().unwrap())
        .unwrap();
    s.server
        .put_object(&key("COMPLETE"), &serde_json::to_vec(&marker).unwrap())
        .unwrap();
    let staging = s.tmp.path().join("dl");
    let err = s
        .store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, StoreError::Incomplete { detail, .. } if detail.contains("larger than")),
        "{err}"
    );
    assert!(!staging.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_is_checked_against_the_ca_bundle() {
    let s = setup(4096);
    let mut config = s.server.store_config();
    config.endpoint = s.server.https_endpoint();
    config.ca_file = Some(s.server.ca_file());
    let store = Store::new(config.clone()).unwrap();
    store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    store.verify(NS, HASH).await.unwrap();

    // Without the bundle the system's CAs do not know the server's.
    config.ca_file = None;
    let err = Store::new(config.clone())
        .unwrap()
        .verify(NS, HASH)
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::Tls { detail, .. } if detail.contains("certificate")),
        "a certificate refused is not tried again: {err}"
    );

    // A bundle that holds no certificate is refused up front, naming the setting.
    config.ca_file = Some(s.server.access_key_file());
    let err = Store::new(config).unwrap_err();
    assert!(
        matches!(&err, StoreError::Client(m) if m.contains("--s3-ca-file")),
        "{err}"
    );
}

/// Rewrites the published artifact in `dir` as an older build published it: manifest format 1,
/// one whole-file SHA-256 per file.
fn make_format_1(dir: &Path) {
    let mut manifest = warmstart_shared::artifact::read_manifest(dir).unwrap();
    manifest.format_version = 1;
    manifest.chunk_bytes = 0;
    for file in &mut manifest.files {
        file.chunks.clear();
        file.sha256 = warmstart_shared::artifact::sha256_file(&dir.join(&file.path)).unwrap();
    }
    manifest.seal();
    let marker = warmstart_shared::artifact::CompletionMarker::for_manifest(&manifest);
    std::fs::write(dir.join("manifest.json"), manifest.to_json().unwrap()).unwrap();
    std::fs::write(dir.join("COMPLETE"), serde_json::to_vec(&marker).unwrap()).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_format_1_artifact_round_trips_and_a_corrupted_file_is_named() {
    let s = setup(2 * CHUNK + 7);
    make_format_1(&s.local);
    let report = s
        .store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    assert_eq!(report.manifest.format_version, 1);
    let staging = s.tmp.path().join(".download");
    s.store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap();
    assert_same_tree(&s.local, &staging);
    std::fs::remove_dir_all(&staging).unwrap();

    let mut pages = std::fs::read(s.local.join("criu/pages-1.img")).unwrap();
    pages[CHUNK + 3] ^= 1;
    s.server
        .put_object(&key("criu/pages-1.img"), &pages)
        .unwrap();
    let err = s
        .store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::Corrupt { detail, .. } if detail.contains("criu/pages-1.img")),
        "{err}"
    );
    assert!(!staging.exists());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_cache_fetches_from_the_bucket_once_and_never_keeps_a_corrupt_copy() {
    use warmstart_agent::cache::{Cache, CacheError};
    use warmstart_agent::store_source::StoreSource;
    let s = setup(3 * CHUNK);
    let uploaded = s
        .store
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    let digest = warmstart_shared::artifact::read_manifest(&s.local)
        .unwrap()
        .digest;
    let cache = Cache::open(&s.tmp.path().join("cache"), 1 << 30).unwrap();
    let source = StoreSource::new(s.store.clone(), NS, HASH);
    let held = cache.get(NS, HASH, &digest, &source).await.unwrap();
    assert!(held.fetched());
    assert_same_tree(&s.local, held.dir());
    drop(held);
    let again = cache.get(NS, HASH, &digest, &source).await.unwrap();
    assert!(!again.fetched(), "the second restore reads the node's disk");
    drop(again);
    let _ = uploaded;

    // Another artifact whose object was corrupted in the bucket is never cached.
    let other = "00000000000000ee";
    let local = s.tmp.path().join("other");
    copy_tree(&s.local, &local);
    let mut manifest = warmstart_shared::artifact::read_manifest(&local).unwrap();
    manifest.identity_hash = other.into();
    manifest.seal();
    std::fs::write(local.join("manifest.json"), manifest.to_json().unwrap()).unwrap();
    std::fs::write(
        local.join("COMPLETE"),
        serde_json::to_vec(&warmstart_shared::artifact::CompletionMarker::for_manifest(
            &manifest,
        ))
        .unwrap(),
    )
    .unwrap();
    s.store
        .upload(&local, NS, other, &Progress::new())
        .await
        .unwrap();
    let mut pages = std::fs::read(local.join("criu/pages-1.img")).unwrap();
    pages[2 * CHUNK + 7] ^= 0x01;
    s.server
        .put_object(&format!("warm/{NS}/{other}/criu/pages-1.img"), &pages)
        .unwrap();
    let err = cache
        .get(
            NS,
            other,
            &manifest.digest,
            &StoreSource::new(s.store.clone(), NS, other),
        )
        .await
        .unwrap_err();
    let text = warmstart_agent::report::error_chain(&err);
    assert!(matches!(err, CacheError::Fetch { .. }), "{text}");
    assert!(
        text.contains("criu/pages-1.img") && text.contains("chunk 2"),
        "{text}"
    );
    assert!(!cache.dir().join(NS).join(other).exists());
    assert_eq!(
        std::fs::read_dir(cache.dir().join(".staging"))
            .unwrap()
            .count(),
        0,
        "nothing of the download is left"
    );
}

/// Copies a directory tree (files and directories only), the files writable by their owner.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).unwrap();
            std::fs::set_permissions(&target, std::os::unix::fs::PermissionsExt::from_mode(0o644))
                .unwrap();
        }
    }
}

/// A page image of `chunks` chunks and a tail, the first two chunks random and the rest
/// zeros: compressed, it spans several parts and takes far fewer bytes.
fn half_zero_pages(chunks: usize) -> Vec<u8> {
    let mut pages = pattern(2 * CHUNK, 3);
    pages.resize(chunks * CHUNK + 12345, 0);
    pages
}

/// A store of the test server compressing uploads at `level` (0: not compressing).
fn store_at(server: &S3Server, level: i32) -> Store {
    let mut config = server.store_config();
    config.compression_level = level;
    Store::new(config).unwrap()
}

/// The stored objects a compressed upload at `level` makes of the local artifact's page image:
/// its frames (as zstd makes them, the same bytes each time) and the frame index.
fn stored_pages(local: &Path, level: i32) -> (Vec<Vec<u8>>, Vec<u8>) {
    use warmstart_objstore::frames::{FrameIndex, compress};
    let manifest = warmstart_shared::artifact::read_manifest(local).unwrap();
    let mut index = FrameIndex::new(&manifest, level);
    let mut pages = Vec::new();
    for file in &manifest.files {
        let bytes = std::fs::read(local.join(&file.path)).unwrap();
        let frames: Vec<Vec<u8>> = bytes
            .chunks(usize::try_from(manifest.chunk_bytes).unwrap())
            .map(|chunk| compress(chunk, level).unwrap())
            .collect();
        index.files.insert(
            file.path.clone(),
            frames.iter().map(|f| f.len() as u64).collect(),
        );
        if file.path == "criu/pages-1.img" {
            pages = frames;
        }
    }
    (pages, serde_json::to_vec(&index).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_compressed_artifact_round_trips_and_either_kind_is_read_whatever_the_readers_setting() {
    let s = setup_pages(&half_zero_pages(4));
    let compressing = store_at(&s.server, 3);
    let plain_reader = store_at(&s.server, 0);
    let progress = Progress::new();
    let report = compressing
        .upload(&s.local, NS, HASH, &progress)
        .await
        .unwrap();
    assert_eq!(report.compression_level, Some(3));
    assert_eq!(report.multipart_files, 1);
    assert!(
        report.stored_bytes < report.bytes * 2 / 3,
        "{} of {} bytes stored",
        report.stored_bytes,
        report.bytes
    );
    assert_eq!(progress.bytes(), report.manifest.total_size());
    assert_eq!(progress.stored_bytes(), report.stored_bytes);
    let objects = s.store.objects().await.unwrap();
    let size_of = |name: &str| objects.iter().find(|o| o.key == key(name)).map(|o| o.size);
    let (frames, index) = stored_pages(&s.local, 3);
    assert_eq!(
        size_of("criu/pages-1.img"),
        Some(frames.iter().map(|f| f.len() as u64).sum()),
        "the page image is stored as one frame per chunk"
    );
    assert_eq!(size_of("zstd-frames.json"), Some(index.len() as u64));
    // The manifest is the one published: checksums of the uncompressed chunks.
    plain_reader.verify(NS, HASH).await.unwrap();

    // A reader that does not compress reads it, every chunk checked.
    let staging = s.tmp.path().join("dl-plain-reader");
    let progress = Progress::new();
    plain_reader
        .download(NS, HASH, &staging, &progress)
        .await
        .unwrap();
    assert_same_tree(&s.local, &staging);
    assert_eq!(progress.bytes(), report.manifest.total_size());
    assert_eq!(progress.stored_bytes(), report.stored_bytes);

    // Stored plain (over a frame index an interrupted compressed upload left), it is read as
    // plain by a reader that compresses.
    s.store.delete(NS, HASH).await.unwrap();
    s.server
        .put_object(&key("zstd-frames.json"), &index)
        .unwrap();
    let report = plain_reader
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    assert_eq!(report.compression_level, None);
    assert_eq!(report.stored_bytes, report.bytes);
    let keys: Vec<String> = s
        .store
        .objects()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert!(!keys.contains(&key("zstd-frames.json")), "{keys:?}");
    let staging = s.tmp.path().join("dl-compressing-reader");
    let progress = Progress::new();
    store_at(&s.server, 19)
        .download(NS, HASH, &staging, &progress)
        .await
        .unwrap();
    assert_same_tree(&s.local, &staging);
    assert_eq!(progress.stored_bytes(), progress.bytes());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_corrupted_frame_fails_the_download_naming_file_and_chunk() {
    let s = setup_pages(&half_zero_pages(3));
    store_at(&s.server, 3)
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    let (frames, _) = stored_pages(&s.local, 3);
    let staging = s.tmp.path().join(".download");
    // A frame whose header is damaged does not decompress; one whose content is damaged
    // decompresses to a chunk the manifest does not know.
    for (damage, at) in [("header", 0), ("content", frames[1].len() / 2)] {
        let mut stored = frames.clone();
        stored[1][at] ^= 0xff;
        s.server
            .put_object(&key("criu/pages-1.img"), &stored.concat())
            .unwrap();
        s.store.verify(NS, HASH).await.unwrap();
        let err = s
            .store
            .download(NS, HASH, &staging, &Progress::new())
            .await
            .unwrap_err();
        eprintln!("{damage}: {err}");
        match (&err, damage) {
            (StoreError::BadFrame(bad), "header") => assert!(
                bad.file == "criu/pages-1.img"
                    && bad.chunk == 1
                    && bad.stored_offset == frames[0].len() as u64,
                "{err}"
            ),
            (StoreError::ChunkMismatch(bad), "content") => assert!(
                bad.file == "criu/pages-1.img" && bad.chunk == 1 && bad.offset == CHUNK as u64,
                "{err}"
            ),
            _ => panic!("{damage}: {err}"),
        }
        let text = err.to_string();
        assert!(
            text.contains("criu/pages-1.img") && text.contains("chunk 1"),
            "{text}"
        );
        assert!(!staging.exists(), "nothing of a failed download is left");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_truncated_frame_index_is_refused_before_anything_is_read() {
    let s = setup_pages(&half_zero_pages(3));
    store_at(&s.server, 3)
        .upload(&s.local, NS, HASH, &Progress::new())
        .await
        .unwrap();
    let (_, index) = stored_pages(&s.local, 3);
    s.server
        .put_object(&key("zstd-frames.json"), &index[..index.len() / 2])
        .unwrap();
    let staging = s.tmp.path().join(".download");
    let err = s
        .store
        .download(NS, HASH, &staging, &Progress::new())
        .await
        .unwrap_err();
    eprintln!("{err}");
    assert!(
        matches!(&err, StoreError::FrameIndex { detail, .. } if detail.starts_with("unreadable")),
        "{err}"
    );
    assert!(
        err.to_string().contains("frame index (zstd-frames.json)"),
        "{err}"
    );
    assert!(!staging.exists());
    let err = s.store.verify(NS, HASH).await.unwrap_err();
    assert!(matches!(&err, StoreError::FrameIndex { .. }), "{err}");
}
