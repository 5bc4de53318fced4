//! The [`ResponseFuture`] of [`ConcurrencyLimit`](super::ConcurrencyLimit): a permit, then the
//! inner call.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll, ready};

use http::{Request, Response};
use pin_project_lite::pin_project;
use tower_service::Service;

use super::admit::{Admission, admit};
use super::body::PermitBody;
use super::permit::Held;
use super::rejection::advertise;
use super::settings::Settings;
use crate::body::Complete;
use crate::grpc::Wire;
use crate::idempotency::Replayed;
use crate::key::Key;

/// A request's admission under way: it may wait in the key's queue.
type Admitting = Pin<Box<dyn Future<Output = Admission> + Send + 'static>>;

pin_project! {
    /// The response future of [`ConcurrencyLimit`](super::ConcurrencyLimit).
    pub struct ResponseFuture<S, ReqBody>
    where
        S: Service<Request<ReqBody>>,
    {
        #[pin]
        state: State<S::Future, S, Request<ReqBody>>,
        settings: Arc<Settings>,
        // the limit the request counts against, advertised on its response
        limit: u32,
    }
}

pin_project! {
    #[project = StateProj]
    #[project_replace = StateOwned]
    enum State<F, S, R> {
        Admit {
            admitting: Admitting,
            service: S,
            request: R,
        },
        Inner {
            #[pin]
            future: F,
            // the permit, held by the response's body from its head on
            held: Option<Held>,
        },
        Refused {
            response: Response<Complete>,
        },
        Done,
    }
}

impl<S, ReqBody> ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>>,
{
    /// Takes a permit of `key` for `request`, then calls `service`.
    pub(super) fn admit(
        service: S,
        request: Request<ReqBody>,
        settings: Arc<Settings>,
        key: Key,
        limit: u32,
        wire: Wire,
    ) -> Self {
        let admitting = {
            let settings = Arc::clone(&settings);
            Box::pin(async move { admit(&settings, key, limit, wire).await })
        };
        Self::new(
            State::Admit {
                admitting,
                service,
                request,
            },
            settings,
            limit,
        )
    }

    /// The inner call, without a permit.
    pub(super) fn unlimited(future: S::Future, settings: Arc<Settings>, limit: u32) -> Self {
        Self::new(State::Inner { future, held: None }, settings, limit)
    }

    /// `response` instead of the inner call.
    pub(super) fn refused(
        response: Response<Complete>,
        settings: Arc<Settings>,
        limit: u32,
    ) -> Self {
        Self::new(State::Refused { response }, settings, limit)
    }

    fn new(
        state: State<S::Future, S, Request<ReqBody>>,
        settings: Arc<Settings>,
        limit: u32,
    ) -> Self {
        Self {
            state,
            settings,
            limit,
        }
    }
}

impl<S, ReqBody, ResBody> Future for ResponseFuture<S, ReqBody>
where
    S: Service<Request<ReqBody>, Response = Response<ResBody>>,
{
    type Output = Result<Response<PermitBody<ResBody>>, S::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut this = self.project();
        loop {
            match this.state.as_mut().project() {
                StateProj::Admit { admitting, .. } => {
                    let admission = ready!(admitting.as_mut().poll(cx));
                    let StateOwned::Admit {
                        mut service,
                        mut request,
                        ..
                    } = this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Admit");
                    };
                    let held = match admission {
                        Admission::Refused(response) => {
                            return Poll::Ready(Ok(response.map(PermitBody::from)));
                        }
                        Admission::Unlimited => None,
                        Admission::Admitted(held, permit) => {
                            if let Some(permit) = permit {
                                request.extensions_mut().insert(permit);
                            }
                            Some(held)
                        }
                    };
                    // a dropped response future drops `held`: the permit goes back
                    let future = service.call(request);
                    this.state.set(State::Inner { future, held });
                }
                StateProj::Inner { future, held } => {
                    let called = ready!(future.poll(cx));
                    let held = held.take();
                    this.state.set(State::Done);
                    // a failing inner service drops `held`: the permit goes back
                    let mut response = called?;
                    if held.is_some() && response.extensions().get::<Replayed>().is_some() {
                        this.settings.replay_took_a_permit();
                    }
                    advertise(this.settings, *this.limit, response.headers_mut(), None);
                    return Poll::Ready(Ok(response.map(|body| PermitBody::inner(body, held))));
                }
                StateProj::Refused { .. } => {
                    let StateOwned::Refused { response } =
                        this.state.as_mut().project_replace(State::Done)
                    else {
                        unreachable!("the state was Refused");
                    };
                    return Poll::Ready(Ok(response.map(PermitBody::from)));
                }
                StateProj::Done => panic!("ResponseFuture polled after completion"),
            }
        }
    }
}
