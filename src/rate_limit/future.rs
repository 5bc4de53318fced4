//! The [`ResponseFuture`] of [`RateLimit`](super::RateLimit): store check, then the inner call.

use std::fmt;
use std::future::Future;
use std::ops::ControlFlow;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::body::{BodyMeter, ResponseBody};
use super::decision::{self, RateLimitDecision};
use super::rejection::Rejection;
use super::respond::{finish, replayed, settled_decision};
use super::settings::{Settings, Settle};
use crate::grpc::Wire;
use crate::idempotency::Replayed;
use crate::rate::{RateCheck, RateOutcome};
use crate::rate_client::{DecisionSource, Pending, Verdict};
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
            pending: Pending,
            checking: Checking<S, R>,
        },
        // admitted after a wait: the service, not readied while the request waited, is readied
        // now
        Readying {
            verdict: Verdict,
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

/// A request whose check is at the store, and the service that will call it.
struct Checking<S, R> {
    service: S,
    request: R,
    wire: Wire,
    /// Whether `service` was readied (`poll_ready`) for this request; one that was not is
    /// readied once the request is admitted.
    ready: bool,
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// A request whose check is `pending` at the store, to be called on `service` if admitted.
    pub(super) fn check(
        pending: Pending,
        (service, ready): (S, bool),
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        wire: Wire,
    ) -> Self {
        let checking = Checking {
            service,
            request,
            wire,
            ready,
        };
        Self {
            state: State::Check { pending, checking },
            settings,
        }
    }

    /// A request decided without a round trip: called on `service` if admitted.
    pub(super) fn decided(
        verdict: Verdict,
        service: &mut S,
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        wire: Wire,
    ) -> Self {
        Self {
            state: admit(&settings, verdict, service, request, wire),
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
                    let verdict = ready!(Pin::new(pending).poll(cx));
                    let StateOwned::Check { checking, .. } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Check");
                    };
                    if !checking.ready && (verdict.admitted || this.settings.shadow) {
                        this.state.set(State::Readying { verdict, checking });
                        continue;
                    }
                    this.state.set(checking.decided(this.settings, verdict));
                }
                StateProj::Readying { checking, .. } => {
                    if let Err(error) = ready!(checking.service.poll_ready(cx)) {
                        this.state.set(State::Done);
                        return Poll::Ready(Err(error));
                    }
                    let StateOwned::Readying { checking, verdict } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Readying");
                    };
                    this.state.set(checking.decided(this.settings, verdict));
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
                        if replayed(&response) {
                            // settled to nothing at once: none of the replay's bytes are charged
                            meter.replayed();
                        } else {
                            response.body_mut().meter(meter);
                        }
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

impl<S, ReqBody> Checking<S, Request<ReqBody>>
where
    S: Service<Request<ReqBody>>,
{
    /// The request decided by `verdict`: its inner call, or its rejection (see [`admit`]).
    fn decided(
        self,
        settings: &Settings,
        verdict: Verdict,
    ) -> State<S::Future, S, Request<ReqBody>, S::Response> {
        let Self {
            mut service,
            request,
            wire,
            ..
        } = self;
        admit(settings, verdict, &mut service, request, wire)
    }
}

/// After the check: the inner call of an admitted request (or of any, in shadow mode), with
/// what it will settle; or the rejection.
fn admit<S, ReqBody>(
    settings: &Settings,
    verdict: Verdict,
    service: &mut S,
    mut request: Request<ReqBody>,
    wire: Wire,
) -> State<S::Future, S, Request<ReqBody>, S::Response>
where
    S: Service<Request<ReqBody>>,
{
    let check = verdict.check;
    let decision = RateLimitDecision::new(verdict, settings.shadow);
    decision.report();
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
            let meter = BodyMeter::sent(&settings.client.store, &decision.tier.policy, check);
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
    let read = match &settings.settle {
        Some(Settle::Head(read)) => read,
        Some(Settle::Stream(make)) => {
            // settled once the body has gone out, on what it reported
            let (parts, body) = response.into_parts();
            let meter = BodyMeter::usage(
                &settings.client.store,
                &charged.tier.policy,
                check,
                make(&parts),
            );
            let replay = parts.extensions.get::<Replayed>().is_some();
            let mut response = finish(settings, Response::from_parts(parts, body), decision);
            if replay {
                meter.replayed();
            } else {
                response.body_mut().meter(meter);
            }
            return ControlFlow::Break(response);
        }
        _ => return ControlFlow::Break(finish(settings, response, decision)),
    };
    let (parts, body) = response.into_parts();
    // a replay used nothing: what the first run used was settled by the first run
    let actual = if parts.extensions.get::<Replayed>().is_some() {
        Some(0)
    } else {
        read(&parts)
    };
    let response = Response::from_parts(parts, body);
    let Some(actual) = actual.filter(|actual| *actual != check.cost()) else {
        return ControlFlow::Break(finish(settings, response, decision));
    };
    let pending = settings
        .client
        .store
        .settle(&charged.tier.policy, check.settle(actual));
    ControlFlow::Continue(State::Settle {
        pending,
        response,
        decision,
        actual,
    })
}

impl<S, ReqBody> fmt::Debug for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match &self.state {
            State::Check { .. } => "checking",
            State::Readying { .. } => "readying the inner service",
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
