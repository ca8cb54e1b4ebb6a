//! The operator's commands of the real `weir` binary: `--version` with the
//! commit, `check-config FILE` (valid and invalid files, nothing started),
//! completions and man page, and systemd readiness (`READY=1` on
//! `NOTIFY_SOCKET` once listening, `STOPPING=1` at SIGTERM).

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use weir_tests::*;

fn weir(args: &[&str]) -> Output {
    Command::new(weir_bin())
        .args(args)
        .env_remove("WEIR_CONFIG")
        .output()
        .expect("running weir")
}

#[test]
fn version_names_the_commit() {
    let out = weir(&["--version"]);
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    // "weir 0.1.0 (commit 0123456789ab)", or "unknown" built without git.
    let commit = text
        .split("(commit ")
        .nth(1)
        .and_then(|r| r.split(')').next())
        .unwrap_or_else(|| panic!("no commit in {text:?}"));
    assert!(
        commit == "unknown" || (commit.len() >= 7 && commit.chars().all(|c| c.is_ascii_hexdigit())),
        "{text:?}"
    );
}

#[test]
fn check_config_accepts_a_valid_file_without_starting() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().join("data");
    let port = free_port();
    let file = dir.path().join("weir.toml");
    std::fs::write(
        &file,
        format!(
            "[amqp]\nlisten = \"127.0.0.1:{port}\"\n[store.log]\ndata_dir = \"{}\"\n\
             [[policies]]\nname = \"ttl\"\npattern = '^jobs\\.'\ndefinition = {{ message-ttl = 1000 }}\n",
            data.display()
        ),
    )
    .expect("write");
    let out = weir(&["check-config", file.to_str().expect("utf-8")]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("is valid"), "{text}");
    assert!(text.contains(&format!("127.0.0.1:{port}")), "{text}");
    // Nothing was started: no data directory, the port still free.
    assert!(!data.exists(), "check-config created the data directory");
    std::net::TcpListener::bind(("127.0.0.1", port)).expect("port still free");
}

#[test]
fn check_config_refuses_an_invalid_file_with_the_reason() {
    let dir = tempfile::tempdir().expect("tempdir");
    for (body, reason) in [
        ("[amqp]\nframe_max = 10\n", "frame_max"),
        ("[amqp]\nlisten = \"nowhere\"\n", "amqp"),
        ("[bogus]\nx = 1\n", "unknown key `bogus`"),
        (
            "[[policies]]\nname = \"p\"\npattern = \".*\"\ndefinition = { max-priority = 5 }\n",
            "max-priority",
        ),
        (
            "[tls]\ncert_file = \"/nonexistent/c.pem\"\nkey_file = \"/nonexistent/k.pem\"\n",
            "/nonexistent/",
        ),
    ] {
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, body).expect("write");
        let out = weir(&["check-config", file.to_str().expect("utf-8")]);
        assert_eq!(out.status.code(), Some(2), "{body}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(reason), "{body}: {err}");
    }
    let out = weir(&["check-config", "/nonexistent/weir.toml"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn completions_and_man_page() {
    let bash = weir(&["completions", "bash"]);
    assert!(bash.status.success());
    let bash = String::from_utf8_lossy(&bash.stdout);
    assert!(bash.contains("_weir()"), "{bash}");
    assert!(bash.contains("check-config") && bash.contains("--amqp-listen"));
    let zsh = weir(&["completions", "zsh"]);
    assert!(String::from_utf8_lossy(&zsh.stdout).starts_with("#compdef weir"));
    let man = weir(&["man"]);
    assert!(man.status.success());
    let man = String::from_utf8_lossy(&man.stdout);
    assert!(man.contains(".TH weir 1"), "{man}");
    assert!(man.contains("amqp\\-listen"), "flags are in the man page");
}

/// `Type=notify`: READY=1 (with our pid) once the listeners accept, then
/// STOPPING=1 at SIGTERM.
#[test]
fn readiness_is_reported_to_notify_socket() {
    let dir = tempfile::tempdir().expect("tempdir");
    let sock_path = dir.path().join("notify");
    let sock = UnixDatagram::bind(&sock_path).expect("bind notify socket");
    sock.set_read_timeout(Some(START_TIMEOUT)).expect("timeout");
    let amqp = free_port();
    let mut child = Command::new(weir_bin())
        .args([
            "--data-dir",
            dir.path().join("data").to_str().expect("utf-8"),
            "--amqp-listen",
            &format!("127.0.0.1:{amqp}"),
            "--mqtt-listen",
            "127.0.0.1:0",
            "--mqtt-ws-listen",
            "127.0.0.1:0",
            "--http-listen",
            "127.0.0.1:0",
        ])
        .env("NOTIFY_SOCKET", &sock_path)
        .env_remove("WEIR_CONFIG")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn weir");
    let mut buf = [0u8; 512];
    let n = sock
        .recv(&mut buf)
        .expect("READY=1 within the start timeout");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "READY=1"), "{msg}");
    assert!(msg.contains(&format!("MAINPID={}", child.id())), "{msg}");
    // Ready means accepting.
    std::net::TcpStream::connect(("127.0.0.1", amqp)).expect("AMQP accepts once ready");

    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    sock.set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    let n = sock.recv(&mut buf).expect("STOPPING=1 after SIGTERM");
    let msg = String::from_utf8_lossy(&buf[..n]).into_owned();
    assert!(msg.lines().any(|l| l == "STOPPING=1"), "{msg}");
    assert!(child.wait().expect("wait").success());
}
