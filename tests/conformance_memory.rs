//! The conformance suite on [`MemoryStore`].
mod common;

use tollgate::store::MemoryStore;

conformance_suite!((MemoryStore::new(), ()));
