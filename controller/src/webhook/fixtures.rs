//! Test fixtures of the admission webhooks: a Ready Checkpoint, restore pods, AdmissionReviews
//! as the API server sends them, and [`FakeSource`], the in-memory [`CheckpointSource`].

use std::collections::BTreeMap;
use std::sync::Mutex;

use kube::core::DynamicObject;
use kube::core::admission::AdmissionReview;
use serde_json::{Value, json};
use warmstart_shared::{Checkpoint, CheckpointPhase};

use super::admission::{CheckpointFuture, CheckpointSource};

/// Test double of [`CheckpointSource`]: Checkpoints in a map keyed by `(namespace, name)`, as
/// the API server would return them; `fail` makes every read fail like an unreachable API
/// server. Records every read so tests can see the handler asked the pod's namespace.
#[derive(Debug, Default)]
pub(crate) struct FakeSource {
    pub(crate) checkpoints: BTreeMap<(String, String), Checkpoint>,
    pub(crate) fail: bool,
    pub(crate) reads: Mutex<Vec<(String, String)>>,
}

impl FakeSource {
    /// A source holding `checkpoints`, keyed by their own namespace and name.
    pub(crate) fn with(checkpoints: impl IntoIterator<Item = Checkpoint>) -> Self {
        Self {
            checkpoints: checkpoints
                .into_iter()
                .map(|c| {
                    (
                        (
                            c.metadata.namespace.clone().unwrap_or_default(),
                            c.metadata.name.clone().unwrap_or_default(),
                        ),
                        c,
                    )
                })
                .collect(),
            ..Self::default()
        }
    }

    /// The `(namespace, name)` of every read so far.
    pub(crate) fn reads(&self) -> Vec<(String, String)> {
        self.reads.lock().unwrap().clone()
    }
}

impl CheckpointSource for FakeSource {
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> CheckpointFuture<'a> {
        self.reads
            .lock()
            .unwrap()
            .push((namespace.to_owned(), name.to_owned()));
        let result = if self.fail {
            Err(kube::Error::Api(Box::new(
                kube::core::Status::failure("etcdserver: request timed out", "Timeout")
                    .with_code(504),
            )))
        } else {
            Ok(self
                .checkpoints
                .get(&(namespace.to_owned(), name.to_owned()))
                .cloned())
        };
        Box::pin(async move { result })
    }
}

/// A Checkpoint spec as users write it: one container `main`.
pub(crate) fn checkpoint_json(namespace: &str, name: &str) -> Value {
    json!({
        "apiVersion": "warmstart.dev/v1alpha1",
        "kind": "Checkpoint",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": "6b1c7d0e-0000-4000-8000-000000000001",
            "generation": 1,
        },
        "spec": {
            "identity": {"model": "meta-llama/Llama-2-7b-hf", "backendFramework": "vllm"},
            "job": {
                "podTemplateSpec": {"spec": {"containers": [
                    {"name": "main", "image": "vllm/vllm-openai:v0.6.0"}
                ]}},
                "targetContainerName": "main",
            },
        },
    })
}

/// A Checkpoint in `phase` with a complete status (hash, location, manifest digest).
pub(crate) fn checkpoint_in_phase(
    namespace: &str,
    name: &str,
    phase: CheckpointPhase,
) -> Checkpoint {
    let mut value = checkpoint_json(namespace, name);
    value["status"] = json!({
        "phase": phase,
        "identityHash": "96429b2725761a09",
        "location": format!("{namespace}/96429b2725761a09"),
        "storageType": "pvc",
        "artifact": {
            "sizeBytes": 1024,
            "manifestDigest": format!("sha256:{}", "ab".repeat(32)),
            "criuVersion": "4.2.1",
            "kernelVersion": "6.18.0",
        },
    });
    serde_json::from_value(value).unwrap()
}

/// A Ready Checkpoint.
pub(crate) fn ready_checkpoint(namespace: &str, name: &str) -> Checkpoint {
    checkpoint_in_phase(namespace, name, CheckpointPhase::Ready)
}

/// A pod as the API server passes it to a mutating webhook (defaults applied, namespace set),
/// with the given annotations.
pub(crate) fn pod_json(namespace: &str, annotations: &[(&str, &str)]) -> Value {
    let annotations: BTreeMap<&str, &str> = annotations.iter().copied().collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "llama-restored",
            "namespace": namespace,
            "labels": {"app": "llama"},
            "annotations": annotations,
        },
        "spec": {
            "containers": [{
                "name": "main",
                "image": "vllm/vllm-openai:v0.6.0",
                "command": ["sleep", "infinity"],
                "startupProbe": {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 5},
                "readinessProbe": {"httpGet": {"path": "/health", "port": 8000}},
                "terminationMessagePath": "/dev/termination-log",
                "imagePullPolicy": "IfNotPresent",
            }, {
                "name": "sidecar",
                "image": "busybox",
            }],
            "restartPolicy": "Always",
            "dnsPolicy": "ClusterFirst",
        },
        "status": {},
    })
}

/// A pod asking to restore `checkpoint` into `targets`.
pub(crate) fn restore_pod_json(namespace: &str, checkpoint: &str, targets: &str) -> Value {
    pod_json(
        namespace,
        &[
            ("warmstart.dev/restore-from", checkpoint),
            ("warmstart.dev/target-containers", targets),
        ],
    )
}

/// An AdmissionReview v1 for `object` (and `old_object`) of kind `group/version/kind`.
pub(crate) fn review(
    (group, version, kind, resource): (&str, &str, &str, &str),
    operation: &str,
    namespace: &str,
    object: Option<Value>,
    old_object: Option<Value>,
) -> AdmissionReview<DynamicObject> {
    let name = object
        .as_ref()
        .and_then(|o| o["metadata"]["name"].as_str())
        .unwrap_or_default()
        .to_owned();
    serde_json::from_value(review_json(
        (group, version, kind, resource),
        operation,
        namespace,
        &name,
        object,
        old_object,
    ))
    .unwrap()
}

/// The JSON of [`review`].
pub(crate) fn review_json(
    (group, version, kind, resource): (&str, &str, &str, &str),
    operation: &str,
    namespace: &str,
    name: &str,
    object: Option<Value>,
    old_object: Option<Value>,
) -> Value {
    json!({
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
            "kind": {"group": group, "version": version, "kind": kind},
            "resource": {"group": group, "version": version, "resource": resource},
            "name": name,
            "namespace": namespace,
            "operation": operation,
            "userInfo": {"username": "admin", "groups": ["system:authenticated"]},
            "object": object,
            "oldObject": old_object,
            "dryRun": false,
        },
    })
}

/// The GVK+resource of pods.
pub(crate) const POD: (&str, &str, &str, &str) = ("", "v1", "Pod", "pods");
/// The GVK+resource of Checkpoints.
pub(crate) const CHECKPOINT: (&str, &str, &str, &str) =
    ("warmstart.dev", "v1alpha1", "Checkpoint", "checkpoints");
