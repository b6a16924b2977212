//! Tests of capture, plan and apply on real overlay mounts.
use super::apply::*;
use super::capture::*;
use super::plan::*;
use super::*;
use std::ffi::OsString;
use std::fs::{self, File};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::sys::stat::Mode;
use nix::unistd::{Gid, Uid};
use std::collections::BTreeMap;
use std::fs::FileTimes;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt, chown, symlink};
use std::os::unix::net::UnixListener;
use std::time::{Duration, UNIX_EPOCH};
use tar::{Builder, EntryType, Header};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use tempfile::TempDir;

// ---- helpers ------------------------------------------------------------------------------

/// Whether overlay tests can run. CI sets `WARMSTART_REQUIRE_ROOT=1`, so there a missing
/// privilege fails the test instead of skipping it.
fn is_root() -> bool {
    crate::testing::root("mounting overlays")
}

/// Unmounts on drop, also when the test panics.
struct MountGuard(PathBuf);

impl Drop for MountGuard {
    fn drop(&mut self) {
        let _ = umount2(&self.0, MntFlags::MNT_DETACH);
    }
}

struct Overlay {
    upper: PathBuf,
    merged: PathBuf,
    _guard: MountGuard,
}

fn mount_overlay(base: &Path, name: &str, lower: &Path) -> Overlay {
    let dir = base.join(name);
    let upper = dir.join("upper");
    let work = dir.join("work");
    let merged = dir.join("merged");
    for d in [&upper, &work, &merged] {
        fs::create_dir_all(d).expect("create overlay dirs");
    }
    let options = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        MsFlags::empty(),
        Some(options.as_str()),
    )
    .expect("mount overlay");
    Overlay {
        upper,
        merged: merged.clone(),
        _guard: MountGuard(merged),
    }
}

fn write(path: &Path, data: &str) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("create parent");
    }
    fs::write(path, data).expect("write file");
}

fn chmod(path: &Path, mode: u32) {
    fs::set_permissions(path, fs::Permissions::from_mode(mode)).expect("chmod");
}

#[derive(Debug, PartialEq, Eq)]
struct Node {
    kind: &'static str,
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: (i64, i64),
    content: Option<Vec<u8>>,
    target: Option<PathBuf>,
    xattrs: Vec<(OsString, Vec<u8>)>,
}

/// Every path below `root` with its type, content, mode, owner, mtime, link target and
/// `user.*` xattrs (the root's own mtime is left out: applying changes it).
fn snapshot(root: &Path) -> BTreeMap<PathBuf, Node> {
    let mut out = BTreeMap::new();
    snapshot_into(root, Path::new(""), &mut out);
    out
}

fn snapshot_into(root: &Path, rel: &Path, out: &mut BTreeMap<PathBuf, Node>) {
    let full = root.join(rel);
    let meta = fs::symlink_metadata(&full).expect("lstat");
    let ft = meta.file_type();
    let kind = if ft.is_dir() {
        "dir"
    } else if ft.is_symlink() {
        "symlink"
    } else if ft.is_file() {
        "file"
    } else if ft.is_fifo() {
        "fifo"
    } else if ft.is_socket() {
        "socket"
    } else {
        "other"
    };
    let mut xattrs = Vec::new();
    if !ft.is_symlink() {
        for name in xattr::list(&full).expect("list xattrs") {
            if name.as_bytes().starts_with(b"user.") {
                let value = xattr::get(&full, &name)
                    .expect("get xattr")
                    .unwrap_or_default();
                xattrs.push((name, value));
            }
        }
        xattrs.sort();
    }
    let node = Node {
        kind,
        mode: meta.mode() & 0o7777,
        uid: meta.uid(),
        gid: meta.gid(),
        mtime: if rel.as_os_str().is_empty() {
            (0, 0)
        } else {
            (meta.mtime(), meta.mtime_nsec())
        },
        content: ft.is_file().then(|| fs::read(&full).expect("read")),
        target: ft
            .is_symlink()
            .then(|| fs::read_link(&full).expect("readlink")),
        xattrs,
    };
    out.insert(rel.to_path_buf(), node);
    if ft.is_dir() {
        let mut names: Vec<OsString> = fs::read_dir(&full)
            .expect("read_dir")
            .map(|e| e.expect("dir entry").file_name())
            .collect();
        names.sort();
        for name in names {
            snapshot_into(root, &rel.join(name), out);
        }
    }
}

struct Raw<'a> {
    kind: EntryType,
    name: &'a [u8],
    link: Option<&'a [u8]>,
    data: &'a [u8],
}

fn raw(kind: EntryType, name: &'static str) -> Raw<'static> {
    Raw {
        kind,
        name: name.as_bytes(),
        link: None,
        data: b"",
    }
}

/// Writes a tar whose names are copied byte for byte (no validation by the tar crate).
fn raw_tar(path: &Path, entries: &[Raw<'_>]) {
    let mut builder = Builder::new(Vec::new());
    for e in entries {
        let mut header = Header::new_gnu();
        header.set_entry_type(e.kind);
        header.set_size(e.data.len() as u64);
        header.set_mode(if e.kind == EntryType::Directory {
            0o755
        } else {
            0o644
        });
        header.set_uid(u64::from(Uid::effective().as_raw()));
        header.set_gid(u64::from(Gid::effective().as_raw()));
        header.set_mtime(1_700_000_000);
        header.as_old_mut().name[..e.name.len()].copy_from_slice(e.name);
        if let Some(link) = e.link {
            header.as_old_mut().linkname[..link.len()].copy_from_slice(link);
        }
        header.set_cksum();
        builder.append(&header, e.data).expect("append");
    }
    fs::write(path, builder.into_inner().expect("finish")).expect("write tar");
}

fn names_tar(err: &RootfsError, tar: &Path) {
    let text = err.to_string();
    assert!(
        text.contains(&tar.display().to_string()),
        "error {text:?} does not name {}",
        tar.display()
    );
}

// ---- round trip through real overlays -----------------------------------------------------

#[test]
fn round_trip_through_real_overlays() {
    if !is_root() {
        return;
    }
    let base = TempDir::new().expect("tempdir");
    let lower = base.path().join("lower");
    write(&lower.join("a/keep"), "keep");
    write(&lower.join("a/delete-me"), "bye");
    write(&lower.join("b/dir/x"), "x");
    write(&lower.join("c/file"), "lower c\n");
    write(&lower.join("opaque-dir/old"), "old");
    write(&lower.join("opaque-dir/sub/older"), "older");

    let src = mount_overlay(base.path(), "src", &lower);
    let m = &src.merged;
    // New files and directories, with an xattr, a nanosecond mtime and a hard link.
    fs::create_dir_all(m.join("new-dir/empty-dir")).expect("mkdir");
    write(&m.join("new-dir/new-file"), "new");
    xattr::set(m.join("new-dir/new-file"), "user.test", b"value").expect("setxattr");
    File::options()
        .write(true)
        .open(m.join("new-dir/new-file"))
        .expect("open")
        .set_times(
            FileTimes::new().set_modified(UNIX_EPOCH + Duration::new(1_600_000_000, 123_456_789)),
        )
        .expect("set times");
    fs::hard_link(m.join("new-dir/new-file"), m.join("new-dir/hard")).expect("link");
    // Modify a lower file, change a lower directory's mode.
    fs::write(m.join("c/file"), "lower c\nappended\n").expect("append");
    chmod(&m.join("a"), 0o700);
    // Delete a lower file and a lower directory (whiteouts).
    fs::remove_file(m.join("a/delete-me")).expect("rm");
    fs::remove_dir_all(m.join("b/dir")).expect("rm -rf");
    // rm -rf a lower directory and recreate it (opaque directory).
    fs::remove_dir_all(m.join("opaque-dir")).expect("rm -rf");
    fs::create_dir(m.join("opaque-dir")).expect("mkdir");
    write(&m.join("opaque-dir/new"), "fresh");
    // Symbolic links (absolute, relative, dangling, long target): never followed.
    fs::create_dir(m.join("links")).expect("mkdir");
    symlink("/etc/passwd", m.join("links/abs")).expect("symlink");
    symlink("../c/file", m.join("links/rel")).expect("symlink");
    symlink("nowhere/at/all", m.join("links/dangling")).expect("symlink");
    let long_target = format!("{}/{}", "t".repeat(120), "u".repeat(80));
    symlink(&long_target, m.join("links/long")).expect("symlink");
    // Ownership and special modes.
    write(&m.join("secret"), "s3cr3t");
    chown(m.join("secret"), Some(1234), Some(5678)).expect("chown");
    chmod(&m.join("secret"), 0o600);
    write(&m.join("suid"), "#!/bin/true\n");
    chown(m.join("suid"), Some(1000), Some(1000)).expect("chown");
    chmod(&m.join("suid"), 0o4755);
    // /dev/shm-like nested directories, a FIFO, a socket, a long path.
    write(&m.join("dev/shm/nested/deep/file"), "shm");
    fs::create_dir(m.join("run")).expect("mkdir");
    nix::unistd::mkfifo(&m.join("run/fifo"), Mode::from_bits_truncate(0o600)).expect("mkfifo");
    chmod(&m.join("run/fifo"), 0o640);
    let listener = UnixListener::bind(m.join("run/sock")).expect("bind");
    drop(listener);
    let long_path = PathBuf::from("long")
        .join("x".repeat(120))
        .join("y".repeat(150));
    write(&m.join(&long_path), "long");

    // The kernel really produced a whiteout and an opaque directory.
    let wh = fs::symlink_metadata(src.upper.join("a/delete-me")).expect("whiteout");
    assert!(wh.file_type().is_char_device() && wh.rdev() == 0);
    assert_eq!(
        xattr::get(src.upper.join("opaque-dir"), "trusted.overlay.opaque").expect("xattr"),
        Some(b"y".to_vec())
    );

    let layer = base.path().join("layer.tar");
    let captured = capture_diff(&src.upper, &layer).expect("capture");
    assert_eq!(captured.whiteouts, 2, "{captured:?}");
    assert_eq!(captured.opaque_dirs, 1, "{captured:?}");
    assert_eq!(captured.hardlinks, 1, "{captured:?}");
    assert_eq!(captured.symlinks, 4, "{captured:?}");
    assert_eq!(captured.fifos, 1, "{captured:?}");
    assert_eq!(captured.skipped, 1, "{captured:?}");

    let plan = read_plan(&layer).expect("plan");
    assert_eq!(
        plan.stats,
        DiffStats {
            skipped: 0,
            ..captured
        }
    );
    let opaque = plan
        .entries
        .iter()
        .position(|e| e.kind == EntryKind::Opaque)
        .expect("opaque marker");
    assert_eq!(plan.entries[opaque].path, Path::new("opaque-dir"));
    assert_eq!(plan.entries[opaque - 1].path, Path::new("opaque-dir"));
    assert!(
        plan.entries
            .iter()
            .any(|e| e.kind == EntryKind::Whiteout && e.path == Path::new("a/delete-me"))
    );

    let placeholder = mount_overlay(base.path(), "placeholder", &lower);
    let applied = apply_diff(&layer, &placeholder.merged).expect("apply");
    assert_eq!(applied, plan.stats);

    let mut expected = snapshot(&src.merged);
    assert_eq!(
        expected.remove(Path::new("run/sock")).map(|n| n.kind),
        Some("socket")
    );
    let got = snapshot(&placeholder.merged);
    let expected_keys: Vec<_> = expected.keys().collect();
    let got_keys: Vec<_> = got.keys().collect();
    assert_eq!(expected_keys, got_keys);
    for (path, node) in &expected {
        assert_eq!(Some(node), got.get(path), "{}", path.display());
    }

    let p = &placeholder.merged;
    for gone in ["a/delete-me", "b/dir", "opaque-dir/old", "opaque-dir/sub"] {
        assert!(
            fs::symlink_metadata(p.join(gone)).is_err(),
            "{gone} still exists"
        );
    }
    assert_eq!(fs::read(p.join("a/keep")).expect("read"), b"keep");
    let first = fs::metadata(p.join("new-dir/new-file")).expect("stat");
    let second = fs::metadata(p.join("new-dir/hard")).expect("stat");
    assert_eq!(first.ino(), second.ino(), "hard link lost");
    assert_eq!(first.mtime_nsec(), 123_456_789);
}

#[test]
fn planted_symlinks_in_the_target_are_replaced_never_followed() {
    if !is_root() {
        return;
    }
    let base = TempDir::new().expect("tempdir");
    let lower = base.path().join("lower");
    write(&lower.join("a/keep"), "keep");
    write(&lower.join("a/delete-me"), "bye");
    write(&lower.join("c/file"), "lower c");

    let src = mount_overlay(base.path(), "src", &lower);
    fs::remove_file(src.merged.join("a/delete-me")).expect("rm");
    write(&src.merged.join("a/new"), "new");
    fs::write(src.merged.join("c/file"), "changed").expect("write");
    let layer = base.path().join("layer.tar");
    capture_diff(&src.upper, &layer).expect("capture");

    let outside = base.path().join("outside");
    write(&outside.join("delete-me"), "must survive");
    write(&outside.join("keep"), "outside keep");
    write(&outside.join("target"), "outside target");
    let before = snapshot(&outside);

    let placeholder = mount_overlay(base.path(), "placeholder", &lower);
    let p = &placeholder.merged;
    fs::remove_dir_all(p.join("a")).expect("rm -rf");
    symlink(&outside, p.join("a")).expect("plant a");
    fs::remove_file(p.join("c/file")).expect("rm");
    symlink(outside.join("target"), p.join("c/file")).expect("plant c/file");

    apply_diff(&layer, p).expect("apply");

    assert_eq!(
        snapshot(&outside),
        before,
        "something was written outside the root"
    );
    assert!(fs::symlink_metadata(p.join("a")).expect("lstat").is_dir());
    assert_eq!(fs::read(p.join("a/new")).expect("read"), b"new");
    let c = fs::symlink_metadata(p.join("c/file")).expect("lstat");
    assert!(c.file_type().is_file());
    assert_eq!(fs::read(p.join("c/file")).expect("read"), b"changed");
}

#[test]
fn a_symlinked_parent_not_carried_by_the_layer_is_refused() {
    let base = TempDir::new().expect("tempdir");
    let outside = base.path().join("outside");
    write(&outside.join("victim"), "must survive");
    let root = base.path().join("root");
    fs::create_dir(&root).expect("mkdir");
    symlink(&outside, root.join("x")).expect("plant");

    let layer = base.path().join("layer.tar");
    raw_tar(
        &layer,
        &[
            raw(EntryType::Regular, "x/.wh.victim"),
            Raw {
                data: b"data",
                ..raw(EntryType::Regular, "x/y/file")
            },
        ],
    );
    read_plan(&layer).expect("the layer itself is fine");
    let before = snapshot(&outside);
    let err = apply_diff(&layer, &root).expect_err("must refuse");
    assert!(
        matches!(&err, RootfsError::UnsafeTarget { path, .. } if path == Path::new("x/y")),
        "{err}"
    );
    assert_eq!(snapshot(&outside), before);
}

#[test]
fn kept_paths_are_left_alone() {
    use std::os::unix::fs::MetadataExt as _;
    let base = TempDir::new().expect("tempdir");
    let root = base.path().join("root");
    write(&root.join("etc/hosts"), "the pod's hosts");
    write(&root.join("data/keepme"), "volume");
    write(&root.join("etc/motd"), "image");
    let hosts_ino = fs::metadata(root.join("etc/hosts")).expect("stat").ino();

    let layer = base.path().join("layer.tar");
    raw_tar(
        &layer,
        &[
            raw(EntryType::Directory, "etc/"),
            raw(EntryType::Regular, "etc/.wh.motd"),
            raw(EntryType::Regular, "etc/hosts"),
            Raw {
                data: b"new",
                ..raw(EntryType::Regular, "etc/new")
            },
            raw(EntryType::Regular, "data/.wh.keepme"),
            Raw {
                data: b"below",
                ..raw(EntryType::Regular, "data/sub/file")
            },
        ],
    );
    let keep = [PathBuf::from("etc/hosts"), PathBuf::from("data")];
    apply_diff_keeping(&layer, &root, &keep).expect("apply");

    assert_eq!(fs::read(root.join("etc/new")).expect("read"), b"new");
    assert!(!root.join("etc/motd").exists(), "whiteouts elsewhere apply");
    let hosts = fs::metadata(root.join("etc/hosts")).expect("stat");
    assert_eq!(hosts.ino(), hosts_ino, "a kept file is not replaced");
    assert_eq!(
        fs::read(root.join("etc/hosts")).expect("read"),
        b"the pod's hosts"
    );
    assert_eq!(fs::read(root.join("data/keepme")).expect("read"), b"volume");
    assert!(
        !root.join("data/sub").exists(),
        "nothing added below a kept path"
    );
}

// ---- validation ---------------------------------------------------------------------------

#[test]
fn read_plan_refuses_unsafe_entries() {
    let base = TempDir::new().expect("tempdir");
    let cases: Vec<(&str, Vec<Raw<'_>>)> = vec![
        ("parent escape", vec![raw(EntryType::Regular, "../escape")]),
        ("absolute", vec![raw(EntryType::Regular, "/etc/passwd")]),
        ("inner escape", vec![raw(EntryType::Regular, "a/../../x")]),
        ("char device", vec![raw(EntryType::Char, "dev/evil")]),
        ("block device", vec![raw(EntryType::Block, "dev/sda")]),
        (
            "hard link outside",
            vec![Raw {
                link: Some(b"../../etc/shadow"),
                ..raw(EntryType::Link, "shadow")
            }],
        ),
        (
            "hard link to a file not in the layer",
            vec![Raw {
                link: Some(b"etc/shadow"),
                ..raw(EntryType::Link, "shadow")
            }],
        ),
        (
            "absolute hard link",
            vec![Raw {
                link: Some(b"/etc/shadow"),
                ..raw(EntryType::Link, "shadow")
            }],
        ),
        ("opaque root", vec![raw(EntryType::Regular, ".wh..wh..opq")]),
        ("aufs meta", vec![raw(EntryType::Regular, "a/.wh..wh.plnk")]),
        ("whiteout dir", vec![raw(EntryType::Directory, "a/.wh.b")]),
        (
            "duplicate",
            vec![raw(EntryType::Regular, "f"), raw(EntryType::Regular, "./f")],
        ),
        (
            "below a file",
            vec![raw(EntryType::Regular, "f"), raw(EntryType::Regular, "f/g")],
        ),
    ];
    for (what, entries) in cases {
        let tar = base.path().join(format!("{}.tar", what.replace(' ', "-")));
        raw_tar(&tar, &entries);
        let err = read_plan(&tar).expect_err(what);
        assert!(
            matches!(err, RootfsError::UnsafeEntry { .. }),
            "{what}: {err}"
        );
        names_tar(&err, &tar);
    }

    // A NUL byte can only hide in a PAX path.
    let tar = base.path().join("nul.tar");
    let mut builder = Builder::new(Vec::new());
    builder
        .append_pax_extensions([("path", b"a\0b".as_slice())])
        .expect("pax");
    let mut header = Header::new_gnu();
    header.set_size(0);
    builder
        .append_data(&mut header, "cover", io::empty())
        .expect("append");
    fs::write(&tar, builder.into_inner().expect("finish")).expect("write");
    let err = read_plan(&tar).expect_err("nul");
    assert!(matches!(err, RootfsError::UnsafeEntry { .. }), "{err}");
    assert!(
        err.to_string().contains("NUL") || format!("{err:?}").contains("NUL"),
        "{err}"
    );

    // overlayfs's private attributes are never accepted from a layer.
    let tar = base.path().join("overlay-xattr.tar");
    let mut builder = Builder::new(Vec::new());
    builder
        .append_pax_extensions([("SCHILY.xattr.trusted.overlay.opaque", b"y".as_slice())])
        .expect("pax");
    let mut header = Header::new_gnu();
    header.set_entry_type(EntryType::Directory);
    header.set_size(0);
    header.set_mode(0o755);
    header.set_uid(0);
    header.set_gid(0);
    header.set_mtime(0);
    builder
        .append_data(&mut header, "d", io::empty())
        .expect("append");
    fs::write(&tar, builder.into_inner().expect("finish")).expect("write");
    let err = read_plan(&tar).expect_err("overlay xattr");
    assert!(matches!(err, RootfsError::UnsafeEntry { .. }), "{err}");

    // What is fine: "./" prefixes, trailing slashes, absolute symlink targets, hard links to
    // earlier files, a root directory entry.
    let tar = base.path().join("fine.tar");
    raw_tar(
        &tar,
        &[
            Raw {
                data: b"13 comment=x\n",
                ..raw(EntryType::XGlobalHeader, "pax_global_header")
            },
            raw(EntryType::Directory, "./"),
            raw(EntryType::Directory, "./d/"),
            raw(EntryType::Regular, "./d/f"),
            Raw {
                link: Some(b"d/f"),
                ..raw(EntryType::Link, "d/g")
            },
            Raw {
                link: Some(b"/etc/passwd"),
                ..raw(EntryType::Symlink, "d/abs")
            },
            raw(EntryType::Regular, "d/.wh.gone"),
            raw(EntryType::Regular, "d/.wh..wh..opq"),
        ],
    );
    let plan = read_plan(&tar).expect("fine");
    let paths: Vec<_> = plan.entries.iter().map(|e| e.path.clone()).collect();
    assert_eq!(
        paths,
        ["d", "d/f", "d/g", "d/abs", "d/gone", "d"].map(PathBuf::from)
    );
    assert_eq!(plan.stats.whiteouts, 1);
    assert_eq!(plan.stats.opaque_dirs, 1);
    assert_eq!(
        plan.entries[3].kind,
        EntryKind::Symlink {
            target: PathBuf::from("/etc/passwd")
        }
    );
}

#[test]
fn corrupt_and_truncated_tars_are_refused_naming_the_file() {
    let base = TempDir::new().expect("tempdir");
    let good = base.path().join("good.tar");
    let data = vec![7u8; 2000];
    raw_tar(
        &good,
        &[
            Raw {
                data: &data,
                ..raw(EntryType::Regular, "big")
            },
            raw(EntryType::Regular, "small"),
        ],
    );
    read_plan(&good).expect("good");
    let bytes = fs::read(&good).expect("read");

    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("empty", Vec::new()),
        ("mid-header", bytes[..300].to_vec()),
        ("mid-data", bytes[..512 + 1000].to_vec()),
        // Header + 4 data blocks + the second header, but no end marker.
        ("no end marker", bytes[..512 * 6].to_vec()),
        ("bad checksum", {
            let mut b = bytes.clone();
            b[0] ^= 0x20;
            b
        }),
    ];
    for (what, content) in cases {
        let tar = base.path().join(format!("{}.tar", what.replace(' ', "-")));
        fs::write(&tar, content).expect("write");
        let err = read_plan(&tar).expect_err(what);
        assert!(matches!(err, RootfsError::Corrupt { .. }), "{what}: {err}");
        names_tar(&err, &tar);

        let target = base
            .path()
            .join(format!("target-{}", what.replace(' ', "-")));
        fs::create_dir(&target).expect("mkdir");
        apply_diff(&tar, &target).expect_err(what);
        assert_eq!(
            fs::read_dir(&target).expect("ls").count(),
            0,
            "{what}: target touched"
        );
    }

    let missing = base.path().join("missing.tar");
    let err = read_plan(&missing).expect_err("missing");
    assert!(matches!(err, RootfsError::Io { .. }), "{err}");
    names_tar(&err, &missing);
}

#[test]
fn apply_refuses_before_changing_anything() {
    let base = TempDir::new().expect("tempdir");
    let tar = base.path().join("layer.tar");
    raw_tar(
        &tar,
        &[
            raw(EntryType::Directory, "etc"),
            Raw {
                data: b"fine",
                ..raw(EntryType::Regular, "etc/ok")
            },
            raw(EntryType::Regular, "lost/.wh.keep"),
            raw(EntryType::Regular, "../escape"),
        ],
    );
    let root = base.path().join("root");
    write(&root.join("lost/keep"), "still here");
    let before = snapshot(&root);
    let err = apply_diff(&tar, &root).expect_err("unsafe");
    assert!(
        matches!(err, RootfsError::UnsafeEntry { index: 3, .. }),
        "{err}"
    );
    assert_eq!(snapshot(&root), before);
    assert!(!base.path().join("escape").exists());
}

#[test]
fn capture_refuses_names_the_format_cannot_carry() {
    let base = TempDir::new().expect("tempdir");
    let upper = base.path().join("upper");
    write(&upper.join("d/.wh.looks-like-a-whiteout"), "");
    let out = base.path().join("layer.tar");
    let err = capture_diff(&upper, &out).expect_err("unsupported");
    assert!(matches!(err, RootfsError::Unsupported { .. }), "{err}");
    assert!(!out.exists(), "partial layer left behind");
}

#[test]
fn capture_never_follows_symlinks_in_the_upper_dir() {
    let base = TempDir::new().expect("tempdir");
    let outside = base.path().join("outside");
    write(&outside.join("secret"), "not yours");
    let upper = base.path().join("upper");
    fs::create_dir(&upper).expect("mkdir");
    symlink(&outside, upper.join("etc")).expect("symlink");
    symlink(outside.join("secret"), upper.join("file")).expect("symlink");
    let out = base.path().join("layer.tar");
    let stats = capture_diff(&upper, &out).expect("capture");
    assert_eq!(stats.symlinks, 2);
    assert_eq!(stats.files, 0);
    assert_eq!(stats.bytes, 0);
    let plan = read_plan(&out).expect("plan");
    assert!(
        plan.entries
            .iter()
            .all(|e| matches!(e.kind, EntryKind::Symlink { .. }))
    );
}

#[test]
fn pax_mtime_round_trips() {
    for (secs, nanos) in [
        (0, 0),
        (1_600_000_000, 123_456_789),
        (5, 1),
        (-2, 750_000_000),
        (-3, 0),
    ] {
        let m = MTime { secs, nanos };
        assert_eq!(
            parse_mtime(&format_mtime(m)),
            Some(m),
            "{m:?} -> {}",
            format_mtime(m)
        );
    }
    assert_eq!(
        parse_mtime("1.5"),
        Some(MTime {
            secs: 1,
            nanos: 500_000_000
        })
    );
    assert_eq!(
        parse_mtime("-1.25"),
        Some(MTime {
            secs: -2,
            nanos: 750_000_000
        })
    );
    assert_eq!(parse_mtime("x"), None);
    assert_eq!(parse_mtime(""), None);
}
