//! The controller's admission webhooks (docs/architecture.md "The two flows", README "The API"):
//!
//! - `POST /mutate/pods` (`MutatingWebhookConfiguration` `warmstart-restore`): shapes a pod
//!   annotated `warmstart.dev/restore-from` with [`crate::restore::shape_restore_pod`] against
//!   the Checkpoint read straight from the API server, or denies it (fail closed).
//! - `POST /validate/checkpoints` (`ValidatingWebhookConfiguration`
//!   `warmstart-checkpoint-validation`): refuses a Checkpoint the controller could not act on.
//!
//! [`admission`] holds the decisions (no HTTP), [`server`] the HTTPS server, [`crate::tls`]
//! the serving certificate reloaded from files. [`crate::certs`] provides those files when no
//! cert-manager does.

pub mod admission;
#[cfg(test)]
pub(crate) mod fixtures;
pub mod server;

pub use crate::tls::{ReloadingCertResolver, TlsError, TlsSource};
pub use admission::{
    Admission, ApiCheckpointSource, CheckpointFuture, CheckpointSource, MutateError, Outcome,
    PodDecision, ValidateError, decide_checkpoint, decide_pod,
};
pub use server::{WebhookArgs, WebhookError, router, serve, serve_listener};
