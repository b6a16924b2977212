//! The GPU check bundle (`scripts/gpu-bundle.sh`, `make gpu-bundle`): assembled here from the
//! binaries built here, unpacked in an empty directory and run as it runs on a GPU host with only
//! the driver, against the project's stand-in driver (`warmstart-cuda-standin`, a test double of
//! libcuda's checkpoint API; the real driver cannot run here). Its PATH holds no CRIU and no
//! runc of this machine: what it needs comes from the bundle.

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::Path;
use std::process::Command;

use warmstart_e2e::binaries;
use warmstart_e2e::cuda::{GpuNode, SimGpu};
use warmstart_e2e::manifests::repo;

const GIB: u64 = 1 << 30;

fn bundle(into: &Path) -> std::path::PathBuf {
    let bins = into.join("bins");
    std::fs::create_dir_all(&bins).unwrap();
    let (_, workload) = binaries::cuda_standin().unwrap();
    std::fs::copy(binaries::agent().unwrap(), bins.join("warmstart-agent")).unwrap();
    std::fs::copy(&workload, bins.join("warmstart-cuda-workload")).unwrap();
    let tarball = into.join("warmstart-gpu-check.tar.gz");
    let out = Command::new("bash")
        .arg(repo().join("scripts/gpu-bundle.sh"))
        .arg(&bins)
        .arg(&tarball)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gpu-bundle.sh: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    tarball
}

/// Whether the test can run: CRIU needs root. Skipped otherwise, unless `WARMSTART_REQUIRE_ROOT`
/// makes that a failure.
fn runs_as_root() -> bool {
    if nix::unistd::Uid::effective().is_root() {
        return true;
    }
    assert!(
        std::env::var_os("WARMSTART_REQUIRE_ROOT").is_none(),
        "WARMSTART_REQUIRE_ROOT is set but this test does not run as root"
    );
    eprintln!("skipped: needs root (CRIU)");
    false
}

/// `tarball` unpacked in `<dir>/host`, as on a GPU host; the check's entry point.
fn unpacked(tarball: &Path, dir: &Path) -> std::path::PathBuf {
    let host = dir.join("host");
    std::fs::create_dir(&host).unwrap();
    let out = Command::new("tar")
        .arg("-C")
        .arg(&host)
        .arg("-xzf")
        .arg(tarball)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    host.join("warmstart-gpu-check/gpu-check")
}

#[test]
fn the_bundle_is_under_64_mib_and_its_check_passes_on_the_stand_in_without_the_hosts_criu() {
    if !runs_as_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tarball = bundle(dir.path());
    let size = std::fs::metadata(&tarball).unwrap().len();
    assert!(size < 64 << 20, "the bundle is {size} bytes");
    let check = unpacked(&tarball, dir.path());

    let node = GpuNode::start(
        13000,
        &[SimGpu::numbered(0, 80 * GIB), SimGpu::numbered(1, 80 * GIB)],
    )
    .unwrap();
    let out = Command::new(&check)
        .env_clear()
        // No /usr/local/bin: this machine's CRIU wrapper is there.
        .env("PATH", "/usr/bin:/bin:/usr/sbin:/sbin")
        .env("GPU_CHECK_CUDA_LIBRARY", node.library())
        .env("GPU_CHECK_MIB", "32")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "gpu-check failed:\n{stdout}\n{stderr}"
    );
    eprintln!("{stdout}");
    assert_eq!(
        stdout.lines().last(),
        Some("GPU CHECK: PASS"),
        "{stdout}\n{stderr}"
    );
    for needle in [
        "== host",
        "bundle: warmstart ",
        "bundle: criu 4.2.1",
        "a process that maps libcuda but never initialised CUDA:",
        "== CRIU: dump the checkpointed workload (killing it)",
        "the workload is gone",
        "a caller that is not root (uid 65534), asking about the workload:",
        "cannot read /proc/",
        "a caller that is not root (uid 65534), locking the workload (the driver's own answer):",
        "the workload is still running, as documented",
        "the workload stayed stopped through its CUDA restore",
        "host->device: restore",
        // Two GPUs and driver 13.0: a workload checkpointed on the first restores onto the second.
        "== remapped restore: checkpointed on GPU-",
        // runc is on this machine: the container round trip runs too.
        "in a container: READY",
    ] {
        assert!(
            stdout.contains(needle),
            "{needle:?} missing:\n{stdout}\n{stderr}"
        );
    }
    assert_eq!(
        stdout.matches("  OK ").count(),
        6,
        "verified at start, after the in-place restore, after the CRIU restore, before and after \
         the remapped restore and after the container restore:\n{stdout}"
    );
}

#[test]
fn a_failing_check_ends_with_the_reason() {
    if !runs_as_root() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let check = unpacked(&bundle(dir.path()), dir.path());
    // No driver library where it is said to be.
    let out = Command::new(&check)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env(
            "GPU_CHECK_CUDA_LIBRARY",
            dir.path().join("missing/libcuda.so.1"),
        )
        .env("GPU_CHECK_MIB", "32")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(!out.status.success(), "{stdout}");
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("GPU CHECK: FAIL: "), "{stdout}");
}
