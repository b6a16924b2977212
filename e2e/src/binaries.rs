//! Where the end-to-end tests find the programs they run: the `warmstart-agent` binary built
//! next to the test executable, and the static sample worker and entrypoint built by
//! `make sample-worker` and `make entrypoint`.

use std::path::PathBuf;

use crate::fixture::{FixtureError, Image, ImageStore, Result};

/// Where the sample worker lives in the worker image.
pub const WORKER_IN_IMAGE: &str = "/usr/local/bin/warmstart-sample-worker";

/// The cargo target directory (`target/`) of the running test (`target/debug/deps/<test>`)
/// or binary (`target/debug/<bin>`): the parent of the nearest `debug` or `release` directory.
fn target_dir() -> Result<PathBuf> {
    let profile = profile_dir()?;
    profile
        .parent()
        .map(PathBuf::from)
        .ok_or_else(|| FixtureError::Invalid(format!("{} has no parent", profile.display())))
}

/// The profile directory (`target/debug` or `target/release`) of the running test or binary.
fn profile_dir() -> Result<PathBuf> {
    let exe =
        std::env::current_exe().map_err(|e| FixtureError::Invalid(format!("current_exe: {e}")))?;
    exe.ancestors()
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n == "debug" || n == "release")
        })
        .map(PathBuf::from)
        .ok_or_else(|| {
            FixtureError::Invalid(format!("{} is not in a cargo target dir", exe.display()))
        })
}

/// `warmstart-agent` of the running program's profile (`target/debug` for tests,
/// `target/release` for the benchmark).
///
/// # Errors
/// When it has not been built (run the workspace's tests, or `cargo build -p warmstart-agent`).
pub fn agent() -> Result<PathBuf> {
    let path = profile_dir()?.join("warmstart-agent");
    if path.is_file() {
        Ok(path)
    } else {
        Err(FixtureError::Invalid(format!(
            "{} is missing: run `cargo build -p warmstart-agent` (or `make test`)",
            path.display()
        )))
    }
}

/// `warmstart-shim` of the running program's profile: what the tests run the agent's
/// `run` mode under, as a node runs the DaemonSet's pod under its runtime's shim.
///
/// # Errors
/// When it has not been built (run the workspace's tests, or `cargo build -p warmstart-e2e --bin
/// warmstart-shim`).
pub fn shim() -> Result<PathBuf> {
    let path = profile_dir()?.join("warmstart-shim");
    if path.is_file() {
        Ok(path)
    } else {
        Err(FixtureError::Invalid(format!(
            "{} is missing: run `cargo build -p warmstart-e2e --bin warmstart-shim` (or `make test`)",
            path.display()
        )))
    }
}

/// The CRIU under test: `$WARMSTART_CRIU`, else `/usr/local/bin/criu` (what `make setup`
/// installs), else `criu` from `PATH`.
pub fn criu() -> PathBuf {
    if let Some(path) = std::env::var_os("WARMSTART_CRIU") {
        return PathBuf::from(path);
    }
    let local = PathBuf::from("/usr/local/bin/criu");
    if local.exists() {
        local
    } else {
        PathBuf::from("criu")
    }
}

/// `target/debug/warmstart-controller`.
///
/// # Errors
/// When it has not been built (run the workspace's tests, or `cargo build -p warmstart-controller`).
pub fn controller() -> Result<PathBuf> {
    let path = target_dir()?.join("debug").join("warmstart-controller");
    if path.is_file() {
        Ok(path)
    } else {
        Err(FixtureError::Invalid(format!(
            "{} is missing: run `cargo build -p warmstart-controller` (or `make test`)",
            path.display()
        )))
    }
}

/// `target/static/warmstart-sample-worker` (`target/static-release/…` for a release build).
///
/// # Errors
/// When `make sample-worker` has not run.
pub fn static_worker() -> Result<PathBuf> {
    // The benchmark (a release build) measures a release worker (`make bench` builds it).
    let release = profile_dir()?.file_name().is_some_and(|n| n == "release");
    let dir = if release { "static-release" } else { "static" };
    let path = target_dir()?.join(dir).join("warmstart-sample-worker");
    if path.is_file() {
        Ok(path)
    } else {
        Err(FixtureError::Invalid(format!(
            "{} is missing: run `make sample-worker` (`make test` does)",
            path.display()
        )))
    }
}

/// A busybox image with the static sample worker at [`WORKER_IN_IMAGE`].
///
/// # Errors
/// Missing worker binary, or image build errors.
pub fn worker_image(store: &ImageStore) -> Result<Image> {
    let worker = static_worker()?;
    store.get_or_build("busybox-worker", |image| {
        image.add_file(&worker, WORKER_IN_IMAGE, 0o755).map(|_| ())
    })
}

/// `target/static/warmstart-entrypoint`.
///
/// # Errors
/// When `make entrypoint` has not run.
pub fn static_entrypoint() -> Result<PathBuf> {
    let path = target_dir()?.join("static").join("warmstart-entrypoint");
    if path.is_file() {
        Ok(path)
    } else {
        Err(FixtureError::Invalid(format!(
            "{} is missing: run `make entrypoint` (`make test` does)",
            path.display()
        )))
    }
}

/// Builds the CUDA stand-in library and the driver-API workload (once per test process; cargo
/// makes it a no-op when they are up to date) and returns their paths. They are built in a
/// target directory of their own (`target/cuda-standin`): `cargo test` holds the lock of the
/// main one while tests run.
///
/// # Errors
/// When cargo fails.
pub fn cuda_standin() -> Result<(PathBuf, PathBuf)> {
    static BUILT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
    let target = target_dir()?.join("cuda-standin");
    BUILT
        .get_or_init(|| {
            let out = std::process::Command::new(env!("CARGO"))
                .args(["build", "--quiet", "-p", "warmstart-cuda-standin"])
                .env("CARGO_TARGET_DIR", &target)
                .output()
                .map_err(|e| format!("cannot run cargo: {e}"))?;
            if out.status.success() {
                Ok(())
            } else {
                Err(format!(
                    "cargo build -p warmstart-cuda-standin failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
        })
        .clone()
        .map_err(FixtureError::Invalid)?;
    let debug = target.join("debug");
    Ok((
        debug.join("libwarmstart_cuda_standin.so"),
        debug.join("warmstart-cuda-workload"),
    ))
}

/// Where [`cuda_workload_image`] puts the driver-API workload.
pub const CUDA_WORKLOAD_IN_IMAGE: &str = "/usr/local/bin/warmstart-cuda-workload";

/// A busybox image with the driver-API workload of the CUDA stand-in at
/// [`CUDA_WORKLOAD_IN_IMAGE`] and the shared libraries it and the stand-in load (the host's,
/// at the same paths, as `ldd` lists them): a glibc program in a container, like a GPU image.
///
/// # Errors
/// Build errors, `ldd` failures, image errors.
pub fn cuda_workload_image(store: &ImageStore) -> Result<Image> {
    let (library, workload) = cuda_standin()?;
    let mut libs = std::collections::BTreeSet::new();
    for binary in [&workload, &library] {
        let out = std::process::Command::new("ldd")
            .arg(binary)
            .output()
            .map_err(|e| FixtureError::Invalid(format!("cannot run ldd: {e}")))?;
        if !out.status.success() {
            return Err(FixtureError::Invalid(format!(
                "ldd {} failed: {}",
                binary.display(),
                String::from_utf8_lossy(&out.stderr)
            )));
        }
        // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` and `/lib64/ld-linux-x86-64.so.2 (0x…)`.
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let path = line
                .split("=>")
                .last()
                .and_then(|rest| rest.split_whitespace().next())
                .filter(|p| p.starts_with('/'));
            if let Some(path) = path {
                libs.insert(PathBuf::from(path));
            }
        }
    }
    store.get_or_build("busybox-cuda-workload", |image| {
        image.add_file(&workload, CUDA_WORKLOAD_IN_IMAGE, 0o755)?;
        for lib in &libs {
            image.add_file(lib, lib, 0o755)?;
        }
        Ok(())
    })
}
