//! Engine errors. Protocol-neutral kinds; each adapter maps them to its own
//! codes (AMQP reply codes, MQTT reason codes, HTTP statuses).

use weir_backend::StoreError;

/// Why an engine operation failed. The text follows RabbitMQ's wording.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// No such exchange, queue or binding.
    #[error("NOT_FOUND - {0}")]
    NotFound(String),
    /// Not permitted (reserved names, the default exchange, internal exchanges).
    #[error("ACCESS_REFUSED - {0}")]
    AccessRefused(String),
    /// An exclusive queue of another connection.
    #[error("RESOURCE_LOCKED - {0}")]
    ResourceLocked(String),
    /// A declare that does not match, a delete whose condition fails, an unknown tag.
    #[error("PRECONDITION_FAILED - {0}")]
    PreconditionFailed(String),
    /// A request that is invalid whatever the state (unknown exchange type).
    #[error("COMMAND_INVALID - {0}")]
    CommandInvalid(String),
    /// A feature that does not exist.
    #[error("NOT_IMPLEMENTED - {0}")]
    NotImplemented(String),
    /// A tenant limit was reached (`[[tenants]]` quotas). The text starts
    /// with the AMQP code RabbitMQ uses for that limit.
    #[error("{code} - {0}", code = quota_code(.0))]
    Quota(#[from] weir_quota::QuotaError),
    /// The store failed; nothing further is acknowledged.
    #[error("INTERNAL_ERROR - store: {0}")]
    Store(#[from] StoreError),
}

/// The AMQP reply-code name RabbitMQ answers a limit with: NOT_ALLOWED for
/// connections (at connection.open), PRECONDITION_FAILED for the rest
/// (channel errors).
pub fn quota_code(e: &weir_quota::QuotaError) -> &'static str {
    use weir_quota::QuotaError::*;
    match e {
        Connections { .. } | UserConnections { .. } => "NOT_ALLOWED",
        Queues { .. } | Exchanges { .. } | Consumers { .. } | MessageSize { .. } => {
            "PRECONDITION_FAILED"
        }
    }
}

/// Shorthand.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

/// Why a [`crate::client::Client`] operation failed, beyond the engine's
/// own errors: what a protocol maps to its codes.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// An engine error (queue not found, exclusive use, store failure…).
    #[error(transparent)]
    Engine(#[from] EngineError),
    /// A settle named a delivery tag that is not outstanding in its scope.
    #[error("unknown delivery tag {0}")]
    UnknownTag(u64),
    /// A subscription tag already in use in its scope.
    #[error("attempt to reuse consumer tag '{0}'")]
    TagInUse(String),
    /// A message could not be read back from the store (it was dropped).
    #[error("message unreadable from the store")]
    Unreadable,
}
