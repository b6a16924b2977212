//! One container the simulated node started, whichever runtime runs it: a runc container of the
//! node's own ([`Container`]) or a containerd container over CRI ([`CriContainer`]). What the
//! node and tests do with a container (status id, PID, exit, signals, exec, log, HTTP into its
//! network namespace) is here, once.

use std::ffi::OsStr;
use std::process::Output;
use std::time::Duration;

use crate::fixture::{Container, ContainerExit, EXEC_TIMEOUT, FixtureError, Result, http_exchange};

use super::cri::CriContainer;

/// A container of a simulated pod.
#[derive(Debug)]
pub enum NodeContainer {
    /// A runc container under the node's own runc root.
    Runc(Box<Container>),
    /// A containerd container, driven over CRI.
    Cri(CriContainer),
}

impl NodeContainer {
    /// The runtime's id of the container.
    #[must_use]
    pub fn id(&self) -> &str {
        match self {
            Self::Runc(c) => c.id(),
            Self::Cri(c) => c.id(),
        }
    }

    /// The id as a pod's status gives it: `runc://<id>` or `containerd://<id>`.
    #[must_use]
    pub fn status_id(&self) -> String {
        match self {
            Self::Runc(c) => format!("runc://{}", c.id()),
            Self::Cri(c) => format!("containerd://{}", c.id()),
        }
    }

    /// The host PID of the container's init process.
    #[must_use]
    pub fn pid(&self) -> u32 {
        match self {
            Self::Runc(c) => c.pid(),
            Self::Cri(c) => c.pid(),
        }
    }

    /// How the container's init process ended, once it has.
    ///
    /// # Errors
    /// The runtime cannot say (runc: this process is no subreaper; CRI: the call fails).
    pub fn try_wait(&self) -> Result<Option<ContainerExit>> {
        match self {
            Self::Runc(c) => c.try_wait(),
            Self::Cri(c) => c.try_wait(),
        }
    }

    /// Sends `signal` (`TERM`, `KILL`) to the container's init process.
    ///
    /// # Errors
    /// The container is no longer running, or the signal is not one of those.
    pub fn signal(&self, signal: &str) -> Result<()> {
        match self {
            Self::Runc(c) => c.signal(signal),
            Self::Cri(c) => c.signal(signal),
        }
    }

    /// Runs `args` in the container (`runc exec`, or CRI `ExecSync`), for at most `timeout`.
    /// A non-zero exit status is not an error here.
    ///
    /// # Errors
    /// The command cannot be started or outlives `timeout`.
    pub fn exec_timeout<I, S>(&self, args: I, timeout: Duration) -> Result<Output>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        match self {
            Self::Runc(c) => c.exec_timeout(args, timeout),
            Self::Cri(c) => c.exec(
                args.into_iter()
                    .map(|a| a.as_ref().to_string_lossy().into_owned())
                    .collect(),
                timeout,
            ),
        }
    }

    /// Runs `args` in the container and returns its stdout.
    ///
    /// # Errors
    /// As [`NodeContainer::exec_timeout`], and an error with the command's stderr when it exits
    /// non-zero.
    pub fn exec_ok<I, S>(&self, args: I) -> Result<String>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        match self {
            Self::Runc(c) => c.exec_ok(args),
            Self::Cri(c) => {
                let args: Vec<String> = args
                    .into_iter()
                    .map(|a| a.as_ref().to_string_lossy().into_owned())
                    .collect();
                let output = c.exec(args.clone(), EXEC_TIMEOUT)?;
                if output.status.success() {
                    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
                } else {
                    Err(FixtureError::Invalid(format!(
                        "container {}: ExecSync {args:?} exited with {}: {}",
                        c.id(),
                        output.status,
                        String::from_utf8_lossy(&output.stderr).trim()
                    )))
                }
            }
        }
    }

    /// What the container wrote to stdout and stderr so far (for CRI, the content of its CRI log
    /// file, as `kubectl logs` shows it).
    #[must_use]
    pub fn read_log(&self) -> String {
        match self {
            Self::Runc(c) => c.read_log(),
            Self::Cri(c) => c.read_log(),
        }
    }

    /// `GET path` on `127.0.0.1:port` inside the container's network namespace; the status
    /// code and the body.
    ///
    /// # Errors
    /// Connecting fails, or the answer is not HTTP.
    pub fn http_get(&self, port: u16, path: &str) -> Result<(u16, String)> {
        let stream = self.net_connect(port)?;
        http_exchange(
            stream,
            path,
            &format!("container {}: GET {path} on port {port}", self.id()),
        )
    }

    /// Connects to `127.0.0.1:port` inside the container's network namespace.
    ///
    /// # Errors
    /// The namespace cannot be entered, or nothing accepts.
    pub fn net_connect(&self, port: u16) -> Result<std::net::TcpStream> {
        match self {
            Self::Runc(c) => c.net_connect(port),
            Self::Cri(c) => c.net_connect(port),
        }
    }
}
