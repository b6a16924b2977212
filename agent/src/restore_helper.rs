//! The restore helper: a short-lived `warmstart-agent restore-helper` process that puts a CRIU
//! restore inside a placeholder container. It runs single-threaded (so forking is sound) and:
//!
//! 1. pins the placeholder's namespaces and stdio by opening them, then checks the placeholder's
//!    start time so a recycled PID is never entered;
//! 2. joins the placeholder's PID namespace (`setns` affects its children) and forks;
//! 3. the child, now inside that PID namespace, takes a copy of the agent's mount namespace
//!    whose mounts are slaves of the agent's (nothing mounted there propagates back) and mounts a fresh `/proc` there (so CRIU and every program it runs come from
//!    the agent's filesystem, never from the container's), joins the placeholder's cgroups,
//!    and drives `criu restore` with the placeholder's root, network namespace (inherited fd),
//!    UTS and IPC namespaces (pinned fds) and stdio pipes (inherited fds);
//! 4. the restored tree outlives CRIU and the helper: its root is reparented to the
//!    placeholder's init, in the placeholder's namespaces and cgroups.
//!
//! The plan comes as JSON on standard input; the answer ([`HelperAnswer`]: the restored PID or
//! a typed [`HelperFailure`] naming the step, the errno and CRIU's report) is JSON on standard
//! output, and the exit code is 0 or 1.
//!
//! Nothing of an unfinished restore outlives the agent or its deadline. CRIU dies with the
//! helper's child and the child with the helper (parent-death signals), but the tasks CRIU is
//! restoring live in the placeholder's PID namespace below its init, where no parent-death
//! signal reaches them (a broken artifact can leave them spinning in CRIU's restorer). So the
//! helper does not die with the agent: it watches it (its parent) and the deadline while the
//! child restores, and when the agent is gone or the deadline passes it SIGKILLs the child,
//! CRIU and everything below them, and the tree restored below the placeholder's init, then
//! exits. Once it has answered, the tree is the agent's (a dead agent's tree is killed by the
//! next restore attempt, `placeholder::inspect`). The agent, in turn, gives the helper a little
//! longer than the deadline and then kills the same processes itself.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, setns, unshare};
use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::criu::NETNS_KEY;
use crate::criu::{
    Criu, CriuError, ExtMount, InheritFd, JoinNs, NamespaceKind, NsFile, RestoreOpts,
};
use crate::runtime::stat::start_time;
use crate::sys::fork::{Forked, fork};
use warmstart_shared::names::RESTORE_LOG;

/// The plan handed to the restore helper process (JSON on its standard input).
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HelperPlan {
    /// Host PID of the placeholder's init.
    pub placeholder_pid: i32,
    /// Its start time (field 22 of `/proc/<pid>/stat`): guards against PID reuse.
    pub placeholder_start_time: u64,
    /// The CRIU binary.
    pub criu: PathBuf,
    /// CRIU images (read only): the restore's private view of the artifact.
    pub images_dir: PathBuf,
    /// The identity (device, inode) of `images_dir` as the agent made it: the helper refuses
    /// to hand CRIU any other directory found at that path.
    #[serde(default)]
    pub images_dir_id: Option<(u64, u64)>,
    /// Where CRIU writes its log.
    pub work_dir: PathBuf,
    /// The placeholder's root filesystem (host path).
    pub root: PathBuf,
    /// cgroup directories to join.
    pub cgroups: Vec<PathBuf>,
    /// External mount key → host path.
    pub ext_mounts: Vec<(String, String)>,
    /// Inherit-fd key → fd number of the placeholder's init to pass.
    pub stdio: Vec<(String, u8)>,
    /// Whether the network namespace is external (inherit the placeholder's).
    pub netns: bool,
    /// Leave the restored tree stopped: the page images' checksums are still being computed,
    /// or its GPU state is still to be restored; the agent resumes it after both.
    pub leave_stopped: bool,
    /// Dump-time options to replay.
    pub options: warmstart_shared::artifact::CriuOptions,
    /// The agent (the helper's parent) whose death ends the restore.
    pub agent_pid: i32,
    /// Milliseconds the restore may take, CRIU's start included.
    pub deadline_ms: u64,
    /// The most bytes CRIU may write into its log.
    pub log_limit_bytes: u64,
}

/// How much longer than the deadline CRIU's own client waits (the helper's watch comes first).
const CRIU_GRACE: Duration = Duration::from_secs(5);
/// How much longer than the deadline the agent waits for the helper before killing it.
const AGENT_GRACE: Duration = Duration::from_secs(15);
/// How often the helper looks for its agent while the child restores.
const WATCH_TICK_MS: u16 = 50;

/// The hidden subcommand of `warmstart-agent` that runs the helper.
pub const HELPER_COMMAND: &str = "restore-helper";

/// What the helper answers on standard output.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub enum HelperAnswer {
    /// The tree is restored; its root's PID in the placeholder's PID namespace.
    Restored {
        /// The PID.
        pid: i32,
    },
    /// Nothing was restored (CRIU cleans up a failed restore).
    Failed(HelperFailure),
}

/// The step of the helper that failed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum HelperStep {
    /// Reading the plan from standard input.
    ReadPlan,
    /// Opening (pinning) a namespace or descriptor of the placeholder.
    Pin,
    /// The placeholder's init exited or its PID was reused.
    PlaceholderChanged,
    /// Tying the helper to the agent's life.
    DieWithParent,
    /// `setns` into the placeholder's PID namespace.
    EnterPidNamespace,
    /// Forking the child that lives in that namespace.
    Fork,
    /// Unsharing the mount namespace.
    UnshareMounts,
    /// Making the copied mounts slaves of the agent's.
    PrivateMounts,
    /// Mounting `/proc` of the placeholder's PID namespace.
    MountProc,
    /// Joining a cgroup of the placeholder.
    JoinCgroup,
    /// Opening the images directory, the agent's private view.
    ImagesDir,
    /// Another directory than the agent's view was found at the images directory's path.
    ImagesDirReplaced,
    /// CRIU's restore.
    Criu,
    /// The child ended without an answer.
    Child,
    /// The restore ran past its deadline (everything it started was killed).
    Deadline,
    /// The agent died during the restore (everything it started was killed).
    AgentGone,
}

impl HelperStep {
    fn describe(self) -> &'static str {
        match self {
            Self::ReadPlan => "cannot read the restore plan",
            Self::Pin => "cannot open",
            Self::PlaceholderChanged => {
                "the placeholder's init exited or was replaced before the restore"
            }
            Self::DieWithParent => "cannot tie the restore helper to the agent's life",
            Self::EnterPidNamespace => "cannot enter the placeholder's PID namespace",
            Self::Fork => "cannot fork into the placeholder's PID namespace",
            Self::UnshareMounts => "cannot unshare the mount namespace",
            Self::PrivateMounts => "cannot make the copied mounts slaves of the agent's",
            Self::MountProc => "cannot mount /proc of the placeholder's PID namespace",
            Self::JoinCgroup => "cannot join cgroup",
            Self::ImagesDir => "cannot open the restore's view of the artifact",
            Self::ImagesDirReplaced => {
                "another directory took the place of the restore's view of the artifact"
            }
            Self::Criu => "CRIU restore failed",
            Self::Child => "the restore helper's child ended without an answer",
            Self::Deadline => "the restore did not finish within its deadline",
            Self::AgentGone => "the agent died during the restore",
        }
    }
}

/// CRIU's report of a failed restore, as the helper hands it over.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CriuReport {
    /// CRIU's `cr_errno`, when it set one.
    pub cr_errno: Option<i32>,
    /// What CRIU said: its key log lines, or the client's error.
    pub message: String,
    /// The CRIU log.
    pub log: Option<PathBuf>,
}

impl CriuReport {
    fn from_error(err: &CriuError) -> Self {
        let message = match err {
            CriuError::Failed {
                key_lines, message, ..
            } if !key_lines.is_empty() || !message.is_empty() => {
                if key_lines.is_empty() {
                    message.clone()
                } else {
                    key_lines.join(" | ")
                }
            }
            other => crate::report::error_chain(other),
        };
        Self {
            cr_errno: err.cr_errno(),
            message,
            log: err.log().map(Path::to_path_buf),
        }
    }
}

/// Why the helper restored nothing: the step, the path it concerned, the errno, CRIU's report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, Error)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HelperFailure {
    /// The step that failed.
    pub step: HelperStep,
    /// The file or directory it concerned.
    pub path: Option<PathBuf>,
    /// The system error number.
    pub errno: Option<i32>,
    /// CRIU's report, for [`HelperStep::Criu`].
    pub criu: Option<CriuReport>,
    /// How the child ended, for [`HelperStep::Child`] (exit code, or 128 + signal).
    pub status: Option<i32>,
    /// What was killed, for [`HelperStep::Deadline`] and [`HelperStep::AgentGone`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub killed: Option<Box<Killed>>,
}

/// What the helper killed when the restore ran past its deadline or lost its agent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Killed {
    /// The deadline that passed, in milliseconds.
    pub deadline_ms: Option<u64>,
    /// Host PIDs it killed (CRIU, its children, the tree being restored).
    pub pids: Vec<i32>,
}

impl std::fmt::Display for HelperFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.step.describe())?;
        if let Some(Killed {
            deadline_ms: Some(ms),
            pids,
        }) = self.killed.as_deref()
        {
            write!(
                f,
                " of {}s: CRIU and the tree it was restoring were killed (pids {pids:?}); CRIU log {}",
                Duration::from_millis(*ms).as_secs_f64(),
                self.path
                    .as_deref()
                    .map_or_else(|| "unknown".to_owned(), |p| p.display().to_string())
            )?;
            return Ok(());
        }
        if let Some(path) = &self.path {
            write!(f, " {}", path.display())?;
        }
        if let Some(errno) = self.errno {
            write!(f, ": {}", std::io::Error::from_raw_os_error(errno))?;
        }
        if let Some(status) = self.status {
            write!(f, " (status {status})")?;
        }
        if let Some(criu) = &self.criu {
            if let Some(errno) = criu.cr_errno {
                write!(f, " (errno {errno})")?;
            }
            write!(f, ": {}", criu.message)?;
        }
        Ok(())
    }
}

impl HelperFailure {
    fn at(step: HelperStep) -> Self {
        Self {
            step,
            path: None,
            errno: None,
            criu: None,
            status: None,
            killed: None,
        }
    }

    fn io(step: HelperStep, path: Option<&Path>, err: &std::io::Error) -> Self {
        Self {
            path: path.map(Path::to_path_buf),
            errno: err.raw_os_error(),
            ..Self::at(step)
        }
    }

    fn sys(step: HelperStep, errno: nix::Error) -> Self {
        Self {
            errno: Some(errno as i32),
            ..Self::at(step)
        }
    }

    /// The CRIU log this failure refers to.
    pub fn log(&self) -> Option<&Path> {
        match self.step {
            HelperStep::Deadline => self.path.as_deref(),
            _ => self.criu.as_ref().and_then(|c| c.log.as_deref()),
        }
    }

    /// The agent died; `killed` went with it.
    fn agent_gone(killed: Vec<i32>) -> Self {
        Self {
            killed: Some(Box::new(Killed {
                deadline_ms: None,
                pids: killed,
            })),
            ..Self::at(HelperStep::AgentGone)
        }
    }

    /// The restore ran past `deadline`; `killed` went with it.
    fn deadline(plan: &HelperPlan, killed: Vec<i32>) -> Self {
        Self {
            path: Some(plan.work_dir.join(RESTORE_LOG)),
            killed: Some(Box::new(Killed {
                deadline_ms: Some(plan.deadline_ms),
                pids: killed,
            })),
            ..Self::at(HelperStep::Deadline)
        }
    }
}

/// Why running the helper failed (the agent's side).
#[derive(Debug, Error)]
pub enum HelperError {
    /// The helper could not be started.
    #[error("cannot start the restore helper {}", path.display())]
    Spawn {
        /// The binary.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The plan could not be handed over.
    #[error("cannot send the plan to the restore helper")]
    Send(#[source] std::io::Error),
    /// The helper ended without a readable answer.
    #[error(
        "the restore helper ended ({status}) without an answer{}",
        fmt_stderr(stderr)
    )]
    NoAnswer {
        /// How it ended.
        status: std::process::ExitStatus,
        /// Its last standard-error lines.
        stderr: Vec<String>,
    },
    /// The helper restored nothing.
    #[error(transparent)]
    Failed(#[from] HelperFailure),
}

impl HelperError {
    /// The CRIU log this error refers to.
    pub fn log(&self) -> Option<&Path> {
        match self {
            Self::Failed(failure) => failure.log(),
            _ => None,
        }
    }
}

fn fmt_stderr(lines: &[String]) -> String {
    if lines.is_empty() {
        String::new()
    } else {
        format!(": {}", lines.join(" | "))
    }
}

/// Runs `helper restore-helper` with `plan` and waits for its answer, at most a little longer
/// than the plan's deadline: past that, the helper, everything below it and the tree restored
/// into the placeholder are killed. Blocking.
///
/// The helper does not die with this thread: it watches the agent and, if the agent dies,
/// kills what it started before it exits (see the module docs).
///
/// # Errors
/// [`HelperError`]. On every error, no restored process is left in the placeholder.
pub fn spawn_and_wait(helper: &Path, plan: &HelperPlan) -> Result<i32, HelperError> {
    let result = spawn_and_wait_inner(helper, plan);
    if result.is_err() {
        // Whatever failed, a tree CRIU left (spinning in its restorer, or half restored) goes.
        let left = crate::placeholder::kill_restored_tree(plan.placeholder_pid);
        if !left.is_empty() {
            tracing::warn!(pids = ?left, "killed what the failed restore left in the placeholder");
        }
    }
    result
}

fn spawn_and_wait_inner(helper: &Path, plan: &HelperPlan) -> Result<i32, HelperError> {
    let input = serde_json::to_vec(plan).map_err(|e| HelperError::Send(e.into()))?;
    let (stdin_read, mut stdin_write) = std::io::pipe().map_err(HelperError::Send)?;
    let (mut stdout_read, stdout_write) = std::io::pipe().map_err(HelperError::Send)?;
    let (mut stderr_read, stderr_write) = std::io::pipe().map_err(HelperError::Send)?;
    let spawn_error = |source| HelperError::Spawn {
        path: helper.to_path_buf(),
        source,
    };
    let deadline = after(Duration::from_millis(plan.deadline_ms).saturating_add(AGENT_GRACE));
    // What runs in the placeholder before the restore is the placeholder's; anything new below
    // its init is the restore's (see `kill_restore`).
    let before = crate::runtime::stat::descendants(plan.placeholder_pid);
    let pid = crate::sys::spawn::spawn(&crate::sys::spawn::SpawnSpec {
        program: helper,
        args: &[std::ffi::OsStr::new(HELPER_COMMAND)],
        fds: &[
            (stdin_read.as_fd(), 0),
            (stdout_write.as_fd(), 1),
            (stderr_write.as_fd(), 2),
        ],
        // It watches this process instead, to clean up after it.
        parent_death_signal: None,
        file_size_limit: None,
    })
    .map_err(spawn_error)?;
    drop((stdin_read, stdout_write, stderr_write));
    // The plan is small (a few KiB): it fits the pipe, so writing before reading cannot
    // deadlock; a helper that died early reads as EPIPE, reported through its status below.
    let sent = stdin_write.write_all(&input);
    drop(stdin_write);
    let stderr_thread = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = stderr_read.read_to_string(&mut text);
        text
    });
    let answer = match read_until(&mut stdout_read, deadline, || true) {
        Watched::Done(answer) => answer,
        Watched::Deadline | Watched::ParentGone => {
            let killed = kill_restore(pid.as_raw(), plan.placeholder_pid, &before);
            let _ = wait_status(pid);
            let _ = stderr_thread.join();
            tracing::error!(pids = ?killed, "the restore helper did not answer by the deadline: killed it and what it started");
            return Err(HelperError::Failed(HelperFailure::deadline(plan, killed)));
        }
    };
    let stderr = stderr_thread.join().unwrap_or_default();
    let status = wait_status(pid);
    if let Ok(answer) = serde_json::from_slice::<HelperAnswer>(&answer) {
        return match answer {
            HelperAnswer::Restored { pid } => Ok(pid),
            HelperAnswer::Failed(failure) => Err(HelperError::Failed(failure)),
        };
    }
    sent.map_err(HelperError::Send)?;
    let lines: Vec<String> = stderr.lines().map(str::to_owned).collect();
    Err(HelperError::NoAnswer {
        status,
        stderr: lines[lines.len().saturating_sub(5)..].to_vec(),
    })
}

/// `wait` from now, or as far as the clock goes.
fn after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 24 * 3600))
}

/// How reading a child's answer ended.
enum Watched {
    /// End of file: everything it wrote.
    Done(Vec<u8>),
    /// The deadline passed first.
    Deadline,
    /// `parent_alive` said no first.
    ParentGone,
}

/// Reads `pipe` to its end, unless `deadline` passes or `parent_alive` turns false (checked
/// every [`WATCH_TICK_MS`]) first.
fn read_until(
    pipe: &mut std::io::PipeReader,
    deadline: Instant,
    parent_alive: impl Fn() -> bool,
) -> Watched {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let mut bytes = Vec::new();
    let mut buf = [0_u8; 4096];
    loop {
        if !parent_alive() {
            return Watched::ParentGone;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Watched::Deadline;
        }
        let tick = u16::try_from(left.as_millis())
            .unwrap_or(u16::MAX)
            .clamp(1, WATCH_TICK_MS);
        let mut fds = [PollFd::new(pipe.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(tick)) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(_) => {
                // Cannot poll: read blocking, as before deadlines existed.
                let _ = pipe.read_to_end(&mut bytes);
                return Watched::Done(bytes);
            }
        }
        match pipe.read(&mut buf) {
            Ok(0) => return Watched::Done(bytes),
            Ok(n) => bytes.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return Watched::Done(bytes),
        }
    }
}

/// SIGKILLs `root`, every process below it, and every process below the placeholder's init
/// `placeholder` that was not there `before` the restore (the restored tree among them), until
/// none is left (a few seconds at most). Every process of one pass is signalled before any is
/// waited for. Returns the PIDs it signalled.
fn kill_restore(root: i32, placeholder: i32, before: &[i32]) -> Vec<i32> {
    let live = |pid: &i32| {
        crate::runtime::stat::fields(*pid)
            .and_then(|f| f.first().cloned())
            .is_some_and(|state| state != "Z" && state != "X")
    };
    let mut killed: Vec<i32> = Vec::new();
    let until = Instant::now() + Duration::from_secs(5);
    let mut quiet_passes = 0;
    loop {
        let mut pass: Vec<i32> = crate::runtime::stat::descendants(root)
            .into_iter()
            .filter(live)
            .collect();
        // Whatever lives below the placeholder's init now and did not before the restore is the
        // restore's: the restored tree (a placeholder that held one is never restored into), and
        // a process CRIU forked after the scan above, which outlives CRIU as a child of the init
        // in the init's own PID namespace (seen: a stopped `criu swrk` fork).
        pass.extend(
            crate::runtime::stat::descendants(placeholder)
                .into_iter()
                .skip(1)
                .filter(live)
                .filter(|pid| !before.contains(pid)),
        );
        pass.sort_unstable();
        pass.dedup();
        if pass.is_empty() {
            // Quiet twice in a row: a process being reparented between two reads of /proc is
            // seen by the next pass.
            quiet_passes += 1;
            if quiet_passes >= 3 {
                break;
            }
        } else {
            quiet_passes = 0;
        }
        if Instant::now() >= until {
            break;
        }
        for pid in &pass {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
            if !killed.contains(pid) {
                killed.push(*pid);
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    killed
}

fn wait_status(pid: nix::unistd::Pid) -> std::process::ExitStatus {
    use std::os::unix::process::ExitStatusExt;
    let code = crate::sys::fork::wait(pid).unwrap_or(-1);
    if code >= 128 {
        std::process::ExitStatus::from_raw(code - 128)
    } else {
        std::process::ExitStatus::from_raw((code & 0xff) << 8)
    }
}

fn open(path: String) -> Result<OwnedFd, HelperFailure> {
    File::open(&path)
        .map(OwnedFd::from)
        .map_err(|e| HelperFailure::io(HelperStep::Pin, Some(Path::new(&path)), &e))
}

/// Reads the plan from standard input and runs it. Call only from the helper process.
pub fn run_from_stdin() -> HelperAnswer {
    let mut input = Vec::new();
    if let Err(e) = std::io::stdin().read_to_end(&mut input) {
        return HelperAnswer::Failed(HelperFailure::io(HelperStep::ReadPlan, None, &e));
    }
    let plan: HelperPlan = match serde_json::from_slice(&input) {
        Ok(plan) => plan,
        Err(_) => return HelperAnswer::Failed(HelperFailure::at(HelperStep::ReadPlan)),
    };
    match run(&plan) {
        Ok(pid) => HelperAnswer::Restored { pid },
        Err(failure) => HelperAnswer::Failed(failure),
    }
}

/// Runs a plan (see the module docs for the order of steps); returns the restored root's PID.
///
/// # Errors
/// [`HelperFailure`].
pub fn run(plan: &HelperPlan) -> Result<i32, HelperFailure> {
    let started = Instant::now();
    if nix::unistd::getppid().as_raw() != plan.agent_pid {
        return Err(HelperFailure::at(HelperStep::AgentGone));
    }
    let pid = plan.placeholder_pid;
    let ns = |name: &str| open(format!("/proc/{pid}/ns/{name}"));
    let pid_ns = ns("pid")?;
    let net_ns = ns("net")?;
    let uts_ns = ns("uts")?;
    let ipc_ns = ns("ipc")?;
    let mut stdio = Vec::new();
    for (key, fd) in &plan.stdio {
        stdio.push((key.clone(), open(format!("/proc/{pid}/fd/{fd}"))?));
    }
    // Everything is pinned; if the placeholder is still the same process, the pins are its.
    if start_time(pid) != Some(plan.placeholder_start_time) {
        return Err(HelperFailure::at(HelperStep::PlaceholderChanged));
    }
    setns(&pid_ns, CloneFlags::CLONE_NEWPID)
        .map_err(|e| HelperFailure::sys(HelperStep::EnterPidNamespace, e))?;
    let (mut reader, writer) =
        std::io::pipe().map_err(|e| HelperFailure::io(HelperStep::Fork, None, &e))?;
    // What runs in the placeholder now is the placeholder's (see `kill_restore`).
    let before = crate::runtime::stat::descendants(pid);
    // The child lives in the placeholder's PID namespace, where this process has no PID.
    let me = nix::unistd::Pid::from_raw(0);
    match fork().map_err(|e| HelperFailure::io(HelperStep::Fork, None, &e))? {
        Forked::Child => {
            drop(reader);
            let outcome = crate::sys::spawn::die_with_parent(me)
                .map_err(|e| HelperFailure::io(HelperStep::DieWithParent, None, &e))
                .and_then(|()| in_namespace(plan, net_ns, uts_ns, ipc_ns, stdio));
            let mut writer = writer;
            let answer = match outcome {
                Ok(pid) => HelperAnswer::Restored { pid },
                Err(failure) => HelperAnswer::Failed(failure),
            };
            let code = i32::from(!matches!(answer, HelperAnswer::Restored { .. }));
            let _ = serde_json::to_writer(&mut writer, &answer);
            drop(writer);
            crate::sys::fork::exit_child(code)
        }
        Forked::Parent(child) => {
            drop(writer);
            let deadline = started
                .checked_add(Duration::from_millis(plan.deadline_ms))
                .unwrap_or_else(|| after(Duration::MAX));
            let agent_alive = || nix::unistd::getppid().as_raw() == plan.agent_pid;
            let answer = match read_until(&mut reader, deadline, agent_alive) {
                Watched::Done(answer) => answer,
                Watched::Deadline => {
                    let killed = kill_restore(child.as_raw(), plan.placeholder_pid, &before);
                    let _ = crate::sys::fork::wait(child);
                    return Err(HelperFailure::deadline(plan, killed));
                }
                Watched::ParentGone => {
                    let killed = kill_restore(child.as_raw(), plan.placeholder_pid, &before);
                    let _ = crate::sys::fork::wait(child);
                    return Err(HelperFailure::agent_gone(killed));
                }
            };
            let status = crate::sys::fork::wait(child)
                .map_err(|e| HelperFailure::io(HelperStep::Child, None, &e))?;
            let outcome = match serde_json::from_slice::<HelperAnswer>(&answer) {
                Ok(HelperAnswer::Restored { pid }) => Ok(pid),
                Ok(HelperAnswer::Failed(failure)) => Err(failure),
                Err(_) => Err(HelperFailure {
                    status: Some(status),
                    ..HelperFailure::at(HelperStep::Child)
                }),
            };
            // Handed over only to a live agent; a failed restore leaves nothing behind.
            if outcome.is_err() || !agent_alive() {
                // CRIU has exited: what it left is below the placeholder's init.
                let killed = crate::placeholder::kill_restored_tree(plan.placeholder_pid);
                if outcome.is_ok() {
                    return Err(HelperFailure::agent_gone(killed));
                }
            }
            outcome
        }
    }
}

fn in_namespace(
    plan: &HelperPlan,
    net_ns: OwnedFd,
    uts_ns: OwnedFd,
    ipc_ns: OwnedFd,
    stdio: Vec<(String, OwnedFd)>,
) -> Result<i32, HelperFailure> {
    let sys = |step| move |errno| HelperFailure::sys(step, errno);
    unshare(CloneFlags::CLONE_NEWNS).map_err(sys(HelperStep::UnshareMounts))?;
    // Slaves, not private: nothing mounted here (`/proc`, CRIU's mounts) reaches the agent's
    // namespace either way, but a container's root filesystem under a shared mount (`/` is
    // shared on systemd nodes; it reaches the agent through HostToContainer) keeps its master,
    // and CRIU restores the dumped root's slavery by copying it from the placeholder's root
    // (MOVE_MOUNT_SET_GROUP), which the kernel refuses from a private mount (EINVAL: "Failed
    // to copy sharing from source").
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .map_err(sys(HelperStep::PrivateMounts))?;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(sys(HelperStep::MountProc))?;
    for dir in &plan.cgroups {
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, b"0")
            .map_err(|e| HelperFailure::io(HelperStep::JoinCgroup, Some(&procs), &e))?;
    }
    // CRIU gets the directory opened here (through this process's descriptor of it), and only
    // once it is known to be the agent's view: a directory renamed into its path is refused.
    let images = open_images(plan)?;
    let pinned;
    let plan = match &images {
        Some(fd) => {
            pinned = HelperPlan {
                images_dir: PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd())),
                ..plan.clone()
            };
            &pinned
        }
        None => plan,
    };
    let mut inherit_fds: Vec<InheritFd> = stdio
        .into_iter()
        .map(|(key, fd)| InheritFd { key, fd })
        .collect();
    if plan.netns {
        inherit_fds.push(InheritFd {
            key: NETNS_KEY.to_owned(),
            fd: net_ns,
        });
    }
    let opts = restore_opts(
        plan,
        inherit_fds,
        vec![
            JoinNs {
                ns: NamespaceKind::Uts,
                file: NsFile::Fd(uts_ns),
            },
            JoinNs {
                ns: NamespaceKind::Ipc,
                file: NsFile::Fd(ipc_ns),
            },
        ],
    );
    let outcome = Criu::new(&plan.criu)
        .with_timeout(Duration::from_millis(plan.deadline_ms) + CRIU_GRACE)
        .with_log_limit(plan.log_limit_bytes)
        .restore(&opts)
        .map_err(|err| HelperFailure {
            criu: Some(CriuReport::from_error(&err)),
            ..HelperFailure::at(HelperStep::Criu)
        })?;
    Ok(outcome.pid.as_raw())
}

/// Opens the plan's images directory without following a link at its end and checks it is the
/// directory the agent made (`images_dir_id`); `None` when the plan names no identity.
fn open_images(plan: &HelperPlan) -> Result<Option<OwnedFd>, HelperFailure> {
    use nix::fcntl::OFlag;
    let Some(expected) = plan.images_dir_id else {
        return Ok(None);
    };
    let failure = |step, errno: Option<i32>| HelperFailure {
        path: Some(plan.images_dir.clone()),
        errno,
        ..HelperFailure::at(step)
    };
    let fd = nix::fcntl::open(
        &plan.images_dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        nix::sys::stat::Mode::empty(),
    )
    .map_err(|errno| failure(HelperStep::ImagesDir, Some(errno as i32)))?;
    let st = nix::sys::stat::fstat(&fd)
        .map_err(|errno| failure(HelperStep::ImagesDir, Some(errno as i32)))?;
    if (st.st_dev, st.st_ino) != expected {
        return Err(failure(HelperStep::ImagesDirReplaced, None));
    }
    Ok(Some(fd))
}

/// The options of the restore: every dump-time option that must match (TCP, file locks,
/// external unix sockets, shell job, cgroup mode, network lock) comes from the manifest; the
/// placeholder's root, mounts, descriptors and namespaces from the plan.
fn restore_opts(
    plan: &HelperPlan,
    inherit_fds: Vec<InheritFd>,
    join_ns: Vec<JoinNs>,
) -> RestoreOpts {
    let o = &plan.options;
    RestoreOpts {
        work_dir: Some(plan.work_dir.clone()),
        log_file: RESTORE_LOG.to_owned(),
        tcp_established: o.tcp_established,
        file_locks: o.file_locks,
        ext_unix_sk: o.ext_unix_sk,
        shell_job: o.shell_job,
        manage_cgroups_mode: o.manage_cgroups_mode.into(),
        network_lock: o.network_lock.into(),
        ext_mounts: plan
            .ext_mounts
            .iter()
            .map(|(key, value)| ExtMount {
                key: key.clone(),
                value: value.clone(),
            })
            .collect(),
        root: Some(plan.root.clone()),
        inherit_fds,
        join_ns,
        leave_stopped: plan.leave_stopped,
        ..RestoreOpts::new(&plan.images_dir)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_replays_the_options_the_dump_recorded() {
        use warmstart_shared::artifact::{CgroupMode, CriuOptions, NetworkLock};
        let plan = HelperPlan {
            placeholder_pid: 1,
            placeholder_start_time: 1,
            criu: PathBuf::from("criu"),
            images_dir: PathBuf::from("/artifact/criu"),
            images_dir_id: None,
            work_dir: PathBuf::from("/logs"),
            root: PathBuf::from("/rootfs"),
            cgroups: Vec::new(),
            ext_mounts: vec![("/data".to_owned(), "/host/data".to_owned())],
            stdio: Vec::new(),
            netns: false,
            leave_stopped: true,
            agent_pid: 1,
            deadline_ms: 1000,
            log_limit_bytes: 1 << 20,
            options: CriuOptions {
                tcp_established: true,
                file_locks: true,
                manage_cgroups_mode: CgroupMode::Soft,
                network_lock: NetworkLock::Nftables,
                ..CriuOptions::default()
            },
        };
        let opts = restore_opts(&plan, Vec::new(), Vec::new());
        assert_eq!(
            opts.manage_cgroups_mode,
            crate::criu::ManageCgroupsMode::Soft
        );
        assert_eq!(opts.network_lock, crate::criu::NetworkLockMethod::Nftables);
        assert!(opts.tcp_established && opts.file_locks);
        assert_eq!(opts.root.as_deref(), Some(Path::new("/rootfs")));
        assert!(
            opts.leave_stopped,
            "the tree waits for the page images' checksums"
        );
        let ignore = HelperPlan {
            options: CriuOptions {
                manage_cgroups_mode: CgroupMode::Ignore,
                ..plan.options.clone()
            },
            ..plan
        };
        let opts = restore_opts(&ignore, Vec::new(), Vec::new());
        assert_eq!(
            opts.manage_cgroups_mode,
            crate::criu::ManageCgroupsMode::Ignore
        );
    }

    #[test]
    fn criu_gets_the_agents_view_or_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let view = tmp.path().join("criu");
        std::fs::create_dir(&view).unwrap();
        let st = nix::sys::stat::stat(&view).unwrap();
        let plan = HelperPlan {
            placeholder_pid: 1,
            placeholder_start_time: 1,
            criu: PathBuf::from("criu"),
            images_dir: view.clone(),
            images_dir_id: Some((st.st_dev, st.st_ino)),
            work_dir: PathBuf::from("/logs"),
            root: PathBuf::from("/rootfs"),
            cgroups: Vec::new(),
            ext_mounts: Vec::new(),
            stdio: Vec::new(),
            netns: false,
            leave_stopped: true,
            options: warmstart_shared::artifact::CriuOptions::default(),
            agent_pid: 1,
            deadline_ms: 1000,
            log_limit_bytes: 1 << 20,
        };
        let fd = open_images(&plan).unwrap().unwrap();
        assert_eq!(nix::sys::stat::fstat(&fd).unwrap().st_ino, st.st_ino);
        // Someone who can rename in the directory above puts another directory there.
        std::fs::rename(&view, tmp.path().join("moved")).unwrap();
        std::fs::create_dir(&view).unwrap();
        let err = open_images(&plan).unwrap_err();
        assert_eq!(err.step, HelperStep::ImagesDirReplaced, "{err}");
        assert!(err.to_string().contains("took the place"), "{err}");
        // Or a link to the real one: never followed.
        std::fs::remove_dir(&view).unwrap();
        std::os::unix::fs::symlink(tmp.path().join("moved"), &view).unwrap();
        let err = open_images(&plan).unwrap_err();
        assert_eq!(err.step, HelperStep::ImagesDir, "{err}");
    }

    #[test]
    fn a_failure_crosses_the_process_boundary_typed() {
        let failure = HelperFailure {
            criu: Some(CriuReport {
                cr_errno: Some(libc::EEXIST),
                message: "Error (criu/cr-restore.c:1): pid 7 is busy".to_owned(),
                log: Some(PathBuf::from("/logs/restore.log")),
            }),
            ..HelperFailure::at(HelperStep::Criu)
        };
        let answer = HelperAnswer::Failed(failure.clone());
        let text = serde_json::to_string(&answer).unwrap();
        let back: HelperAnswer = serde_json::from_str(&text).unwrap();
        assert_eq!(back, answer);
        assert_eq!(failure.log(), Some(Path::new("/logs/restore.log")));
        assert_eq!(
            failure.to_string(),
            "CRIU restore failed (errno 17): Error (criu/cr-restore.c:1): pid 7 is busy"
        );
        let pinned = HelperFailure::io(
            HelperStep::JoinCgroup,
            Some(Path::new("/sys/fs/cgroup/x/cgroup.procs")),
            &std::io::Error::from_raw_os_error(libc::EACCES),
        );
        assert!(
            pinned
                .to_string()
                .starts_with("cannot join cgroup /sys/fs/cgroup/x/cgroup.procs: Permission denied"),
            "{pinned}"
        );
    }
}
