//! The protocol listeners: one table of sockets, each with the protocol it
//! serves, plain or over TLS, and one accept loop over all of them.
//!
//! A protocol plugs in by implementing [`Door`] (how an accepted plain or
//! TLS connection is served) in its own module and adding its rows to
//! [`table`]. The HTTP listener is not in the table: it has its own accept
//! loop with hyper (`crate::http`).

use super::{ServerError, Services};
use crate::config::Config;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::task::Poll;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// A protocol as the listeners see it: how one accepted connection is
/// served. Each connection runs in its own task, whose future is the
/// protocol's own (a connection of a small protocol does not carry the
/// state of a large one).
pub trait Door: 'static {
    /// Held for the life of the connection, from its accept on (before a
    /// TLS handshake): MQTT counts its sockets against its connection
    /// limit.
    type Slot: Send + 'static;

    /// A slot for a new connection, or `None`: close it at once.
    fn admit(services: &Services) -> Option<Self::Slot>;

    /// Serves a plain TCP connection until it closes.
    fn serve(
        stream: TcpStream,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static;

    /// Serves a TLS connection (handshake done) until it closes.
    fn serve_tls(
        stream: crate::tls::TlsStream,
        identity: crate::tls::PeerIdentity,
        peer: SocketAddr,
        services: Arc<Services>,
        shutdown: watch::Receiver<bool>,
    ) -> impl Future<Output = ()> + Send + 'static;
}

/// What an accepted connection is handed with.
pub(super) struct Accepted<'a> {
    stream: TcpStream,
    peer: SocketAddr,
    services: &'a Arc<Services>,
    shutdown: &'a watch::Receiver<bool>,
    tls: Option<&'a crate::tls::Tls>,
}

/// Starts the task of an accepted connection.
type Spawn = fn(&mut JoinSet<()>, Accepted<'_>);

/// Every protocol listener the broker opens: its name (for logs), its
/// address and how its connections are served. This is where the
/// protocols are wired to sockets; a new one adds its rows.
fn table(cfg: &Config, tls: bool) -> Vec<(&'static str, SocketAddr, Spawn)> {
    use crate::amqp::Amqp;
    use crate::config::{AMQPS_DEFAULT_LISTEN, MQTTS_DEFAULT_LISTEN, MQTT_WSS_DEFAULT_LISTEN};
    use crate::mqtt::{Mqtt, MqttWebSocket};
    let mut t: Vec<(&'static str, SocketAddr, Spawn)> = vec![
        ("AMQP", cfg.amqp.listen, plain::<Amqp>),
        ("MQTT", cfg.mqtt.listen, plain::<Mqtt>),
        ("MQTT WebSocket", cfg.mqtt.ws_listen, plain::<MqttWebSocket>),
    ];
    if tls {
        let or = |a: Option<SocketAddr>, default| a.unwrap_or(default);
        t.extend([
            (
                "AMQPS",
                or(cfg.amqp.tls_listen, AMQPS_DEFAULT_LISTEN),
                secure::<Amqp> as Spawn,
            ),
            (
                "MQTTS",
                or(cfg.mqtt.tls_listen, MQTTS_DEFAULT_LISTEN),
                secure::<Mqtt>,
            ),
            (
                "MQTT secure WebSocket",
                or(cfg.mqtt.wss_listen, MQTT_WSS_DEFAULT_LISTEN),
                secure::<MqttWebSocket>,
            ),
        ]);
    }
    t
}

/// Serves a plain connection of `D`.
fn plain<D: Door>(conns: &mut JoinSet<()>, a: Accepted<'_>) {
    let Some(slot) = D::admit(a.services) else {
        tracing::debug!(peer = %a.peer, "too many connections: closed");
        return;
    };
    let (services, shutdown) = (a.services.clone(), a.shutdown.clone());
    let (stream, peer) = (a.stream, a.peer);
    conns.spawn(async move {
        let _slot = slot;
        D::serve(stream, peer, services, shutdown).await;
    });
}

/// Runs the TLS handshake of a connection of `D` (in its own task, so a
/// slow client holds up no one), then serves it.
fn secure<D: Door>(conns: &mut JoinSet<()>, a: Accepted<'_>) {
    let Some(tls) = a.tls else {
        return;
    };
    // Counted from its accept, before the handshake.
    let Some(slot) = D::admit(a.services) else {
        tracing::debug!(peer = %a.peer, "too many connections: closed");
        return;
    };
    let acceptor = tls.acceptor();
    let (services, shutdown) = (a.services.clone(), a.shutdown.clone());
    let (tcp, peer) = (a.stream, a.peer);
    conns.spawn(async move {
        let _slot = slot;
        let _ = tcp.set_nodelay(true);
        let (stream, identity) = match crate::tls::accept(acceptor, tcp).await {
            Ok(s) => s,
            Err(e) => {
                tracing::info!(%peer, error = %e, "TLS handshake failed");
                return;
            }
        };
        D::serve_tls(stream, identity, peer, services, shutdown).await;
    });
}

/// One bound listener.
struct Listener {
    name: &'static str,
    socket: TcpListener,
    spawn: Spawn,
}

/// The bound protocol listeners, and the certificates of the TLS ones.
pub(super) struct Listeners {
    table: Vec<Listener>,
    tls: Option<Arc<crate::tls::Tls>>,
    /// Where the next accept starts looking (see [`Listeners::accept`]).
    next: usize,
}

impl Listeners {
    /// Binds every listener of [`table`]; the TLS ones with `tls`.
    pub(super) async fn bind(
        cfg: &Config,
        tls: Option<Arc<crate::tls::Tls>>,
    ) -> Result<Self, ServerError> {
        let mut bound = Vec::new();
        for (name, addr, spawn) in table(cfg, tls.is_some()) {
            let socket = TcpListener::bind(addr)
                .await
                .map_err(|source| ServerError::Bind { addr, source })?;
            bound.push(Listener {
                name,
                socket,
                spawn,
            });
        }
        Ok(Listeners {
            table: bound,
            tls,
            next: 0,
        })
    }

    /// The bound address of the listener named `name`.
    pub(super) fn addr(&self, name: &str) -> Option<SocketAddr> {
        let l = self.table.iter().find(|l| l.name == name)?;
        l.socket.local_addr().ok()
    }

    /// Logs every listener's address.
    pub(super) fn log_ready(&self) {
        for l in &self.table {
            if let Ok(addr) = l.socket.local_addr() {
                tracing::info!(%addr, "{} listener ready", l.name);
            }
        }
    }

    /// The next connection accepted by any listener (cancel safe), with the
    /// listener's index. Listeners are looked at in turn from a rotating
    /// start, so a flood of connections on one does not starve the others.
    pub(super) async fn accept(&mut self) -> (usize, std::io::Result<(TcpStream, SocketAddr)>) {
        std::future::poll_fn(|cx| {
            let n = self.table.len();
            for k in 0..n {
                let i = (self.next + k) % n;
                if let Poll::Ready(r) = self.table[i].socket.poll_accept(cx) {
                    self.next = (i + 1) % n;
                    return Poll::Ready((i, r));
                }
            }
            Poll::Pending
        })
        .await
    }

    /// The name of listener `i` (for logs).
    pub(super) fn name(&self, i: usize) -> &'static str {
        self.table.get(i).map_or("protocol", |l| l.name)
    }

    /// Starts the task of a connection accepted by listener `i`.
    pub(super) fn spawn(
        &self,
        i: usize,
        conns: &mut JoinSet<()>,
        (stream, peer): (TcpStream, SocketAddr),
        services: &Arc<Services>,
        shutdown: &watch::Receiver<bool>,
    ) {
        let Some(l) = self.table.get(i) else {
            return;
        };
        (l.spawn)(
            conns,
            Accepted {
                stream,
                peer,
                services,
                shutdown,
                tls: self.tls.as_deref(),
            },
        );
    }
}
