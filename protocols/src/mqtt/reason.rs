//! MQTT 5 reason codes (2.4) used by the adapter and its session.
//!
//! [`super::Event::Closed`] carries one of these for both versions (3.1.1
//! has no reason codes on the wire; the code is then for the log).

/// Success / normal disconnection / granted QoS 0.
pub const SUCCESS: u8 = 0x00;
/// DISCONNECT: disconnect with will message.
pub const DISCONNECT_WITH_WILL: u8 = 0x04;
/// PUBACK / PUBREC: accepted, but nobody subscribed.
pub const NO_MATCHING_SUBSCRIBERS: u8 = 0x10;
/// UNSUBACK: there was no such subscription.
pub const NO_SUBSCRIPTION_EXISTED: u8 = 0x11;
pub const UNSPECIFIED_ERROR: u8 = 0x80;
pub const MALFORMED_PACKET: u8 = 0x81;
pub const PROTOCOL_ERROR: u8 = 0x82;
pub const IMPLEMENTATION_SPECIFIC_ERROR: u8 = 0x83;
pub const UNSUPPORTED_PROTOCOL_VERSION: u8 = 0x84;
pub const CLIENT_ID_NOT_VALID: u8 = 0x85;
pub const BAD_USER_NAME_OR_PASSWORD: u8 = 0x86;
pub const NOT_AUTHORIZED: u8 = 0x87;
pub const SERVER_UNAVAILABLE: u8 = 0x88;
pub const SERVER_BUSY: u8 = 0x89;
pub const SERVER_SHUTTING_DOWN: u8 = 0x8B;
pub const BAD_AUTHENTICATION_METHOD: u8 = 0x8C;
pub const KEEP_ALIVE_TIMEOUT: u8 = 0x8D;
pub const SESSION_TAKEN_OVER: u8 = 0x8E;
pub const TOPIC_FILTER_INVALID: u8 = 0x8F;
pub const TOPIC_NAME_INVALID: u8 = 0x90;
pub const PACKET_ID_IN_USE: u8 = 0x91;
pub const PACKET_ID_NOT_FOUND: u8 = 0x92;
pub const RECEIVE_MAXIMUM_EXCEEDED: u8 = 0x93;
pub const TOPIC_ALIAS_INVALID: u8 = 0x94;
pub const PACKET_TOO_LARGE: u8 = 0x95;
pub const QUOTA_EXCEEDED: u8 = 0x97;
pub const ADMINISTRATIVE_ACTION: u8 = 0x98;
pub const PAYLOAD_FORMAT_INVALID: u8 = 0x99;
pub const RETAIN_NOT_SUPPORTED: u8 = 0x9A;
pub const QOS_NOT_SUPPORTED: u8 = 0x9B;
pub const SHARED_SUBSCRIPTIONS_NOT_SUPPORTED: u8 = 0x9E;
pub const SUBSCRIPTION_IDS_NOT_SUPPORTED: u8 = 0xA1;
pub const WILDCARD_SUBSCRIPTIONS_NOT_SUPPORTED: u8 = 0xA2;
