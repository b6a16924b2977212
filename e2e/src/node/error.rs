//! The node simulator's error type.

use std::io;

use crate::fixture::FixtureError;

/// What went wrong in the node simulator. Every variant says what was being
/// done to which object.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NodeError {
    /// A request to the Kubernetes API failed.
    #[error("{context}: {source}")]
    Api {
        /// What was being done, to which object.
        context: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The container fixture (runc, overlay mounts) failed.
    #[error("{context}: {source}")]
    Fixture {
        /// What was being done, to which container.
        context: String,
        /// The fixture's error.
        #[source]
        source: FixtureError,
    },
    /// A file-system operation failed.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, to which path.
        context: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// An image reference names no local image.
    #[error("image {reference:?}: {why}")]
    Image {
        /// The reference as the pod spelled it.
        reference: String,
        /// Why it did not resolve.
        why: String,
    },
    /// A background task panicked or was cancelled.
    #[error("{context}: {source}")]
    Task {
        /// Which task.
        context: String,
        /// How it ended.
        #[source]
        source: tokio::task::JoinError,
    },
    /// An input was rejected (a configuration value, a path).
    #[error("{0}")]
    Invalid(String),
    /// Tearing down left things behind.
    #[error("{what}: cleanup incomplete: {}", problems.join("; "))]
    Cleanup {
        /// What was being torn down.
        what: String,
        /// Each leftover and why.
        problems: Vec<String>,
    },
}

/// Attaches context to errors of the layers below.
pub(crate) trait Context<T> {
    /// Wraps the error with `context()`'s description of what was being done.
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, NodeError>;
}

impl<T> Context<T> for Result<T, kube::Error> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, NodeError> {
        self.map_err(|source| NodeError::Api {
            context: context(),
            source,
        })
    }
}

impl<T> Context<T> for Result<T, FixtureError> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, NodeError> {
        self.map_err(|source| NodeError::Fixture {
            context: context(),
            source,
        })
    }
}

impl<T> Context<T> for io::Result<T> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, NodeError> {
        self.map_err(|source| NodeError::Io {
            context: context(),
            source,
        })
    }
}

impl<T> Context<T> for Result<T, tokio::task::JoinError> {
    fn ctx(self, context: impl FnOnce() -> String) -> Result<T, NodeError> {
        self.map_err(|source| NodeError::Task {
            context: context(),
            source,
        })
    }
}

/// Whether `error` is the API's 404 Not Found.
pub(crate) fn is_not_found(error: &kube::Error) -> bool {
    api_code(error) == Some(404)
}

/// Whether `error` is the API's 409 Conflict (already exists, or a failed precondition).
pub(crate) fn is_conflict(error: &kube::Error) -> bool {
    api_code(error) == Some(409)
}

/// The HTTP status code of an API error response.
fn api_code(error: &kube::Error) -> Option<u16> {
    match error {
        kube::Error::Api(status) => Some(status.code),
        _ => None,
    }
}
