//! warmstart's install manifests as the tools render them: `kubectl kustomize` of `deploy/` and
//! `helm template` of the chart in `deploy/helm/warmstart`, with the Helm that
//! `scripts/build-helm.sh` builds. Test infrastructure only: nothing is contacted.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use thiserror::Error;

/// The chart, relative to the repository.
pub const CHART: &str = "deploy/helm/warmstart";

/// Why manifests could not be rendered.
#[derive(Debug, Error)]
pub enum RenderError {
    /// A tool could not be started.
    #[error("{tool}: {source}")]
    Spawn {
        tool: String,
        source: std::io::Error,
    },
    /// A tool refused: what it printed.
    #[error("{command} failed: {stderr}")]
    Refused { command: String, stderr: String },
    /// Its output is not a YAML stream of objects.
    #[error("{command}: output is not YAML: {reason}")]
    Parse { command: String, reason: String },
}

/// The repository root.
#[must_use]
pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The objects of a YAML stream (empty documents left out).
///
/// # Errors
/// A document is not YAML.
pub fn parse_stream(text: &str) -> Result<Vec<Value>, String> {
    serde_norway::Deserializer::from_str(text)
        .map(|doc| serde::Deserialize::deserialize(doc).map_err(|e| e.to_string()))
        .filter(|v| !matches!(v, Ok(Value::Null)))
        .collect()
}

fn output(mut command: Command, shown: String) -> Result<String, RenderError> {
    let out = command.output().map_err(|source| RenderError::Spawn {
        tool: shown.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(RenderError::Refused {
            command: shown,
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `kubectl kustomize <dir>` (relative to the repository).
///
/// # Errors
/// kubectl fails or prints something else than objects.
pub fn kustomize(dir: &str) -> Result<Vec<Value>, RenderError> {
    let shown = format!("kubectl kustomize {dir}");
    let mut command = Command::new("kubectl");
    command.arg("kustomize").arg(repo().join(dir));
    let text = output(command, shown.clone())?;
    parse_stream(&text).map_err(|reason| RenderError::Parse {
        command: shown,
        reason,
    })
}

/// The Helm binary `make helm-build` left in its cache (`scripts/build-helm.sh --cached-only`).
///
/// # Errors
/// None is cached: the error says to run `make helm-build`.
pub fn helm() -> Result<PathBuf, RenderError> {
    let mut command = Command::new("bash");
    command
        .arg(repo().join("scripts/build-helm.sh"))
        .arg("--cached-only");
    let path = output(command, "scripts/build-helm.sh --cached-only".to_owned())?;
    Ok(PathBuf::from(
        path.lines().last().unwrap_or_default().trim(),
    ))
}

/// Runs helm with `args` in the repository root and returns what it printed.
///
/// # Errors
/// Helm is not built or refuses (its message in the error).
pub fn helm_run(args: &[&str]) -> Result<String, RenderError> {
    let mut command = Command::new(helm()?);
    command.args(args).current_dir(repo());
    output(command, format!("helm {}", args.join(" ")))
}

/// `helm template warmstart <chart> -n warmstart-system` with `--set` for each of `values`
/// (`key=value`).
///
/// # Errors
/// The chart does not render (Helm's message, e.g. a `fail` of the chart) or is not YAML.
pub fn helm_template(values: &[&str]) -> Result<Vec<Value>, RenderError> {
    let mut args = vec![
        "template",
        "warmstart",
        CHART,
        "--namespace",
        "warmstart-system",
    ];
    for v in values {
        args.push("--set");
        args.push(v);
    }
    let text = helm_run(&args)?;
    parse_stream(&text).map_err(|reason| RenderError::Parse {
        command: format!("helm {}", args.join(" ")),
        reason,
    })
}

/// The object of `kind` named `name`, if rendered.
#[must_use]
pub fn find<'a>(objects: &'a [Value], kind: &str, name: &str) -> Option<&'a Value> {
    objects
        .iter()
        .find(|o| o["kind"] == kind && o["metadata"]["name"] == name)
}
