//! [`ScriptCall`]: a script with its keys and arguments, run plainly or in a durable pipeline.

use redis::aio::ConnectionLike;
use redis::{FromRedisValue, Pipeline, RedisResult, Script, ToRedisArgs};

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

    /// Adds `EVAL <source> <keys> <args>` to `pipe`: the source, not its hash, so that a
    /// `NOSCRIPT` answer cannot cost a durable write a second `WAIT`.
    pub(super) fn add_eval(&self, pipe: &mut Pipeline, source: &str) {
        pipe.cmd("EVAL")
            .arg(source)
            .arg(self.keys.len())
            .arg(&self.keys)
            .arg(&self.args);
    }

    /// The hash tag of the first key (the whole key when it has none): on Cluster, calls with
    /// the same one go to the same node.
    pub(super) fn hash_tag(&self) -> &[u8] {
        let key = self.keys.first().map_or(&[][..], Vec::as_slice);
        let Some(open) = key.iter().position(|&b| b == b'{') else {
            return key;
        };
        match key[open + 1..].iter().position(|&b| b == b'}') {
            Some(len) if len > 0 => &key[open + 1..open + 1 + len],
            _ => key,
        }
    }
}
