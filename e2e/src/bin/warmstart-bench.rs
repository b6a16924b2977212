//! `make bench`: checkpoint and restore speed on this machine, against baselines measured in the
//! same run. For each size of sample worker (`--sizes`, MiB of weights; default 256,1024,4096):
//!
//! - **cold start**: container start → serving (weights generated, `--warmup-ms` of warm-up);
//! - **checkpoint**: `warmstart-agent checkpoint --stop` of one worker vs `runc checkpoint` of an
//!   identical one (both stop the workload; wall time of the command); and `runc checkpoint`
//!   until its images are on disk (`syncfs`), since the agent's artifact is durable when its
//!   command returns and runc's images are then still in the page cache;
//! - **storage**: a cold sequential read (page cache dropped, one reader, 4 MiB reads) of the
//!   agent artifact's page images: the storage's limit for a restore;
//! - **restore**: `warmstart-agent restore` (verification included, to `restore-complete`) into a
//!   placeholder vs `runc restore` of the runc images, each with the page cache dropped first;
//!   and the agent's restore again with the page images cached (CRIU's own cost);
//! - **lazy pages** (exploration): CRIU's restore of the sample worker as a plain host process,
//!   time to its first answered request with every page restored before it runs, and with
//!   CRIU's lazy pages (userfaultfd, pages served by `criu lazy-pages` as they are touched), and
//!   when the last lazy page was in. Page cache dropped before each;
//! - **artifact ready on a node** (the step before CRIU's restore; the restore itself is the
//!   same whichever the source): the artifact on the volume verified in full as a restore
//!   without a cache reads it (the baseline), copied from the volume into a cold node cache,
//!   from the object store (SeaweedFS on loopback, started here) into a cold cache, from a warm
//!   cache (a hit), and eight reads of it at once through a cold cache (one download, asserted);
//! - **zstd** (`--zstd-level`): ratio and one core's compress and decompress speed on the page
//!   images of the sample worker and of a mostly-zero artifact of the same size, and their
//!   upload and cold-cache fetch plain vs compressed.
//!
//! Prints a table with ratios and writes the same as JSON (`--json`, default
//! `target/bench.json`). Needs root (containers, CRIU, dropping the page cache).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail, ensure};
use clap::Parser;
use serde::Serialize;
use warmstart_e2e::binaries::{self, WORKER_IN_IMAGE};
use warmstart_e2e::fixture::{BindMount, Container, ContainerSpec, Image, ImageStore, Runtime};
use warmstart_e2e::worker::{get_state, run_agent, wait_serving};

const TIMEOUT: Duration = Duration::from_secs(300);
const MIB: f64 = 1024.0 * 1024.0;

/// `make bench` (see the module documentation).
#[derive(Debug, Parser)]
struct Args {
    /// Sizes of the sample worker's weights, in MiB.
    #[arg(
        long,
        env = "WARMSTART_BENCH_SIZES",
        value_delimiter = ',',
        default_value = "256,1024,4096"
    )]
    sizes: Vec<u32>,
    /// The worker's warm-up after loading its weights (stands for kernel compilation).
    #[arg(long, env = "WARMSTART_BENCH_WARMUP_MS", default_value_t = 2000)]
    warmup_ms: u64,
    /// Where the results go as JSON.
    #[arg(
        long,
        env = "WARMSTART_BENCH_JSON",
        default_value = "target/bench.json"
    )]
    json: PathBuf,
    /// Where artifacts and images are written (the storage under test).
    #[arg(long, env = "WARMSTART_BENCH_DIR")]
    dir: Option<PathBuf>,
    /// zstd level of the object store's compression measured (1 to 19).
    #[arg(
        long,
        env = "WARMSTART_BENCH_ZSTD_LEVEL",
        default_value_t = 3,
        value_parser = clap::value_parser!(i32).range(1..=19)
    )]
    zstd_level: i32,
    /// Times each artifact read is measured (the fastest is kept).
    #[arg(long, env = "WARMSTART_BENCH_REPEAT", default_value_t = 3)]
    repeat: u32,
    /// Measure only the artifact reads and zstd, of this published artifact (a real worker's
    /// checkpoint, say): no containers, `--sizes` unused.
    #[arg(long)]
    artifact: Option<PathBuf>,
}

/// One size's measurements, in seconds unless named otherwise.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Row {
    weights_mib: u32,
    /// Bytes of CRIU page images in the agent's artifact.
    page_bytes: u64,
    cold_start: f64,
    checkpoint_agent: f64,
    /// The agent checkpoint's own phases.
    checkpoint_agent_phases: Vec<(String, f64)>,
    checkpoint_runc: f64,
    /// `runc checkpoint` until its images were written back to disk.
    checkpoint_runc_synced: f64,
    /// Cold sequential read of the page images.
    page_read: f64,
    restore_agent: f64,
    /// The agent restore's own phases.
    restore_agent_phases: Vec<(String, f64)>,
    restore_runc: f64,
    /// Agent restore to serving (after `restore-complete`, the first answered request).
    restore_agent_to_serving: f64,
    /// The same restore with the page images in the page cache: what CRIU's own page restore
    /// costs without storage.
    restore_agent_warm: f64,
    /// Its phases.
    restore_agent_warm_phases: Vec<(String, f64)>,
    /// CRIU restore of the worker as a host process, to its first answer: pages restored first.
    criu_eager_to_first_answer: f64,
    /// The same with lazy pages.
    criu_lazy_to_first_answer: f64,
    /// With lazy pages, until every page was in (`criu lazy-pages` exited).
    criu_lazy_all_pages: f64,
    /// The artifact made ready on a node from each source, and zstd.
    store: StoreReads,
}

impl Row {
    fn storage_mib_s(&self) -> f64 {
        self.page_bytes as f64 / MIB / self.page_read
    }
    fn restore_mib_s(&self) -> f64 {
        self.page_bytes as f64 / MIB / self.restore_agent
    }
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Report {
    machine: String,
    warmup_ms: u64,
    rows: Vec<Row>,
}

fn main() -> Result<()> {
    let args = Args::parse();
    ensure!(
        nix::unistd::geteuid().is_root(),
        "the benchmark needs root (containers, CRIU, dropping the page cache)"
    );
    ensure!(!args.sizes.is_empty(), "--sizes is empty");
    if let Some(artifact) = &args.artifact {
        let tmp = tempfile::Builder::new()
            .prefix("warmstart-bench-")
            .tempdir_in(args.dir.as_deref().unwrap_or(Path::new("/var/tmp")))
            .context("benchmark directory")?;
        let reads = store_reads(artifact, tmp.path(), args.zstd_level, args.repeat)?;
        println!("artifact {}", artifact.display());
        let size = format!("{:.0}", reads.artifact_bytes as f64 / MIB);
        print_store_table(&[(size, &reads)]);
        return Ok(());
    }
    let tmp = match &args.dir {
        Some(dir) => tempfile::tempdir_in(dir),
        None => tempfile::Builder::new()
            .prefix("warmstart-bench-")
            .tempdir_in("/var/tmp"),
    }
    .context("benchmark directory")?;
    let store = ImageStore::temporary().context("image store")?;
    let image = binaries::worker_image(&store).context("worker image")?;
    let agent = binaries::agent().context("warmstart-agent binary")?;
    let rt = Runtime::default();
    let machine = machine();
    println!(
        "warmstart bench on {machine}; artifacts in {}",
        tmp.path().display()
    );
    let mut rows = Vec::new();
    for (i, mib) in args.sizes.iter().enumerate() {
        let dir = tmp.path().join(format!("{i}-{mib}"));
        std::fs::create_dir(&dir).with_context(|| format!("create {}", dir.display()))?;
        println!("== {mib} MiB");
        let row = measure(&rt, &image, &agent, &dir, *mib, &args)
            .with_context(|| format!("{mib} MiB"))?;
        std::fs::remove_dir_all(&dir).with_context(|| format!("remove {}", dir.display()))?;
        rows.push(row);
    }
    print_table(&rows);
    let report = Report {
        machine,
        warmup_ms: args.warmup_ms,
        rows,
    };
    let json = serde_json::to_string_pretty(&report).context("serialise the results")?;
    if let Some(parent) = args.json.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    std::fs::write(&args.json, json + "\n")
        .with_context(|| format!("write {}", args.json.display()))?;
    println!("JSON: {}", args.json.display());
    Ok(())
}

fn worker_spec(
    image: &Image,
    name: &str,
    control: &Path,
    mib: u32,
    warmup_ms: u64,
) -> ContainerSpec {
    ContainerSpec::new(
        name,
        image,
        [
            WORKER_IN_IMAGE,
            "--weights-mib",
            &mib.to_string(),
            "--warmup-ms",
            &warmup_ms.to_string(),
            "--port",
            "8000",
        ],
    )
    .with_env("WARMSTART_CONTROL_DIR", "/warmstart-control")
    .with_mount(BindMount::new(control, "/warmstart-control"))
}

fn mkdir(path: PathBuf) -> Result<PathBuf> {
    std::fs::create_dir_all(&path).with_context(|| format!("create {}", path.display()))?;
    Ok(path)
}

fn measure(
    rt: &Runtime,
    image: &Image,
    agent: &Path,
    dir: &Path,
    mib: u32,
    args: &Args,
) -> Result<Row> {
    let warmup_ms = args.warmup_ms;
    // Cold start, then the agent's checkpoint of that worker.
    let spec = worker_spec(
        image,
        "bench",
        &mkdir(dir.join("control-src"))?,
        mib,
        warmup_ms,
    );
    let started = Instant::now();
    let source = Container::start_in(rt, &spec).context("start the worker")?;
    wait_serving(&source, TIMEOUT)?;
    let cold_start = started.elapsed().as_secs_f64();
    let before = get_state(&source)?;
    let artifact = dir.join("artifact");
    // Both checkpoints start with no dirty pages left by what ran before them.
    nix::unistd::sync();
    let started = Instant::now();
    let out = run_agent(
        agent,
        rt,
        &["checkpoint", "--stop", "--runc", source.id(), "--output"],
        &artifact,
    )?;
    let checkpoint_agent = started.elapsed().as_secs_f64();
    let checkpoint_agent_phases = phases(&out);
    drop(source);
    println!("  cold start {cold_start:.2} s, agent checkpoint {checkpoint_agent:.2} s");

    // runc's checkpoint of an identical worker.
    let twin_spec = worker_spec(
        image,
        "bench-runc",
        &mkdir(dir.join("control-runc"))?,
        mib,
        warmup_ms,
    );
    let twin = Container::start_in(rt, &twin_spec).context("start the runc twin")?;
    wait_serving(&twin, TIMEOUT)?;
    let images = mkdir(dir.join("runc-images"))?;
    nix::unistd::sync();
    let started = Instant::now();
    runc(
        rt,
        &[
            "checkpoint".as_ref(),
            "--image-path".as_ref(),
            images.as_os_str(),
            "--work-path".as_ref(),
            mkdir(dir.join("runc-work"))?.as_os_str(),
            twin.id().as_ref(),
        ],
    )?;
    let checkpoint_runc = started.elapsed().as_secs_f64();
    let fs = std::fs::File::open(&images).with_context(|| format!("open {}", images.display()))?;
    nix::unistd::syncfs(&fs).with_context(|| format!("syncfs {}", images.display()))?;
    let checkpoint_runc_synced = started.elapsed().as_secs_f64();
    println!(
        "  runc checkpoint {checkpoint_runc:.2} s ({checkpoint_runc_synced:.2} s with its images on disk)"
    );

    // The storage's limit: a cold sequential read of the agent artifact's page images.
    let pages = page_images(&artifact.join("criu"))?;
    let page_bytes: u64 = pages.iter().map(|(_, size)| size).sum();
    drop_caches()?;
    let started = Instant::now();
    read_all(&pages)?;
    let page_read = started.elapsed().as_secs_f64();
    println!(
        "  cold read of {:.0} MiB of page images {page_read:.2} s ({:.0} MiB/s)",
        page_bytes as f64 / MIB,
        page_bytes as f64 / MIB / page_read
    );

    // The agent's restore, cold.
    let mut ph_spec = spec.placeholder("bench-ph");
    ph_spec.mounts = vec![BindMount::new(
        mkdir(dir.join("control-ph"))?,
        "/warmstart-control",
    )];
    let placeholder = Container::start_in(rt, &ph_spec).context("start the placeholder")?;
    drop_caches()?;
    let started = Instant::now();
    let out = run_agent(
        agent,
        rt,
        &["restore", "--into-runc", placeholder.id(), "--artifact"],
        &artifact,
    )?;
    let restore_agent = started.elapsed().as_secs_f64();
    wait_serving(&placeholder, TIMEOUT)?;
    let restore_agent_to_serving = started.elapsed().as_secs_f64();
    let after = get_state(&placeholder)?;
    ensure!(
        after["weightsSha256"] == before["weightsSha256"]
            && after["startedAt"] == before["startedAt"],
        "the restored worker is not the checkpointed one: {before} vs {after}"
    );
    let restore_agent_phases = phases(&out);
    drop(placeholder);
    println!(
        "  agent restore {restore_agent:.2} s (serving after {restore_agent_to_serving:.2} s)"
    );

    // The same restore again, the page images still cached: CRIU's cost without storage.
    let mut warm_spec = spec.placeholder("bench-warm");
    warm_spec.mounts = vec![BindMount::new(
        mkdir(dir.join("control-warm"))?,
        "/warmstart-control",
    )];
    let warm = Container::start_in(rt, &warm_spec).context("start the second placeholder")?;
    read_all(&pages)?;
    let started = Instant::now();
    let out = run_agent(
        agent,
        rt,
        &["restore", "--into-runc", warm.id(), "--artifact"],
        &artifact,
    )?;
    let restore_agent_warm = started.elapsed().as_secs_f64();
    let restore_agent_warm_phases = phases(&out);
    drop(warm);
    println!("  agent restore, page cache warm {restore_agent_warm:.2} s");

    // runc's restore of its images, cold: the twin's bundle and root filesystem, a new id.
    drop_caches()?;
    let restored = RuncContainer {
        rt,
        id: format!("{}-r", twin.id()),
    };
    // The restored worker keeps runc's standard output and error (the twin's were pipes): a
    // file, so that nothing waits for them to close.
    let log = dir.join("runc-restore.log");
    let started = Instant::now();
    let status = rt
        .runc_command()
        .arg("restore")
        .arg("--detach")
        .arg("--image-path")
        .arg(&images)
        .arg("--work-path")
        .arg(mkdir(dir.join("runc-restore-work"))?)
        .arg("--bundle")
        .arg(twin.bundle())
        .arg(&restored.id)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).context("runc restore log")?)
        .stderr(std::fs::File::create(dir.join("runc-restore.err")).context("runc restore log")?)
        .status()
        .context("run runc restore")?;
    let restore_runc = started.elapsed().as_secs_f64();
    ensure!(
        status.success(),
        "runc restore failed ({status}): {}",
        std::fs::read_to_string(dir.join("runc-restore.err")).unwrap_or_default()
    );
    drop(restored);
    drop(twin);
    println!("  runc restore {restore_runc:.2} s");

    let lazy = lazy_pages(&mkdir(dir.join("lazy"))?, mib)?;
    println!(
        "  CRIU restore of a host process to its first answer: eager {:.2} s, lazy pages {:.2} s (all pages in after {:.2} s)",
        lazy.eager, lazy.lazy, lazy.lazy_all
    );

    let store = store_reads(
        &artifact,
        &mkdir(dir.join("store"))?,
        args.zstd_level,
        args.repeat,
    )
    .context("artifact reads")?;
    println!(
        "  artifact ready: volume {:.2} s, volume into a cache {:.2} s, object store into a cold cache {:.2} s, warm cache {:.4} s, eight at once {:.2} s ({} download)",
        store.pvc_read,
        store.pvc_to_cache,
        store.s3_cold,
        store.warm_hit,
        store.eight_cold,
        store.eight_fetches
    );

    Ok(Row {
        weights_mib: mib,
        page_bytes,
        cold_start,
        checkpoint_agent,
        checkpoint_agent_phases,
        checkpoint_runc,
        checkpoint_runc_synced,
        page_read,
        restore_agent,
        restore_agent_phases,
        restore_runc,
        restore_agent_to_serving,
        restore_agent_warm,
        restore_agent_warm_phases,
        criu_eager_to_first_answer: lazy.eager,
        criu_lazy_to_first_answer: lazy.lazy,
        criu_lazy_all_pages: lazy.lazy_all,
        store,
    })
}

/// What [`lazy_pages`] measured, in seconds.
struct Lazy {
    eager: f64,
    lazy: f64,
    lazy_all: f64,
}

/// A child process killed and reaped when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The sample worker as a host process (its own session, listening on a free port), dumped
/// by CRIU, then restored twice into a new PID namespace each (`unshare --kill-child`, so that
/// ending it ends the restored tree): once with every page restored before the tree runs, once
/// with lazy pages. Page cache dropped before each; the time is to the first `GET /state`
/// answered by the checkpointed worker (same start time and weights).
fn lazy_pages(dir: &Path, mib: u32) -> Result<Lazy> {
    let port = warmstart_e2e::ports::reserve().context("a free port")?;
    let images = mkdir(dir.join("images"))?;
    let log = std::fs::File::create(dir.join("worker.log")).context("worker log")?;
    let mut worker = Child(
        std::process::Command::new("setsid")
            .arg(binaries::static_worker()?)
            .args(["--weights-mib", &mib.to_string(), "--warmup-ms", "0"])
            .args(["--port", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(log.try_clone().context("worker log")?)
            .stderr(log)
            .spawn()
            .context("start the worker on the host")?,
    );
    let before = poll_state(port, TIMEOUT)?.1;
    let criu = binaries::criu();
    let dumped = std::process::Command::new(&criu)
        .args(["dump", "--shell-job", "-o", "dump.log", "-t"])
        .arg(worker.0.id().to_string())
        .arg("-D")
        .arg(&images)
        .status()
        .context("run criu dump")?;
    ensure!(
        dumped.success(),
        "criu dump of the host worker failed: {}",
        std::fs::read_to_string(images.join("dump.log")).unwrap_or_default()
    );
    let _ = worker.0.wait();
    let mut times = Vec::new();
    for lazy in [false, true] {
        drop_caches()?;
        let daemon = if lazy {
            let daemon = Child(
                std::process::Command::new(&criu)
                    .args(["lazy-pages", "-o", "lazy-pages.log", "-D"])
                    .arg(&images)
                    .stdin(Stdio::null())
                    .spawn()
                    .context("start criu lazy-pages")?,
            );
            // Its socket appears in the images directory once it listens.
            let deadline = Instant::now() + Duration::from_secs(10);
            while !images.join("lazy-pages.socket").exists() {
                ensure!(Instant::now() < deadline, "criu lazy-pages did not listen");
                std::thread::sleep(Duration::from_millis(5));
            }
            Some(daemon)
        } else {
            None
        };
        let name = if lazy { "lazy" } else { "eager" };
        let started = Instant::now();
        let mut command = std::process::Command::new("unshare");
        command
            .args(["--pid", "--fork", "--mount-proc", "--kill-child"])
            .arg(&criu)
            .args([
                "restore",
                "--shell-job",
                "-o",
                &format!("restore-{name}.log"),
            ])
            .arg("-D")
            .arg(&images)
            .stdin(Stdio::null());
        if lazy {
            command.arg("--lazy-pages");
        }
        let restore = Child(command.spawn().context("run criu restore")?);
        let (first, after) = poll_state(port, TIMEOUT).with_context(|| {
            std::fs::read_to_string(images.join(format!("restore-{name}.log"))).unwrap_or_default()
        })?;
        let first = first.duration_since(started).as_secs_f64();
        ensure!(
            after["startedAt"] == before["startedAt"]
                && after["weightsSha256"] == before["weightsSha256"],
            "the {name} restore is not the checkpointed worker: {before} vs {after}"
        );
        let all = match daemon {
            Some(mut daemon) => {
                let _ = daemon.0.wait();
                started.elapsed().as_secs_f64()
            }
            None => first,
        };
        // SIGTERM: unshare passes SIGKILL on to the namespace's init, which ends the tree.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(i32::try_from(restore.0.id()).unwrap_or(i32::MAX)),
            nix::sys::signal::Signal::SIGTERM,
        );
        drop(restore);
        // The port is free again once the restored worker is gone.
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            ensure!(Instant::now() < deadline, "the restored worker did not end");
            std::thread::sleep(Duration::from_millis(20));
        }
        times.push((first, all));
    }
    Ok(Lazy {
        eager: times[0].0,
        lazy: times[1].0,
        lazy_all: times[1].1,
    })
}

/// Polls `GET /state` on `127.0.0.1:port` until it answers 200: when, and the state.
fn poll_state(port: u16, timeout: Duration) -> Result<(Instant, serde_json::Value)> {
    let deadline = Instant::now() + timeout;
    loop {
        let answer = std::net::TcpStream::connect(("127.0.0.1", port))
            .ok()
            .and_then(|s| warmstart_e2e::fixture::http_exchange(s, "/state", "GET /state").ok());
        if let Some((200, body)) = answer {
            let at = Instant::now();
            return Ok((
                at,
                serde_json::from_str(&body).context("the worker's state")?,
            ));
        }
        ensure!(Instant::now() < deadline, "no answer on port {port}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// A container runc restored: deleted when dropped.
struct RuncContainer<'a> {
    rt: &'a Runtime,
    id: String,
}

impl Drop for RuncContainer<'_> {
    fn drop(&mut self) {
        if let Err(err) = self.rt.remove_runc_container(&self.id) {
            eprintln!(
                "cannot remove the runc-restored container {}: {err}",
                self.id
            );
        }
    }
}

fn runc(rt: &Runtime, args: &[&std::ffi::OsStr]) -> Result<()> {
    let out = rt
        .runc_command()
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("run runc")?;
    if !out.status.success() {
        bail!(
            "runc {:?} failed: {}{}",
            args,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// `pages-*.img` of a CRIU image directory, with their sizes.
fn page_images(dir: &Path) -> Result<Vec<(PathBuf, u64)>> {
    let mut pages = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))? {
        let entry = entry?;
        let name = entry.file_name();
        if name.to_string_lossy().starts_with("pages-") {
            pages.push((entry.path(), entry.metadata()?.len()));
        }
    }
    pages.sort();
    ensure!(!pages.is_empty(), "no page images in {}", dir.display());
    Ok(pages)
}

fn read_all(files: &[(PathBuf, u64)]) -> Result<()> {
    let mut buf = vec![0u8; 4 << 20];
    for (path, _) in files {
        let mut f =
            std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
        while f.read(&mut buf)? > 0 {}
    }
    Ok(())
}

/// Writes dirty pages back and drops the page cache, so the next read comes from storage.
fn drop_caches() -> Result<()> {
    nix::unistd::sync();
    std::fs::write("/proc/sys/vm/drop_caches", "3\n").context("drop the page cache")
}

/// Phases as `name seconds, …`, without the total.
fn phase_list(phases: &[(String, f64)]) -> String {
    phases
        .iter()
        .filter(|(name, _)| name != "total")
        .map(|(name, secs)| format!("{name} {secs:.2}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// The agent's phase table (`phase  seconds` lines; a phase that ran beside the others reads
/// `phase (beside)  seconds` and keeps its mark).
fn phases(table: &str) -> Vec<(String, f64)> {
    table
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let mut name = words.next()?.to_owned();
            let mut next = words.next()?;
            if next == "(beside)" {
                name.push_str(" (beside)");
                next = words.next()?;
            }
            let secs = next.parse::<f64>().ok()?;
            words.next().is_none().then_some((name, secs))
        })
        .collect()
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown CPU".to_owned());
    let cores = std::thread::available_parallelism().map_or(0, std::num::NonZero::get);
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        })
        .map_or_else(String::new, |kib| format!(", {} GiB", kib >> 20));
    format!("{cpu}, {cores} cores{mem}")
}

fn print_table(rows: &[Row]) {
    println!();
    println!(
        "{:>6} {:>8} | {:>7} {:>7} {:>6} | {:>7} {:>7} {:>6} | {:>9} {:>9} {:>6} | {:>7} {:>7}",
        "MiB",
        "cold s",
        "ckpt s",
        "runc s",
        "ratio",
        "rest s",
        "runc s",
        "ratio",
        "disk MB/s",
        "rest MB/s",
        "ratio",
        "serve s",
        "speedup"
    );
    for r in rows {
        println!(
            "{:>6} {:>8.2} | {:>7.2} {:>7.2} {:>5.2}x | {:>7.2} {:>7.2} {:>5.2}x | {:>9.0} {:>9.0} {:>5.2}x | {:>7.2} {:>6.1}x",
            r.weights_mib,
            r.cold_start,
            r.checkpoint_agent,
            r.checkpoint_runc,
            r.checkpoint_runc / r.checkpoint_agent,
            r.restore_agent,
            r.restore_runc,
            r.restore_runc / r.restore_agent,
            r.storage_mib_s(),
            r.restore_mib_s(),
            r.restore_mib_s() / r.storage_mib_s(),
            r.restore_agent_to_serving,
            r.cold_start / r.restore_agent_to_serving,
        );
    }
    println!();
    println!("ckpt/rest ratio: runc's time over the agent's (>1: the agent is faster).");
    println!(
        "disk MB/s: cold sequential read of the page images; rest MB/s: the same bytes over the agent's"
    );
    println!(
        "whole restore (verification included); ratio: restore over storage throughput (target >= 0.8)."
    );
    println!("serve s: agent restore to the first answered request; speedup: cold start over it.");
    println!();
    println!(
        "CRIU lazy pages (the worker as a host process, CRIU alone): time to the first answer"
    );
    println!(
        "{:>6} | {:>9} {:>9} {:>12}",
        "MiB", "eager s", "lazy s", "all pages s"
    );
    for r in rows {
        println!(
            "{:>6} | {:>9.2} {:>9.2} {:>12.2}",
            r.weights_mib,
            r.criu_eager_to_first_answer,
            r.criu_lazy_to_first_answer,
            r.criu_lazy_all_pages
        );
    }
    for r in rows {
        println!(
            "{:>6} MiB checkpoint phases: {}; runc checkpoint {:.2} s, {:.2} s with its images on disk ({:.2}x)",
            r.weights_mib,
            phase_list(&r.checkpoint_agent_phases),
            r.checkpoint_runc,
            r.checkpoint_runc_synced,
            r.checkpoint_runc_synced / r.checkpoint_agent,
        );
    }
    for r in rows {
        println!(
            "{:>6} MiB restore phases: {}",
            r.weights_mib,
            phase_list(&r.restore_agent_phases)
        );
        let criu = |phases: &[(String, f64)]| {
            phases
                .iter()
                .find(|(name, _)| name == "criu-restore")
                .map_or(0.0, |(_, secs)| *secs)
        };
        println!(
            "{:>6} MiB warm page cache: restore {:.2} s, criu-restore {:.2} s (cold {:.2} s)",
            r.weights_mib,
            r.restore_agent_warm,
            criu(&r.restore_agent_warm_phases),
            criu(&r.restore_agent_phases),
        );
    }
    let reads: Vec<(String, &StoreReads)> = rows
        .iter()
        .map(|r| (r.weights_mib.to_string(), &r.store))
        .collect();
    print_store_table(&reads);
}

/// The artifact reads and zstd measurements, one row per size (or artifact).
fn print_store_table(rows: &[(String, &StoreReads)]) {
    println!();
    println!(
        "Artifact ready for a restore on a node (verified, before CRIU's restore, which is the same for every source);"
    );
    println!(
        "x: the volume read's time over each (>1: faster than today's read from the artifact volume)"
    );
    println!(
        "{:>6} {:>9} | {:>7} | {:>9} {:>6} | {:>9} {:>6} | {:>8} {:>7} | {:>7} {:>6} {:>9}",
        "MiB",
        "art. MiB",
        "PVC s",
        "PVC>c s",
        "x",
        "S3 cold s",
        "x",
        "warm ms",
        "x",
        "8x s",
        "x",
        "downloads"
    );
    for (size, s) in rows {
        let x = |secs: f64| s.pvc_read / secs;
        println!(
            "{:>6} {:>9.0} | {:>7.2} | {:>9.2} {:>5.2}x | {:>9.2} {:>5.2}x | {:>8.1} {:>6.0}x | {:>7.2} {:>5.2}x {:>9}",
            size,
            s.artifact_bytes as f64 / MIB,
            s.pvc_read,
            s.pvc_to_cache,
            x(s.pvc_to_cache),
            s.s3_cold,
            x(s.s3_cold),
            s.warm_hit * 1000.0,
            x(s.warm_hit),
            s.eight_cold,
            x(s.eight_cold),
            format!(
                "{} ({:.0} MiB)",
                s.eight_fetches,
                s.eight_bytes as f64 / MIB
            ),
        );
    }
    println!(
        "PVC: the artifact on the volume verified in full, page cache dropped (a restore's read without a cache);"
    );
    println!(
        "PVC>c: copied from the volume into a cold node cache and verified; S3 cold: from the object store (SeaweedFS"
    );
    println!(
        "on loopback, data on this disk) into a cold cache, every chunk checked; warm: a cache hit; 8x: eight reads at"
    );
    println!(
        "once through a cold cache, until the last has it (downloads made, bytes fetched). Each the fastest of"
    );
    println!("--repeat runs.");
    println!();
    println!(
        "zstd per 8 MiB chunk (object store compression), one core; fetch: cold cache from the object store"
    );
    println!(
        "{:>6} {:>14} {:>3} | {:>8} {:>8} {:>6} | {:>8} {:>8} | {:>8} {:>8} | {:>8} {:>8} {:>6}",
        "MiB",
        "image",
        "lvl",
        "page MiB",
        "zstd MiB",
        "ratio",
        "comp/s",
        "decomp/s",
        "upload s",
        "zstd s",
        "fetch s",
        "zstd s",
        "x"
    );
    for (size, s) in rows {
        for c in &s.zstd {
            println!(
                "{:>6} {:>14} {:>3} | {:>8.0} {:>8.1} {:>5.1}x | {:>8.0} {:>8.0} | {:>8.2} {:>8.2} | {:>8.2} {:>8.2} {:>5.2}x",
                size,
                c.image,
                c.level,
                c.page_bytes as f64 / MIB,
                c.page_stored_bytes as f64 / MIB,
                c.page_bytes as f64 / c.page_stored_bytes.max(1) as f64,
                c.compress_mib_s,
                c.decompress_mib_s,
                c.upload_plain,
                c.upload_zstd,
                c.fetch_plain,
                c.fetch_zstd,
                c.fetch_plain / c.fetch_zstd,
            );
        }
    }
    println!(
        "ratio: page image bytes over their frames' bytes; comp/s, decomp/s: MiB/s of page image on one core;"
    );
    println!(
        "x: the plain fetch's time over the compressed one's (>1: compression made the restore's fetch faster)."
    );
}

/// Namespace of the bench's artifacts in the object store and the caches.
const NS: &str = "bench";
/// Identity hash of the mostly-zero artifact.
const ZERO_HASH: &str = "00000000000000b0";

/// What [`store_reads`] measured for one size, in seconds unless named otherwise.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct StoreReads {
    /// Bytes of the artifact's files.
    artifact_bytes: u64,
    /// A restore's read without a cache: the artifact on the volume verified in full (every
    /// chunk's checksum), page cache dropped.
    pvc_read: f64,
    /// The artifact copied from the volume into a cold node cache and verified there.
    pvc_to_cache: f64,
    /// The artifact from the object store into a cold node cache (every chunk checked).
    s3_cold: f64,
    /// The same artifact again from that cache (a hit).
    warm_hit: f64,
    /// Eight reads of the artifact at once on one node through a cold cache, until the last
    /// had it.
    eight_cold: f64,
    /// Downloads the eight reads made (must be 1).
    eight_fetches: usize,
    /// Artifact bytes those downloads fetched.
    eight_bytes: u64,
    /// Uploads, plain (for reference).
    upload_plain: f64,
    /// zstd measurements: the sample worker's artifact, then a mostly-zero one.
    zstd: Vec<Compression>,
}

/// zstd at one level on one artifact.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
struct Compression {
    image: &'static str,
    level: i32,
    /// Bytes of the page images.
    page_bytes: u64,
    /// Their bytes as frames (one per 8 MiB chunk).
    page_stored_bytes: u64,
    /// One core compressing the page images chunk by chunk, MiB/s of input.
    compress_mib_s: f64,
    /// One core decompressing them, MiB/s of output.
    decompress_mib_s: f64,
    /// Artifact upload, plain and compressed.
    upload_plain: f64,
    upload_zstd: f64,
    /// Bytes of the artifact's stored objects, compressed.
    stored_bytes: u64,
    /// Cold-cache fetch of the artifact, plain and compressed.
    fetch_plain: f64,
    fetch_zstd: f64,
}

/// A cache source that counts its downloads and the bytes they fetched.
struct Counting<S> {
    inner: S,
    fetches: std::sync::atomic::AtomicUsize,
    bytes: std::sync::atomic::AtomicU64,
}

impl<S> Counting<S> {
    fn new(inner: S) -> Self {
        Self {
            inner,
            fetches: Default::default(),
            bytes: Default::default(),
        }
    }
}

impl<S: warmstart_agent::cache::Source> warmstart_agent::cache::Source for Counting<S> {
    fn size(
        &self,
    ) -> futures::future::BoxFuture<'_, Result<u64, warmstart_agent::cache::FetchError>> {
        self.inner.size()
    }

    fn fetch<'a>(
        &'a self,
        into: &'a Path,
        meter: std::sync::Arc<warmstart_agent::progress::Meter>,
    ) -> futures::future::BoxFuture<'a, Result<(), warmstart_agent::cache::FetchError>> {
        use std::sync::atomic::Ordering;
        Box::pin(async move {
            self.fetches.fetch_add(1, Ordering::Relaxed);
            let (before, _) = meter.get();
            let result = self.inner.fetch(into, meter.clone()).await;
            self.bytes
                .fetch_add(meter.get().0 - before, Ordering::Relaxed);
            result
        })
    }
}

/// The artifact-ready step of a restore on a node, for the checkpoint in `artifact`: from the
/// volume, from the object store (SeaweedFS on loopback, started here, its data on this
/// machine's disk) through a cold cache and from a warm one, eight at once through a cold
/// cache; and zstd on its page images and on a mostly-zero artifact of the same size. Page
/// cache dropped before each cold read; each read timed `repeat` times, the fastest kept (the
/// machine may be shared); uploads once each, after one untimed upload (the server's first
/// writes allocate its volumes). The server holds about five times the artifact's size.
fn store_reads(artifact: &Path, dir: &Path, level: i32, repeat: u32) -> Result<StoreReads> {
    use warmstart_agent::cache::{Cache, Source, VolumeSource};
    use warmstart_agent::store_source::StoreSource;
    use warmstart_objstore::{Progress, Store};
    use warmstart_shared::artifact::{Verification, read_published};

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let manifest = read_published(artifact, Verification::Sizes).context("the artifact")?;
    let hash = manifest.identity_hash.clone();
    let digest = manifest.digest.clone();
    let artifact_bytes = manifest.total_size();
    let zero = mostly_zero_artifact(&dir.join("zero"), manifest_page_bytes(&manifest))?;
    // Each artifact uploaded plain and compressed, and the warm-up: the mostly-zero
    // artifact's compressed size is at most half its own.
    let server = warmstart_e2e::s3_server::S3Server::start_with_capacity(
        "bench",
        artifact_bytes * 5 + (1 << 30),
    )
    .context("start SeaweedFS (make s3-build)")?;
    let store_at = |prefix: &str, level: i32| {
        let mut config = server.store_config();
        config.prefix = prefix.into();
        // The agent's settings, not the tests' quick ones.
        config.part_size = 16 << 20;
        config.retries = 4;
        config.request_timeout = Duration::from_secs(300);
        config.compression_level = level;
        Store::new(config).context("object store client")
    };
    let plain = store_at("plain", 0)?;
    let zstd = store_at("zstd", level)?;
    let limit = u64::MAX / 2;
    let timed = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
        let started = Instant::now();
        f()?;
        Ok(started.elapsed().as_secs_f64())
    };
    let fastest = |f: &mut dyn FnMut() -> Result<f64>| -> Result<f64> {
        let mut best = f64::INFINITY;
        for _ in 0..repeat.max(1) {
            best = best.min(f()?);
        }
        Ok(best)
    };
    // One read of `hash` through a new, cold cache (page cache dropped): its time, and the
    // cache (removed) after it.
    let cold = |name: &str, hash: &str, digest: &str, source: &dyn Source| -> Result<f64> {
        let cache = Cache::open(&dir.join(name), limit).context("cache")?;
        drop_caches()?;
        let secs = timed(&mut || {
            let held = runtime
                .block_on(cache.get(NS, hash, digest, source))
                .with_context(|| format!("{name}: a read through a cold cache"))?;
            ensure!(held.fetched(), "{name}: a cold cache fetched nothing");
            Ok(())
        })?;
        std::fs::remove_dir_all(cache.dir()).context("remove the cache")?;
        Ok(secs)
    };
    let upload = |store: &Store, path: &Path, hash: &str| -> Result<(f64, u64)> {
        let mut stored = 0;
        let secs = timed(&mut || {
            let report = runtime
                .block_on(store.upload(path, NS, hash, &Progress::new()))
                .context("upload")?;
            ensure!(!report.already_present, "uploaded before");
            stored = report.stored_bytes;
            Ok(())
        })?;
        Ok((secs, stored))
    };

    // The server's first writes allocate its volumes: the mostly-zero artifact, compressed, is
    // sent first, untimed.
    let warmup = store_at("warmup", level)?;
    upload(&warmup, &zero, ZERO_HASH)?;

    let pvc_read = fastest(&mut || {
        drop_caches()?;
        timed(&mut || {
            read_published(artifact, Verification::Checksums).context("verify the artifact")?;
            Ok(())
        })
    })?;
    let volume = VolumeSource::new(artifact.to_path_buf());
    let pvc_to_cache = fastest(&mut || cold("cache-pvc", &hash, &digest, &volume))?;
    let (upload_plain, _) = upload(&plain, artifact, &hash)?;
    let source = StoreSource::new(plain.clone(), NS, &hash);
    let s3_cold = fastest(&mut || cold("cache-s3", &hash, &digest, &source))?;

    let cache = Cache::open(&dir.join("cache-warm"), limit).context("cache")?;
    runtime
        .block_on(cache.get(NS, &hash, &digest, &source))
        .context("fill the cache")?;
    let warm_hit = fastest(&mut || {
        timed(&mut || {
            let held = runtime
                .block_on(cache.get(NS, &hash, &digest, &source))
                .context("a cache hit")?;
            ensure!(!held.fetched(), "a warm cache fetched again");
            Ok(())
        })
    })?;
    std::fs::remove_dir_all(cache.dir()).context("remove the cache")?;

    let (mut eight_fetches, mut eight_bytes) = (0, 0);
    let eight_cold = fastest(&mut || {
        let cache = Cache::open(&dir.join("cache-8"), limit).context("cache")?;
        let counting = Counting::new(StoreSource::new(plain.clone(), NS, &hash));
        drop_caches()?;
        let secs = timed(&mut || {
            let held = runtime.block_on(futures::future::join_all(
                (0..8).map(|_| cache.get(NS, &hash, &digest, &counting)),
            ));
            let held = held
                .into_iter()
                .collect::<Result<Vec<_>, _>>()
                .context("eight reads at once")?;
            let fetched = held.iter().filter(|h| h.fetched()).count();
            ensure!(
                fetched == 1,
                "{fetched} of the eight reads fetched the artifact"
            );
            Ok(())
        })?;
        eight_fetches = counting.fetches.load(std::sync::atomic::Ordering::Relaxed);
        eight_bytes = counting.bytes.load(std::sync::atomic::Ordering::Relaxed);
        ensure!(
            eight_fetches == 1 && eight_bytes == artifact_bytes,
            "eight reads at once made {eight_fetches} download(s) of {eight_bytes} bytes; one of {artifact_bytes} expected"
        );
        std::fs::remove_dir_all(cache.dir()).context("remove the cache")?;
        Ok(secs)
    })?;

    let mut compression = Vec::new();
    for (image, path, hash, uploaded) in [
        ("sample worker", artifact, hash.as_str(), Some(upload_plain)),
        ("mostly zero", zero.as_path(), ZERO_HASH, None),
    ] {
        let digest = read_published(path, Verification::Sizes)
            .context("the artifact")?
            .digest;
        let (page_bytes, page_stored_bytes, compress_s, decompress_s) =
            chunk_costs(&page_images(&path.join("criu"))?, level)?;
        let upload_plain = match uploaded {
            Some(secs) => secs,
            None => upload(&plain, path, hash)?.0,
        };
        let (upload_zstd, stored_bytes) = upload(&zstd, path, hash)?;
        let plain_source = StoreSource::new(plain.clone(), NS, hash);
        let fetch_plain = fastest(&mut || cold("cache-plain", hash, &digest, &plain_source))?;
        let zstd_source = StoreSource::new(zstd.clone(), NS, hash);
        let fetch_zstd = fastest(&mut || cold("cache-zstd", hash, &digest, &zstd_source))?;
        let mib = |bytes: u64| bytes as f64 / MIB;
        compression.push(Compression {
            image,
            level,
            page_bytes,
            page_stored_bytes,
            compress_mib_s: mib(page_bytes) / compress_s,
            decompress_mib_s: mib(page_bytes) / decompress_s,
            upload_plain,
            upload_zstd,
            stored_bytes,
            fetch_plain,
            fetch_zstd,
        });
    }
    drop(server);
    Ok(StoreReads {
        artifact_bytes,
        pvc_read,
        pvc_to_cache,
        s3_cold,
        warm_hit,
        eight_cold,
        eight_fetches,
        eight_bytes,
        upload_plain,
        zstd: compression,
    })
}

/// Bytes of the page images a manifest lists.
fn manifest_page_bytes(manifest: &warmstart_shared::artifact::Manifest) -> u64 {
    manifest
        .files
        .iter()
        .filter(|f| f.path.starts_with("criu/pages-"))
        .map(|f| f.size)
        .sum()
}

/// Publishes (as the agent does) an artifact whose page image of `bytes` bytes is mostly zero
/// pages: memory a worker allocated and zeroed, one 4 KiB page in eight holding data.
fn mostly_zero_artifact(root: &Path, bytes: u64) -> Result<PathBuf> {
    use std::io::Write;
    use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo};
    let out = root.join(NS).join(ZERO_HASH);
    std::fs::create_dir_all(root.join(NS)).context("create the artifact's parent")?;
    let staging = warmstart_agent::publish::Staging::create(&out).context("staging")?;
    let criu = mkdir(staging.path().join("criu"))?;
    let mut file = std::io::BufWriter::new(
        std::fs::File::create(criu.join("pages-1.img")).context("page image")?,
    );
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    let mut page = vec![0u8; 4096];
    let zero = vec![0u8; 4096];
    for index in 0..bytes.div_ceil(4096) {
        let len = usize::try_from((bytes - index * 4096).min(4096)).unwrap_or(4096);
        if index % 8 == 0 {
            for word in page.chunks_mut(8) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                word.copy_from_slice(&state.to_le_bytes());
            }
            file.write_all(&page[..len])?;
        } else {
            file.write_all(&zero[..len])?;
        }
    }
    file.flush()?;
    drop(file);
    std::fs::write(criu.join("inventory.img"), [1u8; 64]).context("inventory")?;
    let manifest = Manifest {
        format_version: MANIFEST_FORMAT_VERSION,
        identity_hash: ZERO_HASH.into(),
        created_at: "2026-12-06T00:00:00Z".into(),
        source: SourceInfo::default(),
        criu: CriuInfo::default(),
        mounts: vec![],
        cuda: None,
        assigned_gpus: None,
        timings: Default::default(),
        chunk_bytes: 0,
        files: vec![],
        digest: String::new(),
    };
    staging
        .publish(manifest, &warmstart_agent::progress::Meter::default())
        .context("publish the mostly-zero artifact")?;
    Ok(out)
}

/// zstd at `level` on the page images, 8 MiB chunk by chunk on one core (the page cache
/// warm): bytes in, bytes out, seconds compressing, seconds decompressing.
fn chunk_costs(pages: &[(PathBuf, u64)], level: i32) -> Result<(u64, u64, f64, f64)> {
    use warmstart_objstore::frames::{compress, decompress};
    let mut chunk = vec![0u8; 8 << 20];
    let (mut raw, mut stored, mut compress_s, mut decompress_s) = (0, 0, 0.0, 0.0);
    for (path, _) in pages {
        let mut file =
            std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?;
        loop {
            let mut len = 0;
            while len < chunk.len() {
                match file.read(&mut chunk[len..])? {
                    0 => break,
                    n => len += n,
                }
            }
            if len == 0 {
                break;
            }
            let started = Instant::now();
            let frame = compress(&chunk[..len], level)?;
            compress_s += started.elapsed().as_secs_f64();
            let started = Instant::now();
            let back = decompress(&frame, len).map_err(anyhow::Error::msg)?;
            decompress_s += started.elapsed().as_secs_f64();
            ensure!(back == chunk[..len], "zstd did not give the chunk back");
            raw += len as u64;
            stored += frame.len() as u64;
        }
    }
    Ok((raw, stored, compress_s, decompress_s))
}
