//! The OpenAPI documents kubectl downloads before it sends an object with its default
//! `--validate`, so `kubectl apply -f` works against the double as against a cluster:
//!
//! - `/openapi/v3` and one v3 document per group version (what kubectl reads to learn whether
//!   the server takes the `fieldValidation` parameter): a custom resource's schema is its CRD's
//!   `openAPIV3Schema` with `apiVersion`, `kind` and `metadata` added, as kube-apiserver
//!   publishes it; built-in kinds are published as objects accepting any field (the double does
//!   not carry their schemas). No operation declares `fieldValidation`, so kubectl validates on
//!   the client, with
//! - `/openapi/v2`, the protobuf document kubectl's client-side validation reads: published
//!   without definitions, so kubectl finds no schema and leaves every check to the server (the
//!   double validates custom resources against their CRD schema, and built-ins as far as it
//!   models them).

use std::collections::BTreeSet;

use serde_json::{Map, Value, json};
use sha2::{Digest, Sha256};

use super::resources::ResourceType;

/// The path of a group version in the discovery document: `api/v1`, `apis/<group>/<version>`.
fn gv_path(group: &str, version: &str) -> String {
    if group.is_empty() {
        format!("api/{version}")
    } else {
        format!("apis/{group}/{version}")
    }
}

/// The name a schema is published under (`dev.warmstart.v1alpha1.Checkpoint`,
/// `io.k8s.api.core.v1.Pod`), as kube-apiserver names them.
fn schema_name(t: &ResourceType) -> String {
    if t.group.is_empty() {
        return format!("io.k8s.api.core.{}.{}", t.version, t.kind);
    }
    let reversed: Vec<&str> = t.group.split('.').rev().collect();
    if t.custom {
        format!("{}.{}.{}", reversed.join("."), t.version, t.kind)
    } else {
        let short = t.group.split('.').next().unwrap_or(&t.group);
        format!("io.k8s.api.{short}.{}.{}", t.version, t.kind)
    }
}

/// `/openapi/v3`: every served group version with the URL of its document.
pub fn root(types: &[ResourceType]) -> Value {
    let gvs: BTreeSet<(String, String)> = types
        .iter()
        .map(|t| (t.group.clone(), t.version.clone()))
        .collect();
    let mut paths = Map::new();
    for (group, version) in gvs {
        let path = gv_path(&group, &version);
        let hash = document(types, &group, &version).map_or_else(String::new, |doc| {
            hex::encode(Sha256::digest(doc.to_string().as_bytes()))
        });
        paths.insert(
            path.clone(),
            json!({"serverRelativeURL": format!("/openapi/v3/{path}?hash={hash}")}),
        );
    }
    json!({"paths": paths})
}

/// The OpenAPI v3 document of one group version; `None` when nothing is served there.
pub fn document(types: &[ResourceType], group: &str, version: &str) -> Option<Value> {
    let served = super::discovery::served_at(types, group, version)?;
    let mut schemas = Map::new();
    for t in served {
        let gvk = json!([{"group": t.group, "version": t.version, "kind": t.kind}]);
        let mut schema = match (&t.schema, t.custom) {
            (Some(schema), true) => {
                let mut s = (**schema).clone();
                if let Some(props) = s
                    .as_object_mut()
                    .map(|o| o.entry("properties").or_insert_with(|| json!({})))
                    .and_then(Value::as_object_mut)
                {
                    props.insert("apiVersion".into(), json!({"type": "string"}));
                    props.insert("kind".into(), json!({"type": "string"}));
                    props.insert(
                        "metadata".into(),
                        json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
                    );
                }
                s
            }
            _ => json!({"type": "object", "x-kubernetes-preserve-unknown-fields": true}),
        };
        if let Some(obj) = schema.as_object_mut() {
            obj.insert("x-kubernetes-group-version-kind".into(), gvk);
        }
        schemas.insert(schema_name(t), schema);
    }
    Some(json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes (warmstart API server double)", "version": "v1.33.0"},
        "paths": {},
        "components": {"schemas": schemas}
    }))
}

/// Content type the protobuf OpenAPI v2 document is served with (kube-openapi answers
/// kubectl's `application/com.github.proto-openapi.spec.v2@v1.0+protobuf` with it; the `@` is
/// not a valid media type to echo back).
pub const V2_PROTOBUF: &str = "application/octet-stream";

/// `/openapi/v2` as protobuf (gnostic's `openapi_v2.Document`): `swagger: "2.0"` and an `info`
/// with title and version, no definitions.
pub fn v2_protobuf() -> Vec<u8> {
    // Length-delimited fields only: tag = field number << 3 | 2.
    fn field(out: &mut Vec<u8>, number: u8, bytes: &[u8]) {
        out.push((number << 3) | 2);
        // Every value here is shorter than 128 bytes: a one-byte varint.
        out.push(u8::try_from(bytes.len()).unwrap_or(u8::MAX) & 0x7f);
        out.extend_from_slice(bytes);
    }
    let mut info = Vec::new();
    field(&mut info, 1, b"Kubernetes (warmstart API server double)");
    field(&mut info, 2, b"v1.33.0");
    let mut doc = Vec::new();
    field(&mut doc, 1, b"2.0");
    field(&mut doc, 2, &info);
    doc
}
