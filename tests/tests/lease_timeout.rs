//! The lease (visibility) timeout: a delivery left unacknowledged longer than
//! `--consumer-timeout` closes its channel with 406, as RabbitMQ's
//! `consumer_timeout` does, and the message goes back to the queue,
//! redelivered, for another consumer. Which leases count as expired (the
//! oldest unsettled one, by the time given) is tested in process
//! (`engine/tests/client.rs`); this is the flag, the session's timer and
//! the 406, once, and it waits about two seconds of real time.

use lapin::options::*;
use lapin::types::FieldTable;
use lapin::BasicProperties;
use weir_tests::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unacked_delivery_times_out_and_returns_to_the_queue() {
    let broker = Broker::start_with(&["--consumer-timeout", "1"]);
    let conn = connect(&broker.url()).await;
    let ch = confirm_channel(&conn).await;
    declare_queue(&ch, "lt").await;
    publish_confirmed(&ch, "", "lt", b"slow", BasicProperties::default()).await;

    // A consumer that takes the message and never acks it.
    let mut events = error_events(&conn);
    let stuck = conn.create_channel().await.expect("channel");
    let mut consumer = stuck
        .basic_consume(
            "lt".into(),
            "stuck".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let first = next_delivery(&mut consumer).await;
    assert_eq!(first.data, b"slow");
    assert!(!first.redelivered);

    // The broker closes that channel with 406 once the lease expires...
    assert_eq!(next_error_code(&mut events).await, 406);

    // ...and the message is back in the queue, flagged redelivered.
    let other = connect(&broker.url()).await;
    let och = other.create_channel().await.expect("channel");
    let mut c2 = och
        .basic_consume(
            "lt".into(),
            "other".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .expect("consume");
    let again = next_delivery(&mut c2).await;
    assert_eq!(again.data, b"slow");
    assert!(again.redelivered);
    again.ack(BasicAckOptions::default()).await.expect("ack");
    assert_eq!(queue_len(&och, "lt").await, 0);

    // The connection that held the expired lease still works.
    let fresh = conn.create_channel().await.expect("a new channel");
    assert_eq!(queue_len(&fresh, "lt").await, 0);
}
