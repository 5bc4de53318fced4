//! What a request costs: its cost from its head, and how that is settled to what it used.

use std::sync::Arc;

use http::request::Parts;

use super::RateLimitLayerBuilder;
use crate::rate_limit::settings::Settle;

impl<K> RateLimitLayerBuilder<K> {
    /// The cost of each request (default 1). With [`settle`](Self::settle) or
    /// [`settle_body_size`](Self::settle_body_size), the amount a request reserves: it is
    /// admitted only when that fits, and a reservation is at least 1 — a request whose cost is 0
    /// is checked like any other (refused once the budget is spent) and then charged what it
    /// used. Without a settlement a cost of 0 passes without a store call: free, as the function
    /// decided.
    ///
    /// The function's input is the client's request, so a number read from it is the client's
    /// word: give it a floor and a ceiling (`docs/security.md` says which inputs the layers
    /// trust).
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response, StatusCode};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let tokens = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("tokens", 1000))
    ///     .key(Header::from_static("x-api-key"))
    ///     // the client's estimate, kept between a floor and a ceiling
    ///     .cost(|req| {
    ///         let max = req.headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         max.unwrap_or(256).clamp(1, 4096)
    ///     })
    ///     .settle(|res| res.headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
    ///     .build()
    ///     .unwrap();
    /// let llm = ServiceBuilder::new().layer(tokens).service_fn(|_req: Request<String>| async {
    ///     let response = Response::builder().header("x-tokens-used", "500").body(String::new());
    ///     Ok::<_, std::convert::Infallible>(response.unwrap())
    /// });
    /// let call = || {
    ///     let request = Request::post("/complete").header("x-api-key", "alice");
    ///     request.header("x-max-tokens", "0").body(String::new()).unwrap()
    /// };
    /// // an estimate of 0 pays what it used, and is refused once the budget is spent
    /// let statuses = [
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    ///     llm.clone().oneshot(call()).await.unwrap().status(),
    /// ];
    /// assert_eq!(statuses, [StatusCode::OK, StatusCode::OK, StatusCode::TOO_MANY_REQUESTS]);
    /// # }
    /// ```
    pub fn cost(mut self, cost: impl Fn(&Parts) -> u64 + Send + Sync + 'static) -> Self {
        self.draft.cost = Some(Arc::new(cost));
        self
    }

    /// Reserve, then settle: once the inner service has answered an admitted request, its
    /// charge is corrected from what it reserved ([`cost`](Self::cost)) to the actual amount
    /// `actual` reads from the response head (a header, an extension the handler set) — the
    /// difference refunded or added, in one atomic store step applied once
    /// ([`RateCheck::settle`](crate::rate::RateCheck::settle)). An overrun takes the balance
    /// past the quota (by at most one more quota per limit): the caller is then denied until
    /// the debt has left the window.
    ///
    /// The settlement is made before the response head goes out, so that its `RateLimit`
    /// headers (and its [`RateLimitDecision`](crate::rate_limit::RateLimitDecision)) show the settled balance. A request is charged
    /// what it reserved when `actual` answers `None`, when the inner service fails without a
    /// response, when the store cannot settle (logged), and when the store did not decide it
    /// (the local fallback, shadow denials).
    ///
    /// A replay of an [idempotency layer](crate::idempotency) inside this one (a response with
    /// [`Replayed`](crate::idempotency::Replayed) in its extensions) is settled to 0, whatever
    /// its recorded headers say: the first run was charged what it used, and the replay ran
    /// nothing. It still needs room for its reservation to be admitted.
    ///
    /// gRPC: a handler reports its usage in its response metadata, which is the head (tonic
    /// sends a failed call's `Status` metadata in its trailers-only head, so failed calls settle
    /// too). Usage that only trailing metadata carries (after a streamed body) is not read: such
    /// a call is charged what it reserved.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response};
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let tokens = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_minute("tokens", 1000))
    ///     .key(Header::from_static("x-api-key"))
    ///     // reserve what the caller says it may use...
    ///     .cost(|req| {
    ///         let max = req.headers.get("x-max-tokens").and_then(|v| v.to_str().ok()?.parse().ok());
    ///         max.unwrap_or(1)
    ///     })
    ///     // ...and charge what the handler reports it used
    ///     .settle(|res| res.headers.get("x-tokens-used")?.to_str().ok()?.parse().ok())
    ///     .build()
    ///     .unwrap();
    /// let llm = ServiceBuilder::new().layer(tokens).service_fn(|_req: Request<String>| async {
    ///     let response = Response::builder().header("x-tokens-used", "120").body(String::new());
    ///     Ok::<_, std::convert::Infallible>(response.unwrap())
    /// });
    /// let call = Request::post("/complete")
    ///     .header("x-api-key", "alice")
    ///     .header("x-max-tokens", "300")
    ///     .body(String::new())
    ///     .unwrap();
    /// let response = llm.oneshot(call).await.unwrap();
    /// // charged 120, not the 300 reserved
    /// assert_eq!(response.headers()["ratelimit"], r#""tokens";r=880;t=60"#);
    /// # }
    /// ```
    pub fn settle(
        mut self,
        actual: impl Fn(&http::response::Parts) -> Option<u64> + Send + Sync + 'static,
    ) -> Self {
        self.draft.settle = Some(Settle::Head(Arc::new(actual)));
        self
    }

    /// Reserve, then settle on the bytes sent: an admitted request reserves its
    /// [`cost`](Self::cost) (the most its response may be: required), and once its response
    /// body has gone out — or been dropped midway, a client gone — the charge is corrected to
    /// the bytes of body actually sent, in the background, as [`settle`](Self::settle) does. A
    /// request that ends before its response head (its client left, or the inner service failed
    /// without a response) was sent nothing: it is settled to 0, and so is a
    /// [replay](crate::idempotency::Replayed) of an idempotency layer inside this one.
    /// A byte budget per caller for downloads, exports and proxies. The response's `RateLimit`
    /// headers, sent before its body, show the balance with the reservation charged.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{Request, Response};
    /// use http_body_util::BodyExt;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Algorithm, Limit, QuotaUnit, RateLimitLayer};
    /// use tollgate::store::MemoryStore;
    ///
    /// let bytes = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("egress", 1_000_000))
    ///     .algorithm(Algorithm::SlidingCounter)
    ///     .key(Header::from_static("x-api-key"))
    ///     .cost(|_| 64 * 1024) // no response is larger
    ///     .settle_body_size()
    ///     .quota_unit(QuotaUnit::ContentBytes)
    ///     .build()
    ///     .unwrap();
    /// let export = ServiceBuilder::new().layer(bytes.clone()).service_fn(|_: Request<String>| async {
    ///     Ok::<_, std::convert::Infallible>(Response::new("x".repeat(300)))
    /// });
    /// let call = Request::get("/export").header("x-api-key", "alice").body(String::new()).unwrap();
    /// let response = export.oneshot(call).await.unwrap();
    /// let body = response.into_body().collect().await.unwrap().to_bytes();
    /// assert_eq!(body.len(), 300);
    /// # tokio::task::yield_now().await;
    /// let alice = bytes.key_of(&Request::get("/").header("x-api-key", "alice").body(()).unwrap().into_parts().0);
    /// let left = bytes.peek(alice.unwrap()).await.unwrap();
    /// // charged the 300 bytes sent, not the 64 KiB reserved
    /// assert_eq!(left.limits[0].remaining, 1_000_000 - 300);
    /// # }
    /// ```
    pub fn settle_body_size(mut self) -> Self {
        self.draft.settle = Some(Settle::BodyBytes);
        self
    }

    /// Reserve, then settle on the usage the response **body** reports as it streams — in its
    /// last server-sent event (an LLM API's `usage`), in a trailer (gRPC's trailing metadata) —
    /// read by a [`Meter`](crate::rate_limit::Meter) that `meter` makes from each admitted response's head
    /// ([`SseUsage`](crate::rate_limit::SseUsage), feature `sse`; [`TrailerUsage`](crate::rate_limit::TrailerUsage)).
    /// The body is passed on frame by frame, never held back; an admitted request reserves its
    /// [`cost`](Self::cost) (required), and once its body has ended — or been dropped midway —
    /// its charge is corrected in the background, as [`settle`](Self::settle) does, to:
    ///
    /// | the body | is charged |
    /// | --- | --- |
    /// | ended, its usage reported | the usage |
    /// | ended, no usage reported | what it reserved |
    /// | cut short (the client left, the body failed) | the usage reported until then, else what it reserved |
    /// | never begun (no response head: the client left, the service failed) | what it reserved |
    /// | a [replay](crate::idempotency::Replayed) of an idempotency layer inside | 0 |
    ///
    /// The response's `RateLimit` headers, sent before its body, show the balance with the
    /// reservation charged.
    ///
    /// ```
    /// # #[tokio::main(flavor = "current_thread")] async fn main() {
    /// use http::{HeaderMap, Request, Response};
    /// use http_body_util::{BodyExt, Full, StreamBody};
    /// use http_body::Frame;
    /// use tower::{ServiceBuilder, ServiceExt};
    /// use tollgate::key::Header;
    /// use tollgate::rate_limit::{Limit, RateLimitLayer, TrailerUsage};
    /// use tollgate::store::MemoryStore;
    ///
    /// let tokens = RateLimitLayer::builder(MemoryStore::new())
    ///     .limit(Limit::per_hour("tokens", 10_000))
    ///     .key(Header::from_static("x-api-key"))
    ///     .cost(|_| 500)
    ///     .settle_stream(|_| TrailerUsage::from_static("x-tokens-used"))
    ///     .build()
    ///     .unwrap();
    /// let llm = ServiceBuilder::new().layer(tokens.clone()).service_fn(|_: Request<String>| async {
    ///     let mut trailers = HeaderMap::new();
    ///     trailers.insert("x-tokens-used", "120".parse().unwrap());
    ///     let frames = [Ok::<_, std::convert::Infallible>(Frame::data(bytes::Bytes::from("Hello"))), Ok(Frame::trailers(trailers))];
    ///     Ok::<_, std::convert::Infallible>(Response::new(StreamBody::new(futures_util::stream::iter(frames))))
    /// });
    /// let call = Request::post("/v1/chat").header("x-api-key", "alice").body(String::new()).unwrap();
    /// let response = llm.oneshot(call).await.unwrap();
    /// response.into_body().collect().await.unwrap();
    /// # tokio::task::yield_now().await;
    /// let alice = tokens.key_of(&Request::get("/").header("x-api-key", "alice").body(()).unwrap().into_parts().0);
    /// // charged the 120 the trailer reported, not the 500 reserved
    /// assert_eq!(tokens.peek(alice.unwrap()).await.unwrap().limits[0].remaining, 10_000 - 120);
    /// # }
    /// ```
    pub fn settle_stream<M: crate::rate_limit::Meter>(
        mut self,
        meter: impl Fn(&http::response::Parts) -> M + Send + Sync + 'static,
    ) -> Self {
        let make = move |head: &http::response::Parts| {
            Box::new(meter(head)) as Box<dyn crate::rate_limit::Meter>
        };
        self.draft.settle = Some(Settle::Stream(Arc::new(make)));
        self
    }
}
