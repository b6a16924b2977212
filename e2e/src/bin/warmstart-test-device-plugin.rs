//! A test double of NVIDIA's Kubernetes device plugin, for the local cluster: advertises the
//! CUDA stand-in's GPUs to the kubelet as `nvidia.com/gpu` and answers `Allocate` in the form
//! the form file asks for (see `warmstart_e2e::device_plugin`). Test infrastructure only.
//!
//! `warmstart-test-device-plugin [--kubelet-root DIR] [--count N] [--form-file FILE]`

use std::path::PathBuf;

use anyhow::Result;
use clap::Parser;
use warmstart_e2e::device_plugin::{self, Settings};

/// The stand-in GPUs as the kubelet's `nvidia.com/gpu`.
#[derive(Debug, Parser)]
struct Args {
    /// The kubelet's root directory (its `device-plugins/` holds the sockets).
    #[arg(long, default_value = "/var/lib/kubelet")]
    kubelet_root: PathBuf,
    /// How many GPUs to advertise.
    #[arg(long, default_value_t = 8)]
    count: u8,
    /// The file choosing how `Allocate` names the devices: `uuids` (also when missing),
    /// `cdi` or `cdi-annotations`.
    #[arg(long, default_value = "/var/lib/warmstart-cluster/device-plugin/form")]
    form_file: PathBuf,
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let settings = Settings::standin(&args.kubelet_root, args.count, args.form_file);
    device_plugin::run(settings).await?;
    Ok(())
}
