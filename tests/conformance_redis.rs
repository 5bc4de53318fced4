//! The conformance suite on a real redis-server.
mod common;

use common::RedisServer;

conformance_suite!({
    let server = RedisServer::start();
    (server.store(), server)
});
