//! Per-kind create and update rules (the registry strategies of k8s.io/kubernetes
//! `pkg/registry/...`): system metadata, defaulting (`pkg/apis/*/v1/defaults.go`), status
//! reset and spec/status isolation, and the validation that tests can run into.
//!
//! Defaulting and validation cover the fields this project's programs and tests use; the module
//! docs of `apiserver` list what is not checked.

use serde_json::{Map, Value, json};

use super::crd;
use super::error::{ApiError, Cause};
use super::meta::{self, NameRule};
use super::resources::ResourceType;

/// Shape an incoming object for creation: namespace from the URL, generated name, system fields
/// dropped, status reset, defaults applied.
pub fn prepare_create(rt: &ResourceType, mut obj: Value, ns: &str) -> Value {
    {
        let m = meta::meta_mut(&mut obj);
        if rt.namespaced {
            m.insert("namespace".into(), json!(ns));
        } else {
            m.remove("namespace");
        }
        let name = m
            .get("name")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_owned();
        if name.is_empty()
            && let Some(prefix) = m
                .get("generateName")
                .and_then(Value::as_str)
                .filter(|p| !p.is_empty())
        {
            let prefix: String = prefix.chars().take(58).collect();
            m.insert(
                "name".into(),
                json!(format!("{prefix}{}", meta::random_suffix())),
            );
        }
        for field in [
            "resourceVersion",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "selfLink",
            "managedFields",
        ] {
            m.remove(field);
        }
        m.insert("uid".into(), json!(meta::new_uid()));
        for empty in ["labels", "annotations", "finalizers", "ownerReferences"] {
            if m.get(empty).is_some_and(Value::is_null) {
                m.remove(empty);
            }
        }
    }
    if rt.custom {
        if rt.status
            && let Value::Object(m) = &mut obj
        {
            m.remove("status");
        }
        if let Some(schema) = &rt.schema {
            crd::prune(schema, &mut obj);
            crd::apply_defaults(schema, &mut obj);
        }
        return obj;
    }
    match (rt.group.as_str(), rt.kind.as_str()) {
        ("", "Pod") => {
            if let Some(spec) = obj.get_mut("spec") {
                default_pod_spec(spec);
            }
            let qos = qos_class(&obj["spec"]);
            obj["status"] = json!({"phase": "Pending", "qosClass": qos});
        }
        ("batch", "Job") => {
            default_job(&mut obj);
            obj["status"] = json!({});
        }
        ("", "Namespace") => {
            let name = meta::name(&obj).to_owned();
            let m = meta::meta_mut(&mut obj);
            let labels = m.entry("labels").or_insert_with(|| json!({}));
            if let Value::Object(l) = labels {
                l.insert("kubernetes.io/metadata.name".into(), json!(name));
            }
            if obj["spec"]["finalizers"].is_null() {
                obj["spec"]["finalizers"] = json!(["kubernetes"]);
            }
            obj["status"] = json!({"phase": "Active"});
        }
        ("", "Secret") => default_secret(&mut obj),
        ("", "Service") => {
            if let Some(spec) = obj.get_mut("spec") {
                default_service(spec);
            }
            obj["status"] = json!({"loadBalancer": {}});
        }
        ("apiextensions.k8s.io", "CustomResourceDefinition") => crd::prepare_crd(&mut obj),
        ("admissionregistration.k8s.io", _) => default_webhooks(rt, &mut obj),
        _ => {}
    }
    obj
}

/// Shape an update: the main resource cannot change status, and the status subresource can
/// change only status (`ResetObjectMetaForStatus` and friends).
pub fn prepare_update(
    rt: &ResourceType,
    old: &Value,
    mut new: Value,
    subresource: Option<&str>,
) -> Value {
    match subresource {
        Some("status") => {
            let mut out = old.clone();
            out["status"] = new.get("status").cloned().unwrap_or(Value::Null);
            if out["status"].is_null()
                && let Value::Object(m) = &mut out
            {
                m.remove("status");
            }
            let rv = meta::at(&new, &["metadata", "resourceVersion"]).cloned();
            let mf = meta::at(&new, &["metadata", "managedFields"]).cloned();
            let m = meta::meta_mut(&mut out);
            match rv {
                Some(rv) => m.insert("resourceVersion".into(), rv),
                None => m.remove("resourceVersion"),
            };
            if let Some(mf) = mf {
                m.insert("managedFields".into(), mf);
            }
            out
        }
        _ => {
            if rt.status
                && let Value::Object(m) = &mut new
            {
                match old.get("status") {
                    Some(s) => m.insert("status".into(), s.clone()),
                    None => m.remove("status"),
                };
            }
            if rt.custom {
                if let Some(schema) = &rt.schema {
                    crd::prune(schema, &mut new);
                    crd::apply_defaults(schema, &mut new);
                }
            } else {
                match (rt.group.as_str(), rt.kind.as_str()) {
                    ("", "Pod") => {
                        if let Some(spec) = new.get_mut("spec") {
                            default_pod_spec(spec);
                        }
                    }
                    ("batch", "Job") => {
                        if new["spec"]["selector"].is_null() {
                            new["spec"]["selector"] = old["spec"]["selector"].clone();
                        }
                        default_job(&mut new);
                    }
                    ("", "Secret") => default_secret(&mut new),
                    ("", "Service") => {
                        if let Some(spec) = new.get_mut("spec") {
                            default_service(spec);
                        }
                    }
                    ("", "Namespace") => {
                        if new["spec"]["finalizers"].is_null() {
                            new["spec"]["finalizers"] = old["spec"]["finalizers"].clone();
                        }
                        let name = meta::name(&new).to_owned();
                        if let Value::Object(l) = meta::meta_mut(&mut new)
                            .entry("labels")
                            .or_insert_with(|| json!({}))
                        {
                            l.insert("kubernetes.io/metadata.name".into(), json!(name));
                        }
                    }
                    ("admissionregistration.k8s.io", _) => default_webhooks(rt, &mut new),
                    ("apiextensions.k8s.io", "CustomResourceDefinition") => {
                        crd::default_crd_spec(&mut new)
                    }
                    _ => {}
                }
            }
            new
        }
    }
}

fn obj_entry<'a>(v: &'a mut Value, key: &str) -> &'a mut Value {
    if !v.is_object() {
        *v = json!({});
    }
    let Value::Object(m) = v else {
        unreachable!("made an object above")
    };
    m.entry(key).or_insert(Value::Null)
}

fn set_default(v: &mut Value, key: &str, default: Value) {
    if !v.is_object() {
        *v = json!({});
    }
    let entry = obj_entry(v, key);
    if entry.is_null() {
        *entry = default;
    }
}

fn default_probe(p: &mut Value) {
    if p.is_object() {
        set_default(p, "timeoutSeconds", json!(1));
        set_default(p, "periodSeconds", json!(10));
        set_default(p, "successThreshold", json!(1));
        set_default(p, "failureThreshold", json!(3));
    }
}

fn default_container(c: &mut Value) {
    let image = c["image"].as_str().unwrap_or_default().to_owned();
    let tag_latest = {
        let last = image.rsplit('/').next().unwrap_or_default();
        !image.contains('@') && (!last.contains(':') || last.ends_with(":latest"))
    };
    set_default(
        c,
        "imagePullPolicy",
        json!(if tag_latest { "Always" } else { "IfNotPresent" }),
    );
    set_default(c, "terminationMessagePath", json!("/dev/termination-log"));
    set_default(c, "terminationMessagePolicy", json!("File"));
    set_default(c, "resources", json!({}));
    if let Some(ports) = c.get_mut("ports").and_then(Value::as_array_mut) {
        for p in ports {
            set_default(p, "protocol", json!("TCP"));
        }
    }
    if let Some(env) = c.get_mut("env").and_then(Value::as_array_mut) {
        for e in env {
            if let Some(f) = e.get_mut("valueFrom").and_then(|v| v.get_mut("fieldRef")) {
                set_default(f, "apiVersion", json!("v1"));
            }
        }
    }
    for probe in ["livenessProbe", "readinessProbe", "startupProbe"] {
        if let Some(p) = c.get_mut(probe) {
            default_probe(p);
        }
    }
}

/// `SetDefaults_PodSpec` and friends, plus what the `ServiceAccount`, `Priority` and
/// `DefaultTolerationSeconds` admission plugins add.
fn default_pod_spec(spec: &mut Value) {
    if !spec.is_object() {
        return;
    }
    set_default(spec, "restartPolicy", json!("Always"));
    set_default(spec, "dnsPolicy", json!("ClusterFirst"));
    set_default(spec, "terminationGracePeriodSeconds", json!(30));
    set_default(spec, "schedulerName", json!("default-scheduler"));
    set_default(spec, "securityContext", json!({}));
    set_default(spec, "enableServiceLinks", json!(true));
    set_default(spec, "serviceAccountName", json!("default"));
    let sa = spec["serviceAccountName"].clone();
    set_default(spec, "serviceAccount", sa);
    set_default(spec, "priority", json!(0));
    set_default(spec, "preemptionPolicy", json!("PreemptLowerPriority"));
    let tolerations = obj_entry(spec, "tolerations");
    if tolerations.is_null() {
        *tolerations = json!([]);
    }
    if let Some(t) = tolerations.as_array_mut() {
        for key in [
            "node.kubernetes.io/not-ready",
            "node.kubernetes.io/unreachable",
        ] {
            if !t.iter().any(|x| x["key"] == key) {
                t.push(json!({"key": key, "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}));
            }
        }
    }
    for list in ["containers", "initContainers"] {
        if let Some(cs) = spec.get_mut(list).and_then(Value::as_array_mut) {
            cs.iter_mut().for_each(default_container);
        }
    }
    if let Some(vols) = spec.get_mut("volumes").and_then(Value::as_array_mut) {
        for v in vols {
            for source in ["configMap", "secret", "downwardAPI", "projected"] {
                if let Some(s) = v.get_mut(source).filter(|s| s.is_object()) {
                    set_default(s, "defaultMode", json!(420));
                }
            }
            if let Some(h) = v.get_mut("hostPath").filter(|s| s.is_object()) {
                set_default(h, "type", json!(""));
            }
            if let Some(items) = v
                .get_mut("downwardAPI")
                .and_then(|d| d.get_mut("items"))
                .and_then(Value::as_array_mut)
            {
                for i in items {
                    if let Some(f) = i.get_mut("fieldRef") {
                        set_default(f, "apiVersion", json!("v1"));
                    }
                }
            }
        }
    }
}

fn qos_class(spec: &Value) -> &'static str {
    let containers = spec["containers"].as_array().cloned().unwrap_or_default();
    let mut any = false;
    let mut guaranteed = !containers.is_empty();
    for c in &containers {
        let req = &c["resources"]["requests"];
        let lim = &c["resources"]["limits"];
        if req.as_object().is_some_and(|m| !m.is_empty())
            || lim.as_object().is_some_and(|m| !m.is_empty())
        {
            any = true;
        }
        let full = ["cpu", "memory"]
            .iter()
            .all(|r| !lim[r].is_null() && (req[r].is_null() || req[r] == lim[r]));
        guaranteed &= full;
    }
    if !any {
        "BestEffort"
    } else if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

fn default_job(job: &mut Value) {
    let uid = meta::uid(job).to_owned();
    let name = meta::name(job).to_owned();
    let spec = obj_entry(job, "spec");
    if !spec.is_object() {
        *spec = json!({});
    }
    set_default(spec, "parallelism", json!(1));
    set_default(spec, "completions", json!(1));
    set_default(spec, "backoffLimit", json!(6));
    set_default(spec, "completionMode", json!("NonIndexed"));
    set_default(spec, "suspend", json!(false));
    if spec["podFailurePolicy"].is_null() {
        set_default(spec, "podReplacementPolicy", json!("TerminatingOrFailed"));
    }
    let manual = spec["manualSelector"].as_bool() == Some(true);
    if !manual && spec["selector"].is_null() && !uid.is_empty() {
        spec["selector"] = json!({"matchLabels": {"batch.kubernetes.io/controller-uid": uid}});
    }
    let controller_uid = spec["selector"]["matchLabels"]["batch.kubernetes.io/controller-uid"]
        .as_str()
        .unwrap_or(&uid)
        .to_owned();
    if !manual {
        let template = obj_entry(spec, "template");
        let tmeta = obj_entry(template, "metadata");
        let labels = obj_entry(tmeta, "labels");
        if !labels.is_object() {
            *labels = json!({});
        }
        if let Value::Object(l) = labels {
            for (k, v) in [
                ("batch.kubernetes.io/controller-uid", &controller_uid),
                ("batch.kubernetes.io/job-name", &name),
                ("controller-uid", &controller_uid),
                ("job-name", &name),
            ] {
                l.entry(k).or_insert_with(|| json!(v));
            }
        }
    }
    if let Some(pod_spec) = spec.get_mut("template").and_then(|t| t.get_mut("spec")) {
        default_pod_spec(pod_spec);
    }
}

fn default_secret(obj: &mut Value) {
    set_default(obj, "type", json!("Opaque"));
    if let Some(Value::Object(string_data)) =
        obj.as_object_mut().and_then(|m| m.remove("stringData"))
    {
        let data = obj_entry(obj, "data");
        if !data.is_object() {
            *data = json!({});
        }
        if let Value::Object(d) = data {
            for (k, v) in string_data {
                d.insert(
                    k,
                    json!(base64_encode(v.as_str().unwrap_or_default().as_bytes())),
                );
            }
        }
    }
}

fn default_service(spec: &mut Value) {
    if !spec.is_object() {
        return;
    }
    set_default(spec, "type", json!("ClusterIP"));
    set_default(spec, "sessionAffinity", json!("None"));
    set_default(spec, "internalTrafficPolicy", json!("Cluster"));
    if spec["clusterIP"].is_null() && spec["type"] != "ExternalName" {
        let n = meta::random_u64();
        let ip = format!("10.96.{}.{}", (n >> 8) % 256, (n % 253) + 1);
        spec["clusterIP"] = json!(ip);
        spec["clusterIPs"] = json!([ip]);
        set_default(spec, "ipFamilies", json!(["IPv4"]));
        set_default(spec, "ipFamilyPolicy", json!("SingleStack"));
    }
    if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
        for p in ports {
            set_default(p, "protocol", json!("TCP"));
            let port = p["port"].clone();
            set_default(p, "targetPort", port);
        }
    }
}

fn default_webhooks(rt: &ResourceType, obj: &mut Value) {
    let mutating = rt.kind == "MutatingWebhookConfiguration";
    if let Some(hooks) = obj.get_mut("webhooks").and_then(Value::as_array_mut) {
        for h in hooks {
            set_default(h, "failurePolicy", json!("Fail"));
            set_default(h, "matchPolicy", json!("Equivalent"));
            set_default(h, "namespaceSelector", json!({}));
            set_default(h, "objectSelector", json!({}));
            set_default(h, "timeoutSeconds", json!(10));
            if mutating {
                set_default(h, "reinvocationPolicy", json!("Never"));
            }
            if let Some(rules) = h.get_mut("rules").and_then(Value::as_array_mut) {
                for r in rules {
                    set_default(r, "scope", json!("*"));
                }
            }
            if let Some(s) = h
                .get_mut("clientConfig")
                .and_then(|c| c.get_mut("service"))
                .filter(|s| s.is_object())
            {
                set_default(s, "port", json!(443));
            }
        }
    }
}

/// Standard base64 with padding (Secret `data`).
pub fn base64_encode(bytes: &[u8]) -> String {
    const T: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(char::from(T[((n >> (18 - 6 * i)) & 63) as usize]));
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// Decode standard base64; `None` when malformed.
pub fn base64_decode(s: &str) -> Option<Vec<u8>> {
    let s = s.trim_end_matches('=');
    let mut out = Vec::with_capacity(s.len() * 3 / 4);
    let mut acc = 0_u32;
    let mut bits = 0;
    for c in s.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        };
        acc = (acc << 6) | u32::from(v);
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push(u8::try_from((acc >> bits) & 0xff).ok()?);
        }
    }
    Some(out)
}

fn invalid(rt: &ResourceType, obj: &Value, causes: &[Cause]) -> Result<(), ApiError> {
    if causes.is_empty() {
        Ok(())
    } else {
        Err(ApiError::invalid(
            &rt.group,
            &rt.kind,
            meta::name(obj),
            causes,
        ))
    }
}

fn validate_containers(spec: &Value, path: &str, causes: &mut Vec<Cause>) {
    let containers = spec["containers"].as_array();
    if containers.is_none_or(Vec::is_empty) {
        causes.push(Cause::required(format!("{path}.containers"), ""));
    }
    let mut seen = Vec::new();
    for list in ["initContainers", "containers"] {
        for (i, c) in spec[list].as_array().into_iter().flatten().enumerate() {
            let name = c["name"].as_str().unwrap_or_default();
            let field = format!("{path}.{list}[{i}]");
            if name.is_empty() {
                causes.push(Cause::required(format!("{field}.name"), ""));
            } else {
                for msg in meta::validate_name(NameRule::Label, name) {
                    causes.push(Cause::invalid(format!("{field}.name"), &c["name"], msg));
                }
                if seen.contains(&name) {
                    causes.push(Cause {
                        reason: "FieldValueDuplicate",
                        field: format!("{field}.name"),
                        message: format!("Duplicate value: {name:?}"),
                    });
                }
                seen.push(name);
            }
            if c["image"].as_str().is_none_or(|s| s.trim().is_empty()) {
                causes.push(Cause::required(format!("{field}.image"), ""));
            }
        }
    }
    let mut volumes = Vec::new();
    for (i, v) in spec["volumes"].as_array().into_iter().flatten().enumerate() {
        let name = v["name"].as_str().unwrap_or_default();
        if name.is_empty() {
            causes.push(Cause::required(format!("{path}.volumes[{i}].name"), ""));
        } else if volumes.contains(&name) {
            causes.push(Cause {
                reason: "FieldValueDuplicate",
                field: format!("{path}.volumes[{i}].name"),
                message: format!("Duplicate value: {name:?}"),
            });
        }
        volumes.push(name);
    }
    for list in ["initContainers", "containers"] {
        for (i, c) in spec[list].as_array().into_iter().flatten().enumerate() {
            for (j, m) in c["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .enumerate()
            {
                let name = m["name"].as_str().unwrap_or_default();
                if !volumes.contains(&name) {
                    causes.push(Cause {
                        reason: "FieldValueNotFound",
                        field: format!("{path}.{list}[{i}].volumeMounts[{j}].name"),
                        message: format!("Not found: {name:?}"),
                    });
                }
            }
        }
    }
}

/// Validate a new object.
///
/// # Errors
/// 422 `Invalid` with every cause found.
pub fn validate_create(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    refuse_unfaithful(rt, obj)?;
    let mut causes = Vec::new();
    meta::validate_object_meta(obj, rt.name_rule, &mut causes);
    validate_kind(rt, obj, &mut causes);
    invalid(rt, obj, &causes)
}

fn validate_kind(rt: &ResourceType, obj: &Value, causes: &mut Vec<Cause>) {
    if rt.custom {
        if let Some(schema) = &rt.schema {
            crd::validate(schema, obj, causes);
        }
        return;
    }
    match (rt.group.as_str(), rt.kind.as_str()) {
        ("", "Pod") => {
            validate_containers(&obj["spec"], "spec", causes);
            let rp = &obj["spec"]["restartPolicy"];
            if !["Always", "OnFailure", "Never"].iter().any(|p| rp == p) {
                causes.push(Cause::not_supported(
                    "spec.restartPolicy",
                    rp,
                    &["Always", "OnFailure", "Never"],
                ));
            }
        }
        ("batch", "Job") => {
            let spec = &obj["spec"]["template"]["spec"];
            validate_containers(spec, "spec.template.spec", causes);
            let rp = &spec["restartPolicy"];
            if !["OnFailure", "Never"].iter().any(|p| rp == p) {
                causes.push(Cause::not_supported(
                    "spec.template.spec.restartPolicy",
                    rp,
                    &["OnFailure", "Never"],
                ));
            }
            if let Ok(sel) = super::selectors::LabelSelector::from_object(&obj["spec"]["selector"])
            {
                let labels = obj["spec"]["template"]["metadata"]["labels"]
                    .as_object()
                    .cloned()
                    .unwrap_or_default();
                if sel.0.is_empty() || !sel.matches(&labels) {
                    causes.push(Cause::invalid(
                        "spec.template.metadata.labels",
                        &Value::Object(labels),
                        "`selector` does not match template `labels`",
                    ));
                }
            }
            for f in [
                "parallelism",
                "completions",
                "backoffLimit",
                "activeDeadlineSeconds",
                "ttlSecondsAfterFinished",
            ] {
                if let Some(n) = obj["spec"][f].as_i64()
                    && (n < 0 || (f == "activeDeadlineSeconds" && n == 0))
                {
                    let detail = if f == "activeDeadlineSeconds" {
                        "must be greater than 0"
                    } else {
                        "must be greater than or equal to 0"
                    };
                    causes.push(Cause::invalid(format!("spec.{f}"), &obj["spec"][f], detail));
                }
            }
        }
        ("", "Secret") => {
            if let Some(data) = obj["data"].as_object() {
                for (k, v) in data {
                    if v.as_str().is_none_or(|s| base64_decode(s).is_none()) {
                        causes.push(Cause::invalid(
                            format!("data[{k}]"),
                            v,
                            "must be base64-encoded bytes",
                        ));
                    }
                }
            }
        }
        ("apiextensions.k8s.io", "CustomResourceDefinition") => crd::validate_crd(obj, causes),
        ("admissionregistration.k8s.io", _) => validate_webhooks(obj, causes),
        ("coordination.k8s.io", "Lease") => {
            if let Some(n) = obj["spec"]["leaseDurationSeconds"].as_i64()
                && n <= 0
            {
                causes.push(Cause::invalid(
                    "spec.leaseDurationSeconds",
                    &json!(n),
                    "must be greater than 0",
                ));
            }
        }
        _ => {}
    }
}

/// Configuration the double would act on differently from a real API server: refused (501).
fn refuse_unfaithful(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    match (rt.group.as_str(), rt.kind.as_str()) {
        ("admissionregistration.k8s.io", "MutatingWebhookConfiguration") => {
            let reinvoked = obj["webhooks"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|h| h["reinvocationPolicy"] == "IfNeeded");
            if reinvoked {
                return Err(ApiError::not_implemented(
                    "webhook reinvocationPolicy IfNeeded",
                ));
            }
        }
        ("apiextensions.k8s.io", "CustomResourceDefinition")
            if obj["spec"]["conversion"]["strategy"] == "Webhook" =>
        {
            return Err(ApiError::not_implemented("CRD conversion webhooks"));
        }
        _ => {}
    }
    Ok(())
}

fn validate_webhooks(obj: &Value, causes: &mut Vec<Cause>) {
    let mut names = Vec::new();
    for (i, h) in obj["webhooks"].as_array().into_iter().flatten().enumerate() {
        let field = format!("webhooks[{i}]");
        let name = h["name"].as_str().unwrap_or_default();
        if name.is_empty() {
            causes.push(Cause::required(format!("{field}.name"), ""));
        } else if name.split('.').count() < 3
            || !meta::validate_name(NameRule::Subdomain, name).is_empty()
        {
            causes.push(Cause::invalid(
                format!("{field}.name"),
                &h["name"],
                "should be a domain with at least three segments separated by dots",
            ));
        } else if names.contains(&name) {
            causes.push(Cause {
                reason: "FieldValueDuplicate",
                field: format!("{field}.name"),
                message: format!("Duplicate value: {name:?}"),
            });
        }
        names.push(name);
        let se = &h["sideEffects"];
        if se.is_null() {
            causes.push(Cause::required(
                format!("{field}.sideEffects"),
                "must specify one of None, NoneOnDryRun",
            ));
        } else if !["None", "NoneOnDryRun"].iter().any(|s| se == s) {
            causes.push(Cause::not_supported(
                format!("{field}.sideEffects"),
                se,
                &["None", "NoneOnDryRun"],
            ));
        }
        let versions = h["admissionReviewVersions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        if !versions.iter().any(|v| v == "v1" || v == "v1beta1") {
            causes.push(Cause::required(
                format!("{field}.admissionReviewVersions"),
                "must specify one of v1, v1beta1",
            ));
        }
        let cc = &h["clientConfig"];
        if let Some(url) = cc["url"].as_str()
            && !url.starts_with("https://")
        {
            causes.push(Cause::invalid(
                format!("{field}.clientConfig.url"),
                &cc["url"],
                "'https' is the only allowed URL scheme",
            ));
        }
        if cc["url"].is_null() == cc["service"].is_null() {
            causes.push(Cause::required(
                format!("{field}.clientConfig"),
                "exactly one of url or service is required",
            ));
        }
        let fp = &h["failurePolicy"];
        if !["Fail", "Ignore"].iter().any(|s| fp == s) {
            causes.push(Cause::not_supported(
                format!("{field}.failurePolicy"),
                fp,
                &["Fail", "Ignore"],
            ));
        }
        if let Some(t) = h["timeoutSeconds"].as_i64()
            && !(1..=30).contains(&t)
        {
            causes.push(Cause::invalid(
                format!("{field}.timeoutSeconds"),
                &json!(t),
                "the timeout value must be between 1 and 30 seconds",
            ));
        }
    }
}

fn without(v: &Value, paths: &[&[&str]]) -> Value {
    let mut v = v.clone();
    for path in paths {
        remove_path(&mut v, path);
    }
    v
}

fn remove_path(v: &mut Value, path: &[&str]) {
    match path {
        [] => {}
        [last] => {
            if let Value::Object(m) = v {
                m.remove(*last);
            }
        }
        [first, rest @ ..] => {
            if *first == "*" {
                if let Value::Array(a) = v {
                    for item in a {
                        remove_path(item, rest);
                    }
                }
            } else if let Some(child) = v.get_mut(*first) {
                remove_path(child, rest);
            }
        }
    }
}

/// Validate an update (the new object after the strategy shaped it).
///
/// # Errors
/// 422 `Invalid` with every cause found.
pub fn validate_update(rt: &ResourceType, old: &Value, new: &Value) -> Result<(), ApiError> {
    refuse_unfaithful(rt, new)?;
    let mut causes = Vec::new();
    meta::validate_object_meta(new, rt.name_rule, &mut causes);
    validate_kind(rt, new, &mut causes);
    if meta::is_deleting(old) {
        let before = meta::finalizers(old);
        if meta::finalizers(new).iter().any(|f| !before.contains(f)) {
            causes.push(Cause::forbidden(
                "metadata.finalizers",
                "no new finalizers can be added if the object is being deleted",
            ));
        }
    }
    if rt.custom {
        if let Some(schema) = &rt.schema {
            crd::validate_transition(schema, old, new, &mut causes);
        }
    } else {
        match (rt.group.as_str(), rt.kind.as_str()) {
            ("", "Pod") => {
                let mutable: &[&[&str]] = &[
                    &["containers", "*", "image"],
                    &["initContainers", "*", "image"],
                    &["activeDeadlineSeconds"],
                    &["tolerations"],
                    &["terminationGracePeriodSeconds"],
                    &["schedulingGates"],
                ];
                if without(&old["spec"], mutable) != without(&new["spec"], mutable) {
                    causes.push(Cause::forbidden(
                        "spec",
                        "pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
                    ));
                }
            }
            ("batch", "Job") => {
                for f in ["selector", "template", "completionMode"] {
                    if old["spec"][f] != new["spec"][f] {
                        causes.push(Cause::invalid(
                            format!("spec.{f}"),
                            &new["spec"][f],
                            "field is immutable",
                        ));
                    }
                }
            }
            ("", "Secret" | "ConfigMap")
                if old["immutable"] == json!(true)
                    && (old["data"] != new["data"]
                        || old["binaryData"] != new["binaryData"]
                        || new["immutable"] != json!(true)) =>
            {
                causes.push(Cause::forbidden(
                    "data",
                    "field is immutable when `immutable` is set",
                ));
            }
            ("apiextensions.k8s.io", "CustomResourceDefinition") => {
                for f in ["scope", "group"] {
                    if old["spec"][f] != new["spec"][f] {
                        causes.push(Cause::invalid(
                            format!("spec.{f}"),
                            &new["spec"][f],
                            "field is immutable",
                        ));
                    }
                }
            }
            _ => {}
        }
    }
    invalid(rt, new, &causes)
}

/// Merge `from` into the annotations of `obj`.
pub fn merge_annotations(obj: &mut Value, from: &Map<String, Value>) {
    if from.is_empty() {
        return;
    }
    let m = meta::meta_mut(obj);
    if let Value::Object(a) = m.entry("annotations").or_insert_with(|| json!({})) {
        for (k, v) in from {
            a.insert(k.clone(), v.clone());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_round_trips() {
        for s in ["", "a", "ab", "abc", "abcd", "hello world"] {
            let e = base64_encode(s.as_bytes());
            assert_eq!(
                base64_decode(&e).as_deref(),
                Some(s.as_bytes()),
                "{s} -> {e}"
            );
        }
        assert_eq!(base64_encode(b"hi"), "aGk=");
        assert!(base64_decode("a*b").is_none());
    }
}
