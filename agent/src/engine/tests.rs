//! The order of the engine's steps, without root: the CRIU and CUDA seams are recording
//! doubles, the "container" is a `sleep` child of the test resolved as a bare PID.

use std::path::Path;
use std::process::{Child, Command};
use std::sync::Arc;

use warmstart_shared::artifact::SourceInfo;
use warmstart_shared::names::{FILE_COMPLETE, FILE_MANIFEST};

use super::recording::{DumpBehaviour, Journal, RecordingCriu};
use crate::checkpoint::{CheckpointError, CheckpointRequest, checkpoint};
use crate::runtime::{ContainerInfo, pid};
use crate::seams::cuda::CudaSlot;
use crate::seams::cuda::recording::RecordingCuda;

struct Sleeper(Child);

impl Sleeper {
    fn start() -> Self {
        Self(Command::new("sleep").arg("1000").spawn().unwrap())
    }

    /// A sleeper whose environment holds `NVIDIA_VISIBLE_DEVICES=<value>`.
    fn with_visible_devices(value: &str) -> Self {
        Self(
            Command::new("sleep")
                .arg("1000")
                .env("NVIDIA_VISIBLE_DEVICES", value)
                .spawn()
                .unwrap(),
        )
    }

    fn pid(&self) -> i32 {
        i32::try_from(self.0.id()).unwrap()
    }

    fn container(&self) -> ContainerInfo {
        ContainerInfo {
            // No overlay of its own: nothing to capture.
            upper_dir: None,
            ..pid::resolve(self.pid()).unwrap()
        }
    }
}

impl Drop for Sleeper {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn request(container: ContainerInfo, output: &Path, stop: bool) -> CheckpointRequest {
    CheckpointRequest {
        container,
        output: output.to_path_buf(),
        identity_hash: "00000000000000aa".to_owned(),
        source: SourceInfo::default(),
        leave_running: !stop,
        tcp_established: false,
    }
}

/// A recording CRIU whose post-dump hook answer is journalled with what the staging directory
/// holds at that moment (sealed manifest, no completion marker) and whether the final
/// directory exists yet.
fn criu_watching(journal: &Arc<Journal>, output: &Path) -> RecordingCriu {
    RecordingCriu {
        watch: Some(output.to_path_buf()),
        ..RecordingCriu::new(journal.clone())
    }
}

#[test]
fn with_stop_the_tree_is_held_until_the_artifact_is_sealed_then_killed_then_published() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let criu = criu_watching(&journal, &output);
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    let report = checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(sleeper.container(), &output, true),
        &crate::progress::Reporter::default(),
    )
    .unwrap();
    assert_eq!(
        journal.entries(),
        [
            format!("cuda lock {p}"),
            format!("cuda checkpoint {p}"),
            "criu dump".to_owned(),
            "criu post-dump".to_owned(),
            "post-dump answered true: staging sealed, not published".to_owned(),
            "criu kill".to_owned(),
        ]
    );
    assert!(report.stopped);
    assert!(output.join(FILE_COMPLETE).is_file());
    assert!(output.join(FILE_MANIFEST).is_file());
    let dump = &criu.dumps.lock().unwrap()[0];
    assert!(!dump.leave_running, "CRIU kills the tree, after the hook");
}

#[test]
fn with_stop_a_failed_publication_resumes_the_tree_and_its_gpu_state() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let criu = criu_watching(&journal, &output);
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    // An upper directory that does not exist: capturing the file changes fails in the hook.
    let container = ContainerInfo {
        upper_dir: Some(tmp.path().join("no-such-upper")),
        ..sleeper.container()
    };
    let err = checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(container, &output, true),
        &crate::progress::Reporter::default(),
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Rootfs { .. }), "{err}");
    assert_eq!(
        journal.entries(),
        [
            format!("cuda lock {p}"),
            format!("cuda checkpoint {p}"),
            "criu dump".to_owned(),
            "criu post-dump".to_owned(),
            "post-dump answered false: staging not sealed, not published".to_owned(),
            "criu resume".to_owned(),
            format!("cuda restore {p}"),
            format!("cuda unlock {p}"),
        ]
    );
    assert!(!output.exists(), "nothing published");
    let left: Vec<_> = std::fs::read_dir(tmp.path()).unwrap().flatten().collect();
    assert!(left.is_empty(), "the staging directory is gone: {left:?}");
    assert!(Path::new(&format!("/proc/{p}")).exists(), "the tree lives");
}

#[test]
fn without_stop_the_tree_and_its_gpu_state_resume_right_after_the_dump() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let criu = criu_watching(&journal, &output);
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(sleeper.container(), &output, false),
        &crate::progress::Reporter::default(),
    )
    .unwrap();
    assert_eq!(
        journal.entries(),
        [
            format!("cuda lock {p}"),
            format!("cuda checkpoint {p}"),
            "criu dump".to_owned(),
            "criu resume".to_owned(),
            format!("cuda restore {p}"),
            format!("cuda unlock {p}"),
        ]
    );
    assert!(output.join(FILE_COMPLETE).is_file());
    assert!(Path::new(&format!("/proc/{p}")).exists(), "the tree lives");
}

#[test]
fn a_failed_dump_publishes_nothing_and_gives_the_gpu_state_back() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let criu = RecordingCriu {
        dump: DumpBehaviour::Fail,
        ..RecordingCriu::new(journal.clone())
    };
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    let err = checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(sleeper.container(), &output, true),
        &crate::progress::Reporter::default(),
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Dump { .. }), "{err}");
    assert_eq!(
        journal.entries(),
        [
            format!("cuda lock {p}"),
            format!("cuda checkpoint {p}"),
            "criu dump".to_owned(),
            "criu resume".to_owned(),
            format!("cuda restore {p}"),
            format!("cuda unlock {p}"),
        ]
    );
    assert!(!output.exists());
}

// The staging directory that held CRIU's log is removed with the failed checkpoint: the
// error names a copy that outlives it.
#[test]
fn a_failed_dump_names_a_log_that_still_exists() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::start();
    for stop in [true, false] {
        let criu = RecordingCriu {
            dump: DumpBehaviour::Fail,
            ..RecordingCriu::new(Arc::new(Journal::default()))
        };
        let err = checkpoint(
            &criu,
            &CudaSlot::none(),
            &request(sleeper.container(), &output, stop),
            &crate::progress::Reporter::default(),
        )
        .unwrap_err();
        let CheckpointError::Dump { source, .. } = &err else {
            panic!("not a dump failure: {err}");
        };
        let log = source.log().unwrap().to_path_buf();
        assert!(
            crate::report::error_chain(&err).contains(&log.display().to_string()),
            "{err}"
        );
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "Error (criu/seize.c:1): Can't seize 7\n",
            "the log the error names ({}) still exists",
            log.display()
        );
        std::fs::remove_dir_all(log.parent().unwrap()).unwrap();
    }
}

/// `pid`'s container as a pod's, with the kubelet's allocation (`gpus`: `nvidia.com/gpu`
/// device IDs; none allocated when empty).
fn in_pod(container: ContainerInfo, gpus: &[&str]) -> ContainerInfo {
    use crate::podresources::{AllocatedDevices, PodContainer};
    use crate::runtime::gpus::{Allocation, RuntimeGpus};
    let allocation = if gpus.is_empty() {
        Vec::new()
    } else {
        vec![AllocatedDevices {
            resource: "nvidia.com/gpu".to_owned(),
            ids: gpus.iter().map(|g| (*g).to_owned()).collect(),
            ..AllocatedDevices::default()
        }]
    };
    ContainerInfo {
        gpus: RuntimeGpus {
            pod: Some(PodContainer {
                namespace: "ml".to_owned(),
                pod: "llama-0".to_owned(),
                container: "worker".to_owned(),
            }),
            allocation: Allocation::Devices(allocation),
            cdi_devices: Vec::new(),
        },
        ..container
    }
}

#[test]
fn a_container_whose_gpus_cannot_be_told_is_refused_before_anything_is_held_or_dumped() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::with_visible_devices("void");
    let journal = Arc::new(Journal::default());
    let criu = criu_watching(&journal, &output);
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    let err = checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(in_pod(sleeper.container(), &[]), &output, false),
        &crate::progress::Reporter::default(),
    )
    .unwrap_err();
    assert!(matches!(err, CheckpointError::Gpus { .. }), "{err}");
    let text = crate::report::error_chain(&err);
    assert!(
        text.contains("NVIDIA_VISIBLE_DEVICES=\"void\"")
            && text.contains("no GPU allocated to ml/llama-0 container worker"),
        "{text}"
    );
    assert!(journal.entries().is_empty(), "{:?}", journal.entries());
    assert!(!output.exists());
}

#[test]
fn the_manifest_records_the_gpus_the_kubelet_allocated_in_cdi_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("art");
    let sleeper = Sleeper::with_visible_devices("void");
    let journal = Arc::new(Journal::default());
    let criu = criu_watching(&journal, &output);
    let p = u32::try_from(sleeper.pid()).unwrap();
    let cuda = RecordingCuda::new(journal.clone(), &[p]);
    let gpu = "GPU-00000000-0000-0000-0000-000000000001";
    let report = checkpoint(
        &criu,
        &CudaSlot::with(Arc::new(cuda)),
        &request(in_pod(sleeper.container(), &[gpu]), &output, false),
        &crate::progress::Reporter::default(),
    )
    .unwrap();
    let assigned = report.manifest.assigned_gpus.unwrap();
    assert_eq!(
        assigned.source,
        warmstart_shared::artifact::GpuSource::PodResources
    );
    assert_eq!(assigned.uuids, [gpu]);
    let section = report.manifest.cuda.unwrap();
    assert_eq!(section.processes[0].gpus, [gpu]);
}

/// The restore restores exactly the artifact it was validated against: another valid, sealed
/// artifact put at its path since is refused, naming the artifact and both manifest digests,
/// before the placeholder is claimed or CRIU runs.
#[test]
fn a_restore_refuses_an_artifact_other_than_the_one_it_was_validated_against() {
    let tmp = tempfile::tempdir().unwrap();
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let criu = Arc::new(RecordingCriu::new(journal));
    let capture = |dir: &Path, hash: &str| {
        let mut request = request(sleeper.container(), dir, false);
        hash.clone_into(&mut request.identity_hash);
        checkpoint(
            criu.as_ref(),
            &CudaSlot::none(),
            &request,
            &crate::progress::Reporter::default(),
        )
        .unwrap()
        .manifest
    };
    let validated = capture(&tmp.path().join("validated"), "00000000000000aa");
    let artifact = tmp.path().join("replacement");
    let replacement = capture(&artifact, "00000000000000bb");
    assert_ne!(validated.digest, replacement.digest);
    let engine = super::Engine::new(
        criu.clone(),
        CudaSlot::none(),
        super::Runtimes {
            runc: crate::runtime::runc::RuncResolver::new("runc", "/nonexistent"),
            cri_socket: "/nonexistent/cri.sock".into(),
            cri: crate::runtime::cri::CriOptions::default(),
        },
    );
    let log_dir = tmp.path().join("logs");
    let restore = |expected: &str| {
        let request = crate::restore::RestoreRequest {
            artifact: artifact.clone(),
            placeholder: sleeper.container(),
            log_dir: log_dir.clone(),
            manifest_digest: Some(expected.to_owned()),
            control: crate::restore::ControlDir::OfPlaceholder,
        };
        engine.restore_blocking(
            &request,
            &mut crate::timings::Timings::default(),
            &crate::progress::Reporter::default(),
        )
    };
    let err = restore(&validated.digest).unwrap_err();
    let text = crate::report::error_chain(&err);
    assert!(
        matches!(
            err,
            crate::restore::RestoreError::Replaced { ref expected, ref found, .. }
                if *expected == validated.digest && *found == replacement.digest
        ),
        "{text}"
    );
    assert!(
        text.contains(&artifact.display().to_string()) && text.contains("replaced"),
        "{text}"
    );
    assert!(criu.restores.lock().unwrap().is_empty(), "CRIU ran");
    assert!(!log_dir.exists(), "the restore went past its checks");
    // The artifact it was validated against restores.
    restore(&replacement.digest).unwrap();
    assert_eq!(criu.restores.lock().unwrap().len(), 1);
}

#[test]
fn a_node_whose_criu_is_older_than_the_dumps_refuses_before_the_claim_and_says_why() {
    let tmp = tempfile::tempdir().unwrap();
    let sleeper = Sleeper::start();
    let journal = Arc::new(Journal::default());
    let dumped_by = Arc::new(RecordingCriu::new(journal.clone()));
    let artifact = tmp.path().join("artifact");
    let mut request = request(sleeper.container(), &artifact, false);
    "00000000000000cc".clone_into(&mut request.identity_hash);
    checkpoint(
        dumped_by.as_ref(),
        &CudaSlot::none(),
        &request,
        &crate::progress::Reporter::default(),
    )
    .unwrap();
    // The node the restore runs on has an older CRIU.
    let mut older = RecordingCriu::new(journal);
    older.version.minor = 1;
    let older = Arc::new(older);
    let engine = super::Engine::new(
        older.clone(),
        CudaSlot::none(),
        super::Runtimes {
            runc: crate::runtime::runc::RuncResolver::new("runc", "/nonexistent"),
            cri_socket: "/nonexistent/cri.sock".into(),
            cri: crate::runtime::cri::CriOptions::default(),
        },
    )
    .knowing_criu(Some(older.version.clone()));
    let control = tmp.path().join("control");
    std::fs::create_dir(&control).unwrap();
    let log_dir = tmp.path().join("logs");
    let restore = crate::restore::RestoreRequest {
        artifact: artifact.clone(),
        placeholder: sleeper.container(),
        log_dir: log_dir.clone(),
        manifest_digest: None,
        control: crate::restore::ControlDir::Pod(control.clone()),
    };
    let err = engine
        .restore_blocking(
            &restore,
            &mut crate::timings::Timings::default(),
            &crate::progress::Reporter::default(),
        )
        .unwrap_err();
    let text = crate::report::error_chain(&err);
    assert!(
        matches!(err, crate::restore::RestoreError::OtherNode { .. }),
        "{text}"
    );
    assert!(
        text.contains("dumped by CRIU 4.2.1; this node's CRIU 4.1.1 is older"),
        "{text}"
    );
    assert!(older.restores.lock().unwrap().is_empty(), "CRIU ran");
    assert!(!log_dir.exists(), "the restore went past its checks");
    // The standby entrypoint is told, and cold starts.
    let failed =
        std::fs::read_to_string(control.join(warmstart_shared::names::FILE_RESTORE_FAILED))
            .unwrap();
    assert!(failed.contains("is older"), "{failed}");
}
