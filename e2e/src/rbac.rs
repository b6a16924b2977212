//! RBAC authorisation as kube-apiserver's RBAC authorizer decides it, over the Roles and
//! bindings of a rendered manifest set (e.g. `kubectl kustomize deploy`): which recorded
//! [`Request`]s a ServiceAccount may make. A test double for checking that what the programs
//! call is granted; it covers resource requests only (discovery is open to every
//! authenticated user upstream).

use serde_json::Value;

use crate::apiserver::Request;

/// One rule of a Role or ClusterRole, with where it applies.
#[derive(Clone, Debug)]
pub struct Grant {
    /// The Role or ClusterRole it comes from (`ClusterRole/warmstart-agent`).
    pub role: String,
    /// The namespace a RoleBinding confines it to; `None` for a ClusterRoleBinding.
    pub namespace: Option<String>,
    /// The rule as written.
    pub rule: Value,
}

/// The grants of one user, from rendered manifests.
#[derive(Clone, Debug)]
pub struct Authorizer {
    grants: Vec<Grant>,
}

/// `system:serviceaccount:<namespace>:<name>`, the user a ServiceAccount token authenticates.
pub fn service_account_user(namespace: &str, name: &str) -> String {
    format!("system:serviceaccount:{namespace}:{name}")
}

fn strings(v: &Value) -> Vec<&str> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn binds(binding: &Value, namespace: &str, name: &str) -> bool {
    binding["subjects"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| {
            s["kind"] == "ServiceAccount"
                && s["name"] == name
                && s["namespace"].as_str().unwrap_or_else(|| {
                    binding["metadata"]["namespace"]
                        .as_str()
                        .unwrap_or_default()
                }) == namespace
        })
}

impl Authorizer {
    /// The grants of ServiceAccount `namespace/name` in `objects`.
    pub fn for_service_account(objects: &[Value], namespace: &str, name: &str) -> Self {
        let role = |kind: &str, role_name: &str, role_ns: Option<&str>| -> Option<&Value> {
            objects.iter().find(|o| {
                o["kind"] == kind
                    && o["metadata"]["name"] == role_name
                    && role_ns.is_none_or(|ns| o["metadata"]["namespace"] == ns)
            })
        };
        let mut grants = Vec::new();
        for binding in objects {
            let kind = binding["kind"].as_str().unwrap_or_default();
            if !matches!(kind, "ClusterRoleBinding" | "RoleBinding")
                || !binds(binding, namespace, name)
            {
                continue;
            }
            let ref_kind = binding["roleRef"]["kind"].as_str().unwrap_or_default();
            let ref_name = binding["roleRef"]["name"].as_str().unwrap_or_default();
            let binding_ns = binding["metadata"]["namespace"].as_str();
            let found = match ref_kind {
                "ClusterRole" => role("ClusterRole", ref_name, None),
                _ => role("Role", ref_name, binding_ns),
            };
            let Some(found) = found else {
                continue;
            };
            for rule in found["rules"].as_array().into_iter().flatten() {
                grants.push(Grant {
                    role: format!("{ref_kind}/{ref_name}"),
                    namespace: (kind == "RoleBinding")
                        .then(|| binding_ns.unwrap_or_default().to_owned()),
                    rule: rule.clone(),
                });
            }
        }
        Self { grants }
    }

    /// Every grant, for reports.
    pub fn grants(&self) -> &[Grant] {
        &self.grants
    }

    /// The first grant that allows `request`, as RBAC matches rules: group, resource (with
    /// `/subresource`), verb, and `resourceNames` (which never match a create, a
    /// deletecollection, or a list or watch not narrowed to one name).
    pub fn allowing(&self, request: &Request) -> Option<&Grant> {
        let resource = if request.subresource.is_empty() {
            request.resource.clone()
        } else {
            format!("{}/{}", request.resource, request.subresource)
        };
        self.grants.iter().find(|g| {
            if g.namespace
                .as_deref()
                .is_some_and(|ns| ns != request.namespace)
            {
                return false;
            }
            let rule = &g.rule;
            let any = |list: Vec<&str>, want: &str| list.iter().any(|x| *x == "*" || *x == want);
            if !any(strings(&rule["apiGroups"]), &request.group)
                || !any(strings(&rule["resources"]), &resource)
                || !any(strings(&rule["verbs"]), request.verb)
            {
                return false;
            }
            let names = strings(&rule["resourceNames"]);
            names.is_empty()
                || (!request.name.is_empty()
                    && request.verb != "create"
                    && names.contains(&request.name.as_str()))
        })
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn req(verb: &'static str, group: &str, resource: &str, ns: &str, name: &str) -> Request {
        Request {
            user: String::new(),
            verb,
            group: group.to_owned(),
            resource: resource.to_owned(),
            subresource: String::new(),
            namespace: ns.to_owned(),
            name: name.to_owned(),
        }
    }

    fn objects() -> Vec<Value> {
        vec![
            json!({"kind": "ClusterRole", "metadata": {"name": "c"}, "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list"]},
                {"apiGroups": ["x.dev"], "resources": ["things/status"], "verbs": ["patch"]},
                {"apiGroups": ["a"], "resources": ["hooks"], "resourceNames": ["mine"], "verbs": ["get", "list", "create"]}]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "c"}, "roleRef": {"kind": "ClusterRole", "name": "c"},
                "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "sys"}]}),
            json!({"kind": "Role", "metadata": {"name": "r", "namespace": "sys"}, "rules": [
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]}]}),
            json!({"kind": "RoleBinding", "metadata": {"name": "r", "namespace": "sys"}, "roleRef": {"kind": "Role", "name": "r"},
                "subjects": [{"kind": "ServiceAccount", "name": "sa", "namespace": "sys"}]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "other"}, "roleRef": {"kind": "ClusterRole", "name": "c"},
                "subjects": [{"kind": "ServiceAccount", "name": "other", "namespace": "sys"}]}),
        ]
    }

    #[test]
    fn rules_match_as_rbac_matches_them() {
        let a = Authorizer::for_service_account(&objects(), "sys", "sa");
        assert!(a.allowing(&req("get", "", "pods", "any", "p")).is_some());
        assert!(a.allowing(&req("patch", "", "pods", "any", "p")).is_none());
        let mut status = req("patch", "x.dev", "things", "ns", "t");
        assert!(a.allowing(&status).is_none());
        status.subresource = "status".into();
        assert!(a.allowing(&status).is_some());
        // resourceNames: by name only, never a create or an unnarrowed list.
        assert!(a.allowing(&req("get", "a", "hooks", "", "mine")).is_some());
        assert!(
            a.allowing(&req("get", "a", "hooks", "", "theirs"))
                .is_none()
        );
        assert!(a.allowing(&req("list", "a", "hooks", "", "")).is_none());
        assert!(a.allowing(&req("list", "a", "hooks", "", "mine")).is_some());
        assert!(
            a.allowing(&req("create", "a", "hooks", "", "mine"))
                .is_none()
        );
        // A RoleBinding's grants stay in its namespace.
        assert!(a.allowing(&req("get", "", "secrets", "sys", "s")).is_some());
        assert!(
            a.allowing(&req("get", "", "secrets", "other", "s"))
                .is_none()
        );
        // Nobody else's grants.
        let none = Authorizer::for_service_account(&objects(), "sys", "nobody");
        assert!(none.allowing(&req("get", "", "pods", "any", "p")).is_none());
    }
}
