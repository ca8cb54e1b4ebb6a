//! What a session acts on, and the answers it gives.

use crate::Secret;
use bytes::Bytes;

/// Protocol level of the connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Version {
    /// MQTT 3.1.1 (protocol level 4).
    V311,
    /// MQTT 5.0 (protocol level 5).
    V5,
}

/// Quality of service.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum QoS {
    AtMostOnce = 0,
    AtLeastOnce = 1,
    ExactlyOnce = 2,
}

/// MQTT 5 message properties carried by PUBLISH and will messages (empty
/// for 3.1.1).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MessageProperties {
    /// Payload format indicator: `Some(true)` = UTF-8.
    pub payload_is_utf8: Option<bool>,
    /// Message expiry interval, seconds.
    pub message_expiry_secs: Option<u32>,
    pub content_type: Option<String>,
    pub response_topic: Option<String>,
    pub correlation_data: Option<Bytes>,
    pub user_properties: Vec<(String, String)>,
}

/// A will message from CONNECT.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Will {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    /// MQTT 5 will delay interval, seconds (0 for 3.1.1).
    pub delay_secs: u32,
    pub properties: MessageProperties,
}

/// A CONNECT, validated (client id syntax, will topic, flags).
#[derive(Clone, Debug)]
pub struct Connect {
    pub version: Version,
    /// Empty when the client asked the server to assign one (the session
    /// then calls [`crate::mqtt::Connection::accept`] with an assigned id).
    pub client_id: String,
    pub clean_start: bool,
    /// Seconds; 0 = no keep-alive.
    pub keep_alive: u16,
    pub username: Option<String>,
    pub password: Option<Secret>,
    pub will: Option<Will>,
    /// MQTT 5 session expiry interval, seconds (3.1.1: 0 when clean
    /// session, `u32::MAX` otherwise, i.e. the 3.1.1 semantics).
    pub session_expiry_secs: u32,
    /// How many QoS 1/2 publishes the client accepts in flight (65,535
    /// when absent).
    pub receive_maximum: u16,
    /// Largest packet the client accepts (`None`: no limit but the
    /// protocol's).
    pub maximum_packet_size: Option<u32>,
    /// Topic aliases the client accepts from the server.
    pub topic_alias_maximum: u16,
    pub request_response_information: bool,
    pub request_problem_information: bool,
    pub user_properties: Vec<(String, String)>,
}

/// The session's positive answer to a [`Connect`].
#[derive(Clone, Debug, Default)]
pub struct ConnectAccept {
    pub session_present: bool,
    /// Set when the client sent an empty client id.
    pub assigned_client_id: Option<String>,
    /// Server keep-alive (MQTT 5) overriding the client's, seconds.
    pub server_keep_alive: Option<u16>,
    /// Session expiry the server grants, when lower than asked (MQTT 5).
    pub session_expiry_secs: Option<u32>,
    /// When the client requested response information (MQTT 5).
    pub response_information: Option<String>,
}

/// Reasons for refusing a CONNECT (MQTT 5 reason code; the 3.1.1 return
/// code is derived).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnectRefusal {
    /// 0x85 / 3.1.1: 2.
    ClientIdNotValid,
    /// 0x86 / 3.1.1: 4.
    BadUserNameOrPassword,
    /// 0x87 / 3.1.1: 5.
    NotAuthorized,
    /// 0x88 / 3.1.1: 3.
    ServerUnavailable,
    /// 0x89 / 3.1.1: 3.
    ServerBusy,
    /// 0x97 / 3.1.1: 3.
    QuotaExceeded,
    /// 0x8C / 3.1.1: 4.
    BadAuthenticationMethod,
}

/// A PUBLISH from the client, its topic alias resolved.
#[derive(Clone, Debug)]
pub struct Publish {
    pub topic: String,
    pub payload: Bytes,
    pub qos: QoS,
    pub retain: bool,
    pub dup: bool,
    /// Set for QoS 1 and 2.
    pub packet_id: Option<u16>,
    pub properties: MessageProperties,
}

/// Subscription options of one filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SubscribeFilter {
    /// As sent, `$share/group/` prefix included.
    pub filter: String,
    /// Parsed `$share/group/filter`, if shared.
    pub shared: Option<super::SharedFilter>,
    pub qos: QoS,
    pub no_local: bool,
    pub retain_as_published: bool,
    /// 0: send retained at subscribe; 1: only if the subscription is new; 2: never.
    pub retain_handling: u8,
    /// Set when the filter is invalid: the session answers this code in the
    /// SUBACK (0x8F topic filter invalid, 0x9E shared subscriptions not
    /// supported, …) and does not subscribe.
    pub invalid: Option<u8>,
}

/// Everything the session must act on.
#[derive(Clone, Debug)]
pub enum Event {
    /// The first packet. Answer with [`crate::mqtt::Connection::accept`] or
    /// [`crate::mqtt::Connection::refuse`].
    Connect(Box<Connect>),
    /// A message from the client. QoS 1: answer with `puback`; QoS 2: with
    /// `pubrec` (the adapter remembers the id until PUBREL).
    Publish(Publish),
    /// The client acknowledged our QoS 1 publish.
    PubAck { packet_id: u16, reason: u8 },
    /// The client received our QoS 2 publish; the adapter answered PUBREL
    /// (the id stays in flight until [`Event::PubComp`]). With a failure
    /// `reason` (≥ 0x80, MQTT 5) no PUBREL is sent: the exchange is over
    /// and the id is free.
    PubRec { packet_id: u16, reason: u8 },
    /// The client released its QoS 2 publish: answer with `pubcomp`.
    PubRel { packet_id: u16 },
    /// The client completed our QoS 2 publish.
    PubComp { packet_id: u16 },
    /// Answer with `suback` (one reason code per filter, in order).
    Subscribe {
        packet_id: u16,
        filters: Vec<SubscribeFilter>,
        subscription_id: Option<u32>,
        user_properties: Vec<(String, String)>,
    },
    /// Answer with `unsuback`.
    Unsubscribe {
        packet_id: u16,
        filters: Vec<String>,
    },
    /// A clean DISCONNECT; the connection is finished. `publish_will`:
    /// MQTT 5 reason 0x04 (disconnect with will message), or any other
    /// reason but 0x00 (MQTT 5 3.1.2.5: only a normal disconnection discards
    /// the will); always false for 3.1.1. `session_expiry_secs`: a new
    /// expiry the client set (MQTT 5; raising it from 0 is refused with
    /// [`Event::Closed`] 0x82 instead).
    Disconnect {
        publish_will: bool,
        session_expiry_secs: Option<u32>,
    },
    /// The connection ends for a protocol error or a keep-alive timeout
    /// (already answered on the wire as the version allows): the will is
    /// published.
    ///
    /// Returned once, by `poll`, for every ending the adapter decides: a
    /// malformed packet (0x81), a protocol error (0x82), a limit (0x93,
    /// 0x94, 0x95, 0x9A, 0x9B, …), the keep-alive (0x8D) or CONNECT timeout
    /// (0x80), an unsupported protocol level (0x84), or a refused CONNECT
    /// (0x85, 0x86, 0x8C, 0x90, …; no session exists then). `reason` is the
    /// MQTT 5 code for 3.1.1 too, where the wire got at most a CONNACK
    /// return code. Never after the session's own `refuse` / `disconnect`
    /// nor after [`Event::Disconnect`]. `out` may hold a last DISCONNECT or
    /// CONNACK to flush before closing.
    Closed { reason: u8, text: String },
}
