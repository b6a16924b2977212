//! How the controller prints an error: the error and its causes on one line, as every
//! warmstart program does.

pub use warmstart_shared::errors::error_chain;
