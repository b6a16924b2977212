//! `warmstart-entrypoint`: the workload side of the warmstart protocol for servers that know
//! nothing of it (vLLM, SGLang, TensorRT-LLM, Triton, redis, anything), as a small static
//! binary prefixed to the container's command (`warmstart-entrypoint -- <command> <args>…`).
//!
//! The mode comes from the environment the Job and restore-pod builders set: a checkpoint
//! source (`WARMSTART_READY_FILE`), a restore pod's standby (`WARMSTART_RESTORE_STANDBY=1`), or
//! neither (plain supervision). See [`supervise`] for what each mode does, [`probe`] for the
//! readiness probe it runs, and [`control`] for the files it reads and writes.
#![forbid(unsafe_code)]

pub mod cli;
pub mod control;
pub mod grpc;
pub mod install;
pub mod probe;
pub mod reaper;
pub mod signals;
pub mod spawn;
pub mod supervise;
