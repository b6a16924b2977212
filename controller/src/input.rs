//! Reading user documents (YAML or JSON, from a file or standard input) into typed objects,
//! with errors that name the source and the problem.
//!
//! Bad input stays cheap and is refused as the API server would refuse it: at most
//! [`MAX_DOCUMENT_BYTES`] are read, UTF-8 only (a byte order mark is skipped), no node nested
//! deeper than [`MAX_DEPTH`] (checked before the document is parsed, see [`crate::yaml_depth`]),
//! no key twice in one mapping, and no field the expected type does not have.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::Serialize;
use serde::de::{DeserializeOwned, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::{Map, Value};
use thiserror::Error;

/// Largest document read: the API server's limit on a request body (3 MiB).
pub const MAX_DOCUMENT_BYTES: usize = 3 * 1024 * 1024;
/// Deepest nesting of collections accepted. A pod template nests about 15 deep; the limit keeps
/// parsing linear in the input (see [`crate::yaml_depth`]).
pub const MAX_DEPTH: usize = 64;

/// The UTF-8 byte order mark, which editors on some systems put at the start of a file.
const UTF8_BOM: &str = "\u{feff}";

/// Where a document comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// Standard input (`-` or no argument).
    Stdin,
    /// A file.
    File(PathBuf),
}

impl Source {
    /// `-` means standard input; anything else is a file path.
    pub fn from_arg(arg: Option<&Path>) -> Self {
        match arg {
            None => Self::Stdin,
            Some(p) if p == Path::new("-") => Self::Stdin,
            Some(p) => Self::File(p.to_path_buf()),
        }
    }
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Stdin => f.write_str("standard input"),
            Self::File(p) => write!(f, "{}", p.display()),
        }
    }
}

/// Why a document could not be read.
#[derive(Debug, Error)]
pub enum InputError {
    /// The file or stream could not be read.
    #[error("cannot read {source_name}")]
    Read {
        /// Where from.
        source_name: Source,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Empty input.
    #[error("{0} is empty: expected one YAML or JSON document")]
    Empty(Source),
    /// More than one document.
    #[error("{0} holds several YAML documents: expected exactly one")]
    Several(Source),
    /// Larger than [`MAX_DOCUMENT_BYTES`].
    #[error("{source_name} is larger than {limit} bytes, the largest document accepted")]
    TooLarge {
        /// Where from.
        source_name: Source,
        /// The limit.
        limit: usize,
    },
    /// Not UTF-8.
    #[error("{source_name} is not UTF-8 text: {problem} at byte {offset}")]
    NotUtf8 {
        /// Where from.
        source_name: Source,
        /// Byte offset of the first bad byte.
        offset: usize,
        /// What is wrong there.
        problem: &'static str,
    },
    /// A node nested deeper than [`MAX_DEPTH`].
    #[error(
        "{source_name} nests deeper than {limit} levels (at line {line} column {column}): the deepest nesting accepted is {limit}"
    )]
    TooDeep {
        /// Where from.
        source_name: Source,
        /// The limit.
        limit: usize,
        /// 1-based line of the first node past the limit.
        line: u64,
        /// 1-based column.
        column: u64,
    },
    /// A field the expected type does not have (a typo, or a field of another version).
    #[error("{source_name} is not a valid {what}: unknown field {path}")]
    UnknownField {
        /// Where from.
        source_name: Source,
        /// What was expected.
        what: &'static str,
        /// The field's path (`spec.job.podTemplateSpec.spec.containers[0].imagee`).
        path: String,
    },
    /// Not valid YAML or JSON, or not the expected shape.
    #[error("{source_name} is not a valid {what}: {message}")]
    Parse {
        /// Where from.
        source_name: Source,
        /// What was expected.
        what: &'static str,
        /// The parser's message (line and column included).
        message: String,
    },
}

/// Reads the whole input as text: at most [`MAX_DOCUMENT_BYTES`], UTF-8, without a leading
/// byte order mark.
///
/// # Errors
/// [`InputError::Read`], [`InputError::TooLarge`], [`InputError::NotUtf8`].
pub fn read_text(source: &Source, stdin: &mut dyn Read) -> Result<String, InputError> {
    let read_err = |e| InputError::Read {
        source_name: source.clone(),
        source: e,
    };
    let mut bytes = Vec::new();
    let limit = u64::try_from(MAX_DOCUMENT_BYTES).unwrap_or(u64::MAX);
    match source {
        Source::Stdin => stdin.take(limit + 1).read_to_end(&mut bytes),
        Source::File(path) => {
            std::fs::File::open(path).and_then(|file| file.take(limit + 1).read_to_end(&mut bytes))
        }
    }
    .map_err(read_err)?;
    text_of(source, bytes)
}

/// `bytes` as text (see [`read_text`]).
///
/// # Errors
/// [`InputError::TooLarge`], [`InputError::NotUtf8`].
pub fn text_of(source: &Source, bytes: Vec<u8>) -> Result<String, InputError> {
    if bytes.len() > MAX_DOCUMENT_BYTES {
        return Err(InputError::TooLarge {
            source_name: source.clone(),
            limit: MAX_DOCUMENT_BYTES,
        });
    }
    if bytes.starts_with(&[0xff, 0xfe]) || bytes.starts_with(&[0xfe, 0xff]) {
        return Err(InputError::NotUtf8 {
            source_name: source.clone(),
            offset: 0,
            problem: "a UTF-16 byte order mark (save the file as UTF-8)",
        });
    }
    let mut text = String::from_utf8(bytes).map_err(|e| InputError::NotUtf8 {
        source_name: source.clone(),
        offset: e.utf8_error().valid_up_to(),
        problem: "an invalid byte sequence",
    })?;
    if text.starts_with(UTF8_BOM) {
        text.drain(..UTF8_BOM.len());
    }
    Ok(text)
}

/// Parses exactly one YAML (or JSON, which is YAML) document into a generic value.
///
/// # Errors
/// [`InputError::Empty`], [`InputError::Several`], [`InputError::TooDeep`] or
/// [`InputError::Parse`] (syntax, or a key repeated in one mapping).
pub fn parse_one(source: &Source, text: &str) -> Result<Value, InputError> {
    let parse_err = |message: String| InputError::Parse {
        source_name: source.clone(),
        what: "YAML or JSON document",
        message,
    };
    crate::yaml_depth::check(text, MAX_DEPTH).map_err(|deep| InputError::TooDeep {
        source_name: source.clone(),
        limit: MAX_DEPTH,
        line: deep.line,
        column: deep.column,
    })?;
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value = StrictValue::root()
            .deserialize(doc)
            .map_err(|e| parse_err(e.to_string()))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    match docs.len() {
        0 => Err(InputError::Empty(source.clone())),
        1 => Ok(docs.remove(0)),
        _ => Err(InputError::Several(source.clone())),
    }
}

/// Parses a JSON document into a generic value as strictly as [`parse_one`]: no key twice in
/// one mapping, nothing nested deeper than [`MAX_DEPTH`].
///
/// # Errors
/// The parser's message (line and column included).
pub fn parse_json_strict(bytes: &[u8]) -> Result<Value, serde_json::Error> {
    let mut de = serde_json::Deserializer::from_slice(bytes);
    let value = StrictValue::root().deserialize(&mut de)?;
    de.end()?;
    Ok(value)
}

/// Builds a [`Value`] like `serde_json::Value`'s own deserialiser, but refuses a key that
/// repeats in one mapping (which would otherwise silently keep the last one) and nesting deeper
/// than [`MAX_DEPTH`]. Errors name the path of the offending node.
#[derive(Debug, Clone)]
struct StrictValue {
    path: String,
    depth: usize,
}

impl StrictValue {
    fn root() -> Self {
        Self {
            path: String::new(),
            depth: 0,
        }
    }

    fn child(&self, step: &str) -> Self {
        let path = if self.path.is_empty() || step.starts_with('[') {
            format!("{}{step}", self.path)
        } else {
            format!("{}.{step}", self.path)
        };
        Self {
            path,
            depth: self.depth + 1,
        }
    }

    fn at(&self) -> &str {
        if self.path.is_empty() {
            "the top level"
        } else {
            &self.path
        }
    }

    fn enter<E: serde::de::Error>(&self) -> Result<(), E> {
        if self.depth >= MAX_DEPTH {
            return Err(E::custom(format_args!(
                "{} nests deeper than {MAX_DEPTH} levels, the deepest nesting accepted",
                self.at()
            )));
        }
        Ok(())
    }
}

impl<'de> DeserializeSeed<'de> for StrictValue {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for StrictValue {
    type Value = Value;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("any YAML or JSON value")
    }

    fn visit_bool<E>(self, v: bool) -> Result<Value, E> {
        Ok(Value::Bool(v))
    }

    fn visit_i64<E>(self, v: i64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_u64<E>(self, v: u64) -> Result<Value, E> {
        Ok(Value::from(v))
    }

    fn visit_f64<E>(self, v: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(v).map_or(Value::Null, Value::Number))
    }

    fn visit_str<E>(self, v: &str) -> Result<Value, E> {
        Ok(Value::String(v.to_owned()))
    }

    fn visit_string<E>(self, v: String) -> Result<Value, E> {
        Ok(Value::String(v))
    }

    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }

    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        self.enter()?;
        let mut items = Vec::new();
        while let Some(item) = seq.next_element_seed(self.child(&format!("[{}]", items.len())))? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        self.enter()?;
        let mut fields = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            if fields.contains_key(&key) {
                return Err(serde::de::Error::custom(format_args!(
                    "duplicate key {key:?} in {}",
                    self.at()
                )));
            }
            let value = map.next_value_seed(self.child(&key))?;
            fields.insert(key, value);
        }
        Ok(Value::Object(fields))
    }
}

/// Converts a generic value into a typed object, refusing a field the type does not have (as
/// the API server does with strict field validation, kubectl's default).
///
/// # Errors
/// [`InputError::Parse`] with the deserialiser's message (it names the field);
/// [`InputError::UnknownField`] naming the first unknown field's path.
pub fn typed<T: DeserializeOwned + Serialize>(
    source: &Source,
    what: &'static str,
    value: Value,
) -> Result<T, InputError> {
    let parse_err = |e: serde_json::Error| InputError::Parse {
        source_name: source.clone(),
        what,
        message: e.to_string(),
    };
    let typed: T = serde_json::from_value(value.clone()).map_err(parse_err)?;
    let known = serde_json::to_value(&typed).map_err(parse_err)?;
    if let Some(path) = crate::strict::first_unknown(&value, &known, "", true) {
        return Err(InputError::UnknownField {
            source_name: source.clone(),
            what,
            path,
        });
    }
    Ok(typed)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    #[test]
    fn yaml_and_json_documents_parse_alike() {
        let src = Source::Stdin;
        let a = parse_one(&src, "model: m\nbackendFramework: b\n").unwrap();
        let b = parse_one(&src, r#"{"model":"m","backendFramework":"b"}"#).unwrap();
        assert_eq!(a, b);
    }

    #[test]
    fn empty_several_and_broken_inputs_are_named() {
        let src = Source::File("id.yaml".into());
        assert_eq!(
            parse_one(&src, "").unwrap_err().to_string(),
            "id.yaml is empty: expected one YAML or JSON document"
        );
        assert!(parse_one(&src, "---\n# only a comment\n").is_err());
        let err = parse_one(&src, "a: 1\n---\nb: 2\n").unwrap_err();
        assert!(matches!(err, InputError::Several(_)));
        let err = parse_one(&src, "a: [1, 2\n").unwrap_err().to_string();
        assert!(
            err.starts_with("id.yaml is not a valid YAML or JSON document"),
            "{err}"
        );
    }

    #[test]
    fn dash_means_standard_input() {
        assert_eq!(Source::from_arg(Some(Path::new("-"))), Source::Stdin);
        assert_eq!(Source::from_arg(None), Source::Stdin);
        assert_eq!(
            Source::from_arg(Some(Path::new("x.yaml"))),
            Source::File("x.yaml".into())
        );
    }

    /// `{a: {a: … 1 …}}`, `levels` deep, on one line.
    fn nested_flow_mappings(levels: usize) -> String {
        format!("{}1{}\n", "{a: ".repeat(levels), "}".repeat(levels))
    }

    /// A flat mapping of about `bytes` bytes.
    fn flat_mapping(bytes: usize) -> String {
        let mut text = String::new();
        let mut i = 0;
        while text.len() < bytes {
            text.push_str(&format!("key{i}: value{i}\n"));
            i += 1;
        }
        text
    }

    #[test]
    fn nesting_up_to_the_limit_parses() {
        let src = Source::Stdin;
        let value = parse_one(&src, &nested_flow_mappings(MAX_DEPTH)).unwrap();
        let mut depth = 0;
        let mut node = &value;
        while let Some(inner) = node.get("a") {
            depth += 1;
            node = inner;
        }
        assert_eq!(depth, MAX_DEPTH);
    }

    // A 192 KB document of nested flow mappings took 8.5 s in libyaml (time quadratic in the
    // nesting); the depth check stops at the first node past the limit.
    #[test]
    fn deep_nesting_is_refused_at_the_limit_and_cheaply() {
        let src = Source::File("deep.yaml".into());
        let deep = nested_flow_mappings(192 * 1024 / 4);
        let flat = flat_mapping(deep.len());
        let started = std::time::Instant::now();
        let err = parse_one(&src, &deep).unwrap_err();
        let deep_took = started.elapsed();
        // Refused at the first mapping past the limit: 4 bytes per level on line 1.
        assert!(
            matches!(
                err,
                InputError::TooDeep { limit: MAX_DEPTH, line: 1, column, .. }
                    if column == 4 * MAX_DEPTH as u64 + 1
            ),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            format!(
                "deep.yaml nests deeper than {MAX_DEPTH} levels (at line 1 column {}): the deepest nesting accepted is {MAX_DEPTH}",
                4 * MAX_DEPTH + 1
            )
        );
        let started = std::time::Instant::now();
        parse_one(&src, &flat).unwrap();
        let flat_took = started.elapsed();
        assert!(
            deep_took < flat_took * 4,
            "refusing {} deeply nested bytes took {deep_took:?}, parsing as many flat bytes {flat_took:?}",
            deep.len()
        );
    }

    #[test]
    fn deep_json_is_refused_too() {
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        let err = parse_one(&Source::Stdin, &deep).unwrap_err();
        assert!(
            matches!(err, InputError::TooDeep { column: 65, .. }),
            "{err:?}"
        );
        let err = parse_json_strict(deep.as_bytes()).unwrap_err().to_string();
        assert!(err.contains("nests deeper than 64 levels"), "{err}");
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse_json_strict(ok.as_bytes()).is_ok());
    }

    #[test]
    fn input_past_the_size_limit_is_refused_unread() {
        // Standard input is read up to one byte past the limit, not to its end.
        let mut endless = std::io::repeat(b' ');
        let err = read_text(&Source::Stdin, &mut endless).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "standard input is larger than {MAX_DOCUMENT_BYTES} bytes, the largest document accepted"
            )
        );
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.yaml");
        std::fs::write(&big, vec![b' '; MAX_DOCUMENT_BYTES + 1]).unwrap();
        let src = Source::File(big.clone());
        assert!(matches!(
            read_text(&src, &mut std::io::empty()),
            Err(InputError::TooLarge { .. })
        ));
        std::fs::write(&big, vec![b' '; MAX_DOCUMENT_BYTES]).unwrap();
        assert_eq!(
            read_text(&src, &mut std::io::empty()).unwrap().len(),
            MAX_DOCUMENT_BYTES
        );
    }

    #[test]
    fn invalid_utf8_is_bad_input_naming_the_byte() {
        let err = read_text(&Source::Stdin, &mut &b"kind: Pod\nname: \xff\n"[..]).unwrap_err();
        assert_eq!(
            err.to_string(),
            "standard input is not UTF-8 text: an invalid byte sequence at byte 16"
        );
        let err = read_text(&Source::Stdin, &mut &b"\xff\xfek\0i\0"[..]).unwrap_err();
        assert!(err.to_string().contains("UTF-16 byte order mark"), "{err}");
    }

    #[test]
    fn a_utf8_byte_order_mark_is_skipped() {
        let text = read_text(&Source::Stdin, &mut &b"\xef\xbb\xbfkind: Pod\n"[..]).unwrap();
        assert_eq!(text, "kind: Pod\n");
        let value = parse_one(&Source::Stdin, &text).unwrap();
        assert_eq!(value, serde_json::json!({"kind": "Pod"}));
    }

    #[test]
    fn a_key_given_twice_is_refused_with_its_path() {
        let src = Source::File("pod.yaml".into());
        let err = parse_one(&src, "kind: Pod\nkind: Job\n")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("duplicate key \"kind\" in the top level"),
            "{err}"
        );
        let yaml = "spec:\n  containers:\n  - name: main\n    image: a\n    image: b\n";
        let err = parse_one(&src, yaml).unwrap_err().to_string();
        assert!(
            err.contains("duplicate key \"image\" in spec.containers[0]"),
            "{err}"
        );
        let err = parse_one(&src, r#"{"spec": {"a": 1, "a": 2}}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("duplicate key \"a\" in spec"), "{err}");
        let err = parse_json_strict(br#"{"a": 1, "a": 1}"#)
            .unwrap_err()
            .to_string();
        assert!(err.contains("duplicate key \"a\""), "{err}");
        // The same key in two mappings is fine.
        assert!(parse_one(&src, "a: {k: 1}\nb: {k: 1}\n").is_ok());
    }

    #[test]
    fn unknown_fields_are_refused_with_their_path() {
        let src = Source::File("pod.yaml".into());
        let value = parse_one(
            &src,
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec:\n  containers:\n  - name: main\n    imagee: vllm\n",
        )
        .unwrap();
        let err = typed::<k8s_openapi::api::core::v1::Pod>(&src, "Pod", value).unwrap_err();
        assert_eq!(
            err.to_string(),
            "pod.yaml is not a valid Pod: unknown field spec.containers[0].imagee"
        );
        let value = parse_one(
            &src,
            "apiVersion: v1\nkind: Pod\nmetadata: {name: p, labels: {}}\nspec:\n  containers:\n  - name: main\n    image: vllm\n    args: []\n",
        )
        .unwrap();
        assert!(typed::<k8s_openapi::api::core::v1::Pod>(&src, "Pod", value).is_ok());
    }

    #[test]
    fn unreadable_files_name_the_path() {
        let src = Source::File("/nonexistent/warmstart.yaml".into());
        let err = read_text(&src, &mut std::io::empty()).unwrap_err();
        assert_eq!(err.to_string(), "cannot read /nonexistent/warmstart.yaml");
    }
}
