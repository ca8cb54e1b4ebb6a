//! TLS for the AMQPS and MQTTS listeners: rustls (ring provider), the
//! certificate files of `[tls]`, client-certificate verification, and
//! reloading the files without a restart.
//!
//! One [`Tls`] is shared by every TLS listener. It holds the current rustls
//! server configuration behind a lock that is taken once per accepted
//! connection; a reload builds a whole new configuration from the files and
//! swaps it in. New connections get the new certificate, established ones
//! keep the configuration they were accepted with (rustls holds it by
//! `Arc`). A reload that fails (a file missing or half-written, a key that
//! does not match) keeps the previous configuration and logs why.
//!
//! Reloads happen when a file's modification time changes (checked every
//! `tls.reload_interval` seconds) and on SIGHUP.

use crate::config::TlsConfig;
use parking_lot::{Mutex, RwLock};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime};
use tokio::net::TcpStream;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;

/// How long a client may take to complete the TLS handshake (RabbitMQ's
/// `ssl_handshake_timeout` is 5 s).
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A TLS connection, handshake done.
pub type TlsStream = tokio_rustls::server::TlsStream<TcpStream>;

/// Why the TLS files could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file could not be read or holds no usable PEM item.
    #[error("{what} {path}: {reason}")]
    File {
        /// Which file (`tls.cert_file`, …).
        what: &'static str,
        /// Its path.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// rustls refused the combination (a key that does not match the
    /// certificate, a CA it cannot use).
    #[error("TLS configuration: {0}")]
    Config(String),
}

/// The shared TLS acceptor state of every TLS listener.
pub struct Tls {
    files: TlsConfig,
    current: RwLock<Arc<rustls::ServerConfig>>,
    /// Modification times of the files the current configuration was
    /// built from (cert, key, CA).
    stamps: Mutex<Vec<Option<SystemTime>>>,
}

impl Tls {
    /// Reads the files of `files` and builds the first configuration; any
    /// problem is a startup error.
    pub fn load(files: &TlsConfig) -> Result<Arc<Tls>, TlsError> {
        let stamps = stamps(files);
        let config = build(files)?;
        Ok(Arc::new(Tls {
            files: files.clone(),
            current: RwLock::new(config),
            stamps: Mutex::new(stamps),
        }))
    }

    /// An acceptor with the current certificate.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.read().clone())
    }

    /// Rebuilds the configuration from the files; on failure keeps the old
    /// one. `why` is logged.
    pub fn reload(&self, why: &str) -> Result<(), TlsError> {
        // Stamps first: a file replaced while we read it is read again at
        // the next check.
        let new_stamps = stamps(&self.files);
        match build(&self.files) {
            Ok(config) => {
                *self.current.write() = config;
                *self.stamps.lock() = new_stamps;
                tracing::info!(reason = why, cert_file = %self.files.cert_file.display(), "TLS certificates reloaded");
                Ok(())
            }
            Err(e) => {
                // Not retried until a file changes again (or SIGHUP): a
                // broken file is not re-read every few seconds.
                *self.stamps.lock() = new_stamps;
                tracing::error!(reason = why, error = %e, "TLS reload failed: keeping the previous certificates");
                Err(e)
            }
        }
    }

    /// Reloads if a file's modification time changed since the last load.
    pub fn reload_if_changed(&self) {
        let now = stamps(&self.files);
        if *self.stamps.lock() != now {
            let _ = self.reload("a file changed");
        }
    }

    /// Watches the files (every `reload_interval` seconds, if not 0) and
    /// `hup` (from [`sighup`]), reloading on either. Runs until aborted.
    pub async fn watch(self: Arc<Self>, mut hup: Hangup) {
        let every = (self.files.reload_interval > 0)
            .then(|| Duration::from_secs(self.files.reload_interval));
        loop {
            let tick = async {
                match every {
                    Some(d) => tokio::time::sleep(d).await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(unix)]
            let hup_recv = async {
                match hup.as_mut() {
                    Some(s) => s.recv().await,
                    None => std::future::pending().await,
                }
            };
            #[cfg(not(unix))]
            let hup_recv = async {
                let _ = &mut hup;
                std::future::pending::<Option<()>>().await
            };
            // The checks read files: off the runtime's workers.
            let me = self.clone();
            tokio::select! {
                () = tick => {
                    let _ = tokio::task::spawn_blocking(move || me.reload_if_changed()).await;
                }
                Some(()) = hup_recv => {
                    let _ = tokio::task::spawn_blocking(move || me.reload("SIGHUP")).await;
                }
            }
        }
    }
}

/// SIGHUP, once listened for (`None` where it cannot be).
#[cfg(unix)]
pub type Hangup = Option<tokio::signal::unix::Signal>;
/// No SIGHUP on this platform.
#[cfg(not(unix))]
pub type Hangup = Option<()>;

/// Starts listening for SIGHUP. Call before the listeners open: from then
/// on SIGHUP no longer ends the process (its default action), so a reload
/// signal sent as soon as the broker accepts connections is not fatal.
pub fn sighup() -> Hangup {
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
            Ok(s) => Some(s),
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGHUP: TLS reload only by file changes");
                None
            }
        }
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Who a TLS client is, as its verified certificate says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The client presented a certificate that verified against `ca_file`.
    pub verified: bool,
    /// Its subject's first common name, if it has one in UTF-8.
    pub common_name: Option<String>,
}

/// Runs the server side of the handshake on `tcp`, bounded by
/// [`HANDSHAKE_TIMEOUT`]. A client certificate that does not verify fails
/// here (rustls sends the alert).
pub async fn accept(
    acceptor: tokio_rustls::TlsAcceptor,
    tcp: TcpStream,
) -> std::io::Result<(TlsStream, PeerIdentity)> {
    let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
        .await
        .map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")
        })??;
    let identity = match stream.get_ref().1.peer_certificates() {
        // rustls only completes a handshake with a client certificate that
        // its verifier accepted.
        Some([leaf, ..]) => PeerIdentity {
            verified: true,
            common_name: common_name(leaf),
        },
        _ => PeerIdentity::default(),
    };
    Ok((stream, identity))
}

/// The first common name of a certificate's subject; `None` for anything
/// that does not parse or has no UTF-8 CN.
pub fn common_name(der: &[u8]) -> Option<String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let cn = cert.subject().iter_common_name().next()?;
    cn.as_str().ok().map(str::to_owned)
}

fn stamps(files: &TlsConfig) -> Vec<Option<SystemTime>> {
    let mtime = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut v = vec![mtime(&files.cert_file), mtime(&files.key_file)];
    if let Some(ca) = &files.ca_file {
        v.push(mtime(ca));
    }
    v
}

fn file_err(what: &'static str, path: &Path, reason: impl ToString) -> TlsError {
    TlsError::File {
        what,
        path: path.to_path_buf(),
        reason: reason.to_string(),
    }
}

fn read_certs(what: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = std::fs::read(path).map_err(|e| file_err(what, path, e))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| file_err(what, path, e))?;
    if certs.is_empty() {
        return Err(file_err(what, path, "no PEM certificate in it"));
    }
    Ok(certs)
}

/// Builds a server configuration from the files.
fn build(files: &TlsConfig) -> Result<Arc<rustls::ServerConfig>, TlsError> {
    let certs = read_certs("tls.cert_file", &files.cert_file)?;
    let key_bytes =
        std::fs::read(&files.key_file).map_err(|e| file_err("tls.key_file", &files.key_file, e))?;
    let key = PrivateKeyDer::from_pem_slice(&key_bytes)
        .map_err(|e| file_err("tls.key_file", &files.key_file, e))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?;
    let builder = match &files.ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let mut roots = rustls::RootCertStore::empty();
            for c in read_certs("tls.ca_file", ca)? {
                roots.add(c).map_err(|e| file_err("tls.ca_file", ca, e))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if files.fail_if_no_peer_cert {
                verifier
            } else {
                verifier.allow_unauthenticated()
            };
            builder.with_client_cert_verifier(
                verifier
                    .build()
                    .map_err(|e| TlsError::Config(format!("tls.ca_file: {e}")))?,
            )
        }
    };
    let config = builder
        .with_single_cert(certs, key)
        .map_err(|e| TlsError::Config(format!("tls.cert_file and tls.key_file: {e}")))?;
    Ok(Arc::new(config))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn common_name_of_garbage_is_none() {
        assert_eq!(common_name(b""), None);
        assert_eq!(common_name(&[0x30, 0x82, 0xff, 0xff, 1, 2, 3]), None);
    }

    #[test]
    fn missing_files_are_a_clear_error() {
        let files = TlsConfig {
            cert_file: "/nonexistent/cert.pem".into(),
            key_file: "/nonexistent/key.pem".into(),
            ..TlsConfig::default()
        };
        let e = Tls::load(&files).err().map(|e| e.to_string());
        assert!(
            e.as_deref()
                .is_some_and(|e| e.starts_with("tls.cert_file /nonexistent/cert.pem")),
            "{e:?}"
        );
    }
}
