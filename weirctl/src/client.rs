//! The management API over HTTP/1 with Basic credentials: one blocking
//! request at a time, errors carrying the API's `{"error", "reason"}`.

use std::fmt;
use std::time::Duration;

use base64::Engine as _;
use serde_json::Value;
use ureq::http::Response;
use ureq::Body;

/// Why a command failed.
#[derive(Debug)]
pub enum Error {
    /// The API answered with an error status.
    Api {
        status: u16,
        error: String,
        reason: String,
    },
    /// No answer: connection refused, timeout, unreadable body.
    Transport(String),
    /// Bad arguments or local files.
    Usage(String),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Api {
                status,
                error,
                reason,
            } => write!(f, "HTTP {status} {error}: {reason}"),
            Error::Transport(e) => write!(f, "cannot reach the API: {e}"),
            Error::Usage(e) => write!(f, "{e}"),
        }
    }
}

/// Largest page asked for when listing (RabbitMQ's own maximum page size).
const PAGE_SIZE: u32 = 500;

/// A management API endpoint with credentials.
pub struct Client {
    agent: ureq::Agent,
    base: String,
    auth: String,
}

/// Percent-encodes one path segment (a vhost `/` becomes `%2F`).
pub fn seg(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

impl Client {
    /// A client of the API at `base` (e.g. `http://127.0.0.1:15672`).
    ///
    /// An `https` URL is verified against `ca` (PEM certificates: a private
    /// CA, or a self-signed server's own certificate) if given, else against
    /// the Mozilla roots; a plain `http` URL never uses TLS.
    pub fn new(base: &str, user: &str, password: &str, ca: Option<&[u8]>) -> Result<Client, Error> {
        let mut tls = ureq::tls::TlsConfig::builder().provider(ureq::tls::TlsProvider::Rustls);
        if let Some(pem) = ca {
            let mut roots = Vec::new();
            for item in ureq::tls::parse_pem(pem) {
                match item {
                    Ok(ureq::tls::PemItem::Certificate(c)) => roots.push(c),
                    Ok(_) => {}
                    Err(e) => return Err(Error::Usage(format!("--cacert: {e}"))),
                }
            }
            if roots.is_empty() {
                return Err(Error::Usage(
                    "--cacert: no PEM certificate in the file".into(),
                ));
            }
            tls = tls.root_certs(ureq::tls::RootCerts::from(roots));
        }
        let agent = ureq::Agent::config_builder()
            // Error statuses carry the reason in the body: read it ourselves.
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(60)))
            .tls_config(tls.build())
            .build()
            .into();
        let token = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"));
        Ok(Client {
            agent,
            base: base.trim_end_matches('/').to_string(),
            auth: format!("Basic {token}"),
        })
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// `GET path` as JSON.
    pub fn get(&self, path: &str) -> Result<Value, Error> {
        let r = self
            .agent
            .get(self.url(path))
            .header("Authorization", &self.auth)
            .call();
        answer(r)
    }

    /// `GET path`, where an error status is an answer too (health checks
    /// answer 503 with the failing alarms).
    pub fn get_allowing_failure(&self, path: &str) -> Result<Value, Error> {
        match self.get(path) {
            Err(Error::Api {
                status: 503,
                error,
                reason,
            }) => Ok(serde_json::json!({"status": "failed", "error": error, "reason": reason})),
            r => r,
        }
    }

    /// Every item of a list: follows pages when the API pages (`{items,
    /// page_count}`), takes a plain array as it is.
    pub fn get_all(&self, path: &str) -> Result<Vec<Value>, Error> {
        let mut all = Vec::new();
        let mut page = 1u64;
        loop {
            let sep = if path.contains('?') { '&' } else { '?' };
            let body = self.get(&format!("{path}{sep}page={page}&page_size={PAGE_SIZE}"))?;
            match body {
                Value::Array(items) => return Ok(items),
                Value::Object(mut o) => {
                    if let Some(Value::Array(items)) = o.remove("items") {
                        all.extend(items);
                    }
                    let pages = o.get("page_count").and_then(Value::as_u64).unwrap_or(1);
                    if page >= pages {
                        return Ok(all);
                    }
                    page += 1;
                }
                other => {
                    return Err(Error::Transport(format!(
                        "unexpected answer to {path}: {other}"
                    )))
                }
            }
        }
    }

    /// `PUT path` with a JSON body.
    pub fn put(&self, path: &str, body: &Value) -> Result<Value, Error> {
        let r = self
            .agent
            .put(self.url(path))
            .header("Authorization", &self.auth)
            .send_json(body);
        answer(r)
    }

    /// `POST path` with a JSON body.
    pub fn post(&self, path: &str, body: &Value) -> Result<Value, Error> {
        let r = self
            .agent
            .post(self.url(path))
            .header("Authorization", &self.auth)
            .send_json(body);
        answer(r)
    }

    /// `DELETE path`.
    pub fn delete(&self, path: &str) -> Result<Value, Error> {
        let r = self
            .agent
            .delete(self.url(path))
            .header("Authorization", &self.auth)
            .call();
        answer(r)
    }
}

/// The JSON of a success (`null` when empty), or the API's error.
fn answer(r: Result<Response<Body>, ureq::Error>) -> Result<Value, Error> {
    let mut resp = r.map_err(|e| Error::Transport(e.to_string()))?;
    let status = resp.status().as_u16();
    let text = resp
        .body_mut()
        .read_to_string()
        .map_err(|e| Error::Transport(e.to_string()))?;
    let body: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    if status >= 400 {
        let field = |k: &str| body.get(k).and_then(Value::as_str).map(str::to_string);
        return Err(Error::Api {
            status,
            error: field("error").unwrap_or_else(|| {
                resp.status()
                    .canonical_reason()
                    .unwrap_or("error")
                    .to_lowercase()
            }),
            reason: field("reason").unwrap_or_else(|| match &body {
                Value::String(s) => s.clone(),
                _ => String::new(),
            }),
        });
    }
    Ok(body)
}
