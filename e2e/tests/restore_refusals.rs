//! Every restore refusal of the node engine, end to end (docs/architecture.md "Restore, step by step":
//! on any failure nothing is restored): the real `warmstart-agent restore` against a real runc
//! placeholder, with an artifact checkpointed from a real busybox workload.
//!
//! One artifact is checkpointed once per test process (lazily, [`shared`]) from a workload that
//! creates, modifies and deletes files and then prints ticks; it has a bind mount at `/data` and
//! a control directory at `/warmstart-control`. Each test copies it (`cp -a`) into its own
//! directory, damages the copy in one way (or the placeholder), starts its own placeholder and
//! asserts that the restore
//! - exits 1 with one `warmstart-agent: ` line on stderr naming the problem, and
//! - changed nothing: the placeholder's overlay upper directory is exactly as before, its log got
//!   no output, `runc ps` lists only its own process, its control directory stays empty (no
//!   `restore-complete`), and the restore log directory was never created.
//!
//! [`an_untampered_copy_restores`] runs the same harness without damage and sees every one of
//! those things change, so the "nothing changed" checks can tell.
//!
//! Needs root, runc, CRIU (`WARMSTART_CRIU`, default `/usr/local/bin/criu` when present) and the
//! agent binary built next to this test (`cargo build -p warmstart-agent`).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::collections::BTreeMap;
use std::fs;
use std::io::Read;
use std::os::unix::fs::{FileTypeExt, MetadataExt, symlink};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::OnceLock;
use std::thread;
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;
use sha2::{Digest, Sha256};
use warmstart_e2e::agent_cli;
use warmstart_e2e::fixture::{BindMount, Container, ContainerSpec, Image, ImageStore, Runtime};
use warmstart_shared::artifact::{CompletionMarker, CudaSection, GpuInfo, Manifest};
use warmstart_shared::names::{
    FILE_COMPLETE, FILE_MANIFEST, FILE_RESTORE_CLAIM, FILE_RESTORE_COMPLETE, FILE_RESTORE_FAILED,
    MOUNT_CONTROL,
};

/// Where the workload's bind mount is, in the container.
const DATA_MOUNT: &str = "/data";
/// How long one agent command may take before the test kills it (only that PID).
const AGENT_TIMEOUT: Duration = Duration::from_secs(120);
/// How long to keep watching the placeholder after a refusal for late output.
const SETTLE: Duration = Duration::from_millis(500);
/// The workload: changes its root filesystem, then prints a tick every 200 ms.
const WORKLOAD: &str = "echo created > /made-by-source; \
    mkdir -p /var/source-dir; echo nested > /var/source-dir/file; \
    echo modified >> /etc/passwd; rm /etc/hostname; \
    i=0; while true; do i=$((i+1)); echo tick $i; sleep 0.2; done";

/// What an agent command did.
#[derive(Debug)]
struct Outcome {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

/// Runs the agent with `args` (after `--runc-root` and `--criu`), bounded by [`AGENT_TIMEOUT`].
fn run_agent(rt: &Runtime, args: &[&std::ffi::OsStr]) -> Outcome {
    let mut command = agent_cli::command(rt).unwrap();
    command.args(args);
    let out = agent_cli::run(command, AGENT_TIMEOUT).unwrap();
    Outcome {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The artifact every test starts from, checkpointed once per test process.
struct Shared {
    rt: Runtime,
    /// Keeps the image store alive for the placeholders (its directory is under `base`).
    _store: ImageStore,
    image: Image,
    /// The workload's spec; placeholders are made from it.
    spec: ContainerSpec,
    /// The pristine artifact (never changed; tests copy it).
    artifact: PathBuf,
    /// This process's scratch directory.
    base: PathBuf,
}

/// The shared artifact, made by the first test that needs it (the others wait for it).
fn shared() -> &'static Shared {
    static SHARED: OnceLock<Shared> = OnceLock::new();
    SHARED.get_or_init(make_shared)
}

/// A statics' scratch directory per test process, under one parent; directories of processes
/// that are gone (an earlier run: statics are never dropped) are removed first.
fn scratch_base() -> PathBuf {
    let parent = std::env::temp_dir().join("warmstart-e2e-restore-refusals");
    fs::create_dir_all(&parent).unwrap();
    for entry in fs::read_dir(&parent).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        let alive = name
            .parse::<u32>()
            .is_ok_and(|pid| Path::new(&format!("/proc/{pid}")).exists());
        if !alive {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
    let base = parent.join(std::process::id().to_string());
    fs::create_dir_all(&base).unwrap();
    base
}

fn make_shared() -> Shared {
    let started = Instant::now();
    let rt = Runtime::default();
    // Containers of dead test processes first: their overlays may use a directory swept below.
    if let Err(e) = rt.cleanup_stale() {
        eprintln!("restore_refusals: {e}");
    }
    let base = scratch_base();
    let store = ImageStore::new(base.join("images")).unwrap();
    let image = store.busybox().unwrap();
    let data = base.join("data");
    let control = base.join("source-control");
    fs::create_dir_all(&data).unwrap();
    fs::create_dir_all(&control).unwrap();
    let spec = ContainerSpec::new("refusal-src", &image, ["sh", "-c", WORKLOAD])
        .with_mount(BindMount::new(&data, DATA_MOUNT))
        .with_mount(BindMount::new(&control, MOUNT_CONTROL));
    let source = Container::start_in(&rt, &spec).unwrap();
    source
        .wait_for_log("tick 3", Duration::from_secs(20))
        .unwrap();
    let artifact = base.join("artifact");
    let work = base.join("checkpoint-run");
    fs::create_dir_all(&work).unwrap();
    let o = run_agent(
        &rt,
        &[
            "checkpoint".as_ref(),
            "--stop".as_ref(),
            "--runc".as_ref(),
            source.id().as_ref(),
            "--output".as_ref(),
            artifact.as_os_str(),
        ],
    );
    assert!(
        o.status.success(),
        "checkpoint failed: {}\n{}",
        o.stdout,
        o.stderr
    );
    source.destroy().unwrap();
    eprintln!(
        "restore_refusals: shared artifact {} ready in {:.1}s: {:?}",
        artifact.display(),
        started.elapsed().as_secs_f64(),
        listing(&artifact).keys().collect::<Vec<_>>()
    );
    Shared {
        rt,
        _store: store,
        image,
        spec,
        artifact,
        base,
    }
}

/// One test's own directory, its copy of the artifact and its placeholder.
struct Case {
    /// Declared first: dropped (removed) before its directories are.
    placeholder: Container,
    dir: tempfile::TempDir,
    artifact: PathBuf,
    control: PathBuf,
    log_dir: PathBuf,
    before: Snapshot,
    /// Whether a refusal was answered in the control directory already.
    answered: std::cell::Cell<bool>,
}

/// What must not change when a restore is refused.
#[derive(Debug, PartialEq, Eq)]
struct Snapshot {
    upper: BTreeMap<String, String>,
    control: BTreeMap<String, String>,
    log: String,
}

impl Case {
    /// A copy of the shared artifact and a placeholder made from the workload's spec (with its
    /// own control directory); `adjust` may change the placeholder's spec first.
    fn new(name: &str, adjust: impl FnOnce(&mut ContainerSpec)) -> Self {
        let shared = shared();
        let dir = tempfile::Builder::new()
            .prefix(&format!("refusal-{name}-"))
            .tempdir_in(&shared.base)
            .unwrap();
        let artifact = dir.path().join("artifact");
        let cp = Command::new("cp")
            .arg("-a")
            .arg(&shared.artifact)
            .arg(&artifact)
            .status()
            .unwrap();
        assert!(cp.success(), "cp -a of the artifact failed");
        let control = dir.path().join("control");
        fs::create_dir(&control).unwrap();
        let mut spec = shared.spec.placeholder(&format!("refusal-{name}"));
        for mount in &mut spec.mounts {
            if mount.destination == MOUNT_CONTROL {
                mount.source.clone_from(&control);
            }
        }
        assert_eq!(spec.image, shared.image);
        adjust(&mut spec);
        let placeholder = Container::start_in(&shared.rt, &spec).unwrap();
        let log_dir = dir.path().join("restore-log");
        let mut case = Self {
            placeholder,
            dir,
            artifact,
            control,
            log_dir,
            before: Snapshot {
                upper: BTreeMap::new(),
                control: BTreeMap::new(),
                log: String::new(),
            },
            answered: std::cell::Cell::new(false),
        };
        case.before = case.snapshot();
        assert!(
            case.before.upper.keys().all(|k| !k.contains("source")),
            "the placeholder starts without the workload's files: {:?}",
            case.before.upper
        );
        case
    }

    fn snapshot(&self) -> Snapshot {
        Snapshot {
            upper: listing(&self.placeholder.upper_dir()),
            control: listing(&self.control),
            log: self.placeholder.read_log(),
        }
    }

    /// `restore --artifact <path> --into-runc <placeholder> --log-dir <ours>`.
    fn restore_from(&self, artifact: &Path) -> Outcome {
        run_agent(
            &shared().rt,
            &[
                "restore".as_ref(),
                "--artifact".as_ref(),
                artifact.as_os_str(),
                "--into-runc".as_ref(),
                self.placeholder.id().as_ref(),
                "--log-dir".as_ref(),
                self.log_dir.as_os_str(),
            ],
        )
    }

    fn restore(&self) -> Outcome {
        self.restore_from(&self.artifact)
    }

    /// Host PIDs `runc ps` lists for the placeholder (none once it stopped).
    /// The placeholder's processes that are not zombies.
    fn live_processes(&self) -> Vec<u32> {
        self.runc_ps()
            .into_iter()
            .filter(|pid| proc_state(i32::try_from(*pid).unwrap()).is_some_and(|s| s != 'Z'))
            .collect()
    }

    fn runc_ps(&self) -> Vec<u32> {
        let out = shared()
            .rt
            .runc_command()
            .args(["ps", "--format", "json", self.placeholder.id()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "runc ps: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        // A stopped container has `null` processes.
        serde_json::from_slice::<Option<Vec<u32>>>(&out.stdout)
            .unwrap()
            .unwrap_or_default()
    }

    /// Asserts a refusal: exit 1, one `warmstart-agent: ` error line containing every needle,
    /// and nothing changed in or around the placeholder.
    fn assert_refused(&self, o: &Outcome, needles: &[&str]) {
        assert_eq!(
            o.status.code(),
            Some(1),
            "expected a refusal (exit 1); stdout: {}\nstderr: {}",
            o.stdout,
            o.stderr
        );
        let errors: Vec<&str> = o
            .stderr
            .lines()
            .filter(|l| l.starts_with("warmstart-agent: "))
            .collect();
        assert_eq!(errors.len(), 1, "one error line; stderr: {}", o.stderr);
        eprintln!("refused: {}", errors[0]);
        for needle in needles {
            assert!(
                errors[0].contains(needle),
                "the error names {needle:?}: {}",
                errors[0]
            );
        }
        assert!(
            !o.stdout.contains("restored"),
            "nothing claims a restore: {}",
            o.stdout
        );
        // The refusal is answered in the control directory (the restore claim): the
        // placeholder is claimed by "restore" and `restore-failed` carries the same reason, so
        // a standby entrypoint cold starts instead of waiting.
        let claim: Value =
            serde_json::from_slice(&fs::read(self.control.join(FILE_RESTORE_CLAIM)).unwrap())
                .unwrap();
        assert_eq!(claim["by"], "restore", "{claim}");
        let failed: Value =
            serde_json::from_slice(&fs::read(self.control.join(FILE_RESTORE_FAILED)).unwrap())
                .unwrap();
        // Written once: a later refusal into the same placeholder leaves the first answer.
        if !self.answered.replace(true) {
            assert_eq!(
                failed["reason"].as_str(),
                errors[0].strip_prefix("warmstart-agent: "),
                "restore-failed names the refusal"
            );
        }
        thread::sleep(SETTLE);
        self.assert_unchanged();
    }

    /// Clears the control directory's answer to a refusal (as a new pod's empty control
    /// directory would be), so the same placeholder can take another restore.
    fn reset_control(&self) {
        for name in [FILE_RESTORE_CLAIM, FILE_RESTORE_FAILED] {
            fs::remove_file(self.control.join(name)).unwrap();
        }
        self.answered.set(false);
    }

    fn assert_unchanged(&self) {
        let after = self.snapshot();
        assert_eq!(
            after.upper, self.before.upper,
            "the placeholder's upper directory is unchanged"
        );
        let mut control = after.control.clone();
        control.remove(FILE_RESTORE_CLAIM);
        control.remove(FILE_RESTORE_FAILED);
        assert_eq!(
            control, self.before.control,
            "the control directory is unchanged (but for the answer to the refusal)"
        );
        assert!(!self.control.join(FILE_RESTORE_COMPLETE).exists());
        assert_eq!(
            after.log, self.before.log,
            "the placeholder's log got no output"
        );
        assert!(!after.log.contains("tick"), "{}", after.log);
        assert!(
            !self.log_dir.exists(),
            "the restore log directory {} was never created",
            self.log_dir.display()
        );
        let expected = if self.placeholder.state().unwrap() == "running" {
            vec![self.placeholder.pid()]
        } else {
            Vec::new()
        };
        assert_eq!(
            self.runc_ps(),
            expected,
            "runc ps lists only the placeholder's own process"
        );
    }
}

/// Every entry below `root` (relative path → type, mode, size and content digest or link
/// target); overlay whiteouts show as character devices 0:0.
fn listing(root: &Path) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let mut entries: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        entries.sort();
        for path in entries {
            let meta = fs::symlink_metadata(&path).unwrap();
            let rel = path
                .strip_prefix(root)
                .unwrap()
                .to_string_lossy()
                .into_owned();
            let kind = meta.file_type();
            let what = if kind.is_dir() {
                stack.push(path.clone());
                "dir".to_owned()
            } else if kind.is_symlink() {
                format!("link -> {}", fs::read_link(&path).unwrap().display())
            } else if kind.is_file() {
                let mut digest = Sha256::new();
                let mut content = Vec::new();
                fs::File::open(&path)
                    .unwrap()
                    .read_to_end(&mut content)
                    .unwrap();
                digest.update(&content);
                format!("file {} {}", meta.len(), hex::encode(digest.finalize()))
            } else if kind.is_char_device() {
                format!("char {:#x}", meta.rdev())
            } else {
                format!("other {:?}", kind)
            };
            out.insert(rel, format!("{what} mode {:o}", meta.mode()));
        }
    }
    out
}

/// The artifact's largest CRIU image (the pages, in practice), relative to the artifact.
fn largest_image(artifact: &Path) -> String {
    largest_image_where(artifact, |_| true)
}

/// The largest CRIU image whose file name `select` accepts.
fn largest_image_where(artifact: &Path, select: impl Fn(&str) -> bool) -> String {
    let mut images: Vec<(u64, String)> = fs::read_dir(artifact.join("criu"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.file_name().to_string_lossy().ends_with(".img"))
        .filter(|e| select(&e.file_name().to_string_lossy()))
        .map(|e| {
            (
                e.metadata().unwrap().len(),
                format!("criu/{}", e.file_name().to_string_lossy()),
            )
        })
        .collect();
    images.sort();
    let (size, name) = images.pop().expect("the artifact holds CRIU images");
    assert!(size > 0, "{name} is empty");
    name
}

fn read_manifest(artifact: &Path) -> Manifest {
    Manifest::from_json(&fs::read(artifact.join(FILE_MANIFEST)).unwrap()).unwrap()
}

/// Rewrites the manifest sealed (valid digest) and a completion marker for it.
fn write_sealed(artifact: &Path, mut manifest: Manifest) {
    manifest.seal();
    fs::write(artifact.join(FILE_MANIFEST), manifest.to_json().unwrap()).unwrap();
    fs::write(
        artifact.join(FILE_COMPLETE),
        serde_json::to_vec(&CompletionMarker::for_manifest(&manifest)).unwrap(),
    )
    .unwrap();
}

/// The positive control: the same harness, an undamaged copy: the restore happens, and every
/// "nothing changed" check of the refusals would have seen it.
#[test]
fn an_untampered_copy_restores() {
    let case = Case::new("control", |_| {});
    let o = case.restore();
    assert!(
        o.status.success(),
        "restore failed: {}\n{}",
        o.stdout,
        o.stderr
    );
    case.placeholder
        .wait_for_log("tick", Duration::from_secs(10))
        .unwrap();
    let after = case.snapshot();
    assert_ne!(after.upper, case.before.upper);
    assert!(
        after.upper.contains_key("made-by-source"),
        "{:?}",
        after.upper
    );
    assert!(
        case.control.join(FILE_RESTORE_COMPLETE).exists(),
        "restore-complete is written"
    );
    let ps = case.runc_ps();
    assert!(
        ps.len() > 1,
        "the restored tree runs in the placeholder: {ps:?}"
    );
    assert!(case.log_dir.exists());
}

/// CRIU opens its restore log as root, following links: a log directory planted as a link to
/// another directory is refused before anything in the placeholder changes, and nothing is
/// written where the link points.
#[test]
fn a_planted_log_directory_is_refused() {
    let case = Case::new("planted-log", |_| {});
    let elsewhere = case.dir.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    symlink(&elsewhere, &case.log_dir).unwrap();
    let o = case.restore();
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains(&format!(
            "log directory {} is unsafe",
            case.log_dir.display()
        )),
        "{}",
        o.stderr
    );
    assert_eq!(
        fs::read_dir(&elsewhere).unwrap().count(),
        0,
        "nothing was written through the link"
    );
    thread::sleep(SETTLE);
    let after = case.snapshot();
    assert_eq!(
        after.upper, case.before.upper,
        "the placeholder is unchanged"
    );
    assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
    assert!(case.control.join(FILE_RESTORE_FAILED).exists());
    assert_eq!(case.runc_ps(), vec![case.placeholder.pid()]);
}

/// Without `--log-dir`, CRIU's log goes into a new private directory under the temporary
/// directory, removed once the restore succeeded: nothing is left there.
#[test]
fn the_default_log_directory_is_private_and_removed() {
    let case = Case::new("default-log", |_| {});
    let tmp = case.dir.path().join("tmp");
    fs::create_dir(&tmp).unwrap();
    let mut command = agent_cli::command(&shared().rt).unwrap();
    command
        .env("TMPDIR", &tmp)
        .args([
            "restore",
            "--into-runc",
            case.placeholder.id(),
            "--artifact",
        ])
        .arg(&case.artifact);
    let out = agent_cli::run(command, AGENT_TIMEOUT).unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("CRIU log not kept"), "{stdout}");
    let left: Vec<_> = fs::read_dir(&tmp)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert!(left.is_empty(), "left in the temporary directory: {left:?}");
    case.placeholder
        .wait_for_log("tick", Duration::from_secs(10))
        .unwrap();
}

/// (1) A CRIU image's content differs (one byte flipped, same size): refused naming the file.
#[test]
fn a_changed_file_is_refused() {
    let case = Case::new("checksum", |_| {});
    // An image CRIU interprets: verified before anything is restored.
    let image = largest_image_where(&case.artifact, |name| !name.starts_with("pages-"));
    let path = case.artifact.join(&image);
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    let size = bytes.len();
    fs::write(&path, bytes).unwrap();
    assert_eq!(fs::metadata(&path).unwrap().len(), size as u64);
    let o = case.restore();
    case.assert_refused(&o, &["failed verification", &image, "sha256"]);

    // The refusal left the placeholder usable: the repaired artifact restores into it (once its
    // control directory no longer says the restore failed: before, it is refused as such).
    let mut bytes = fs::read(&path).unwrap();
    bytes[middle] ^= 0xff;
    fs::write(&path, bytes).unwrap();
    let o = case.restore();
    assert_eq!(o.status.code(), Some(1), "{}", o.stderr);
    assert!(o.stderr.contains("already failed"), "{}", o.stderr);
    case.reset_control();
    let o = case.restore();
    assert!(o.status.success(), "{}\n{}", o.stdout, o.stderr);
    case.placeholder
        .wait_for_log("tick", Duration::from_secs(10))
        .unwrap();
    assert!(case.control.join(FILE_RESTORE_COMPLETE).exists());
}

/// (1b) A page image changed by one byte. Page images are raw memory, hashed while CRIU
/// restores: the restored tree stays stopped until every checksum matched, so the mismatch
/// kills it before it ever ran, and the restore fails after its claim (`restore-failed`, no
/// `restore-complete`). The placeholder itself keeps running.
#[test]
fn a_changed_page_image_kills_the_restored_tree_before_it_runs() {
    let case = Case::new("pages", |_| {});
    let image = largest_image_where(&case.artifact, |name| name.starts_with("pages-"));
    let path = case.artifact.join(&image);
    let mut bytes = fs::read(&path).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x01;
    fs::write(&path, bytes).unwrap();
    let o = case.restore();
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
    for needle in [image.as_str(), "differs from the manifest in chunk"] {
        assert!(o.stderr.contains(needle), "{needle:?} not in {}", o.stderr);
    }
    let failed: Value =
        serde_json::from_slice(&fs::read(case.control.join(FILE_RESTORE_FAILED)).unwrap()).unwrap();
    assert!(
        failed["reason"].as_str().unwrap().contains(&image),
        "{failed}"
    );
    assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
    thread::sleep(SETTLE);
    assert_eq!(
        case.snapshot().log,
        case.before.log,
        "the restored tree never ran: no output reached the placeholder's log"
    );
    assert!(
        warmstart_agent::placeholder::restored_tree(i32::try_from(case.placeholder.pid()).unwrap())
            .is_empty(),
        "the restored tree is gone"
    );
    assert_eq!(case.placeholder.state().unwrap(), "running");
}

/// (1c) A file the manifest does not list, under a name CRIU looks for: CRIU would restore it
/// unverified. `inspect --verify` and the restore refuse the artifact naming it.
#[test]
fn an_unlisted_file_is_refused_by_inspect_and_restore() {
    let case = Case::new("unlisted", |_| {});
    let image = largest_image_where(&case.artifact, |name| !name.starts_with("pages-"));
    let extra = "criu/pages-999.img";
    fs::copy(case.artifact.join(&image), case.artifact.join(extra)).unwrap();
    let o = run_agent(
        &shared().rt,
        &[
            "inspect".as_ref(),
            "--verify".as_ref(),
            case.artifact.as_os_str(),
        ],
    );
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
    assert!(
        o.stderr.contains(extra) && o.stderr.contains("not listed in the manifest"),
        "{}",
        o.stderr
    );
    let o = case.restore();
    case.assert_refused(&o, &[extra, "not listed in the manifest"]);
}

/// (2) A CRIU image listed in the manifest is missing.
#[test]
fn a_missing_file_is_refused() {
    let case = Case::new("missing", |_| {});
    let image = largest_image(&case.artifact);
    fs::remove_file(case.artifact.join(&image)).unwrap();
    let o = case.restore();
    case.assert_refused(&o, &[&image, "is missing"]);
}

/// (3) The manifest was edited (a recorded value changed, digest and marker left as they were).
#[test]
fn an_edited_manifest_is_refused() {
    let case = Case::new("edited", |_| {});
    let path = case.artifact.join(FILE_MANIFEST);
    let text = fs::read_to_string(&path).unwrap();
    let manifest: Value = serde_json::from_str(&text).unwrap();
    let old = manifest["source"]["containerId"].as_str().unwrap();
    // Edited in place, as an editor would: one value changes, nothing moves.
    let edited = text.replacen(
        &format!("\"containerId\": \"{old}\""),
        &format!("\"containerId\": \"{old}-edited\""),
        1,
    );
    assert_ne!(edited, text);
    fs::write(&path, edited).unwrap();
    let o = case.restore();
    case.assert_refused(&o, &["is invalid", "manifest digest mismatch", "edited"]);
}

/// The manifest was edited and resealed, but the completion marker names the old manifest.
#[test]
fn a_marker_of_another_manifest_is_refused() {
    let case = Case::new("marker", |_| {});
    let marker = fs::read(case.artifact.join(FILE_COMPLETE)).unwrap();
    let mut manifest = read_manifest(&case.artifact);
    manifest.source.container_id.push_str("-resealed");
    write_sealed(&case.artifact, manifest);
    fs::write(case.artifact.join(FILE_COMPLETE), marker).unwrap();
    let o = case.restore();
    case.assert_refused(&o, &["completion marker names manifest"]);
}

/// (4) Unsafe artifact paths: the artifact reached through a symbolic link (the link itself, or
/// a linked parent directory), and a path with `..` (the CLI makes paths absolute but keeps it).
#[test]
fn unsafe_artifact_paths_are_refused() {
    let case = Case::new("unsafe", |_| {});
    let dir = case.dir.path();
    let link = dir.join("link-to-artifact");
    symlink(&case.artifact, &link).unwrap();
    let o = case.restore_from(&link);
    case.assert_refused(
        &o,
        &[
            "is unsafe",
            &format!("{} is a symbolic link", link.display()),
        ],
    );

    let linked_parent = dir.join("linked-parent");
    symlink(dir, &linked_parent).unwrap();
    let o = case.restore_from(&linked_parent.join("artifact"));
    case.assert_refused(
        &o,
        &[
            "is unsafe",
            &format!("{} is a symbolic link", linked_parent.display()),
        ],
    );

    fs::create_dir(dir.join("sub")).unwrap();
    let dotdot = dir.join("sub").join("..").join("artifact");
    let o = case.restore_from(&dotdot);
    case.assert_refused(&o, &["is unsafe", "'..'", &dotdot.display().to_string()]);

    // A relative path is made absolute from the agent's working directory: `..` stays.
    let relative = Path::new("..")
        .join(dir.file_name().unwrap())
        .join("artifact");
    let mut command = agent_cli::command(&shared().rt).unwrap();
    command
        .current_dir(dir.join("sub"))
        .args([
            "restore",
            "--into-runc",
            case.placeholder.id(),
            "--artifact",
        ])
        .arg(&relative)
        .arg("--log-dir")
        .arg(&case.log_dir);
    let out = command.output().unwrap();
    let o = Outcome {
        status: out.status,
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    };
    case.assert_refused(&o, &["is unsafe", "'..'"]);
}

/// (5) The placeholder lacks a bind mount the manifest lists as external.
#[test]
fn a_missing_mount_is_refused() {
    let case = Case::new("mount", |spec| {
        spec.mounts.retain(|m| m.destination != DATA_MOUNT);
    });
    let manifest = read_manifest(&case.artifact);
    assert!(
        manifest.mounts.iter().any(|m| m.destination == DATA_MOUNT),
        "the artifact needs {DATA_MOUNT}"
    );
    let o = case.restore();
    case.assert_refused(
        &o,
        &[
            "lacks mounts the checkpoint needs",
            DATA_MOUNT,
            case.placeholder.id(),
        ],
    );
}

/// (6) The artifact holds GPU state (a `cuda` section, manifest resealed and marker rewritten so
/// that only the GPU check can refuse) and the placeholder has no GPU.
#[test]
fn gpu_state_without_a_gpu_is_refused() {
    let case = Case::new("gpu", |_| {});
    let mut manifest = read_manifest(&case.artifact);
    manifest.cuda = Some(CudaSection {
        driver_version: "12.8".to_owned(),
        gpus: vec![GpuInfo {
            uuid: "GPU-00000000-1111-2222-3333-444444444444".to_owned(),
            model: "NVIDIA H200".to_owned(),
            memory_bytes: 150_754_820_096,
        }],
        pids: vec![1],
        method: "driver-api".to_owned(),
        processes: Vec::new(),
    });
    write_sealed(&case.artifact, manifest);
    // The artifact itself is valid: only the placeholder can be refused.
    let inspect = run_agent(
        &shared().rt,
        &[
            "inspect".as_ref(),
            case.artifact.as_os_str(),
            "--verify".as_ref(),
        ],
    );
    assert!(
        inspect.status.success(),
        "inspect --verify: {}",
        inspect.stderr
    );
    assert!(
        inspect.stdout.contains("gpu state      yes"),
        "{}",
        inspect.stdout
    );
    let o = case.restore();
    case.assert_refused(
        &o,
        &[
            "holds GPU state (1 GPU(s))",
            "has no GPU",
            "/dev/nvidiactl",
            case.placeholder.id(),
        ],
    );
}

/// (7) The placeholder container is not running (killed, runc says `stopped`).
#[test]
fn a_stopped_placeholder_is_refused() {
    let case = Case::new("stopped", |_| {});
    let kill = shared()
        .rt
        .runc_command()
        .args(["kill", case.placeholder.id(), "KILL"])
        .status()
        .unwrap();
    assert!(kill.success());
    case.placeholder
        .wait_for_state("stopped", Duration::from_secs(10))
        .unwrap();
    let o = case.restore();
    case.assert_refused(&o, &["is not running", case.placeholder.id()]);
    assert_eq!(case.placeholder.state().unwrap(), "stopped");
    assert_eq!(case.runc_ps(), Vec::<u32>::new(), "no process runs in it");
}

/// (8) No completion marker: not a complete artifact.
#[test]
fn an_artifact_without_its_marker_is_refused() {
    let case = Case::new("incomplete", |_| {});
    fs::remove_file(case.artifact.join(FILE_COMPLETE)).unwrap();
    let o = case.restore();
    case.assert_refused(&o, &["is not a complete artifact", FILE_COMPLETE]);
}

/// Host PIDs and command lines of every live descendant of `root`.
fn descendants(root: u32) -> Vec<(u32, String)> {
    let stats: Vec<(u32, u32)> = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let rest = &stat[stat.rfind(')')? + 2..];
            let mut fields = rest.split(' ');
            let state = fields.next()?;
            let ppid = fields.next()?.parse().ok()?;
            (state != "Z").then_some((pid, ppid))
        })
        .collect();
    let mut found = Vec::new();
    let mut parents = vec![root];
    while let Some(parent) = parents.pop() {
        for &(pid, _) in stats.iter().filter(|(_, p)| *p == parent) {
            parents.push(pid);
            let cmdline = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            found.push((pid, cmdline));
        }
    }
    found
}

/// (Issue: one restore per placeholder) `restore` is SIGKILLed at two points: once its restore
/// helper runs, and once CRIU runs. The helper and CRIU die with it, and the next `restore`
/// into the same placeholder does not restore again: it reports the dead agent's claim and
/// what it left (a restored tree, or nothing, in which case `restore-failed` is written so a
/// standby entrypoint can cold start). The placeholder never holds two restored trees.
#[test]
fn a_restore_whose_agent_died_is_recognised_not_repeated() {
    for (name, kill_when) in [("helper", "restore-helper"), ("criu", "swrk")] {
        let case = Case::new(&format!("killed-at-{name}"), |_| {});
        let rt = &shared().rt;
        let mut child = agent_cli::command(rt)
            .unwrap()
            .arg("restore")
            .arg("--artifact")
            .arg(&case.artifact)
            .arg("--into-runc")
            .arg(case.placeholder.id())
            .arg("--log-dir")
            .arg(&case.log_dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let agent_pid = child.id();
        let started = Instant::now();
        let family = loop {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("the restore ended ({status}) before its {kill_when} was seen");
            }
            assert!(
                started.elapsed() < AGENT_TIMEOUT,
                "no {kill_when} after {AGENT_TIMEOUT:?}"
            );
            let family = descendants(agent_pid);
            if family.iter().any(|(_, cmd)| cmd.contains(kill_when)) {
                break family;
            }
            thread::sleep(Duration::from_millis(1));
        };
        kill(
            Pid::from_raw(i32::try_from(agent_pid).unwrap()),
            Signal::SIGKILL,
        )
        .unwrap();
        child.wait().unwrap();
        let killed = Instant::now();
        // The helper and CRIU die with the agent.
        let restorers: Vec<u32> = family
            .iter()
            .filter(|(_, cmd)| cmd.contains("restore-helper") || cmd.contains("swrk"))
            .map(|(pid, _)| *pid)
            .collect();
        let alive = |pid: &u32| {
            fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| !stat.contains(") Z "))
        };
        while restorers.iter().any(alive) {
            assert!(
                killed.elapsed() < Duration::from_secs(5),
                "the agent's restore processes outlived it: {family:?}"
            );
            thread::sleep(Duration::from_millis(10));
        }
        let claim: Value =
            serde_json::from_slice(&fs::read(case.control.join(FILE_RESTORE_CLAIM)).unwrap())
                .unwrap();
        assert_eq!(claim["by"], "restore");
        assert_eq!(claim["pid"], agent_pid);
        // Processes the helper killed can linger as zombies until the placeholder's init reaps
        // them (a standby init need not reap before it is told the outcome): dead, so not
        // counted.
        let before = case.live_processes();
        eprintln!(
            "restore_refusals: agent killed at its {kill_when}; the placeholder holds {before:?}"
        );

        let o = case.restore();
        assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
        assert!(
            o.stderr
                .contains(&format!("claimed by agent pid {agent_pid}"))
                && o.stderr.contains("ended with that agent, unfinished"),
            "{}",
            o.stderr
        );
        thread::sleep(SETTLE);
        let after = case.live_processes();
        // Only the placeholder's own process is left: nothing restored again, and a tree the
        // dead agent left (it never got restore-complete; it may even be stopped, its memory
        // unverified) is killed, never left half-restored.
        assert_eq!(after.len(), 1, "{:?}", describe(&after));
        assert!(before.contains(&after[0]), "{before:?} {after:?}");
        if before.len() == 1 {
            assert!(o.stderr.contains("nothing was restored"), "{}", o.stderr);
        } else {
            assert!(o.stderr.contains("was killed"), "{}", o.stderr);
        }
        assert!(case.control.join(FILE_RESTORE_FAILED).is_file());
        assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
        // A third attempt is refused too, and changes nothing.
        let o = case.restore();
        assert_eq!(o.status.code(), Some(1), "{}", o.stderr);
        assert_eq!(case.live_processes(), after);
    }
}

/// Each process's PID, state, parent, PID namespace and command line, for failure messages.
fn describe(pids: &[u32]) -> Vec<String> {
    pids.iter()
        .map(|pid| {
            let stat = fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let after = stat.rfind(')').map_or("", |i| &stat[i + 1..]);
            let cmd = fs::read(format!("/proc/{pid}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).replace('\0', " "))
                .unwrap_or_default();
            let ns = fs::read_link(format!("/proc/{pid}/ns/pid")).unwrap_or_default();
            format!("{pid}:{}: {} {}", after.trim(), ns.display(), cmd.trim())
        })
        .collect()
}

/// The state letter of `/proc/<pid>/stat` (`T` stopped, `Z` zombie…), `None` once it is gone.
fn proc_state(pid: i32) -> Option<char> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.trim_start().chars().next()
}

/// (Issue: verification overlapped with restore) `restore` dies while the tree CRIU restored
/// is still stopped, waiting for the page images' checksums: the agent is frozen once its
/// restore helper runs, so CRIU finishes and leaves the tree stopped, then SIGKILLed. The tree
/// is never resumed: the next `restore` into the placeholder kills it, writes `restore-failed`
/// and restores nothing; the workload never printed a line in the placeholder.
#[test]
fn a_tree_left_stopped_by_a_dead_agent_is_killed_never_resumed() {
    let case = Case::new("killed-while-stopped", |_| {});
    let placeholder = i32::try_from(case.placeholder.pid()).unwrap();
    let rt = &shared().rt;
    let mut child = agent_cli::command(rt)
        .unwrap()
        .arg("restore")
        .arg("--artifact")
        .arg(&case.artifact)
        .arg("--into-runc")
        .arg(case.placeholder.id())
        .arg("--log-dir")
        .arg(&case.log_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let agent = Pid::from_raw(i32::try_from(child.id()).unwrap());
    let started = Instant::now();
    let helper = loop {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the restore ended before its helper was seen"
        );
        assert!(
            started.elapsed() < AGENT_TIMEOUT,
            "no CRIU under a restore helper"
        );
        // Once CRIU runs, the helper has its plan: nothing more is asked of the agent until
        // the helper answers.
        let family = descendants(child.id());
        if family.iter().any(|(_, cmd)| cmd.contains("swrk"))
            && let Some((pid, _)) = family
                .iter()
                .find(|(_, cmd)| cmd.contains("restore-helper"))
        {
            break i32::try_from(*pid).unwrap();
        }
        thread::sleep(Duration::from_millis(1));
    };
    kill(agent, Signal::SIGSTOP).unwrap();
    // CRIU finishes, the helper answers into its pipe and exits; the frozen agent cannot
    // resume the tree.
    let tree = loop {
        assert!(
            started.elapsed() < AGENT_TIMEOUT,
            "no stopped restored tree (helper state {:?})",
            proc_state(helper)
        );
        let tree = warmstart_agent::placeholder::restored_tree(placeholder);
        let helper_done = matches!(proc_state(helper), None | Some('Z'));
        if helper_done && !tree.is_empty() && tree.iter().all(|pid| proc_state(*pid) == Some('T')) {
            break tree;
        }
        thread::sleep(Duration::from_millis(10));
    };
    kill(agent, Signal::SIGKILL).unwrap();
    child.wait().unwrap();
    thread::sleep(SETTLE);
    assert!(
        tree.iter().all(|pid| proc_state(*pid) == Some('T')),
        "nothing resumed the tree once its agent died"
    );

    let o = case.restore();
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
    for needle in [
        format!("claimed by agent pid {agent}"),
        "ended with that agent, unfinished".to_owned(),
        "was killed".to_owned(),
    ] {
        assert!(o.stderr.contains(&needle), "{needle:?} not in {}", o.stderr);
    }
    assert!(
        warmstart_agent::placeholder::restored_tree(placeholder).is_empty(),
        "the stopped tree is gone"
    );
    assert!(
        tree.iter()
            .all(|pid| matches!(proc_state(*pid), None | Some('Z'))),
        "the tree's processes ended"
    );
    assert!(case.control.join(FILE_RESTORE_FAILED).is_file());
    assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
    thread::sleep(SETTLE);
    assert_eq!(
        case.snapshot().log,
        case.before.log,
        "the restored workload never ran: no tick reached the placeholder's log"
    );
    assert_eq!(case.placeholder.state().unwrap(), "running");
}

/// A stand-in for `criu swrk` whose restore never finishes, as CRIU's does on a broken artifact
/// whose restorer spins: it leaves a spinning child behind (CRIU's restorer tasks are children
/// CRIU leaves in the placeholder), writes 100 MiB into the restore log `log` and then spins
/// itself. `token` marks the command lines of the spinning processes.
fn spinning_criu(dir: &Path, log: &Path, token: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = dir.join("spinning-criu");
    fs::write(
        &path,
        format!(
            "#!/bin/sh\n\
             sh -c 'while :; do :; done # {token}' &\n\
             head -c 104857600 /dev/zero > '{}'\n\
             exec sh -c 'while :; do :; done # {token}'\n",
            log.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&path, fs::Permissions::from_mode(0o755)).unwrap();
    path
}

/// Live (not zombie) processes whose command line holds `token`.
fn processes_with(token: &str) -> Vec<u32> {
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(token))
                && proc_state(i32::try_from(*pid).unwrap()).is_some_and(|s| s != 'Z')
        })
        .collect()
}

/// Kills, on drop, every process still carrying the token (a failed test leaves no spinner).
struct Spinners(String);

impl Drop for Spinners {
    fn drop(&mut self) {
        for pid in processes_with(&self.0) {
            let _ = kill(Pid::from_raw(i32::try_from(pid).unwrap()), Signal::SIGKILL);
        }
    }
}

/// `warmstart-agent --runc-root <root> --criu <criu> <args>`, standard input closed.
fn agent_with_criu(criu: &Path, args: &[&std::ffi::OsStr]) -> Command {
    let mut command = Command::new(warmstart_e2e::binaries::agent().unwrap());
    command
        .arg("--runc-root")
        .arg(shared().rt.runc_root())
        .arg("--criu")
        .arg(criu)
        .args(args)
        .stdin(Stdio::null());
    command
}

/// (Issue: every CRIU call has a deadline, CRIU logs are capped) A restore whose CRIU never
/// finishes, spinning and writing its log, is killed at its deadline: the restore fails within
/// seconds naming the deadline and the log, the log stopped at its cap, and no process CRIU
/// started is left running; the placeholder holds only its own process.
#[test]
fn a_restore_that_never_finishes_is_killed_at_its_deadline_with_its_log_capped() {
    let case = Case::new("deadline", |_| {});
    let token = format!("warmstart-spin-deadline-{}", std::process::id());
    let _spinners = Spinners(token.clone());
    let log = case.log_dir.join("restore.log");
    let criu = spinning_criu(case.dir.path(), &log, &token);
    let started = Instant::now();
    let command = agent_with_criu(
        &criu,
        &[
            "--criu-deadline-seconds".as_ref(),
            "3".as_ref(),
            "--criu-deadline-seconds-per-gib".as_ref(),
            "0".as_ref(),
            "--criu-log-limit-mib".as_ref(),
            "1".as_ref(),
            "restore".as_ref(),
            "--artifact".as_ref(),
            case.artifact.as_os_str(),
            "--into-runc".as_ref(),
            case.placeholder.id().as_ref(),
            "--log-dir".as_ref(),
            case.log_dir.as_os_str(),
        ],
    );
    let out = agent_cli::run(command, AGENT_TIMEOUT).unwrap();
    let took = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        took < Duration::from_secs(30),
        "the restore ended at its deadline, not {took:?} later"
    );
    for needle in [
        "did not finish within its deadline of 3s".to_owned(),
        log.display().to_string(),
    ] {
        assert!(stderr.contains(&needle), "{needle:?} not in {stderr}");
    }
    let size = fs::metadata(&log).unwrap().len();
    assert!(
        size <= 1 << 20,
        "the restore log is capped at 1 MiB: {size} bytes"
    );
    let deadline = Instant::now() + Duration::from_secs(5);
    while !processes_with(&token).is_empty() {
        assert!(
            Instant::now() < deadline,
            "CRIU's processes outlived the deadline: {:?}",
            processes_with(&token)
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        case.runc_ps().len(),
        1,
        "only the placeholder's own process"
    );
    assert!(case.control.join(FILE_RESTORE_FAILED).is_file());
    assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
}

/// (Issue: nothing outlives the agent) `restore` is SIGKILLed while its CRIU spins with a child
/// left in the placeholder (as CRIU's restorer tasks are): the restore helper, CRIU and that
/// child are all gone within seconds, and the placeholder holds only its own process.
#[test]
fn an_agent_killed_mid_restore_leaves_no_criu_restorer_or_helper_running() {
    let case = Case::new("agent-killed-spinning", |_| {});
    let token = format!("warmstart-spin-killed-{}", std::process::id());
    let _spinners = Spinners(token.clone());
    let criu = spinning_criu(case.dir.path(), &case.log_dir.join("restore.log"), &token);
    let mut child = agent_with_criu(
        &criu,
        &[
            "restore".as_ref(),
            "--artifact".as_ref(),
            case.artifact.as_os_str(),
            "--into-runc".as_ref(),
            case.placeholder.id().as_ref(),
            "--log-dir".as_ref(),
            case.log_dir.as_os_str(),
        ],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let agent_pid = child.id();
    let started = Instant::now();
    // Both spinners run: the one CRIU left behind and CRIU itself.
    while processes_with(&token).len() < 2 {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the restore ended ({status}) before its CRIU spun");
        }
        assert!(started.elapsed() < AGENT_TIMEOUT, "no spinning CRIU");
        thread::sleep(Duration::from_millis(5));
    }
    let family = descendants(agent_pid);
    kill(
        Pid::from_raw(i32::try_from(agent_pid).unwrap()),
        Signal::SIGKILL,
    )
    .unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    let alive = |pid: &u32| proc_state(i32::try_from(*pid).unwrap()).is_some_and(|s| s != 'Z');
    loop {
        let left: Vec<&(u32, String)> = family.iter().filter(|(pid, _)| alive(pid)).collect();
        let spinning = processes_with(&token);
        if left.is_empty() && spinning.is_empty() {
            break;
        }
        assert!(
            killed.elapsed() < Duration::from_secs(5),
            "outlived the agent: {left:?}, spinning {spinning:?}"
        );
        thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        case.runc_ps().len(),
        1,
        "only the placeholder's own process"
    );
}

/// (Issue: check before CRIU runs what each page image must hold) A page image one page short,
/// the manifest re-sealed to match it: a consistent artifact, but not what its pagemap says
/// CRIU reads from it (CRIU would misread it; its restorer can spin on that). Refused before
/// anything is restored, naming the file and both sizes.
#[test]
fn a_page_image_shorter_than_its_pagemap_is_refused_before_criu_runs() {
    let case = Case::new("short-pages", |_| {});
    let image = largest_image_where(&case.artifact, |name| name.starts_with("pages-"));
    let path = case.artifact.join(&image);
    let bytes = fs::read(&path).unwrap();
    let short = bytes.len() - 4096;
    fs::write(&path, &bytes[..short]).unwrap();
    let mut manifest = read_manifest(&case.artifact);
    let short = u64::try_from(short).unwrap();
    let chunks = warmstart_shared::filehash::chunk_digests(
        &[(path.clone(), short)],
        manifest.chunk_bytes,
        1,
        &|_| {},
    )
    .unwrap();
    let entry = manifest.files.iter_mut().find(|f| f.path == image).unwrap();
    entry.size = short;
    entry.chunks = chunks.into_iter().next().unwrap();
    write_sealed(&case.artifact, manifest);
    let o = case.restore();
    case.assert_refused(
        &o,
        &[&image, "its pagemap needs", &format!("holds {short} bytes")],
    );
}

/// The control directory is the workload's: what it plants there is read as hostile. A
/// `restore-failed` linked to a root-only file, a FIFO in place of `restore-failed` or
/// `restore-claim`: each refused promptly, naming the file and what it is, the linked file's
/// content never shown, nothing restored.
#[test]
fn a_hostile_control_directory_is_refused_unread() {
    let case = Case::new("hostile-control", |_| {});
    let secret = case.dir.path().join("secret");
    fs::write(&secret, "root-only-secret-4711").unwrap();
    let claim = case.control.join(FILE_RESTORE_CLAIM);
    let failed = case.control.join(FILE_RESTORE_FAILED);
    // A claim by an agent long gone, answered by a link.
    fs::write(
        &claim,
        br#"{"by":"restore","pid":1,"at":"2001-01-01T00:00:00Z"}"#,
    )
    .unwrap();
    symlink(&secret, &failed).unwrap();
    let fifo = |path: &Path| {
        nix::unistd::mkfifo(path, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
    };
    let refused = |needle: &str| {
        let started = Instant::now();
        let o = case.restore();
        assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "refused promptly, not blocked"
        );
        assert!(o.stderr.contains(needle), "{needle:?} not in {}", o.stderr);
        assert!(!o.stderr.contains("4711"), "{}", o.stderr);
        assert_eq!(case.runc_ps(), vec![case.placeholder.pid()]);
        assert!(!case.control.join(FILE_RESTORE_COMPLETE).exists());
    };
    refused("restore-failed is a symbolic link");
    fs::remove_file(&failed).unwrap();
    fifo(&failed);
    refused("restore-failed is a FIFO");
    fs::remove_file(&failed).unwrap();
    fs::remove_file(&claim).unwrap();
    fifo(&claim);
    refused("restore-claim is a FIFO");
    assert_eq!(case.placeholder.state().unwrap(), "running");
}

/// `restore-complete` cannot be written (the workload made it a directory): the restored tree
/// is killed rather than left serving while the pod is told the restore failed; the error
/// names the file and why, and `restore-failed` says so.
#[test]
fn a_restore_that_cannot_write_restore_complete_kills_what_it_restored() {
    let case = Case::new("unannounced", |_| {});
    fs::create_dir_all(case.control.join(FILE_RESTORE_COMPLETE).join("inside")).unwrap();
    let o = case.restore();
    assert_eq!(o.status.code(), Some(1), "{}\n{}", o.stdout, o.stderr);
    for needle in ["restore-complete", "Is a directory", "was killed"] {
        assert!(o.stderr.contains(needle), "{needle:?} not in {}", o.stderr);
    }
    assert_eq!(
        case.runc_ps(),
        vec![case.placeholder.pid()],
        "only the placeholder's own process is left"
    );
    let failed: Value =
        serde_json::from_slice(&fs::read(case.control.join(FILE_RESTORE_FAILED)).unwrap()).unwrap();
    assert!(
        failed["reason"]
            .as_str()
            .is_some_and(|r| r.contains("restore-complete") && r.contains("was killed")),
        "{failed}"
    );
    let log = case.snapshot().log;
    thread::sleep(SETTLE);
    assert_eq!(
        case.snapshot().log,
        log,
        "no restored process prints anymore"
    );
    assert_eq!(case.placeholder.state().unwrap(), "running");
}
