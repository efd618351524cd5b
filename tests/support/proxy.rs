//! In-process TCP fault-injection proxy.
//!
//! [`Proxy::start`] listens on `127.0.0.1:<free port>` and forwards every
//! accepted connection to `127.0.0.1:<target port>`. The proxy runs on its own
//! background thread with its own (current-thread) tokio runtime, so it keeps
//! forwarding while the test blocks in synchronous code (`std::process::Command`,
//! `std::thread::sleep`, a blocked current-thread test runtime, ...). All
//! control methods are synchronous and callable from any thread or runtime.
//!
//! Faults:
//! * [`Proxy::stall`]: black hole. No bytes (and no EOF) are forwarded in
//!   either direction; sockets stay open, so peers see silence. Data already
//!   read by the proxy is held, data not yet read stays in the kernel buffers
//!   (senders eventually block, like over a partitioned network). New
//!   connections are accepted, but the upstream connection is only opened once
//!   the proxy passes again. [`Proxy::pass`] resumes every connection intact.
//! * [`Proxy::cut`]: every current connection is closed abruptly on both sides
//!   (`SO_LINGER` 0, so the peers get an RST). New connections are accepted
//!   in the current mode.
//! * [`Proxy::refuse`]: cut, and every new connection is accepted and
//!   immediately reset, until [`Proxy::pass`] (or [`Proxy::stall`]).
//!
//! Forwarding uses 64 KiB buffers per direction and `TCP_NODELAY` on both
//! sockets; it checks the mode before every read and write (and wakes up on
//! every mode change), so a stall takes effect immediately, even mid-stream.
//! An EOF from one side is forwarded as a half-close (`shutdown(Write)`); a
//! read/write error on one side resets the other side too.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{ReadHalf, WriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// Per-direction forwarding buffer.
const BUF_SIZE: usize = 64 * 1024;

/// How long `cut()` / `refuse()` / `Drop` wait for connections to be closed.
const CLOSE_WAIT: Duration = Duration::from_secs(2);

/// Forwarding mode of a [`Proxy`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward normally.
    Pass,
    /// Forward nothing, keep sockets open.
    Stall,
    /// Reset new connections at once.
    Refuse,
}

#[derive(Debug, Clone, Copy)]
struct State {
    mode: Mode,
    /// Bumped by every cut; a connection dies when this differs from the
    /// value it was accepted under.
    epoch: u64,
    shutdown: bool,
}

#[derive(Debug)]
struct Shared {
    state: watch::Sender<State>,
    accepted: AtomicUsize,
    next_id: AtomicU64,
    /// Live connections: id -> epoch they were accepted under.
    conns: Mutex<HashMap<u64, u64>>,
}

impl Shared {
    fn conns(&self) -> std::sync::MutexGuard<'_, HashMap<u64, u64>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Live connections accepted under an epoch older than `epoch`.
    fn older_than(&self, epoch: u64) -> usize {
        self.conns().values().filter(|&&e| e < epoch).count()
    }

    /// Block (briefly) until no connection older than `epoch` is left.
    fn wait_closed(&self, epoch: u64) {
        let deadline = Instant::now() + CLOSE_WAIT;
        while self.older_than(epoch) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

/// A TCP fault-injection proxy in front of `127.0.0.1:target_port`. Stops
/// listening and resets every connection on Drop.
#[derive(Debug)]
pub struct Proxy {
    port: u16,
    target_port: u16,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listens on 127.0.0.1:<free port> (bound before returning, so clients
    /// may connect at once) and forwards every accepted connection to
    /// 127.0.0.1:target_port. Starts in [`Mode::Pass`].
    pub fn start(target_port: u16) -> Proxy {
        let listener =
            std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).expect("proxy: bind 127.0.0.1:0");
        listener
            .set_nonblocking(true)
            .expect("proxy: set_nonblocking");
        let port = listener.local_addr().expect("proxy: local_addr").port();
        let (state, _) = watch::channel(State {
            mode: Mode::Pass,
            epoch: 0,
            shutdown: false,
        });
        let shared = Arc::new(Shared {
            state,
            accepted: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            conns: Mutex::new(HashMap::new()),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("proxy: build runtime");
        let target = SocketAddr::from((Ipv4Addr::LOCALHOST, target_port));
        let sh = Arc::clone(&shared);
        let thread = std::thread::Builder::new()
            .name(format!("proxy-{port}"))
            .spawn(move || {
                runtime.block_on(async move {
                    let listener = TcpListener::from_std(listener).expect("proxy: from_std");
                    accept_loop(listener, target, Arc::clone(&sh)).await;
                    // Give the connection tasks a moment to reset their sockets.
                    let deadline = Instant::now() + CLOSE_WAIT;
                    while !sh.conns().is_empty() && Instant::now() < deadline {
                        tokio::time::sleep(Duration::from_millis(1)).await;
                    }
                });
                // Dropping the runtime drops any remaining tasks and sockets.
                drop(runtime);
            })
            .expect("proxy: spawn thread");
        Proxy {
            port,
            target_port,
            shared,
            thread: Some(thread),
        }
    }

    /// The port the proxy listens on (127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The port the proxy forwards to (127.0.0.1).
    pub fn target_port(&self) -> u16 {
        self.target_port
    }

    /// Current mode.
    pub fn mode(&self) -> Mode {
        self.shared.state.borrow().mode
    }

    /// Forward normally (the default). Resumes stalled connections intact and
    /// ends [`Proxy::refuse`].
    pub fn pass(&self) {
        self.set_mode(Mode::Pass);
    }

    /// Black hole: stop forwarding bytes in both directions on existing and
    /// new connections, keeping the sockets open (peers see silence, not
    /// EOF). New connections are accepted but stalled too. Takes effect
    /// immediately; undone by [`Proxy::pass`].
    pub fn stall(&self) {
        self.set_mode(Mode::Stall);
    }

    /// Close every current connection abruptly on both sides (RST via
    /// `SO_LINGER` 0) and keep accepting new ones in the current mode.
    /// Returns once the connections are closed (at most ~2 s).
    pub fn cut(&self) {
        let epoch = self.bump(None);
        self.shared.wait_closed(epoch);
    }

    /// Reset new connections right after accepting them, until
    /// [`Proxy::pass`]; existing connections are cut too (see [`Proxy::cut`]).
    pub fn refuse(&self) {
        let epoch = self.bump(Some(Mode::Refuse));
        self.shared.wait_closed(epoch);
    }

    /// Number of connections accepted so far (including refused ones).
    pub fn accepted(&self) -> usize {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Number of connections currently open (stalled ones included).
    pub fn open(&self) -> usize {
        self.shared.conns().len()
    }

    fn set_mode(&self, mode: Mode) {
        self.shared.state.send_modify(|s| s.mode = mode);
    }

    /// Start a new epoch (cutting every older connection), optionally
    /// switching mode at the same time. Returns the new epoch.
    fn bump(&self, mode: Option<Mode>) -> u64 {
        let mut epoch = 0;
        self.shared.state.send_modify(|s| {
            s.epoch += 1;
            epoch = s.epoch;
            if let Some(m) = mode {
                s.mode = m;
            }
        });
        epoch
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.state.send_modify(|s| {
            s.shutdown = true;
            s.epoch += 1;
        });
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn accept_loop(listener: TcpListener, target: SocketAddr, shared: Arc<Shared>) {
    let mut rx = shared.state.subscribe();
    loop {
        if rx.borrow_and_update().shutdown {
            return;
        }
        let accepted = tokio::select! {
            biased;
            changed = rx.changed() => {
                if changed.is_err() {
                    return;
                }
                continue;
            }
            r = listener.accept() => r,
        };
        let stream = match accepted {
            Ok((s, _)) => s,
            Err(_) => {
                // E.g. EMFILE or a connection reset before accept: back off.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        // Register under the lock, reading the epoch while holding it, so a
        // concurrent cut() either sees this connection or it sees the cut.
        let registered = {
            let mut conns = shared.conns();
            let st = *shared.state.borrow();
            if st.mode == Mode::Refuse || st.shutdown {
                None
            } else {
                let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
                conns.insert(id, st.epoch);
                Some((id, st.epoch))
            }
        };
        let Some((id, epoch)) = registered else {
            reset(&stream);
            drop(stream);
            continue;
        };
        let conn_rx = shared.state.subscribe();
        let sh = Arc::clone(&shared);
        tokio::spawn(async move {
            serve(stream, target, conn_rx, epoch).await;
            sh.conns().remove(&id);
        });
    }
}

/// Set `SO_LINGER` 0 so that closing the socket sends an RST.
fn reset(stream: &TcpStream) {
    let _ = stream.set_zero_linger();
}

/// Wait until the proxy passes traffic. False if this connection must die
/// (cut, refuse or shutdown).
async fn wait_pass(rx: &mut watch::Receiver<State>, epoch: u64) -> bool {
    loop {
        let st = *rx.borrow_and_update();
        if st.shutdown || st.epoch != epoch {
            return false;
        }
        match st.mode {
            Mode::Pass => return true,
            Mode::Stall => {}
            // refuse() always bumps the epoch, so this is not reached for
            // live connections; treat it as a cut anyway.
            Mode::Refuse => return false,
        }
        if rx.changed().await.is_err() {
            return false;
        }
    }
}

/// Resolves once this connection must die.
async fn wait_dead(rx: &mut watch::Receiver<State>, epoch: u64) {
    loop {
        let st = *rx.borrow_and_update();
        if st.shutdown || st.epoch != epoch {
            return;
        }
        if rx.changed().await.is_err() {
            return;
        }
    }
}

async fn serve(
    mut client: TcpStream,
    target: SocketAddr,
    mut rx: watch::Receiver<State>,
    epoch: u64,
) {
    let _ = client.set_nodelay(true);
    // Connect upstream only when passing: a stalled network does not let the
    // SYN through either.
    let upstream = if wait_pass(&mut rx, epoch).await {
        tokio::select! {
            biased;
            _ = wait_dead(&mut rx, epoch) => None,
            r = TcpStream::connect(target) => r.ok(),
        }
    } else {
        None
    };
    let Some(mut upstream) = upstream else {
        reset(&client);
        return;
    };
    let _ = upstream.set_nodelay(true);
    let clean = {
        let (cr, cw) = client.split();
        let (ur, uw) = upstream.split();
        let up = pump(cr, uw, rx.clone(), epoch);
        let down = pump(ur, cw, rx, epoch);
        tokio::pin!(up, down);
        let (mut up_done, mut down_done) = (false, false);
        loop {
            let end = tokio::select! {
                e = &mut up, if !up_done => { up_done = true; e }
                e = &mut down, if !down_done => { down_done = true; e }
            };
            match end {
                End::Abort => break false,
                End::Eof if up_done && down_done => break true,
                End::Eof => {}
            }
        }
    };
    if !clean {
        reset(&client);
        reset(&upstream);
    }
}

/// How one direction of a connection ended.
enum End {
    /// EOF read and forwarded as a half-close.
    Eof,
    /// Error, cut or shutdown: reset the whole connection.
    Abort,
}

/// Forward `src` to `dst` until EOF, error or cut, honoring the mode before
/// every read and write.
async fn pump(
    mut src: ReadHalf<'_>,
    mut dst: WriteHalf<'_>,
    mut rx: watch::Receiver<State>,
    epoch: u64,
) -> End {
    let mut buf = vec![0u8; BUF_SIZE];
    loop {
        if !wait_pass(&mut rx, epoch).await {
            return End::Abort;
        }
        // `biased`: a pending mode change wins over ready data.
        let n = tokio::select! {
            biased;
            changed = rx.changed() => {
                if changed.is_err() {
                    return End::Abort;
                }
                continue;
            }
            r = src.read(&mut buf) => match r {
                Ok(0) => break,
                Ok(n) => n,
                Err(_) => return End::Abort,
            },
        };
        let mut off = 0;
        while off < n {
            if !wait_pass(&mut rx, epoch).await {
                return End::Abort;
            }
            tokio::select! {
                biased;
                changed = rx.changed() => {
                    if changed.is_err() {
                        return End::Abort;
                    }
                }
                w = dst.write(&buf[off..n]) => match w {
                    Ok(0) | Err(_) => return End::Abort,
                    Ok(k) => off += k,
                },
            }
        }
    }
    // EOF: forward it as a half-close once passing.
    if !wait_pass(&mut rx, epoch).await {
        return End::Abort;
    }
    let _ = dst.shutdown().await;
    End::Eof
}
