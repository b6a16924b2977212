//! Where the artifact store is and how to reach it: the settings (command line or environment),
//! their validation, and the credentials read from files (a mounted Secret), which never appear
//! in `Debug` output, logs or errors.

use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use thiserror::Error;
use url::Url;
use warmstart_shared::artifact::validate_path_element;

/// The smallest part S3 accepts (every part of a multipart upload but the last).
pub const MIN_PART_SIZE: u64 = 5 << 20;
/// The largest part S3 accepts.
pub const MAX_PART_SIZE: u64 = 5 << 30;
/// Most parallel requests per transfer.
pub const MAX_CONCURRENCY: usize = 256;
/// Largest credential file read (a key id or secret is tens of bytes).
const MAX_SECRET_FILE: u64 = 4096;

/// A setting that cannot be used.
#[derive(Debug, Error)]
pub enum ConfigError {
    /// A setting's value is refused.
    #[error("object store setting {field}: {problem}")]
    Field {
        /// The setting, as the command line names it (`--s3-bucket`).
        field: &'static str,
        /// What is wrong, with the value where it is not secret.
        problem: String,
    },
    /// A credential or CA file cannot be read.
    #[error("object store setting {field}: cannot read {}: {source}", path.display())]
    ReadFile {
        /// The setting.
        field: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
}

fn field(field: &'static str, problem: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        field,
        problem: problem.into(),
    }
}

/// The object store settings as the agent and the controller take them (flatten into their
/// command line). Without `--s3-endpoint` no object store is used.
#[derive(Clone, Debug, clap::Args)]
pub struct Args {
    /// S3 endpoint URL (`https://s3.eu-west-1.amazonaws.com`, `http://minio:9000`); no object
    /// store when absent.
    #[arg(long = "s3-endpoint", env = "WARMSTART_S3_ENDPOINT")]
    pub endpoint: Option<String>,
    /// Bucket holding the artifacts (it must exist).
    #[arg(long = "s3-bucket", env = "WARMSTART_S3_BUCKET")]
    pub bucket: Option<String>,
    /// Key prefix under which artifacts are stored (`<prefix>/<namespace>/<hash>/<file>`).
    #[arg(long = "s3-prefix", env = "WARMSTART_S3_PREFIX", default_value = "")]
    pub prefix: String,
    /// Region the requests are signed for.
    #[arg(
        long = "s3-region",
        env = "WARMSTART_S3_REGION",
        default_value = "us-east-1"
    )]
    pub region: String,
    /// Path-style URLs (`<endpoint>/<bucket>/<key>`, what MinIO, Ceph and SeaweedFS serve);
    /// `false` for virtual-host style (`<bucket>.<endpoint host>/<key>`).
    #[arg(
        long = "s3-path-style",
        env = "WARMSTART_S3_PATH_STYLE",
        default_value_t = true,
        action = clap::ArgAction::Set
    )]
    pub path_style: bool,
    /// File holding the access key id (a mounted Secret's key).
    #[arg(
        long = "s3-access-key-id-file",
        env = "WARMSTART_S3_ACCESS_KEY_ID_FILE"
    )]
    pub access_key_id_file: Option<PathBuf>,
    /// File holding the secret access key (a mounted Secret's key).
    #[arg(
        long = "s3-secret-access-key-file",
        env = "WARMSTART_S3_SECRET_ACCESS_KEY_FILE"
    )]
    pub secret_access_key_file: Option<PathBuf>,
    /// PEM bundle of the CAs an https endpoint's certificate is checked against (default: the
    /// system's).
    #[arg(long = "s3-ca-file", env = "WARMSTART_S3_CA_FILE")]
    pub ca_file: Option<PathBuf>,
    /// Size of each part of a multipart upload, in bytes (5 MiB to 5 GiB); files up to this size
    /// are uploaded in one request.
    #[arg(long = "s3-part-size", env = "WARMSTART_S3_PART_SIZE", default_value_t = 16 << 20)]
    pub part_size: u64,
    /// Requests in flight at once per transfer (parts, ranged reads).
    #[arg(
        long = "s3-concurrency",
        env = "WARMSTART_S3_CONCURRENCY",
        default_value_t = 8
    )]
    pub concurrency: usize,
    /// Times a failed request is tried again (with exponential backoff) before the transfer
    /// fails.
    #[arg(long = "s3-retries", env = "WARMSTART_S3_RETRIES", default_value_t = 4)]
    pub retries: u32,
    /// Times an upload that failed for a transient cause (the server unreachable or failing)
    /// is started again, with a backoff from 5 s doubling up to 2 minutes.
    #[arg(
        long = "s3-upload-retries",
        env = "WARMSTART_S3_UPLOAD_RETRIES",
        default_value_t = 3
    )]
    pub upload_retries: u32,
    /// zstd level artifacts are compressed with when uploaded, each manifest chunk its own
    /// frame (1 to 19; 0: stored as they are). Readers take either whatever their own setting.
    #[arg(
        long = "s3-compression-level",
        env = "WARMSTART_S3_COMPRESSION_LEVEL",
        default_value_t = 0
    )]
    pub compression_level: i32,
}

impl Args {
    /// The validated settings, or `None` when no endpoint is set.
    ///
    /// # Errors
    /// [`ConfigError`] naming the first bad setting.
    pub fn config(&self) -> Result<Option<StoreConfig>, ConfigError> {
        let Some(endpoint) = &self.endpoint else {
            return Ok(None);
        };
        let required = |value: &Option<PathBuf>, name: &'static str| {
            value
                .clone()
                .ok_or_else(|| field(name, "required with --s3-endpoint"))
        };
        let config = StoreConfig {
            endpoint: endpoint
                .parse()
                .map_err(|e| field("--s3-endpoint", format!("{endpoint:?} is not a URL: {e}")))?,
            bucket: self
                .bucket
                .clone()
                .ok_or_else(|| field("--s3-bucket", "required with --s3-endpoint"))?,
            prefix: self.prefix.clone(),
            region: self.region.clone(),
            path_style: self.path_style,
            access_key_id_file: required(&self.access_key_id_file, "--s3-access-key-id-file")?,
            secret_access_key_file: required(
                &self.secret_access_key_file,
                "--s3-secret-access-key-file",
            )?,
            ca_file: self.ca_file.clone(),
            part_size: self.part_size,
            concurrency: self.concurrency,
            retries: self.retries,
            retry_backoff: Duration::from_millis(250),
            upload_retries: self.upload_retries,
            upload_retry_backoff: Duration::from_secs(5),
            request_timeout: Duration::from_secs(300),
            compression_level: self.compression_level,
        };
        config.validate()?;
        Ok(Some(config))
    }
}

/// The object store's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoreConfig {
    /// The endpoint (`http` or `https`, a host, no credentials, query or fragment).
    pub endpoint: Url,
    /// The bucket.
    pub bucket: String,
    /// Key prefix, `/`-separated safe elements (empty: the bucket's root).
    pub prefix: String,
    /// Signing region.
    pub region: String,
    /// Path-style URLs rather than virtual-host style.
    pub path_style: bool,
    /// File holding the access key id.
    pub access_key_id_file: PathBuf,
    /// File holding the secret access key.
    pub secret_access_key_file: PathBuf,
    /// PEM bundle of trusted CAs for https (default: the system's).
    pub ca_file: Option<PathBuf>,
    /// Multipart part size in bytes.
    pub part_size: u64,
    /// Requests in flight at once per transfer.
    pub concurrency: usize,
    /// Retries of a failed request.
    pub retries: u32,
    /// Wait before the first retry (doubled for each further one).
    pub retry_backoff: Duration,
    /// Times a whole upload is started again after a transient failure.
    pub upload_retries: u32,
    /// Wait before an upload is first started again (doubled for each further time).
    pub upload_retry_backoff: Duration,
    /// Longest one request (with its body) may take.
    pub request_timeout: Duration,
    /// zstd level of uploads (0: uncompressed); see [`Args::compression_level`].
    pub compression_level: i32,
}

impl StoreConfig {
    /// A configuration with the defaults of [`Args`] for everything but the place and the
    /// credentials.
    pub fn new(
        endpoint: Url,
        bucket: impl Into<String>,
        access_key_id_file: impl Into<PathBuf>,
        secret_access_key_file: impl Into<PathBuf>,
    ) -> Self {
        Self {
            endpoint,
            bucket: bucket.into(),
            prefix: String::new(),
            region: "us-east-1".into(),
            path_style: true,
            access_key_id_file: access_key_id_file.into(),
            secret_access_key_file: secret_access_key_file.into(),
            ca_file: None,
            part_size: 16 << 20,
            concurrency: 8,
            retries: 4,
            retry_backoff: Duration::from_millis(250),
            upload_retries: 3,
            upload_retry_backoff: Duration::from_secs(5),
            request_timeout: Duration::from_secs(300),
            compression_level: 0,
        }
    }

    /// Checks every setting.
    ///
    /// # Errors
    /// [`ConfigError::Field`] naming the first bad setting.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let url = &self.endpoint;
        if !matches!(url.scheme(), "http" | "https") {
            return Err(field(
                "--s3-endpoint",
                format!("{url}: the scheme must be http or https"),
            ));
        }
        if url.host_str().is_none_or(str::is_empty) {
            return Err(field("--s3-endpoint", format!("{url}: no host")));
        }
        if !url.username().is_empty() || url.password().is_some() {
            // Never echo the URL: it holds a credential.
            return Err(field(
                "--s3-endpoint",
                "the URL must not hold a user name or password: credentials come from the key files",
            ));
        }
        if url.query().is_some() || url.fragment().is_some() {
            return Err(field(
                "--s3-endpoint",
                format!("{url}: no query or fragment allowed"),
            ));
        }
        check_bucket(&self.bucket)?;
        if !self.prefix.is_empty() {
            for element in self.prefix.split('/') {
                validate_path_element("prefix element", element)
                    .map_err(|e| field("--s3-prefix", format!("{:?}: {e}", self.prefix)))?;
            }
        }
        if self.region.is_empty()
            || !self
                .region
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        {
            return Err(field(
                "--s3-region",
                format!("{:?}: lowercase letters, digits and '-' only", self.region),
            ));
        }
        if !self.path_style
            && url
                .host()
                .is_some_and(|h| !matches!(h, url::Host::Domain(_)))
        {
            return Err(field(
                "--s3-path-style",
                format!("virtual-host style needs a DNS name, {url} has an IP address"),
            ));
        }
        if !(MIN_PART_SIZE..=MAX_PART_SIZE).contains(&self.part_size) {
            return Err(field(
                "--s3-part-size",
                format!(
                    "{} bytes: S3 takes parts of {MIN_PART_SIZE} to {MAX_PART_SIZE} bytes",
                    self.part_size
                ),
            ));
        }
        if !(1..=MAX_CONCURRENCY).contains(&self.concurrency) {
            return Err(field(
                "--s3-concurrency",
                format!("{}: 1 to {MAX_CONCURRENCY}", self.concurrency),
            ));
        }
        if self.retries > 20 {
            return Err(field(
                "--s3-retries",
                format!("{}: at most 20", self.retries),
            ));
        }
        if self.upload_retries > 20 {
            return Err(field(
                "--s3-upload-retries",
                format!("{}: at most 20", self.upload_retries),
            ));
        }
        if !(0..=crate::frames::MAX_LEVEL).contains(&self.compression_level) {
            return Err(field(
                "--s3-compression-level",
                format!(
                    "{}: 0 (no compression) or a zstd level from 1 to {}",
                    self.compression_level,
                    crate::frames::MAX_LEVEL
                ),
            ));
        }
        if self.request_timeout.is_zero() {
            return Err(field("request timeout", "must be more than 0"));
        }
        Ok(())
    }

    /// `<prefix>/` (empty for no prefix): what every key of the store starts with.
    pub fn key_root(&self) -> String {
        if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        }
    }

    /// The endpoint and bucket, for messages (`http://127.0.0.1:8333 bucket artifacts`).
    pub fn describe(&self) -> String {
        format!("{} bucket {}", self.endpoint, self.bucket)
    }

    /// Reads the credentials from their files.
    ///
    /// # Errors
    /// [`ConfigError`] naming the file (never its content).
    pub fn credentials(&self) -> Result<Credentials, ConfigError> {
        Ok(Credentials {
            access_key_id: read_secret("--s3-access-key-id-file", &self.access_key_id_file)?,
            secret_access_key: read_secret(
                "--s3-secret-access-key-file",
                &self.secret_access_key_file,
            )?,
        })
    }
}

/// S3 bucket naming rules: 3 to 63 characters, lowercase letters, digits, `.` and `-`,
/// beginning and ending with a letter or digit.
fn check_bucket(bucket: &str) -> Result<(), ConfigError> {
    let ok = (3..=63).contains(&bucket.len())
        && bucket
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-')
        && bucket.starts_with(|c: char| c.is_ascii_alphanumeric())
        && bucket.ends_with(|c: char| c.is_ascii_alphanumeric());
    if ok {
        Ok(())
    } else {
        Err(field(
            "--s3-bucket",
            format!(
                "{bucket:?} is not a bucket name: 3 to 63 lowercase letters, digits, '.' or '-', beginning and ending with a letter or digit"
            ),
        ))
    }
}

/// The content of a credential file without surrounding whitespace (a Secret written with a
/// trailing newline works).
fn read_secret(name: &'static str, path: &Path) -> Result<Secret, ConfigError> {
    use std::io::Read;
    let read_error = |source| ConfigError::ReadFile {
        field: name,
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(read_error)?;
    let mut bytes = Vec::new();
    file.take(MAX_SECRET_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if bytes.len() as u64 > MAX_SECRET_FILE {
        return Err(field(
            name,
            format!("{} is larger than {MAX_SECRET_FILE} bytes", path.display()),
        ));
    }
    let text = String::from_utf8(bytes)
        .map_err(|_| field(name, format!("{} is not UTF-8 text", path.display())))?;
    let value = text.trim();
    if value.is_empty() {
        return Err(field(name, format!("{} is empty", path.display())));
    }
    if value.chars().any(char::is_control) {
        return Err(field(
            name,
            format!("{} holds more than one line", path.display()),
        ));
    }
    Ok(Secret(value.to_owned()))
}

/// A credential value: shown as `<redacted>`.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(String);

impl Secret {
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The access key id and secret access key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Credentials {
    /// The access key id (also redacted: it names an account).
    pub access_key_id: Secret,
    /// The secret access key.
    pub secret_access_key: Secret,
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser, Debug)]
    struct Cli {
        #[command(flatten)]
        s3: Args,
    }

    fn parse(args: &[&str]) -> Result<Option<StoreConfig>, ConfigError> {
        let mut all = vec!["test"];
        all.extend_from_slice(args);
        Cli::try_parse_from(all).unwrap().s3.config()
    }

    const BASE: &[&str] = &[
        "--s3-endpoint=http://127.0.0.1:9000",
        "--s3-bucket=artifacts",
        "--s3-access-key-id-file=/k",
        "--s3-secret-access-key-file=/s",
    ];

    /// The base settings with `extra` added or replacing the setting of the same name.
    fn with(extra: &str) -> Result<Option<StoreConfig>, ConfigError> {
        let name = extra.split('=').next().unwrap();
        let mut args: Vec<&str> = BASE
            .iter()
            .copied()
            .filter(|a| a.split('=').next() != Some(name))
            .collect();
        args.push(extra);
        parse(&args)
    }

    #[test]
    fn no_endpoint_is_no_store_and_a_full_set_validates() {
        assert!(parse(&[]).unwrap().is_none());
        let config = parse(BASE).unwrap().unwrap();
        assert_eq!(config.bucket, "artifacts");
        assert!(config.path_style);
        assert_eq!(config.key_root(), "");
        let config = with("--s3-prefix=team-a/warm").unwrap().unwrap();
        assert_eq!(config.key_root(), "team-a/warm/");
        assert_eq!(config.compression_level, 0, "off unless asked for");
        let config = with("--s3-compression-level=19").unwrap().unwrap();
        assert_eq!(config.compression_level, 19);
    }

    #[test]
    fn each_bad_setting_is_named() {
        for (arg, named) in [
            ("--s3-endpoint=ftp://x", "--s3-endpoint"),
            ("--s3-endpoint=not a url", "--s3-endpoint"),
            ("--s3-endpoint=http://127.0.0.1:9000/?a=b", "--s3-endpoint"),
            ("--s3-bucket=Bad_Bucket", "--s3-bucket"),
            ("--s3-bucket=ab", "--s3-bucket"),
            ("--s3-prefix=a/../b", "--s3-prefix"),
            ("--s3-prefix=/a", "--s3-prefix"),
            ("--s3-region=EU West", "--s3-region"),
            ("--s3-part-size=1024", "--s3-part-size"),
            ("--s3-concurrency=0", "--s3-concurrency"),
            ("--s3-path-style=false", "--s3-path-style"),
            ("--s3-compression-level=20", "--s3-compression-level"),
            ("--s3-compression-level=-1", "--s3-compression-level"),
        ] {
            let err = with(arg).unwrap_err();
            assert!(
                matches!(&err, ConfigError::Field { field, .. } if *field == named),
                "{arg}: {err}"
            );
        }
        let err = parse(&["--s3-endpoint=http://h:1", "--s3-bucket=abc"]).unwrap_err();
        assert!(err.to_string().contains("--s3-access-key-id-file"), "{err}");
    }

    #[test]
    fn a_password_in_the_endpoint_is_refused_without_echoing_it() {
        let err = with("--s3-endpoint=http://user:hunter2@host:9000").unwrap_err();
        assert!(!format!("{err} {err:?}").contains("hunter2"), "{err}");
        assert!(err.to_string().contains("--s3-endpoint"), "{err}");
    }

    #[test]
    fn credentials_come_from_files_and_never_show() {
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("key");
        let secret = dir.path().join("secret");
        std::fs::write(&key, "AKIDEXAMPLE\n").unwrap();
        std::fs::write(&secret, "wJalrXUtnFEMI/K7MDENG\n").unwrap();
        let mut config = StoreConfig::new(
            "http://127.0.0.1:9000".parse().unwrap(),
            "artifacts",
            &key,
            &secret,
        );
        let creds = config.credentials().unwrap();
        assert_eq!(creds.secret_access_key.expose(), "wJalrXUtnFEMI/K7MDENG");
        let shown = format!("{creds:?} {config:?}");
        assert!(
            !shown.contains("wJalr") && !shown.contains("AKIDEXAMPLE"),
            "{shown}"
        );
        std::fs::write(&secret, "\n").unwrap();
        let err = config.credentials().unwrap_err();
        assert!(err.to_string().contains("is empty"), "{err}");
        config.secret_access_key_file = dir.path().join("absent");
        let err = config.credentials().unwrap_err();
        assert!(
            err.to_string().contains("--s3-secret-access-key-file")
                && err.to_string().contains("absent"),
            "{err}"
        );
    }
}
