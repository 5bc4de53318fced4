//! The conformance suite on PostgreSQL: one server for the binary, each test in a schema of its
//! own.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

tollgate::store_suite!((common::postgres::store().await, ()));
tollgate::limits_store_suite!((common::postgres::store().await, ()));
tollgate::rate_lines_suite!((common::postgres::store().await, ()));
