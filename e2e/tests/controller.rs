//! `warmstart-controller run` as a whole program against a real kube-apiserver (the tests'
//! control plane, without its Job controller), as ServiceAccount
//! `warmstart-system/warmstart-controller` with exactly the RBAC of `deploy/rbac`: the
//! Checkpoint lifecycle, every error path, artifact deletion policies, a restart mid-way, leader
//! election, and the restore admission webhook called by the API server over TLS. The test
//! plays the parts of the Job controller and the node agent: it sets Job conditions and writes
//! artifacts on the (temporary) artifact root, exactly as those would. Every test ends by
//! checking that RBAC refused the controller nothing.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::batch::v1::Job;
use k8s_openapi::api::core::v1::{Event, Pod};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use warmstart_agent::publish::Staging;
use warmstart_e2e::binaries;
use warmstart_e2e::cluster::{
    DEPLOY_NAMESPACE, apply, free_addr, install_crd, install_rbac, install_webhooks, repo,
    requests_outside_rbac, webhook_cert_dir, yaml_docs,
};
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_e2e::s3_server::S3Server;
use warmstart_shared::artifact::{CriuInfo, MANIFEST_FORMAT_VERSION, Manifest, SourceInfo};
use warmstart_shared::{Checkpoint, CheckpointPhase};

const WAIT: Duration = Duration::from_secs(30);
const NS: &str = "default";

/// The control plane, a running controller, and the artifact root.
struct Harness {
    plane: ControlPlane,
    client: Client,
    root: tempfile::TempDir,
    dir: tempfile::TempDir,
    controller: Option<Child>,
    webhook: std::net::SocketAddr,
    admin: std::net::SocketAddr,
    /// Start controllers in self-signed certificate mode (the default of `deploy/`) instead of
    /// with a serving certificate of the test CA.
    self_signed: bool,
    /// More flags for every controller started.
    extra_args: Vec<String>,
}

impl Harness {
    async fn start(webhooks: bool) -> Self {
        Self::start_with(webhooks, Vec::new()).await
    }

    async fn start_with(webhooks: bool, extra_args: Vec<String>) -> Self {
        let mut plane = ControlPlane::start_with(false).await.unwrap();
        let client = plane.client();
        install_crd(&mut plane, &["default", "other"])
            .await
            .unwrap();
        install_rbac(&mut plane).await.unwrap();
        let webhook = free_addr().unwrap();
        if webhooks {
            install_webhooks(&plane, webhook).await.unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        plane
            .service_account_kubeconfig(
                DEPLOY_NAMESPACE,
                "warmstart-controller",
                &dir.path().join("kubeconfig"),
            )
            .await
            .unwrap();
        let mut h = Self {
            plane,
            client,
            root: tempfile::tempdir().unwrap(),
            dir,
            controller: None,
            webhook,
            admin: free_addr().unwrap(),
            self_signed: false,
            extra_args,
        };
        h.start_controller(webhooks).await;
        h
    }

    async fn start_controller(&mut self, wait_for_webhook: bool) {
        let child = self.spawn_replica("controller-0", self.admin, self.webhook, "controller.log");
        self.controller = Some(child);
        if wait_for_webhook {
            let deadline = Instant::now() + WAIT;
            while std::net::TcpStream::connect(self.webhook).is_err() {
                assert!(
                    Instant::now() < deadline,
                    "webhook never listened:\n{}",
                    self.log()
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }

    /// Starts one controller process (a replica) with its own identity, ports and log.
    fn spawn_replica(
        &self,
        identity: &str,
        admin: std::net::SocketAddr,
        webhook: std::net::SocketAddr,
        log_name: &str,
    ) -> Child {
        let kubeconfig = self.dir.path().join("kubeconfig");
        let certs = self.dir.path().join(format!("tls-{identity}"));
        webhook_cert_dir(&self.plane, &certs).unwrap();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join(log_name))
            .unwrap();
        Command::new(binaries::controller().unwrap())
            .arg("run")
            .arg("--artifact-root")
            .arg(self.root.path())
            .args(["--admin-listen", &admin.to_string()])
            .args(["--webhook-listen", &webhook.to_string()])
            .arg("--webhook-cert-dir")
            .arg(certs)
            .arg(format!("--webhook-self-signed={}", self.self_signed))
            .args(["--identity", identity, "--lease-seconds", "3"])
            .args(&self.extra_args)
            .env("KUBECONFIG", &kubeconfig)
            .env("RUST_LOG", "info,warmstart_controller=debug")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    fn stop_controller(&mut self) {
        if let Some(mut c) = self.controller.take() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(i32::try_from(c.id()).unwrap()),
                nix::sys::signal::Signal::SIGTERM,
            );
            let deadline = Instant::now() + Duration::from_secs(15);
            loop {
                if c.try_wait().unwrap().is_some() {
                    break;
                }
                if Instant::now() > deadline {
                    let _ = c.kill();
                    let _ = c.wait();
                    panic!("controller ignored SIGTERM:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("controller.log")).unwrap_or_default()
    }

    fn checkpoints(&self, ns: &str) -> Api<Checkpoint> {
        Api::namespaced(self.client.clone(), ns)
    }

    async fn create(&self, name: &str, model: &str, extra: Value) -> Checkpoint {
        let mut doc = json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": name, "namespace": NS},
            "spec": {"identity": {"model": model, "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {"spec": {"containers": [
                         {"name": "main", "image": "busybox", "command": ["sleep", "1000"]}]}}}}
        });
        json_merge(&mut doc, &extra);
        self.checkpoints(NS)
            .create(
                &PostParams::default(),
                &serde_json::from_value(doc).unwrap(),
            )
            .await
            .unwrap()
    }

    /// Waits until the checkpoint satisfies `pred`; panics with the controller log otherwise.
    async fn wait_for(
        &self,
        name: &str,
        what: &str,
        pred: impl Fn(&Checkpoint) -> bool,
    ) -> Checkpoint {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Ok(Some(ck)) = self.checkpoints(NS).get_opt(name).await
                && pred(&ck)
            {
                return ck;
            }
            if Instant::now() > deadline {
                let ck = self.checkpoints(NS).get_opt(name).await.ok().flatten();
                panic!(
                    "{name}: never {what}; now {:?}\ncontroller log:\n{}",
                    ck.map(|c| c.status),
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until the checkpoint `name` is gone (its finalizer done).
    async fn wait_gone(&self, name: &str) {
        let deadline = Instant::now() + WAIT;
        while self.checkpoints(NS).get_opt(name).await.unwrap().is_some() {
            assert!(Instant::now() < deadline, "never deleted:\n{}", self.log());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn wait_phase(&self, name: &str, phase: CheckpointPhase) -> Checkpoint {
        self.wait_for(name, &format!("{phase}"), |c| phase_of(c) == Some(phase))
            .await
    }

    async fn set_job_condition(&self, job: &str, kind: &str, reason: &str, message: &str) {
        // Now, as the Job controller writes it: the controller-manager's TTL controller deletes
        // a finished Job `ttlSecondsAfterFinished` after its completion time.
        self.set_job_condition_at(job, kind, reason, message, jiff::Timestamp::now())
            .await;
    }

    /// [`Self::set_job_condition`] with the conditions' times (and the completion time) `at`.
    async fn set_job_condition_at(
        &self,
        job: &str,
        kind: &str,
        reason: &str,
        message: &str,
        at: jiff::Timestamp,
    ) {
        let jobs: Api<Job> = Api::namespaced(self.client.clone(), NS);
        let now = at.strftime("%Y-%m-%dT%H:%M:%SZ").to_string();
        let now = now.as_str();
        let mut conditions = vec![json!({"type": kind, "status": "True", "reason": reason,
            "message": message, "lastTransitionTime": now, "lastProbeTime": now})];
        if kind == "Complete" {
            conditions.insert(
                0,
                json!({"type": "SuccessCriteriaMet", "status": "True", "reason": reason,
                "lastTransitionTime": now, "lastProbeTime": now}),
            );
        } else {
            conditions.insert(
                0,
                json!({"type": "FailureTarget", "status": "True", "reason": reason,
                "lastTransitionTime": now, "lastProbeTime": now}),
            );
        }
        let status = if kind == "Complete" {
            json!({"status": {"conditions": conditions, "succeeded": 1, "startTime": now, "completionTime": now}})
        } else {
            json!({"status": {"conditions": conditions, "failed": 4, "startTime": now}})
        };
        jobs.patch_status(job, &PatchParams::default(), &Patch::Merge(&status))
            .await
            .unwrap();
    }

    /// Publishes an artifact for `hash` in `ns` exactly as the agent does.
    fn publish(&self, ns: &str, hash: &str) -> PathBuf {
        let out = self.root.path().join(ns).join(hash);
        let staging = Staging::create(&out).unwrap();
        std::fs::create_dir(staging.path().join("criu")).unwrap();
        std::fs::write(staging.path().join("criu/pages-1.img"), vec![7u8; 8192]).unwrap();
        let manifest = Manifest {
            format_version: MANIFEST_FORMAT_VERSION,
            identity_hash: hash.into(),
            created_at: "2026-12-02T18:00:00Z".into(),
            source: SourceInfo::default(),
            criu: CriuInfo {
                version: "4.2.1".into(),
                kernel_version: "6.18.0".into(),
                ..Default::default()
            },
            mounts: vec![],
            cuda: None,
            assigned_gpus: None,
            timings: [("dump".to_owned(), 1.25), ("publish".to_owned(), 0.5)].into(),
            chunk_bytes: 0,
            files: vec![],
            digest: String::new(),
        };
        staging
            .publish(manifest, &warmstart_agent::progress::Meter::default())
            .unwrap();
        out
    }

    /// Waits until an Event with `reason` names `name`. The controller publishes a transition's
    /// Event after writing the status, so a reader who saw the new phase may not see the Event
    /// yet.
    async fn wait_event(&self, name: &str, reason: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let events = self.events_for(name).await;
            if events.iter().any(|r| r == reason) {
                return;
            }
            if Instant::now() > deadline {
                panic!(
                    "{name}: no {reason} event; events {events:?}\ncontroller log:\n{}",
                    self.log()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    async fn events_for(&self, name: &str) -> Vec<String> {
        let events: Api<Event> = Api::namespaced(self.client.clone(), NS);
        events
            .list(&Default::default())
            .await
            .unwrap()
            .items
            .into_iter()
            .filter(|e| e.involved_object.name.as_deref() == Some(name))
            .filter_map(|e| e.reason)
            .collect()
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        // RBAC refused the controller nothing (checked only on success: a failing test
        // reports its own problem).
        if !std::thread::panicking() {
            let refused = requests_outside_rbac(&self.plane, "warmstart-controller").unwrap();
            assert!(
                refused.is_empty(),
                "RBAC refused the controller: {refused:#?}\ncontroller log:\n{}",
                self.log()
            );
        }
        if let Some(mut c) = self.controller.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn json_merge(target: &mut Value, patch: &Value) {
    if let (Some(t), Some(p)) = (target.as_object_mut(), patch.as_object()) {
        for (k, v) in p {
            json_merge(t.entry(k.clone()).or_insert(Value::Null), v);
        }
    } else {
        *target = patch.clone();
    }
}

fn phase_of(c: &Checkpoint) -> Option<CheckpointPhase> {
    c.status.as_ref().and_then(|s| s.phase)
}

fn hash_of(c: &Checkpoint) -> String {
    c.status
        .as_ref()
        .and_then(|s| s.identity_hash.clone())
        .unwrap()
}

fn message_of(c: &Checkpoint) -> String {
    c.status
        .as_ref()
        .and_then(|s| s.message.clone())
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_to_ready_then_deletion_removes_the_artifact() {
    let h = Harness::start(false).await;
    h.create("llama", "meta-llama/Llama-2-7b-hf", json!({}))
        .await;
    let ck = h.wait_phase("llama", CheckpointPhase::Creating).await;
    assert_eq!(
        hash_of(&ck),
        "96429b2725761a09",
        "Dynamo-compatible hash computed once into status"
    );
    assert!(
        ck.finalizers()
            .iter()
            .any(|f| f == "warmstart.dev/artifact-cleanup")
    );
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    let job = jobs.get("checkpoint-llama").await.unwrap();
    assert_eq!(job.owner_references()[0].uid, ck.uid().unwrap());
    assert_eq!(job.owner_references()[0].controller, Some(true));

    let dir = h.publish(NS, &hash_of(&ck));
    h.set_job_condition("checkpoint-llama", "Complete", "CompletionsReached", "done")
        .await;
    let ck = h.wait_phase("llama", CheckpointPhase::Ready).await;
    let status = ck.status.clone().unwrap();
    let artifact = status.artifact.clone().unwrap();
    assert_eq!(artifact.size_bytes, 8192);
    assert_eq!(artifact.criu_version, "4.2.1");
    assert!(artifact.manifest_digest.starts_with("sha256:"));
    assert_eq!(status.timings["dump"], 1.25);
    assert!(status.created_at.is_some());
    // Relative to the artifact root: the agent and the controller mount it at different paths.
    assert_eq!(
        status.location.as_deref(),
        Some(format!("{NS}/{}", hash_of(&ck)).as_str())
    );
    assert!(dir.ends_with(status.location.as_deref().unwrap()));
    assert_eq!(status.observed_generation, Some(1));
    for kind in ["JobCreated", "JobCompleted", "ArtifactVerified"] {
        assert!(
            status
                .conditions
                .iter()
                .any(|c| c.type_ == kind && c.status == "True"),
            "{kind}: {:?}",
            status.conditions
        );
    }
    for reason in ["Pending", "JobCreated", "Ready"] {
        h.wait_event("llama", reason).await;
    }
    // Reconciling again changes nothing: the object stays as it is.
    let rv = ck.resource_version();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        h.checkpoints(NS)
            .get("llama")
            .await
            .unwrap()
            .resource_version(),
        rv
    );

    // Deletion with the default policy (Delete) removes the artifact, then the object.
    h.checkpoints(NS)
        .delete("llama", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("llama").await;
    assert!(!dir.exists(), "artifact removed with its checkpoint");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retain_keeps_the_artifact() {
    let h = Harness::start(false).await;
    h.create(
        "kept",
        "retained-model",
        json!({"spec": {"deletionPolicy": "Retain"}}),
    )
    .await;
    let ck = h.wait_phase("kept", CheckpointPhase::Creating).await;
    let dir = h.publish(NS, &hash_of(&ck));
    h.set_job_condition("checkpoint-kept", "Complete", "CompletionsReached", "done")
        .await;
    h.wait_phase("kept", CheckpointPhase::Ready).await;
    h.checkpoints(NS)
        .delete("kept", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("kept").await;
    assert!(
        dir.join("manifest.json").exists(),
        "Retain keeps the artifact"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn job_failures_fail_the_checkpoint_with_the_jobs_reason() {
    let h = Harness::start(false).await;
    h.create("backoff", "model-a", json!({})).await;
    h.create("deadline", "model-b", json!({})).await;
    h.wait_phase("backoff", CheckpointPhase::Creating).await;
    h.wait_phase("deadline", CheckpointPhase::Creating).await;
    h.set_job_condition(
        "checkpoint-backoff",
        "Failed",
        "BackoffLimitExceeded",
        "Job has reached the specified backoff limit",
    )
    .await;
    h.set_job_condition(
        "checkpoint-deadline",
        "Failed",
        "DeadlineExceeded",
        "Job was active longer than specified deadline",
    )
    .await;
    let ck = h.wait_phase("backoff", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("BackoffLimitExceeded"),
        "{}",
        message_of(&ck)
    );
    let ck = h.wait_phase("deadline", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("DeadlineExceeded"),
        "{}",
        message_of(&ck)
    );
    h.wait_event("deadline", "JobFailed").await;
}

/// A Job that cannot create its pod (refused by admission, over quota) is reported on the
/// Checkpoint as the Job controller says it (its `FailedCreate` Event), without waiting for the
/// Job's deadline; the Checkpoint stays Creating. The test plays the Job controller.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_cannot_create_its_pod_is_reported_on_the_checkpoint() {
    let h = Harness::start(false).await;
    h.create("refused", "model-refused", json!({})).await;
    h.wait_phase("refused", CheckpointPhase::Creating).await;
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    let job = jobs.get("checkpoint-refused").await.unwrap();
    let events: Api<k8s_openapi::api::core::v1::Event> = Api::namespaced(h.client.clone(), NS);
    let refusal = "pods \"checkpoint-refused-x7k2p\" is forbidden: violates PodSecurity \"baseline:latest\": privileged";
    events
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({
                "metadata": {"name": "checkpoint-refused.failedcreate", "namespace": NS},
                "involvedObject": {"kind": "Job", "apiVersion": "batch/v1", "namespace": NS,
                    "name": "checkpoint-refused", "uid": job.metadata.uid},
                "reason": "FailedCreate", "type": "Warning",
                "message": format!("Error creating: {refusal}"),
                "source": {"component": "job-controller"},
                "lastTimestamp": "2026-12-03T12:00:00Z", "count": 1
            }))
            .unwrap(),
        )
        .await
        .unwrap();
    let ck = h
        .wait_for("refused", "reported as unable to create its pod", |c| {
            message_of(c).contains("cannot create its pod")
        })
        .await;
    assert_eq!(phase_of(&ck), Some(CheckpointPhase::Creating));
    assert!(
        message_of(&ck).contains("PodSecurity"),
        "{}",
        message_of(&ck)
    );
    let ready = ck
        .status
        .as_ref()
        .unwrap()
        .conditions
        .iter()
        .find(|c| c.type_ == "Ready")
        .cloned()
        .unwrap();
    assert_eq!(ready.reason, "JobFailedCreate");
    h.wait_event("refused", "JobFailedCreate").await;
}

// A seccomp profile the user set is kept in the Job, with
// a warning Event on the Checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_users_seccomp_profile_is_kept_with_a_warning_event() {
    let h = Harness::start(false).await;
    h.create(
        "own-seccomp",
        "model-s",
        json!({"spec": {"job": {"podTemplateSpec": {"spec": {
            "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}}}}}}}),
    )
    .await;
    h.wait_phase("own-seccomp", CheckpointPhase::Creating).await;
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    let job = jobs.get("checkpoint-own-seccomp").await.unwrap();
    let pod = job.spec.unwrap().template.spec.unwrap();
    assert_eq!(
        pod.security_context.unwrap().seccomp_profile.unwrap().type_,
        "RuntimeDefault"
    );
    h.wait_event("own-seccomp", "SeccompProfileKept").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_deleted_mid_way_is_created_again() {
    let h = Harness::start(false).await;
    let ck = h.create("again", "model-c", json!({})).await;
    h.wait_phase("again", CheckpointPhase::Creating).await;
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    let first = jobs.get("checkpoint-again").await.unwrap().uid().unwrap();
    jobs.delete("checkpoint-again", &DeleteParams::background())
        .await
        .unwrap();
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(Some(job)) = jobs.get_opt("checkpoint-again").await
            && job.uid().unwrap() != first
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "job never recreated:\n{}",
            h.log()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ck2 = h.wait_phase("again", CheckpointPhase::Creating).await;
    assert_eq!(ck2.uid(), ck.uid());
    h.wait_event("again", "JobDeleted").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_succeeded_job_without_a_valid_artifact_fails_saying_why() {
    let h = Harness::start(false).await;
    h.create("missing", "model-d", json!({})).await;
    h.create("tampered", "model-e", json!({})).await;
    h.wait_phase("missing", CheckpointPhase::Creating).await;
    let ck = h.wait_phase("tampered", CheckpointPhase::Creating).await;
    let dir = h.publish(NS, &hash_of(&ck));
    let manifest = dir.join("manifest.json");
    let text = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(&manifest, text.replace("6.18.0", "6.18.9")).unwrap();
    h.set_job_condition(
        "checkpoint-missing",
        "Complete",
        "CompletionsReached",
        "done",
    )
    .await;
    h.set_job_condition(
        "checkpoint-tampered",
        "Complete",
        "CompletionsReached",
        "done",
    )
    .await;
    let ck = h.wait_phase("missing", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("no artifact at"),
        "{}",
        message_of(&ck)
    );
    let ck = h.wait_phase("tampered", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("digest mismatch"),
        "{}",
        message_of(&ck)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_hash_fails_naming_the_owner_and_an_invalid_identity_names_the_field() {
    let h = Harness::start(false).await;
    h.create("first", "same-model", json!({})).await;
    h.wait_phase("first", CheckpointPhase::Creating).await;
    h.create("second", "same-model", json!({})).await;
    let ck = h.wait_phase("second", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("already owned by checkpoint default/first"),
        "{}",
        message_of(&ck)
    );
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    assert!(jobs.get_opt("checkpoint-second").await.unwrap().is_none());
    // Deleting the rejected duplicate leaves the owner's artifact alone.
    let owner = h.checkpoints(NS).get("first").await.unwrap();
    let dir = h.publish(NS, &hash_of(&owner));
    h.checkpoints(NS)
        .delete("second", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("second").await;
    assert!(dir.exists(), "the owner's artifact survives");

    h.create("empty", "", json!({})).await;
    let ck = h.wait_phase("empty", CheckpointPhase::Failed).await;
    assert!(
        message_of(&ck).contains("spec.identity.model"),
        "{}",
        message_of(&ck)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_controller_recovers_its_state_from_the_api() {
    let mut h = Harness::start(false).await;
    h.create("restart", "model-f", json!({})).await;
    let ck = h.wait_phase("restart", CheckpointPhase::Creating).await;
    h.stop_controller();
    assert!(
        h.log().contains("controller stopped"),
        "graceful shutdown:\n{}",
        h.log()
    );
    h.publish(NS, &hash_of(&ck));
    h.set_job_condition(
        "checkpoint-restart",
        "Complete",
        "CompletionsReached",
        "done",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        phase_of(&h.checkpoints(NS).get("restart").await.unwrap()),
        Some(CheckpointPhase::Creating)
    );
    h.start_controller(false).await;
    let ck = h.wait_phase("restart", CheckpointPhase::Ready).await;
    assert_eq!(
        ck.status.unwrap().job_name.as_deref(),
        Some("checkpoint-restart")
    );
}

fn restore_pod(name: &str, ns: &str, from: Option<&str>, targets: &str) -> Pod {
    let mut annotations = serde_json::Map::new();
    if let Some(from) = from {
        annotations.insert("warmstart.dev/restore-from".into(), json!(from));
        annotations.insert("warmstart.dev/target-containers".into(), json!(targets));
    }
    serde_json::from_value(json!({
        "metadata": {"name": name, "namespace": ns, "annotations": annotations},
        "spec": {"containers": [{"name": "main", "image": "busybox", "command": ["sleep", "1000"],
                 "startupProbe": {"httpGet": {"path": "/health", "port": 8000}}}]}
    }))
    .unwrap()
}

/// The Job completes while the controller is down, and its `ttlSecondsAfterFinished` (300 s,
/// the default) has passed when the controller comes back: the controller-manager removed the
/// Job, the verified artifact says it succeeded, and nothing is captured again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_removed_by_its_ttl_while_the_controller_was_down_still_ends_ready() {
    let mut h = Harness::start(false).await;
    h.create("expired", "model-expired", json!({})).await;
    let ck = h.wait_phase("expired", CheckpointPhase::Creating).await;
    h.stop_controller();
    h.publish(NS, &hash_of(&ck));
    let an_hour_ago = jiff::Timestamp::now() - jiff::SignedDuration::from_hours(1);
    h.set_job_condition_at(
        "checkpoint-expired",
        "Complete",
        "CompletionsReached",
        "done",
        an_hour_ago,
    )
    .await;
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    let deadline = Instant::now() + WAIT;
    while jobs.get_opt("checkpoint-expired").await.unwrap().is_some() {
        assert!(
            Instant::now() < deadline,
            "the TTL controller never removed the Job"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.start_controller(false).await;
    let ready = h.wait_phase("expired", CheckpointPhase::Ready).await;
    assert_eq!(
        ready.status.unwrap().artifact.unwrap().size_bytes,
        8192,
        "the published artifact"
    );
    assert!(
        jobs.get_opt("checkpoint-expired").await.unwrap().is_none(),
        "no Job created again:\n{}",
        h.log()
    );
}

/// A Checkpoint deleted and created again under its name while the garbage collector has not
/// removed its old Job yet (held here by a finalizer, so the timing is the test's): the new
/// one waits, deletes the old Job, and creates its own, instead of failing on a Job it does not
/// own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_created_again_under_its_name_replaces_the_old_job() {
    let h = Harness::start(false).await;
    let jobs: Api<Job> = Api::namespaced(h.client.clone(), NS);
    h.create("again", "model-again", json!({})).await;
    let first = h.wait_phase("again", CheckpointPhase::Creating).await;
    let hold = json!({"metadata": {"finalizers": ["warmstart.test/hold"]}});
    jobs.patch(
        "checkpoint-again",
        &PatchParams::default(),
        &Patch::Merge(&hold),
    )
    .await
    .unwrap();
    h.checkpoints(NS)
        .delete("again", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("again").await;
    h.create("again", "model-again", json!({})).await;
    let waiting = h
        .wait_for("again", "waiting for the old job", |c| {
            message_of(c).contains("of an earlier checkpoint of this name is being deleted")
        })
        .await;
    assert_eq!(phase_of(&waiting), Some(CheckpointPhase::Pending));
    assert_ne!(waiting.uid(), first.uid());
    let release = json!({"metadata": {"finalizers": null}});
    jobs.patch(
        "checkpoint-again",
        &PatchParams::default(),
        &Patch::Merge(&release),
    )
    .await
    .unwrap();
    let second = h.wait_phase("again", CheckpointPhase::Creating).await;
    let job = jobs.get("checkpoint-again").await.unwrap();
    assert_eq!(job.owner_references()[0].uid, second.uid().unwrap());
}

/// Self-signed mode, as `deploy/` runs the controller: it keeps its certificate in the Secret
/// and injects its CA as `caBundle` into both webhook configurations, exactly as applied from
/// `deploy/webhook/` (Service client config, no `caBundle`), with the RBAC `deploy/rbac` grants.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn self_signed_mode_keeps_its_certificate_in_the_secret_and_injects_the_ca_bundle() {
    let mut h = Harness::start(false).await;
    h.stop_controller();
    for file in ["mutating.yaml", "validating.yaml"] {
        for doc in yaml_docs(&repo().join("deploy/webhook").join(file)).unwrap() {
            apply(&h.client, &doc).await.unwrap();
        }
    }
    h.self_signed = true;
    h.start_controller(true).await;
    let secrets: Api<k8s_openapi::api::core::v1::Secret> =
        Api::namespaced(h.client.clone(), "warmstart-system");
    let mutating: Api<k8s_openapi::api::admissionregistration::v1::MutatingWebhookConfiguration> =
        Api::all(h.client.clone());
    let validating: Api<
        k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration,
    > = Api::all(h.client.clone());
    let deadline = Instant::now() + WAIT;
    loop {
        let secret = secrets.get_opt("warmstart-webhook-tls").await.unwrap();
        let ca = secret
            .as_ref()
            .and_then(|s| s.data.as_ref())
            .and_then(|d| d.get("ca.crt"))
            .map(|b| b.0.clone());
        let m = mutating.get("warmstart-restore").await.unwrap();
        let v = validating
            .get("warmstart-checkpoint-validation")
            .await
            .unwrap();
        let bundles: Vec<Option<Vec<u8>>> = m
            .webhooks
            .iter()
            .flatten()
            .map(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.clone()))
            .chain(
                v.webhooks
                    .iter()
                    .flatten()
                    .map(|w| w.client_config.ca_bundle.as_ref().map(|b| b.0.clone())),
            )
            .collect();
        if ca.is_some() && bundles.len() == 2 && bundles.iter().all(|b| *b == ca) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "no Secret and injected caBundle: secret {}, bundles {bundles:?}\n{}",
            secret.is_some(),
            h.log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let written = std::fs::read_to_string(h.dir.path().join("tls-controller-0/ca.crt")).unwrap();
    assert!(written.contains("BEGIN CERTIFICATE"), "{written}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_shapes_restore_pods_and_denies_what_it_cannot_bind() {
    let h = Harness::start(true).await;
    h.create("ready", "webhook-model", json!({})).await;
    let ck = h.wait_phase("ready", CheckpointPhase::Creating).await;
    h.publish(NS, &hash_of(&ck));
    h.set_job_condition("checkpoint-ready", "Complete", "CompletionsReached", "done")
        .await;
    h.create("pending", "webhook-model-2", json!({})).await;
    h.wait_phase("pending", CheckpointPhase::Creating).await;
    let ck = h.wait_phase("ready", CheckpointPhase::Ready).await;

    let pods: Api<Pod> = Api::namespaced(h.client.clone(), NS);
    // Mutated: restore gate, control volume, binding of this exact incarnation.
    let pod = pods
        .create(
            &PostParams::default(),
            &restore_pod("r1", NS, Some("ready"), "main"),
        )
        .await
        .unwrap();
    let Some(binding) = pod.annotations().get("warmstart.dev/checkpoint-binding") else {
        panic!(
            "not mutated: {:?}\ncontroller log:\n{}",
            pod.metadata.annotations,
            h.log()
        );
    };
    assert!(
        binding.starts_with(&format!("v1/{}/1/", ck.uid().unwrap())),
        "{binding}"
    );
    let main = &pod.spec.as_ref().unwrap().containers[0];
    let probe = main.startup_probe.as_ref().unwrap().exec.as_ref().unwrap();
    assert_eq!(
        probe.command.as_ref().unwrap().last().unwrap(),
        "/warmstart-control/restore-complete"
    );
    assert!(
        pod.spec
            .as_ref()
            .unwrap()
            .volumes
            .as_ref()
            .unwrap()
            .iter()
            .any(|v| v.name == "warmstart-control")
    );

    // Unannotated pods are untouched.
    let plain = pods
        .create(&PostParams::default(), &restore_pod("plain", NS, None, ""))
        .await
        .unwrap();
    assert!(
        plain
            .annotations()
            .get("warmstart.dev/checkpoint-binding")
            .is_none()
    );
    assert!(
        plain.spec.unwrap().containers[0]
            .startup_probe
            .as_ref()
            .unwrap()
            .http_get
            .is_some()
    );

    // Denied, each with a message that names the problem; nothing is created.
    let other: Api<Pod> = Api::namespaced(h.client.clone(), "other");
    let cases = [
        (
            pods.clone(),
            restore_pod("r2", NS, Some("absent"), "main"),
            "absent",
        ),
        (
            pods.clone(),
            restore_pod("r3", NS, Some("pending"), "main"),
            "not Ready",
        ),
        (
            other.clone(),
            restore_pod("r4", "other", Some("ready"), "main"),
            "own namespace",
        ),
        (
            pods.clone(),
            restore_pod("r5", NS, Some("ready"), "main,sidecar"),
            "sidecar",
        ),
    ];
    for (api, pod, needle) in cases {
        let name = pod.name_any();
        let err = api.create(&PostParams::default(), &pod).await.unwrap_err();
        let text = err.to_string();
        assert!(text.contains(needle), "{name}: {text}");
        assert!(
            api.get_opt(&name).await.unwrap().is_none(),
            "{name} must not exist"
        );
    }
}

fn http_get(addr: std::net::SocketAddr, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status = out.split(' ').nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    (status, body)
}

/// The controller's flags for the tests' S3 server (the prefix and quick retries of
/// [`S3Server::store_config`]).
fn store_flags(server: &S3Server) -> Vec<String> {
    let path = |p: PathBuf| p.to_str().unwrap().to_owned();
    vec![
        "--s3-endpoint".into(),
        server.endpoint().to_string(),
        "--s3-bucket".into(),
        server.bucket().into(),
        "--s3-prefix".into(),
        "warm".into(),
        "--s3-access-key-id-file".into(),
        path(server.access_key_file()),
        "--s3-secret-access-key-file".into(),
        path(server.secret_key_file()),
        "--s3-retries".into(),
        "1".into(),
    ]
}

/// Waits until the controller's metrics contain `needle`.
async fn wait_metric(h: &Harness, needle: &str) {
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, metrics) = http_get(h.admin, "/metrics");
        if metrics.contains(needle) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "metrics never showed {needle}:\n{metrics}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_object_store_the_bucket_is_what_is_verified_waited_for_and_deleted() {
    let mut server = S3Server::start("artifacts").unwrap();
    let h = Harness::start_with(false, store_flags(&server)).await;
    let store = warmstart_objstore::Store::new(server.store_config()).unwrap();
    h.create("llama", "model-s3", json!({})).await;
    let ck = h.wait_phase("llama", CheckpointPhase::Creating).await;
    let hash = hash_of(&ck);
    // Uploaded as the agent does, then the volume's copy gone: only the bucket can make it
    // Ready.
    let dir = h.publish(NS, &hash);
    let uploaded = store
        .upload(&dir, NS, &hash, &warmstart_objstore::Progress::new())
        .await
        .unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    // The store unreachable when the Job completes: the Checkpoint waits, saying why, and is
    // never failed for it.
    server.stop();
    h.set_job_condition("checkpoint-llama", "Complete", "CompletionsReached", "done")
        .await;
    h.wait_event("llama", "ArtifactStoreUnavailable").await;
    let waiting = h.checkpoints(NS).get("llama").await.unwrap();
    assert_eq!(phase_of(&waiting), Some(CheckpointPhase::Creating));
    assert!(
        h.log()
            .contains("cannot verify the artifact in the object store"),
        "{}",
        h.log()
    );
    assert!(!h.log().contains(server.secret()), "the secret was logged");

    server.restart().unwrap();
    let ck = h.wait_phase("llama", CheckpointPhase::Ready).await;
    let status = ck.status.clone().unwrap();
    assert_eq!(status.storage_type.as_deref(), Some("s3"));
    let artifact = status.artifact.unwrap();
    assert_eq!(artifact.manifest_digest, uploaded.manifest.digest);
    assert_eq!(artifact.size_bytes, 8192);
    wait_metric(&h, "warmstart_artifact_bytes{store=\"s3\"} 8192").await;

    // An artifact with a file missing in the bucket fails its Checkpoint, naming the file.
    h.create("broken", "model-s3-broken", json!({})).await;
    let broken = h.wait_phase("broken", CheckpointPhase::Creating).await;
    let broken_hash = hash_of(&broken);
    let dir = h.publish(NS, &broken_hash);
    store
        .upload(&dir, NS, &broken_hash, &warmstart_objstore::Progress::new())
        .await
        .unwrap();
    server
        .delete_object(&format!("warm/{NS}/{broken_hash}/criu/pages-1.img"))
        .unwrap();
    h.set_job_condition(
        "checkpoint-broken",
        "Complete",
        "CompletionsReached",
        "done",
    )
    .await;
    let broken = h.wait_phase("broken", CheckpointPhase::Failed).await;
    let message = message_of(&broken);
    assert!(message.contains("criu/pages-1.img is missing"), "{message}");

    // Deleting the Checkpoint (policy Delete) deletes its artifact from the bucket.
    h.checkpoints(NS)
        .delete("llama", &DeleteParams::default())
        .await
        .unwrap();
    h.wait_gone("llama").await;
    let left: Vec<String> = store
        .objects()
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .filter(|k| k.contains(&hash))
        .collect();
    assert!(left.is_empty(), "left in the bucket: {left:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_endpoints_answer_and_metrics_count_reconciles() {
    let h = Harness::start(false).await;
    h.create("counted", "model-g", json!({})).await;
    h.wait_phase("counted", CheckpointPhase::Creating).await;

    assert_eq!(http_get(h.admin, "/healthz"), (200, "ok".to_owned()));
    assert_eq!(http_get(h.admin, "/readyz").0, 200);
    assert_eq!(http_get(h.admin, "/metrics").0, 200);
    for needle in [
        "warmstart_reconciles_total{result=\"ok\"}",
        "warmstart_checkpoints{phase=\"Creating\"} 1",
        "warmstart_reconcile_duration_seconds_count",
    ] {
        wait_metric(&h, needle).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_leader_reconciles_and_a_successor_takes_over() {
    let mut h = Harness::start(false).await;
    h.create("one", "model-h", json!({})).await;
    h.wait_phase("one", CheckpointPhase::Creating).await;
    let mut second = h.spawn_replica(
        "controller-1",
        free_addr().unwrap(),
        free_addr().unwrap(),
        "replica.log",
    );
    tokio::time::sleep(Duration::from_secs(2)).await;
    let leases: Api<k8s_openapi::api::coordination::v1::Lease> =
        Api::namespaced(h.client.clone(), "warmstart-system");
    let holder = |l: k8s_openapi::api::coordination::v1::Lease| l.spec.unwrap().holder_identity;
    assert_eq!(
        holder(leases.get("warmstart-controller").await.unwrap()).as_deref(),
        Some("controller-0")
    );
    let replica_log = std::fs::read_to_string(h.dir.path().join("replica.log")).unwrap();
    assert!(
        !replica_log.contains("leading"),
        "a follower does not reconcile:\n{replica_log}"
    );

    h.stop_controller();
    h.create("two", "model-i", json!({})).await;
    h.wait_phase("two", CheckpointPhase::Creating).await;
    assert_eq!(
        holder(leases.get("warmstart-controller").await.unwrap()).as_deref(),
        Some("controller-1")
    );
    let replica_log = std::fs::read_to_string(h.dir.path().join("replica.log")).unwrap();
    assert!(replica_log.contains("leading"), "{replica_log}");
    let _ = second.kill();
    let _ = second.wait();
}
