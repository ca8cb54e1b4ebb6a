//! Where a stream consumer starts, and RabbitMQ's duration texts.

/// Where a consumer of a stream starts (`x-stream-offset`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffsetSpec {
    /// The first event still retained.
    First,
    /// The newest event (Weir starts at the last event; RabbitMQ at the
    /// start of the last chunk it wrote).
    Last,
    /// Only events published after the consume (the default).
    Next,
    /// This offset (per partition).
    Offset(u64),
    /// The first event published at or after this time (ms since the
    /// epoch). An AMQP timestamp is in seconds.
    Timestamp(u64),
    /// The first event published at most this long ago (ms): an interval
    /// string such as `1h` or `30m`.
    Ago(u64),
}

/// An `x-stream-offset` text Weir cannot read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid x-stream-offset '{0}'")]
pub struct OffsetSpecError(pub String);

impl OffsetSpec {
    /// Reads the string forms: `first`, `last`, `next`, or an interval
    /// (`30s`, `10m`, `1h`, `2D`, `1M`, `1Y`, as RabbitMQ reads them).
    pub fn parse(text: &str) -> Result<OffsetSpec, OffsetSpecError> {
        match text {
            "first" => Ok(OffsetSpec::First),
            "last" => Ok(OffsetSpec::Last),
            "next" => Ok(OffsetSpec::Next),
            _ => parse_age(text)
                .map(OffsetSpec::Ago)
                .ok_or_else(|| OffsetSpecError(text.to_string())),
        }
    }
}

/// A RabbitMQ duration (`x-max-age`, interval offsets) in ms: a number and
/// one unit among `Y` (365 days), `M` (30 days), `D`, `h`, `m`, `s`.
pub fn parse_age(text: &str) -> Option<u64> {
    let unit = text.chars().last()?;
    let n: u64 = text[..text.len() - unit.len_utf8()].parse().ok()?;
    let ms: u64 = match unit {
        'Y' => 365 * 86_400_000,
        'M' => 30 * 86_400_000,
        'D' => 86_400_000,
        'h' => 3_600_000,
        'm' => 60_000,
        's' => 1_000,
        _ => return None,
    };
    n.checked_mul(ms)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offset_texts_and_ages_read_as_rabbitmq_reads_them() {
        assert_eq!(OffsetSpec::parse("first"), Ok(OffsetSpec::First));
        assert_eq!(OffsetSpec::parse("last"), Ok(OffsetSpec::Last));
        assert_eq!(OffsetSpec::parse("next"), Ok(OffsetSpec::Next));
        assert_eq!(OffsetSpec::parse("1h"), Ok(OffsetSpec::Ago(3_600_000)));
        assert_eq!(OffsetSpec::parse("30m"), Ok(OffsetSpec::Ago(1_800_000)));
        assert_eq!(OffsetSpec::parse("2D"), Ok(OffsetSpec::Ago(172_800_000)));
        assert!(OffsetSpec::parse("soon").is_err());
        assert!(OffsetSpec::parse("h").is_err());
        assert!(OffsetSpec::parse("").is_err());
        assert_eq!(parse_age("7D"), Some(604_800_000));
        assert_eq!(parse_age("10s"), Some(10_000));
        assert_eq!(parse_age("10x"), None);
        assert_eq!(parse_age("-1h"), None);
    }
}
