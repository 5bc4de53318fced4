//! The [`RateLimit`] service.

use std::sync::Arc;
use std::task::{Context, Poll};

use http::{Request, Response};
use tower_service::Service;

use super::body::ResponseBody;
use super::future::ResponseFuture;
use super::lease::Take;
use super::rejection::Rejection;
use super::settings::Settings;
use super::tiers::Tier;
use super::{decide, decision};
use crate::grpc::Wire;
use crate::key::{Key, KeyExtractor};
use crate::rate::{RateCheck, RateOutcome};

layer_service! {
    /// Admits a request only while every limit has room for the caller; made by
    /// [`RateLimitLayer`](super::RateLimitLayer).
    ///
    /// The decision is one round trip to the store, made in the response future: `poll_ready` only
    /// asks the inner service, so the service never waits for capacity (it rejects instead) and is
    /// cheap to clone.
    RateLimit { key }
}

impl<S, K, ReqBody, ResBody> Service<Request<ReqBody>> for RateLimit<S, K>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>> + Clone,
    K: KeyExtractor,
{
    type Response = Response<ResponseBody<ResBody>>;
    type Error = S::Error;
    type Future = ResponseFuture<S, ReqBody>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<ReqBody>) -> Self::Future {
        let settings = Arc::clone(&self.settings);
        let (parts, body) = request.into_parts();
        let wire = Wire::of(&parts.headers);
        let key = self.key.extract(&parts);
        let cost = settings.cost_of(&parts);
        let tier = settings.tiers.for_request(&parts);
        let request = Request::from_parts(parts, body);

        let Some(key) = key else {
            return match settings.missing_key.refusal() {
                Some(_) if !settings.shadow => {
                    ResponseFuture::reject(Rejection::MissingKey, settings, wire)
                }
                _ => ResponseFuture::unchecked(self.inner.call(request), settings),
            };
        };
        if cost == 0 {
            return ResponseFuture::unchecked(self.inner.call(request), settings);
        }
        // the deny cache and leased slices hear of resets and refunds made through other copies
        if settings.deny_cache.is_some() || tier.leases.is_some() {
            settings.listener.ensure(&settings);
        }
        // a slice with room answers first: it was charged in the store, whatever was denied since
        if let Some(outcome) = tier.leases.as_ref().and_then(|l| l.admit(key, cost)) {
            return self.leased(request, settings, tier, (key, cost), outcome);
        }
        if let Some(denied) = settings
            .deny_cache
            .as_ref()
            .and_then(|c| c.check(key, cost))
            // a denial under another tier (the caller changed plans) says nothing of this one
            .filter(|denied| Arc::ptr_eq(&denied.tier, &tier))
        {
            denied.report();
            return ResponseFuture::reject(Rejection::Denied(denied), settings, wire);
        }
        // a check that will be settled is a reservation: the store keeps where it went
        let check = if settings.settle.is_some() {
            RateCheck::reservation(key, cost)
        } else {
            RateCheck::new(key, cost)
        };
        let pending = match tier.leases.as_ref().map(|leases| leases.take(check)) {
            None => settings.store.check_rate(&tier.policy, check),
            Some(Take::Store(pending)) => pending,
            Some(Take::Local(outcome)) => {
                return self.leased(request, settings, tier, (key, cost), outcome);
            }
        };
        // The clone goes on serving; the instance that `poll_ready` readied handles this request.
        let clone = self.inner.clone();
        let ready = std::mem::replace(&mut self.inner, clone);
        ResponseFuture::check(pending, ready, request, settings, tier, check, wire)
    }
}

impl<S, K> RateLimit<S, K> {
    /// The inner call of a request admitted from a slice of its caller's quota.
    fn leased<ReqBody>(
        &mut self,
        mut request: Request<ReqBody>,
        settings: Arc<Settings>,
        tier: Arc<Tier>,
        (key, cost): (Key, u64),
        outcome: RateOutcome,
    ) -> ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        let decision = decide::leased(&settings, outcome, tier, key, cost);
        decision::record(request.extensions_mut(), decision.clone());
        let future = self.inner.call(request);
        ResponseFuture::admitted(future, settings, decision)
    }
}
