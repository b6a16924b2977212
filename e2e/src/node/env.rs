//! A container's environment as the kubelet builds it: `envFrom`, then `env` in order, with
//! `$(VAR)` references expanded, Downward API `fieldRef`s, ConfigMap and Secret keys; and the same
//! `$(VAR)` expansion for `command`, `args` and `subPathExpr`.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod, Secret};

/// The ConfigMaps and Secrets a pod refers to, read from the API before its containers start.
/// `None`: the object does not exist.
#[derive(Debug, Clone, Default)]
pub(crate) struct Sources {
    /// ConfigMaps of the pod's namespace, by name.
    pub(crate) config_maps: BTreeMap<String, Option<ConfigMap>>,
    /// Secrets of the pod's namespace, by name.
    pub(crate) secrets: BTreeMap<String, Option<Secret>>,
}

impl Sources {
    /// The data of ConfigMap `name` (`data` and `binaryData`), or why it cannot be used.
    pub(crate) fn config_map(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, String> {
        match self.config_maps.get(name) {
            Some(Some(map)) => {
                let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                for (key, value) in map.binary_data.iter().flatten() {
                    data.insert(key.clone(), value.0.clone());
                }
                for (key, value) in map.data.iter().flatten() {
                    data.insert(key.clone(), value.clone().into_bytes());
                }
                Ok(data)
            }
            _ => Err(format!("configmap {name:?} not found")),
        }
    }

    /// The data of Secret `name` (`data`, then `stringData`), or why it cannot be used.
    pub(crate) fn secret(&self, name: &str) -> Result<BTreeMap<String, Vec<u8>>, String> {
        match self.secrets.get(name) {
            Some(Some(secret)) => {
                let mut data: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                for (key, value) in secret.data.iter().flatten() {
                    data.insert(key.clone(), value.0.clone());
                }
                for (key, value) in secret.string_data.iter().flatten() {
                    data.insert(key.clone(), value.clone().into_bytes());
                }
                Ok(data)
            }
            _ => Err(format!("secret {name:?} not found")),
        }
    }
}

/// What the node knows about a pod beyond its object: the addresses for `status.podIP` and
/// `status.hostIP`, and the node's name (`spec.nodeName` before the binding is seen).
#[derive(Debug, Clone)]
pub(crate) struct PodFacts {
    /// The node the pod runs on.
    pub(crate) node_name: String,
    /// The pod's IP address.
    pub(crate) pod_ip: String,
    /// The node's IP address.
    pub(crate) host_ip: String,
}

/// The value of a Downward API field path (`metadata.name`, `metadata.namespace`,
/// `metadata.uid`, `metadata.labels['k']`, `metadata.annotations['k']`, `metadata.labels`,
/// `metadata.annotations` (volumes only), `spec.nodeName`, `spec.serviceAccountName`,
/// `status.podIP`, `status.podIPs`, `status.hostIP`, `status.hostIPs`).
pub(crate) fn field_ref(pod: &Pod, facts: &PodFacts, path: &str) -> Result<String, String> {
    let meta = &pod.metadata;
    let spec = pod.spec.as_ref();
    let keyed = |prefix: &str| -> Option<String> {
        let rest = path.strip_prefix(prefix)?.strip_suffix("']")?;
        Some(rest.to_owned())
    };
    if let Some(key) = keyed("metadata.labels['") {
        return Ok(meta
            .labels
            .as_ref()
            .and_then(|l| l.get(&key))
            .cloned()
            .unwrap_or_default());
    }
    if let Some(key) = keyed("metadata.annotations['") {
        return Ok(meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(&key))
            .cloned()
            .unwrap_or_default());
    }
    let value = match path {
        "metadata.name" => meta.name.clone().unwrap_or_default(),
        "metadata.namespace" => meta.namespace.clone().unwrap_or_default(),
        "metadata.uid" => meta.uid.clone().unwrap_or_default(),
        "metadata.labels" => format_map(meta.labels.as_ref()),
        "metadata.annotations" => format_map(meta.annotations.as_ref()),
        "spec.nodeName" => spec
            .and_then(|s| s.node_name.clone())
            .unwrap_or_else(|| facts.node_name.clone()),
        "spec.serviceAccountName" => spec
            .and_then(|s| s.service_account_name.clone())
            .unwrap_or_else(|| "default".to_owned()),
        "status.podIP" | "status.podIPs" => facts.pod_ip.clone(),
        "status.hostIP" | "status.hostIPs" => facts.host_ip.clone(),
        other => return Err(format!("unsupported fieldRef fieldPath {other:?}")),
    };
    Ok(value)
}

/// A label or annotation map as the Downward API volume writes it: `key="value"` lines, sorted,
/// values quoted like Go's `%q`.
pub(crate) fn format_map(map: Option<&BTreeMap<String, String>>) -> String {
    map.into_iter()
        .flatten()
        .map(|(key, value)| format!("{key}={}\n", go_quote(value)))
        .collect()
}

/// `value` quoted like Go's `strconv.Quote` (for printable ASCII and common escapes).
fn go_quote(value: &str) -> String {
    let mut quoted = String::with_capacity(value.len() + 2);
    quoted.push('"');
    for c in value.chars() {
        match c {
            '"' => quoted.push_str("\\\""),
            '\\' => quoted.push_str("\\\\"),
            '\n' => quoted.push_str("\\n"),
            '\t' => quoted.push_str("\\t"),
            '\r' => quoted.push_str("\\r"),
            c if u32::from(c) < 0x20 || c == '\u{7f}' => {
                quoted.push_str(&format!("\\x{:02x}", u32::from(c)));
            }
            c => quoted.push(c),
        }
    }
    quoted.push('"');
    quoted
}

/// Expands `$(VAR)` in `input` with `lookup` as the kubelet does: `$$` is a literal `$`, a
/// reference to an undefined variable (or an unterminated one) stays as written, and any other
/// `$` is kept.
pub(crate) fn expand(input: &str, lookup: impl Fn(&str) -> Option<String>) -> String {
    let mut out = String::with_capacity(input.len());
    let mut rest = input;
    while let Some(pos) = rest.find('$') {
        out.push_str(&rest[..pos]);
        let after = &rest[pos + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('(') {
            match body.find(')') {
                Some(end) => {
                    let name = &body[..end];
                    match lookup(name) {
                        Some(value) => out.push_str(&value),
                        None => {
                            out.push_str("$(");
                            out.push_str(name);
                            out.push(')');
                        }
                    }
                    rest = &body[end + 1..];
                }
                None => {
                    out.push_str("$(");
                    rest = body;
                }
            }
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// Expands `input` with the variables of `env` (the last definition of a name wins).
pub(crate) fn expand_with(input: &str, env: &[(String, String)]) -> String {
    expand(input, |name| {
        env.iter()
            .rev()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.clone())
    })
}

/// Sets `key` in `env`, replacing an earlier definition in place.
fn set(env: &mut Vec<(String, String)>, key: String, value: String) {
    match env.iter_mut().find(|(k, _)| *k == key) {
        Some(entry) => entry.1 = value,
        None => env.push((key, value)),
    }
}

/// The environment of `container` in `pod`: `envFrom` sources in order (keys that are not valid
/// variable names are skipped, as the kubelet does), then `env` entries in order, each value
/// expanded with the variables defined before it.
///
/// # Errors
/// A missing ConfigMap, Secret or key that is not `optional`, or an unsupported source
/// (`resourceFieldRef`, an unknown field path): the kubelet's `CreateContainerConfigError`.
pub(crate) fn container_env(
    pod: &Pod,
    container: &Container,
    facts: &PodFacts,
    sources: &Sources,
) -> Result<Vec<(String, String)>, String> {
    let mut env: Vec<(String, String)> = Vec::new();
    for from in container.env_from.iter().flatten() {
        let prefix = from.prefix.clone().unwrap_or_default();
        let data = if let Some(cm) = &from.config_map_ref {
            match sources.config_map(&cm.name) {
                Ok(data) => data,
                Err(_) if cm.optional == Some(true) => continue,
                Err(e) => return Err(e),
            }
        } else if let Some(secret) = &from.secret_ref {
            match sources.secret(&secret.name) {
                Ok(data) => data,
                Err(_) if secret.optional == Some(true) => continue,
                Err(e) => return Err(e),
            }
        } else {
            continue;
        };
        for (key, value) in data {
            let name = format!("{prefix}{key}");
            if valid_env_name(&name) {
                set(&mut env, name, String::from_utf8_lossy(&value).into_owned());
            }
        }
    }
    for var in container.env.iter().flatten() {
        let value = if let Some(from) = &var.value_from {
            if let Some(field) = &from.field_ref {
                field_ref(pod, facts, &field.field_path)?
            } else if let Some(key) = &from.config_map_key_ref {
                match sources
                    .config_map(&key.name)
                    .and_then(|data| lookup_key(data, &key.name, &key.key))
                {
                    Ok(value) => value,
                    Err(_) if key.optional == Some(true) => continue,
                    Err(e) => return Err(format!("env {}: {e}", var.name)),
                }
            } else if let Some(key) = &from.secret_key_ref {
                match sources
                    .secret(&key.name)
                    .and_then(|data| lookup_key(data, &key.name, &key.key))
                {
                    Ok(value) => value,
                    Err(_) if key.optional == Some(true) => continue,
                    Err(e) => return Err(format!("env {}: {e}", var.name)),
                }
            } else if from.resource_field_ref.is_some() {
                return Err(format!(
                    "env {}: resourceFieldRef is not supported by the node simulator",
                    var.name
                ));
            } else {
                String::new()
            }
        } else {
            expand_with(var.value.as_deref().unwrap_or_default(), &env)
        };
        set(&mut env, var.name.clone(), value);
    }
    Ok(env)
}

/// `data[key]` as text, or which key of which object is missing.
fn lookup_key(
    mut data: BTreeMap<String, Vec<u8>>,
    object: &str,
    key: &str,
) -> Result<String, String> {
    data.remove(key)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .ok_or_else(|| format!("key {key:?} not found in {object:?}"))
}

/// Whether `name` is a valid environment variable name for Kubernetes (printable ASCII, no `=`).
fn valid_env_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_graphic() && c != '=')
}

#[cfg(test)]
mod tests {
    use k8s_openapi::ByteString;
    use serde_json::json;

    use super::*;

    fn pod() -> Pod {
        serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "ns", "uid": "u-1",
                         "labels": {"app": "web", "b": "x\"y"}, "annotations": {"note": "n"}},
            "spec": {"containers": [], "nodeName": "node-a"},
        }))
        .unwrap()
    }

    fn facts() -> PodFacts {
        PodFacts {
            node_name: "node-a".to_owned(),
            pod_ip: "127.0.0.1".to_owned(),
            host_ip: "127.0.0.2".to_owned(),
        }
    }

    #[test]
    fn expansion_follows_the_kubelet() {
        let env = vec![
            ("A".to_owned(), "1".to_owned()),
            ("B".to_owned(), "two".to_owned()),
        ];
        assert_eq!(expand_with("$(A)-$(B)", &env), "1-two");
        assert_eq!(expand_with("$(MISSING)/x", &env), "$(MISSING)/x");
        assert_eq!(expand_with("$$(A) $$ $x $", &env), "$(A) $ $x $");
        assert_eq!(expand_with("a$(A", &env), "a$(A");
        assert_eq!(expand_with("/d/$(A)$(A)", &env), "/d/11");
    }

    #[test]
    fn field_refs_cover_the_downward_api() {
        let pod = pod();
        let f = facts();
        assert_eq!(field_ref(&pod, &f, "metadata.name").unwrap(), "p");
        assert_eq!(field_ref(&pod, &f, "metadata.namespace").unwrap(), "ns");
        assert_eq!(field_ref(&pod, &f, "metadata.uid").unwrap(), "u-1");
        assert_eq!(
            field_ref(&pod, &f, "metadata.labels['app']").unwrap(),
            "web"
        );
        assert_eq!(field_ref(&pod, &f, "metadata.labels['none']").unwrap(), "");
        assert_eq!(
            field_ref(&pod, &f, "metadata.annotations['note']").unwrap(),
            "n"
        );
        assert_eq!(field_ref(&pod, &f, "spec.nodeName").unwrap(), "node-a");
        assert_eq!(field_ref(&pod, &f, "status.podIP").unwrap(), "127.0.0.1");
        assert_eq!(field_ref(&pod, &f, "status.hostIP").unwrap(), "127.0.0.2");
        assert_eq!(
            field_ref(&pod, &f, "metadata.labels").unwrap(),
            "app=\"web\"\nb=\"x\\\"y\"\n"
        );
        assert!(field_ref(&pod, &f, "spec.bogus").is_err());
    }

    #[test]
    fn env_is_built_in_order_with_sources() {
        let pod = pod();
        let container: Container = serde_json::from_value(json!({
            "name": "c",
            "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"},
                        {"secretRef": {"name": "gone", "optional": true}}],
            "env": [
                {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                {"name": "DIR", "value": "/data/$(POD)/$(CM_k)"},
                {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "pw"}}},
                {"name": "OPT", "valueFrom": {"configMapKeyRef": {"name": "cm", "key": "no", "optional": true}}},
                {"name": "CM_k", "value": "override"},
            ],
        }))
        .unwrap();
        let mut sources = Sources::default();
        sources.config_maps.insert(
            "cm".to_owned(),
            Some(
                serde_json::from_value(
                    json!({"metadata": {"name": "cm"}, "data": {"k": "v", "bad=key": "x"}}),
                )
                .unwrap(),
            ),
        );
        let secret = Secret {
            data: Some(BTreeMap::from([(
                "pw".to_owned(),
                ByteString(b"hunter2".to_vec()),
            )])),
            ..Secret::default()
        };
        sources.secrets.insert("s".to_owned(), Some(secret));
        let env = container_env(&pod, &container, &facts(), &sources).unwrap();
        assert_eq!(
            env,
            [
                ("CM_k".to_owned(), "override".to_owned()),
                ("POD".to_owned(), "p".to_owned()),
                ("DIR".to_owned(), "/data/p/v".to_owned()),
                ("PASS".to_owned(), "hunter2".to_owned()),
            ]
        );

        sources.secrets.insert("s".to_owned(), None);
        let error = container_env(&pod, &container, &facts(), &sources).unwrap_err();
        assert!(error.contains("secret \"s\" not found"), "{error}");
    }
}
