//! HTTP routing and the REST verbs (k8s.io/apiserver `pkg/endpoints/handlers`): paths,
//! content negotiation, create/get/list/watch/update/patch/delete/deletecollection, the status
//! and binding subresources, and `Status` bodies for every refusal.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::Shared;
use super::admission::{self, Attributes};
use super::apply;
use super::commit::{commit_update, create_object};
use super::discovery;
use super::error::ApiError;
use super::fieldmanager;
use super::meta;
use super::openapi;
use super::patch;
use super::resources::{self, ResourceType};
use super::selectors::{FieldSelector, LabelSelector};
use super::store::{DeleteOpts, Propagation};
use super::strategy;
use super::table::{Include, Tabler};
use super::watch::{self, Filter, WatchTask};

/// The largest request body accepted (kube-apiserver's limit is 3 MiB).
const MAX_BODY: usize = 3 * 1024 * 1024;

/// Query parameters.
type Query = HashMap<String, String>;

/// How the response is rendered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Render {
    Json,
    Yaml,
    Table(Include),
    Metadata,
}

fn json_response(code: u16, body: &Value, render: Render) -> Response<Body> {
    let (bytes, ctype) = match render {
        Render::Yaml => (
            serde_norway::to_string(body)
                .unwrap_or_default()
                .into_bytes(),
            "application/yaml",
        ),
        _ => (body.to_string().into_bytes(), "application/json"),
    };
    let mut resp = Response::new(Body::from(bytes));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static(ctype));
    resp
}

/// The response for a refused request.
pub fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.to_status(), Render::Json)
}

fn text_response(code: u16, text: &'static str) -> Response<Body> {
    let mut resp = Response::new(Body::from(text));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    resp
}

fn parse_query(q: Option<&str>) -> Query {
    q.map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default()
}

fn flag(q: &Query, key: &str) -> bool {
    q.get(key).is_some_and(|v| v == "true" || v == "1")
}

fn render_for(headers: &HeaderMap, q: &Query) -> Result<Render, ApiError> {
    let accept = headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if accept.is_empty() {
        return Ok(Render::Json);
    }
    for part in accept.split(',') {
        let mut params = part.split(';').map(str::trim);
        let media = params.next().unwrap_or_default();
        let params: Vec<&str> = params.collect();
        let as_ = params.iter().find_map(|p| p.strip_prefix("as="));
        if !matches!(
            media,
            "application/json" | "application/*" | "*/*" | "application/yaml"
        ) {
            continue;
        }
        match as_ {
            Some("Table") => {
                let include = match q.get("includeObject").map(String::as_str) {
                    Some("None") => Include::None,
                    Some("Object") => Include::Object,
                    _ => Include::Metadata,
                };
                return Ok(Render::Table(include));
            }
            Some("PartialObjectMetadata" | "PartialObjectMetadataList") => {
                return Ok(Render::Metadata);
            }
            Some(_) => continue,
            None => {
                return Ok(if media == "application/yaml" {
                    Render::Yaml
                } else {
                    Render::Json
                });
            }
        }
    }
    if accept.contains("application/vnd.kubernetes.protobuf") {
        return Err(ApiError::not_implemented(
            "protobuf responses (accept application/json)",
        ));
    }
    Err(ApiError::not_acceptable(
        "only the following media types are accepted: application/json, application/yaml",
    ))
}

/// Consumes one injected fault matching the request, if any.
fn take_fault(shared: &Shared, method: &str, path: &str) -> bool {
    let mut faults = shared
        .faults
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(i) = faults
        .iter()
        .position(|f| f.method == method && path.ends_with(&f.path_suffix) && f.count > 0)
    else {
        return false;
    };
    faults[i].count -= 1;
    if faults[i].count == 0 {
        faults.remove(i);
    }
    true
}

/// Serve one request.
pub async fn handle(shared: Arc<Shared>, req: Request<Body>) -> Response<Body> {
    let (parts, body) = req.into_parts();
    let body = match axum::body::to_bytes(body, MAX_BODY).await {
        Ok(b) => b,
        Err(_) => {
            return error_response(&ApiError {
                code: 413,
                reason: "RequestEntityTooLarge".into(),
                message: "the request body is too large".into(),
                details: None,
            });
        }
    };
    let query = parse_query(parts.uri.query());
    let path = parts.uri.path().to_owned();
    tracing::debug!(method = %parts.method, path = %path, "api request");
    if take_fault(&shared, parts.method.as_str(), &path) {
        return error_response(&ApiError {
            code: 409,
            reason: "Conflict".into(),
            message: format!(
                "Operation cannot be fulfilled on {path}: the object has been modified; please apply your changes to the latest version and try again"
            ),
            details: None,
        });
    }
    let segs: Vec<String> = path
        .split('/')
        .filter(|s| !s.is_empty())
        .map(percent_decode)
        .collect();
    let segs: Vec<&str> = segs.iter().map(String::as_str).collect();
    let result = match segs.as_slice() {
        [] => Ok(json_response(
            200,
            &json!({"paths": ["/api", "/api/v1", "/apis", "/healthz", "/livez", "/readyz", "/version"]}),
            Render::Json,
        )),
        ["healthz" | "livez" | "readyz", ..] => Ok(text_response(200, "ok")),
        ["version"] => Ok(json_response(200, &discovery::version(), Render::Json)),
        ["openapi", "v2"] => Ok(Response::builder()
            .status(StatusCode::OK)
            .header(header::CONTENT_TYPE, openapi::V2_PROTOBUF)
            .body(Body::from(openapi::v2_protobuf()))
            .unwrap_or_else(|_| text_response(500, "cannot build the response\n"))),
        ["openapi", "v3"] => Ok(json_response(
            200,
            &openapi::root(shared.store.lock().types()),
            Render::Json,
        )),
        ["openapi", "v3", "api", version] => openapi_document(&shared, "", version),
        ["openapi", "v3", "apis", group, version] => openapi_document(&shared, group, version),
        ["api"] => Ok(json_response(
            200,
            &discovery::api_versions(&shared.addr.to_string()),
            Render::Json,
        )),
        ["apis"] => {
            let doc = discovery::api_group_list(shared.store.lock().types());
            Ok(json_response(200, &doc, Render::Json))
        }
        ["api", "v1", rest @ ..] => {
            resource(
                &shared,
                &parts.method,
                &parts.headers,
                &query,
                "",
                "v1",
                rest,
                body,
            )
            .await
        }
        ["apis", group] => match discovery::api_group(shared.store.lock().types(), group) {
            Some(doc) => Ok(json_response(200, &doc, Render::Json)),
            None => Ok(text_response(404, "404 page not found\n")),
        },
        ["apis", group, version, rest @ ..] => {
            resource(
                &shared,
                &parts.method,
                &parts.headers,
                &query,
                group,
                version,
                rest,
                body,
            )
            .await
        }
        _ => Ok(text_response(404, "404 page not found\n")),
    };
    result.unwrap_or_else(|e| error_response(&e))
}

fn openapi_document(
    shared: &Shared,
    group: &str,
    version: &str,
) -> Result<Response<Body>, ApiError> {
    match openapi::document(shared.store.lock().types(), group, version) {
        Some(doc) => Ok(json_response(200, &doc, Render::Json)),
        None => Ok(text_response(404, "404 page not found\n")),
    }
}

fn percent_decode(s: &str) -> String {
    form_urlencoded::parse(format!("x={}", s.replace('+', "%2B")).as_bytes())
        .next()
        .map_or_else(|| s.to_owned(), |(_, v)| v.into_owned())
}

/// A parsed resource path.
struct Target<'a> {
    rt: ResourceType,
    namespace: Option<&'a str>,
    name: Option<&'a str>,
    subresource: Option<&'a str>,
    watch_path: bool,
}

#[allow(clippy::too_many_arguments)]
async fn resource(
    shared: &Shared,
    method: &Method,
    headers: &HeaderMap,
    q: &Query,
    group: &str,
    version: &str,
    rest: &[&str],
    body: Bytes,
) -> Result<Response<Body>, ApiError> {
    let (watch_path, rest) = match rest {
        ["watch", more @ ..] => (true, more),
        _ => (false, rest),
    };
    if rest.is_empty() {
        if watch_path {
            return Ok(text_response(404, "404 page not found\n"));
        }
        let list = discovery::resource_list(shared.store.lock().types(), group, version);
        return Ok(match list {
            Some(doc) => json_response(200, &doc, Render::Json),
            None => text_response(404, "404 page not found\n"),
        });
    }
    let (namespace, plural, name, subresource) = match rest {
        ["namespaces", ns, plural, more @ ..] if !matches!(*plural, "status" | "finalize") => (
            Some(*ns),
            *plural,
            more.first().copied(),
            more.get(1).copied(),
        ),
        [plural, more @ ..] => (None, *plural, more.first().copied(), more.get(1).copied()),
        [] => return Err(ApiError::no_such_resource()),
    };
    let too_long = match rest {
        ["namespaces", _, p, more @ ..] if !matches!(*p, "status" | "finalize") => more.len() > 2,
        [_, more @ ..] => more.len() > 2,
        [] => false,
    };
    let found = shared.store.lock().find_type(group, version, plural);
    let Some(rt) = found else {
        let served =
            discovery::resource_list(shared.store.lock().types(), group, version).is_some();
        return if served {
            Err(ApiError::no_such_resource())
        } else {
            Ok(text_response(404, "404 page not found\n"))
        };
    };
    if too_long || (namespace.is_some() && !rt.namespaced) {
        return Err(ApiError::no_such_resource());
    }
    if let Some(sub) = subresource {
        let known = (sub == "status" && rt.status) || rt.extra_subresources.contains(&sub);
        if !known {
            return Err(ApiError::no_such_resource());
        }
    }
    if rt.namespaced && namespace.is_none() && name.is_some() {
        return Err(ApiError::no_such_resource());
    }
    let t = Target {
        rt,
        namespace,
        name,
        subresource,
        watch_path,
    };
    let render = render_for(headers, q)?;
    let ctype = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    let ctype = ctype
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned();
    let manager = fieldmanager::manager_name(q, headers);
    if flag(q, "dryRun") || q.get("dryRun").is_some_and(|v| v == "All") {
        return Err(ApiError::not_implemented("dryRun"));
    }
    let is_watch = t.watch_path || flag(q, "watch");
    record(shared, method, headers, q, &t, is_watch);
    match (method, t.name, t.subresource) {
        (&Method::GET, None, None) if is_watch => watch_list(shared, &t, q, render),
        (&Method::GET, None, None) => list(shared, &t, q, render),
        (&Method::GET, Some(name), None | Some("status")) if !is_watch => {
            get(shared, &t, name, render)
        }
        (&Method::POST, None, None) => create(shared, &t, q, &ctype, &body, &manager, render).await,
        (&Method::POST, Some(name), Some("binding")) => bind(shared, &t, name, &ctype, &body).await,
        (&Method::GET, Some(name), Some("log")) if !is_watch => pod_log(shared, &t, name, q),
        (&Method::PUT, Some(name), None | Some("status" | "finalize")) => {
            update(shared, &t, name, &ctype, &body, &manager, render).await
        }
        (&Method::PATCH, Some(name), None | Some("status")) => {
            patch_object(shared, &t, name, q, &ctype, &body, &manager, render).await
        }
        (&Method::DELETE, Some(name), None) => delete(shared, &t, name, q, &body, render).await,
        (&Method::DELETE, None, None) => delete_collection(shared, &t, q, &body, render).await,
        _ => Err(ApiError::method_not_allowed(
            "the server does not allow this method on the requested resource",
        )),
    }
}

/// Records the request with the attributes RBAC decides on.
fn record(
    shared: &Shared,
    method: &Method,
    headers: &HeaderMap,
    q: &Query,
    t: &Target<'_>,
    is_watch: bool,
) {
    let verb = match (method, t.name) {
        (&Method::GET, Some(_)) if !is_watch => "get",
        (&Method::GET, _) if is_watch => "watch",
        (&Method::GET, _) => "list",
        (&Method::POST, _) => "create",
        (&Method::PUT, _) => "update",
        (&Method::PATCH, _) => "patch",
        (&Method::DELETE, Some(_)) => "delete",
        (&Method::DELETE, None) => "deletecollection",
        _ => "unknown",
    };
    let user = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .unwrap_or_default()
        .to_owned();
    // A list or watch of one object by `metadata.name` is authorised by that name.
    let selected = q
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
        .filter(|n| !n.contains(','));
    let name = t.name.or(selected).unwrap_or_default().to_owned();
    shared
        .audit
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .push(super::Request {
            user,
            verb,
            group: t.rt.group.clone(),
            resource: t.rt.plural.clone(),
            subresource: t.subresource.unwrap_or_default().to_owned(),
            namespace: t.namespace.unwrap_or_default().to_owned(),
            name,
        });
}

fn parse_body(ctype: &str, body: &[u8]) -> Result<Value, ApiError> {
    if body.is_empty() {
        return Err(ApiError::bad_request("the body of the request was empty"));
    }
    match ctype {
        "application/json"
        | "application/merge-patch+json"
        | "application/json-patch+json"
        | "application/strategic-merge-patch+json"
        | "" => serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
        }),
        "application/yaml"
        | "application/apply-patch+yaml"
        | "application/x-yaml"
        | "text/yaml" => serde_json::from_slice(body).or_else(|_| {
            serde_norway::from_slice::<Value>(body).map_err(|e| {
                ApiError::bad_request(format!("error converting YAML to JSON: yaml: {e}"))
            })
        }),
        "application/vnd.kubernetes.protobuf" => Err(ApiError::not_implemented(
            "protobuf request bodies (send application/json; kubectl's generator commands such as `create configmap` use protobuf, `create -f` does not)",
        )),
        other => Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml (got {other:?})"
        ))),
    }
}

fn check_type_meta(rt: &ResourceType, obj: &Value) -> Result<(), ApiError> {
    let Value::Object(m) = obj else {
        return Err(ApiError::bad_request(format!(
            "the object provided is unrecognized (must be of type {}): couldn't get version/kind; json parse error: expected an object",
            rt.kind
        )));
    };
    let api_version = m
        .get("apiVersion")
        .and_then(Value::as_str)
        .unwrap_or_default();
    let kind = m.get("kind").and_then(Value::as_str).unwrap_or_default();
    if kind.is_empty() {
        return Err(ApiError::bad_request(format!(
            "Object 'Kind' is missing in '{obj}'"
        )));
    }
    if api_version.is_empty() {
        return Err(ApiError::bad_request(format!(
            "Object 'apiVersion' is missing in '{obj}'"
        )));
    }
    if api_version != rt.api_version() {
        return Err(ApiError::bad_request(format!(
            "the API version in the data ({api_version}) does not match the expected API version ({})",
            rt.api_version()
        )));
    }
    if kind != rt.kind {
        return Err(ApiError::bad_request(format!(
            "{} in version {:?} cannot be handled as a {kind}: the kind in the data ({kind}) does not match the expected kind ({})",
            rt.kind, rt.version, rt.kind
        )));
    }
    if let Some(md) = m.get("metadata")
        && !md.is_object()
        && !md.is_null()
    {
        return Err(ApiError::bad_request(format!(
            "{} in version {:?} cannot be handled as a {}: metadata must be an object",
            rt.kind, rt.version, rt.kind
        )));
    }
    Ok(())
}

fn served(rt: &ResourceType, stored: &Value, render: Render) -> Value {
    let obj = resources::to_served(rt, stored);
    match render {
        Render::Table(include) => Tabler::new(rt, include).table(&[obj], false),
        Render::Metadata => {
            json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]})
        }
        _ => obj,
    }
}

/// `pods/log`: the container's current (or `previous`) log from the node's kubelet-layout log
/// directory, as text; `tailLines` honoured, `follow` refused.
fn pod_log(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    q: &Query,
) -> Result<Response<Body>, ApiError> {
    let namespace = t.namespace.unwrap_or("");
    let pod = shared
        .store
        .lock()
        .get(&t.rt.storage, namespace, name)
        .cloned()
        .ok_or_else(|| ApiError::not_found(&t.rt.group, &t.rt.plural, name))?;
    if flag(q, "follow") {
        return Err(ApiError::not_implemented("follow"));
    }
    let containers: Vec<String> = pod["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .chain(
            pod["spec"]["initContainers"]
                .as_array()
                .into_iter()
                .flatten(),
        )
        .filter_map(|c| c["name"].as_str().map(str::to_owned))
        .collect();
    let container = match q.get("container") {
        Some(c) if containers.contains(c) => c.clone(),
        Some(c) => {
            return Err(ApiError::bad_request(format!(
                "container {c} is not valid for pod {name}"
            )));
        }
        None if containers.len() == 1 => containers[0].clone(),
        None => {
            return Err(ApiError::bad_request(format!(
                "a container name must be specified for pod {name}, choose one of: {containers:?}"
            )));
        }
    };
    let uid = pod["metadata"]["uid"].as_str().unwrap_or_default();
    let dir = shared.config.pod_logs.as_ref().map(|root| {
        root.join(format!("{namespace}_{name}_{uid}"))
            .join(&container)
    });
    let mut restarts: Vec<u32> = dir
        .as_ref()
        .and_then(|d| std::fs::read_dir(d).ok())
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.strip_suffix(".log")?.parse().ok())
        .collect();
    restarts.sort_unstable();
    let wanted = if flag(q, "previous") {
        restarts.iter().rev().nth(1)
    } else {
        restarts.last()
    };
    let (Some(dir), Some(n)) = (dir, wanted) else {
        return Err(ApiError::bad_request(format!(
            "container {container:?} in pod {name:?} has no log on the node{}",
            if flag(q, "previous") {
                " from a previous run"
            } else {
                ""
            }
        )));
    };
    let raw = std::fs::read(dir.join(format!("{n}.log"))).unwrap_or_default();
    let mut text = crate::fixture::containerd::cri_log_text(&String::from_utf8_lossy(&raw));
    if let Some(tail) = q.get("tailLines").and_then(|v| v.parse::<usize>().ok()) {
        let lines: Vec<&str> = text.lines().collect();
        let kept = lines[lines.len().saturating_sub(tail)..].join("\n");
        text = if kept.is_empty() { kept } else { kept + "\n" };
    }
    let mut resp = Response::new(Body::from(text));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    Ok(resp)
}

fn get(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let st = shared.store.lock();
    let obj = st
        .get(&t.rt.storage, t.namespace.unwrap_or(""), name)
        .ok_or_else(|| ApiError::not_found(&t.rt.group, &t.rt.plural, name))?;
    Ok(json_response(200, &served(&t.rt, obj, render), render))
}

fn selectors(rt: &ResourceType, q: &Query) -> Result<(LabelSelector, FieldSelector), ApiError> {
    let labels = LabelSelector::parse(q.get("labelSelector").map_or("", String::as_str))?;
    let fields = FieldSelector::parse(rt, q.get("fieldSelector").map_or("", String::as_str))?;
    Ok((labels, fields))
}

fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse().map_err(|_| {
        ApiError::bad_request(format!("invalid resource version: {s:?}")).with_invalid_rv()
    })
}

impl ApiError {
    fn with_invalid_rv(mut self) -> Self {
        self.code = 400;
        self
    }
}

fn continue_token(rv: u64, ns: &str, name: &str) -> String {
    strategy::base64_encode(
        json!({"v": "meta.k8s.io/v1", "rv": rv, "start": format!("{ns}/{name}\u{0}")})
            .to_string()
            .as_bytes(),
    )
}

fn parse_continue(token: &str) -> Result<(u64, String, String), ApiError> {
    let bad = || {
        ApiError::bad_request(
            "continue key is not valid: incorrect encoded start resourceVersion (version meta.k8s.io/v1)",
        )
    };
    let raw = strategy::base64_decode(token).ok_or_else(bad)?;
    let v: Value = serde_json::from_slice(&raw).map_err(|_| bad())?;
    let rv = v["rv"].as_u64().ok_or_else(bad)?;
    let start = v["start"]
        .as_str()
        .ok_or_else(bad)?
        .trim_end_matches('\u{0}');
    let (ns, name) = start.split_once('/').ok_or_else(bad)?;
    Ok((rv, ns.to_owned(), name.to_owned()))
}

fn list(
    shared: &Shared,
    t: &Target<'_>,
    q: &Query,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let (labels, fields) = selectors(&t.rt, q)?;
    let filter = Filter {
        rt: t.rt.clone(),
        namespace: t.namespace.map(str::to_owned),
        labels,
        fields,
    };
    let limit: usize = match q.get("limit") {
        Some(l) if !l.is_empty() => l
            .parse::<i64>()
            .map_err(|_| ApiError::bad_request(format!("invalid limit: {l:?}")))?
            .max(0)
            .try_into()
            .unwrap_or(0),
        _ => 0,
    };
    let st = shared.store.lock();
    let current = st.rv();
    let rv_param = q.get("resourceVersion").map_or("", String::as_str);
    let rv_match = q.get("resourceVersionMatch").map_or("", String::as_str);
    if !rv_param.is_empty() && rv_param != "0" {
        let rv = parse_rv(rv_param)?;
        match rv_match {
            "Exact" if rv != current => {
                return Err(ApiError::not_implemented(
                    "list with resourceVersionMatch=Exact at a resourceVersion other than the current one",
                ));
            }
            _ if rv > current => {
                return Err(ApiError::timeout(format!(
                    "Too large resource version: {rv}, current: {current}"
                )));
            }
            _ => {}
        }
    } else if rv_match == "Exact" {
        return Err(ApiError::invalid(
            "meta.k8s.io",
            "ListOptions",
            "",
            &[super::error::Cause::forbidden(
                "resourceVersionMatch",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            )],
        ));
    }
    let (mut start, list_rv) = match q.get("continue").filter(|c| !c.is_empty()) {
        Some(token) => {
            let (rv, ns, name) = parse_continue(token)?;
            (Some((ns, name)), rv)
        }
        None => (None, current),
    };
    let mut items = Vec::new();
    let mut next = None;
    let mut remaining = 0_i64;
    for obj in st.list(&t.rt.storage, t.namespace) {
        if let Some((ns, name)) = &start
            && (meta::namespace(obj), meta::name(obj)) <= (ns.as_str(), name.as_str())
        {
            continue;
        }
        let Some(served) = filter.select(obj) else {
            continue;
        };
        if limit > 0 && items.len() == limit {
            remaining += 1;
            continue;
        }
        if limit > 0 && items.len() + 1 == limit {
            next = Some((meta::namespace(obj).to_owned(), meta::name(obj).to_owned()));
        }
        items.push(served);
    }
    start = None;
    let _ = start;
    drop(st);
    let mut list_meta = json!({"resourceVersion": list_rv.to_string()});
    if remaining > 0
        && let Some((ns, name)) = next
    {
        list_meta["continue"] = json!(continue_token(list_rv, &ns, &name));
        list_meta["remainingItemCount"] = json!(remaining);
    }
    let body = match render {
        Render::Table(include) => {
            let mut table = Tabler::new(&t.rt, include).table(&items, false);
            table["metadata"] = list_meta;
            table
        }
        Render::Metadata => {
            let items: Vec<Value> = items
                .iter()
                .map(|o| json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]}))
                .collect();
            json!({"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1", "metadata": list_meta, "items": items})
        }
        _ => {
            if !t.rt.custom {
                for item in &mut items {
                    if let Value::Object(m) = item {
                        m.remove("apiVersion");
                        m.remove("kind");
                    }
                }
            }
            json!({"kind": format!("{}List", t.rt.kind), "apiVersion": t.rt.api_version(), "metadata": list_meta, "items": items})
        }
    };
    Ok(json_response(200, &body, render))
}

fn watch_list(
    shared: &Shared,
    t: &Target<'_>,
    q: &Query,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let (labels, fields) = selectors(&t.rt, q)?;
    let filter = Filter {
        rt: t.rt.clone(),
        namespace: t.namespace.map(str::to_owned),
        labels,
        fields,
    };
    let rv_param = q.get("resourceVersion").map_or("", String::as_str);
    let send_initial = q.get("sendInitialEvents").map(String::as_str);
    let bookmarks = flag(q, "allowWatchBookmarks");
    if send_initial == Some("true")
        && (q.get("resourceVersionMatch").map(String::as_str) != Some("NotOlderThan") || !bookmarks)
    {
        return Err(ApiError::invalid(
            "meta.k8s.io",
            "ListOptions",
            "",
            &[super::error::Cause::forbidden(
                "sendInitialEvents",
                "sendInitialEvents is forbidden for watch unless the WatchList feature gate is enabled and resourceVersionMatch is set to NotOlderThan and allowWatchBookmarks is set to true",
            )],
        ));
    }
    let timeout = match q.get("timeoutSeconds") {
        Some(s) if !s.is_empty() => Duration::from_secs(
            s.parse::<u64>()
                .map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds: {s:?}")))?,
        ),
        _ => shared.config.default_watch_timeout,
    };
    let (initial, from) = {
        let mut st = shared.store.lock();
        let snapshot = |st: &super::store::State| -> Vec<Value> {
            st.list(&t.rt.storage, t.namespace)
                .into_iter()
                .filter_map(|o| filter.select(o))
                .collect()
        };
        if send_initial == Some("true") || rv_param.is_empty() || rv_param == "0" {
            let objs = snapshot(&st);
            let start = st.watch(&t.rt.storage, None)?;
            (objs, start)
        } else {
            let rv = parse_rv(rv_param)?;
            match st.watch(&t.rt.storage, Some(rv)) {
                Ok(start) => (Vec::new(), start),
                Err(e) if e.code == 410 => {
                    // kube-apiserver answers 200 and sends one ERROR event with the 410 Status.
                    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(1);
                    let line = watch::error_line(&e.to_status());
                    drop(tx.try_send(Ok(line)));
                    drop(tx);
                    return Ok(stream_response(rx));
                }
                Err(e) => return Err(e),
            }
        }
    };
    let table = match render {
        Render::Table(include) => Some(Tabler::new(&t.rt, include)),
        _ => None,
    };
    let task = WatchTask {
        filter,
        initial,
        initial_end_bookmark: send_initial == Some("true"),
        backlog: from.backlog,
        live: from.live,
        start_rv: from.rv,
        bookmarks,
        bookmark_every: shared.config.bookmark_interval,
        timeout,
        shutdown: shared.shutdown.clone(),
        table,
        metadata_only: render == Render::Metadata,
    };
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(task.run(tx));
    Ok(stream_response(rx))
}

fn stream_response(rx: mpsc::Receiver<Result<Bytes, std::io::Error>>) -> Response<Body> {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|item| (item, rx))
    });
    let mut resp = Response::new(Body::from_stream(stream));
    resp.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp.headers_mut().insert(
        header::CACHE_CONTROL,
        HeaderValue::from_static("no-cache, private"),
    );
    resp
}

fn check_namespace_matches(t: &Target<'_>, obj: &Value) -> Result<(), ApiError> {
    if t.rt.namespaced {
        let body_ns = meta::namespace(obj);
        if !body_ns.is_empty() && Some(body_ns) != t.namespace {
            return Err(ApiError::bad_request(
                "the namespace of the provided object does not match the namespace sent on the request",
            ));
        }
    }
    Ok(())
}

async fn create(
    shared: &Shared,
    t: &Target<'_>,
    q: &Query,
    ctype: &str,
    body: &[u8],
    manager: &str,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    if !matches!(
        ctype,
        "application/json" | "application/yaml" | "application/vnd.kubernetes.protobuf" | ""
    ) {
        return Err(ApiError::unsupported_media_type(format!(
            "the body of the request was in an unknown format - accepted media types include: application/json, application/yaml, application/vnd.kubernetes.protobuf (got {ctype:?})"
        )));
    }
    let obj = parse_body(ctype, body)?;
    check_type_meta(&t.rt, &obj)?;
    check_namespace_matches(t, &obj)?;
    if meta::name(&obj).is_empty() && meta::str_at(&obj, &["metadata", "generateName"]).is_empty() {
        return Err(ApiError::invalid(
            &t.rt.group,
            &t.rt.kind,
            "",
            &[super::error::Cause::required(
                "metadata.name",
                "name or generateName is required",
            )],
        ));
    }
    let _ = q;
    let created = create_object(shared, &t.rt, t.namespace.unwrap_or(""), obj, manager).await?;
    Ok(json_response(201, &served(&t.rt, &created, render), render))
}

async fn update(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    ctype: &str,
    body: &[u8],
    manager: &str,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let obj = parse_body(ctype, body)?;
    check_type_meta(&t.rt, &obj)?;
    check_namespace_matches(t, &obj)?;
    if meta::name(&obj) != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({}) does not match the name on the URL ({name})",
            meta::name(&obj)
        )));
    }
    let ns = t.namespace.unwrap_or("");
    let old = shared.store.lock().get(&t.rt.storage, ns, name).cloned();
    let Some(old) = old else {
        if t.rt.kind == "Event" && t.subresource.is_none() {
            let created = create_object(shared, &t.rt, ns, obj, manager).await?;
            return Ok(json_response(201, &served(&t.rt, &created, render), render));
        }
        return Err(ApiError::not_found(&t.rt.group, &t.rt.plural, name));
    };
    let given_rv = meta::str_at(&obj, &["metadata", "resourceVersion"]).to_owned();
    let expected = if given_rv.is_empty() {
        if t.rt.custom {
            return Err(ApiError::invalid(
                &t.rt.group,
                &t.rt.kind,
                name,
                &[super::error::Cause::invalid(
                    "metadata.resourceVersion",
                    &json!("0x0"),
                    "must be specified for an update",
                )],
            ));
        }
        meta::resource_version(&old)
    } else {
        parse_rv(&given_rv).map_err(|_| ApiError::conflict(&t.rt.group, &t.rt.plural, name))?
    };
    if expected != meta::resource_version(&old) {
        return Err(ApiError::conflict(&t.rt.group, &t.rt.plural, name));
    }
    let new = resources::to_storage(&t.rt, &obj);
    let new = match t.subresource {
        Some("finalize") => {
            let mut out = old.clone();
            out["spec"]["finalizers"] = new["spec"]["finalizers"].clone();
            out
        }
        sub => strategy::prepare_update(&t.rt, &old, new, sub),
    };
    let updated = commit_update(
        shared,
        &t.rt,
        &old,
        new,
        t.subresource.unwrap_or(""),
        manager,
        "Update",
    )
    .await?;
    Ok(json_response(200, &served(&t.rt, &updated, render), render))
}

#[allow(clippy::too_many_arguments)]
async fn patch_object(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    q: &Query,
    ctype: &str,
    body: &[u8],
    manager: &str,
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let ns = t.namespace.unwrap_or("");
    let patch_doc = match ctype {
        "application/merge-patch+json"
        | "application/json-patch+json"
        | "application/strategic-merge-patch+json"
        | "application/apply-patch+yaml" => parse_body(ctype, body)?,
        other => {
            return Err(ApiError::unsupported_media_type(format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml{} (got {other:?})",
                if t.rt.custom {
                    ""
                } else {
                    ", application/strategic-merge-patch+json"
                }
            )));
        }
    };
    if ctype == "application/strategic-merge-patch+json" && t.rt.custom {
        return Err(ApiError::unsupported_media_type(
            "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml",
        ));
    }
    if ctype == "application/apply-patch+yaml" {
        let force = flag(q, "force");
        if q.get("fieldManager").is_none_or(String::is_empty) {
            return Err(ApiError::bad_request(
                "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
            )
            .with_code(422, "Invalid"));
        }
        let applied = apply::apply(
            shared,
            &t.rt,
            ns,
            name,
            t.subresource.unwrap_or(""),
            patch_doc,
            manager,
            force,
        )
        .await?;
        let (code, obj) = applied;
        return Ok(json_response(code, &served(&t.rt, &obj, render), render));
    }
    for _attempt in 0..10 {
        let old = shared.store.lock().get(&t.rt.storage, ns, name).cloned();
        let Some(old) = old else {
            return Err(ApiError::not_found(&t.rt.group, &t.rt.plural, name));
        };
        let served_old = resources::to_served(&t.rt, &old);
        let patched = match ctype {
            "application/merge-patch+json" => {
                if !patch_doc.is_object() {
                    return Err(ApiError::bad_request(
                        "the body of the request was in an unknown format - a merge patch must be a JSON object",
                    ));
                }
                patch::merge_patch(&served_old, &patch_doc)
            }
            "application/json-patch+json" => patch::json_patch(&served_old, &patch_doc)?,
            _ => patch::strategic_merge(&t.rt, &served_old, &patch_doc)?,
        };
        if !patched.is_object() {
            return Err(ApiError::bad_request(
                "the patched object is not a JSON object",
            ));
        }
        let precondition = meta::str_at(&patched, &["metadata", "resourceVersion"]);
        let user_rv = !precondition.is_empty()
            && precondition != meta::str_at(&old, &["metadata", "resourceVersion"]);
        if user_rv {
            return Err(ApiError::conflict(&t.rt.group, &t.rt.plural, name));
        }
        if patched.get("apiVersion") != served_old.get("apiVersion")
            || patched.get("kind") != served_old.get("kind")
        {
            check_type_meta(&t.rt, &patched)?;
        }
        if meta::uid(&patched) != meta::uid(&old) && !meta::uid(&patched).is_empty() {
            return Err(ApiError::conflict_because(
                &t.rt.group,
                &t.rt.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {}, UID in object meta: {}",
                    meta::uid(&patched),
                    meta::uid(&old)
                ),
            ));
        }
        let new = strategy::prepare_update(
            &t.rt,
            &old,
            resources::to_storage(&t.rt, &patched),
            t.subresource,
        );
        match commit_update(
            shared,
            &t.rt,
            &old,
            new,
            t.subresource.unwrap_or(""),
            manager,
            "Update",
        )
        .await
        {
            Ok(updated) => return Ok(json_response(200, &served(&t.rt, &updated, render), render)),
            Err(e) if e.code == 409 && e.reason == "Conflict" => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::conflict(&t.rt.group, &t.rt.plural, name))
}

impl ApiError {
    fn with_code(mut self, code: u16, reason: &str) -> Self {
        self.code = code;
        self.reason = reason.to_owned();
        self
    }
}

fn delete_opts(q: &Query, body: &[u8]) -> Result<DeleteOpts, ApiError> {
    let body: Value = if body.is_empty() {
        json!({})
    } else {
        serde_json::from_slice(body).map_err(|e| {
            ApiError::bad_request(format!("couldn't get version/kind; json parse error: {e}"))
        })?
    };
    let mut opts = DeleteOpts::default();
    let grace = q
        .get("gracePeriodSeconds")
        .cloned()
        .or_else(|| body["gracePeriodSeconds"].as_i64().map(|g| g.to_string()));
    if let Some(g) = grace {
        opts.grace =
            Some(g.parse().map_err(|_| {
                ApiError::bad_request(format!("invalid gracePeriodSeconds: {g:?}"))
            })?);
    }
    let policy = q
        .get("propagationPolicy")
        .cloned()
        .or_else(|| body["propagationPolicy"].as_str().map(str::to_owned));
    opts.propagation = match policy.as_deref() {
        None | Some("") => None,
        Some("Orphan") => Some(Propagation::Orphan),
        Some("Background") => Some(Propagation::Background),
        Some("Foreground") => Some(Propagation::Foreground),
        Some(other) => {
            return Err(ApiError::invalid(
                "meta.k8s.io",
                "DeleteOptions",
                "",
                &[super::error::Cause::not_supported(
                    "propagationPolicy",
                    &json!(other),
                    &["Foreground", "Background", "Orphan", "nil"],
                )],
            ));
        }
    };
    let orphan = q
        .get("orphanDependents")
        .cloned()
        .or_else(|| body["orphanDependents"].as_bool().map(|b| b.to_string()));
    if let Some(o) = orphan {
        if opts.propagation.is_some() {
            return Err(ApiError::invalid(
                "meta.k8s.io",
                "DeleteOptions",
                "",
                &[super::error::Cause::invalid(
                    "propagationPolicy",
                    &json!(policy),
                    "orphanDependents and deletionPropagation cannot be both set",
                )],
            ));
        }
        opts.propagation = Some(if o == "true" {
            Propagation::Orphan
        } else {
            Propagation::Background
        });
    }
    if let Some(uid) = body["preconditions"]["uid"].as_str() {
        opts.uid = Some(uid.to_owned());
    }
    if let Some(rv) = body["preconditions"]["resourceVersion"].as_str() {
        opts.resource_version = Some(rv.to_owned());
    }
    if body["dryRun"].as_array().is_some_and(|a| !a.is_empty()) {
        return Err(ApiError::not_implemented("dryRun"));
    }
    Ok(opts)
}

/// Kinds whose REST storage returns the deleted object rather than a `Status`.
fn returns_deleted_object(rt: &ResourceType) -> bool {
    rt.custom
        || matches!(
            rt.kind.as_str(),
            "Pod" | "Service" | "Namespace" | "Node" | "CustomResourceDefinition"
        )
}

async fn delete(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    q: &Query,
    body: &[u8],
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let opts = delete_opts(q, body)?;
    let ns = t.namespace.unwrap_or("");
    let old = shared.store.lock().get(&t.rt.storage, ns, name).cloned();
    let Some(old) = old else {
        return Err(ApiError::not_found(&t.rt.group, &t.rt.plural, name));
    };
    let served_old = resources::to_served(&t.rt, &old);
    let attrs = Attributes {
        rt: &t.rt,
        operation: "DELETE",
        subresource: "",
        namespace: ns,
        name,
        old: Some(&served_old),
        dry_run: false,
    };
    admission::validate(shared, &attrs, &served_old).await?;
    let result = shared.store.lock().delete(&t.rt, ns, name, &opts)?;
    let mut resp = if result.removed && !returns_deleted_object(&t.rt) {
        let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
            "details": {"name": name, "group": t.rt.group, "kind": t.rt.plural, "uid": meta::uid(&result.object)}});
        json_response(200, &status, Render::Json)
    } else {
        let code = if result.removed { 200 } else { 202 };
        json_response(code, &served(&t.rt, &result.object, render), render)
    };
    if t.rt.group == "batch" && t.rt.kind == "Job" && opts.propagation.is_none() {
        resp.headers_mut().insert(
            "Warning",
            HeaderValue::from_static("299 - \"child pods are preserved by default when jobs are deleted; set propagationPolicy=Background to remove them or set propagationPolicy=Orphan to suppress this warning\""),
        );
    }
    Ok(resp)
}

async fn delete_collection(
    shared: &Shared,
    t: &Target<'_>,
    q: &Query,
    body: &[u8],
    render: Render,
) -> Result<Response<Body>, ApiError> {
    let opts = delete_opts(q, body)?;
    let (labels, fields) = selectors(&t.rt, q)?;
    let filter = Filter {
        rt: t.rt.clone(),
        namespace: t.namespace.map(str::to_owned),
        labels,
        fields,
    };
    let targets: Vec<(String, String)> = shared
        .store
        .lock()
        .list(&t.rt.storage, t.namespace)
        .into_iter()
        .filter(|o| filter.select(o).is_some())
        .map(|o| (meta::namespace(o).to_owned(), meta::name(o).to_owned()))
        .collect();
    let mut items = Vec::new();
    for (ns, name) in targets {
        let old = shared.store.lock().get(&t.rt.storage, &ns, &name).cloned();
        let Some(old) = old else { continue };
        let served_old = resources::to_served(&t.rt, &old);
        let attrs = Attributes {
            rt: &t.rt,
            operation: "DELETE",
            subresource: "",
            namespace: &ns,
            name: &name,
            old: Some(&served_old),
            dry_run: false,
        };
        admission::validate(shared, &attrs, &served_old).await?;
        match shared.store.lock().delete(&t.rt, &ns, &name, &opts) {
            Ok(d) => items.push(resources::to_served(&t.rt, &d.object)),
            Err(e) if e.code == 404 => {}
            Err(e) => return Err(e),
        }
    }
    let rv = shared.store.lock().rv();
    let body = json!({"kind": format!("{}List", t.rt.kind), "apiVersion": t.rt.api_version(),
        "metadata": {"resourceVersion": rv.to_string()}, "items": items});
    Ok(json_response(200, &body, render))
}

async fn bind(
    shared: &Shared,
    t: &Target<'_>,
    name: &str,
    ctype: &str,
    body: &[u8],
) -> Result<Response<Body>, ApiError> {
    let binding = parse_body(ctype, body)?;
    if binding["kind"] != "Binding" {
        return Err(ApiError::bad_request(format!(
            "the kind in the data ({}) does not match the expected kind (Binding)",
            binding["kind"].as_str().unwrap_or_default()
        )));
    }
    let bname = meta::name(&binding);
    if !bname.is_empty() && bname != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({bname}) does not match the name on the URL ({name})"
        )));
    }
    let node = binding["target"]["name"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    if node.is_empty() {
        return Err(ApiError::invalid(
            "",
            "Binding",
            name,
            &[super::error::Cause::required("target.name", "")],
        ));
    }
    let ns = t.namespace.unwrap_or("");
    for _ in 0..10 {
        let old = shared.store.lock().get(&t.rt.storage, ns, name).cloned();
        let Some(old) = old else {
            return Err(ApiError::not_found(&t.rt.group, &t.rt.plural, name));
        };
        if meta::is_deleting(&old) {
            return Err(ApiError::conflict_because(
                "",
                "pods",
                name,
                &format!("pod {name} is being deleted, cannot be assigned to a host"),
            ));
        }
        let current = meta::str_at(&old, &["spec", "nodeName"]);
        if !current.is_empty() {
            return Err(ApiError::conflict_because(
                "",
                "pods",
                name,
                &format!("pod {name} is already assigned to node {current:?}"),
            ));
        }
        let mut new = old.clone();
        new["spec"]["nodeName"] = json!(node);
        if let Some(a) = binding["metadata"]["annotations"].as_object() {
            strategy::merge_annotations(&mut new, a);
        }
        let conds = new["status"]["conditions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut conds: Vec<Value> = conds
            .into_iter()
            .filter(|c| c["type"] != "PodScheduled")
            .collect();
        conds.push(json!({"type": "PodScheduled", "status": "True", "lastProbeTime": null, "lastTransitionTime": meta::now()}));
        new["status"]["conditions"] = Value::Array(conds);
        let result = shared
            .store
            .lock()
            .update(&t.rt, new, meta::resource_version(&old));
        match result {
            Ok(_) => {
                let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201});
                return Ok(json_response(201, &status, Render::Json));
            }
            Err(e) if e.code == 409 => continue,
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::conflict("", "pods", name))
}
