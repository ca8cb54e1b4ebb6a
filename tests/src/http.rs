//! A minimal blocking HTTP/1.1 client for the management API tests: one
//! request per connection (`Connection: close`), JSON bodies, Basic auth.
//! Hand-written on purpose: a client crate would add a second HTTP stack
//! (or new hyper features, rebuilding the broker's) to the test build for a
//! few dozen requests to 127.0.0.1.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

/// An answer.
#[derive(Debug, Clone)]
pub struct Resp {
    /// Status code.
    pub status: u16,
    /// Headers, names lowercased.
    pub headers: Vec<(String, String)>,
    /// Body text.
    pub text: String,
}

impl Resp {
    /// The body as JSON (panics if it is not).
    #[track_caller]
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.text)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {:?} (status {})", self.text, self.status))
    }

    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A client of one broker's HTTP listener, as one user.
#[derive(Clone)]
pub struct Http {
    port: u16,
    auth: Option<(String, String)>,
}

fn b64(s: &str) -> String {
    const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for c in b.chunks(3) {
        let n = (u32::from(c[0]) << 16)
            | (u32::from(*c.get(1).unwrap_or(&0)) << 8)
            | u32::from(*c.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= c.len() {
                out.push(T[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

impl Http {
    /// As `user`/`pass` on `port`.
    pub fn new(port: u16, user: &str, pass: &str) -> Http {
        Http {
            port,
            auth: Some((user.into(), pass.into())),
        }
    }

    /// Without credentials.
    pub fn anonymous(port: u16) -> Http {
        Http { port, auth: None }
    }

    /// As another user on the same broker.
    pub fn as_user(&self, user: &str, pass: &str) -> Http {
        Http::new(self.port, user, pass)
    }

    /// One request; `body` is sent as JSON.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        extra: &[(&str, &str)],
    ) -> Resp {
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        self.send(method, path, &body, extra)
    }

    /// One request with a raw body.
    pub fn send(&self, method: &str, path: &str, body: &str, extra: &[(&str, &str)]) -> Resp {
        let mut s =
            TcpStream::connect(("127.0.0.1", self.port)).expect("connect to the HTTP listener");
        s.set_read_timeout(Some(Duration::from_secs(60))).ok();
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n",
            body.len()
        );
        if !body.is_empty() {
            req.push_str("Content-Type: application/json\r\n");
        }
        if let Some((u, p)) = &self.auth {
            req.push_str(&format!(
                "Authorization: Basic {}\r\n",
                b64(&format!("{u}:{p}"))
            ));
        }
        for (k, v) in extra {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        req.push_str(body);
        s.write_all(req.as_bytes()).expect("send request");
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).expect("read response");
        let text = String::from_utf8_lossy(&raw).to_string();
        let (head, rest) = text.split_once("\r\n\r\n").expect("HTTP head");
        let mut lines = head.lines();
        let status: u16 = lines
            .next()
            .and_then(|l| l.split(' ').nth(1))
            .and_then(|c| c.parse().ok())
            .expect("status line");
        let headers: Vec<(String, String)> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_lowercase(), v.trim().to_string()))
            .collect();
        let chunked = headers
            .iter()
            .any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
        let text = if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        };
        Resp {
            status,
            headers,
            text,
        }
    }

    /// GET.
    pub fn get(&self, path: &str) -> Resp {
        self.request("GET", path, None, &[])
    }

    /// GET, expecting 200 and JSON.
    #[track_caller]
    pub fn get_json(&self, path: &str) -> serde_json::Value {
        let r = self.get(path);
        assert_eq!(r.status, 200, "GET {path}: {}", r.text);
        r.json()
    }

    /// PUT with a JSON body.
    pub fn put(&self, path: &str, body: serde_json::Value) -> Resp {
        self.request("PUT", path, Some(&body), &[])
    }

    /// POST with a JSON body.
    pub fn post(&self, path: &str, body: serde_json::Value) -> Resp {
        self.request("POST", path, Some(&body), &[])
    }

    /// DELETE.
    pub fn delete(&self, path: &str) -> Resp {
        self.request("DELETE", path, None, &[])
    }
}

fn dechunk(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    while let Some((len, after)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 || after.len() < n {
            break;
        }
        out.push_str(&after[..n]);
        rest = after[n..].trim_start_matches("\r\n");
    }
    out
}
