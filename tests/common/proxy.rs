//! A TCP proxy in front of a redis-server that the tests control: cut every connection (and
//! refuse new ones), heal, delay every byte or only the server's replies, or silence the open
//! connections (a black hole: they stay open and carry nothing).
//!
//! A client that closes its connection closes it as TCP would across a network: what it sent is
//! still delivered (late, if delayed or silenced), then its end of stream, and the server's
//! replies are taken (and dropped) until the server closes too. So a server runs to the end what
//! it was sent before the close — a PostgreSQL transaction sent whole commits — instead of
//! meeting a reset right after the first reply, which on loopback would come within
//! microseconds, far sooner than from a client a network away.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// How long a connection whose client has closed waits for the server to close its side.
const LINGER: Duration = Duration::from_secs(10);

pub struct Proxy {
    addr: SocketAddr,
    cut: Arc<AtomicBool>,
    /// Added to every chunk, both directions ([`delay`](Self::delay)).
    delay_ms: Arc<AtomicU64>,
    /// Added to every chunk from the server to the client ([`delay_replies`](Self::delay_replies)).
    reply_delay_ms: Arc<AtomicU64>,
    /// Bumped by [`cut`](Self::cut): every open connection is dropped.
    kills: watch::Sender<u64>,
    /// The generation of the connections accepted now; [`silence`](Self::silence) starts a new one.
    generation: Arc<AtomicU64>,
    /// Connections of a generation below this one carry nothing (0: none is silenced).
    silenced_below: watch::Sender<u64>,
}

/// What a connection's pumps read from the proxy's controls.
#[derive(Clone)]
struct Controls {
    delays: Vec<Arc<AtomicU64>>,
    generation: u64,
    silenced_below: watch::Receiver<u64>,
}

impl Proxy {
    /// Starts a proxy to `upstream` on a free local port (on the current tokio runtime).
    pub async fn start(upstream: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("proxy bind");
        let addr = listener.local_addr().expect("proxy addr");
        let cut = Arc::new(AtomicBool::new(false));
        let delay_ms = Arc::new(AtomicU64::new(0));
        let reply_delay_ms = Arc::new(AtomicU64::new(0));
        let (kills, _) = watch::channel(0u64);
        let generation = Arc::new(AtomicU64::new(0));
        let (silenced_below, _) = watch::channel(0u64);
        let proxy = Self {
            addr,
            cut: cut.clone(),
            delay_ms: delay_ms.clone(),
            reply_delay_ms: reply_delay_ms.clone(),
            kills: kills.clone(),
            generation: generation.clone(),
            silenced_below: silenced_below.clone(),
        };
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if cut.load(Ordering::SeqCst) {
                    drop(client);
                    continue;
                }
                // the generation the connection was opened in, before anything can silence it
                let opened_in = generation.load(Ordering::SeqCst);
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                // no Nagle: a small chunk held back for a delayed ACK would add 40 ms
                let _ = (client.set_nodelay(true), server.set_nodelay(true));
                let mut killed = kills.subscribe();
                let requests = Controls {
                    delays: vec![delay_ms.clone()],
                    generation: opened_in,
                    silenced_below: silenced_below.subscribe(),
                };
                let replies = Controls {
                    delays: vec![delay_ms.clone(), reply_delay_ms.clone()],
                    ..requests.clone()
                };
                tokio::spawn(async move {
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let to_client = pump(sr, cw, replies);
                    tokio::pin!(to_client);
                    tokio::select! {
                        () = pump(cr, sw, requests) => {
                            // the client ended: what it sent is delivered and the server has
                            // its end of stream; its replies are taken until it closes too
                            tokio::select! {
                                _ = tokio::time::timeout(LINGER, &mut to_client) => {}
                                _ = killed.changed() => {}
                            }
                        }
                        () = &mut to_client => {}
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

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Drops every open connection and refuses new ones until [`heal`](Self::heal).
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
        self.kills.send_modify(|g| *g += 1);
    }

    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }

    /// Delays every chunk in both directions by `delay` (replies also by
    /// [`delay_replies`](Self::delay_replies)). A chunk is delayed from when the proxy read it,
    /// and chunks keep their order.
    pub fn delay(&self, delay: Duration) {
        self.delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Delays only what the server sends (its replies) by `delay`: a command reaches Redis at once
    /// and runs, and its reply arrives `delay` late. A reply is delayed from when the proxy read
    /// it, so replies in a row are each `delay` late, not late by the sum; `Duration::ZERO` ends
    /// it for replies read from then on (those already read keep their delay).
    pub fn delay_replies(&self, delay: Duration) {
        self.reply_delay_ms
            .store(delay.as_millis() as u64, Ordering::SeqCst);
    }

    /// Black-holes every connection open now: in both directions it stops forwarding, but stays
    /// open (no FIN, no RST), as a connection to a crashed VM or through an expired NAT entry
    /// does. Its client can still write (the proxy's socket buffers fill up) and hears nothing.
    /// Connections accepted after this call work normally. Until [`unsilence`](Self::unsilence),
    /// nothing is discarded: the bytes are held.
    pub fn silence(&self) {
        // connections of generations up to `opened` go dark; new ones get `opened + 1`
        let opened = self.generation.fetch_add(1, Ordering::SeqCst);
        self.silenced_below.send_replace(opened + 1);
    }

    /// Lets every silenced connection flow again. Nothing was discarded: the bytes held while it
    /// was silent are delivered first, in order, as TCP would deliver them once a partition heals.
    pub fn unsilence(&self) {
        self.silenced_below.send_replace(0);
    }
}

/// Forwards `from` to `to`: each chunk as read, after the sum of `controls.delays` (counted from
/// when it was read), and only while the connection is not silenced. Returns when `from` ends,
/// after what was read is delivered — dropped, once `to` has failed (its peer is gone) — and
/// `to` is shut down for writing with it.
async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, controls: Controls) {
    let Controls {
        delays,
        generation,
        mut silenced_below,
    } = controls;
    // bounded: a writer held back (delayed, silenced) holds the reader back too
    let (chunks, mut due_chunks) = mpsc::channel::<(Instant, Vec<u8>)>(64);
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            let delay: u64 = delays.iter().map(|d| d.load(Ordering::SeqCst)).sum();
            let due = Instant::now() + Duration::from_millis(delay);
            if chunks.send((due, buf[..n].to_vec())).await.is_err() {
                return;
            }
        }
    };
    let writer = async move {
        let mut broken = false;
        while let Some((due, chunk)) = due_chunks.recv().await {
            if broken {
                continue;
            }
            tokio::time::sleep_until(due).await;
            // the accept loop keeps a sender, so this fails only once the runtime goes
            if silenced_below
                .wait_for(|below| generation >= *below)
                .await
                .is_err()
            {
                return;
            }
            broken = to.write_all(&chunk).await.is_err();
        }
    };
    tokio::pin!(writer);
    tokio::select! {
        () = &mut writer => return,
        () = reader => {}
    }
    // `from` ended: deliver what was read, then end
    writer.await;
}
