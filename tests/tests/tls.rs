//! TLS on the real binary: AMQPS with lapin (rustls) against certificates
//! this test makes with rcgen (a test CA, a server certificate for
//! `localhost`/127.0.0.1, client certificates), SASL EXTERNAL by client
//! certificate, an untrusted client certificate refused in the handshake,
//! certificate reload (SIGHUP and file change) seen by new connections
//! while established ones keep working, MQTTS certificate login
//! (`mqtt.ssl_cert_login`), and unusable TLS files refusing to start.

use lapin::options::*;
use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection, ConnectionProperties};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use weir_tests::*;

/// A certificate authority made for one test.
struct Ca {
    cert: rcgen::Certificate,
    key: KeyPair,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let key = KeyPair::generate().unwrap();
        let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
        p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        p.distinguished_name.push(DnType::CommonName, name);
        p.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = p.self_signed(&key).unwrap();
        Ca { cert, key }
    }

    fn pem(&self) -> String {
        self.cert.pem()
    }

    /// A leaf certificate and its key (PEM): a server certificate for
    /// localhost and 127.0.0.1, or a client certificate with subject CN `cn`.
    fn issue(&self, cn: &str, server: bool) -> (String, String) {
        let key = KeyPair::generate().unwrap();
        let sans = if server {
            vec!["localhost".to_string(), "127.0.0.1".to_string()]
        } else {
            Vec::new()
        };
        let mut p = CertificateParams::new(sans).unwrap();
        p.distinguished_name.push(DnType::CommonName, cn);
        p.extended_key_usages = vec![if server {
            ExtendedKeyUsagePurpose::ServerAuth
        } else {
            ExtendedKeyUsagePurpose::ClientAuth
        }];
        let cert = p.signed_by(&key, &self.cert, &self.key).unwrap();
        (cert.pem(), key.serialize_pem())
    }
}

/// A broker with `[tls]` (server certificate from `ca`, clients' CA
/// `client_ca`), users `alice` and `guest`, AMQPS and MQTTS on free ports.
struct TlsBroker {
    broker: Broker,
    amqps: u16,
    mqtts: u16,
    dir: tempfile::TempDir,
}

impl TlsBroker {
    fn start(ca: &Ca, client_ca: &Ca, extra_tls: &str, extra_mqtt: &str) -> TlsBroker {
        let dir = tempfile::tempdir().unwrap();
        let (cert, key) = ca.issue("localhost", true);
        write_pair(dir.path(), &cert, &key);
        std::fs::write(dir.path().join("clients-ca.pem"), client_ca.pem()).unwrap();
        let config = dir.path().join("weir.toml");
        std::fs::write(
            &config,
            format!(
                "[tls]\n\
                 cert_file = {:?}\n\
                 key_file = {:?}\n\
                 ca_file = {:?}\n\
                 {extra_tls}\n\
                 [mqtt]\n\
                 {extra_mqtt}\n\
                 [[auth.users]]\n\
                 name = \"alice\"\n\
                 password = \"not-used-by-certificate-logins\"\n",
                dir.path().join("server.pem"),
                dir.path().join("server.key"),
                dir.path().join("clients-ca.pem"),
            ),
        )
        .unwrap();
        // Port 0: the broker picks its ports and logs them (see
        // `Broker::listener_port`).
        let broker = Broker::start_with(&[
            "--config",
            config.to_str().unwrap(),
            "--amqps-listen",
            "127.0.0.1:0",
            "--mqtts-listen",
            "127.0.0.1:0",
            "--mqtt-wss-listen",
            "127.0.0.1:0",
        ]);
        let (amqps, mqtts) = (broker.listener_port("AMQPS"), broker.listener_port("MQTTS"));
        TlsBroker {
            broker,
            amqps,
            mqtts,
            dir,
        }
    }

    fn amqps_url(&self, query: &str) -> String {
        format!("amqps://guest:guest@localhost:{}/%2f{query}", self.amqps)
    }

    /// Replaces the server certificate and key with new ones from `ca`.
    fn replace_server_cert(&self, ca: &Ca) {
        let (cert, key) = ca.issue("localhost", true);
        write_pair(self.dir.path(), &cert, &key);
    }
}

/// Writes server.pem and server.key whole (a temporary file renamed over
/// each), so a reload never sees half a file.
fn write_pair(dir: &Path, cert: &str, key: &str) {
    for (name, text) in [("server.key", key), ("server.pem", cert)] {
        let tmp: PathBuf = dir.join(format!("{name}.tmp"));
        std::fs::write(&tmp, text).unwrap();
        std::fs::rename(&tmp, dir.join(name)).unwrap();
    }
}

/// lapin's TLS settings: trust `ca`, optionally present a client certificate.
fn tls_config(ca: &Ca, client: Option<(String, String)>) -> OwnedTLSConfig {
    OwnedTLSConfig {
        identity: client.map(|(cert, key)| OwnedIdentity::PKCS8 {
            pem: cert.into_bytes(),
            key: key.into_bytes(),
        }),
        cert_chain: Some(ca.pem()),
    }
}

async fn connect_tls(url: &str, tls: OwnedTLSConfig) -> Result<Connection, lapin::Error> {
    within(
        "TLS connect",
        Connection::connect_with_config(
            url,
            ConnectionProperties::default(),
            tls,
            lapin::runtime::default_runtime().unwrap(),
        ),
    )
    .await
}

/// Declares a queue, publishes one confirmed message and consumes it.
async fn round_trip(conn: &Connection, queue: &str) {
    let ch = confirm_channel(conn).await;
    declare_queue(&ch, queue).await;
    publish_confirmed(&ch, "", queue, b"over tls", BasicProperties::default()).await;
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let d = next_delivery(&mut consumer).await;
    assert_eq!(d.data, b"over tls");
    d.ack(BasicAckOptions::default()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqps_publish_and_consume_with_a_test_ca() {
    let ca = Ca::new("Weir test CA");
    let b = TlsBroker::start(&ca, &ca, "", "");
    let conn = connect_tls(&b.amqps_url(""), tls_config(&ca, None))
        .await
        .expect("AMQPS connection with the test CA");
    round_trip(&conn, "tls-q").await;
    // Bulk both ways: output larger than the socket and TLS buffers (the
    // TLS writer is driven by readiness like a socket: nothing may stay
    // behind in it once the client reads again).
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "tls-bulk").await;
    let big: Vec<u8> = (0..4 << 20).map(|i| (i % 251) as u8).collect();
    for _ in 0..4 {
        publish_confirmed(&ch, "", "tls-bulk", &big, BasicProperties::default()).await;
    }
    let mut consumer = ch
        .basic_consume(
            "tls-bulk".into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..4 {
        let d = next_delivery(&mut consumer).await;
        assert!(d.data == big, "body of {} bytes differs", d.data.len());
        d.ack(BasicAckOptions::default()).await.unwrap();
    }
    // The plain listener still serves plain AMQP.
    let plain = connect(&b.broker.url()).await;
    assert_eq!(queue_len(&confirm_channel(&plain).await, "tls-q").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn external_login_by_client_certificate() {
    let ca = Ca::new("Weir test CA");
    let b = TlsBroker::start(&ca, &ca, "", "");
    // No password in the URL: the certificate (CN = alice) is the login.
    let url = format!("amqps://localhost:{}/%2f?auth_mechanism=external", b.amqps);
    let conn = connect_tls(&url, tls_config(&ca, Some(ca.issue("alice", false))))
        .await
        .expect("EXTERNAL login as alice");
    round_trip(&conn, "external-q").await;

    // A verified certificate naming no user is refused like a bad login.
    let r = connect_tls(&url, tls_config(&ca, Some(ca.issue("mallory", false)))).await;
    assert_eq!(r.as_ref().err().and_then(reply_code), Some(403), "{r:?}");
    // Without a client certificate EXTERNAL is not available.
    let r = connect_tls(&url, tls_config(&ca, None)).await;
    assert!(r.is_err(), "EXTERNAL without a certificate was accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn untrusted_client_certificate_is_refused_in_the_handshake() {
    let ca = Ca::new("Weir test CA");
    let rogue = Ca::new("Rogue CA");
    let b = TlsBroker::start(&ca, &ca, "", "");
    let r = connect_tls(
        &b.amqps_url(""),
        tls_config(&ca, Some(rogue.issue("alice", false))),
    )
    .await;
    assert!(
        r.is_err(),
        "a certificate from an untrusted CA was accepted"
    );
    assert!(
        b.broker
            .wait_for_log("TLS handshake failed", Duration::from_secs(10)),
        "no handshake failure logged:\n{}",
        b.broker.run_logs()
    );
    // The same client with a trusted certificate gets in.
    connect_tls(
        &b.amqps_url(""),
        tls_config(&ca, Some(ca.issue("alice", false))),
    )
    .await
    .expect("trusted client certificate");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fail_if_no_peer_cert_refuses_clients_without_one() {
    let ca = Ca::new("Weir test CA");
    let b = TlsBroker::start(&ca, &ca, "fail_if_no_peer_cert = true", "");
    let r = connect_tls(&b.amqps_url(""), tls_config(&ca, None)).await;
    assert!(r.is_err(), "a client without a certificate was accepted");
    let conn = connect_tls(
        &b.amqps_url(""),
        tls_config(&ca, Some(ca.issue("alice", false))),
    )
    .await
    .expect("client with a certificate, password login");
    round_trip(&conn, "peer-cert-q").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_on_sighup() {
    let old_ca = Ca::new("Old CA");
    let new_ca = Ca::new("New CA");
    // Polling off: only SIGHUP reloads.
    let b = TlsBroker::start(&old_ca, &old_ca, "reload_interval = 0", "");
    let url = b.amqps_url("");
    let before = connect_tls(&url, tls_config(&old_ca, None))
        .await
        .expect("connection with the first certificate");
    assert!(
        connect_tls(&url, tls_config(&new_ca, None)).await.is_err(),
        "the new CA was trusted before the reload"
    );

    b.replace_server_cert(&new_ca);
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(b.broker.pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    assert!(
        b.broker
            .wait_for_log("TLS certificates reloaded", Duration::from_secs(15)),
        "no reload logged:\n{}",
        b.broker.run_logs()
    );
    // The new configuration is in place before the reload is logged.
    let after = connect_tls(&url, tls_config(&new_ca, None))
        .await
        .expect("the reloaded certificate is served");
    round_trip(&after, "after-reload").await;
    // The connection made before the reload keeps working.
    round_trip(&before, "before-reload").await;
    assert!(
        connect_tls(&url, tls_config(&old_ca, None)).await.is_err(),
        "the old certificate is still served"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificate_reload_when_the_files_change() {
    let old_ca = Ca::new("Old CA");
    let new_ca = Ca::new("New CA");
    let b = TlsBroker::start(&old_ca, &old_ca, "reload_interval = 1", "");
    b.replace_server_cert(&new_ca);
    assert!(
        b.broker
            .wait_for_log("TLS certificates reloaded", Duration::from_secs(15)),
        "no reload logged:\n{}",
        b.broker.run_logs()
    );
    // (A check between the two files' writes fails and is logged as such;
    // the success line comes once both are new.)
    connect_tls(&b.amqps_url(""), tls_config(&new_ca, None))
        .await
        .expect("the reloaded certificate is served");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broken_files_on_reload_keep_the_old_certificate() {
    let ca = Ca::new("Weir test CA");
    let b = TlsBroker::start(&ca, &ca, "reload_interval = 0", "");
    std::fs::write(b.dir.path().join("server.pem"), "not a certificate").unwrap();
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(b.broker.pid().unwrap() as libc::pid_t, libc::SIGHUP);
    }
    assert!(
        b.broker
            .wait_for_log("TLS reload failed", Duration::from_secs(15)),
        "no failed reload logged:\n{}",
        b.broker.run_logs()
    );
    connect_tls(&b.amqps_url(""), tls_config(&ca, None))
        .await
        .expect("the previous certificate is still served");
}

/// An MQTT 3.1.1 CONNECT (clean session, keep-alive 30 s) with optional
/// user name and password.
fn mqtt_connect(client_id: &str, user: Option<&str>, pass: Option<&str>) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4];
    let flags = 0x02 | user.map_or(0, |_| 0x80) | pass.map_or(0, |_| 0x40);
    body.extend_from_slice(&[flags, 0, 30]);
    for s in [Some(client_id), user, pass].into_iter().flatten() {
        body.extend_from_slice(&(s.len() as u16).to_be_bytes());
        body.extend_from_slice(s.as_bytes());
    }
    let mut packet = vec![0x10, body.len() as u8];
    packet.extend_from_slice(&body);
    packet
}

/// Connects to MQTTS with a client certificate, sends `connect` and
/// returns the CONNACK return code.
async fn mqtts_connack(port: u16, ca: &Ca, client: (String, String), connect: &[u8]) -> u8 {
    use tokio_rustls::rustls;
    use tokio_rustls::rustls::pki_types::pem::PemObject;
    use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(ca.pem().as_bytes()).unwrap())
        .unwrap();
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(
            vec![CertificateDer::from_pem_slice(client.0.as_bytes()).unwrap()],
            PrivateKeyDer::from_pem_slice(client.1.as_bytes()).unwrap(),
        )
        .unwrap();
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut tls = within(
        "MQTTS handshake",
        tokio_rustls::TlsConnector::from(Arc::new(config))
            .connect(ServerName::try_from("localhost").unwrap(), tcp),
    )
    .await
    .unwrap();
    tls.write_all(connect).await.unwrap();
    let mut connack = [0u8; 4];
    within("CONNACK", tls.read_exact(&mut connack))
        .await
        .unwrap();
    assert_eq!(connack[0], 0x20, "not a CONNACK: {connack:?}");
    connack[3]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtts_certificate_login() {
    let ca = Ca::new("Weir test CA");
    let b = TlsBroker::start(&ca, &ca, "", "ssl_cert_login = true");
    let alice = ca.issue("alice", false);
    // No user name, no password: the certificate's CN is the user.
    let code = mqtts_connack(b.mqtts, &ca, alice.clone(), &mqtt_connect("c1", None, None)).await;
    assert_eq!(code, 0, "certificate login refused");
    // A user name only picks the tenant (`tenant:`); an unknown one is refused.
    let code = mqtts_connack(
        b.mqtts,
        &ca,
        alice.clone(),
        &mqtt_connect("c2", Some("nowhere:"), None),
    )
    .await;
    assert_eq!(code, 5, "login into an unknown tenant");
    // A certificate naming no user is refused.
    let code = mqtts_connack(
        b.mqtts,
        &ca,
        ca.issue("mallory", false),
        &mqtt_connect("c3", None, None),
    )
    .await;
    assert_eq!(code, 4, "certificate of an unknown user accepted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mqtts_without_ssl_cert_login_needs_a_password() {
    let ca = Ca::new("Weir test CA");
    // Without anonymous clients (which would be `guest`, not the
    // certificate's user): the certificate alone logs in as nobody.
    let b = TlsBroker::start(&ca, &ca, "", "allow_anonymous = false");
    let alice = ca.issue("alice", false);
    let code = mqtts_connack(b.mqtts, &ca, alice.clone(), &mqtt_connect("c1", None, None)).await;
    assert_eq!(code, 5, "certificate login without mqtt.ssl_cert_login");
    let code = mqtts_connack(
        b.mqtts,
        &ca,
        alice,
        &mqtt_connect("c2", Some("guest"), Some("guest")),
    )
    .await;
    assert_eq!(code, 0, "password login over MQTTS");
}

#[test]
fn unusable_tls_files_refuse_to_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("weir.toml");
    std::fs::write(
        &config,
        "[tls]\ncert_file = \"/nonexistent/server.pem\"\nkey_file = \"/nonexistent/server.key\"\n",
    )
    .unwrap();
    let (status, log) = run_weir_to_exit(|cmd| {
        cmd.arg("--config")
            .arg(&config)
            .arg("--data-dir")
            .arg(dir.path().join("data"))
            .arg("--amqp-listen")
            .arg("127.0.0.1:0")
            .arg("--mqtt-listen")
            .arg("127.0.0.1:0")
            .arg("--mqtt-ws-listen")
            .arg("127.0.0.1:0");
    });
    assert!(!status.success(), "started with missing TLS files:\n{log}");
    assert!(
        log.contains("tls.cert_file /nonexistent/server.pem"),
        "the error does not name the file:\n{log}"
    );
}
