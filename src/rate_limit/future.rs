//! The [`ResponseFuture`] of [`RateLimit`](super::RateLimit): store check, then the inner call.

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tokio::time::Instant;
use tower_service::Service;

use super::body::{BodyMeter, ResponseBody};
use super::decide;
use super::decision::{self, DecisionSource, RateLimitDecision};
use super::rejection::Rejection;
use super::settings::{Settings, Settle};
use super::tiers::Tier;
use crate::grpc::Wire;
use crate::rate::{RateCheck, RateOutcome};
use crate::store::StoreFuture;

pin_project! {
    /// The response future of [`RateLimit`](super::RateLimit).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S::Future, S, Request<ReqBody>, S::Response>,
        settings: Arc<Settings>,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<F, S, R, B> {
        Check {
            pending: StoreFuture<RateOutcome>,
            checking: Checking<S, R>,
        },
        Inner {
            #[pin]
            future: F,
            decision: Option<RateLimitDecision>,
            // the check to settle once the response tells the actual cost
            settle: Option<RateCheck>,
            // with `settle_body_size`: the meter of the body to come, which settles the bytes
            // sent when dropped — none, when the request goes before its response head does
            meter: Option<BodyMeter>,
        },
        Settle {
            pending: StoreFuture<RateOutcome>,
            response: B,
            decision: Option<RateLimitDecision>,
            actual: u64,
        },
        Reject {
            rejection: Rejection,
            wire: Wire,
        },
        Done,
    }
}

/// A request whose check is at the store, and what its decision needs.
struct Checking<S, R> {
    service: S,
    request: R,
    tier: Arc<Tier>,
    check: RateCheck,
    /// When the check went to the store: a cached denial counts from then.
    sent_at: Instant,
    wire: Wire,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    pub(super) fn check(
        pending: StoreFuture<RateOutcome>,
        service: S,
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        tier: Arc<Tier>,
        check: RateCheck,
        wire: Wire,
    ) -> Self {
        Self {
            state: State::Check {
                pending,
                checking: Checking {
                    service,
                    request,
                    tier,
                    check,
                    sent_at: Instant::now(),
                    wire,
                },
            },
            settings,
        }
    }

    /// The inner call of a request admitted without a round trip, with its decision.
    pub(super) fn admitted(
        future: S::Future,
        settings: Arc<Settings>,
        decision: RateLimitDecision,
    ) -> Self {
        Self {
            state: State::Inner {
                future,
                decision: Some(decision),
                settle: None,
                meter: None,
            },
            settings,
        }
    }

    pub(super) fn unchecked(future: S::Future, settings: Arc<Settings>) -> Self {
        Self {
            state: State::Inner {
                future,
                decision: None,
                settle: None,
                meter: None,
            },
            settings,
        }
    }

    pub(super) fn reject(rejection: Rejection, settings: Arc<Settings>, wire: Wire) -> Self {
        Self {
            state: State::Reject { rejection, wire },
            settings,
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<ResponseBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Check { pending, .. } => {
                    let result = ready!(pending.as_mut().poll(cx));
                    let StateOwned::Check { checking, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Check");
                    };
                    this.state.set(admit(this.settings, result, checking));
                }
                StateProj::Inner {
                    future,
                    decision,
                    settle,
                    meter,
                } => {
                    let response = ready!(future.poll(cx))?;
                    if let Some(meter) = meter.take() {
                        let mut response = finish(this.settings, response, decision.take());
                        response.body_mut().meter(meter);
                        this.state.set(State::Done);
                        return Poll::Ready(Ok(response));
                    }
                    match settlement(this.settings, response, decision.take(), settle.take()) {
                        ControlFlow::Break(response) => {
                            this.state.set(State::Done);
                            return Poll::Ready(Ok(response));
                        }
                        ControlFlow::Continue(settling) => this.state.set(settling),
                    }
                }
                StateProj::Settle { pending, .. } => {
                    let settled = ready!(pending.as_mut().poll(cx));
                    let StateOwned::Settle {
                        response,
                        decision,
                        actual,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Settle");
                    };
                    let decision = settled_decision(settled, decision, actual);
                    return Poll::Ready(Ok(finish(this.settings, response, decision)));
                }
                StateProj::Reject { .. } => {
                    let StateOwned::Reject { rejection, wire } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Reject");
                    };
                    return Poll::Ready(Ok(rejection.into_response(this.settings, wire)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}

/// After the check: the inner call of an admitted request (or of any, in shadow mode), with
/// what it will settle; or the rejection.
fn admit<S, ReqBody>(
    settings: &Settings,
    result: Result<RateOutcome, crate::store::StoreError>,
    checking: Checking<S, Request<ReqBody>>,
) -> State<S::Future, S, Request<ReqBody>, S::Response>
where
    S: Service<Request<ReqBody>>,
{
    let Checking {
        mut service,
        mut request,
        tier,
        check,
        sent_at,
        wire,
    } = checking;
    let decision = decide::decide(settings, result, tier, check, sent_at);
    if !decision.admitted() && !settings.shadow {
        return State::Reject {
            rejection: Rejection::Denied(decision),
            wire,
        };
    }
    // only what the store charged is settled there
    let charged = decision.admitted() && decision.source == DecisionSource::Store;
    let settle = (charged && settings.settle.is_some()).then_some(check);
    // settled on the bytes of body sent: metered from now, so that a request that goes before
    // its response head (the client left) is settled too — on the nothing it was sent
    let (settle, meter) = match (&settings.settle, settle) {
        (Some(Settle::BodyBytes), Some(check)) => {
            let meter = BodyMeter::new(&settings.store, &decision.tier.policy, check);
            (None, Some(meter))
        }
        (_, settle) => (settle, None),
    };
    decision::record(request.extensions_mut(), decision.clone());
    State::Inner {
        future: service.call(request),
        decision: Some(decision),
        settle,
        meter,
    }
}

/// After the inner call: the response to send, or — when its actual cost differs from what it
/// reserved — the settlement to make first.
#[allow(clippy::type_complexity)]
fn settlement<F, S, R, B>(
    settings: &Settings,
    response: Response<B>,
    decision: Option<RateLimitDecision>,
    settle: Option<RateCheck>,
) -> ControlFlow<Response<ResponseBody<B>>, State<F, S, R, Response<B>>> {
    let Some((check, charged)) = settle.zip(decision.as_ref()) else {
        return ControlFlow::Break(finish(settings, response, decision));
    };
    // settled on the bytes of body sent: the meter went with the request (see `admit`)
    let Some(Settle::Head(read)) = &settings.settle else {
        return ControlFlow::Break(finish(settings, response, decision));
    };
    let (parts, body) = response.into_parts();
    let actual = read(&parts);
    let response = Response::from_parts(parts, body);
    let Some(actual) = actual.filter(|actual| *actual != check.cost()) else {
        return ControlFlow::Break(finish(settings, response, decision));
    };
    let pending = settings
        .store
        .check_rate(&charged.tier.policy, check.settle(actual));
    ControlFlow::Continue(State::Settle {
        pending,
        response,
        decision,
        actual,
    })
}

/// The decision as the settlement left it: charged `actual` — or, when the store could not
/// settle, what it reserved (logged).
fn settled_decision(
    settled: Result<RateOutcome, crate::store::StoreError>,
    mut decision: Option<RateLimitDecision>,
    actual: u64,
) -> Option<RateLimitDecision> {
    match (settled, decision.as_mut()) {
        (Ok(outcome), Some(decision)) => {
            decision.cost = actual;
            decision.states = outcome.limits;
        }
        (Err(error), _) => tracing::warn!(
            target: "tollgate::rate_limit",
            %error, actual,
            "could not settle a request's actual cost: it stays charged what it reserved"
        ),
        (Ok(_), None) => {}
    }
    decision
}

/// The response to send: the inner service's, with the decision's headers and record.
fn finish<B>(
    settings: &Settings,
    response: Response<B>,
    decision: Option<RateLimitDecision>,
) -> Response<ResponseBody<B>> {
    let mut response = response.map(ResponseBody::inner);
    if let Some(decision) = decision {
        if settings.headers {
            decision.write_headers(settings.partition_key, response.headers_mut());
        }
        decision::record(response.extensions_mut(), decision);
    }
    response
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Check { .. } => "checking",
            State::Inner { .. } => "calling inner service",
            State::Settle { .. } => "settling the actual cost",
            State::Reject { .. } => "rejecting",
            State::Done => "done",
        };
        f.debug_struct("ResponseFuture")
            .field("state", &state)
            .finish_non_exhaustive()
    }
}
