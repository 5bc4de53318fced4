//! The pace of warnings that a flood must not turn into a flood of log lines.

/// Lets one event through per second.
#[derive(Debug)]
pub(crate) struct OncePerSecond {
    start: std::time::Instant,
    last: std::sync::atomic::AtomicU64,
}

impl OncePerSecond {
    pub(crate) fn new() -> Self {
        Self {
            start: std::time::Instant::now(),
            last: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Whether a second has passed since the last event let through.
    pub(crate) fn ready(&self) -> bool {
        use std::sync::atomic::Ordering;
        // +1: the first call is let through at once
        let now = self.start.elapsed().as_secs() + 1;
        let last = self.last.load(Ordering::Relaxed);
        now > last
            && self
                .last
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}
