//! `rate.lua` as Redis runs it: a function of a library where the server keeps them (Redis 7 and
//! later, Valkey), a script elsewhere.
//!
//! Run as a script (`EVALSHA`), the file makes its functions and tables at every call; loaded as
//! a library (`FUNCTION LOAD`), it makes them once, and each call (`FCALL`) runs only what
//! decides its checks: a lone check costs Redis about a sixth less, one of a batch of four about
//! a tenth (docs/performance.md). The library's name is `tollgate_rate_` and the start of the
//! script's hash, and the function it registers bears it too, so that copies of two versions
//! during a rolling deploy each call their own.
//!
//! A server that lost the library (a restart without persistence, `FUNCTION FLUSH`, a Cluster
//! node added since) answers that the function is not found: nothing ran, and the library is
//! loaded (`FUNCTION LOAD REPLACE`, on every primary of a Cluster) and called again. A server
//! without functions (before Redis 7), or whose user may not load or call them (ACL), gets the
//! script from then on; one that cannot load the library now (a Cluster primary down) gets the
//! script for that call.

use std::sync::atomic::{AtomicBool, Ordering};

use redis::aio::ConnectionLike;
use redis::{Cmd, RedisError, RedisResult, Value};

use super::Lua;
use super::connection::Connection;
use crate::store::span::Command;

/// A Lua file run as a library's function where the server allows it, as a script elsewhere.
pub(super) struct Library {
    script: Lua,
    /// The library's name, and its function's.
    name: String,
    /// `FUNCTION LOAD REPLACE` of the library.
    load: Cmd,
    /// Whether calls go by `FCALL`: until the server says it has no functions or refuses them.
    functions: AtomicBool,
}

impl Library {
    /// `script` as a library: its source after the library's name line, with
    /// `local library_name = '<name>'` at the start of its first line (see the end of
    /// `rate.lua`).
    pub(super) fn new(script: Lua) -> Self {
        let hash = script.get_hash();
        let name = format!("tollgate_{}_{}", script.name, &hash[..hash.len().min(16)]);
        let source = format!(
            "#!lua name={name}\nlocal library_name = '{name}' {}",
            script.source
        );
        let mut load = redis::cmd("FUNCTION");
        load.arg("LOAD").arg("REPLACE").arg(source);
        Self {
            script,
            name,
            load,
            functions: AtomicBool::new(true),
        }
    }

    /// The command a call is sent by, as its span names it.
    pub(super) fn command(&self) -> Command {
        if self.functions.load(Ordering::Relaxed) {
            Command::Fcall
        } else {
            Command::Evalsha
        }
    }

    /// The file's name, as spans name what a call runs.
    pub(super) fn file(&self) -> &'static str {
        self.script.name
    }

    /// Runs one call on `conn`: the command `call` makes of a verb and what it names
    /// (`FCALL <function>`, `EVALSHA <hash>` or `EVAL <source>`), its keys and arguments after.
    pub(super) async fn run(
        &self,
        conn: &mut Connection,
        call: impl Fn(&str, &str) -> Cmd,
    ) -> RedisResult<Value> {
        if self.functions.load(Ordering::Relaxed) {
            let fcall = call("FCALL", &self.name);
            match send(conn, &fcall).await {
                Err(e) if not_found(&e) => match send(conn, &self.load).await {
                    Ok(_) => return send(conn, &fcall).await,
                    Err(e) if refused(&e) => self.functions.store(false, Ordering::Relaxed),
                    // not loaded everywhere now: the script runs this call
                    Err(_) => {}
                },
                Err(e) if refused(&e) => self.functions.store(false, Ordering::Relaxed),
                sent => return sent,
            }
        }
        let evalsha = call("EVALSHA", self.script.get_hash());
        match send(conn, &evalsha).await {
            Err(e) if e.code() == Some("NOSCRIPT") => {
                // loads the script as it runs it
                send(conn, &call("EVAL", self.script.source)).await
            }
            sent => sent,
        }
    }
}

/// Whether `error` says the function called is not on the server: nothing ran.
fn not_found(error: &RedisError) -> bool {
    error.code() == Some("ERR") && error.detail() == Some("Function not found")
}

/// Whether `error` says the server has no functions, or does not let this user load or call
/// them: nothing ran, and the script will.
fn refused(error: &RedisError) -> bool {
    error.code() == Some("NOPERM")
        || (error.code() == Some("ERR")
            && error
                .detail()
                .is_some_and(|detail| detail.starts_with("unknown command")))
}

/// Sends `cmd`; an error reply is an error (Cluster connections hand it over as a value).
async fn send(conn: &mut Connection, cmd: &Cmd) -> RedisResult<Value> {
    match conn.req_packed_command(cmd).await? {
        Value::ServerError(error) => Err(error.into()),
        reply => Ok(reply),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error a server answers with `reply` (a RESP error line).
    fn answered(reply: &str) -> RedisError {
        match redis::parse_redis_value(format!("-{reply}\r\n").as_bytes()) {
            Ok(Value::ServerError(error)) => error.into(),
            other => panic!("not an error reply: {other:?}"),
        }
    }

    #[test]
    fn a_missing_function_is_loaded_and_a_refusal_turns_to_the_script() {
        assert!(not_found(&answered("ERR Function not found")));
        // Redis 6.2, 6.0: no functions
        for refusal in [
            "ERR unknown command 'FCALL', with args beginning with: 'tollgate_rate_1' '2' ",
            "ERR unknown command `FCALL`, with args beginning with: `tollgate_rate_1`, `2`, ",
            "NOPERM User scripts has no permissions to run the 'fcall' command",
            "NOPERM User no-loading has no permissions to run the 'function|load' command",
        ] {
            let error = answered(refusal);
            assert!(refused(&error) && !not_found(&error), "{refusal}");
        }
        // anything else is the call's error, as a script's would be
        for other in [
            "NOSCRIPT No matching script.",
            "ERR Error registering functions: ERR user_function:1: unexpected symbol",
            "BUSY Redis is busy running a script.",
            "OOM command not allowed when used memory > 'maxmemory'.",
        ] {
            let error = answered(other);
            assert!(!refused(&error) && !not_found(&error), "{other}");
        }
    }
}
