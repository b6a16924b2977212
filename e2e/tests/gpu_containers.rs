//! The GPU path on real containers, against the CUDA stand-in (no GPU exists where these tests
//! run; `e2e/cuda-standin` is a faithful double of `libcuda.so.1`, loaded by the agent through
//! the same code path as the real library, whose device memory lives outside the workload so
//! that CRIU refuses a workload that was not CUDA-checkpointed). A runc container runs two
//! driver-API workloads; `warmstart-agent checkpoint --stop` takes their GPU state and dumps
//! them, `warmstart-agent restore` brings them back into a placeholder with a GPU device, and
//! each workload then checks its device memory and that CUDA calls work. Needs root, runc and
//! CRIU (`make setup`).

#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use warmstart_e2e::agent_cli;
use warmstart_e2e::binaries::{self, CUDA_WORKLOAD_IN_IMAGE};
use warmstart_e2e::cuda::{CallRecord, GpuNode, SimGpu};
use warmstart_e2e::fixture::{BindMount, Container, ContainerSpec, Image, ImageStore, Runtime};

const GIB: u64 = 1 << 30;
const WAIT: Duration = Duration::from_secs(30);
const HASH: &str = "00000000000000c0";
/// Workloads per container.
const WORKLOADS: usize = 2;

struct Gpu {
    node: GpuNode,
    _store: ImageStore,
    image: Image,
    rt: Runtime,
    tmp: tempfile::TempDir,
}

impl Gpu {
    fn new(driver_version: i32) -> Self {
        let node = GpuNode::start(driver_version, &gpus(2, 80)).unwrap();
        std::fs::create_dir(node.dir().join("reports")).unwrap();
        let store = ImageStore::temporary().unwrap();
        let image = binaries::cuda_workload_image(&store).unwrap();
        Self {
            node,
            _store: store,
            image,
            rt: Runtime::default(),
            tmp: tempfile::tempdir().unwrap(),
        }
    }

    fn control(&self, name: &str) -> PathBuf {
        let dir = self.tmp.path().join(name);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// A container running [`WORKLOADS`] workloads of `mib` MiB each, with the stand-in's
    /// state directory at the same path, a control directory and a GPU control device.
    fn spec(&self, name: &str, mib: u32) -> ContainerSpec {
        self.spec_with(name, mib, &["0"; WORKLOADS])
    }

    /// [`Gpu::spec`] with workload `i` holding the GPUs `devices[i]` (`0,1`).
    fn spec_with(&self, name: &str, mib: u32, devices: &[&str]) -> ContainerSpec {
        self.spec_full(name, mib, devices, false)
    }

    /// [`Gpu::spec`] whose workloads record when they first run in a new PID namespace
    /// ([`Gpu::ticks`]).
    fn spec_ticking(&self, name: &str, mib: u32) -> ContainerSpec {
        self.spec_full(name, mib, &["0"; WORKLOADS], true)
    }

    fn spec_full(&self, name: &str, mib: u32, devices: &[&str], ticks: bool) -> ContainerSpec {
        let dir = self.node.dir().display().to_string();
        let lib = self.node.library().display().to_string();
        let workloads: Vec<String> = devices
            .iter()
            .enumerate()
            .map(|(i, device)| {
                let ticks = if ticks {
                    format!(" --ticks {dir}/reports/{name}-{i}.ticks")
                } else {
                    String::new()
                };
                format!(
                    "{CUDA_WORKLOAD_IN_IMAGE} --library {lib} --mib {mib} --piece-mib 4 \
                     --device {device} --report {dir}/reports/{name}-{i}{ticks} &"
                )
            })
            .collect();
        let mut spec = ContainerSpec::new(
            name,
            &self.image,
            ["/bin/sh", "-c", &format!("{} wait", workloads.join(" "))],
        )
        .with_mount(BindMount::new(self.node.dir(), &dir))
        .with_mount(BindMount::new(self.control(name), "/warmstart-control"));
        // The NVIDIA runtime gives a GPU container its control device; nothing opens it here.
        spec.oci_patch = Some(json!({"linux": {"devices": [
            {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438}
        ]}}));
        spec
    }

    fn placeholder(&self, spec: &ContainerSpec, name: &str) -> ContainerSpec {
        let mut ph = spec.placeholder(name);
        ph.mounts = vec![
            BindMount::new(self.node.dir(), self.node.dir().display().to_string()),
            BindMount::new(self.control(name), "/warmstart-control"),
        ];
        ph
    }

    fn agent(&self, args: &[&str], paths: &[&Path]) -> Output {
        let mut command = agent_cli::command(&self.rt).unwrap();
        command
            .arg("--cuda-library")
            .arg(self.node.library())
            .arg("--nvidia-driver-dir")
            .arg(self.node.nvidia_driver_dir())
            .args(["--cuda-call-timeout", "20", "--cuda-lock-timeout", "1"])
            .args(args)
            .args(paths);
        agent_cli::run(command, agent_cli::DEFAULT_TIMEOUT).unwrap()
    }

    fn checkpoint(&self, src: &Container, artifact: &Path) -> Output {
        self.agent(
            &[
                "checkpoint",
                "--stop",
                "--hash",
                HASH,
                "--runc",
                src.id(),
                "--output",
            ],
            &[artifact],
        )
    }

    fn restore(&self, ph: &Container, artifact: &Path) -> Output {
        self.agent(
            &["restore", "--into-runc", ph.id(), "--artifact"],
            &[artifact],
        )
    }

    /// `(PID namespace, wall-clock ns)` of each time workload `name-i` first ran in a PID
    /// namespace: its start, then each restore.
    fn ticks(&self, name: &str, i: usize) -> Vec<(String, u128)> {
        let path = self.node.dir().join(format!("reports/{name}-{i}.ticks"));
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| {
                let (ns, at) = l.split_once(' ')?;
                Some((ns.to_owned(), at.parse().ok()?))
            })
            .collect()
    }

    fn report(&self, name: &str, i: usize) -> PathBuf {
        self.node.dir().join(format!("reports/{name}-{i}"))
    }

    /// Waits until report `name-i` has `n` complete lines; returns them.
    fn lines(&self, name: &str, i: usize, n: usize) -> Vec<String> {
        let path = self.report(name, i);
        let deadline = Instant::now() + WAIT;
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<String> = text.lines().map(str::to_owned).collect();
            if lines.len() >= n && text.ends_with('\n') {
                return lines;
            }
            assert!(
                Instant::now() < deadline,
                "{} has {} of {n} lines: {text}",
                path.display(),
                lines.len()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Starts the source container and waits until every workload is READY.
    fn start(&self, name: &str, mib: u32) -> Container {
        self.start_spec(name, &self.spec(name, mib))
    }

    /// [`Gpu::start`] of a spec made by [`Gpu::spec_with`] for `name`.
    fn start_spec(&self, name: &str, spec: &ContainerSpec) -> Container {
        let src = Container::start_in(&self.rt, spec).unwrap();
        for i in 0..WORKLOADS {
            let ready = &self.lines(name, i, 1)[0];
            assert!(ready.starts_with("READY "), "{ready}");
        }
        src
    }

    /// Asks every workload below `root` to check its device memory and CUDA; returns the
    /// answers (report `name-i`, line `line`).
    fn verify(&self, root: u32, name: &str, line: usize) -> Vec<String> {
        ask_to_verify(root);
        (0..WORKLOADS)
            .map(|i| self.lines(name, i, line + 1)[line].clone())
            .collect()
    }

    fn calls(&self, call: &str) -> Vec<CallRecord> {
        self.node
            .calls()
            .unwrap()
            .into_iter()
            .filter(|c| c.call == call)
            .collect()
    }
}

fn gpus(n: u8, gib: u64) -> Vec<SimGpu> {
    (0..n).map(|i| SimGpu::numbered(i, gib * GIB)).collect()
}

/// Asks every workload below `root` to check its device memory and CUDA (SIGUSR1); each
/// answers on its next report line.
fn ask_to_verify(root: u32) {
    let pids = workloads_below(root);
    assert_eq!(pids.len(), WORKLOADS, "workloads below {root}: {pids:?}");
    for pid in pids {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(pid).unwrap()),
            nix::sys::signal::Signal::SIGUSR1,
        )
        .unwrap();
    }
}

/// Host PIDs of the workload processes below `root`.
fn workloads_below(root: u32) -> Vec<u32> {
    let mut found = Vec::new();
    let mut queue = vec![root];
    while let Some(parent) = queue.pop() {
        let children = std::fs::read_to_string(format!("/proc/{parent}/task/{parent}/children"))
            .unwrap_or_default();
        for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
            let cmdline = std::fs::read(format!("/proc/{child}/cmdline")).unwrap_or_default();
            // argv[0] (the shell that started them names them in its script).
            let program = cmdline.split(|b| *b == 0).next().unwrap_or_default();
            if program.ends_with(b"warmstart-cuda-workload") {
                found.push(child);
            }
            queue.push(child);
        }
    }
    found.sort_unstable();
    found
}

fn manifest(artifact: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(artifact.join("manifest.json")).unwrap()).unwrap()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// The intervals of `calls` overlap pairwise: they ran in parallel.
fn overlapped(calls: &[CallRecord]) -> bool {
    let start = calls.iter().map(|c| c.start_ns).max().unwrap();
    let end = calls.iter().map(|c| c.end_ns).min().unwrap();
    start < end
}

#[test]
fn several_cuda_processes_are_checkpointed_and_restored_with_device_memory_intact() {
    let gpu = Gpu::new(12080);
    gpu.node
        .set_faults(&json!({"transferDelayMs": 300}))
        .unwrap();
    let src = gpu.start("src", 16);
    let artifact = gpu.tmp.path().join("artifact");
    let out = gpu.checkpoint(&src, &artifact);
    assert!(out.status.success(), "checkpoint failed: {}", stderr(&out));
    let table = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        table.contains("cuda-lock") && table.contains("cuda-checkpoint"),
        "{table}"
    );

    let m = manifest(&artifact);
    let cuda = &m["cuda"];
    assert_eq!(cuda["driverVersion"], "12.8");
    assert_eq!(cuda["method"], "driver-api");
    assert_eq!(cuda["pids"].as_array().unwrap().len(), WORKLOADS);
    // The container sees two GPUs; its processes hold the first only.
    let first = SimGpu::numbered(0, 0).uuid;
    assert_eq!(cuda["gpus"].as_array().unwrap().len(), 1);
    assert_eq!(cuda["gpus"][0]["uuid"], first.as_str());
    assert_eq!(cuda["gpus"][0]["memoryBytes"], 80 * GIB);
    for process in cuda["processes"].as_array().unwrap() {
        assert_eq!(process["gpus"], json!([first]), "{process}");
    }
    assert!(m["timings"]["cuda-checkpoint"].as_f64().unwrap() >= 0.3);

    // Both processes were locked, then checkpointed, each step in parallel across them.
    let locks = gpu.calls("cuCheckpointProcessLock");
    let checkpoints = gpu.calls("cuCheckpointProcessCheckpoint");
    assert_eq!(locks.len(), WORKLOADS);
    assert_eq!(checkpoints.len(), WORKLOADS);
    assert!(checkpoints.iter().all(|c| c.rc == 0));
    let last_lock = locks.iter().map(|c| c.end_ns).max().unwrap();
    assert!(checkpoints.iter().all(|c| c.start_ns >= last_lock));
    assert!(
        overlapped(&checkpoints),
        "checkpoints ran one after another"
    );
    assert_eq!(
        gpu.node.resident_bytes(),
        0,
        "the source's device memory is gone"
    );

    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(src.spec(), "ph")).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    assert!(gpu.control("ph").join("restore-complete").exists());
    let restores = gpu.calls("cuCheckpointProcessRestore");
    let unlocks = gpu.calls("cuCheckpointProcessUnlock");
    assert_eq!(restores.len(), WORKLOADS);
    assert!(overlapped(&restores), "restores ran one after another");
    assert!(restores.iter().all(|c| c.args["gpuPairs"] == json!([])));
    let last_restore = restores.iter().map(|c| c.end_ns).max().unwrap();
    assert!(unlocks.iter().all(|c| c.start_ns >= last_restore));
    // The source's own line 0 is READY; the restored workloads answer on line 1.
    for answer in gpu.verify(ph.pid(), "src", 1) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
    assert_eq!(gpu.node.resident_bytes(), (WORKLOADS as u64) * (16 << 20));
}

#[test]
fn the_restored_tree_stays_stopped_until_its_gpu_state_is_back_and_unlocked() {
    let gpu = Gpu::new(12080);
    let spec = gpu.spec_ticking("src", 8);
    let src = gpu.start_spec("src", &spec);
    let artifact = gpu.tmp.path().join("artifact");
    let out = gpu.checkpoint(&src, &artifact);
    assert!(out.status.success(), "checkpoint failed: {}", stderr(&out));
    // Restores that take a while: time for application threads to run, if they could.
    gpu.node
        .set_faults(&json!({"transferDelayMs": 500}))
        .unwrap();
    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, "ph")).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    let restores = gpu.calls("cuCheckpointProcessRestore");
    let unlocks = gpu.calls("cuCheckpointProcessUnlock");
    assert_eq!(restores.len(), WORKLOADS);
    assert!(unlocks.iter().all(|c| c.rc == 0));
    let unlocked = unlocks.iter().map(|c| c.end_ns).max().unwrap();
    for answer in gpu.verify(ph.pid(), "src", 1) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
    for i in 0..WORKLOADS {
        let ticks = gpu.ticks("src", i);
        assert_eq!(ticks.len(), 2, "started, then restored: {ticks:?}");
        let (_, first_run) = ticks[1];
        assert!(
            first_run >= unlocked,
            "workload {i}'s own thread ran {} ms before its GPU state was restored and unlocked",
            (unlocked - first_run) / 1_000_000
        );
    }
}

#[test]
fn a_placeholder_on_other_gpus_is_restored_with_a_gpu_map_from_driver_13000() {
    let gpu = Gpu::new(13000);
    let src = gpu.start("src", 8);
    let artifact = gpu.tmp.path().join("artifact");
    assert!(gpu.checkpoint(&src, &artifact).status.success());
    let source_uuid = manifest(&artifact)["cuda"]["gpus"][0]["uuid"]
        .as_str()
        .unwrap()
        .to_owned();

    // The placeholder sees only the node's second GPU: the processes held only the first,
    // so that is enough.
    let target = SimGpu::numbered(1, 80 * GIB).uuid;
    let spec = gpu.spec("src", 8);
    let mut ph_spec = gpu.placeholder(&spec, "ph");
    ph_spec = ph_spec.with_env("NVIDIA_VISIBLE_DEVICES", &target);
    let ph = Container::start_in(&gpu.rt, &ph_spec).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    let restores = gpu.calls("cuCheckpointProcessRestore");
    assert_eq!(restores.len(), WORKLOADS);
    for restore in &restores {
        assert_eq!(restore.args["gpuPairs"], json!([[source_uuid, target]]));
    }
    for answer in gpu.verify(ph.pid(), "src", 1) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
    drop(ph);

    // Both GPUs visible, in the other order of UUIDs: same GPUs, no map.
    // A node whose GPUs are other ones: the map pairs them in order.
    gpu.node
        .set_node(
            13000,
            &[SimGpu::numbered(7, 80 * GIB), SimGpu::numbered(8, 80 * GIB)],
        )
        .unwrap();
    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, "ph2")).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    let restores = gpu.calls("cuCheckpointProcessRestore");
    assert_eq!(restores.len(), 2 * WORKLOADS);
    let pairs = &restores[WORKLOADS].args["gpuPairs"];
    assert_eq!(pairs[0][0], source_uuid.as_str());
    assert_eq!(pairs[0][1], SimGpu::numbered(7, 0).uuid.as_str());
    for answer in gpu.verify(ph.pid(), "src", 2) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
}

#[test]
fn each_process_is_restored_onto_other_gpus_with_the_pairs_of_its_own_gpus() {
    let gpu = Gpu::new(13000);
    // Workload 0 holds both GPUs, workload 1 the first only.
    let spec = gpu.spec_with("src", 8, &["0,1", "0"]);
    let src = gpu.start_spec("src", &spec);
    let artifact = gpu.tmp.path().join("artifact");
    let out = gpu.checkpoint(&src, &artifact);
    assert!(out.status.success(), "checkpoint failed: {}", stderr(&out));
    let (g0, g1) = (SimGpu::numbered(0, 0).uuid, SimGpu::numbered(1, 0).uuid);
    let m = manifest(&artifact);
    let mut held: Vec<Value> = m["cuda"]["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["gpus"].clone())
        .collect();
    held.sort_by_key(|g| g.as_array().map_or(0, Vec::len));
    assert_eq!(held, [json!([g0]), json!([g0, g1])]);

    // A node whose GPUs are other ones.
    let (g7, g8) = (SimGpu::numbered(7, 0).uuid, SimGpu::numbered(8, 0).uuid);
    gpu.node
        .set_node(
            13000,
            &[SimGpu::numbered(7, 80 * GIB), SimGpu::numbered(8, 80 * GIB)],
        )
        .unwrap();
    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, "ph")).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    let mut pairs: Vec<Value> = gpu
        .calls("cuCheckpointProcessRestore")
        .iter()
        .map(|c| c.args["gpuPairs"].clone())
        .collect();
    pairs.sort_by_key(|p| p.as_array().map_or(0, Vec::len));
    assert_eq!(
        pairs,
        [json!([[g0, g7]]), json!([[g0, g7], [g1, g8]])],
        "each process gets its own GPUs' pairs, and no other"
    );
    for answer in gpu.verify(ph.pid(), "src", 1) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
}

/// The control node and the nodes of the GPUs `minors`, as the NVIDIA runtime gives a
/// container its GPUs.
fn gpu_devices(minors: &[u32]) -> Value {
    let mut devices = vec![
        json!({"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255, "fileMode": 438}),
    ];
    devices.extend(minors.iter().map(|m| {
        json!({"path": format!("/dev/nvidia{m}"), "type": "c", "major": 195, "minor": m, "fileMode": 438})
    }));
    json!({"linux": {"devices": devices}})
}

#[test]
fn the_restored_tree_opens_the_placeholders_gpu_device_nodes() {
    let gpu = Gpu::new(13000);
    // Each process opens the GPUs' nodes in its own /dev, as with the real driver.
    gpu.node.use_process_dev();
    gpu.node.set_node(13000, &gpus(2, 80)).unwrap();
    let (g0, g1) = (SimGpu::numbered(0, 0).uuid, SimGpu::numbered(1, 0).uuid);
    let mut spec = gpu.spec("src", 8).with_env("NVIDIA_VISIBLE_DEVICES", &g0);
    spec.oci_patch = Some(gpu_devices(&[0]));
    let src = gpu.start_spec("src", &spec);
    let artifact = gpu.tmp.path().join("artifact");
    let out = gpu.checkpoint(&src, &artifact);
    assert!(out.status.success(), "checkpoint failed: {}", stderr(&out));
    drop(src);

    let mut ph_spec = gpu
        .placeholder(&spec, "ph")
        .with_env("NVIDIA_VISIBLE_DEVICES", &g1);
    ph_spec.oci_patch = Some(gpu_devices(&[1]));
    let ph = Container::start_in(&gpu.rt, &ph_spec).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(out.status.success(), "restore failed: {}", stderr(&out));
    let restores = gpu.calls("cuCheckpointProcessRestore");
    assert!(
        restores
            .iter()
            .all(|c| c.rc == 0 && c.args["gpuPairs"] == json!([[g0, g1]]))
    );
    for answer in gpu.verify(ph.pid(), "src", 1) {
        assert!(answer.starts_with("OK "), "{answer}");
    }
    let restored = workloads_below(ph.pid())[0];
    let dev = PathBuf::from(format!("/proc/{restored}/root/dev"));
    assert!(
        dev.join("nvidia1").exists(),
        "the placeholder's node is there"
    );
    assert!(
        !dev.join("nvidia0").exists(),
        "the checkpoint's node is gone"
    );
}

#[test]
fn restores_the_node_cannot_take_are_refused_before_anything_is_restored() {
    let gpu = Gpu::new(12080);
    let src = gpu.start("src", 8);
    let artifact = gpu.tmp.path().join("artifact");
    assert!(gpu.checkpoint(&src, &artifact).status.success());
    let spec = gpu.spec("src", 8);
    let cases: [(&str, i32, Vec<SimGpu>, &str); 4] = [
        (
            "old",
            12040,
            gpus(2, 80),
            "captured with CUDA driver 12.8; this node's driver is 12.4",
        ),
        (
            "remap",
            12080,
            vec![SimGpu::numbered(5, 80 * GIB), SimGpu::numbered(6, 80 * GIB)],
            "needs CUDA driver 13.0",
        ),
        (
            "small",
            12080,
            gpus(2, 40),
            "has 85899345920 bytes of memory",
        ),
        ("nogpu", 12080, Vec::new(), "the placeholder sees 0"),
    ];
    for (name, driver, node_gpus, expected) in cases {
        gpu.node.set_node(driver, &node_gpus).unwrap();
        let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, name)).unwrap();
        let out = gpu.restore(&ph, &artifact);
        assert!(!out.status.success(), "{name}: restored");
        assert!(stderr(&out).contains(expected), "{name}: {}", stderr(&out));
        let failed = std::fs::read_to_string(gpu.control(name).join("restore-failed")).unwrap();
        assert!(
            failed.contains(expected),
            "{name}: restore-failed says {failed}"
        );
        assert!(
            !gpu.control(name).join("restore-complete").exists(),
            "{name}: restore-complete written"
        );
        assert!(workloads_below(ph.pid()).is_empty(), "{name}: restored");
    }
    assert!(gpu.calls("cuCheckpointProcessRestore").is_empty());

    // Without any driver on the node.
    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, "nodriver")).unwrap();
    let mut command = agent_cli::command(&gpu.rt).unwrap();
    command
        .args(["--cuda-library", "/nonexistent/libcuda.so.1"])
        .args(["restore", "--into-runc", ph.id(), "--artifact"])
        .arg(&artifact);
    let out = agent_cli::run(command, agent_cli::DEFAULT_TIMEOUT).unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("no usable CUDA driver"),
        "{}",
        stderr(&out)
    );
}

/// `NVIDIA_VISIBLE_DEVICES` in each of its forms, on a node without the kubelet: a source or a
/// placeholder whose variable says `void` or `none` (and nothing else names its GPUs) or names a
/// GPU the node lacks is refused, naming the container, the value and the sources tried; never
/// taken as "no GPU". A source given its GPU by UUID records it, with where it was found.
#[test]
fn gpus_that_cannot_be_told_are_refused_in_every_form_of_the_variable() {
    let gpu = Gpu::new(12080);
    let first = SimGpu::numbered(0, 0).uuid;
    for (value, expected) in [
        (
            "void",
            "NVIDIA_VISIBLE_DEVICES=\"void\" says its GPUs come through CDI",
        ),
        ("none", "NVIDIA_VISIBLE_DEVICES=\"none\""),
        ("GPU-nope", "was given GPU \"GPU-nope\""),
    ] {
        let name = format!("src-{}", value.to_lowercase());
        let spec = gpu.spec(&name, 8).with_env("NVIDIA_VISIBLE_DEVICES", value);
        let src = gpu.start_spec(&name, &spec);
        let artifact = gpu.tmp.path().join(format!("artifact-{name}"));
        let out = gpu.checkpoint(&src, &artifact);
        assert!(!out.status.success(), "{value}: checkpointed");
        let err = stderr(&out);
        assert!(err.contains(expected), "{value}: {err}");
        assert!(
            err.contains("PodResources API (not asked") && err.contains("CDI devices (none)")
                || value == "GPU-nope",
            "{value}: the sources tried are named: {err}"
        );
        assert!(!artifact.exists(), "{value}: published");
        assert!(
            gpu.calls("cuCheckpointProcessLock").is_empty(),
            "{value}: GPU state was taken"
        );
    }

    let spec = gpu
        .spec("src", 8)
        .with_env("NVIDIA_VISIBLE_DEVICES", &first);
    let src = gpu.start_spec("src", &spec);
    let artifact = gpu.tmp.path().join("artifact");
    assert!(gpu.checkpoint(&src, &artifact).status.success());
    let assigned = &manifest(&artifact)["assignedGpus"];
    assert_eq!(assigned["source"], "env", "{assigned}");
    assert_eq!(assigned["uuids"], json!([first]), "{assigned}");
    for (value, expected) in [
        ("void", "NVIDIA_VISIBLE_DEVICES=\"void\""),
        ("none", "NVIDIA_VISIBLE_DEVICES=\"none\""),
        ("GPU-nope", "was given GPU \"GPU-nope\""),
    ] {
        let name = format!("ph-{}", value.to_lowercase());
        let ph_spec = gpu
            .placeholder(&spec, &name)
            .with_env("NVIDIA_VISIBLE_DEVICES", value);
        let ph = Container::start_in(&gpu.rt, &ph_spec).unwrap();
        let out = gpu.restore(&ph, &artifact);
        assert!(!out.status.success(), "{value}: restored");
        assert!(stderr(&out).contains(expected), "{value}: {}", stderr(&out));
        let failed: Value = serde_json::from_str(
            &std::fs::read_to_string(gpu.control(&name).join("restore-failed")).unwrap(),
        )
        .unwrap();
        let reason = failed["reason"].as_str().unwrap_or_default();
        assert!(
            reason.contains(expected),
            "{value}: restore-failed says {failed}"
        );
        assert!(workloads_below(ph.pid()).is_empty(), "{value}: restored");
    }
    assert!(gpu.calls("cuCheckpointProcessRestore").is_empty());
}

#[test]
fn cuda_faults_at_checkpoint_leave_every_process_running_and_nothing_published() {
    let gpu = Gpu::new(12080);
    let src = gpu.start("src", 8);
    let refused = |faults: &Value, artifact: &Path, expected: &str| {
        let out = gpu.checkpoint(&src, artifact);
        assert!(!out.status.success(), "{faults}: checkpointed");
        assert!(
            stderr(&out).contains(expected),
            "{faults}: {}",
            stderr(&out)
        );
        assert!(!artifact.exists(), "{faults}: published");
    };
    // GPU work in flight that outlasts the lock timeout (1 s): the locks give up.
    let faults = json!({"callDelayMs": 3000});
    gpu.node.set_faults(&faults).unwrap();
    ask_to_verify(src.pid());
    std::thread::sleep(Duration::from_millis(300));
    refused(
        &faults,
        &gpu.tmp.path().join("artifact-1"),
        "lock failed for",
    );
    gpu.node.set_faults(&json!({})).unwrap();
    for i in 0..WORKLOADS {
        let answer = &gpu.lines("src", i, 2)[1];
        assert!(answer.starts_with("OK "), "{faults}: {answer}");
    }
    let faults = json!({"checkpointError": 999});
    gpu.node.set_faults(&faults).unwrap();
    refused(
        &faults,
        &gpu.tmp.path().join("artifact-2"),
        "CUDA_ERROR_UNKNOWN",
    );
    gpu.node.set_faults(&json!({})).unwrap();
    for answer in gpu.verify(src.pid(), "src", 2) {
        assert!(answer.starts_with("OK "), "{faults}: {answer}");
    }
}

#[test]
fn a_gpu_restore_failure_kills_the_restored_tree_and_says_why() {
    let gpu = Gpu::new(12080);
    let spec = gpu.spec_ticking("src", 8);
    let src = gpu.start_spec("src", &spec);
    let artifact = gpu.tmp.path().join("artifact");
    assert!(gpu.checkpoint(&src, &artifact).status.success());
    gpu.node.set_faults(&json!({"restoreOom": true})).unwrap();
    let ph = Container::start_in(&gpu.rt, &gpu.placeholder(&spec, "ph")).unwrap();
    let out = gpu.restore(&ph, &artifact);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("CUDA_ERROR_OUT_OF_MEMORY"),
        "{}",
        stderr(&out)
    );
    let failed = std::fs::read_to_string(gpu.control("ph").join("restore-failed")).unwrap();
    assert!(failed.contains("restore failed"), "{failed}");
    assert!(!gpu.control("ph").join("restore-complete").exists());
    let deadline = Instant::now() + WAIT;
    while !workloads_below(ph.pid()).is_empty() {
        assert!(Instant::now() < deadline, "the restored tree lives on");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(
        ph.state().unwrap(),
        "running",
        "the placeholder itself is left to its pod"
    );
    for i in 0..WORKLOADS {
        let ticks = gpu.ticks("src", i);
        assert_eq!(ticks.len(), 1, "the restored workload {i} ran: {ticks:?}");
    }
}

#[test]
fn check_lists_the_driver_and_gpus_as_text_and_json() {
    let node = GpuNode::start(12080, &gpus(2, 80)).unwrap();
    let run = |json: bool| {
        let mut cmd = Command::new(binaries::agent().unwrap());
        cmd.arg("--cuda-library").arg(node.library()).arg("check");
        if json {
            cmd.arg("--json");
        }
        String::from_utf8(cmd.output().unwrap().stdout).unwrap()
    };
    let text = run(false);
    let line = text.lines().find(|l| l.contains("cuda driver")).unwrap();
    assert!(line.starts_with("PASS"), "{line}");
    assert!(line.contains("CUDA 12.8, 2 GPU(s)"), "{line}");
    assert!(line.contains(&SimGpu::numbered(1, 0).uuid), "{line}");
    let doc: Value = serde_json::from_str(&run(true)).unwrap();
    assert_eq!(doc["cuda"]["driverVersion"], 12080);
    assert_eq!(doc["cuda"]["gpus"][1]["memoryBytes"], 80 * GIB);
    let check = doc["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "cuda driver")
        .unwrap();
    assert_eq!(check["verdict"], "PASS");
}

/// `scripts/gpu-check.sh`, the script prepared for a GPU node, run here against the stand-in:
/// its logic (driver-API cycle, CRIU dump, the container round trip through the agent) is
/// checked where no GPU exists.
#[test]
fn the_gpu_check_script_passes_against_the_stand_in() {
    let node = GpuNode::start(12080, &gpus(1, 80)).unwrap();
    let bins = tempfile::tempdir().unwrap();
    let (_, workload) = binaries::cuda_standin().unwrap();
    std::os::unix::fs::symlink(
        binaries::agent().unwrap(),
        bins.path().join("warmstart-agent"),
    )
    .unwrap();
    std::os::unix::fs::symlink(&workload, bins.path().join("warmstart-cuda-workload")).unwrap();
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/gpu-check.sh");
    let out = Command::new("bash")
        .arg(&script)
        .env("GPU_CHECK_BIN_DIR", bins.path())
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
    for needle in [
        "== container round trip",
        "in a container: READY",
        "restore-complete written",
        // A kernel outlasting the lock timeout: the lock is refused, the workload runs on.
        "SPIN launched ms=5000",
        "  refused after ",
        "the workload is still running, as documented",
        "SPIN done ms=",
        // The CRIU-restored workload stays stopped while its restore thread alone restores.
        "the workload stayed stopped through its CUDA restore",
        "GPU CHECK: PASS",
    ] {
        assert!(
            stdout.contains(needle),
            "{needle:?} missing:\n{stdout}\n{stderr}"
        );
    }
    assert_eq!(
        stdout.matches("  OK ").count(),
        4,
        "verified at start, after the in-place restore, after the CRIU restore and after the \
         container restore:\n{stdout}"
    );
}

/// The CUDA states of the processes below `root`, as `warmstart-agent cuda state` reads them.
fn cuda_states(gpu: &Gpu, root: u32) -> Vec<String> {
    let out = gpu.agent(
        &["cuda", "state", "--json", "--pid", &root.to_string()],
        &[],
    );
    assert!(out.status.success(), "cuda state: {}", stderr(&out));
    let list: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap();
    list.iter()
        .map(|p| p["state"].as_str().unwrap().to_owned())
        .collect()
}

/// An agent SIGKILLed while it holds a workload's GPU state leaves the workload frozen: the
/// driver finishes the checkpoint the agent asked for and nobody gives the state back, so the
/// workload's CUDA calls block. `warmstart-agent cuda release` gives it back (the agent in
/// cluster mode does the same when it restarts): both processes restored and unlocked, their
/// device memory intact, the request they were blocked on answered; a second release finds
/// nothing held.
#[test]
fn gpu_state_left_held_by_a_killed_agent_is_given_back() {
    let gpu = Gpu::new(12080);
    gpu.node
        .set_faults(&json!({"transferDelayMs": 1500}))
        .unwrap();
    let src = gpu.start("held", 8);
    let mut command = agent_cli::command(&gpu.rt).unwrap();
    command
        .arg("--cuda-library")
        .arg(gpu.node.library())
        .args(["--cuda-call-timeout", "20", "--cuda-lock-timeout", "1"])
        .args(["checkpoint", "--hash", HASH, "--runc", src.id(), "--output"])
        .arg(gpu.tmp.path().join("held-artifact"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut agent = command.spawn().unwrap();
    let deadline = Instant::now() + WAIT;
    while gpu.calls("cuCheckpointProcessLock").len() < WORKLOADS {
        assert!(
            Instant::now() < deadline,
            "the agent never locked the workloads"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // Mid-checkpoint (each takes 1.5 s): the agent dies, its helper processes with it.
    std::thread::sleep(Duration::from_millis(300));
    agent.kill().unwrap();
    agent.wait().unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        let states = cuda_states(&gpu, src.pid());
        if states.len() == WORKLOADS && states.iter().all(|s| s == "checkpointed") {
            break;
        }
        assert!(Instant::now() < deadline, "states: {states:?}");
        std::thread::sleep(Duration::from_millis(100));
    }
    // Frozen: asked to check their memory, the workloads cannot answer.
    ask_to_verify(src.pid());
    std::thread::sleep(Duration::from_secs(1));
    for i in 0..WORKLOADS {
        let report = std::fs::read_to_string(gpu.report("held", i)).unwrap();
        assert_eq!(report.lines().count(), 1, "answered while frozen: {report}");
    }

    let out = gpu.agent(&["cuda", "release", "--pid", &src.pid().to_string()], &[]);
    assert!(out.status.success(), "cuda release: {}", stderr(&out));
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(text.matches("released").count(), WORKLOADS, "{text}");
    assert_eq!(cuda_states(&gpu, src.pid()), vec!["running"; WORKLOADS]);
    for i in 0..WORKLOADS {
        let answer = &gpu.lines("held", i, 2)[1];
        assert!(answer.starts_with("OK "), "{answer}");
    }
    let out = gpu.agent(&["cuda", "release", "--pid", &src.pid().to_string()], &[]);
    assert!(out.status.success(), "cuda release: {}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("holds its GPU state"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = gpu.agent(&["cuda", "release", "--pid", "999999999"], &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("no such process"), "{}", stderr(&out));
}
