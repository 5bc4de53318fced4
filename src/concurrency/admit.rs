//! The admission of a request: a permit from the store — waiting in the key's queue, if so
//! configured — or the failure policy's answer.

use std::sync::Arc;
use std::time::Duration;

use http::Response;
use tokio::time::Instant;

use super::permit::{Held, Permit, StorePermit};
use super::rejection::{full, store_unavailable};
use super::report::{Outcome, report};
use super::settings::Settings;
use crate::body::Complete;
use crate::grpc::Wire;
use crate::keepalive::{self, Owner, UndoUnanswered};
use crate::key::Key;
use crate::keyspace;
use crate::on_error::OnStoreError;
use crate::store::{Hold, PermitAttempt, PermitRequest, StoreError};

/// What became of a request's claim to a permit.
pub(super) enum Admission {
    /// It holds a permit (the store's, with its [`Permit`], or the local fallback's).
    Admitted(Held, Option<Permit>),
    /// It goes on without a permit: no key, or the store unreachable.
    Unlimited,
    /// It is refused with this response.
    Refused(Response<Complete>),
}

/// Takes one of `key`'s `limit` permits — waiting for one in the key's queue, if so configured —
/// or says why not.
pub(super) async fn admit(settings: &Settings, key: Key, limit: u32, wire: Wire) -> Admission {
    let (permits, fence_key) = keyspace::permits(&settings.prefix, &key);
    let hold = Hold::new(permits, uuid::Uuid::new_v4().to_string());
    let give_up_at = settings.queue.map(|patience| Instant::now() + patience);
    // a waiter that goes away (cancelled, or giving up) leaves the queue at once
    let mut leave = None;
    let mut pause = FIRST_PAUSE;
    loop {
        match acquire(settings, &hold, &fence_key, limit).await {
            Ok(PermitAttempt::Acquired { fence }) => {
                if let Some(mut leave) = leave.take() {
                    UndoUnanswered::disarm(&mut leave);
                }
                report(&settings.limiter, key, limit, Outcome::Acquired, "store");
                let store = Arc::clone(&settings.store);
                let (held, permit) = StorePermit::new(store, hold, settings.lease, fence);
                return Admission::Admitted(Held::Store { _permit: held }, Some(permit));
            }
            Ok(PermitAttempt::Full { next_free, .. }) => {
                let now = Instant::now();
                match give_up_at {
                    Some(at) if now + pause < at => {
                        if leave.is_none() {
                            report(&settings.limiter, key, limit, Outcome::Queued, "store");
                        }
                        leave.get_or_insert_with(|| leave_queue(settings, &hold));
                        tokio::time::sleep(jittered(pause)).await;
                        pause = (pause * 2).min(LAST_PAUSE);
                    }
                    _ => {
                        report(&settings.limiter, key, limit, Outcome::Refused, "store");
                        return Admission::Refused(full(settings, limit, next_free, wire));
                    }
                }
            }
            Err(error) => return unavailable(settings, key, limit, &error, wire),
        }
    }
}

/// The first pause of a waiter between attempts; it doubles up to [`LAST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(5);
/// The longest pause of a waiter between attempts.
const LAST_PAUSE: Duration = Duration::from_millis(100);

/// One attempt at a permit for `hold`: should it go unanswered, it may have taken one, which is
/// given back in the background, token-checked, once its deadline has passed (the store
/// refuses it from then on).
async fn acquire(
    settings: &Settings,
    hold: &Hold,
    fence_key: &str,
    limit: u32,
) -> Result<PermitAttempt, StoreError> {
    let store = &settings.store;
    let deadline = Instant::now() + store.timeout();
    let undo = {
        let (store, hold) = (Arc::clone(store), hold.clone());
        move || store.permit_release(hold.clone())
    };
    // a waiter's place outlives the pauses between its attempts and a slow answer
    let place = settings.queue.map(|_| LAST_PAUSE * 4 + store.timeout() * 2);
    let lease = settings.lease;
    let fence_key = fence_key.to_owned();
    let attempt = store.permit_acquire(
        PermitRequest::new(hold.clone(), fence_key, limit, lease, place),
        deadline,
    );
    keepalive::attempt_with_undo(Owner::Permit, deadline, undo, attempt).await
}

/// Gives up `hold`'s place in the queue when dropped (unless disarmed).
fn leave_queue(
    settings: &Settings,
    hold: &Hold,
) -> UndoUnanswered<impl FnMut() -> crate::store::StoreFuture<bool> + Send + 'static> {
    let (store, hold) = (Arc::clone(&settings.store), hold.clone());
    let release = move || store.permit_release(hold.clone());
    UndoUnanswered::new(
        Owner::Permit,
        "a waiter left the queue",
        Instant::now(),
        release,
    )
}

/// `pause`, less a random part of up to half of it: waiters of many copies do not try in step.
fn jittered(pause: Duration) -> Duration {
    pause.mul_f64(1.0 - crate::lock::rand_unit() / 2.0)
}

/// What the failure policy makes of a request whose permit the store could not decide.
fn unavailable(
    settings: &Settings,
    key: Key,
    limit: u32,
    error: &StoreError,
    wire: Wire,
) -> Admission {
    if settings.store_warning.ready() {
        tracing::warn!(
            target: "tollgate::concurrency",
            %error, policy = ?settings.on_store_error,
            "the concurrency-limit store failed"
        );
    }
    let limiter = &settings.limiter;
    match settings.on_store_error {
        OnStoreError::Allow => {
            report(limiter, key, limit, Outcome::Acquired, "store_unavailable");
            Admission::Unlimited
        }
        OnStoreError::Deny => {
            report(limiter, key, limit, Outcome::Refused, "store_unavailable");
            Admission::Refused(store_unavailable(wire))
        }
        OnStoreError::LocalFallback { .. } => {
            match settings
                .local
                .as_ref()
                .and_then(|local| local.acquire(key, limit))
            {
                Some(permit) => {
                    report(limiter, key, limit, Outcome::Acquired, "local_fallback");
                    Admission::Admitted(Held::Local { _permit: permit }, None)
                }
                None => {
                    report(limiter, key, limit, Outcome::Refused, "local_fallback");
                    Admission::Refused(full(settings, limit, Duration::from_secs(1), wire))
                }
            }
        }
    }
}
