//! Configuration in sections and hashed users, end to end: the real binary
//! started with a sectioned TOML file, a user whose password is an argon2id
//! hash printed by `weir hash-password`, and lapin logging in.

#![forbid(unsafe_code)]

use lapin::{Connection, ConnectionProperties};
use std::io::Write;
use std::process::{Command, Stdio};
use weir_tests::*;

/// `weir hash-password` with `password` (and a newline) on stdin.
fn hash_password(password: &str) -> String {
    let mut child = Command::new(weir_bin())
        .arg("hash-password")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawning weir hash-password");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(format!("{password}\n").as_bytes())
        .expect("writing the password");
    let out = child.wait_with_output().expect("weir hash-password");
    assert!(
        out.status.success(),
        "weir hash-password failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let phc = String::from_utf8(out.stdout).expect("utf-8 hash");
    let phc = phc.trim().to_string();
    assert!(
        phc.starts_with("$argon2id$"),
        "not an argon2id PHC string: {phc}"
    );
    assert!(!phc.contains(password), "the hash contains the password");
    phc
}

/// The AMQP reply code of a refused lapin connection.
async fn refused_code(url: &str) -> Option<u16> {
    match within(
        "refused connect",
        Connection::connect(url, ConnectionProperties::default()),
    )
    .await
    {
        Ok(_) => panic!("{url}: login accepted"),
        Err(e) => reply_code(&e),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sectioned_file_with_a_hashed_user() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let file = tmp.path().join("weir.toml");
    let phc = hash_password("wonderland");
    let (f, d) = (file.clone(), dir.clone());
    let broker = Broker::start_custom(&dir, move |port, cmd| {
        std::fs::write(
            &f,
            format!(
                "log = \"info\"\n\
                 \n\
                 [amqp]\n\
                 listen = \"127.0.0.1:{port}\"\n\
                 heartbeat = 30\n\
                 \n\
                 [store]\n\
                 kind = \"log\"\n\
                 \n\
                 [store.log]\n\
                 data_dir = {:?}\n\
                 segment_mb = 8\n\
                 \n\
                 [auth]\n\
                 default_pass = \"s3cret\"\n\
                 \n\
                 [[auth.users]]\n\
                 name = \"alice\"\n\
                 password_hash = \"{phc}\"\n\
                 tags = [\"administrator\"]\n",
                d.display().to_string()
            ),
        )
        .unwrap();
        cmd.arg("--config").arg(&f).current_dir(f.parent().unwrap());
    });

    // The hashed user and the default user (plain in [auth], hashed at load).
    assert_broker_healthy(&broker.url_with("alice", "wonderland", "%2f")).await;
    assert_broker_healthy(&broker.url_with("guest", "s3cret", "%2f")).await;
    // A second login takes the verification cache's path: still accepted.
    assert_broker_healthy(&broker.url_with("alice", "wonderland", "%2f")).await;

    // Wrong passwords and unknown users are refused alike, with 403.
    // (Few attempts: each failure from an address waits twice as long.)
    for (user, pass) in [
        ("alice", "Wonderland"),
        ("guest", "guest"),
        ("mallory", "wonderland"),
    ] {
        assert_eq!(
            refused_code(&broker.url_with(user, pass, "%2f")).await,
            Some(403),
            "{user}/{pass}"
        );
    }
    assert!(
        dir.join("log").is_dir(),
        "the store is not in [store.log] data_dir {}",
        dir.display()
    );
    let logs = broker.logs();
    assert!(
        !logs.contains("deprecated"),
        "a sectioned file warned:\n{logs}"
    );
    assert!(
        !logs.contains("wonderland"),
        "a password reached the log:\n{logs}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flat_keys_still_work_with_a_deprecation_warning() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("data");
    let file = tmp.path().join("old.toml");
    let (f, d) = (file.clone(), dir.clone());
    let broker = Broker::start_custom(&dir, move |port, cmd| {
        std::fs::write(
            &f,
            format!(
                "amqp_listen = \"127.0.0.1:{port}\"\ndata_dir = {:?}\nheartbeat = 30\n",
                d.display().to_string()
            ),
        )
        .unwrap();
        cmd.arg("--config").arg(&f).current_dir(f.parent().unwrap());
    });
    assert_broker_healthy(&broker.url()).await;
    let logs = broker.logs();
    for (old, new) in [("amqp_listen", "[amqp]"), ("data_dir", "[store.log]")] {
        assert!(
            logs.lines()
                .any(|l| l.contains(&format!("`{old}` is deprecated")) && l.contains(new)),
            "no deprecation warning for {old}:\n{logs}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_text_where_a_hash_belongs_is_refused_at_startup() {
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("weir.toml");
    std::fs::write(
        &file,
        format!(
            "[amqp]\nlisten = \"127.0.0.1:{}\"\n[store.log]\ndata_dir = {:?}\n\
             [[auth.users]]\nname = \"bob\"\npassword_hash = \"hunter2\"\n",
            free_port(),
            tmp.path().join("data").display().to_string()
        ),
    )
    .unwrap();
    let (status, output) = run_weir_to_exit(|cmd| {
        cmd.arg("--config").arg(&file).current_dir(tmp.path());
    });
    assert!(!status.success(), "weir started with a bad hash\n{output}");
    assert!(
        output.contains("user bob"),
        "the error does not name the user:\n{output}"
    );
    assert!(!output.contains("AMQP listener ready"), "{output}");
}
