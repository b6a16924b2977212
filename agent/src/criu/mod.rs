//! The agent's own CRIU client: checkpoint and restore of process trees through CRIU's RPC
//! (`criu swrk`, protobuf over a `SOCK_SEQPACKET` socketpair), as runc and go-criu drive it.
//!
//! - [`Criu`] is a CRIU binary; [`Criu::version`], [`Criu::check`], [`Criu::dump`] and
//!   [`Criu::restore`] each start one `criu swrk`, send one request and reap it. They block.
//! - [`DumpOpts`] and [`RestoreOpts`] are plain structs, validated before CRIU is started.
//! - Every dump and restore writes a debug-level log into the images (or work) directory, so
//!   it stays with the artifact; a failure ([`CriuError::Failed`]) names that log and quotes its
//!   key error lines, since CRIU's own message is usually the harmless RLIMIT_NOFILE line
//!   (README "Prerequisites").
//! - [`rpc`] is the generated protobuf code of CRIU's `rpc.proto` (CRIU 4.x), committed; see
//!   `scripts/gen-criu-proto.sh`.
//!
//! # Invariants
//! - CRIU loads no plugin of its own: every dump and restore names an agent-owned
//!   configuration whose plugin directory is empty ([`plugins`]); the GPU state is warmstart's.
//! - No descriptor of this process leaks into CRIU except those a request names: the socket,
//!   and a restore's inherited fds and pinned namespace files, at the numbers the request
//!   gives (the layout is documented in `client.rs`); even descriptors this process inherited
//!   without close-on-exec are closed in the CRIU child.
//! - CRIU never outlives a request: it is reaped on every path, killed when the request's
//!   timeout passes.
//!
//! # CRIU quirks this module knows about
//! - The images and work directories travel as descriptors of *this* process: CRIU opens
//!   `/proc/<socketpair creator>/fd/<n>`.
//! - A dump that does not leave the tree running kills it, but the root stays a zombie (and its
//!   PID taken) until its parent reaps it; a restore into the same PID namespace needs that PID.
//! - With `rst_sibling` the restored root becomes the caller's child, not CRIU's.

mod client;
mod error;
mod log;
mod opts;
pub mod pagemap;
pub mod plugins;
pub mod rpc;
mod version;

#[cfg(test)]
mod tests;

pub use client::{Criu, DumpOutcome, RestoreOutcome};
pub use error::{CriuError, CriuOp};
pub use opts::{
    DEFAULT_DUMP_LOG, DEFAULT_LOG_LEVEL, DEFAULT_RESTORE_LOG, DumpOpts, ExtMount, InheritFd,
    JoinNs, MAX_LOG_LEVEL, ManageCgroupsMode, NETNS_KEY, NamespaceKind, NetworkLockMethod, NsFile,
    OptsError, RestoreOpts,
};
pub use version::{CriuVersion, MIN_VERSION};
