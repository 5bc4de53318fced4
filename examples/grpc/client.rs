//! A small `SayHello` client, so that the example can be tried without grpcurl:
//!
//! ```text
//! cargo run --release --example grpc -- call --count 7 --api-key alice
//! cargo run --release --example grpc -- call --count 2 --idempotency-key order-1
//! ```
//!
//! Each call prints one line: the reply (and whether it was a replay) or the status code with
//! its `retry-after` metadata.

use tonic::metadata::{AsciiMetadataValue, MetadataMap};

use crate::server::helloworld::HelloRequest;
use crate::server::helloworld::greeter_client::GreeterClient;
use crate::server::{API_KEY, IDEMPOTENCY_KEY};

/// What `call` is asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallArgs {
    /// The server, e.g. `http://127.0.0.1:50051`.
    pub url: String,
    /// The name to greet.
    pub name: String,
    /// How many calls to make, one after the other.
    pub count: u32,
    /// `x-api-key` metadata, if any.
    pub api_key: Option<String>,
    /// `idempotency-key` metadata, if any.
    pub idempotency_key: Option<String>,
}

/// How to use `call`.
pub const USAGE: &str = "usage: grpc call [--url URL] [--name NAME] [--count N] \
     [--api-key KEY] [--idempotency-key KEY]\n  defaults: --url http://127.0.0.1:$PORT (PORT \
     or 50051), --name world, --count 1";

impl CallArgs {
    /// Parses the arguments after `call`; `default_url` unless `--url` is given.
    pub fn parse(
        args: impl IntoIterator<Item = String>,
        default_url: String,
    ) -> Result<Self, String> {
        let mut parsed = Self {
            url: default_url,
            name: "world".to_owned(),
            count: 1,
            api_key: None,
            idempotency_key: None,
        };
        let mut args = args.into_iter();
        while let Some(flag) = args.next() {
            let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
            match flag.as_str() {
                "--url" => parsed.url = value()?,
                "--name" => parsed.name = value()?,
                "--count" => {
                    let count = value()?;
                    parsed.count = count
                        .parse()
                        .map_err(|_| format!("--count {count:?} is not a whole number"))?;
                }
                "--api-key" => parsed.api_key = Some(value()?),
                "--idempotency-key" => parsed.idempotency_key = Some(value()?),
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(parsed)
    }
}

/// Makes the calls and prints one line for each.
pub async fn call(args: CallArgs) -> Result<(), String> {
    let mut metadata = MetadataMap::new();
    for (name, value) in [
        (API_KEY, &args.api_key),
        (IDEMPOTENCY_KEY, &args.idempotency_key),
    ] {
        if let Some(value) = value {
            let value: AsciiMetadataValue = value
                .parse()
                .map_err(|_| format!("{value:?} is not a valid {name} metadata value"))?;
            metadata.insert(name, value);
        }
    }
    let mut client = GreeterClient::connect(args.url.clone())
        .await
        .map_err(|e| format!("cannot connect to {}: {e}", args.url))?;
    for i in 1..=args.count {
        let mut request = tonic::Request::new(HelloRequest {
            name: args.name.clone(),
        });
        *request.metadata_mut() = metadata.clone();
        match client.say_hello(request).await {
            Ok(reply) => {
                let replayed = reply.metadata().get("idempotent-replayed").is_some();
                let replay = if replayed { " (replayed)" } else { "" };
                println!("{i}: OK {:?}{replay}", reply.get_ref().message);
            }
            Err(status) => {
                let retry_after = status
                    .metadata()
                    .get("retry-after")
                    .and_then(|v| v.to_str().ok())
                    .map(|s| format!(", retry-after {s}s"))
                    .unwrap_or_default();
                println!(
                    "{i}: {:?} {:?}{retry_after}",
                    status.code(),
                    status.message()
                );
            }
        }
    }
    Ok(())
}
