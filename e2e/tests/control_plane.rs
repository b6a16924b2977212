//! The tests' control plane (`warmstart_e2e::control_plane`): upstream etcd, kube-apiserver and
//! kube-controller-manager start on loopback, serve, and leave nothing behind; a ServiceAccount
//! client has exactly what `deploy/rbac` grants, and the audit log names what RBAC refused.

// An integration-test crate: every function is test code.
#![allow(clippy::tests_outside_test_module, clippy::unwrap_used)]

use k8s_openapi::api::core::v1::{Pod, Secret};
use kube::Api;
use kube::api::ListParams;
use warmstart_e2e::cluster::{DEPLOY_NAMESPACE, install_crd, install_rbac, requests_outside_rbac};
use warmstart_e2e::control_plane::ControlPlane;
use warmstart_shared::Checkpoint;

#[tokio::test]
async fn the_control_plane_serves_and_leaves_nothing_behind() {
    let started = std::time::Instant::now();
    let plane = ControlPlane::start().await.unwrap();
    eprintln!("control plane ready in {:?}", started.elapsed());
    let version = plane.client().apiserver_version().await.unwrap();
    assert_eq!(version.major, "1");
    let pids = plane.pids();
    let dir = plane.dir().to_owned();
    assert_eq!(pids.len(), 3);
    drop(plane);
    for pid in pids {
        assert!(
            !std::path::Path::new(&format!("/proc/{pid}")).exists(),
            "process {pid} outlived the control plane"
        );
    }
    assert!(!dir.exists(), "{} left behind", dir.display());
}

#[tokio::test]
async fn the_programs_service_accounts_get_exactly_what_deploy_rbac_grants() {
    let mut plane = ControlPlane::start().await.unwrap();
    install_crd(&mut plane, &["default"]).await.unwrap();
    install_rbac(&mut plane).await.unwrap();
    let agent = plane
        .service_account_client(DEPLOY_NAMESPACE, "warmstart-agent")
        .await
        .unwrap();
    // Granted: reading Checkpoints and pods everywhere.
    Api::<Checkpoint>::all(agent.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    Api::<Pod>::all(agent.clone())
        .list(&ListParams::default())
        .await
        .unwrap();
    // Not granted: Secrets.
    let err = Api::<Secret>::namespaced(agent, "default")
        .list(&ListParams::default())
        .await
        .unwrap_err();
    assert!(
        matches!(&err, kube::Error::Api(e) if e.code == 403),
        "{err}"
    );
    assert_eq!(
        requests_outside_rbac(&plane, "warmstart-agent").unwrap(),
        vec!["list core/secrets default/".to_owned()]
    );
}
