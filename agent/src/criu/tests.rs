//! Tests against the real CRIU (`criu` in `PATH`, 4.x) with real processes; they need root,
//! as CI has (`make setup` installs CRIU). They run one at a time: they start and kill process
//! trees, and a restore needs the dumped PID to stay free.

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::signal::{Signal, kill, killpg};
use nix::sys::stat::fstat;
use nix::sys::wait::waitpid;
use nix::unistd::{Pid, pipe2};

use super::*;

/// Serialises the tests that run CRIU or start process trees.
static CRIU_LOCK: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    CRIU_LOCK.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A counter loop in one process (perl, so no `sleep` child whose PID would also have to be
/// free on restore): writes 1, 2, 3, ... into `file` (atomically) and to stdout, every 50 ms.
const COUNTER: &str = r#"
$| = 1;
my $file = shift;
my $i = 0;
while (1) {
    $i++;
    open(my $h, '>', "$file.tmp") or die "open: $!";
    print $h $i;
    close($h);
    rename("$file.tmp", $file) or die "rename: $!";
    print "$i\n";
    select(undef, undef, undef, 0.05);
}
"#;

/// A process tree this test started: killed (whole process group) and reaped on drop, also
/// when the test fails. After a restore with `rst_sibling` the restored root is our child too.
struct Tree {
    pid: Pid,
    /// The original child, until it is reaped.
    child: Option<Child>,
    /// Whether `pid` (restored) is our child that still needs reaping.
    restored: bool,
}

impl Tree {
    /// Starts the counter in its own session (CRIU refuses a tree whose session leader is
    /// outside it unless `shell_job`), stdin from /dev/null, stdout as given.
    fn counter(file: &Path, stdout: Stdio) -> Self {
        let child = Command::new("setsid")
            .args(["perl", "-e", COUNTER])
            .arg(file)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::null())
            .spawn()
            .expect("start the counter");
        let pid = Pid::from_raw(i32::try_from(child.id()).expect("pid fits i32"));
        let tree = Self {
            pid,
            child: Some(child),
            restored: false,
        };
        // setsid execs in place (we are not a group leader's parent of it), so the PID is the
        // perl process once it runs; wait for that and for the first count.
        wait_for(
            || read_counter(file).is_some_and(|n| n >= 3),
            "the counter to start",
        );
        let stat = fs::read_to_string(format!("/proc/{pid}/stat")).expect("read stat");
        let fields: Vec<&str> = stat
            .rsplit_once(')')
            .expect("stat")
            .1
            .split_whitespace()
            .collect();
        assert_eq!(
            fields[3],
            pid.to_string(),
            "counter is not its own session leader"
        );
        tree
    }

    /// Reaps the original process after CRIU killed it, freeing its PID for the restore.
    fn reap_original(&mut self) {
        let mut child = self.child.take().expect("original child");
        let status = child.wait().expect("reap the dumped counter");
        assert!(
            !status.success(),
            "the dumped counter exited by itself: {status}"
        );
    }
}

impl Drop for Tree {
    fn drop(&mut self) {
        // Only our own tree: its process group is its PID (own session).
        let _ = killpg(self.pid, Signal::SIGKILL);
        let _ = kill(self.pid, Signal::SIGKILL);
        if let Some(mut child) = self.child.take() {
            let _ = child.wait();
        }
        if self.restored {
            let _ = waitpid(self.pid, None);
        }
    }
}

fn read_counter(file: &Path) -> Option<u64> {
    fs::read_to_string(file).ok()?.trim().parse().ok()
}

fn wait_for(mut condition: impl FnMut() -> bool, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !condition() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn is_alive(pid: Pid) -> bool {
    // A zombie still answers kill(0); read its state to tell.
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next().map(|s| s != "Z"))
        })
        .unwrap_or(false)
}

fn images_dir(tmp: &tempfile::TempDir) -> PathBuf {
    let dir = tmp.path().join("images");
    fs::create_dir(&dir).expect("create images dir");
    dir
}

/// A PID with no process behind it.
fn unused_pid() -> Pid {
    let max: i32 = fs::read_to_string("/proc/sys/kernel/pid_max")
        .expect("pid_max")
        .trim()
        .parse()
        .expect("pid_max number");
    (1..1000)
        .map(|offset| Pid::from_raw(max - offset))
        .find(|pid| kill(*pid, None) == Err(nix::Error::ESRCH))
        .expect("a free pid")
}

#[test]
fn version_is_4_x_and_meets_the_minimum() {
    let _serial = serial();
    let criu = Criu::default();
    let version = criu.version().expect("criu version");
    assert_eq!(version.major, 4, "criu {version}");
    let checked = criu
        .require_min_version(MIN_VERSION.0, MIN_VERSION.1)
        .expect("criu is new enough");
    assert_eq!(checked, version);
    assert!(version.to_string().starts_with("4."));
}

#[test]
fn require_min_version_rejects_a_newer_requirement() {
    let _serial = serial();
    let err = Criu::default()
        .require_min_version(99, 0)
        .expect_err("no criu 99");
    assert!(
        matches!(
            err,
            CriuError::TooOld {
                required: (99, 0),
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("need 99.0 or newer"), "{err}");
}

#[test]
fn check_passes_on_this_kernel() {
    let _serial = serial();
    Criu::default().check().expect("criu check");
}

#[test]
fn dump_then_restore_continues_the_counter_under_the_same_pid() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(&tmp);
    let counter = tmp.path().join("counter");
    let mut tree = Tree::counter(&counter, Stdio::null());
    let pid = tree.pid;
    let criu = Criu::default();

    let dumped = criu
        .dump(&DumpOpts::new(pid, &images))
        .expect("dump the counter");
    assert_eq!(dumped.log, images.join("dump.log"));
    assert!(images.join("dump.log").is_file());
    assert!(images.join("inventory.img").is_file());
    tree.reap_original();
    assert!(
        !is_alive(pid),
        "dump without leave_running must kill the tree"
    );
    let at_dump = read_counter(&counter).expect("counter after dump");
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        read_counter(&counter),
        Some(at_dump),
        "counter moved while dumped"
    );

    let restored = criu
        .restore(&RestoreOpts {
            rst_sibling: true,
            ..RestoreOpts::new(&images)
        })
        .expect("restore the counter");
    tree.restored = true;
    assert_eq!(restored.pid, pid, "restored under another pid");
    assert_eq!(restored.log, images.join("restore.log"));
    wait_for(
        || read_counter(&counter).is_some_and(|n| n > at_dump + 3),
        "the restored counter to continue",
    );
    assert!(is_alive(pid));
    eprintln!(
        "criu round trip: dump {:?}, restore {:?}",
        dumped.elapsed, restored.elapsed
    );
}

/// A `criu` that, like a node whose CRIU package ships plugins, is told to load every plugin
/// of a directory holding a `cuda_plugin.so` (not a loadable library: CRIU fails any request
/// that loads it).
fn criu_with_a_plugin_dir(tmp: &tempfile::TempDir) -> Criu {
    let plugins = tmp.path().join("criu-default-plugins");
    fs::create_dir(&plugins).expect("plugin dir");
    fs::write(plugins.join(plugins::CUDA_PLUGIN), b"not a library").expect("plugin");
    let wrapper = tmp.path().join("criu");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nCRIU_LIBS_DIR='{}' exec criu \"$@\"\n",
            plugins.display()
        ),
    )
    .expect("wrapper");
    fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    Criu::new(wrapper).with_settings_dir(tmp.path().join("settings"))
}

#[test]
fn dump_and_restore_load_no_plugin_of_criu_s_own() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(&tmp);
    let counter = tmp.path().join("counter");
    let mut tree = Tree::counter(&counter, Stdio::null());
    let pid = tree.pid;
    let criu = criu_with_a_plugin_dir(&tmp);

    criu.dump(&DumpOpts::new(pid, &images))
        .expect("dump ignoring CRIU's plugin directory");
    tree.reap_original();
    let log = fs::read_to_string(images.join("dump.log")).expect("dump log");
    assert!(
        !log.contains(plugins::CUDA_PLUGIN),
        "CRIU looked at its own plugins:\n{log}"
    );
    let at_dump = read_counter(&counter).expect("counter after dump");
    criu.restore(&RestoreOpts {
        rst_sibling: true,
        ..RestoreOpts::new(&images)
    })
    .expect("restore ignoring CRIU's plugin directory");
    tree.restored = true;
    wait_for(
        || read_counter(&counter).is_some_and(|n| n > at_dump + 3),
        "the restored counter to continue",
    );
}

#[test]
fn restore_wires_inherited_fds_and_pinned_namespaces_into_criu() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(&tmp);
    let counter = tmp.path().join("counter");
    let (read_end, write_end) = pipe2(OFlag::O_CLOEXEC).expect("pipe");
    let pipe_inode = fstat(write_end.as_fd()).expect("fstat pipe").st_ino;
    let child_stdout: OwnedFd = write_end.try_clone().expect("dup pipe");
    let mut tree = Tree::counter(&counter, Stdio::from(child_stdout));
    let pid = tree.pid;

    // Lines the counter prints, read off the pipe we keep both ends of.
    let (lines_tx, lines_rx) = mpsc::channel::<u64>();
    std::thread::spawn(move || {
        for line in BufReader::new(fs::File::from(read_end)).lines() {
            let Ok(line) = line else { break };
            let Ok(n) = line.trim().parse() else { continue };
            if lines_tx.send(n).is_err() {
                break;
            }
        }
    });
    let first = lines_rx
        .recv_timeout(Duration::from_secs(10))
        .expect("counter output before dump");
    assert!(first >= 1);

    let criu = Criu::default();
    criu.dump(&DumpOpts::new(pid, &images))
        .expect("dump the counter");
    tree.reap_original();
    let at_dump = read_counter(&counter).expect("counter after dump");
    while lines_rx.try_recv().is_ok() {}

    let uts: OwnedFd = fs::File::open("/proc/self/ns/uts")
        .expect("open our uts ns")
        .into();
    let restored = criu
        .restore(&RestoreOpts {
            rst_sibling: true,
            inherit_fds: vec![InheritFd {
                key: format!("pipe:[{pipe_inode}]"),
                fd: write_end,
            }],
            join_ns: vec![JoinNs {
                ns: NamespaceKind::Uts,
                file: NsFile::Fd(uts),
            }],
            ..RestoreOpts::new(&images)
        })
        .expect("restore with the pipe inherited");
    tree.restored = true;
    assert_eq!(restored.pid, pid);

    // The restored counter writes into *our* pipe: without the inherited fd CRIU would have
    // made a new pipe nobody reads.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = lines_rx
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            .expect("restored counter output on the inherited pipe");
        if n > at_dump + 2 {
            break;
        }
    }
    let log = fs::read_to_string(images.join("restore.log")).expect("restore log");
    assert!(
        log.contains("uts"),
        "restore log does not mention the joined uts ns"
    );
}

#[test]
fn dump_of_a_missing_pid_fails_naming_the_log_and_the_cause() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(&tmp);
    let err = Criu::default()
        .dump(&DumpOpts::new(unused_pid(), &images))
        .expect_err("dump of a missing pid");
    let CriuError::Failed {
        op, log, key_lines, ..
    } = &err
    else {
        panic!("expected a failed request, got {err:?}");
    };
    assert_eq!(*op, CriuOp::Dump);
    assert_eq!(log.as_deref(), Some(images.join("dump.log").as_path()));
    assert!(!key_lines.is_empty(), "no key lines: {err}");
    assert!(
        key_lines.iter().all(|line| !line.contains("RLIMIT_NOFILE")),
        "{key_lines:?}"
    );
    let shown = err.to_string();
    assert!(
        shown.contains(&images.join("dump.log").display().to_string()),
        "{shown}"
    );
    assert!(shown.contains(&key_lines[key_lines.len() - 1]), "{shown}");
    eprintln!("missing pid: {shown}");
}

#[test]
fn restore_of_an_empty_images_dir_fails_with_the_log_lines() {
    let _serial = serial();
    let tmp = tempfile::tempdir().expect("tempdir");
    let images = images_dir(&tmp);
    let err = Criu::default()
        .restore(&RestoreOpts::new(&images))
        .expect_err("restore of nothing");
    assert!(
        matches!(
            err,
            CriuError::Failed {
                op: CriuOp::Restore,
                ..
            }
        ),
        "{err:?}"
    );
    assert_eq!(err.log(), Some(images.join("restore.log").as_path()));
    eprintln!("empty images: {err}");
}

#[test]
fn missing_images_dir_is_reported_before_criu_starts() {
    // A binary that does not exist: reaching the spawn would be a different error.
    let criu = Criu::new("/nonexistent/criu");
    let err = criu
        .dump(&DumpOpts::new(Pid::from_raw(1), "/nonexistent/images"))
        .expect_err("no images dir");
    assert!(
        matches!(&err, CriuError::ImagesDir { path, .. } if path == Path::new("/nonexistent/images")),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "cannot open criu images directory /nonexistent/images"
    );
    let err = criu
        .restore(&RestoreOpts::new("/nonexistent/images"))
        .expect_err("no images dir");
    assert!(matches!(err, CriuError::ImagesDir { .. }), "{err:?}");
}

#[test]
fn invalid_options_are_reported_before_criu_starts() {
    let criu = Criu::new("/nonexistent/criu");
    let err = criu
        .dump(&DumpOpts {
            log_file: "../escape.log".to_owned(),
            ..DumpOpts::new(Pid::from_raw(1), "/")
        })
        .expect_err("bad log name");
    assert!(
        matches!(err, CriuError::InvalidOpts(OptsError::LogFile(_))),
        "{err:?}"
    );
}

#[test]
fn a_missing_binary_is_a_spawn_error_naming_it() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let err = Criu::new("/nonexistent/criu")
        .dump(&DumpOpts::new(Pid::from_raw(1), tmp.path()))
        .expect_err("no criu there");
    assert!(
        matches!(&err, CriuError::Spawn { path, op: CriuOp::Dump, .. } if path == Path::new("/nonexistent/criu")),
        "{err:?}"
    );
    let err = Criu::new("warmstart-no-such-criu")
        .version()
        .expect_err("not in PATH");
    assert!(matches!(err, CriuError::Spawn { .. }), "{err:?}");
}

#[test]
fn a_request_past_its_timeout_kills_criu() {
    let _serial = serial();
    let err = Criu::default()
        .with_timeout(Duration::ZERO)
        .version()
        .expect_err("zero timeout");
    assert!(
        matches!(
            err,
            CriuError::Timeout {
                op: CriuOp::Version,
                ..
            }
        ),
        "{err:?}"
    );
}
