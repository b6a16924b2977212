//! The container fixture against real runc: busybox containers on overlays, their logs, mounts,
//! network namespaces, and that nothing is left behind afterwards (also after a failed start and
//! after a crashed owner).

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::fs;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use warmstart_e2e::fixture::{
    BindMount, Container, ContainerSpec, FixtureError, ImageStore, Network, Runtime, TmpfsMount,
};

const WAIT: Duration = Duration::from_secs(10);

/// Whether `path` appears as a mount point or mount root in this process's mount table.
fn mounted(path: &Path) -> bool {
    let table = fs::read_to_string("/proc/self/mountinfo").unwrap();
    let path = path.to_str().unwrap();
    table.lines().any(|line| line.contains(path))
}

/// Whether runc (under `runtime`) still knows container `id`.
fn runc_knows(runtime: &Runtime, id: &str) -> bool {
    let status = runtime
        .runc_command()
        .args(["state", id])
        .output()
        .unwrap()
        .status;
    status.success() || runtime.runc_root().join(id).exists()
}

/// Waits until `/proc/<pid>` is gone (the process has exited and been reaped).
fn wait_gone(pid: u32) {
    let deadline = Instant::now() + WAIT;
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(Instant::now() < deadline, "process {pid} still exists");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn busybox_container_logs_mounts_and_leaves_nothing_behind() {
    let store = ImageStore::temporary().unwrap();
    let image = store.busybox().unwrap();
    let host = tempfile::tempdir().unwrap();
    let ro = host.path().join("ro");
    let rw = host.path().join("rw");
    fs::create_dir_all(&ro).unwrap();
    fs::create_dir_all(&rw).unwrap();
    fs::write(ro.join("hello.txt"), "from the host\n").unwrap();

    let spec = ContainerSpec::new(
        "fixture-basic",
        &image,
        [
            "sh",
            "-c",
            "echo hello; echo err >&2; mkdir -p /data; echo x > /tmp/f; sleep 1000",
        ],
    )
    .with_env("GREETING", "hi there")
    .with_mount(BindMount::readonly(&ro, "/mnt/ro"))
    .with_mount(BindMount::new(&rw, "/mnt/rw"))
    .with_tmpfs(TmpfsMount::new("/scratch"));
    let container = Container::start(&spec).unwrap();

    // Output arrives through the pipes in the log.
    let log = container.wait_for_log("err", WAIT).unwrap();
    assert!(log.contains("hello\n"), "{log}");
    assert!(log.contains("err\n"), "{log}");

    // Writes land in the overlay's upper directory; the image stays untouched.
    let f = container.wait_for_file("/tmp/f", WAIT).unwrap();

    // The container's stdio: /dev/null and pipes, not host files. Read from `sleep`, the
    // script's last command: while the shell runs `echo err >&2` or `echo x > /tmp/f` its own
    // fd 1 is briefly redirected, so only a process started after them shows the final stdio.
    let sleeping = sleeping_process(container.pid());
    let fd = |n: u32| {
        fs::read_link(format!("/proc/{sleeping}/fd/{n}"))
            .unwrap()
            .to_string_lossy()
            .into_owned()
    };
    assert_eq!(fd(0), "/dev/null");
    assert!(fd(1).starts_with("pipe:["), "fd 1 is {}", fd(1));
    assert!(fd(2).starts_with("pipe:["), "fd 2 is {}", fd(2));
    assert_ne!(fd(1), fd(2), "stdout and stderr are separate pipes");
    assert_eq!(fs::read_to_string(f).unwrap(), "x\n");
    assert_eq!(
        fs::read_to_string(container.upper_dir().join("tmp/f")).unwrap(),
        "x\n"
    );
    assert!(container.upper_dir().join("data").is_dir());
    assert!(!image.host_path("/tmp/f").unwrap().exists());
    assert!(mounted(&container.rootfs()));

    // Bind mounts, environment, tmpfs, hostname.
    assert_eq!(
        container.exec_ok(["cat", "/mnt/ro/hello.txt"]).unwrap(),
        "from the host\n"
    );
    let denied = container.exec(["touch", "/mnt/ro/new"]).unwrap();
    assert!(!denied.status.success(), "read-only bind mount is writable");
    container
        .exec_ok(["sh", "-c", "echo written > /mnt/rw/out"])
        .unwrap();
    assert_eq!(fs::read_to_string(rw.join("out")).unwrap(), "written\n");
    assert_eq!(
        container.exec_ok(["sh", "-c", "echo $GREETING"]).unwrap(),
        "hi there\n"
    );
    let mounts = container.exec_ok(["cat", "/proc/mounts"]).unwrap();
    assert!(mounts.contains(" /scratch tmpfs "), "{mounts}");
    assert_eq!(container.exec_ok(["hostname"]).unwrap(), "fixture-basic\n");
    let failing = container
        .exec_ok(["sh", "-c", "echo oops >&2; exit 3"])
        .unwrap_err();
    assert!(failing.to_string().contains("oops"), "{failing}");

    assert_eq!(container.state().unwrap(), "running");

    let id = container.id().to_owned();
    let runtime = container.runtime().clone();
    let state_dir = container.state_dir().to_owned();
    let rootfs = container.rootfs();
    let pid = container.pid();
    container.destroy().unwrap();

    assert!(!runc_knows(&runtime, &id), "runc still knows {id}");
    assert!(!mounted(&rootfs), "{} still mounted", rootfs.display());
    assert!(!state_dir.exists(), "{} still exists", state_dir.display());
    wait_gone(pid);
    // The image and the host directories survive the container.
    assert!(image.host_path("/bin/busybox").unwrap().is_file());
    assert!(ro.join("hello.txt").is_file());
}

#[test]
fn network_namespace_has_loopback_up_and_is_reachable_from_the_host() {
    let store = ImageStore::temporary().unwrap();
    let image = store
        .get_or_build("www", |image| {
            image
                .write_file("/www/index.html", "served from the container\n", 0o644)
                .map(drop)
        })
        .unwrap();
    let web = Container::start(&ContainerSpec::new(
        "fixture-web",
        &image,
        ["httpd", "-f", "-p", "8080", "-h", "/www"],
    ))
    .unwrap();
    let nc = Container::start(&ContainerSpec::new(
        "fixture-nc",
        &image,
        ["sh", "-c", "nc -l -p 8080 > /tmp/received; echo nc done"],
    ))
    .unwrap();

    let addresses = web.exec_ok(["ip", "addr", "show", "lo"]).unwrap();
    assert!(addresses.contains("UP"), "{addresses}");
    assert!(addresses.contains("127.0.0.1"), "{addresses}");

    // Both containers listen on port 8080, each in its own network namespace.
    web.wait_for_port(8080, WAIT).unwrap();
    let (status, body) = web.http_get(8080, "/index.html").unwrap();
    assert_eq!(status, 200);
    assert_eq!(body, "served from the container\n");
    let (status, _) = web.http_get(8080, "/missing").unwrap();
    assert_eq!(status, 404);

    // A container joining the web container's network namespace, like a second container of
    // the same pod, reaches its server on loopback.
    let netns = format!("/proc/{}/ns/net", web.pid());
    let sidecar = Container::start(
        &ContainerSpec::new("fixture-sidecar", &image, ["sleep", "1000"])
            .with_network(Network::Join(netns.into())),
    )
    .unwrap();
    assert_eq!(
        sidecar
            .exec_ok(["wget", "-q", "-O", "-", "http://127.0.0.1:8080/index.html"])
            .unwrap(),
        "served from the container\n"
    );
    drop(sidecar);

    let mut stream = nc.wait_for_port(8080, WAIT).unwrap();
    std::io::Write::write_all(&mut stream, b"ping\n").unwrap();
    drop(stream);
    nc.wait_for_log("nc done", WAIT).unwrap();
    assert_eq!(
        fs::read_to_string(nc.host_path("/tmp/received").unwrap()).unwrap(),
        "ping\n"
    );

    // Nothing listens there any more: a refused connection is an Io error.
    match nc.net_connect(8080) {
        Err(FixtureError::Io { .. }) => {}
        other => panic!("expected a refused connection, got {other:?}"),
    }
}

#[test]
fn placeholder_has_the_same_mounts_and_stands_by() {
    let store = ImageStore::temporary().unwrap();
    let image = store.busybox().unwrap();
    let volume = tempfile::tempdir().unwrap();
    fs::write(volume.path().join("model"), "weights").unwrap();
    let worker = ContainerSpec::new("fixture-worker", &image, ["sh", "-c", "exit 0"])
        .with_mount(BindMount::readonly(volume.path(), "/models"));
    let placeholder = Container::start(&worker.placeholder("fixture-placeholder")).unwrap();
    assert_eq!(placeholder.state().unwrap(), "running");
    assert_eq!(
        placeholder.exec_ok(["cat", "/models/model"]).unwrap(),
        "weights"
    );
    let cmdline = fs::read(format!("/proc/{}/cmdline", placeholder.pid())).unwrap();
    assert_eq!(cmdline, b"/bin/sleep\x001000000\x00");
}

#[test]
fn failed_start_reports_runc_error_and_leaves_nothing_behind() {
    let store = ImageStore::temporary().unwrap();
    let image = store.busybox().unwrap();
    let runtime = Runtime::default();
    let spec = ContainerSpec::new("fixture-fail", &image, ["/does/not/exist"]);
    let error = runtime.start(&spec).unwrap_err();
    let text = error.to_string();
    assert!(matches!(error, FixtureError::Runc { .. }), "{text}");
    assert!(text.contains(&spec.id), "{text}");
    assert!(text.contains("/does/not/exist"), "{text}");

    assert!(!runc_knows(&runtime, &spec.id));
    let state_dir = runtime.containers_dir().join(&spec.id);
    assert!(!state_dir.exists(), "{} still exists", state_dir.display());
    assert!(!mounted(&state_dir));
}

#[test]
fn stale_containers_of_a_dead_owner_are_removed() {
    let base = tempfile::tempdir().unwrap();
    let runtime = Runtime::new(base.path());
    let store = ImageStore::temporary().unwrap();
    let image = store.busybox().unwrap();
    let container = runtime
        .start(&ContainerSpec::new(
            "fixture-stale",
            &image,
            ["sleep", "1000"],
        ))
        .unwrap();
    let id = container.id().to_owned();
    let state_dir = container.state_dir().to_owned();
    let rootfs = container.rootfs();
    let pid = container.pid();

    // Play a crashed owner: forget the handle and hand the state to a process that has exited.
    std::mem::forget(container);
    let mut child = Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    fs::write(
        state_dir.join("owner.json"),
        format!(r#"{{"pid":{dead},"start_time":1}}"#),
    )
    .unwrap();

    let removed = runtime.cleanup_stale().unwrap();
    assert_eq!(removed, std::slice::from_ref(&id));
    assert!(!runc_knows(&runtime, &id));
    assert!(!mounted(&rootfs));
    assert!(!state_dir.exists());
    wait_gone(pid);
}

#[test]
fn short_lived_container_starts_stops_and_keeps_its_log() {
    let store = ImageStore::temporary().unwrap();
    let image = store.busybox().unwrap();
    let container = Container::start(&ContainerSpec::new(
        "fixture-short",
        &image,
        ["sh", "-c", "echo bye"],
    ))
    .unwrap();
    container.wait_for_state("stopped", WAIT).unwrap();
    assert_eq!(container.wait_for_log("bye", WAIT).unwrap(), "bye\n");
    wait_gone(container.pid());
    let state_dir = container.state_dir().to_owned();
    drop(container);
    assert!(!state_dir.exists());
}

/// The process running `sleep` in the tree of `init` (the shell itself once it execs its last
/// command, or its child), waited for.
fn sleeping_process(init: u32) -> u32 {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let children =
            fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap_or_default();
        let found = std::iter::once(init)
            .chain(children.split_whitespace().filter_map(|p| p.parse().ok()))
            .find(|pid| {
                fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
            });
        if let Some(pid) = found {
            return pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no sleep process below {init}"
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}
