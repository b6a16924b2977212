//! `warmstart.dev/v1alpha1`: the `Checkpoint` custom resource (spec, status, defaults, the CEL
//! rule that freezes `spec.identity`, printer columns). README "The API" describes it.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodTemplateSpec;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// Desired state of a `Checkpoint`: what to capture and how.
#[derive(CustomResource, Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[kube(
    group = "warmstart.dev",
    version = "v1alpha1",
    kind = "Checkpoint",
    namespaced,
    shortname = "ckpt",
    status = "CheckpointStatus",
    doc = "A Checkpoint captures a fully initialised inference worker (its process tree with CRIU, its GPU memory with the CUDA checkpoint API) once, in a Job built from spec.job, and stores it by identity hash; pods annotated warmstart.dev/restore-from: <name> are then restored from it in seconds instead of loading the model again. Ready when the artifact is verified (condition Ready).",
    printcolumn = r#"{"name":"Model","type":"string","jsonPath":".spec.identity.model"}"#,
    printcolumn = r#"{"name":"Backend","type":"string","jsonPath":".spec.identity.backendFramework"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase"}"#,
    printcolumn = r#"{"name":"Hash","type":"string","jsonPath":".status.identityHash"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Size","type":"string","description":"Artifact size","jsonPath":".status.artifact.size"}"#,
    printcolumn = r#"{"name":"Bytes","type":"integer","format":"int64","priority":1,"description":"Artifact size in bytes","jsonPath":".status.artifact.sizeBytes"}"#,
    printcolumn = r#"{"name":"Progress","type":"string","description":"How far a running capture is","jsonPath":".status.progress.message"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    printcolumn = r#"{"name":"Message","type":"string","priority":1,"jsonPath":".status.message"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointSpec {
    /// What makes two checkpoints equivalent; immutable after creation.
    #[schemars(extend("x-kubernetes-validations" = [
        {"rule": "self == oldSelf", "message": "spec.identity is immutable"}
    ]))]
    pub identity: CheckpointIdentity,
    /// How to produce the checkpoint.
    pub job: CheckpointJobSpec,
    /// What happens to the artifact when the object is deleted.
    #[serde(default)]
    pub deletion_policy: DeletionPolicy,
    /// Nodes to warm: once the Checkpoint is Ready, the agents of the nodes it selects fetch
    /// the artifact into their node cache (and report it in `status.prestage`), so the first
    /// restore there reads local disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prestage: Option<Prestage>,
}

/// Which nodes warm a Checkpoint's artifact ahead of restores.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Prestage {
    /// Labels a node must all carry (as a pod's `nodeSelector`); empty selects every node
    /// with a warmstart agent and a node cache.
    #[serde(default)]
    pub node_selector: BTreeMap<String, String>,
}

impl Prestage {
    /// Whether a node with `labels` is selected.
    pub fn selects(&self, labels: &BTreeMap<String, String>) -> bool {
        self.node_selector
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
    }
}

/// The identity of a checkpoint; its hash addresses the artifact (Dynamo-compatible).
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CheckpointIdentity {
    /// Model name, e.g. `meta-llama/Llama-2-7b-hf`.
    pub model: String,
    /// Inference backend, e.g. `vllm`, `sglang`, `trtllm`.
    pub backend_framework: String,
    /// Dynamo version the worker runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dynamo_version: Option<String>,
    /// Tensor parallel size (0 hashes like 1).
    #[serde(default = "default_parallel_size")]
    #[schemars(range(min = 0))]
    pub tensor_parallel_size: i64,
    /// Pipeline parallel size (0 hashes like 1).
    #[serde(default = "default_parallel_size")]
    #[schemars(range(min = 0))]
    pub pipeline_parallel_size: i64,
    /// Data type of the weights, e.g. `float16`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
    /// Maximum model length.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_model_len: Option<i64>,
    /// Any other parameter that changes the captured state.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extra_parameters: Option<BTreeMap<String, String>>,
}

fn default_parallel_size() -> i64 {
    1
}

/// How the checkpoint Job is produced.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointJobSpec {
    /// The pod that loads the model; its target container is checkpointed once ready.
    #[schemars(schema_with = "pod_template_schema")]
    pub pod_template_spec: PodTemplateSpec,
    /// Container to checkpoint: defaults to `main`, or the only container.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub target_container_name: Option<String>,
    /// Job `activeDeadlineSeconds`.
    #[serde(default = "default_active_deadline_seconds")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: i64,
    /// Job `backoffLimit`.
    #[serde(default = "default_backoff_limit")]
    #[schemars(range(min = 0))]
    pub backoff_limit: i32,
    /// Job `ttlSecondsAfterFinished`.
    #[serde(default = "default_ttl_seconds_after_finished")]
    #[schemars(range(min = 0))]
    pub ttl_seconds_after_finished: i32,
    /// How the target plays the workload's side of the protocol: `Native` (the server does
    /// it itself) or `Wrap` (`warmstart-entrypoint` runs the unchanged server; its container
    /// must spell out `command` and have a readiness probe).
    #[serde(default)]
    pub entrypoint: EntrypointMode,
}

/// Who plays the workload's side of the checkpoint protocol in the target container.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum EntrypointMode {
    /// The server writes `ready`, waits for `<hash>.done` and honours the standby convention.
    #[default]
    Native,
    /// `warmstart-entrypoint` is put in front of the container's command: it decides readiness
    /// with the container's own readiness probe, and in restore pods waits in standby and falls
    /// back to a cold start.
    Wrap,
}

impl EntrypointMode {
    /// The mode as spelt in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "Native",
            Self::Wrap => "Wrap",
        }
    }
}

/// Default Job deadline in seconds.
pub const DEFAULT_ACTIVE_DEADLINE_SECONDS: i64 = 3600;
/// Default Job backoff limit.
pub const DEFAULT_BACKOFF_LIMIT: i32 = 3;
/// Default Job TTL after it finished, in seconds.
pub const DEFAULT_TTL_SECONDS_AFTER_FINISHED: i32 = 300;

fn default_active_deadline_seconds() -> i64 {
    DEFAULT_ACTIVE_DEADLINE_SECONDS
}
fn default_backoff_limit() -> i32 {
    DEFAULT_BACKOFF_LIMIT
}
fn default_ttl_seconds_after_finished() -> i32 {
    DEFAULT_TTL_SECONDS_AFTER_FINISHED
}

/// The pod template is validated by the webhook and the Job builder, not by a 400 KiB
/// structural copy of the Pod schema in the CRD; the API server keeps it as given.
fn pod_template_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
        "description": "Pod template of the checkpoint Job (core/v1 PodTemplateSpec)."
    })
}

/// What happens to the artifact when the `Checkpoint` is deleted.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, JsonSchema)]
pub enum DeletionPolicy {
    /// The artifact is removed with the object.
    #[default]
    Delete,
    /// The artifact stays on storage.
    Retain,
}

/// Lifecycle phase of a `Checkpoint`.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash, JsonSchema)]
pub enum CheckpointPhase {
    /// Hash computed, Job not yet created.
    Pending,
    /// The checkpoint Job runs.
    Creating,
    /// The artifact is verified on storage.
    Ready,
    /// The checkpoint cannot be produced; `status.message` says why.
    Failed,
}

impl CheckpointPhase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Self; 4] = [Self::Pending, Self::Creating, Self::Ready, Self::Failed];

    /// The phase as spelt in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "Pending",
            Self::Creating => "Creating",
            Self::Ready => "Ready",
            Self::Failed => "Failed",
        }
    }
}

impl std::fmt::Display for CheckpointPhase {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Condition type: the artifact is verified and restore pods may use it (phase `Ready`); what
/// `kubectl wait --for=condition=Ready` and GitOps health checks look at.
pub const CONDITION_READY: &str = "Ready";
/// Condition type: the checkpoint Job was created.
pub const CONDITION_JOB_CREATED: &str = "JobCreated";
/// Condition type: the checkpoint Job completed.
pub const CONDITION_JOB_COMPLETED: &str = "JobCompleted";
/// Condition type: the artifact was verified on storage.
pub const CONDITION_ARTIFACT_VERIFIED: &str = "ArtifactVerified";

/// Observed state of a `Checkpoint`.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The identity hash, computed once.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity_hash: Option<String>,
    /// Lifecycle phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<CheckpointPhase>,
    /// Name of the checkpoint Job.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub job_name: Option<String>,
    /// Where the artifact lives (`<namespace>/<hash>` under the artifact root).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub location: Option<String>,
    /// Storage type (`pvc`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub storage_type: Option<String>,
    /// When the artifact was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub created_at: Option<Time>,
    /// Human-readable reason of the current phase.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// `Ready`, `JobCreated`, `JobCompleted`, `ArtifactVerified`; one per type.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
    /// What was captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub artifact: Option<ArtifactStatus>,
    /// Seconds per phase of the capture.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub timings: BTreeMap<String, f64>,
    /// The entrypoint mode the checkpoint Job ran with (so restore pods are shaped to match
    /// even if `spec.job` is edited later).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub entrypoint: Option<EntrypointMode>,
    /// How far the running capture is: written by the node agent every few seconds while it
    /// dumps and hashes, removed by the controller once the Checkpoint leaves `Creating`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub progress: Option<CheckpointProgress>,
    /// The nodes `spec.prestage` selects, one entry per node, each written by that node's
    /// agent (server-side apply, field manager `warmstart-agent-<node>`): the artifact fetched
    /// into its cache, being fetched, or why it could not be.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["node"]))]
    pub prestage: Vec<PrestageStatus>,
}

/// One node's pre-staging of a Checkpoint's artifact.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PrestageStatus {
    /// The node.
    pub node: String,
    /// `Fetching`, `Warmed` or `Failed`.
    pub state: PrestageState,
    /// The manifest digest of the artifact this entry is about (`status.artifact.manifestDigest`
    /// when the node acted on it).
    pub manifest_digest: String,
    /// Bytes in the node's cache once warmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size_bytes: Option<u64>,
    /// Why it failed, or how it was fetched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// When the agent wrote this entry.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

/// Where a node's pre-staging is.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, Default, PartialEq, Eq, Hash, JsonSchema)]
pub enum PrestageState {
    /// The agent is fetching the artifact into its cache.
    #[default]
    Fetching,
    /// The artifact is in the node's cache, verified.
    Warmed,
    /// The artifact could not be fetched; `message` says why.
    Failed,
}

impl PrestageState {
    /// The state as spelt in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fetching => "Fetching",
            Self::Warmed => "Warmed",
            Self::Failed => "Failed",
        }
    }
}

/// How far a running capture is.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointProgress {
    /// Bytes done by the current step.
    pub bytes_done: u64,
    /// Bytes the current step expects (for the dump: the workload's resident memory).
    pub bytes_total: u64,
    /// For people: `dumping 41.2 GiB/70.0 GiB at 1.9 GiB/s`.
    pub message: String,
    /// When the agent wrote it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub updated_at: Option<Time>,
}

/// Summary of a verified artifact.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ArtifactStatus {
    /// Total size of the artifact files in bytes.
    pub size_bytes: u64,
    /// The same, for people (`512.6 MiB`, `70.0 GiB`): [`human_size`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<String>,
    /// Digest of the manifest (`sha256:<hex>`).
    pub manifest_digest: String,
    /// CRIU version that made the dump.
    pub criu_version: String,
    /// Kernel version of the source node.
    pub kernel_version: String,
    /// GPU state, when it was captured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuStatus>,
    /// The container whose process the artifact holds (the manifest's `source.container`, the
    /// Job's target container): restore pods may target only it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub container: Option<String>,
}

/// `bytes` for people, in binary units with one decimal: `512 B`, `4.0 KiB`, `512.6 MiB`,
/// `70.0 GiB`.
pub fn human_size(bytes: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    #[allow(clippy::cast_precision_loss)]
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

/// GPU state captured with the checkpoint.
#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuStatus {
    /// GPU models.
    #[serde(default)]
    pub models: Vec<String>,
    /// GPU UUIDs.
    #[serde(default)]
    pub uuids: Vec<String>,
    /// NVIDIA driver version.
    #[serde(default)]
    pub driver_version: String,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use kube::CustomResourceExt;
    use serde_json::{Value, json};

    use super::*;

    fn crd() -> Value {
        serde_json::to_value(Checkpoint::crd()).unwrap()
    }

    fn schema() -> Value {
        crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
    }

    #[test]
    fn crd_names_scope_and_subresources() {
        let crd = crd();
        assert_eq!(crd["metadata"]["name"], "checkpoints.warmstart.dev");
        assert_eq!(crd["spec"]["group"], "warmstart.dev");
        assert_eq!(crd["spec"]["scope"], "Namespaced");
        assert_eq!(crd["spec"]["names"]["kind"], "Checkpoint");
        assert_eq!(crd["spec"]["names"]["shortNames"], json!(["ckpt"]));
        let version = &crd["spec"]["versions"][0];
        assert_eq!(version["name"], "v1alpha1");
        assert_eq!(version["subresources"]["status"], json!({}));
    }

    #[test]
    fn crd_printer_columns_show_readiness_and_a_size_for_people() {
        let cols = crd()["spec"]["versions"][0]["additionalPrinterColumns"].clone();
        let names: Vec<&str> = cols
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["name"].as_str().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "Model", "Backend", "Phase", "Hash", "Ready", "Size", "Bytes", "Progress", "Age",
                "Message"
            ]
        );
        assert_eq!(cols[3]["jsonPath"], ".status.identityHash");
        assert_eq!(
            cols[4]["jsonPath"],
            ".status.conditions[?(@.type==\"Ready\")].status"
        );
        assert_eq!(cols[5]["jsonPath"], ".status.artifact.size");
        assert_eq!(cols[6]["jsonPath"], ".status.artifact.sizeBytes");
        assert_eq!(cols[6]["priority"], 1, "bytes show with -o wide");
        assert_eq!(cols[7]["jsonPath"], ".status.progress.message");
        assert!(
            cols[7]["priority"].is_null(),
            "a capture's progress shows by default"
        );
        assert_eq!(cols[9]["jsonPath"], ".status.message");
        assert_eq!(cols[9]["priority"], 1, "the message shows with -o wide");
    }

    #[test]
    fn sizes_for_people_use_binary_units_with_one_decimal() {
        assert_eq!(human_size(0), "0 B");
        assert_eq!(human_size(1023), "1023 B");
        assert_eq!(human_size(4096), "4.0 KiB");
        assert_eq!(human_size(537_520_526), "512.6 MiB");
        assert_eq!(human_size(70 << 30), "70.0 GiB");
        assert_eq!(human_size(u64::MAX), "16.0 EiB");
    }

    #[test]
    fn identity_is_immutable_through_a_cel_rule() {
        let identity = &schema()["properties"]["spec"]["properties"]["identity"];
        assert_eq!(
            identity["x-kubernetes-validations"],
            json!([{"rule": "self == oldSelf", "message": "spec.identity is immutable"}])
        );
        assert_eq!(identity["required"], json!(["backendFramework", "model"]));
    }

    #[test]
    fn schema_carries_the_defaults_of_the_contract() {
        let spec = &schema()["properties"]["spec"]["properties"];
        let identity = &spec["identity"]["properties"];
        assert_eq!(identity["tensorParallelSize"]["default"], 1);
        assert_eq!(identity["pipelineParallelSize"]["default"], 1);
        let job = &spec["job"]["properties"];
        assert_eq!(job["activeDeadlineSeconds"]["default"], 3600);
        assert_eq!(job["backoffLimit"]["default"], 3);
        assert_eq!(job["ttlSecondsAfterFinished"]["default"], 300);
        assert_eq!(
            job["podTemplateSpec"]["x-kubernetes-preserve-unknown-fields"],
            true
        );
        assert_eq!(spec["deletionPolicy"]["default"], "Delete");
        assert_eq!(spec["deletionPolicy"]["enum"], json!(["Delete", "Retain"]));
        assert_eq!(job["entrypoint"]["default"], "Native");
        assert_eq!(job["entrypoint"]["enum"], json!(["Native", "Wrap"]));
    }

    #[test]
    fn spec_defaults_apply_when_parsing() {
        let ck: Checkpoint = serde_json::from_value(json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": "c"},
            "spec": {"identity": {"model": "m", "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {}}}
        }))
        .unwrap();
        assert_eq!(ck.spec.identity.tensor_parallel_size, 1);
        assert_eq!(
            ck.spec.job.active_deadline_seconds,
            DEFAULT_ACTIVE_DEADLINE_SECONDS
        );
        assert_eq!(ck.spec.job.backoff_limit, DEFAULT_BACKOFF_LIMIT);
        assert_eq!(
            ck.spec.job.ttl_seconds_after_finished,
            DEFAULT_TTL_SECONDS_AFTER_FINISHED
        );
        assert_eq!(ck.spec.deletion_policy, DeletionPolicy::Delete);
        assert_eq!(ck.spec.job.target_container_name, None);
        assert_eq!(ck.spec.job.entrypoint, EntrypointMode::Native);
    }

    // Kube conventions.
    #[test]
    fn conditions_are_a_list_map_keyed_by_type_and_the_crd_is_described() {
        let conditions = &schema()["properties"]["status"]["properties"]["conditions"];
        assert_eq!(conditions["x-kubernetes-list-type"], "map");
        assert_eq!(conditions["x-kubernetes-list-map-keys"], json!(["type"]));
        let description = schema()["description"].as_str().unwrap().to_owned();
        assert!(
            description.starts_with("A Checkpoint captures"),
            "{description}"
        );
        assert!(!description.contains("Auto-generated"));
    }

    #[test]
    fn prestage_entries_are_a_list_map_keyed_by_node_and_the_selector_matches_all_labels() {
        let entries = &schema()["properties"]["status"]["properties"]["prestage"];
        assert_eq!(entries["x-kubernetes-list-type"], "map");
        assert_eq!(entries["x-kubernetes-list-map-keys"], json!(["node"]));
        let state = &entries["items"]["properties"]["state"];
        assert_eq!(state["enum"], json!(["Fetching", "Warmed", "Failed"]));
        let prestage: Prestage = serde_json::from_value(json!({
            "nodeSelector": {"pool": "h100", "zone": "a"}
        }))
        .unwrap();
        let labels = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        assert!(prestage.selects(&labels(&[("pool", "h100"), ("zone", "a"), ("x", "y")])));
        assert!(!prestage.selects(&labels(&[("pool", "h100")])));
        assert!(!prestage.selects(&labels(&[("pool", "a100"), ("zone", "a")])));
        assert!(Prestage::default().selects(&labels(&[])));
        assert!(
            serde_json::from_value::<Prestage>(json!({"nodeSelectr": {}})).is_err(),
            "a misspelt field is refused, not read as every node"
        );
    }

    #[test]
    fn status_phases_serialise_as_the_api_spells_them() {
        for phase in CheckpointPhase::ALL {
            assert_eq!(serde_json::to_value(phase).unwrap(), json!(phase.as_str()));
        }
        let status = &schema()["properties"]["status"]["properties"];
        for field in [
            "observedGeneration",
            "identityHash",
            "phase",
            "jobName",
            "location",
            "storageType",
            "createdAt",
            "message",
            "conditions",
            "artifact",
            "timings",
            "entrypoint",
            "prestage",
        ] {
            assert!(
                status.get(field).is_some(),
                "status.{field} missing from the schema"
            );
        }
    }
}
