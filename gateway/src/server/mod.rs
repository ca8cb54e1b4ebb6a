//! Starting and stopping the broker, and what every connection shares.
//!
//! * `services`: [`Services`], the engine and everything the sessions and
//!   the HTTP API share; the resource [`Alarms`].
//! * `login`: logins behind the login throttle.
//! * `monitors`: the memory and disk monitors that set the alarms, heap
//!   trims.
//! * `listeners`: the protocol listeners (one table, one accept loop) and
//!   the [`Door`] a protocol implements to be served on them.
//! * `lifecycle`: [`Broker`]: open the store, recover, listen, serve,
//!   shut down.

mod lifecycle;
mod listeners;
mod login;
mod monitors;
mod services;

pub use lifecycle::{shutdown_signal, Broker, ServerError};
pub use listeners::Door;
pub use monitors::pin_mmap_threshold;
pub(crate) use monitors::resident_bytes;
pub use services::{Alarms, Services};
