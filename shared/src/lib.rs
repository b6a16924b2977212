//! The warmstart contract: the `Checkpoint` API, the identity hash, the checkpoint binding, the
//! checkpoint-Job and restore-pod shaping rules, and the artifact layout and manifest.
//!
//! Pure code: no cluster I/O, no async runtime, no `unsafe`. The controller and the agent apply
//! these rules; nothing else re-implements them.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod artifact;
pub mod binding;
pub mod control;
pub mod errors;
pub mod filehash;
pub mod identity;
pub mod job;
pub mod mounts;
pub mod names;
pub mod placement;
pub mod restore_pod;
pub mod signal;
pub mod v1alpha1;
pub mod wrap;

pub use v1alpha1::{
    Checkpoint, CheckpointIdentity, CheckpointJobSpec, CheckpointPhase, CheckpointSpec,
    CheckpointStatus, DeletionPolicy, EntrypointMode, Prestage, PrestageState, PrestageStatus,
};
