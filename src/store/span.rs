//! The tracing span of one store call, shaped by OpenTelemetry's database conventions so that
//! `tracing-opentelemetry` exports it as a client span: one span per round trip to the server
//! (a batch of rate checks or of durable writes is one), at `DEBUG` under target
//! `tollgate::store`.
//!
//! The span's own name is the command (`EVALSHA`, `SELECT`): tracing names are static.
//! `otel.name` carries the full OpenTelemetry name, `{db.operation.name} {target}`, the target
//! being the script or function called (`EVALSHA rate`, `SELECT tollgate.decide_rates`). Every
//! field is computed only when a subscriber takes the span: with none, a call pays one check of
//! the callsite's interest, and nothing is allocated.

use std::fmt;

use tracing::Span;
use tracing::field::Empty;

use super::StoreError;

/// Where a store's calls go: `server.address` and `server.port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Server {
    pub(crate) address: Box<str>,
    pub(crate) port: u16,
}

/// The database a backend speaks, as `db.system.name` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum System {
    #[cfg(feature = "redis")]
    Redis,
    #[cfg(feature = "postgres")]
    Postgresql,
}

impl System {
    fn as_str(self) -> &'static str {
        match self {
            #[cfg(feature = "redis")]
            Self::Redis => "redis",
            #[cfg(feature = "postgres")]
            Self::Postgresql => "postgresql",
        }
    }
}

/// The command a call sends: `db.operation.name`, and the span's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Command {
    /// A Lua script by its hash (loaded on `NOSCRIPT` within the same span).
    #[cfg(feature = "redis")]
    Evalsha,
    /// A function of a Lua library (loaded when the server lacks it, within the same span).
    #[cfg(feature = "redis")]
    Fcall,
    #[cfg(feature = "redis")]
    Ping,
    /// A pipeline: durable writes (`EVAL` each) and the `WAIT` that acknowledges them.
    #[cfg(feature = "redis")]
    Batch,
    /// A function call, `SELECT <schema>.<function>(...)`.
    #[cfg(feature = "postgres")]
    Select,
}

/// One store call, as its span describes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Call<'a> {
    pub(crate) system: System,
    pub(crate) command: Command,
    /// The script or function called (`db.stored_procedure.name`); empty for a plain command.
    pub(crate) target: &'a str,
    /// The store operation, as the metrics label it (`tollgate.operation`).
    pub(crate) operation: &'static str,
}

/// `{db.operation.name} {target}`, the span's OpenTelemetry name.
struct Named<'a>(&'static str, &'a str);

impl fmt::Display for Named<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)?;
        if !self.1.is_empty() {
            write!(f, " {}", Unquoted(self.1))?;
        }
        Ok(())
    }
}

/// A name without the double quotes of its SQL form: `tollgate.claim` for `"tollgate".claim`.
struct Unquoted<'a>(&'a str);

impl fmt::Display for Unquoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.split('"').try_for_each(|part| f.write_str(part))
    }
}

/// A store-call span named `$name`, with every field a call may record.
macro_rules! call_span {
    ($name:literal, $call:expr) => {{
        let call: &Call<'_> = $call;
        tracing::debug_span!(
            target: "tollgate::store",
            $name,
            otel.name = %Named($name, call.target),
            otel.kind = "client",
            otel.status_code = Empty,
            otel.status_description = Empty,
            db.system.name = call.system.as_str(),
            db.operation.name = $name,
            db.stored_procedure.name = Empty,
            db.operation.batch.size = Empty,
            db.response.status_code = Empty,
            error.type = Empty,
            server.address = Empty,
            server.port = Empty,
            tollgate.operation = call.operation,
        )
    }};
}

/// The span of `call`, a child of the current span; disabled (and free) when no subscriber
/// wants it. `server`, when known, is read only for a span that is recorded.
pub(crate) fn call_span(call: &Call<'_>, server: impl FnOnce() -> Option<Server>) -> Span {
    let span = match call.command {
        #[cfg(feature = "redis")]
        Command::Evalsha => call_span!("EVALSHA", call),
        #[cfg(feature = "redis")]
        Command::Fcall => call_span!("FCALL", call),
        #[cfg(feature = "redis")]
        Command::Ping => call_span!("PING", call),
        #[cfg(feature = "redis")]
        Command::Batch => call_span!("BATCH", call),
        #[cfg(feature = "postgres")]
        Command::Select => call_span!("SELECT", call),
    };
    if span.is_disabled() {
        return span;
    }
    if !call.target.is_empty() {
        span.record(
            "db.stored_procedure.name",
            tracing::field::display(Unquoted(call.target)),
        );
    }
    if let Some(server) = server() {
        span.record("server.address", &*server.address);
        // OpenTelemetry wants an int: exporters take an i64 as one, a u64 as text
        span.record("server.port", i64::from(server.port));
    }
    span
}

/// Records that the call carried `size` operations of the store (rate checks, durable writes):
/// only for two or more, as OpenTelemetry asks.
pub(crate) fn record_batch(span: &Span, size: usize) {
    if size > 1 && !span.is_disabled() {
        span.record(
            "db.operation.batch.size",
            i64::try_from(size).unwrap_or(i64::MAX),
        );
    }
}

/// Records how the call ended: on an error, its kind (`error.type`), the server's code for it
/// (`db.response.status_code`: a Redis error code, a PostgreSQL SQLSTATE) when the server
/// answered one, and the error status.
pub(crate) fn record_result<T>(
    span: &Span,
    result: &Result<T, StoreError>,
    status_code: for<'e> fn(&'e StoreError) -> Option<&'e str>,
) {
    let Err(error) = result else {
        return;
    };
    if span.is_disabled() {
        return;
    }
    span.record("error.type", error.kind().as_str());
    if let Some(code) = status_code(error) {
        span.record("db.response.status_code", code);
    }
    span.record("otel.status_code", "ERROR");
    span.record("otel.status_description", tracing::field::display(error));
}

/// The error `error` was made from, if it is an `E`.
pub(crate) fn cause<E: std::error::Error + 'static>(error: &StoreError) -> Option<&E> {
    std::error::Error::source(error).and_then(|source| source.downcast_ref::<E>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_otel_name_joins_command_and_target() {
        assert_eq!(Named("EVALSHA", "rate").to_string(), "EVALSHA rate");
        assert_eq!(Named("PING", "").to_string(), "PING");
        assert_eq!(
            Named("SELECT", "\"tollgate\".claim").to_string(),
            "SELECT tollgate.claim"
        );
    }
}
