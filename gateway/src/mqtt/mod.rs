//! MQTT 3.1.1 and 5.0 in the gateway.
//!
//! * [`convert`]: topics ⇄ routing keys, and MQTT messages ⇄ the engine's
//!   message model (the MQTT header format and its codec).

pub mod convert;
