//! [`ScriptCall`]: a script with its keys and arguments, run plainly or as a durable write.

use redis::aio::ConnectionLike;
use redis::{FromRedisValue, RedisResult, Script, ToRedisArgs};

/// A script with its keys and arguments.
#[derive(Debug, Default)]
pub(super) struct ScriptCall {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl ScriptCall {
    pub(super) fn key(mut self, key: impl ToRedisArgs) -> Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub(super) fn arg(mut self, arg: impl ToRedisArgs) -> Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// Runs `script` by `EVALSHA` (loading it on `NOSCRIPT`).
    pub(super) async fn invoke<T, C>(&self, script: &Script, conn: &mut C) -> RedisResult<T>
    where
        T: FromRedisValue,
        C: ConnectionLike + Send,
    {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key.as_slice());
        }
        for arg in &self.args {
            invocation.arg(arg.as_slice());
        }
        invocation.invoke_async(conn).await
    }

    /// Runs the script of `source` and `WAIT replicas wait_ms` in one pipeline on one
    /// connection, so that the count is of replicas that acknowledged this very write: the reply
    /// and that count. The source goes along (`EVAL`), not its hash: a `NOSCRIPT` answer would
    /// cost a second `WAIT`, and a durable write must fit in the store timeout.
    pub(super) async fn invoke_and_wait<T, C>(
        &self,
        source: &str,
        conn: &mut C,
        replicas: u32,
        wait_ms: u64,
    ) -> RedisResult<(T, u32)>
    where
        T: FromRedisValue,
        C: ConnectionLike + Send,
    {
        let mut pipe = redis::pipe();
        pipe.cmd("EVAL")
            .arg(source)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
        pipe.cmd("WAIT").arg(replicas).arg(wait_ms);
        pipe.query_async(conn).await
    }
}
