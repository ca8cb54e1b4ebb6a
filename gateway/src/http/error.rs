//! Errors as RabbitMQ's management API reports them: a status code and a
//! JSON body `{"error": ..., "reason": ...}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use weir_engine::EngineError;

/// The realm RabbitMQ's management plugin names in `WWW-Authenticate`.
pub const AUTH_REALM: &str = "Basic realm=\"RabbitMQ Management\"";

/// An HTTP error with RabbitMQ's body shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// Status code.
    pub status: StatusCode,
    /// Short category (`"Object Not Found"`, `"bad_request"`, `"not_authorised"`).
    pub error: String,
    /// What went wrong, for a person.
    pub reason: String,
}

impl ApiError {
    /// An error with the given status and texts.
    pub fn new(status: StatusCode, error: impl Into<String>, reason: impl Into<String>) -> Self {
        ApiError {
            status,
            error: error.into(),
            reason: reason.into(),
        }
    }

    /// 404, as RabbitMQ answers for a missing object or path.
    pub fn not_found() -> Self {
        Self::new(StatusCode::NOT_FOUND, "Object Not Found", "Not Found")
    }

    /// 400 with a reason.
    pub fn bad_request(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, "bad_request", reason)
    }

    /// 401: no or wrong credentials (answered with `WWW-Authenticate`).
    pub fn unauthorized(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::UNAUTHORIZED, "not_authorized", reason)
    }

    /// 403: logged in, but the user's tags or vhost permissions do not
    /// allow it.
    pub fn forbidden(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "not_authorised", reason)
    }

    /// 405, for a method a path does not take.
    pub fn method_not_allowed() -> Self {
        Self::new(
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
            "Method Not Allowed",
        )
    }

    /// 500: the store failed.
    pub fn internal(reason: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, "internal_error", reason)
    }
}

impl From<EngineError> for ApiError {
    /// RabbitMQ's statuses for the AMQP errors behind them: a missing object
    /// is 404, a refused permission 403 (RabbitMQ: 401), an inequivalent
    /// redeclare or a bad argument 400 with the AMQP text as the reason.
    fn from(e: EngineError) -> Self {
        let reason = e.to_string();
        match e {
            EngineError::NotFound(_) => ApiError::new(StatusCode::NOT_FOUND, "not_found", reason),
            EngineError::AccessRefused(_) => ApiError::forbidden(reason),
            EngineError::ResourceLocked(_) => ApiError::bad_request(reason),
            EngineError::PreconditionFailed(_)
            | EngineError::CommandInvalid(_)
            | EngineError::NotImplemented(_)
            | EngineError::Quota(_) => ApiError::bad_request(reason),
            EngineError::Store(_) => ApiError::internal(reason),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.error, "reason": self.reason });
        let mut r = (self.status, Json(body)).into_response();
        if self.status == StatusCode::UNAUTHORIZED {
            r.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static(AUTH_REALM),
            );
        }
        r
    }
}

/// The router's fallback: any unknown path is a JSON 404.
pub async fn not_found() -> ApiError {
    ApiError::not_found()
}
