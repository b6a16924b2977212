//! Strict reading of user input (the admission webhook's and the command line's): unknown
//! fields named, not dropped. For a pod template: the CRD keeps `spec.job.podTemplateSpec` as given
//! (`x-kubernetes-preserve-unknown-fields`, rather than a 400 KiB copy of the Pod schema), so a
//! typo such as `imagee:` would reach the Job as a container without an image. The validating
//! webhook finds such fields by reading the template as k8s-openapi's `PodTemplateSpec` and
//! naming every input field that does not come back out.

use k8s_openapi::api::core::v1::PodTemplateSpec;
use serde_json::Value;

/// The path of the first field of `template` that is not a field of a core/v1 pod template
/// (`spec.containers[0].imagee`), or `None` when every field is known. A `null` value counts as
/// absent, as the API server treats it.
///
/// # Errors
/// The template does not even parse as a `PodTemplateSpec` (wrong types): the parser's message.
pub fn unknown_template_field(template: &Value) -> Result<Option<String>, serde_json::Error> {
    let typed: PodTemplateSpec = serde_json::from_value(template.clone())?;
    let known = serde_json::to_value(&typed)?;
    Ok(first_unknown(template, &known, "", false))
}

/// The path of the first field of `input` that is absent from `known` (the same document
/// after a round trip through the expected type). A `null` counts as absent; so do `[]` and
/// `{}` with `empty_is_absent`, for types that leave empty fields out when serialised (the
/// Checkpoint's status).
pub(crate) fn first_unknown(
    input: &Value,
    known: &Value,
    path: &str,
    empty_is_absent: bool,
) -> Option<String> {
    match (input, known) {
        (Value::Object(given), Value::Object(kept)) => given.iter().find_map(|(key, value)| {
            let at = if path.is_empty() {
                key.clone()
            } else {
                format!("{path}.{key}")
            };
            match kept.get(key) {
                _ if value.is_null() || (empty_is_absent && is_empty(value)) => None,
                None => Some(at),
                Some(inner) => first_unknown(value, inner, &at, empty_is_absent),
            }
        }),
        (Value::Array(given), Value::Array(kept)) => {
            given
                .iter()
                .zip(kept)
                .enumerate()
                .find_map(|(i, (value, inner))| {
                    first_unknown(value, inner, &format!("{path}[{i}]"), empty_is_absent)
                })
        }
        // A field whose value the type reads in another shape (an object where a map is
        // expected, …) fails to parse instead; scalars have no fields.
        _ => None,
    }
}

fn is_empty(value: &Value) -> bool {
    match value {
        Value::Array(items) => items.is_empty(),
        Value::Object(fields) => fields.is_empty(),
        _ => false,
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;

    fn template() -> Value {
        json!({
            "metadata": {"labels": {"app": "llm", "x.io/any-key": "v"}, "annotations": {"a": "b"}},
            "spec": {
                "containers": [{
                    "name": "main", "image": "vllm:1", "args": [],
                    "env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
                    "resources": {"limits": {"nvidia.com/gpu": 1, "memory": "8Gi"}},
                    "ports": [{"containerPort": 8000}],
                    "readinessProbe": {"httpGet": {"path": "/health", "port": "http"}},
                    "securityContext": {},
                }],
                "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}],
                "nodeSelector": {"gpu": "h100"},
                "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
                "serviceAccountName": null,
            }
        })
    }

    #[test]
    fn a_complete_template_has_no_unknown_field() {
        assert_eq!(unknown_template_field(&template()).unwrap(), None);
        assert_eq!(unknown_template_field(&json!({})).unwrap(), None);
    }

    // `imagee:` used to pass and render a Job without image.
    #[test]
    fn a_typo_is_named_with_its_path() {
        let mut t = template();
        t["spec"]["containers"][0]["imagee"] = json!("vllm:1");
        assert_eq!(
            unknown_template_field(&t).unwrap().as_deref(),
            Some("spec.containers[0].imagee")
        );
        let mut t = template();
        t["spec"]["volumes"][0]["emptyDir"]["sizeLimitt"] = json!("1Gi");
        assert_eq!(
            unknown_template_field(&t).unwrap().as_deref(),
            Some("spec.volumes[0].emptyDir.sizeLimitt")
        );
        let mut t = template();
        t["specc"] = json!({});
        assert_eq!(
            unknown_template_field(&t).unwrap().as_deref(),
            Some("specc")
        );
    }

    #[test]
    fn wrong_types_are_parse_errors() {
        let mut t = template();
        t["spec"]["containers"] = json!("main");
        assert!(unknown_template_field(&t).is_err());
    }
}
