//! What the idempotency layer tells of each keyed request: the metrics count it, and the traces
//! get one event, target `tollgate::idempotency`, at `DEBUG`, with `tollgate.*` fields.

/// Reports how a keyed request fared: `executed` (the first run: the handler runs),
/// `replayed` (the stored response is sent again), `conflict` (another request holds the key),
/// `mismatch` (the key was used with another request) or `rejected`, and for a refusal its
/// `reason` (the rejection's code, such as `in_flight` or `store_unavailable`).
pub(super) fn report(outcome: &'static str, reason: Option<&'static str>) {
    crate::metrics::idempotency(outcome);
    tracing::event!(
        target: "tollgate::idempotency",
        tracing::Level::DEBUG,
        tollgate.outcome = outcome,
        tollgate.reason = reason,
        "idempotency decision"
    );
}
