//! Whether an artifact captured on one node can be restored on this one, as far as the kernel
//! and CRIU go (the GPU model, driver and memory are [`crate::gpu::plan_restore`]'s, the mounts
//! the restore's own): checked before anything is claimed, so a mismatched node refuses with
//! the reason and the pod cold starts.

use thiserror::Error;
use warmstart_shared::artifact::Manifest;

use crate::criu::CriuVersion;

/// What a restore needs to know of this node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFacts {
    /// The kernel release (`uname -r`).
    pub kernel: String,
    /// The CRIU the restore runs, when it answered.
    pub criu: Option<CriuVersion>,
}

impl NodeFacts {
    /// This node's kernel, and `criu`.
    pub fn here(criu: Option<CriuVersion>) -> Self {
        Self {
            kernel: kernel_release(),
            criu,
        }
    }
}

/// This node's kernel release (`uname -r`), as a manifest records it.
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Why this node cannot restore an artifact.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum Mismatch {
    /// Another kernel line: CRIU restores what the source kernel set up (namespaces, cgroups,
    /// vDSO, socket options) only on a kernel that has the same.
    #[error(
        "the artifact was captured on kernel {artifact}; this node runs {node}: a restore needs the same kernel major.minor"
    )]
    Kernel {
        /// The source node's kernel.
        artifact: String,
        /// This node's.
        node: String,
    },
    /// An older CRIU than the one that dumped: it may not read the images.
    #[error(
        "the artifact was dumped by CRIU {artifact}; this node's CRIU {node} is older and may not read its images"
    )]
    Criu {
        /// The dumping CRIU.
        artifact: String,
        /// This node's.
        node: String,
    },
}

/// Checks that `manifest`'s artifact can be restored on the node `node` describes. What the
/// manifest does not record (an empty version) is not checked.
///
/// # Errors
/// [`Mismatch`], saying what differs.
pub fn check(manifest: &Manifest, node: &NodeFacts) -> Result<(), Mismatch> {
    let recorded = &manifest.criu.kernel_version;
    if !recorded.is_empty() && kernel_line(recorded) != kernel_line(&node.kernel) {
        return Err(Mismatch::Kernel {
            artifact: recorded.clone(),
            node: node.kernel.clone(),
        });
    }
    let dumped = &manifest.criu.version;
    if let (Some(dumped_by), Some(here)) = (criu_numbers(dumped), &node.criu)
        && (here.major, here.minor, here.sublevel) < dumped_by
    {
        return Err(Mismatch::Criu {
            artifact: dumped.clone(),
            node: here.to_string(),
        });
    }
    Ok(())
}

/// `6.18` of `6.18.0-1-amd64`; the whole release when it does not start with two numbers.
fn kernel_line(release: &str) -> String {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .take(2)
        .map(str::parse::<u32>);
    match (numbers.next(), numbers.next()) {
        (Some(Ok(major)), Some(Ok(minor))) => format!("{major}.{minor}"),
        _ => release.to_owned(),
    }
}

/// `(4, 2, 1)` of `4.2.1`, `(4, 2, 0)` of `4.2`; `None` when not numbers.
fn criu_numbers(version: &str) -> Option<(u32, u32, u32)> {
    let mut parts = version.split('.').map(str::parse::<u32>);
    let major = parts.next()?.ok()?;
    let minor = parts.next()?.ok()?;
    let sublevel = match parts.next() {
        Some(n) => n.ok()?,
        None => 0,
    };
    Some((major, minor, sublevel))
}

#[cfg(test)]
mod tests {
    use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, SourceInfo};

    use super::*;

    fn manifest(criu: &str, kernel: &str) -> Manifest {
        Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: "0123456789abcdef".into(),
            created_at: "2026-12-05T00:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo {
                version: criu.into(),
                kernel_version: kernel.into(),
                ..CriuInfo::default()
            },
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: Default::default(),
            chunk_bytes: 0,
            files: vec![],
            digest: String::new(),
        }
    }

    fn node(kernel: &str, criu: (u32, u32, u32)) -> NodeFacts {
        NodeFacts {
            kernel: kernel.into(),
            criu: Some(CriuVersion {
                major: criu.0,
                minor: criu.1,
                sublevel: criu.2,
                gitid: None,
            }),
        }
    }

    #[test]
    fn the_same_kernel_line_and_a_criu_as_new_restore() {
        let m = manifest("4.2.1", "6.18.0-1-amd64");
        assert_eq!(check(&m, &node("6.18.0-1-amd64", (4, 2, 1))), Ok(()));
        assert_eq!(check(&m, &node("6.18.5-2-cloud-amd64", (4, 2, 1))), Ok(()));
        assert_eq!(check(&m, &node("6.18.0", (4, 3, 0))), Ok(()));
        assert_eq!(check(&m, &node("6.18.0", (5, 0, 0))), Ok(()));
        // What the manifest does not record is not checked.
        assert_eq!(check(&manifest("", ""), &node("5.4.0", (3, 0, 0))), Ok(()));
    }

    #[test]
    fn another_kernel_line_or_an_older_criu_is_refused_saying_what_differs() {
        let m = manifest("4.2.1", "6.18.0-1-amd64");
        let err = check(&m, &node("6.19.0-1-amd64", (4, 2, 1))).unwrap_err();
        assert_eq!(
            err.to_string(),
            "the artifact was captured on kernel 6.18.0-1-amd64; this node runs 6.19.0-1-amd64: a restore needs the same kernel major.minor"
        );
        assert!(check(&m, &node("5.18.0", (4, 2, 1))).is_err());
        let err = check(&m, &node("6.18.0-1-amd64", (4, 2, 0))).unwrap_err();
        assert_eq!(
            err,
            Mismatch::Criu {
                artifact: "4.2.1".into(),
                node: "4.2".into()
            }
        );
        assert!(check(&m, &node("6.18.0", (3, 19, 0))).is_err());
        // A release that is not numbers must match exactly.
        let odd = manifest("4.2.1", "custom-kernel");
        assert!(check(&odd, &node("custom-kernel", (4, 2, 1))).is_ok());
        assert!(check(&odd, &node("6.18.0", (4, 2, 1))).is_err());
    }
}
