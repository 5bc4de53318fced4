//! [`StoreError`]: what went wrong talking to a store.

use std::fmt;

use crate::error::BoxError;

/// What went wrong talking to a store.
#[derive(Debug)]
pub struct StoreError {
    kind: StoreErrorKind,
    source: Option<BoxError>,
}

/// The kind of a [`StoreError`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StoreErrorKind {
    /// No answer within the store's timeout.
    Timeout,
    /// The store could not be reached, or the connection broke.
    Unavailable,
    /// The store answered with an error or with something this crate does not understand.
    Protocol,
    /// The store cannot be used as configured, and retrying will not help: a URL that does not
    /// parse, a wrong password or database name, a role without the rights it needs, a server
    /// without a command the configuration asks for.
    Config,
    /// The store does not offer the operation: a backend written before the operation was added
    /// to its capability trait keeps the trait's default, which answers this.
    Unsupported,
}

impl StoreError {
    /// A new error of `kind`, caused by `source`.
    pub fn new(kind: StoreErrorKind, source: impl Into<BoxError>) -> Self {
        Self {
            kind,
            source: Some(source.into()),
        }
    }

    /// A timeout.
    pub fn timeout() -> Self {
        Self {
            kind: StoreErrorKind::Timeout,
            source: None,
        }
    }

    /// The store answered with an error, or with something this crate does not understand.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn protocol(source: impl Into<BoxError>) -> Self {
        Self::new(StoreErrorKind::Protocol, source)
    }

    /// A write that the store received after its deadline, and so did not run: the caller had
    /// given up on it already.
    pub(crate) fn expired() -> Self {
        Self::new(
            StoreErrorKind::Timeout,
            "the store received the call after its deadline and did nothing",
        )
    }

    /// The operation `what` is not offered by this store (kind
    /// [`Unsupported`](StoreErrorKind::Unsupported)).
    pub(crate) fn unsupported(what: &str) -> Self {
        Self::new(
            StoreErrorKind::Unsupported,
            format!("this store does not offer {what}"),
        )
    }

    /// The kind of failure.
    pub fn kind(&self) -> StoreErrorKind {
        self.kind
    }

    /// The same failure again, for another caller of the call that failed.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn shared(&self) -> Self {
        Self {
            kind: self.kind,
            source: self.source.as_ref().map(|s| s.to_string().into()),
        }
    }
}

impl StoreErrorKind {
    /// The kind as the metrics label it: `timeout`, `unavailable`, `protocol`, `config` or
    /// `unsupported`.
    ///
    /// ```
    /// use tollgate::store::StoreErrorKind;
    ///
    /// assert_eq!(StoreErrorKind::Unavailable.as_str(), "unavailable");
    /// ```
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Timeout => "timeout",
            Self::Unavailable => "unavailable",
            Self::Protocol => "protocol",
            Self::Config => "config",
            Self::Unsupported => "unsupported",
        }
    }
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.kind {
            StoreErrorKind::Timeout => "store timed out",
            StoreErrorKind::Unavailable => "store unavailable",
            StoreErrorKind::Protocol => "store protocol error",
            StoreErrorKind::Config => "store configuration invalid",
            StoreErrorKind::Unsupported => "store operation unsupported",
        };
        match &self.source {
            Some(source) => write!(f, "{what}: {source}"),
            None => f.write_str(what),
        }
    }
}

impl std::error::Error for StoreError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.source
            .as_deref()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}
