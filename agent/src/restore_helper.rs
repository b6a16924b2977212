//! The restore helper: a short-lived `warmstart-agent restore-helper` process that puts a CRIU
//! restore inside a placeholder container. It runs single-threaded (so forking is sound) and:
//!
//! 1. pins the placeholder's namespaces and stdio by opening them, then checks the placeholder's
//!    start time so a recycled PID is never entered;
//! 2. joins the placeholder's PID namespace (`setns` affects its children) and forks;
//! 3. the child, now inside that PID namespace, takes a private copy of the agent's mount
//!    namespace and mounts a fresh `/proc` there (so CRIU and every program it runs come from
//!    the agent's filesystem, never from the container's), joins the placeholder's cgroups,
//!    and drives `criu restore` with the placeholder's root, network namespace (inherited fd),
//!    UTS and IPC namespaces (pinned fds) and stdio pipes (inherited fds);
//! 4. the restored tree outlives CRIU and the helper: its root is reparented to the
//!    placeholder's init, in the placeholder's namespaces and cgroups.
//!
//! The plan comes as JSON on standard input; the result is JSON on standard output.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::path::PathBuf;

use nix::mount::{MsFlags, mount};
use nix::sched::{CloneFlags, setns, unshare};
use thiserror::Error;

use crate::checkpoint::{NETNS_KEY, RESTORE_LOG};
use crate::criu::{
    Criu, CriuError, ExtMount, InheritFd, JoinNs, ManageCgroupsMode, NamespaceKind, NsFile,
    RestoreOpts,
};
use crate::restore::{HelperPlan, HelperResult};
use crate::runtime::stat::start_time;
use crate::sys::fork::{Forked, fork};

/// Why the helper failed.
#[derive(Debug, Error)]
pub enum HelperError {
    /// The plan could not be read.
    #[error("cannot read the restore plan")]
    Plan(#[source] serde_json::Error),
    /// Reading standard input failed.
    #[error("cannot read standard input")]
    Stdin(#[source] std::io::Error),
    /// The placeholder changed or vanished.
    #[error("placeholder pid {0} exited or was replaced before the restore")]
    Placeholder(i32),
    /// Opening a namespace or fd of the placeholder failed.
    #[error("cannot open {path}")]
    Open {
        /// The path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A namespace or mount operation failed.
    #[error("{op} failed")]
    Sys {
        /// The operation.
        op: &'static str,
        /// The errno.
        #[source]
        source: nix::Error,
    },
    /// Joining a cgroup failed.
    #[error("cannot join cgroup {path}")]
    Cgroup {
        /// The cgroup.procs file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// CRIU failed.
    #[error(transparent)]
    Criu(#[from] CriuError),
    /// The forked child failed; its message.
    #[error("{0}")]
    Child(String),
    /// Forking failed.
    #[error("cannot fork the restore helper")]
    Fork(#[source] std::io::Error),
}

fn open(path: String) -> Result<OwnedFd, HelperError> {
    File::open(&path)
        .map(OwnedFd::from)
        .map_err(|source| HelperError::Open {
            path: PathBuf::from(path),
            source,
        })
}

/// Reads the plan from standard input and runs it. Call only from the helper process.
///
/// # Errors
/// [`HelperError`].
pub fn run_from_stdin() -> Result<HelperResult, HelperError> {
    let mut input = Vec::new();
    std::io::stdin()
        .read_to_end(&mut input)
        .map_err(HelperError::Stdin)?;
    let plan: HelperPlan = serde_json::from_slice(&input).map_err(HelperError::Plan)?;
    run(&plan)
}

/// Runs a plan (see the module docs for the order of steps).
///
/// # Errors
/// [`HelperError`].
pub fn run(plan: &HelperPlan) -> Result<HelperResult, HelperError> {
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
        return Err(HelperError::Placeholder(pid));
    }
    setns(&pid_ns, CloneFlags::CLONE_NEWPID).map_err(|source| HelperError::Sys {
        op: "setns into the placeholder's PID namespace",
        source,
    })?;
    let (mut reader, writer) = std::io::pipe().map_err(HelperError::Fork)?;
    match fork().map_err(HelperError::Fork)? {
        Forked::Child => {
            drop(reader);
            let outcome = in_namespace(plan, net_ns, uts_ns, ipc_ns, stdio);
            let mut writer = writer;
            let code = match outcome {
                Ok(result) => {
                    let _ = serde_json::to_writer(&mut writer, &result);
                    0
                }
                Err(err) => {
                    let _ = write!(writer, "{}", error_chain(&err));
                    1
                }
            };
            drop(writer);
            crate::sys::fork::exit_child(code)
        }
        Forked::Parent(child) => {
            drop(writer);
            let mut answer = String::new();
            let _ = reader.read_to_string(&mut answer);
            let status = crate::sys::fork::wait(child).map_err(HelperError::Fork)?;
            if status == 0 {
                serde_json::from_str(&answer).map_err(HelperError::Plan)
            } else {
                Err(HelperError::Child(answer))
            }
        }
    }
}

fn in_namespace(
    plan: &HelperPlan,
    net_ns: OwnedFd,
    uts_ns: OwnedFd,
    ipc_ns: OwnedFd,
    stdio: Vec<(String, OwnedFd)>,
) -> Result<HelperResult, HelperError> {
    let sys = |op| move |source| HelperError::Sys { op, source };
    unshare(CloneFlags::CLONE_NEWNS).map_err(sys("unshare the mount namespace"))?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_PRIVATE,
        None::<&str>,
    )
    .map_err(sys("make the mount namespace private"))?;
    mount(
        Some("proc"),
        "/proc",
        Some("proc"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        None::<&str>,
    )
    .map_err(sys("mount /proc of the placeholder's PID namespace"))?;
    for dir in &plan.cgroups {
        let procs = dir.join("cgroup.procs");
        std::fs::write(&procs, b"0").map_err(|source| HelperError::Cgroup {
            path: procs.clone(),
            source,
        })?;
    }
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
    let o = &plan.options;
    let opts = RestoreOpts {
        work_dir: Some(plan.work_dir.clone()),
        log_file: RESTORE_LOG.to_owned(),
        tcp_established: o.tcp_established,
        file_locks: o.file_locks,
        ext_unix_sk: o.ext_unix_sk,
        shell_job: o.shell_job,
        manage_cgroups_mode: ManageCgroupsMode::Ignore,
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
        join_ns: vec![
            JoinNs {
                ns: NamespaceKind::Uts,
                file: NsFile::Fd(uts_ns),
            },
            JoinNs {
                ns: NamespaceKind::Ipc,
                file: NsFile::Fd(ipc_ns),
            },
        ],
        ..RestoreOpts::new(&plan.images_dir)
    };
    let outcome = Criu::new(&plan.criu).restore(&opts)?;
    Ok(HelperResult {
        pid: outcome.pid.as_raw(),
    })
}

/// An error and its sources on one line.
pub fn error_chain(err: &dyn std::error::Error) -> String {
    let mut message = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
