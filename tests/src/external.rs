//! Other brokers a test starts for itself (the shovel tests, issue 27):
//! a RabbitMQ node of its own (its own node name, ports and data, so
//! restarting it disturbs no other test or the conformance node on 5672)
//! and a Mosquitto instance with persistence. Each `start` returns
//! `Err(reason)` when the broker cannot be had here (not installed, not
//! root): the test then says "skipped" with that reason.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::free_port;

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

fn is_root() -> bool {
    // SAFETY: getuid has no preconditions.
    unsafe { libc::getuid() == 0 }
}

/// A RabbitMQ node of the test's own.
pub struct RabbitNode {
    node: String,
    port: u16,
    dir: tempfile::TempDir,
}

impl RabbitNode {
    /// Starts a node on a free port and waits until it has booted.
    pub fn start() -> Result<RabbitNode, String> {
        if !have("rabbitmq-server") || !have("rabbitmqctl") {
            return Err("rabbitmq-server is not installed (scripts/install-deps.sh)".into());
        }
        if !is_root() {
            return Err("starting a RabbitMQ node needs root (the Debian wrapper switches to the rabbitmq user)".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = free_port();
        let node = format!("weirshovel{port}");
        std::fs::write(dir.path().join("enabled_plugins"), "[].\n").map_err(|e| e.to_string())?;
        let chown = Command::new("chown")
            .args(["-R", "rabbitmq"])
            .arg(dir.path())
            .status()
            .map_err(|e| e.to_string())?;
        if !chown.success() {
            return Err("chown to the rabbitmq user failed".into());
        }
        let n = RabbitNode { node, port, dir };
        n.server()?;
        n.await_boot()?;
        Ok(n)
    }

    /// Waits until the node has booted. Right after `-detached` the node
    /// may not be registered yet, and `await_startup` then fails at once
    /// ("not running at all"): tried again within the budget, as
    /// scripts/start-rabbitmq.sh does.
    fn await_boot(&self) -> Result<(), String> {
        let deadline = std::time::Instant::now() + Duration::from_secs(180);
        loop {
            match self.ctl(&["await_startup", "--timeout", "120"]) {
                Ok(_) => return Ok(()),
                Err(e) if std::time::Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_secs(1)),
            }
        }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    fn server(&self) -> Result<(), String> {
        let s = Command::new("rabbitmq-server")
            .arg("-detached")
            .env("RABBITMQ_NODENAME", &self.node)
            .env("RABBITMQ_NODE_PORT", self.port.to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            // Erlang distribution: anything free (not 25672, the default
            // node's).
            .env("RABBITMQ_DIST_PORT", free_port().to_string())
            .env("RABBITMQ_MNESIA_BASE", self.path("mnesia"))
            .env("RABBITMQ_LOG_BASE", self.path("log"))
            .env(
                "RABBITMQ_ENABLED_PLUGINS_FILE",
                self.path("enabled_plugins"),
            )
            .env("RABBITMQ_PID_FILE", self.path("pid"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| format!("rabbitmq-server: {e}"))?;
        if s.success() {
            Ok(())
        } else {
            Err(format!("rabbitmq-server -detached: {s}"))
        }
    }

    /// Runs `rabbitmqctl -n NODE args…`.
    pub fn ctl(&self, args: &[&str]) -> Result<String, String> {
        let out = Command::new("rabbitmqctl")
            .arg("-n")
            .arg(&self.node)
            .args(args)
            .output()
            .map_err(|e| format!("rabbitmqctl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).into_owned())
        } else {
            Err(format!(
                "rabbitmqctl {args:?}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ))
        }
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2F`.
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2F", self.port)
    }

    /// Restarts the broker the hard way: SIGKILL to its Erlang VM at once
    /// (a graceful `stop_app` takes seconds, long enough for a shovel to
    /// finish), then a new node on the same data. What RabbitMQ confirmed
    /// is on its disk; unacknowledged deliveries are ready again.
    pub fn kill_and_restart(&self) -> Result<(), String> {
        let pid: i32 = std::fs::read_to_string(self.path("pid"))
            .map_err(|e| format!("pid file: {e}"))?
            .trim()
            .parse()
            .map_err(|e| format!("pid file: {e}"))?;
        // SAFETY: kill(2) on the node's VM, whose pid it wrote.
        unsafe { libc::kill(pid, libc::SIGKILL) };
        // Gone once signal 0 fails.
        // SAFETY: as above, signal 0 only checks.
        while unsafe { libc::kill(pid, 0) } == 0 {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.server()?;
        self.await_boot()
    }
}

impl Drop for RabbitNode {
    fn drop(&mut self) {
        let _ = self.ctl(&["stop"]);
    }
}

/// A Mosquitto instance of the test's own, persistent.
pub struct Mosquitto {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl Mosquitto {
    /// Starts it on a free port and waits until it accepts connections.
    pub fn start() -> Result<Mosquitto, String> {
        if !have("mosquitto") {
            return Err("mosquitto is not installed (scripts/install-deps.sh)".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let port = free_port();
        let conf = format!(
            "listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n\
             persistence_location {}/\nmax_queued_messages 0\nmax_inflight_messages 100\n\
             user root\nlog_dest stderr\n",
            dir.path().display()
        );
        std::fs::write(dir.path().join("mosquitto.conf"), conf).map_err(|e| e.to_string())?;
        let mut m = Mosquitto {
            child: None,
            port,
            dir,
        };
        m.spawn()?;
        Ok(m)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new("mosquitto")
            .arg("-c")
            .arg(self.dir.path().join("mosquitto.conf"))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("mosquitto: {e}"))?;
        self.child = Some(child);
        // Ready once it accepts a TCP connection (it binds before serving).
        for _ in 0..200 {
            if std::net::TcpStream::connect(("127.0.0.1", self.port)).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("mosquitto did not listen within 10 s".into())
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `mqtt://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    /// Stops it with SIGTERM (it saves its persistent sessions and queued
    /// messages) and starts it again on the same port and data.
    pub fn restart(&mut self) -> Result<(), String> {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill with a pid we own.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
        self.spawn()
    }
}

impl Drop for Mosquitto {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A NATS server with JetStream, of the test's own (file storage in its
/// own directory, kept across [`NatsServer::restart`]).
pub struct NatsServer {
    child: Option<Child>,
    port: u16,
    dir: tempfile::TempDir,
}

impl NatsServer {
    /// Starts `nats-server -js` on a free port.
    pub fn start() -> Result<NatsServer, String> {
        if !have("nats-server") {
            return Err("nats-server is not installed (Debian package nats-server)".into());
        }
        let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
        let mut n = NatsServer {
            child: None,
            port: free_port(),
            dir,
        };
        n.spawn()?;
        Ok(n)
    }

    fn spawn(&mut self) -> Result<(), String> {
        let child = Command::new("nats-server")
            .args([
                "-a",
                "127.0.0.1",
                "-p",
                &self.port.to_string(),
                "-js",
                "-sd",
            ])
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("nats-server: {e}"))?;
        self.child = Some(child);
        // Ready once a client gets its PONG (JetStream is up by then).
        for _ in 0..200 {
            if let Ok(mut c) = NatsClient::connect(self.port) {
                if c.request("$JS.API.INFO", b"").is_ok() {
                    return Ok(());
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err("nats-server did not serve JetStream within 10 s".into())
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `nats://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// SIGTERM, then start again on the same port and store.
    pub fn restart(&mut self) -> Result<(), String> {
        if let Some(mut c) = self.child.take() {
            // SAFETY: kill with a pid we own.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
            let _ = c.wait();
        }
        self.spawn()
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// A blocking NATS client for checks, on the text protocol.
pub struct NatsClient {
    rd: std::io::BufReader<std::net::TcpStream>,
    wr: std::net::TcpStream,
    next_inbox: u64,
}

/// A message a [`NatsClient`] received.
#[derive(Debug)]
pub struct NatsMsg {
    /// Its subject.
    pub subject: String,
    /// JetStream status code of a header-only message (404, 408, …).
    pub status: Option<u16>,
    /// Its payload.
    pub payload: Vec<u8>,
}

impl NatsClient {
    /// Connects and logs in (no credentials).
    pub fn connect(port: u16) -> std::io::Result<NatsClient> {
        use std::io::{BufRead, Write};
        let s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(Duration::from_secs(30)))?;
        let mut rd = std::io::BufReader::new(s.try_clone()?);
        let mut wr = s;
        let mut line = String::new();
        rd.read_line(&mut line)?;
        wr.write_all(
            b"CONNECT {\"verbose\":false,\"headers\":true,\"no_responders\":true}\r\nPING\r\n",
        )?;
        let mut c = NatsClient {
            rd,
            wr,
            next_inbox: 0,
        };
        c.until_pong()?;
        Ok(c)
    }

    fn until_pong(&mut self) -> std::io::Result<()> {
        loop {
            if let Op::Pong = self.op()? {
                return Ok(());
            }
        }
    }

    fn op(&mut self) -> std::io::Result<Op> {
        use std::io::{BufRead, Read, Write};
        let bad = |m: String| std::io::Error::new(std::io::ErrorKind::InvalidData, m);
        loop {
            let mut line = String::new();
            if self.rd.read_line(&mut line)? == 0 {
                return Err(bad("closed".into()));
            }
            let p: Vec<&str> = line.split_ascii_whitespace().collect();
            match p.first().copied() {
                Some("PING") => self.wr.write_all(b"PONG\r\n")?,
                Some("PONG") => return Ok(Op::Pong),
                Some("-ERR") => return Err(bad(line)),
                Some("MSG") | Some("HMSG") => {
                    let hmsg = p[0] == "HMSG";
                    let n = |s: &str| s.parse::<usize>().map_err(|_| bad(line.clone()));
                    let total = n(p[p.len() - 1])?;
                    let hdr = if hmsg { n(p[p.len() - 2])? } else { 0 };
                    let mut buf = vec![0; total + 2];
                    self.rd.read_exact(&mut buf)?;
                    buf.truncate(total);
                    let status = (hdr > 0)
                        .then(|| {
                            String::from_utf8_lossy(&buf[..hdr])
                                .split_ascii_whitespace()
                                .nth(1)
                                .and_then(|c| c.parse().ok())
                        })
                        .flatten();
                    return Ok(Op::Msg(NatsMsg {
                        subject: p[1].to_string(),
                        status,
                        payload: buf[hdr..].to_vec(),
                    }));
                }
                _ => {}
            }
        }
    }

    fn inbox(&mut self) -> String {
        self.next_inbox += 1;
        format!("_INBOX.check.{}.{}", std::process::id(), self.next_inbox)
    }

    /// A request: the first answer's payload (status messages are errors).
    pub fn request(&mut self, subject: &str, payload: &[u8]) -> std::io::Result<Vec<u8>> {
        use std::io::Write;
        let inbox = self.inbox();
        let mut out = format!(
            // Unsubscribed by the server after the one answer (an UNSUB
            // after the PUB could be processed before the answer arrives).
            "SUB {inbox} 9\r\nUNSUB 9 1\r\nPUB {subject} {inbox} {}\r\n",
            payload.len()
        )
        .into_bytes();
        out.extend_from_slice(payload);
        out.extend_from_slice(b"\r\n");
        self.wr.write_all(&out)?;
        loop {
            if let Op::Msg(m) = self.op()? {
                if let Some(s) = m.status {
                    return Err(std::io::Error::other(format!("status {s} from {subject}")));
                }
                return Ok(m.payload);
            }
        }
    }

    /// Publishes to a JetStream subject and waits for each stream ack.
    pub fn js_publish(&mut self, msgs: &[(String, Vec<u8>)]) -> std::io::Result<()> {
        use std::io::Write;
        let inbox = self.inbox();
        let mut out = format!("SUB {inbox} 8\r\n").into_bytes();
        for (subject, payload) in msgs {
            out.extend_from_slice(
                format!("PUB {subject} {inbox} {}\r\n", payload.len()).as_bytes(),
            );
            out.extend_from_slice(payload);
            out.extend_from_slice(b"\r\n");
        }
        self.wr.write_all(&out)?;
        let mut acked = 0;
        while acked < msgs.len() {
            if let Op::Msg(m) = self.op()? {
                let ok = m.status.is_none()
                    && !String::from_utf8_lossy(&m.payload).contains("\"error\"");
                if !ok {
                    return Err(std::io::Error::other(format!(
                        "JetStream publish refused: {:?} {}",
                        m.status,
                        String::from_utf8_lossy(&m.payload)
                    )));
                }
                acked += 1;
            }
        }
        self.wr.write_all(b"UNSUB 8\r\n")
    }

    /// Pulls up to `batch` messages of a durable consumer (ack policy
    /// none), waiting at most `wait` for them.
    pub fn pull(
        &mut self,
        stream: &str,
        consumer: &str,
        batch: usize,
        wait: Duration,
    ) -> std::io::Result<Vec<NatsMsg>> {
        use std::io::Write;
        let inbox = self.inbox();
        let req = format!("{{\"batch\":{batch},\"expires\":{}}}", wait.as_nanos());
        self.wr.write_all(
            format!(
                "SUB {inbox} 7\r\nPUB $JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer} {inbox} {}\r\n{req}\r\n",
                req.len()
            )
            .as_bytes(),
        )?;
        let mut got = Vec::new();
        while got.len() < batch {
            if let Op::Msg(m) = self.op()? {
                if m.status.is_some() {
                    break;
                }
                got.push(m);
            }
        }
        self.wr.write_all(b"UNSUB 7\r\n")?;
        Ok(got)
    }
}

enum Op {
    Pong,
    Msg(NatsMsg),
}
