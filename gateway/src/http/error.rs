//! Errors as RabbitMQ's management API reports them: a status code and a
//! JSON body `{"error": ..., "reason": ...}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

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
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({ "error": self.error, "reason": self.reason });
        (self.status, Json(body)).into_response()
    }
}

/// The router's fallback: any unknown path is a JSON 404.
pub async fn not_found() -> ApiError {
    ApiError::not_found()
}
