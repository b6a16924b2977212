//! Label selectors (equality- and set-based, k8s.io/apimachinery `pkg/labels`) and field
//! selectors (`pkg/fields`) with the field labels each kind supports.

use serde_json::{Map, Value};

use super::error::ApiError;
use super::meta;
use super::resources::ResourceType;

/// One label requirement.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Requirement {
    /// `key=value`, `key==value`, `key in (a,b)`.
    In(String, Vec<String>),
    /// `key!=value`, `key notin (a,b)`.
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    DoesNotExist(String),
}

/// A parsed label selector: all requirements must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LabelSelector(pub Vec<Requirement>);

fn split_top_level(s: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0_i32;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&s[start..]);
    parts
}

fn check_key(key: &str, whole: &str) -> Result<(), ApiError> {
    let errs = meta::validate_qualified_name(key);
    if let Some(e) = errs.first() {
        return Err(ApiError::bad_request(format!(
            "unable to parse requirement: values[0][{whole}]: Invalid value: {key:?}: {e}"
        )));
    }
    Ok(())
}

fn check_value(value: &str) -> Result<(), ApiError> {
    let errs = meta::validate_label_value(value);
    if let Some(e) = errs.first() {
        return Err(ApiError::bad_request(format!(
            "unable to parse requirement: values[0][{value}]: Invalid value: {value:?}: {e}"
        )));
    }
    Ok(())
}

impl LabelSelector {
    /// Parse the `labelSelector` query parameter.
    ///
    /// # Errors
    /// 400 when it does not parse, as the API server answers.
    pub fn parse(s: &str) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        for part in split_top_level(s) {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let bad = || {
                ApiError::bad_request(format!(
                    "unable to parse requirement: found '{part}', expected: identifier"
                ))
            };
            if let Some(key) = part.strip_prefix('!') {
                let key = key.trim();
                check_key(key, part)?;
                reqs.push(Requirement::DoesNotExist(key.to_owned()));
            } else if let Some((k, v)) = part.split_once("!=") {
                check_key(k.trim(), part)?;
                check_value(v.trim())?;
                reqs.push(Requirement::NotIn(
                    k.trim().to_owned(),
                    vec![v.trim().to_owned()],
                ));
            } else if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                check_key(k.trim(), part)?;
                check_value(v.trim())?;
                reqs.push(Requirement::In(
                    k.trim().to_owned(),
                    vec![v.trim().to_owned()],
                ));
            } else if let Some(open) = part.find('(') {
                let head: Vec<&str> = part[..open].split_whitespace().collect();
                let Some(inner) = part[open + 1..].strip_suffix(')') else {
                    return Err(bad());
                };
                let values: Vec<String> = inner
                    .split(',')
                    .map(|v| v.trim().to_owned())
                    .filter(|v| !v.is_empty())
                    .collect();
                for v in &values {
                    check_value(v)?;
                }
                match head.as_slice() {
                    [k, "in"] => {
                        check_key(k, part)?;
                        if values.is_empty() {
                            return Err(ApiError::bad_request(
                                "unable to parse requirement: for 'in', 'notin' operators, values set can't be empty",
                            ));
                        }
                        reqs.push(Requirement::In((*k).to_owned(), values));
                    }
                    [k, "notin"] => {
                        check_key(k, part)?;
                        reqs.push(Requirement::NotIn((*k).to_owned(), values));
                    }
                    _ => return Err(bad()),
                }
            } else if part.split_whitespace().count() == 1 {
                check_key(part, part)?;
                reqs.push(Requirement::Exists(part.to_owned()));
            } else {
                return Err(bad());
            }
        }
        Ok(Self(reqs))
    }

    /// From a `metav1.LabelSelector` object (`matchLabels`, `matchExpressions`).
    ///
    /// # Errors
    /// 400 on an unknown operator.
    pub fn from_object(sel: &Value) -> Result<Self, ApiError> {
        let mut reqs = Vec::new();
        if let Some(m) = sel.get("matchLabels").and_then(Value::as_object) {
            for (k, v) in m {
                reqs.push(Requirement::In(
                    k.clone(),
                    vec![v.as_str().unwrap_or_default().to_owned()],
                ));
            }
        }
        if let Some(exprs) = sel.get("matchExpressions").and_then(Value::as_array) {
            for e in exprs {
                let key = e["key"].as_str().unwrap_or_default().to_owned();
                let values: Vec<String> = e["values"]
                    .as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(Value::as_str)
                            .map(str::to_owned)
                            .collect()
                    })
                    .unwrap_or_default();
                reqs.push(match e["operator"].as_str().unwrap_or_default() {
                    "In" => Requirement::In(key, values),
                    "NotIn" => Requirement::NotIn(key, values),
                    "Exists" => Requirement::Exists(key),
                    "DoesNotExist" => Requirement::DoesNotExist(key),
                    other => {
                        return Err(ApiError::bad_request(format!(
                            "{other:?} is not a valid label selector operator"
                        )));
                    }
                });
            }
        }
        Ok(Self(reqs))
    }

    /// Whether labels satisfy every requirement.
    pub fn matches(&self, labels: &Map<String, Value>) -> bool {
        self.0.iter().all(|r| match r {
            Requirement::In(k, vs) => labels
                .get(k)
                .and_then(Value::as_str)
                .is_some_and(|v| vs.iter().any(|x| x == v)),
            Requirement::NotIn(k, vs) => labels
                .get(k)
                .and_then(Value::as_str)
                .is_none_or(|v| !vs.iter().any(|x| x == v)),
            Requirement::Exists(k) => labels.contains_key(k),
            Requirement::DoesNotExist(k) => !labels.contains_key(k),
        })
    }
}

/// One field requirement (`path=value` or `path!=value`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FieldRequirement {
    /// Field label, e.g. `spec.nodeName`.
    pub field: String,
    /// Expected value.
    pub value: String,
    /// `!=` instead of `=`.
    pub negated: bool,
}

/// A parsed field selector.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FieldSelector(pub Vec<FieldRequirement>);

/// The field labels a kind supports beyond `metadata.name` and `metadata.namespace`
/// (each kind's `GetAttrs`/`AddFieldLabelConversionFunc` in k8s.io/kubernetes).
fn supported_fields(rt: &ResourceType) -> Vec<String> {
    let builtin: &[&str] = match (rt.group.as_str(), rt.kind.as_str()) {
        ("", "Pod") => &[
            "spec.nodeName",
            "spec.restartPolicy",
            "spec.schedulerName",
            "spec.serviceAccountName",
            "spec.hostNetwork",
            "status.phase",
            "status.podIP",
            "status.nominatedNodeName",
        ],
        ("", "Event") => &[
            "involvedObject.kind",
            "involvedObject.namespace",
            "involvedObject.name",
            "involvedObject.uid",
            "involvedObject.apiVersion",
            "involvedObject.resourceVersion",
            "involvedObject.fieldPath",
            "reason",
            "reportingComponent",
            "source",
            "type",
        ],
        ("events.k8s.io", "Event") => &[
            "regarding.kind",
            "regarding.namespace",
            "regarding.name",
            "regarding.uid",
            "regarding.apiVersion",
            "regarding.resourceVersion",
            "regarding.fieldPath",
            "reason",
            "reportingController",
            "type",
        ],
        ("", "Node") => &["spec.unschedulable"],
        ("", "Namespace") => &["status.phase"],
        ("", "Secret") => &["type"],
        ("batch", "Job") => &["status.successful"],
        _ => &[],
    };
    let mut all: Vec<String> = builtin.iter().map(|s| (*s).to_owned()).collect();
    all.extend(rt.selectable_fields.iter().cloned());
    all
}

/// The value of a field label on an object, as the API server compares it (strings; booleans and
/// numbers formatted; absent as `""`).
fn field_value(rt: &ResourceType, obj: &Value, field: &str) -> String {
    let path: Vec<&str> = match (rt.kind.as_str(), field) {
        ("Event", "source") => vec!["source", "component"],
        _ => field.split('.').collect(),
    };
    match meta::at(obj, &path) {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Bool(b)) => b.to_string(),
        Some(Value::Number(n)) => n.to_string(),
        Some(Value::Null) | None => {
            if field == "spec.hostNetwork" || field == "spec.unschedulable" {
                "false".into()
            } else {
                String::new()
            }
        }
        Some(other) => other.to_string(),
    }
}

impl FieldSelector {
    /// Parse the `fieldSelector` query parameter and check every field is supported by `rt`.
    ///
    /// # Errors
    /// 400 `field label not supported: …` as the API server answers.
    pub fn parse(rt: &ResourceType, s: &str) -> Result<Self, ApiError> {
        let supported = supported_fields(rt);
        let mut reqs = Vec::new();
        for part in s.split(',') {
            let part = part.trim();
            if part.is_empty() {
                continue;
            }
            let (field, value, negated) = if let Some((f, v)) = part.split_once("!=") {
                (f, v, true)
            } else if let Some((f, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
                (f, v, false)
            } else {
                return Err(ApiError::bad_request(format!(
                    "invalid selector: '{s}'; can't understand '{part}'"
                )));
            };
            let field = field.trim();
            if field != "metadata.name"
                && field != "metadata.namespace"
                && !supported.iter().any(|f| f == field)
            {
                return Err(if rt.custom {
                    ApiError::bad_request(format!(
                        "{field:?} is not a known field selector: only \"metadata.name\", \"metadata.namespace\""
                    ))
                } else {
                    ApiError::bad_request(format!("field label not supported: {field}"))
                });
            }
            reqs.push(FieldRequirement {
                field: field.to_owned(),
                value: value.trim().to_owned(),
                negated,
            });
        }
        Ok(Self(reqs))
    }

    /// Whether the (served-version) object satisfies every requirement.
    pub fn matches(&self, rt: &ResourceType, obj: &Value) -> bool {
        self.0
            .iter()
            .all(|r| (field_value(rt, obj, &r.field) == r.value) != r.negated)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn labels(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn equality_and_set_based_label_selectors() {
        let l = labels(json!({"app": "web", "tier": "front"}));
        let ok = [
            "app=web",
            "app==web",
            "app!=db",
            "app in (web, db)",
            "tier notin (back)",
            "app",
            "!missing",
            "app=web,tier",
        ];
        for s in ok {
            assert!(LabelSelector::parse(s).expect(s).matches(&l), "{s}");
        }
        let no = [
            "app=db",
            "app in (db)",
            "missing",
            "!app",
            "app notin (web)",
        ];
        for s in no {
            assert!(!LabelSelector::parse(s).expect(s).matches(&l), "{s}");
        }
        assert_eq!(LabelSelector::parse("a in (").map_err(|e| e.code), Err(400));
        assert_eq!(LabelSelector::parse("-x=1").map_err(|e| e.code), Err(400));
    }

    #[test]
    fn field_selectors_check_supported_labels() {
        let rt = super::super::resources::builtins()
            .into_iter()
            .find(|r| r.kind == "Pod")
            .expect("pods built in");
        let pod = json!({"metadata": {"name": "p"}, "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}});
        assert!(
            FieldSelector::parse(&rt, "spec.nodeName=n1,status.phase!=Failed")
                .expect("parses")
                .matches(&rt, &pod)
        );
        assert!(
            !FieldSelector::parse(&rt, "metadata.name=q")
                .expect("parses")
                .matches(&rt, &pod)
        );
        assert!(
            FieldSelector::parse(&rt, "spec.nodeName=")
                .expect("parses")
                .matches(&rt, &json!({}))
        );
        let err = FieldSelector::parse(&rt, "spec.foo=1").expect_err("unsupported");
        assert_eq!(err.message, "field label not supported: spec.foo");
    }
}
