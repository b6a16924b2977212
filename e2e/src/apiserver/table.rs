//! Server-side printing: `meta.k8s.io/v1` `Table`s, which kubectl asks for
//! (`Accept: application/json;as=Table;v=v1;g=meta.k8s.io`) when it prints `get` output. Columns
//! follow k8s.io/kubernetes `pkg/printers/internalversion` for the built-in kinds served, and a
//! CRD's `additionalPrinterColumns` for custom resources.

use serde_json::{Value, json};

use super::meta;
use super::resources::{PrinterColumn, ResourceType};

/// What each row carries (`includeObject`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Include {
    /// Nothing.
    None,
    /// `PartialObjectMetadata` (the default).
    Metadata,
    /// The whole object.
    Object,
}

/// Renders objects of one type as Table rows.
#[derive(Clone, Debug)]
pub struct Tabler {
    rt: ResourceType,
    include: Include,
}

fn col(name: &str, type_: &str, priority: i64, description: &str) -> PrinterColumn {
    PrinterColumn {
        name: name.to_owned(),
        type_: type_.to_owned(),
        json_path: String::new(),
        priority,
        description: description.to_owned(),
    }
}

/// A short human duration since an RFC 3339 time, as kubectl prints ages.
pub fn age(since: &str) -> String {
    let Ok(t) = since.parse::<jiff::Timestamp>() else {
        return "<unknown>".into();
    };
    let secs = jiff::Timestamp::now().duration_since(t).as_secs().max(0);
    if secs < 120 {
        format!("{secs}s")
    } else if secs < 600 {
        format!("{}m{}s", secs / 60, secs % 60)
    } else if secs < 3 * 3600 {
        format!("{}m", secs / 60)
    } else if secs < 48 * 3600 {
        format!("{}h", secs / 3600)
    } else {
        format!("{}d", secs / 86400)
    }
}

fn json_path(obj: &Value, path: &str) -> Value {
    let path = path
        .trim()
        .trim_start_matches('{')
        .trim_end_matches('}')
        .trim_start_matches('.');
    let mut cur = obj;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (key, index) = match part.split_once('[') {
            Some((k, rest)) => (k, rest.trim_end_matches(']').parse::<usize>().ok()),
            None => (part, None),
        };
        cur = match cur.get(key) {
            Some(v) => v,
            None => return Value::Null,
        };
        if let Some(i) = index {
            cur = match cur.get(i) {
                Some(v) => v,
                None => return Value::Null,
            };
        }
    }
    cur.clone()
}

impl Tabler {
    /// A renderer for `rt`.
    pub fn new(rt: &ResourceType, include: Include) -> Self {
        Self {
            rt: rt.clone(),
            include,
        }
    }

    fn columns(&self) -> Vec<PrinterColumn> {
        let name = col(
            "Name",
            "string",
            0,
            "Name must be unique within a namespace.",
        );
        let age = col(
            "Age",
            "string",
            0,
            "CreationTimestamp is a timestamp representing the server time when this object was created.",
        );
        let mut cols = vec![name];
        if self.rt.custom {
            if self.rt.printer_columns.is_empty() {
                cols.push(age);
            } else {
                cols.extend(self.rt.printer_columns.iter().cloned());
            }
            return cols;
        }
        let more: Vec<PrinterColumn> = match self.rt.kind.as_str() {
            "Pod" => vec![
                col(
                    "Ready",
                    "string",
                    0,
                    "The aggregate readiness state of this pod for accepting traffic.",
                ),
                col(
                    "Status",
                    "string",
                    0,
                    "The aggregate status of the containers in this pod.",
                ),
                col(
                    "Restarts",
                    "string",
                    0,
                    "The number of times the containers in this pod have been restarted.",
                ),
                age,
                col("IP", "string", 1, "IP address allocated to the pod."),
                col(
                    "Node",
                    "string",
                    1,
                    "Name of the node the pod is assigned to.",
                ),
            ],
            "Node" => vec![
                col("Status", "string", 0, "The status of the node"),
                col("Roles", "string", 0, "The roles of the node"),
                age,
                col(
                    "Version",
                    "string",
                    0,
                    "Kubelet Version reported by the node.",
                ),
            ],
            "Namespace" => vec![
                col("Status", "string", 0, "The status of the namespace"),
                age,
            ],
            "Event" => vec![
                col("Last Seen", "string", 0, "Time when last event occurred"),
                col("Type", "string", 0, "Type of this event"),
                col(
                    "Reason",
                    "string",
                    0,
                    "Reason for the transition into the object's current status",
                ),
                col("Object", "string", 0, "Object this event is about"),
                col(
                    "Message",
                    "string",
                    0,
                    "A human-readable description of the status of this operation",
                ),
            ],
            "Secret" => vec![
                col("Type", "string", 0, "Secret type"),
                col("Data", "integer", 0, "Number of data"),
                age,
            ],
            "ConfigMap" => vec![col("Data", "integer", 0, "Number of data"), age],
            "Service" => vec![
                col("Type", "string", 0, "Type of the service"),
                col("Cluster-IP", "string", 0, "Cluster IP"),
                col("External-IP", "string", 0, "External IPs"),
                col("Port(s)", "string", 0, "Ports"),
                age,
            ],
            "Job" => vec![
                col("Status", "string", 0, "Status of the job"),
                col(
                    "Completions",
                    "string",
                    0,
                    "The completion status of the job",
                ),
                col("Duration", "string", 0, "Time required to complete the job"),
                age,
            ],
            "Lease" => vec![col("Holder", "string", 0, "The holder of the lease"), age],
            "MutatingWebhookConfiguration" | "ValidatingWebhookConfiguration" => {
                vec![col("Webhooks", "integer", 0, "Number of webhooks"), age]
            }
            "CustomResourceDefinition" => vec![col("Created At", "date", 0, "Creation time")],
            _ => vec![age],
        };
        if self.rt.kind == "Event" {
            return more;
        }
        cols.extend(more);
        cols
    }

    fn cells(&self, obj: &Value) -> Vec<Value> {
        let name = json!(meta::name(obj));
        let created = meta::str_at(obj, &["metadata", "creationTimestamp"]);
        let age_cell = json!(age(created));
        if self.rt.custom {
            let mut cells = vec![name];
            if self.rt.printer_columns.is_empty() {
                cells.push(age_cell);
            } else {
                for c in &self.rt.printer_columns {
                    let v = json_path(obj, &c.json_path);
                    cells.push(match (&v, c.type_.as_str()) {
                        (Value::String(s), "date") => json!(age(s)),
                        (Value::Null, _) => json!("<none>"),
                        (Value::Array(_) | Value::Object(_), _) => json!(v.to_string()),
                        _ => v,
                    });
                }
            }
            return cells;
        }
        let count = |v: &Value| v.as_object().map_or(0, serde_json::Map::len);
        match self.rt.kind.as_str() {
            "Pod" => {
                let statuses = obj["status"]["containerStatuses"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let total = obj["spec"]["containers"].as_array().map_or(0, Vec::len);
                let ready = statuses.iter().filter(|s| s["ready"] == true).count();
                let restarts: i64 = statuses
                    .iter()
                    .filter_map(|s| s["restartCount"].as_i64())
                    .sum();
                let mut status = obj["status"]["reason"]
                    .as_str()
                    .unwrap_or_else(|| obj["status"]["phase"].as_str().unwrap_or("Unknown"))
                    .to_owned();
                for s in &statuses {
                    if let Some(r) = s["state"]["waiting"]["reason"].as_str() {
                        status = r.to_owned();
                    } else if let Some(r) = s["state"]["terminated"]["reason"].as_str() {
                        status = r.to_owned();
                    }
                }
                if meta::is_deleting(obj) {
                    status = "Terminating".into();
                }
                let ip = obj["status"]["podIP"].as_str().unwrap_or("<none>");
                let node = obj["spec"]["nodeName"].as_str().unwrap_or("<none>");
                vec![
                    name,
                    json!(format!("{ready}/{total}")),
                    json!(status),
                    json!(restarts.to_string()),
                    age_cell,
                    json!(ip),
                    json!(node),
                ]
            }
            "Node" => {
                let ready = obj["status"]["conditions"]
                    .as_array()
                    .and_then(|c| c.iter().find(|c| c["type"] == "Ready"))
                    .map_or("Unknown", |c| {
                        if c["status"] == "True" {
                            "Ready"
                        } else {
                            "NotReady"
                        }
                    });
                let status = if obj["spec"]["unschedulable"] == true {
                    format!("{ready},SchedulingDisabled")
                } else {
                    ready.to_owned()
                };
                let version = obj["status"]["nodeInfo"]["kubeletVersion"]
                    .as_str()
                    .unwrap_or("");
                vec![
                    name,
                    json!(status),
                    json!("<none>"),
                    age_cell,
                    json!(version),
                ]
            }
            "Namespace" => vec![
                name,
                json!(obj["status"]["phase"].as_str().unwrap_or("")),
                age_cell,
            ],
            "Event" => {
                let last = obj["lastTimestamp"]
                    .as_str()
                    .or_else(|| obj["eventTime"].as_str())
                    .unwrap_or(created);
                let io = &obj["involvedObject"];
                let object = format!(
                    "{}/{}",
                    io["kind"].as_str().unwrap_or_default().to_lowercase(),
                    io["name"].as_str().unwrap_or_default()
                );
                vec![
                    json!(age(last)),
                    obj["type"].clone(),
                    obj["reason"].clone(),
                    json!(object),
                    obj["message"].clone(),
                ]
            }
            "Secret" => vec![
                name,
                obj["type"].clone(),
                json!(count(&obj["data"])),
                age_cell,
            ],
            "ConfigMap" => vec![
                name,
                json!(count(&obj["data"]) + count(&obj["binaryData"])),
                age_cell,
            ],
            "Service" => {
                let ports: Vec<String> = obj["spec"]["ports"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|p| format!("{}/{}", p["port"], p["protocol"].as_str().unwrap_or("TCP")))
                    .collect();
                let ports = if ports.is_empty() {
                    "<none>".to_owned()
                } else {
                    ports.join(",")
                };
                vec![
                    name,
                    obj["spec"]["type"].clone(),
                    json!(obj["spec"]["clusterIP"].as_str().unwrap_or("<none>")),
                    json!("<none>"),
                    json!(ports),
                    age_cell,
                ]
            }
            "Job" => {
                let conds = obj["status"]["conditions"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                let has = |t: &str| {
                    conds
                        .iter()
                        .any(|c| c["type"] == t && c["status"] == "True")
                };
                let status = if has("Complete") {
                    "Complete"
                } else if has("Failed") {
                    "Failed"
                } else if has("Suspended") {
                    "Suspended"
                } else {
                    "Running"
                };
                let completions = format!(
                    "{}/{}",
                    obj["status"]["succeeded"].as_i64().unwrap_or(0),
                    obj["spec"]["completions"].as_i64().unwrap_or(1)
                );
                let duration = match (
                    obj["status"]["startTime"].as_str(),
                    obj["status"]["completionTime"].as_str(),
                ) {
                    (Some(s), Some(e)) => {
                        match (s.parse::<jiff::Timestamp>(), e.parse::<jiff::Timestamp>()) {
                            (Ok(s), Ok(e)) => format!("{}s", e.duration_since(s).as_secs()),
                            _ => String::new(),
                        }
                    }
                    (Some(s), None) => age(s),
                    _ => String::new(),
                };
                vec![
                    name,
                    json!(status),
                    json!(completions),
                    json!(duration),
                    age_cell,
                ]
            }
            "Lease" => vec![
                name,
                json!(obj["spec"]["holderIdentity"].as_str().unwrap_or("")),
                age_cell,
            ],
            "MutatingWebhookConfiguration" | "ValidatingWebhookConfiguration" => {
                vec![
                    name,
                    json!(obj["webhooks"].as_array().map_or(0, Vec::len)),
                    age_cell,
                ]
            }
            "CustomResourceDefinition" => vec![name, json!(created)],
            _ => vec![name, age_cell],
        }
    }

    /// A Table of `objects` (served form); `no_headers` leaves out the column definitions (watch
    /// events after the first).
    pub fn table(&self, objects: &[Value], no_headers: bool) -> Value {
        let columns: Vec<Value> = self
            .columns()
            .iter()
            .map(|c| {
                let format = if c.name == "Name" { "name" } else { "" };
                json!({"name": c.name, "type": c.type_, "format": format, "description": c.description, "priority": c.priority})
            })
            .collect();
        let rows: Vec<Value> = objects
            .iter()
            .map(|o| {
                let mut row = json!({"cells": self.cells(o)});
                match self.include {
                    Include::None => {}
                    Include::Metadata => {
                        row["object"] = json!({"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": o["metadata"]});
                    }
                    Include::Object => row["object"] = o.clone(),
                }
                row
            })
            .collect();
        let mut t =
            json!({"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": {}, "rows": rows});
        if !no_headers {
            t["columnDefinitions"] = Value::Array(columns);
        }
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_paths_reach_nested_and_indexed_values() {
        let o = json!({"spec": {"a": {"b": "x"}, "l": [{"n": 1}]}});
        assert_eq!(json_path(&o, ".spec.a.b"), json!("x"));
        assert_eq!(json_path(&o, ".spec.l[0].n"), json!(1));
        assert_eq!(json_path(&o, ".spec.none"), Value::Null);
    }
}
