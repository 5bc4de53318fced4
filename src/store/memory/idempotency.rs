//! [`IdempotencyStore`] in process: idempotency claims and records.

use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use super::{Entry, MemoryStore, NOMINAL_TIMEOUT, OnMatch, Value, before, done, expiry};
use crate::store::{BeginRequest, CompleteRequest, IdempotencyState};
use crate::store::{Hold, IdempotencyBegin, IdempotencyStore, StoreFuture};

#[derive(Debug)]
pub(super) struct IdemRecord {
    fingerprint: String,
    /// The owner's token, kept once done (so that a second completion is recognised).
    token: String,
    /// The response, once done.
    response: Option<Bytes>,
    /// Store time in microseconds when the request claimed it.
    created: u64,
}

impl Value {
    /// Whether this is an idempotency record whose running claim `token` owns.
    fn owned_by(&self, token: &str) -> bool {
        matches!(self, Self::Idem(r) if r.token == token && r.response.is_none())
    }
}

impl Entry {
    /// Stores `response` in the running idempotency record that `token` owns, kept until
    /// `expires_at`; whether it is stored (or was: a second run of the same completion stored
    /// this very response).
    fn complete(&mut self, token: &str, response: &Bytes, expires_at: u64) -> bool {
        let Value::Idem(record) = &mut self.value else {
            return false;
        };
        if record.token != token {
            return false;
        }
        if let Some(stored) = &record.response {
            return stored == response;
        }
        record.response = Some(response.clone());
        self.expires_at = expires_at;
        true
    }
}

impl IdempotencyStore for MemoryStore {
    fn timeout(&self) -> Duration {
        NOMINAL_TIMEOUT
    }

    fn idempotency_begin(
        &self,
        request: BeginRequest,
        deadline: Instant,
    ) -> StoreFuture<IdempotencyBegin> {
        let Hold { key, token } = request.hold;
        before(deadline, || {
            let now = self.now_us();
            self.inner.entries.run(&key, None, now, |held| {
                let lease_left = held.left(&key, now);
                Ok(match held.live(&key, now) {
                    None => {
                        let record = IdemRecord {
                            fingerprint: request.fingerprint.clone(),
                            token: token.clone(),
                            response: None,
                            created: now,
                        };
                        held.put(&key, Value::Idem(record), expiry(now, request.lease))?;
                        IdempotencyBegin::Claimed
                    }
                    Some(Value::Idem(record)) if record.fingerprint != request.fingerprint => {
                        IdempotencyBegin::Mismatch
                    }
                    Some(Value::Idem(IdemRecord {
                        response: Some(response),
                        ..
                    })) => IdempotencyBegin::Completed(response.clone()),
                    // the same attempt again: claimed already
                    Some(v) if v.owned_by(&token) => {
                        held.set_expiry(&key, expiry(now, request.lease));
                        IdempotencyBegin::Claimed
                    }
                    Some(_) => IdempotencyBegin::InFlight { lease_left },
                })
            })
        })
    }

    fn idempotency_complete(
        &self,
        request: CompleteRequest,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = request.hold;
        before(deadline, || {
            let now = self.now_us();
            self.inner.entries.run(&key, None, now, |held| {
                let retained = expiry(now, request.retention);
                let stored = held.update(&key, |entry| {
                    entry.complete(&token, &request.response, retained)
                });
                Ok(stored.unwrap_or(false))
            })
        })
    }

    fn idempotency_release(&self, hold: Hold) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        self.token_checked(&key, |v| v.owned_by(&token), OnMatch::Release, None)
    }

    fn idempotency_extend(
        &self,
        hold: Hold,
        lease: Duration,
        deadline: Instant,
    ) -> StoreFuture<bool> {
        let Hold { key, token } = hold;
        let expire = OnMatch::Expire(lease);
        self.token_checked(&key, |v| v.owned_by(&token), expire, Some(deadline))
    }

    fn idempotency_state(&self, key: &str) -> StoreFuture<IdempotencyState> {
        let now = self.now_us();
        done(self.inner.entries.run(key, None, now, |held| {
            let left = held.left(key, now);
            let Some(Value::Idem(record)) = held.live(key, now) else {
                return Ok(IdempotencyState::Absent);
            };
            let age = Some(Duration::from_millis(
                now.saturating_sub(record.created) / 1000,
            ));
            Ok(match &record.response {
                Some(response) => IdempotencyState::Completed {
                    response: response.clone(),
                    retention_left: left,
                    age,
                },
                None => IdempotencyState::InFlight {
                    lease_left: left,
                    age,
                },
            })
        }))
    }
}
