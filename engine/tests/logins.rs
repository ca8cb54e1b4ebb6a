//! Logins cannot be starved (issue 20, item 5): the login gate
//! (`weir_engine::login`) with the authenticator, in process, time given.
//!
//! Count-based: who gets the next verification slot, how many argon2
//! hashes a flood costs (`Authenticator::verifications`), never how long
//! anything took. The gateway's `Shared::login` runs the same steps as
//! [`attempt`] below (budget, cache, turn, budget and cache again, hash,
//! failure recorded before the slot goes back); `tests/tests/hardening_login.rs`
//! shows them on the real binary.

use std::net::IpAddr;
use std::time::{Duration, Instant};
use weir_engine::auth::{Authenticator, Credential, Principal, UserSpec};
use weir_engine::login::{
    Entry, LoginGate, LoginRefused, Slot, Waiter, BUDGET, DECAY, PER_SOURCE_WAITING, TABLE_MAX,
};

fn ip(s: &str) -> IpAddr {
    s.parse().expect("ip")
}

fn run(e: Entry) -> Slot {
    match e {
        Entry::Run(s) => s,
        other => panic!("expected a slot at once, got {other:?}"),
    }
}

fn wait(e: Entry) -> Waiter {
    match e {
        Entry::Wait(w) => w,
        other => panic!("expected to wait, got {other:?}"),
    }
}

fn users() -> Authenticator {
    let user = |name: &str, pass: &str| UserSpec {
        name: name.into(),
        credential: Credential::Plain(pass.into()),
        tags: vec![],
        loopback_only: false,
    };
    Authenticator::new([user("alice", "alice-pw"), user("bob", "bob-pw")]).expect("users")
}

/// One login as `Shared::login` does it, when the slot is free or the
/// turn has come (the flood below is driven one attempt at a time).
fn attempt(
    gate: &LoginGate,
    auth: &Authenticator,
    user: &str,
    pass: &str,
    from: IpAddr,
    now: Instant,
) -> Result<Principal, LoginRefused> {
    let over = |gate: &LoginGate| {
        gate.over_budget(from, now)
            .then(|| LoginRefused::OverBudget {
                delay: gate.failed(from, now),
            })
    };
    let failed = |gate: &LoginGate| LoginRefused::Failed {
        delay: gate.failed(from, now),
    };
    if let Some(r) = over(gate) {
        return Err(r);
    }
    if let Some(r) = auth.check_cached(user, pass.as_bytes(), from) {
        return r.map_err(|_| failed(gate));
    }
    let slot = match gate.enter(from, now) {
        Entry::Run(s) => s,
        Entry::Wait(mut w) => w.try_take().expect("a sequential login gets its turn"),
        Entry::Busy => return Err(LoginRefused::Busy),
    };
    if let Some(r) = over(gate) {
        return Err(r);
    }
    let r = auth
        .authenticate(user, pass.as_bytes(), from)
        .map_err(|_| failed(gate));
    drop(slot);
    r
}

#[test]
fn a_flood_from_one_source_never_sits_in_front_of_another_sources_login() {
    let gate = LoginGate::new(2);
    let now = Instant::now();
    let (flood, bob, carol) = (ip("10.0.0.1"), ip("10.0.0.2"), ip("10.0.0.3"));
    // 400 logins at once from one address: one runs, 256 wait for that
    // source's turns, the rest are refused at once.
    let first = run(gate.enter(flood, now));
    let mut queued = Vec::new();
    let mut busy = 0;
    for _ in 1..400 {
        match gate.enter(flood, now) {
            Entry::Wait(w) => queued.push(w),
            Entry::Busy => busy += 1,
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(queued.len(), PER_SOURCE_WAITING);
    assert_eq!(busy, 399 - PER_SOURCE_WAITING);
    assert_eq!(gate.stats().running, 1, "one verification per source");
    // Another address arriving after all of them is served at once.
    let bob_slot = run(gate.enter(bob, now));
    // With both slots busy, a third address waits, but only for a turn:
    // the next slot freed is its, not the flood's.
    let mut carol_turn = wait(gate.enter(carol, now));
    assert!(carol_turn.try_take().is_none());
    drop(first);
    let carol_slot = carol_turn
        .try_take()
        .expect("the new source's turn comes first");
    assert!(
        queued.iter_mut().all(|w| w.try_take().is_none()),
        "no flood login got that slot"
    );
    assert_eq!(gate.stats().waiting, PER_SOURCE_WAITING);
    // The flood goes on, one at a time, as slots come back.
    drop(bob_slot);
    let mut next = queued.remove(0);
    let next_slot = next.try_take().expect("the flood's next turn");
    assert!(queued.iter_mut().all(|w| w.try_take().is_none()));
    drop(carol_slot);
    assert!(
        queued.iter_mut().all(|w| w.try_take().is_none()),
        "still one verification at a time for the flood's source"
    );
    drop(next_slot);
    assert!(queued[0].try_take().is_some());
}

#[test]
fn over_budget_sources_are_refused_without_hashing_and_other_users_get_in() {
    let auth = users();
    let gate = LoginGate::new(2);
    let now = Instant::now();
    let (flood, elsewhere) = (ip("192.0.2.1"), ip("198.51.100.7"));
    // Bob logged in once before the flood: remembered.
    assert!(attempt(&gate, &auth, "bob", "bob-pw", elsewhere, now).is_ok());
    let before = auth.verifications();
    let mut failed = 0;
    let mut over = 0;
    for i in 0..400 {
        match attempt(&gate, &auth, "alice", &format!("guess-{i}"), flood, now) {
            Err(LoginRefused::Failed { .. }) => failed += 1,
            Err(LoginRefused::OverBudget { delay }) => {
                assert_eq!(delay, Duration::from_millis(3200));
                over += 1
            }
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(failed, BUDGET, "failures hashed before the budget ran out");
    assert_eq!(over, 400 - BUDGET);
    assert_eq!(
        auth.verifications() - before,
        u64::from(BUDGET),
        "an over-budget attempt costs no hash"
    );
    // Over budget, even the right password is refused unchecked (the cache
    // must not answer a guesser for free).
    assert!(matches!(
        attempt(&gate, &auth, "alice", "alice-pw", flood, now),
        Err(LoginRefused::OverBudget { .. })
    ));
    assert_eq!(auth.verifications() - before, u64::from(BUDGET));
    // Everyone else: Alice's first login from elsewhere is one hash, and
    // Bob's known login none: the flood left the cache alone.
    let mark = auth.verifications();
    assert!(attempt(&gate, &auth, "alice", "alice-pw", elsewhere, now).is_ok());
    assert!(attempt(&gate, &auth, "bob", "bob-pw", elsewhere, now).is_ok());
    assert_eq!(auth.verifications() - mark, 1);
    assert!(matches!(
        auth.check_cached("bob", b"bob-pw", elsewhere),
        Some(Ok(_))
    ));
}

#[test]
fn a_source_is_let_back_in_after_a_quiet_spell_only() {
    let auth = users();
    let gate = LoginGate::new(1);
    let t0 = Instant::now();
    let from = ip("203.0.113.9");
    for _ in 0..BUDGET {
        assert!(gate.failed(from, t0) > Duration::ZERO);
    }
    assert!(gate.over_budget(from, t0));
    // Refused attempts keep it locked while they go on...
    let mut t = t0;
    for _ in 0..5 {
        t += DECAY / 2;
        assert!(matches!(
            attempt(&gate, &auth, "alice", "x", from, t),
            Err(LoginRefused::OverBudget { .. })
        ));
    }
    // ...and one quiet period lets one attempt through.
    t += DECAY;
    assert!(!gate.over_budget(from, t));
    assert!(attempt(&gate, &auth, "alice", "alice-pw", from, t).is_ok());
    // A wrong one puts it straight back over.
    assert!(matches!(
        attempt(&gate, &auth, "alice", "nope", from, t),
        Err(LoginRefused::Failed { .. })
    ));
    assert!(gate.over_budget(from, t));
}

#[test]
fn logins_whose_connection_went_away_are_skipped() {
    let gate = LoginGate::new(1);
    let now = Instant::now();
    let a = ip("10.1.0.1");
    let held = run(gate.enter(a, now));
    let gone = wait(gate.enter(a, now));
    let mut next = wait(gate.enter(a, now));
    drop(gone);
    drop(held);
    assert!(next.try_take().is_some(), "the turn went to a live login");
    assert_eq!(gate.stats().waiting, 0);
}

#[test]
fn a_granted_turn_never_taken_is_given_back() {
    let gate = LoginGate::new(1);
    let now = Instant::now();
    let (a, b) = (ip("10.2.0.1"), ip("10.2.0.2"));
    let held = run(gate.enter(a, now));
    let b_turn = wait(gate.enter(b, now));
    let mut a_next = wait(gate.enter(a, now));
    drop(held); // B's turn is granted, but B never takes it.
    drop(b_turn);
    assert!(a_next.try_take().is_some());
}

#[test]
fn one_source_waits_with_a_bounded_queue() {
    let gate = LoginGate::new(1);
    let now = Instant::now();
    let a = ip("10.3.0.1");
    let _held = run(gate.enter(a, now));
    let waiting: Vec<Waiter> = (0..PER_SOURCE_WAITING)
        .map(|_| wait(gate.enter(a, now)))
        .collect();
    assert!(matches!(gate.enter(a, now), Entry::Busy));
    // A waiter whose connection went away makes room.
    drop(waiting);
    assert!(matches!(gate.enter(a, now), Entry::Wait(_)));
    // Another source is not affected.
    assert!(matches!(gate.enter(ip("10.3.0.2"), now), Entry::Wait(_)));
}

#[test]
fn the_source_table_is_bounded() {
    let gate = LoginGate::new(2);
    let now = Instant::now();
    for i in 0..(TABLE_MAX as u32 + 1000) {
        let from = IpAddr::from((0x0a00_0000u32 + i).to_be_bytes());
        gate.failed(from, now);
        // Sources that only logged in leave nothing behind.
        drop(run(gate.enter(
            IpAddr::from((0x0b00_0000u32 + i).to_be_bytes()),
            now,
        )));
    }
    let sources = gate.stats().sources;
    assert!(sources <= TABLE_MAX, "{sources}");
    // IPv6 sources are /64s: a client walking its /64 is one entry.
    let before = gate.stats().sources;
    for i in 0..100u16 {
        gate.failed(
            IpAddr::from([0x2001, 0xdb8, 0, 1, 0, 0, 0, i]),
            now + DECAY * 100,
        );
    }
    assert!(gate.stats().sources <= before + 1);
    assert!(gate.over_budget(
        IpAddr::from([0x2001, 0xdb8, 0, 1, 9, 9, 9, 9]),
        now + DECAY * 100
    ));
}
