//! The engine's seam for CRIU: a dump (with an optional hook CRIU calls while the tree is
//! still stopped, after the images are complete) and a restore into a placeholder container.
//! Production: [`RpcCriu`], CRIU's RPC client for the dump and the restore helper process for
//! the restore; the engine's ordering tests use a recording double.

use std::path::{Path, PathBuf};

use crate::criu::{Criu, CriuError, CriuVersion, DumpOpts};
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
}

/// The production driver: CRIU's RPC (`criu swrk`) for dumps, the restore helper process
/// (`warmstart-agent restore-helper`, which enters the placeholder and drives CRIU) for
/// restores.
#[derive(Clone, Debug)]
pub struct RpcCriu {
    criu: Criu,
    helper: PathBuf,
}

impl RpcCriu {
    /// CRIU at `criu`; restores run `helper restore-helper`.
    pub fn new(criu: impl Into<PathBuf>, helper: impl Into<PathBuf>) -> Self {
        Self {
            criu: Criu::new(criu),
            helper: helper.into(),
        }
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
        match post_dump {
            Some(hook) => self.criu.dump_with_post_dump(opts, hook).map(drop),
            None => self.criu.dump(opts).map(drop),
        }
    }

    fn restore(&self, plan: &HelperPlan) -> Result<i32, HelperError> {
        let plan = HelperPlan {
            criu: self.criu.path().to_path_buf(),
            ..plan.clone()
        };
        restore_helper::spawn_and_wait(&self.helper, &plan)
    }
}
