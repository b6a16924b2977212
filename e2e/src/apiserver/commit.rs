//! Writes that reach the store: a create or an update goes through the type's strategy, the
//! admission webhooks and validation, then the store, with its managed fields recorded. Shared
//! by the HTTP verbs and server-side apply.

use serde_json::{Value, json};

use super::Shared;
use super::admission::{self, Attributes};
use super::error::ApiError;
use super::fieldmanager;
use super::meta;
use super::resources::{self, ResourceType};
use super::strategy;

/// Create an object given in the served version: strategy, admission, validation, store.
///
/// # Errors
/// Any refusal along the way.
pub async fn create_object(
    shared: &Shared,
    rt: &ResourceType,
    ns: &str,
    obj: Value,
    manager: &str,
) -> Result<Value, ApiError> {
    create_object_with(shared, rt, ns, obj, manager, |o| {
        fieldmanager::record_update(rt, None, o, manager, "")
    })
    .await
}

/// [`create_object`] with the managed fields recorded by `fields`.
///
/// # Errors
/// Any refusal along the way.
pub async fn create_object_with(
    shared: &Shared,
    rt: &ResourceType,
    ns: &str,
    obj: Value,
    _manager: &str,
    fields: impl FnOnce(&mut Value),
) -> Result<Value, ApiError> {
    let stored_in = resources::to_storage(rt, &obj);
    let mut prepared = strategy::prepare_create(rt, stored_in, ns);
    let name = meta::name(&prepared).to_owned();
    let attrs = Attributes {
        rt,
        operation: "CREATE",
        subresource: "",
        namespace: ns,
        name: &name,
        old: None,
        dry_run: false,
    };
    let mutated = admission::mutate(shared, &attrs, resources::to_served(rt, &prepared)).await?;
    if mutated != resources::to_served(rt, &prepared) {
        let uid = meta::uid(&prepared).to_owned();
        prepared = strategy::prepare_create(rt, resources::to_storage(rt, &mutated), ns);
        let m = meta::meta_mut(&mut prepared);
        m.insert("name".into(), json!(name));
        m.insert("uid".into(), json!(uid));
    }
    strategy::validate_create(rt, &prepared)?;
    admission::validate(shared, &attrs, &resources::to_served(rt, &prepared)).await?;
    fields(&mut prepared);
    let mut st = shared.store.lock();
    st.create(rt, prepared)
}

/// Validate, admit and store an update of `old` to `new` (both storage form).
///
/// # Errors
/// Any refusal along the way; 409 when `old` is no longer current.
pub async fn commit_update(
    shared: &Shared,
    rt: &ResourceType,
    old: &Value,
    mut new: Value,
    subresource: &str,
    manager: &str,
    operation: &str,
) -> Result<Value, ApiError> {
    {
        let m = meta::meta_mut(&mut new);
        m.insert("name".into(), json!(meta::name(old)));
        if rt.namespaced {
            m.insert("namespace".into(), json!(meta::namespace(old)));
        }
    }
    let served_old = resources::to_served(rt, old);
    let attrs = Attributes {
        rt,
        operation: "UPDATE",
        subresource,
        namespace: meta::namespace(old),
        name: meta::name(old),
        old: Some(&served_old),
        dry_run: false,
    };
    let served_new = resources::to_served(rt, &new);
    let mutated = admission::mutate(shared, &attrs, served_new.clone()).await?;
    if mutated != served_new {
        new = strategy::prepare_update(
            rt,
            old,
            resources::to_storage(rt, &mutated),
            (!subresource.is_empty()).then_some(subresource),
        );
    }
    strategy::validate_update(rt, old, &new)?;
    admission::validate(shared, &attrs, &resources::to_served(rt, &new)).await?;
    if operation != "Apply" {
        fieldmanager::record_update(rt, Some(old), &mut new, manager, subresource);
    }
    let mut st = shared.store.lock();
    st.update(rt, new, meta::resource_version(old))
}
