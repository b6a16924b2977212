//! A simulated Kubernetes node as a standalone program: registers a Node with the API server of
//! a kubeconfig, binds pending pods to itself and runs them as runc containers on this machine;
//! with `--jobs`, also runs the minimal Job controller. Test infrastructure only (root, runc and a
//! directory of image root filesystems needed); see `warmstart_e2e::node` for what it supports.
//!
//! `warmstart-sim-node --kubeconfig PATH --images DIR [--name NAME] [--state-dir DIR] [--jobs]`
//! runs until SIGINT or SIGTERM, then removes every container it started.

use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use clap::Parser;
use kube::config::{KubeConfigOptions, Kubeconfig};
use tokio::signal::unix::{SignalKind, signal};
use warmstart_e2e::node::{JobController, NodeConfig, NodeImages, SimNode};

/// Command line.
#[derive(Debug, Parser)]
#[command(about = "A simulated Kubernetes node running pods as runc containers (tests only)")]
struct Args {
    /// The kubeconfig of the API server.
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: PathBuf,
    /// The node's name.
    #[arg(long, default_value = "warmstart-sim-node")]
    name: String,
    /// The image directory: `<dir>/<name>` is the root filesystem of image `name` (any tag).
    #[arg(long)]
    images: PathBuf,
    /// The node's state (runc state, pod volumes); default `/run/warmstart-sim-node/<name>`.
    #[arg(long)]
    state_dir: Option<PathBuf>,
    /// Stands in for `/` for hostPath volumes; default `<state dir>/host`.
    #[arg(long)]
    host_root: Option<PathBuf>,
    /// Holds `<namespace>/<claim>` directories for PVC volumes; default `<state dir>/pvcs`.
    #[arg(long)]
    pvc_root: Option<PathBuf>,
    /// An extra node label, `key=value` (repeatable).
    #[arg(long = "label")]
    labels: Vec<String>,
    /// Do not bind pending pods (another scheduler or node does).
    #[arg(long)]
    no_bind: bool,
    /// Also run the minimal Job controller.
    #[arg(long)]
    jobs: bool,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let kubeconfig = Kubeconfig::read_from(&args.kubeconfig)
        .with_context(|| format!("read {}", args.kubeconfig.display()))?;
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default())
        .await
        .with_context(|| format!("load {}", args.kubeconfig.display()))?;
    let client = kube::Client::try_from(config).context("build the API client")?;

    let state_dir = args
        .state_dir
        .unwrap_or_else(|| PathBuf::from("/run/warmstart-sim-node").join(&args.name));
    let mut node_config =
        NodeConfig::new(&args.name, NodeImages::from_dir(&args.images), state_dir);
    if let Some(root) = args.host_root {
        node_config.host_root = root;
    }
    if let Some(root) = args.pvc_root {
        node_config.pvc_root = root;
    }
    let mut labels = BTreeMap::new();
    for label in &args.labels {
        let Some((key, value)) = label.split_once('=') else {
            bail!("--label {label:?}: expected key=value");
        };
        labels.insert(key.to_owned(), value.to_owned());
    }
    node_config.labels = labels;
    node_config.bind_pending_pods = !args.no_bind;

    let node = SimNode::start(client.clone(), node_config)
        .await
        .with_context(|| format!("start node {}", args.name))?;
    let jobs = args.jobs.then(|| JobController::start(client));
    println!("node {} running", node.name());

    let mut terminate = signal(SignalKind::terminate()).context("listen for SIGTERM")?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
    if let Some(jobs) = jobs {
        jobs.shutdown().await.context("stop the Job controller")?;
    }
    node.shutdown().await.context("stop the node")?;
    Ok(())
}
