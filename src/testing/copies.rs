//! [`Copies`]: several copies of a service, and many requests at once across them.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

use http::{Request, Response, StatusCode};
use tokio::sync::Barrier;
use tower_service::Service;

/// `n` copies of a service, each built by its own call of a factory — so that each has its own
/// in-process state, as separate processes would — usually on one shared store.
#[derive(Debug, Clone)]
pub struct Copies<S> {
    services: Vec<S>,
}

impl<S> Copies<S> {
    /// `n` copies (at least one), copy `i` built by `factory(i)`.
    pub fn new(n: usize, mut factory: impl FnMut(usize) -> S) -> Self {
        Self {
            services: (0..n.max(1)).map(&mut factory).collect(),
        }
    }

    /// How many copies there are.
    pub fn len(&self) -> usize {
        self.services.len()
    }

    /// Whether there are none (never: [`new`](Self::new) makes at least one).
    pub fn is_empty(&self) -> bool {
        self.services.is_empty()
    }

    /// Sends `requests` requests at once — request `i` made by `request(i)` and sent to copy
    /// `i % n` — and counts their statuses per copy. Every request is made and handed to its
    /// task first; then all start together. Must be called inside a Tokio runtime.
    pub async fn fire<B, ResBody>(
        &self,
        requests: usize,
        mut request: impl FnMut(usize) -> Request<B>,
    ) -> Statuses
    where
        S: Service<Request<B>, Response = Response<ResBody>> + Clone + Send + 'static,
        S::Future: Send,
        B: Send + 'static,
        ResBody: Send + 'static,
    {
        let start = Arc::new(Barrier::new(requests + 1));
        let mut tasks = Vec::with_capacity(requests);
        for i in 0..requests {
            let copy = i % self.services.len();
            let service = self.services[copy].clone();
            let (start, request) = (Arc::clone(&start), request(i));
            tasks.push((copy, tokio::spawn(send(service, request, start))));
        }
        start.wait().await;
        let mut statuses = Statuses::new(self.services.len());
        for (copy, task) in tasks {
            // a service that failed or panicked answered nothing: an error
            let status = task.await.ok().flatten();
            statuses.record(copy, status);
        }
        statuses
    }
}

/// Waits for the start, then sends `request` to `service`: its status, or `None` when the
/// service failed.
async fn send<S, B, ResBody>(
    mut service: S,
    request: Request<B>,
    start: Arc<Barrier>,
) -> Option<u16>
where
    S: Service<Request<B>, Response = Response<ResBody>>,
{
    start.wait().await;
    std::future::poll_fn(|cx| service.poll_ready(cx))
        .await
        .ok()?;
    let response = service.call(request).await.ok()?;
    Some(response.status().as_u16())
}

/// The statuses [`Copies::fire`] counted, per copy and in all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Statuses {
    per_copy: Vec<BTreeMap<u16, usize>>,
    errors: Vec<usize>,
}

impl Statuses {
    fn new(copies: usize) -> Self {
        Self {
            per_copy: vec![BTreeMap::new(); copies],
            errors: vec![0; copies],
        }
    }

    fn record(&mut self, copy: usize, status: Option<u16>) {
        match status {
            Some(status) => *self.per_copy[copy].entry(status).or_default() += 1,
            None => self.errors[copy] += 1,
        }
    }

    /// How many responses had `status`, over all copies.
    pub fn count(&self, status: StatusCode) -> usize {
        let status = status.as_u16();
        self.per_copy.iter().filter_map(|c| c.get(&status)).sum()
    }

    /// How many responses copy `copy` gave with `status`.
    pub fn count_at(&self, copy: usize, status: StatusCode) -> usize {
        let counts = self.per_copy.get(copy);
        counts
            .and_then(|c| c.get(&status.as_u16()))
            .copied()
            .unwrap_or(0)
    }

    /// How many requests got no response: the service failed, or its task panicked.
    pub fn errors(&self) -> usize {
        self.errors.iter().sum()
    }

    /// Every status seen, with how many responses had it, over all copies.
    pub fn totals(&self) -> BTreeMap<u16, usize> {
        let mut totals = BTreeMap::new();
        for (&status, &n) in self.per_copy.iter().flatten() {
            *totals.entry(status).or_default() += n;
        }
        totals
    }
}

/// A table: one row per copy, one column per status (and `error`), then the totals.
impl fmt::Display for Statuses {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let columns: Vec<u16> = self.totals().into_keys().collect();
        write!(f, "{:<8}", "copy")?;
        for status in &columns {
            write!(f, "{status:>6}")?;
        }
        writeln!(f, "{:>7}", "error")?;
        for (copy, counts) in self.per_copy.iter().enumerate() {
            write!(f, "{copy:<8}")?;
            for status in &columns {
                write!(f, "{:>6}", counts.get(status).copied().unwrap_or(0))?;
            }
            writeln!(f, "{:>7}", self.errors[copy])?;
        }
        write!(f, "{:<8}", "total")?;
        for status in &columns {
            write!(f, "{:>6}", self.totals().get(status).copied().unwrap_or(0))?;
        }
        writeln!(f, "{:>7}", self.errors())
    }
}
