//! Helpers shared by the black-box tests, by concern:
//!
//! * [`broker`]: start, stop, restart and read the log of the real `weir`
//!   binary ([`Broker`], [`weir_command`], [`run_weir_to_exit`]);
//! * [`clients`]: lapin conveniences ([`connect`], [`publish_confirmed`],
//!   [`assert_code`], …);
//! * [`raw`]: a tiny raw AMQP 0-9-1 client for frames no well-behaved client
//!   would send;
//! * [`http`]: a minimal HTTP client for the management API tests;
//! * [`hardening`]: what the `hardening_*` tests share (memory, tmpfs, …).
//!
//! The first two are re-exported here, so `use weir_tests::*;` brings them in.
//!
//! The tests need the broker binary: build it first with
//! `cargo build -p weir-gateway` (then `cargo nextest run -p weir-tests`).
//! The binary is looked up as `$WEIR_BIN`, else
//! `$CARGO_TARGET_DIR/debug/weir`, else `<workspace>/target/debug/weir`.
//! Which behaviour is tested where (engine in process, black box,
//! conformance): `tests/README.md`.

use std::time::Duration;

pub use futures_lite::StreamExt;
pub use lapin;

pub mod broker;
pub mod clients;
pub mod external;
pub mod hardening;
pub mod http;
pub mod raw;

pub use broker::*;
pub use clients::*;

/// How long the broker gets to become ready or to exit.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Generic bound for anything a test awaits from the broker.
pub const OP_TIMEOUT: Duration = Duration::from_secs(15);
