//! Smoke tests for the TCP fault-injection proxy (`support::Proxy`), against
//! a real echo server and a real PostgreSQL.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use crate::support::{Postgres, Proxy};

/// Start an echo server on 127.0.0.1:<free port> on the current runtime;
/// returns its port.
async fn echo_server() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                continue;
            };
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
            });
        }
    });
    port
}

async fn connect(port: u16) -> TcpStream {
    let s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.set_nodelay(true).unwrap();
    s
}

/// Write `msg` and read exactly `msg.len()` bytes back (5 s timeout).
async fn roundtrip(s: &mut TcpStream, msg: &[u8]) {
    s.write_all(msg).await.unwrap();
    let mut back = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut back))
        .await
        .expect("echo timed out")
        .unwrap();
    assert_eq!(back, msg);
}

/// True if the peer closed (EOF or error) within `within`.
async fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    let mut buf = [0u8; 64];
    let deadline = Instant::now() + within;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}

fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) % 251) as u8
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_roundtrip_and_throughput() {
    let echo = echo_server().await;
    let proxy = Proxy::start(echo);
    assert_ne!(proxy.port(), echo);
    assert_eq!(proxy.target_port(), echo);

    let mut s = connect(proxy.port()).await;
    roundtrip(&mut s, b"hello through the proxy").await;
    assert_eq!(proxy.accepted(), 1);
    assert_eq!(proxy.open(), 1);

    // Bulk: 8 MiB written and read concurrently, byte-exact.
    let total = 8 << 20;
    let (mut r, mut w) = s.into_split();
    let t0 = Instant::now();
    let writer = tokio::spawn(async move {
        let data: Vec<u8> = (0..total).map(pattern).collect();
        for chunk in data.chunks(100_000) {
            w.write_all(chunk).await.unwrap();
        }
        w
    });
    let mut got = vec![0u8; total];
    tokio::time::timeout(Duration::from_secs(20), r.read_exact(&mut got))
        .await
        .expect("bulk echo timed out")
        .unwrap();
    let bulk = t0.elapsed();
    assert!(
        got.iter().enumerate().all(|(i, &b)| b == pattern(i)),
        "bulk data corrupted"
    );
    let mut s = r.reunite(writer.await.unwrap()).unwrap();

    // Many small messages, pipelined: 20k x 40 bytes.
    let n = 20_000;
    let msg = [7u8; 40];
    let t0 = Instant::now();
    let (mut r, mut w) = s.split();
    let write = async {
        for _ in 0..n {
            w.write_all(&msg).await.unwrap();
        }
    };
    let read = async {
        let mut back = vec![0u8; n * msg.len()];
        r.read_exact(&mut back).await.unwrap();
        assert!(back.iter().all(|&b| b == 7));
    };
    tokio::time::timeout(Duration::from_secs(20), async { tokio::join!(write, read) })
        .await
        .expect("small messages timed out");
    let small = t0.elapsed();
    eprintln!("proxy: 8 MiB echoed in {bulk:?}, {n} small messages in {small:?}");
    assert!(small < Duration::from_secs(5), "{small:?}");

    // Several concurrent connections.
    let mut conns = Vec::new();
    for _ in 0..5 {
        conns.push(connect(proxy.port()).await);
    }
    for (i, c) in conns.iter_mut().enumerate() {
        roundtrip(c, format!("conn {i}").as_bytes()).await;
    }
    assert_eq!(proxy.accepted(), 6);
    assert_eq!(proxy.open(), 6);

    // Half-close is forwarded: shutdown(Write) on the client → the echo
    // server sees EOF, closes, and the client reads EOF.
    s.shutdown().await.unwrap();
    assert!(closed_within(&mut s, Duration::from_secs(2)).await);
    drop(s);
    drop(conns);
    assert!(
        crate::support::wait_until(Duration::from_secs(2), || async { proxy.open() == 0 }).await,
        "open = {}",
        proxy.open()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_stall_then_pass() {
    let echo = echo_server().await;
    let proxy = Proxy::start(echo);
    let mut s = connect(proxy.port()).await;
    roundtrip(&mut s, b"before").await;

    proxy.stall();
    s.write_all(b"held").await.unwrap();
    let mut buf = [0u8; 4];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), s.read_exact(&mut buf))
            .await
            .is_err(),
        "echo arrived while stalled"
    );
    // New connections are accepted but stalled too.
    let mut s2 = connect(proxy.port()).await;
    s2.write_all(b"new").await.unwrap();
    let mut buf2 = [0u8; 3];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), s2.read_exact(&mut buf2))
            .await
            .is_err(),
        "echo arrived on a new connection while stalled"
    );
    assert_eq!(proxy.accepted(), 2);
    assert_eq!(proxy.open(), 2);

    proxy.pass();
    tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut buf))
        .await
        .expect("held data not delivered after pass")
        .unwrap();
    assert_eq!(&buf, b"held");
    tokio::time::timeout(Duration::from_secs(2), s2.read_exact(&mut buf2))
        .await
        .expect("new connection not resumed after pass")
        .unwrap();
    assert_eq!(&buf2, b"new");
    roundtrip(&mut s, b"after").await;

    // Mid-stream: a writer streams continuously; stall must stop the echo
    // quickly, and pass must deliver everything intact.
    let total = 16 << 20;
    let (mut r, mut w) = s.into_split();
    let written = Arc::new(AtomicUsize::new(0));
    let wr = Arc::clone(&written);
    let writer = tokio::spawn(async move {
        let mut i = 0;
        let mut chunk = vec![0u8; 16 * 1024];
        while i < total {
            let n = chunk.len().min(total - i);
            for (k, b) in chunk[..n].iter_mut().enumerate() {
                *b = pattern(i + k);
            }
            w.write_all(&chunk[..n]).await.unwrap();
            i += n;
            wr.store(i, Ordering::SeqCst);
            // Throttle a little so the stream lasts a while.
            tokio::time::sleep(Duration::from_micros(200)).await;
        }
    });
    let read_count = Arc::new(AtomicUsize::new(0));
    let rc = Arc::clone(&read_count);
    let reader = tokio::spawn(async move {
        let mut buf = vec![0u8; 64 * 1024];
        let mut pos = 0;
        while pos < total {
            let n = r.read(&mut buf).await.unwrap();
            assert!(n > 0, "unexpected EOF at {pos}");
            for (k, &b) in buf[..n].iter().enumerate() {
                assert_eq!(b, pattern(pos + k), "corrupted at {}", pos + k);
            }
            pos += n;
            rc.store(pos, Ordering::SeqCst);
        }
    });
    assert!(
        crate::support::wait_until(Duration::from_secs(5), || async {
            read_count.load(Ordering::SeqCst) > 1 << 20
        })
        .await,
        "stream did not start"
    );
    proxy.stall();
    // Bytes already on the wire may still arrive; after 100 ms nothing moves.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let frozen = read_count.load(Ordering::SeqCst);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        read_count.load(Ordering::SeqCst),
        frozen,
        "data moved while stalled"
    );
    assert!(frozen < total, "stream finished before the stall");
    eprintln!(
        "proxy: stalled at {frozen} bytes read, {} written",
        written.load(Ordering::SeqCst)
    );
    proxy.pass();
    tokio::time::timeout(Duration::from_secs(30), reader)
        .await
        .expect("stream did not finish after pass")
        .unwrap();
    writer.await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_cut() {
    let echo = echo_server().await;
    let proxy = Proxy::start(echo);
    let mut a = connect(proxy.port()).await;
    let mut b = connect(proxy.port()).await;
    roundtrip(&mut a, b"a").await;
    roundtrip(&mut b, b"b").await;
    assert_eq!(proxy.open(), 2);

    proxy.cut();
    assert_eq!(proxy.open(), 0);
    assert!(closed_within(&mut a, Duration::from_secs(1)).await);
    assert!(closed_within(&mut b, Duration::from_secs(1)).await);

    let mut c = connect(proxy.port()).await;
    roundtrip(&mut c, b"after cut").await;
    assert_eq!(proxy.accepted(), 3);
    assert_eq!(proxy.open(), 1);

    // Cutting a stalled connection works too, and new ones stay stalled.
    proxy.stall();
    proxy.cut();
    assert!(closed_within(&mut c, Duration::from_secs(1)).await);
    let mut d = connect(proxy.port()).await;
    d.write_all(b"d").await.unwrap();
    let mut buf = [0u8; 1];
    assert!(
        tokio::time::timeout(Duration::from_millis(300), d.read_exact(&mut buf))
            .await
            .is_err()
    );
    proxy.pass();
    tokio::time::timeout(Duration::from_secs(2), d.read_exact(&mut buf))
        .await
        .expect("stalled connection not resumed")
        .unwrap();
    assert_eq!(&buf, b"d");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_refuse_then_pass() {
    let echo = echo_server().await;
    let proxy = Proxy::start(echo);
    let mut old = connect(proxy.port()).await;
    roundtrip(&mut old, b"old").await;

    proxy.refuse();
    assert!(
        closed_within(&mut old, Duration::from_secs(1)).await,
        "existing connection not cut by refuse()"
    );
    for _ in 0..3 {
        // The kernel completes the handshake; the proxy resets at once.
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", proxy.port())).await {
            let t0 = Instant::now();
            let _ = s.write_all(b"x").await;
            assert!(closed_within(&mut s, Duration::from_secs(1)).await);
            assert!(t0.elapsed() < Duration::from_millis(500));
        }
    }
    assert!(
        crate::support::wait_until(Duration::from_secs(1), || async { proxy.accepted() == 4 })
            .await,
        "accepted = {}",
        proxy.accepted()
    );
    assert_eq!(proxy.open(), 0);

    proxy.pass();
    let mut s = connect(proxy.port()).await;
    roundtrip(&mut s, b"restored").await;
    assert_eq!(proxy.open(), 1);
}

/// The proxy keeps forwarding while the test thread blocks in sync code on a
/// current-thread runtime.
#[tokio::test]
async fn proxy_works_while_test_blocks() {
    let echo = echo_server().await;
    let proxy = Proxy::start(echo);
    let port = proxy.port();
    // Blocking client on the (single) test thread, so the echo server must
    // not live on this runtime: use a std echo thread.
    let std_echo = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let std_port = std_echo.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let (mut s, _) = std_echo.accept().unwrap();
        let mut r = s.try_clone().unwrap();
        let _ = std::io::copy(&mut r, &mut s);
    });
    let proxy2 = Proxy::start(std_port);
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", proxy2.port())).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.write_all(b"blocking").unwrap();
        let mut back = [0u8; 8];
        c.read_exact(&mut back).unwrap();
        assert_eq!(&back, b"blocking");
        proxy2.stall();
        c.write_all(b"zz").unwrap();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .unwrap();
        assert!(c.read_exact(&mut back[..2]).is_err());
        proxy2.pass();
        c.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        c.read_exact(&mut back[..2]).unwrap();
        assert_eq!(&back[..2], b"zz");
    }
    drop(proxy2);
    // The first proxy is still fine after the other one was dropped.
    let mut s = connect(port).await;
    roundtrip(&mut s, b"still here").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_postgres_cut_and_stall() {
    let pg = Postgres::shared();
    let proxy = Proxy::start(pg.port());
    let url = format!("postgres://postgres@127.0.0.1:{}/postgres", proxy.port());

    let client = Postgres::client_url(&url).await.unwrap();
    let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    assert_eq!(proxy.open(), 1);

    // Stall: a query hangs, then completes after pass().
    proxy.stall();
    let q = tokio::spawn(async move {
        let v: i32 = client.query_one("SELECT 2", &[]).await.unwrap().get(0);
        (client, v)
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!q.is_finished(), "query completed while stalled");
    proxy.pass();
    let (client, two) = tokio::time::timeout(Duration::from_secs(5), q)
        .await
        .expect("query did not complete after pass")
        .unwrap();
    assert_eq!(two, 2);

    // Cut: the next query fails; a new connection works.
    proxy.cut();
    let err = tokio::time::timeout(Duration::from_secs(5), client.query_one("SELECT 1", &[]))
        .await
        .expect("query after cut hung")
        .expect_err("query after cut succeeded");
    eprintln!("proxy: query after cut: {err}");
    assert!(client.is_closed());

    let client = Postgres::client_url(&url).await.unwrap();
    let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
    assert_eq!(proxy.accepted(), 2);

    // Refuse: connecting fails; pass() restores.
    proxy.refuse();
    assert!(client.query_one("SELECT 1", &[]).await.is_err());
    assert!(Postgres::client_url(&url).await.is_err());
    proxy.pass();
    let client = Postgres::client_url(&url).await.unwrap();
    let one: i32 = client.query_one("SELECT 1", &[]).await.unwrap().get(0);
    assert_eq!(one, 1);
}
