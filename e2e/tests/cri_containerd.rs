//! The CRI resolver against a real containerd (Debian 12's 1.6 package, installed by
//! `make setup`): the test starts its own containerd on a private socket with private root and
//! state directories under a temporary directory, builds and imports a busybox image (also used as
//! the pod sandbox image, so no pause image is needed), runs a host-network pod (no CNI) with one
//! container that writes `/tmp/x` and has a bind-mounted volume, and checks what
//! `runtime::cri` resolves against the host: PID, root filesystem host path, overlay upper
//! directory, bind mounts, masked paths, image. Then it checkpoints that container with CRIU
//! through the engine (`Engine::checkpoint_blocking`, container left running) and checks the artifact.
//!
//! The second test checkpoints a busybox counter loop in one pod and restores it through the
//! engine (`Engine::restore_blocking`, helper = this crate's `warmstart-agent`) into
//! a placeholder container (same image, `sleep`) of a second pod with its own volume, control
//! directory and `/etc/hosts`-like files. It checks that the restored tree is a child of the
//! placeholder's init in a PID namespace nested in the placeholder's, shares its cgroups and
//! network/IPC/UTS namespaces, sees the placeholder pod's mounts, continues the counter in the
//! placeholder's CRI log, carries the source's file changes into the placeholder's root
//! filesystem, and that the placeholder's own mounts survive the restore.
//!
//! Everything a test started is stopped and removed even when an assertion fails (restored
//! processes by the PIDs identified as theirs, then pods, runc leftovers, containerd by PID, its
//! shims, mounts, cgroups). The tests run one at a time. They fail (not skip) when containerd,
//! ctr, runc, busybox or criu are missing.
//!
//! The containerd, its image, pods and containers come from
//! [`warmstart_e2e::fixture::containerd`].

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_cri::v1::ContainerState;
use warmstart_agent::checkpoint::CheckpointRequest;
use warmstart_agent::engine::{Engine, Runtimes};
use warmstart_agent::report::error_chain;
use warmstart_agent::restore::RestoreRequest;
use warmstart_agent::runtime::cri::{self, CriClient};
use warmstart_agent::runtime::runc::RuncResolver;
use warmstart_agent::runtime::{ResolveError, RuntimeKind};
use warmstart_agent::seams::criu::RpcCriu;
use warmstart_agent::timings::Timings;
use warmstart_e2e::fixture::containerd::{
    Containerd, IMAGE, KUBELET_MASKED_PATHS, container_config, cri_runtime, import_image,
    pod_config, require, run, run_pod, serial, start_container,
};
use warmstart_shared::artifact::{MountTreatment, SourceInfo};

const SCRIPT: &str = "echo hi > /tmp/x; sleep 1000";

fn nspid(pid: i32) -> Vec<String> {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .unwrap()
        .split_whitespace()
        .map(str::to_owned)
        .collect()
}

fn ppid(pid: i32) -> i32 {
    let status = fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

fn cmdline(pid: i32) -> String {
    String::from_utf8_lossy(&fs::read(format!("/proc/{pid}/cmdline")).unwrap()).replace('\0', " ")
}

#[test]
fn resolves_a_containerd_cri_container() {
    let _serial = serial();
    let t0 = Instant::now();
    let containerd = Containerd::start();
    let rt = cri_runtime();
    let client = containerd.wait_ready(&rt);
    let t_ready = t0.elapsed();
    import_image(&containerd, &rt, &client);
    let t_image = t0.elapsed();

    // A host-network pod (no CNI) whose sandbox runs our image's entrypoint.
    let volume = containerd.path().join("volume");
    fs::create_dir_all(&volume).unwrap();
    fs::write(volume.join("hello"), "from the host\n").unwrap();
    let logs = containerd.path().join("logs");
    let sandbox_config = pod_config(
        "warmstart-cri-test",
        &format!("/{}", containerd.cgroup_parent),
        &logs,
    );
    let sandbox_id = run_pod(&rt, &client, &sandbox_config);
    let t_sandbox = t0.elapsed();

    let container_config = container_config(
        "main",
        &["sh", "-c", SCRIPT],
        &[("/data", &volume)],
        "main.log",
    );
    let container_id =
        start_container(&rt, &client, &sandbox_id, &sandbox_config, container_config);
    let t_container = t0.elapsed();

    // Resolve by a unique prefix, with the private state directory.
    let prefix = &container_id[..12];
    let started = Instant::now();
    let mut info = cri::resolve_blocking_with(&containerd.socket, prefix, &containerd.options())
        .unwrap_or_else(|e| panic!("resolve {prefix}: {e}"));
    let t_resolve = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(10);
    while !info.rootfs.join("tmp/x").exists() {
        assert!(
            Instant::now() < deadline,
            "/tmp/x never appeared in {}",
            info.rootfs.display()
        );
        std::thread::sleep(Duration::from_millis(50));
        info =
            cri::resolve_blocking_with(&containerd.socket, prefix, &containerd.options()).unwrap();
    }
    eprintln!("resolved: {info:#?}");

    assert_eq!(info.id, container_id);
    assert_eq!(info.runtime, RuntimeKind::Cri);
    assert_eq!(info.uri(), format!("cri://{container_id}"));
    assert!(info.running, "{info:?}");
    assert!(info.pid > 0);
    // The PID is the container's init: PID 1 of its own PID namespace, child of the runc shim,
    // and the PID containerd's task API reports.
    let ns = nspid(info.pid);
    assert_eq!(ns.last().map(String::as_str), Some("1"), "NSpid {ns:?}");
    assert_eq!(ns.first().unwrap(), &info.pid.to_string());
    let parent = cmdline(ppid(info.pid));
    assert!(
        parent.contains("containerd-shim"),
        "parent of {}: {parent}",
        info.pid
    );
    // busybox sh execs its last command in place: the init's command line turns from the
    // script into `sleep 1000` (and reads empty during that exec). Wait for that final state, so
    // that the dump below does not race the exec.
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let cmd = cmdline(info.pid);
        if cmd.trim_end() == "sleep 1000" {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "cmdline of {}: {cmd:?}",
            info.pid
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let tasks = run(containerd.ctr().args(["tasks", "ls"]));
    let task_line = tasks
        .lines()
        .find(|l| l.starts_with(&container_id))
        .unwrap_or_else(|| panic!("ctr tasks ls has no {container_id}:\n{tasks}"));
    assert_eq!(
        task_line.split_whitespace().nth(1),
        Some(info.pid.to_string().as_str())
    );

    // The root filesystem: the task bundle's rootfs under our state dir, the merged view.
    let bundle_rootfs = containerd
        .path()
        .join("state/io.containerd.runtime.v2.task/k8s.io")
        .join(&container_id)
        .join("rootfs");
    assert_eq!(info.rootfs, bundle_rootfs);
    assert_eq!(
        fs::read_to_string(info.rootfs.join("tmp/x")).unwrap(),
        "hi\n"
    );
    assert!(info.rootfs.join("bin/busybox").is_file());
    // The upper directory: in our overlayfs snapshotter, holding the new file.
    let upper = info.upper_dir.clone().expect("an overlay upper dir");
    assert!(
        upper.starts_with(
            containerd
                .path()
                .join("root/io.containerd.snapshotter.v1.overlayfs")
        ),
        "{}",
        upper.display()
    );
    assert_eq!(fs::read_to_string(upper.join("tmp/x")).unwrap(), "hi\n");
    assert!(
        !upper.join("bin/busybox").exists(),
        "upper dir holds only changes"
    );
    // The bind mount with its host source.
    let data = info.mount_at("/data").expect("the /data mount");
    assert_eq!(Path::new(&data.source), volume);
    assert!(data.is_bind(), "{data:?}");
    assert_eq!(
        fs::read_to_string(format!("/proc/{}/root/data/hello", info.pid)).unwrap(),
        "from the host\n"
    );
    assert!(info.mount_at("/proc").is_some());
    assert_eq!(info.masked_paths, KUBELET_MASKED_PATHS, "masked paths");
    assert_eq!(info.image, IMAGE);

    // Without the private state dir: found through the agent's mount table instead.
    let fallback = cri::resolve_blocking(&containerd.socket, &container_id).unwrap();
    assert_eq!(fallback.rootfs, bundle_rootfs);
    assert_eq!(fallback.upper_dir, info.upper_dir);

    // The async API and errors.
    let all = rt.block_on(client.list_containers(None)).unwrap();
    assert_eq!(all.len(), 1, "{all:?}");
    let status = rt.block_on(client.container_status(&container_id)).unwrap();
    let verbose = cri::parse_verbose_info(&container_id, &status.info).unwrap();
    assert_eq!(verbose.flavor, cri::CriFlavor::Containerd);
    assert_eq!(verbose.sandbox_id.as_deref(), Some(sandbox_id.as_str()));
    if let Ok(path) = std::env::var("WARMSTART_CRI_DUMP_INFO") {
        let mut f = fs::File::create(path).unwrap();
        f.write_all(status.info[cri::INFO_KEY].as_bytes()).unwrap();
    }
    match cri::resolve_blocking(&containerd.socket, "0123456789abcdef") {
        Err(ResolveError::NotFound { .. }) => {}
        other => panic!("unknown id: {other:?}"),
    }
    match cri::resolve_blocking(&containerd.socket, "../etc") {
        Err(ResolveError::InvalidId(_)) => {}
        other => panic!("bad id: {other:?}"),
    }

    // A CRIU checkpoint of that container through the engine (container left running).
    let criu = engine(&containerd, warmstart_e2e::binaries::criu());
    let output = containerd.path().join("artifacts/default/0123456789abcdef");
    fs::create_dir_all(output.parent().unwrap()).unwrap();
    let request = CheckpointRequest {
        container: info.clone(),
        output: output.clone(),
        identity_hash: "0123456789abcdef".to_owned(),
        source: SourceInfo {
            pod: "warmstart-cri-test".to_owned(),
            namespace: "default".to_owned(),
            container: "main".to_owned(),
            ..SourceInfo::default()
        },
        leave_running: true,
        tcp_established: false,
    };
    let started = Instant::now();
    let report = criu
        .checkpoint_blocking(&request, &warmstart_agent::progress::Reporter::default())
        .unwrap_or_else(|e| {
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            panic!("checkpoint of {}: {msg}", info.uri())
        });
    let t_checkpoint = started.elapsed();
    eprintln!("checkpoint timings:\n{}", report.timings.table());
    assert_eq!(report.dir, output);
    assert_eq!(report.manifest.source.container_id, info.uri());
    assert_eq!(report.manifest.source.image, IMAGE);
    assert!(output.join("criu/dump.log").is_file());
    assert!(
        report
            .manifest
            .files
            .iter()
            .any(|f| f.path.ends_with("pstree.img")),
        "{:?}",
        report.manifest.files
    );
    // The rootfs diff carries the container's new file.
    let listing = run(Command::new(require("tar"))
        .arg("-tf")
        .arg(output.join("rootfs-diff.tar")));
    assert!(
        listing
            .lines()
            .any(|l| l.trim_start_matches("./") == "tmp/x"),
        "rootfs diff:\n{listing}"
    );
    // The runtime's bind mounts are external with their host sources.
    let plan_data = report
        .manifest
        .mounts
        .iter()
        .find(|m| m.destination == "/data")
        .expect("/data in the mount plan");
    assert_eq!(plan_data.treatment, MountTreatment::External);
    assert_eq!(Path::new(&plan_data.source), volume);
    for dest in ["/etc/hosts", "/etc/resolv.conf", "/dev/shm"] {
        let entry = report
            .manifest
            .mounts
            .iter()
            .find(|m| m.destination == dest);
        assert_eq!(
            entry.map(|m| m.treatment),
            Some(MountTreatment::External),
            "{dest}: {entry:?}"
        );
    }
    // Still running after the dump.
    let after =
        cri::resolve_blocking_with(&containerd.socket, &container_id, &containerd.options())
            .unwrap();
    assert!(after.running);
    assert_eq!(after.pid, info.pid);

    eprintln!(
        "timings: containerd ready {t_ready:?}, image imported {:?}, sandbox running {:?}, \
         container started {:?}, resolve {t_resolve:?}, checkpoint {t_checkpoint:?}",
        t_image - t_ready,
        t_sandbox - t_image,
        t_container - t_sandbox
    );
    drop(client);
    drop(rt);
    drop(containerd);
}

/// The source workload of the restore test: a counter printed to stdout, mirrored into a file of
/// the root filesystem and one of the volume, a file created and one deleted per tick, plus a file
/// created and an image file deleted once at start.
const LOOP: &str = "echo created > /tmp/made; rm /etc/motd; i=0; while true; do i=$((i+1)); \
                    echo tick $i; echo $i > /tmp/counter; echo $i > /data/last; touch /tmp/f$i; \
                    rm -f /tmp/f$((i-1)); sleep 0.2; done";

/// The messages of a CRI container log (`<time> <stream> <P|F> <message>` lines) on `stream`.
fn cri_log(path: &Path, stream: &str) -> Vec<String> {
    fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|line| {
            let mut parts = line.splitn(4, ' ');
            let (_, s, _, message) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
            (s == stream).then(|| message.to_owned())
        })
        .collect()
}

/// The `tick N` counters in a CRI log.
fn ticks(path: &Path) -> Vec<u64> {
    cri_log(path, "stdout")
        .iter()
        .filter_map(|m| m.strip_prefix("tick ")?.parse().ok())
        .collect()
}

fn wait_for(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The number in a file the running loop rewrites (`echo $i > file` truncates, then writes: a
/// read in between sees it empty), once it holds one.
fn read_number_settled(path: &Path) -> u64 {
    let mut value = None;
    wait_for(
        &format!("a number in {}", path.display()),
        Duration::from_secs(10),
        || {
            value = read_number(path);
            value.is_some()
        },
    );
    value.unwrap()
}

fn read_number(path: &Path) -> Option<u64> {
    fs::read_to_string(path).ok()?.trim().parse().ok()
}

fn start_time(pid: i32) -> Option<u64> {
    warmstart_agent::runtime::stat::start_time(pid)
}

/// Processes this test restored, killed on drop (before the containerd cleanup, which would also
/// take them down with the placeholder's PID namespace): the PIDs identified as the restored
/// tree, and any child of the placeholder's init (a `sleep` that has none of its own), each only
/// while its start time still matches, so a recycled PID is never signalled.
struct Restored {
    placeholder: Option<(i32, u64)>,
    pids: Vec<(i32, u64)>,
}

impl Restored {
    fn children_of(pid: i32) -> Vec<i32> {
        let Ok(entries) = fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_string_lossy().parse::<i32>().ok())
            .filter(|&p| {
                fs::read_to_string(format!("/proc/{p}/status"))
                    .ok()
                    .and_then(|s| {
                        s.lines()
                            .find_map(|l| l.strip_prefix("PPid:"))
                            .and_then(|v| v.trim().parse::<i32>().ok())
                    })
                    == Some(pid)
            })
            .collect()
    }

    fn add(&mut self, pid: i32) {
        if let Some(start) = start_time(pid) {
            self.pids.push((pid, start));
        }
    }
}

impl Drop for Restored {
    fn drop(&mut self) {
        let mut targets = self.pids.clone();
        if let Some((pid, start)) = self.placeholder
            && start_time(pid) == Some(start)
        {
            for child in Self::children_of(pid) {
                if let Some(start) = start_time(child) {
                    targets.push((child, start));
                }
            }
        }
        targets.sort_unstable();
        targets.dedup();
        for (pid, start) in targets {
            if start_time(pid) == Some(start) {
                eprintln!("cleanup: killing restored process {pid}: {}", cmdline(pid));
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

fn container_state(rt: &tokio::runtime::Runtime, client: &CriClient, id: &str) -> i32 {
    rt.block_on(client.container_status(id))
        .unwrap()
        .status
        .unwrap()
        .state
}

fn ns_link(pid: i32, ns: &str) -> PathBuf {
    fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap()
}

fn inode(path: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt as _;
    let m = fs::metadata(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    (m.dev(), m.ino())
}

/// Checkpoints a busybox loop in one CRI pod and restores it into a placeholder container (same
/// image, `sleep`) in a second pod, through the engine's library API: the restored tree runs in
/// the placeholder's cgroups and namespaces (nested PID namespace), writes into the placeholder's
/// CRI log and volume, sees the source's file changes, and continues its counter.
#[test]
fn restores_a_cri_container_into_a_cri_placeholder() {
    let _serial = serial();
    let t0 = Instant::now();
    let containerd = Containerd::start();
    let rt = cri_runtime();
    let client = containerd.wait_ready(&rt);
    import_image(&containerd, &rt, &client);
    let t_setup = t0.elapsed();
    let criu = warmstart_e2e::binaries::criu();
    let options = containerd.options();

    // The source pod: the loop, a volume at /data, a control directory (mount parity).
    let dir = containerd.path();
    let mkdir = |name: &str, hello: &str| {
        let path = dir.join(name);
        fs::create_dir_all(&path).unwrap();
        fs::write(path.join("hello"), hello).unwrap();
        path
    };
    let src_volume = mkdir("src-volume", "source volume\n");
    let src_control = mkdir("src-control", "");
    let src_logs = dir.join("logs/src");
    let src_pod_config = pod_config(
        "warmstart-cri-source",
        &format!("/{}/source", containerd.cgroup_parent),
        &src_logs,
    );
    let src_pod = run_pod(&rt, &client, &src_pod_config);
    let src_id = start_container(
        &rt,
        &client,
        &src_pod,
        &src_pod_config,
        container_config(
            "main",
            &["sh", "-c", LOOP],
            &[("/data", &src_volume), ("/warmstart-control", &src_control)],
            "main.log",
        ),
    );
    let src_log = src_logs.join("main.log");
    wait_for(
        "tick 5 in the source's log",
        Duration::from_secs(20),
        || ticks(&src_log).contains(&5),
    );
    let t_source = t0.elapsed();
    let source = cri::resolve_blocking_with(&containerd.socket, &src_id, &options)
        .unwrap_or_else(|e| panic!("resolve source {src_id}: {e}"));
    eprintln!("source: {source:#?}");
    eprintln!(
        "source stdio: {:?}",
        (0..3)
            .map(|fd| fs::read_link(format!("/proc/{}/fd/{fd}", source.pid)))
            .collect::<Vec<_>>()
    );

    // Checkpoint, stopping the source (so its log ends where the dump was taken).
    let artifact = dir.join("artifacts/default/00000000000000aa");
    fs::create_dir_all(artifact.parent().unwrap()).unwrap();
    let request = CheckpointRequest {
        container: source.clone(),
        output: artifact.clone(),
        identity_hash: "00000000000000aa".to_owned(),
        source: SourceInfo {
            pod: "warmstart-cri-source".to_owned(),
            namespace: "default".to_owned(),
            container: "main".to_owned(),
            ..SourceInfo::default()
        },
        leave_running: false,
        tcp_established: false,
    };
    let started = Instant::now();
    let engine = engine(&containerd, criu.clone());
    let report = engine
        .checkpoint_blocking(&request, &warmstart_agent::progress::Reporter::default())
        .unwrap_or_else(|e| panic!("checkpoint of {}: {}", source.uri(), error_chain(&e)));
    let t_checkpoint = started.elapsed();
    eprintln!("checkpoint timings:\n{}", report.timings.table());
    eprintln!("mount plan: {:#?}", report.manifest.mounts);
    eprintln!("stdio: {:?}", report.manifest.criu.options.stdio);
    wait_for("the source to exit", Duration::from_secs(10), || {
        container_state(&rt, &client, &src_id) == ContainerState::ContainerExited as i32
    });
    let listing = run(Command::new(require("tar"))
        .arg("-tf")
        .arg(artifact.join("rootfs-diff.tar")));
    eprintln!("rootfs diff:\n{listing}");
    for want in ["tmp/made", "tmp/counter", "etc/.wh.motd"] {
        assert!(
            listing.lines().any(|l| l.trim_start_matches("./") == want),
            "{want} not in the rootfs diff"
        );
    }

    // The placeholder pod: same image, `sleep`, its own volume and control directory.
    let t_ph_start = t0.elapsed();
    let ph_volume = mkdir("ph-volume", "placeholder volume\n");
    let ph_control = mkdir("ph-control", "");
    let ph_logs = dir.join("logs/ph");
    let ph_pod_config = pod_config(
        "warmstart-cri-placeholder",
        &format!("/{}/placeholder", containerd.cgroup_parent),
        &ph_logs,
    );
    let ph_pod = run_pod(&rt, &client, &ph_pod_config);
    let ph_id = start_container(
        &rt,
        &client,
        &ph_pod,
        &ph_pod_config,
        container_config(
            "main",
            &["/bin/sleep", "1000000"],
            &[("/data", &ph_volume), ("/warmstart-control", &ph_control)],
            "main.log",
        ),
    );
    let ph_log = ph_logs.join("main.log");
    let placeholder = cri::resolve_blocking_with(&containerd.socket, &ph_id, &options)
        .unwrap_or_else(|e| panic!("resolve placeholder {ph_id}: {e}"));
    let mut restored = Restored {
        placeholder: start_time(placeholder.pid).map(|s| (placeholder.pid, s)),
        pids: Vec::new(),
    };
    assert!(placeholder.running);
    assert!(!placeholder.rootfs.join("tmp/made").exists());
    assert!(placeholder.rootfs.join("etc/motd").exists());
    let t_placeholder = t0.elapsed();

    // Restore through the library API (the private containerd state dir is in `options`).
    let log_dir = dir.join("restore-logs");
    let request = RestoreRequest {
        artifact: artifact.clone(),
        placeholder: placeholder.clone(),
        log_dir: log_dir.clone(),
        manifest_digest: None,
        control: warmstart_agent::restore::ControlDir::OfPlaceholder,
    };
    let started = Instant::now();
    let mut timings = Timings::default();
    let outcome = engine.restore_blocking(
        &request,
        &mut timings,
        &warmstart_agent::progress::Reporter::default(),
    );
    let t_restore = started.elapsed();
    let report = outcome.unwrap_or_else(|e| {
        let log = fs::read_to_string(log_dir.join("restore.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().collect();
        panic!(
            "restore into {}: {}\nCRIU restore log (last lines):\n{}",
            placeholder.uri(),
            error_chain(&e),
            tail[tail.len().saturating_sub(40)..].join("\n")
        )
    });
    eprintln!("restore timings:\n{}", timings.table());

    // The restored root: a child of the placeholder's init, PID report.pid in the placeholder's
    // PID namespace and 1 in a namespace nested in it (the source had its own).
    let ph_nspid = nspid(placeholder.pid);
    let children = Restored::children_of(placeholder.pid);
    for &child in &children {
        restored.add(child);
    }
    let root = children
        .iter()
        .copied()
        .find(|&c| {
            let ns = nspid(c);
            ns.len() == ph_nspid.len() + 1 && ns[ph_nspid.len() - 1] == report.pid.to_string()
        })
        .unwrap_or_else(|| {
            panic!(
                "no child of the placeholder's init {} has pid {} in its namespace: children {children:?}",
                placeholder.pid, report.pid
            )
        });
    let root_nspid = nspid(root);
    eprintln!(
        "restored root: host pid {root}, NSpid {root_nspid:?}, placeholder NSpid {ph_nspid:?}: {}",
        cmdline(root)
    );
    assert_eq!(root_nspid.last().map(String::as_str), Some("1"));
    assert!(cmdline(root).contains("while true"), "{}", cmdline(root));
    // Its cgroups are the placeholder's.
    assert_eq!(
        fs::read_to_string(format!("/proc/{root}/cgroup")).unwrap(),
        fs::read_to_string(format!("/proc/{}/cgroup", placeholder.pid)).unwrap(),
        "cgroups of the restored root and of the placeholder's init"
    );
    let ph_cgroup = fs::read_to_string(format!("/proc/{}/cgroup", placeholder.pid)).unwrap();
    assert!(ph_cgroup.contains(&ph_id), "{ph_cgroup}");
    // Its network, IPC and UTS namespaces are the placeholder's; its PID namespace is nested.
    for ns in ["net", "ipc", "uts"] {
        assert_eq!(ns_link(root, ns), ns_link(placeholder.pid, ns), "{ns}");
    }
    assert_ne!(ns_link(root, "pid"), ns_link(placeholder.pid, "pid"));
    // Its mounts: the placeholder's volume and the placeholder pod's /etc/hosts.
    assert_eq!(
        fs::read_to_string(format!("/proc/{root}/root/data/hello")).unwrap(),
        "placeholder volume\n"
    );
    for dest in ["/etc/hosts", "/etc/resolv.conf"] {
        let theirs = placeholder
            .mount_at(dest)
            .unwrap_or_else(|| panic!("placeholder has no {dest}"));
        assert_eq!(
            inode(Path::new(&format!("/proc/{root}/root{dest}"))),
            inode(Path::new(&theirs.source)),
            "{dest} of the restored tree is the placeholder pod's {}",
            theirs.source
        );
    }

    // Its output continues the counter in the placeholder's log.
    wait_for(
        "3 ticks in the placeholder's log",
        Duration::from_secs(10),
        || ticks(&ph_log).len() >= 3,
    );
    let t_ticking = t0.elapsed();
    // The source's log, read only now: containerd copies the source's output into it after
    // the tree is gone, and seconds have passed since (no sleep needed for a deadline).
    let src_ticks = ticks(&src_log);
    let last = *src_ticks.last().unwrap();
    assert_eq!(
        src_ticks,
        (1..=last).collect::<Vec<_>>(),
        "source ticks are consecutive"
    );
    let src_last_file = read_number(&src_volume.join("last")).unwrap();
    assert!(
        src_last_file == last || src_last_file + 1 == last,
        "source volume says {src_last_file}, log {last}"
    );
    let ph_ticks = ticks(&ph_log);
    eprintln!(
        "source ticks 1..={last}, placeholder ticks {:?}",
        ph_ticks.first()..ph_ticks.last()
    );
    assert_eq!(
        ph_ticks.first(),
        Some(&(last + 1)),
        "the placeholder's log continues from the source's last tick {last}"
    );
    assert_eq!(
        ph_ticks,
        (last + 1..=*ph_ticks.last().unwrap()).collect::<Vec<_>>(),
        "consecutive"
    );
    assert!(cri_log(&ph_log, "stderr").is_empty(), "no errors");

    // The source's file changes are in the placeholder's root filesystem, and the loop keeps
    // changing it (and the placeholder's volume, not the source's).
    let rootfs = &placeholder.rootfs;
    assert_eq!(
        fs::read_to_string(rootfs.join("tmp/made")).unwrap(),
        "created\n"
    );
    assert!(!rootfs.join("etc/motd").exists(), "deleted in the source");
    let counter = read_number_settled(&rootfs.join("tmp/counter"));
    assert!(counter > last, "counter {counter} after {last}");
    let volume_last = read_number_settled(&ph_volume.join("last"));
    assert!(volume_last > last, "placeholder volume says {volume_last}");
    assert_eq!(read_number(&src_volume.join("last")), Some(src_last_file));
    let files: Vec<u64> = fs::read_dir(rootfs.join("tmp"))
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_prefix('f')?.parse().ok())
        .collect();
    assert!(
        !files.is_empty() && files.len() <= 2 && files.iter().all(|&f| f > last),
        "tick files in the placeholder: {files:?}"
    );

    // restore-complete went into the placeholder's control directory only.
    assert!(report.signalled);
    assert!(ph_control.join("restore-complete").is_file());
    assert!(!src_control.join("restore-complete").exists());
    // The placeholder still runs, its own mounts intact.
    assert_eq!(
        container_state(&rt, &client, &ph_id),
        ContainerState::ContainerRunning as i32
    );
    let ph_mounts = fs::read_to_string(format!("/proc/{}/mountinfo", placeholder.pid)).unwrap();
    for dest in ["/etc/hosts", "/etc/resolv.conf", "/data", "/dev/shm"] {
        assert!(
            ph_mounts.lines().any(|l| l.split(' ').nth(4) == Some(dest)),
            "the placeholder's own {dest} mount is gone:\n{ph_mounts}"
        );
    }
    assert_eq!(
        fs::read_to_string(format!("/proc/{}/root/data/hello", placeholder.pid)).unwrap(),
        "placeholder volume\n"
    );

    eprintln!(
        "timings: containerd + image {t_setup:?}, source pod + 5 ticks {:?}, checkpoint \
         {t_checkpoint:?}, placeholder pod running and resolved {:?}, restore (prepare + \
         execute) {t_restore:?}, then 3 ticks in the placeholder's log {:?}",
        t_source - t_setup,
        t_placeholder - t_ph_start,
        t_ticking - t_placeholder - t_restore
    );
    drop(restored);
    drop(client);
    drop(rt);
    drop(containerd);
}

/// The engine as the agent builds it: CRIU's RPC client, this crate's `warmstart-agent` as the
/// restore helper, the test's containerd.
fn engine(containerd: &Containerd, criu: PathBuf) -> Engine {
    Engine::new(
        Arc::new(RpcCriu::new(
            criu,
            warmstart_e2e::binaries::agent().unwrap(),
        )),
        warmstart_agent::seams::cuda::CudaSlot::none(),
        Runtimes {
            runc: RuncResolver::new("runc", "/run/runc"),
            cri_socket: containerd.socket.clone(),
            cri: containerd.options(),
        },
    )
}
