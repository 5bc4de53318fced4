//! A store written outside the crate, as a user writes one: a newtype that implements the four
//! store capabilities by delegating every call to a [`MemoryStore`], run against the
//! conformance suite that ships with the crate (feature `conformance`).
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;
use tollgate::key::Key;
use tollgate::rate::{RateCheck, RateOutcome, RatePolicy};
use tollgate::store::{
    ClaimOutcome, Hold, IdempotencyBegin, IdempotencyStore, LockAttempt, LockStore, MemoryStore,
    PermitAttempt, PermitStore, RateStore, StoreFuture,
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
}

impl LockStore for Delegating {
    fn timeout(&self) -> Duration {
        LockStore::timeout(&self.0)
    }

    fn claim(
        &self,
        key: String,
        holder: String,
        ttl: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<ClaimOutcome> {
        self.0.claim(key, holder, ttl, deadline)
    }

    fn lock_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<LockAttempt> {
        let Hold { key, token } = hold;
        self.0
            .lock_acquire(Hold::new(key, token), fence_key, lease, deadline)
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
}

impl IdempotencyStore for Delegating {
    fn timeout(&self) -> Duration {
        IdempotencyStore::timeout(&self.0)
    }

    fn idempotency_begin(
        &self,
        hold: Hold,
        fingerprint: String,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let Hold { key, token } = hold;
        self.0
            .idempotency_begin(Hold::new(key, token), fingerprint, lease, deadline)
    }

    fn idempotency_complete(
        &self,
        hold: Hold,
        response: Bytes,
        retention: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.0
            .idempotency_complete(Hold::new(key, token), response, retention, deadline)
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
}

impl PermitStore for Delegating {
    fn timeout(&self) -> Duration {
        PermitStore::timeout(&self.0)
    }

    fn permit_acquire(
        &self,
        hold: Hold,
        fence_key: String,
        limit: u32,
        lease: Duration,
        wait: Option<Duration>,
        deadline: Instant,
    ) -> StoreFuture<PermitAttempt> {
        self.0
            .permit_acquire(hold, fence_key, limit, lease, wait, deadline)
    }

    fn permit_extend(&self, hold: Hold, lease: Duration, deadline: Instant) -> StoreFuture<bool> {
        self.0.permit_extend(hold, lease, deadline)
    }

    fn permit_release(&self, hold: Hold) -> StoreFuture<bool> {
        self.0.permit_release(hold)
    }
}

tollgate::store_suite!((Delegating::default(), ()));
