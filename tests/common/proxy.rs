//! A TCP proxy in front of a redis-server that the tests control: cut every connection (and
//! refuse new ones), heal, or delay every byte.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    delay_ms: Arc<AtomicU64>,
    generation: watch::Sender<u64>,
}

impl Proxy {
    /// Starts a proxy to `upstream` on a free local port (on the current tokio runtime).
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let cut = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let (generation, _) = watch::channel(0u64);
        let proxy = Self {
            addr,
            cut: cut.clone(),
            delay_ms: delay_ms.clone(),
            generation: generation.clone(),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let mut killed = generation.subscribe();
                let delay = delay_ms.clone();
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    tokio::select! {
                        _ = pump(cr, sw, delay.clone()) => {}
                        _ = pump(sr, cw, delay) => {}
                        _ = killed.changed() => {}
                    }
                });
            }
        });
        proxy
    }

    pub fn url(&self) -> String {
        format!("redis://{}/", self.addr)
    }

    /// Drops every open connection and refuses new ones until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.generation.send_modify(|g| *g += 1);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Delays every chunk in both directions by `delay`.
    pub fn delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    delay_ms: Arc<AtomicU64>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        let delay = delay_ms.load(Ordering::SeqCst);
        if delay > 0 {
            tokio::time::sleep(Duration::from_millis(delay)).await;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}
