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
        n.ctl(&["await_startup", "--timeout", "120"])?;
        Ok(n)
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
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", self.path("enabled_plugins"))
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

    /// Restarts the broker (its application: every connection is closed,
    /// durable queues and persistent messages are recovered from disk).
    pub fn restart(&self) -> Result<(), String> {
        self.ctl(&["stop_app"])?;
        self.ctl(&["start_app"])?;
        self.ctl(&["await_startup", "--timeout", "120"])?;
        Ok(())
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
