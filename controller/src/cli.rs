//! The command line of `warmstart-controller`: the user-facing commands that print the CRD,
//! hash an identity and shape Jobs and restore pods without a cluster.

use std::io::{Read, Write};
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use k8s_openapi::api::core::v1::Pod;
use kube::{CustomResourceExt, ResourceExt};
use serde::Serialize;
use thiserror::Error;
use warmstart_shared::artifact::{ArtifactLayout, PathError};
use warmstart_shared::identity::{self, IdentityError};
use warmstart_shared::job::{self, JobBuildError};
use warmstart_shared::names::DEFAULT_ARTIFACT_ROOT;
use warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE;
use warmstart_shared::{Checkpoint, CheckpointIdentity};

use crate::input::{self, InputError, Source};
use crate::restore::{RestoreShapeError, shape_restore_pod};

/// Namespace assumed for documents that name none, as kubectl does.
const DEFAULT_NAMESPACE: &str = "default";

/// warmstart cluster controller.
#[derive(Debug, Parser)]
#[command(name = "warmstart-controller", version, about, long_about = None)]
pub struct Cli {
    /// Log output format.
    #[arg(long, global = true, env = "WARMSTART_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Log output format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the cluster controller (reconciler, admission webhook, artifact GC).
    Run(Box<crate::run::RunArgs>),
    /// Delete warmstart's DaemonSets and Deployments and wait until their pods have ended (the
    /// first step of an uninstall: they leave while their RBAC still exists).
    StopWorkloads(crate::stop::StopArgs),
    /// Print a shell completion script (`source <(warmstart-controller completion bash)`).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the Checkpoint CustomResourceDefinition as YAML.
    Crd,
    /// Print the identity hash of a checkpoint identity.
    ///
    /// Reads the `spec.identity` object (or a whole Checkpoint) as YAML or JSON.
    IdentityHash {
        /// File to read; `-` or nothing reads standard input.
        file: Option<PathBuf>,
    },
    /// Print the checkpoint Job the controller would create for a Checkpoint.
    RenderJob {
        /// The Checkpoint (YAML or JSON); `-` reads standard input.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// UID of the Checkpoint, when the document has no `metadata.uid`.
        #[arg(long)]
        uid: Option<String>,
        /// Image of the entrypoint's install init container (`spec.job.entrypoint: Wrap`).
        #[arg(long, env = "WARMSTART_ENTRYPOINT_IMAGE", default_value = DEFAULT_ENTRYPOINT_IMAGE)]
        entrypoint_image: String,
    },
    /// Print a pod shaped to restore from a Ready Checkpoint, as the admission webhook does.
    RenderRestorePod {
        /// The Ready Checkpoint (`kubectl get checkpoint NAME -o yaml`).
        #[arg(long)]
        checkpoint: PathBuf,
        /// The pod, annotated with `warmstart.dev/restore-from` and
        /// `warmstart.dev/target-containers`; `-` reads standard input.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Image of the entrypoint's install init container (checkpoints taken with `Wrap`).
        #[arg(long, env = "WARMSTART_ENTRYPOINT_IMAGE", default_value = DEFAULT_ENTRYPOINT_IMAGE)]
        entrypoint_image: String,
    },
}

/// Why a command failed.
#[derive(Debug, Error)]
pub enum CliError {
    /// The input could not be read or parsed.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The identity breaks a rule.
    #[error("{source_name}: invalid identity")]
    Identity {
        /// Where the identity came from.
        source_name: Source,
        /// The rule.
        #[source]
        source: IdentityError,
    },
    /// The Checkpoint has no uid to own the Job.
    #[error(
        "checkpoint {checkpoint} has no metadata.uid, which the Job's owner reference needs: render from `kubectl get checkpoint -o yaml`, or pass --uid"
    )]
    NoUid {
        /// `<namespace>/<name>`.
        checkpoint: String,
    },
    /// The artifact location is unsafe.
    #[error("invalid artifact location")]
    Location(#[source] PathError),
    /// The Job builder refused the Checkpoint.
    #[error("cannot build the checkpoint Job")]
    Job(#[source] JobBuildError),
    /// The pod cannot be shaped.
    #[error(transparent)]
    Restore(#[from] RestoreShapeError),
    /// The result could not be written.
    #[error("cannot write the output")]
    Output(#[source] std::io::Error),
    /// The result could not be serialised.
    #[error("cannot serialise the output as YAML")]
    Yaml(#[source] serde_norway::Error),
    /// The controller failed to start or stopped with an error.
    #[error(transparent)]
    Run(#[from] crate::run::RunError),
    /// The workloads could not be stopped.
    #[error(transparent)]
    Stop(#[from] crate::stop::StopError),
    /// The async runtime could not be built.
    #[error("cannot start the async runtime")]
    Runtime(#[source] std::io::Error),
}

impl CliError {
    /// 2 for bad input (the user can fix the document), 1 for failures.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Output(_) | Self::Yaml(_) | Self::Run(_) | Self::Stop(_) | Self::Runtime(_) => 1,
            Self::Input(InputError::Read { .. }) => 1,
            _ => 2,
        }
    }
}

impl Cli {
    /// Runs the command with the process's standard input.
    ///
    /// # Errors
    /// See [`CliError`].
    pub fn run(&self, stdout: &mut dyn Write) -> Result<(), CliError> {
        self.run_with(&mut std::io::stdin().lock(), stdout)
    }

    /// Runs the command with the given streams.
    ///
    /// # Errors
    /// See [`CliError`].
    pub fn run_with(&self, stdin: &mut dyn Read, stdout: &mut dyn Write) -> Result<(), CliError> {
        match &self.command {
            Command::Run(args) => {
                let runtime = tokio::runtime::Builder::new_multi_thread()
                    .enable_all()
                    .build()
                    .map_err(CliError::Runtime)?;
                Ok(runtime.block_on(crate::run::run((**args).clone()))?)
            }
            Command::StopWorkloads(args) => {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .map_err(CliError::Runtime)?;
                Ok(runtime.block_on(crate::stop::stop_workloads(args.clone()))?)
            }
            Command::Completion { shell } => {
                use clap::CommandFactory;
                clap_complete::generate(
                    *shell,
                    &mut Cli::command(),
                    "warmstart-controller",
                    stdout,
                );
                Ok(())
            }
            Command::Crd => write_yaml(stdout, &Checkpoint::crd()),
            Command::IdentityHash { file } => {
                let source = Source::from_arg(file.as_deref());
                let value = input::parse_one(&source, &input::read_text(&source, stdin)?)?;
                // A whole Checkpoint is accepted too: take its spec.identity.
                let value = match value.get("spec").and_then(|s| s.get("identity")) {
                    Some(identity) if value.get("kind").is_some() => identity.clone(),
                    _ => value,
                };
                let identity: CheckpointIdentity =
                    input::typed(&source, "checkpoint identity", value)?;
                let hash = identity::identity_hash(&identity).map_err(|source_err| {
                    CliError::Identity {
                        source_name: source.clone(),
                        source: source_err,
                    }
                })?;
                writeln!(stdout, "{hash}").map_err(CliError::Output)
            }
            Command::RenderJob {
                file,
                uid,
                entrypoint_image,
            } => {
                let source = Source::from_arg(Some(file));
                let mut checkpoint: Checkpoint = read_typed(&source, stdin, "Checkpoint")?;
                if checkpoint.metadata.namespace.is_none() {
                    checkpoint.metadata.namespace = Some(DEFAULT_NAMESPACE.to_owned());
                }
                if let Some(uid) = uid {
                    checkpoint.metadata.uid = Some(uid.clone());
                }
                if checkpoint.metadata.uid.is_none() {
                    return Err(CliError::NoUid {
                        checkpoint: format!(
                            "{}/{}",
                            checkpoint.namespace().unwrap_or_default(),
                            checkpoint.name_any()
                        ),
                    });
                }
                let hash = identity::identity_hash(&checkpoint.spec.identity).map_err(|e| {
                    CliError::Identity {
                        source_name: source.clone(),
                        source: e,
                    }
                })?;
                // The location is relative to the artifact root (each program mounts the
                // volume where it likes); the root here only checks the path is safe.
                let layout = ArtifactLayout::new(
                    DEFAULT_ARTIFACT_ROOT,
                    &checkpoint.namespace().unwrap_or_default(),
                    &hash,
                )
                .map_err(CliError::Location)?;
                let location = layout.relative();
                let job =
                    job::build_checkpoint_job(&checkpoint, &hash, &location, entrypoint_image)
                        .map_err(CliError::Job)?;
                write_yaml(stdout, &job)
            }
            Command::RenderRestorePod {
                checkpoint,
                file,
                entrypoint_image,
            } => {
                let checkpoint_source = Source::File(checkpoint.clone());
                let mut checkpoint: Checkpoint =
                    read_typed(&checkpoint_source, stdin, "Checkpoint")?;
                if checkpoint.metadata.namespace.is_none() {
                    checkpoint.metadata.namespace = Some(DEFAULT_NAMESPACE.to_owned());
                }
                let pod_source = Source::from_arg(Some(file));
                let pod: Pod = read_typed(&pod_source, stdin, "Pod")?;
                let namespace = pod
                    .metadata
                    .namespace
                    .clone()
                    .unwrap_or_else(|| DEFAULT_NAMESPACE.to_owned());
                let shaped = shape_restore_pod(&pod, &namespace, &checkpoint, entrypoint_image)?;
                write_yaml(stdout, &shaped)
            }
        }
    }
}

fn read_typed<T: serde::de::DeserializeOwned + Serialize>(
    source: &Source,
    stdin: &mut dyn Read,
    what: &'static str,
) -> Result<T, CliError> {
    let value = input::parse_one(source, &input::read_text(source, stdin)?)?;
    Ok(input::typed(source, what, value)?)
}

fn write_yaml(stdout: &mut dyn Write, value: &impl Serialize) -> Result<(), CliError> {
    let text = serde_norway::to_string(value).map_err(CliError::Yaml)?;
    stdout.write_all(text.as_bytes()).map_err(CliError::Output)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn run(args: &[&str], stdin: &[u8]) -> Result<String, CliError> {
        let cli = Cli::try_parse_from(args).unwrap();
        let mut out = Vec::new();
        cli.run_with(&mut &stdin[..], &mut out)?;
        Ok(String::from_utf8(out).unwrap())
    }

    // Bad input is the user's to fix (exit 2), whatever is wrong with it.
    #[test]
    fn undecodable_oversized_and_deep_input_exit_2() {
        let render = ["warmstart-controller", "render-job", "-f", "-"];
        for (stdin, needle) in [
            (
                b"kind: Checkpoint\nmetadata: {name: \xff}\n".to_vec(),
                "not UTF-8",
            ),
            (
                vec![b'#'; crate::input::MAX_DOCUMENT_BYTES + 1],
                "larger than",
            ),
            (
                format!("{}1{}", "[".repeat(100), "]".repeat(100)).into_bytes(),
                "nests deeper than 64 levels",
            ),
            (
                b"kind: Checkpoint\nkind: Checkpoint\n".to_vec(),
                "duplicate key",
            ),
        ] {
            let err = run(&render, &stdin).unwrap_err();
            assert!(err.to_string().contains(needle), "{err}");
            assert_eq!(err.exit_code(), 2, "{err}");
        }
    }

    #[test]
    fn render_job_refuses_unknown_fields() {
        let checkpoint = r"
apiVersion: warmstart.dev/v1alpha1
kind: Checkpoint
metadata: {name: llama, namespace: default, uid: 0b9e-uid}
spec:
  identity: {model: m, backendFramework: vllm}
  job:
    podTemplateSpec:
      spec:
        containers:
        - {name: main, image: vllm:1}
    backoffLimitt: 3
";
        let render = ["warmstart-controller", "render-job", "-f", "-"];
        let err = run(&render, checkpoint.as_bytes()).unwrap_err();
        assert_eq!(
            err.to_string(),
            "standard input is not a valid Checkpoint: unknown field spec.job.backoffLimitt"
        );
        assert_eq!(err.exit_code(), 2);
        let fixed = checkpoint.replace("backoffLimitt", "backoffLimit");
        assert!(
            run(&render, fixed.as_bytes())
                .unwrap()
                .contains("kind: Job")
        );
    }
}
