//! The LLM gateway example (`examples/llm_gateway`): the session `docs/metering.md` shows is
//! sent to it, request by request, and every answer must be the one the page prints.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use http::Request;
use http_body_util::BodyExt;
use tower::ServiceExt;

use crate::llm_gateway::{Options, gateway};
use tollgate::store::MemoryStore;

/// One request of the session, as its `curl` command line says, and the answer printed under it.
#[derive(Debug)]
struct Exchange {
    command: String,
    request: Request<Body>,
    answer: String,
}

/// The words of a shell command line, with its single quotes taken off.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quoted = false;
    let mut started = false;
    for c in line.chars() {
        match c {
            '\'' => {
                quoted = !quoted;
                started = true;
            }
            ' ' if !quoted => {
                if started {
                    words.push(std::mem::take(&mut word));
                    started = false;
                }
            }
            c => {
                word.push(c);
                started = true;
            }
        }
    }
    if started {
        words.push(word);
    }
    words
}

/// The request a `curl` command line sends (the options the page uses: `-s`, `-sN`, `-H`, `-d`).
fn request(line: &str) -> Request<Body> {
    let words = words(line);
    assert_eq!(words[0], "curl", "{line}");
    let mut builder = Request::builder();
    let mut body = None;
    let mut args = words[1..].iter();
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "-s" | "-sN" => {}
            "-H" => {
                let (name, value) = args.next().unwrap().split_once(": ").unwrap();
                builder = builder.header(name, value);
            }
            "-d" => body = Some(args.next().unwrap().clone()),
            url => {
                let path = url.strip_prefix("localhost:3000").expect(url);
                builder = builder.uri(path);
            }
        }
    }
    let method = if body.is_some() { "POST" } else { "GET" };
    builder
        .method(method)
        .body(Body::from(body.unwrap_or_default()))
        .unwrap()
}

/// Every `$ curl` to `localhost:3000` of the page's `text` blocks, with the lines printed under
/// it.
fn session(page: &str) -> Vec<Exchange> {
    let mut exchanges: Vec<Exchange> = Vec::new();
    let mut in_block = false;
    // the exchange the lines read belong to: none before a block's first command
    let mut current = None;
    for line in page.lines() {
        if line.starts_with("```") {
            in_block = line == "```text";
            current = None;
            continue;
        }
        if !in_block {
            continue;
        }
        // the session is on one copy at port 3000; commands on several copies are shown, not sent
        let on_one_copy =
            |command: &str| command.starts_with("curl ") && command.contains(" localhost:3000/");
        if let Some(command) = line.strip_prefix("$ ") {
            if !on_one_copy(command) {
                current = None;
                continue;
            }
            exchanges.push(Exchange {
                command: command.to_owned(),
                request: request(command),
                answer: String::new(),
            });
            current = Some(exchanges.len() - 1);
        } else if let Some(i) = current {
            exchanges[i].answer.push_str(line);
            exchanges[i].answer.push('\n');
        }
    }
    exchanges
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_session_of_the_metering_page_is_what_the_gateway_answers() {
    let page =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/metering.md")).unwrap();
    let exchanges = session(&page);
    assert_eq!(exchanges.len(), 8, "the page's session");
    let options = Options {
        word_delay: Duration::ZERO,
        ..Options::default()
    };
    let store: Arc<dyn tollgate::store::Store> = Arc::new(MemoryStore::new());
    let app = gateway(&store, &options).unwrap();
    for exchange in exchanges {
        let response = app.clone().oneshot(exchange.request).await.unwrap();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let body = String::from_utf8(body.to_vec()).unwrap();
        assert_eq!(
            body.trim_end(),
            exchange.answer.trim_end(),
            "$ {}",
            exchange.command
        );
        // the settlement of a stream is made once its body has gone out, in the background
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[test]
fn a_command_line_reads_as_the_shell_reads_it() {
    assert_eq!(
        words(r#"curl -s url -H 'x-api-key: demo' -d '{"a": 1}'"#),
        [
            "curl",
            "-s",
            "url",
            "-H",
            "x-api-key: demo",
            "-d",
            r#"{"a": 1}"#
        ]
    );
}
