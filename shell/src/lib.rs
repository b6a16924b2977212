//! The process shell every warmstart program shares: how it formats an error, sets up its
//! telemetry, serves its admin endpoint and metrics, and hears that it must stop. One copy, so
//! the controller, the node agent and the standby entrypoint behave alike at their edges.

pub use warmstart_shared::errors::error_chain;

pub mod telemetry;

#[cfg(feature = "server")]
pub mod admin;
#[cfg(feature = "server")]
pub mod metrics;
#[cfg(feature = "server")]
pub mod shutdown;
