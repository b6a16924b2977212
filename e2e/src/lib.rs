//! Test harness of warmstart: runc container fixtures, the programs the end-to-end tests run, the
//! Kubernetes API server double and the simulated node. Test infrastructure only.

pub mod agent_cli;
pub mod apiserver;
pub mod binaries;
pub mod cluster;
pub mod control_plane;
pub mod cuda;
pub mod fixture;
pub mod local_cluster;
pub mod node;
pub mod rbac;
pub mod testca;
pub mod worker;
