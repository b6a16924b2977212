//! Test harness and end-to-end tests of warmstart (API server double, node simulator and sample worker come with their issues).

pub mod fixture;
