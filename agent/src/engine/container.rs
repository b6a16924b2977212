//! One way to name a container, and one place that resolves it: `runc://<id>`, `cri://<id>`
//! or `pid://<host pid>` through the runtime resolvers the engine holds.

use std::fmt;
use std::path::PathBuf;
use std::str::FromStr;

use crate::runtime::cri::{CriClient, CriOptions};
use crate::runtime::runc::RuncResolver;
use crate::runtime::{ContainerInfo, ResolveError, pid};

/// A container as the engine is asked about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContainerRef {
    /// By runc id (runc state root).
    Runc(String),
    /// By CRI id or unique prefix (containerd, CRI-O).
    Cri(String),
    /// A bare process tree, by host PID.
    Pid(i32),
}

impl fmt::Display for ContainerRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Runc(id) => write!(f, "runc://{id}"),
            Self::Cri(id) => write!(f, "cri://{id}"),
            Self::Pid(pid) => write!(f, "pid://{pid}"),
        }
    }
}

impl FromStr for ContainerRef {
    type Err = ResolveError;

    /// `runc://<id>`, `cri://<id>` (also `containerd://<id>` and `cri-o://<id>`, as a pod's
    /// status names its containers) or `pid://<pid>`.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = || ResolveError::InvalidId(s.to_owned());
        let (scheme, rest) = s.split_once("://").ok_or_else(invalid)?;
        if rest.is_empty() {
            return Err(invalid());
        }
        match scheme {
            "runc" => Ok(Self::Runc(rest.to_owned())),
            "cri" | "containerd" | "cri-o" => Ok(Self::Cri(rest.to_owned())),
            "pid" => rest.parse().map(Self::Pid).map_err(|_| invalid()),
            _ => Err(invalid()),
        }
    }
}

/// The container runtimes the engine can resolve through.
#[derive(Clone, Debug)]
pub struct Runtimes {
    /// runc (binary and state root).
    pub runc: RuncResolver,
    /// The CRI socket.
    pub cri_socket: PathBuf,
    /// CRI resolver settings.
    pub cri: CriOptions,
}

impl Runtimes {
    /// Resolves `reference` (async: the CRI client is async; runc and `/proc` reads run on the
    /// blocking pool).
    ///
    /// # Errors
    /// [`ResolveError`].
    pub async fn resolve(&self, reference: &ContainerRef) -> Result<ContainerInfo, ResolveError> {
        match reference {
            ContainerRef::Runc(id) => {
                let (runc, id) = (self.runc.clone(), id.clone());
                super::blocking(move || runc.resolve(&id)).await
            }
            ContainerRef::Pid(p) => {
                let p = *p;
                super::blocking(move || pid::resolve(p)).await
            }
            ContainerRef::Cri(id) => {
                let resolved = async {
                    CriClient::connect(&self.cri_socket, self.cri.clone())
                        .await?
                        .resolve(id)
                        .await
                };
                resolved.await.map_err(|err| match err {
                    // Connecting knows no container: name the one asked for.
                    ResolveError::Runtime {
                        tool,
                        id: unnamed,
                        detail,
                    } if unnamed.is_empty() => ResolveError::Runtime {
                        tool,
                        id: id.clone(),
                        detail,
                    },
                    other => other,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn references_round_trip_and_bad_ones_are_named() {
        for text in ["runc://abc", "cri://0123abcd", "pid://42"] {
            let parsed: ContainerRef = text.parse().unwrap();
            assert_eq!(parsed.to_string(), text);
        }
        for pod_status_id in ["containerd://0123abcd", "cri-o://0123abcd"] {
            assert_eq!(
                pod_status_id.parse::<ContainerRef>().unwrap(),
                ContainerRef::Cri("0123abcd".to_owned())
            );
        }
        for bad in ["abc", "runc://", "pid://x", "docker://abc"] {
            let err = bad.parse::<ContainerRef>().unwrap_err();
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[tokio::test]
    async fn a_bare_pid_resolves_from_async_code() {
        let runtimes = Runtimes {
            runc: RuncResolver::new("runc", "/nonexistent"),
            cri_socket: PathBuf::from("/nonexistent/cri.sock"),
            cri: CriOptions::default(),
        };
        let me = i32::try_from(std::process::id()).unwrap();
        let info = runtimes.resolve(&ContainerRef::Pid(me)).await.unwrap();
        assert_eq!(info.pid, me);
        let err = runtimes
            .resolve(&ContainerRef::Cri("abc".to_owned()))
            .await
            .unwrap_err();
        let text = crate::report::error_chain(&err);
        assert!(text.contains("abc") && text.contains("cri.sock"), "{text}");
    }
}
