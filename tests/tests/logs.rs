//! The broker's log lines as operators expect them (issue 25, item 7),
//! against the real `weir` binary with stdout piped (not a terminal):
//! no ANSI escape codes even when the environment does not ask for none
//! (`NO_COLOR` removed), and `--log-format json` writes one JSON object
//! per line, spans and fields included.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use weir_tests::*;

/// Something that logs at info with fields: an MQTT CONNECT with a wrong
/// password, refused and logged with its peer and user.
fn provoke_connection_logs(mqtt_port: u16) {
    let mut s = TcpStream::connect(("127.0.0.1", mqtt_port)).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // 3.1.1 CONNECT, user "guest", password "wrong".
    let id = b"logtest";
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0xC2, 0, 60];
    body.extend_from_slice(&(id.len() as u16).to_be_bytes());
    body.extend_from_slice(id);
    for field in [&b"guest"[..], &b"wrong"[..]] {
        body.extend_from_slice(&(field.len() as u16).to_be_bytes());
        body.extend_from_slice(field);
    }
    let mut p = vec![0x10, body.len() as u8];
    p.extend_from_slice(&body);
    s.write_all(&p).unwrap();
    // The CONNACK refusal (or the close) comes after the throttle's delay.
    let mut buf = [0u8; 4];
    let _ = s.read(&mut buf);
}

/// A broker (and its directory, kept while it runs).
fn start(args: &[&str]) -> (Broker, tempfile::TempDir) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path().to_path_buf();
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    let b = Broker::start_custom(&dir.clone(), move |port, cmd| {
        // The harness sets NO_COLOR; a real service manager does not.
        cmd.env_remove("NO_COLOR")
            .arg("--data-dir")
            .arg(dir.join("data"))
            .arg("--amqp-listen")
            .arg(format!("127.0.0.1:{port}"))
            .arg("--mqtt-listen")
            .arg("127.0.0.1:0")
            .arg("--mqtt-ws-listen")
            .arg("127.0.0.1:0")
            .arg("--http-listen")
            .arg("127.0.0.1:0")
            .args(&args);
    });
    (b, tmp)
}

/// The MQTT port from the "MQTT listener ready" line, text or JSON.
fn mqtt_port(b: &Broker) -> u16 {
    assert!(
        b.wait_for_log("MQTT listener ready", START_TIMEOUT),
        "no MQTT listener\n{}",
        b.logs()
    );
    let logs = b.run_logs();
    let line = logs
        .lines()
        .find(|l| l.contains("MQTT listener ready"))
        .expect("the line");
    let at = line.find("127.0.0.1:").expect("an address") + "127.0.0.1:".len();
    line[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .expect("a port")
}

#[test]
fn text_logs_to_a_pipe_have_no_escape_codes() {
    let (mut b, _dir) = start(&[]);
    provoke_connection_logs(mqtt_port(&b));
    assert!(
        b.wait_for_log("MQTT login refused", OP_TIMEOUT),
        "{}",
        b.logs()
    );
    b.stop();
    let logs = b.logs();
    assert!(
        !logs.contains('\u{1b}'),
        "escape codes in a piped log:\n{}",
        logs.escape_debug()
    );
    // Still the usual text lines.
    assert!(logs.contains(" INFO "), "{logs}");
}

#[test]
fn json_logs_are_one_object_per_line() {
    let (mut b, _dir) = start(&["--log-format", "json"]);
    provoke_connection_logs(mqtt_port(&b));
    assert!(
        b.wait_for_log("MQTT login refused", OP_TIMEOUT),
        "{}",
        b.logs()
    );
    b.stop();
    // This run's output (the harness writes a line of its own before it).
    let logs = b.run_logs();
    let mut lines = 0;
    let mut refused = None;
    for line in logs.lines() {
        let v: serde_json::Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("not a JSON object ({e}): {line:?}\n{logs}"));
        assert!(v.is_object(), "{line}");
        for key in ["timestamp", "level", "target", "message"] {
            assert!(v.get(key).is_some(), "no {key}: {line}");
        }
        if v["message"] == "MQTT login refused" {
            refused = Some(v);
        }
        lines += 1;
    }
    assert!(lines >= 3, "{logs}");
    let refused = refused.expect("the refused login's line");
    assert_eq!(refused["level"], "INFO");
    assert_eq!(refused["fields"]["user"], "guest");
    assert!(
        refused["fields"]["peer"]
            .as_str()
            .is_some_and(|p| p.starts_with("127.0.0.1:")),
        "{refused}"
    );
}
