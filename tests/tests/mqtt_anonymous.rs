//! Anonymous MQTT clients (issue 25, item 1), against the real `weir`
//! binary: as RabbitMQ's MQTT plugin, a CONNECT without a username logs in
//! as `[mqtt] default_user` (`guest`) when `[mqtt] allow_anonymous` (the
//! default), with that user's loopback-only rule; `allow_anonymous = false`
//! refuses it with CONNACK 5 (3.1.1) / 0x87 (5).
//!
//! "From another machine" is a connection to the machine's own
//! non-loopback address (the broker listening on 0.0.0.0): the broker sees
//! that address as the peer, which is what the loopback rule looks at.
//! (A second loopback address such as 127.0.0.2 would not do: 127.0.0.0/8
//! is loopback to Weir, as to RabbitMQ.) Without a non-loopback IPv4
//! address the test says it is skipped and why.

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::process::Command;
use std::time::Duration;
use weir_tests::*;

/// A 3.1.1 or 5 CONNECT without username or password (clean session,
/// keep-alive 60 s).
fn anonymous_connect(version: u8, client_id: &str) -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', version, 0x02, 0, 60];
    if version == 5 {
        body.push(0); // no properties
    }
    body.extend_from_slice(&(client_id.len() as u16).to_be_bytes());
    body.extend_from_slice(client_id.as_bytes());
    let mut p = vec![0x10, body.len() as u8];
    p.extend_from_slice(&body);
    p
}

/// Connects anonymously to `addr` and returns the CONNACK's return code
/// (3.1.1) or reason code (5).
fn connack_code(addr: SocketAddr, version: u8) -> u8 {
    let mut s = TcpStream::connect_timeout(&addr, OP_TIMEOUT)
        .unwrap_or_else(|e| panic!("connect to {addr}: {e}"));
    // A refused login is answered after the login throttle's delay.
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(&anonymous_connect(version, &format!("anon-{version}")))
        .unwrap();
    let mut head = [0u8; 2];
    s.read_exact(&mut head)
        .unwrap_or_else(|e| panic!("no CONNACK from {addr}: {e}"));
    assert_eq!(head[0], 0x20, "CONNACK expected, got {head:?}");
    let mut body = vec![0u8; head[1] as usize];
    s.read_exact(&mut body).unwrap();
    body[1]
}

/// The machine's first global IPv4 address, if it has one.
fn non_loopback_ipv4() -> Option<IpAddr> {
    let out = Command::new("ip")
        .args(["-o", "-4", "addr", "show", "scope", "global"])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .skip_while(|w| *w != "inet")
        .nth(1)
        .and_then(|cidr| cidr.split('/').next())
        .and_then(|a| a.parse().ok())
}

fn mqtt_port_of(b: &Broker) -> u16 {
    b.listener_port("MQTT")
}

#[test]
fn anonymous_clients_are_the_default_user_from_loopback_only() {
    let b = Broker::start_with(&["--mqtt-listen", "0.0.0.0:0"]);
    let port = mqtt_port_of(&b);
    let local = SocketAddr::from(([127, 0, 0, 1], port));
    assert_eq!(connack_code(local, 4), 0, "3.1.1 from loopback: accepted");
    assert_eq!(connack_code(local, 5), 0, "5 from loopback: accepted");

    // Out of the box, as `mosquitto_sub -h localhost -t '#'`: no -u, no -P.
    let topic = "anonymous/works";
    let out = Command::new("mosquitto_pub")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-t", topic, "-m", "hello", "-r", "-q", "1"])
        .output()
        .expect("mosquitto_pub (package mosquitto-clients: scripts/install-deps.sh)");
    assert!(
        out.status.success(),
        "anonymous mosquitto_pub: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("mosquitto_sub")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(["-t", "anonymous/#", "-C", "1", "-W", "20", "-F", "%t %p"])
        .output()
        .expect("mosquitto_sub");
    assert!(
        out.status.success(),
        "anonymous mosquitto_sub: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "anonymous/works hello"
    );

    let Some(ip) = non_loopback_ipv4() else {
        eprintln!(
            "skipped (the non-loopback half): this machine has no global IPv4 address to \
             connect from (`ip -o -4 addr show scope global` found none)"
        );
        return;
    };
    let remote = SocketAddr::new(ip, port);
    // Refused as guest would be from there: bad user name or password.
    assert_eq!(connack_code(remote, 4), 4, "3.1.1 from {ip}: refused");
    assert_eq!(connack_code(remote, 5), 0x86, "5 from {ip}: refused");
    assert!(b.wait_for_log("MQTT login refused", OP_TIMEOUT));
}

#[test]
fn allow_anonymous_false_refuses_connects_without_a_username() {
    let b = Broker::start_mqtt_with(&["--mqtt-allow-anonymous", "false"]);
    let local = SocketAddr::from(([127, 0, 0, 1], b.mqtt_port()));
    assert_eq!(connack_code(local, 4), 5, "3.1.1: not authorized");
    assert_eq!(connack_code(local, 5), 0x87, "5: not authorized");
}

#[test]
fn default_user_names_who_anonymous_clients_are() {
    // A default user that does not exist: refused even from loopback.
    let b = Broker::start_mqtt_with(&["--mqtt-default-user", "nobody"]);
    let local = SocketAddr::from(([127, 0, 0, 1], b.mqtt_port()));
    assert_eq!(connack_code(local, 4), 4, "3.1.1: no such user");
}
