//! Queue arguments (`x-…`), parsed and checked once at declare.
//!
//! The names, types and ranges are RabbitMQ's, so existing declares and
//! policies keep working; a value of the wrong type or out of range is
//! refused with PRECONDITION_FAILED (406) as RabbitMQ refuses it. Unknown
//! `x-` arguments are kept and ignored, as RabbitMQ does.
//!
//! [`QueueArgs`] is what a queue acts on: its declared arguments with the
//! matching policy's definition under them ([`QueueArgs::under_policy`];
//! an argument wins over a policy).

use serde_json::Value;

/// Default idempotency window (`x-dedup-window`): two minutes.
pub const DEFAULT_DEDUP_WINDOW_MS: u64 = 120_000;

/// Default delivery limit of `x-queue-type: quorum` queues (RabbitMQ 4).
pub const QUORUM_DEFAULT_DELIVERY_LIMIT: u32 = 20;

/// Most partitions a queue may have (`x-partitions`).
pub const MAX_PARTITIONS: u16 = 256;

/// What a queue does when a publish would take it past a length limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overflow {
    /// Drops (dead-letters) messages from the head to make room.
    #[default]
    DropHead,
    /// Refuses the publish (nacked with confirms).
    RejectPublish,
    /// Refuses the publish and dead-letters it.
    RejectPublishDlx,
}

/// Which returns are retried after a delay (`x-delayed-retry-type`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RetryType {
    /// Every return: rejected/nacked with requeue, and returned because the
    /// consumer went away.
    All,
    /// Only explicit rejections with requeue.
    Failed,
    /// Only returns of a consumer that went away (channel or connection
    /// closed, consumer timeout).
    Returned,
}

/// Delayed retries of requeued messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DelayedRetry {
    /// Which returns are delayed.
    pub kind: RetryType,
    /// Delay of the first retry (ms).
    pub min_ms: u64,
    /// Largest delay (ms); the delay doubles per attempt up to it.
    pub max_ms: u64,
}

impl DelayedRetry {
    /// The delay before attempt `attempts + 1`, given `attempts` made.
    pub fn delay_ms(&self, attempts: u32) -> u64 {
        let shift = attempts.saturating_sub(1).min(63);
        self.min_ms
            .saturating_mul(1u64.checked_shl(shift).unwrap_or(u64::MAX))
            .min(self.max_ms)
    }
}

/// The queue type (`x-queue-type`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum QueueType {
    /// `classic` (the default).
    #[default]
    Classic,
    /// `quorum`: same engine; differs only in defaults (delivery limit 20).
    Quorum,
    /// `stream`: an append-only log read by offset (`crate::stream`).
    Stream,
}

/// A queue's arguments as it acts on them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueArgs {
    /// `x-queue-type`.
    pub queue_type: QueueType,
    /// `x-message-ttl` (ms).
    pub message_ttl: Option<u64>,
    /// `x-expires` (ms): deleted after being unused this long.
    pub expires: Option<u64>,
    /// `x-max-length` (messages).
    pub max_length: Option<u64>,
    /// `x-max-length-bytes` (bodies and properties).
    pub max_length_bytes: Option<u64>,
    /// `x-overflow`.
    pub overflow: Overflow,
    /// `x-dead-letter-exchange` ("" is the default exchange).
    pub dead_letter_exchange: Option<String>,
    /// `x-dead-letter-routing-key`.
    pub dead_letter_routing_key: Option<String>,
    /// `x-delivery-limit`: deliveries after which a returned message is
    /// dead-lettered (or dropped). None = no limit.
    pub delivery_limit: Option<u32>,
    /// `x-max-priority` (0–255; 0 is one level, as without it).
    pub max_priority: Option<u8>,
    /// `x-single-active-consumer`.
    pub single_active_consumer: bool,
    /// `x-delayed-retry-type` / `-min` / `-max`.
    pub delayed_retry: Option<DelayedRetry>,
    /// `x-delayed`: honour the `x-delay` header of messages published here.
    pub delayed: bool,
    /// `x-partitions` (≥ 1).
    pub partitions: u16,
    /// `x-dedup-on-message-id`: `message-id` is the idempotency key.
    pub dedup_on_message_id: bool,
    /// `x-dedup-window` (ms).
    pub dedup_window_ms: u64,
    /// `x-dead-letter-strategy: at-least-once` (quorum queues). Accepted
    /// and kept; Weir's dead-lettering is the same for both strategies
    /// (see docs/compatibility.md).
    pub dead_letter_at_least_once: bool,
    /// `x-max-age` (streams, ms): events older than this are dropped, a
    /// whole chunk at a time.
    pub max_age_ms: Option<u64>,
    /// `x-stream-max-segment-size-bytes` (streams): accepted as RabbitMQ
    /// accepts it; Weir caps its chunks by it.
    pub stream_segment_bytes: Option<u64>,
}

/// Arguments RabbitMQ 3.10 knows for quorum queues only: a classic queue
/// declared with one is refused ("of queue type rabbit_classic_queue").
pub const QUORUM_ONLY: &[&str] = &[
    "x-quorum-initial-group-size",
    "x-queue-leader-locator",
    "x-dead-letter-strategy",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
];

/// Arguments RabbitMQ 3.10 knows for classic queues only: a quorum queue
/// declared with one is refused ("of queue type rabbit_quorum_queue").
pub const CLASSIC_ONLY: &[&str] = &[
    "x-max-priority",
    "x-queue-mode",
    "x-queue-master-locator",
    "x-queue-version",
];

/// Arguments RabbitMQ 3.10 refuses on a stream (every queue argument it
/// knows outside a stream's capabilities: `x-max-length-bytes`,
/// `x-max-age`, `x-stream-max-segment-size-bytes`,
/// `x-initial-cluster-size`, `x-queue-leader-locator`).
pub const STREAM_REFUSED: &[&str] = &[
    "x-max-priority",
    "x-queue-mode",
    "x-queue-master-locator",
    "x-queue-version",
    "x-quorum-initial-group-size",
    "x-dead-letter-strategy",
    "x-max-in-memory-length",
    "x-max-in-memory-bytes",
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-delivery-limit",
    "x-single-active-consumer",
];

/// Why an argument was refused; the text is RabbitMQ's shape.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid arg '{arg}': {reason}")]
pub struct ArgError {
    /// The argument.
    pub arg: &'static str,
    /// `{unacceptable_type,…}` or `{value_out_of_range,…}` or a sentence.
    pub reason: String,
}

impl ArgError {
    /// The full message for queue `queue` in tenant `vhost`.
    pub fn message(&self, queue: &str, vhost: &str) -> String {
        format!(
            "invalid arg '{}' for queue '{queue}' in vhost '{vhost}': {}",
            self.arg, self.reason
        )
    }
}

fn type_name(v: &Value) -> &'static str {
    match v {
        Value::String(_) => "longstr",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "double",
        Value::Number(_) => "long",
        Value::Array(_) => "array",
        Value::Object(_) => "table",
        Value::Null => "void",
    }
}

fn unacceptable(arg: &'static str, v: &Value) -> ArgError {
    ArgError {
        arg,
        reason: format!("{{unacceptable_type,{}}}", type_name(v)),
    }
}

fn out_of_range(arg: &'static str, v: &Value) -> ArgError {
    ArgError {
        arg,
        reason: format!("{{value_out_of_range,{v}}}"),
    }
}

/// A non-negative integer no larger than `max`.
fn int(arg: &'static str, v: &Value, min: i64, max: u64) -> Result<u64, ArgError> {
    let Value::Number(n) = v else {
        return Err(unacceptable(arg, v));
    };
    if n.is_f64() {
        return Err(unacceptable(arg, v));
    }
    match n.as_i64() {
        Some(i) if i >= min && (i as u64) <= max => Ok(i as u64),
        None if n.as_u64().is_some_and(|u| u <= max) => Ok(n.as_u64().unwrap_or(max)),
        _ => Err(out_of_range(arg, v)),
    }
}

/// RabbitMQ's `check_non_neg_int_arg` and friends: an integer, with its
/// own error texts for the wrong type and for a negative (or, when
/// `zero_ok` is false, zero) value.
fn rabbit_int(arg: &'static str, v: &Value, zero_ok: bool) -> Result<u64, ArgError> {
    let n = match v {
        Value::Number(n) if !n.is_f64() => n,
        _ => {
            return Err(ArgError {
                arg,
                reason: format!("\"expected integer, got {}\"", type_name(v)),
            })
        }
    };
    match n.as_i64() {
        Some(i) if i < 0 => Err(ArgError {
            arg,
            reason: format!("{{value_negative,{i}}}"),
        }),
        Some(0) if !zero_ok => Err(ArgError {
            arg,
            reason: "{value_zero,0}".into(),
        }),
        _ => Ok(n.as_u64().unwrap_or(u64::MAX)),
    }
}

/// A string among `known`; else `unknown(value)` is the reason.
fn one_of(
    arg: &'static str,
    v: &Value,
    known: &[&str],
    unknown: impl FnOnce(&str) -> String,
) -> Result<(), ArgError> {
    let s = string(arg, v)?;
    if known.contains(&s) {
        Ok(())
    } else {
        Err(ArgError {
            arg,
            reason: unknown(s),
        })
    }
}

fn string<'a>(arg: &'static str, v: &'a Value) -> Result<&'a str, ArgError> {
    v.as_str().ok_or_else(|| unacceptable(arg, v))
}

fn boolean(arg: &'static str, v: &Value) -> Result<bool, ArgError> {
    v.as_bool().ok_or_else(|| unacceptable(arg, v))
}

impl QueueArgs {
    /// Parses and checks a declare's arguments (a JSON object; anything
    /// else counts as no arguments).
    pub fn parse(arguments: &Value) -> Result<QueueArgs, ArgError> {
        let mut a = QueueArgs {
            partitions: 1,
            dedup_window_ms: DEFAULT_DEDUP_WINDOW_MS,
            ..QueueArgs::default()
        };
        let Some(map) = arguments.as_object() else {
            return Ok(a);
        };
        let get = |k: &str| map.get(k).filter(|v| !v.is_null());
        if let Some(v) = get("x-queue-type") {
            a.queue_type = match string("x-queue-type", v)? {
                "classic" => QueueType::Classic,
                "quorum" => QueueType::Quorum,
                "stream" => QueueType::Stream,
                other => {
                    return Err(ArgError {
                        arg: "x-queue-type",
                        reason: format!("unsupported queue type '{other}'"),
                    })
                }
            };
        }
        const MAX_MS: u64 = u32::MAX as u64;
        if let Some(v) = get("x-message-ttl") {
            a.message_ttl = Some(int("x-message-ttl", v, 0, MAX_MS)?);
        }
        if let Some(v) = get("x-expires") {
            a.expires = Some(int("x-expires", v, 1, MAX_MS)?);
        }
        if let Some(v) = get("x-max-length") {
            a.max_length = Some(int("x-max-length", v, 0, i64::MAX as u64)?);
        }
        if let Some(v) = get("x-max-length-bytes") {
            a.max_length_bytes = Some(int("x-max-length-bytes", v, 0, i64::MAX as u64)?);
        }
        if let Some(v) = get("x-overflow") {
            a.overflow = match string("x-overflow", v)? {
                "drop-head" => Overflow::DropHead,
                "reject-publish" => Overflow::RejectPublish,
                "reject-publish-dlx" => Overflow::RejectPublishDlx,
                _ => return Err(out_of_range("x-overflow", v)),
            };
        }
        if let Some(v) = get("x-dead-letter-exchange") {
            a.dead_letter_exchange = Some(string("x-dead-letter-exchange", v)?.to_string());
        }
        if let Some(v) = get("x-dead-letter-routing-key") {
            if a.dead_letter_exchange.is_none() {
                // RabbitMQ: a routing key without an exchange is an error.
                return Err(ArgError {
                    arg: "x-dead-letter-exchange",
                    reason: "Routing key specified but no dead letter exchange".into(),
                });
            }
            a.dead_letter_routing_key = Some(string("x-dead-letter-routing-key", v)?.to_string());
        }
        if let Some(v) = get("x-delivery-limit") {
            // RabbitMQ 4: a negative limit means none.
            let n = int("x-delivery-limit", v, i64::MIN, u32::MAX as u64);
            a.delivery_limit = match (n, v.as_i64()) {
                (Ok(n), _) => Some(n as u32),
                (Err(_), Some(i)) if i < 0 => None,
                (Err(e), _) => return Err(e),
            };
        } else if a.queue_type == QueueType::Quorum {
            a.delivery_limit = Some(QUORUM_DEFAULT_DELIVERY_LIMIT);
        }
        if let Some(v) = get("x-max-priority") {
            // 0 is accepted as RabbitMQ does (one level: a plain queue).
            a.max_priority = Some(int("x-max-priority", v, 0, 255)? as u8);
        }
        if let Some(v) = get("x-single-active-consumer") {
            a.single_active_consumer = boolean("x-single-active-consumer", v)?;
        }
        if let Some(v) = get("x-delayed-retry-type") {
            let kind = match string("x-delayed-retry-type", v)? {
                "all" => RetryType::All,
                "failed" => RetryType::Failed,
                "returned" => RetryType::Returned,
                _ => return Err(out_of_range("x-delayed-retry-type", v)),
            };
            let min_ms = match get("x-delayed-retry-min") {
                Some(v) => int("x-delayed-retry-min", v, 0, MAX_MS)?,
                None => 1_000,
            };
            let max_ms = match get("x-delayed-retry-max") {
                Some(v) => int("x-delayed-retry-max", v, 0, MAX_MS)?,
                None => min_ms.max(60_000),
            };
            if max_ms < min_ms {
                return Err(out_of_range("x-delayed-retry-max", &Value::from(max_ms)));
            }
            a.delayed_retry = Some(DelayedRetry {
                kind,
                min_ms,
                max_ms,
            });
        }
        if let Some(v) = get("x-delayed") {
            a.delayed = boolean("x-delayed", v)?;
        }
        if let Some(v) = get("x-partitions") {
            a.partitions = int("x-partitions", v, 1, u64::from(MAX_PARTITIONS))? as u16;
        }
        if let Some(v) = get("x-dedup-on-message-id") {
            a.dedup_on_message_id = boolean("x-dedup-on-message-id", v)?;
        }
        if let Some(v) = get("x-dedup-window") {
            a.dedup_window_ms = int("x-dedup-window", v, 1, MAX_MS)?;
        }
        // RabbitMQ's arguments for placement, paging and replication: Weir
        // has one node and its own paging, so they change nothing, but they
        // are checked as RabbitMQ 3.10 checks them (texts included).
        if let Some(v) = get("x-queue-mode") {
            one_of("x-queue-mode", v, &["default", "lazy"], |s| {
                format!("\"unsupported queue mode '{s}'\"")
            })?;
        }
        if let Some(v) = get("x-queue-master-locator") {
            // RabbitMQ 3.10 crashes the connection (541) on an unknown one.
            one_of(
                "x-queue-master-locator",
                v,
                &["min-masters", "client-local", "random"],
                |_| "invalid_queue_master_locator".into(),
            )?;
        }
        if let Some(v) = get("x-queue-leader-locator") {
            one_of(
                "x-queue-leader-locator",
                v,
                &["client-local", "balanced", "random", "least-leaders"],
                |_| "invalid_queue_locator_arg".into(),
            )?;
        }
        if let Some(v) = get("x-quorum-initial-group-size") {
            rabbit_int("x-quorum-initial-group-size", v, false)?;
        }
        if let Some(v) = get("x-dead-letter-strategy") {
            one_of(
                "x-dead-letter-strategy",
                v,
                &["at-most-once", "at-least-once"],
                |_| "invalid_dlx_strategy".into(),
            )?;
            a.dead_letter_at_least_once = v.as_str() == Some("at-least-once");
        }
        if let Some(v) = get("x-max-age") {
            let text = string("x-max-age", v)?;
            a.max_age_ms = Some(
                crate::stream::parse_age(text)
                    .filter(|ms| *ms > 0)
                    .ok_or_else(|| ArgError {
                        arg: "x-max-age",
                        reason: format!("{{invalid_max_age,{text}}}"),
                    })?,
            );
        }
        if let Some(v) = get("x-stream-max-segment-size-bytes") {
            a.stream_segment_bytes = Some(int(
                "x-stream-max-segment-size-bytes",
                v,
                1,
                i64::MAX as u64,
            )?);
        }
        if let Some(v) = get("x-initial-cluster-size") {
            rabbit_int("x-initial-cluster-size", v, false)?;
        }
        for arg in ["x-max-in-memory-length", "x-max-in-memory-bytes"] {
            if let Some(v) = get(arg) {
                rabbit_int(arg, v, true)?;
            }
        }
        Ok(a)
    }

    /// The first argument of `arguments` that RabbitMQ refuses for a queue
    /// of type `queue_type` (quorum-only ones on a classic queue and the
    /// reverse), with RabbitMQ's name of the type.
    pub fn wrong_type(arguments: &Value, queue_type: QueueType) -> Option<(&str, &'static str)> {
        let (refused, type_name) = match queue_type {
            QueueType::Classic => (QUORUM_ONLY, "rabbit_classic_queue"),
            QueueType::Quorum => (CLASSIC_ONLY, "rabbit_quorum_queue"),
            QueueType::Stream => (STREAM_REFUSED, "rabbit_stream_queue"),
        };
        let map = arguments.as_object()?;
        map.iter()
            .find(|(k, v)| !v.is_null() && refused.contains(&k.as_str()))
            .map(|(k, _)| (k.as_str(), type_name))
    }

    /// Whether anything beyond plain FIFO delivery is switched on, so the
    /// hot path can skip every check at once.
    pub fn is_plain(&self) -> bool {
        self.message_ttl.is_none()
            && self.max_length.is_none()
            && self.max_length_bytes.is_none()
            && self.dead_letter_exchange.is_none()
            && self.delivery_limit.is_none()
            && self.delayed_retry.is_none()
            && !self.delayed
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn rabbitmq_types_and_ranges() {
        let ok = QueueArgs::parse(&json!({
            "x-message-ttl": 1000, "x-max-length": 10, "x-overflow": "reject-publish",
            "x-dead-letter-exchange": "dlx", "x-dead-letter-routing-key": "dead",
            "x-max-priority": 10, "x-single-active-consumer": true, "x-delivery-limit": 3,
            "x-unknown": "kept"
        }))
        .expect("valid");
        assert_eq!(ok.message_ttl, Some(1000));
        assert_eq!(ok.overflow, Overflow::RejectPublish);
        assert_eq!(ok.max_priority, Some(10));
        assert_eq!(ok.delivery_limit, Some(3));
        for bad in [
            json!({"x-max-priority": "10"}),
            json!({"x-max-priority": -1}),
            json!({"x-max-priority": 256}),
            json!({"x-message-ttl": -1}),
            json!({"x-message-ttl": 1.5}),
            json!({"x-expires": 0}),
            json!({"x-overflow": "sideways"}),
            json!({"x-single-active-consumer": "yes"}),
            json!({"x-dead-letter-routing-key": "k"}),
            json!({"x-partitions": 0}),
        ] {
            assert!(QueueArgs::parse(&bad).is_err(), "{bad} accepted");
        }
        let e = QueueArgs::parse(&json!({"x-max-priority": "x"})).unwrap_err();
        assert_eq!(
            e.message("q", "/"),
            "invalid arg 'x-max-priority' for queue 'q' in vhost '/': {unacceptable_type,longstr}"
        );
    }

    #[test]
    fn quorum_defaults_to_a_delivery_limit_of_20_and_negative_means_none() {
        let q = QueueArgs::parse(&json!({"x-queue-type": "quorum"})).expect("valid");
        assert_eq!(q.delivery_limit, Some(20));
        let q = QueueArgs::parse(&json!({"x-queue-type": "quorum", "x-delivery-limit": -1}))
            .expect("valid");
        assert_eq!(q.delivery_limit, None);
        assert_eq!(
            QueueArgs::parse(&json!({})).expect("valid").delivery_limit,
            None
        );
    }

    #[test]
    fn retry_delay_doubles_between_min_and_max() {
        let r = DelayedRetry {
            kind: RetryType::All,
            min_ms: 100,
            max_ms: 1_000,
        };
        let d: Vec<u64> = (1..=6).map(|a| r.delay_ms(a)).collect();
        assert_eq!(d, vec![100, 200, 400, 800, 1_000, 1_000]);
    }

    #[test]
    fn rabbitmq_placement_and_paging_arguments_are_checked_like_rabbitmq() {
        let reason = |v: Value| QueueArgs::parse(&v).expect_err("refused").reason;
        assert!(QueueArgs::parse(
            &json!({"x-queue-mode": "lazy", "x-queue-master-locator": "min-masters"})
        )
        .is_ok());
        assert_eq!(
            reason(json!({"x-queue-mode": "bogus"})),
            "\"unsupported queue mode 'bogus'\""
        );
        assert_eq!(
            reason(json!({"x-queue-mode": 5})),
            "{unacceptable_type,long}"
        );
        assert_eq!(
            reason(json!({"x-queue-leader-locator": "x"})),
            "invalid_queue_locator_arg"
        );
        assert_eq!(
            reason(json!({"x-quorum-initial-group-size": 0})),
            "{value_zero,0}"
        );
        assert_eq!(
            reason(json!({"x-quorum-initial-group-size": -1})),
            "{value_negative,-1}"
        );
        assert_eq!(
            reason(json!({"x-max-in-memory-length": "x"})),
            "\"expected integer, got longstr\""
        );
        assert_eq!(
            reason(json!({"x-dead-letter-strategy": "x"})),
            "invalid_dlx_strategy"
        );
        let a = QueueArgs::parse(
            &json!({"x-queue-type": "quorum", "x-dead-letter-strategy": "at-least-once"}),
        )
        .expect("valid");
        assert!(a.dead_letter_at_least_once);
        // Each queue type refuses the other's arguments.
        let classic = json!({"x-quorum-initial-group-size": 3});
        assert_eq!(
            QueueArgs::wrong_type(&classic, QueueType::Classic),
            Some(("x-quorum-initial-group-size", "rabbit_classic_queue"))
        );
        assert_eq!(QueueArgs::wrong_type(&classic, QueueType::Quorum), None);
        let quorum = json!({"x-queue-mode": "lazy"});
        assert_eq!(
            QueueArgs::wrong_type(&quorum, QueueType::Quorum),
            Some(("x-queue-mode", "rabbit_quorum_queue"))
        );
    }
}
