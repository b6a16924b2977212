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

use std::collections::BTreeMap;
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Args;
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
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use serde::de::DeserializeOwned;
use thiserror::Error;
use tracing::{info, warn};
use x509_parser::certificate::X509Certificate;
use x509_parser::error::{PEMError, X509Error};
use x509_parser::extensions::GeneralName;
use x509_parser::pem::Pem;

use crate::webhook::tls::{self, TlsError};

/// Default name of the Secret holding the webhook certificate.
pub const DEFAULT_SECRET_NAME: &str = "warmstart-webhook-tls";
/// Default namespace of that Secret and of the webhook Service.
pub const DEFAULT_NAMESPACE: &str = "warmstart-system";
/// Default name of the Service in front of the webhook (`deploy/controller/service.yaml`).
pub const DEFAULT_SERVICE_NAME: &str = "warmstart-controller";
/// The `MutatingWebhookConfiguration` whose `caBundle` is injected.
pub const MUTATING_CONFIGURATION: &str = "warmstart-restore";
/// The `ValidatingWebhookConfiguration` whose `caBundle` is injected.
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
}

impl CertArgs {
    /// The settings for certificates written to `dir`.
    pub fn settings(&self, dir: PathBuf) -> CertSettings {
        CertSettings {
            secret_name: self.secret_name.clone(),
            secret_namespace: self.namespace.clone(),
            service_name: self.service_name.clone(),
            service_namespace: self.namespace.clone(),
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
            dir: PathBuf::from(crate::webhook::server::DEFAULT_CERT_DIR),
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

/// Issues a new self-signed CA and a serving certificate for `dns_names`, valid from `now`
/// (back-dated an hour) for `validity`.
///
/// # Errors
/// [`CertError::Generate`] or [`CertError::Time`].
pub fn generate(
    dns_names: &[String],
    now: SystemTime,
    validity: Duration,
) -> Result<CertBundle, CertError> {
    let not_before = offset_time(now.checked_sub(BACKDATE), "notBefore")?;
    let not_after = offset_time(now.checked_add(validity), "notAfter")?;
    let ca_err = |source| CertError::Generate { what: "CA", source };
    let leaf_err = |source| CertError::Generate {
        what: "serving certificate",
        source,
    };

    let ca_key = KeyPair::generate().map_err(ca_err)?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name = rcgen::DistinguishedName::new();
    ca.distinguished_name
        .push(DnType::CommonName, CA_COMMON_NAME);
    // Path length 0: this CA signs serving certificates only, never another CA.
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    ca.not_before = not_before;
    ca.not_after = not_after;
    let ca_cert = ca.self_signed(&ca_key).map_err(ca_err)?;
    let issuer = Issuer::new(ca, ca_key);

    let key = KeyPair::generate().map_err(leaf_err)?;
    let mut leaf = CertificateParams::new(dns_names.to_vec()).map_err(leaf_err)?;
    leaf.distinguished_name = rcgen::DistinguishedName::new();
    if let Some(first) = dns_names.first() {
        leaf.distinguished_name
            .push(DnType::CommonName, first.as_str());
    }
    leaf.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    leaf.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    leaf.use_authority_key_identifier_extension = true;
    leaf.not_before = not_before;
    leaf.not_after = not_after;
    let cert = leaf.signed_by(&key, &issuer).map_err(leaf_err)?;

    Ok(CertBundle {
        ca_pem: ca_cert.pem(),
        cert_pem: cert.pem(),
        key_pem: key.serialize_pem(),
    })
}

fn offset_time(
    t: Option<SystemTime>,
    bound: &'static str,
) -> Result<time::OffsetDateTime, CertError> {
    let secs = t
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .and_then(|d| i64::try_from(d.as_secs()).ok())
        .ok_or(CertError::Time { bound })?;
    time::OffsetDateTime::from_unix_timestamp(secs).map_err(|_| CertError::Time { bound })
}

fn unix_seconds(t: SystemTime) -> i64 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        Err(before) => i64::try_from(before.duration().as_secs()).map_or(i64::MIN, |s| -s),
    }
}

fn pems(what: &'static str, text: &str) -> Result<Vec<Pem>, CertProblem> {
    let pems = Pem::iter_from_buffer(text.as_bytes())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| CertProblem::Pem { what, source })?;
    if pems.is_empty() {
        return Err(CertProblem::NoCertificate { what });
    }
    Ok(pems)
}

fn parse<'a>(what: &'static str, pem: &'a Pem) -> Result<X509Certificate<'a>, CertProblem> {
    pem.parse_x509().map_err(|err| CertProblem::Certificate {
        what,
        source: match err {
            x509_parser::nom::Err::Error(e) | x509_parser::nom::Err::Failure(e) => e,
            x509_parser::nom::Err::Incomplete(_) => X509Error::InvalidCertificate,
        },
    })
}

/// Refuses a certificate not valid at `now` or expiring within `renew_before` of it.
fn check_window(
    what: &'static str,
    cert: &X509Certificate<'_>,
    now: SystemTime,
    renew_before: Duration,
) -> Result<(), CertProblem> {
    let validity = cert.validity();
    let now = unix_seconds(now);
    if now < validity.not_before.timestamp() {
        return Err(CertProblem::NotYetValid {
            what,
            not_before: validity.not_before.to_string(),
        });
    }
    let margin = i64::try_from(renew_before.as_secs()).unwrap_or(i64::MAX);
    if now.saturating_add(margin) >= validity.not_after.timestamp() {
        return Err(CertProblem::ExpiresSoon {
            what,
            not_after: validity.not_after.to_string(),
        });
    }
    Ok(())
}

/// Checks that `bundle` can be served for `dns_names` at `now` and need not be renewed yet:
/// the first certificate of `ca.crt` is a CA, it signed `tls.crt`, `tls.crt` names every one
/// of `dns_names`, neither expires within `renew_before`, and `tls.key` is `tls.crt`'s key.
///
/// # Errors
/// The first [`CertProblem`] found.
pub fn check(
    bundle: &CertBundle,
    dns_names: &[String],
    now: SystemTime,
    renew_before: Duration,
) -> Result<(), CertProblem> {
    let ca_pems = pems(CA_FILE, &bundle.ca_pem)?;
    let ca_pem = ca_pems
        .first()
        .ok_or(CertProblem::NoCertificate { what: CA_FILE })?;
    let ca = parse(CA_FILE, ca_pem)?;
    if !ca.is_ca() {
        return Err(CertProblem::NotCa);
    }
    check_window("CA", &ca, now, renew_before)?;

    let leaf_pems = pems(tls::CERT_FILE, &bundle.cert_pem)?;
    let leaf_pem = leaf_pems.first().ok_or(CertProblem::NoCertificate {
        what: tls::CERT_FILE,
    })?;
    let leaf = parse(tls::CERT_FILE, leaf_pem)?;
    if leaf.issuer() != ca.subject() {
        return Err(CertProblem::IssuerMismatch {
            issuer: leaf.issuer().to_string(),
            ca: ca.subject().to_string(),
        });
    }
    leaf.verify_signature(Some(ca.public_key()))
        .map_err(CertProblem::NotSignedByCa)?;
    check_window("serving certificate", &leaf, now, renew_before)?;

    let names = dns_names_of(&leaf)?;
    if let Some(missing) = dns_names.iter().find(|n| !names.contains(n)) {
        return Err(CertProblem::MissingName {
            name: missing.clone(),
            names,
        });
    }
    tls::certified_key(
        bundle.cert_pem.as_bytes(),
        bundle.key_pem.as_bytes(),
        Path::new(tls::CERT_FILE),
        Path::new(tls::KEY_FILE),
    )
    .map_err(CertProblem::Serve)?;
    Ok(())
}

fn dns_names_of(cert: &X509Certificate<'_>) -> Result<Vec<String>, CertProblem> {
    let san = cert
        .subject_alternative_name()
        .map_err(|source| CertProblem::Certificate {
            what: tls::CERT_FILE,
            source,
        })?;
    Ok(san
        .map(|ext| {
            ext.value
                .general_names
                .iter()
                .filter_map(|n| match n {
                    GeneralName::DNSName(name) => Some((*name).to_owned()),
                    _ => None,
                })
                .collect()
        })
        .unwrap_or_default())
}

/// Appends the CA of `previous` to `fresh`'s CA bundle when it differs and is still valid at
/// `now`, so clients trust both certificates while replicas switch over. Only one previous CA
/// is kept.
pub fn carry_over_ca(mut fresh: CertBundle, previous: &CertBundle, now: SystemTime) -> CertBundle {
    let Some(block) = first_pem_block(&previous.ca_pem) else {
        return fresh;
    };
    let Ok(old) = pems(CA_FILE, block) else {
        return fresh;
    };
    let Some(old) = old.first() else {
        return fresh;
    };
    let still_valid = parse(CA_FILE, old)
        .is_ok_and(|ca| ca.is_ca() && check_window("CA", &ca, now, Duration::ZERO).is_ok());
    let is_fresh = pems(CA_FILE, &fresh.ca_pem)
        .is_ok_and(|new| new.first().is_some_and(|new| new.contents == old.contents));
    if still_valid && !is_fresh {
        if !fresh.ca_pem.ends_with('\n') {
            fresh.ca_pem.push('\n');
        }
        fresh.ca_pem.push_str(block);
        fresh.ca_pem.push('\n');
    }
    fresh
}

/// The text of the first PEM certificate in `text`, markers included.
fn first_pem_block(text: &str) -> Option<&str> {
    const BEGIN: &str = "-----BEGIN CERTIFICATE-----";
    const END: &str = "-----END CERTIFICATE-----";
    let start = text.find(BEGIN)?;
    let end = start + text.get(start..)?.find(END)? + END.len();
    text.get(start..end)
}

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

/// Sets the `caBundle` of every webhook in `warmstart-restore` and
/// `warmstart-checkpoint-validation` to `ca_pem` (no write when they already carry it).
///
/// # Errors
/// [`CertError`] when a configuration cannot be read or patched.
pub async fn inject_ca_bundle(client: &Client, ca_pem: &[u8]) -> Result<(), CertError> {
    inject::<MutatingWebhookConfiguration>(client, MUTATING_CONFIGURATION, ca_pem).await?;
    inject::<ValidatingWebhookConfiguration>(client, VALIDATING_CONFIGURATION, ca_pem).await
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
    tokio::fs::create_dir_all(dir)
        .await
        .map_err(|source| CertError::WriteFile {
            path: dir.to_owned(),
            source,
        })?;
    // Key first: a pair is only ever mismatched for the instant between the two renames.
    write_file(&dir.join(tls::KEY_FILE), bundle.key_pem.as_bytes(), 0o600).await?;
    write_file(&dir.join(tls::CERT_FILE), bundle.cert_pem.as_bytes(), 0o644).await?;
    write_file(&dir.join(CA_FILE), bundle.ca_pem.as_bytes(), 0o644).await
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
    if let Err(err) = inject_ca_bundle(client, bundle.ca_pem.as_bytes()).await {
        warn!(
            error = %crate::webhook::error_chain(&err),
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
                            reason = %crate::webhook::error_chain(&problem),
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
                error = %crate::webhook::error_chain(&err),
                "webhook certificate check failed, keeping the current one"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> Vec<String> {
        CertSettings::default().dns_names()
    }

    fn now() -> SystemTime {
        SystemTime::now()
    }

    const DAY: Duration = Duration::from_secs(24 * 3600);

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
    fn a_generated_bundle_is_valid_for_the_service_names() {
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        check(&bundle, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap();

        let ca_pems = pems(CA_FILE, &bundle.ca_pem).unwrap();
        let ca = parse(CA_FILE, &ca_pems[0]).unwrap();
        assert!(ca.is_ca());
        let leaf_pems = pems(tls::CERT_FILE, &bundle.cert_pem).unwrap();
        let leaf = parse(tls::CERT_FILE, &leaf_pems[0]).unwrap();
        assert!(!leaf.is_ca());
        leaf.verify_signature(Some(ca.public_key())).unwrap();
        let mut sans = dns_names_of(&leaf).unwrap();
        sans.sort();
        let mut want = names();
        want.sort();
        assert_eq!(sans, want);
        let eku = leaf.extended_key_usage().unwrap().unwrap();
        assert!(eku.value.server_auth);
    }

    #[test]
    fn another_service_name_is_refused() {
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let other = CertSettings {
            service_name: "elsewhere".to_owned(),
            ..CertSettings::default()
        };
        let err = check(&bundle, &other.dns_names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        assert!(
            matches!(&err, CertProblem::MissingName { name, .. } if name.starts_with("elsewhere.")),
            "{err:?}"
        );
    }

    #[test]
    fn a_bundle_near_expiry_is_renewed() {
        let bundle = generate(&names(), now(), 20 * DAY).unwrap();
        check(&bundle, &names(), now(), 10 * DAY).unwrap();
        let err = check(&bundle, &names(), now(), 30 * DAY).unwrap_err();
        assert!(matches!(err, CertProblem::ExpiresSoon { .. }), "{err:?}");
        // Expired outright.
        let later = now() + 21 * DAY;
        let err = check(&bundle, &names(), later, Duration::ZERO).unwrap_err();
        assert!(matches!(err, CertProblem::ExpiresSoon { .. }), "{err:?}");
    }

    #[test]
    fn a_bundle_from_the_future_is_refused() {
        let bundle = generate(&names(), now() + 10 * DAY, DEFAULT_VALIDITY).unwrap();
        let err = check(&bundle, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        assert!(matches!(err, CertProblem::NotYetValid { .. }), "{err:?}");
    }

    #[test]
    fn a_certificate_of_another_ca_is_refused() {
        let a = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let b = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let mixed = CertBundle {
            ca_pem: a.ca_pem.clone(),
            ..b
        };
        let err = check(&mixed, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        // Same subject (our CA's name), different key: the signature gives it away.
        assert!(matches!(err, CertProblem::NotSignedByCa(_)), "{err:?}");
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let a = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let b = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let mixed = CertBundle {
            key_pem: b.key_pem,
            ..a
        };
        let err = check(&mixed, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        assert!(matches!(err, CertProblem::Serve(_)), "{err:?}");
    }

    #[test]
    fn a_leaf_as_ca_is_refused() {
        let a = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let mixed = CertBundle {
            ca_pem: a.cert_pem.clone(),
            ..a
        };
        let err = check(&mixed, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        assert!(matches!(err, CertProblem::NotCa), "{err:?}");
    }

    #[test]
    fn garbage_is_refused() {
        let a = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let mixed = CertBundle {
            cert_pem: "nothing here".to_owned(),
            ..a
        };
        let err = check(&mixed, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap_err();
        assert!(matches!(err, CertProblem::NoCertificate { .. }), "{err:?}");
    }

    #[test]
    fn a_renewal_keeps_trusting_the_previous_ca() {
        let old = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let fresh = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let merged = carry_over_ca(fresh.clone(), &old, now());
        let cas = pems(CA_FILE, &merged.ca_pem).unwrap();
        assert_eq!(cas.len(), 2);
        assert_eq!(
            cas[1].contents,
            pems(CA_FILE, &old.ca_pem).unwrap()[0].contents
        );
        // The new CA stays first and signs the serving certificate.
        check(&merged, &names(), now(), DEFAULT_RENEW_BEFORE).unwrap();
        // Only one previous CA is carried, and never the fresh one twice.
        let again = carry_over_ca(fresh.clone(), &merged, now());
        assert_eq!(pems(CA_FILE, &again.ca_pem).unwrap().len(), 1);
        let next = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let rotated = carry_over_ca(next, &merged, now());
        assert_eq!(pems(CA_FILE, &rotated.ca_pem).unwrap().len(), 2);
    }

    #[test]
    fn an_expired_previous_ca_is_dropped() {
        let old = generate(&names(), now() - 400 * DAY, DEFAULT_VALIDITY).unwrap();
        let fresh = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let merged = carry_over_ca(fresh.clone(), &old, now());
        assert_eq!(merged, fresh);
    }

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
    fn the_bundle_is_redacted_in_debug_output() {
        let bundle = generate(&names(), now(), DEFAULT_VALIDITY).unwrap();
        let text = format!("{bundle:?}");
        assert!(!text.contains("PRIVATE KEY"));
        assert!(text.contains("<redacted>"));
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
}
