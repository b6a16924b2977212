//! Why an object store operation failed: each error names the endpoint and bucket, the object
//! (artifact file, part or chunk) and what the server answered; none holds a credential.

use std::path::PathBuf;

use thiserror::Error;

use crate::config::ConfigError;

/// What the server answered to a refused request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerAnswer {
    /// HTTP status.
    pub status: u16,
    /// S3 error code (`AccessDenied`, `BadDigest`, …); empty when the body held none.
    pub code: String,
    /// S3 error message.
    pub message: String,
}

impl std::fmt::Display for ServerAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}", self.status)?;
        if !self.code.is_empty() {
            write!(f, " {}", self.code)?;
        }
        if !self.message.is_empty() {
            write!(f, ": {}", self.message)?;
        }
        Ok(())
    }
}

/// A downloaded chunk that differs from the manifest.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "{store}: artifact file {file} of {namespace}/{hash} differs from the manifest in chunk {chunk} (from byte {offset}): sha256 {actual}, the manifest says {expected}"
)]
pub struct BadChunk {
    /// Endpoint and bucket.
    pub store: String,
    /// Namespace.
    pub namespace: String,
    /// Identity hash.
    pub hash: String,
    /// The artifact file.
    pub file: String,
    /// Chunk index.
    pub chunk: usize,
    /// First byte of the chunk.
    pub offset: u64,
    /// Digest in the manifest.
    pub expected: String,
    /// Digest of the bytes received.
    pub actual: String,
}

/// A stored zstd frame that cannot be decompressed into its chunk.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
#[error(
    "{store}: artifact file {file} of {namespace}/{hash}: the compressed frame of chunk {chunk} (stored bytes {stored_offset}..{stored_end}) is unusable: {detail}"
)]
pub struct BadFrame {
    /// Endpoint and bucket.
    pub store: String,
    /// Namespace.
    pub namespace: String,
    /// Identity hash.
    pub hash: String,
    /// The artifact file.
    pub file: String,
    /// Chunk index.
    pub chunk: usize,
    /// First byte of the frame in the stored object.
    pub stored_offset: u64,
    /// End of the frame in the stored object.
    pub stored_end: u64,
    /// What is wrong.
    pub detail: String,
}

/// Why an object store operation failed.
#[derive(Debug, Error)]
pub enum StoreError {
    /// The settings or the credential files are unusable.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The HTTP client could not be set up (the CA bundle).
    #[error("object store client: {0}")]
    Client(String),
    /// The server refused the credentials or the signature.
    #[error(
        "{store}: access denied ({answer}) to {op}: check the access key id and secret access key files and the bucket's policy"
    )]
    AccessDenied {
        /// Endpoint and bucket.
        store: String,
        /// What was being done.
        op: String,
        /// The server's answer.
        answer: ServerAnswer,
    },
    /// The bucket does not exist.
    #[error("{store}: bucket {bucket:?} does not exist ({answer}); create it or fix --s3-bucket")]
    NoSuchBucket {
        /// Endpoint and bucket.
        store: String,
        /// The bucket.
        bucket: String,
        /// The server's answer.
        answer: ServerAnswer,
    },
    /// The server refused a request for another reason (after retries where retrying made
    /// sense).
    #[error("{store}: {op} failed after {attempts} attempt(s): {answer}")]
    Server {
        /// Endpoint and bucket.
        store: String,
        /// What was being done (which file, part or chunk).
        op: String,
        /// Requests made.
        attempts: u32,
        /// The last answer.
        answer: ServerAnswer,
    },
    /// The server could not be reached or did not answer in time (after retries).
    #[error("{store}: {op} failed after {attempts} attempt(s): {detail}")]
    Transport {
        /// Endpoint and bucket.
        store: String,
        /// What was being done.
        op: String,
        /// Requests made.
        attempts: u32,
        /// The last error.
        detail: String,
    },
    /// The TLS handshake failed: the endpoint's certificate is not trusted or does not name it
    /// (not tried again).
    #[error("{store}: {op} failed: {detail}; check --s3-ca-file and the endpoint's name")]
    Tls {
        /// Endpoint and bucket.
        store: String,
        /// What was being done.
        op: String,
        /// The handshake's error.
        detail: String,
    },
    /// No artifact is stored for this namespace and hash.
    #[error("{store}: no artifact {namespace}/{hash} (no completion marker at {key})")]
    NotFound {
        /// Endpoint and bucket.
        store: String,
        /// Namespace.
        namespace: String,
        /// Identity hash.
        hash: String,
        /// The marker's key.
        key: String,
    },
    /// Objects of the artifact are stored but it is not complete or not consistent: never used.
    #[error("{store}: artifact {namespace}/{hash} is incomplete: {detail}")]
    Incomplete {
        /// Endpoint and bucket.
        store: String,
        /// Namespace.
        namespace: String,
        /// Identity hash.
        hash: String,
        /// What is missing or wrong.
        detail: String,
    },
    /// Another artifact (another manifest digest) is already complete under this hash.
    #[error(
        "{store}: artifact {namespace}/{hash} already exists with manifest {remote}, not {local}: delete it first"
    )]
    Exists {
        /// Endpoint and bucket.
        store: String,
        /// Namespace.
        namespace: String,
        /// Identity hash.
        hash: String,
        /// Digest of the stored manifest.
        remote: String,
        /// Digest of the local manifest.
        local: String,
    },
    /// A downloaded chunk differs from the manifest's digest: the download is discarded.
    #[error("{0}")]
    ChunkMismatch(Box<BadChunk>),
    /// A downloaded compressed frame does not decompress into its chunk: the download is
    /// discarded.
    #[error("{0}")]
    BadFrame(Box<BadFrame>),
    /// The frame index of a compressed artifact is unreadable or does not match the manifest:
    /// nothing of the artifact is read.
    #[error(
        "{store}: artifact {namespace}/{hash}: its frame index ({}) is unusable: {detail}",
        crate::frames::FRAME_INDEX
    )]
    FrameIndex {
        /// Endpoint and bucket.
        store: String,
        /// Namespace.
        namespace: String,
        /// Identity hash.
        hash: String,
        /// What is wrong.
        detail: String,
    },
    /// A downloaded file differs from the manifest's whole-file digest (manifest format 1):
    /// the download is discarded.
    #[error(
        "{store}: artifact {namespace}/{hash} as downloaded differs from its manifest: {detail}"
    )]
    Corrupt {
        /// Endpoint and bucket.
        store: String,
        /// Namespace.
        namespace: String,
        /// Identity hash.
        hash: String,
        /// Which file and how.
        detail: String,
    },
    /// A ranged read returned another length than asked for.
    #[error("{store}: {op}: got {got} bytes, expected {expected}")]
    ShortRead {
        /// Endpoint and bucket.
        store: String,
        /// Which file and range.
        op: String,
        /// Bytes received.
        got: u64,
        /// Bytes asked for.
        expected: u64,
    },
    /// The manifest or marker (local or stored) is invalid.
    #[error("{what}")]
    Manifest {
        /// Which manifest and where.
        what: String,
        /// The cause.
        #[source]
        source: warmstart_shared::artifact::ManifestError,
    },
    /// The local published artifact cannot be read.
    #[error("local artifact {}", dir.display())]
    Published {
        /// The directory.
        dir: PathBuf,
        /// The cause.
        #[source]
        source: warmstart_shared::artifact::PublishedError,
    },
    /// A local file operation failed.
    #[error("{op} {}", path.display())]
    Io {
        /// What was being done.
        op: &'static str,
        /// On which path.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// A local file does not match its manifest while it is uploaded.
    #[error("local artifact file {} no longer matches its manifest: {detail}", path.display())]
    LocalChanged {
        /// The file.
        path: PathBuf,
        /// What differs.
        detail: String,
    },
    /// A namespace or hash is not a safe key element.
    #[error(transparent)]
    Name(#[from] warmstart_shared::artifact::PathError),
    /// A blocking task panicked or was cancelled.
    #[error("background task failed: {0}")]
    Task(String),
}

impl StoreError {
    /// Whether the cause is the store's credentials or policy.
    pub fn is_access_denied(&self) -> bool {
        matches!(self, Self::AccessDenied { .. })
    }

    /// Whether the artifact itself is at fault (absent, incomplete, an unreadable manifest, an
    /// unsafe name), as opposed to the store (unreachable, refusing the credentials, no such
    /// bucket) or this machine: only then is the artifact unusable rather than unreachable.
    pub fn is_artifact_fault(&self) -> bool {
        matches!(
            self,
            Self::NotFound { .. }
                | Self::Incomplete { .. }
                | Self::Manifest { .. }
                | Self::Corrupt { .. }
                | Self::ChunkMismatch(_)
                | Self::BadFrame(_)
                | Self::FrameIndex { .. }
                | Self::Name(_)
        )
    }

    /// Whether trying the whole operation again later may succeed: the server could not be
    /// reached, failed (5xx) or throttled, or an answer was cut short. Refusals (credentials,
    /// bucket, checksum), local problems and bad artifacts are not.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Transport { .. } | Self::ShortRead { .. } => true,
            Self::Server { answer, .. } => answer.status >= 500 || answer.status == 429,
            _ => false,
        }
    }
}

pub(crate) fn io_err(
    op: &'static str,
    path: impl Into<PathBuf>,
) -> impl FnOnce(std::io::Error) -> StoreError {
    let path = path.into();
    move |source| StoreError::Io { op, path, source }
}
