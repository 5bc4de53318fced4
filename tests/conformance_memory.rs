//! The conformance suite on [`MemoryStore`].
#![allow(clippy::unwrap_used, clippy::expect_used)]
mod common;

use tollgate::store::MemoryStore;

conformance_suite!((MemoryStore::new(), ()));
