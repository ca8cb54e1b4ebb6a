//! OpenTelemetry export of the broker's tracing spans (cargo feature
//! `otel`, off by default): the connection spans (`amqp`, `mqtt`: peer,
//! user, vhost) and whatever else the log filter lets through, sent over
//! OTLP/HTTP (protobuf) to `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`). The exporter reads the other
//! standard `OTEL_EXPORTER_OTLP_*` variables itself (headers, timeout).
//! Without an endpoint nothing is exported and nothing is started.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;

/// Keeps the exporter running; dropping it flushes the spans still queued.
pub struct OtelGuard(SdkTracerProvider);

impl Drop for OtelGuard {
    fn drop(&mut self) {
        if let Err(e) = self.0.shutdown() {
            eprintln!("weir: flushing OpenTelemetry spans failed: {e}");
        }
    }
}

/// The tracing layer exporting spans, if an OTLP endpoint is configured;
/// an error names why the exporter could not be built.
pub fn layer<S>() -> Result<Option<(impl tracing_subscriber::Layer<S>, OtelGuard)>, String>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let configured = [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    if !configured {
        return Ok(None);
    }
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| e.to_string())?;
    // Spans are batched and sent from the SDK's own thread, off the runtime.
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("weir")
                .build(),
        )
        .build();
    let tracer = provider.tracer("weir");
    Ok(Some((
        tracing_opentelemetry::layer().with_tracer(tracer),
        OtelGuard(provider),
    )))
}
