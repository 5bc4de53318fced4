//! [`Stack`]: the layers of a metered endpoint — an estimate from the body, budgets, idempotency,
//! a limit in flight — in the one order where each keeps its promise, whatever order they are
//! given in.
//!
//! Outermost first:
//!
//! | layer | why there |
//! | --- | --- |
//! | [`EstimateLayer`] | the budgets reserve what it reads from the body |
//! | [`RateLimitLayer`]s (budgets) | a client cannot retry its way past them; a replay is charged nothing by one that settles (it reads [`Replayed`](crate::idempotency::Replayed)) |
//! | [`IdempotencyLayer`] | answers a replay before anything inside runs |
//! | [`ConcurrencyLimitLayer`]s (in flight) | only executions take a permit: 50 replays of a completed key at once are 50 replays |
//!
//! Each method takes one kind of layer and puts it in its place; budgets and limits in flight
//! may be given more than once (the first given is the outermost of its kind). A `Stack` is a
//! [`Layer`]: hand it to `ServiceBuilder::layer`, axum's `route_layer` or tonic's
//! `Server::layer`. The reasons are in the guide's
//! [Layer order](crate::guide::customizing#layer-order).
//!
//! ```
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! use http::{Request, Response};
//! use tollgate::concurrency::ConcurrencyLimitLayer;
//! use tollgate::idempotency::{IdempotencyLayer, RequestBody};
//! use tollgate::rate_limit::{Limit, RateLimitLayer};
//! use tollgate::stack::Stack;
//! use tollgate::store::MemoryStore;
//! use tower::{Layer, ServiceExt};
//!
//! let store = MemoryStore::new();
//! // given in any order, stacked in the one that works
//! let stack = Stack::new()
//!     .in_flight(ConcurrencyLimitLayer::builder(store.clone()).limit(2).build().unwrap())
//!     .idempotency(IdempotencyLayer::builder(store.clone()).unscoped().build().unwrap())
//!     .budget(
//!         RateLimitLayer::builder(store)
//!             .limit(Limit::per_hour("requests", 100))
//!             .build()
//!             .unwrap(),
//!     );
//! let svc = stack.layer(tower::service_fn(|_: Request<RequestBody<String>>| async {
//!     Ok::<_, std::convert::Infallible>(Response::new(String::from("paid")))
//! }));
//! let pay = || Request::post("/pay").header("idempotency-key", "k-1").body(String::new()).unwrap();
//! let first = svc.clone().oneshot(pay()).await.unwrap();
//! let replay = svc.oneshot(pay()).await.unwrap();
//! assert_eq!((first.status().as_u16(), replay.status().as_u16()), (200, 200));
//! assert!(replay.headers().contains_key("idempotent-replayed"));
//! assert_eq!(replay.headers()["ratelimit"], r#""requests";r=98;t=3600"#);
//! # }
//! ```

use tower_layer::{Identity, Layer, Stack as Nested};

use crate::concurrency::ConcurrencyLimitLayer;
use crate::idempotency::IdempotencyLayer;
use crate::rate_limit::{EstimateLayer, RateLimitLayer};

/// The layers of a metered endpoint in their one working order (see the
/// [module](self)); made by [`Stack::new`].
#[derive(Debug, Clone)]
pub struct Stack<Estimate = Identity, Budgets = Identity, Replays = Identity, InFlight = Identity> {
    estimate: Estimate,
    budgets: Budgets,
    replays: Replays,
    in_flight: InFlight,
}

impl Stack {
    /// A stack of no layer yet.
    pub fn new() -> Self {
        Self {
            estimate: Identity::new(),
            budgets: Identity::new(),
            replays: Identity::new(),
            in_flight: Identity::new(),
        }
    }
}

impl Default for Stack {
    fn default() -> Self {
        Self::new()
    }
}

impl<E, B, R, F> Stack<E, B, R, F> {
    /// The estimate of a request's cost, read from its body: outermost, so that every budget
    /// can reserve it. Replaces an estimate given before.
    pub fn estimate<G>(self, layer: EstimateLayer<G>) -> Stack<EstimateLayer<G>, B, R, F> {
        Stack {
            estimate: layer,
            budgets: self.budgets,
            replays: self.replays,
            in_flight: self.in_flight,
        }
    }

    /// A budget — any rate limit — outside the idempotency layer, inside those given before.
    pub fn budget<K>(
        self,
        layer: RateLimitLayer<K>,
    ) -> Stack<E, Nested<RateLimitLayer<K>, B>, R, F> {
        Stack {
            estimate: self.estimate,
            budgets: Nested::new(layer, self.budgets),
            replays: self.replays,
            in_flight: self.in_flight,
        }
    }

    /// The idempotency layer, between the budgets and the limits in flight. Replaces one given
    /// before.
    pub fn idempotency<K>(self, layer: IdempotencyLayer<K>) -> Stack<E, B, IdempotencyLayer<K>, F> {
        Stack {
            estimate: self.estimate,
            budgets: self.budgets,
            replays: layer,
            in_flight: self.in_flight,
        }
    }

    /// A limit in flight, inside the idempotency layer (so that a replay takes no permit), and
    /// inside those given before.
    pub fn in_flight<K>(
        self,
        layer: ConcurrencyLimitLayer<K>,
    ) -> Stack<E, B, R, Nested<ConcurrencyLimitLayer<K>, F>> {
        Stack {
            estimate: self.estimate,
            budgets: self.budgets,
            replays: self.replays,
            in_flight: Nested::new(layer, self.in_flight),
        }
    }
}

impl<S, E, B, R, F> Layer<S> for Stack<E, B, R, F>
where
    F: Layer<S>,
    R: Layer<F::Service>,
    B: Layer<R::Service>,
    E: Layer<B::Service>,
{
    type Service = E::Service;

    fn layer(&self, inner: S) -> Self::Service {
        let in_flight = self.in_flight.layer(inner);
        let replays = self.replays.layer(in_flight);
        self.estimate.layer(self.budgets.layer(replays))
    }
}
