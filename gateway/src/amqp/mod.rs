//! AMQP 0-9-1 sessions: the glue between the sans-IO adapter in
//! `weir-protocols` and the engine's per-client interface
//! ([`crate::engine::Client`]).
//!
//! * [`session`]: the session adapter run by the session driver (method
//!   handlers by class, delivery encoding, queued replies).
//! * [`headers`]: AMQP's basic property block ⇄ the engine's properties
//!   (the AMQP header codec, number 1), field tables to engine arguments.
//! * [`Amqp`]: how the listeners hand it a connection.

pub mod headers;
pub mod session;

use crate::server::{Door, Services};
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::net::TcpStream;
use tokio::sync::watch;

/// AMQP 0-9-1 on its listeners (`[amqp] listen`, and `tls_listen` for
/// AMQPS).
pub struct Amqp;

impl Door for Amqp {
    type Slot = ();

    fn admit(_: &Services) -> Option<()> {
        Some(())
    }

    fn serve(
        stream: TcpStream,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        session::serve(stream, peer, services, shutdown)
    }

    fn serve_tls(
        stream: crate::tls::TlsStream,
        identity: crate::tls::PeerIdentity,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl std::future::Future<Output = ()> + Send + 'static {
        session::serve_tls(stream, peer, identity, services, shutdown)
    }
}
