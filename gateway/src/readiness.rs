//! Service-manager readiness: systemd's `sd_notify` protocol without
//! libsystemd.
//!
//! With `Type=notify` systemd passes `NOTIFY_SOCKET` (a path, or an abstract
//! socket name starting with `@`) and considers the unit started only when
//! the service sends `READY=1` there. Weir sends it once every listener is
//! bound and the store is open, so `systemctl start weir` returns when
//! clients can connect, and `STOPPING=1` when it begins to shut down.
//! Without `NOTIFY_SOCKET` (a terminal, a container) nothing is sent.

use std::os::unix::net::UnixDatagram;

/// What could not be told to the service manager (logged, never fatal: a
/// broker that runs but whose manager missed the message is better than
/// none).
#[derive(Debug, thiserror::Error)]
pub enum NotifyError {
    /// The socket could not be created or the datagram not sent.
    #[error("sd_notify to {socket}: {source}")]
    Send {
        /// `NOTIFY_SOCKET` as given.
        socket: String,
        /// The I/O error.
        source: std::io::Error,
    },
}

/// Sends `READY=1`: the broker accepts connections.
pub fn ready() -> Result<(), NotifyError> {
    notify(&format!(
        "READY=1\nMAINPID={}\nSTATUS=accepting connections",
        std::process::id()
    ))
}

/// Sends `STOPPING=1`: the broker is closing its connections.
pub fn stopping() -> Result<(), NotifyError> {
    notify("STOPPING=1\nSTATUS=closing connections")
}

/// Sends `state` to `$NOTIFY_SOCKET` if it is set; a no-op otherwise.
pub fn notify(state: &str) -> Result<(), NotifyError> {
    let Some(socket) = std::env::var_os("NOTIFY_SOCKET") else {
        return Ok(());
    };
    let socket = socket.to_string_lossy().into_owned();
    send(&socket, state).map_err(|source| NotifyError::Send { socket, source })
}

fn send(socket: &str, state: &str) -> std::io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    if let Some(name) = socket.strip_prefix('@') {
        // Linux abstract namespace: the name without the leading `@`.
        use std::os::linux::net::SocketAddrExt as _;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
        sock.send_to_addr(state.as_bytes(), &addr)?;
    } else {
        sock.send_to(state.as_bytes(), socket)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sends_the_state_to_a_path_socket() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("notify");
        let server = UnixDatagram::bind(&path).expect("bind");
        send(path.to_str().expect("utf-8 path"), "READY=1").expect("send");
        let mut buf = [0u8; 64];
        let n = server.recv(&mut buf).expect("recv");
        assert_eq!(&buf[..n], b"READY=1");
    }
}
