//! Background tasks that must not outlive their owner.

/// Aborts a spawned task when dropped: a lease keeper stops with the work it keeps alive, however
/// that work ends — finished, failed, panicked or cancelled.
#[derive(Debug)]
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}
