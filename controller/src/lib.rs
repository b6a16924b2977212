//! The warmstart cluster controller: user-facing commands that apply the contract of
//! `warmstart-shared` (CRD, identity hash, Job and restore-pod shaping). The reconciler and the
//! admission webhook build on the same functions.
// `unsafe` only in `yaml_depth` (libyaml's event parser, behind one safe function).
#![deny(unsafe_code)]

pub mod artifact;
pub mod certs;
pub mod cli;
pub mod decide;
pub mod errors;
pub mod input;
pub mod leader;
pub mod metrics;
pub mod reconcile;
pub mod restore;
pub mod run;
pub mod stop;
pub mod strict;
pub mod tls;
pub mod webhook;
pub mod yaml_depth;
