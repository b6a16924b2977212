//! Options of a CRIU dump and restore: plain, validated structs that map onto CRIU's
//! `criu_opts` RPC message.
//!
//! The structs hold what warmstart decides (they mirror the `criu dump`/`criu restore` flags
//! runc uses, which a restore into a placeholder container by hand also needed); the client adds
//! what belongs to the transport (the images directory as a file descriptor, the numbers of the
//! inherited descriptors in the `criu swrk` child). Options not listed here are left at CRIU's
//! defaults, except `notify_scripts` and `orphan_pts_master`, which are always off.

use std::collections::HashSet;
use std::fmt;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use nix::unistd::Pid;

use super::rpc;

/// Key under which the container's network namespace is external.
pub const NETNS_KEY: &str = "extRootNetNS";
/// Log file name of a dump, kept in the images directory.
pub const DEFAULT_DUMP_LOG: &str = "dump.log";
/// Log file name of a restore, kept in the images directory.
pub const DEFAULT_RESTORE_LOG: &str = "restore.log";
/// CRIU's most detailed log level (debug), the default: the log is kept with the artifact.
pub const DEFAULT_LOG_LEVEL: u32 = 4;
/// The highest log level CRIU knows.
pub const MAX_LOG_LEVEL: u32 = 4;

/// Options rejected before CRIU is started.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum OptsError {
    /// The PID to dump is not a valid process id.
    #[error("invalid criu dump options: pid {0} is not a process id")]
    Pid(i32),
    /// The log file name is empty, a path, `.` or `..` (CRIU writes it in its work directory).
    #[error("invalid criu options: log file {0:?} must be a plain file name")]
    LogFile(String),
    /// The log level is above [`MAX_LOG_LEVEL`].
    #[error("invalid criu options: log level {0} is above {MAX_LOG_LEVEL}")]
    LogLevel(u32),
    /// A key or value (of an external resource, mount map or inherited fd) is empty.
    #[error("invalid criu options: empty {what}")]
    Empty {
        /// Which kind of entry.
        what: &'static str,
    },
    /// Two inherited fds use the same key.
    #[error("invalid criu restore options: inherit fd key {0:?} given twice")]
    DuplicateInheritKey(String),
    /// A path CRIU resolves from its own root is relative.
    #[error("invalid criu restore options: {what} {} is not an absolute path", path.display())]
    RelativePath {
        /// Which option.
        what: &'static str,
        /// The path.
        path: PathBuf,
    },
    /// A name (of a cgroup mode, a network lock method) CRIU does not know.
    #[error("invalid criu options: unknown {what} {name:?}")]
    UnknownName {
        /// What kind of name.
        what: &'static str,
        /// The name.
        name: String,
    },
    /// A namespace was given twice to join.
    #[error("invalid criu restore options: namespace {0} joined twice")]
    DuplicateJoinNs(NamespaceKind),
}

/// CRIU's cgroup handling (`--manage-cgroups`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ManageCgroupsMode {
    /// Neither dump nor restore cgroups (warmstart joins the placeholder's cgroups by hand).
    Ignore,
    /// CRIU's default: restore cgroup properties only for cgroups it creates.
    #[default]
    Soft,
    /// Restore all cgroup properties.
    Full,
    /// Restore properties and require the cgroup tree to be as dumped.
    Strict,
}

impl ManageCgroupsMode {
    /// CRIU's name for the mode (`ignore`, `soft`, `full`, `strict`), as `--manage-cgroups`
    /// takes it; [`str::parse`] reads it back (for options persisted in a manifest).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ignore => "ignore",
            Self::Soft => "soft",
            Self::Full => "full",
            Self::Strict => "strict",
        }
    }

    fn to_rpc(self) -> rpc::CriuCgMode {
        match self {
            Self::Ignore => rpc::CriuCgMode::Ignore,
            Self::Soft => rpc::CriuCgMode::Soft,
            Self::Full => rpc::CriuCgMode::Full,
            Self::Strict => rpc::CriuCgMode::Strict,
        }
    }
}

/// How CRIU locks the network while a dumped tree is frozen (`--network-lock`); a restore
/// must use the method of its dump.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NetworkLockMethod {
    /// CRIU's default; needs `iptables` on the node.
    #[default]
    Iptables,
    /// nftables.
    Nftables,
    /// No locking (only safe when nothing can reach the tree's sockets).
    Skip,
}

impl NetworkLockMethod {
    /// CRIU's name for the method (`iptables`, `nftables`, `skip`), as `--network-lock` takes
    /// it; [`str::parse`] reads it back.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
            Self::Skip => "skip",
        }
    }

    fn to_rpc(self) -> rpc::CriuNetworkLockMethod {
        match self {
            Self::Iptables => rpc::CriuNetworkLockMethod::Iptables,
            Self::Nftables => rpc::CriuNetworkLockMethod::Nftables,
            Self::Skip => rpc::CriuNetworkLockMethod::Skip,
        }
    }
}

impl From<warmstart_shared::artifact::CgroupMode> for ManageCgroupsMode {
    fn from(mode: warmstart_shared::artifact::CgroupMode) -> Self {
        use warmstart_shared::artifact::CgroupMode;
        match mode {
            CgroupMode::Ignore => Self::Ignore,
            CgroupMode::Soft => Self::Soft,
            CgroupMode::Full => Self::Full,
            CgroupMode::Strict => Self::Strict,
        }
    }
}

impl From<ManageCgroupsMode> for warmstart_shared::artifact::CgroupMode {
    fn from(mode: ManageCgroupsMode) -> Self {
        match mode {
            ManageCgroupsMode::Ignore => Self::Ignore,
            ManageCgroupsMode::Soft => Self::Soft,
            ManageCgroupsMode::Full => Self::Full,
            ManageCgroupsMode::Strict => Self::Strict,
        }
    }
}

impl From<warmstart_shared::artifact::NetworkLock> for NetworkLockMethod {
    fn from(lock: warmstart_shared::artifact::NetworkLock) -> Self {
        use warmstart_shared::artifact::NetworkLock;
        match lock {
            NetworkLock::Iptables => Self::Iptables,
            NetworkLock::Nftables => Self::Nftables,
            NetworkLock::Skip => Self::Skip,
        }
    }
}

impl From<NetworkLockMethod> for warmstart_shared::artifact::NetworkLock {
    fn from(lock: NetworkLockMethod) -> Self {
        match lock {
            NetworkLockMethod::Iptables => Self::Iptables,
            NetworkLockMethod::Nftables => Self::Nftables,
            NetworkLockMethod::Skip => Self::Skip,
        }
    }
}

impl fmt::Display for ManageCgroupsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for ManageCgroupsMode {
    type Err = OptsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::Ignore, Self::Soft, Self::Full, Self::Strict]
            .into_iter()
            .find(|mode| mode.as_str() == s)
            .ok_or_else(|| OptsError::UnknownName {
                what: "cgroup mode",
                name: s.to_owned(),
            })
    }
}

impl fmt::Display for NetworkLockMethod {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for NetworkLockMethod {
    type Err = OptsError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        [Self::Iptables, Self::Nftables, Self::Skip]
            .into_iter()
            .find(|method| method.as_str() == s)
            .ok_or_else(|| OptsError::UnknownName {
                what: "network lock method",
                name: s.to_owned(),
            })
    }
}

/// One external mount (`--ext-mount-map KEY:VALUE`, RPC `ext_mnt`). On dump, `key` is the
/// mount point inside the dumped tree and `value` the name it is recorded under; on restore,
/// `key` is that name and `value` the host path to bind there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExtMount {
    /// Mount point (dump) or recorded name (restore).
    pub key: String,
    /// Recorded name (dump) or host source (restore).
    pub value: String,
}

/// A file descriptor handed to CRIU for an external resource of the restored tree
/// (`--inherit-fd fd[N]:KEY`): e.g. key `pipe:[12345]` for a dumped stdout pipe, or the key of
/// an external network namespace.
///
/// The client makes the fd available in the `criu swrk` child under the number it puts in the
/// request; the caller keeps ownership (restore borrows it).
#[derive(Debug)]
pub struct InheritFd {
    /// The resource key as recorded in the dump (`pipe:[<inode>]`, `extRootNetNS`, ...).
    pub key: String,
    /// The descriptor to use for it.
    pub fd: OwnedFd,
}

/// A namespace the restored tree joins instead of getting a new one (`--join-ns`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum NamespaceKind {
    /// IPC namespace.
    Ipc,
    /// Network namespace.
    Net,
    /// UTS namespace.
    Uts,
}

impl NamespaceKind {
    /// The name CRIU uses (`ipc`, `net`, `uts`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ipc => "ipc",
            Self::Net => "net",
            Self::Uts => "uts",
        }
    }
}

impl fmt::Display for NamespaceKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where the namespace to join is.
#[derive(Debug)]
pub enum NsFile {
    /// A namespace file path CRIU opens itself (`/proc/<pid>/ns/net`, a bind-mounted ns file).
    Path(PathBuf),
    /// A namespace file already opened (pinned) by the caller: handed to the `criu swrk`
    /// child and named to CRIU as `/proc/self/fd/<n>`, so no PID can be recycled in between.
    Fd(OwnedFd),
}

/// One namespace to join on restore.
#[derive(Debug)]
pub struct JoinNs {
    /// Which namespace.
    pub ns: NamespaceKind,
    /// The namespace file.
    pub file: NsFile,
}

/// Options of a dump. Build with [`DumpOpts::new`] and struct update syntax:
/// `DumpOpts { leave_running: true, ..DumpOpts::new(pid, dir) }`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DumpOpts {
    /// Root of the process tree to dump.
    pub pid: Pid,
    /// Where the images go (must exist; opened by the client and passed as a descriptor).
    pub images_dir: PathBuf,
    /// Where the log goes, when not in `images_dir` (must exist).
    pub work_dir: Option<PathBuf>,
    /// Log file name inside the work directory (default [`DEFAULT_DUMP_LOG`]).
    pub log_file: String,
    /// Log level 0..=4 (default [`DEFAULT_LOG_LEVEL`]).
    pub log_level: u32,
    /// Leave the tree running after the dump (default: CRIU kills it).
    pub leave_running: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// Allow link-remap files for open-but-unlinked files.
    pub link_remap: bool,
    /// Allow external unix sockets.
    pub ext_unix_sk: bool,
    /// The tree is a shell job (its session or terminal is outside the tree).
    pub shell_job: bool,
    /// Cgroup handling.
    pub manage_cgroups_mode: ManageCgroupsMode,
    /// Network locking method.
    pub network_lock: NetworkLockMethod,
    /// External resources (`--external`), e.g. `net[4026531993]:extRootNetNS`.
    pub external: Vec<String>,
    /// External mounts (`--ext-mount-map`).
    pub ext_mounts: Vec<ExtMount>,
}

impl DumpOpts {
    /// Dump options for `pid` into `images_dir`, everything else at its default (CRIU kills the
    /// tree after the dump, cgroups [`ManageCgroupsMode::Soft`], debug log `dump.log`).
    pub fn new(pid: Pid, images_dir: impl Into<PathBuf>) -> Self {
        Self {
            pid,
            images_dir: images_dir.into(),
            work_dir: None,
            log_file: DEFAULT_DUMP_LOG.to_owned(),
            log_level: DEFAULT_LOG_LEVEL,
            leave_running: false,
            tcp_established: false,
            file_locks: false,
            link_remap: false,
            ext_unix_sk: false,
            shell_job: false,
            manage_cgroups_mode: ManageCgroupsMode::default(),
            network_lock: NetworkLockMethod::default(),
            external: Vec::new(),
            ext_mounts: Vec::new(),
        }
    }

    /// Checks what can be checked without touching the system.
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), OptsError> {
        if self.pid.as_raw() <= 0 {
            return Err(OptsError::Pid(self.pid.as_raw()));
        }
        validate_log(&self.log_file, self.log_level)?;
        validate_externals(&self.external, &self.ext_mounts)
    }

    /// Where CRIU writes the log of this dump.
    pub fn log_path(&self) -> PathBuf {
        log_path(&self.images_dir, self.work_dir.as_deref(), &self.log_file)
    }

    /// The RPC options, given the images (and work) directory descriptors as numbered in the
    /// *client* process (CRIU opens them as `/proc/<client pid>/fd/<n>`).
    pub(crate) fn to_rpc(&self, images_dir_fd: RawFd, work_dir_fd: Option<RawFd>) -> rpc::CriuOpts {
        let mut opts = rpc::CriuOpts {
            images_dir_fd,
            work_dir_fd,
            pid: Some(self.pid.as_raw()),
            log_file: Some(self.log_file.clone()),
            log_level: Some(log_level_to_rpc(self.log_level)),
            leave_running: Some(self.leave_running),
            tcp_established: Some(self.tcp_established),
            file_locks: Some(self.file_locks),
            link_remap: Some(self.link_remap),
            ext_unix_sk: Some(self.ext_unix_sk),
            shell_job: Some(self.shell_job),
            notify_scripts: Some(false),
            external: self.external.clone(),
            ext_mnt: ext_mnt_to_rpc(&self.ext_mounts),
            ..Default::default()
        };
        opts.set_manage_cgroups_mode(self.manage_cgroups_mode.to_rpc());
        opts.set_network_lock(self.network_lock.to_rpc());
        opts
    }
}

/// Options of a restore. Build with [`RestoreOpts::new`] and struct update syntax. Holds the
/// descriptors to hand to CRIU, so it is neither `Clone` nor comparable.
#[derive(Debug)]
pub struct RestoreOpts {
    /// Where the images are (must exist; opened by the client and passed as a descriptor).
    pub images_dir: PathBuf,
    /// Where the log goes, when not in `images_dir` (must exist; e.g. when the images are
    /// read-only).
    pub work_dir: Option<PathBuf>,
    /// Log file name inside the work directory (default [`DEFAULT_RESTORE_LOG`]).
    pub log_file: String,
    /// Log level 0..=4 (default [`DEFAULT_LOG_LEVEL`]).
    pub log_level: u32,
    /// Restore established TCP connections (must match the dump).
    pub tcp_established: bool,
    /// Restore file locks (must match the dump).
    pub file_locks: bool,
    /// Allow external unix sockets (must match the dump).
    pub ext_unix_sk: bool,
    /// The tree is a shell job (must match the dump).
    pub shell_job: bool,
    /// Cgroup handling.
    pub manage_cgroups_mode: ManageCgroupsMode,
    /// Network unlocking method (must match the dump).
    pub network_lock: NetworkLockMethod,
    /// External resources (`--external`).
    pub external: Vec<String>,
    /// External mounts (`--ext-mount-map`): recorded name to host path.
    pub ext_mounts: Vec<ExtMount>,
    /// Root filesystem to restore into (`--root`), as a path in the caller's mount namespace;
    /// `None` restores into the caller's root.
    pub root: Option<PathBuf>,
    /// Descriptors for external resources (`--inherit-fd`).
    pub inherit_fds: Vec<InheritFd>,
    /// Namespaces to join (`--join-ns`).
    pub join_ns: Vec<JoinNs>,
    /// Make the restored root task a child of the caller (a sibling of `criu swrk`) rather
    /// than of CRIU: it does not depend on CRIU staying around, and the caller must reap it.
    pub rst_sibling: bool,
    /// Leave every restored task stopped (SIGSTOP); the caller resumes them with SIGCONT.
    pub leave_stopped: bool,
}

impl RestoreOpts {
    /// Restore options for the images in `images_dir`, everything else at its default
    /// (cgroups [`ManageCgroupsMode::Soft`], debug log `restore.log`, no `rst_sibling`).
    pub fn new(images_dir: impl Into<PathBuf>) -> Self {
        Self {
            images_dir: images_dir.into(),
            work_dir: None,
            log_file: DEFAULT_RESTORE_LOG.to_owned(),
            log_level: DEFAULT_LOG_LEVEL,
            tcp_established: false,
            file_locks: false,
            ext_unix_sk: false,
            shell_job: false,
            manage_cgroups_mode: ManageCgroupsMode::default(),
            network_lock: NetworkLockMethod::default(),
            external: Vec::new(),
            ext_mounts: Vec::new(),
            root: None,
            inherit_fds: Vec::new(),
            join_ns: Vec::new(),
            rst_sibling: false,
            leave_stopped: false,
        }
    }

    /// Checks what can be checked without touching the system.
    ///
    /// # Errors
    /// The first problem found.
    pub fn validate(&self) -> Result<(), OptsError> {
        validate_log(&self.log_file, self.log_level)?;
        validate_externals(&self.external, &self.ext_mounts)?;
        if let Some(root) = &self.root {
            require_absolute("root", root)?;
        }
        let mut keys = HashSet::new();
        for inherit in &self.inherit_fds {
            if inherit.key.is_empty() {
                return Err(OptsError::Empty {
                    what: "inherit fd key",
                });
            }
            if !keys.insert(inherit.key.as_str()) {
                return Err(OptsError::DuplicateInheritKey(inherit.key.clone()));
            }
        }
        let mut kinds = HashSet::new();
        for join in &self.join_ns {
            if !kinds.insert(join.ns) {
                return Err(OptsError::DuplicateJoinNs(join.ns));
            }
            if let NsFile::Path(path) = &join.file {
                require_absolute("join-ns file", path)?;
            }
        }
        Ok(())
    }

    /// Where CRIU writes the log of this restore.
    pub fn log_path(&self) -> PathBuf {
        log_path(&self.images_dir, self.work_dir.as_deref(), &self.log_file)
    }

    /// The descriptors the `criu swrk` child must have, in the order [`Self::to_rpc`] numbers
    /// them: inherited fds, then pinned namespace files.
    pub(crate) fn child_fds(&self) -> Vec<BorrowedFd<'_>> {
        self.inherit_fds
            .iter()
            .map(|inherit| inherit.fd.as_fd())
            .chain(self.join_ns.iter().filter_map(|join| match &join.file {
                NsFile::Fd(fd) => Some(fd.as_fd()),
                NsFile::Path(_) => None,
            }))
            .collect()
    }

    /// The RPC options. `images_dir_fd`/`work_dir_fd` are numbered in the client process;
    /// `first_child_fd` is the number the first of [`Self::child_fds`] gets in the `criu swrk`
    /// child, the others following consecutively.
    pub(crate) fn to_rpc(
        &self,
        images_dir_fd: RawFd,
        work_dir_fd: Option<RawFd>,
        first_child_fd: RawFd,
    ) -> rpc::CriuOpts {
        let mut next_fd = first_child_fd;
        let mut take_fd = || {
            let fd = next_fd;
            next_fd += 1;
            fd
        };
        let inherit_fd = self
            .inherit_fds
            .iter()
            .map(|inherit| rpc::InheritFd {
                key: inherit.key.clone(),
                fd: take_fd(),
            })
            .collect();
        let join_ns = self
            .join_ns
            .iter()
            .map(|join| rpc::JoinNamespace {
                ns: join.ns.as_str().to_owned(),
                ns_file: match &join.file {
                    NsFile::Path(path) => path.to_string_lossy().into_owned(),
                    NsFile::Fd(_) => format!("/proc/self/fd/{}", take_fd()),
                },
                extra_opt: None,
            })
            .collect();
        let mut opts = rpc::CriuOpts {
            images_dir_fd,
            work_dir_fd,
            log_file: Some(self.log_file.clone()),
            log_level: Some(log_level_to_rpc(self.log_level)),
            tcp_established: Some(self.tcp_established),
            file_locks: Some(self.file_locks),
            ext_unix_sk: Some(self.ext_unix_sk),
            shell_job: Some(self.shell_job),
            notify_scripts: Some(false),
            rst_sibling: Some(self.rst_sibling),
            leave_stopped: Some(self.leave_stopped),
            root: self
                .root
                .as_ref()
                .map(|root| root.to_string_lossy().into_owned()),
            external: self.external.clone(),
            ext_mnt: ext_mnt_to_rpc(&self.ext_mounts),
            inherit_fd,
            join_ns,
            ..Default::default()
        };
        opts.set_manage_cgroups_mode(self.manage_cgroups_mode.to_rpc());
        opts.set_network_lock(self.network_lock.to_rpc());
        opts
    }
}

fn log_path(images_dir: &Path, work_dir: Option<&Path>, log_file: &str) -> PathBuf {
    work_dir.unwrap_or(images_dir).join(log_file)
}

fn log_level_to_rpc(level: u32) -> i32 {
    // Validated to be at most MAX_LOG_LEVEL before any request is built.
    i32::try_from(level.min(MAX_LOG_LEVEL)).unwrap_or(i32::MAX)
}

fn ext_mnt_to_rpc(mounts: &[ExtMount]) -> Vec<rpc::ExtMountMap> {
    mounts
        .iter()
        .map(|mount| rpc::ExtMountMap {
            key: mount.key.clone(),
            val: mount.value.clone(),
        })
        .collect()
}

fn validate_log(log_file: &str, log_level: u32) -> Result<(), OptsError> {
    if log_file.is_empty() || log_file.contains('/') || log_file == "." || log_file == ".." {
        return Err(OptsError::LogFile(log_file.to_owned()));
    }
    if log_level > MAX_LOG_LEVEL {
        return Err(OptsError::LogLevel(log_level));
    }
    Ok(())
}

fn validate_externals(external: &[String], ext_mounts: &[ExtMount]) -> Result<(), OptsError> {
    if external.iter().any(String::is_empty) {
        return Err(OptsError::Empty {
            what: "external resource",
        });
    }
    for mount in ext_mounts {
        if mount.key.is_empty() {
            return Err(OptsError::Empty {
                what: "ext mount key",
            });
        }
        if mount.value.is_empty() {
            return Err(OptsError::Empty {
                what: "ext mount value",
            });
        }
    }
    Ok(())
}

fn require_absolute(what: &'static str, path: &Path) -> Result<(), OptsError> {
    if path.is_absolute() {
        Ok(())
    } else {
        Err(OptsError::RelativePath {
            what,
            path: path.to_owned(),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::fs::File;

    use super::*;

    fn devnull() -> OwnedFd {
        File::open("/dev/null").expect("open /dev/null").into()
    }

    #[test]
    fn dump_defaults_are_criu_defaults_with_a_debug_log_in_the_images_dir() {
        let opts = DumpOpts::new(Pid::from_raw(42), "/images");
        assert_eq!(opts.validate(), Ok(()));
        assert_eq!(opts.log_path(), Path::new("/images/dump.log"));
        let rpc = opts.to_rpc(7, None);
        assert_eq!(rpc.images_dir_fd, 7);
        assert_eq!(rpc.pid, Some(42));
        assert_eq!(rpc.log_file.as_deref(), Some("dump.log"));
        assert_eq!(rpc.log_level, Some(4));
        assert_eq!(rpc.leave_running, Some(false));
        assert_eq!(rpc.manage_cgroups_mode(), rpc::CriuCgMode::Soft);
        assert_eq!(rpc.network_lock(), rpc::CriuNetworkLockMethod::Iptables);
        assert_eq!(rpc.notify_scripts, Some(false));
        assert_eq!(rpc.orphan_pts_master, None);
    }

    #[test]
    fn dump_maps_externals_and_mounts() {
        let opts = DumpOpts {
            external: vec!["net[4026531993]:extRootNetNS".to_owned()],
            ext_mounts: vec![ExtMount {
                key: "/data".to_owned(),
                value: "/data".to_owned(),
            }],
            manage_cgroups_mode: ManageCgroupsMode::Ignore,
            work_dir: Some(PathBuf::from("/work")),
            ..DumpOpts::new(Pid::from_raw(42), "/images")
        };
        assert_eq!(opts.log_path(), Path::new("/work/dump.log"));
        let rpc = opts.to_rpc(7, Some(8));
        assert_eq!(rpc.work_dir_fd, Some(8));
        assert_eq!(rpc.external, vec!["net[4026531993]:extRootNetNS"]);
        assert_eq!(rpc.ext_mnt[0].key, "/data");
        assert_eq!(rpc.manage_cgroups_mode(), rpc::CriuCgMode::Ignore);
    }

    #[test]
    fn dump_rejects_bad_pid_log_and_empty_entries() {
        let base = DumpOpts::new(Pid::from_raw(42), "/images");
        let bad_pid = DumpOpts {
            pid: Pid::from_raw(0),
            ..base.clone()
        };
        assert_eq!(bad_pid.validate(), Err(OptsError::Pid(0)));
        for name in ["", "a/b", ".", ".."] {
            let bad_log = DumpOpts {
                log_file: name.to_owned(),
                ..base.clone()
            };
            assert_eq!(bad_log.validate(), Err(OptsError::LogFile(name.to_owned())));
        }
        let bad_level = DumpOpts {
            log_level: 5,
            ..base.clone()
        };
        assert_eq!(bad_level.validate(), Err(OptsError::LogLevel(5)));
        let empty_external = DumpOpts {
            external: vec![String::new()],
            ..base.clone()
        };
        assert!(matches!(
            empty_external.validate(),
            Err(OptsError::Empty { .. })
        ));
    }

    #[test]
    fn restore_numbers_inherited_then_pinned_namespace_fds_consecutively() {
        let opts = RestoreOpts {
            inherit_fds: vec![
                InheritFd {
                    key: "pipe:[1]".to_owned(),
                    fd: devnull(),
                },
                InheritFd {
                    key: "extRootNetNS".to_owned(),
                    fd: devnull(),
                },
            ],
            join_ns: vec![
                JoinNs {
                    ns: NamespaceKind::Uts,
                    file: NsFile::Fd(devnull()),
                },
                JoinNs {
                    ns: NamespaceKind::Ipc,
                    file: NsFile::Path(PathBuf::from("/proc/1/ns/ipc")),
                },
            ],
            root: Some(PathBuf::from("/rootfs")),
            rst_sibling: true,
            ..RestoreOpts::new("/images")
        };
        assert_eq!(opts.validate(), Ok(()));
        assert_eq!(opts.child_fds().len(), 3);
        let rpc = opts.to_rpc(9, None, 4);
        let inherit: Vec<_> = rpc
            .inherit_fd
            .iter()
            .map(|i| (i.key.as_str(), i.fd))
            .collect();
        assert_eq!(inherit, vec![("pipe:[1]", 4), ("extRootNetNS", 5)]);
        assert_eq!(rpc.join_ns[0].ns, "uts");
        assert_eq!(rpc.join_ns[0].ns_file, "/proc/self/fd/6");
        assert_eq!(rpc.join_ns[1].ns_file, "/proc/1/ns/ipc");
        assert_eq!(rpc.root.as_deref(), Some("/rootfs"));
        assert_eq!(rpc.rst_sibling, Some(true));
        assert_eq!(rpc.pid, None);
        assert_eq!(rpc.log_file.as_deref(), Some("restore.log"));
    }

    #[test]
    fn mode_and_lock_names_round_trip_like_criu_spells_them() {
        for mode in [
            ManageCgroupsMode::Ignore,
            ManageCgroupsMode::Soft,
            ManageCgroupsMode::Full,
            ManageCgroupsMode::Strict,
        ] {
            assert_eq!(mode.as_str().parse(), Ok(mode));
        }
        assert_eq!(ManageCgroupsMode::Ignore.to_string(), "ignore");
        for method in [
            NetworkLockMethod::Iptables,
            NetworkLockMethod::Nftables,
            NetworkLockMethod::Skip,
        ] {
            assert_eq!(method.as_str().parse(), Ok(method));
        }
        assert!(matches!(
            "IGNORE".parse::<ManageCgroupsMode>(),
            Err(OptsError::UnknownName { .. })
        ));
    }

    #[test]
    fn restore_rejects_duplicates_and_relative_paths() {
        let dup_key = RestoreOpts {
            inherit_fds: vec![
                InheritFd {
                    key: "k".to_owned(),
                    fd: devnull(),
                },
                InheritFd {
                    key: "k".to_owned(),
                    fd: devnull(),
                },
            ],
            ..RestoreOpts::new("/images")
        };
        assert_eq!(
            dup_key.validate(),
            Err(OptsError::DuplicateInheritKey("k".to_owned()))
        );
        let relative_root = RestoreOpts {
            root: Some(PathBuf::from("rootfs")),
            ..RestoreOpts::new("/images")
        };
        assert!(matches!(
            relative_root.validate(),
            Err(OptsError::RelativePath { what: "root", .. })
        ));
        let dup_ns = RestoreOpts {
            join_ns: vec![
                JoinNs {
                    ns: NamespaceKind::Net,
                    file: NsFile::Path(PathBuf::from("/proc/1/ns/net")),
                },
                JoinNs {
                    ns: NamespaceKind::Net,
                    file: NsFile::Fd(devnull()),
                },
            ],
            ..RestoreOpts::new("/images")
        };
        assert_eq!(
            dup_ns.validate(),
            Err(OptsError::DuplicateJoinNs(NamespaceKind::Net))
        );
    }
}
