//! The certificates themselves: a new CA and serving certificate, and the checks a stored
//! bundle must pass to be reused. No cluster I/O.

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use x509_parser::certificate::X509Certificate;
use x509_parser::error::X509Error;
use x509_parser::extensions::GeneralName;
use x509_parser::pem::Pem;

use super::*;

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

#[cfg(test)]
mod tests {
    use super::*;

    use crate::certs::tests::{names, now};

    const DAY: Duration = Duration::from_secs(24 * 3600);
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
}
