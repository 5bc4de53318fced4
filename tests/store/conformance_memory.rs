//! The conformance suite on [`MemoryStore`].
use tollgate::store::MemoryStore;

tollgate::store_suite!((MemoryStore::new(), ()));
