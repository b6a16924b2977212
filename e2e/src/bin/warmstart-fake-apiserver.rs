//! The Kubernetes API server double as a standalone program, for tests and manual poking with
//! kubectl: `warmstart-fake-apiserver --listen 127.0.0.1:PORT --kubeconfig PATH` writes a
//! kubeconfig pointing at it and serves until killed. Test infrastructure only; see
//! `warmstart_e2e::apiserver` for what it does and does not do. kubectl works with its default
//! validation (the OpenAPI documents it downloads are served).

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Parser;
use warmstart_e2e::apiserver::{ApiServer, ServerConfig};

/// Command line.
#[derive(Debug, Parser)]
#[command(about = "A Kubernetes API server double for tests")]
struct Args {
    /// Address to serve plain HTTP on.
    #[arg(
        long,
        env = "WARMSTART_FAKE_APISERVER_LISTEN",
        default_value = "127.0.0.1:6443"
    )]
    listen: SocketAddr,
    /// Where to write a kubeconfig pointing at the server.
    #[arg(long, env = "WARMSTART_FAKE_APISERVER_KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Changes kept per resource for watches from a resourceVersion.
    #[arg(
        long,
        env = "WARMSTART_FAKE_APISERVER_HISTORY",
        default_value_t = 10_000
    )]
    history: usize,
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
    let config = ServerConfig {
        listen: args.listen,
        history_limit: args.history,
        ..ServerConfig::default()
    };
    let server = ApiServer::start_with(config)
        .await
        .context("start the API server double")?;
    if let Some(path) = &args.kubeconfig {
        server
            .kubeconfig(path)
            .with_context(|| format!("write {}", path.display()))?;
    }
    println!("serving {}", server.url());
    tokio::select! {
        r = server.wait() => r.context("serve")?,
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
