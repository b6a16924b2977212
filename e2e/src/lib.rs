//! Test harness of warmstart: runc container fixtures, the programs the end-to-end tests run, a
//! real Kubernetes control plane and the simulated node. Test infrastructure only.

pub mod agent_cli;
pub mod binaries;
pub mod cluster;
pub mod control_plane;
pub mod cuda;
pub mod device_plugin;
pub mod fixture;
pub mod manifests;
pub mod node;
pub mod ports;
pub mod real_kube;
pub mod s3_server;
pub mod testca;
pub mod watch_hold;
pub mod worker;
