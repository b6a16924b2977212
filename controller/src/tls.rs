//! The webhook's serving certificate: read from PEM files and reloaded when they change, so a
//! rotated certificate (cert-manager's Secret volume, or [`crate::certs`] in self-signed mode)
//! is served without a restart.
//!
//! Invariants:
//! - Handshakes never touch the filesystem: they read the current key under a short lock. A
//!   background task polls the files' metadata every [`TlsSource::reload_interval`].
//! - A new pair is installed only once it parses and the key matches the certificate; a bad
//!   pair is logged and the previous one stays in service.

use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::{Duration, SystemTime};

use thiserror::Error;
use tokio::sync::watch;
use tokio_rustls::rustls;
use tokio_rustls::rustls::crypto::CryptoProvider;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::{ClientHello, ResolvesServerCert};
use tokio_rustls::rustls::sign::CertifiedKey;
use tracing::{info, warn};

/// Default directory of `tls.crt` and `tls.key`: on the Deployment's writable `/tmp` volume,
/// where self-signed mode writes them; with cert-manager, mount its Secret elsewhere and point
/// `--webhook-cert-dir` at it.
pub const DEFAULT_CERT_DIR: &str = "/tmp/warmstart-webhook-tls";
/// File name of the certificate chain in a certificate directory (as in a `kubernetes.io/tls`
/// Secret).
pub const CERT_FILE: &str = "tls.crt";
/// File name of the private key in a certificate directory.
pub const KEY_FILE: &str = "tls.key";
/// Default period of the certificate files check.
pub const DEFAULT_RELOAD_INTERVAL: Duration = Duration::from_secs(5);

/// Where the serving certificate comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsSource {
    /// PEM certificate chain, leaf first.
    pub cert_path: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key_path: PathBuf,
    /// How often the files are checked for a change.
    pub reload_interval: Duration,
}

impl TlsSource {
    /// `tls.crt` and `tls.key` in `dir`, checked every [`DEFAULT_RELOAD_INTERVAL`].
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            cert_path: dir.join(CERT_FILE),
            key_path: dir.join(KEY_FILE),
            reload_interval: DEFAULT_RELOAD_INTERVAL,
        }
    }

    /// The same, checked every `interval`.
    #[must_use]
    pub fn with_reload_interval(mut self, interval: Duration) -> Self {
        self.reload_interval = interval;
        self
    }
}

/// Why a certificate pair cannot be served.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: io::Error,
    },
    /// The certificate file holds no valid PEM certificate.
    #[error("{path} holds no PEM certificate")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// A PEM block could not be decoded.
    #[error("cannot decode the PEM in {path}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// The decoder's reason.
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    /// The key is unsupported or does not match the certificate.
    #[error("the key in {key} cannot serve the certificate in {cert}")]
    Key {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// rustls's reason.
        #[source]
        source: rustls::Error,
    },
}

/// Parses a PEM certificate chain and key into what rustls serves.
///
/// # Errors
/// [`TlsError`] when there is no certificate, a PEM block is bad, or the key is unsupported or
/// does not match the leaf. `cert_path` and `key_path` only name the sources in errors.
pub fn certified_key(
    cert_pem: &[u8],
    key_pem: &[u8],
    cert_path: &Path,
    key_path: &Path,
) -> Result<CertifiedKey, TlsError> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::Pem {
            path: cert_path.to_owned(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: cert_path.to_owned(),
        });
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::Pem {
        path: key_path.to_owned(),
        source,
    })?;
    let key_err = |source| TlsError::Key {
        cert: cert_path.to_owned(),
        key: key_path.to_owned(),
        source,
    };
    let certified = CertifiedKey::from_der(chain, key, &provider()).map_err(key_err)?;
    // `from_der` lets an unknown key/certificate consistency pass; serving a mismatched pair
    // would fail every handshake, so require a positive match.
    certified.keys_match().map_err(key_err)?;
    Ok(certified)
}

/// The crypto provider of the webhook server: ring, as everywhere in the workspace.
pub(crate) fn provider() -> CryptoProvider {
    rustls::crypto::ring::default_provider()
}

/// Identity of the two files as last seen: a rewrite changes the mtime or size, a replacement
/// (rename, Secret volume symlink swap) the inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fingerprint {
    cert: FileStamp,
    key: FileStamp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileStamp {
    modified: Option<SystemTime>,
    len: u64,
    dev: u64,
    ino: u64,
}

async fn stamp(path: &Path) -> Result<FileStamp, TlsError> {
    // `metadata` follows symlinks: a Secret volume's `..data` swap shows as a new inode.
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })?;
    Ok(FileStamp {
        modified: meta.modified().ok(),
        len: meta.len(),
        dev: meta.dev(),
        ino: meta.ino(),
    })
}

async fn fingerprint(source: &TlsSource) -> Result<Fingerprint, TlsError> {
    Ok(Fingerprint {
        cert: stamp(&source.cert_path).await?,
        key: stamp(&source.key_path).await?,
    })
}

async fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    tokio::fs::read(path)
        .await
        .map_err(|source| TlsError::Read {
            path: path.to_owned(),
            source,
        })
}

async fn load(source: &TlsSource) -> Result<CertifiedKey, TlsError> {
    let cert = read(&source.cert_path).await?;
    let key = read(&source.key_path).await?;
    certified_key(&cert, &key, &source.cert_path, &source.key_path)
}

/// What one check of the files did.
#[derive(Debug)]
pub enum ReloadOutcome {
    /// The files are as last seen.
    Unchanged,
    /// A new pair is being served.
    Reloaded,
    /// The files changed but cannot be served; the previous pair stays.
    Rejected(TlsError),
}

/// A [`ResolvesServerCert`] serving the latest good pair from a [`TlsSource`].
#[derive(Debug)]
pub struct ReloadingCertResolver {
    source: TlsSource,
    current: RwLock<Arc<CertifiedKey>>,
    seen: tokio::sync::Mutex<Option<Fingerprint>>,
}

impl ReloadingCertResolver {
    /// Loads the pair from `source`.
    ///
    /// # Errors
    /// [`TlsError`] when the files cannot be read or served: without a first pair there is
    /// nothing to serve.
    pub async fn load(source: TlsSource) -> Result<Self, TlsError> {
        let seen = fingerprint(&source).await?;
        let key = load(&source).await?;
        Ok(Self {
            source,
            current: RwLock::new(Arc::new(key)),
            seen: tokio::sync::Mutex::new(Some(seen)),
        })
    }

    /// The pair being served.
    pub fn current(&self) -> Arc<CertifiedKey> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Checks the files once and installs a changed pair if it is good.
    ///
    /// # Guarantees
    /// A pair that fails to load is reported once per change of the files, not at every check,
    /// and never replaces the pair in service.
    pub async fn reload_if_changed(&self) -> ReloadOutcome {
        let mut seen = self.seen.lock().await;
        // Fingerprint before reading: a write that lands between the two shows as another
        // change at the next check, never as a missed one.
        let now = match fingerprint(&self.source).await {
            Ok(now) => now,
            Err(err) => {
                // A file missing for a moment (being replaced) is retried at the next check;
                // report it only once.
                if seen.take().is_some() {
                    return ReloadOutcome::Rejected(err);
                }
                return ReloadOutcome::Unchanged;
            }
        };
        if *seen == Some(now) {
            return ReloadOutcome::Unchanged;
        }
        *seen = Some(now);
        match load(&self.source).await {
            Ok(key) => {
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(key);
                ReloadOutcome::Reloaded
            }
            Err(err) => ReloadOutcome::Rejected(err),
        }
    }

    /// Checks the files every [`TlsSource::reload_interval`] until `stop` turns true (or its
    /// sender is dropped), logging reloads and rejected pairs.
    pub async fn watch(self: Arc<Self>, mut stop: watch::Receiver<bool>) {
        let mut tick = tokio::time::interval(self.source.reload_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                changed = stop.changed() => {
                    if changed.is_err() || *stop.borrow() {
                        return;
                    }
                    continue;
                }
            }
            match self.reload_if_changed().await {
                ReloadOutcome::Unchanged => {}
                ReloadOutcome::Reloaded => info!(
                    tls.cert = %self.source.cert_path.display(),
                    "serving certificate reloaded"
                ),
                ReloadOutcome::Rejected(err) => warn!(
                    tls.cert = %self.source.cert_path.display(),
                    error = %crate::errors::error_chain(&err),
                    "new serving certificate rejected, still serving the previous one"
                ),
            }
        }
    }
}

impl ResolvesServerCert for ReloadingCertResolver {
    fn resolve(&self, _client_hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(name: &str) -> (String, String) {
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = rcgen::CertificateParams::new(vec![name.to_owned()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// Replaces a file the way a careful writer does (temporary file, then rename).
    fn put(path: &Path, contents: &str) {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, contents).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    fn leaf(key: &CertifiedKey) -> Vec<u8> {
        key.end_entity_cert().unwrap().to_vec()
    }

    #[test]
    fn a_key_of_another_certificate_is_refused() {
        let (cert, _) = pair("a.example");
        let (_, other_key) = pair("b.example");
        let err = certified_key(
            cert.as_bytes(),
            other_key.as_bytes(),
            Path::new("tls.crt"),
            Path::new("tls.key"),
        )
        .unwrap_err();
        assert!(matches!(err, TlsError::Key { .. }), "{err:?}");
    }

    #[test]
    fn a_file_without_certificate_is_refused() {
        let (_, key) = pair("a.example");
        let err = certified_key(
            b"not pem",
            key.as_bytes(),
            Path::new("tls.crt"),
            Path::new("tls.key"),
        )
        .unwrap_err();
        assert!(matches!(err, TlsError::NoCertificate { .. }), "{err:?}");
    }

    #[tokio::test]
    async fn changed_files_are_served_and_a_bad_pair_keeps_the_previous_one() {
        let dir = tempfile::tempdir().unwrap();
        let source = TlsSource::in_dir(dir.path());
        let (cert_a, key_a) = pair("a.example");
        put(&source.cert_path, &cert_a);
        put(&source.key_path, &key_a);
        let resolver = ReloadingCertResolver::load(source.clone()).await.unwrap();
        let first = leaf(&resolver.current());
        assert!(matches!(
            resolver.reload_if_changed().await,
            ReloadOutcome::Unchanged
        ));

        let (cert_b, key_b) = pair("b.example");
        put(&source.cert_path, &cert_b);
        put(&source.key_path, &key_b);
        assert!(matches!(
            resolver.reload_if_changed().await,
            ReloadOutcome::Reloaded
        ));
        let second = leaf(&resolver.current());
        assert_ne!(first, second);

        // Half a rotation: a new certificate next to the old key.
        let (cert_c, _) = pair("c.example");
        put(&source.cert_path, &cert_c);
        assert!(matches!(
            resolver.reload_if_changed().await,
            ReloadOutcome::Rejected(TlsError::Key { .. })
        ));
        assert_eq!(leaf(&resolver.current()), second);
        // Reported once, not at every check.
        assert!(matches!(
            resolver.reload_if_changed().await,
            ReloadOutcome::Unchanged
        ));
    }
}
