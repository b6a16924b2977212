//! Legacy discovery documents (`/api`, `/apis`, `/apis/<group>`, resource lists per group
//! version) and `/version`. Aggregated discovery (`apidiscovery.k8s.io/v2`) is not served: the
//! double answers such requests with the legacy document and `Content-Type: application/json`,
//! on which client-go (kubectl) and kube-rs fall back to legacy discovery.

use std::cmp::Ordering;
use std::collections::BTreeMap;

use serde_json::{Value, json};

use super::resources::ResourceType;

/// Kubernetes version priority (`v1` > `v1beta2` > `v1beta1` > `v1alpha1` > anything else).
pub fn version_cmp(a: &str, b: &str) -> Ordering {
    fn parse(v: &str) -> Option<(u64, u8, u64)> {
        let rest = v.strip_prefix('v')?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
        let major: u64 = digits.parse().ok()?;
        let tail = &rest[digits.len()..];
        if tail.is_empty() {
            return Some((major, 2, 0));
        }
        let (stage, n) = if let Some(n) = tail.strip_prefix("beta") {
            (1, n)
        } else if let Some(n) = tail.strip_prefix("alpha") {
            (0, n)
        } else {
            return None;
        };
        Some((major, stage, n.parse().ok()?))
    }
    match (parse(a), parse(b)) {
        (Some((ma, sa, na)), Some((mb, sb, nb))) => sa.cmp(&sb).then(ma.cmp(&mb)).then(na.cmp(&nb)),
        (Some(_), None) => Ordering::Greater,
        (None, Some(_)) => Ordering::Less,
        (None, None) => b.cmp(a),
    }
}

fn groups(types: &[ResourceType]) -> BTreeMap<String, Vec<String>> {
    let mut groups: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for t in types {
        let versions = groups.entry(t.group.clone()).or_default();
        if !versions.contains(&t.version) {
            versions.push(t.version.clone());
        }
    }
    for versions in groups.values_mut() {
        versions.sort_by(|a, b| version_cmp(b, a));
    }
    groups
}

fn group_doc(name: &str, versions: &[String]) -> Value {
    let vs: Vec<Value> = versions
        .iter()
        .map(|v| json!({"groupVersion": format!("{name}/{v}"), "version": v}))
        .collect();
    let preferred = vs.first().cloned().unwrap_or(Value::Null);
    json!({"name": name, "versions": vs, "preferredVersion": preferred})
}

/// `/api`.
pub fn api_versions(server_address: &str) -> Value {
    json!({"kind": "APIVersions", "versions": ["v1"],
        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}]})
}

/// `/apis`.
pub fn api_group_list(types: &[ResourceType]) -> Value {
    let groups: Vec<Value> = groups(types)
        .iter()
        .filter(|(g, _)| !g.is_empty())
        .map(|(g, vs)| group_doc(g, vs))
        .collect();
    json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": groups})
}

/// `/apis/<group>`, if served.
pub fn api_group(types: &[ResourceType], group: &str) -> Option<Value> {
    let groups = groups(types);
    let versions = groups.get(group)?;
    let mut doc = group_doc(group, versions);
    doc["kind"] = json!("APIGroup");
    doc["apiVersion"] = json!("v1");
    Some(doc)
}

/// The types served at a group version; `None` when it serves none.
pub fn served_at<'a>(
    types: &'a [ResourceType],
    group: &str,
    version: &str,
) -> Option<Vec<&'a ResourceType>> {
    let served: Vec<&ResourceType> = types
        .iter()
        .filter(|t| t.group == group && t.version == version)
        .collect();
    (!served.is_empty()).then_some(served)
}

/// The resource list of a group version, if served.
pub fn resource_list(types: &[ResourceType], group: &str, version: &str) -> Option<Value> {
    let served = served_at(types, group, version)?;
    let mut resources = Vec::new();
    for t in served {
        let mut r = json!({
            "name": t.plural, "singularName": t.singular, "namespaced": t.namespaced, "kind": t.kind,
            "verbs": ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"],
        });
        if !t.short_names.is_empty() {
            r["shortNames"] = json!(t.short_names);
        }
        if !t.categories.is_empty() {
            r["categories"] = json!(t.categories);
        }
        resources.push(r);
        if t.status {
            resources.push(json!({"name": format!("{}/status", t.plural), "singularName": "", "namespaced": t.namespaced,
                "kind": t.kind, "verbs": ["get", "patch", "update"]}));
        }
        for sub in &t.extra_subresources {
            let (kind, verbs) = match *sub {
                "binding" => ("Binding", json!(["create"])),
                _ => (t.kind.as_str(), json!(["update"])),
            };
            resources.push(json!({"name": format!("{}/{sub}", t.plural), "singularName": "", "namespaced": t.namespaced,
                "kind": kind, "verbs": verbs}));
        }
    }
    let gv = if group.is_empty() {
        version.to_owned()
    } else {
        format!("{group}/{version}")
    };
    Some(
        json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv, "resources": resources}),
    )
}

/// `/version`: the Kubernetes version whose API the double follows.
pub fn version() -> Value {
    json!({"major": "1", "minor": "33", "gitVersion": "v1.33.0-warmstart-double", "gitCommit": "",
        "gitTreeState": "clean", "buildDate": "2025-01-01T00:00:00Z", "goVersion": "go1.24.0",
        "compiler": "gc", "platform": "linux/amd64"})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_sort_by_kubernetes_priority() {
        let mut v = vec!["v1alpha1", "v2", "v1beta1", "v1", "v1beta2", "foo"];
        v.sort_by(|a, b| version_cmp(b, a));
        assert_eq!(v, ["v2", "v1", "v1beta2", "v1beta1", "v1alpha1", "foo"]);
    }
}
