//! The conformance suite on [`MemoryStore`].
use tollgate::store::MemoryStore;

tollgate::store_suite!((MemoryStore::new(), ()));
tollgate::limits_store_suite!((MemoryStore::new(), ()));
tollgate::rate_lines_suite!((MemoryStore::new(), ()));
