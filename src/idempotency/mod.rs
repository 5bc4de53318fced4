//! `Idempotency-Key` deduplication shared by every copy of a service (IETF
//! draft-ietf-httpapi-idempotency-key-header, with Stripe's semantics).
//!
//! A client that may retry a non-idempotent request — a payment, an order — sends a unique
//! `Idempotency-Key`. [`IdempotencyLayer`] runs the first request with that key once, across all
//! copies of the service, stores its response in the shared [`Store`](crate::store::Store), and
//! replays it to every retry.
//!
//! | situation | response |
//! | --- | --- |
//! | method not covered (default: POST and PATCH are) | passes through untouched |
//! | key missing where [required](IdempotencyLayerBuilder::required) | `400` |
//! | key malformed: empty, over 255 characters, not visible ASCII (bare token and sf-string `"..."` both accepted, naming the same key) | `400` |
//! | a keyed request whose [scope](IdempotencyLayerBuilder::scope) (its caller) cannot be read | `400`, or as [`missing_scope`](IdempotencyLayerBuilder::missing_scope) says; nothing is claimed, read or stored |
//! | request body over the [limit](IdempotencyLayerBuilder::body_limit) | `413` |
//! | the request body does not arrive whole within the [body timeout](IdempotencyLayerBuilder::body_timeout) (default 30 s) | `408` |
//! | the caller's bodies would pass its [share](IdempotencyLayerBuilder::max_buffered_per_caller) of the buffer budget, or all callers' bodies the [budget](IdempotencyLayerBuilder::max_buffered) and no room comes back within the [wait](IdempotencyLayerBuilder::buffer_wait) | `503` with `Retry-After` |
//! | first request with this key | the handler runs; its response (status, headers but `Set-Cookie` and the [sensitive ones](IdempotencyLayerBuilder::unstored_headers), body, trailers) is stored |
//! | same key and fingerprint, still running | `409` with `Retry-After` (or, with [`OnConcurrent::Wait`], wait and replay) |
//! | same key, different fingerprint (method, path + query, body, [chosen headers](IdempotencyLayerBuilder::fingerprint_headers)) | `422` |
//! | same key, completed | the stored response, byte for byte, plus `Idempotent-Replayed: true` |
//! | handler failed (5xx by [default](IdempotencyLayerBuilder::store_when), a retryable [gRPC status](IdempotencyLayerBuilder::store_grpc_when), an error, a panic, a broken body) | key released, nothing stored: a retry runs again |
//! | store unavailable or timing out | `503`, the handler is **not** run (fail closed: never twice) |
//! | the handler answered, but the store did not confirm its record within the lease (it failed, timed out, lost the claim, or the lease was taken over) | `503` with `Retry-After` (gRPC: UNAVAILABLE) instead of the handler's response, none of which went out; the key is **not** released, so retries get `409` while the lease runs |
//!
//! The rule these rows hold: **a client that was told success only ever sees that one execution
//! again.** A response to be recorded leaves the layer — its status and headers included — only
//! once the store has confirmed its record, so a client never reads a `2xx` (or a gRPC OK) whose
//! record may be missing; a retry then gets the replay. Its limits:
//! - A client that got no complete answer (a `503`, a broken body) may see the request run again
//!   when it retries after the lease: the record was never confirmed, and the claim expired. If
//!   the record was stored after all (its confirmation was what got lost), the retry gets the
//!   replay.
//! - The record lives in the store: a store that loses it (a restart without persistence, a
//!   failover to a replica that had not received it, eviction) forgets the request, and a retry
//!   after that runs again.
//! - A response over the [storage cap](IdempotencyLayerBuilder::response_limit) is delivered
//!   without a record (and streams from the moment it passes the cap); a retry runs again.
//!
//! gRPC calls (`content-type: application/grpc*`) get the same decisions as trailers-only
//! responses: `400` → INVALID_ARGUMENT, `409` → ABORTED, `413` → RESOURCE_EXHAUSTED, `422` →
//! FAILED_PRECONDITION (the key is bound to another request: a state of the system, not a
//! malformed argument), `503` → UNAVAILABLE. Replays include the stored trailers (`grpc-status`
//! and all), so a client cannot tell a replay from the first answer.
//!
//! How it holds across copies:
//! - Keys are scoped by a caller [extractor](IdempotencyLayerBuilder::scope) — a choice the
//!   builder requires, or an explicit [`unscoped`](IdempotencyLayerBuilder::unscoped) — so that a
//!   client guessing another's key (`order-123`) runs its own request instead of being replayed
//!   someone else's response; a request whose scope cannot be read is refused, not filed
//!   under a namespace that every such request would share; keys are hashed with the scope
//!   into the store key `<prefix>:idem:{<digest>}`: the raw key never reaches the store.
//! - Claim, complete, release and extend are each one atomic script that checks the claim's
//!   random token: a copy whose lease ran out and was taken over cannot overwrite the new owner's
//!   record. The lease (default 30 s) is extended every third of it while the handler runs, and a
//!   crashed copy's claim expires after it.
//! - The handler runs in its own task: if the client disconnects, it still runs to completion
//!   and its response is stored, so the client's retry gets the replay rather than a second
//!   execution.
//! - A response to be stored (by its status and, for gRPC, the `grpc-status` of its trailers) is
//!   held whole in the layer while the handler produces it — it is what gets recorded anyway —
//!   and reaches the first caller, head and body, once its record is confirmed: a response that
//!   streams (server-sent events, a long download) reaches the first caller only at its end.
//!   The first caller gets it as the handler gave it, its body's data in one piece and its
//!   trailers in one frame.
//! - A response that passes the [storage cap](IdempotencyLayerBuilder::response_limit) is not
//!   stored: at that moment the key is released and the first caller gets the head and what was
//!   held, then the rest as it is produced. A response not stored by its
//!   [status](IdempotencyLayerBuilder::store_when) (a 5xx) streams at once; its key is released
//!   before the caller sees the end of its body, so a client that has its whole answer and
//!   retries runs again, never gets `409`. A body that fails releases the key, then reaches the
//!   caller as far as it came, ending with the error.
//! - A streaming first caller's body is forwarded with backpressure: a caller that stops reading
//!   holds the handler's task (and, until the key is released, its lease) until it reads on or
//!   goes away.
//! - A claim attempt that went unanswered (the store timed out, the caller left) is released in
//!   the background once the store answers, so that a store hiccup does not block the key for a
//!   whole lease. Every script is safe to run twice: a claim, completion or release re-sent
//!   after a lost reply answers as its first run did.
//! - Completion is retried, token-checked, while the store fails, for up to a lease.
//! - The request body is buffered (up to the limit) before anything else happens: apply the layer
//!   to unary calls, not to client-streaming or bidirectional gRPC methods, whose request stream
//!   does not end before the response begins.
//! - Cost: a replay is one store round trip; a first execution two (claim, complete), plus one
//!   lease extension per third of the lease that the handler outlives.
//! - Traces: each keyed request is a `tracing` event, target `tollgate::idempotency`, at `DEBUG`,
//!   with `tollgate.outcome` (`executed`, `replayed`, `conflict`, `mismatch`, `rejected`) and
//!   `tollgate.reason` (see [Tracing](crate::guide::operations#tracing)).
//!
//! **In the handler's own transaction.** The record is made after the handler ran, so a crash
//! between the two leaves its effects without the record. When those effects are rows in
//! PostgreSQL, [`IdempotencyLayer::in_transaction`] closes the gap: the handler writes through
//! the transaction the layer opened (an [`OnceTx`] in its extensions),
//! and the response is recorded in the same commit — both stand, or neither does.
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use std::convert::Infallible;
//! use std::sync::Arc;
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use http::{Request, Response, StatusCode};
//! use http_body_util::{BodyExt, Full};
//! use tower::{ServiceBuilder, ServiceExt};
//! use tollgate::idempotency::IdempotencyLayer;
//! use tollgate::store::MemoryStore;
//!
//! let runs = Arc::new(AtomicUsize::new(0));
//! let counter = runs.clone();
//! let service = ServiceBuilder::new()
//!     .layer(IdempotencyLayer::builder(MemoryStore::new()).unscoped().build().unwrap())
//!     .service_fn(move |_req: Request<_>| {
//!         let n = counter.fetch_add(1, Ordering::SeqCst) + 1;
//!         async move { Ok::<_, Infallible>(Response::new(Full::new(format!("payment {n}").into()))) }
//!     });
//!
//! let pay = || Request::post("/payments").header("idempotency-key", "k-1").body(Full::new("{}".into())).unwrap();
//! let first = service.clone().oneshot(pay()).await.unwrap();
//! assert_eq!(first.into_body().collect().await.unwrap().to_bytes(), "payment 1");
//! let retry = service.clone().oneshot(pay()).await.unwrap();
//! assert_eq!(retry.headers()["idempotent-replayed"], "true");
//! assert_eq!(retry.into_body().collect().await.unwrap().to_bytes(), "payment 1");
//! assert_eq!(runs.load(Ordering::SeqCst), 1);
//!
//! let changed = Request::post("/payments").header("idempotency-key", "k-1").body(Full::new("{\"x\":1}".into())).unwrap();
//! assert_eq!(service.clone().oneshot(changed).await.unwrap().status(), StatusCode::UNPROCESSABLE_ENTITY);
//! # }
//! ```
//!
//! [`OnceTx`]: https://docs.rs/tollgate/latest/tollgate/store/struct.OnceTx.html

mod body;
mod budget;
mod execute;
#[cfg(all(feature = "postgres", feature = "axum"))]
mod extract;
mod fingerprint;
mod flow;
mod future;
mod handler;
mod key_header;
mod layer;
mod rejection;
mod report;
mod service;
mod settings;

pub use body::IdempotencyBody;
#[cfg(all(feature = "postgres", feature = "axum"))]
pub use extract::NoTransaction;
pub use flow::Replayed;
pub use future::ResponseFuture;
pub use handler::RequestBody;
pub use layer::{IdempotencyLayer, IdempotencyLayerBuilder};
pub use rejection::IdempotencyRejection;
pub use service::Idempotency;
pub use settings::{MissingScope, OnConcurrent};
