//! The resource types the double serves: the built-in ones it knows, and those every
//! CustomResourceDefinition adds (apiextensions-apiserver serves each CRD's served versions).

use std::sync::Arc;

use serde_json::{Value, json};

use super::meta::NameRule;

/// Where the objects of a resource live, whatever version they are served at.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StorageKey {
    /// API group (`""` for core).
    pub group: String,
    /// Plural resource name.
    pub resource: String,
}

impl StorageKey {
    /// A key from a group and a plural name.
    pub fn new(group: &str, resource: &str) -> Self {
        Self {
            group: group.to_owned(),
            resource: resource.to_owned(),
        }
    }
}

/// How objects are converted between the stored and the served version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Conversion {
    /// Only `apiVersion` changes (built-ins served at one version; CRDs with strategy `None`).
    None,
    /// `events.k8s.io/v1` Events, stored as `core/v1` Events (k8s.io/kubernetes
    /// `pkg/apis/events/v1/conversion.go`).
    EventsV1,
}

/// A printer column of a CRD version (`additionalPrinterColumns`) or a built-in table.
#[derive(Clone, Debug)]
pub struct PrinterColumn {
    /// Column header.
    pub name: String,
    /// OpenAPI type: `string`, `integer`, `number`, `boolean`, `date`.
    pub type_: String,
    /// Simple JSONPath (`.spec.x.y`) of the value.
    pub json_path: String,
    /// Priority (0 shows by default, more only with `-o wide`).
    pub priority: i64,
    /// Column description.
    pub description: String,
}

/// One served group/version/resource.
#[derive(Clone, Debug)]
pub struct ResourceType {
    /// API group (`""` for core).
    pub group: String,
    /// Served version.
    pub version: String,
    /// Kind.
    pub kind: String,
    /// Plural resource name.
    pub plural: String,
    /// Singular resource name.
    pub singular: String,
    /// Namespaced or cluster-scoped.
    pub namespaced: bool,
    /// Short names for kubectl.
    pub short_names: Vec<String>,
    /// Categories (e.g. `all`).
    pub categories: Vec<String>,
    /// Whether a `status` subresource exists (spec and status then isolated).
    pub status: bool,
    /// Whether `metadata.generation` is maintained (bumped by spec changes).
    pub generation: bool,
    /// Name validation rule.
    pub name_rule: NameRule,
    /// Where the objects are stored.
    pub storage: StorageKey,
    /// `apiVersion` of stored objects.
    pub storage_version: String,
    /// Conversion from storage to this version.
    pub conversion: Conversion,
    /// A CustomResourceDefinition's schema for this version.
    pub schema: Option<Arc<Value>>,
    /// Printer columns beyond the name (CRDs: `additionalPrinterColumns`).
    pub printer_columns: Vec<PrinterColumn>,
    /// Extra field-selectable paths (CRD `selectableFields`).
    pub selectable_fields: Vec<String>,
    /// Whether the type comes from a CRD.
    pub custom: bool,
    /// Whether `kubectl`'s `scale` subresource is served (never here).
    pub extra_subresources: Vec<&'static str>,
}

impl ResourceType {
    /// `group/version` or `version`.
    pub fn api_version(&self) -> String {
        if self.group.is_empty() {
            self.version.clone()
        } else {
            format!("{}/{}", self.group, self.version)
        }
    }

    /// Whether objects of this type pass through a webhook rule naming `resource` (with
    /// optional `/subresource`).
    pub fn qualified(&self) -> String {
        super::error::qualified(&self.group, &self.plural)
    }
}

#[allow(clippy::too_many_arguments)]
fn builtin(
    group: &str,
    version: &str,
    kind: &str,
    plural: &str,
    namespaced: bool,
    short: &[&str],
    status: bool,
    generation: bool,
) -> ResourceType {
    ResourceType {
        group: group.into(),
        version: version.into(),
        kind: kind.into(),
        plural: plural.into(),
        singular: kind.to_lowercase(),
        namespaced,
        short_names: short.iter().map(|s| (*s).to_owned()).collect(),
        categories: Vec::new(),
        status,
        generation,
        name_rule: NameRule::Subdomain,
        storage: StorageKey::new(group, plural),
        storage_version: if group.is_empty() {
            version.into()
        } else {
            format!("{group}/{version}")
        },
        conversion: Conversion::None,
        schema: None,
        printer_columns: Vec::new(),
        selectable_fields: Vec::new(),
        custom: false,
        extra_subresources: Vec::new(),
    }
}

/// The built-in resource types.
pub fn builtins() -> Vec<ResourceType> {
    let mut pods = builtin("", "v1", "Pod", "pods", true, &["po"], true, false);
    pods.categories = vec!["all".into()];
    pods.extra_subresources = vec!["binding", "log"];
    let mut namespaces = builtin(
        "",
        "v1",
        "Namespace",
        "namespaces",
        false,
        &["ns"],
        true,
        false,
    );
    namespaces.name_rule = NameRule::Label;
    namespaces.extra_subresources = vec!["finalize"];
    let mut services = builtin("", "v1", "Service", "services", true, &["svc"], true, false);
    services.name_rule = NameRule::Dns1035;
    services.categories = vec!["all".into()];
    let mut jobs = builtin("batch", "v1", "Job", "jobs", true, &[], true, true);
    jobs.categories = vec!["all".into()];
    let mut events_v1 = builtin(
        "events.k8s.io",
        "v1",
        "Event",
        "events",
        true,
        &["ev"],
        false,
        false,
    );
    events_v1.storage = StorageKey::new("", "events");
    events_v1.storage_version = "v1".into();
    events_v1.conversion = Conversion::EventsV1;
    let mut crds = builtin(
        "apiextensions.k8s.io",
        "v1",
        "CustomResourceDefinition",
        "customresourcedefinitions",
        false,
        &["crd", "crds"],
        true,
        true,
    );
    crds.categories = vec!["api-extensions".into()];
    let mut mutating = builtin(
        "admissionregistration.k8s.io",
        "v1",
        "MutatingWebhookConfiguration",
        "mutatingwebhookconfigurations",
        false,
        &[],
        false,
        true,
    );
    mutating.categories = vec!["api-extensions".into()];
    let mut validating = builtin(
        "admissionregistration.k8s.io",
        "v1",
        "ValidatingWebhookConfiguration",
        "validatingwebhookconfigurations",
        false,
        &[],
        false,
        true,
    );
    validating.categories = vec!["api-extensions".into()];
    vec![
        pods,
        builtin("", "v1", "Node", "nodes", false, &["no"], true, false),
        builtin("", "v1", "Event", "events", true, &["ev"], false, false),
        namespaces,
        builtin("", "v1", "Secret", "secrets", true, &[], false, false),
        builtin(
            "",
            "v1",
            "ConfigMap",
            "configmaps",
            true,
            &["cm"],
            false,
            false,
        ),
        services,
        builtin(
            "",
            "v1",
            "ServiceAccount",
            "serviceaccounts",
            true,
            &["sa"],
            false,
            false,
        ),
        jobs,
        builtin(
            "coordination.k8s.io",
            "v1",
            "Lease",
            "leases",
            true,
            &[],
            false,
            false,
        ),
        events_v1,
        mutating,
        validating,
        crds,
    ]
}

/// The resource types a CRD (as stored, with a valid spec) serves: one per served version.
pub fn from_crd(crd: &Value) -> Vec<ResourceType> {
    let spec = &crd["spec"];
    let group = spec["group"].as_str().unwrap_or_default();
    let names = &spec["names"];
    let plural = names["plural"].as_str().unwrap_or_default();
    let kind = names["kind"].as_str().unwrap_or_default();
    let singular = names["singular"]
        .as_str()
        .map_or_else(|| kind.to_lowercase(), str::to_owned);
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let short_names = strs(&names["shortNames"]);
    let categories = strs(&names["categories"]);
    let namespaced = spec["scope"].as_str() == Some("Namespaced");
    let versions = spec["versions"].as_array().cloned().unwrap_or_default();
    let storage_version = versions
        .iter()
        .find(|v| v["storage"].as_bool() == Some(true))
        .and_then(|v| v["name"].as_str())
        .unwrap_or_default();
    versions
        .iter()
        .filter(|v| v["served"].as_bool() == Some(true))
        .map(|v| {
            let version = v["name"].as_str().unwrap_or_default();
            let printer_columns = v["additionalPrinterColumns"]
                .as_array()
                .map(|cols| {
                    cols.iter()
                        .map(|c| PrinterColumn {
                            name: c["name"].as_str().unwrap_or_default().to_owned(),
                            type_: c["type"].as_str().unwrap_or("string").to_owned(),
                            json_path: c["jsonPath"].as_str().unwrap_or_default().to_owned(),
                            priority: c["priority"].as_i64().unwrap_or(0),
                            description: c["description"].as_str().unwrap_or_default().to_owned(),
                        })
                        .collect()
                })
                .unwrap_or_default();
            let selectable_fields = v["selectableFields"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|f| f["jsonPath"].as_str())
                        .map(|p| p.trim_start_matches('.').to_owned())
                        .collect()
                })
                .unwrap_or_default();
            ResourceType {
                group: group.to_owned(),
                version: version.to_owned(),
                kind: kind.to_owned(),
                plural: plural.to_owned(),
                singular: singular.clone(),
                namespaced,
                short_names: short_names.clone(),
                categories: categories.clone(),
                status: v["subresources"].get("status").is_some(),
                generation: true,
                name_rule: NameRule::Subdomain,
                storage: StorageKey::new(group, plural),
                storage_version: format!("{group}/{storage_version}"),
                conversion: Conversion::None,
                schema: v["schema"].get("openAPIV3Schema").cloned().map(Arc::new),
                printer_columns,
                selectable_fields,
                custom: true,
                extra_subresources: Vec::new(),
            }
        })
        .collect()
}

/// Convert a stored object to the version `rt` serves.
pub fn to_served(rt: &ResourceType, stored: &Value) -> Value {
    let mut obj = stored.clone();
    match rt.conversion {
        Conversion::None => {}
        Conversion::EventsV1 => obj = core_event_to_events_v1(&obj),
    }
    if let Value::Object(map) = &mut obj {
        map.insert("apiVersion".into(), json!(rt.api_version()));
        map.insert("kind".into(), json!(rt.kind));
    }
    obj
}

/// Convert an object of the version `rt` serves to the stored version.
pub fn to_storage(rt: &ResourceType, served: &Value) -> Value {
    let mut obj = served.clone();
    match rt.conversion {
        Conversion::None => {}
        Conversion::EventsV1 => obj = events_v1_to_core_event(&obj),
    }
    if let Value::Object(map) = &mut obj {
        map.insert("apiVersion".into(), json!(rt.storage_version));
        map.insert("kind".into(), json!(rt.kind));
    }
    obj
}

const EVENT_FIELD_MAP: &[(&str, &str)] = &[
    ("involvedObject", "regarding"),
    ("message", "note"),
    ("reportingComponent", "reportingController"),
    ("source", "deprecatedSource"),
    ("firstTimestamp", "deprecatedFirstTimestamp"),
    ("lastTimestamp", "deprecatedLastTimestamp"),
    ("count", "deprecatedCount"),
];

fn rename_fields(obj: &Value, to_v1: bool) -> Value {
    let Value::Object(map) = obj else {
        return obj.clone();
    };
    let mut out = serde_json::Map::new();
    for (k, v) in map {
        let renamed = EVENT_FIELD_MAP
            .iter()
            .find(|(core, v1)| if to_v1 { core == k } else { v1 == k })
            .map(|(core, v1)| if to_v1 { *v1 } else { *core })
            .unwrap_or(k);
        out.insert(renamed.to_owned(), v.clone());
    }
    Value::Object(out)
}

fn core_event_to_events_v1(obj: &Value) -> Value {
    let mut out = rename_fields(obj, true);
    // The core source.component is what events.k8s.io calls reportingController when unset.
    if out
        .get("reportingController")
        .is_none_or(|v| v.as_str().is_none_or(str::is_empty))
        && let Some(c) = obj["source"]["component"].as_str()
        && let Value::Object(m) = &mut out
    {
        m.insert("reportingController".into(), json!(c));
    }
    out
}

fn events_v1_to_core_event(obj: &Value) -> Value {
    let mut out = rename_fields(obj, false);
    if let Value::Object(m) = &mut out
        && m.get("source").is_none()
        && let Some(c) = obj["reportingController"].as_str()
    {
        m.insert(
            "source".into(),
            json!({"component": c, "host": obj["reportingInstance"]}),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_v1_round_trips_through_core() {
        let rt = builtins()
            .into_iter()
            .find(|r| r.group == "events.k8s.io")
            .expect("events.k8s.io is built in");
        let v1 = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"},
            "regarding": {"kind": "Pod", "name": "p"}, "note": "hello", "reason": "Started",
            "reportingController": "ctl", "reportingInstance": "ctl-1", "eventTime": "2024-01-01T00:00:00.000000Z"});
        let core = to_storage(&rt, &v1);
        assert_eq!(core["apiVersion"], "v1");
        assert_eq!(core["involvedObject"]["name"], "p");
        assert_eq!(core["message"], "hello");
        let back = to_served(&rt, &core);
        assert_eq!(back["note"], "hello");
        assert_eq!(back["regarding"]["kind"], "Pod");
        assert_eq!(back["reportingController"], "ctl");
    }
}
