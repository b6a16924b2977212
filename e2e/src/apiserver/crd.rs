//! CustomResourceDefinitions: the CRD's own defaults, status and validation
//! (apiextensions-apiserver `pkg/apis/apiextensions/validation`), and for custom resources the
//! structural-schema behaviour of `pkg/apiserver/schema`: pruning of unknown fields, `default`s,
//! OpenAPI v3 value validation, and `x-kubernetes-validations` CEL rules (evaluated with
//! `kube-cel`, including transition rules such as `self == oldSelf`).

use serde_json::{Value, json};

use super::error::Cause;
use super::meta;

/// Fill the CRD's defaults and the status apiextensions-apiserver reports once the names are
/// accepted and the resource is established (at once, here).
pub fn prepare_crd(obj: &mut Value) {
    default_crd_spec(obj);
    let names = obj["spec"]["names"].clone();
    let storage: Vec<Value> = obj["spec"]["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["storage"].as_bool() == Some(true))
        .map(|v| v["name"].clone())
        .collect();
    let now = meta::now();
    obj["status"] = json!({
        "acceptedNames": names,
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": now},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": now},
        ],
        "storedVersions": storage,
    });
}

/// `SetDefaults_CustomResourceDefinition`.
pub fn default_crd_spec(obj: &mut Value) {
    let Some(spec) = obj.get_mut("spec").filter(|s| s.is_object()) else {
        return;
    };
    let kind = spec["names"]["kind"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if spec["names"].is_object() {
        if spec["names"]["singular"].is_null() {
            spec["names"]["singular"] = json!(kind.to_lowercase());
        }
        if spec["names"]["listKind"].is_null() && !kind.is_empty() {
            spec["names"]["listKind"] = json!(format!("{kind}List"));
        }
    }
    if spec["conversion"].is_null() {
        spec["conversion"] = json!({"strategy": "None"});
    }
}

/// Validate a CRD.
pub fn validate_crd(obj: &Value, causes: &mut Vec<Cause>) {
    let spec = &obj["spec"];
    let group = spec["group"].as_str().unwrap_or_default();
    let plural = spec["names"]["plural"].as_str().unwrap_or_default();
    if group.is_empty() {
        causes.push(Cause::required("spec.group", ""));
    } else if !group.contains('.') {
        causes.push(Cause::invalid(
            "spec.group",
            &spec["group"],
            "should be a domain with at least one dot",
        ));
    }
    if plural.is_empty() {
        causes.push(Cause::required("spec.names.plural", ""));
    }
    if spec["names"]["kind"].as_str().is_none_or(str::is_empty) {
        causes.push(Cause::required("spec.names.kind", ""));
    }
    let name = meta::name(obj);
    if !group.is_empty() && !plural.is_empty() && name != format!("{plural}.{group}") {
        causes.push(Cause::invalid(
            "metadata.name",
            &json!(name),
            "must be spec.names.plural+\".\"+spec.group",
        ));
    }
    let scope = &spec["scope"];
    if !["Namespaced", "Cluster"].iter().any(|s| scope == s) {
        causes.push(Cause::not_supported(
            "spec.scope",
            scope,
            &["Cluster", "Namespaced"],
        ));
    }
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    if versions.is_empty() {
        causes.push(Cause::required(
            "spec.versions",
            "must have exactly one version marked as storage version",
        ));
    } else if versions
        .iter()
        .filter(|v| v["storage"].as_bool() == Some(true))
        .count()
        != 1
    {
        causes.push(Cause::invalid(
            "spec.versions",
            &json!(versions.len()),
            "must have exactly one version marked as storage version",
        ));
    }
    for (i, v) in versions.iter().enumerate() {
        let schema = &v["schema"]["openAPIV3Schema"];
        if schema.is_null() {
            causes.push(Cause::required(
                format!("spec.versions[{i}].schema.openAPIV3Schema"),
                "schemas are required",
            ));
            continue;
        }
        let compiled = kube_cel::compile_schema(schema);
        for err in compiled.compilation_errors() {
            causes.push(Cause::invalid(
                format!("spec.versions[{i}].schema.openAPIV3Schema"),
                &json!("x-kubernetes-validations"),
                format!("compilation failed: {err}"),
            ));
        }
    }
}

fn preserves_unknown(schema: &Value) -> bool {
    schema["x-kubernetes-preserve-unknown-fields"].as_bool() == Some(true)
}

/// Drop fields the schema does not know (structural pruning).
pub fn prune(schema: &Value, obj: &mut Value) {
    let Value::Object(map) = obj else { return };
    for (k, v) in map.iter_mut() {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        if let Some(s) = schema["properties"].get(k) {
            prune_value(s, v);
        }
    }
    if !preserves_unknown(schema)
        && let Some(props) = schema["properties"].as_object()
    {
        map.retain(|k, _| {
            matches!(k.as_str(), "apiVersion" | "kind" | "metadata") || props.contains_key(k)
        });
    }
}

fn prune_value(schema: &Value, v: &mut Value) {
    match v {
        Value::Object(map) => {
            let embedded = schema["x-kubernetes-embedded-resource"].as_bool() == Some(true);
            if let Some(props) = schema["properties"].as_object() {
                if !preserves_unknown(schema) {
                    map.retain(|k, _| {
                        props.contains_key(k)
                            || (embedded
                                && matches!(k.as_str(), "apiVersion" | "kind" | "metadata"))
                    });
                }
                for (k, child) in map.iter_mut() {
                    if let Some(s) = props.get(k) {
                        prune_value(s, child);
                    }
                }
            } else if let Some(add) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for child in map.values_mut() {
                    prune_value(add, child);
                }
            } else if !preserves_unknown(schema) && schema["type"] == "object" {
                map.retain(|k, _| {
                    embedded && matches!(k.as_str(), "apiVersion" | "kind" | "metadata")
                });
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for item in items {
                    prune_value(s, item);
                }
            }
        }
        _ => {}
    }
}

/// Apply schema `default`s; nulls of non-nullable fields are dropped first, as the API server
/// does.
pub fn apply_defaults(schema: &Value, obj: &mut Value) {
    drop_nulls(schema, obj);
    *obj = kube_cel::apply_defaults(schema, obj);
}

fn drop_nulls(schema: &Value, v: &mut Value) {
    match v {
        Value::Object(map) => {
            if let Some(props) = schema["properties"].as_object() {
                map.retain(|k, child| {
                    !(child.is_null()
                        && props
                            .get(k)
                            .is_some_and(|s| s["nullable"].as_bool() != Some(true)))
                });
                for (k, child) in map.iter_mut() {
                    if let Some(s) = props.get(k) {
                        drop_nulls(s, child);
                    }
                }
            } else if let Some(add) = schema.get("additionalProperties").filter(|a| a.is_object()) {
                for child in map.values_mut() {
                    drop_nulls(add, child);
                }
            }
        }
        Value::Array(items) => {
            if let Some(s) = schema.get("items") {
                for item in items {
                    drop_nulls(s, item);
                }
            }
        }
        _ => {}
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

fn check_value(schema: &Value, v: &Value, path: &str, causes: &mut Vec<Cause>) {
    if v.is_null() {
        if schema["nullable"].as_bool() != Some(true) && schema.get("type").is_some() {
            causes.push(Cause {
                reason: "FieldValueTypeInvalid",
                field: path.to_owned(),
                message: format!(
                    "Invalid value: \"null\": {path} in body must be of type {}: \"null\"",
                    schema["type"].as_str().unwrap_or("object")
                ),
            });
        }
        return;
    }
    let int_or_string = schema["x-kubernetes-int-or-string"].as_bool() == Some(true);
    if let Some(want) = schema["type"].as_str() {
        let got = type_name(v);
        let ok = got == want
            || (want == "number" && got == "integer")
            || (int_or_string && (got == "integer" || got == "string"));
        if !ok {
            causes.push(Cause {
                reason: "FieldValueTypeInvalid",
                field: path.to_owned(),
                message: format!(
                    "Invalid value: {:?}: {path} in body must be of type {want}: {:?}",
                    got, got
                ),
            });
            return;
        }
    } else if int_or_string && !matches!(type_name(v), "integer" | "string") {
        causes.push(Cause {
            reason: "FieldValueTypeInvalid",
            field: path.to_owned(),
            message: format!(
                "Invalid value: {:?}: {path} in body must be of type integer or string",
                type_name(v)
            ),
        });
        return;
    }
    if let Some(values) = schema["enum"].as_array()
        && !values.contains(v)
    {
        let supported: Vec<String> = values
            .iter()
            .map(|x| x.as_str().map_or_else(|| x.to_string(), str::to_owned))
            .collect();
        let refs: Vec<&str> = supported.iter().map(String::as_str).collect();
        causes.push(Cause::not_supported(path, v, &refs));
    }
    if let Some(n) = v.as_f64() {
        let exclusive_min = schema["exclusiveMinimum"].as_bool() == Some(true);
        let exclusive_max = schema["exclusiveMaximum"].as_bool() == Some(true);
        if let Some(min) = schema["minimum"].as_f64()
            && (n < min || (exclusive_min && n <= min))
        {
            let op = if exclusive_min {
                "greater than"
            } else {
                "greater than or equal to"
            };
            causes.push(Cause::invalid(
                path,
                v,
                format!("{path} in body should be {op} {}", fmt_num(min)),
            ));
        }
        if let Some(max) = schema["maximum"].as_f64()
            && (n > max || (exclusive_max && n >= max))
        {
            let op = if exclusive_max {
                "less than"
            } else {
                "less than or equal to"
            };
            causes.push(Cause::invalid(
                path,
                v,
                format!("{path} in body should be {op} {}", fmt_num(max)),
            ));
        }
    }
    if let Some(s) = v.as_str() {
        let len = s.chars().count();
        if let Some(min) = schema["minLength"].as_u64()
            && (len as u64) < min
        {
            causes.push(Cause::invalid(
                path,
                v,
                format!("{path} in body should be at least {min} chars long"),
            ));
        }
        if let Some(max) = schema["maxLength"].as_u64()
            && (len as u64) > max
        {
            causes.push(Cause {
                reason: "FieldValueTooLong",
                field: path.to_owned(),
                message: format!("Too long: may not be more than {max} bytes"),
            });
        }
        if let Some(p) = schema["pattern"].as_str() {
            match regex::Regex::new(p) {
                Ok(re) if !re.is_match(s) => {
                    causes.push(Cause::invalid(
                        path,
                        v,
                        format!("{path} in body should match '{p}'"),
                    ));
                }
                Ok(_) => {}
                Err(_) => causes.push(Cause::invalid(
                    path,
                    v,
                    format!("the pattern '{p}' does not compile"),
                )),
            }
        }
    }
    match v {
        Value::Object(map) => {
            for req in schema["required"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
            {
                if !map.contains_key(req) {
                    causes.push(Cause::required(join(path, req), ""));
                }
            }
            let props = schema["properties"].as_object();
            let additional = schema.get("additionalProperties").filter(|a| a.is_object());
            for (k, child) in map {
                if let Some(s) = props.and_then(|p| p.get(k)) {
                    check_value(s, child, &join(path, k), causes);
                } else if let Some(s) = additional {
                    check_value(s, child, &join(path, k), causes);
                }
            }
            if let Some(max) = schema["maxProperties"].as_u64()
                && map.len() as u64 > max
            {
                causes.push(Cause {
                    reason: "FieldValueTooMany",
                    field: path.to_owned(),
                    message: format!("Too many: {}: must have at most {max} items", map.len()),
                });
            }
        }
        Value::Array(items) => {
            if let Some(min) = schema["minItems"].as_u64()
                && (items.len() as u64) < min
            {
                causes.push(Cause::invalid(
                    path,
                    &json!(items.len()),
                    format!("{path} in body should have at least {min} items"),
                ));
            }
            if let Some(max) = schema["maxItems"].as_u64()
                && (items.len() as u64) > max
            {
                causes.push(Cause {
                    reason: "FieldValueTooMany",
                    field: path.to_owned(),
                    message: format!("Too many: {}: must have at most {max} items", items.len()),
                });
            }
            if let Some(s) = schema.get("items") {
                for (i, item) in items.iter().enumerate() {
                    check_value(s, item, &format!("{path}[{i}]"), causes);
                }
            }
        }
        _ => {}
    }
}

fn fmt_num(n: f64) -> String {
    if n.fract() == 0.0 {
        format!("{n:.0}")
    } else {
        n.to_string()
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_owned()
    } else {
        format!("{path}.{key}")
    }
}

/// Validate a custom resource against its version's schema (values and CEL rules without
/// `oldSelf`).
pub fn validate(schema: &Value, obj: &Value, causes: &mut Vec<Cause>) {
    let mut body = obj.clone();
    if let Value::Object(m) = &mut body {
        m.remove("apiVersion");
        m.remove("kind");
        m.remove("metadata");
    }
    let mut root = schema.clone();
    if let Some(Value::Object(props)) = root.get_mut("properties") {
        props.remove("apiVersion");
        props.remove("kind");
        props.remove("metadata");
    }
    check_value(&root, &body, "", causes);
    cel_rules(&root, &body, None, causes);
}

/// Run the transition rules (those using `oldSelf`) on an update.
pub fn validate_transition(schema: &Value, old: &Value, new: &Value, causes: &mut Vec<Cause>) {
    let strip = |o: &Value| {
        let mut b = o.clone();
        if let Value::Object(m) = &mut b {
            m.remove("apiVersion");
            m.remove("kind");
            m.remove("metadata");
        }
        b
    };
    let mut root = schema.clone();
    if let Some(Value::Object(props)) = root.get_mut("properties") {
        props.remove("apiVersion");
        props.remove("kind");
        props.remove("metadata");
    }
    // Rules without oldSelf already ran in `validate`; keep only the transition failures.
    let mut all = Vec::new();
    cel_rules(&root, &strip(new), Some(&strip(old)), &mut all);
    let mut plain = Vec::new();
    cel_rules(&root, &strip(new), None, &mut plain);
    for c in all {
        if !plain
            .iter()
            .any(|p| p.field == c.field && p.message == c.message)
        {
            causes.push(c);
        }
    }
}

fn cel_rules(schema: &Value, body: &Value, old: Option<&Value>, causes: &mut Vec<Cause>) {
    if !schema.to_string().contains("x-kubernetes-validations") {
        return;
    }
    if let Err(errors) = kube_cel::Validator::new().validate(schema, body, old) {
        for e in errors.iter() {
            if e.kind == kube_cel::ErrorKind::CompilationFailure {
                continue;
            }
            let field = e.field_path.trim_start_matches('.').to_owned();
            causes.push(Cause {
                reason: "FieldValueInvalid",
                field: field.clone(),
                message: format!("Invalid value: \"object\": {}", e.message),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> Value {
        json!({"type": "object", "properties": {
            "spec": {"type": "object", "required": ["model"], "properties": {
                "model": {"type": "string", "x-kubernetes-validations": [{"rule": "self == oldSelf", "message": "model is immutable"}]},
                "size": {"type": "integer", "default": 1, "minimum": 0},
                "policy": {"type": "string", "enum": ["Delete", "Retain"], "default": "Delete"},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}},
            "status": {"type": "object", "properties": {"phase": {"type": "string"}}}}})
    }

    #[test]
    fn prunes_unknown_fields_and_applies_defaults() {
        let mut obj = json!({"apiVersion": "x/v1", "kind": "X", "metadata": {"name": "a"},
            "spec": {"model": "m", "bogus": 1, "free": {"any": {"thing": 1}}}, "junk": true});
        prune(&schema(), &mut obj);
        apply_defaults(&schema(), &mut obj);
        assert_eq!(
            obj["spec"],
            json!({"model": "m", "size": 1, "policy": "Delete", "free": {"any": {"thing": 1}}})
        );
        assert!(obj.get("junk").is_none());
        assert_eq!(obj["metadata"]["name"], "a");
    }

    #[test]
    fn validates_types_required_enum_and_minimum() {
        let mut causes = Vec::new();
        validate(
            &schema(),
            &json!({"spec": {"size": "x", "policy": "Nope"}}),
            &mut causes,
        );
        let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
        assert!(fields.contains(&"spec.model"), "{causes:?}");
        assert!(fields.contains(&"spec.size"), "{causes:?}");
        assert!(fields.contains(&"spec.policy"), "{causes:?}");
        let mut causes = Vec::new();
        validate(
            &schema(),
            &json!({"spec": {"model": "m", "size": -1}}),
            &mut causes,
        );
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert!(
            causes[0]
                .message
                .contains("should be greater than or equal to 0"),
            "{causes:?}"
        );
    }

    #[test]
    fn transition_rules_see_the_old_object() {
        let mut causes = Vec::new();
        validate_transition(
            &schema(),
            &json!({"spec": {"model": "a"}}),
            &json!({"spec": {"model": "b"}}),
            &mut causes,
        );
        assert_eq!(causes.len(), 1, "{causes:?}");
        assert!(causes[0].message.contains("model is immutable"));
        let mut causes = Vec::new();
        validate_transition(
            &schema(),
            &json!({"spec": {"model": "a"}}),
            &json!({"spec": {"model": "a", "size": 2}}),
            &mut causes,
        );
        assert!(causes.is_empty(), "{causes:?}");
    }
}
