//! warmstart artifacts in S3-compatible object storage: the settings ([`Args`],
//! [`StoreConfig`]), and the [`Store`] that uploads a published artifact (multipart, parts in
//! parallel, each checksummed by the server, the completion marker last), verifies it in the
//! bucket, downloads it chunk-checked into a staging directory ([`place`] renames that into
//! place), deletes it (marker first) and sweeps stale multipart uploads.
//!
//! Object layout: `<prefix>/<namespace>/<hash>/<file>`, the directory artifact's layout
//! (`manifest.json`, `COMPLETE` and the listed files) under a key prefix. With
//! `--s3-compression-level` each listed file is stored as zstd frames, one per manifest chunk,
//! and `zstd-frames.json` beside the manifest gives their lengths ([`frames`]); the manifest
//! and its checksums stay those of the uncompressed files.

mod client;
pub mod config;
mod download;
pub mod error;
pub mod frames;
mod requests;
mod store;
mod upload;

pub use config::{Args, ConfigError, Credentials, Secret, StoreConfig};
pub use download::place;
pub use error::{BadChunk, BadFrame, ServerAnswer, StoreError};
pub use requests::{ListedObject, PendingUpload};
pub use store::{Progress, Store};
pub use upload::UploadReport;
