//! Test harness of warmstart: runc container fixtures, the programs the end-to-end tests run, and
//! (with their issues) the API server double and node simulator. Test infrastructure only.

pub mod apiserver;
pub mod binaries;
pub mod fixture;
pub mod node;
