//! The agent's `unsafe` code besides the CUDA binding (`cuda/ffi.rs`): small safe wrappers
//! around process-level syscalls whose soundness depends on conditions the wrapper checks
//! itself.
#![allow(unsafe_code)]

pub mod fork;
pub mod lease;
pub mod ptrace;
pub mod spawn;
