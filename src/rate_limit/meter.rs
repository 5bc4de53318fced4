//! Usage read from a response body as it streams, for
//! [`settle_stream`](super::RateLimitLayerBuilder::settle_stream): the [`Meter`] trait, and
//! meters for a trailer ([`TrailerUsage`]) and for server-sent events ([`SseUsage`], feature
//! `sse`).

use http::{HeaderMap, HeaderName};

/// Reads the usage a response reports in its body, frame by frame as the body goes out — in
/// its last server-sent event, in a trailer — so that a reservation is settled on it without
/// the body being held back or buffered. One meter per response, made from its head by the
/// closure given to [`settle_stream`](super::RateLimitLayerBuilder::settle_stream).
///
/// ```
/// use http::HeaderMap;
/// use tollgate::rate_limit::Meter;
///
/// /// Usage as the number of lines the body sends.
/// #[derive(Default)]
/// struct Lines(u64);
///
/// impl Meter for Lines {
///     fn data(&mut self, data: &[u8]) {
///         self.0 += data.iter().filter(|b| **b == b'\n').count() as u64;
///     }
///     fn usage(&self) -> Option<u64> {
///         Some(self.0)
///     }
/// }
///
/// let mut lines = Lines::default();
/// lines.data(b"one\ntwo\n");
/// lines.trailers(&HeaderMap::new());
/// assert_eq!(lines.usage(), Some(2));
/// ```
pub trait Meter: Send + 'static {
    /// A data frame of the body, as it goes out.
    fn data(&mut self, data: &[u8]) {
        let _ = data;
    }

    /// The body's trailers (gRPC: its trailing metadata).
    fn trailers(&mut self, trailers: &HeaderMap) {
        let _ = trailers;
    }

    /// The usage reported so far; `None` while the body has reported none.
    fn usage(&self) -> Option<u64>;
}

/// The usage a trailer of the response names, a number (`x-tokens-used: 120`): for gRPC, a
/// value of the trailing metadata. A trailer that is absent or not a number reports nothing.
///
/// ```
/// use http::HeaderMap;
/// use tollgate::rate_limit::{Meter, TrailerUsage};
///
/// let mut used = TrailerUsage::from_static("x-tokens-used");
/// let mut trailers = HeaderMap::new();
/// trailers.insert("x-tokens-used", "120".parse().unwrap());
/// used.trailers(&trailers);
/// assert_eq!(used.usage(), Some(120));
/// ```
#[derive(Debug, Clone)]
pub struct TrailerUsage {
    name: HeaderName,
    usage: Option<u64>,
}

impl TrailerUsage {
    /// Reads trailer `name`.
    pub fn new(name: HeaderName) -> Self {
        Self { name, usage: None }
    }

    /// Reads trailer `name`, a lowercase header name known when compiling.
    pub fn from_static(name: &'static str) -> Self {
        Self::new(HeaderName::from_static(name))
    }
}

impl Meter for TrailerUsage {
    fn trailers(&mut self, trailers: &HeaderMap) {
        let value = trailers.get(&self.name).and_then(|v| v.to_str().ok());
        if let Some(usage) = value.and_then(|v| v.trim().parse().ok()) {
            self.usage = Some(usage);
        }
    }

    fn usage(&self) -> Option<u64> {
        self.usage
    }
}

#[cfg(feature = "sse")]
pub use sse::SseUsage;

#[cfg(feature = "sse")]
mod sse {
    use std::collections::VecDeque;
    use std::convert::Infallible;
    use std::pin::Pin;
    use std::sync::{Arc, Mutex, PoisonError};
    use std::task::{Context, Poll, Waker};

    use bytes::Bytes;
    use eventsource_stream::{EventStream, Eventsource};
    use futures_util::Stream;

    use super::Meter;

    /// The most of a body an event may take before it is complete: past it, the meter stops
    /// reading (and reports what it read), so that a body of no events holds no memory.
    const MAX_EVENT: usize = 256 * 1024;

    /// The usage server-sent events report (`text/event-stream`, feature `sse`): the events
    /// parsed by `eventsource-stream` as the body goes out, each event's data read as JSON,
    /// and the usage the sum of the last number found at each of the given paths. A body
    /// that is not events, an event that is not JSON, a path that holds no number report
    /// nothing of theirs; an event of more than 256 KiB stops the reading.
    ///
    /// | provider | stream | usage |
    /// | --- | --- | --- |
    /// | OpenAI-style ([`openai`](Self::openai)) | the last chunk's `usage` (`stream_options.include_usage`) | `usage.total_tokens` |
    /// | Anthropic-style ([`anthropic`](Self::anthropic)) | `message_start` then `message_delta` events | `message.usage.input_tokens` + `usage.output_tokens` |
    ///
    /// ```
    /// use tollgate::rate_limit::{Meter, SseUsage};
    ///
    /// let mut usage = SseUsage::openai();
    /// usage.data(b"data: {\"choices\":[{\"delta\":{\"content\":\"Hi\"}}]}\n\n");
    /// assert_eq!(usage.usage(), None);
    /// usage.data(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":9,\"completion_tokens\":");
    /// usage.data(b"12,\"total_tokens\":21}}\n\ndata: [DONE]\n\n");
    /// assert_eq!(usage.usage(), Some(21));
    /// ```
    pub struct SseUsage {
        paths: Vec<Vec<String>>,
        /// The first key of each path, quoted as JSON writes it: an event whose data names
        /// none of them is not parsed.
        first_keys: Vec<String>,
        found: Vec<Option<u64>>,
        /// The events of the bytes fed to it; `None` once the reading stopped.
        events: Option<Pin<Box<EventStream<Feed>>>>,
        feed: Arc<Mutex<VecDeque<Bytes>>>,
        /// Bytes fed since the last complete event.
        pending: usize,
    }

    impl std::fmt::Debug for SseUsage {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.debug_struct("SseUsage")
                .field("paths", &self.paths)
                .field("found", &self.found)
                .field("reading", &self.events.is_some())
                .finish_non_exhaustive()
        }
    }

    impl SseUsage {
        /// The sum of the last number at each of `paths` (dotted: `usage.total_tokens`) in the
        /// JSON data of the events.
        pub fn json_paths(paths: &[&str]) -> Self {
            let feed = Arc::new(Mutex::new(VecDeque::new()));
            let events = Feed(Arc::clone(&feed)).eventsource();
            let paths: Vec<Vec<String>> = paths
                .iter()
                .map(|path| path.split('.').map(str::to_owned).collect())
                .collect();
            let first_keys = paths
                .iter()
                .filter_map(|path| path.first())
                .map(|key| format!("\"{key}\""))
                .collect();
            Self {
                found: vec![None; paths.len()],
                paths,
                first_keys,
                events: Some(Box::pin(events)),
                feed,
                pending: 0,
            }
        }

        /// OpenAI-style streams: `usage.total_tokens` of the last chunk (sent with
        /// `stream_options: {"include_usage": true}`).
        pub fn openai() -> Self {
            Self::json_paths(&["usage.total_tokens"])
        }

        /// Anthropic-style streams: the input tokens of `message_start` plus the output tokens
        /// of the last `message_delta` (a running total).
        pub fn anthropic() -> Self {
            Self::json_paths(&["message.usage.input_tokens", "usage.output_tokens"])
        }

        fn event(&mut self, data: &str) {
            // most events are content: found without parsing them
            if !self
                .first_keys
                .iter()
                .any(|key| data.contains(key.as_str()))
            {
                return;
            }
            let Ok(json) = serde_json::from_str::<serde_json::Value>(data) else {
                return;
            };
            for (path, found) in self.paths.iter().zip(&mut self.found) {
                let at = path.iter().try_fold(&json, |value, key| value.get(key));
                if let Some(number) = at.and_then(serde_json::Value::as_u64) {
                    *found = Some(number);
                }
            }
        }
    }

    impl Meter for SseUsage {
        fn data(&mut self, data: &[u8]) {
            let Some(events) = self.events.as_mut() else {
                return;
            };
            self.feed
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .push_back(Bytes::copy_from_slice(data));
            self.pending += data.len();
            // the feed never wakes anyone: each event is taken as its bytes arrive
            let mut cx = Context::from_waker(Waker::noop());
            let mut complete = Vec::new();
            let mut stop = false;
            loop {
                match events.as_mut().poll_next(&mut cx) {
                    Poll::Ready(Some(Ok(event))) => complete.push(event.data),
                    Poll::Ready(Some(Err(_)) | None) => {
                        stop = true;
                        break;
                    }
                    Poll::Pending => break,
                }
            }
            if !complete.is_empty() {
                self.pending = 0;
            }
            for data in complete {
                self.event(&data);
            }
            if stop || self.pending > MAX_EVENT {
                self.events = None;
                self.feed
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
            }
        }

        fn usage(&self) -> Option<u64> {
            self.found
                .iter()
                .flatten()
                .copied()
                .reduce(u64::saturating_add)
        }
    }

    /// The bytes fed to an [`SseUsage`], as the stream `eventsource-stream` reads.
    struct Feed(Arc<Mutex<VecDeque<Bytes>>>);

    impl Stream for Feed {
        type Item = Result<Bytes, Infallible>;

        fn poll_next(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<Option<Self::Item>> {
            let next = self
                .0
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .pop_front();
            next.map_or(Poll::Pending, |data| Poll::Ready(Some(Ok(data))))
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn anthropic_usage_sums_the_input_and_the_last_output() {
            let mut usage = SseUsage::anthropic();
            usage.data(b"event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"usage\":{\"input_tokens\":25,\"output_tokens\":1}}}\n\n");
            usage.data(b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"delta\":{\"text\":\"Hi\"}}\n\n");
            assert_eq!(usage.usage(), Some(25));
            usage.data(b"event: message_delta\ndata: {\"type\":\"message_delta\",\"usage\":{\"output_tokens\":15}}\n\n");
            usage.data(b"event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n");
            assert_eq!(usage.usage(), Some(40));
        }

        #[test]
        fn a_body_of_no_events_is_let_go_past_the_cap() {
            let mut usage = SseUsage::openai();
            let line = vec![b'x'; 64 * 1024];
            for _ in 0..5 {
                usage.data(&line);
            }
            assert!(usage.events.is_none(), "stopped reading");
            assert!(usage.feed.lock().unwrap().is_empty(), "holds nothing");
            // events after it are not read
            usage.data(b"\n\ndata: {\"usage\":{\"total_tokens\":3}}\n\n");
            assert_eq!(usage.usage(), None);
        }

        #[test]
        fn events_split_anywhere_read_the_same() {
            let body: &[u8] = b"data: {\"usage\":{\"total_tokens\":7}}\r\n\r\ndata: [DONE]\n\n";
            for split in 0..body.len() {
                let mut usage = SseUsage::openai();
                usage.data(&body[..split]);
                usage.data(&body[split..]);
                assert_eq!(usage.usage(), Some(7), "split at {split}");
            }
        }
    }
}
