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
}

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
        Ok(a)
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
}
