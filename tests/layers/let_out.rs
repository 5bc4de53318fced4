//! When an outbound limit let each call out, and a provider's token bucket judged at those
//! moments.
//!
//! A stand-in provider that judges each call as it arrives also judges the way there: a
//! connection opened, a task that waited for a core busy with other tests. No limit of a copy
//! controls that; calls the store let out a tenth of a second apart can arrive together. What a
//! limit promises is when it lets calls out, so the client stamps each call right below the
//! limit (`x-let-out`, microseconds since the run's start) and the tests replay the provider's
//! bucket over those stamps, in their order, reporting what arrival would have said beside it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::future::Future;
use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Request, StatusCode};
use http_body_util::Full;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::Instant;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};

use tollgate::key::Global;
use tollgate::outbound::{OutboundError, OutboundLimitLayer};

/// The stamp's header.
const HEADER: &str = "x-let-out";

/// A copy's client: hyper's, behind the outbound limit, each call stamped with when the limit
/// let it out (since `start`).
pub(crate) type Caller = BoxCloneService<Request<Full<Bytes>>, StatusCode, String>;

/// The client of a copy whose calls go through `layer`, stamped from `start`.
pub(crate) fn caller(layer: OutboundLimitLayer<Global>, start: Instant) -> Caller {
    let client: Client<HttpConnector, Full<Bytes>> =
        Client::builder(TokioExecutor::new()).build_http();
    BoxCloneService::new(
        ServiceBuilder::new()
            .layer(layer)
            .map_request(move |mut request: Request<Full<Bytes>>| {
                stamp(request.headers_mut(), start);
                request
            })
            .service(client)
            .map_response(|response| response.status())
            .map_err(|error| match error {
                OutboundError::Limited(limited) => format!("limited {limited:?}"),
                other => other.to_string(),
            }),
    )
}

/// The stamp of a `reqwest-middleware` client, added right after the outbound limit's
/// middleware: each call stamped with when the limit let it out (since `start`).
pub(crate) struct Stamp {
    pub(crate) start: Instant,
}

impl reqwest_middleware::Middleware for Stamp {
    fn handle<'a, 'b, 'c, 'd>(
        &'a self,
        mut request: reqwest::Request,
        extensions: &'b mut http::Extensions,
        next: reqwest_middleware::Next<'c>,
    ) -> Pin<Box<dyn Future<Output = reqwest_middleware::Result<reqwest::Response>> + Send + 'd>>
    where
        Self: 'd,
        'a: 'd,
        'b: 'd,
        'c: 'd,
    {
        stamp(request.headers_mut(), self.start);
        next.run(request, extensions)
    }
}

/// Stamps a call with when the limit let it out: now, since `start`.
fn stamp(headers: &mut HeaderMap, start: Instant) {
    let micros = u64::try_from(start.elapsed().as_micros()).unwrap();
    headers.insert(HEADER, HeaderValue::from(micros));
}

/// When the limit let a call out, from its stamp.
pub(crate) fn let_out(headers: &HeaderMap) -> Option<Duration> {
    let micros = headers.get(HEADER)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_micros(micros))
}

/// One token bucket on the run's clock: what it holds as of `filled`, refilled at `rate` a
/// second up to `rate` (full at the start).
#[derive(Debug)]
pub(crate) struct Bucket {
    rate: f64,
    held: f64,
    filled: Duration,
}

impl Bucket {
    pub(crate) fn new(rate: f64) -> Self {
        Self {
            rate,
            held: rate,
            filled: Duration::ZERO,
        }
    }

    /// Whether it holds `n` at `at` (no earlier than the last time asked).
    pub(crate) fn holds(&mut self, at: Duration, n: f64) -> bool {
        let refill = at.saturating_sub(self.filled).as_secs_f64() * self.rate;
        self.held = (self.held + refill).min(self.rate);
        self.filled = self.filled.max(at);
        self.held >= n
    }

    /// Takes `n`, which it holds.
    pub(crate) fn take(&mut self, n: f64) {
        self.held -= n;
    }
}

/// The calls of `calls` (each when it was let out or arrived, and its weight) that buckets of
/// `rates` refuse, judged in the order of their moments: for each bucket, the calls it alone
/// would refuse (a call is taken only where every bucket holds its weight in it).
pub(crate) fn refused<const N: usize>(
    calls: impl IntoIterator<Item = (Duration, [f64; N])>,
    rates: [f64; N],
) -> [usize; N] {
    let mut calls: Vec<_> = calls.into_iter().collect();
    calls.sort_by_key(|&(at, _)| at);
    let mut buckets = rates.map(Bucket::new);
    let mut refused = [0; N];
    for (at, weights) in calls {
        let mut taken = true;
        for ((bucket, weight), refused) in buckets.iter_mut().zip(weights).zip(&mut refused) {
            if !bucket.holds(at, weight) {
                *refused += 1;
                taken = false;
            }
        }
        if taken {
            for (bucket, weight) in buckets.iter_mut().zip(weights) {
                bucket.take(weight);
            }
        }
    }
    refused
}

#[test]
fn a_bucket_refuses_what_it_does_not_hold_and_refills_at_its_rate() {
    let at = Duration::from_millis;
    // two a second: two at once, a third refused, one more half a second later
    let calls = [
        (at(0), [1.0]),
        (at(1), [1.0]),
        (at(2), [1.0]),
        (at(502), [1.0]),
    ];
    assert_eq!(refused(calls, [2.0]), [1]);
    // out of order, judged in order; a call both buckets refuse counts for each
    let calls = [
        (at(1010), [1.0, 5.0]),
        (at(0), [1.0, 10.0]),
        (at(10), [1.0, 1.0]),
    ];
    assert_eq!(refused(calls, [1.0, 10.0]), [1, 1]);
}
