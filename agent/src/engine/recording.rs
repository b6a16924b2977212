//! Recording doubles for the engine's ordering tests (no root, no CRIU): every call of the
//! CRIU and CUDA seams is written, in order, into one [`Journal`].

use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use crate::criu::{CriuError, CriuOp, CriuVersion, DumpOpts};
use crate::restore_helper::HelperPlan;
use crate::restore_helper::{HelperError, HelperFailure, HelperStep};

use crate::seams::criu::CriuDriver;

/// The calls, in order.
#[derive(Debug, Default)]
pub struct Journal(Mutex<Vec<String>>);

impl Journal {
    /// Appends one entry.
    pub fn push(&self, entry: impl Into<String>) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(entry.into());
    }

    /// Everything so far.
    pub fn entries(&self) -> Vec<String> {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

/// What the recording CRIU does when asked to dump.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DumpBehaviour {
    /// Writes an image file and succeeds.
    Succeed,
    /// Fails before the images are complete.
    Fail,
}

/// Records dumps and restores; a dump writes one small image file and calls the post-dump
/// hook like CRIU does, then "kills" or "resumes" the tree (recorded).
#[derive(Debug)]
pub struct RecordingCriu {
    /// Where calls are recorded.
    pub journal: Arc<Journal>,
    /// What a dump does.
    pub dump: DumpBehaviour,
    /// The PID a restore reports.
    pub restored_pid: i32,
    /// Every dump's options, for assertions.
    pub dumps: Mutex<Vec<DumpOpts>>,
    /// Every restore's plan, for assertions.
    pub restores: Mutex<Vec<HelperPlan>>,
    /// A checkpoint's final directory (the hook's answer is journalled with whether its
    /// staging directory is sealed and whether it is published), or a restore's control
    /// directory (the restore is journalled with the files it holds).
    pub watch: Option<PathBuf>,
    /// Whether a restore fails.
    pub fail_restore: bool,
    /// The version it answers (4.2.1 unless set).
    pub version: CriuVersion,
}

impl RecordingCriu {
    /// A double that succeeds.
    pub fn new(journal: Arc<Journal>) -> Self {
        Self {
            journal,
            dump: DumpBehaviour::Succeed,
            restored_pid: 1,
            dumps: Mutex::new(Vec::new()),
            restores: Mutex::new(Vec::new()),
            watch: None,
            fail_restore: false,
            version: CriuVersion {
                major: 4,
                minor: 2,
                sublevel: 1,
                gitid: None,
            },
        }
    }
}

impl CriuDriver for RecordingCriu {
    fn version(&self) -> Result<CriuVersion, CriuError> {
        Ok(self.version.clone())
    }

    fn dump(
        &self,
        opts: &DumpOpts,
        post_dump: Option<&mut dyn FnMut() -> bool>,
    ) -> Result<(), CriuError> {
        self.dumps
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(opts.clone());
        self.journal.push("criu dump");
        let failed = |message: &str| CriuError::Failed {
            op: CriuOp::Dump,
            cr_errno: None,
            message: message.to_owned(),
            log: Some(opts.log_path()),
            key_lines: Vec::new(),
        };
        if self.dump == DumpBehaviour::Fail {
            // As CRIU does: the reason is in its log, in the images directory.
            let _ = std::fs::write(opts.log_path(), "Error (criu/seize.c:1): Can't seize 7\n");
            self.journal.push("criu resume");
            return Err(failed("dump failed"));
        }
        std::fs::write(opts.images_dir.join("core-1.img"), b"image")
            .map_err(|e| failed(&e.to_string()))?;
        let accepted = post_dump.is_none_or(|hook| {
            self.journal.push("criu post-dump");
            let accepted = hook();
            if let Some(output) = &self.watch {
                let sealed = opts
                    .images_dir
                    .parent()
                    .is_some_and(|staging| staging.join(FILE_MANIFEST).is_file());
                self.journal.push(format!(
                    "post-dump answered {accepted}: staging {}sealed, {}published",
                    if sealed { "" } else { "not " },
                    if output.join(FILE_COMPLETE).exists() {
                        ""
                    } else {
                        "not "
                    },
                ));
            }
            accepted
        });
        if !accepted {
            self.journal.push("criu resume");
            return Err(failed("post-dump refused"));
        }
        self.journal.push(if opts.leave_running {
            "criu resume"
        } else {
            "criu kill"
        });
        Ok(())
    }

    fn restore(&self, plan: &HelperPlan) -> Result<i32, HelperError> {
        self.restores
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(plan.clone());
        let control: Vec<String> = self
            .watch
            .as_ref()
            .and_then(|dir| std::fs::read_dir(dir).ok())
            .map(|entries| {
                let mut names: Vec<String> = entries
                    .flatten()
                    .map(|e| e.file_name().to_string_lossy().into_owned())
                    .collect();
                names.sort();
                names
            })
            .unwrap_or_default();
        self.journal
            .push(format!("criu restore; control dir holds {control:?}"));
        if self.fail_restore {
            return Err(HelperError::Failed(HelperFailure {
                step: HelperStep::Criu,
                path: None,
                errno: None,
                criu: None,
                status: None,
                killed: None,
            }));
        }
        Ok(self.restored_pid)
    }
}
