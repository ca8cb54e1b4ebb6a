//! `weirctl` over `https`: against the real `weir` behind an in-process TLS
//! front (the broker's HTTP listener is plain HTTP; operators put TLS in
//! front of it), with a throwaway self-signed certificate. The certificate
//! is verified: trusted through `--cacert` it works, without it the command
//! fails on the certificate.

use std::process::{Command, Output};
use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio_rustls::rustls;
use weir_tests::*;

/// A TLS listener on 127.0.0.1 forwarding every connection to `backend`;
/// its port and the certificate's PEM. Runs on its own thread until the
/// test process exits.
fn tls_front(backend: String) -> (u16, String) {
    let cert = rcgen::generate_simple_self_signed(vec!["localhost".into(), "127.0.0.1".into()])
        .expect("self-signed certificate");
    let pem = cert.cert.pem();
    let key = rustls::pki_types::PrivateKeyDer::Pkcs8(cert.key_pair.serialize_der().into());
    let config = rustls::ServerConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .expect("protocol versions")
    .with_no_client_auth()
    .with_single_cert(vec![cert.cert.der().clone()], key)
    .expect("server config");
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let std_listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    std_listener.set_nonblocking(true).expect("nonblocking");
    let port = std_listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Runtime::new().expect("runtime");
        rt.block_on(async move {
            let listener = TcpListener::from_std(std_listener).expect("listener");
            loop {
                let Ok((sock, _)) = listener.accept().await else {
                    continue;
                };
                let (acceptor, backend) = (acceptor.clone(), backend.clone());
                tokio::spawn(async move {
                    // A client that refuses our certificate ends here.
                    let Ok(mut tls) = acceptor.accept(sock).await else {
                        return;
                    };
                    if let Ok(mut up) = TcpStream::connect(&backend).await {
                        let _ = tokio::io::copy_bidirectional(&mut tls, &mut up).await;
                    }
                });
            }
        });
    });
    (port, pem)
}

fn ctl(url: &str, cacert: Option<&std::path::Path>, args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_weirctl"));
    cmd.args(args)
        .env("WEIRCTL_URL", url)
        .env("WEIRCTL_USER", "guest")
        .env("WEIRCTL_PASSWORD", "guest")
        .env_remove("WEIRCTL_CACERT");
    if let Some(p) = cacert {
        cmd.arg("--cacert").arg(p);
    }
    cmd.output().expect("running weirctl")
}

#[test]
fn https_url_with_cacert_reaches_the_api() {
    let b = Broker::start();
    let backend = b.http_url().trim_start_matches("http://").to_string();
    let (port, pem) = tls_front(backend);
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = dir.path().join("server.pem");
    std::fs::write(&ca, pem).expect("write cert");
    let url = format!("https://localhost:{port}");

    let out = ctl(&url, Some(&ca), &["queues", "declare", "over-tls"]);
    assert!(
        out.status.success(),
        "weirctl over https failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = ctl(&url, Some(&ca), &["queues", "list", "--json"]);
    assert!(out.status.success());
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert!(
        list.as_array()
            .expect("array")
            .iter()
            .any(|q| q["name"] == "over-tls"),
        "{list}"
    );
}

#[test]
fn https_url_verifies_the_certificate() {
    let b = Broker::start();
    let backend = b.http_url().trim_start_matches("http://").to_string();
    let (port, _pem) = tls_front(backend);
    // Not trusted: the Mozilla roots do not include our self-signed certificate.
    let out = ctl(&format!("https://localhost:{port}"), None, &["status"]);
    assert!(
        !out.status.success(),
        "an untrusted certificate was accepted"
    );
    let err = String::from_utf8_lossy(&out.stderr).to_lowercase();
    assert!(
        err.contains("certificate") || err.contains("issuer"),
        "{err}"
    );
}

#[test]
fn cacert_without_a_certificate_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let empty = dir.path().join("empty.pem");
    std::fs::write(&empty, "not a pem\n").expect("write");
    let out = ctl("https://localhost:1", Some(&empty), &["status"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--cacert"));
}
