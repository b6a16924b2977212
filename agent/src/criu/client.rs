//! The `criu swrk` client: one CRIU process per request, spoken to over a `SOCK_SEQPACKET`
//! socketpair with protobuf messages (what runc, go-criu and libcriu do).
//!
//! # File descriptors
//! The `criu swrk` child is started through [`crate::sys::spawn`] (for a restore with the
//! parent-death signal SIGKILL: it never outlives the thread driving it) with exactly these
//! descriptors, every other one of ours being closed:
//! - 0: `/dev/null`; 1 and 2: a memfd capturing CRIU's output before its log is set up;
//! - 3: the child's end of the socketpair (`criu swrk 3`);
//! - 4 and up: the restore's inherited fds, then its pinned namespace files, numbered in the
//!   request to match.
//!
//! The images and work directories are *not* passed: CRIU opens them as
//! `/proc/<peer>/fd/<n>`, where the peer is the process that created the socketpair
//! (`SO_PEERCRED`), i.e. this one.

use std::ffi::OsStr;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::memfd::{MFdFlags, memfd_create};
use nix::sys::signal::{Signal, kill};
use nix::sys::socket::{
    AddressFamily, MsgFlags, SockFlag, SockType, recv, send, setsockopt, socketpair, sockopt,
};
use nix::sys::stat::Mode;
use nix::sys::time::{TimeVal, TimeValLike};
use nix::sys::wait::{WaitPidFlag, WaitStatus, waitpid};
use nix::unistd::Pid;
use prost::Message;
use tracing::{debug, warn};

use super::error::{CriuError, CriuOp};
use super::log;
use super::opts::{DumpOpts, RestoreOpts};
use super::rpc;
use super::version::CriuVersion;
use crate::sys::spawn::SpawnSpec;

/// The descriptor number of the RPC socket in the `criu swrk` child.
const CHILD_SOCKET_FD: RawFd = 3;
/// The first descriptor number of a restore's inherited fds in the `criu swrk` child.
const FIRST_CHILD_EXTRA_FD: RawFd = 4;
/// The notification CRIU sends once a dump's images are complete, the tree still stopped.
const POST_DUMP: &str = "post-dump";
/// Larger than any response CRIU sends (they are a few hundred bytes); a bigger one is an error.
const MAX_RESPONSE: usize = 64 * 1024;
/// `PATH` when the environment has none (execvp's default, plus the sbin directories).
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// A CRIU binary, driven through `criu swrk`. Cheap to clone; every request starts its own
/// CRIU process, so one `Criu` can serve concurrent requests.
///
/// All methods block (for as long as the dump or restore takes): call them from
/// `spawn_blocking` or a dedicated thread.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Criu {
    path: PathBuf,
    timeout: Duration,
    log_limit: Option<u64>,
    /// Where the empty plugin directory and the configuration naming it live.
    settings_dir: PathBuf,
}

/// The result of a successful dump.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpOutcome {
    /// The CRIU log of the dump.
    pub log: PathBuf,
    /// How long the request took, CRIU's start included.
    pub elapsed: Duration,
}

/// The result of a successful restore.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RestoreOutcome {
    /// PID of the restored root task, in the caller's PID namespace (with `rst_sibling`, a
    /// child of the caller, which must reap it).
    pub pid: Pid,
    /// The CRIU log of the restore.
    pub log: PathBuf,
    /// How long the request took, CRIU's start included.
    pub elapsed: Duration,
}

impl Default for Criu {
    /// `criu`, resolved through `PATH` at each request, with [`Criu::DEFAULT_TIMEOUT`].
    fn default() -> Self {
        Self::new("criu")
    }
}

impl Criu {
    /// How long a request may take unless [`Criu::with_timeout`] says otherwise: a dump writes
    /// the whole memory of a GPU worker (tens of GiB) to storage.
    pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30 * 60);

    /// The CRIU binary at `path`; a bare name (`criu`) is looked up in `PATH` at each request.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            timeout: Self::DEFAULT_TIMEOUT,
            log_limit: None,
            settings_dir: PathBuf::from(super::plugins::DEFAULT_SETTINGS_DIR),
        }
    }

    /// The same binary with its empty plugin directory and configuration file under `dir`
    /// instead of [`super::plugins::DEFAULT_SETTINGS_DIR`].
    #[must_use]
    pub fn with_settings_dir(self, dir: impl Into<PathBuf>) -> Self {
        Self {
            settings_dir: dir.into(),
            ..self
        }
    }

    /// Where the empty plugin directory and the configuration naming it live.
    pub fn settings_dir(&self) -> &Path {
        &self.settings_dir
    }

    /// The same binary whose restores may write at most `bytes` into any one file: a restore's
    /// CRIU writes only its log (a spinning restore can write it at tens of MB/s), so that caps
    /// the log. Dumps, which write the images, are never limited.
    #[must_use]
    pub fn with_log_limit(self, bytes: u64) -> Self {
        Self {
            log_limit: Some(bytes),
            ..self
        }
    }

    /// The same binary with another per-request timeout. When it passes, CRIU is killed
    /// (a dumped tree is then released by the kernel when its tracer dies).
    #[must_use]
    pub fn with_timeout(self, timeout: Duration) -> Self {
        Self { timeout, ..self }
    }

    /// The binary as configured.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The per-request timeout.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// CRIU's version (RPC `VERSION`).
    ///
    /// # Errors
    /// CRIU cannot be started or answers something else than a version.
    pub fn version(&self) -> Result<CriuVersion, CriuError> {
        let op = CriuOp::Version;
        let resp = self.call(
            op,
            request(rpc::CriuReqType::Version, None),
            &[],
            None,
            None,
        )?;
        let version = resp
            .version
            .ok_or_else(|| protocol(op, "no version in the response"))?;
        let number = |value: i32, what: &str| {
            u32::try_from(value).map_err(|_| protocol(op, &format!("negative {what} {value}")))
        };
        Ok(CriuVersion {
            major: number(version.major_number, "major version")?,
            minor: number(version.minor_number, "minor version")?,
            sublevel: number(version.sublevel.unwrap_or(0), "sublevel")?,
            gitid: version
                .gitid
                .filter(|gitid| !gitid.is_empty() && gitid != "0"),
        })
    }

    /// CRIU's version, if it is at least `major.minor` (warmstart needs
    /// [`super::MIN_VERSION`]); call once at startup.
    ///
    /// # Errors
    /// [`CriuError::TooOld`], or any error of [`Criu::version`].
    pub fn require_min_version(&self, major: u32, minor: u32) -> Result<CriuVersion, CriuError> {
        let found = self.version()?;
        if found.at_least(major, minor) {
            Ok(found)
        } else {
            Err(CriuError::TooOld {
                found,
                required: (major, minor),
            })
        }
    }

    /// CRIU's check of the kernel's support (RPC `CHECK`, like `criu check`). CHECK has no
    /// images directory, so CRIU logs to its stderr, which the error then quotes.
    ///
    /// # Errors
    /// [`CriuError::Failed`] when the check fails, or a transport error.
    pub fn check(&self) -> Result<(), CriuError> {
        self.call(
            CriuOp::Check,
            request(rpc::CriuReqType::Check, None),
            &[],
            None,
            None,
        )
        .map(drop)
    }

    /// Dumps the process tree rooted at `opts.pid` into `opts.images_dir` (RPC `DUMP`).
    ///
    /// # Errors
    /// Invalid options or a missing images directory (before CRIU is started), a transport
    /// error, or [`CriuError::Failed`] with the key lines of the dump log.
    ///
    /// # Guarantees
    /// Without `leave_running`, CRIU has killed the tree when this returns `Ok`; the caller
    /// still has to reap the root if it is its child (its PID stays taken until then, and a
    /// restore into the same PID namespace needs it free).
    pub fn dump(&self, opts: &DumpOpts) -> Result<DumpOutcome, CriuError> {
        self.dump_inner(opts, None)
    }

    /// [`Criu::dump`] that calls `post_dump` once the images are complete, while CRIU still
    /// holds the tree stopped (CRIU's `post-dump` notification). `post_dump` returning `true`
    /// lets CRIU finish as `opts` says (kill the tree, or resume it with `leave_running`);
    /// `false` makes CRIU resume the tree and fail the dump.
    ///
    /// # Errors
    /// As [`Criu::dump`]; a refused `post-dump` is [`CriuError::Failed`].
    ///
    /// # Guarantees
    /// If this process dies while `post_dump` runs, CRIU reads the end of the socket as a
    /// refusal: it resumes the tree (and unlocks its network) and exits. The tree is never
    /// killed unless `post_dump` returned `true`.
    pub fn dump_with_post_dump(
        &self,
        opts: &DumpOpts,
        post_dump: &mut dyn FnMut() -> bool,
    ) -> Result<DumpOutcome, CriuError> {
        self.dump_inner(opts, Some(post_dump))
    }

    fn dump_inner(
        &self,
        opts: &DumpOpts,
        post_dump: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<DumpOutcome, CriuError> {
        opts.validate()?;
        let (images, work) = open_dirs(&opts.images_dir, opts.work_dir.as_deref())?;
        let log = opts.log_path();
        let mut rpc_opts = opts.to_rpc(images.as_raw_fd(), work.as_ref().map(AsRawFd::as_raw_fd));
        rpc_opts.config_file = Some(self.config_file()?);
        rpc_opts.notify_scripts = Some(post_dump.is_some());
        let mut notify = post_dump
            .map(|hook| move |script: &str| if script == POST_DUMP { hook() } else { true });
        let start = Instant::now();
        self.call(
            CriuOp::Dump,
            request(rpc::CriuReqType::Dump, Some(rpc_opts)),
            &[],
            Some(&log),
            notify.as_mut().map(|n| n as &mut dyn FnMut(&str) -> bool),
        )?;
        let elapsed = start.elapsed();
        debug!(criu.log = %log.display(), pid = opts.pid.as_raw(), elapsed_ms = elapsed.as_millis(), "criu dump finished");
        Ok(DumpOutcome { log, elapsed })
    }

    /// Restores the tree in `opts.images_dir` (RPC `RESTORE`); returns its root PID.
    ///
    /// # Errors
    /// Invalid options or a missing images directory (before CRIU is started), a transport
    /// error, or [`CriuError::Failed`] with the key lines of the restore log.
    ///
    /// # Assumptions
    /// The dumped PIDs are free in the PID namespace the tree is restored into (CRIU restores
    /// the same PIDs), and this process's `/proc/<pid>` is visible to CRIU (it opens the
    /// images directory through it).
    pub fn restore(&self, opts: &RestoreOpts) -> Result<RestoreOutcome, CriuError> {
        opts.validate()?;
        let (images, work) = open_dirs(&opts.images_dir, opts.work_dir.as_deref())?;
        let log = opts.log_path();
        let mut rpc_opts = opts.to_rpc(
            images.as_raw_fd(),
            work.as_ref().map(AsRawFd::as_raw_fd),
            FIRST_CHILD_EXTRA_FD,
        );
        rpc_opts.config_file = Some(self.config_file()?);
        let start = Instant::now();
        let op = CriuOp::Restore;
        let resp = self.call(
            op,
            request(rpc::CriuReqType::Restore, Some(rpc_opts)),
            &opts.child_fds(),
            Some(&log),
            None,
        )?;
        let elapsed = start.elapsed();
        let raw_pid = resp
            .restore
            .map(|restore| restore.pid)
            .ok_or_else(|| protocol(op, "no restore pid in the response"))?;
        if raw_pid <= 0 {
            return Err(protocol(op, &format!("restored pid {raw_pid}")));
        }
        let pid = Pid::from_raw(raw_pid);
        debug!(criu.log = %log.display(), pid = raw_pid, elapsed_ms = elapsed.as_millis(), "criu restore finished");
        Ok(RestoreOutcome { pid, log, elapsed })
    }

    /// The configuration file a dump or restore names: CRIU's plugin directory is then the
    /// agent's empty one, whatever CRIU's default, `$CRIU_LIBS_DIR` or `/etc/criu` say.
    fn config_file(&self) -> Result<String, CriuError> {
        let path = super::plugins::prepare(&self.settings_dir)?;
        path.to_str()
            .map(str::to_owned)
            .ok_or_else(|| CriuError::PluginDir {
                path: path.clone(),
                source: io::Error::other("the path is not UTF-8"),
            })
    }

    /// Runs one request: starts `criu swrk`, sends `req`, answers notifications, returns the
    /// final successful response, and reaps CRIU.
    fn call(
        &self,
        op: CriuOp,
        req: rpc::CriuReq,
        extra_fds: &[BorrowedFd<'_>],
        log: Option<&Path>,
        notify: Option<&mut dyn FnMut(&str) -> bool>,
    ) -> Result<rpc::CriuResp, CriuError> {
        let deadline = Instant::now() + self.timeout;
        let socket_error = |step: &'static str| {
            move |errno: nix::Error| CriuError::Socket {
                op,
                step,
                source: errno.into(),
            }
        };
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(socket_error("create the socketpair"))?;
        let mut output: File = memfd_create("criu-swrk-output", MFdFlags::MFD_CLOEXEC)
            .map_err(socket_error("create the output memfd"))?
            .into();
        let child = self.spawn(op, theirs, output.as_fd(), extra_fds)?;

        let result = exchange(op, &ours, &req, deadline, notify);
        let status = child.wait(deadline);
        let mut output_lines = || {
            log::read_tail_of(&mut output)
                .map(|text| text_lines(&text))
                .unwrap_or_default()
        };
        let resp = match result {
            Ok(resp) => resp,
            Err(Exchange::TimedOut) => {
                return Err(CriuError::Timeout {
                    op,
                    timeout: self.timeout,
                    log: log.map(Path::to_path_buf),
                });
            }
            Err(Exchange::Closed) => {
                return Err(CriuError::NoResponse {
                    op,
                    status: status.unwrap_or(WaitStatus::StillAlive),
                    output: output_lines(),
                    log: log.map(Path::to_path_buf),
                });
            }
            Err(Exchange::Failed(err)) => return Err(err),
        };
        if resp.success {
            // CRIU exits 0 right after a successful answer; anything else is worth a look
            // but does not undo what it reported done.
            if !matches!(status, Some(WaitStatus::Exited(_, 0))) {
                warn!(criu.op = %op, status = ?status, "criu swrk ended abnormally after succeeding");
            }
            return Ok(resp);
        }
        let key_lines = log
            .and_then(|path| log::read_tail(path).ok())
            .map(|text| log::key_error_lines(&text))
            .filter(|lines| !lines.is_empty())
            .unwrap_or_else(output_lines);
        Err(CriuError::Failed {
            op,
            cr_errno: resp.cr_errno.filter(|errno| *errno != 0),
            message: resp.cr_errmsg.unwrap_or_default().trim().to_owned(),
            log: log.map(Path::to_path_buf),
            key_lines,
        })
    }

    /// Starts `criu swrk 3` with the descriptors laid out as the module documents.
    fn spawn(
        &self,
        op: CriuOp,
        socket: OwnedFd,
        output: BorrowedFd<'_>,
        extra_fds: &[BorrowedFd<'_>],
    ) -> Result<SwrkChild, CriuError> {
        let program = resolve_program(&self.path).map_err(|source| CriuError::Spawn {
            op,
            path: self.path.clone(),
            source,
        })?;
        let spawn_error = |source: io::Error| CriuError::Spawn {
            op,
            path: program.clone(),
            source,
        };

        let mut layout: Vec<(BorrowedFd<'_>, RawFd)> =
            vec![(output, 1), (output, 2), (socket.as_fd(), CHILD_SOCKET_FD)];
        layout.extend(
            (FIRST_CHILD_EXTRA_FD..)
                .zip(extra_fds)
                .map(|(target, fd)| (*fd, target)),
        );
        let socket_arg = CHILD_SOCKET_FD.to_string();
        // A restore dies with the thread that drives it (which waits for it): a killed agent
        // leaves no CRIU restoring on its own. A dump does not: CRIU killed mid-dump would
        // leave the tree's network locked (its iptables rules) and a parasite in it; left
        // alone, it finishes, finds the agent gone at its post-dump notification (or simply
        // resumes the tree with `leave_running`), unlocks the network and resumes the tree.
        let parent_death_signal = (op == CriuOp::Restore).then_some(Signal::SIGKILL);
        let pid = crate::sys::spawn::spawn(&SpawnSpec {
            program: &program,
            args: &[OsStr::new("swrk"), OsStr::new(&socket_arg)],
            fds: &layout,
            parent_death_signal,
            file_size_limit: self.log_limit.filter(|_| op == CriuOp::Restore),
        })
        .map_err(spawn_error)?;
        debug!(criu.op = %op, pid = pid.as_raw(), criu.path = %program.display(), "criu swrk started");
        // Our copy of the child's end goes now, so that CRIU's death reads as end-of-file.
        drop(socket);
        Ok(SwrkChild { pid, reaped: false })
    }
}

/// How an exchange of messages ended, short of a final response.
enum Exchange {
    /// CRIU closed the socket without a final response.
    Closed,
    /// The deadline passed.
    TimedOut,
    /// Anything else.
    Failed(CriuError),
}

impl From<CriuError> for Exchange {
    fn from(err: CriuError) -> Self {
        Self::Failed(err)
    }
}

/// Sends `req` and reads responses until the final one, answering `NOTIFY` messages.
fn exchange(
    op: CriuOp,
    socket: &OwnedFd,
    req: &rpc::CriuReq,
    deadline: Instant,
    mut notify: Option<&mut dyn FnMut(&str) -> bool>,
) -> Result<rpc::CriuResp, Exchange> {
    send_message(op, socket, req)?;
    let mut buf = vec![0_u8; MAX_RESPONSE];
    loop {
        let remaining = deadline.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Exchange::TimedOut);
        }
        // A zero SO_RCVTIMEO means "no timeout", so never set less than a millisecond.
        let micros = i64::try_from(remaining.as_micros())
            .unwrap_or(i64::MAX)
            .max(1000);
        setsockopt(
            socket,
            sockopt::ReceiveTimeout,
            &TimeVal::microseconds(micros),
        )
        .map_err(|errno| CriuError::Socket {
            op,
            step: "set the receive timeout",
            source: errno.into(),
        })?;
        // MSG_TRUNC makes recv return the datagram's real length, so an oversized one is
        // detected instead of silently cut.
        let len = match recv(socket.as_raw_fd(), &mut buf, MsgFlags::MSG_TRUNC) {
            Ok(0) => return Err(Exchange::Closed),
            Ok(len) => len,
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EAGAIN) => return Err(Exchange::TimedOut),
            Err(nix::Error::ECONNRESET) => return Err(Exchange::Closed),
            Err(errno) => {
                return Err(CriuError::Socket {
                    op,
                    step: "receive a response",
                    source: errno.into(),
                }
                .into());
            }
        };
        if len > buf.len() {
            return Err(protocol(op, &format!("response of {len} bytes")).into());
        }
        let resp = rpc::CriuResp::decode(&buf[..len])
            .map_err(|source| CriuError::Decode { op, source })?;
        match resp.r#type() {
            rpc::CriuReqType::Notify => {
                // Sent only with notify_scripts (on when a hook is given); answered in any
                // case so a CRIU that sends one is never left waiting.
                let script = resp
                    .notify
                    .as_ref()
                    .and_then(|n| n.script.as_deref())
                    .unwrap_or_default();
                debug!(criu.op = %op, script, "criu notify");
                let success = notify.as_mut().is_none_or(|hook| hook(script));
                let ack = rpc::CriuReq {
                    notify_success: Some(success),
                    ..request(rpc::CriuReqType::Notify, None)
                };
                send_message(op, socket, &ack)?;
            }
            kind if kind == req.r#type() => return Ok(resp),
            // CRIU answers a request it could not even parse with EMPTY (send_criu_err).
            rpc::CriuReqType::Empty if !resp.success => return Ok(resp),
            kind => {
                return Err(
                    protocol(op, &format!("response of type {}", kind.as_str_name())).into(),
                );
            }
        }
    }
}

fn send_message(op: CriuOp, socket: &OwnedFd, req: &rpc::CriuReq) -> Result<(), Exchange> {
    let bytes = req.encode_to_vec();
    loop {
        return match send(socket.as_raw_fd(), &bytes, MsgFlags::MSG_NOSIGNAL) {
            Ok(_) => Ok(()),
            Err(nix::Error::EINTR) => continue,
            Err(nix::Error::EPIPE | nix::Error::ECONNRESET) => Err(Exchange::Closed),
            Err(errno) => Err(CriuError::Socket {
                op,
                step: "send the request",
                source: errno.into(),
            }
            .into()),
        };
    }
}

/// A running `criu swrk`; killed and reaped on drop unless waited for.
#[derive(Debug)]
struct SwrkChild {
    pid: Pid,
    reaped: bool,
}

impl SwrkChild {
    /// Reaps CRIU, killing it if it is still running at `deadline` (it exits right after its
    /// final response). `None` only if waiting itself failed.
    fn wait(mut self, deadline: Instant) -> Option<WaitStatus> {
        let mut pause = Duration::from_millis(1);
        loop {
            match waitpid(self.pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => {}
                Err(nix::Error::EINTR) => continue,
                Ok(status) => {
                    self.reaped = true;
                    return Some(status);
                }
                Err(errno) => {
                    warn!(pid = self.pid.as_raw(), error = %errno, "cannot wait for criu swrk");
                    self.reaped = true;
                    return None;
                }
            }
            if Instant::now() >= deadline {
                return self.kill_and_reap();
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    fn kill_and_reap(&mut self) -> Option<WaitStatus> {
        // The PID cannot have been recycled: it stays ours until reaped below.
        if let Err(errno) = kill(self.pid, Signal::SIGKILL) {
            debug!(pid = self.pid.as_raw(), error = %errno, "cannot kill criu swrk");
        }
        self.reaped = true;
        loop {
            match waitpid(self.pid, None) {
                Err(nix::Error::EINTR) => {}
                Ok(status) => return Some(status),
                Err(_) => return None,
            }
        }
    }
}

impl Drop for SwrkChild {
    fn drop(&mut self) {
        if !self.reaped {
            self.kill_and_reap();
        }
    }
}

/// Resolves a bare program name through `PATH` (as execvp would); a name with a `/` is used
/// as given.
fn resolve_program(program: &Path) -> io::Result<PathBuf> {
    if program.as_os_str().as_bytes().contains(&b'/') {
        return Ok(program.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| DEFAULT_PATH.into());
    std::env::split_paths(&path)
        .filter(|dir| !dir.as_os_str().is_empty())
        .map(|dir| dir.join(program))
        .find(|candidate| {
            candidate
                .metadata()
                .is_ok_and(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        })
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("{} not found in PATH", program.display()),
            )
        })
}

fn open_dir(path: &Path) -> io::Result<OwnedFd> {
    nix::fcntl::open(
        path,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(io::Error::from)
}

/// Opens the images directory and the optional work directory CRIU is handed as descriptors.
fn open_dirs(images: &Path, work: Option<&Path>) -> Result<(OwnedFd, Option<OwnedFd>), CriuError> {
    let images = open_dir(images).map_err(|source| images_dir_error(images, source))?;
    let work = work
        .map(|dir| open_dir(dir).map_err(|source| work_dir_error(dir, source)))
        .transpose()?;
    Ok((images, work))
}

fn images_dir_error(path: &Path, source: io::Error) -> CriuError {
    CriuError::ImagesDir {
        path: path.to_owned(),
        source,
    }
}

fn work_dir_error(path: &Path, source: io::Error) -> CriuError {
    CriuError::WorkDir {
        path: path.to_owned(),
        source,
    }
}

fn request(kind: rpc::CriuReqType, opts: Option<rpc::CriuOpts>) -> rpc::CriuReq {
    rpc::CriuReq {
        r#type: kind as i32,
        opts,
        ..Default::default()
    }
}

fn protocol(op: CriuOp, detail: &str) -> CriuError {
    CriuError::Protocol {
        op,
        detail: detail.to_owned(),
    }
}

/// Error lines of CRIU's own output, or its last lines when none is marked as an error.
fn text_lines(text: &str) -> Vec<String> {
    let key = log::key_error_lines(text);
    if key.is_empty() {
        log::last_lines(text)
    } else {
        key
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolve_program_uses_paths_with_a_slash_as_given() {
        assert_eq!(
            resolve_program(Path::new("./criu")).expect("resolve"),
            Path::new("./criu")
        );
    }

    #[test]
    fn resolve_program_finds_sh_in_path_and_reports_missing_programs() {
        assert!(resolve_program(Path::new("sh")).expect("sh").is_absolute());
        let err = resolve_program(Path::new("warmstart-no-such-program")).expect_err("missing");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}
