//! Admission webhooks (k8s.io/apiserver `pkg/admission/plugin/webhook`): for every request, the
//! registered MutatingWebhookConfigurations' webhooks (in name order, `reinvocationPolicy`
//! treated as `Never`), then the ValidatingWebhookConfigurations' ones, are matched on `rules`,
//! `namespaceSelector`, `objectSelector` and CEL `matchConditions`, and called with a v1
//! `AdmissionReview` over HTTPS, verifying the server certificate against `caBundle`. Returned
//! JSON patches are applied; a denial becomes the `Status` the API server returns; an error or
//! timeout follows `failurePolicy`.
//!
//! A `clientConfig.service` reference is reached through a route the test registers with
//! [`super::ApiServer::route_service`] (there is no cluster network); the certificate must be
//! valid for `<service>.<namespace>.svc`, as kube-apiserver requires. Webhooks are not called for
//! webhook configuration objects themselves, as upstream.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, ServerName};

use super::Shared;
use super::error::ApiError;
use super::meta;
use super::patch;
use super::resources::ResourceType;
use super::selectors::LabelSelector;
use super::strategy;

/// One request passing through admission.
#[derive(Clone, Debug)]
pub struct Attributes<'a> {
    /// The served type.
    pub rt: &'a ResourceType,
    /// `CREATE`, `UPDATE`, `DELETE`.
    pub operation: &'static str,
    /// Subresource (`status`, `binding`) or empty.
    pub subresource: &'a str,
    /// Namespace of the object.
    pub namespace: &'a str,
    /// Name of the object.
    pub name: &'a str,
    /// The existing object (served form) for UPDATE and DELETE.
    pub old: Option<&'a Value>,
    /// `dryRun`.
    pub dry_run: bool,
}

fn exempt(attrs: &Attributes<'_>) -> bool {
    attrs.rt.group == "admissionregistration.k8s.io"
}

fn webhooks(shared: &Shared, resource: &str) -> Vec<Value> {
    let st = shared.store.lock();
    let key = super::resources::StorageKey::new("admissionregistration.k8s.io", resource);
    st.list(&key, None)
        .into_iter()
        .flat_map(|cfg| cfg["webhooks"].as_array().cloned().unwrap_or_default())
        .collect()
}

fn list_matches(list: &Value, value: &str) -> bool {
    list.as_array()
        .is_some_and(|a| a.iter().any(|v| v == "*" || v == value))
}

fn resource_matches(list: &Value, resource: &str, sub: &str) -> bool {
    let full = if sub.is_empty() {
        resource.to_owned()
    } else {
        format!("{resource}/{sub}")
    };
    list.as_array().is_some_and(|a| {
        a.iter().filter_map(Value::as_str).any(|r| {
            r == "*/*"
                || r == full
                || (sub.is_empty() && r == "*")
                || (!sub.is_empty() && (r == format!("*/{sub}") || r == format!("{resource}/*")))
        })
    })
}

fn rule_matches(hook: &Value, attrs: &Attributes<'_>) -> bool {
    hook["rules"].as_array().is_some_and(|rules| {
        rules.iter().any(|r| {
            let scope = r["scope"].as_str().unwrap_or("*");
            let scope_ok = match scope {
                "Namespaced" => attrs.rt.namespaced,
                "Cluster" => !attrs.rt.namespaced,
                _ => true,
            };
            scope_ok
                && list_matches(&r["operations"], attrs.operation)
                && list_matches(&r["apiGroups"], &attrs.rt.group)
                && list_matches(&r["apiVersions"], &attrs.rt.version)
                && resource_matches(&r["resources"], &attrs.rt.plural, attrs.subresource)
        })
    })
}

fn selector_matches(
    sel: &Value,
    labels: &serde_json::Map<String, Value>,
) -> Result<bool, ApiError> {
    if sel.is_null() {
        return Ok(true);
    }
    Ok(LabelSelector::from_object(sel)?.matches(labels))
}

/// Whether the webhook applies; `Err` when a match condition could not be evaluated.
fn hook_matches(
    shared: &Shared,
    hook: &Value,
    attrs: &Attributes<'_>,
    obj: &Value,
) -> Result<bool, String> {
    if !rule_matches(hook, attrs) {
        return Ok(false);
    }
    let ns_labels = if attrs.rt.plural == "namespaces" && attrs.rt.group.is_empty() {
        Some(meta::labels(obj))
    } else if attrs.rt.namespaced {
        let st = shared.store.lock();
        Some(
            st.get(
                &super::resources::StorageKey::new("", "namespaces"),
                "",
                attrs.namespace,
            )
            .map(meta::labels)
            .unwrap_or_default(),
        )
    } else {
        None
    };
    if let Some(labels) = ns_labels
        && !selector_matches(&hook["namespaceSelector"], &labels).map_err(|e| e.message)?
    {
        return Ok(false);
    }
    let new_match =
        selector_matches(&hook["objectSelector"], &meta::labels(obj)).map_err(|e| e.message)?;
    let old_match = attrs
        .old
        .map(|o| selector_matches(&hook["objectSelector"], &meta::labels(o)))
        .transpose()
        .map_err(|e| e.message)?
        .unwrap_or(false);
    if !new_match && !old_match {
        return Ok(false);
    }
    let conditions = hook["matchConditions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    if conditions.is_empty() {
        return Ok(true);
    }
    let object = if attrs.operation == "DELETE" {
        Value::Null
    } else {
        obj.clone()
    };
    let request = json!({
        "operation": attrs.operation,
        "userInfo": {"username": "system:admin", "groups": ["system:masters", "system:authenticated"]},
        "name": attrs.name,
        "namespace": attrs.namespace,
        "dryRun": attrs.dry_run,
        "kind": {"group": attrs.rt.group, "version": attrs.rt.version, "kind": attrs.rt.kind},
        "resource": {"group": attrs.rt.group, "version": attrs.rt.version, "resource": attrs.rt.plural},
        "subResource": attrs.subresource,
    });
    let mut all = true;
    for c in &conditions {
        let expression = c["expression"].as_str().unwrap_or_default();
        match eval_condition(expression, &object, attrs.old, &request) {
            Ok(true) => {}
            Ok(false) => all = false,
            Err(why) => {
                return Err(format!(
                    "failed to evaluate match condition {:?}: {why}",
                    c["name"].as_str().unwrap_or_default()
                ));
            }
        }
    }
    Ok(all)
}

/// Fields of the built-in kinds whose values are maps with free-form keys (not escaped in CEL,
/// unlike struct field names).
const MAP_FIELDS: &[&str] = &[
    "labels",
    "annotations",
    "data",
    "binaryData",
    "stringData",
    "nodeSelector",
    "matchLabels",
    "limits",
    "requests",
    "capacity",
    "allocatable",
];

const CEL_RESERVED: &[&str] = &[
    "true",
    "false",
    "null",
    "in",
    "as",
    "break",
    "const",
    "continue",
    "else",
    "for",
    "function",
    "if",
    "import",
    "let",
    "loop",
    "package",
    "namespace",
    "return",
    "var",
    "void",
    "while",
];

/// Escape a struct field name as Kubernetes CEL does (`apiserver/schema/cel/model`).
fn escape_field(name: &str) -> String {
    if CEL_RESERVED.contains(&name) {
        return format!("__{name}__");
    }
    let mut out = String::with_capacity(name.len());
    for ch in name.chars() {
        match ch {
            '_' => out.push_str("__"),
            '.' => out.push_str("__dot__"),
            '-' => out.push_str("__dash__"),
            '/' => out.push_str("__slash__"),
            c => out.push(c),
        }
    }
    out
}

fn cel_json(v: &Value, map: bool) -> Value {
    match v {
        Value::Object(m) => Value::Object(
            m.iter()
                .map(|(k, val)| {
                    let key = if map { k.clone() } else { escape_field(k) };
                    (key, cel_json(val, MAP_FIELDS.contains(&k.as_str())))
                })
                .collect(),
        ),
        Value::Array(a) => Value::Array(a.iter().map(|x| cel_json(x, false)).collect()),
        other => other.clone(),
    }
}

/// Evaluate one match condition with `object`, `oldObject` and `request` bound.
fn eval_condition(
    expression: &str,
    object: &Value,
    old: Option<&Value>,
    request: &Value,
) -> Result<bool, String> {
    use kube_cel::KubeCelExt as _;
    use kube_cel::cel;
    let program =
        cel::Program::compile(expression).map_err(|e| format!("compilation failed: {e}"))?;
    let mut ctx = cel::Context::default();
    ctx.register_all();
    let to = |v: &Value| cel::to_value(cel_json(v, false)).map_err(|e| e.to_string());
    ctx.add_variable_from_value("object", to(object)?);
    ctx.add_variable_from_value("oldObject", to(old.unwrap_or(&Value::Null))?);
    ctx.add_variable_from_value("request", to(request)?);
    match program.execute(&ctx) {
        Ok(cel::Value::Bool(b)) => Ok(b),
        Ok(other) => Err(format!("expression returned non-boolean: {other:?}")),
        Err(e) => Err(e.to_string()),
    }
}

fn review(attrs: &Attributes<'_>, obj: &Value, uid: &str) -> Value {
    let gvk = json!({"group": attrs.rt.group, "version": attrs.rt.version, "kind": attrs.rt.kind});
    let gvr =
        json!({"group": attrs.rt.group, "version": attrs.rt.version, "resource": attrs.rt.plural});
    let mut request = json!({
        "uid": uid,
        "kind": gvk, "resource": gvr, "requestKind": gvk, "requestResource": gvr,
        "name": attrs.name,
        "operation": attrs.operation,
        "userInfo": {"username": "system:admin", "groups": ["system:masters", "system:authenticated"]},
        "object": if attrs.operation == "DELETE" { Value::Null } else { obj.clone() },
        "oldObject": attrs.old.cloned().unwrap_or(Value::Null),
        "dryRun": attrs.dry_run,
        "options": match attrs.operation {
            "CREATE" => json!({"kind": "CreateOptions", "apiVersion": "meta.k8s.io/v1"}),
            "UPDATE" => json!({"kind": "UpdateOptions", "apiVersion": "meta.k8s.io/v1"}),
            _ => json!({"kind": "DeleteOptions", "apiVersion": "meta.k8s.io/v1"}),
        },
    });
    if !attrs.namespace.is_empty() {
        request["namespace"] = json!(attrs.namespace);
    }
    if !attrs.subresource.is_empty() {
        request["subResource"] = json!(attrs.subresource);
        request["requestSubResource"] = json!(attrs.subresource);
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

/// Where and how to reach a webhook.
struct Endpoint {
    addr: String,
    server_name: String,
    host_header: String,
    path: String,
    ca: Vec<u8>,
}

fn endpoint(shared: &Shared, hook: &Value) -> Result<Endpoint, String> {
    let cc = &hook["clientConfig"];
    let ca = match cc["caBundle"].as_str() {
        Some(b) if !b.is_empty() => {
            strategy::base64_decode(b).ok_or("caBundle is not valid base64")?
        }
        _ => Vec::new(),
    };
    if let Some(url) = cc["url"].as_str() {
        let rest = url
            .strip_prefix("https://")
            .ok_or_else(|| format!("webhook URL {url:?} is not https"))?;
        let (authority, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        let host = match authority.rsplit_once(':') {
            Some((h, _)) if !h.ends_with(']') || authority.starts_with('[') => h,
            _ => authority,
        };
        let addr = if authority.contains(':') && !authority.ends_with(']') {
            authority.to_owned()
        } else {
            format!("{authority}:443")
        };
        return Ok(Endpoint {
            addr,
            server_name: host
                .trim_start_matches('[')
                .trim_end_matches(']')
                .to_owned(),
            host_header: authority.to_owned(),
            path: path.to_owned(),
            ca,
        });
    }
    let svc = &cc["service"];
    let name = svc["name"].as_str().unwrap_or_default();
    let namespace = svc["namespace"].as_str().unwrap_or_default();
    let port = svc["port"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .unwrap_or(443);
    let routes = shared
        .services
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let addr = routes
        .get(&(namespace.to_owned(), name.to_owned(), port))
        .ok_or_else(|| format!("service \"{namespace}/{name}\" port {port} is not routed (ApiServer::route_service)"))?;
    let host = format!("{name}.{namespace}.svc");
    Ok(Endpoint {
        addr: addr.to_string(),
        server_name: host.clone(),
        host_header: format!("{host}:{port}"),
        path: svc["path"].as_str().unwrap_or("/").to_owned(),
        ca,
    })
}

async fn post(ep: &Endpoint, body: Vec<u8>) -> Result<Value, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(&ep.ca) {
        let cert = cert.map_err(|e| format!("caBundle: {e}"))?;
        roots.add(cert).map_err(|e| format!("caBundle: {e}"))?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let name = ServerName::try_from(ep.server_name.clone()).map_err(|e| e.to_string())?;
    let tcp = tokio::net::TcpStream::connect(&ep.addr)
        .await
        .map_err(|e| format!("dial tcp {}: {e}", ep.addr))?;
    let tls = connector
        .connect(name, tcp)
        .await
        .map_err(|e| format!("tls: failed to verify certificate: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tls))
        .await
        .map_err(|e| e.to_string())?;
    tokio::spawn(async move {
        // The connection ends with the request; its error is the request's.
        let _ = conn.await;
    });
    let req = axum::http::Request::post(ep.path.as_str())
        .header("Host", ep.host_header.as_str())
        .header("Content-Type", "application/json")
        .header("Accept", "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(|e| e.to_string())?;
    let resp = sender.send_request(req).await.map_err(|e| e.to_string())?;
    let status = resp.status();
    let bytes = resp
        .into_body()
        .collect()
        .await
        .map_err(|e| e.to_string())?
        .to_bytes();
    if !status.is_success() {
        return Err(format!(
            "the server responded with status {status}: {}",
            String::from_utf8_lossy(&bytes)
        ));
    }
    serde_json::from_slice(&bytes).map_err(|e| format!("received invalid webhook response: {e}"))
}

/// The outcome of one call.
enum Verdict {
    Allowed(Option<Value>),
    Denied(ApiError),
}

async fn call(
    shared: &Shared,
    hook: &Value,
    attrs: &Attributes<'_>,
    obj: &Value,
) -> Result<Verdict, String> {
    let ep = endpoint(shared, hook)?;
    let uid = meta::new_uid();
    let body = review(attrs, obj, &uid).to_string().into_bytes();
    let timeout = Duration::from_secs(hook["timeoutSeconds"].as_u64().unwrap_or(10));
    let answer = tokio::time::timeout(timeout, post(&ep, body))
        .await
        .map_err(|_| "context deadline exceeded".to_owned())??;
    let resp = &answer["response"];
    if resp["uid"].as_str() != Some(uid.as_str()) {
        return Err(format!(
            "expected response.uid={uid:?}, got {}",
            resp["uid"]
        ));
    }
    if resp["allowed"].as_bool() != Some(true) {
        let name = hook["name"].as_str().unwrap_or_default();
        let status = &resp["status"];
        let denied_by = format!("admission webhook {name:?} denied the request");
        let message = match (status["message"].as_str(), status["reason"].as_str()) {
            (Some(m), _) if !m.is_empty() => format!("{denied_by}: {m}"),
            (_, Some(r)) if !r.is_empty() => format!("{denied_by}: {r}"),
            _ => format!("{denied_by} without explanation"),
        };
        let code = status["code"]
            .as_u64()
            .and_then(|c| u16::try_from(c).ok())
            .filter(|c| *c >= 400)
            .unwrap_or(403);
        let reason = status["reason"].as_str().unwrap_or_default().to_owned();
        return Ok(Verdict::Denied(ApiError {
            code,
            reason,
            message,
            details: status.get("details").cloned(),
        }));
    }
    // Go's encoding/json decodes a `[]byte` from a base64 string or from an array of byte
    // values (what kube-rs sends), so kube-apiserver takes both.
    let raw = match &resp["patch"] {
        Value::String(p) if !p.is_empty() => {
            Some(strategy::base64_decode(p).ok_or("the patch is not valid base64")?)
        }
        Value::Array(items) if !items.is_empty() => Some(
            items
                .iter()
                .map(|b| b.as_u64().and_then(|b| u8::try_from(b).ok()))
                .collect::<Option<Vec<u8>>>()
                .ok_or("the patch is not an array of bytes")?,
        ),
        _ => None,
    };
    match raw {
        Some(raw) => {
            if resp["patchType"].as_str() != Some("JSONPatch") {
                return Err(format!("unsupported patch type {}", resp["patchType"]));
            }
            let patch: Value =
                serde_json::from_slice(&raw).map_err(|e| format!("the patch is not JSON: {e}"))?;
            Ok(Verdict::Allowed(Some(patch)))
        }
        _ => Ok(Verdict::Allowed(None)),
    }
}

fn failed(hook: &Value, why: &str) -> Option<ApiError> {
    let name = hook["name"].as_str().unwrap_or_default();
    if hook["failurePolicy"].as_str() == Some("Ignore") {
        tracing::warn!(
            webhook = name,
            error = why,
            "webhook failed, ignored by its failure policy"
        );
        return None;
    }
    Some(ApiError::internal(format!(
        "Internal error occurred: failed calling webhook {name:?}: {why}"
    )))
}

/// Run mutating webhooks on `obj` (served form); returns the mutated object.
///
/// # Errors
/// The denial or failure of a webhook whose failure policy is `Fail`.
pub async fn mutate(
    shared: &Shared,
    attrs: &Attributes<'_>,
    mut obj: Value,
) -> Result<Value, ApiError> {
    if exempt(attrs) {
        return Ok(obj);
    }
    for hook in webhooks(shared, "mutatingwebhookconfigurations") {
        match hook_matches(shared, &hook, attrs, &obj) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(why) => match failed(&hook, &why) {
                Some(e) => return Err(e),
                None => continue,
            },
        }
        match call(shared, &hook, attrs, &obj).await {
            Ok(Verdict::Allowed(Some(p))) => match patch::json_patch(&obj, &p) {
                Ok(patched) => obj = patched,
                Err(e) => {
                    if let Some(e) = failed(&hook, &format!("JSON patch failed: {}", e.message)) {
                        return Err(e);
                    }
                }
            },
            Ok(Verdict::Allowed(None)) => {}
            Ok(Verdict::Denied(e)) => return Err(e),
            Err(why) => {
                if let Some(e) = failed(&hook, &why) {
                    return Err(e);
                }
            }
        }
    }
    Ok(obj)
}

/// Run validating webhooks on `obj` (served form).
///
/// # Errors
/// The denial or failure of a webhook whose failure policy is `Fail`.
pub async fn validate(
    shared: &Shared,
    attrs: &Attributes<'_>,
    obj: &Value,
) -> Result<(), ApiError> {
    if exempt(attrs) {
        return Ok(());
    }
    // Built-in validating admission runs before the webhooks, as upstream.
    if attrs.operation == "CREATE"
        && attrs.subresource.is_empty()
        && attrs.rt.group.is_empty()
        && attrs.rt.plural == "pods"
    {
        let labels = {
            let st = shared.store.lock();
            st.get(
                &super::resources::StorageKey::new("", "namespaces"),
                "",
                attrs.namespace,
            )
            .map(meta::labels)
            .unwrap_or_default()
        };
        super::podsecurity::admit_pod(&labels, obj)?;
    }
    for hook in webhooks(shared, "validatingwebhookconfigurations") {
        match hook_matches(shared, &hook, attrs, obj) {
            Ok(false) => continue,
            Ok(true) => {}
            Err(why) => match failed(&hook, &why) {
                Some(e) => return Err(e),
                None => continue,
            },
        }
        match call(shared, &hook, attrs, obj).await {
            Ok(Verdict::Allowed(_)) => {}
            Ok(Verdict::Denied(e)) => return Err(e),
            Err(why) => {
                if let Some(e) = failed(&hook, &why) {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn match_conditions_see_annotation_keys_unescaped_and_fields_escaped() {
        let obj = json!({"metadata": {"name": "p", "namespace": "ns", "annotations": {"warmstart.dev/restore-from": "c"}}});
        let req = json!({"operation": "CREATE"});
        let cond = "has(object.metadata.annotations) && 'warmstart.dev/restore-from' in object.metadata.annotations";
        assert_eq!(eval_condition(cond, &obj, None, &req), Ok(true));
        assert_eq!(
            eval_condition("object.metadata.__namespace__ == 'ns'", &obj, None, &req),
            Ok(true)
        );
        assert_eq!(
            eval_condition("has(object.metadata.labels)", &obj, None, &req),
            Ok(false)
        );
        assert_eq!(
            eval_condition(
                "request.operation == 'CREATE' && oldObject == null",
                &obj,
                None,
                &req
            ),
            Ok(true)
        );
        assert!(eval_condition("object.", &obj, None, &req).is_err());
    }
}
