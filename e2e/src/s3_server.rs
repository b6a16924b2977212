//! A real S3 server for the tests: SeaweedFS's `weed server -s3` (built by
//! `scripts/build-seaweedfs.sh`, `make s3-build`) on loopback ports reserved by
//! [`crate::ports`] (or on another address of this machine the test owns, such as the local
//! cluster's bridge address, for pods to reach: [`S3Server::start_on`]), its data, credentials and logs in a temporary directory, one identity with
//! an access key and secret (no anonymous access) and one bucket. It can be stopped and started
//! again on the same ports and data mid-test (fault tests), and is killed and reaped by PID when
//! dropped.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use rusty_s3::{Bucket, Credentials, S3Action, UrlStyle};
use url::Url;
use warmstart_objstore::StoreConfig;

/// The access key id of the server's one identity.
pub const ACCESS_KEY: &str = "warmstart-test";
/// How long the server may take to answer S3 requests after it is started.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// Why the server cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum S3ServerError {
    /// The `weed` binary is not built.
    #[error("SeaweedFS is not built: {0} (run `make s3-build`)")]
    Binary(String),
    /// A file of the server's directory cannot be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The test CA could not issue the server's certificate.
    #[error("certificate: {0}")]
    Cert(#[from] crate::testca::CertError),
    /// No loopback port.
    #[error("reserving a port: {0}")]
    Port(#[from] crate::ports::PortError),
    /// The server exited or did not answer in time.
    #[error("SeaweedFS {problem}; last lines of its log ({log_path}):\n{log}")]
    Server {
        /// What happened.
        problem: String,
        /// The log file.
        log_path: PathBuf,
        /// The end of its log.
        log: String,
    },
}

type Result<T, E = S3ServerError> = std::result::Result<T, E>;

fn io_error(path: &Path) -> impl FnOnce(std::io::Error) -> S3ServerError + '_ {
    move |source| S3ServerError::Io {
        path: path.to_owned(),
        source,
    }
}

/// The `weed` binary: `$WARMSTART_WEED`, else what `scripts/build-seaweedfs.sh --cached-only`
/// prints (it never builds).
///
/// # Errors
/// When it is not built.
pub fn weed_binary() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os("WARMSTART_WEED") {
        return Ok(PathBuf::from(path));
    }
    let script = crate::cluster::repo().join("scripts/build-seaweedfs.sh");
    let out = Command::new("bash")
        .arg(&script)
        .arg("--cached-only")
        .stdin(Stdio::null())
        .output()
        .map_err(|e| S3ServerError::Binary(format!("bash {}: {e}", script.display())))?;
    if !out.status.success() {
        return Err(S3ServerError::Binary(
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    let path = PathBuf::from(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or_default()
            .trim(),
    );
    if path.is_file() {
        Ok(path)
    } else {
        Err(S3ServerError::Binary(format!("no {}", path.display())))
    }
}

/// The loopback ports the server listens on.
#[derive(Clone, Copy, Debug)]
struct Ports {
    s3: u16,
    s3_https: u16,
    s3_grpc: u16,
    master: u16,
    master_grpc: u16,
    volume: u16,
    volume_grpc: u16,
    filer: u16,
    filer_grpc: u16,
}

/// A running SeaweedFS with S3 on loopback.
#[derive(Debug)]
pub struct S3Server {
    weed: PathBuf,
    dir: tempfile::TempDir,
    ports: Ports,
    child: Option<Child>,
    secret: String,
    bucket: String,
    /// The one address every service of the server binds.
    host: IpAddr,
    volumes: u64,
}

/// The size of each of the server's volumes (`-master.volumeSizeLimitMB`), in MiB.
const VOLUME_MIB: u64 = 256;

impl S3Server {
    /// Starts the server, waits until S3 answers and creates the bucket `bucket`.
    ///
    /// # Errors
    /// When `weed` is not built, or the server does not start (with its log).
    pub fn start(bucket: &str) -> Result<Self> {
        Self::start_on(bucket, IpAddr::V4(Ipv4Addr::LOCALHOST))
    }

    /// [`S3Server::start`], with every service bound to `host` alone (an address of this
    /// machine: loopback, or one on an interface the test created), its certificate issued for
    /// it.
    ///
    /// # Errors
    /// As [`S3Server::start`].
    pub fn start_on(bucket: &str, host: IpAddr) -> Result<Self> {
        Self::start_full(bucket, host, 16 * (VOLUME_MIB << 20))
    }

    /// As [`S3Server::start`], the server holding up to `bytes` of objects (the tests' server
    /// holds 4 GiB; space a delete frees is not reused at once).
    ///
    /// # Errors
    /// When `weed` is not built, or the server does not start (with its log).
    pub fn start_with_capacity(bucket: &str, bytes: u64) -> Result<Self> {
        Self::start_full(bucket, IpAddr::V4(Ipv4Addr::LOCALHOST), bytes)
    }

    fn start_full(bucket: &str, host: IpAddr, bytes: u64) -> Result<Self> {
        let weed = weed_binary()?;
        let dir = tempfile::Builder::new()
            .prefix("warmstart-s3-")
            .tempdir()
            .map_err(io_error(Path::new("/tmp")))?;
        let reserve = crate::ports::reserve;
        let ports = Ports {
            s3: reserve()?,
            s3_https: reserve()?,
            s3_grpc: reserve()?,
            master: reserve()?,
            master_grpc: reserve()?,
            volume: reserve()?,
            volume_grpc: reserve()?,
            filer: reserve()?,
            filer_grpc: reserve()?,
        };
        let secret = format!(
            "secret-{:016x}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
                ^ u128::from(std::process::id())
        );
        let mut server = Self {
            weed,
            dir,
            ports,
            child: None,
            secret,
            bucket: bucket.to_owned(),
            host,
            volumes: bytes.div_ceil(VOLUME_MIB << 20).max(16),
        };
        server.write_files()?;
        server.spawn()?;
        server.wait_ready(|s| {
            let (status, body) = s.request(
                "PUT",
                s.bucket_url(bucket)?
                    .create_bucket(&s.credentials())
                    .sign(Duration::from_secs(600)),
                &[],
                &[],
            )?;
            Ok(status == 200 || (status == 409 && body.contains("BucketAlreadyOwnedByYou")))
        })?;
        Ok(server)
    }

    fn write_files(&self) -> Result<()> {
        let ca = crate::testca::TestCa::new()?;
        let serving = ca.issue(&[&self.host.to_string()])?;
        for sub in ["data", "logs"] {
            let path = self.dir.path().join(sub);
            std::fs::create_dir_all(&path).map_err(io_error(&path))?;
        }
        let identities = serde_json::json!({
            "identities": [{
                "name": "warmstart",
                "credentials": [{"accessKey": ACCESS_KEY, "secretKey": self.secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }]
        });
        for (name, content) in [
            ("s3.json", identities.to_string()),
            ("access-key-id", format!("{ACCESS_KEY}\n")),
            ("secret-access-key", format!("{}\n", self.secret)),
            ("wrong-secret-access-key", "not-the-secret\n".to_owned()),
            ("ca.pem", ca.cert_pem()),
            ("tls.crt", serving.cert_pem),
            ("tls.key", serving.key_pem),
        ] {
            let path = self.dir.path().join(name);
            std::fs::write(&path, content).map_err(io_error(&path))?;
        }
        Ok(())
    }

    fn log_path(&self) -> PathBuf {
        self.dir.path().join("logs/weed.log")
    }

    fn spawn(&mut self) -> Result<()> {
        self.remove_sockets();
        let p = self.ports;
        let dir = self.dir.path();
        let log_path = self.log_path();
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&log_path)
            .map_err(io_error(&log_path))?;
        let err = log.try_clone().map_err(io_error(&log_path))?;
        let mut command = Command::new(&self.weed);
        command
            .arg("-logtostderr")
            .arg("server")
            .arg(format!("-ip={}", self.host))
            .arg(format!("-ip.bind={}", self.host))
            .arg(format!("-dir={}", dir.join("data").display()))
            .arg(format!("-master.port={}", p.master))
            .arg(format!("-master.port.grpc={}", p.master_grpc))
            .arg("-master.telemetry=false")
            .arg(format!("-master.volumeSizeLimitMB={VOLUME_MIB}"))
            .arg(format!("-volume.port={}", p.volume))
            .arg(format!("-volume.port.grpc={}", p.volume_grpc))
            .arg(format!("-volume.max={}", self.volumes))
            .arg("-volume.preStopSeconds=0")
            .arg("-filer")
            .arg(format!("-filer.port={}", p.filer))
            .arg(format!("-filer.port.grpc={}", p.filer_grpc))
            .arg(format!(
                "-filer.localSocket={}",
                dir.join("filer.sock").display()
            ))
            .arg("-s3")
            .arg(format!("-s3.port={}", p.s3))
            .arg(format!("-s3.port.grpc={}", p.s3_grpc))
            .arg(format!("-s3.port.https={}", p.s3_https))
            .arg(format!("-s3.cert.file={}", dir.join("tls.crt").display()))
            .arg(format!("-s3.key.file={}", dir.join("tls.key").display()))
            .arg("-s3.port.iceberg=0")
            .arg("-s3.port.lance=0")
            .arg(format!("-s3.localSocket={}", dir.join("s3.sock").display()))
            .arg(format!("-s3.config={}", dir.join("s3.json").display()))
            .arg("-s3.autoCreateBucket=false")
            .current_dir(dir);
        warmstart_agent::sys::spawn::kill_with_parent(&mut command);
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(err)
            .spawn()
            .map_err(|e| S3ServerError::Binary(format!("{}: {e}", self.weed.display())))?;
        self.child = Some(child);
        Ok(())
    }

    fn wait_ready(&mut self, ready: impl Fn(&Self) -> std::io::Result<bool>) -> Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Ok(Some(status)) = child.try_wait()
            {
                return Err(self.failed(format!("exited ({status})")));
            }
            let last = match ready(self) {
                Ok(true) => return Ok(()),
                Ok(false) => "not ready".to_owned(),
                Err(e) => e.to_string(),
            };
            if Instant::now() > deadline {
                return Err(self.failed(format!(
                    "did not answer S3 requests within {READY_TIMEOUT:?} (last: {last})"
                )));
            }
            std::thread::sleep(Duration::from_millis(250));
        }
    }

    fn failed(&self, problem: String) -> S3ServerError {
        S3ServerError::Server {
            problem,
            log_path: self.log_path(),
            log: self.log_tail(),
        }
    }

    /// The last lines of the server's log.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.log_path()).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }

    /// The S3 endpoint, `http://127.0.0.1:<port>` (or the address it was started on).
    pub fn endpoint(&self) -> Url {
        Url::parse(&format!("http://{}:{}", self.host, self.ports.s3))
            .expect("an IPv4 URL with a port parses")
    }

    /// The same S3 API over https, `https://127.0.0.1:<port>`, its certificate issued by the
    /// CA in [`S3Server::ca_file`].
    pub fn https_endpoint(&self) -> Url {
        Url::parse(&format!("https://{}:{}", self.host, self.ports.s3_https))
            .expect("an IPv4 URL with a port parses")
    }

    /// The PEM file of the CA that issued the https certificate.
    pub fn ca_file(&self) -> PathBuf {
        self.dir.path().join("ca.pem")
    }

    /// The bucket created at start.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The file holding the access key id.
    pub fn access_key_file(&self) -> PathBuf {
        self.dir.path().join("access-key-id")
    }

    /// The file holding the secret access key.
    pub fn secret_key_file(&self) -> PathBuf {
        self.dir.path().join("secret-access-key")
    }

    /// A file holding a secret the server does not know.
    pub fn wrong_secret_key_file(&self) -> PathBuf {
        self.dir.path().join("wrong-secret-access-key")
    }

    /// The secret access key itself (for checking it never shows).
    pub fn secret(&self) -> &str {
        &self.secret
    }

    /// A store configuration for the bucket, with quick retries (tests wait on failures).
    pub fn store_config(&self) -> StoreConfig {
        let mut config = StoreConfig::new(
            self.endpoint(),
            self.bucket.clone(),
            self.access_key_file(),
            self.secret_key_file(),
        );
        config.prefix = "warm".into();
        config.part_size = 5 << 20;
        config.retries = 2;
        config.retry_backoff = Duration::from_millis(100);
        config.upload_retries = 1;
        config.upload_retry_backoff = Duration::from_millis(200);
        config.request_timeout = Duration::from_secs(30);
        config
    }

    /// The server's process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL, like a crash or a lost node) and reaps it; its data stays.
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // By PID: the child is ours and not yet reaped, so the PID is still its.
            let _ = child.kill();
            let _ = child.wait();
        }
        self.remove_sockets();
    }

    /// `weed server` makes a unix socket per service at a fixed place,
    /// `/tmp/seaweedfs-<service>-grpc-<grpc port>.sock`, and a killed server leaves them: they
    /// are named by ports this process reserved, so they are this server's to remove.
    fn remove_sockets(&self) {
        for path in self.socket_paths() {
            let _ = std::fs::remove_file(path);
        }
    }

    /// The unix sockets `weed server` makes outside its directory.
    pub fn socket_paths(&self) -> Vec<PathBuf> {
        let p = self.ports;
        [
            ("master", p.master_grpc),
            ("volume", p.volume_grpc),
            ("filer", p.filer_grpc),
            ("s3", p.s3_grpc),
        ]
        .into_iter()
        .map(|(service, port)| PathBuf::from(format!("/tmp/seaweedfs-{service}-grpc-{port}.sock")))
        .collect()
    }

    /// Its directory (data, credentials, log), removed when it is dropped.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Starts the server again on the same ports and data, and waits until the bucket answers.
    ///
    /// # Errors
    /// When it does not come back (with its log).
    pub fn restart(&mut self) -> Result<()> {
        self.stop();
        self.spawn()?;
        let bucket = self.bucket.clone();
        self.wait_ready(|s| {
            let url = s
                .bucket_url(&bucket)?
                .head_bucket(Some(&s.credentials()))
                .sign(Duration::from_secs(600));
            Ok(s.request("HEAD", url, &[], &[])?.0 == 200)
        })
    }

    /// Writes `bytes` as object `key` of the bucket directly (to corrupt a stored artifact).
    ///
    /// # Errors
    /// When the server refuses it.
    pub fn put_object(&self, key: &str, bytes: &[u8]) -> std::io::Result<()> {
        let url = self
            .bucket_url(&self.bucket)?
            .put_object(Some(&self.credentials()), key)
            .sign(Duration::from_secs(600));
        let (status, body) = self.request("PUT", url, &[], bytes)?;
        if status == 200 {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "PUT {key}: HTTP {status}: {body}"
            )))
        }
    }

    /// Deletes object `key` of the bucket directly (to lose part of a stored artifact).
    ///
    /// # Errors
    /// When the server refuses it.
    pub fn delete_object(&self, key: &str) -> std::io::Result<()> {
        let bucket = self.bucket_url(&self.bucket)?;
        let credentials = self.credentials();
        let url = bucket
            .delete_object(Some(&credentials), key)
            .sign(Duration::from_secs(600));
        let (status, body) = self.request("DELETE", url, &[], &[])?;
        if status == 204 || status == 200 {
            Ok(())
        } else {
            Err(std::io::Error::other(format!(
                "DELETE {key}: HTTP {status}: {body}"
            )))
        }
    }

    /// Sends a request with a raw `Content-MD5` header (to see the server check it); the
    /// status and body.
    ///
    /// # Errors
    /// When the server cannot be reached.
    pub fn put_with_md5(
        &self,
        key: &str,
        bytes: &[u8],
        md5: &str,
    ) -> std::io::Result<(u16, String)> {
        let bucket = self.bucket_url(&self.bucket)?;
        let credentials = self.credentials();
        let mut action = bucket.put_object(Some(&credentials), key);
        action.headers_mut().insert("content-md5", md5.to_owned());
        let url = action.sign(Duration::from_secs(600));
        self.request("PUT", url, &[("Content-MD5", md5)], bytes)
    }

    /// Starts a multipart upload of `key` and sends part 1 with the `Content-MD5` `md5`; the
    /// upload id and the part's status and body. The upload is left open (for the caller to
    /// sweep or abort).
    ///
    /// # Errors
    /// When the server cannot be reached or refuses to start the upload.
    pub fn part_with_md5(
        &self,
        key: &str,
        bytes: &[u8],
        md5: &str,
    ) -> std::io::Result<(String, u16, String)> {
        let bucket = self.bucket_url(&self.bucket)?;
        let credentials = self.credentials();
        let url = bucket
            .create_multipart_upload(Some(&credentials), key)
            .sign(Duration::from_secs(600));
        let (status, body) = self.request("POST", url, &[], &[])?;
        if status != 200 {
            return Err(std::io::Error::other(format!(
                "create multipart upload of {key}: HTTP {status}: {body}"
            )));
        }
        let upload_id = rusty_s3::actions::CreateMultipartUpload::parse_response(&body)
            .map_err(std::io::Error::other)?
            .upload_id()
            .to_owned();
        let mut action = bucket.upload_part(Some(&credentials), key, 1, &upload_id);
        action.headers_mut().insert("content-md5", md5.to_owned());
        let url = action.sign(Duration::from_secs(600));
        let (status, body) = self.request("PUT", url, &[("Content-MD5", md5)], bytes)?;
        Ok((upload_id, status, body))
    }

    fn credentials(&self) -> Credentials {
        Credentials::new(ACCESS_KEY, self.secret.clone())
    }

    fn bucket_url(&self, name: &str) -> std::io::Result<Bucket> {
        Bucket::new(
            self.endpoint(),
            UrlStyle::Path,
            name.to_owned(),
            "us-east-1",
        )
        .map_err(std::io::Error::other)
    }

    /// One HTTP/1.1 request to the server (`Connection: close`); status and body text.
    fn request(
        &self,
        method: &str,
        url: Url,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> std::io::Result<(u16, String)> {
        let mut stream = TcpStream::connect((self.host, self.ports.s3))?;
        stream.set_read_timeout(Some(Duration::from_secs(20)))?;
        stream.set_write_timeout(Some(Duration::from_secs(20)))?;
        let target = match url.query() {
            Some(query) => format!("{}?{query}", url.path()),
            None => url.path().to_owned(),
        };
        let mut head = format!(
            "{method} {target} HTTP/1.1\r\nHost: {}:{}\r\nContent-Length: {}\r\nConnection: close\r\n",
            self.host,
            self.ports.s3,
            body.len()
        );
        for (name, value) in headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        stream.write_all(head.as_bytes())?;
        stream.write_all(body)?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer)?;
        let text = String::from_utf8_lossy(&answer);
        let status = text
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| std::io::Error::other(format!("not an HTTP answer: {text:.200}")))?;
        let body = text.split_once("\r\n\r\n").map(|(_, b)| b).unwrap_or("");
        Ok((status, body.to_owned()))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        self.stop();
    }
}
