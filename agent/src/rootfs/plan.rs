//! Reading a layer tarball: every entry parsed and validated into a plan before anything
//! is applied.

use std::collections::{HashMap, HashSet};
use std::ffi::{OsStr, OsString};
use std::fs::File;
use std::io::{self, BufReader, Read};
use std::os::unix::ffi::{OsStrExt, OsStringExt};
use std::path::{Path, PathBuf};

use tar::{Archive, EntryType};

use super::walk::*;
use super::*;

pub(super) fn parse_mtime(text: &str) -> Option<MTime> {
    let (negative, text) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (whole, frac) = text.split_once('.').unwrap_or((text, ""));
    if whole.is_empty() || !whole.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    if !frac.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let secs: i64 = whole.parse().ok()?;
    let mut digits: String = frac.chars().take(9).collect();
    while digits.len() < 9 {
        digits.push('0');
    }
    let nanos: u32 = digits.parse().ok()?;
    if !negative {
        return Some(MTime { secs, nanos });
    }
    if nanos == 0 {
        Some(MTime {
            secs: -secs,
            nanos: 0,
        })
    } else {
        Some(MTime {
            secs: -secs - 1,
            nanos: 1_000_000_000 - nanos,
        })
    }
}

// ---------------------------------------------------------------------------------------------
// Reading and validating

/// A reader that remembers whether it ever reached end of file (a tar archive that ends without
/// its end-of-archive marker was truncated).
pub(super) struct EofWatch<R> {
    inner: R,
    hit_eof: bool,
}

impl<R: Read> Read for EofWatch<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.hit_eof = true;
        }
        Ok(n)
    }
}

/// Calls `each` with every entry of the tarball, parsed (`None` for an ignored root directory
/// entry), then checks that the archive ended with its end-of-archive marker.
pub(super) fn for_each_entry(
    tar: &Path,
    mut each: impl FnMut(
        usize,
        Option<PlanEntry>,
        &mut tar::Entry<'_, EofWatch<BufReader<File>>>,
    ) -> Result<(), RootfsError>,
) -> Result<(), RootfsError> {
    let file = File::open(tar).map_err(io_err("open layer", tar))?;
    let mut archive = Archive::new(EofWatch {
        inner: BufReader::new(file),
        hit_eof: false,
    });
    let corrupt = |index: usize| {
        move |source: io::Error| RootfsError::Corrupt {
            tar: tar.to_path_buf(),
            index,
            source,
        }
    };
    let mut count = 0;
    {
        let entries = archive.entries().map_err(corrupt(0))?;
        for (index, entry) in entries.enumerate() {
            count = index + 1;
            let mut entry = entry.map_err(corrupt(index))?;
            let parsed = parse_entry(tar, index, &mut entry)?;
            each(index, parsed, &mut entry)?;
            // Read whatever `each` left, so truncated data is noticed here.
            io::copy(&mut entry, &mut io::sink()).map_err(corrupt(index))?;
        }
    }
    if archive.into_inner().hit_eof {
        return Err(RootfsError::Corrupt {
            tar: tar.to_path_buf(),
            index: count,
            source: io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the archive ends without its end-of-archive marker",
            ),
        });
    }
    Ok(())
}

/// Normalises an archive path: relative, no `..`, no NUL; `.` and empty components dropped.
fn normalize(bytes: &[u8]) -> Result<PathBuf, String> {
    if bytes.contains(&0) {
        return Err("the path contains a NUL byte".to_owned());
    }
    if bytes.first() == Some(&b'/') {
        return Err("absolute path".to_owned());
    }
    let mut out = PathBuf::new();
    for component in bytes.split(|b| *b == b'/') {
        match component {
            b"" | b"." => {}
            b".." => return Err("the path contains `..`".to_owned()),
            name => out.push(OsStr::from_bytes(name)),
        }
    }
    Ok(out)
}

fn parse_entry<R: Read>(
    tar: &Path,
    index: usize,
    entry: &mut tar::Entry<'_, R>,
) -> Result<Option<PlanEntry>, RootfsError> {
    if entry.header().entry_type() == EntryType::XGlobalHeader {
        // A PAX global header (`git archive` writes one): nothing to apply.
        return Ok(None);
    }
    let raw_path = entry.path_bytes().into_owned();
    let shown = String::from_utf8_lossy(&raw_path).into_owned();
    let refuse = |reason: String| RootfsError::UnsafeEntry {
        tar: tar.to_path_buf(),
        index,
        entry: shown.clone(),
        reason,
    };
    let corrupt = |source: io::Error| RootfsError::Corrupt {
        tar: tar.to_path_buf(),
        index,
        source,
    };
    let path = normalize(&raw_path).map_err(&refuse)?;
    let header = entry.header();
    let entry_type = header.entry_type();
    let mode = header.mode().map_err(corrupt)? & 0o7777;
    let uid = u32::try_from(header.uid().map_err(corrupt)?)
        .map_err(|_| refuse("uid out of range".to_owned()))?;
    let gid = u32::try_from(header.gid().map_err(corrupt)?)
        .map_err(|_| refuse("gid out of range".to_owned()))?;
    let header_mtime = header.mtime().map_err(corrupt)?;
    let mut mtime = MTime {
        secs: i64::try_from(header_mtime).map_err(|_| refuse("mtime out of range".to_owned()))?,
        nanos: 0,
    };
    let link = entry.link_name_bytes().map(|b| b.into_owned());
    let mut xattrs = Vec::new();
    if let Some(pax) = entry.pax_extensions().map_err(corrupt)? {
        for record in pax {
            let record = record.map_err(corrupt)?;
            match pax_record(&record).map_err(&refuse)? {
                Pax::Mtime(value) => mtime = value,
                Pax::Xattr(name) => xattrs.push((name, record.value_bytes().to_vec())),
                Pax::Ignored => {}
            }
        }
    }
    let Some((path, kind)) = entry_kind(entry_type, path, link, entry.size()).map_err(&refuse)?
    else {
        return Ok(None);
    };
    if path.as_os_str().is_empty() {
        return Err(refuse("the entry names the root itself".to_owned()));
    }
    Ok(Some(PlanEntry {
        index,
        path,
        kind,
        mode,
        uid,
        gid,
        mtime,
        xattrs,
    }))
}

/// What a PAX record of an entry means to the plan.
enum Pax {
    /// The entry's modification time, to the nanosecond.
    Mtime(MTime),
    /// An extended attribute the plan carries (its value is the record's).
    Xattr(OsString),
    /// Anything else.
    Ignored,
}

/// Reads one PAX record; the error is why the entry is refused.
fn pax_record(record: &tar::PaxExtension<'_>) -> Result<Pax, String> {
    let key = record
        .key()
        .map_err(|_| "a PAX record key is not UTF-8".to_owned())?;
    if key == "mtime" {
        return record
            .value()
            .ok()
            .and_then(parse_mtime)
            .map(Pax::Mtime)
            .ok_or_else(|| "malformed PAX mtime".to_owned());
    }
    let Some(name) = key.strip_prefix(PAX_XATTR_PREFIX) else {
        return Ok(Pax::Ignored);
    };
    let name = OsString::from(name);
    if name.is_empty() || name.as_bytes().contains(&0) {
        return Err("malformed extended attribute name".to_owned());
    }
    if is_overlay_xattr(&name) {
        return Err(format!(
            "carries overlayfs's private extended attribute {}",
            name.to_string_lossy()
        ));
    }
    Ok(if is_carried_xattr(&name) {
        Pax::Xattr(name)
    } else {
        Pax::Ignored
    })
}

/// What an entry of type `entry_type` at `path` makes (whiteout and opaque markers read as
/// what they mark); `None` for the root directory, which is nothing to apply. The error is why
/// the entry is refused.
fn entry_kind(
    entry_type: EntryType,
    path: PathBuf,
    link: Option<Vec<u8>>,
    size: u64,
) -> Result<Option<(PathBuf, EntryKind)>, String> {
    let name = path.file_name().map(OsStr::as_bytes).unwrap_or_default();
    let is_marker = name.starts_with(WHITEOUT_PREFIX.as_bytes());
    Ok(Some(match entry_type {
        EntryType::Regular | EntryType::Continuous if is_marker => {
            let parent = path.parent().map(Path::to_path_buf).unwrap_or_default();
            if name == OPAQUE_MARKER.as_bytes() {
                if parent.as_os_str().is_empty() {
                    return Err("opaque marker on the root directory".to_owned());
                }
                (parent, EntryKind::Opaque)
            } else {
                let hidden = &name[WHITEOUT_PREFIX.len()..];
                if hidden.starts_with(WHITEOUT_PREFIX.as_bytes()) {
                    return Err("unsupported whiteout meta-entry".to_owned());
                }
                if hidden.is_empty() || hidden == b"." || hidden == b".." {
                    return Err("whiteout of an invalid name".to_owned());
                }
                (parent.join(OsStr::from_bytes(hidden)), EntryKind::Whiteout)
            }
        }
        _ if is_marker => {
            return Err("a whiteout name on an entry that is not a regular file".to_owned());
        }
        EntryType::Regular | EntryType::Continuous => (path, EntryKind::File { size }),
        EntryType::Directory if path.as_os_str().is_empty() => return Ok(None),
        EntryType::Directory => (path, EntryKind::Dir),
        EntryType::Symlink => {
            let target = link.ok_or_else(|| "symbolic link without a target".to_owned())?;
            if target.is_empty() || target.contains(&0) {
                return Err("invalid symbolic link target".to_owned());
            }
            (
                path,
                EntryKind::Symlink {
                    target: PathBuf::from(OsString::from_vec(target)),
                },
            )
        }
        EntryType::Link => {
            let target = link.ok_or_else(|| "hard link without a target".to_owned())?;
            let target =
                normalize(&target).map_err(|reason| format!("hard link target: {reason}"))?;
            (path, EntryKind::Hardlink { target })
        }
        EntryType::Fifo => (path, EntryKind::Fifo),
        EntryType::Char | EntryType::Block => return Err("device node".to_owned()),
        EntryType::GNUSparse => return Err("sparse entries are not supported".to_owned()),
        other => return Err(format!("unsupported entry type {other:?}")),
    }))
}

/// Cross-entry checks: duplicates, parents, hard link targets.
#[derive(Default)]
struct Validator {
    /// Paths added by the layer → whether they are directories.
    added: HashMap<PathBuf, bool>,
    /// Paths the layer adds as regular files (hard link targets).
    files: HashSet<PathBuf>,
    /// Every proper ancestor of every added path.
    implied_dirs: HashSet<PathBuf>,
}

impl Validator {
    fn check(&mut self, entry: &PlanEntry) -> Result<(), String> {
        let is_dir = match &entry.kind {
            EntryKind::Whiteout | EntryKind::Opaque => return Ok(()),
            EntryKind::Dir => true,
            EntryKind::Hardlink { target } => {
                if !self.files.contains(target) {
                    return Err(format!(
                        "hard link to {}, which is not an earlier regular file of this layer",
                        target.display()
                    ));
                }
                false
            }
            EntryKind::File { .. } | EntryKind::Symlink { .. } | EntryKind::Fifo => false,
        };
        if self.added.contains_key(&entry.path) {
            return Err("the path appears twice in the layer".to_owned());
        }
        if !is_dir && self.implied_dirs.contains(&entry.path) {
            return Err("the layer has entries below this non-directory".to_owned());
        }
        for ancestor in entry.path.ancestors().skip(1) {
            if ancestor.as_os_str().is_empty() {
                break;
            }
            if self.added.get(ancestor) == Some(&false) {
                return Err(format!(
                    "its parent {} is not a directory in this layer",
                    ancestor.display()
                ));
            }
            self.implied_dirs.insert(ancestor.to_path_buf());
        }
        self.added.insert(entry.path.clone(), is_dir);
        if matches!(
            entry.kind,
            EntryKind::File { .. } | EntryKind::Hardlink { .. }
        ) {
            self.files.insert(entry.path.clone());
        }
        Ok(())
    }
}

/// Parses and validates the whole tarball without touching any target: every path relative and
/// free of `..` and NUL, no device nodes, hard links only to earlier regular files of the layer,
/// no duplicate paths, no entry below a non-directory of the layer, a readable archive with its
/// end marker. A restore calls this first so it can refuse before changing anything.
///
/// A directory entry for the root itself (`./`) and PAX global headers are ignored;
/// `security.selinux` attributes are dropped.
pub fn read_plan(tar: &Path) -> Result<DiffPlan, RootfsError> {
    let mut plan = DiffPlan::default();
    let mut validator = Validator::default();
    for_each_entry(tar, |index, parsed, _entry| {
        let Some(entry) = parsed else {
            return Ok(());
        };
        validator
            .check(&entry)
            .map_err(|reason| RootfsError::UnsafeEntry {
                tar: tar.to_path_buf(),
                index,
                entry: entry.path.to_string_lossy().into_owned(),
                reason,
            })?;
        let stats = &mut plan.stats;
        match &entry.kind {
            EntryKind::Dir => stats.dirs += 1,
            EntryKind::File { size } => {
                stats.files += 1;
                stats.bytes += size;
            }
            EntryKind::Symlink { .. } => stats.symlinks += 1,
            EntryKind::Hardlink { .. } => stats.hardlinks += 1,
            EntryKind::Fifo => stats.fifos += 1,
            EntryKind::Whiteout => stats.whiteouts += 1,
            EntryKind::Opaque => stats.opaque_dirs += 1,
        }
        plan.entries.push(entry);
        Ok(())
    })?;
    Ok(plan)
}

// ---------------------------------------------------------------------------------------------
// Applying
