//! The webhook's serving certificate without cert-manager: a self-signed CA and a serving
//! certificate for `<service>.<namespace>.svc[.cluster.local]`, kept in one Secret
//! (`kubernetes.io/tls` layout: `ca.crt`, `tls.crt`, `tls.key`) that every replica shares,
//! written to the directory the webhook server reads (so rotation takes the same reload path
//! as a cert-manager Secret volume), and injected as `caBundle` into the two webhook
//! configurations.
//!
//! Invariants:
//! - The Secret is reused while it is valid for the service names and not within
//!   `renew_before` of expiry; otherwise a new CA and certificate replace it. The CA key is
//!   never stored: renewal makes a new CA.
//! - Concurrent replicas converge on one Secret: creation races resolve on 409 by re-reading
//!   the winner's, replacements are optimistic (resourceVersion) and retried the same way.
//! - A renewal keeps the previous CA (while it is still valid) after the new one in `ca.crt`,
//!   so the `caBundle` trusts replicas that still serve the old certificate until they reload.
//! - The `caBundle` patch is idempotent (nothing is sent when every webhook already trusts the
//!   CA) and guarded by a `test` of each webhook's name, so a reordered list is never patched
//!   at the wrong index.

mod cluster;
mod x509;

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use thiserror::Error;
use x509_parser::error::{PEMError, X509Error};

use crate::tls::{self, TlsError};

/// Default name of the Secret holding the webhook certificate.
pub const DEFAULT_SECRET_NAME: &str = "warmstart-webhook-tls";
/// Default namespace of that Secret and of the webhook Service.
pub const DEFAULT_NAMESPACE: &str = "warmstart-system";
/// Default name of the Service in front of the webhook (`deploy/controller/service.yaml`).
pub const DEFAULT_SERVICE_NAME: &str = "warmstart-controller";
/// Default name of the `MutatingWebhookConfiguration` whose `caBundle` is injected.
pub const MUTATING_CONFIGURATION: &str = "warmstart-restore";
/// Default name of the `ValidatingWebhookConfiguration` whose `caBundle` is injected.
pub const VALIDATING_CONFIGURATION: &str = "warmstart-checkpoint-validation";
/// Secret key (and file name) of the CA bundle.
pub const CA_FILE: &str = "ca.crt";
/// Type of the Secret this module creates.
pub const SECRET_TYPE_TLS: &str = "kubernetes.io/tls";
/// Default lifetime of a generated CA and certificate.
pub const DEFAULT_VALIDITY: Duration = Duration::from_secs(365 * 24 * 3600);
/// Default margin before expiry at which the certificate is renewed.
pub const DEFAULT_RENEW_BEFORE: Duration = Duration::from_secs(30 * 24 * 3600);
/// Default period of [`maintain`]'s re-check.
pub const DEFAULT_RECHECK_INTERVAL: Duration = Duration::from_secs(600);
/// Certificates start this long before their creation, for clocks that run behind.
const BACKDATE: Duration = Duration::from_secs(3600);
/// Attempts at converging on the Secret (or a configuration) when others write it too.
const MAX_ATTEMPTS: u32 = 5;
/// Common name of the generated CA.
const CA_COMMON_NAME: &str = "warmstart-webhook-ca";

/// Flags of the self-signed certificate mode (every one also readable from the environment).
#[derive(Debug, Clone, Args)]
pub struct CertArgs {
    /// Issue and rotate the webhook certificate here (self-signed CA in a Secret) instead of
    /// reading files provided by cert-manager.
    #[arg(
        id = "webhook_self_signed",
        long = "webhook-self-signed",
        env = "WARMSTART_WEBHOOK_SELF_SIGNED",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub self_signed: bool,
    /// Name of the Secret holding the certificate.
    #[arg(id = "webhook_secret", long = "webhook-secret", env = "WARMSTART_WEBHOOK_SECRET", default_value = DEFAULT_SECRET_NAME)]
    pub secret_name: String,
    /// Namespace of that Secret and of the webhook Service.
    #[arg(id = "webhook_namespace", long = "webhook-namespace", env = "POD_NAMESPACE", default_value = DEFAULT_NAMESPACE)]
    pub namespace: String,
    /// Name of the Service the API server calls.
    #[arg(id = "webhook_service", long = "webhook-service", env = "WARMSTART_WEBHOOK_SERVICE", default_value = DEFAULT_SERVICE_NAME)]
    pub service_name: String,
    /// The MutatingWebhookConfiguration whose `caBundle` is kept current.
    #[arg(id = "webhook_mutating_configuration", long = "webhook-mutating-configuration", env = "WARMSTART_WEBHOOK_MUTATING_CONFIGURATION", default_value = MUTATING_CONFIGURATION)]
    pub mutating_configuration: String,
    /// The ValidatingWebhookConfiguration whose `caBundle` is kept current.
    #[arg(id = "webhook_validating_configuration", long = "webhook-validating-configuration", env = "WARMSTART_WEBHOOK_VALIDATING_CONFIGURATION", default_value = VALIDATING_CONFIGURATION)]
    pub validating_configuration: String,
}

impl CertArgs {
    /// The settings for certificates written to `dir`.
    pub fn settings(&self, dir: PathBuf) -> CertSettings {
        CertSettings {
            secret_name: self.secret_name.clone(),
            secret_namespace: self.namespace.clone(),
            service_name: self.service_name.clone(),
            service_namespace: self.namespace.clone(),
            mutating_configuration: self.mutating_configuration.clone(),
            validating_configuration: self.validating_configuration.clone(),
            dir,
            ..CertSettings::default()
        }
    }
}

/// Where the certificate is kept and for which names it is issued.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CertSettings {
    /// Name of the Secret.
    pub secret_name: String,
    /// Namespace of the Secret.
    pub secret_namespace: String,
    /// Name of the webhook Service.
    pub service_name: String,
    /// Namespace of the webhook Service.
    pub service_namespace: String,
    /// The MutatingWebhookConfiguration whose `caBundle` is injected.
    pub mutating_configuration: String,
    /// The ValidatingWebhookConfiguration whose `caBundle` is injected.
    pub validating_configuration: String,
    /// Directory the webhook server reads `tls.crt` and `tls.key` from.
    pub dir: PathBuf,
    /// Lifetime of a new CA and certificate.
    pub validity: Duration,
    /// Renew when the certificate expires sooner than this.
    pub renew_before: Duration,
}

impl Default for CertSettings {
    fn default() -> Self {
        Self {
            secret_name: DEFAULT_SECRET_NAME.to_owned(),
            secret_namespace: DEFAULT_NAMESPACE.to_owned(),
            service_name: DEFAULT_SERVICE_NAME.to_owned(),
            service_namespace: DEFAULT_NAMESPACE.to_owned(),
            mutating_configuration: MUTATING_CONFIGURATION.to_owned(),
            validating_configuration: VALIDATING_CONFIGURATION.to_owned(),
            dir: PathBuf::from(crate::tls::DEFAULT_CERT_DIR),
            validity: DEFAULT_VALIDITY,
            renew_before: DEFAULT_RENEW_BEFORE,
        }
    }
}

impl CertSettings {
    /// The names the API server may use for the Service: `<service>.<namespace>.svc` and
    /// `<service>.<namespace>.svc.cluster.local`.
    pub fn dns_names(&self) -> Vec<String> {
        let base = format!("{}.{}.svc", self.service_name, self.service_namespace);
        vec![format!("{base}.cluster.local"), base]
    }
}

/// The PEM material of the webhook's TLS, as stored in the Secret.
#[derive(Clone, PartialEq, Eq)]
pub struct CertBundle {
    /// CA certificates: the issuer of `cert_pem` first, then possibly the previous CA.
    pub ca_pem: String,
    /// The serving certificate.
    pub cert_pem: String,
    /// The serving certificate's private key (PKCS#8).
    pub key_pem: String,
}

impl fmt::Debug for CertBundle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CertBundle")
            .field("ca_pem", &self.ca_pem)
            .field("cert_pem", &self.cert_pem)
            .field("key_pem", &"<redacted>")
            .finish()
    }
}

/// Why the certificate could not be issued, stored, written or injected.
#[derive(Debug, Error)]
pub enum CertError {
    /// rcgen failed.
    #[error("cannot generate the webhook {what}")]
    Generate {
        /// `CA` or `serving certificate`.
        what: &'static str,
        /// rcgen's reason.
        #[source]
        source: rcgen::Error,
    },
    /// A validity bound is outside what a certificate can hold.
    #[error("the webhook certificate's {bound} is out of range")]
    Time {
        /// `notBefore` or `notAfter`.
        bound: &'static str,
    },
    /// The Secret could not be read.
    #[error("cannot read secret {secret}")]
    ReadSecret {
        /// `<namespace>/<name>`.
        secret: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// The Secret could not be created or replaced.
    #[error("cannot write secret {secret}")]
    WriteSecret {
        /// `<namespace>/<name>`.
        secret: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// Others kept changing the Secret or a configuration.
    #[error("{object} kept changing while it was being updated ({attempts} attempts)")]
    Contended {
        /// What was being written.
        object: String,
        /// How many attempts were made.
        attempts: u32,
    },
    /// A certificate file could not be written.
    #[error("cannot write {path}")]
    WriteFile {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// A freshly generated bundle fails its own check (a bug).
    #[error("the generated webhook certificate is not valid")]
    Generated(#[source] CertProblem),
    /// A webhook configuration could not be read.
    #[error("cannot read {kind} {name}")]
    ReadConfiguration {
        /// `MutatingWebhookConfiguration` or `ValidatingWebhookConfiguration`.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
    /// A webhook configuration could not be patched.
    #[error("cannot patch the caBundle of {kind} {name}")]
    PatchConfiguration {
        /// `MutatingWebhookConfiguration` or `ValidatingWebhookConfiguration`.
        kind: &'static str,
        /// Its name.
        name: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

/// Why a stored bundle is not reused.
#[derive(Debug, Error)]
pub enum CertProblem {
    /// A Secret key is absent.
    #[error("secret has no {key}")]
    MissingKey {
        /// The key.
        key: &'static str,
    },
    /// A Secret value is not UTF-8 PEM.
    #[error("{key} is not UTF-8")]
    NotUtf8 {
        /// The key.
        key: &'static str,
    },
    /// A PEM block cannot be decoded.
    #[error("{what} is not valid PEM")]
    Pem {
        /// `ca.crt` or `tls.crt`.
        what: &'static str,
        /// The decoder's reason.
        #[source]
        source: PEMError,
    },
    /// A file holds no certificate.
    #[error("{what} holds no certificate")]
    NoCertificate {
        /// `ca.crt` or `tls.crt`.
        what: &'static str,
    },
    /// A certificate cannot be parsed.
    #[error("{what} is not a valid X.509 certificate")]
    Certificate {
        /// `ca.crt` or `tls.crt`.
        what: &'static str,
        /// The parser's reason.
        #[source]
        source: X509Error,
    },
    /// The first certificate of `ca.crt` is not a CA.
    #[error("the first certificate of ca.crt is not a CA")]
    NotCa,
    /// The serving certificate was not issued by the CA.
    #[error("tls.crt is not signed by the CA in ca.crt")]
    NotSignedByCa(#[source] X509Error),
    /// The serving certificate's issuer is not the CA's subject.
    #[error("tls.crt names issuer {issuer}, the CA is {ca}")]
    IssuerMismatch {
        /// The certificate's issuer.
        issuer: String,
        /// The CA's subject.
        ca: String,
    },
    /// A service name is not among the certificate's DNS names.
    #[error("tls.crt is not valid for {name} (it names {names:?})")]
    MissingName {
        /// The missing name.
        name: String,
        /// The DNS names it has.
        names: Vec<String>,
    },
    /// A certificate is not valid yet.
    #[error("the {what} is not valid before {not_before}")]
    NotYetValid {
        /// `CA` or `serving certificate`.
        what: &'static str,
        /// Its notBefore.
        not_before: String,
    },
    /// A certificate expires within the renewal window (or has expired).
    #[error("the {what} expires at {not_after}, within the renewal window")]
    ExpiresSoon {
        /// `CA` or `serving certificate`.
        what: &'static str,
        /// Its notAfter.
        not_after: String,
    },
    /// The server could not serve the pair (bad key, key of another certificate).
    #[error("tls.crt and tls.key cannot be served")]
    Serve(#[source] TlsError),
}

pub use cluster::{
    bundle_from_secret, ca_bundle_patch, ensure, inject_ca_bundle, maintain, new_secret,
    secret_data, write_files,
};
pub use x509::{carry_over_ca, check, generate};

#[cfg(test)]
mod tests {
    use super::*;

    /// The default service's DNS names (shared with the submodules' tests).
    pub(crate) fn names() -> Vec<String> {
        CertSettings::default().dns_names()
    }

    pub(crate) fn now() -> SystemTime {
        SystemTime::now()
    }
    use std::path::Path;
    use std::time::SystemTime;
    #[test]
    fn service_names_cover_both_cluster_spellings() {
        assert_eq!(
            names(),
            vec![
                "warmstart-controller.warmstart-system.svc.cluster.local".to_owned(),
                "warmstart-controller.warmstart-system.svc".to_owned(),
            ]
        );
    }

    #[test]
    fn the_bundle_is_redacted_in_debug_output() {
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let text = format!("{bundle:?}");
        assert!(!text.contains("PRIVATE KEY"));
        assert!(text.contains("<redacted>"));
    }

    fn manifest(path: &str) -> Vec<serde_json::Value> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy")
            .join(path);
        let text = std::fs::read_to_string(&path).unwrap();
        serde_norway::Deserializer::from_str(&text)
            .map(|doc| serde::Deserialize::deserialize(doc).unwrap())
            .collect()
    }

    #[test]
    fn the_manifests_name_what_the_code_uses() {
        use crate::webhook::server::{PATH_MUTATE_PODS, PATH_VALIDATE_CHECKPOINTS};
        for (file, name, path) in [
            (
                "webhook/mutating.yaml",
                MUTATING_CONFIGURATION,
                PATH_MUTATE_PODS,
            ),
            (
                "webhook/validating.yaml",
                VALIDATING_CONFIGURATION,
                PATH_VALIDATE_CHECKPOINTS,
            ),
        ] {
            let docs = manifest(file);
            assert_eq!(docs[0]["metadata"]["name"], name, "{file}");
            for webhook in docs[0]["webhooks"].as_array().unwrap() {
                let service = &webhook["clientConfig"]["service"];
                assert_eq!(service["name"], DEFAULT_SERVICE_NAME, "{file}");
                assert_eq!(service["namespace"], DEFAULT_NAMESPACE, "{file}");
                assert_eq!(service["path"], path, "{file}");
                assert_eq!(service["port"], 443, "{file}");
            }
        }
        let rbac = manifest("rbac/controller.yaml");
        let role = rbac
            .iter()
            .find(|d| d["kind"] == "Role" && d["metadata"]["namespace"] == DEFAULT_NAMESPACE)
            .unwrap();
        let secrets: Vec<&serde_json::Value> = role["rules"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["resources"] == serde_json::json!(["secrets"]))
            .collect();
        let by_name = secrets
            .iter()
            .find(|r| r["resourceNames"] == serde_json::json!([DEFAULT_SECRET_NAME]))
            .expect("a rule for the certificate Secret by name");
        for verb in ["get", "update"] {
            assert!(by_name["verbs"].as_array().unwrap().contains(&verb.into()));
        }
        assert!(
            secrets
                .iter()
                .any(|r| r["verbs"] == serde_json::json!(["create"]))
        );
        for (kind, name) in [
            ("mutatingwebhookconfigurations", MUTATING_CONFIGURATION),
            ("validatingwebhookconfigurations", VALIDATING_CONFIGURATION),
        ] {
            let cluster_role = rbac.iter().find(|d| d["kind"] == "ClusterRole").unwrap();
            let rule = cluster_role["rules"]
                .as_array()
                .unwrap()
                .iter()
                .find(|r| r["resources"] == serde_json::json!([kind]))
                .unwrap();
            assert_eq!(rule["resourceNames"], serde_json::json!([name]));
            for verb in ["get", "patch"] {
                assert!(rule["verbs"].as_array().unwrap().contains(&verb.into()));
            }
        }
        let service = manifest("controller/service.yaml");
        assert_eq!(service[0]["metadata"]["name"], DEFAULT_SERVICE_NAME);
    }
}
