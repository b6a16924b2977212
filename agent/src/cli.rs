//! The agent's local command line, for an operator on a node: `check`, `checkpoint`,
//! `restore`, `inspect`. Every command ends with a table of phase timings; failures print one
//! line naming what is wrong (and CRIU's log on CRIU failures).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::{Args, Parser, Subcommand};
use thiserror::Error;
use warmstart_shared::artifact::{Manifest, PublishedError, SourceInfo};
use warmstart_shared::identity::is_identity_hash;

use crate::criu::Criu;
use crate::engine::{CheckpointOptions, ContainerRef, Engine, EngineError, Runtimes};
use crate::progress::{Operation, StderrLine};
pub use crate::report::{LogFormat, LogJournal};
use crate::restore::{self, RestoreError};
use crate::runtime::cri::CriOptions;
use crate::runtime::runc::{DEFAULT_RUNC_ROOT, RuncResolver};
use crate::seams::criu::RpcCriu;
use crate::seams::cuda::CudaSlot;
use crate::timings::Timings;

/// Where the kubelet keeps its state on a node set up the usual way (its PodResources socket
/// is under it).
const DEFAULT_KUBELET_ROOT: &str = "/var/lib/kubelet";

/// warmstart node agent: checkpoints and restores containers with CRIU and the CUDA driver.
#[derive(Debug, Parser)]
#[command(name = "warmstart-agent", version, about, long_about = None)]
pub struct Cli {
    /// Options shared by every command.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Options shared by every command.
#[derive(Debug, Args)]
pub struct GlobalArgs {
    /// The CRIU binary (4.x).
    #[arg(long, global = true, env = "WARMSTART_CRIU", default_value = "criu")]
    pub criu: PathBuf,
    /// The runc binary.
    #[arg(
        long = "runc-binary",
        global = true,
        env = "WARMSTART_RUNC",
        default_value = "runc"
    )]
    pub runc_binary: PathBuf,
    /// runc's state root.
    #[arg(long, global = true, env = "WARMSTART_RUNC_ROOT", default_value = DEFAULT_RUNC_ROOT)]
    pub runc_root: PathBuf,
    /// Log output format (default: journald when `JOURNAL_STREAM` is set, else text).
    #[arg(long, global = true, env = "WARMSTART_LOG_FORMAT", value_enum)]
    pub log_format: Option<LogFormat>,
    /// Also write entries to the node's journal (`/run/systemd/journal/socket`), besides
    /// standard error: `auto` when the journal answers and standard error is not the journal.
    #[arg(
        long,
        global = true,
        env = "WARMSTART_LOG_JOURNAL",
        value_enum,
        default_value_t = LogJournal::Auto
    )]
    pub log_journal: LogJournal,
    /// The CUDA driver.
    #[command(flatten)]
    pub cuda: crate::cuda::CudaArgs,
    /// Deadlines, log cap and staging age.
    #[command(flatten)]
    pub limits: crate::limits::Limits,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print a shell completion script (`source <(warmstart-agent completion bash)`).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Check that this node can checkpoint and restore (CRIU, kernel, cgroups, tools, GPU).
    Check {
        /// Print the checks and the GPU inventory as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Checkpoint a container into an artifact directory.
    Checkpoint(CheckpointArgs),
    /// Restore an artifact into a running placeholder container.
    Restore(RestoreArgs),
    /// Show an artifact's manifest; `--verify` re-hashes every file.
    Inspect {
        /// The artifact directory.
        dir: PathBuf,
        /// Re-hash every file against the manifest.
        #[arg(long)]
        verify: bool,
        /// Print the manifest, the verification and the timings as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Run as the node agent of a cluster (the DaemonSet's command).
    Run(Box<crate::cluster::RunArgs>),
    /// GPU state of single processes through the CUDA driver: the node's GPUs, a process's
    /// state, lock + checkpoint, restore + unlock.
    #[command(subcommand)]
    Cuda(CudaCommand),
    /// Internal: the restore helper process (reads its plan on standard input).
    #[command(hide = true, name = "restore-helper")]
    RestoreHelper,
    /// Internal: runs one CUDA driver call (request on standard input, answer on standard
    /// output), in a process the agent can kill when the call hangs.
    #[command(hide = true, name = "cuda-helper")]
    CudaHelper,
}

/// `cuda` subcommands.
#[derive(Debug, Subcommand)]
pub enum CudaCommand {
    /// The driver version and the GPUs.
    Inventory {
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// The CUDA processes of a tree and their states.
    State {
        /// Root of the tree (host PID).
        #[arg(long)]
        pid: u32,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Lock, then checkpoint one process (its device memory moves to host memory).
    Checkpoint {
        /// The process (host PID).
        #[arg(long)]
        pid: u32,
        /// The driver-side lock timeout, in seconds.
        #[arg(long, default_value_t = 10)]
        lock_timeout: u64,
    },
    /// Give back the GPU state of every process of a tree left locked or checkpointed (by a
    /// checkpoint whose agent was killed): restore, then unlock each. Running ones are left.
    Release {
        /// Root of the tree (host PID), e.g. the container's init process.
        #[arg(long)]
        pid: u32,
    },
    /// Restore, then unlock one checkpointed process.
    Restore {
        /// The process (host PID).
        #[arg(long)]
        pid: u32,
        /// GPU remapping, `GPU-old=GPU-new`, repeatable (driver 13.0+).
        #[arg(long = "gpu-map")]
        gpu_map: Vec<String>,
    },
}

/// `checkpoint` arguments.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("target").required(true).args(["runc", "cri", "pid"])))]
pub struct CheckpointArgs {
    /// The container, by runc id.
    #[arg(long)]
    pub runc: Option<String>,
    /// The container, by CRI id (over --cri-socket).
    #[arg(long)]
    pub cri: Option<String>,
    /// A bare process tree, by host PID.
    #[arg(long)]
    pub pid: Option<i32>,
    /// The artifact directory to create (must not exist; its parent must).
    #[arg(long)]
    pub output: PathBuf,
    /// Kill the workload after a successful dump (default: it keeps running).
    #[arg(long)]
    pub stop: bool,
    /// Identity hash to record (16 hex characters); default: derived from the container id.
    #[arg(long)]
    pub hash: Option<String>,
    /// Dump established TCP connections too.
    #[arg(long)]
    pub tcp_established: bool,
    /// Print the result and the phase timings as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
    /// The CRI socket for --cri.
    #[arg(
        long,
        env = "WARMSTART_CRI_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    pub cri_socket: PathBuf,
}

/// `restore` arguments.
#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("into").required(true).args(["into_runc", "into_cri"])))]
pub struct RestoreArgs {
    /// The artifact directory.
    #[arg(long)]
    pub artifact: PathBuf,
    /// The placeholder container, by runc id.
    #[arg(long)]
    pub into_runc: Option<String>,
    /// The placeholder container, by CRI id.
    #[arg(long)]
    pub into_cri: Option<String>,
    /// The CRI socket for --into-cri.
    #[arg(
        long,
        env = "WARMSTART_CRI_SOCKET",
        default_value = "/run/containerd/containerd.sock"
    )]
    pub cri_socket: PathBuf,
    /// Where CRIU's restore log goes, kept (created mode 0700 if missing; refused if another
    /// user can change it). Default: a new private directory under the system temp dir, removed
    /// afterwards unless the restore failed with an error that names the log.
    #[arg(long)]
    pub log_dir: Option<PathBuf>,
    /// Print the result and the phase timings as JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Why a command failed.
#[derive(Debug, Error)]
pub enum CliError {
    /// A bad argument value.
    #[error("{0}")]
    Usage(String),
    /// The engine failed or refused.
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// Reading or verifying an artifact for `inspect` failed.
    #[error(transparent)]
    Restore(#[from] RestoreError),
    /// Required preflight items failed.
    #[error("{0} required check(s) failed")]
    Check(usize),
    /// Writing output failed.
    #[error("cannot write output")]
    Output(#[source] std::io::Error),
    /// Cluster mode stopped with an error.
    #[error(transparent)]
    Run(#[from] crate::cluster::RunError),
    /// The restore helper restored nothing (its answer is on standard output).
    #[error(transparent)]
    Helper(#[from] crate::restore_helper::HelperFailure),
    /// The async runtime could not be started.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
    /// A CUDA driver operation failed.
    #[error(transparent)]
    Cuda(#[from] crate::cuda::CudaError),
    /// Giving GPU state back failed.
    #[error(transparent)]
    Gpu(#[from] crate::gpu::GpuError),
    /// This user may not look at what was asked about.
    #[error("{0}")]
    Permission(String),
}

impl CliError {
    /// 2 for usage errors, 1 for failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Usage(_) => 2,
            _ => 1,
        }
    }
}

impl Cli {
    /// The log format in effect ([`LogFormat::resolve`]).
    pub fn log_format(&self) -> LogFormat {
        LogFormat::resolve(
            self.global.log_format,
            std::env::var_os("JOURNAL_STREAM").as_deref(),
        )
    }

    /// The default log filter: lifecycle (`info`) for the long-running cluster mode, warnings
    /// only for one-shot commands, whose results go to standard output.
    pub fn default_log_filter(&self) -> &'static str {
        if matches!(self.command, Command::Run(_)) {
            "info"
        } else {
            "warn"
        }
    }

    /// Runs the command, printing results to `out`.
    ///
    /// The restore helper runs on this thread alone (it forks); every other command runs on a
    /// current-thread async runtime with the engine's blocking pool.
    ///
    /// # Errors
    /// [`CliError`].
    pub fn run(&self, out: &mut dyn Write) -> Result<(), CliError> {
        if let Command::RestoreHelper = self.command {
            let answer = crate::restore_helper::run_from_stdin();
            serde_json::to_writer(&mut *out, &answer)
                .map_err(|e| CliError::Output(std::io::Error::other(e)))?;
            return match answer {
                crate::restore_helper::HelperAnswer::Restored { .. } => Ok(()),
                crate::restore_helper::HelperAnswer::Failed(failure) => Err(failure.into()),
            };
        }
        match &self.command {
            Command::Completion { shell } => {
                use clap::CommandFactory;
                clap_complete::generate(*shell, &mut Cli::command(), "warmstart-agent", out);
                return Ok(());
            }
            // Blocking driver calls, each in a killable helper process.
            Command::Cuda(command) => return run_cuda(&self.global.cuda, command, out),
            Command::CudaHelper => {
                return match crate::cuda::helper::run_helper(&mut std::io::stdin().lock(), out) {
                    0 => Ok(()),
                    _ => Err(CliError::Usage(
                        "cuda-helper: unreadable request or unwritable answer".to_owned(),
                    )),
                };
            }
            _ => {}
        }
        if let Command::Run(args) = &self.command {
            // Cluster mode runs its own multi-threaded runtime.
            let g = &self.global;
            return crate::cluster::run_blocking(
                args,
                self.cuda_slot(),
                g.criu.clone(),
                g.runc_binary.clone(),
                g.runc_root.clone(),
                g.limits,
            )
            .map_err(CliError::Run);
        }
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(CliError::Runtime)?
            .block_on(self.run_async(out))
    }

    fn engine(&self) -> Result<Engine, CliError> {
        let g = &self.global;
        let helper = std::env::current_exe()
            .map_err(|e| CliError::Usage(format!("cannot find this program's path: {e}")))?;
        Ok(Engine::new(
            Arc::new(RpcCriu::new(&g.criu, helper).with_limits(g.limits)),
            self.cuda_slot(),
            Runtimes {
                runc: RuncResolver::new(&g.runc_binary, &g.runc_root),
                cri_socket: self.cri_socket(),
                cri: CriOptions {
                    // On a Kubernetes node, the kubelet says which GPUs a pod's container has.
                    pod_resources: Some(crate::podresources::socket_under(Path::new(
                        DEFAULT_KUBELET_ROOT,
                    )))
                    .filter(|socket| socket.exists()),
                    ..CriOptions::default()
                },
            },
        ))
    }

    /// The CUDA driver of `--cuda-library`, opened when a GPU workload first needs it.
    fn cuda_slot(&self) -> CudaSlot {
        match self.global.cuda.options() {
            Ok(options) => CudaSlot::driver(options),
            Err(err) => {
                tracing::warn!(error = %err, "no CUDA helper: GPU state cannot be handled");
                CudaSlot::none()
            }
        }
    }

    fn cri_socket(&self) -> PathBuf {
        match &self.command {
            Command::Checkpoint(args) => args.cri_socket.clone(),
            Command::Restore(args) => args.cri_socket.clone(),
            _ => PathBuf::from(crate::runtime::cri::CONTAINERD_SOCKET),
        }
    }

    async fn run_async(&self, out: &mut dyn Write) -> Result<(), CliError> {
        match &self.command {
            Command::Check { json } => self.check(*json, out).await,
            Command::Checkpoint(args) => self.checkpoint(args, out).await,
            Command::Restore(args) => self.restore(args, out).await,
            Command::Inspect { dir, verify, json } => self.inspect(dir, *verify, *json, out).await,
            Command::Run(_)
            | Command::Completion { .. }
            | Command::RestoreHelper
            | Command::Cuda(_)
            | Command::CudaHelper => Ok(()),
        }
    }

    /// `check`: the node's preflight, as a table or JSON; an error when a required item fails.
    async fn check(&self, json: bool, out: &mut dyn Write) -> Result<(), CliError> {
        let g = &self.global;
        let criu = Criu::new(&g.criu);
        let runc = g.runc_binary.clone();
        let cuda_options = g.cuda.options();
        let (items, cuda) = crate::engine::blocking(move || {
            let cuda = cuda_options
                .map_err(|e| crate::cuda::CudaError::Unavailable {
                    reason: format!("cannot find this program's path: {e}"),
                })
                .and_then(crate::cuda::CudaDriver::open)
                .map(|driver| driver.inventory());
            (crate::preflight::run(&criu, &runc, &cuda), cuda)
        })
        .await;
        let failed = items.iter().filter(|i| !i.ok && i.required).count();
        if json {
            let checks: Vec<serde_json::Value> = items
                .iter()
                .map(|i| {
                    serde_json::json!({
                        "name": i.name, "verdict": i.verdict(), "required": i.required,
                        "detail": i.detail, "advice": if i.ok { "" } else { i.advice },
                    })
                })
                .collect();
            let doc = serde_json::json!({
                "checks": checks,
                "cuda": cuda.as_ref().ok(),
                "ok": failed == 0,
            });
            writeln!(out, "{doc:#}").map_err(CliError::Output)?;
            return if failed > 0 {
                Err(CliError::Check(failed))
            } else {
                Ok(())
            };
        }
        for item in &items {
            let line = if item.ok || item.advice.is_empty() {
                format!("{:<4} {:<12} {}", item.verdict(), item.name, item.detail)
            } else {
                format!(
                    "{:<4} {:<12} {} — {}",
                    item.verdict(),
                    item.name,
                    item.detail,
                    item.advice
                )
            };
            writeln!(out, "{line}").map_err(CliError::Output)?;
        }
        if failed > 0 {
            return Err(CliError::Check(failed));
        }
        Ok(())
    }

    /// `checkpoint`: capture a container or process tree into a published artifact.
    async fn checkpoint(&self, args: &CheckpointArgs, out: &mut dyn Write) -> Result<(), CliError> {
        let stderr_is_terminal = std::io::stderr().is_terminal();
        let output = absolute(&args.output)?;
        check_output_parent(&output)?;
        let target = source_ref(args)?;
        let identity_hash = match &args.hash {
            Some(h) if is_identity_hash(h) => Some(h.clone()),
            Some(h) => {
                return Err(CliError::Usage(format!(
                    "--hash {h:?} is not 16 lowercase hex characters"
                )));
            }
            None => None,
        };
        let options = CheckpointOptions {
            output,
            identity_hash,
            source: SourceInfo::default(),
            stop: args.stop,
            tcp_established: args.tcp_established,
        };
        let (progress, line) =
            StderrLine::reporter(crate::progress::shows_line(args.json, stderr_is_terminal));
        let report = self.engine()?.checkpoint(&target, options, progress).await;
        drop(line);
        let report = report?;
        if args.json {
            let doc = serde_json::json!({
                "artifact": report.dir,
                "container": report.manifest.source.container_id,
                "identityHash": report.manifest.identity_hash,
                "manifestDigest": report.manifest.digest,
                "files": report.manifest.files.len(),
                "bytes": report.manifest.total_size(),
                "stopped": report.stopped,
                "cuda": report.manifest.cuda,
                "timings": report.timings.as_seconds(),
                "totalSeconds": report.timings.total().as_secs_f64(),
                "besidePhases": report.timings.beside_phases(),
            });
            return writeln!(out, "{doc:#}").map_err(CliError::Output);
        }
        writeln!(
            out,
            "checkpoint of {} published at {} ({} files, {} bytes, hash {})",
            report.manifest.source.container_id,
            report.dir.display(),
            report.manifest.files.len(),
            report.manifest.total_size(),
            report.manifest.identity_hash
        )
        .map_err(CliError::Output)?;
        write!(out, "{}", report.timings.table()).map_err(CliError::Output)
    }

    /// `restore`: restore an artifact into a running placeholder container.
    async fn restore(&self, args: &RestoreArgs, out: &mut dyn Write) -> Result<(), CliError> {
        let g = &self.global;
        let stderr_is_terminal = std::io::stderr().is_terminal();
        let into = if let Some(id) = &args.into_runc {
            ContainerRef::Runc(id.clone())
        } else if let Some(id) = &args.into_cri {
            ContainerRef::Cri(id.clone())
        } else {
            return Err(CliError::Usage(
                "--into-runc or --into-cri is required".into(),
            ));
        };
        let artifact = absolute(&args.artifact)?;
        let (dir, limits) = (artifact.clone(), g.limits);
        crate::engine::blocking(move || finish_interrupted(&dir, &limits)).await;
        let log_dir = LogDir::for_restore(args.log_dir.as_deref())?;
        let (progress, line) =
            StderrLine::reporter(crate::progress::shows_line(args.json, stderr_is_terminal));
        let restored = match self.engine() {
            Ok(engine) => {
                let order = crate::engine::RestoreOrder {
                    artifact: artifact.clone(),
                    into: into.clone(),
                    log_dir: log_dir.path.clone(),
                    manifest_digest: None,
                    control: crate::restore::ControlDir::OfPlaceholder,
                };
                let restored = engine.restore(order, progress).await;
                drop(line);
                restored
            }
            Err(err) => {
                log_dir.finish(None);
                return Err(err);
            }
        };
        let report = match restored {
            Ok(report) => report,
            Err(err) => {
                log_dir.finish(Some(&crate::report::error_chain(&err)));
                return Err(err.into());
            }
        };
        let log = log_dir.finish(None).then_some(&report.log);
        if args.json {
            let doc = serde_json::json!({
                "artifact": artifact,
                "placeholder": into.to_string(),
                "pid": report.pid,
                "restoreComplete": report.signalled,
                "criuLog": log,
                "timings": report.timings.as_seconds(),
                "totalSeconds": report.timings.total().as_secs_f64(),
                "besidePhases": report.timings.beside_phases(),
            });
            return writeln!(out, "{doc:#}").map_err(CliError::Output);
        }
        writeln!(
            out,
            "restored {} into {} (pid {} in its PID namespace{}); {}",
            artifact.display(),
            into,
            report.pid,
            if report.signalled {
                ", restore-complete written"
            } else {
                ""
            },
            log.map_or_else(
                || "CRIU log not kept (--log-dir keeps it)".to_owned(),
                |log| format!("CRIU log {}", log.display())
            )
        )
        .map_err(CliError::Output)?;
        write!(out, "{}", report.timings.table()).map_err(CliError::Output)
    }

    /// `inspect`: an artifact's manifest, verified with `--verify`.
    async fn inspect(
        &self,
        dir: &Path,
        verify: bool,
        json: bool,
        out: &mut dyn Write,
    ) -> Result<(), CliError> {
        let g = &self.global;
        let stderr_is_terminal = std::io::stderr().is_terminal();
        let dir = absolute(dir)?;

        let (progress, line) =
            StderrLine::reporter(verify && crate::progress::shows_line(json, stderr_is_terminal));
        let limits = g.limits;
        let (manifest, timings) = crate::engine::blocking(move || {
            finish_interrupted(&dir, &limits);
            let mut timings = Timings::default();
            let manifest = if verify {
                let (meter, _watch) = progress.meter(Operation::Inspect, "verifying");
                timings.measure("verify", || restore::verify_artifact(&dir, &meter))
            } else {
                timings.measure("read", || read_manifest(&dir))
            };
            (manifest, timings)
        })
        .await;
        drop(line);
        let manifest = manifest?;
        if json {
            let doc = serde_json::json!({
                "manifest": manifest,
                "verified": verify,
                "timings": timings.as_seconds(),
                "totalSeconds": timings.total().as_secs_f64(),
                "besidePhases": timings.beside_phases(),
            });
            return writeln!(out, "{doc:#}").map_err(CliError::Output);
        }
        for (key, value) in restore::summary(&manifest) {
            writeln!(out, "{key:<14} {value}").map_err(CliError::Output)?;
        }
        for m in &manifest.mounts {
            writeln!(
                out,
                "mount          {:<9} {} ({})",
                format!("{:?}", m.treatment),
                m.destination,
                m.fstype
            )
            .map_err(CliError::Output)?;
        }
        if verify {
            writeln!(out, "verified       every file matches its SHA-256")
                .map_err(CliError::Output)?;
        }
        write!(out, "{}", timings.table()).map_err(CliError::Output)
    }
}

fn source_ref(args: &CheckpointArgs) -> Result<ContainerRef, CliError> {
    if let Some(id) = &args.runc {
        Ok(ContainerRef::Runc(id.clone()))
    } else if let Some(id) = &args.cri {
        Ok(ContainerRef::Cri(id.clone()))
    } else if let Some(p) = args.pid {
        Ok(ContainerRef::Pid(p))
    } else {
        Err(CliError::Usage(
            "one of --runc, --cri or --pid is required".into(),
        ))
    }
}

/// An artifact that is not there may be a sealed capture an interrupted `checkpoint --stop` left
/// beside it: that is verified and published first, so it is read like any other.
fn finish_interrupted(dir: &std::path::Path, limits: &crate::limits::Limits) {
    if std::fs::symlink_metadata(dir).is_err() {
        crate::checkpoint::recover_interrupted(dir, limits.staging_max_age());
    }
}

fn read_manifest(dir: &std::path::Path) -> Result<Manifest, RestoreError> {
    // Read as hostile input: no link followed, a regular file, bounded.
    warmstart_shared::artifact::read_manifest(dir).map_err(|e| match e {
        PublishedError::Manifest(source) => RestoreError::Manifest {
            path: dir.to_path_buf(),
            source,
        },
        PublishedError::Path(source) => RestoreError::UnsafePath {
            path: dir.to_path_buf(),
            source,
        },
        PublishedError::Files(source) => RestoreError::Files {
            path: dir.to_path_buf(),
            source,
        },
        source @ PublishedError::Missing { .. } => RestoreError::Incomplete {
            path: dir.to_path_buf(),
            source,
        },
    })
}

/// `checkpoint --output` names a directory to create in an existing one: a typo in the parent
/// is refused rather than created as a new tree.
fn check_output_parent(output: &std::path::Path) -> Result<(), CliError> {
    let Some(parent) = output.parent().filter(|p| !p.as_os_str().is_empty()) else {
        return Ok(());
    };
    match std::fs::metadata(parent) {
        Ok(meta) if meta.is_dir() => Ok(()),
        Ok(_) => Err(CliError::Usage(format!(
            "--output {}: {} is not a directory",
            output.display(),
            parent.display()
        ))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Err(CliError::Usage(format!(
            "--output {}: the directory {} does not exist; create it first",
            output.display(),
            parent.display()
        ))),
        Err(err) => Err(CliError::Usage(format!(
            "--output {}: cannot inspect {}: {err}",
            output.display(),
            parent.display()
        ))),
    }
}

/// Where a `restore` puts CRIU's log: the directory the operator named (kept), or a new
/// private one (see [`crate::logdir`]).
struct LogDir {
    path: PathBuf,
    temporary: bool,
}

impl LogDir {
    fn for_restore(chosen: Option<&std::path::Path>) -> Result<Self, CliError> {
        Ok(match chosen {
            // Prepared (created or checked) only once the restore runs: a refusal creates
            // nothing.
            Some(dir) => Self {
                path: absolute(dir)?,
                temporary: false,
            },
            None => Self {
                path: crate::logdir::private("warmstart-restore-")
                    .map_err(|e| CliError::Usage(crate::report::error_chain(&e)))?,
                temporary: true,
            },
        })
    }

    /// Done with the restore; `failure` is its error's text. A temporary directory is removed
    /// unless that error names the log in it. Returns whether the directory remains.
    fn finish(self, failure: Option<&str>) -> bool {
        if !self.temporary {
            return true;
        }
        let log = self.path.join(warmstart_shared::names::RESTORE_LOG);
        if failure.is_some_and(|text| text.contains(&log.display().to_string())) {
            return true;
        }
        if let Err(err) = std::fs::remove_dir_all(&self.path) {
            tracing::warn!(dir = %self.path.display(), error = %err, "cannot remove the restore's log directory");
        }
        false
    }
}

fn absolute(path: &std::path::Path) -> Result<PathBuf, CliError> {
    std::path::absolute(path).map_err(|e| CliError::Usage(format!("{}: {e}", path.display())))
}

/// Refuses a tree with a process whose memory map this user may not read: whether it uses
/// CUDA cannot be told, which must be said, never printed as "no CUDA process".
fn readable_tree(pid: u32) -> Result<(), CliError> {
    let tree = i32::try_from(pid)
        .map(crate::runtime::stat::descendants)
        .unwrap_or_default();
    for p in &tree {
        if let Err(e) = std::fs::read_to_string(format!("/proc/{p}/maps"))
            && e.kind() == std::io::ErrorKind::PermissionDenied
        {
            return Err(CliError::Permission(format!(
                "cannot read /proc/{p}/maps (pid {p} of the tree of {pid}): {e}; whether it uses CUDA cannot be told (run as root)"
            )));
        }
    }
    Ok(())
}

/// Runs a `cuda` subcommand.
fn run_cuda(
    args: &crate::cuda::CudaArgs,
    command: &CudaCommand,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    use std::time::{Duration, Instant};
    if let CudaCommand::State { pid, .. } = command {
        readable_tree(*pid)?;
    }
    let options = args
        .options()
        .map_err(|e| CliError::Usage(format!("cannot find this executable: {e}")))?;
    let driver = crate::cuda::CudaDriver::open(options)?;
    match command {
        CudaCommand::Inventory { json } => cuda_inventory(&driver, *json, out),
        CudaCommand::State { pid, json } => {
            let found = driver.discover(*pid)?;
            if *json {
                let list: Vec<_> = found
                    .iter()
                    .map(|p| serde_json::json!({"pid": p.pid, "restoreTid": p.restore_tid, "state": p.state.to_string()}))
                    .collect();
                return w(out, serde_json::Value::Array(list).to_string());
            }
            for p in &found {
                w(out, format!("pid {}  {}", p.pid, p.state))?;
            }
            Ok(())
        }
        CudaCommand::Checkpoint { pid, lock_timeout } => {
            let t = Instant::now();
            driver.lock(*pid, Duration::from_secs(*lock_timeout))?;
            let lock = t.elapsed();
            let t = Instant::now();
            if let Err(e) = driver.checkpoint(*pid) {
                // Never leave the process locked: a failed checkpoint stays LOCKED.
                if let Err(undo) = driver.unlock(*pid) {
                    tracing::error!(pid, error = %undo, "cannot unlock after a failed checkpoint");
                }
                return Err(e.into());
            }
            let checkpoint = t.elapsed();
            w(
                out,
                format!(
                    "lock_ms={} checkpoint_ms={}",
                    lock.as_millis(),
                    checkpoint.as_millis()
                ),
            )
        }
        CudaCommand::Release { pid } => cuda_release(&driver, *pid, out),
        CudaCommand::Restore { pid, gpu_map } => cuda_restore(&driver, *pid, gpu_map, out),
    }
}

/// One line of a `cuda` command's output.
fn w(out: &mut dyn Write, text: String) -> Result<(), CliError> {
    writeln!(out, "{text}").map_err(CliError::Output)
}

/// `cuda inventory`: the driver and its GPUs.
fn cuda_inventory(
    driver: &crate::cuda::CudaDriver,
    json: bool,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let inv = driver.inventory();
    if json {
        let text = serde_json::to_string_pretty(&inv)
            .map_err(|e| CliError::Output(std::io::Error::other(e)))?;
        return w(out, text);
    }
    w(
        out,
        format!(
            "driver  {} ({})",
            inv.driver_version_text(),
            inv.driver_version
        ),
    )?;
    for (i, gpu) in inv.gpus.iter().enumerate() {
        w(
            out,
            format!(
                "gpu {i}   {}  {}  {} MiB",
                gpu.uuid,
                gpu.name,
                gpu.memory_bytes >> 20
            ),
        )?;
    }
    Ok(())
}

/// `cuda release`: every process of the tree that holds its GPU state gets it back.
fn cuda_release(
    driver: &crate::cuda::CudaDriver,
    pid: u32,
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let root =
        i32::try_from(pid).map_err(|_| CliError::Usage(format!("--pid {pid} is not a PID")))?;
    if !std::path::Path::new(&format!("/proc/{root}")).exists() {
        return Err(CliError::Usage(format!("--pid {pid}: no such process")));
    }
    let tree: Vec<u32> = crate::runtime::stat::descendants(root)
        .into_iter()
        .filter_map(|p| u32::try_from(p).ok())
        .collect();
    let released = crate::gpu::give_back_tree(driver, &tree)?;
    if released.is_empty() {
        return w(
            out,
            format!("no process of the tree of {pid} holds its GPU state"),
        );
    }
    for p in released {
        w(out, format!("pid {p}  released (restored and unlocked)"))?;
    }
    Ok(())
}

/// `cuda restore`: restore and unlock one process, with `--gpu-map` pairs.
fn cuda_restore(
    driver: &crate::cuda::CudaDriver,
    pid: u32,
    gpu_map: &[String],
    out: &mut dyn Write,
) -> Result<(), CliError> {
    let map = gpu_map
        .iter()
        .map(|pair| {
            pair.split_once('=')
                .map(|(a, b)| (a.to_owned(), b.to_owned()))
                .ok_or_else(|| CliError::Usage(format!("--gpu-map {pair:?} is not OLD=NEW")))
        })
        .collect::<Result<Vec<_>, _>>()?;
    // A stopped process (left stopped by `criu restore --leave-stopped`) stays
    // stopped: only its restore thread is woken for the two calls.
    let tids = driver
        .probe(&[pid])?
        .into_iter()
        .map(|p| (p.pid, p.restore_tid))
        .collect();
    let mut timings = crate::timings::Timings::default();
    crate::gpu::restore_then_unlock(driver, &[pid], &tids, |_| map.clone(), &mut timings)?;
    let ms = |name: &str| {
        timings
            .phases()
            .iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, d)| d.as_millis())
    };
    w(
        out,
        format!(
            "restore_ms={} unlock_ms={}",
            ms("cuda-restore"),
            ms("cuda-unlock")
        ),
    )
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn completion_scripts_cover_every_command() {
        let cli = Cli::try_parse_from(["warmstart-agent", "completion", "bash"]).unwrap();
        let mut out = Vec::new();
        cli.run(&mut out).unwrap();
        let script = String::from_utf8(out).unwrap();
        for command in ["checkpoint", "restore", "inspect", "run", "check"] {
            assert!(script.contains(command), "{command} missing");
        }
        assert!(Cli::try_parse_from(["warmstart-agent", "completion", "tcsh"]).is_err());
    }

    // A typo in the parent of --output used to create a new directory tree there.
    #[test]
    fn checkpoint_into_a_missing_directory_is_refused_not_created() {
        let tmp = tempfile::tempdir().unwrap();
        let missing = tmp.path().join("typo");
        let output = missing.join("art");
        let mut sleeper = std::process::Command::new("sleep")
            .arg("1000")
            .spawn()
            .unwrap();
        let pid = sleeper.id().to_string();
        let cli = Cli::try_parse_from([
            "warmstart-agent",
            "--criu",
            "/bin/false",
            "checkpoint",
            "--pid",
            &pid,
            "--output",
            output.to_str().unwrap(),
        ])
        .unwrap();
        let result = cli.run(&mut Vec::new());
        let _ = sleeper.kill();
        let _ = sleeper.wait();
        let err = result.unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "--output {}: the directory {} does not exist; create it first",
                output.display(),
                missing.display()
            )
        );
        assert_eq!(err.exit_code(), 2);
        assert!(!missing.exists());
    }

    #[test]
    fn local_hashes_look_like_identity_hashes() {
        assert!(is_identity_hash(&crate::engine::local_hash("runc://x")));
    }
}
