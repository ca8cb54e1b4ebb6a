//! A shovel's definition in RabbitMQ's terms: the `value` of a runtime
//! parameter of component `shovel` (`PUT /api/parameters/shovel/{vhost}/{name}`,
//! the `parameters` of a definitions export, `[[shovels]]` in the config
//! file), checked once into a [`ShovelDef`].
//!
//! RabbitMQ's keys are kept: `src-protocol`/`dest-protocol` (`amqp091`,
//! the default), `src-uri`/`dest-uri` (a string or a list, the first is
//! used), `src-queue`, `src-exchange` + `src-exchange-key`, `dest-queue`,
//! `dest-exchange` + `dest-exchange-key`, `ack-mode`, `src-prefetch-count`
//! (or the older `prefetch-count`), `src-delete-after` (or `delete-after`)
//! and `reconnect-delay`. A URI without a host (`amqp://`, `amqp:///vhost`)
//! is RabbitMQ's direct connection to the local node: here, a Weir queue or
//! exchange reached through an engine client. Weir adds two protocols:
//! `mqtt` (`src-topic`: a topic filter, `dest-topic`, `src-qos`/`dest-qos`)
//! and `nats` (`src-subject`, or a JetStream `src-stream` + `src-consumer`;
//! `dest-subject`, and `dest-stream` to have each publish acknowledged).

use std::time::Duration;

use serde_json::Value;

/// The largest prefetch a shovel asks for (RabbitMQ's default is 1,000).
pub const MAX_PREFETCH: u16 = 10_000;

/// A definition that cannot be used, with RabbitMQ-like texts (HTTP 400).
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DefError {
    /// A key is missing.
    #[error("shovel: '{0}' is required")]
    Missing(&'static str),
    /// A key has the wrong type or value.
    #[error("shovel: invalid '{key}': {why}")]
    Invalid {
        /// The key.
        key: &'static str,
        /// What is wrong.
        why: String,
    },
    /// A protocol Weir's shovels do not speak (yet).
    #[error("shovel: unsupported {0}")]
    Unsupported(String),
}

/// Where a source takes messages from or a destination puts them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A queue (a source consumes from it; a destination publishes to it
    /// through the default exchange).
    Queue(String),
    /// An exchange: a destination publishes to it with `key` (None: the
    /// message's own routing key); a source binds a private queue to it.
    Exchange {
        /// Exchange name ("" = the default exchange).
        name: String,
        /// Routing or binding key.
        key: Option<String>,
    },
}

/// One end of a shovel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// This broker: a vhost's queue or exchange, through an engine client
    /// acting as the shovel's user.
    Local {
        /// The vhost (from the URI's path, else the shovel's own).
        vhost: String,
        /// What in it.
        target: Target,
    },
    /// An AMQP 0-9-1 broker (lapin).
    Amqp {
        /// Its URI (credentials included).
        uri: String,
        /// What on it.
        target: Target,
    },
    /// An MQTT 3.1.1 broker (rumqttc).
    Mqtt {
        /// `mqtt://[user[:password]@]host[:port]`.
        uri: String,
        /// Source: the topic filter subscribed to; destination: the topic
        /// (None: the message's routing key as a topic).
        topic: Option<String>,
        /// QoS of the subscription or the publishes (1 by default; 0 gives
        /// up at-least-once).
        qos: u8,
    },
    /// A NATS server (core NATS subjects).
    Nats {
        /// `nats://[user:password@]host[:port]`.
        uri: String,
        /// Source: the subject subscribed to (JetStream: the consumer's
        /// filter); destination: the subject (None: the message's routing
        /// key).
        subject: Option<String>,
        /// JetStream: source, the stream of `consumer`; destination, given
        /// when the subject belongs to a stream (each publish is then
        /// acknowledged by the stream).
        stream: Option<String>,
        /// JetStream source: the durable pull consumer (created when
        /// missing).
        consumer: Option<String>,
    },
}

impl Endpoint {
    /// The protocol name as the API shows it.
    pub fn protocol(&self) -> &'static str {
        match self {
            Endpoint::Local { .. } | Endpoint::Amqp { .. } => "amqp091",
            Endpoint::Mqtt { .. } => "mqtt",
            Endpoint::Nats { .. } => "nats",
        }
    }
}

/// When a source's messages are acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckMode {
    /// After the destination confirmed them (at-least-once).
    OnConfirm,
    /// After they were handed to the destination, unconfirmed.
    OnPublish,
    /// Taken without acknowledgements (may lose messages).
    NoAck,
}

impl AckMode {
    /// RabbitMQ's name.
    pub fn name(self) -> &'static str {
        match self {
            AckMode::OnConfirm => "on-confirm",
            AckMode::OnPublish => "on-publish",
            AckMode::NoAck => "no-ack",
        }
    }
}

/// When a shovel stops by itself (and is deleted, as RabbitMQ does).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeleteAfter {
    /// Runs until deleted.
    Never,
    /// After moving as many messages as the source queue held at start.
    QueueLength,
    /// After moving this many messages.
    Count(u64),
}

/// A checked shovel definition.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShovelDef {
    /// Where messages come from.
    pub src: Endpoint,
    /// Where they go.
    pub dest: Endpoint,
    /// When the source is acknowledged.
    pub ack_mode: AckMode,
    /// Unacknowledged messages in flight (the source's prefetch).
    pub prefetch: u16,
    /// When to stop.
    pub delete_after: DeleteAfter,
    /// The first wait before reconnecting after a failure; doubled on each
    /// failure in a row, up to [`MAX_RECONNECT_DELAY`].
    pub reconnect_delay: Duration,
}

/// The longest wait between reconnection attempts.
pub const MAX_RECONNECT_DELAY: Duration = Duration::from_secs(60);

fn str_of(v: &Value, key: &'static str) -> Result<Option<String>, DefError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(other) => Err(DefError::Invalid {
            key,
            why: format!("expected a string, got {other}"),
        }),
    }
}

fn uri_of(v: &Value, key: &'static str) -> Result<String, DefError> {
    match v.get(key) {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(Value::Array(a)) => match a.first() {
            Some(Value::String(s)) => Ok(s.clone()),
            _ => Err(DefError::Invalid {
                key,
                why: "expected a non-empty list of URIs".into(),
            }),
        },
        None | Some(Value::Null) => Err(DefError::Missing(key)),
        Some(other) => Err(DefError::Invalid {
            key,
            why: format!("expected a URI, got {other}"),
        }),
    }
}

fn num_of(v: &Value, key: &'static str) -> Result<Option<u64>, DefError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n.as_u64().map(Some).ok_or_else(|| DefError::Invalid {
            key,
            why: format!("expected a non-negative integer, got {n}"),
        }),
        Some(Value::String(s)) => s.trim().parse().map(Some).map_err(|_| DefError::Invalid {
            key,
            why: format!("expected a non-negative integer, got \"{s}\""),
        }),
        Some(other) => Err(DefError::Invalid {
            key,
            why: format!("expected a number, got {other}"),
        }),
    }
}

/// `amqp://host…` or the local node (`amqp://`, `amqp:///vhost`): the
/// vhost of a local URI, percent-decoded ("/" when the path is empty).
fn local_vhost(uri: &str, own: &str) -> Option<String> {
    let rest = uri.strip_prefix("amqp://")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i + 1..]),
        None => (rest, ""),
    };
    // RabbitMQ's direct URIs have no host (credentials are not used).
    let host = authority.rsplit('@').next().unwrap_or("");
    if !host.is_empty() {
        return None;
    }
    let path = path.split('?').next().unwrap_or("");
    if path.is_empty() {
        return Some(own.to_string());
    }
    Some(percent_decode(path))
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%' && i + 2 < b.len() {
            if let Ok(x) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(x);
                i += 3;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn qos_of(v: &Value, key: &'static str) -> Result<u8, DefError> {
    match num_of(v, key)? {
        None => Ok(1),
        Some(q @ 0..=1) => Ok(q as u8),
        Some(q) => Err(DefError::Invalid {
            key,
            why: format!("QoS {q}: 0 or 1"),
        }),
    }
}

fn endpoint(v: &Value, side: Side, own_vhost: &str) -> Result<Endpoint, DefError> {
    let k = |a: &'static str, b: &'static str| if side == Side::Src { a } else { b };
    let protocol = str_of(v, k("src-protocol", "dest-protocol"))?;
    let uri_key = k("src-uri", "dest-uri");
    match protocol.as_deref().unwrap_or("amqp091") {
        "amqp091" | "local" => {
            let uri = match protocol.as_deref() {
                Some("local") => v
                    .get(uri_key)
                    .map(|_| uri_of(v, uri_key))
                    .transpose()?
                    .unwrap_or_else(|| "amqp://".into()),
                _ => uri_of(v, uri_key)?,
            };
            let queue = str_of(v, k("src-queue", "dest-queue"))?;
            let exchange = str_of(v, k("src-exchange", "dest-exchange"))?;
            let key = str_of(v, k("src-exchange-key", "dest-exchange-key"))?;
            let target = match (queue, exchange) {
                (Some(_), Some(_)) => {
                    return Err(DefError::Invalid {
                        key: k("src-queue", "dest-queue"),
                        why: "give a queue or an exchange, not both".into(),
                    })
                }
                (Some(q), None) => Target::Queue(q),
                (None, Some(x)) => Target::Exchange { name: x, key },
                (None, None) if side == Side::Dest => Target::Exchange {
                    // RabbitMQ: no destination given = the default exchange
                    // with the message's own routing key.
                    name: String::new(),
                    key,
                },
                (None, None) => return Err(DefError::Missing("src-queue")),
            };
            if let Some(vhost) = local_vhost(&uri, own_vhost) {
                if side == Side::Src && matches!(target, Target::Exchange { .. }) {
                    return Err(DefError::Unsupported(
                        "src-exchange on the local broker: shovel from a queue bound to it".into(),
                    ));
                }
                return Ok(Endpoint::Local { vhost, target });
            }
            if !uri.starts_with("amqp://") {
                return Err(DefError::Invalid {
                    key: uri_key,
                    why: format!("'{uri}': an amqp:// URI (amqps is not supported yet)"),
                });
            }
            Ok(Endpoint::Amqp { uri, target })
        }
        "mqtt" => {
            let uri = uri_of(v, uri_key)?;
            if !uri.starts_with("mqtt://") {
                return Err(DefError::Invalid {
                    key: uri_key,
                    why: format!("'{uri}': an mqtt:// URI"),
                });
            }
            let topic = str_of(v, k("src-topic", "dest-topic"))?;
            if side == Side::Src && topic.is_none() {
                return Err(DefError::Missing("src-topic"));
            }
            Ok(Endpoint::Mqtt {
                uri,
                topic,
                qos: qos_of(v, k("src-qos", "dest-qos"))?,
            })
        }
        "nats" => {
            let uri = uri_of(v, uri_key)?;
            if !uri.starts_with("nats://") {
                return Err(DefError::Invalid {
                    key: uri_key,
                    why: format!("'{uri}': a nats:// URI"),
                });
            }
            let subject = str_of(v, k("src-subject", "dest-subject"))?;
            let stream = str_of(v, k("src-stream", "dest-stream"))?;
            let consumer = if side == Side::Src {
                str_of(v, "src-consumer")?
            } else {
                None
            };
            if side == Side::Src {
                match (&stream, &consumer) {
                    (None, None) if subject.is_none() => {
                        return Err(DefError::Missing("src-subject"))
                    }
                    (Some(_), None) => return Err(DefError::Missing("src-consumer")),
                    (None, Some(_)) => return Err(DefError::Missing("src-stream")),
                    _ => {}
                }
            }
            Ok(Endpoint::Nats {
                uri,
                subject,
                stream,
                consumer,
            })
        }
        other => Err(DefError::Unsupported(format!("protocol '{other}'"))),
    }
}

#[derive(PartialEq, Eq, Clone, Copy)]
enum Side {
    Src,
    Dest,
}

impl ShovelDef {
    /// Checks a parameter value (`{"src-uri": …}`) of a shovel in
    /// `vhost` (the vhost a local URI without a path means).
    pub fn parse(v: &Value, vhost: &str) -> Result<ShovelDef, DefError> {
        if !v.is_object() {
            return Err(DefError::Invalid {
                key: "value",
                why: "expected an object".into(),
            });
        }
        let src = endpoint(v, Side::Src, vhost)?;
        let dest = endpoint(v, Side::Dest, vhost)?;
        let ack_mode = match str_of(v, "ack-mode")?.as_deref() {
            None | Some("on-confirm") => AckMode::OnConfirm,
            Some("on-publish") => AckMode::OnPublish,
            Some("no-ack") => AckMode::NoAck,
            Some(other) => {
                return Err(DefError::Invalid {
                    key: "ack-mode",
                    why: format!("'{other}': on-confirm, on-publish or no-ack"),
                })
            }
        };
        let prefetch = match num_of(v, "src-prefetch-count")?.or(num_of(v, "prefetch-count")?) {
            None => 1000,
            Some(0) => {
                return Err(DefError::Invalid {
                    key: "src-prefetch-count",
                    why: "must be at least 1".into(),
                })
            }
            Some(n) => n.min(u64::from(MAX_PREFETCH)) as u16,
        };
        let da_key = if v.get("src-delete-after").is_some() {
            "src-delete-after"
        } else {
            "delete-after"
        };
        let delete_after = match v.get(da_key) {
            None | Some(Value::Null) => DeleteAfter::Never,
            Some(Value::String(s)) if s == "never" => DeleteAfter::Never,
            Some(Value::String(s)) if s == "queue-length" => DeleteAfter::QueueLength,
            Some(_) => match num_of(v, da_key)? {
                Some(n) => DeleteAfter::Count(n),
                None => DeleteAfter::Never,
            },
        };
        if delete_after == DeleteAfter::QueueLength
            && !matches!(
                src,
                Endpoint::Local { .. }
                    | Endpoint::Amqp {
                        target: Target::Queue(_),
                        ..
                    }
            )
        {
            return Err(DefError::Invalid {
                key: "src-delete-after",
                why: "queue-length needs a source queue".into(),
            });
        }
        let reconnect_delay = match v.get("reconnect-delay") {
            None | Some(Value::Null) => Duration::from_secs(5),
            Some(Value::Number(n)) => match n.as_f64() {
                Some(s) if (0.0..=3600.0).contains(&s) => Duration::from_secs_f64(s),
                _ => {
                    return Err(DefError::Invalid {
                        key: "reconnect-delay",
                        why: format!("{n}: seconds, 0 to 3600"),
                    })
                }
            },
            Some(other) => {
                return Err(DefError::Invalid {
                    key: "reconnect-delay",
                    why: format!("expected seconds, got {other}"),
                })
            }
        };
        Ok(ShovelDef {
            src,
            dest,
            ack_mode,
            prefetch,
            delete_after,
            reconnect_delay,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rabbitmq_dynamic_shovel_parses() {
        let d = ShovelDef::parse(
            &json!({
                "src-protocol": "amqp091", "src-uri": "amqp://guest:guest@rabbit:5672/%2F",
                "src-queue": "orders", "dest-protocol": "amqp091", "dest-uri": "amqp://",
                "dest-queue": "orders", "ack-mode": "on-confirm",
                "src-prefetch-count": 500, "src-delete-after": "queue-length",
                "reconnect-delay": 2
            }),
            "prod",
        )
        .expect("parses");
        assert_eq!(
            d.src,
            Endpoint::Amqp {
                uri: "amqp://guest:guest@rabbit:5672/%2F".into(),
                target: Target::Queue("orders".into())
            }
        );
        assert_eq!(
            d.dest,
            Endpoint::Local {
                vhost: "prod".into(),
                target: Target::Queue("orders".into())
            }
        );
        assert_eq!(d.prefetch, 500);
        assert_eq!(d.delete_after, DeleteAfter::QueueLength);
        assert_eq!(d.reconnect_delay, Duration::from_secs(2));
    }

    #[test]
    fn local_uri_names_a_vhost() {
        assert_eq!(local_vhost("amqp://", "v").as_deref(), Some("v"));
        assert_eq!(local_vhost("amqp:///%2F", "v").as_deref(), Some("/"));
        assert_eq!(local_vhost("amqp:///other", "v").as_deref(), Some("other"));
        assert_eq!(local_vhost("amqp://host/other", "v"), None);
    }

    #[test]
    fn bad_values_are_refused() {
        let base = json!({"src-uri": "amqp://", "src-queue": "a", "dest-uri": "amqp://h", "dest-queue": "b"});
        assert!(ShovelDef::parse(&base, "/").is_ok());
        for (k, v) in [
            ("ack-mode", json!("sometimes")),
            ("src-prefetch-count", json!(0)),
            ("reconnect-delay", json!("soon")),
            ("src-delete-after", json!("later")),
        ] {
            let mut b = base.clone();
            b[k] = v;
            assert!(ShovelDef::parse(&b, "/").is_err(), "{k} accepted");
        }
        assert_eq!(
            ShovelDef::parse(&json!({"src-uri": "amqp://"}), "/"),
            Err(DefError::Missing("src-queue"))
        );
    }
}
