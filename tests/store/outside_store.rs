//! A store written outside the crate, as a user writes one: a newtype that implements the four
//! store capabilities by delegating every call to a [`MemoryStore`], run against the
//! conformance suite that ships with the crate (feature `conformance`).
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tollgate::key::Key;
use tollgate::rate::{RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{BeginRequest, ClaimRequest, CompleteRequest, LockRequest, PermitRequest};
use tollgate::store::{
    ClaimOutcome, Hold, IdempotencyBegin, IdempotencyState, IdempotencyStore, LockAttempt,
    LockState, LockStore, MemoryStore, PermitAttempt, PermitStore, PermitUsage, RateStore,
    StoreErrorKind, StoreFuture,
};

/// The outside store: every operation handed to the memory store it wraps.
#[derive(Debug, Clone, Default)]
struct Delegating(MemoryStore);

impl RateStore for Delegating {
    fn check_rate(&self, policy: &Arc<RatePolicy>, check: RateCheck) -> StoreFuture<RateOutcome> {
        self.0.check_rate(policy, check)
    }

    fn timeout(&self) -> Duration {
        RateStore::timeout(&self.0)
    }

    fn reset_rate(&self, policy: &Arc<RatePolicy>, key: Key) -> StoreFuture<()> {
        self.0.reset_rate(policy, key)
    }

    fn line_up(
        &self,
        policy: &Arc<RatePolicy>,
        key: Key,
        waiter: u64,
        keep: Duration,
        deadline: Instant,
    ) -> StoreFuture<u32> {
        self.0.line_up(policy, key, waiter, keep, deadline)
    }

    fn leave_line(&self, policy: &Arc<RatePolicy>, key: Key, waiter: u64) -> StoreFuture<()> {
        self.0.leave_line(policy, key, waiter)
    }
}

impl LockStore for Delegating {
    fn timeout(&self) -> Duration {
        LockStore::timeout(&self.0)
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        let ClaimRequest {
            key, holder, ttl, ..
        } = request;
        self.0.claim(ClaimRequest::new(key, holder, ttl), deadline)
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        let LockRequest {
            hold,
            fence_key,
            lease,
            ..
        } = request;
        let Hold { key, token } = hold;
        self.0.lock_acquire(
            LockRequest::new(Hold::new(key, token), fence_key, lease),
            deadline,
        )
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0
            .extend_if_held(Hold::new(key, token), lease, deadline)
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0.delete_if_held(Hold::new(key, token))
    }

    fn lock_state(&self, key: &str, fence_key: &str) -> StoreFuture<LockState> {
        self.0.lock_state(key, fence_key)
    }
}

impl IdempotencyStore for Delegating {
    fn timeout(&self) -> Duration {
        IdempotencyStore::timeout(&self.0)
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let BeginRequest {
            hold,
            fingerprint,
            lease,
            ..
        } = request;
        let Hold { key, token } = hold;
        self.0.idempotency_begin(
            BeginRequest::new(Hold::new(key, token), fingerprint, lease),
            deadline,
        )
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let CompleteRequest {
            hold,
            response,
            retention,
            ..
        } = request;
        let Hold { key, token } = hold;
        self.0.idempotency_complete(
            CompleteRequest::new(Hold::new(key, token), response, retention),
            deadline,
        )
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0.idempotency_release(Hold::new(key, token))
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0
            .idempotency_extend(Hold::new(key, token), lease, deadline)
    }

    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        self.0.idempotency_state(key)
    }
}

impl PermitStore for Delegating {
    fn timeout(&self) -> Duration {
        PermitStore::timeout(&self.0)
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        let PermitRequest {
            hold,
            fence_key,
            limit,
            lease,
            wait,
            ..
        } = request;
        self.0.permit_acquire(
            PermitRequest::new(hold, fence_key, limit, lease, wait),
            deadline,
        )
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        self.0.permit_extend(hold, lease, deadline)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        self.0.permit_release(hold)
    }

    fn permit_usage(&self, key: &str) -> StoreFuture<PermitUsage> {
        self.0.permit_usage(key)
    }
}

tollgate::store_suite!((Delegating::default(), ()));
tollgate::rate_lines_suite!((Delegating::default(), ()));

/// A store written before the reads were added to the capability traits: it implements only
/// the writes, and still builds; its reads answer `Unsupported`.
#[derive(Debug, Clone, Default)]
struct WritesOnly(MemoryStore);

impl LockStore for WritesOnly {
    fn timeout(&self) -> Duration {
        LockStore::timeout(&self.0)
    }

    fn claim(&self, request: ClaimRequest, deadline: Instant) -> StoreFuture<ClaimOutcome> {
        self.0.claim(request, deadline)
    }

    fn lock_acquire(&self, request: LockRequest, deadline: Instant) -> StoreFuture<LockAttempt> {
        self.0.lock_acquire(request, deadline)
    }

    fn extend_if_held(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        self.0.extend_if_held(hold, lease, deadline)
    }

    fn delete_if_held(&self, hold: Hold) -> StoreFuture<bool> {
        self.0.delete_if_held(hold)
    }
}

impl IdempotencyStore for WritesOnly {
    fn timeout(&self) -> Duration {
        IdempotencyStore::timeout(&self.0)
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        self.0.idempotency_begin(request, deadline)
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        self.0.idempotency_complete(request, deadline)
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        self.0.idempotency_release(hold)
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        self.0.idempotency_extend(hold, lease, deadline)
    }
}

impl PermitStore for WritesOnly {
    fn timeout(&self) -> Duration {
        PermitStore::timeout(&self.0)
    }

    fn permit_acquire(
        &self,
        request: PermitRequest,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        self.0.permit_acquire(request, deadline)
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        self.0.permit_extend(hold, lease, deadline)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        self.0.permit_release(hold)
    }
}

#[tokio::test]
async fn reads_a_store_does_not_offer_answer_unsupported() {
    let store = WritesOnly::default();
    let kind = |error: tollgate::store::StoreError| error.kind();
    let lock = store.lock_state("k", "k:fence").await.map_err(kind);
    assert_eq!(lock, Err(StoreErrorKind::Unsupported));
    let permits = store.permit_usage("k").await.map_err(kind);
    assert_eq!(permits, Err(StoreErrorKind::Unsupported));
    let record = store.idempotency_state("k").await.map_err(kind);
    assert_eq!(record, Err(StoreErrorKind::Unsupported));
}
