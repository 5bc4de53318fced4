//! A TCP proxy that puts the store at a distance: every chunk read from either side is written
//! to the other `DELAY_MS` milliseconds after it was read, however many are in flight (a reader
//! stamps each chunk, a writer sends it when due), so a pipelined client sees the round trip grow
//! by twice the delay and nothing else. No Nagle on either side.
//!
//! usage: LISTEN=127.0.0.1:PORT UPSTREAM=127.0.0.1:PORT DELAY_MS=1 delay

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

fn var(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set"))
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let delay = Duration::from_micros(
        (var("DELAY_MS").parse::<f64>().expect("DELAY_MS: a number") * 1000.0) as u64,
    );
    let upstream = var("UPSTREAM");
    let listener = TcpListener::bind(var("LISTEN"))
        .await
        .expect("LISTEN: a free address");
    loop {
        let Ok((client, _)) = listener.accept().await else {
            continue;
        };
        let upstream = upstream.clone();
        tokio::spawn(async move {
            let Ok(server) = TcpStream::connect(&upstream).await else {
                return;
            };
            let _ = (client.set_nodelay(true), server.set_nodelay(true));
            let (cr, cw) = client.into_split();
            let (sr, sw) = server.into_split();
            tokio::spawn(forward(cr, sw, delay));
            tokio::spawn(forward(sr, cw, delay));
        });
    }
}

/// Copies `from` to `to`, each chunk `delay` after it was read.
async fn forward(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, delay: Duration) {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let writer = tokio::spawn(async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
        }
        let _ = to.shutdown().await;
    });
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if tx
                    .send((Instant::now() + delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }
    }
    drop(tx);
    let _ = writer.await;
}
