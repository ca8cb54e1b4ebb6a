//! Running the real `weir` binary: start (on a temporary or given data
//! directory, with flags or a custom environment), wait for readiness, read
//! its log, SIGTERM / SIGKILL, restart on the same directory, and run it to
//! exit (for settings that must refuse to start).

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, TcpStream as StdTcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use crate::START_TIMEOUT;

/// Path of the `weir` binary under test.
pub fn weir_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("WEIR_BIN") {
        return PathBuf::from(p);
    }
    let target = match std::env::var_os("CARGO_TARGET_DIR") {
        Some(t) => {
            let t = PathBuf::from(t);
            if t.is_absolute() {
                t
            } else {
                workspace_root().join(t)
            }
        }
        None => workspace_root().join("target"),
    };
    let bin = target.join("debug").join("weir");
    assert!(
        bin.exists(),
        "weir binary not found at {}: run `cargo build -p weir-gateway` first (or set WEIR_BIN)",
        bin.display()
    );
    bin
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A free loopback port (bound then released; the broker binds it next).
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("binding an ephemeral port")
        .port()
}

/// Everything the broker wrote to stdout and stderr, across restarts.
#[derive(Default)]
struct LogBuf {
    text: Mutex<String>,
    changed: Condvar,
}

impl LogBuf {
    fn push_line(&self, line: &str) {
        let mut t = self.text.lock().unwrap();
        t.push_str(line);
        t.push('\n');
        self.changed.notify_all();
    }
}

/// One running (or stopped) `weir` process on a data directory.
pub struct Broker {
    child: Option<Child>,
    port: u16,
    data_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    logs: Arc<LogBuf>,
    /// Offset into `logs` where the current process's output starts.
    run_start: usize,
    extra_args: Vec<String>,
    /// Serve MQTT on `127.0.0.1:mqtt_port` (see [`Broker::start_mqtt_with`]).
    mqtt: bool,
    mqtt_port: u16,
    /// The HTTP listener's port (management API, `/metrics`, dashboard).
    http_port: u16,
}

impl Broker {
    /// Starts a broker on a fresh temporary data directory.
    pub fn start() -> Broker {
        Self::start_with(&[])
    }

    /// Like [`Broker::start`], with extra command-line flags.
    pub fn start_with(args: &[&str]) -> Broker {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut b = Self::new(dir, Some(tmp), args);
        b.spawn_ready(None);
        b
    }

    /// Starts a broker on an existing data directory (the caller keeps it).
    pub fn start_in(dir: &Path) -> Broker {
        Self::start_in_with(dir, &[])
    }

    /// Like [`Broker::start_in`], with extra command-line flags (kept for
    /// restarts).
    pub fn start_in_with(dir: &Path, args: &[&str]) -> Broker {
        let mut b = Self::new(dir.to_path_buf(), None, args);
        b.spawn_ready(None);
        b
    }

    fn new(data_dir: PathBuf, tmp: Option<tempfile::TempDir>, args: &[&str]) -> Broker {
        Broker {
            child: None,
            port: 0,
            data_dir,
            _tmp: tmp,
            logs: Arc::new(LogBuf::default()),
            run_start: 0,
            extra_args: args.iter().map(|s| s.to_string()).collect(),
            mqtt: false,
            mqtt_port: 0,
            http_port: 0,
        }
    }

    /// Like [`Broker::start_with`], plus an MQTT listener on a free loopback
    /// port ([`Broker::mqtt_port`]; `--mqtt-listen`). A restart keeps both
    /// ports, so MQTT clients reconnect to the same address.
    pub fn start_mqtt_with(args: &[&str]) -> Broker {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path().to_path_buf();
        let mut b = Self::new(dir, Some(tmp), args);
        b.mqtt = true;
        b.spawn_ready(None);
        b
    }

    /// Like [`Broker::start_mqtt_with`] on an existing data directory (the
    /// caller keeps it).
    pub fn start_mqtt_in(dir: &Path, args: &[&str]) -> Broker {
        let mut b = Self::new(dir.to_path_buf(), None, args);
        b.mqtt = true;
        b.spawn_ready(None);
        b
    }

    /// The MQTT listener's port (brokers started with `start_mqtt_*`).
    /// The port of the HTTP listener (management API, `/metrics`,
    /// dashboard), chosen at each start unless the flags named one.
    pub fn http_port(&self) -> u16 {
        assert!(self.http_port != 0, "this broker's HTTP port is not known");
        self.http_port
    }

    /// `http://127.0.0.1:PORT`, the HTTP listener's base URL.
    pub fn http_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.http_port())
    }

    pub fn mqtt_port(&self) -> u16 {
        assert!(
            self.mqtt,
            "this broker was started without an MQTT listener"
        );
        self.mqtt_port
    }

    /// Starts the broker again on the same data directory, on the same port
    /// when it is free (so reconnecting clients find it), else a new one.
    pub fn restart(&mut self) {
        assert!(self.child.is_none(), "restart: the broker is still running");
        let port = self.port;
        self.spawn_ready(Some(port));
    }

    fn spawn_ready(&mut self, mut port: Option<u16>) {
        let mut last_err = String::new();
        for _attempt in 0..4 {
            // A restart keeps the MQTT port on its first attempt, as it
            // keeps the AMQP one; otherwise a fresh one each attempt.
            if self.mqtt && (port.is_none() || self.mqtt_port == 0) {
                self.mqtt_port = free_port();
            }
            let p = port.take().unwrap_or_else(free_port);
            match self.spawn_once(p) {
                Ok(()) => return,
                Err(e) => last_err = e,
            }
        }
        panic!(
            "weir did not start: {last_err}\n--- log ---\n{}",
            self.logs()
        );
    }

    fn spawn_once(&mut self, port: u16) -> Result<(), String> {
        let mut cmd = weir_command();
        cmd.arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--amqp-listen")
            .arg(format!("127.0.0.1:{port}"));
        if self.mqtt {
            cmd.arg("--mqtt-listen")
                .arg(format!("127.0.0.1:{}", self.mqtt_port));
        } else if !self
            .extra_args
            .iter()
            .any(|a| a.starts_with("--mqtt-listen"))
        {
            // Tests run in parallel: never the default 1883.
            cmd.arg("--mqtt-listen").arg("127.0.0.1:0");
        }
        if !self
            .extra_args
            .iter()
            .any(|a| a.starts_with("--mqtt-ws-listen"))
        {
            // Nor the default 8083.
            cmd.arg("--mqtt-ws-listen").arg("127.0.0.1:0");
        }
        if !self
            .extra_args
            .iter()
            .any(|a| a.starts_with("--http-listen"))
        {
            // Nor the default 15672; a fresh port each start.
            self.http_port = free_port();
            cmd.arg("--http-listen")
                .arg(format!("127.0.0.1:{}", self.http_port));
        }
        cmd.args(&self.extra_args);
        self.spawn_command(cmd, port)
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port the current run's listener `name` (as the broker logs it:
    /// "AMQPS", "MQTTS", "MQTT WebSocket", ...) bound. Tests pass
    /// `127.0.0.1:0` for the listeners they add and read the port here: a
    /// port picked before the broker binds it can be taken meanwhile by
    /// another test running in parallel.
    pub fn listener_port(&self, name: &str) -> u16 {
        let needle = format!(" {name} listener ready addr=");
        // Readiness is "AMQP listener ready", the first of the lines.
        self.wait_for_log(&needle, START_TIMEOUT);
        let logs = self.run_logs();
        let rest = logs
            .split_once(&needle)
            .unwrap_or_else(|| panic!("no `{name} listener ready` in the log:\n{logs}"))
            .1;
        let addr: String = rest.chars().take_while(|c| !c.is_whitespace()).collect();
        addr.parse::<SocketAddr>()
            .unwrap_or_else(|e| panic!("`{addr}` logged for {name}: {e}"))
            .port()
    }

    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.port))
    }

    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// `amqp://guest:guest@127.0.0.1:PORT/%2f`
    pub fn url(&self) -> String {
        format!("amqp://guest:guest@127.0.0.1:{}/%2f", self.port)
    }

    pub fn url_with(&self, user: &str, pass: &str, vhost: &str) -> String {
        format!("amqp://{user}:{pass}@127.0.0.1:{}/{vhost}", self.port)
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            Some(c) => c.try_wait().unwrap().is_none(),
            None => false,
        }
    }

    /// All output of every run so far.
    pub fn logs(&self) -> String {
        self.logs.text.lock().unwrap().clone()
    }

    /// Output of the current (or last) run only.
    pub fn run_logs(&self) -> String {
        self.logs.text.lock().unwrap()[self.run_start..].to_string()
    }

    /// Waits until the current run logged a line containing `needle`.
    pub fn wait_for_log(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut t = self.logs.text.lock().unwrap();
        loop {
            if t[self.run_start..].contains(needle) {
                return true;
            }
            let now = Instant::now();
            if now >= deadline {
                return false;
            }
            t = self.logs.changed.wait_timeout(t, deadline - now).unwrap().0;
        }
    }

    /// SIGTERM, wait (bounded) and return the exit status.
    pub fn terminate(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("terminate: broker not running");
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(child.id() as libc::pid_t, libc::SIGTERM);
        }
        wait_bounded(&mut child, START_TIMEOUT)
            .unwrap_or_else(|| panic!("weir did not exit within {START_TIMEOUT:?} of SIGTERM"))
    }

    /// SIGTERM and assert a clean exit (status 0).
    pub fn stop(&mut self) {
        let status = self.terminate();
        assert!(
            status.success(),
            "weir exited with {status} after SIGTERM\n--- log ---\n{}",
            self.run_logs()
        );
    }

    /// SIGKILL and reap.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!("--- weir log ---\n{}", self.logs());
        }
    }
}

fn pump(stream: impl Read + Send + 'static, logs: Arc<LogBuf>) {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => logs.push_line(line.trim_end_matches('\n')),
            }
        }
    });
}

/// Waits for `child` without blocking forever; `None` on timeout.
fn wait_bounded(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let deadline = Instant::now() + timeout;
    let mut backoff = Duration::from_millis(2);
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        // No child-exit notification in std; a short capped back-off.
        std::thread::sleep(backoff);
        backoff = (backoff * 2).min(Duration::from_millis(50));
    }
}

/// Environment variables `weir` reads its settings from; the harness clears
/// them so a test's own setup is the only source.
pub const WEIR_SETTING_VARS: &[&str] = &[
    "WEIR_CONFIG",
    "WEIR_DATA_DIR",
    "WEIR_AMQP_LISTEN",
    "WEIR_FSYNC",
    "WEIR_SEGMENT_MB",
    "WEIR_HEARTBEAT",
    "WEIR_FRAME_MAX",
    "WEIR_DEFAULT_PASS",
    "WEIR_GUEST_REMOTE",
    "WEIR_CONSUMER_TIMEOUT",
    "WEIR_CHANNEL_MAX",
    "WEIR_PARTIAL_CONTENT_TIMEOUT",
    "WEIR_MEMORY_LIMIT",
    "WEIR_STORE",
    "WEIR_MQTT_LISTEN",
    "WEIR_MQTT_WS_LISTEN",
    "WEIR_HTTP_LISTEN",
    "WEIR_NATIVE_LISTEN",
    "WEIR_AMQPS_LISTEN",
    "WEIR_MQTTS_LISTEN",
    "WEIR_MQTT_WSS_LISTEN",
    "WEIR_MQTT_SSL_CERT_LOGIN",
    "WEIR_TLS_CERT_FILE",
    "WEIR_TLS_KEY_FILE",
    "WEIR_TLS_CA_FILE",
    "WEIR_TLS_FAIL_IF_NO_PEER_CERT",
    "WEIR_TLS_RELOAD_INTERVAL",
    "WEIR_LOG_FORMAT",
    "WEIR_MQTT_ALLOW_ANONYMOUS",
    "WEIR_MQTT_DEFAULT_USER",
];

/// A `weir` command with no arguments, inherited settings cleared (see
/// [`WEIR_SETTING_VARS`]), `WEIR_LOG=info` unless the environment sets it,
/// no colours, stdin closed and stdout/stderr piped.
pub fn weir_command() -> Command {
    let mut cmd = Command::new(weir_bin());
    for var in WEIR_SETTING_VARS {
        cmd.env_remove(var);
    }
    cmd.env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if std::env::var_os("WEIR_LOG").is_none() {
        cmd.env("WEIR_LOG", "info");
    }
    cmd
}

/// Runs `weir` to completion with the settings `setup` adds to
/// [`weir_command`]; returns its exit status and everything it printed.
/// Panics if it is still running after [`START_TIMEOUT`].
pub fn run_weir_to_exit(setup: impl FnOnce(&mut Command)) -> (ExitStatus, String) {
    let mut cmd = weir_command();
    // Should it start after all, never on the default ports.
    cmd.env("WEIR_MQTT_LISTEN", "127.0.0.1:0")
        .env("WEIR_MQTT_WS_LISTEN", "127.0.0.1:0")
        .env("WEIR_HTTP_LISTEN", "127.0.0.1:0");
    setup(&mut cmd);
    let mut child = cmd.spawn().expect("spawning weir");
    let logs = Arc::new(LogBuf::default());
    let out = pump_joinable(child.stdout.take().unwrap(), logs.clone());
    let err = pump_joinable(child.stderr.take().unwrap(), logs.clone());
    let status = wait_bounded(&mut child, START_TIMEOUT).unwrap_or_else(|| {
        panic!(
            "weir was expected to exit but still ran after {START_TIMEOUT:?}\n--- log ---\n{}",
            logs.text.lock().unwrap()
        )
    });
    // The pipes close with the process: read them to the end.
    let _ = out.join();
    let _ = err.join();
    let text = logs.text.lock().unwrap().clone();
    (status, text)
}

fn pump_joinable(
    stream: impl Read + Send + 'static,
    logs: Arc<LogBuf>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        loop {
            line.clear();
            match r.read_line(&mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => logs.push_line(line.trim_end_matches('\n')),
            }
        }
    })
}

impl Broker {
    /// Starts `weir` without the harness's `--data-dir`/`--amqp-listen`
    /// flags: `setup` gets a free loopback port and a [`weir_command`] and
    /// tells the broker to listen on `127.0.0.1:<port>` and to keep its store
    /// in `data_dir` its own way (environment variables, `--config`). Tried
    /// on up to four ports. The caller keeps `data_dir`. A later
    /// [`Broker::restart`] passes the usual flags (same port and directory),
    /// not `setup`'s environment.
    pub fn start_custom(data_dir: &Path, setup: impl Fn(u16, &mut Command)) -> Broker {
        let mut b = Self::new(data_dir.to_path_buf(), None, &[]);
        let mut last_err = String::new();
        for _attempt in 0..4 {
            let port = free_port();
            let mut cmd = weir_command();
            // Tests run in parallel: never the default MQTT port 1883 (an
            // environment variable, so a setup's flag or env still wins).
            b.http_port = free_port();
            cmd.env("WEIR_MQTT_LISTEN", "127.0.0.1:0")
                .env("WEIR_MQTT_WS_LISTEN", "127.0.0.1:0")
                .env("WEIR_HTTP_LISTEN", format!("127.0.0.1:{}", b.http_port));
            setup(port, &mut cmd);
            match b.spawn_command(cmd, port) {
                Ok(()) => return b,
                Err(e) => last_err = e,
            }
        }
        panic!("weir did not start: {last_err}\n--- log ---\n{}", b.logs());
    }

    fn spawn_command(&mut self, mut cmd: Command, port: u16) -> Result<(), String> {
        {
            let mut t = self.logs.text.lock().unwrap();
            t.push_str(&format!("=== starting weir on 127.0.0.1:{port} ===\n"));
            self.run_start = t.len();
        }
        let mut child = cmd.spawn().map_err(|e| format!("spawning weir: {e}"))?;
        pump(child.stdout.take().unwrap(), self.logs.clone());
        pump(child.stderr.take().unwrap(), self.logs.clone());
        self.port = port;
        self.child = Some(child);
        let deadline = Instant::now() + START_TIMEOUT;
        let mut t = self.logs.text.lock().unwrap();
        loop {
            if t[self.run_start..].contains("AMQP listener ready") {
                break;
            }
            drop(t);
            if let Some(status) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                return Err(format!("weir exited during startup with {status}"));
            }
            t = self.logs.text.lock().unwrap();
            let now = Instant::now();
            if now >= deadline {
                drop(t);
                self.kill9();
                return Err("timed out waiting for `AMQP listener ready`".into());
            }
            // Woken by every new log line; the timeout only bounds how late we
            // notice a silent exit.
            t = self
                .logs
                .changed
                .wait_timeout(t, Duration::from_millis(100).min(deadline - now))
                .unwrap()
                .0;
        }
        drop(t);
        StdTcpStream::connect_timeout(&self.addr(), Duration::from_secs(5))
            .map_err(|e| format!("ready logged but port {port} refuses: {e}"))?;
        Ok(())
    }
}
