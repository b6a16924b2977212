//! Admission decisions (docs/architecture.md "The two flows", README "The API"): the mutating webhook that
//! shapes restore pods, and the validating webhook that checks `Checkpoint`s beyond what the CRD
//! schema and its CEL rule can express. No HTTP here (see [`super::server`]).
//!
//! Invariants:
//! - Fail closed: every error denies the request. A mutating response carries either no patch
//!   or one that turns the pod the API server sent into exactly what [`shape_restore_pod`]
//!   returned; the patch is applied to the admitted object and compared before answering, so
//!   the pod is never half-mutated.
//! - The Checkpoint is read through a [`CheckpointSource`], in production straight from the API
//!   server ([`ApiCheckpointSource`]), never from a cache: a stale `Ready` would bind a pod to an
//!   artifact that is gone or replaced.
//! - Every decision increments `warmstart_webhook_decisions_total{webhook, outcome}` once and
//!   logs one line naming the object, its namespace and the outcome.

use std::error::Error as StdError;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::core::admission::{
    AdmissionRequest, AdmissionResponse, AdmissionReview, ConvertAdmissionReviewError, Operation,
    SerializePatchError,
};
use kube::core::{DynamicObject, Status};
use kube::{Client, ResourceExt};
use thiserror::Error;
use tracing::{info, warn};
use warmstart_shared::Checkpoint;
use warmstart_shared::artifact::{self, ArtifactLayout, PathError};
use warmstart_shared::identity::{self, IdentityError};
use warmstart_shared::job::{self, JobBuildError};
use warmstart_shared::names::{self, ANNOTATION_RESTORE_FROM};

use crate::errors::error_chain;
use crate::metrics::Metrics;
use crate::restore::{RestoreShapeError, seccomp_warnings, shape_restore_pod};
use warmstart_shared::wrap::DEFAULT_ENTRYPOINT_IMAGE;

/// Metric label of the mutating webhook (`/mutate/pods`).
pub const WEBHOOK_MUTATE_PODS: &str = "mutate-pods";
/// Metric label of the validating webhook (`/validate/checkpoints`).
pub const WEBHOOK_VALIDATE_CHECKPOINTS: &str = "validate-checkpoints";

/// How long the mutating webhook waits for the Checkpoint read: below the `timeoutSeconds: 10`
/// of the webhook configurations, so the API server gets our denial, not its own timeout.
pub const DEFAULT_LOOKUP_TIMEOUT: Duration = Duration::from_secs(8);

/// Placeholder uid for the dry-run Job build of a `Checkpoint` that has none yet: the uid
/// only fills the Job's owner reference, which the dry run throws away.
const DRY_RUN_UID: &str = "admission-dry-run";

/// What one admission decision came to (the `outcome` label of the decision metric).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Admitted unchanged.
    Allowed,
    /// Admitted with a patch.
    Mutated,
    /// Refused by a rule the user can fix.
    Denied,
    /// Refused because the webhook could not decide (API error, malformed request): fail closed.
    Error,
}

impl Outcome {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Allowed => "allowed",
            Self::Mutated => "mutated",
            Self::Denied => "denied",
            Self::Error => "error",
        }
    }
}

impl fmt::Display for Outcome {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The future of a [`CheckpointSource::get`].
pub type CheckpointFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<Checkpoint>, kube::Error>> + Send + 'a>>;

/// Where the mutating webhook reads Checkpoints from.
pub trait CheckpointSource: Send + Sync {
    /// The Checkpoint `name` in `namespace`, or `None` when it does not exist.
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> CheckpointFuture<'a>;
}

/// The production [`CheckpointSource`]: one GET on the API server per call, no cache.
#[derive(Clone)]
pub struct ApiCheckpointSource {
    client: Client,
}

impl ApiCheckpointSource {
    /// Reads through `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

impl fmt::Debug for ApiCheckpointSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiCheckpointSource")
            .finish_non_exhaustive()
    }
}

impl CheckpointSource for ApiCheckpointSource {
    fn get<'a>(&'a self, namespace: &'a str, name: &'a str) -> CheckpointFuture<'a> {
        Box::pin(async move {
            Api::<Checkpoint>::namespaced(self.client.clone(), namespace)
                .get_opt(name)
                .await
        })
    }
}

/// Why the mutating webhook refuses a pod.
#[derive(Debug, Error)]
pub enum MutateError {
    /// The review carries no request.
    #[error("admission review has no request")]
    NoRequest(#[source] ConvertAdmissionReviewError),
    /// The webhook was called for something else than a core/v1 Pod.
    #[error("expected a core/v1 Pod, got {kind}: the webhook configuration is wrong")]
    NotAPod {
        /// `group/version Kind` of the request.
        kind: String,
    },
    /// A CREATE without the object.
    #[error("admission request {uid} has no object")]
    NoObject {
        /// The request uid.
        uid: String,
    },
    /// The object does not decode as a Pod.
    #[error("cannot decode the pod of admission request {uid}")]
    DecodePod {
        /// The request uid.
        uid: String,
        /// The decoder's reason.
        #[source]
        source: serde_json::Error,
    },
    /// Neither the request nor the pod names a namespace.
    #[error("pod {pod} has no namespace")]
    NoNamespace {
        /// The pod's name.
        pod: String,
    },
    /// The restore annotation does not name a Checkpoint.
    #[error("pod {pod} has an invalid {ANNOTATION_RESTORE_FROM} annotation")]
    BadRestoreFrom {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// Which rule the value breaks.
        #[source]
        source: PathError,
    },
    /// The API server could not be asked.
    #[error("cannot read checkpoint {checkpoint} in namespace {namespace}")]
    Lookup {
        /// The Checkpoint's name.
        checkpoint: String,
        /// The pod's namespace.
        namespace: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The API server did not answer in time.
    #[error(
        "reading checkpoint {checkpoint} in namespace {namespace} took longer than {timeout:?}"
    )]
    LookupTimeout {
        /// The Checkpoint's name.
        checkpoint: String,
        /// The pod's namespace.
        namespace: String,
        /// The limit.
        timeout: Duration,
    },
    /// No such Checkpoint in the pod's namespace.
    #[error(
        "checkpoint {checkpoint} not found in namespace {namespace}: a pod restores only from a Checkpoint in its own namespace"
    )]
    CheckpointNotFound {
        /// The Checkpoint's name.
        checkpoint: String,
        /// The pod's namespace.
        namespace: String,
    },
    /// The restore-pod shaping refused the pod (not Ready, no targets, unknown container…).
    #[error(transparent)]
    Shape(#[from] RestoreShapeError),
    /// A pod could not be turned into JSON.
    #[error("cannot serialise pod {pod} to compute the patch")]
    Serialize {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// The serialiser's reason.
        #[source]
        source: serde_json::Error,
    },
    /// The computed patch does not apply to the pod as the API server sent it.
    #[error("the patch for pod {pod} does not apply to the pod as admitted")]
    PatchApply {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// Which operation failed.
        #[source]
        source: json_patch::PatchError,
    },
    /// The patched pod no longer decodes as a Pod.
    #[error("the patched pod {pod} does not decode as a Pod")]
    PatchDecode {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// The decoder's reason.
        #[source]
        source: serde_json::Error,
    },
    /// The patched pod differs from the shaped pod.
    #[error("the patch for pod {pod} does not reproduce the shaped pod")]
    PatchMismatch {
        /// `<namespace>/<name>` of the pod.
        pod: String,
    },
    /// The patch could not be put into the response.
    #[error("cannot encode the patch for pod {pod}")]
    EncodePatch {
        /// `<namespace>/<name>` of the pod.
        pod: String,
        /// The encoder's reason.
        #[source]
        source: SerializePatchError,
    },
}

impl MutateError {
    /// [`Outcome::Denied`] for what the user can fix, [`Outcome::Error`] otherwise.
    pub fn outcome(&self) -> Outcome {
        match self {
            Self::BadRestoreFrom { .. } | Self::CheckpointNotFound { .. } | Self::Shape(_) => {
                Outcome::Denied
            }
            _ => Outcome::Error,
        }
    }
}

/// Why the validating webhook refuses a `Checkpoint`.
#[derive(Debug, Error)]
pub enum ValidateError {
    /// The review carries no request.
    #[error("admission review has no request")]
    NoRequest(#[source] ConvertAdmissionReviewError),
    /// The webhook was called for something else than a Checkpoint.
    #[error("expected a warmstart.dev Checkpoint, got {kind}: the webhook configuration is wrong")]
    NotACheckpoint {
        /// `group/version Kind` of the request.
        kind: String,
    },
    /// A CREATE or UPDATE without the object (or an UPDATE without the old one).
    #[error("admission request {uid} has no {field}")]
    NoObject {
        /// The request uid.
        uid: String,
        /// `object` or `oldObject`.
        field: &'static str,
    },
    /// The object does not decode as a Checkpoint.
    #[error("the {field} of admission request {uid} is not a valid Checkpoint")]
    Decode {
        /// The request uid.
        uid: String,
        /// `object` or `oldObject`.
        field: &'static str,
        /// The decoder's reason.
        #[source]
        source: serde_json::Error,
    },
    /// `spec.identity` breaks a rule.
    #[error("checkpoint {checkpoint} has an invalid spec.identity")]
    Identity {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// The rule.
        #[source]
        source: IdentityError,
    },
    /// An UPDATE changes `spec.identity`.
    #[error(
        "checkpoint {checkpoint}: spec.identity is immutable; create a new Checkpoint for another identity"
    )]
    IdentityChanged {
        /// `<namespace>/<name>`.
        checkpoint: String,
    },
    /// The name or namespace cannot be a path element of the artifact layout.
    #[error("checkpoint {checkpoint} has an unusable {field}")]
    Name {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// `metadata.name` or `metadata.namespace`.
        field: &'static str,
        /// The rule.
        #[source]
        source: PathError,
    },
    /// The target container cannot be resolved in the pod template.
    #[error("checkpoint {checkpoint} has no usable target container")]
    Target {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// Why (unknown name, ambiguous, no containers, …).
        #[source]
        source: JobBuildError,
    },
    /// The pod template has a field a core/v1 pod template does not have (a typo).
    #[error(
        "checkpoint {checkpoint}: spec.job.podTemplateSpec.{path} is not a field of a pod template (core/v1 PodTemplateSpec)"
    )]
    UnknownTemplateField {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// The field's path inside the template.
        path: String,
    },
    /// The pod template does not parse as a core/v1 pod template.
    #[error("checkpoint {checkpoint}: spec.job.podTemplateSpec is not a valid pod template")]
    InvalidTemplate {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// The parser's reason.
        #[source]
        source: serde_json::Error,
    },
    /// The controller could not build the checkpoint Job from this spec.
    #[error("checkpoint {checkpoint} cannot produce its checkpoint Job")]
    Job {
        /// `<namespace>/<name>`.
        checkpoint: String,
        /// The Job builder's reason.
        #[source]
        source: JobBuildError,
    },
}

impl ValidateError {
    /// [`Outcome::Denied`] for what the user can fix, [`Outcome::Error`] otherwise.
    pub fn outcome(&self) -> Outcome {
        match self {
            Self::NoRequest(_)
            | Self::NotACheckpoint { .. }
            | Self::NoObject { .. }
            | Self::Decode {
                field: "oldObject", ..
            } => Outcome::Error,
            _ => Outcome::Denied,
        }
    }
}

/// What the mutating webhook decided for a pod it admits.
#[derive(Debug, Default)]
pub struct PodDecision {
    /// `None` admits the pod unchanged, `Some(patch)` with the JSON patch from the admitted pod
    /// to the shaped one.
    pub patch: Option<json_patch::Patch>,
    /// Admission warnings shown to the user (`kubectl` prints them): a seccomp profile of theirs
    /// kept instead of warmstart's.
    pub warnings: Vec<String>,
}

/// The mutating decision for one request: the patch that shapes the pod, if any, and warnings.
///
/// Only a Pod CREATE carrying `warmstart.dev/restore-from` is shaped; anything else passes.
///
/// # Errors
/// [`MutateError`]: no Checkpoint of that name in the pod's namespace, the shaping refuses the
/// pod (not Ready, missing targets, unknown container, …), the API read failed or timed out,
/// or the patch could not be proven to reproduce the shaped pod.
///
/// # Guarantees
/// A returned patch, applied to the object as the API server sent it, yields a pod equal to
/// [`shape_restore_pod`]'s output (checked here before returning).
pub async fn decide_pod(
    source: &dyn CheckpointSource,
    request: &AdmissionRequest<DynamicObject>,
    lookup_timeout: Duration,
    entrypoint_image: &str,
) -> Result<PodDecision, MutateError> {
    let kind = &request.kind;
    if !(kind.group.is_empty() && kind.version == "v1" && kind.kind == "Pod") {
        return Err(MutateError::NotAPod {
            kind: describe_kind(request),
        });
    }
    if request.operation != Operation::Create {
        return Ok(PodDecision::default());
    }
    let object = request
        .object
        .as_ref()
        .ok_or_else(|| MutateError::NoObject {
            uid: request.uid.clone(),
        })?;
    let admitted = serde_json::to_value(object).map_err(|source| MutateError::DecodePod {
        uid: request.uid.clone(),
        source,
    })?;
    let pod: Pod =
        serde_json::from_value(admitted.clone()).map_err(|source| MutateError::DecodePod {
            uid: request.uid.clone(),
            source,
        })?;
    let Some(wanted) = pod.annotations().get(ANNOTATION_RESTORE_FROM).cloned() else {
        return Ok(PodDecision::default());
    };
    let namespace = request
        .namespace
        .clone()
        .or_else(|| pod.namespace())
        .filter(|ns| !ns.is_empty())
        .ok_or_else(|| MutateError::NoNamespace {
            pod: pod_name(request, &pod),
        })?;
    let pod_key = format!("{namespace}/{}", pod_name(request, &pod));
    // The value goes into an API path: refuse anything that is not one plain name.
    artifact::validate_path_element("checkpoint name", &wanted).map_err(|source| {
        MutateError::BadRestoreFrom {
            pod: pod_key.clone(),
            source,
        }
    })?;
    let checkpoint = tokio::time::timeout(lookup_timeout, source.get(&namespace, &wanted))
        .await
        .map_err(|_| MutateError::LookupTimeout {
            checkpoint: wanted.clone(),
            namespace: namespace.clone(),
            timeout: lookup_timeout,
        })?
        .map_err(|source| MutateError::Lookup {
            checkpoint: wanted.clone(),
            namespace: namespace.clone(),
            source,
        })?
        .ok_or_else(|| MutateError::CheckpointNotFound {
            checkpoint: wanted.clone(),
            namespace: namespace.clone(),
        })?;
    let shaped = shape_restore_pod(&pod, &namespace, &checkpoint, entrypoint_image)?;

    let serialize = |p: &Pod| {
        serde_json::to_value(p).map_err(|source| MutateError::Serialize {
            pod: pod_key.clone(),
            source,
        })
    };
    // Typed against typed: fields the API server sent that k8s-openapi does not know are in
    // neither side, so the patch never touches (or drops) them.
    let patch = json_patch::diff(&serialize(&pod)?, &serialize(&shaped)?);
    let mut patched = admitted;
    json_patch::patch(&mut patched, &patch).map_err(|source| MutateError::PatchApply {
        pod: pod_key.clone(),
        source,
    })?;
    let patched: Pod =
        serde_json::from_value(patched).map_err(|source| MutateError::PatchDecode {
            pod: pod_key.clone(),
            source,
        })?;
    if patched != shaped {
        return Err(MutateError::PatchMismatch { pod: pod_key });
    }
    Ok(PodDecision {
        patch: Some(patch),
        warnings: seccomp_warnings(&shaped),
    })
}

/// The validating decision for one request on a `Checkpoint`.
///
/// CREATE and UPDATE are checked (other operations pass): the identity is valid; on UPDATE it is
/// unchanged (beside the CRD's CEL rule); the name and namespace are safe path elements; the
/// target container resolves in the pod template; and the controller could build the
/// checkpoint Job `checkpoint-<name>` from the spec (name length, label rules, Job settings,
/// reserved volumes and mounts).
///
/// # Errors
/// [`ValidateError`] naming the checkpoint and the rule.
///
/// # Caveats
/// An UPDATE that leaves `spec` as it was (finalizers, labels, annotations) is admitted after
/// the identity check without the other rules: a Checkpoint created before a rule existed must
/// still be deletable, and its finalizer removable.
pub fn decide_checkpoint(request: &AdmissionRequest<DynamicObject>) -> Result<(), ValidateError> {
    let kind = &request.kind;
    if !(kind.group == names::API_GROUP && kind.kind == names::CHECKPOINT_KIND) {
        return Err(ValidateError::NotACheckpoint {
            kind: describe_kind(request),
        });
    }
    let update = match request.operation {
        Operation::Create => false,
        Operation::Update => true,
        Operation::Delete | Operation::Connect => return Ok(()),
    };
    let checkpoint = decode_checkpoint(request, request.object.as_ref(), "object")?;
    let name = checkpoint
        .metadata
        .name
        .clone()
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| request.name.clone());
    let namespace = request
        .namespace
        .clone()
        .or_else(|| checkpoint.namespace())
        .unwrap_or_default();
    let key = format!("{namespace}/{name}");
    let spec = &checkpoint.spec;
    identity::validate(&spec.identity).map_err(|source| ValidateError::Identity {
        checkpoint: key.clone(),
        source,
    })?;
    if update {
        let old = decode_checkpoint(request, request.old_object.as_ref(), "oldObject")?;
        if old.spec.identity != spec.identity {
            return Err(ValidateError::IdentityChanged { checkpoint: key });
        }
        if old.spec == *spec {
            return Ok(());
        }
    }
    for (field, value) in [("metadata.name", &name), ("metadata.namespace", &namespace)] {
        artifact::validate_path_element(field, value).map_err(|source| ValidateError::Name {
            checkpoint: key.clone(),
            field,
            source,
        })?;
    }
    // The typed Checkpoint silently dropped any field of the template it does not know: read
    // the template as sent.
    let raw_template = request
        .object
        .as_ref()
        .and_then(|o| serde_json::to_value(o).ok())
        .map(|v| v["spec"]["job"]["podTemplateSpec"].clone())
        .unwrap_or(serde_json::Value::Null);
    if !raw_template.is_null() {
        match crate::strict::unknown_template_field(&raw_template) {
            Ok(None) => {}
            Ok(Some(path)) => {
                return Err(ValidateError::UnknownTemplateField {
                    checkpoint: key,
                    path,
                });
            }
            Err(source) => {
                return Err(ValidateError::InvalidTemplate {
                    checkpoint: key,
                    source,
                });
            }
        }
    }
    let job_err = |source| ValidateError::Job {
        checkpoint: key.clone(),
        source,
    };
    let pod_spec = spec
        .job
        .pod_template_spec
        .spec
        .as_ref()
        .ok_or_else(|| job_err(JobBuildError::MissingPodSpec))?;
    job::resolve_target_container(pod_spec, spec.job.target_container_name.as_deref()).map_err(
        |source| ValidateError::Target {
            checkpoint: key.clone(),
            source,
        },
    )?;
    let hash =
        identity::identity_hash(&spec.identity).map_err(|source| ValidateError::Identity {
            checkpoint: key.clone(),
            source,
        })?;
    let location = ArtifactLayout::new(names::DEFAULT_ARTIFACT_ROOT, &namespace, &hash)
        .map_err(|source| ValidateError::Name {
            checkpoint: key.clone(),
            field: "metadata.namespace",
            source,
        })?
        .relative();
    // A dry run of what the reconciler will do, so a spec it cannot build is refused now
    // rather than turning Failed later.
    let mut dry_run = checkpoint.clone();
    dry_run.metadata.name = Some(name.clone());
    dry_run.metadata.namespace = Some(namespace.clone());
    if dry_run.metadata.uid.as_deref().is_none_or(str::is_empty) {
        dry_run.metadata.uid = Some(DRY_RUN_UID.to_owned());
    }
    // The image is irrelevant to whether the Job can be built.
    job::build_checkpoint_job(&dry_run, &hash, &location, DEFAULT_ENTRYPOINT_IMAGE)
        .map_err(job_err)?;
    Ok(())
}

fn decode_checkpoint(
    request: &AdmissionRequest<DynamicObject>,
    object: Option<&DynamicObject>,
    field: &'static str,
) -> Result<Checkpoint, ValidateError> {
    let object = object.ok_or_else(|| ValidateError::NoObject {
        uid: request.uid.clone(),
        field,
    })?;
    let decode_err = |source| ValidateError::Decode {
        uid: request.uid.clone(),
        field,
        source,
    };
    let value = serde_json::to_value(object).map_err(decode_err)?;
    serde_json::from_value(value).map_err(decode_err)
}

fn describe_kind<T: kube::Resource>(request: &AdmissionRequest<T>) -> String {
    let k = &request.kind;
    if k.group.is_empty() {
        format!("{}/{}", k.version, k.kind)
    } else {
        format!("{}/{} {}", k.group, k.version, k.kind)
    }
}

/// The pod's name for messages: the name, else `<generateName>*`, else the request's name.
fn pod_name(request: &AdmissionRequest<DynamicObject>, pod: &Pod) -> String {
    pod.metadata
        .name
        .clone()
        .or_else(|| pod.metadata.generate_name.as_ref().map(|g| format!("{g}*")))
        .filter(|n| !n.is_empty())
        .unwrap_or_else(|| request.name.clone())
}

/// The admission webhooks with their collaborators: where Checkpoints are read and where
/// decisions are counted. Cheap to clone.
#[derive(Clone)]
pub struct Admission {
    source: Arc<dyn CheckpointSource>,
    metrics: Arc<Metrics>,
    lookup_timeout: Duration,
    entrypoint_image: String,
}

impl fmt::Debug for Admission {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Admission")
            .field("lookup_timeout", &self.lookup_timeout)
            .finish_non_exhaustive()
    }
}

impl Admission {
    /// Webhooks reading Checkpoints from `source` and counting decisions in `metrics`, with
    /// [`DEFAULT_LOOKUP_TIMEOUT`].
    pub fn new(source: Arc<dyn CheckpointSource>, metrics: Arc<Metrics>) -> Self {
        Self {
            source,
            metrics,
            lookup_timeout: DEFAULT_LOOKUP_TIMEOUT,
            entrypoint_image: DEFAULT_ENTRYPOINT_IMAGE.to_owned(),
        }
    }

    /// The same with another image for the entrypoint's install init container (restore pods
    /// of `Wrap` checkpoints).
    #[must_use]
    pub fn with_entrypoint_image(mut self, image: String) -> Self {
        self.entrypoint_image = image;
        self
    }

    /// The same with another limit on the Checkpoint read.
    #[must_use]
    pub fn with_lookup_timeout(mut self, timeout: Duration) -> Self {
        self.lookup_timeout = timeout;
        self
    }

    /// The metrics decisions are counted in.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Answers a review from the mutating webhook (`/mutate/pods`): see [`decide_pod`]. Every
    /// error denies the pod with the error's full message chain.
    pub async fn mutate_pods(
        &self,
        review: AdmissionReview<DynamicObject>,
    ) -> AdmissionReview<DynamicObject> {
        let request: AdmissionRequest<DynamicObject> = match review.try_into() {
            Ok(request) => request,
            Err(err) => return self.invalid(WEBHOOK_MUTATE_PODS, &MutateError::NoRequest(err)),
        };
        let subject = Subject::of_pod(&request);
        let (response, outcome, reason) = match decide_pod(
            self.source.as_ref(),
            &request,
            self.lookup_timeout,
            &self.entrypoint_image,
        )
        .await
        {
            Ok(PodDecision { patch: None, .. }) => {
                (AdmissionResponse::from(&request), Outcome::Allowed, None)
            }
            Ok(PodDecision {
                patch: Some(patch),
                warnings,
            }) => match AdmissionResponse::from(&request).with_patch(patch) {
                Ok(mut response) => {
                    if !warnings.is_empty() {
                        for w in &warnings {
                            warn!(pod = %subject.key(), warning = %w, "restore pod admitted with a warning");
                        }
                        response.warnings = Some(warnings);
                    }
                    (response, Outcome::Mutated, None)
                }
                Err(source) => {
                    let err = MutateError::EncodePatch {
                        pod: subject.key(),
                        source,
                    };
                    let message = error_chain(&err);
                    (
                        refuse(&request, err.outcome(), &message),
                        err.outcome(),
                        Some(message),
                    )
                }
            },
            Err(err) => {
                let message = error_chain(&err);
                (
                    refuse(&request, err.outcome(), &message),
                    err.outcome(),
                    Some(message),
                )
            }
        };
        self.record(
            WEBHOOK_MUTATE_PODS,
            &request.uid,
            &subject,
            outcome,
            reason.as_deref(),
        );
        response.into_review()
    }

    /// Answers a review from the validating webhook (`/validate/checkpoints`): see
    /// [`decide_checkpoint`].
    pub fn validate_checkpoints(
        &self,
        review: AdmissionReview<DynamicObject>,
    ) -> AdmissionReview<DynamicObject> {
        let request: AdmissionRequest<DynamicObject> = match review.try_into() {
            Ok(request) => request,
            Err(err) => {
                return self.invalid(WEBHOOK_VALIDATE_CHECKPOINTS, &ValidateError::NoRequest(err));
            }
        };
        let subject = Subject::of_checkpoint(&request);
        let (response, outcome, reason) = match decide_checkpoint(&request) {
            Ok(()) => (AdmissionResponse::from(&request), Outcome::Allowed, None),
            Err(err) => {
                let message = error_chain(&err);
                (
                    refuse(&request, err.outcome(), &message),
                    err.outcome(),
                    Some(message),
                )
            }
        };
        self.record(
            WEBHOOK_VALIDATE_CHECKPOINTS,
            &request.uid,
            &subject,
            outcome,
            reason.as_deref(),
        );
        response.into_review()
    }

    /// Counts and logs a request that could not even be read (no request in the review, or a
    /// body that is not a review): used by the HTTP layer too.
    pub fn record_unreadable(&self, webhook: &'static str, reason: &str) {
        self.metrics
            .webhook_decision(webhook, Outcome::Error.as_str());
        warn!(
            webhook,
            outcome = Outcome::Error.as_str(),
            reason,
            "admission request unreadable"
        );
    }

    fn invalid(
        &self,
        webhook: &'static str,
        err: &(dyn StdError + 'static),
    ) -> AdmissionReview<DynamicObject> {
        let message = error_chain(err);
        self.record_unreadable(webhook, &message);
        AdmissionResponse::invalid(message).into_review()
    }

    fn record(
        &self,
        webhook: &'static str,
        uid: &str,
        subject: &Subject,
        outcome: Outcome,
        reason: Option<&str>,
    ) {
        self.metrics.webhook_decision(webhook, outcome.as_str());
        let reason = reason.unwrap_or_default();
        macro_rules! decision {
            ($level:ident) => {
                $level!(
                    webhook,
                    request.uid = uid,
                    object.kind = subject.kind(),
                    object.name = subject.name(),
                    object.namespace = subject.namespace(),
                    checkpoint.name = subject.checkpoint(),
                    outcome = outcome.as_str(),
                    reason,
                    "admission decision"
                )
            };
        }
        // An error is degraded operation (the webhook could not decide); a denial is a
        // decision like any other.
        if outcome == Outcome::Error {
            decision!(warn);
        } else {
            decision!(info);
        }
    }
}

/// A denial: 403 Forbidden for a rule, 500 for an error (the API server shows both to the user
/// and keeps the message).
fn refuse(
    request: &AdmissionRequest<DynamicObject>,
    outcome: Outcome,
    message: &str,
) -> AdmissionResponse {
    let (code, reason) = match outcome {
        Outcome::Error => (500, "InternalError"),
        _ => (403, "Forbidden"),
    };
    let mut response = AdmissionResponse::from(request).deny(message);
    response.result = Status::failure(message, reason).with_code(code);
    response
}

/// What a decision was about, for the log line.
#[derive(Debug)]
enum Subject {
    Pod {
        name: String,
        namespace: String,
        checkpoint: String,
    },
    Checkpoint {
        name: String,
        namespace: String,
    },
}

impl Subject {
    fn of_pod(request: &AdmissionRequest<DynamicObject>) -> Self {
        let meta = request.object.as_ref().map(|o| &o.metadata);
        let name = meta
            .and_then(|m| {
                m.name
                    .clone()
                    .or_else(|| m.generate_name.as_ref().map(|g| format!("{g}*")))
            })
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| request.name.clone());
        let namespace = request
            .namespace
            .clone()
            .or_else(|| meta.and_then(|m| m.namespace.clone()))
            .unwrap_or_default();
        let checkpoint = meta
            .and_then(|m| m.annotations.as_ref())
            .and_then(|a| a.get(ANNOTATION_RESTORE_FROM))
            .cloned()
            .unwrap_or_default();
        Self::Pod {
            name,
            namespace,
            checkpoint,
        }
    }

    fn of_checkpoint(request: &AdmissionRequest<DynamicObject>) -> Self {
        let meta = request.object.as_ref().map(|o| &o.metadata);
        let name = meta
            .and_then(|m| m.name.clone())
            .filter(|n| !n.is_empty())
            .unwrap_or_else(|| request.name.clone());
        let namespace = request
            .namespace
            .clone()
            .or_else(|| meta.and_then(|m| m.namespace.clone()))
            .unwrap_or_default();
        Self::Checkpoint { name, namespace }
    }

    fn kind(&self) -> &'static str {
        match self {
            Self::Pod { .. } => "Pod",
            Self::Checkpoint { .. } => names::CHECKPOINT_KIND,
        }
    }

    fn name(&self) -> &str {
        match self {
            Self::Pod { name, .. } | Self::Checkpoint { name, .. } => name,
        }
    }

    fn namespace(&self) -> &str {
        match self {
            Self::Pod { namespace, .. } | Self::Checkpoint { namespace, .. } => namespace,
        }
    }

    /// The Checkpoint the decision is about: the one a pod restores from, or itself.
    fn checkpoint(&self) -> &str {
        match self {
            Self::Pod { checkpoint, .. } => checkpoint,
            Self::Checkpoint { name, .. } => name,
        }
    }

    fn key(&self) -> String {
        format!("{}/{}", self.namespace(), self.name())
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use serde_json::{Value, json};
    use warmstart_shared::CheckpointPhase;
    use warmstart_shared::names::ANNOTATION_CHECKPOINT_BINDING;

    use super::*;
    use crate::webhook::fixtures::{
        CHECKPOINT, FakeSource, POD, checkpoint_in_phase, checkpoint_json, pod_json,
        ready_checkpoint, restore_pod_json, review,
    };

    fn admission(source: FakeSource) -> (Admission, Arc<FakeSource>, Arc<Metrics>) {
        let source = Arc::new(source);
        let metrics = Arc::new(Metrics::default());
        (
            Admission::new(source.clone(), metrics.clone()),
            source,
            metrics,
        )
    }

    async fn mutate(
        source: FakeSource,
        pod: Value,
    ) -> (AdmissionResponse, Arc<FakeSource>, Arc<Metrics>) {
        let (admission, source, metrics) = admission(source);
        let out = admission
            .mutate_pods(review(POD, "CREATE", "default", Some(pod), None))
            .await;
        (out.response.unwrap(), source, metrics)
    }

    fn validate(
        operation: &str,
        object: Value,
        old: Option<Value>,
    ) -> (AdmissionResponse, Arc<Metrics>) {
        let (admission, _, metrics) = admission(FakeSource::default());
        let out = admission.validate_checkpoints(review(
            CHECKPOINT,
            operation,
            "default",
            Some(object),
            old,
        ));
        (out.response.unwrap(), metrics)
    }

    fn counted(metrics: &Metrics, webhook: &str, outcome: &str) -> bool {
        metrics.encode().contains(&format!(
            "warmstart_webhook_decisions_total{{webhook=\"{webhook}\",outcome=\"{outcome}\"}} 1"
        ))
    }

    fn assert_denied(response: &AdmissionResponse, needle: &str) {
        assert!(!response.allowed, "admitted: {response:?}");
        assert!(response.patch.is_none(), "a denial carries no patch");
        assert!(
            response.result.message.contains(needle),
            "{:?} lacks {needle:?}",
            response.result.message
        );
    }

    // --- mutating webhook ---

    #[tokio::test]
    async fn a_pod_without_the_restore_annotation_passes_untouched() {
        let (response, source, metrics) =
            mutate(FakeSource::default(), pod_json("default", &[])).await;
        assert!(response.allowed);
        assert!(response.patch.is_none());
        assert!(
            source.reads().is_empty(),
            "no Checkpoint read for a plain pod"
        );
        assert!(counted(&metrics, "mutate-pods", "allowed"));
    }

    #[tokio::test]
    async fn a_restore_pod_is_patched_into_exactly_the_shaped_pod() {
        let original = restore_pod_json("default", "llama", "main");
        let (response, source, metrics) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            original.clone(),
        )
        .await;
        assert!(response.allowed, "{:?}", response.result);
        assert_eq!(
            source.reads(),
            vec![("default".to_owned(), "llama".to_owned())]
        );
        assert!(counted(&metrics, "mutate-pods", "mutated"));

        let patch: json_patch::Patch =
            serde_json::from_slice(response.patch.as_deref().unwrap()).unwrap();
        let wire = serde_json::to_value(&response).unwrap();
        assert_eq!(wire["patchType"], "JSONPatch");
        let mut patched = original.clone();
        json_patch::patch(&mut patched, &patch).unwrap();
        let patched: Pod = serde_json::from_value(patched).unwrap();

        let pod: Pod = serde_json::from_value(original).unwrap();
        let expected = shape_restore_pod(
            &pod,
            "default",
            &ready_checkpoint("default", "llama"),
            DEFAULT_ENTRYPOINT_IMAGE,
        )
        .unwrap();
        assert_eq!(patched, expected);
        let binding = &patched.annotations()[ANNOTATION_CHECKPOINT_BINDING];
        assert!(
            binding.starts_with("v1/6b1c7d0e-0000-4000-8000-000000000001/1/"),
            "{binding}"
        );
        // The patch only adds to what the user wrote: their annotations and probes survive.
        assert_eq!(patched.labels()["app"], "llama");
        let main = &patched.spec.as_ref().unwrap().containers[0];
        assert!(main.readiness_probe.is_some());
    }

    #[tokio::test]
    async fn a_pod_named_by_generate_name_is_shaped_too() {
        let mut pod = restore_pod_json("default", "llama", "main");
        pod["metadata"]["name"] = Value::Null;
        pod["metadata"]["generateName"] = json!("llama-");
        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            pod,
        )
        .await;
        assert!(response.allowed, "{:?}", response.result);
        assert!(response.patch.is_some());
    }

    #[tokio::test]
    async fn a_missing_checkpoint_denies_the_pod() {
        let (response, _, metrics) = mutate(
            FakeSource::default(),
            restore_pod_json("default", "llama", "main"),
        )
        .await;
        assert_denied(&response, "checkpoint llama not found in namespace default");
        assert_eq!(response.result.code, 403);
        assert!(counted(&metrics, "mutate-pods", "denied"));
    }

    #[tokio::test]
    async fn a_checkpoint_in_another_namespace_is_not_found_in_the_pods_namespace() {
        let (response, source, _) = mutate(
            FakeSource::with([ready_checkpoint("team-b", "llama")]),
            restore_pod_json("default", "llama", "main"),
        )
        .await;
        assert_denied(
            &response,
            "checkpoint llama not found in namespace default: a pod restores only from a Checkpoint in its own namespace",
        );
        assert_eq!(
            source.reads(),
            vec![("default".to_owned(), "llama".to_owned())]
        );
    }

    #[tokio::test]
    async fn a_checkpoint_answered_from_another_namespace_is_refused() {
        // A source that (wrongly) answers with another namespace's object: shaping refuses it.
        let source = FakeSource {
            checkpoints: BTreeMap::from([(
                ("default".to_owned(), "llama".to_owned()),
                ready_checkpoint("team-b", "llama"),
            )]),
            ..FakeSource::default()
        };
        let (response, _, _) = mutate(source, restore_pod_json("default", "llama", "main")).await;
        assert_denied(&response, "a pod restores only from its own namespace");
    }

    #[tokio::test]
    async fn a_checkpoint_that_is_not_ready_denies_the_pod() {
        let (response, _, metrics) = mutate(
            FakeSource::with([checkpoint_in_phase(
                "default",
                "llama",
                CheckpointPhase::Creating,
            )]),
            restore_pod_json("default", "llama", "main"),
        )
        .await;
        assert_denied(
            &response,
            "checkpoint default/llama is not Ready (phase Creating)",
        );
        assert!(counted(&metrics, "mutate-pods", "denied"));
    }

    #[tokio::test]
    async fn an_unknown_target_container_denies_the_pod_with_the_whole_chain() {
        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            restore_pod_json("default", "llama", "ghost"),
        )
        .await;
        assert_denied(
            &response,
            "pod default/llama-restored cannot be shaped for restore: target container \"ghost\" not found in pod",
        );
    }

    fn with_binding(binding: &str) -> Value {
        let mut pod = restore_pod_json("default", "llama", "main");
        pod["metadata"]["annotations"][ANNOTATION_CHECKPOINT_BINDING] = json!(binding);
        pod
    }

    // A binding already on the pod is never silently
    // replaced.
    #[tokio::test]
    async fn a_pod_carrying_a_garbage_binding_is_denied() {
        let (response, _, metrics) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            with_binding("garbage"),
        )
        .await;
        assert_denied(
            &response,
            "pod default/llama-restored already carries an invalid warmstart.dev/checkpoint-binding annotation: checkpoint binding \"garbage\" has 1 parts",
        );
        assert!(counted(&metrics, "mutate-pods", "denied"));
    }

    #[tokio::test]
    async fn a_pod_carrying_a_stale_binding_is_denied() {
        let live = warmstart_shared::binding::Binding::for_checkpoint(&ready_checkpoint(
            "default", "llama",
        ))
        .unwrap();
        let recreated = format!("v1/0000-other-uid/1/{}", live.digest);
        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            with_binding(&recreated),
        )
        .await;
        assert_denied(&response, "is not current for checkpoint default/llama");
        assert_denied(&response, "uid (the checkpoint was deleted and recreated)");

        let replaced = format!("v1/{}/1/{}", live.uid, "0".repeat(64));
        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            with_binding(&replaced),
        )
        .await;
        assert_denied(
            &response,
            "digest (its name, hash, location or artifact changed)",
        );
    }

    #[tokio::test]
    async fn a_pod_carrying_the_current_binding_is_admitted_even_after_an_edit() {
        let mut edited = ready_checkpoint("default", "llama");
        let stamped = warmstart_shared::binding::Binding::for_checkpoint(&edited).unwrap();
        // deletionPolicy changed after Ready: a new generation, the same artifact.
        edited.metadata.generation = Some(2);
        edited.spec.deletion_policy = warmstart_shared::DeletionPolicy::Retain;
        let (response, _, _) = mutate(
            FakeSource::with([edited]),
            with_binding(&stamped.to_string()),
        )
        .await;
        assert!(response.allowed, "{:?}", response.result);
    }

    // Targets must be what the checkpoint captured.
    #[tokio::test]
    async fn a_target_the_checkpoint_did_not_capture_is_denied() {
        for targets in ["main,sidecar", "sidecar"] {
            let (response, _, _) = mutate(
                FakeSource::with([ready_checkpoint("default", "llama")]),
                restore_pod_json("default", "llama", targets),
            )
            .await;
            assert_denied(
                &response,
                "target container \"sidecar\" was not captured by checkpoint default/llama (it captured \"main\")",
            );
        }
    }

    #[tokio::test]
    async fn the_captured_container_recorded_in_the_status_wins_over_the_spec() {
        // The Job template may be edited after Ready; what the artifact holds does not change.
        let mut ck = ready_checkpoint("default", "llama");
        ck.status
            .as_mut()
            .unwrap()
            .artifact
            .as_mut()
            .unwrap()
            .container = Some("sidecar".to_owned());
        let (response, _, _) = mutate(
            FakeSource::with([ck.clone()]),
            restore_pod_json("default", "llama", "sidecar"),
        )
        .await;
        assert!(response.allowed, "{:?}", response.result);
        let (response, _, _) = mutate(
            FakeSource::with([ck]),
            restore_pod_json("default", "llama", "main"),
        )
        .await;
        assert_denied(&response, "(it captured \"sidecar\")");
    }

    #[tokio::test]
    async fn a_users_seccomp_profile_is_kept_with_an_admission_warning() {
        let mut pod = restore_pod_json("default", "llama", "main");
        pod["spec"]["securityContext"] = json!({"seccompProfile": {"type": "RuntimeDefault"}});
        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            pod.clone(),
        )
        .await;
        assert!(response.allowed, "{:?}", response.result);
        let warnings = response.warnings.clone().unwrap_or_default();
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].starts_with(
                "the pod's seccompProfile is RuntimeDefault, kept instead of warmstart's"
            ),
            "{warnings:?}"
        );
        let wire = serde_json::to_value(&response).unwrap();
        assert_eq!(wire["warnings"], json!(warnings));
        let patch: json_patch::Patch =
            serde_json::from_slice(response.patch.as_deref().unwrap()).unwrap();
        json_patch::patch(&mut pod, &patch).unwrap();
        assert_eq!(
            pod["spec"]["securityContext"]["seccompProfile"],
            json!({"type": "RuntimeDefault"})
        );

        let (response, _, _) = mutate(
            FakeSource::with([ready_checkpoint("default", "llama")]),
            restore_pod_json("default", "llama", "main"),
        )
        .await;
        assert_eq!(
            response.warnings, None,
            "no warning when warmstart's profile applies"
        );
    }

    #[tokio::test]
    async fn an_unsafe_checkpoint_name_is_refused_before_any_read() {
        let (response, source, _) = mutate(
            FakeSource::default(),
            restore_pod_json("default", "../secrets", "main"),
        )
        .await;
        assert_denied(&response, "invalid warmstart.dev/restore-from annotation");
        assert!(source.reads().is_empty());
    }

    #[tokio::test]
    async fn an_unreachable_api_server_denies_the_pod_as_an_error() {
        let mut source = FakeSource::with([ready_checkpoint("default", "llama")]);
        source.fail = true;
        let (response, _, metrics) =
            mutate(source, restore_pod_json("default", "llama", "main")).await;
        assert_denied(
            &response,
            "cannot read checkpoint llama in namespace default: ApiError: etcdserver: request timed out",
        );
        assert_eq!(response.result.code, 500);
        assert!(counted(&metrics, "mutate-pods", "error"));
    }

    /// A source whose reads never finish.
    struct Stuck;
    impl CheckpointSource for Stuck {
        fn get<'a>(&'a self, _: &'a str, _: &'a str) -> CheckpointFuture<'a> {
            Box::pin(std::future::pending())
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_slow_api_server_denies_the_pod_before_the_webhook_timeout() {
        let metrics = Arc::new(Metrics::default());
        let admission = Admission::new(Arc::new(Stuck), metrics.clone());
        let out = admission
            .mutate_pods(review(
                POD,
                "CREATE",
                "default",
                Some(restore_pod_json("default", "llama", "main")),
                None,
            ))
            .await;
        assert_denied(&out.response.unwrap(), "took longer than 8s");
        assert!(counted(&metrics, "mutate-pods", "error"));
    }

    #[tokio::test]
    async fn only_creates_are_shaped() {
        let (admission, source, _) = admission(FakeSource::default());
        let pod = restore_pod_json("default", "llama", "main");
        let out = admission
            .mutate_pods(review(
                POD,
                "UPDATE",
                "default",
                Some(pod.clone()),
                Some(pod),
            ))
            .await;
        let response = out.response.unwrap();
        assert!(response.allowed && response.patch.is_none());
        assert!(source.reads().is_empty());
    }

    #[tokio::test]
    async fn another_kind_on_the_pod_webhook_is_an_error() {
        let (admission, _, metrics) = admission(FakeSource::default());
        let out = admission
            .mutate_pods(review(
                CHECKPOINT,
                "CREATE",
                "default",
                Some(checkpoint_json("default", "llama")),
                None,
            ))
            .await;
        assert_denied(&out.response.unwrap(), "expected a core/v1 Pod");
        assert!(counted(&metrics, "mutate-pods", "error"));
    }

    #[tokio::test]
    async fn a_review_without_request_is_invalid() {
        let (admission, _, metrics) = admission(FakeSource::default());
        let empty: AdmissionReview<DynamicObject> = serde_json::from_value(json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"
        }))
        .unwrap();
        let response = admission.mutate_pods(empty).await.response.unwrap();
        assert!(!response.allowed);
        assert!(counted(&metrics, "mutate-pods", "error"));
    }

    // --- validating webhook ---

    #[test]
    fn a_valid_checkpoint_is_admitted() {
        let (response, metrics) = validate("CREATE", checkpoint_json("default", "llama"), None);
        assert!(response.allowed, "{:?}", response.result);
        assert!(response.patch.is_none());
        assert!(counted(&metrics, "validate-checkpoints", "allowed"));
    }

    #[test]
    fn an_invalid_identity_is_denied() {
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["identity"]["model"] = json!("");
        let (response, metrics) = validate("CREATE", ck, None);
        assert_denied(
            &response,
            "checkpoint default/llama has an invalid spec.identity: spec.identity.model is required",
        );
        assert!(counted(&metrics, "validate-checkpoints", "denied"));

        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["identity"]["tensorParallelSize"] = json!(-2);
        let (response, _) = validate("CREATE", ck, None);
        assert_denied(&response, "spec.identity.tensorParallelSize is -2");
    }

    #[test]
    fn changing_the_identity_is_denied() {
        let old = checkpoint_json("default", "llama");
        let mut new = old.clone();
        new["spec"]["identity"]["dtype"] = json!("float16");
        let (response, metrics) = validate("UPDATE", new, Some(old));
        assert_denied(&response, "spec.identity is immutable");
        assert!(counted(&metrics, "validate-checkpoints", "denied"));
    }

    #[test]
    fn changing_the_job_is_checked_like_a_create() {
        let old = checkpoint_json("default", "llama");
        let mut new = old.clone();
        new["spec"]["job"]["backoffLimit"] = json!(5);
        let (response, _) = validate("UPDATE", new.clone(), Some(old.clone()));
        assert!(response.allowed, "{:?}", response.result);

        new["spec"]["job"]["targetContainerName"] = json!("ghost");
        let (response, _) = validate("UPDATE", new, Some(old));
        assert_denied(&response, "target container");
    }

    #[test]
    fn a_missing_target_container_is_denied() {
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["job"]["targetContainerName"] = json!("ghost");
        let (response, _) = validate("CREATE", ck, None);
        assert_denied(
            &response,
            "checkpoint default/llama has no usable target container: spec.job.targetContainerName \"ghost\" not found in pod template",
        );

        // Several containers, none named main, no explicit target.
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["job"]["targetContainerName"] = Value::Null;
        ck["spec"]["job"]["podTemplateSpec"]["spec"]["containers"] =
            json!([{"name": "a", "image": "x"}, {"name": "b", "image": "x"}]);
        let (response, _) = validate("CREATE", ck, None);
        assert_denied(&response, "targetContainerName is unset");
    }

    #[test]
    fn a_name_too_long_for_the_job_is_denied() {
        // `checkpoint-` + 53 characters = 64, one more than a Job name (label value) may have.
        let name = "a".repeat(53);
        let (response, _) = validate("CREATE", checkpoint_json("default", &name), None);
        assert_denied(&response, "cannot produce its checkpoint Job: job name");
        assert_denied(&response, "at most 63 characters");

        let name = "a".repeat(52);
        let (response, _) = validate("CREATE", checkpoint_json("default", &name), None);
        assert!(response.allowed, "{:?}", response.result);
    }

    #[test]
    fn a_name_that_is_not_a_path_element_is_denied() {
        let (response, _) = validate("CREATE", checkpoint_json("default", "a/b"), None);
        assert_denied(&response, "unusable metadata.name");
    }

    #[test]
    fn a_typo_in_the_pod_template_is_denied_naming_the_field() {
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["job"]["podTemplateSpec"]["spec"]["containers"][0]["imagee"] = json!("x");
        let (response, metrics) = validate("CREATE", ck, None);
        assert!(!response.allowed);
        assert!(
            response.result.message.contains(
                "spec.job.podTemplateSpec.spec.containers[0].imagee is not a field of a pod template"
            ),
            "{}",
            response.result.message
        );
        assert!(counted(&metrics, "validate-checkpoints", "denied"));
    }

    #[test]
    fn a_reserved_volume_in_the_template_is_denied() {
        let mut ck = checkpoint_json("default", "llama");
        ck["spec"]["job"]["podTemplateSpec"]["spec"]["volumes"] =
            json!([{"name": "warmstart-signal", "emptyDir": {}}]);
        let (response, _) = validate("CREATE", ck, None);
        assert_denied(&response, "reserved by warmstart");
    }

    #[test]
    fn a_metadata_only_update_is_never_blocked() {
        // A Checkpoint stored before a rule existed (here: an unknown target) must still be
        // able to lose its finalizer.
        let mut old = checkpoint_json("default", "llama");
        old["spec"]["job"]["targetContainerName"] = json!("ghost");
        let mut new = old.clone();
        new["metadata"]["finalizers"] = json!([]);
        let (response, _) = validate("UPDATE", new, Some(old));
        assert!(response.allowed, "{:?}", response.result);
    }

    #[test]
    fn deletes_pass() {
        let (admission, _, _) = admission(FakeSource::default());
        let out = admission.validate_checkpoints(review(
            CHECKPOINT,
            "DELETE",
            "default",
            None,
            Some(checkpoint_json("default", "llama")),
        ));
        assert!(out.response.unwrap().allowed);
    }

    #[test]
    fn another_kind_on_the_checkpoint_webhook_is_an_error() {
        let (admission, _, metrics) = admission(FakeSource::default());
        let out = admission.validate_checkpoints(review(
            POD,
            "CREATE",
            "default",
            Some(pod_json("default", &[])),
            None,
        ));
        assert_denied(
            &out.response.unwrap(),
            "expected a warmstart.dev Checkpoint",
        );
        assert!(counted(&metrics, "validate-checkpoints", "error"));
    }

    #[test]
    fn the_error_chain_lists_every_cause_once() {
        let err = ValidateError::Identity {
            checkpoint: "default/x".to_owned(),
            source: IdentityError::Empty { field: "model" },
        };
        assert_eq!(
            error_chain(&err),
            "checkpoint default/x has an invalid spec.identity: spec.identity.model is required and must not be empty"
        );
    }
}
