//! `warmstart-controller stop-workloads`: the first step of an uninstall. Deletes warmstart's
//! DaemonSets and Deployments in its namespace (foreground: each goes only after its pods have
//! ended) and waits for them, so the agents take their label off their nodes and the leader
//! releases its Lease while their RBAC still exists. The Helm chart runs it as a pre-delete hook;
//! kustomize users run the equivalent `kubectl delete --cascade=foreground --wait`.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::{DaemonSet, Deployment};
use kube::api::{DeleteParams, ListParams, PropagationPolicy};
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use thiserror::Error;
use tracing::info;

/// Flags of `stop-workloads`.
#[derive(Debug, Clone, clap::Args)]
pub struct StopArgs {
    /// warmstart's namespace.
    #[arg(long, env = "POD_NAMESPACE")]
    pub namespace: String,
    /// The label selector of warmstart's DaemonSets and Deployments.
    #[arg(long, default_value = "app.kubernetes.io/part-of=warmstart")]
    pub selector: String,
    /// How long their pods may take to end, in seconds (the agent's grace period is 60 s).
    #[arg(long, env = "WARMSTART_STOP_TIMEOUT_SECONDS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_seconds: u64,
}

/// Why the workloads could not be stopped.
#[derive(Debug, Error)]
pub enum StopError {
    /// No client configuration.
    #[error("cannot configure a client of the API server")]
    Client(#[source] kube::Error),
    /// A request was refused.
    #[error("cannot {verb} {kind} in namespace {namespace}")]
    Api {
        /// `list` or `delete`.
        verb: &'static str,
        /// `daemonsets` or `deployments`.
        kind: &'static str,
        /// The namespace.
        namespace: String,
        /// The API server's answer.
        #[source]
        source: kube::Error,
    },
    /// Pods still running at the deadline.
    #[error("after {seconds}s these have not ended: {left}")]
    Timeout {
        /// The deadline.
        seconds: u64,
        /// What is left (`daemonset/warmstart-agent`, ...).
        left: String,
    },
}

/// Deletes the workloads matching `args.selector` with foreground propagation and waits until
/// they (and so their pods) are gone.
///
/// # Errors
/// See [`StopError`].
pub async fn stop_workloads(args: StopArgs) -> Result<(), StopError> {
    let client = Client::try_default().await.map_err(StopError::Client)?;
    let started = Instant::now();
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &args.namespace);
    let deployments: Api<Deployment> = Api::namespaced(client, &args.namespace);
    let deadline = started + Duration::from_secs(args.timeout_seconds);
    loop {
        let mut left = remove(&daemonsets, &args, "daemonsets").await?;
        left.extend(remove(&deployments, &args, "deployments").await?);
        if left.is_empty() {
            info!(
                namespace = %args.namespace,
                seconds = started.elapsed().as_secs_f64(),
                "warmstart's workloads and their pods have ended"
            );
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(StopError::Timeout {
                seconds: args.timeout_seconds,
                left: left.join(", "),
            });
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// Deletes (foreground) every object of `api` matching the selector that is not already being
/// deleted; returns the ones that still exist.
async fn remove<K>(
    api: &Api<K>,
    args: &StopArgs,
    kind: &'static str,
) -> Result<Vec<String>, StopError>
where
    K: Resource + Clone + DeserializeOwned + std::fmt::Debug,
{
    let error = |verb, source| StopError::Api {
        verb,
        kind,
        namespace: args.namespace.clone(),
        source,
    };
    let found = api
        .list(&ListParams::default().labels(&args.selector))
        .await
        .map_err(|e| error("list", e))?;
    let foreground = DeleteParams {
        propagation_policy: Some(PropagationPolicy::Foreground),
        ..DeleteParams::default()
    };
    let mut left = Vec::new();
    for object in found.items {
        let name = object.name_any();
        if object.meta().deletion_timestamp.is_none() {
            info!(namespace = %args.namespace, "deleting {kind}/{name} and waiting for its pods");
            match api.delete(&name, &foreground).await {
                Ok(_) => {}
                Err(kube::Error::Api(status)) if status.code == 404 => continue,
                Err(e) => return Err(error("delete", e)),
            }
        }
        left.push(format!("{}/{name}", kind.trim_end_matches('s')));
    }
    Ok(left)
}
