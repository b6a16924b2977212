//! The checkpoint binding (contract): `v1/<checkpoint uid>/<generation>/<digest>`.
//!
//! It pins a restore pod to one exact incarnation of one Ready checkpoint's artifact. The digest
//! is the lowercase hex SHA-256 of the canonical JSON of `{identityHash, location,
//! manifestDigest, name, namespace}` (keys sorted, no whitespace), so a deleted-and-recreated
//! checkpoint (new uid) or a replaced artifact (new manifest digest) no longer matches.
//!
//! The generation is recorded (the wire format keeps it, for the record of which spec was
//! current at admission) but not verified: edits that do not change the artifact
//! (`deletionPolicy`, the Job template after `Ready`) bump it, and must not unbind the restore
//! pods of a checkpoint that still holds the same artifact.
//!
//! The subject holds strings only, taken as they are from the checkpoint: the digest never
//! depends on how a number is written or read back (the manifest digest it includes is itself
//! defined over the manifest's text, see [`crate::artifact::Manifest::seal`]).

use std::fmt;
use std::str::FromStr;

use kube::ResourceExt;
use serde::Serialize;
use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::v1alpha1::Checkpoint;

/// The only binding format version.
pub const BINDING_VERSION: &str = "v1";

/// A parsed, well-formed checkpoint binding.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Binding {
    /// `metadata.uid` of the checkpoint.
    pub uid: String,
    /// `metadata.generation` of the checkpoint (1 or more).
    pub generation: i64,
    /// Digest of the [`BindingSubject`] (64 lowercase hex characters).
    pub digest: String,
}

/// What the binding digest covers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BindingSubject {
    // Field order is the canonical (sorted) key order of the digested JSON; keep it sorted.
    /// `status.identityHash`.
    pub identity_hash: String,
    /// `status.location`.
    pub location: String,
    /// `status.artifact.manifestDigest`.
    pub manifest_digest: String,
    /// `metadata.name`.
    pub name: String,
    /// `metadata.namespace`.
    pub namespace: String,
}

impl BindingSubject {
    /// Lowercase hex SHA-256 of the canonical JSON of the subject.
    pub fn digest(&self) -> String {
        // Serialising a struct of strings cannot fail; fall back to an empty document (which
        // can never match a real digest) rather than panic.
        let json = serde_json::to_vec(self).unwrap_or_default();
        hex::encode(Sha256::digest(&json))
    }
}

/// Why a binding string is not well formed, or cannot be made for a checkpoint.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum BindingError {
    /// Not four `/`-separated parts.
    #[error(
        "checkpoint binding {value:?} has {parts} parts: expected 4 (v1/<uid>/<generation>/<digest>)"
    )]
    PartCount {
        /// The binding as given.
        value: String,
        /// How many parts it has.
        parts: usize,
    },
    /// First part is not `v1`.
    #[error("checkpoint binding version {version:?} is not supported: expected \"v1\"")]
    Version {
        /// The version part.
        version: String,
    },
    /// Empty or malformed uid.
    #[error(
        "checkpoint binding uid {uid:?} is invalid: it must be non-empty and use only [A-Za-z0-9-]"
    )]
    Uid {
        /// The uid part.
        uid: String,
    },
    /// Generation not a decimal integer of 1 or more.
    #[error(
        "checkpoint binding generation {generation:?} is invalid: expected a decimal integer of 1 or more"
    )]
    Generation {
        /// The generation part.
        generation: String,
    },
    /// Digest not 64 lowercase hex digits.
    #[error("checkpoint binding digest {digest:?} is invalid: expected 64 lowercase hex digits")]
    Digest {
        /// The digest part.
        digest: String,
    },
    /// The checkpoint lacks a field the binding needs.
    #[error("checkpoint {checkpoint} cannot be bound: {field} is not set")]
    Incomplete {
        /// `<namespace>/<name>` of the checkpoint.
        checkpoint: String,
        /// The missing field.
        field: &'static str,
    },
}

/// Which verified part of a binding differs from the expected one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BindingPart {
    /// The checkpoint was deleted and recreated.
    Uid,
    /// The namespace, name, hash, location or artifact changed.
    Digest,
}

impl fmt::Display for BindingPart {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Uid => "uid (the checkpoint was deleted and recreated)",
            Self::Digest => "digest (its name, hash, location or artifact changed)",
        })
    }
}

/// A binding that is well formed but pins another checkpoint incarnation.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("checkpoint binding does not match: {}", describe(.parts, .expected, .actual))]
pub struct BindingMismatch {
    /// Every part that differs, in binding order.
    pub parts: Vec<BindingPart>,
    /// The binding of the live checkpoint.
    pub expected: Box<Binding>,
    /// The binding found on the pod.
    pub actual: Box<Binding>,
}

fn describe(parts: &[BindingPart], expected: &Binding, actual: &Binding) -> String {
    parts
        .iter()
        .map(|part| {
            let (want, got) = match part {
                BindingPart::Uid => (expected.uid.clone(), actual.uid.clone()),
                BindingPart::Digest => (expected.digest.clone(), actual.digest.clone()),
            };
            format!("{part}: pod has {got}, checkpoint has {want}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

impl Binding {
    /// The binding of a Ready checkpoint as it is now.
    ///
    /// # Errors
    /// [`BindingError::Incomplete`] naming the first missing field.
    pub fn for_checkpoint(checkpoint: &Checkpoint) -> Result<Self, BindingError> {
        let key = format!(
            "{}/{}",
            checkpoint.namespace().unwrap_or_default(),
            checkpoint.name_any()
        );
        let missing = |field| BindingError::Incomplete {
            checkpoint: key.clone(),
            field,
        };
        let status = checkpoint
            .status
            .as_ref()
            .ok_or_else(|| missing("status"))?;
        let subject = BindingSubject {
            identity_hash: status
                .identity_hash
                .clone()
                .ok_or_else(|| missing("status.identityHash"))?,
            location: status
                .location
                .clone()
                .ok_or_else(|| missing("status.location"))?,
            manifest_digest: status
                .artifact
                .as_ref()
                .map(|a| a.manifest_digest.clone())
                .filter(|d| !d.is_empty())
                .ok_or_else(|| missing("status.artifact.manifestDigest"))?,
            name: checkpoint
                .metadata
                .name
                .clone()
                .ok_or_else(|| missing("metadata.name"))?,
            namespace: checkpoint
                .namespace()
                .ok_or_else(|| missing("metadata.namespace"))?,
        };
        let uid = checkpoint.uid().ok_or_else(|| missing("metadata.uid"))?;
        let generation = checkpoint
            .metadata
            .generation
            .filter(|g| *g >= 1)
            .ok_or_else(|| missing("metadata.generation"))?;
        let binding = Self {
            uid,
            generation,
            digest: subject.digest(),
        };
        // A uid the parser would refuse must not be stamped on a pod.
        binding.to_string().parse::<Self>()?;
        Ok(binding)
    }

    /// Checks that this binding (found on a pod) pins `expected` (made from the live checkpoint):
    /// the same uid and digest. The generation is not compared (see the module doc).
    ///
    /// # Errors
    /// [`BindingMismatch`] listing every part that differs.
    pub fn verify(&self, expected: &Binding) -> Result<(), BindingMismatch> {
        let mut parts = Vec::new();
        if self.uid != expected.uid {
            parts.push(BindingPart::Uid);
        }
        if self.digest != expected.digest {
            parts.push(BindingPart::Digest);
        }
        if parts.is_empty() {
            Ok(())
        } else {
            Err(BindingMismatch {
                parts,
                expected: Box::new(expected.clone()),
                actual: Box::new(self.clone()),
            })
        }
    }
}

impl fmt::Display for Binding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{BINDING_VERSION}/{}/{}/{}",
            self.uid, self.generation, self.digest
        )
    }
}

impl FromStr for Binding {
    type Err = BindingError;

    fn from_str(value: &str) -> Result<Self, Self::Err> {
        let parts: Vec<&str> = value.split('/').collect();
        let [version, uid, generation, digest] = parts.as_slice() else {
            return Err(BindingError::PartCount {
                value: value.to_owned(),
                parts: parts.len(),
            });
        };
        if *version != BINDING_VERSION {
            return Err(BindingError::Version {
                version: (*version).to_owned(),
            });
        }
        if uid.is_empty() || !uid.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-') {
            return Err(BindingError::Uid {
                uid: (*uid).to_owned(),
            });
        }
        let bad_generation = || BindingError::Generation {
            generation: (*generation).to_owned(),
        };
        // `i64::from_str` accepts a leading `+`; the contract allows digits only.
        if generation.is_empty() || !generation.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad_generation());
        }
        let generation_value: i64 = generation.parse().map_err(|_| bad_generation())?;
        if generation_value < 1 {
            return Err(bad_generation());
        }
        if digest.len() != 64
            || !digest
                .bytes()
                .all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(BindingError::Digest {
                digest: (*digest).to_owned(),
            });
        }
        Ok(Self {
            uid: (*uid).to_owned(),
            generation: generation_value,
            digest: (*digest).to_owned(),
        })
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::v1alpha1::{ArtifactStatus, CheckpointStatus};

    const DIGEST: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    fn subject() -> BindingSubject {
        BindingSubject {
            identity_hash: "96429b2725761a09".into(),
            location: "/var/lib/warmstart/checkpoints/default/96429b2725761a09".into(),
            manifest_digest: format!("sha256:{DIGEST}"),
            name: "llama".into(),
            namespace: "default".into(),
        }
    }

    fn ready_checkpoint() -> Checkpoint {
        let mut ck: Checkpoint = serde_json::from_value(serde_json::json!({
            "apiVersion": "warmstart.dev/v1alpha1", "kind": "Checkpoint",
            "metadata": {"name": "llama", "namespace": "default", "uid": "1f0c-aa", "generation": 2},
            "spec": {"identity": {"model": "m", "backendFramework": "vllm"},
                     "job": {"podTemplateSpec": {"spec": {"containers": [{"name": "main"}]}}}}
        }))
        .unwrap();
        let s = subject();
        ck.status = Some(CheckpointStatus {
            identity_hash: Some(s.identity_hash),
            location: Some(s.location),
            artifact: Some(ArtifactStatus {
                manifest_digest: s.manifest_digest,
                ..Default::default()
            }),
            ..Default::default()
        });
        ck
    }

    #[test]
    fn canonical_json_has_sorted_keys_and_no_whitespace() {
        let json = serde_json::to_string(&subject()).unwrap();
        assert!(json.starts_with(r#"{"identityHash":"96429b2725761a09","location":"#));
        assert!(json.contains(r#","manifestDigest":"#));
        assert!(json.ends_with(r#","name":"llama","namespace":"default"}"#));
        assert!(!json.contains(' '));
    }

    // The contract's value: a change of the canonical form would unbind every restore pod.
    #[test]
    fn digest_golden_vector() {
        assert_eq!(
            subject().digest(),
            "2c5b9f1df00a7b44a07dec7f4d5aa1c3f60cdd15500a2c2e00e5861258814ddf"
        );
    }

    #[test]
    fn a_checkpoint_read_back_from_json_binds_the_same() {
        let ck = ready_checkpoint();
        let through_the_api: Checkpoint =
            serde_json::from_slice(&serde_json::to_vec(&ck).unwrap()).unwrap();
        assert_eq!(
            Binding::for_checkpoint(&through_the_api).unwrap(),
            Binding::for_checkpoint(&ck).unwrap()
        );
    }

    #[test]
    fn digest_is_sha256_of_the_canonical_json() {
        let json = serde_json::to_vec(&subject()).unwrap();
        assert_eq!(subject().digest(), hex::encode(Sha256::digest(json)));
        let mut other = subject();
        other.location.push('x');
        assert_ne!(other.digest(), subject().digest());
    }

    #[test]
    fn binding_round_trips_through_its_string_form() {
        let b = Binding::for_checkpoint(&ready_checkpoint()).unwrap();
        assert_eq!(b.uid, "1f0c-aa");
        assert_eq!(b.generation, 2);
        assert_eq!(b.digest, subject().digest());
        let s = b.to_string();
        assert_eq!(s, format!("v1/1f0c-aa/2/{}", subject().digest()));
        assert_eq!(s.parse::<Binding>().unwrap(), b);
    }

    #[test]
    fn every_malformed_form_is_rejected_with_a_reason() {
        let cases: &[(&str, &str)] = &[
            ("", "parts"),
            ("v1", "parts"),
            (&format!("v1/uid/1/{DIGEST}/extra"), "parts"),
            (&format!("v2/uid/1/{DIGEST}"), "version"),
            (&format!("V1/uid/1/{DIGEST}"), "version"),
            (&format!("v1//1/{DIGEST}"), "uid"),
            (&format!("v1/u id/1/{DIGEST}"), "uid"),
            (&format!("v1/uid/0/{DIGEST}"), "generation"),
            (&format!("v1/uid/-1/{DIGEST}"), "generation"),
            (&format!("v1/uid/+1/{DIGEST}"), "generation"),
            (&format!("v1/uid//{DIGEST}"), "generation"),
            (&format!("v1/uid/1x/{DIGEST}"), "generation"),
            (
                &format!("v1/uid/99999999999999999999/{DIGEST}"),
                "generation",
            ),
            ("v1/uid/1/abc", "digest"),
            (&format!("v1/uid/1/{}", DIGEST.to_uppercase()), "digest"),
            (&format!("v1/uid/1/{}g", &DIGEST[1..]), "digest"),
            (&format!("v1/uid/1/{DIGEST}0"), "digest"),
        ];
        for (input, reason) in cases {
            let err = input.parse::<Binding>().unwrap_err();
            assert!(
                err.to_string().contains(reason),
                "{input:?} rejected with {err:?}, expected a {reason} error"
            );
        }
    }

    #[test]
    fn verification_names_each_differing_part() {
        let live = Binding::for_checkpoint(&ready_checkpoint()).unwrap();
        assert_eq!(live.verify(&live), Ok(()));

        let mut recreated = live.clone();
        recreated.uid = "other".into();
        let err = recreated.verify(&live).unwrap_err();
        assert_eq!(err.parts, vec![BindingPart::Uid]);
        assert!(
            err.to_string()
                .contains("uid (the checkpoint was deleted and recreated)")
        );

        let mut replaced = ready_checkpoint();
        replaced
            .status
            .as_mut()
            .unwrap()
            .artifact
            .as_mut()
            .unwrap()
            .manifest_digest = "sha256:other".into();
        let old = Binding::for_checkpoint(&replaced).unwrap();
        let err = old.verify(&live).unwrap_err();
        assert_eq!(err.parts, vec![BindingPart::Digest]);

        let mut all = old.clone();
        all.uid = "x".into();
        all.generation = 9;
        assert_eq!(
            all.verify(&live).unwrap_err().parts,
            vec![BindingPart::Uid, BindingPart::Digest]
        );
    }

    // Edits that keep the artifact keep the binding.
    #[test]
    fn a_binding_stays_valid_across_edits_that_keep_the_artifact() {
        let stamped = Binding::for_checkpoint(&ready_checkpoint()).unwrap();
        let mut edited = ready_checkpoint();
        edited.metadata.generation = Some(7);
        edited.spec.deletion_policy = crate::v1alpha1::DeletionPolicy::Retain;
        edited.spec.job.backoff_limit = 9;
        let live = Binding::for_checkpoint(&edited).unwrap();
        assert_eq!(live.generation, 7);
        assert_eq!(stamped.verify(&live), Ok(()));
        // The wire format still records the generation current at admission.
        assert_eq!(
            stamped.to_string(),
            format!("v1/1f0c-aa/2/{}", subject().digest())
        );
    }

    #[test]
    fn a_binding_stops_matching_a_recreated_checkpoint_or_a_replaced_artifact() {
        let stamped = Binding::for_checkpoint(&ready_checkpoint()).unwrap();
        let mut recreated = ready_checkpoint();
        recreated.metadata.uid = Some("2a7d-bb".into());
        recreated.metadata.generation = Some(1);
        let err = stamped
            .verify(&Binding::for_checkpoint(&recreated).unwrap())
            .unwrap_err();
        assert_eq!(err.parts, vec![BindingPart::Uid]);
        let mut replaced = ready_checkpoint();
        replaced
            .status
            .as_mut()
            .unwrap()
            .artifact
            .as_mut()
            .unwrap()
            .manifest_digest = format!("sha256:{}", "f".repeat(64));
        let err = stamped
            .verify(&Binding::for_checkpoint(&replaced).unwrap())
            .unwrap_err();
        assert_eq!(err.parts, vec![BindingPart::Digest]);
    }

    #[test]
    fn a_checkpoint_without_artifact_cannot_be_bound() {
        let mut ck = ready_checkpoint();
        ck.status.as_mut().unwrap().artifact = None;
        let err = Binding::for_checkpoint(&ck).unwrap_err();
        assert_eq!(
            err.to_string(),
            "checkpoint default/llama cannot be bound: status.artifact.manifestDigest is not set"
        );
        ck.status = None;
        assert!(matches!(
            Binding::for_checkpoint(&ck),
            Err(BindingError::Incomplete {
                field: "status",
                ..
            })
        ));
    }

    proptest! {
        #[test]
        fn parser_never_panics_and_accepts_only_what_it_prints(s in ".{0,120}") {
            if let Ok(b) = s.parse::<Binding>() {
                prop_assert_eq!(b.to_string(), s);
            }
        }

        #[test]
        fn parser_accepts_every_valid_binding(
            uid in "[A-Za-z0-9-]{1,40}", generation in 1i64..i64::MAX, digest in "[0-9a-f]{64}",
        ) {
            let s = format!("v1/{uid}/{generation}/{digest}");
            let b: Binding = s.parse().unwrap();
            prop_assert_eq!(b.to_string(), s);
        }
    }
}
