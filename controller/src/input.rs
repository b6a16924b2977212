//! Reading user documents (YAML or JSON, from a file or standard input) into typed objects,
//! with errors that name the source and the problem.

use std::io::Read;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use thiserror::Error;

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

/// Reads the whole input as text.
///
/// # Errors
/// [`InputError::Read`].
pub fn read_text(source: &Source, stdin: &mut dyn Read) -> Result<String, InputError> {
    let mut text = String::new();
    let result = match source {
        Source::Stdin => stdin.read_to_string(&mut text).map(|_| ()),
        Source::File(path) => std::fs::read_to_string(path).map(|t| text = t),
    };
    result.map_err(|e| InputError::Read {
        source_name: source.clone(),
        source: e,
    })?;
    Ok(text)
}

/// Parses exactly one YAML (or JSON, which is YAML) document into a generic value.
///
/// # Errors
/// [`InputError::Empty`], [`InputError::Several`] or [`InputError::Parse`].
pub fn parse_one(source: &Source, text: &str) -> Result<serde_json::Value, InputError> {
    let parse_err = |message: String| InputError::Parse {
        source_name: source.clone(),
        what: "YAML or JSON document",
        message,
    };
    let mut docs = Vec::new();
    for doc in serde_norway::Deserializer::from_str(text) {
        let value: serde_json::Value =
            serde::Deserialize::deserialize(doc).map_err(|e| parse_err(e.to_string()))?;
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

/// Converts a generic value into a typed object.
///
/// # Errors
/// [`InputError::Parse`] with the deserialiser's message (it names the field).
pub fn typed<T: DeserializeOwned>(
    source: &Source,
    what: &'static str,
    value: serde_json::Value,
) -> Result<T, InputError> {
    serde_json::from_value(value).map_err(|e| InputError::Parse {
        source_name: source.clone(),
        what,
        message: e.to_string(),
    })
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

    #[test]
    fn unreadable_files_name_the_path() {
        let src = Source::File("/nonexistent/warmstart.yaml".into());
        let err = read_text(&src, &mut std::io::empty()).unwrap_err();
        assert_eq!(err.to_string(), "cannot read /nonexistent/warmstart.yaml");
    }
}
