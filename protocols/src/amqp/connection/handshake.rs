//! The connection handshake (protocol header, start/start-ok with the
//! login, tune/tune-ok, open/open-ok) and the other connection-class
//! methods a client sends (close, blocked, update-secret).

use super::{codec, reply, Connection, Event, Phase};
use crate::amqp::sasl;
use amq_protocol::protocol::{connection, AMQPClass};
use amq_protocol::types::{AMQPValue, FieldTable};

impl Connection {
    pub(super) fn refuse_header(&mut self) {
        // Spec 4.2.2: answer a bad header with the header we speak, then close.
        self.out.extend_from_slice(codec::PROTOCOL_HEADER);
        self.phase = Phase::Finished;
    }

    pub(super) fn send_start(&mut self) {
        let mut caps = FieldTable::default();
        for cap in [
            "publisher_confirms",
            "exchange_exchange_bindings",
            "basic.nack",
            "consumer_cancel_notify",
            "connection.blocked",
            "authentication_failure_close",
            "per_consumer_qos",
        ] {
            caps.insert(cap.into(), AMQPValue::Boolean(true));
        }
        let mut props = FieldTable::default();
        props.insert("product".into(), AMQPValue::LongString("Weir".into()));
        props.insert(
            "version".into(),
            AMQPValue::LongString(self.config.version.as_str().into()),
        );
        props.insert("platform".into(), AMQPValue::LongString("Rust".into()));
        props.insert("capabilities".into(), AMQPValue::FieldTable(caps));
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Start(connection::Start {
                version_major: 0,
                version_minor: 9,
                server_properties: props,
                mechanisms: if self.external {
                    "PLAIN AMQPLAIN EXTERNAL".into()
                } else {
                    "PLAIN AMQPLAIN".into()
                },
                locales: "en_US".into(),
            })),
        );
    }

    /// Offers SASL EXTERNAL in connection.start (call before the client's
    /// protocol header is read): the transport already authenticated the
    /// client (a verified TLS client certificate). An EXTERNAL login then
    /// comes as [`Event::Login`] with empty credentials; the session knows
    /// who the certificate names.
    pub fn offer_external(&mut self) {
        self.external = true;
    }

    /// Credentials accepted: continue with connection.tune.
    pub fn accept_login(&mut self) {
        debug_assert_eq!(self.phase, Phase::Authenticating);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::Tune(connection::Tune {
                channel_max: self.config.channel_max,
                frame_max: self.config.frame_max,
                heartbeat: self.config.heartbeat,
            })),
        );
        self.phase = Phase::AwaitingTuneOk;
    }

    /// Credentials refused: close with 403 ACCESS_REFUSED, as RabbitMQ does
    /// for clients with the `authentication_failure_close` capability.
    pub fn refuse_login(&mut self, text: &str) {
        self.fail(
            reply::ACCESS_REFUSED,
            format!("ACCESS_REFUSED - {text}"),
            10,
            11,
        );
    }

    /// The virtual host exists and may be used.
    pub fn accept_open(&mut self) {
        debug_assert_eq!(self.phase, Phase::Opening);
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::OpenOk(connection::OpenOk {})),
        );
        self.phase = Phase::Open;
    }

    /// Answers connection.update-secret with update-secret-ok.
    pub fn accept_update_secret(&mut self) {
        self.send_method(
            0,
            AMQPClass::Connection(connection::AMQPMethod::UpdateSecretOk(
                connection::UpdateSecretOk {},
            )),
        );
    }

    /// Refuses connection.update-secret: the connection is closed with 530
    /// NOT_ALLOWED, as RabbitMQ closes it.
    pub fn refuse_update_secret(&mut self, text: &str) {
        self.fail(reply::NOT_ALLOWED, format!("NOT_ALLOWED - {text}"), 10, 70);
    }

    /// Refuses connection.open (530 NOT_ALLOWED).
    pub fn refuse_open(&mut self, text: &str) {
        self.fail(reply::NOT_ALLOWED, format!("NOT_ALLOWED - {text}"), 10, 40);
    }

    pub(super) fn on_connection_method(
        &mut self,
        method: AMQPClass,
        class_id: u16,
        method_id: u16,
    ) {
        use connection::AMQPMethod as M;
        let AMQPClass::Connection(m) = method else {
            return self.fail(
                reply::COMMAND_INVALID,
                format!(
                    "COMMAND_INVALID - method {class_id}.{method_id} is not allowed on channel 0"
                ),
                class_id,
                method_id,
            );
        };
        match (self.phase, m) {
            (Phase::AwaitingStartOk, M::StartOk(start_ok)) => {
                self.accepts_blocked = matches!(
                    start_ok.client_properties.inner().get("capabilities"),
                    Some(AMQPValue::FieldTable(caps))
                        if matches!(caps.inner().get("connection.blocked"), Some(AMQPValue::Boolean(true)))
                );
                // Bounded by the frame: at most frame-max bytes of text.
                self.connection_name =
                    match start_ok.client_properties.inner().get("connection_name") {
                        Some(AMQPValue::LongString(n)) => {
                            Some(String::from_utf8_lossy(n.as_bytes()).into_owned())
                        }
                        Some(AMQPValue::ShortString(n)) => Some(n.as_str().to_string()),
                        _ => None,
                    };
                self.client_properties = Some(super::client_properties::bounded(
                    &start_ok.client_properties,
                ));
                let mechanism = start_ok.mechanism.as_str().to_string();
                let decoded = if mechanism == "EXTERNAL" && self.external {
                    // The response is an optional authorization identity,
                    // not a credential: the certificate is the credential.
                    Ok(sasl::Credentials {
                        username: String::new(),
                        password: String::new().into(),
                    })
                } else {
                    sasl::decode(&mechanism, start_ok.response.as_bytes())
                };
                let sasl::Credentials { username, password } = match decoded {
                    Ok(c) => c,
                    Err(e) => {
                        return self.fail(
                            reply::ACCESS_REFUSED,
                            format!(
                                "ACCESS_REFUSED - login with mechanism {mechanism} refused: {e}"
                            ),
                            10,
                            11,
                        )
                    }
                };
                self.phase = Phase::Authenticating;
                self.pending.push_back(Event::Login {
                    mechanism,
                    username,
                    password,
                });
            }
            (Phase::AwaitingTuneOk, M::TuneOk(tune)) => {
                let frame_max = if tune.frame_max == 0 {
                    self.config.frame_max
                } else {
                    tune.frame_max
                };
                if frame_max < 4096 || frame_max > self.config.frame_max {
                    return self.fail(
                        reply::NOT_ALLOWED,
                        format!(
                            "NOT_ALLOWED - frame_max {frame_max} outside 4096..={}",
                            self.config.frame_max
                        ),
                        10,
                        31,
                    );
                }
                let channel_max = if tune.channel_max == 0 {
                    self.config.channel_max
                } else {
                    tune.channel_max
                };
                self.frame_max = frame_max as usize;
                self.channel_max = channel_max.min(self.config.channel_max);
                self.heartbeat = tune.heartbeat;
                self.phase = Phase::AwaitingOpen;
            }
            (Phase::AwaitingOpen, M::Open(open)) => {
                self.phase = Phase::Opening;
                self.pending.push_back(Event::OpenVhost {
                    vhost: open.virtual_host.as_str().to_string(),
                });
            }
            (Phase::Open, M::Close(_)) => {
                self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.clear_channels();
                self.phase = Phase::Finished;
                self.pending.push_back(Event::Closed);
            }
            (Phase::Open, M::Blocked(_) | M::Unblocked(_)) => {}
            (Phase::Open, M::UpdateSecret(u)) => {
                let secret = String::from_utf8_lossy(u.new_secret.as_bytes()).into_owned();
                self.pending.push_back(Event::UpdateSecret {
                    secret: secret.into(),
                    reason: u.reason.as_str().to_string(),
                });
            }
            (_, M::Close(_)) => {
                // Closing during the handshake.
                self.send_method(
                    0,
                    AMQPClass::Connection(connection::AMQPMethod::CloseOk(connection::CloseOk {})),
                );
                self.phase = Phase::Finished;
                self.pending.push_back(Event::Closed);
            }
            (phase, _) => self.fail(
                reply::COMMAND_INVALID,
                format!("COMMAND_INVALID - unexpected method {class_id}.{method_id} in {phase:?}"),
                class_id,
                method_id,
            ),
        }
    }
}
