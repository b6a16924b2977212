//! The in-memory store: every object as JSON in its storage version, one global
//! `resourceVersion` counter (etcd's revision), a bounded history of changes per resource for
//! watches from a `resourceVersion` (410 Gone once compacted), and the controllers a real control
//! plane runs that tests observe through the API: garbage collection through ownerReferences
//! (background, foreground, orphan), namespace and CRD content cleanup, and finalizers.
//!
//! # Invariants
//! - Every mutation happens under the state lock and is broadcast (in `resourceVersion` order)
//!   while the lock is held, so a watcher that snapshots the history and subscribes under the
//!   lock sees no gap and no duplicate.
//! - An object with a `deletionTimestamp` is removed as soon as it has no finalizers and a zero
//!   `deletionGracePeriodSeconds`; only a kubelet (the node simulator) zeroes a pod's grace period.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde_json::{Map, Value, json};
use tokio::sync::broadcast;

use super::error::ApiError;
use super::meta;
use super::resources::{self, ResourceType, StorageKey};

/// What happened to an object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChangeKind {
    /// Created.
    Added,
    /// Updated.
    Modified,
    /// Removed.
    Deleted,
}

/// One committed change, as watches see it.
#[derive(Debug)]
pub struct Change {
    /// Which resource.
    pub key: StorageKey,
    /// The `resourceVersion` the change got.
    pub rv: u64,
    /// Created, updated or removed.
    pub kind: ChangeKind,
    /// The object after the change (its last state for a removal), storage version.
    pub object: Value,
    /// The object before the change (updates only), so selector watches can turn an update into
    /// ADDED or DELETED as the object enters or leaves the selection.
    pub old: Option<Value>,
}

#[derive(Debug, Default)]
struct Table {
    objects: BTreeMap<(String, String), Value>,
    history: VecDeque<Arc<Change>>,
    /// Watches from a `resourceVersion` below this are too old (410).
    earliest: u64,
}

/// `propagationPolicy` of a deletion.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Propagation {
    /// Dependents are orphaned (their ownerReference to the object removed).
    Orphan,
    /// The object goes at once; the garbage collector deletes dependents afterwards.
    Background,
    /// Dependents are deleted first; the object waits with the `foregroundDeletion` finalizer.
    Foreground,
}

/// Options of a deletion (`DeleteOptions`).
#[derive(Clone, Debug, Default)]
pub struct DeleteOpts {
    /// `gracePeriodSeconds`.
    pub grace: Option<i64>,
    /// `propagationPolicy` (or the legacy `orphanDependents`).
    pub propagation: Option<Propagation>,
    /// `preconditions.uid`.
    pub uid: Option<String>,
    /// `preconditions.resourceVersion`.
    pub resource_version: Option<String>,
    /// `dryRun=All`.
    pub dry_run: bool,
}

/// The result of a deletion.
#[derive(Debug)]
pub struct Deleted {
    /// The object (removed, or marked for deletion).
    pub object: Value,
    /// Whether it is gone (else waiting for finalizers or a kubelet).
    pub removed: bool,
}

/// A snapshot of matching history for a new watch, plus its live feed.
#[derive(Debug)]
pub struct WatchStart {
    /// Changes after the requested `resourceVersion` still in history.
    pub backlog: Vec<Arc<Change>>,
    /// Live changes after the snapshot.
    pub live: broadcast::Receiver<Arc<Change>>,
    /// The current `resourceVersion` at the snapshot.
    pub rv: u64,
}

/// The lock-protected state.
#[derive(Debug)]
pub struct State {
    rv: u64,
    history_limit: usize,
    types: Vec<ResourceType>,
    tables: BTreeMap<StorageKey, Table>,
    tx: broadcast::Sender<Arc<Change>>,
}

/// The shared store.
#[derive(Debug)]
pub struct Store {
    state: Mutex<State>,
}

/// Finalizer the double's CRD cleanup uses (as apiextensions-apiserver does).
pub const CRD_CLEANUP_FINALIZER: &str = "customresourcecleanup.apiextensions.k8s.io";
/// Finalizer of foreground deletion.
pub const FOREGROUND_FINALIZER: &str = "foregroundDeletion";

fn crd_key() -> StorageKey {
    StorageKey::new("apiextensions.k8s.io", "customresourcedefinitions")
}

fn ns_key() -> StorageKey {
    StorageKey::new("", "namespaces")
}

fn obj_key(obj: &Value) -> (String, String) {
    (meta::namespace(obj).to_owned(), meta::name(obj).to_owned())
}

impl Store {
    /// An empty store with the built-in types and the namespaces every cluster has.
    pub fn new(history_limit: usize) -> Self {
        let (tx, _) = broadcast::channel(4096);
        let mut state = State {
            rv: 1,
            history_limit: history_limit.max(1),
            types: resources::builtins(),
            tables: BTreeMap::new(),
            tx,
        };
        for ns in ["default", "kube-system", "kube-public", "kube-node-lease"] {
            let obj = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}});
            if let Some(rt) = state.find_type("", "v1", "namespaces") {
                let obj = super::strategy::prepare_create(&rt, obj, "");
                // Creating the built-in namespaces in an empty store cannot fail.
                let _ = state.create(&rt, obj);
            }
        }
        Self {
            state: Mutex::new(state),
        }
    }

    /// Lock the state. A panic while holding the lock is a bug in the double; the state is still
    /// consistent at every await-free step, so a poisoned lock is recovered.
    pub fn lock(&self) -> MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl State {
    /// The current `resourceVersion`.
    pub fn rv(&self) -> u64 {
        self.rv
    }

    /// Every served type.
    pub fn types(&self) -> &[ResourceType] {
        &self.types
    }

    /// The type served at `group/version` as `plural`.
    pub fn find_type(&self, group: &str, version: &str, plural: &str) -> Option<ResourceType> {
        self.types
            .iter()
            .find(|t| t.group == group && t.version == version && t.plural == plural)
            .cloned()
    }

    /// The preferred served type storing under `key` (built-ins: the only one; CRDs: the storage
    /// version).
    pub fn type_for_key(&self, key: &StorageKey) -> Option<ResourceType> {
        let mut candidates = self
            .types
            .iter()
            .filter(|t| &t.storage == key && t.group == key.group);
        let first = candidates.next()?.clone();
        let storage = self.types.iter().find(|t| {
            &t.storage == key && t.group == key.group && t.api_version() == t.storage_version
        });
        Some(storage.cloned().unwrap_or(first))
    }

    /// The stored object.
    pub fn get(&self, key: &StorageKey, ns: &str, name: &str) -> Option<&Value> {
        self.tables
            .get(key)?
            .objects
            .get(&(ns.to_owned(), name.to_owned()))
    }

    /// Stored objects of a resource, optionally in one namespace.
    pub fn list(&self, key: &StorageKey, ns: Option<&str>) -> Vec<&Value> {
        let Some(table) = self.tables.get(key) else {
            return Vec::new();
        };
        match ns {
            Some(ns) => table
                .objects
                .range((ns.to_owned(), String::new())..)
                .take_while(|((n, _), _)| n == ns)
                .map(|(_, v)| v)
                .collect(),
            None => table.objects.values().collect(),
        }
    }

    /// Start a watch on `key` from `rv` (`None`: from now).
    ///
    /// # Errors
    /// 410 when `rv` is older than the history kept.
    pub fn watch(&mut self, key: &StorageKey, from: Option<u64>) -> Result<WatchStart, ApiError> {
        let live = self.tx.subscribe();
        let table = self.tables.entry(key.clone()).or_default();
        let backlog = match from {
            None => Vec::new(),
            Some(rv) => {
                if rv < table.earliest {
                    return Err(ApiError::gone(format!(
                        "too old resource version: {rv} ({})",
                        table.earliest
                    )));
                }
                table
                    .history
                    .iter()
                    .filter(|c| c.rv > rv)
                    .cloned()
                    .collect()
            }
        };
        Ok(WatchStart {
            backlog,
            live,
            rv: self.rv,
        })
    }

    /// Forget all history: every watch from an earlier `resourceVersion` gets 410.
    pub fn compact(&mut self) {
        let rv = self.rv;
        for table in self.tables.values_mut() {
            table.history.clear();
            table.earliest = rv;
        }
    }

    fn commit(
        &mut self,
        key: &StorageKey,
        kind: ChangeKind,
        mut object: Value,
        old: Option<Value>,
    ) -> Value {
        self.rv += 1;
        let rv = self.rv;
        meta::meta_mut(&mut object).insert("resourceVersion".into(), json!(rv.to_string()));
        let limit = self.history_limit;
        let table = self.tables.entry(key.clone()).or_default();
        let k = obj_key(&object);
        if kind == ChangeKind::Deleted {
            table.objects.remove(&k);
        } else {
            table.objects.insert(k, object.clone());
        }
        let change = Arc::new(Change {
            key: key.clone(),
            rv,
            kind,
            object: object.clone(),
            old,
        });
        table.history.push_back(change.clone());
        while table.history.len() > limit {
            if let Some(dropped) = table.history.pop_front() {
                table.earliest = dropped.rv;
            }
        }
        // No receiver is not an error: nobody watches.
        let _ = self.tx.send(change);
        if *key == crd_key() {
            self.refresh_custom_types();
        }
        object
    }

    fn refresh_custom_types(&mut self) {
        self.types.retain(|t| !t.custom);
        let crds: Vec<Value> = self.list(&crd_key(), None).into_iter().cloned().collect();
        for crd in crds {
            let established = crd["status"]["conditions"].as_array().is_some_and(|c| {
                c.iter()
                    .any(|c| c["type"] == "Established" && c["status"] == "True")
            });
            if established {
                self.types.extend(resources::from_crd(&crd));
            }
        }
    }

    fn check_namespace(&self, rt: &ResourceType, ns: &str, name: &str) -> Result<(), ApiError> {
        if !rt.namespaced {
            return Ok(());
        }
        match self.get(&ns_key(), "", ns) {
            None => Err(ApiError::not_found("", "namespaces", ns)),
            Some(n) if meta::is_deleting(n) => Err(ApiError::forbidden(format!(
                "{} {name:?} is forbidden: unable to create new content in namespace {ns} because it is being terminated",
                rt.qualified()
            ))
            .with_reason_details("Forbidden", &rt.group, &rt.plural, name)),
            Some(_) => Ok(()),
        }
    }

    /// Create a prepared, validated object (name set).
    ///
    /// # Errors
    /// 404 when the namespace does not exist, 403 when it is terminating, 409 when the name is
    /// taken.
    pub fn create(&mut self, rt: &ResourceType, mut obj: Value) -> Result<Value, ApiError> {
        let (ns, name) = obj_key(&obj);
        self.check_namespace(rt, &ns, &name)?;
        if self.get(&rt.storage, &ns, &name).is_some() {
            return Err(ApiError::already_exists(&rt.group, &rt.plural, &name));
        }
        let m = meta::meta_mut(&mut obj);
        if m.get("uid")
            .and_then(Value::as_str)
            .is_none_or(str::is_empty)
        {
            m.insert("uid".into(), json!(meta::new_uid()));
        }
        m.insert("creationTimestamp".into(), json!(meta::now()));
        m.remove("deletionTimestamp");
        m.remove("deletionGracePeriodSeconds");
        if rt.generation {
            m.insert("generation".into(), json!(1));
        } else {
            m.remove("generation");
        }
        let created = self.commit(&rt.storage, ChangeKind::Added, obj, None);
        if rt.storage == ns_key() {
            self.create_default_service_account(&name);
        }
        self.settle();
        Ok(created)
    }

    /// What the ServiceAccount controller does for a new namespace.
    fn create_default_service_account(&mut self, ns: &str) {
        let Some(rt) = self.find_type("", "v1", "serviceaccounts") else {
            return;
        };
        let sa = json!({"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default", "namespace": ns}});
        let sa = super::strategy::prepare_create(&rt, sa, ns);
        // A new namespace has no service account yet; failure would only mean one exists.
        let _ = self.create(&rt, sa);
    }

    /// Replace an object (already shaped by the strategy), if its `resourceVersion` is
    /// `expected_rv`.
    ///
    /// # Errors
    /// 404 when absent, 409 on a stale `resourceVersion`, 409 on a changed UID.
    pub fn update(
        &mut self,
        rt: &ResourceType,
        mut obj: Value,
        expected_rv: u64,
    ) -> Result<Value, ApiError> {
        let (ns, name) = obj_key(&obj);
        let Some(old) = self.get(&rt.storage, &ns, &name).cloned() else {
            return Err(ApiError::not_found(&rt.group, &rt.plural, &name));
        };
        if meta::resource_version(&old) != expected_rv {
            return Err(ApiError::conflict(&rt.group, &rt.plural, &name));
        }
        let new_uid = meta::uid(&obj);
        if !new_uid.is_empty() && new_uid != meta::uid(&old) {
            return Err(ApiError::conflict_because(
                &rt.group,
                &rt.plural,
                &name,
                &format!(
                    "Precondition failed: UID in precondition: {}, UID in object meta: {new_uid}",
                    meta::uid(&old)
                ),
            ));
        }
        let spec_changed = spec_of(rt, &old) != spec_of(rt, &obj);
        {
            let m = meta::meta_mut(&mut obj);
            let old_meta = old["metadata"].as_object().cloned().unwrap_or_default();
            for field in [
                "uid",
                "creationTimestamp",
                "deletionTimestamp",
                "deletionGracePeriodSeconds",
            ] {
                match old_meta.get(field) {
                    Some(v) => m.insert(field.into(), v.clone()),
                    None => m.remove(field),
                };
            }
            if rt.generation {
                let next_gen = meta::generation(&old) + i64::from(spec_changed);
                m.insert("generation".into(), json!(next_gen));
            } else {
                m.remove("generation");
            }
        }
        if old == with_rv(&obj, &old) {
            // A no-op update does not change the resourceVersion and emits no event.
            return Ok(old);
        }
        let result = if should_remove(&obj) {
            self.commit(&rt.storage, ChangeKind::Deleted, obj, None)
        } else {
            self.commit(&rt.storage, ChangeKind::Modified, obj, Some(old))
        };
        self.settle();
        Ok(result)
    }

    /// Delete an object.
    ///
    /// # Errors
    /// 404 when absent, 409 when a precondition fails.
    pub fn delete(
        &mut self,
        rt: &ResourceType,
        ns: &str,
        name: &str,
        opts: &DeleteOpts,
    ) -> Result<Deleted, ApiError> {
        let Some(obj) = self.get(&rt.storage, ns, name).cloned() else {
            return Err(ApiError::not_found(&rt.group, &rt.plural, name));
        };
        if let Some(uid) = &opts.uid
            && uid != meta::uid(&obj)
        {
            return Err(ApiError::conflict_because(
                &rt.group,
                &rt.plural,
                name,
                &format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta::uid(&obj)
                ),
            ));
        }
        if let Some(rv) = &opts.resource_version
            && *rv != meta::str_at(&obj, &["metadata", "resourceVersion"])
        {
            return Err(ApiError::conflict_because(
                &rt.group,
                &rt.plural,
                name,
                &format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta::str_at(&obj, &["metadata", "resourceVersion"])
                ),
            ));
        }
        if opts.dry_run {
            return Ok(Deleted {
                object: obj,
                removed: true,
            });
        }
        let result = self.delete_inner(rt, obj, opts);
        self.settle();
        Ok(result)
    }

    fn delete_inner(&mut self, rt: &ResourceType, mut obj: Value, opts: &DeleteOpts) -> Deleted {
        let grace = grace_period(rt, &obj, opts.grace);
        let key = rt.storage.clone();
        if meta::is_deleting(&obj) {
            let current = meta::at(&obj, &["metadata", "deletionGracePeriodSeconds"])
                .and_then(Value::as_i64)
                .unwrap_or(0);
            if grace < current {
                let old = obj.clone();
                let m = meta::meta_mut(&mut obj);
                m.insert("deletionGracePeriodSeconds".into(), json!(grace));
                m.insert("deletionTimestamp".into(), json!(timestamp_in(grace)));
                if should_remove(&obj) {
                    let object = self.commit(&key, ChangeKind::Deleted, obj, None);
                    return Deleted {
                        object,
                        removed: true,
                    };
                }
                let object = self.commit(&key, ChangeKind::Modified, obj, Some(old));
                return Deleted {
                    object,
                    removed: false,
                };
            }
            return Deleted {
                object: obj,
                removed: false,
            };
        }
        let propagation = opts.propagation.unwrap_or_else(|| default_propagation(rt));
        let uid = meta::uid(&obj).to_owned();
        let mut finalizers = meta::finalizers(&obj);
        match propagation {
            Propagation::Orphan => self.orphan_dependents(&uid),
            Propagation::Foreground => {
                if self.has_dependents(&uid)
                    && !finalizers.iter().any(|f| f == FOREGROUND_FINALIZER)
                {
                    finalizers.push(FOREGROUND_FINALIZER.to_owned());
                }
            }
            Propagation::Background => {}
        }
        let spec_finalizers = obj["spec"]["finalizers"]
            .as_array()
            .is_some_and(|a| !a.is_empty());
        if *rt.kind == *"CustomResourceDefinition"
            && !finalizers.iter().any(|f| f == CRD_CLEANUP_FINALIZER)
        {
            finalizers.push(CRD_CLEANUP_FINALIZER.to_owned());
        }
        if finalizers.is_empty() && grace == 0 && !spec_finalizers {
            let object = self.commit(&key, ChangeKind::Deleted, obj, None);
            return Deleted {
                object,
                removed: true,
            };
        }
        let old = obj.clone();
        let next_gen = meta::generation(&obj);
        let m = meta::meta_mut(&mut obj);
        m.insert("deletionTimestamp".into(), json!(timestamp_in(grace)));
        m.insert("deletionGracePeriodSeconds".into(), json!(grace));
        if !finalizers.is_empty() {
            m.insert("finalizers".into(), json!(finalizers));
        }
        if next_gen > 0 {
            m.insert("generation".into(), json!(next_gen + 1));
        }
        if rt.storage == ns_key() {
            obj["status"]["phase"] = json!("Terminating");
        }
        let object = self.commit(&key, ChangeKind::Modified, obj, Some(old));
        Deleted {
            object,
            removed: false,
        }
    }

    fn has_dependents(&self, uid: &str) -> bool {
        self.tables
            .values()
            .flat_map(|t| t.objects.values())
            .any(|o| owner_uids(o).iter().any(|u| u == uid))
    }

    fn orphan_dependents(&mut self, uid: &str) {
        let dependents: Vec<(StorageKey, Value)> = self
            .tables
            .iter()
            .flat_map(|(k, t)| t.objects.values().map(move |o| (k.clone(), o)))
            .filter(|(_, o)| owner_uids(o).iter().any(|u| u == uid))
            .map(|(k, o)| (k, o.clone()))
            .collect();
        for (key, old) in dependents {
            let mut obj = old.clone();
            remove_owner_refs(&mut obj, &[uid.to_owned()]);
            self.commit(&key, ChangeKind::Modified, obj, Some(old));
        }
    }

    /// Run the control-plane controllers the double folds into the store until nothing changes:
    /// garbage collection, foreground deletion, namespace and CRD content cleanup.
    fn settle(&mut self) {
        for _ in 0..10_000 {
            if !self.settle_once() {
                return;
            }
        }
        tracing::warn!("the store did not settle");
    }

    fn settle_once(&mut self) -> bool {
        // uid -> (kind, name, namespace, waiting for dependents (foreground))
        let mut owners: HashMap<String, (String, String, bool)> = HashMap::new();
        for table in self.tables.values() {
            for o in table.objects.values() {
                let waiting = meta::is_deleting(o)
                    && meta::finalizers(o)
                        .iter()
                        .any(|f| f == FOREGROUND_FINALIZER);
                owners.insert(
                    meta::uid(o).to_owned(),
                    (
                        meta::str_at(o, &["kind"]).to_owned(),
                        meta::name(o).to_owned(),
                        waiting,
                    ),
                );
            }
        }
        // 1. Dependents whose owners are gone or waiting for them.
        for (key, table) in &self.tables {
            for o in table.objects.values() {
                let Some(refs) = o["metadata"]["ownerReferences"].as_array() else {
                    continue;
                };
                if refs.is_empty() || meta::is_deleting(o) {
                    continue;
                }
                let mut solid = 0;
                let mut gone = Vec::new();
                for r in refs {
                    let uid = r["uid"].as_str().unwrap_or_default();
                    match owners.get(uid) {
                        Some((kind, name, waiting))
                            if r["kind"].as_str() == Some(kind)
                                && r["name"].as_str() == Some(name) =>
                        {
                            if *waiting {
                                gone.push(uid.to_owned());
                            } else {
                                solid += 1;
                            }
                        }
                        _ => gone.push(uid.to_owned()),
                    }
                }
                if solid == 0 {
                    let key = key.clone();
                    let obj = o.clone();
                    if let Some(rt) = self.type_for_key(&key) {
                        let opts = DeleteOpts {
                            propagation: Some(Propagation::Background),
                            ..DeleteOpts::default()
                        };
                        self.delete_inner(&rt, obj, &opts);
                        return true;
                    }
                } else if !gone.is_empty() {
                    let key = key.clone();
                    let old = o.clone();
                    let mut obj = old.clone();
                    remove_owner_refs(&mut obj, &gone);
                    self.commit(&key, ChangeKind::Modified, obj, Some(old));
                    return true;
                }
            }
        }
        // 2. Foreground owners whose blocking dependents are gone.
        let mut blocking: HashMap<String, usize> = HashMap::new();
        for table in self.tables.values() {
            for o in table.objects.values() {
                for r in o["metadata"]["ownerReferences"]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    if r["blockOwnerDeletion"].as_bool() == Some(true) {
                        *blocking
                            .entry(r["uid"].as_str().unwrap_or_default().to_owned())
                            .or_default() += 1;
                    }
                }
            }
        }
        for (key, table) in &self.tables {
            for o in table.objects.values() {
                if meta::is_deleting(o)
                    && meta::finalizers(o)
                        .iter()
                        .any(|f| f == FOREGROUND_FINALIZER)
                    && !blocking.contains_key(meta::uid(o))
                    && !owners_dependents_pending(&self.tables, meta::uid(o))
                {
                    let key = key.clone();
                    let old = o.clone();
                    let mut obj = old.clone();
                    remove_finalizer(&mut obj, FOREGROUND_FINALIZER);
                    self.commit_maybe_removing(&key, obj, old);
                    return true;
                }
            }
        }
        // 3. Terminating namespaces: delete their content, then finalize.
        let terminating: Vec<Value> = self
            .list(&ns_key(), None)
            .into_iter()
            .filter(|n| meta::is_deleting(n))
            .cloned()
            .collect();
        for namespace in terminating {
            let ns = meta::name(&namespace).to_owned();
            let mut content = Vec::new();
            for (key, table) in &self.tables {
                for o in table.objects.values() {
                    if meta::namespace(o) == ns {
                        content.push((key.clone(), o.clone()));
                    }
                }
            }
            if let Some((key, obj)) = content.iter().find(|(_, o)| !meta::is_deleting(o))
                && let Some(rt) = self.type_for_key(key)
            {
                self.delete_inner(&rt, obj.clone(), &DeleteOpts::default());
                return true;
            }
            if content.is_empty() {
                let old = namespace.clone();
                let mut obj = namespace;
                if let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) {
                    spec.insert("finalizers".into(), json!([]));
                }
                self.commit_maybe_removing(&ns_key(), obj, old);
                if self
                    .get(&ns_key(), "", &ns)
                    .is_some_and(|n| !meta::finalizers(n).is_empty())
                {
                    continue;
                }
                return true;
            }
        }
        // 4. Deleted CRDs: delete their instances, then finalize.
        let deleting_crds: Vec<Value> = self
            .list(&crd_key(), None)
            .into_iter()
            .filter(|c| {
                meta::is_deleting(c)
                    && meta::finalizers(c)
                        .iter()
                        .any(|f| f == CRD_CLEANUP_FINALIZER)
            })
            .cloned()
            .collect();
        for crd in deleting_crds {
            let key = StorageKey::new(
                meta::str_at(&crd, &["spec", "group"]),
                meta::str_at(&crd, &["spec", "names", "plural"]),
            );
            let instances: Vec<Value> = self.list(&key, None).into_iter().cloned().collect();
            if let Some(obj) = instances.iter().find(|o| !meta::is_deleting(o))
                && let Some(rt) = self.type_for_key(&key)
            {
                self.delete_inner(&rt, obj.clone(), &DeleteOpts::default());
                return true;
            }
            if instances.is_empty() {
                let old = crd.clone();
                let mut obj = crd;
                remove_finalizer(&mut obj, CRD_CLEANUP_FINALIZER);
                self.commit_maybe_removing(&crd_key(), obj, old);
                self.tables.remove(&key);
                return true;
            }
        }
        false
    }

    fn commit_maybe_removing(&mut self, key: &StorageKey, obj: Value, old: Value) {
        if should_remove(&obj) {
            self.commit(key, ChangeKind::Deleted, obj, None);
        } else {
            self.commit(key, ChangeKind::Modified, obj, Some(old));
        }
    }
}

/// Whether any object not yet being deleted still names `uid` as an owner (foreground deletion
/// waits for dependents to be deleted, blocking or not, before the garbage collector
/// removes the finalizer; only blocking ones are waited for to disappear).
fn owners_dependents_pending(tables: &BTreeMap<StorageKey, Table>, uid: &str) -> bool {
    tables
        .values()
        .flat_map(|t| t.objects.values())
        .any(|o| !meta::is_deleting(o) && owner_uids(o).iter().any(|u| u == uid))
}

fn owner_uids(obj: &Value) -> Vec<String> {
    obj["metadata"]["ownerReferences"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|r| r["uid"].as_str())
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

fn remove_owner_refs(obj: &mut Value, uids: &[String]) {
    let m = meta::meta_mut(obj);
    if let Some(Value::Array(refs)) = m.get_mut("ownerReferences") {
        refs.retain(|r| !uids.iter().any(|u| r["uid"].as_str() == Some(u)));
        if refs.is_empty() {
            m.remove("ownerReferences");
        }
    }
}

fn remove_finalizer(obj: &mut Value, name: &str) {
    let m = meta::meta_mut(obj);
    if let Some(Value::Array(f)) = m.get_mut("finalizers") {
        f.retain(|x| x.as_str() != Some(name));
        if f.is_empty() {
            m.remove("finalizers");
        }
    }
}

/// `ShouldDeleteDuringUpdate`: being deleted, no finalizers, grace period over.
fn should_remove(obj: &Value) -> bool {
    meta::is_deleting(obj)
        && meta::finalizers(obj).is_empty()
        && meta::at(obj, &["metadata", "deletionGracePeriodSeconds"])
            .and_then(Value::as_i64)
            .unwrap_or(0)
            == 0
        && obj["spec"]["finalizers"]
            .as_array()
            .is_none_or(Vec::is_empty)
}

/// The object without the fields that do not count as spec changes.
fn spec_of(rt: &ResourceType, obj: &Value) -> Value {
    let mut v = obj.clone();
    if let Value::Object(m) = &mut v {
        m.remove("metadata");
        m.remove("apiVersion");
        m.remove("kind");
        if rt.status {
            m.remove("status");
        }
    }
    v
}

fn with_rv(obj: &Value, old: &Value) -> Value {
    let mut v = obj.clone();
    meta::meta_mut(&mut v).insert(
        "resourceVersion".into(),
        json!(meta::str_at(old, &["metadata", "resourceVersion"])),
    );
    if meta::at(old, &["metadata", "managedFields"]).is_some()
        || meta::at(&v, &["metadata", "managedFields"]).is_some()
    {
        // managedFields timestamps change on every write; they alone do not make a change.
        let mf = old["metadata"]["managedFields"].clone();
        let m = meta::meta_mut(&mut v);
        if mf.is_null() {
            m.remove("managedFields");
        } else {
            m.insert("managedFields".into(), mf);
        }
    }
    v
}

fn timestamp_in(seconds: i64) -> String {
    let now = jiff::Timestamp::now();
    let then = now
        .checked_add(jiff::SignedDuration::from_secs(seconds))
        .unwrap_or(now);
    then.strftime("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// The grace period a deletion gets (`pod.Strategy.CheckGracefulDelete`): pods on a node that are
/// not finished wait for their kubelet; everything else goes at once.
fn grace_period(rt: &ResourceType, obj: &Value, requested: Option<i64>) -> i64 {
    if rt.storage != StorageKey::new("", "pods") {
        return 0;
    }
    let phase = meta::str_at(obj, &["status", "phase"]);
    if meta::str_at(obj, &["spec", "nodeName"]).is_empty()
        || phase == "Succeeded"
        || phase == "Failed"
    {
        return 0;
    }
    let default = obj["spec"]["terminationGracePeriodSeconds"]
        .as_i64()
        .unwrap_or(30);
    requested.unwrap_or(default).max(0)
}

/// The propagation a deletion without one gets: `batch/v1` Jobs orphan their pods (kept for
/// backward compatibility by Kubernetes); everything else is background.
fn default_propagation(rt: &ResourceType) -> Propagation {
    if rt.group == "batch" && rt.plural == "jobs" {
        Propagation::Orphan
    } else {
        Propagation::Background
    }
}

impl ApiError {
    fn with_reason_details(mut self, reason: &str, group: &str, plural: &str, name: &str) -> Self {
        self.reason = reason.to_owned();
        let mut d = Map::new();
        d.insert("name".into(), json!(name));
        if !group.is_empty() {
            d.insert("group".into(), json!(group));
        }
        d.insert("kind".into(), json!(plural));
        self.details = Some(Value::Object(d));
        self
    }
}
