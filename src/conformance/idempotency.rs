//! The rules of [`IdempotencyStore`]: one claim per key, tokens, retention, attempts run twice,
//! deadlines.

use std::time::Duration;

use bytes::Bytes;

use super::{soon, unique};
use crate::store::{BeginRequest, CompleteRequest};
use crate::store::{Hold, IdempotencyBegin, IdempotencyState, IdempotencyStore, StoreErrorKind};

fn idem_key() -> String {
    format!("t:idem:{{{}}}", unique("k"))
}

/// Idempotency records: lifecycle.
pub async fn lifecycle(store: &(impl IdempotencyStore + Clone)) {
    let key = idem_key();
    let lease = Duration::from_secs(30);
    let begin = |fp: &str, token: &str| {
        store.idempotency_begin(
            BeginRequest::new(
                Hold::new(key.clone(), token.to_owned()),
                fp.to_owned(),
                lease,
            ),
            soon(),
        )
    };
    assert_eq!(begin("fp", "a").await.unwrap(), IdempotencyBegin::Claimed);
    match begin("fp", "b").await.unwrap() {
        IdempotencyBegin::InFlight { lease_left } => {
            assert!(
                lease_left > Duration::from_secs(29) && lease_left <= lease,
                "{lease_left:?}"
            );
        }
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(
        begin("other", "b").await.unwrap(),
        IdempotencyBegin::Mismatch
    );
    let response = Bytes::from_static(b"\x00binary\xffresponse");
    assert!(
        store
            .idempotency_complete(
                CompleteRequest::new(
                    Hold::new(key.clone(), "a"),
                    response.clone(),
                    Duration::from_secs(60)
                ),
                soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(
        begin("fp", "c").await.unwrap(),
        IdempotencyBegin::Completed(response)
    );
    assert_eq!(
        begin("other", "c").await.unwrap(),
        IdempotencyBegin::Mismatch
    );
    // a completed record is no longer anybody's claim
    assert!(
        !store
            .idempotency_release(Hold::new(key.clone(), "a"))
            .await
            .unwrap()
    );
    assert!(
        !store
            .idempotency_extend(Hold::new(key.clone(), "a"), lease, soon())
            .await
            .unwrap()
    );
}

/// Idempotency records: exactly one claim among concurrent.
pub async fn exactly_one_claim_among_concurrent(store: &(impl IdempotencyStore + Clone)) {
    let key = idem_key();
    let attempts = (0..100).map(|i| {
        store.idempotency_begin(
            BeginRequest::new(
                Hold::new(key.clone(), format!("t{i}")),
                "fp",
                Duration::from_secs(30),
            ),
            soon(),
        )
    });
    let results = futures_util::future::join_all(attempts).await;
    let claimed = results
        .iter()
        .filter(|r| matches!(r, Ok(IdempotencyBegin::Claimed)))
        .count();
    let in_flight = results
        .iter()
        .filter(|r| matches!(r, Ok(IdempotencyBegin::InFlight { .. })))
        .count();
    assert_eq!((claimed, in_flight), (1, 99));
}

/// Idempotency records: only the owning token extends, releases or completes a claim, and a
/// claim whose lease ran out is taken over by the next request.
pub async fn token_checks_and_takeover(store: &(impl IdempotencyStore + Clone)) {
    let key = idem_key();
    let begin = |token: &str, lease: Duration| {
        store.idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), token.to_owned()), "fp", lease),
            soon(),
        )
    };
    let claimed = begin("stale", Duration::from_millis(200)).await.unwrap();
    assert_eq!(claimed, IdempotencyBegin::Claimed);
    assert!(!extend(store, &key, "intruder", Duration::from_secs(1)).await);
    assert!(!release(store, &key, "intruder").await);
    tokio::time::sleep(Duration::from_millis(260)).await;
    // the stalled owner's lease ran out: another request takes the key over
    let taken = begin("fresh", Duration::from_secs(30)).await.unwrap();
    assert_eq!(taken, IdempotencyBegin::Claimed);
    let fresh = Bytes::from_static(b"fresh");
    assert!(
        !complete(store, &key, "stale", Bytes::from_static(b"stale")).await,
        "stale completion refused"
    );
    assert!(!extend(store, &key, "stale", Duration::from_secs(30)).await);
    assert!(complete(store, &key, "fresh", fresh.clone()).await);
    assert_eq!(
        begin("late", Duration::from_secs(30)).await.unwrap(),
        IdempotencyBegin::Completed(fresh)
    );
}

/// `idempotency_extend` of `key` by `token` to `lease`.
async fn extend(store: &impl IdempotencyStore, key: &str, token: &str, lease: Duration) -> bool {
    let extend =
        store.idempotency_extend(Hold::new(key.to_owned(), token.to_owned()), lease, soon());
    extend.await.expect("store answers")
}

/// `idempotency_release` of `key` by `token`.
async fn release(store: &impl IdempotencyStore, key: &str, token: &str) -> bool {
    let release = store.idempotency_release(Hold::new(key.to_owned(), token.to_owned()));
    release.await.expect("store answers")
}

/// `idempotency_complete` of `key` by `token` with `response`, kept for a minute.
async fn complete(store: &impl IdempotencyStore, key: &str, token: &str, response: Bytes) -> bool {
    let retention = Duration::from_secs(60);
    let complete = store.idempotency_complete(
        CompleteRequest::new(
            Hold::new(key.to_owned(), token.to_owned()),
            response,
            retention,
        ),
        soon(),
    );
    complete.await.expect("store answers")
}

/// Idempotency records: retention and release.
pub async fn retention_and_release(store: &(impl IdempotencyStore + Clone)) {
    let key = idem_key();
    let begin = |token: &str| {
        store.idempotency_begin(
            BeginRequest::new(
                Hold::new(key.clone(), token.to_owned()),
                "fp",
                Duration::from_secs(30),
            ),
            soon(),
        )
    };
    assert_eq!(begin("a").await.unwrap(), IdempotencyBegin::Claimed);
    assert!(
        store
            .idempotency_extend(Hold::new(key.clone(), "a"), Duration::from_secs(30), soon())
            .await
            .unwrap()
    );
    assert!(
        store
            .idempotency_release(Hold::new(key.clone(), "a"))
            .await
            .unwrap()
    );
    // released: the next request runs
    assert_eq!(begin("b").await.unwrap(), IdempotencyBegin::Claimed);
    let done = Bytes::from_static(b"done");
    assert!(
        store
            .idempotency_complete(
                CompleteRequest::new(
                    Hold::new(key.clone(), "b"),
                    done.clone(),
                    Duration::from_millis(200)
                ),
                soon()
            )
            .await
            .unwrap()
    );
    assert_eq!(begin("c").await.unwrap(), IdempotencyBegin::Completed(done));
    tokio::time::sleep(Duration::from_millis(260)).await;
    assert_eq!(
        begin("d").await.unwrap(),
        IdempotencyBegin::Claimed,
        "retention over"
    );
}

/// Idempotency operations run twice (a call re-sent after a lost reply) answer as their first
/// run did: a claim claims again, a completion completes again, and a completed record is
/// neither released nor cut short.
pub async fn operations_run_twice_answer_alike(store: &(impl IdempotencyStore + Clone)) {
    let key = idem_key();
    let lease = Duration::from_secs(30);
    let begin = |token: &str| {
        store.idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), token.to_owned()), "fp", lease),
            soon(),
        )
    };
    assert_eq!(begin("a").await.unwrap(), IdempotencyBegin::Claimed);
    assert_eq!(
        begin("a").await.unwrap(),
        IdempotencyBegin::Claimed,
        "the second run of a claim claims again, not 409 to its own request"
    );
    assert!(matches!(
        begin("b").await.unwrap(),
        IdempotencyBegin::InFlight { .. }
    ));
    let record = Bytes::from_static(b"record");
    for run in ["first", "second"] {
        let completed = complete(store, &key, "a", record.clone()).await;
        assert!(completed, "{run} run of the completion");
    }
    let replay = begin("b").await.unwrap();
    assert_eq!(replay, IdempotencyBegin::Completed(record.clone()));
    // a completed record is neither released nor cut short by its owner's token
    assert!(!release(store, &key, "a").await);
    assert!(!extend(store, &key, "a", Duration::from_millis(50)).await);
    tokio::time::sleep(Duration::from_millis(120)).await;
    assert_eq!(
        begin("c").await.unwrap(),
        IdempotencyBegin::Completed(record)
    );
    // a release frees the key
    let other = idem_key();
    let begin_other = |token: &str| {
        store.idempotency_begin(
            BeginRequest::new(Hold::new(other.clone(), token.to_owned()), "fp", lease),
            soon(),
        )
    };
    assert_eq!(begin_other("d").await.unwrap(), IdempotencyBegin::Claimed);
    assert!(release(store, &other, "d").await);
    let after = begin_other("e").await.unwrap();
    assert_eq!(after, IdempotencyBegin::Claimed, "the released key is free");
}

/// Durations past what a store keeps (`Duration::MAX`) are clamped, never an error.
pub async fn huge_durations_are_clamped_alike(store: &(impl IdempotencyStore + Clone)) {
    let forever = Duration::MAX;
    let key = idem_key();
    let claimed = store
        .idempotency_begin(
            BeginRequest::new(Hold::new(key.clone(), "a"), "fp", forever),
            soon(),
        )
        .await
        .unwrap();
    assert_eq!(claimed, IdempotencyBegin::Claimed);
    assert!(
        store
            .idempotency_extend(Hold::new(key.clone(), "a"), forever, soon())
            .await
            .unwrap()
    );
    let record = Bytes::from_static(b"kept");
    assert!(
        store
            .idempotency_complete(
                CompleteRequest::new(Hold::new(key.clone(), "a"), record.clone(), forever),
                soon()
            )
            .await
            .unwrap()
    );
    let replay = store
        .idempotency_begin(
            BeginRequest::new(Hold::new(key, "b"), "fp", forever),
            soon(),
        )
        .await
        .unwrap();
    assert_eq!(replay, IdempotencyBegin::Completed(record), "written whole");
}

/// A write that reaches the store after its deadline does nothing and fails as a timeout: its
/// caller gave up on it, so it must neither take a key nor touch one held.
pub async fn writes_after_their_deadline_change_nothing(store: &(impl IdempotencyStore + Clone)) {
    let passed = tokio::time::Instant::now();
    let late = |what: &str, error: Option<crate::store::StoreError>| {
        let error = error.unwrap_or_else(|| panic!("{what}: a late write answered"));
        assert_eq!(error.kind(), StoreErrorKind::Timeout, "{what}: {error}");
    };
    let lease = Duration::from_secs(30);
    let record = format!("t:idem:{{{}}}", unique("late"));
    let begin = store.idempotency_begin(
        BeginRequest::new(Hold::new(record.clone(), "a"), "fp", lease),
        passed,
    );
    late("idempotency_begin", begin.await.err());
    let begin = store.idempotency_begin(
        BeginRequest::new(Hold::new(record.clone(), "b"), "fp", lease),
        soon(),
    );
    assert_eq!(
        begin.await.unwrap(),
        IdempotencyBegin::Claimed,
        "the record was left free"
    );
    let complete = store.idempotency_complete(
        CompleteRequest::new(Hold::new(record.clone(), "b"), "r", lease),
        passed,
    );
    late("idempotency_complete", complete.await.err());
    late(
        "idempotency_extend",
        store
            .idempotency_extend(Hold::new(record.clone(), "b"), lease, passed)
            .await
            .err(),
    );
    let begin = store.idempotency_begin(
        BeginRequest::new(Hold::new(record.clone(), "c"), "fp", lease),
        soon(),
    );
    assert!(
        matches!(begin.await.unwrap(), IdempotencyBegin::InFlight { .. }),
        "the late completion stored nothing"
    );
    assert!(
        store
            .idempotency_release(Hold::new(record, "b"))
            .await
            .unwrap()
    );
}

/// `idempotency_state` of `key`.
async fn state_of(store: &impl IdempotencyStore, key: &str) -> IdempotencyState {
    store.idempotency_state(key).await.expect("store answers")
}

/// Whether `left` is within the last second of `lease`: a lease read just after it was set.
fn fresh(left: Duration, lease: Duration) -> bool {
    left <= lease && left > lease - Duration::from_secs(1)
}

/// A record's state reads absent, in flight with its lease left, or completed with its response
/// and retention left — each with its age since its claim — and changes nothing; a released or
/// expired record reads absent.
pub async fn idempotency_state_reads_the_record_and_changes_nothing(
    store: &(impl IdempotencyStore + Clone),
) {
    let key = idem_key();
    assert_eq!(state_of(store, &key).await, IdempotencyState::Absent);
    let lease = Duration::from_secs(30);
    let begin = |token: &str, lease: Duration| {
        let hold = Hold::new(key.clone(), token.to_owned());
        store.idempotency_begin(BeginRequest::new(hold, "fp", lease), soon())
    };
    assert_eq!(begin("a", lease).await.unwrap(), IdempotencyBegin::Claimed);
    let mut first_age = Duration::ZERO;
    for _ in 0..2 {
        match state_of(store, &key).await {
            IdempotencyState::InFlight { lease_left, age } => {
                assert!(fresh(lease_left, lease), "{lease_left:?}");
                let age = age.expect("the record's age is kept");
                assert!(age < Duration::from_secs(1), "{age:?}");
                first_age = age;
            }
            other => panic!("expected in flight, got {other:?}"),
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(matches!(
        begin("b", lease).await.unwrap(),
        IdempotencyBegin::InFlight { .. }
    ));
    assert!(complete(store, &key, "a", Bytes::from_static(b"done")).await);
    for _ in 0..2 {
        match state_of(store, &key).await {
            IdempotencyState::Completed {
                response,
                retention_left,
                age,
            } => {
                assert_eq!(response, Bytes::from_static(b"done"));
                // aged since its claim, not since its completion
                let age = age.expect("the record's age is kept");
                assert!(
                    age >= first_age + Duration::from_millis(300) && age < Duration::from_secs(2),
                    "{age:?} after {first_age:?}"
                );
                assert!(
                    fresh(retention_left, Duration::from_secs(60)),
                    "{retention_left:?}"
                );
            }
            other => panic!("expected completed, got {other:?}"),
        }
    }
    assert_eq!(
        begin("c", lease).await.unwrap(),
        IdempotencyBegin::Completed(Bytes::from_static(b"done"))
    );
    let released = idem_key();
    let hold = Hold::new(released.clone(), "r".to_owned());
    let claimed = store.idempotency_begin(BeginRequest::new(hold, "fp", lease), soon());
    assert_eq!(claimed.await.unwrap(), IdempotencyBegin::Claimed);
    assert!(release(store, &released, "r").await);
    assert_eq!(state_of(store, &released).await, IdempotencyState::Absent);
    let brief = idem_key();
    let hold = Hold::new(brief.clone(), "s".to_owned());
    let short = BeginRequest::new(hold, "fp", Duration::from_millis(300));
    assert_eq!(
        store.idempotency_begin(short, soon()).await.unwrap(),
        IdempotencyBegin::Claimed
    );
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        state_of(store, &brief).await,
        IdempotencyState::Absent,
        "its lease ended"
    );
}
