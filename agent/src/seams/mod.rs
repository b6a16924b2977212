//! The node engine's seams: CRIU and the CUDA driver as the engine's steps (checkpoint,
//! restore, the GPU steps) call them, so the steps are tested against recording doubles. Below
//! the steps, above the drivers themselves (`criu`, `cuda`, `restore_helper`).

pub mod criu;
pub mod cuda;
