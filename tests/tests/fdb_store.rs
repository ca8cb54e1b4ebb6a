//! The gateway on the FoundationDB store (`--store fdb`), black box: a
//! confirmed persistent message is in FoundationDB, not on the gateway's
//! disk, so a gateway killed with SIGKILL and started again on an empty
//! data directory still has it.
//!
//! Needs a cluster (`scripts/start-fdb.sh start DIR` prints
//! `WEIR_FDB_CLUSTER_FILE`) and a `weir` built with `--features fdb`;
//! without the variable the test says "skipped" and why.

use lapin::options::*;
use lapin::types::FieldTable;
use weir_tests::*;

fn cluster_file() -> Option<String> {
    match std::env::var("WEIR_FDB_CLUSTER_FILE") {
        Ok(f) if !f.is_empty() => Some(f),
        _ => {
            println!(
                "skipped: WEIR_FDB_CLUSTER_FILE is not set (scripts/start-fdb.sh start DIR, and a weir built with --features fdb)"
            );
            None
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_messages_survive_a_killed_gateway_on_foundationdb() {
    let Some(file) = cluster_file() else {
        return;
    };
    // A namespace of its own: the cluster may hold other tests' data.
    let namespace = format!(
        "smoke-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    );
    let args = [
        "--store",
        "fdb",
        "--fdb-cluster-file",
        file.as_str(),
        "--fdb-namespace",
        namespace.as_str(),
        "--node-id",
        "gw-1",
    ];
    let mut broker = Broker::start_with(&args);
    assert!(
        broker.logs().contains("FoundationDB store opened"),
        "the gateway did not open the FoundationDB store:\n{}",
        broker.logs()
    );
    let bodies: Vec<String> = (0..20).map(|i| format!("fdb message {i}")).collect();
    {
        let conn = connect(&broker.url()).await;
        let ch = confirm_channel(&conn).await;
        ch.queue_declare(
            "fdb-q".into(),
            QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .expect("declare");
        for b in &bodies {
            publish_confirmed(&ch, "", "fdb-q", b.as_bytes(), persistent()).await;
        }
    }
    broker.kill9();
    // A fresh data directory: whatever comes back came from FoundationDB.
    let broker = Broker::start_with(&args);
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    assert_eq!(queue_len(&ch, "fdb-q").await, 20, "{}", broker.logs());
    let mut seen = Vec::new();
    while let Some(m) = ch
        .basic_get("fdb-q".into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        seen.push(String::from_utf8_lossy(&m.delivery.data).into_owned());
    }
    assert_eq!(seen, bodies, "messages after the restart, in order");
}
