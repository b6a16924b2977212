//! The warmstart node agent: node engine (CRIU, CUDA, container runtimes) and local CLI.
#![deny(unsafe_code)]
pub mod artifact_view;
pub mod cache;
pub mod cgroups;
pub mod checkpoint;
pub mod cli;
pub mod clock;
pub mod cluster;
pub mod criu;
pub mod cuda;
pub mod dump_progress;
pub mod engine;
pub mod fault;
pub mod gpu;
pub mod gpu_assignment;
pub mod limits;
pub mod logdir;
pub mod mounts;
pub mod node_match;
pub mod placeholder;
pub mod podfiles;
pub mod podresources;
pub mod preflight;
pub mod procfs;
pub mod progress;
pub mod publish;
pub mod report;
pub mod restore;
pub mod restore_helper;
pub mod rootfs;
pub mod runtime;
pub mod seams;
pub mod store_source;
pub mod sys;
#[cfg(test)]
mod testing;
pub mod timings;
