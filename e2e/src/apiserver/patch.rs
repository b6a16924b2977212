//! Patches: JSON merge patch (RFC 7386), JSON patch (RFC 6902), and strategic merge patch for the
//! built-in kinds served (k8s.io/apimachinery `pkg/util/strategicpatch`, with the
//! `patchStrategy`/`patchMergeKey` tags of the k8s.io/api types written out below for the fields
//! of those kinds; other lists are replaced, as for a field without tags).

use serde_json::{Map, Value};

use super::error::ApiError;
use super::resources::ResourceType;

/// How a list field merges.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ListStrategy {
    /// Replaced whole (no `patchStrategy`).
    Replace,
    /// A list of maps merged by a key (`patchStrategy:"merge" patchMergeKey:"…"`).
    MergeKey(&'static str),
    /// A list of primitives merged as a set (`patchStrategy:"merge"` on `[]string`).
    MergePrimitives,
}

/// Where in a known type a value sits (to look up its fields' strategies).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ty {
    /// No strategy known below here.
    Unknown,
    /// The top of an object of a kind.
    Root(&'static str),
    /// `ObjectMeta`.
    ObjectMeta,
    /// `PodTemplateSpec`.
    PodTemplateSpec,
    /// `PodSpec`.
    PodSpec,
    /// `Container`.
    Container,
    /// `PodStatus`.
    PodStatus,
    /// `JobSpec`.
    JobSpec,
    /// `JobStatus`.
    JobStatus,
    /// `ServiceSpec`.
    ServiceSpec,
    /// `NodeSpec`.
    NodeSpec,
    /// `NodeStatus`.
    NodeStatus,
}

/// The root type of a built-in kind.
pub fn root(rt: &ResourceType) -> Ty {
    let kind: &'static str = match rt.kind.as_str() {
        "Pod" => "Pod",
        "Job" => "Job",
        "Service" => "Service",
        "Node" => "Node",
        "ServiceAccount" => "ServiceAccount",
        "MutatingWebhookConfiguration" | "ValidatingWebhookConfiguration" => "Webhooks",
        _ => "Other",
    };
    Ty::Root(kind)
}

/// The strategy of `field` in `ty`, and the type of its value (or items).
pub fn field(ty: Ty, field: &str) -> (ListStrategy, Ty) {
    use ListStrategy::{MergeKey, MergePrimitives, Replace};
    match (ty, field) {
        (Ty::Root(_), "metadata") | (Ty::PodTemplateSpec, "metadata") => (Replace, Ty::ObjectMeta),
        (Ty::Root("Pod"), "spec") | (Ty::PodTemplateSpec, "spec") => (Replace, Ty::PodSpec),
        (Ty::Root("Pod"), "status") => (Replace, Ty::PodStatus),
        (Ty::Root("Job"), "spec") => (Replace, Ty::JobSpec),
        (Ty::Root("Job"), "status") => (Replace, Ty::JobStatus),
        (Ty::Root("Service"), "spec") => (Replace, Ty::ServiceSpec),
        (Ty::Root("Node"), "spec") => (Replace, Ty::NodeSpec),
        (Ty::Root("Node"), "status") => (Replace, Ty::NodeStatus),
        (Ty::Root("ServiceAccount"), "secrets" | "imagePullSecrets") => {
            (MergeKey("name"), Ty::Unknown)
        }
        (Ty::Root("Webhooks"), "webhooks") => (MergeKey("name"), Ty::Unknown),
        (Ty::ObjectMeta, "finalizers") => (MergePrimitives, Ty::Unknown),
        (Ty::ObjectMeta, "ownerReferences") => (MergeKey("uid"), Ty::Unknown),
        (Ty::JobSpec, "template") => (Replace, Ty::PodTemplateSpec),
        (Ty::PodSpec, "containers" | "initContainers" | "ephemeralContainers") => {
            (MergeKey("name"), Ty::Container)
        }
        (Ty::PodSpec, "volumes" | "imagePullSecrets" | "schedulingGates" | "resourceClaims") => {
            (MergeKey("name"), Ty::Unknown)
        }
        (Ty::PodSpec, "hostAliases") => (MergeKey("ip"), Ty::Unknown),
        (Ty::PodSpec, "topologySpreadConstraints") => (MergeKey("topologyKey"), Ty::Unknown),
        (Ty::Container, "ports") => (MergeKey("containerPort"), Ty::Unknown),
        (Ty::Container, "env") => (MergeKey("name"), Ty::Unknown),
        (Ty::Container, "volumeMounts") => (MergeKey("mountPath"), Ty::Unknown),
        (Ty::Container, "volumeDevices") => (MergeKey("devicePath"), Ty::Unknown),
        (Ty::PodStatus | Ty::JobStatus | Ty::NodeStatus, "conditions") => {
            (MergeKey("type"), Ty::Unknown)
        }
        (Ty::PodStatus, "podIPs" | "hostIPs") => (MergeKey("ip"), Ty::Unknown),
        (Ty::PodStatus, "resourceClaimStatuses") => (MergeKey("name"), Ty::Unknown),
        (Ty::ServiceSpec, "ports") => (MergeKey("port"), Ty::Unknown),
        (Ty::NodeStatus, "addresses") => (MergeKey("type"), Ty::Unknown),
        (Ty::NodeSpec, "podCIDRs") => (MergePrimitives, Ty::Unknown),
        _ => (Replace, Ty::Unknown),
    }
}

fn bad(msg: impl Into<String>) -> ApiError {
    ApiError::bad_request(msg)
}

/// Apply a JSON merge patch.
pub fn merge_patch(target: &Value, patch: &Value) -> Value {
    let mut out = target.clone();
    json_patch::merge(&mut out, patch);
    out
}

/// Apply a JSON patch.
///
/// # Errors
/// 422 when an operation fails (as the API server answers a failed `test` or a bad path), 400
/// when the document is not a JSON patch.
pub fn json_patch(target: &Value, patch: &Value) -> Result<Value, ApiError> {
    let mut ops: json_patch::Patch = serde_json::from_value(patch.clone()).map_err(|e| {
        bad(format!(
            "the server rejected our request due to an error in our request: {e}"
        ))
    })?;
    // kube-apiserver's JSON patch library (evanphx/json-patch) lets `test` of a missing path
    // against `null` succeed; clients rely on it (kube-rs adds the first finalizer with
    // `test /metadata/finalizers null` + `add`).
    ops.0.retain(|op| match op {
        json_patch::PatchOperation::Test(t) => {
            !(t.value.is_null() && target.pointer(t.path.as_str()).is_none())
        }
        _ => true,
    });
    let mut out = target.clone();
    json_patch::patch(&mut out, &ops).map_err(|e| ApiError {
        code: 422,
        reason: "Invalid".into(),
        message: format!("the server rejected our request due to an error in our request: {e}"),
        details: None,
    })?;
    Ok(out)
}

/// Apply a strategic merge patch to a built-in kind.
///
/// # Errors
/// 400 on a malformed patch or an unknown directive.
pub fn strategic_merge(
    rt: &ResourceType,
    target: &Value,
    patch: &Value,
) -> Result<Value, ApiError> {
    let (Value::Object(t), Value::Object(p)) = (target, patch) else {
        return Err(bad(
            "the body of the request was in an unknown format - a strategic merge patch must be a JSON object",
        ));
    };
    match merge_map(t, p, root(rt))? {
        Some(m) => Ok(Value::Object(m)),
        None => Ok(Value::Object(Map::new())),
    }
}

fn merge_map(
    original: &Map<String, Value>,
    patch: &Map<String, Value>,
    ty: Ty,
) -> Result<Option<Map<String, Value>>, ApiError> {
    match patch.get("$patch").and_then(Value::as_str) {
        Some("replace") => {
            let mut p = patch.clone();
            p.remove("$patch");
            return Ok(Some(strip_directives(&p, ty)?));
        }
        Some("delete") => return Ok(None),
        Some("merge") | None => {}
        Some(other) => return Err(bad(format!("Unknown patch type: {other:?}"))),
    }
    let mut out = original.clone();
    if let Some(retain) = patch.get("$retainKeys") {
        let keys: Vec<&str> = retain
            .as_array()
            .ok_or_else(|| bad("$retainKeys must be a list of strings"))?
            .iter()
            .filter_map(Value::as_str)
            .collect();
        out.retain(|k, _| keys.contains(&k.as_str()));
    }
    let mut orders = Vec::new();
    for (key, pv) in patch {
        if let Some(field) = key.strip_prefix("$setElementOrder/") {
            orders.push((field.to_owned(), pv.clone()));
            continue;
        }
        if let Some(field) = key.strip_prefix("$deleteFromPrimitiveList/") {
            let remove = pv.as_array().cloned().unwrap_or_default();
            if let Some(Value::Array(list)) = out.get_mut(field) {
                list.retain(|x| !remove.contains(x));
            }
            continue;
        }
        if key.starts_with('$') {
            continue;
        }
        let (strategy, child) = field(ty, key);
        if pv.is_null() {
            out.remove(key);
            continue;
        }
        let merged = match (out.get(key), pv) {
            (Some(Value::Object(o)), Value::Object(p)) => {
                merge_map(o, p, child)?.map(Value::Object)
            }
            (None | Some(Value::Null), Value::Object(p)) => {
                merge_map(&Map::new(), p, child)?.map(Value::Object)
            }
            (Some(Value::Array(o)), Value::Array(p)) => {
                Some(Value::Array(merge_list(o, p, strategy, child)?))
            }
            (None | Some(Value::Null), Value::Array(p)) => {
                Some(Value::Array(merge_list(&[], p, strategy, child)?))
            }
            (_, v) => Some(v.clone()),
        };
        match merged {
            Some(v) => {
                out.insert(key.clone(), v);
            }
            None => {
                out.remove(key);
            }
        }
    }
    for (field_name, order) in orders {
        let (strategy, _) = field(ty, &field_name);
        if let (Some(Value::Array(list)), Some(order)) =
            (out.get_mut(&field_name), order.as_array())
        {
            reorder(list, order, strategy);
        }
    }
    Ok(Some(out))
}

fn strip_directives(m: &Map<String, Value>, ty: Ty) -> Result<Map<String, Value>, ApiError> {
    Ok(merge_map(&Map::new(), m, ty)?.unwrap_or_default())
}

fn key_of<'a>(v: &'a Value, key: &str) -> Option<&'a Value> {
    v.as_object().and_then(|m| m.get(key))
}

fn merge_list(
    original: &[Value],
    patch: &[Value],
    strategy: ListStrategy,
    child: Ty,
) -> Result<Vec<Value>, ApiError> {
    match strategy {
        ListStrategy::Replace => patch
            .iter()
            .map(|v| match v {
                Value::Object(m) => Ok(Value::Object(strip_directives(m, child)?)),
                other => Ok(other.clone()),
            })
            .collect(),
        ListStrategy::MergePrimitives => {
            let mut out = original.to_vec();
            for v in patch {
                if !out.contains(v) {
                    out.push(v.clone());
                }
            }
            Ok(out)
        }
        ListStrategy::MergeKey(key) => {
            if patch
                .iter()
                .any(|v| v.get("$patch").and_then(Value::as_str) == Some("replace"))
            {
                return patch
                    .iter()
                    .filter(|v| v.get("$patch").is_none())
                    .map(|v| match v {
                        Value::Object(m) => Ok(Value::Object(strip_directives(m, child)?)),
                        other => Ok(other.clone()),
                    })
                    .collect();
            }
            let mut out = original.to_vec();
            for item in patch {
                let Value::Object(pm) = item else {
                    return Err(bad(format!(
                        "the list items of a field merged by {key:?} must be objects"
                    )));
                };
                let Some(k) = pm.get(key) else {
                    return Err(bad(format!(
                        "map: {pm:?} does not contain declared merge key: {key}"
                    )));
                };
                let pos = out.iter().position(|o| key_of(o, key) == Some(k));
                let directive = pm.get("$patch").and_then(Value::as_str);
                match (pos, directive) {
                    (Some(i), Some("delete")) => {
                        out.remove(i);
                    }
                    (None, Some("delete")) => {}
                    (Some(i), _) => {
                        let Value::Object(om) = &out[i] else { continue };
                        match merge_map(om, pm, child)? {
                            Some(m) => out[i] = Value::Object(m),
                            None => {
                                out.remove(i);
                            }
                        }
                    }
                    (None, _) => {
                        if let Some(m) = merge_map(&Map::new(), pm, child)? {
                            out.push(Value::Object(m));
                        }
                    }
                }
            }
            Ok(out)
        }
    }
}

fn reorder(list: &mut Vec<Value>, order: &[Value], strategy: ListStrategy) {
    let position = |v: &Value| -> Option<usize> {
        order.iter().position(|o| match strategy {
            ListStrategy::MergeKey(k) => key_of(o, k).is_some() && key_of(o, k) == key_of(v, k),
            _ => o == v,
        })
    };
    let mut keyed: Vec<(usize, Value)> = list
        .drain(..)
        .enumerate()
        .map(|(i, v)| (position(&v).map_or(order.len() + i, |p| p), v))
        .collect();
    keyed.sort_by_key(|(p, _)| *p);
    list.extend(keyed.into_iter().map(|(_, v)| v));
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::apiserver::resources::builtins;

    fn pods() -> ResourceType {
        builtins()
            .into_iter()
            .find(|r| r.kind == "Pod")
            .expect("pods are built in")
    }

    #[test]
    fn strategic_merge_merges_containers_by_name_and_env_by_name() {
        let pod = json!({"spec": {"containers": [
            {"name": "a", "image": "x", "env": [{"name": "A", "value": "1"}]},
            {"name": "b", "image": "y"}]}});
        let patch =
            json!({"spec": {"containers": [{"name": "a", "env": [{"name": "B", "value": "2"}]}]}});
        let out = strategic_merge(&pods(), &pod, &patch).expect("merges");
        assert_eq!(out["spec"]["containers"][0]["image"], "x");
        assert_eq!(
            out["spec"]["containers"][0]["env"].as_array().map(Vec::len),
            Some(2)
        );
        assert_eq!(out["spec"]["containers"][1]["name"], "b");
    }

    #[test]
    fn strategic_merge_directives() {
        let pod = json!({"metadata": {"finalizers": ["a/x"], "labels": {"k": "v", "z": "1"}},
            "spec": {"containers": [{"name": "a", "image": "x"}, {"name": "b", "image": "y"}],
                     "tolerations": [{"key": "t"}]}});
        let patch = json!({"metadata": {"finalizers": ["b/y"], "labels": {"z": null}},
            "spec": {"containers": [{"name": "b", "$patch": "delete"}], "tolerations": [{"key": "u"}]}});
        let out = strategic_merge(&pods(), &pod, &patch).expect("merges");
        assert_eq!(out["metadata"]["finalizers"], json!(["a/x", "b/y"]));
        assert_eq!(out["metadata"]["labels"], json!({"k": "v"}));
        assert_eq!(
            out["spec"]["containers"],
            json!([{"name": "a", "image": "x"}])
        );
        assert_eq!(out["spec"]["tolerations"], json!([{"key": "u"}]));
        let del = json!({"$deleteFromPrimitiveList/finalizers": ["a/x"]});
        let out = strategic_merge(&pods(), &out, &json!({"metadata": del})).expect("merges");
        assert_eq!(out["metadata"]["finalizers"], json!(["b/y"]));
    }

    #[test]
    fn strategic_merge_set_element_order() {
        let pod = json!({"spec": {"containers": [{"name": "a"}, {"name": "b"}]}});
        let patch = json!({"spec": {"$setElementOrder/containers": [{"name": "b"}, {"name": "a"}, {"name": "c"}],
            "containers": [{"name": "c"}]}});
        let out = strategic_merge(&pods(), &pod, &patch).expect("merges");
        let names: Vec<&str> = out["spec"]["containers"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|c| c["name"].as_str())
            .collect();
        assert_eq!(names, ["b", "a", "c"]);
    }

    #[test]
    fn json_patch_test_of_a_missing_path_against_null_passes_as_upstream() {
        let target = serde_json::json!({"metadata": {"name": "a"}});
        let patch = serde_json::json!([
            {"op": "test", "path": "/metadata/finalizers", "value": null},
            {"op": "add", "path": "/metadata/finalizers", "value": ["x"]}
        ]);
        let out = json_patch(&target, &patch).unwrap();
        assert_eq!(out["metadata"]["finalizers"], serde_json::json!(["x"]));
        let present = serde_json::json!({"metadata": {"finalizers": []}});
        assert!(
            json_patch(&present, &patch).is_err(),
            "a present value still has to match"
        );
    }

    #[test]
    fn json_patch_test_failure_is_422() {
        let err = json_patch(
            &json!({"a": 1}),
            &json!([{"op": "test", "path": "/a", "value": 2}]),
        )
        .expect_err("fails");
        assert_eq!(err.code, 422);
        let err = json_patch(&json!({"a": 1}), &json!({"op": "add"})).expect_err("not a patch");
        assert_eq!(err.code, 400);
    }
}
