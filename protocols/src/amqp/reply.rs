//! AMQP 0-9-1 reply codes (spec 1.2, as RabbitMQ uses them).
//!
//! Soft errors (3xx, 4xx) close a channel; hard errors (5xx, 320) close the
//! connection.

/// Success, used in close.
pub const REPLY_SUCCESS: u16 = 200;
/// The message was too large.
pub const CONTENT_TOO_LARGE: u16 = 311;
/// Mandatory message could not be routed (basic.return).
pub const NO_ROUTE: u16 = 312;
/// Immediate message had no consumer (basic.return).
pub const NO_CONSUMERS: u16 = 313;
/// The server is going away (connection).
pub const CONNECTION_FORCED: u16 = 320;
/// Invalid virtual host path (connection).
pub const INVALID_PATH: u16 = 402;
/// Permission denied (channel).
pub const ACCESS_REFUSED: u16 = 403;
/// No such entity (channel).
pub const NOT_FOUND: u16 = 404;
/// Entity in use by an exclusive owner (channel).
pub const RESOURCE_LOCKED: u16 = 405;
/// A precondition failed (channel).
pub const PRECONDITION_FAILED: u16 = 406;
/// Malformed frame (connection).
pub const FRAME_ERROR: u16 = 501;
/// Malformed method fields (connection).
pub const SYNTAX_ERROR: u16 = 502;
/// Method not valid here (connection).
pub const COMMAND_INVALID: u16 = 503;
/// Bad channel usage (connection).
pub const CHANNEL_ERROR: u16 = 504;
/// Frame out of sequence (connection).
pub const UNEXPECTED_FRAME: u16 = 505;
/// Server lacks resources (connection).
pub const RESOURCE_ERROR: u16 = 506;
/// Not allowed by server policy (connection).
pub const NOT_ALLOWED: u16 = 530;
/// Not implemented (connection).
pub const NOT_IMPLEMENTED: u16 = 540;
/// Internal error (connection).
pub const INTERNAL_ERROR: u16 = 541;

/// The symbolic name RabbitMQ puts in front of a reply text.
pub fn name(code: u16) -> &'static str {
    match code {
        REPLY_SUCCESS => "REPLY_SUCCESS",
        CONTENT_TOO_LARGE => "CONTENT_TOO_LARGE",
        NO_ROUTE => "NO_ROUTE",
        NO_CONSUMERS => "NO_CONSUMERS",
        CONNECTION_FORCED => "CONNECTION_FORCED",
        INVALID_PATH => "INVALID_PATH",
        ACCESS_REFUSED => "ACCESS_REFUSED",
        NOT_FOUND => "NOT_FOUND",
        RESOURCE_LOCKED => "RESOURCE_LOCKED",
        PRECONDITION_FAILED => "PRECONDITION_FAILED",
        FRAME_ERROR => "FRAME_ERROR",
        SYNTAX_ERROR => "SYNTAX_ERROR",
        COMMAND_INVALID => "COMMAND_INVALID",
        CHANNEL_ERROR => "CHANNEL_ERROR",
        UNEXPECTED_FRAME => "UNEXPECTED_FRAME",
        RESOURCE_ERROR => "RESOURCE_ERROR",
        NOT_ALLOWED => "NOT_ALLOWED",
        NOT_IMPLEMENTED => "NOT_IMPLEMENTED",
        _ => "INTERNAL_ERROR",
    }
}

/// True for codes that close the connection rather than the channel.
pub fn is_hard(code: u16) -> bool {
    code == CONNECTION_FORCED || code >= 500 || code == INVALID_PATH
}
