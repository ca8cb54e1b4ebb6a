//! MQTT 5: a Session Expiry Interval changed at DISCONNECT (3.14.2.2.2)
//! is kept across a broker restart (issue 25), against the real `weir`
//! binary with hand-written MQTT 5 packets. Without a restart the same
//! behaviour is compared with Mosquitto in `conformance/mqtt`
//! (`session_expiry_raised_and_lowered_at_disconnect_v5`); here the new
//! interval must survive in the session queue's stored definition.
//!
//! The time that passes is what is tested (as in the conformance
//! scenario): 2.5 s against intervals of 1 s and 300 s.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;
use weir_tests::*;

fn string(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u16).to_be_bytes());
    out.extend_from_slice(s);
}

/// A packet with a one-byte remaining length (all of these are short).
fn packet(first: u8, body: Vec<u8>) -> Vec<u8> {
    assert!(body.len() < 128);
    let mut p = vec![first, body.len() as u8];
    p.extend_from_slice(&body);
    p
}

/// The properties block holding only a Session Expiry Interval.
fn expiry_props(secs: u32) -> Vec<u8> {
    let mut p = vec![5, 0x11];
    p.extend_from_slice(&secs.to_be_bytes());
    p
}

struct Mqtt5(TcpStream);

impl Mqtt5 {
    /// Connects as guest; returns the client and CONNACK's session present.
    fn connect(port: u16, client_id: &str, clean: bool, expiry: u32) -> (Mqtt5, bool) {
        let s = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        s.set_read_timeout(Some(OP_TIMEOUT)).unwrap();
        let mut c = Mqtt5(s);
        let flags = 0xC0 | if clean { 0x02 } else { 0 };
        let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 5, flags, 0, 60];
        body.extend(expiry_props(expiry));
        string(&mut body, client_id.as_bytes());
        string(&mut body, b"guest");
        string(&mut body, b"guest");
        c.0.write_all(&packet(0x10, body)).unwrap();
        let ack = c.read_packet();
        assert_eq!(ack[0], 0x20, "CONNACK expected: {ack:?}");
        assert_eq!(ack[3], 0, "CONNACK refused: {ack:?}");
        (c, ack[2] & 1 == 1)
    }

    /// One whole packet (fixed header included; short remaining lengths).
    fn read_packet(&mut self) -> Vec<u8> {
        let mut head = [0u8; 2];
        self.0.read_exact(&mut head).expect("a packet");
        assert!(head[1] < 128, "long packet: {head:?}");
        let mut body = vec![0u8; head[1] as usize];
        self.0.read_exact(&mut body).unwrap();
        [head.to_vec(), body].concat()
    }

    fn subscribe(&mut self, filter: &str) {
        let mut body = vec![0, 1, 0];
        string(&mut body, filter.as_bytes());
        body.push(1);
        self.0.write_all(&packet(0x82, body)).unwrap();
        let ack = self.read_packet();
        assert_eq!(ack[0], 0x90, "SUBACK expected: {ack:?}");
    }

    /// DISCONNECT with a new session expiry; returns once the broker has
    /// closed the connection (it has acted on it).
    fn disconnect_with_expiry(mut self, secs: u32) {
        let mut body = vec![0];
        body.extend(expiry_props(secs));
        self.0.write_all(&packet(0xE0, body)).unwrap();
        let mut rest = Vec::new();
        let _ = self.0.read_to_end(&mut rest);
    }
}

#[test]
fn session_expiry_changed_at_disconnect_survives_a_restart() {
    let mut b = Broker::start_mqtt_with(&[]);
    assert!(b.wait_for_log("MQTT listener ready", START_TIMEOUT));
    let (mut up, present) = Mqtt5::connect(b.mqtt_port(), "raised", false, 1);
    assert!(!present);
    up.subscribe("expiry/raised");
    up.disconnect_with_expiry(300);
    let (mut down, _) = Mqtt5::connect(b.mqtt_port(), "lowered", false, 300);
    down.subscribe("expiry/lowered");
    down.disconnect_with_expiry(1);

    b.stop();
    b.restart();
    assert!(b.wait_for_log("MQTT listener ready", START_TIMEOUT));
    std::thread::sleep(Duration::from_millis(2500));

    let (_, raised) = Mqtt5::connect(b.mqtt_port(), "raised", false, 300);
    let (_, lowered) = Mqtt5::connect(b.mqtt_port(), "lowered", false, 300);
    assert!(
        raised,
        "CONNECT said 1 s, DISCONNECT 300 s: present 2.5 s after a restart"
    );
    assert!(
        !lowered,
        "CONNECT said 300 s, DISCONNECT 1 s: gone 2.5 s after a restart"
    );
}
