//! The errors the double answers with, shaped as the `meta.k8s.io/v1` `Status` bodies and HTTP
//! codes a real kube-apiserver sends (k8s.io/apimachinery `pkg/api/errors`).

use serde_json::{Value, json};

/// A request the double refuses: an HTTP status code and a `Status` body.
#[derive(Clone, Debug, thiserror::Error)]
#[error("{code} {reason}: {message}")]
pub struct ApiError {
    /// HTTP status code (`Status.code`).
    pub code: u16,
    /// Machine-readable reason (`Status.reason`), e.g. `NotFound`.
    pub reason: String,
    /// Human-readable message (`Status.message`).
    pub message: String,
    /// `Status.details`, when the error names an object or lists causes.
    pub details: Option<Value>,
}

/// A field-level cause of an `Invalid` (422) error.
#[derive(Clone, Debug)]
pub struct Cause {
    /// `FieldValueInvalid`, `FieldValueRequired`, `FieldValueNotSupported`, `FieldValueForbidden`…
    pub reason: &'static str,
    /// The field path, e.g. `metadata.name`.
    pub field: String,
    /// What is wrong, e.g. `Invalid value: "A": a lowercase RFC 1123 subdomain…`.
    pub message: String,
}

impl Cause {
    /// `Invalid value: <value>: <detail>`.
    pub fn invalid(
        field: impl Into<String>,
        value: &Value,
        detail: impl std::fmt::Display,
    ) -> Self {
        let shown = match value {
            Value::String(s) => format!("{s:?}"),
            other => other.to_string(),
        };
        Self {
            reason: "FieldValueInvalid",
            field: field.into(),
            message: format!("Invalid value: {shown}: {detail}"),
        }
    }

    /// `Required value[: detail]`.
    pub fn required(field: impl Into<String>, detail: &str) -> Self {
        let message = if detail.is_empty() {
            "Required value".to_owned()
        } else {
            format!("Required value: {detail}")
        };
        Self {
            reason: "FieldValueRequired",
            field: field.into(),
            message,
        }
    }

    /// `Forbidden: detail`.
    pub fn forbidden(field: impl Into<String>, detail: &str) -> Self {
        Self {
            reason: "FieldValueForbidden",
            field: field.into(),
            message: format!("Forbidden: {detail}"),
        }
    }

    /// `Unsupported value: <value>: supported values: …`.
    pub fn not_supported(field: impl Into<String>, value: &Value, supported: &[&str]) -> Self {
        let list: Vec<String> = supported.iter().map(|s| format!("{s:?}")).collect();
        Self {
            reason: "FieldValueNotSupported",
            field: field.into(),
            message: format!(
                "Unsupported value: {value}: supported values: {}",
                list.join(", ")
            ),
        }
    }
}

/// `plural` or `plural.group`, as Kubernetes names a resource in messages.
pub fn qualified(group: &str, plural: &str) -> String {
    if group.is_empty() {
        plural.to_owned()
    } else {
        format!("{plural}.{group}")
    }
}

impl ApiError {
    fn new(code: u16, reason: &str, message: impl Into<String>) -> Self {
        Self {
            code,
            reason: reason.to_owned(),
            message: message.into(),
            details: None,
        }
    }

    fn with_details(mut self, group: &str, kind: &str, name: &str) -> Self {
        let mut details = serde_json::Map::new();
        if !name.is_empty() {
            details.insert("name".into(), json!(name));
        }
        if !group.is_empty() {
            details.insert("group".into(), json!(group));
        }
        if !kind.is_empty() {
            details.insert("kind".into(), json!(kind));
        }
        self.details = Some(Value::Object(details));
        self
    }

    /// 404 `<resource> "<name>" not found`.
    pub fn not_found(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            404,
            "NotFound",
            format!("{} {name:?} not found", qualified(group, plural)),
        )
        .with_details(group, plural, name)
    }

    /// 404 for a path that names no resource.
    pub fn no_such_resource() -> Self {
        Self::new(
            404,
            "NotFound",
            "the server could not find the requested resource",
        )
        .with_details("", "", "")
    }

    /// 409 `AlreadyExists`.
    pub fn already_exists(group: &str, plural: &str, name: &str) -> Self {
        Self::new(
            409,
            "AlreadyExists",
            format!("{} {name:?} already exists", qualified(group, plural)),
        )
        .with_details(group, plural, name)
    }

    /// 409 `Conflict` on a stale `resourceVersion` (optimistic concurrency).
    pub fn conflict(group: &str, plural: &str, name: &str) -> Self {
        Self::conflict_because(
            group,
            plural,
            name,
            "the object has been modified; please apply your changes to the latest version and try again",
        )
    }

    /// 409 `Conflict` with a given cause.
    pub fn conflict_because(group: &str, plural: &str, name: &str, why: &str) -> Self {
        Self::new(
            409,
            "Conflict",
            format!(
                "Operation cannot be fulfilled on {} {name:?}: {why}",
                qualified(group, plural)
            ),
        )
        .with_details(group, plural, name)
    }

    /// 422 `Invalid` with field causes.
    pub fn invalid(group: &str, kind: &str, name: &str, causes: &[Cause]) -> Self {
        let listed: Vec<String> = causes
            .iter()
            .map(|c| format!("{}: {}", c.field, c.message))
            .collect();
        let summary = if listed.len() == 1 {
            listed.concat()
        } else {
            format!("[{}]", listed.join(", "))
        };
        let kind_name = if group.is_empty() {
            kind.to_owned()
        } else {
            format!("{kind}.{group}")
        };
        let mut err = Self::new(
            422,
            "Invalid",
            format!("{kind_name} {name:?} is invalid: {summary}"),
        )
        .with_details(group, kind, name);
        if let Some(Value::Object(details)) = err.details.as_mut() {
            let causes: Vec<Value> = causes
                .iter()
                .map(|c| json!({"reason": c.reason, "message": c.message, "field": c.field}))
                .collect();
            details.insert("causes".into(), Value::Array(causes));
        }
        err
    }

    /// 400 `BadRequest`.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(400, "BadRequest", message)
    }

    /// 403 `Forbidden`.
    pub fn forbidden(message: impl Into<String>) -> Self {
        Self::new(403, "Forbidden", message)
    }

    /// 405 `MethodNotAllowed`.
    pub fn method_not_allowed(message: impl Into<String>) -> Self {
        Self::new(405, "MethodNotAllowed", message)
    }

    /// 406 `NotAcceptable`.
    pub fn not_acceptable(message: impl Into<String>) -> Self {
        Self::new(406, "NotAcceptable", message)
    }

    /// 410 `Expired` (a watch or list from a compacted `resourceVersion`).
    pub fn gone(message: impl Into<String>) -> Self {
        Self::new(410, "Expired", message)
    }

    /// 415 `UnsupportedMediaType`.
    pub fn unsupported_media_type(message: impl Into<String>) -> Self {
        Self::new(415, "UnsupportedMediaType", message)
    }

    /// 500 `InternalError`.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, "InternalError", message)
    }

    /// 501: the double cannot do this faithfully, so it refuses instead of doing something else.
    pub fn not_implemented(what: impl std::fmt::Display) -> Self {
        Self::new(
            501,
            "NotImplemented",
            format!("not implemented by the warmstart API server double: {what}"),
        )
    }

    /// 504 `Timeout`.
    pub fn timeout(message: impl Into<String>) -> Self {
        Self::new(504, "Timeout", message)
    }

    /// The `Status` body.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.message,
            "reason": self.reason,
            "code": self.code,
        });
        if let (Some(details), Value::Object(map)) = (&self.details, &mut status) {
            map.insert("details".into(), details.clone());
        }
        status
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn not_found_names_the_qualified_resource() {
        let err = ApiError::not_found("batch", "jobs", "a");
        assert_eq!(err.message, "jobs.batch \"a\" not found");
        assert_eq!(err.to_status()["details"]["kind"], "jobs");
    }

    #[test]
    fn invalid_lists_every_cause() {
        let err = ApiError::invalid("", "Pod", "x", &[Cause::required("spec.containers", "")]);
        assert_eq!(err.code, 422);
        assert_eq!(
            err.message,
            "Pod \"x\" is invalid: spec.containers: Required value"
        );
        assert_eq!(
            err.to_status()["details"]["causes"][0]["field"],
            "spec.containers"
        );
    }
}
