//! The engine's seam for CRIU: a dump (with an optional hook CRIU calls while the tree is
//! still stopped, after the images are complete) and a restore into a placeholder container.
//! Production: [`RpcCriu`], CRIU's RPC client for the dump and the restore helper process for
//! the restore; the engine's ordering tests use a recording double.

use std::path::{Path, PathBuf};

use crate::criu::{Criu, CriuError, CriuVersion, DumpOpts};
use crate::dump_progress::{dir_bytes, tree_resident_bytes};
use crate::limits::Limits;
use crate::restore_helper::HelperPlan;
use crate::restore_helper::{self, HelperError};

/// CRIU as the engine drives it. Every method blocks.
pub trait CriuDriver: Send + Sync + std::fmt::Debug {
    /// CRIU's version.
    ///
    /// # Errors
    /// [`CriuError`].
    fn version(&self) -> Result<CriuVersion, CriuError>;

    /// Dumps `opts.pid`'s tree. With `post_dump`, CRIU calls it once the images are complete
    /// while it still holds the tree stopped: `true` lets CRIU finish as `opts` says (kill the
    /// tree unless `leave_running`), `false` makes it resume the tree and fail.
    ///
    /// # Errors
    /// [`CriuError`].
    fn dump(
        &self,
        opts: &DumpOpts,
        post_dump: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<(), CriuError>;

    /// Restores an artifact into a placeholder as `plan` says; returns the restored root's PID
    /// in the placeholder's PID namespace.
    ///
    /// # Errors
    /// [`HelperError`].
    fn restore(&self, plan: &HelperPlan) -> Result<i32, HelperError>;

    /// The limits its calls run under (and the engine's staging age).
    fn limits(&self) -> Limits {
        Limits::default()
    }
}

/// The production driver: CRIU's RPC (`criu swrk`) for dumps, the restore helper process
/// (`warmstart-agent restore-helper`, which enters the placeholder and drives CRIU) for
/// restores.
#[derive(Clone, Debug)]
pub struct RpcCriu {
    criu: Criu,
    helper: PathBuf,
    limits: Limits,
}

impl RpcCriu {
    /// CRIU at `criu`; restores run `helper restore-helper`.
    pub fn new(criu: impl Into<PathBuf>, helper: impl Into<PathBuf>) -> Self {
        Self {
            criu: Criu::new(criu),
            helper: helper.into(),
            limits: Limits::default(),
        }
    }

    /// The same driver under `limits`: every dump and restore gets a deadline scaled by what it
    /// moves, and a restore's CRIU log is capped.
    #[must_use]
    pub fn with_limits(self, limits: Limits) -> Self {
        Self { limits, ..self }
    }

    /// The CRIU client.
    pub fn client(&self) -> &Criu {
        &self.criu
    }

    /// The CRIU binary.
    pub fn criu_path(&self) -> &Path {
        self.criu.path()
    }
}

impl CriuDriver for RpcCriu {
    fn version(&self) -> Result<CriuVersion, CriuError> {
        self.criu.version()
    }

    fn dump(
        &self,
        opts: &DumpOpts,
        post_dump: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<(), CriuError> {
        // The tree's resident memory is what CRIU writes (GPU memory included: the CUDA
        // checkpoint has moved it into host memory by now).
        let bytes = tree_resident_bytes(opts.pid.as_raw());
        let criu = self
            .criu
            .clone()
            .with_timeout(self.limits.criu_deadline(bytes));
        match post_dump {
            Some(hook) => criu.dump_with_post_dump(opts, hook).map(drop),
            None => criu.dump(opts).map(drop),
        }
    }

    fn restore(&self, plan: &HelperPlan) -> Result<i32, HelperError> {
        let bytes = dir_bytes(&plan.images_dir);
        let plan = HelperPlan {
            criu: self.criu.path().to_path_buf(),
            agent_pid: i32::try_from(std::process::id()).unwrap_or(i32::MAX),
            deadline_ms: u64::try_from(self.limits.criu_deadline(bytes).as_millis())
                .unwrap_or(u64::MAX),
            log_limit_bytes: self.limits.criu_log_limit_bytes(),
            ..plan.clone()
        };
        restore_helper::spawn_and_wait(&self.helper, &plan)
    }

    fn limits(&self) -> Limits {
        self.limits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_for_deadlines_are_measured() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert!(tree_resident_bytes(me) > 0);
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("pages-1.img"), vec![0u8; 5000]).unwrap();
        std::fs::write(tmp.path().join("core-1.img"), vec![0u8; 100]).unwrap();
        assert_eq!(dir_bytes(tmp.path()), 5100);
    }
}
