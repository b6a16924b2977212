//! `/proc/<pid>/mountinfo` parsing (proc(5)): the mounts a process sees, with the overlay
//! options of its root, as the kernel reports them.

use std::path::{Path, PathBuf};

use super::ResolveError;

/// One line of mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountInfo {
    /// Mount id.
    pub id: u32,
    /// Parent mount id.
    pub parent: u32,
    /// Root of the mount within its filesystem (`/` unless a bind of a sub-path).
    pub root: String,
    /// Mount point, relative to the process's root.
    pub mount_point: String,
    /// Per-mount options.
    pub options: String,
    /// Filesystem type.
    pub fstype: String,
    /// Mount source.
    pub source: String,
    /// Per-superblock options.
    pub super_options: String,
}

impl MountInfo {
    /// The value of a per-superblock option (`upperdir`, …), unescaped.
    pub fn super_option(&self, key: &str) -> Option<String> {
        self.super_options
            .split(',')
            .filter_map(|kv| kv.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| unescape(v))
    }
}

/// The kernel escapes space, tab, newline and backslash as octal (`\040`).
fn unescape(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\\' && i + 3 < bytes.len() {
            let digits = &bytes[i + 1..(i + 4).min(bytes.len())];
            if digits.len() == 3 && digits.iter().all(|d| (b'0'..=b'7').contains(d)) {
                let value = digits
                    .iter()
                    .fold(0u32, |acc, d| acc * 8 + u32::from(d - b'0'));
                if let Ok(byte) = u8::try_from(value) {
                    out.push(byte);
                    i += 4;
                    continue;
                }
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text. Lines that do not follow proc(5) are an error naming the line.
///
/// # Errors
/// [`ResolveError::Read`] with an `InvalidData` error quoting the line.
pub fn parse(text: &str, origin: &Path) -> Result<Vec<MountInfo>, ResolveError> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            parse_line(line).ok_or_else(|| ResolveError::Read {
                path: origin.to_path_buf(),
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("malformed mountinfo line: {line}"),
                ),
            })
        })
        .collect()
}

fn parse_line(line: &str) -> Option<MountInfo> {
    let (left, right) = line.split_once(" - ")?;
    let left: Vec<&str> = left.split(' ').collect();
    let right: Vec<&str> = right.splitn(3, ' ').collect();
    if left.len() < 6 || right.len() < 2 {
        return None;
    }
    Some(MountInfo {
        id: left[0].parse().ok()?,
        parent: left[1].parse().ok()?,
        root: unescape(left[3]),
        mount_point: unescape(left[4]),
        options: left[5].to_owned(),
        fstype: right[0].to_owned(),
        source: unescape(right[1]),
        super_options: right.get(2).copied().unwrap_or_default().to_owned(),
    })
}

/// Reads and parses `/proc/<pid>/mountinfo`.
///
/// # Errors
/// [`ResolveError::Read`].
pub fn read(pid: i32) -> Result<Vec<MountInfo>, ResolveError> {
    let path = PathBuf::from(format!("/proc/{pid}/mountinfo"));
    let text = std::fs::read_to_string(&path).map_err(|source| ResolveError::Read {
        path: path.clone(),
        source,
    })?;
    parse(&text, &path)
}

/// The overlay upper directory of the process's root mount, if its root is an overlay.
pub fn overlay_upper_dir(mounts: &[MountInfo]) -> Option<PathBuf> {
    mounts
        .iter()
        .rev()
        .find(|m| m.mount_point == "/")
        .filter(|m| m.fstype == "overlay")
        .and_then(|m| m.super_option("upperdir"))
        .map(PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
1021 950 0:97 / / rw,relatime master:1 - overlay overlay rw,lowerdir=/img/busybox,upperdir=/state/c1/upper,workdir=/state/c1/work
1022 1021 0:99 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1023 1021 0:100 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
1030 1021 8:1 /data/with\\040space /data rw,relatime - ext4 /dev/vda rw
1031 1023 0:100 /null /proc/kcore rw,nosuid - tmpfs tmpfs rw,size=65536k,mode=755
";

    #[test]
    fn parses_fields_and_unescapes_octal() {
        let mounts = parse(SAMPLE, Path::new("x")).unwrap();
        assert_eq!(mounts.len(), 5);
        assert_eq!(mounts[0].fstype, "overlay");
        assert_eq!(mounts[3].root, "/data/with space");
        assert_eq!(mounts[3].mount_point, "/data");
        assert_eq!(mounts[4].root, "/null");
        assert_eq!(mounts[1].super_options, "rw");
    }

    #[test]
    fn finds_the_overlay_upper_dir_of_the_root() {
        let mounts = parse(SAMPLE, Path::new("x")).unwrap();
        assert_eq!(
            overlay_upper_dir(&mounts),
            Some(PathBuf::from("/state/c1/upper"))
        );
        assert_eq!(overlay_upper_dir(&mounts[1..]), None);
    }

    #[test]
    fn malformed_lines_are_errors_quoting_the_line() {
        let err = parse("garbage line\n", Path::new("/proc/1/mountinfo")).unwrap_err();
        assert!(format!("{err:?}").contains("garbage line"));
    }

    #[test]
    fn reads_our_own_mountinfo() {
        let mounts = read(std::process::id().try_into().unwrap()).unwrap();
        assert!(mounts.iter().any(|m| m.mount_point == "/"));
    }
}
