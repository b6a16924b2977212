//! The certificates in the cluster: the shared Secret, the `caBundle` of both webhook
//! configurations, the files the webhook server reads, and the renewal loop.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::{Duration, SystemTime};

use json_patch::jsonptr::PointerBuf;
use json_patch::{AddOperation, PatchOperation, TestOperation};
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MutatingWebhookConfiguration, ValidatingWebhookConfiguration,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::{Client, Resource};
use serde::de::DeserializeOwned;
use tracing::{info, warn};

use super::x509::{carry_over_ca, check, generate};
use super::*;

/// The bundle stored in `secret`.
///
/// # Errors
/// [`CertProblem::MissingKey`] or [`CertProblem::NotUtf8`].
pub fn bundle_from_secret(secret: &Secret) -> Result<CertBundle, CertProblem> {
    let data = secret.data.as_ref();
    let get = |key: &'static str| {
        let bytes = data
            .and_then(|d| d.get(key))
            .ok_or(CertProblem::MissingKey { key })?;
        String::from_utf8(bytes.0.clone()).map_err(|_| CertProblem::NotUtf8 { key })
    };
    Ok(CertBundle {
        ca_pem: get(CA_FILE)?,
        cert_pem: get(tls::CERT_FILE)?,
        key_pem: get(tls::KEY_FILE)?,
    })
}

/// The Secret `data` of a bundle.
pub fn secret_data(bundle: &CertBundle) -> BTreeMap<String, ByteString> {
    BTreeMap::from([
        (
            CA_FILE.to_owned(),
            ByteString(bundle.ca_pem.clone().into_bytes()),
        ),
        (
            tls::CERT_FILE.to_owned(),
            ByteString(bundle.cert_pem.clone().into_bytes()),
        ),
        (
            tls::KEY_FILE.to_owned(),
            ByteString(bundle.key_pem.clone().into_bytes()),
        ),
    ])
}

/// A new Secret holding `bundle`, as [`ensure`] creates it.
pub fn new_secret(settings: &CertSettings, bundle: &CertBundle) -> Secret {
    Secret {
        metadata: ObjectMeta {
            name: Some(settings.secret_name.clone()),
            namespace: Some(settings.secret_namespace.clone()),
            labels: Some(BTreeMap::from([
                (
                    "app.kubernetes.io/name".to_owned(),
                    "warmstart-controller".to_owned(),
                ),
                (
                    "app.kubernetes.io/component".to_owned(),
                    "webhook".to_owned(),
                ),
                (
                    "app.kubernetes.io/part-of".to_owned(),
                    "warmstart".to_owned(),
                ),
            ])),
            ..ObjectMeta::default()
        },
        type_: Some(SECRET_TYPE_TLS.to_owned()),
        data: Some(secret_data(bundle)),
        ..Secret::default()
    }
}

/// The JSON patch that sets the `caBundle` of every webhook in a configuration to `ca_pem`,
/// given each webhook's name and current `caBundle` in list order; `None` when all already
/// carry it.
///
/// Each `add` (which also replaces) is preceded by a `test` of that webhook's name, so the patch
/// fails rather than touch the wrong webhook if the list changed since it was read.
pub fn ca_bundle_patch(
    webhooks: &[(String, Option<Vec<u8>>)],
    ca_pem: &[u8],
) -> Option<json_patch::Patch> {
    let bundle = serde_json::to_value(ByteString(ca_pem.to_vec())).ok()?;
    let mut ops = Vec::new();
    for (index, (name, current)) in webhooks.iter().enumerate() {
        if current.as_deref() == Some(ca_pem) {
            continue;
        }
        let index = index.to_string();
        ops.push(PatchOperation::Test(TestOperation {
            path: PointerBuf::from_tokens(["webhooks", index.as_str(), "name"]),
            value: serde_json::Value::String(name.clone()),
        }));
        ops.push(PatchOperation::Add(AddOperation {
            path: PointerBuf::from_tokens(["webhooks", index.as_str(), "clientConfig", "caBundle"]),
            value: bundle.clone(),
        }));
    }
    (!ops.is_empty()).then_some(json_patch::Patch(ops))
}

/// A webhook configuration whose webhooks carry a `caBundle`.
trait WebhookConfiguration:
    Resource<DynamicType = (), Scope = k8s_openapi::ClusterResourceScope>
    + Clone
    + fmt::Debug
    + DeserializeOwned
    + serde::Serialize
{
    const KIND: &'static str;
    /// Name and current `caBundle` of each webhook, in list order.
    fn ca_bundles(&self) -> Vec<(String, Option<Vec<u8>>)>;
}

impl WebhookConfiguration for MutatingWebhookConfiguration {
    const KIND: &'static str = "MutatingWebhookConfiguration";
    fn ca_bundles(&self) -> Vec<(String, Option<Vec<u8>>)> {
        self.webhooks
            .iter()
            .flatten()
            .map(|w| {
                (
                    w.name.clone(),
                    w.client_config.ca_bundle.as_ref().map(|b| b.0.clone()),
                )
            })
            .collect()
    }
}

impl WebhookConfiguration for ValidatingWebhookConfiguration {
    const KIND: &'static str = "ValidatingWebhookConfiguration";
    fn ca_bundles(&self) -> Vec<(String, Option<Vec<u8>>)> {
        self.webhooks
            .iter()
            .flatten()
            .map(|w| {
                (
                    w.name.clone(),
                    w.client_config.ca_bundle.as_ref().map(|b| b.0.clone()),
                )
            })
            .collect()
    }
}

async fn inject<K: WebhookConfiguration>(
    client: &Client,
    name: &str,
    ca_pem: &[u8],
) -> Result<(), CertError> {
    let api = Api::<K>::all(client.clone());
    for _ in 0..MAX_ATTEMPTS {
        let config = api
            .get(name)
            .await
            .map_err(|source| CertError::ReadConfiguration {
                kind: K::KIND,
                name: name.to_owned(),
                source,
            })?;
        let Some(patch) = ca_bundle_patch(&config.ca_bundles(), ca_pem) else {
            return Ok(());
        };
        match api
            .patch(name, &PatchParams::default(), &Patch::Json::<()>(patch))
            .await
        {
            Ok(_) => {
                info!(kind = K::KIND, name, "webhook caBundle injected");
                return Ok(());
            }
            // A failed `test` (the list changed under us) or a conflict: read again.
            Err(kube::Error::Api(status)) if matches!(status.code, 409 | 422) => continue,
            Err(source) => {
                return Err(CertError::PatchConfiguration {
                    kind: K::KIND,
                    name: name.to_owned(),
                    source,
                });
            }
        }
    }
    Err(CertError::Contended {
        object: format!("{} {name}", K::KIND),
        attempts: MAX_ATTEMPTS,
    })
}

/// Sets the `caBundle` of every webhook in the two configurations `settings` names to
/// `ca_pem` (no write when they already carry it).
///
/// # Errors
/// [`CertError`] when a configuration cannot be read or patched.
pub async fn inject_ca_bundle(
    client: &Client,
    settings: &CertSettings,
    ca_pem: &[u8],
) -> Result<(), CertError> {
    inject::<MutatingWebhookConfiguration>(client, &settings.mutating_configuration, ca_pem)
        .await?;
    inject::<ValidatingWebhookConfiguration>(client, &settings.validating_configuration, ca_pem)
        .await
}

/// Writes `tls.crt`, `tls.key` (mode 0600) and `ca.crt` into `dir`, each atomically (temporary
/// file, then rename), skipping files that already hold the same bytes.
///
/// # Errors
/// [`CertError::WriteFile`].
///
/// # Caveats
/// The two files are renamed one after the other: a reload that falls between them sees a
/// mismatched pair, rejects it (keeping the previous one) and takes the new pair at its next
/// check.
pub async fn write_files(bundle: &CertBundle, dir: &Path) -> Result<(), CertError> {
    private_dir(dir).map_err(|source| CertError::WriteFile {
        path: dir.to_owned(),
        source,
    })?;
    // Key first: a pair is only ever mismatched for the instant between the two renames.
    write_file(&dir.join(tls::KEY_FILE), bundle.key_pem.as_bytes(), 0o600).await?;
    write_file(&dir.join(tls::CERT_FILE), bundle.cert_pem.as_bytes(), 0o644).await?;
    write_file(&dir.join(CA_FILE), bundle.ca_pem.as_bytes(), 0o644).await
}

/// Makes `dir` a place the private key can go: created with mode 0700 when missing (the
/// default is a fixed name under `/tmp`, which another local user could create first); an
/// existing one must be a directory, not a link, owned by this user and writable by no one
/// else, or whoever controls it could read or replace the key and certificate, or plant links.
fn private_dir(dir: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{DirBuilderExt as _, MetadataExt as _};
    if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
        std::fs::DirBuilder::new().recursive(true).create(parent)?;
    }
    match std::fs::DirBuilder::new().mode(0o700).create(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e),
    }
    let meta = std::fs::symlink_metadata(dir)?;
    let refuse = |why: String| Err(std::io::Error::other(why));
    if !meta.file_type().is_dir() {
        return refuse("it is not a directory (a symbolic link or a file)".to_owned());
    }
    let me = nix::unistd::geteuid().as_raw();
    if meta.uid() != me {
        return refuse(format!(
            "it is owned by uid {}, not by this user (uid {me})",
            meta.uid()
        ));
    }
    if meta.mode() & 0o022 != 0 {
        return refuse(format!(
            "it is writable by other users (mode {:o})",
            meta.mode() & 0o7777
        ));
    }
    Ok(())
}

async fn write_file(path: &Path, contents: &[u8], mode: u32) -> Result<(), CertError> {
    if tokio::fs::read(path).await.is_ok_and(|old| old == contents) {
        return Ok(());
    }
    let err = |source| CertError::WriteFile {
        path: path.to_owned(),
        source,
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.tmp"));
    {
        use tokio::io::AsyncWriteExt as _;
        let mut file = tokio::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(mode)
            .open(&tmp)
            .await
            .map_err(err)?;
        file.write_all(contents).await.map_err(err)?;
        file.sync_all().await.map_err(err)?;
    }
    tokio::fs::rename(&tmp, path).await.map_err(err)
}

fn is_conflict(err: &kube::Error) -> bool {
    matches!(err, kube::Error::Api(status) if status.code == 409)
}

/// Makes sure the Secret holds a valid, not-near-expiry bundle for the Service (issuing one if
/// needed), writes it to [`CertSettings::dir`] and injects its CA into both webhook
/// configurations (a failed injection is logged and retried by [`maintain`]). Returns the
/// bundle in use.
///
/// # Errors
/// [`CertError`] naming the step that failed.
///
/// # Guarantees
/// Replicas running this concurrently end with the same Secret: a lost create (409) or
/// replace (409 on the resourceVersion) re-reads and adopts the winner's bundle.
pub async fn ensure(client: &Client, settings: &CertSettings) -> Result<CertBundle, CertError> {
    let bundle = ensure_secret(client, settings).await?;
    write_files(&bundle, &settings.dir).await?;
    // The webhook configurations may be installed after the controller (or not at all, where
    // users shape pods with `render-restore-pod`): serve anyway and inject on the next check.
    if let Err(err) = inject_ca_bundle(client, settings, bundle.ca_pem.as_bytes()).await {
        warn!(
            error = %crate::errors::error_chain(&err),
            "cannot inject the webhook caBundle yet; retrying at the next certificate check"
        );
    }
    Ok(bundle)
}

async fn ensure_secret(client: &Client, settings: &CertSettings) -> Result<CertBundle, CertError> {
    let api = Api::<Secret>::namespaced(client.clone(), &settings.secret_namespace);
    let key = format!("{}/{}", settings.secret_namespace, settings.secret_name);
    let names = settings.dns_names();
    for _ in 0..MAX_ATTEMPTS {
        let now = SystemTime::now();
        let existing =
            api.get_opt(&settings.secret_name)
                .await
                .map_err(|source| CertError::ReadSecret {
                    secret: key.clone(),
                    source,
                })?;
        let write_err = |source| CertError::WriteSecret {
            secret: key.clone(),
            source,
        };
        match existing {
            None => {
                let fresh = fresh_bundle(&names, now, settings)?;
                match api
                    .create(&PostParams::default(), &new_secret(settings, &fresh))
                    .await
                {
                    Ok(_) => {
                        info!(secret = %key, "webhook certificate issued");
                        return Ok(fresh);
                    }
                    // Another replica created it first: adopt theirs.
                    Err(err) if is_conflict(&err) => continue,
                    Err(err) => return Err(write_err(err)),
                }
            }
            Some(secret) => {
                let (previous, problem) = match bundle_from_secret(&secret) {
                    Ok(bundle) => match check(&bundle, &names, now, settings.renew_before) {
                        Ok(()) => return Ok(bundle),
                        Err(problem) => (Some(bundle), problem),
                    },
                    Err(problem) => (None, problem),
                };
                let mut fresh = fresh_bundle(&names, now, settings)?;
                if let Some(previous) = &previous {
                    fresh = carry_over_ca(fresh, previous, now);
                }
                let mut updated = secret.clone();
                updated.data = Some(secret_data(&fresh));
                updated.string_data = None;
                // `resourceVersion` stays set: the replace fails with 409 if someone else
                // rotated it meanwhile.
                match api
                    .replace(&settings.secret_name, &PostParams::default(), &updated)
                    .await
                {
                    Ok(_) => {
                        info!(
                            secret = %key,
                            reason = %crate::errors::error_chain(&problem),
                            "webhook certificate renewed"
                        );
                        return Ok(fresh);
                    }
                    Err(err) if is_conflict(&err) => continue,
                    Err(err) => return Err(write_err(err)),
                }
            }
        }
    }
    Err(CertError::Contended {
        object: format!("secret {key}"),
        attempts: MAX_ATTEMPTS,
    })
}

fn fresh_bundle(
    names: &[String],
    now: SystemTime,
    settings: &CertSettings,
) -> Result<CertBundle, CertError> {
    let bundle = generate(names, now, settings.validity)?;
    check(&bundle, names, now, Duration::ZERO).map_err(CertError::Generated)?;
    Ok(bundle)
}

/// Runs [`ensure`] every `interval` until `shutdown` completes, so the certificate is renewed
/// before it expires and a renewal by another replica reaches this one's files. Failures are
/// logged and retried at the next interval: the certificate in service stays.
pub async fn maintain(
    client: Client,
    settings: CertSettings,
    interval: Duration,
    shutdown: impl std::future::Future<Output = ()> + Send,
) {
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            () = tokio::time::sleep(interval) => {}
        }
        if let Err(err) = ensure(&client, &settings).await {
            warn!(
                secret = %settings.secret_name,
                error = %crate::errors::error_chain(&err),
                "webhook certificate check failed, keeping the current one"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::certs::tests::{names, now};
    #[test]
    fn the_secret_round_trips_the_bundle() {
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let secret = new_secret(&CertSettings::default(), &bundle);
        assert_eq!(secret.type_.as_deref(), Some("kubernetes.io/tls"));
        assert_eq!(secret.metadata.name.as_deref(), Some(DEFAULT_SECRET_NAME));
        assert_eq!(
            secret.metadata.namespace.as_deref(),
            Some(DEFAULT_NAMESPACE)
        );
        assert_eq!(bundle_from_secret(&secret).unwrap(), bundle);
        let mut partial = secret.clone();
        partial.data.as_mut().unwrap().remove("tls.key");
        assert!(matches!(
            bundle_from_secret(&partial),
            Err(CertProblem::MissingKey { key: "tls.key" })
        ));
    }

    #[test]
    fn the_ca_bundle_patch_sets_only_what_differs_and_tests_names() {
        let ca = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec();
        let webhooks = vec![
            ("restore.warmstart.dev".to_owned(), None),
            ("current.warmstart.dev".to_owned(), Some(ca.clone())),
            ("stale.warmstart.dev".to_owned(), Some(b"old".to_vec())),
        ];
        let patch = ca_bundle_patch(&webhooks, &ca).unwrap();
        let json = serde_json::to_value(&patch).unwrap();
        let encoded = serde_json::to_value(ByteString(ca.clone())).unwrap();
        assert_eq!(
            json,
            serde_json::json!([
                {"op": "test", "path": "/webhooks/0/name", "value": "restore.warmstart.dev"},
                {"op": "add", "path": "/webhooks/0/clientConfig/caBundle", "value": encoded},
                {"op": "test", "path": "/webhooks/2/name", "value": "stale.warmstart.dev"},
                {"op": "add", "path": "/webhooks/2/clientConfig/caBundle", "value": encoded},
            ])
        );

        // Applied to a configuration, every webhook then carries the CA; a second pass is a
        // no-op.
        let mut config = serde_json::json!({
            "apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "MutatingWebhookConfiguration",
            "metadata": {"name": "warmstart-restore"},
            "webhooks": webhooks.iter().map(|(name, current)| serde_json::json!({
                "name": name,
                "admissionReviewVersions": ["v1"],
                "sideEffects": "None",
                "clientConfig": match current {
                    Some(b) => serde_json::json!({"caBundle": serde_json::to_value(ByteString(b.clone())).unwrap()}),
                    None => serde_json::json!({}),
                },
            })).collect::<Vec<_>>(),
        });
        json_patch::patch(&mut config, &patch).unwrap();
        let typed: MutatingWebhookConfiguration = serde_json::from_value(config).unwrap();
        assert!(
            typed
                .ca_bundles()
                .iter()
                .all(|(_, b)| b.as_deref() == Some(&ca[..]))
        );
        assert!(ca_bundle_patch(&typed.ca_bundles(), &ca).is_none());
    }

    #[test]
    fn a_reordered_list_fails_the_patch_instead_of_hitting_the_wrong_webhook() {
        let ca = b"ca".to_vec();
        let patch =
            ca_bundle_patch(&[("a".to_owned(), None), ("b".to_owned(), None)], &ca).unwrap();
        let mut config = serde_json::json!({"webhooks": [
            {"name": "b", "clientConfig": {}},
            {"name": "a", "clientConfig": {}},
        ]});
        let before = config.clone();
        assert!(json_patch::patch(&mut config, &patch).is_err());
        // json_patch applies atomically: nothing changed.
        assert_eq!(config, before);
    }

    #[tokio::test]
    async fn files_are_written_atomically_with_a_private_key() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        write_files(&bundle, dir.path()).await.unwrap();
        let read = |f: &str| std::fs::read_to_string(dir.path().join(f)).unwrap();
        assert_eq!(read("tls.crt"), bundle.cert_pem);
        assert_eq!(read("tls.key"), bundle.key_pem);
        assert_eq!(read("ca.crt"), bundle.ca_pem);
        let mode = std::fs::metadata(dir.path().join("tls.key"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        // Rewriting the same bundle leaves the files alone (no spurious reload).
        let ino = |f: &str| {
            use std::os::unix::fs::MetadataExt as _;
            std::fs::metadata(dir.path().join(f)).unwrap().ino()
        };
        let before = ino("tls.crt");
        write_files(&bundle, dir.path()).await.unwrap();
        assert_eq!(ino("tls.crt"), before);
        assert!(!dir.path().join(".tls.crt.tmp").exists());
    }

    // The default directory is a fixed name under /tmp: one another user made first, or a link
    // planted there, must not receive the key.
    #[tokio::test]
    async fn a_planted_certificate_directory_is_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let tmp = tempfile::tempdir().unwrap();
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let elsewhere = tmp.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        let link = tmp.path().join("tls");
        std::os::unix::fs::symlink(&elsewhere, &link).unwrap();
        let err = write_files(&bundle, &link).await.unwrap_err();
        assert!(
            crate::errors::error_chain(&err).contains("not a directory"),
            "{err:?}"
        );
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);

        let open = tmp.path().join("open");
        std::fs::create_dir(&open).unwrap();
        std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
        assert!(write_files(&bundle, &open).await.is_err());
        assert_eq!(std::fs::read_dir(&open).unwrap().count(), 0);

        // A missing one is created private.
        let fresh = tmp.path().join("a/fresh");
        write_files(&bundle, &fresh).await.unwrap();
        let mode = std::fs::metadata(&fresh).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o700);
    }
}
