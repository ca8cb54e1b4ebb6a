//! How the broker's log lines look (`log_format`, `--log-format`,
//! `WEIR_LOG_FORMAT`): `text`, tracing's human-readable lines, coloured
//! only when stdout is a terminal (a file, a pipe or journald gets no
//! escape codes); or `json`, one JSON object per line for log shippers.
//!
//! A JSON line is
//! `{"timestamp":…,"level":"INFO","target":…,"message":…,"fields":{…},"spans":[{"name":…,…}]}`:
//! the event's message, its other fields (strings, numbers and booleans
//! as JSON values, anything else as its `Debug` text) and the fields of
//! the spans it happened in, outermost first. Every line is one object,
//! whatever the values hold: JSON escapes newlines.

use serde::Deserialize;
use serde_json::{Map, Value};
use std::fmt;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::time::{FormatTime, SystemTime};
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// The format of log lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    /// tracing's text lines; ANSI colours only on a terminal.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

impl std::str::FromStr for LogFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(format!(
                "log_format must be \"text\" or \"json\", not {other:?}"
            )),
        }
    }
}

/// The fmt layer for `format`, writing to stdout.
pub fn layer<S>(format: LogFormat) -> Box<dyn tracing_subscriber::Layer<S> + Send + Sync>
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync,
{
    use std::io::IsTerminal as _;
    use tracing_subscriber::Layer as _;
    match format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_target(false)
            // Escape codes are for terminals: in a file or a pipe they are
            // noise a log shipper would have to strip.
            .with_ansi(std::io::stdout().is_terminal())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .with_ansi(false)
            .fmt_fields(JsonFields)
            .event_format(JsonLines)
            .boxed(),
    }
}

/// Collects fields as JSON values.
struct Collect<'a>(&'a mut Map<String, Value>);

impl Visit for Collect<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_i64(&mut self, field: &Field, value: i64) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_u64(&mut self, field: &Field, value: u64) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_bool(&mut self, field: &Field, value: bool) {
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_f64(&mut self, field: &Field, value: f64) {
        // NaN and infinities have no JSON number: null.
        self.0.insert(field.name().into(), Value::from(value));
    }
    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        self.0
            .insert(field.name().into(), Value::from(value.to_string()));
    }
    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        self.0
            .insert(field.name().into(), Value::from(format!("{value:?}")));
    }
}

/// Span fields kept as a JSON object's text (in the span's extensions), so
/// [`JsonLines`] can put them in the line as values.
pub struct JsonFields;

impl<'w> FormatFields<'w> for JsonFields {
    fn format_fields<R: tracing_subscriber::field::RecordFields>(
        &self,
        mut writer: Writer<'w>,
        fields: R,
    ) -> fmt::Result {
        let mut map = Map::new();
        fields.record(&mut Collect(&mut map));
        writer.write_str(&Value::Object(map).to_string())
    }

    fn add_fields(
        &self,
        current: &'w mut FormattedFields<Self>,
        fields: &tracing::span::Record<'_>,
    ) -> fmt::Result {
        // Fields recorded later (a span's `Empty` fields filled in at
        // login) are merged into the object, not appended after it.
        let mut map = match serde_json::from_str::<Value>(&current.fields) {
            Ok(Value::Object(m)) => m,
            _ => Map::new(),
        };
        fields.record(&mut Collect(&mut map));
        current.fields = Value::Object(map).to_string();
        Ok(())
    }
}

/// The JSON event format: one object per line.
pub struct JsonLines;

impl<S, N> FormatEvent<S, N> for JsonLines
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        let meta = event.metadata();
        let mut line = Map::new();
        let mut timestamp = String::new();
        SystemTime.format_time(&mut Writer::new(&mut timestamp))?;
        line.insert("timestamp".into(), Value::from(timestamp));
        line.insert("level".into(), Value::from(meta.level().as_str()));
        line.insert("target".into(), Value::from(meta.target()));
        let mut fields = Map::new();
        event.record(&mut Collect(&mut fields));
        if let Some(message) = fields.remove("message") {
            line.insert("message".into(), message);
        }
        if !fields.is_empty() {
            line.insert("fields".into(), Value::Object(fields));
        }
        if let Some(scope) = ctx.event_scope() {
            let mut spans = Vec::new();
            for span in scope.from_root() {
                let mut obj = Map::new();
                obj.insert("name".into(), Value::from(span.name()));
                let ext = span.extensions();
                if let Some(f) = ext.get::<FormattedFields<N>>() {
                    if let Ok(Value::Object(m)) = serde_json::from_str::<Value>(&f.fields) {
                        obj.extend(m);
                    }
                }
                spans.push(Value::Object(obj));
            }
            if !spans.is_empty() {
                line.insert("spans".into(), Value::Array(spans));
            }
        }
        writeln!(writer, "{}", Value::Object(line))
    }
}
