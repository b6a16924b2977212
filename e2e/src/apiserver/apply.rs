//! Server-side apply: the configuration merged into the live object by field ownership
//! ([`super::fieldmanager`]), written through [`super::commit`] as a create or an update.

use serde_json::{Value, json};

use super::Shared;
use super::error::ApiError;
use super::fieldmanager::{
    FieldSet, conflict_error, entries, is_item, lookup, merge, object_fields, remove_at, root_ctx,
    store_entries, upsert,
};
use super::meta;
use super::resources::{self, ResourceType};

/// Server-side apply of `config` (served form) to the named object; returns the HTTP code (201
/// when created) and the stored object.
///
/// # Errors
/// Refusals of the create or update it turns into, 409 on conflicts with other managers.
#[allow(clippy::too_many_arguments)]
pub async fn apply(
    shared: &Shared,
    rt: &ResourceType,
    ns: &str,
    name: &str,
    subresource: &str,
    config: Value,
    manager: &str,
    force: bool,
) -> Result<(u16, Value), ApiError> {
    if !config.is_object() {
        return Err(ApiError::bad_request(
            "the applied configuration must be an object",
        ));
    }
    let api_version = config["apiVersion"].as_str().unwrap_or_default();
    let kind = config["kind"].as_str().unwrap_or_default();
    if api_version != rt.api_version() || kind != rt.kind {
        return Err(ApiError::bad_request(format!(
            "the apiVersion and kind of the applied configuration ({api_version}, {kind}) do not match the request ({}, {})",
            rt.api_version(),
            rt.kind
        )));
    }
    let cfg_name = meta::name(&config);
    if !cfg_name.is_empty() && cfg_name != name {
        return Err(ApiError::bad_request(format!(
            "the name of the object ({cfg_name}) does not match the name on the URL ({name})"
        )));
    }
    let cfg_ns = meta::namespace(&config);
    if rt.namespaced && !cfg_ns.is_empty() && cfg_ns != ns {
        return Err(ApiError::bad_request(
            "the namespace of the provided object does not match the namespace sent on the request",
        ));
    }
    let mut config = config;
    meta::meta_mut(&mut config).insert("name".into(), json!(name));
    let config_fields = object_fields(rt, &config);
    for _ in 0..10 {
        let live = shared.store.lock().get(&rt.storage, ns, name).cloned();
        let Some(live) = live else {
            if !subresource.is_empty() {
                return Err(ApiError::not_found(&rt.group, &rt.plural, name));
            }
            let created =
                super::commit::create_object_with(shared, rt, ns, config.clone(), manager, |obj| {
                    let mut list = Vec::new();
                    let i = upsert(&mut list, manager, "Apply", "", &rt.api_version());
                    list[i].fields = object_fields(rt, &resources::to_served(rt, obj));
                    store_entries(obj, &list);
                })
                .await;
            if let Err(e) = &created
                && e.reason == "AlreadyExists"
            {
                continue;
            }
            return created.map(|c| (201, c));
        };
        let served_live = resources::to_served(rt, &live);
        let mut list = entries(&live);
        let mut conflicts = Vec::new();
        for e in &list {
            if e.manager == manager {
                continue;
            }
            for p in e.fields.intersection(&config_fields) {
                if !is_item(p) && lookup(&served_live, p) != lookup(&config, p) {
                    conflicts.push((e.manager.clone(), p.clone()));
                }
            }
        }
        if !conflicts.is_empty() && !force {
            return Err(conflict_error(rt, name, &conflicts));
        }
        let mut merged = served_live.clone();
        merge(&mut merged, &config, root_ctx(rt));
        let i = upsert(&mut list, manager, "Apply", subresource, &rt.api_version());
        let previous = std::mem::take(&mut list[i].fields);
        let others: FieldSet = list
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .flat_map(|(_, e)| e.fields.iter().cloned())
            .collect();
        for p in previous.difference(&config_fields) {
            if !others.contains(p) && !others.iter().any(|o| o.starts_with(p)) {
                remove_at(&mut merged, p);
            }
        }
        list[i].fields = config_fields.clone();
        for (j, e) in list.iter_mut().enumerate() {
            if j != i {
                // Forced fields move to the applier; values still shared stay co-owned.
                e.fields.retain(|p| !conflicts.iter().any(|(_, c)| c == p));
            }
        }
        let mut new = resources::to_storage(rt, &merged);
        store_entries(&mut new, &list);
        let sub = (!subresource.is_empty()).then_some(subresource);
        let new = super::strategy::prepare_update(rt, &live, new, sub);
        match super::commit::commit_update(shared, rt, &live, new, subresource, manager, "Apply")
            .await
        {
            Ok(updated) => return Ok((200, updated)),
            Err(e)
                if e.code == 409
                    && e.reason == "Conflict"
                    && !e.message.starts_with("Apply failed") =>
            {
                continue;
            }
            Err(e) => return Err(e),
        }
    }
    Err(ApiError::conflict(&rt.group, &rt.plural, name))
}
