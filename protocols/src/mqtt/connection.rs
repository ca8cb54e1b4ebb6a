//! The state machine of one MQTT connection.
//!
//! CONTRACT SKELETON (issue 8): signatures fixed for the session; bodies to
//! be written with the adapter.

use super::event::*;
use bytes::{Bytes, BytesMut};
use std::time::Instant;

/// Limits and identity the server offers (from the configuration).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Largest packet accepted from a client (MQTT 5 CONNACK maximum packet
    /// size; larger packets: 0x95 packet too large).
    pub maximum_packet_size: u32,
    /// QoS 1/2 publishes a client may have unacknowledged towards us
    /// (CONNACK receive maximum; more: 0x93).
    pub receive_maximum: u16,
    /// Topic aliases a client may use towards us (CONNACK).
    pub topic_alias_maximum: u16,
    /// Most levels in a topic name or filter (more: 0x90 / 0x8F).
    pub max_topic_levels: usize,
    /// Time allowed between accepting the socket and a complete CONNECT.
    pub connect_timeout: std::time::Duration,
    /// Server keep-alive imposed on clients asking for none or a longer
    /// one (MQTT 5 only; `None`: the client's own).
    pub server_keep_alive: Option<u16>,
    /// Whether `$share/...` filters are accepted (CONNACK shared
    /// subscription available).
    pub shared_subscriptions: bool,
    /// Highest QoS accepted (CONNACK maximum QoS).
    pub maximum_qos: QoS,
    /// Whether retained messages are supported (CONNACK retain available).
    pub retain_available: bool,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            maximum_packet_size: 1 << 20,
            receive_maximum: 1024,
            topic_alias_maximum: 64,
            max_topic_levels: 32,
            connect_timeout: std::time::Duration::from_secs(10),
            server_keep_alive: None,
            shared_subscriptions: true,
            maximum_qos: QoS::ExactlyOnce,
            retain_available: true,
        }
    }
}

/// A message for the client.
#[derive(Clone, Debug)]
pub struct OutgoingPublish {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// A resend of a publish the client may have seen (persistent session
    /// resumed): keeps `packet_id`.
    pub dup: bool,
    /// For a resend: the id it had. `None`: the adapter allocates one (QoS > 0).
    pub packet_id: Option<u16>,
    pub properties: MessageProperties,
    /// MQTT 5 subscription identifiers of the matching subscriptions.
    pub subscription_ids: Vec<u32>,
}

/// Why a publish was not sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// Larger than the client's maximum packet size: MQTT 5 says discard
    /// it as if it had been delivered.
    #[error("larger than the client's maximum packet size")]
    TooLarge,
    /// The client's receive maximum is reached: wait for an ack.
    #[error("the client's receive maximum is reached")]
    NoQuota,
    /// Not connected (before CONNACK or after the end).
    #[error("not connected")]
    NotConnected,
}

/// One MQTT connection, server side.
pub struct Connection {
    /// Bytes to write to the socket.
    pub out: BytesMut,
    _private: (),
}

impl Connection {
    /// A connection accepted at `now`, waiting for CONNECT.
    pub fn new(config: ServerConfig, now: Instant) -> Connection {
        let _ = (config, now);
        todo!()
    }

    /// The protocol level, once CONNECT was read.
    pub fn version(&self) -> Option<Version> {
        todo!()
    }

    /// Bytes were read at `now` (keep-alive counts from here).
    pub fn on_read(&mut self, now: Instant) {
        let _ = now;
        todo!()
    }

    /// The next event from `input` (complete packets are cut off it), or
    /// `None` when more bytes are needed or the connection is finished.
    /// PINGREQ, PUBREL bookkeeping, malformed packets and protocol errors
    /// are handled inside (a fatal one yields [`Event::Closed`] once).
    pub fn poll(&mut self, input: &mut BytesMut) -> Option<Event> {
        let _ = input;
        todo!()
    }

    /// CONNACK success.
    pub fn accept(&mut self, accept: ConnectAccept) {
        let _ = accept;
        todo!()
    }

    /// CONNACK failure (with `text` as the MQTT 5 reason string); the
    /// connection then finishes.
    pub fn refuse(&mut self, refusal: ConnectRefusal, text: &str) {
        let _ = (refusal, text);
        todo!()
    }

    /// Whether a QoS 1/2 publish can be sent now (client's receive maximum).
    pub fn can_send(&self) -> bool {
        todo!()
    }

    /// Encodes a publish to the client; returns its packet id (QoS 1/2).
    /// Applies an outgoing topic alias when the client allows them.
    pub fn publish(&mut self, msg: OutgoingPublish) -> Result<Option<u16>, SendError> {
        let _ = msg;
        todo!()
    }

    /// Re-sends PUBREL for a QoS 2 publish the client acknowledged with
    /// PUBREC before a reconnect.
    pub fn pubrel(&mut self, packet_id: u16) {
        let _ = packet_id;
        todo!()
    }

    /// Answers a QoS 1 publish (reason 0 = success; MQTT 5 codes such as
    /// 0x10 no matching subscribers, 0x87, 0x90, 0x97).
    pub fn puback(&mut self, packet_id: u16, reason: u8) {
        let _ = (packet_id, reason);
        todo!()
    }

    /// Answers a QoS 2 publish (reason < 0x80: the adapter remembers the id
    /// until PUBREL).
    pub fn pubrec(&mut self, packet_id: u16, reason: u8) {
        let _ = (packet_id, reason);
        todo!()
    }

    /// Completes a QoS 2 publish after [`Event::PubRel`].
    pub fn pubcomp(&mut self, packet_id: u16) {
        let _ = packet_id;
        todo!()
    }

    /// Answers a SUBSCRIBE: one reason code per filter (granted QoS 0-2,
    /// or a failure code; 3.1.1 maps every failure to 0x80).
    pub fn suback(&mut self, packet_id: u16, codes: &[u8]) {
        let _ = (packet_id, codes);
        todo!()
    }

    /// Answers an UNSUBSCRIBE (MQTT 5: one code per filter, 0x00 or 0x11
    /// no subscription existed).
    pub fn unsuback(&mut self, packet_id: u16, codes: &[u8]) {
        let _ = (packet_id, codes);
        todo!()
    }

    /// Ends the connection from the server side: MQTT 5 sends DISCONNECT
    /// with `reason` and `text` (0x8E session taken over, 0x8B server
    /// shutting down, 0x97 quota exceeded, …); 3.1.1 just closes.
    pub fn disconnect(&mut self, reason: u8, text: &str) {
        let _ = (reason, text);
        todo!()
    }

    /// When [`Connection::handle_timeout`] must be called next.
    pub fn poll_timeout(&self) -> Option<Instant> {
        todo!()
    }

    /// Keep-alive (1.5× the negotiated value without a packet: the
    /// connection ends with [`Event::Closed`] on the next poll) and the
    /// CONNECT timeout.
    pub fn handle_timeout(&mut self, now: Instant) {
        let _ = now;
        todo!()
    }

    /// Nothing more will be read; hang up once `out` is written.
    pub fn is_finished(&self) -> bool {
        todo!()
    }
}
