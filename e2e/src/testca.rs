//! A throw-away certificate authority for the tests' control plane: it signs the API server's
//! serving certificate, the client certificates of the admin and the controller-manager, and
//! the serving certificates of webhooks (for `<service>.<namespace>.svc`, `localhost`,
//! `127.0.0.1`), and gives the `caBundle` a webhook configuration carries. Test infrastructure
//! only.

use rcgen::{BasicConstraints, CertificateParams, CertifiedIssuer, IsCa, KeyPair, KeyUsagePurpose};

/// Why a certificate could not be made.
#[derive(Debug, thiserror::Error)]
#[error("generating a test certificate")]
pub struct CertError(#[from] rcgen::Error);

/// A CA that signs serving certificates.
#[derive(Debug)]
pub struct TestCa {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A serving certificate and its key, PEM-encoded.
#[derive(Clone, Debug)]
pub struct ServingCert {
    /// The certificate (PEM).
    pub cert_pem: String,
    /// The PKCS#8 private key (PEM).
    pub key_pem: String,
    /// The certificate (DER).
    pub cert_der: Vec<u8>,
    /// The PKCS#8 private key (DER).
    pub key_der: Vec<u8>,
}

impl TestCa {
    /// A new CA with a fresh key.
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn new() -> Result<Self, CertError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "warmstart test CA");
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate()?)?;
        Ok(Self { issuer })
    }

    /// The CA certificate (PEM).
    pub fn cert_pem(&self) -> String {
        self.issuer.pem()
    }

    /// The `caBundle` of a webhook configuration: the base64 of the CA certificate PEM.
    pub fn ca_bundle(&self) -> String {
        // k8s-openapi's ByteString serialises as the base64 the API carries.
        match serde_json::to_value(k8s_openapi::ByteString(self.cert_pem().into_bytes())) {
            Ok(serde_json::Value::String(encoded)) => encoded,
            _ => String::new(),
        }
    }

    /// Issue a serving certificate for `names` (DNS names or IP addresses).
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn issue(&self, names: &[&str]) -> Result<ServingCert, CertError> {
        let names: Vec<String> = names.iter().map(|n| (*n).to_owned()).collect();
        let mut params = CertificateParams::new(names)?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "warmstart test webhook");
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(ServingCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    }
}

impl TestCa {
    /// Issue a client certificate for user `common_name` in group `organization` (how
    /// kube-apiserver's x509 authenticator reads a certificate).
    ///
    /// # Errors
    /// When key generation or signing fails.
    pub fn issue_client(
        &self,
        common_name: &str,
        organization: Option<&str>,
    ) -> Result<ServingCert, CertError> {
        let mut params = CertificateParams::new(Vec::<String>::new())?;
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, common_name);
        if let Some(org) = organization {
            params
                .distinguished_name
                .push(rcgen::DnType::OrganizationName, org);
        }
        params.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate()?;
        let cert = params.signed_by(&key, &self.issuer)?;
        Ok(ServingCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
            cert_der: cert.der().to_vec(),
            key_der: key.serialize_der(),
        })
    }
}
