//! The identity hash (contract): byte-compatible with NVIDIA Dynamo's DynamoCheckpoint hash, so
//! checkpoints are addressed the same way by both systems.
//!
//! The hash is the first 16 lowercase hex characters of the SHA-256 of the identity serialised
//! exactly as Go's `encoding/json` serialises Dynamo's identity struct: fixed field order,
//! `omitempty` on the optional fields, sorted map keys, and Go's HTML-safe string escaping.

use std::fmt::Write as _;

use sha2::{Digest, Sha256};
use thiserror::Error;

use crate::v1alpha1::CheckpointIdentity;

/// Number of hex characters in an identity hash.
pub const HASH_LEN: usize = 16;

/// Why an identity cannot be hashed.
#[derive(Clone, Debug, Error, PartialEq, Eq)]
pub enum IdentityError {
    /// A required string field is empty.
    #[error("spec.identity.{field} is required and must not be empty")]
    Empty {
        /// The field, as spelt in the API.
        field: &'static str,
    },
    /// A numeric field is negative.
    #[error("spec.identity.{field} is {value}: it must be zero or positive")]
    Negative {
        /// The field, as spelt in the API.
        field: &'static str,
        /// The offending value.
        value: i64,
    },
}

/// Checks the rules an identity must follow before it can be hashed.
///
/// # Errors
/// Names the first field that breaks a rule.
pub fn validate(identity: &CheckpointIdentity) -> Result<(), IdentityError> {
    if identity.model.is_empty() {
        return Err(IdentityError::Empty { field: "model" });
    }
    if identity.backend_framework.is_empty() {
        return Err(IdentityError::Empty {
            field: "backendFramework",
        });
    }
    let numbers = [
        ("tensorParallelSize", Some(identity.tensor_parallel_size)),
        (
            "pipelineParallelSize",
            Some(identity.pipeline_parallel_size),
        ),
        ("maxModelLen", identity.max_model_len),
    ];
    for (field, value) in numbers {
        if let Some(value) = value.filter(|v| *v < 0) {
            return Err(IdentityError::Negative { field, value });
        }
    }
    Ok(())
}

/// The canonical JSON that is hashed, as Go's `encoding/json` writes Dynamo's struct.
///
/// # Errors
/// See [`validate`].
pub fn canonical_json(identity: &CheckpointIdentity) -> Result<String, IdentityError> {
    validate(identity)?;
    let mut out = String::with_capacity(128);
    out.push_str("{\"model\":");
    push_go_string(&mut out, &identity.model);
    out.push_str(",\"backendFramework\":");
    push_go_string(&mut out, &identity.backend_framework);
    if let Some(version) = identity.dynamo_version.as_deref().filter(|v| !v.is_empty()) {
        out.push_str(",\"dynamoVersion\":");
        push_go_string(&mut out, version);
    }
    // Dynamo normalises 0 ("unset") to 1 before hashing, so both address the same artifact.
    let _ = write!(
        out,
        ",\"tensorParallelSize\":{},\"pipelineParallelSize\":{}",
        normalise_parallel(identity.tensor_parallel_size),
        normalise_parallel(identity.pipeline_parallel_size)
    );
    if let Some(dtype) = identity.dtype.as_deref().filter(|v| !v.is_empty()) {
        out.push_str(",\"dtype\":");
        push_go_string(&mut out, dtype);
    }
    if let Some(len) = identity.max_model_len.filter(|v| *v != 0) {
        let _ = write!(out, ",\"maxModelLen\":{len}");
    }
    if let Some(params) = identity.extra_parameters.as_ref().filter(|m| !m.is_empty()) {
        // BTreeMap<String, _> iterates in byte order of the keys, which is Go's map key order.
        out.push_str(",\"extraParameters\":{");
        for (i, (key, value)) in params.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_go_string(&mut out, key);
            out.push(':');
            push_go_string(&mut out, value);
        }
        out.push('}');
    }
    out.push('}');
    Ok(out)
}

/// The identity hash: first 16 lowercase hex characters of SHA-256 of [`canonical_json`].
///
/// # Errors
/// See [`validate`].
pub fn identity_hash(identity: &CheckpointIdentity) -> Result<String, IdentityError> {
    let json = canonical_json(identity)?;
    let digest = Sha256::digest(json.as_bytes());
    let mut hex = hex::encode(digest);
    hex.truncate(HASH_LEN);
    Ok(hex)
}

/// Whether `s` has the shape of an identity hash (16 lowercase hex characters).
pub fn is_identity_hash(s: &str) -> bool {
    s.len() == HASH_LEN && s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

fn normalise_parallel(size: i64) -> i64 {
    if size == 0 { 1 } else { size }
}

/// Appends `s` as a JSON string the way Go's `encoding/json` does with HTML escaping on
/// (its default): `<`, `>`, `&`, U+2028 and U+2029 become `\u003c`-style escapes, `\b` and `\f`
/// keep their short forms (Go 1.22 and later), other control characters use lowercase `\u00xx`.
fn push_go_string(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            '<' | '>' | '&' | '\u{2028}' | '\u{2029}' => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c if u32::from(c) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::*;

    fn identity(model: &str, backend: &str) -> CheckpointIdentity {
        CheckpointIdentity {
            model: model.into(),
            backend_framework: backend.into(),
            tensor_parallel_size: 1,
            pipeline_parallel_size: 1,
            ..Default::default()
        }
    }

    #[test]
    fn golden_vector_minimal_identity_matches_dynamo() {
        let id = identity("meta-llama/Llama-2-7b-hf", "vllm");
        assert_eq!(identity_hash(&id).unwrap(), "96429b2725761a09");
    }

    #[test]
    fn golden_vector_full_identity_matches_dynamo() {
        let id = CheckpointIdentity {
            model: "meta-llama/Llama-2-13b-hf".into(),
            backend_framework: "sglang".into(),
            dynamo_version: Some("0.4.2".into()),
            tensor_parallel_size: 2,
            pipeline_parallel_size: 1,
            dtype: Some("float16".into()),
            max_model_len: Some(4096),
            extra_parameters: Some(BTreeMap::from([(
                "gpu_memory_utilization".into(),
                "0.9".into(),
            )])),
        };
        assert_eq!(identity_hash(&id).unwrap(), "f4ba65bccbb8e4fb");
    }

    #[test]
    fn golden_vector_parsed_from_yaml_with_defaults() {
        let id: CheckpointIdentity =
            serde_norway::from_str("model: meta-llama/Llama-2-7b-hf\nbackendFramework: vllm\n")
                .unwrap();
        assert_eq!(identity_hash(&id).unwrap(), "96429b2725761a09");
    }

    #[test]
    fn zero_parallel_sizes_hash_like_one() {
        let one = identity("m", "vllm");
        let mut zero = one.clone();
        zero.tensor_parallel_size = 0;
        zero.pipeline_parallel_size = 0;
        assert_eq!(identity_hash(&zero).unwrap(), identity_hash(&one).unwrap());
        let mut two = one.clone();
        two.tensor_parallel_size = 2;
        assert_ne!(identity_hash(&two).unwrap(), identity_hash(&one).unwrap());
    }

    #[test]
    fn empty_and_missing_optional_fields_hash_alike() {
        let missing = identity("m", "vllm");
        let empty = CheckpointIdentity {
            dynamo_version: Some(String::new()),
            dtype: Some(String::new()),
            max_model_len: Some(0),
            extra_parameters: Some(BTreeMap::new()),
            ..missing.clone()
        };
        assert_eq!(
            canonical_json(&empty).unwrap(),
            canonical_json(&missing).unwrap()
        );
    }

    #[test]
    fn map_insertion_order_is_irrelevant() {
        let json_a =
            r#"{"model":"m","backendFramework":"b","extraParameters":{"z":"1","a":"2","m":"3"}}"#;
        let json_b =
            r#"{"model":"m","backendFramework":"b","extraParameters":{"m":"3","z":"1","a":"2"}}"#;
        let a: CheckpointIdentity = serde_json::from_str(json_a).unwrap();
        let b: CheckpointIdentity = serde_json::from_str(json_b).unwrap();
        assert_eq!(identity_hash(&a).unwrap(), identity_hash(&b).unwrap());
        assert!(
            canonical_json(&a)
                .unwrap()
                .ends_with(r#"{"a":"2","m":"3","z":"1"}}"#)
        );
    }

    #[test]
    fn html_and_line_separators_are_escaped_like_go() {
        let mut id = identity("a<b>&c\u{2028}d\u{2029}", "v");
        id.dtype = Some("\"q\\\n\t\r\u{8}\u{c}\u{1}\u{1f}é".into());
        assert_eq!(
            canonical_json(&id).unwrap(),
            r#"{"model":"a\u003cb\u003e\u0026c\u2028d\u2029","backendFramework":"v","tensorParallelSize":1,"pipelineParallelSize":1,"dtype":"\"q\\\n\t\r\b\f\u0001\u001fé"}"#
        );
    }

    #[test]
    fn non_ascii_map_keys_sort_by_bytes() {
        let mut id = identity("m", "b");
        // 'Z' (0x5a) < 'a' (0x61) < 'é' (0xc3 0xa9) < '中' (0xe4 ...) by bytes.
        id.extra_parameters = Some(BTreeMap::from([
            ("中".into(), "4".into()),
            ("é".into(), "3".into()),
            ("a".into(), "2".into()),
            ("Z".into(), "1".into()),
        ]));
        assert!(
            canonical_json(&id)
                .unwrap()
                .ends_with(r#""extraParameters":{"Z":"1","a":"2","é":"3","中":"4"}}"#)
        );
    }

    #[test]
    fn missing_model_or_backend_is_an_error_naming_the_field() {
        let err = identity_hash(&identity("", "vllm")).unwrap_err();
        assert_eq!(err, IdentityError::Empty { field: "model" });
        assert!(err.to_string().contains("spec.identity.model"));
        let err = identity_hash(&identity("m", "")).unwrap_err();
        assert!(err.to_string().contains("spec.identity.backendFramework"));
    }

    #[test]
    fn negative_numbers_are_errors_naming_field_and_value() {
        let mut id = identity("m", "b");
        id.max_model_len = Some(-5);
        let err = identity_hash(&id).unwrap_err();
        assert_eq!(
            err.to_string(),
            "spec.identity.maxModelLen is -5: it must be zero or positive"
        );
        let mut id = identity("m", "b");
        id.pipeline_parallel_size = -1;
        assert!(matches!(
            identity_hash(&id),
            Err(IdentityError::Negative {
                field: "pipelineParallelSize",
                value: -1
            })
        ));
    }

    #[test]
    fn unknown_identity_fields_are_rejected_when_parsing() {
        let err = serde_json::from_str::<CheckpointIdentity>(
            r#"{"model":"m","backendFramework":"b","modle":"x"}"#,
        )
        .unwrap_err();
        assert!(err.to_string().contains("modle"), "{err}");
    }

    #[test]
    fn hash_shape_is_recognised() {
        assert!(is_identity_hash("96429b2725761a09"));
        assert!(!is_identity_hash("96429B2725761A09"));
        assert!(!is_identity_hash("96429b2725761a0"));
        assert!(!is_identity_hash("96429b2725761a0g"));
    }

    proptest! {
        #[test]
        fn any_identity_hashes_or_errors_without_panicking(
            model in ".{0,40}",
            backend in ".{0,10}",
            version in proptest::option::of(".{0,10}"),
            tp in -3i64..100,
            pp in -3i64..100,
            len in proptest::option::of(-3i64..100_000),
            params in proptest::collection::btree_map(".{0,8}", ".{0,8}", 0..5),
        ) {
            let id = CheckpointIdentity {
                model, backend_framework: backend, dynamo_version: version,
                tensor_parallel_size: tp, pipeline_parallel_size: pp, dtype: None,
                max_model_len: len, extra_parameters: Some(params),
            };
            match identity_hash(&id) {
                Ok(h) => {
                    prop_assert!(is_identity_hash(&h));
                    // The canonical form is valid JSON that reads back to the same strings.
                    let json = canonical_json(&id).unwrap();
                    let back: serde_json::Value = serde_json::from_str(&json).unwrap();
                    prop_assert_eq!(back["model"].as_str(), Some(id.model.as_str()));
                }
                Err(e) => prop_assert!(validate(&id).is_err(), "{e}"),
            }
        }
    }
}
