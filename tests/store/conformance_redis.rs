//! The conformance suite on a real redis-server.
#![allow(clippy::unwrap_used, clippy::expect_used)]
use crate::common;

use common::RedisServer;

tollgate::store_suite!({
    let server = RedisServer::start();
    (server.store(), server)
});
tollgate::limits_store_suite!({
    let server = RedisServer::start();
    (server.store(), server)
});
tollgate::rate_lines_suite!({
    let server = RedisServer::start();
    (server.store(), server)
});
