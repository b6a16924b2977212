//! Field managers and server-side apply (k8s.io/apiserver `pkg/endpoints/handlers/fieldmanager`,
//! sigs.k8s.io/structured-merge-diff), to the extent kube-rs and kubectl use them:
//!
//! - every write records which fields its manager set in `metadata.managedFields` (`FieldsV1`),
//!   an `Update` entry for create/update/patch, an `Apply` entry for apply;
//! - apply merges the configuration into the live object (maps by key; lists by their list type:
//!   the `patchMergeKey` of built-in fields or `x-kubernetes-list-type`/`-list-map-keys` of a CRD
//!   schema, else atomic), reports conflicts with other managers (409, unless `force`), and removes
//!   fields the applier set before and no longer sets when no other manager owns them.
//!
//! Simplifications: ownership is tracked on leaves and on list items, not on the maps that hold
//! them (so a map emptied by apply stays as `{}`), and list map keys are the single
//! `patchMergeKey` for built-in kinds.

use std::collections::{BTreeSet, HashMap};

use axum::http::HeaderMap;
use serde_json::{Map, Value, json};

use super::error::ApiError;
use super::meta;
use super::patch::{self, ListStrategy, Ty};
use super::resources::{self, ResourceType};

/// The manager of a write: `fieldManager`, else the user agent's program name, as the API server
/// derives it.
pub fn manager_name(q: &HashMap<String, String>, headers: &HeaderMap) -> String {
    if let Some(m) = q.get("fieldManager").filter(|m| !m.is_empty()) {
        return m.clone();
    }
    let agent = headers
        .get(axum::http::header::USER_AGENT)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("unknown");
    agent.split('/').next().unwrap_or("unknown").to_owned()
}

/// One step of a field path.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Pe {
    /// A map key or struct field.
    Field(String),
    /// An associative list item, by its key fields (serialised JSON object).
    Key(String),
    /// A set list element (serialised JSON value).
    Val(String),
}

pub(super) type Path = Vec<Pe>;
pub(super) type FieldSet = BTreeSet<Path>;

/// How a list at some point of an object merges.
#[derive(Clone, Debug)]
pub(super) enum ListKind {
    Atomic,
    Map(Vec<String>),
    Set,
}

/// Where a value sits, to know its lists' kinds.
#[derive(Clone, Copy, Debug)]
pub(super) enum Ctx<'a> {
    Builtin(Ty),
    Schema(&'a Value),
    Unknown,
}

fn child<'a>(ctx: Ctx<'a>, key: &str) -> (Ctx<'a>, ListKind) {
    match ctx {
        Ctx::Builtin(ty) => {
            let (strategy, child_ty) = patch::field(ty, key);
            let kind = match strategy {
                ListStrategy::Replace => ListKind::Atomic,
                ListStrategy::MergeKey(k) => ListKind::Map(vec![k.to_owned()]),
                ListStrategy::MergePrimitives => ListKind::Set,
            };
            (
                if child_ty == Ty::Unknown {
                    Ctx::Unknown
                } else {
                    Ctx::Builtin(child_ty)
                },
                kind,
            )
        }
        Ctx::Schema(s) => {
            let sub = s["properties"]
                .get(key)
                .or_else(|| s.get("additionalProperties").filter(|a| a.is_object()));
            match sub {
                Some(sub) => (Ctx::Schema(sub), list_kind_of_schema(sub)),
                None if key == "metadata" => (Ctx::Builtin(Ty::ObjectMeta), ListKind::Atomic),
                None => (Ctx::Unknown, ListKind::Atomic),
            }
        }
        Ctx::Unknown => (Ctx::Unknown, ListKind::Atomic),
    }
}

fn list_kind_of_schema(s: &Value) -> ListKind {
    match s["x-kubernetes-list-type"].as_str() {
        Some("map") => ListKind::Map(
            s["x-kubernetes-list-map-keys"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .map(str::to_owned)
                        .collect()
                })
                .unwrap_or_default(),
        ),
        Some("set") => ListKind::Set,
        _ => ListKind::Atomic,
    }
}

fn items_ctx(ctx: Ctx<'_>) -> Ctx<'_> {
    match ctx {
        Ctx::Schema(s) => s.get("items").map_or(Ctx::Unknown, Ctx::Schema),
        other => other,
    }
}

fn map_atomic(ctx: Ctx<'_>) -> bool {
    matches!(ctx, Ctx::Schema(s) if s["x-kubernetes-map-type"] == "atomic")
}

pub(super) fn root_ctx(rt: &ResourceType) -> Ctx<'_> {
    match &rt.schema {
        Some(s) => Ctx::Schema(s),
        None if rt.custom => Ctx::Unknown,
        None => Ctx::Builtin(patch::root(rt)),
    }
}

fn item_key(item: &Value, keys: &[String]) -> Option<String> {
    let mut m = Map::new();
    for k in keys {
        m.insert(k.clone(), item.get(k)?.clone());
    }
    Some(Value::Object(m).to_string())
}

/// The fields an object sets (leaves and list items), skipping system metadata.
fn fields_of(v: &Value, ctx: Ctx<'_>, prefix: &mut Path, out: &mut FieldSet, top: bool) {
    match v {
        Value::Object(m) if !m.is_empty() && !map_atomic(ctx) => {
            for (k, val) in m {
                if top && matches!(k.as_str(), "apiVersion" | "kind") {
                    continue;
                }
                if prefix.len() == 1
                    && prefix[0] == Pe::Field("metadata".into())
                    && !matches!(
                        k.as_str(),
                        "labels" | "annotations" | "finalizers" | "ownerReferences"
                    )
                {
                    continue;
                }
                let (c, list) = child(ctx, k);
                prefix.push(Pe::Field(k.clone()));
                match (val, list) {
                    (Value::Array(items), ListKind::Map(keys)) => {
                        let ic = items_ctx(c);
                        for item in items {
                            if let Some(key) = item_key(item, &keys) {
                                prefix.push(Pe::Key(key));
                                out.insert(prefix.clone());
                                fields_of(item, ic, prefix, out, false);
                                prefix.pop();
                            }
                        }
                        if items.is_empty() {
                            out.insert(prefix.clone());
                        }
                    }
                    (Value::Array(items), ListKind::Set) => {
                        for item in items {
                            prefix.push(Pe::Val(item.to_string()));
                            out.insert(prefix.clone());
                            prefix.pop();
                        }
                        if items.is_empty() {
                            out.insert(prefix.clone());
                        }
                    }
                    _ => fields_of(val, c, prefix, out, false),
                }
                prefix.pop();
            }
        }
        _ => {
            if !prefix.is_empty() {
                out.insert(prefix.clone());
            }
        }
    }
}

pub(super) fn lookup<'a>(v: &'a Value, path: &[Pe]) -> Option<&'a Value> {
    let mut cur = v;
    for pe in path {
        cur = match pe {
            Pe::Field(k) => cur.get(k)?,
            Pe::Key(key) => {
                let want: Map<String, Value> = serde_json::from_str(key).ok()?;
                cur.as_array()?
                    .iter()
                    .find(|i| want.iter().all(|(k, v)| i.get(k) == Some(v)))?
            }
            Pe::Val(val) => {
                let want: Value = serde_json::from_str(val).ok()?;
                cur.as_array()?.iter().find(|i| **i == want)?
            }
        };
    }
    Some(cur)
}

pub(super) fn remove_at(v: &mut Value, path: &[Pe]) {
    let Some((last, parent_path)) = path.split_last() else {
        return;
    };
    let mut cur = v;
    for pe in parent_path {
        let next = match pe {
            Pe::Field(k) => cur.get_mut(k),
            Pe::Key(key) => {
                let Ok(want) = serde_json::from_str::<Map<String, Value>>(key) else {
                    return;
                };
                cur.as_array_mut().and_then(|a| {
                    a.iter_mut()
                        .find(|i| want.iter().all(|(k, v)| i.get(k) == Some(v)))
                })
            }
            Pe::Val(_) => return,
        };
        match next {
            Some(n) => cur = n,
            None => return,
        }
    }
    match last {
        Pe::Field(k) => {
            if let Value::Object(m) = cur {
                m.remove(k);
            }
        }
        Pe::Key(key) => {
            if let (Ok(want), Value::Array(a)) =
                (serde_json::from_str::<Map<String, Value>>(key), cur)
            {
                a.retain(|i| !want.iter().all(|(k, v)| i.get(k) == Some(v)));
            }
        }
        Pe::Val(val) => {
            if let (Ok(want), Value::Array(a)) = (serde_json::from_str::<Value>(val), cur) {
                a.retain(|i| *i != want);
            }
        }
    }
}

fn insert_path(node: &mut Map<String, Value>, path: &[Pe]) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    let key = match first {
        Pe::Field(k) => format!("f:{k}"),
        Pe::Key(k) => format!("k:{k}"),
        Pe::Val(v) => format!("v:{v}"),
    };
    let entry = node.entry(key).or_insert_with(|| json!({}));
    if let Value::Object(m) = entry {
        if rest.is_empty() {
            if matches!(first, Pe::Key(_)) {
                m.insert(".".into(), json!({}));
            }
        } else {
            insert_path(m, rest);
        }
    }
}

fn to_fields_v1(set: &FieldSet) -> Value {
    let mut root = Map::new();
    for path in set {
        insert_path(&mut root, path);
    }
    Value::Object(root)
}

fn from_fields_v1(v: &Value, prefix: &mut Path, out: &mut FieldSet) {
    let Some(m) = v.as_object() else { return };
    if (m.is_empty() || m.contains_key(".")) && !prefix.is_empty() {
        out.insert(prefix.clone());
    }
    for (k, child) in m {
        let pe = if let Some(f) = k.strip_prefix("f:") {
            Pe::Field(f.to_owned())
        } else if let Some(key) = k.strip_prefix("k:") {
            Pe::Key(key.to_owned())
        } else if let Some(val) = k.strip_prefix("v:") {
            Pe::Val(val.to_owned())
        } else {
            continue;
        };
        prefix.push(pe);
        from_fields_v1(child, prefix, out);
        prefix.pop();
    }
}

#[derive(Clone, Debug)]
pub(super) struct Entry {
    pub(super) manager: String,
    operation: String,
    subresource: String,
    api_version: String,
    time: String,
    pub(super) fields: FieldSet,
}

pub(super) fn entries(obj: &Value) -> Vec<Entry> {
    meta::at(obj, &["metadata", "managedFields"])
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|e| {
                    let mut fields = FieldSet::new();
                    from_fields_v1(&e["fieldsV1"], &mut Vec::new(), &mut fields);
                    Entry {
                        manager: e["manager"].as_str().unwrap_or_default().to_owned(),
                        operation: e["operation"].as_str().unwrap_or_default().to_owned(),
                        subresource: e["subresource"].as_str().unwrap_or_default().to_owned(),
                        api_version: e["apiVersion"].as_str().unwrap_or_default().to_owned(),
                        time: e["time"].as_str().unwrap_or_default().to_owned(),
                        fields,
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

pub(super) fn store_entries(obj: &mut Value, entries: &[Entry]) {
    let list: Vec<Value> = entries
        .iter()
        .filter(|e| !e.fields.is_empty())
        .map(|e| {
            let mut v = json!({"manager": e.manager, "operation": e.operation, "apiVersion": e.api_version,
                "time": e.time, "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(&e.fields)});
            if !e.subresource.is_empty() {
                v["subresource"] = json!(e.subresource);
            }
            v
        })
        .collect();
    let m = meta::meta_mut(obj);
    if list.is_empty() {
        m.remove("managedFields");
    } else {
        m.insert("managedFields".into(), Value::Array(list));
    }
}

pub(super) fn upsert(
    entries: &mut Vec<Entry>,
    manager: &str,
    operation: &str,
    subresource: &str,
    api_version: &str,
) -> usize {
    if let Some(i) = entries.iter().position(|e| {
        e.manager == manager && e.operation == operation && e.subresource == subresource
    }) {
        entries[i].time = meta::now();
        entries[i].api_version = api_version.to_owned();
        return i;
    }
    entries.push(Entry {
        manager: manager.to_owned(),
        operation: operation.to_owned(),
        subresource: subresource.to_owned(),
        api_version: api_version.to_owned(),
        time: meta::now(),
        fields: FieldSet::new(),
    });
    entries.len() - 1
}

pub(super) fn object_fields(rt: &ResourceType, obj: &Value) -> FieldSet {
    let mut set = FieldSet::new();
    fields_of(obj, root_ctx(rt), &mut Vec::new(), &mut set, true);
    set
}

/// Record an `Update` by `manager` in `new.metadata.managedFields` (storage form; `old` is the
/// object before, `None` for a create): it takes ownership of every field it changed.
pub fn record_update(
    rt: &ResourceType,
    old: Option<&Value>,
    new: &mut Value,
    manager: &str,
    subresource: &str,
) {
    let mut list = old.map(entries).unwrap_or_default();
    if old.is_none() {
        list.clear();
    }
    let served_new = resources::to_served(rt, new);
    let served_old = old.map(|o| resources::to_served(rt, o));
    let new_fields = object_fields(rt, &served_new);
    let changed: FieldSet = new_fields
        .iter()
        .filter(|p| {
            served_old.as_ref().is_none_or(|o| {
                if is_item(p) {
                    lookup(o, p).is_none()
                } else {
                    lookup(o, p) != lookup(&served_new, p)
                }
            })
        })
        .cloned()
        .collect();
    for e in &mut list {
        e.fields
            .retain(|p| new_fields.contains(p) && !changed.contains(p));
    }
    if !changed.is_empty() {
        let i = upsert(&mut list, manager, "Update", subresource, &rt.api_version());
        list[i].fields.extend(changed);
    }
    store_entries(new, &list);
}

/// Whether a path names a list item (owned as a whole, never in conflict by value).
pub(super) fn is_item(p: &Path) -> bool {
    matches!(p.last(), Some(Pe::Key(_)))
}

/// Merge an applied configuration into the live object (served form).
pub(super) fn merge(live: &mut Value, config: &Value, ctx: Ctx<'_>) {
    match (live, config) {
        (Value::Object(l), Value::Object(c)) if !map_atomic(ctx) => {
            for (k, cv) in c {
                let (cctx, list) = child(ctx, k);
                match (l.get_mut(k), cv) {
                    (Some(Value::Array(la)), Value::Array(ca)) => match list {
                        ListKind::Map(keys) => {
                            let ic = items_ctx(cctx);
                            for item in ca {
                                let key = item_key(item, &keys);
                                match la
                                    .iter_mut()
                                    .find(|x| key.is_some() && item_key(x, &keys) == key)
                                {
                                    Some(existing) => merge(existing, item, ic),
                                    None => la.push(item.clone()),
                                }
                            }
                        }
                        ListKind::Set => {
                            for item in ca {
                                if !la.contains(item) {
                                    la.push(item.clone());
                                }
                            }
                        }
                        ListKind::Atomic => *la = ca.clone(),
                    },
                    (Some(lv @ Value::Object(_)), Value::Object(_)) => merge(lv, cv, cctx),
                    (_, _) => {
                        l.insert(k.clone(), cv.clone());
                    }
                }
            }
        }
        (live, config) => *live = config.clone(),
    }
}

pub(super) fn conflict_error(
    rt: &ResourceType,
    name: &str,
    conflicts: &[(String, Path)],
) -> ApiError {
    let render = |p: &Path| -> String {
        p.iter()
            .map(|pe| match pe {
                Pe::Field(f) => format!(".{f}"),
                Pe::Key(k) => {
                    let m: Map<String, Value> = serde_json::from_str(k).unwrap_or_default();
                    let parts: Vec<String> = m.iter().map(|(k, v)| format!("{k}={v}")).collect();
                    format!("[{}]", parts.join(","))
                }
                Pe::Val(v) => format!("[{v}]"),
            })
            .collect()
    };
    let lines: Vec<String> = conflicts
        .iter()
        .map(|(m, p)| format!("- {m}: {}", render(p)))
        .collect();
    let mut err = ApiError::conflict_because(&rt.group, &rt.plural, name, "");
    err.message = format!(
        "Apply failed with {} conflict{}: {}",
        conflicts.len(),
        if conflicts.len() == 1 { "" } else { "s" },
        conflicts
            .iter()
            .map(|(m, p)| format!("conflict with {m:?}: {}", render(p)))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let _ = lines;
    if let Some(Value::Object(d)) = err.details.as_mut() {
        let causes: Vec<Value> = conflicts
            .iter()
            .map(|(m, p)| json!({"reason": "FieldManagerConflict", "message": format!("conflict with {m:?}"), "field": render(p)}))
            .collect();
        d.insert("causes".into(), Value::Array(causes));
    }
    err
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::apiserver::resources::builtins;

    fn pods() -> ResourceType {
        builtins()
            .into_iter()
            .find(|r| r.kind == "Pod")
            .expect("pods are built in")
    }

    #[test]
    fn fields_v1_round_trips() {
        let pod = json!({"metadata": {"name": "p", "labels": {"a": "b"}, "finalizers": ["x/y"]},
            "spec": {"containers": [{"name": "main", "image": "i"}]}});
        let set = object_fields(&pods(), &pod);
        let v1 = to_fields_v1(&set);
        assert_eq!(
            v1["f:spec"]["f:containers"]["k:{\"name\":\"main\"}"]["f:image"],
            json!({})
        );
        assert_eq!(v1["f:metadata"]["f:labels"]["f:a"], json!({}));
        assert!(v1["f:metadata"].get("f:name").is_none());
        let mut back = FieldSet::new();
        from_fields_v1(&v1, &mut Vec::new(), &mut back);
        assert_eq!(back, set);
    }

    #[test]
    fn update_takes_ownership_of_changed_fields() {
        let rt = pods();
        let mut a = json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "labels": {"x": "1"}}});
        record_update(&rt, None, &mut a, "creator", "");
        let mut b = a.clone();
        b["metadata"]["labels"]["y"] = json!("2");
        record_update(&rt, Some(&a), &mut b, "labeller", "");
        let list = entries(&b);
        assert_eq!(list.len(), 2);
        assert!(list[0].fields.contains(&vec![
            Pe::Field("metadata".into()),
            Pe::Field("labels".into()),
            Pe::Field("x".into())
        ]));
        assert!(list[1].fields.contains(&vec![
            Pe::Field("metadata".into()),
            Pe::Field("labels".into()),
            Pe::Field("y".into())
        ]));
    }
}
