//! Helpers shared by the black-box tests: a harness that runs the real `weir`
//! binary, lapin conveniences, and a tiny raw AMQP 0-9-1 client for sending
//! frames no well-behaved client would send.
//!
//! The tests need the broker binary: build it first with
//! `cargo build -p weir-gateway` (then `cargo nextest run -p weir-tests`).
//! The binary is looked up as `$WEIR_BIN`, else
//! `$CARGO_TARGET_DIR/debug/weir`, else `<workspace>/target/debug/weir`.

use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, TcpStream as StdTcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

pub use futures_lite::StreamExt;
pub use lapin;
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
pub mod hardening;

/// How long the broker gets to become ready or to exit.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Generic bound for anything a test awaits from the broker.
pub const OP_TIMEOUT: Duration = Duration::from_secs(15);

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
        }
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
            .arg(format!("127.0.0.1:{port}"))
            .args(&self.extra_args);
        self.spawn_command(cmd, port)
    }

    pub fn port(&self) -> u16 {
        self.port
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

// ---------------------------------------------------------------------------
// lapin conveniences

/// Bounds a future with [`OP_TIMEOUT`], panicking with `what` on timeout.
pub async fn within<F: std::future::Future>(what: &str, f: F) -> F::Output {
    match tokio::time::timeout(OP_TIMEOUT, f).await {
        Ok(v) => v,
        Err(_) => panic!("timed out: {what}"),
    }
}

pub async fn connect(url: &str) -> Connection {
    within(
        "connect",
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    .unwrap_or_else(|e| panic!("connecting to {url}: {e}"))
}

/// A channel in confirm mode.
pub async fn confirm_channel(conn: &Connection) -> Channel {
    let ch = conn.create_channel().await.expect("channel.open");
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .expect("confirm.select");
    ch
}

/// The AMQP reply code of a channel/connection close error, if it is one.
pub fn reply_code(e: &lapin::Error) -> Option<u16> {
    match e.kind() {
        lapin::ErrorKind::ProtocolError(amqp) => Some(amqp.get_id()),
        _ => None,
    }
}

/// Asserts `r` failed with AMQP reply `code`.
#[track_caller]
pub fn assert_code<T: std::fmt::Debug>(r: Result<T, lapin::Error>, code: u16) {
    match r {
        Ok(v) => panic!("expected AMQP error {code}, got Ok({v:?})"),
        Err(e) => assert_eq!(
            reply_code(&e),
            Some(code),
            "expected reply {code}, got error {e:?}"
        ),
    }
}

/// Declares a plain (non-durable) queue.
pub async fn declare_queue(ch: &Channel, name: &str) -> lapin::Queue {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions::default(),
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("declaring {name}: {e}"))
}

/// Message count of `name` via a passive declare.
pub async fn queue_len(ch: &Channel, name: &str) -> u32 {
    ch.queue_declare(
        name.into(),
        QueueDeclareOptions {
            passive: true,
            ..Default::default()
        },
        FieldTable::default(),
    )
    .await
    .unwrap_or_else(|e| panic!("passive declare {name}: {e}"))
    .message_count()
}

pub fn persistent() -> BasicProperties {
    BasicProperties::default().with_delivery_mode(2)
}

/// Publishes and waits for a positive confirm (the channel must be in
/// confirm mode).
pub async fn publish_confirmed(
    ch: &Channel,
    exchange: &str,
    key: &str,
    body: &[u8],
    props: BasicProperties,
) {
    let confirm = within(
        "publish",
        ch.basic_publish(
            exchange.into(),
            key.into(),
            BasicPublishOptions::default(),
            body,
            props,
        ),
    )
    .await
    .expect("basic.publish");
    let c = within("confirm", confirm).await.expect("publisher confirm");
    assert!(
        c.is_ack(),
        "publish to {exchange:?}/{key:?} was nacked: {c:?}"
    );
}

/// Next delivery from a consumer, bounded by [`OP_TIMEOUT`].
pub async fn next_delivery(consumer: &mut lapin::Consumer) -> lapin::message::Delivery {
    within("delivery", consumer.next())
        .await
        .expect("consumer stream ended")
        .expect("delivery error")
}

/// Opens a fresh connection and checks it can declare, publish and get.
pub async fn assert_broker_healthy(url: &str) {
    let conn = connect(url).await;
    let ch = confirm_channel(&conn).await;
    let q = declare_queue(&ch, "").await;
    let name = q.name().as_str().to_string();
    publish_confirmed(&ch, "", &name, b"health", BasicProperties::default()).await;
    let got = ch
        .basic_get(
            name.as_str().into(),
            lapin::options::BasicGetOptions { no_ack: true },
        )
        .await
        .expect("basic.get")
        .expect("health message");
    assert_eq!(got.delivery.data, b"health");
    conn.close(200, "bye".into())
        .await
        .expect("connection.close");
}

// ---------------------------------------------------------------------------
// raw AMQP 0-9-1

pub mod raw {
    //! Hand-built frames for inputs no client library will produce.

    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    pub const PROTOCOL_HEADER: &[u8; 8] = b"AMQP\x00\x00\x09\x01";
    pub const FRAME_METHOD: u8 = 1;
    pub const FRAME_HEADER: u8 = 2;
    pub const FRAME_BODY: u8 = 3;
    pub const FRAME_HEARTBEAT: u8 = 8;
    pub const FRAME_END: u8 = 0xCE;

    /// One frame from the server.
    #[derive(Debug, Clone)]
    pub struct Frame {
        pub kind: u8,
        pub channel: u16,
        pub payload: Vec<u8>,
    }

    impl Frame {
        /// (class id, method id) of a method frame.
        pub fn method(&self) -> Option<(u16, u16)> {
            (self.kind == FRAME_METHOD && self.payload.len() >= 4).then(|| {
                (
                    u16::from_be_bytes([self.payload[0], self.payload[1]]),
                    u16::from_be_bytes([self.payload[2], self.payload[3]]),
                )
            })
        }
        fn args(&self) -> &[u8] {
            &self.payload[4..]
        }
    }

    /// What a connection.close or channel.close carried.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Close {
        pub channel: u16,
        pub code: u16,
        pub text: String,
        pub class_id: u16,
        pub method_id: u16,
    }

    pub fn shortstr(s: &str) -> Vec<u8> {
        let mut v = vec![s.len() as u8];
        v.extend_from_slice(s.as_bytes());
        v
    }

    pub fn longstr(s: &[u8]) -> Vec<u8> {
        let mut v = (s.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(s);
        v
    }

    pub fn frame(kind: u8, channel: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = vec![kind];
        v.extend_from_slice(&channel.to_be_bytes());
        v.extend_from_slice(&(payload.len() as u32).to_be_bytes());
        v.extend_from_slice(payload);
        v.push(FRAME_END);
        v
    }

    pub fn method(channel: u16, class: u16, method: u16, args: &[u8]) -> Vec<u8> {
        let mut p = class.to_be_bytes().to_vec();
        p.extend_from_slice(&method.to_be_bytes());
        p.extend_from_slice(args);
        frame(FRAME_METHOD, channel, &p)
    }

    pub fn channel_open(ch: u16) -> Vec<u8> {
        method(ch, 20, 10, &shortstr(""))
    }

    pub fn channel_close(ch: u16) -> Vec<u8> {
        let mut a = 200u16.to_be_bytes().to_vec();
        a.extend(shortstr("bye"));
        a.extend_from_slice(&[0, 0, 0, 0]);
        method(ch, 20, 40, &a)
    }

    /// queue.declare (non-passive, auto-named unless `name` given).
    pub fn queue_declare(ch: u16, name: &str) -> Vec<u8> {
        let mut a = vec![0, 0];
        a.extend(shortstr(name));
        a.push(0); // passive, durable, exclusive, auto-delete, no-wait all off
        a.extend_from_slice(&0u32.to_be_bytes()); // empty arguments table
        method(ch, 50, 10, &a)
    }

    pub fn exchange_declare(ch: u16, name: &str, kind: &str) -> Vec<u8> {
        let mut a = vec![0, 0];
        a.extend(shortstr(name));
        a.extend(shortstr(kind));
        a.push(0);
        a.extend_from_slice(&0u32.to_be_bytes());
        method(ch, 40, 10, &a)
    }

    pub fn basic_publish(ch: u16, exchange: &str, key: &str) -> Vec<u8> {
        let mut a = vec![0, 0];
        a.extend(shortstr(exchange));
        a.extend(shortstr(key));
        a.push(0);
        method(ch, 60, 40, &a)
    }

    /// Content header for class basic with no properties.
    pub fn content_header(ch: u16, body_size: u64) -> Vec<u8> {
        let mut p = 60u16.to_be_bytes().to_vec();
        p.extend_from_slice(&0u16.to_be_bytes()); // weight
        p.extend_from_slice(&body_size.to_be_bytes());
        p.extend_from_slice(&0u16.to_be_bytes()); // property flags
        frame(FRAME_HEADER, ch, &p)
    }

    pub fn body(ch: u16, data: &[u8]) -> Vec<u8> {
        frame(FRAME_BODY, ch, data)
    }

    pub fn tx_select(ch: u16) -> Vec<u8> {
        method(ch, 90, 10, &[])
    }

    pub struct RawClient {
        pub stream: TcpStream,
        buf: Vec<u8>,
        /// frame_max the server offered in connection.tune.
        pub frame_max: u32,
    }

    const READ_TIMEOUT: Duration = Duration::from_secs(15);

    impl RawClient {
        pub async fn connect(addr: std::net::SocketAddr) -> RawClient {
            let stream = TcpStream::connect(addr).await.expect("tcp connect");
            stream.set_nodelay(true).ok();
            RawClient {
                stream,
                buf: Vec::new(),
                frame_max: 0,
            }
        }

        /// Connects and completes the handshake as guest on vhost `/`.
        pub async fn open(addr: std::net::SocketAddr) -> RawClient {
            let mut c = Self::connect(addr).await;
            c.handshake("guest", "guest", "/").await.expect("handshake");
            c
        }

        pub async fn send(&mut self, bytes: &[u8]) {
            self.stream.write_all(bytes).await.expect("write");
        }

        /// Like [`send`](Self::send) but tolerates the server having gone.
        pub async fn try_send(&mut self, bytes: &[u8]) -> std::io::Result<()> {
            self.stream.write_all(bytes).await
        }

        /// Reads raw bytes until EOF (or error), bounded.
        pub async fn read_to_eof(&mut self) -> Vec<u8> {
            let mut out = std::mem::take(&mut self.buf);
            let fut = async {
                let mut chunk = [0u8; 4096];
                loop {
                    match self.stream.read(&mut chunk).await {
                        Ok(0) | Err(_) => break,
                        Ok(n) => out.extend_from_slice(&chunk[..n]),
                    }
                }
            };
            tokio::time::timeout(READ_TIMEOUT, fut)
                .await
                .expect("server neither closed the socket nor stopped sending");
            out
        }

        /// Next frame, `None` on EOF/reset. Panics on timeout.
        pub async fn read_frame(&mut self) -> Option<Frame> {
            loop {
                if self.buf.len() >= 7 {
                    let size =
                        u32::from_be_bytes([self.buf[3], self.buf[4], self.buf[5], self.buf[6]])
                            as usize;
                    if self.buf.len() >= 8 + size {
                        let f = Frame {
                            kind: self.buf[0],
                            channel: u16::from_be_bytes([self.buf[1], self.buf[2]]),
                            payload: self.buf[7..7 + size].to_vec(),
                        };
                        assert_eq!(
                            self.buf[7 + size],
                            FRAME_END,
                            "server frame lacks frame-end"
                        );
                        self.buf.drain(..8 + size);
                        return Some(f);
                    }
                }
                let mut chunk = [0u8; 8192];
                let n = tokio::time::timeout(READ_TIMEOUT, self.stream.read(&mut chunk))
                    .await
                    .expect("timed out waiting for a frame");
                match n {
                    Ok(0) | Err(_) => return None,
                    Ok(n) => self.buf.extend_from_slice(&chunk[..n]),
                }
            }
        }

        /// Next method frame (skipping heartbeats).
        pub async fn read_method(&mut self) -> Option<Frame> {
            loop {
                let f = self.read_frame().await?;
                if f.kind == FRAME_HEARTBEAT {
                    continue;
                }
                return Some(f);
            }
        }

        /// Expects a specific method next.
        pub async fn expect_method(&mut self, class: u16, method: u16) -> Frame {
            let f = self
                .read_method()
                .await
                .unwrap_or_else(|| panic!("EOF waiting for {class}.{method}"));
            assert_eq!(f.method(), Some((class, method)), "unexpected frame {f:?}");
            f
        }

        /// Reads until the server closes the connection (connection.close),
        /// answers close-ok and returns the close. Frames before it (e.g.
        /// replies to earlier methods) are skipped. `None` if the socket
        /// closed without a connection.close.
        pub async fn expect_connection_close(&mut self) -> Option<Close> {
            loop {
                let f = self.read_method().await?;
                if f.method() == Some((10, 50)) {
                    let c = parse_close(&f);
                    let _ = self.try_send(&method(0, 10, 51, &[])).await;
                    return Some(c);
                }
            }
        }

        /// Reads until a channel.close arrives and answers close-ok.
        pub async fn expect_channel_close(&mut self) -> Option<Close> {
            loop {
                let f = self.read_method().await?;
                if f.method() == Some((10, 50)) {
                    panic!(
                        "expected channel.close, got connection.close {:?}",
                        parse_close(&f)
                    );
                }
                if f.method() == Some((20, 40)) {
                    let c = parse_close(&f);
                    let _ = self.try_send(&method(c.channel, 20, 41, &[])).await;
                    return Some(c);
                }
            }
        }

        /// Client side of the handshake: header, start-ok (PLAIN), tune-ok,
        /// open. Returns the close if the server refused.
        pub async fn handshake(
            &mut self,
            user: &str,
            pass: &str,
            vhost: &str,
        ) -> Result<(), Close> {
            self.send(PROTOCOL_HEADER).await;
            self.expect_method(10, 10).await; // start
            let mut a = 0u32.to_be_bytes().to_vec(); // client-properties: empty table
            a.extend(shortstr("PLAIN"));
            a.extend(longstr(format!("\0{user}\0{pass}").as_bytes()));
            a.extend(shortstr("en_US"));
            self.send(&method(0, 10, 11, &a)).await;
            let f = self.read_method().await.ok_or_else(eof_close)?;
            if f.method() == Some((10, 50)) {
                let c = parse_close(&f);
                let _ = self.try_send(&method(0, 10, 51, &[])).await;
                return Err(c);
            }
            assert_eq!(
                f.method(),
                Some((10, 30)),
                "expected connection.tune, got {f:?}"
            );
            let args = f.args();
            let channel_max = u16::from_be_bytes([args[0], args[1]]);
            self.frame_max = u32::from_be_bytes([args[2], args[3], args[4], args[5]]);
            let mut t = channel_max.to_be_bytes().to_vec();
            t.extend_from_slice(&self.frame_max.to_be_bytes());
            t.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
            self.send(&method(0, 10, 31, &t)).await;
            let mut o = shortstr(vhost);
            o.extend(shortstr(""));
            o.push(0);
            self.send(&method(0, 10, 40, &o)).await;
            let f = self.read_method().await.ok_or_else(eof_close)?;
            if f.method() == Some((10, 50)) {
                let c = parse_close(&f);
                let _ = self.try_send(&method(0, 10, 51, &[])).await;
                return Err(c);
            }
            assert_eq!(
                f.method(),
                Some((10, 41)),
                "expected connection.open-ok, got {f:?}"
            );
            Ok(())
        }

        /// channel.open and wait for open-ok.
        pub async fn open_channel(&mut self, ch: u16) {
            self.send(&channel_open(ch)).await;
            let f = self.expect_method(20, 11).await;
            assert_eq!(f.channel, ch);
        }
    }

    fn eof_close() -> Close {
        Close {
            channel: 0,
            code: 0,
            text: "EOF".into(),
            class_id: 0,
            method_id: 0,
        }
    }

    pub fn parse_close(f: &Frame) -> Close {
        let a = f.args();
        let code = u16::from_be_bytes([a[0], a[1]]);
        let n = a[2] as usize;
        let text = String::from_utf8_lossy(&a[3..3 + n]).into_owned();
        let r = &a[3 + n..];
        Close {
            channel: f.channel,
            code,
            text,
            class_id: u16::from_be_bytes([r[0], r[1]]),
            method_id: u16::from_be_bytes([r[2], r[3]]),
        }
    }
}

/// Connection events, to observe asynchronous channel closes (after a
/// publish or an ack). Subscribe before triggering the error.
pub fn error_events(
    conn: &Connection,
) -> std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>> {
    Box::pin(conn.events_listener())
}

/// The reply code of the next error event.
pub async fn next_error_code(
    events: &mut std::pin::Pin<Box<dyn futures_lite::Stream<Item = lapin::Event> + Send>>,
) -> u16 {
    loop {
        match within("an error event", events.next()).await {
            Some(lapin::Event::Error(e)) => {
                return reply_code(&e).unwrap_or_else(|| panic!("not an AMQP close: {e:?}"))
            }
            Some(_) => continue,
            None => panic!("event stream ended"),
        }
    }
}

// ---------------------------------------------------------------------------
// brokers configured without the harness's flags

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
