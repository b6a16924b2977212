//! Object metadata helpers: JSON accessors, timestamps, UIDs, generated names, and the name and
//! label validation rules of k8s.io/apimachinery `pkg/util/validation`.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

use serde_json::{Map, Value};

use super::error::Cause;

/// The current time as a Kubernetes `Time` (RFC 3339, seconds, UTC).
pub fn now() -> String {
    jiff::Timestamp::now()
        .strftime("%Y-%m-%dT%H:%M:%SZ")
        .to_string()
}

/// A random 64-bit number (std's per-process random hasher keys plus a counter).
pub fn random_u64() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut hasher = RandomState::new().build_hasher();
    hasher.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
    hasher.finish()
}

/// A random version-4 UUID, as the API server assigns to `metadata.uid`.
pub fn new_uid() -> String {
    let a = random_u64();
    let b = random_u64();
    let hex = format!("{a:016x}{b:016x}");
    format!(
        "{}-{}-4{}-{}{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[13..16],
        ["8", "9", "a", "b"][usize::from(hex.as_bytes()[16] % 4)],
        &hex[17..20],
        &hex[20..32]
    )
}

/// The 5-character suffix `generateName` gets (k8s.io/apiserver `names.SimpleNameGenerator`).
pub fn random_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut n = random_u64();
    let mut out = String::with_capacity(5);
    for _ in 0..5 {
        let i = usize::try_from(n % 27).unwrap_or(0);
        out.push(char::from(ALPHABET[i]));
        n /= 27;
    }
    out
}

/// `obj.metadata`, created empty when absent.
pub fn meta_mut(obj: &mut Value) -> &mut Map<String, Value> {
    if !obj.is_object() {
        *obj = Value::Object(Map::new());
    }
    let Value::Object(map) = obj else {
        unreachable!("made an object above")
    };
    let entry = map
        .entry("metadata")
        .or_insert_with(|| Value::Object(Map::new()));
    if !entry.is_object() {
        *entry = Value::Object(Map::new());
    }
    match entry {
        Value::Object(m) => m,
        _ => unreachable!("made an object above"),
    }
}

/// A string at a path of object keys, or `""`.
pub fn str_at<'a>(obj: &'a Value, path: &[&str]) -> &'a str {
    at(obj, path).and_then(Value::as_str).unwrap_or("")
}

/// The value at a path of object keys.
pub fn at<'a>(obj: &'a Value, path: &[&str]) -> Option<&'a Value> {
    let mut cur = obj;
    for key in path {
        cur = cur.get(key)?;
    }
    Some(cur)
}

/// `metadata.name`.
pub fn name(obj: &Value) -> &str {
    str_at(obj, &["metadata", "name"])
}

/// `metadata.namespace`.
pub fn namespace(obj: &Value) -> &str {
    str_at(obj, &["metadata", "namespace"])
}

/// `metadata.uid`.
pub fn uid(obj: &Value) -> &str {
    str_at(obj, &["metadata", "uid"])
}

/// `metadata.finalizers`.
pub fn finalizers(obj: &Value) -> Vec<String> {
    at(obj, &["metadata", "finalizers"])
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(Value::as_str)
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default()
}

/// Whether `metadata.deletionTimestamp` is set.
pub fn is_deleting(obj: &Value) -> bool {
    at(obj, &["metadata", "deletionTimestamp"]).is_some_and(|v| !v.is_null())
}

/// `metadata.labels` as pairs.
pub fn labels(obj: &Value) -> Map<String, Value> {
    at(obj, &["metadata", "labels"])
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default()
}

/// `metadata.resourceVersion` parsed, 0 when absent.
pub fn resource_version(obj: &Value) -> u64 {
    str_at(obj, &["metadata", "resourceVersion"])
        .parse()
        .unwrap_or(0)
}

/// `metadata.generation`, 0 when absent.
pub fn generation(obj: &Value) -> i64 {
    at(obj, &["metadata", "generation"])
        .and_then(Value::as_i64)
        .unwrap_or(0)
}

const DNS1123_LABEL_MSG: &str = "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')";
const DNS1123_SUBDOMAIN_MSG: &str = "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character (e.g. 'example.com', regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')";
const DNS1035_LABEL_MSG: &str = "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or 'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')";
const QUALIFIED_NAME_MSG: &str = "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]')";
const LABEL_VALUE_MSG: &str = "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyValue',  or 'my_value',  or '12345', regex used for validation is '(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?')";

fn is_label(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        && b[0] != b'-'
        && b[b.len() - 1] != b'-'
}

/// Which rule a kind's names follow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NameRule {
    /// RFC 1123 subdomain (most kinds).
    Subdomain,
    /// RFC 1123 label (namespaces).
    Label,
    /// RFC 1035 label (services).
    Dns1035,
}

/// Problems with a name under a rule; empty when valid.
pub fn validate_name(rule: NameRule, name: &str) -> Vec<String> {
    let mut errs = Vec::new();
    match rule {
        NameRule::Subdomain => {
            if name.len() > 253 {
                errs.push("must be no more than 253 characters".to_owned());
            }
            if !name.split('.').all(is_label) {
                errs.push(DNS1123_SUBDOMAIN_MSG.to_owned());
            }
        }
        NameRule::Label => {
            if name.len() > 63 {
                errs.push("must be no more than 63 characters".to_owned());
            }
            if !is_label(&name[..name.len().min(63)]) || name.is_empty() {
                errs.push(DNS1123_LABEL_MSG.to_owned());
            }
        }
        NameRule::Dns1035 => {
            if name.len() > 63 {
                errs.push("must be no more than 63 characters".to_owned());
            }
            if !is_label(name) || !name.starts_with(|c: char| c.is_ascii_lowercase()) {
                errs.push(DNS1035_LABEL_MSG.to_owned());
            }
        }
    }
    errs
}

fn is_qualified_part(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= 63
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
}

/// Problems with a label or annotation key (`[prefix/]name`).
pub fn validate_qualified_name(key: &str) -> Vec<String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    let mut errs = Vec::new();
    if let Some(p) = prefix {
        if p.is_empty() {
            errs.push("prefix part must be non-empty".to_owned());
        } else if !validate_name(NameRule::Subdomain, p).is_empty() {
            errs.push(format!("prefix part {DNS1123_SUBDOMAIN_MSG}"));
        }
        if name.contains('/') {
            errs.push("a qualified name must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character (e.g. 'MyName',  or 'my.name',  or '123-abc', regex used for validation is '([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]') with an optional DNS subdomain prefix and '/' (e.g. 'example.com/MyName')".to_owned());
            return errs;
        }
    }
    if name.is_empty() {
        errs.push("name part must be non-empty".to_owned());
    } else if name.len() > 63 {
        errs.push("name part must be no more than 63 characters".to_owned());
    } else if !is_qualified_part(name) {
        errs.push(QUALIFIED_NAME_MSG.to_owned());
    }
    errs
}

/// Problems with a label value.
pub fn validate_label_value(value: &str) -> Vec<String> {
    let mut errs = Vec::new();
    if value.len() > 63 {
        errs.push("must be no more than 63 characters".to_owned());
    }
    if !value.is_empty() && !is_qualified_part(&value[..value.len().min(63)]) {
        errs.push(LABEL_VALUE_MSG.to_owned());
    }
    errs
}

/// Validate the metadata every object has: name (by `rule`), labels, annotations, finalizers.
pub fn validate_object_meta(obj: &Value, rule: NameRule, causes: &mut Vec<Cause>) {
    let name = name(obj);
    if name.is_empty() {
        causes.push(Cause::required(
            "metadata.name",
            "name or generateName is required",
        ));
    } else {
        for msg in validate_name(rule, name) {
            causes.push(Cause::invalid(
                "metadata.name",
                &Value::String(name.to_owned()),
                msg,
            ));
        }
    }
    if let Some(labels) = at(obj, &["metadata", "labels"]) {
        match labels.as_object() {
            Some(map) => {
                for (k, v) in map {
                    for msg in validate_qualified_name(k) {
                        causes.push(Cause::invalid(
                            "metadata.labels",
                            &Value::String(k.clone()),
                            msg,
                        ));
                    }
                    match v.as_str() {
                        Some(s) => {
                            for msg in validate_label_value(s) {
                                causes.push(Cause::invalid("metadata.labels", v, msg));
                            }
                        }
                        None if v.is_null() => {}
                        None => {
                            causes.push(Cause::invalid("metadata.labels", v, "must be a string"))
                        }
                    }
                }
            }
            None if labels.is_null() => {}
            None => causes.push(Cause::invalid(
                "metadata.labels",
                labels,
                "must be a map of strings",
            )),
        }
    }
    if let Some(annotations) = at(obj, &["metadata", "annotations"]).and_then(Value::as_object) {
        let mut total = 0;
        for (k, v) in annotations {
            total += k.len() + v.as_str().map_or(0, str::len);
            for msg in validate_qualified_name(&k.to_lowercase()) {
                causes.push(Cause::invalid(
                    "metadata.annotations",
                    &Value::String(k.clone()),
                    msg,
                ));
            }
        }
        if total > 256 * 1024 {
            causes.push(Cause {
                reason: "FieldValueTooLong",
                field: "metadata.annotations".into(),
                message: "Too long: must have at most 262144 bytes".into(),
            });
        }
    }
    for (i, f) in finalizers(obj).iter().enumerate() {
        let errs = validate_qualified_name(f);
        if !errs.is_empty() || (!f.contains('/') && !STANDARD_FINALIZERS.contains(&f.as_str())) {
            let detail = errs.into_iter().next().unwrap_or_else(|| {
                "name is neither a standard finalizer name nor is it fully qualified".to_owned()
            });
            causes.push(Cause::invalid(
                format!("metadata.finalizers[{i}]"),
                &Value::String(f.clone()),
                detail,
            ));
        }
    }
}

/// Finalizer names that need no domain prefix.
pub const STANDARD_FINALIZERS: &[&str] = &["kubernetes", "orphan", "foregroundDeletion"];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uids_look_like_uuids() {
        let u = new_uid();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert_ne!(new_uid(), u);
    }

    #[test]
    fn subdomain_names() {
        assert!(validate_name(NameRule::Subdomain, "a.b-c").is_empty());
        assert!(!validate_name(NameRule::Subdomain, "A").is_empty());
        assert!(!validate_name(NameRule::Subdomain, "a_b").is_empty());
        assert!(!validate_name(NameRule::Label, "a.b").is_empty());
        assert!(!validate_name(NameRule::Dns1035, "1a").is_empty());
    }

    #[test]
    fn qualified_names() {
        assert!(validate_qualified_name("warmstart.dev/x").is_empty());
        assert!(validate_qualified_name("app").is_empty());
        assert!(!validate_qualified_name("-a").is_empty());
        assert!(!validate_qualified_name("a/b/c").is_empty());
    }
}
