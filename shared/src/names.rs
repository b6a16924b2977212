//! Every protocol name of the contract (labels, annotations, env vars, volumes, mount paths,
//! file names, the seccomp profile): workloads, manifests and stored artifacts depend on these
//! spellings, so no other file spells them out.

/// API group of the `Checkpoint` resource.
pub const API_GROUP: &str = "warmstart.dev";
/// API version of the `Checkpoint` resource.
pub const API_VERSION: &str = "v1alpha1";
/// Kind of the custom resource.
pub const CHECKPOINT_KIND: &str = "Checkpoint";

/// Finalizer the controller puts on every `Checkpoint` to honour `spec.deletionPolicy`.
pub const FINALIZER: &str = "warmstart.dev/artifact-cleanup";

/// Pod label: name of the `Checkpoint` a checkpoint Job pod works for.
pub const LABEL_CHECKPOINT_NAME: &str = "warmstart.dev/checkpoint-name";
/// Pod label: identity hash of that `Checkpoint`.
pub const LABEL_CHECKPOINT_HASH: &str = "warmstart.dev/checkpoint-hash";
/// Pod label marking a checkpoint source pod (`"true"`).
pub const LABEL_CHECKPOINT_SOURCE: &str = "warmstart.dev/checkpoint-source";
/// Value of [`LABEL_CHECKPOINT_SOURCE`].
pub const LABEL_CHECKPOINT_SOURCE_VALUE: &str = "true";

/// Pod annotation: name of the `Checkpoint` (same namespace) to restore from.
pub const ANNOTATION_RESTORE_FROM: &str = "warmstart.dev/restore-from";
/// Pod annotation: comma-separated names of the containers to restore.
pub const ANNOTATION_TARGET_CONTAINERS: &str = "warmstart.dev/target-containers";
/// Pod annotation stamped by the webhook: the [`crate::binding::Binding`] of the checkpoint.
pub const ANNOTATION_CHECKPOINT_BINDING: &str = "warmstart.dev/checkpoint-binding";
/// Prefix of the per-container restore status annotation (`<prefix><container>`); its values
/// are [`crate::control::RestoreStatus`]'s.
pub const ANNOTATION_RESTORE_STATUS_PREFIX: &str = "warmstart.dev/restore-status.";
/// Checkpoint pod annotation stamped when its Job is built: the target container, resolved
/// once from `spec.job.targetContainerName` then, so an edit of the Checkpoint while the Job
/// runs changes nothing of what is captured.
pub const ANNOTATION_CHECKPOINT_TARGET: &str = "warmstart.dev/checkpoint-target";

/// Name of the emptyDir volume that is a pod's own signal directory. The agent reaches it on
/// the node through the kubelet's pod directory ([`empty_dir_on_host`]).
pub const VOLUME_SIGNAL: &str = "warmstart-signal";
/// Where the signal directory is mounted in a checkpoint source (and restore target) container.
pub const MOUNT_SIGNAL: &str = "/checkpoint-signal";

/// Name of the emptyDir control volume.
pub const VOLUME_CONTROL: &str = "warmstart-control";
/// Where the control volume is mounted in a restore target container.
pub const MOUNT_CONTROL: &str = "/warmstart-control";

/// Name of the Downward API pod-info volume.
pub const VOLUME_POD_INFO: &str = "warmstart-podinfo";
/// Where the pod-info volume is mounted.
pub const MOUNT_POD_INFO: &str = "/etc/podinfo";

/// Pod-info file with the pod's labels (Downward API `metadata.labels`).
pub const PODINFO_FILE_LABELS: &str = "labels";
/// Pod-info file with the pod's annotations (Downward API `metadata.annotations`).
pub const PODINFO_FILE_ANNOTATIONS: &str = "annotations";
/// Pod-info file with the pod's name (Downward API `metadata.name`).
pub const PODINFO_FILE_NAME: &str = "name";
/// Pod-info file with the pod's namespace (Downward API `metadata.namespace`).
pub const PODINFO_FILE_NAMESPACE: &str = "namespace";
/// Pod-info file with the pod's UID (Downward API `metadata.uid`).
pub const PODINFO_FILE_UID: &str = "uid";

/// File the workload writes into its signal directory once it is initialised.
pub const FILE_READY: &str = "ready";
/// Suffix of the signal file the agent writes when a checkpoint finished (`<hash>.done`).
pub const FILE_DONE_SUFFIX: &str = ".done";
/// File the agent writes into the control directory once a restore finished.
pub const FILE_RESTORE_COMPLETE: &str = "restore-complete";
/// File the agent writes into a target's control directory when nothing was restored into it
/// (JSON [`crate::signal::RestoreFailed`]): a standby entrypoint then cold-starts.
pub const FILE_RESTORE_FAILED: &str = "restore-failed";
/// File created exclusively (`O_EXCL`) in a target's control directory by whoever acts on the
/// placeholder first: the agent before a restore, the standby entrypoint before a cold start.
/// Exactly one of them wins. JSON [`crate::control::RestoreClaim`].
pub const FILE_RESTORE_CLAIM: &str = "restore-claim";
/// Node label the agent sets (value `true`) while it is ready to act on the node's pods;
/// checkpoint Jobs and restore pods require it through node affinity.
pub const LABEL_AGENT_READY: &str = "warmstart.dev/agent-ready";
/// Value of [`LABEL_AGENT_READY`].
pub const LABEL_AGENT_READY_VALUE: &str = "true";
/// The kubelet's directory of a pod's emptyDir volumes, relative to the kubelet root:
/// `pods/<uid>/volumes/kubernetes.io~empty-dir/<volume>`.
pub const KUBELET_EMPTY_DIR_PLUGIN: &str = "kubernetes.io~empty-dir";
/// Artifact manifest file name.
pub const FILE_MANIFEST: &str = "manifest.json";
/// Artifact completion marker, written last.
pub const FILE_COMPLETE: &str = "COMPLETE";
/// Directory of CRIU images inside an artifact.
pub const ARTIFACT_CRIU_DIR: &str = "criu";
/// The root filesystem diff (an OCI layer tar) inside an artifact.
pub const ARTIFACT_ROOTFS_DIFF: &str = "rootfs-diff.tar";
/// CRIU's dump log, inside [`ARTIFACT_CRIU_DIR`] (kept with the artifact).
pub const ARTIFACT_DUMP_LOG: &str = "dump.log";
/// CRIU's restore log, in the restore's log directory (artifacts are never written to).
pub const RESTORE_LOG: &str = "restore.log";
/// Prefix of a staging directory inside `<base>/<namespace>/<hash>/`'s parent.
pub const STAGING_PREFIX: &str = ".staging-";

/// Env: path of the `.done` signal file.
pub const ENV_SIGNAL_FILE: &str = "WARMSTART_SIGNAL_FILE";
/// Env: path of the ready file.
pub const ENV_READY_FILE: &str = "WARMSTART_READY_FILE";
/// Env: the checkpoint identity hash.
pub const ENV_CHECKPOINT_HASH: &str = "WARMSTART_CHECKPOINT_HASH";
/// Env: where the artifact is stored.
pub const ENV_CHECKPOINT_LOCATION: &str = "WARMSTART_CHECKPOINT_LOCATION";
/// Env: the storage type (`pvc`).
pub const ENV_STORAGE_TYPE: &str = "WARMSTART_STORAGE_TYPE";
/// Env: the pod UID (Downward API), so a workload can name itself in logs and files.
pub const ENV_POD_UID: &str = "WARMSTART_POD_UID";
/// Env: the control directory of a restore target container.
pub const ENV_CONTROL_DIR: &str = "WARMSTART_CONTROL_DIR";

/// Env: `1` tells the target of a restore pod to wait to be restored instead of starting its
/// server (the standby convention); `warmstart-entrypoint` implements it for any server.
pub const ENV_RESTORE_STANDBY: &str = "WARMSTART_RESTORE_STANDBY";
/// Snapshot-compatible alias of [`ENV_RESTORE_STANDBY`].
pub const ENV_SNAPSHOT_RESTORE_STANDBY: &str = "SNAPSHOT_RESTORE_STANDBY";
/// Env: how long a standby entrypoint waits for a restore before it cold-starts (seconds, or
/// a number with `s`, `m` or `h`).
pub const ENV_RESTORE_TIMEOUT: &str = "WARMSTART_RESTORE_TIMEOUT";
/// Env: the container's own readiness probe (JSON of a Kubernetes `Probe`), which
/// `warmstart-entrypoint` runs to decide when the server is ready to be checkpointed.
pub const ENV_READY_PROBE: &str = "WARMSTART_READY_PROBE";
/// Env: seconds `warmstart-entrypoint` gives its child between SIGTERM and SIGKILL when it
/// stops it after a checkpoint (the pod's `terminationGracePeriodSeconds`).
pub const ENV_STOP_GRACE_PERIOD: &str = "WARMSTART_STOP_GRACE_PERIOD";

/// Dynamo-compatible alias of [`ENV_SIGNAL_FILE`].
pub const ENV_DYN_SIGNAL_FILE: &str = "DYN_CHECKPOINT_SIGNAL_FILE";
/// Dynamo-compatible alias of [`ENV_READY_FILE`].
pub const ENV_DYN_READY_FILE: &str = "DYN_CHECKPOINT_READY_FILE";
/// Dynamo-compatible alias of [`ENV_CHECKPOINT_HASH`].
pub const ENV_DYN_CHECKPOINT_HASH: &str = "DYN_CHECKPOINT_HASH";
/// Dynamo-compatible alias of [`ENV_CHECKPOINT_LOCATION`].
pub const ENV_DYN_CHECKPOINT_LOCATION: &str = "DYN_CHECKPOINT_LOCATION";
/// Dynamo-compatible alias of [`ENV_STORAGE_TYPE`].
pub const ENV_DYN_STORAGE_TYPE: &str = "DYN_CHECKPOINT_STORAGE_TYPE";
/// Snapshot-compatible alias of [`ENV_CONTROL_DIR`].
pub const ENV_SNAPSHOT_CONTROL_DIR: &str = "SNAPSHOT_CONTROL_DIR";

/// File name of the workload-side entrypoint binary.
pub const ENTRYPOINT_BINARY: &str = "warmstart-entrypoint";
/// Where the entrypoint binary is in the agent image (what the install init container runs).
pub const ENTRYPOINT_IN_IMAGE: &str = "/usr/local/bin/warmstart-entrypoint";
/// Name of the emptyDir volume the entrypoint binary is copied into (`spec.job.entrypoint:
/// Wrap`).
pub const VOLUME_ENTRYPOINT: &str = "warmstart-entrypoint";
/// Where that volume is mounted: read-write in the install init container, read-only in the
/// target.
pub const MOUNT_ENTRYPOINT: &str = "/warmstart/bin";
/// Name of the init container that copies the entrypoint binary into [`VOLUME_ENTRYPOINT`].
pub const INIT_CONTAINER_ENTRYPOINT: &str = "warmstart-entrypoint-install";

/// Storage type of artifacts on a ReadWriteMany PVC.
pub const STORAGE_TYPE_PVC: &str = "pvc";
/// Storage type of artifacts in an S3-compatible bucket (restores read them through the
/// nodes' caches).
pub const STORAGE_TYPE_S3: &str = "s3";

/// Localhost seccomp profile that blocks io_uring (CRIU cannot checkpoint it).
pub const SECCOMP_PROFILE: &str = "profiles/warmstart-block-iouring.json";

/// Prefix of the checkpoint Job name (`checkpoint-<checkpoint name>`).
pub const JOB_NAME_PREFIX: &str = "checkpoint-";
/// Default target container name.
pub const DEFAULT_TARGET_CONTAINER: &str = "main";

/// Default artifact root on the node and in the controller.
pub const DEFAULT_ARTIFACT_ROOT: &str = "/var/lib/warmstart/checkpoints";

/// Where the kubelet keeps emptyDir `volume` of pod `uid` on the node:
/// `<kubelet_root>/pods/<uid>/volumes/kubernetes.io~empty-dir/<volume>`. The agent mounts the
/// kubelet root with `HostToContainer` propagation at the same path, so this path is valid
/// inside the agent too.
pub fn empty_dir_on_host(
    kubelet_root: &std::path::Path,
    pod_uid: &str,
    volume: &str,
) -> std::path::PathBuf {
    kubelet_root
        .join("pods")
        .join(pod_uid)
        .join("volumes")
        .join(KUBELET_EMPTY_DIR_PLUGIN)
        .join(volume)
}

/// The signal file name for a hash: `<hash>.done`.
pub fn done_file_name(hash: &str) -> String {
    format!("{hash}{FILE_DONE_SUFFIX}")
}

/// The in-container path of the ready file.
pub fn ready_file_path() -> String {
    format!("{MOUNT_SIGNAL}/{FILE_READY}")
}

/// The in-container path of the `.done` signal file for a hash.
pub fn signal_file_path(hash: &str) -> String {
    format!("{MOUNT_SIGNAL}/{}", done_file_name(hash))
}

/// The in-container path of the restore-complete file.
pub fn restore_complete_path() -> String {
    format!("{MOUNT_CONTROL}/{FILE_RESTORE_COMPLETE}")
}

/// The in-container path of the entrypoint binary in a wrapped target.
pub fn entrypoint_path() -> String {
    format!("{MOUNT_ENTRYPOINT}/{ENTRYPOINT_BINARY}")
}

/// Name of the restore status annotation for a container.
pub fn restore_status_annotation(container: &str) -> String {
    format!("{ANNOTATION_RESTORE_STATUS_PREFIX}{container}")
}

/// Name of the checkpoint Job of a `Checkpoint`.
pub fn job_name(checkpoint: &str) -> String {
    format!("{JOB_NAME_PREFIX}{checkpoint}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_paths_follow_the_contract() {
        assert_eq!(done_file_name("abc"), "abc.done");
        assert_eq!(signal_file_path("abc"), "/checkpoint-signal/abc.done");
        assert_eq!(ready_file_path(), "/checkpoint-signal/ready");
        assert_eq!(
            restore_complete_path(),
            "/warmstart-control/restore-complete"
        );
        assert_eq!(job_name("llama"), "checkpoint-llama");
        assert_eq!(entrypoint_path(), "/warmstart/bin/warmstart-entrypoint");
        assert_eq!(
            empty_dir_on_host(
                std::path::Path::new("/var/lib/kubelet"),
                "0b9e-uid",
                VOLUME_SIGNAL
            ),
            std::path::Path::new(
                "/var/lib/kubelet/pods/0b9e-uid/volumes/kubernetes.io~empty-dir/warmstart-signal"
            )
        );
        assert_eq!(
            restore_status_annotation("main"),
            "warmstart.dev/restore-status.main"
        );
    }
}
