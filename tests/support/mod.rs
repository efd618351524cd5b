//! Integration-test harness for pgoutbox.
//!
//! Starts throwaway PostgreSQL clusters and RabbitMQ nodes from Rust (no
//! dependency on `deploy/stack.sh`), spawns the `pgoutbox` binary, and offers
//! AMQP helpers. Everything lives in `/tmp/pgoutbox-*` directories that are
//! removed when the server is stopped.
//!
//! Lifetime rules:
//! * `Postgres::shared()` / `RabbitMq::shared()` start one server per test
//!   process, lazily. Statics are never dropped, so each server gets a
//!   *watchdog* shell process (in its own process group, so ^C does not kill
//!   it) that waits for the test process to disappear and then runs the
//!   server's `cleanup.sh`.
//! * `start_private()` servers are stopped on `Drop` (and also have a
//!   watchdog in case the test process is killed or aborts).
//!
//! * Under `deploy/test.sh` (cargo-nextest: one process per test), the shared
//!   servers are shared by every process of the run instead: the first process
//!   that needs one starts it, the others attach to it ([`run_shared`]), and it
//!   lives until the script exits (`PGOUTBOX_TEST_SHARED_DIR`,
//!   `PGOUTBOX_TEST_SHARED_OWNER`).
//!
//! Environment knobs:
//! * `PGOUTBOX_TEST_SCALE` multiplies durations/counts (default 1.0).
//! * `PGOUTBOX_PG_BIN_DIR` overrides the PostgreSQL bin directory.
//! * `PGOUTBOX_TEST_PG=14|15|16|17|18` picks the server's major version: the system's
//!   `/usr/lib/postgresql/N` when present, else the pinned npm build that
//!   `deploy/pg-version.sh N` installs into a cache (default: the system's newest).
//! * `PGOUTBOX_RABBITMQ_BIN_DIR` overrides the RabbitMQ scripts directory.
//! * `PGOUTBOX_TEST_KEEP=1` keeps server directories after stop (debugging).
#![allow(dead_code, unused_imports)]

pub mod amqp;
pub mod cli;
pub mod cluster;
pub mod fake_broker;
pub mod fixture;
pub mod pg_tls;
pub mod postgres;
pub mod proxy;
pub mod rabbit;
pub mod stream;
pub mod stream_reader;
pub mod streamer;
pub mod tls;

use std::collections::HashSet;
use std::future::Future;
use std::net::{TcpListener, TcpStream};
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

pub use amqp::{
    amqp_connect, declare_bound_queue, drain_queue, publish, purge_queue, queue_len, Received,
};
pub use fixture::{lsn, Outbox};
pub use pg_tls::TlsPostgres;
pub use postgres::Postgres;
pub use proxy::Proxy;
pub use rabbit::RabbitMq;
pub use stream::{
    declare_stream, publish_stream, read_stream, read_stream_url, StreamMessage, StreamPublish,
};
pub use streamer::Streamer;
pub use tls::TlsRabbit;

/// Scale factor for durations/counts, from `PGOUTBOX_TEST_SCALE` (default 1.0).
pub fn scale() -> f64 {
    std::env::var("PGOUTBOX_TEST_SCALE")
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|f| f.is_finite() && *f > 0.0)
        .unwrap_or(1.0)
}

/// `d * scale()`.
pub fn scaled(d: Duration) -> Duration {
    d.mul_f64(scale())
}

/// `n * scale()`, at least 1.
pub fn scaled_count(n: usize) -> usize {
    ((n as f64) * scale()).round().max(1.0) as usize
}

/// Lowercase unique identifier `<prefix>_<pid>_<counter>`, safe as a database,
/// slot, exchange or queue name (only `[a-z0-9_]`; prefix is sanitized).
pub fn unique(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let mut p: String = prefix
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect();
    if p.is_empty() || !p.starts_with(|c: char| c.is_ascii_lowercase()) {
        p.insert(0, 't');
    }
    // Keep well below NAMEDATALEN (63).
    p.truncate(40);
    format!("{p}_{}_{n}", std::process::id())
}

/// Poll `f` every 50 ms until it returns true (→ `true`) or `timeout` passes
/// (→ `false`, after one last check). Use this instead of sleeping.
pub async fn wait_until<F, Fut>(timeout: Duration, mut f: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if f().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Blocking variant of [`wait_until`] for synchronous code.
pub fn wait_until_blocking(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// True when running as root (effective uid 0), without libc.
pub fn is_root() -> bool {
    std::fs::metadata("/proc/self")
        .map(|m| m.uid() == 0)
        .unwrap_or(false)
}

/// The ports [`free_port`] and [`free_port_outside_ephemeral_range`] handed out.
static HANDED_OUT: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

/// A free TCP port on 127.0.0.1, never the same twice within this process.
pub fn free_port() -> u16 {
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let set = guard.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("bind 127.0.0.1:0");
        // Stay away from the Erlang "port + 20000" / "port + 10000" conventions
        // overflowing, and from ports we already gave out.
        if !(1024..=45000).contains(&port) || !set.insert(port) {
            continue;
        }
        return port;
    }
    panic!("could not find a free port");
}

/// A free TCP port on 127.0.0.1 below the kernel's ephemeral range
/// (`net.ipv4.ip_local_port_range`, from 10000 up), never the same twice within this process.
///
/// A port of [`free_port`] comes from the ephemeral range, where any outgoing connection may
/// take it as its local port while its server is down: a server restarted on such a port may
/// find it taken. Below the range only a listener binds a port, so a server that binds this one
/// again after a restart finds it free (unless a server of another test process picked the
/// same port, as with [`free_port`]: the pick is random over about 22,000 ports).
pub fn free_port_outside_ephemeral_range() -> u16 {
    use std::hash::{BuildHasher, Hasher};
    let low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse::<u16>().ok())
        .unwrap_or(32768);
    if low <= 11_000 {
        return free_port();
    }
    let mut guard = HANDED_OUT.lock().unwrap_or_else(|e| e.into_inner());
    let set = guard.get_or_insert_with(HashSet::new);
    for _ in 0..1000 {
        // RandomState is seeded afresh per process (and per call): a random port.
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        let port = 10_000 + (h.finish() % u64::from(low - 10_000)) as u16;
        if set.contains(&port) || TcpListener::bind(("127.0.0.1", port)).is_err() {
            continue;
        }
        set.insert(port);
        return port;
    }
    panic!("could not find a free port below {low}");
}

/// True if something accepts TCP connections on 127.0.0.1:port.
pub fn port_open(port: u16) -> bool {
    TcpStream::connect_timeout(
        &std::net::SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_millis(200),
    )
    .is_ok()
}

/// Create a persistent, short directory `/tmp/<prefix>XXXXXX` (short because of
/// the ~107-byte Unix socket path limit). Removal is the caller's job.
pub(crate) fn make_server_dir(prefix: &str) -> PathBuf {
    tempfile::Builder::new()
        .prefix(prefix)
        .tempdir_in("/tmp")
        .expect("create temp dir in /tmp")
        .keep()
}

/// Spawn a watchdog: a detached `sh` that waits until this test process exits
/// or `dir/.alive` disappears. If the test process died while `.alive` still
/// exists, it runs `dir/cleanup.sh` and removes `dir`.
///
/// Drop impls remove `.alive` first, then clean up themselves.
pub(crate) fn spawn_watchdog(dir: &Path) {
    let pid = WATCHED_PID
        .with(|w| w.get())
        .unwrap_or_else(std::process::id);
    let alive = dir.join(".alive");
    std::fs::write(&alive, b"").expect("write .alive");
    let keep = std::env::var("PGOUTBOX_TEST_KEEP").is_ok_and(|v| v == "1");
    let script = format!(
        r#"
while kill -0 {pid} 2>/dev/null && [ -e '{alive}' ]; do sleep 0.3; done
if [ -e '{alive}' ]; then
  sh '{dir}/cleanup.sh' >'{dir}/watchdog.log' 2>&1
  {rm}
fi
"#,
        alive = alive.display(),
        dir = dir.display(),
        rm = if keep {
            String::from("true")
        } else {
            format!("rm -rf '{}'", dir.display())
        },
    );
    // Double fork: the outer sh backgrounds the loop and exits at once (we reap
    // it), so the watchdog is re-parented and never becomes our zombie. Its
    // own process group keeps it safe from ^C aimed at `cargo test`.
    let status = Command::new("sh")
        .arg("-c")
        .arg(format!("( {script} ) </dev/null >/dev/null 2>&1 &"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .status()
        .expect("spawn watchdog");
    assert!(status.success(), "watchdog launcher failed: {status}");
}

/// Run a server's cleanup script now (used by Drop): marks it not alive so the
/// watchdog exits, runs `cleanup.sh`, removes the directory.
pub(crate) fn cleanup_now(dir: &Path) {
    let _ = std::fs::remove_file(dir.join(".alive"));
    let _ = Command::new("sh")
        .arg(dir.join("cleanup.sh"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    if !std::env::var("PGOUTBOX_TEST_KEEP").is_ok_and(|v| v == "1") {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Single-quote `s` for sh.
pub(crate) fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Last `n` lines of a file (for panic messages).
pub(crate) fn tail(path: &Path, n: usize) -> String {
    let s = std::fs::read(path)
        .map(|b| String::from_utf8_lossy(&b).into_owned())
        .unwrap_or_default();
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

thread_local! {
    /// The PID whose exit stops the server being started on this thread (see
    /// [`spawn_watchdog`]): set by [`run_shared`] to the run's owner; `None` is this process.
    static WATCHED_PID: std::cell::Cell<Option<u32>> = const { std::cell::Cell::new(None) };
}

/// The directory where the test processes of one run share their servers, and the PID whose
/// exit ends them: `PGOUTBOX_TEST_SHARED_DIR` and `PGOUTBOX_TEST_SHARED_OWNER`, both set by
/// `deploy/test.sh`. `None` (a plain `cargo test`): each process has its own shared servers.
fn shared_run() -> Option<(PathBuf, u32)> {
    let dir = std::env::var_os("PGOUTBOX_TEST_SHARED_DIR")?;
    let owner = std::env::var("PGOUTBOX_TEST_SHARED_OWNER")
        .ok()?
        .parse()
        .ok()?;
    Some((PathBuf::from(dir), owner))
}

/// A shared server of the whole test run: started by `start` in the first process that asks
/// for `name`, described by `describe` (a few `key=value` lines) in
/// `$PGOUTBOX_TEST_SHARED_DIR/NAME.server`, and rebuilt from that text by `attach` in every
/// other process. Its watchdog waits for the run's owner (the script), not for the process
/// that happened to start it. Without a shared run ([`shared_run`]), just `start()`.
///
/// The first process takes `NAME.lock` (`mkdir` is atomic); the others wait for
/// `NAME.server` (written whole, then renamed), or fail at once when the starter left
/// `NAME.failed` (its start panicked).
pub(crate) fn run_shared<T>(
    name: &str,
    start: impl FnOnce() -> T,
    describe: impl FnOnce(&T) -> String,
    attach: impl FnOnce(&str) -> T,
) -> T {
    let Some((dir, owner)) = shared_run() else {
        return start();
    };
    let ready = dir.join(format!("{name}.server"));
    let failed = dir.join(format!("{name}.failed"));
    if std::fs::create_dir(dir.join(format!("{name}.lock"))).is_ok() {
        /// Leaves `NAME.failed` behind when the start panics, and the thread's watched PID
        /// as it was.
        struct Starting(PathBuf, bool);
        impl Drop for Starting {
            fn drop(&mut self) {
                WATCHED_PID.with(|w| w.set(None));
                if !self.1 {
                    let _ = std::fs::write(&self.0, b"");
                }
            }
        }
        let mut starting = Starting(failed, false);
        WATCHED_PID.with(|w| w.set(Some(owner)));
        let server = start();
        let tmp = dir.join(format!("{name}.server.tmp"));
        std::fs::write(&tmp, describe(&server)).expect("write the shared server's description");
        std::fs::rename(&tmp, &ready).expect("publish the shared server's description");
        starting.1 = true;
        return server;
    }
    let deadline = Instant::now() + scaled(Duration::from_secs(300));
    loop {
        if let Ok(text) = std::fs::read_to_string(&ready) {
            return attach(&text);
        }
        assert!(
            !failed.exists(),
            "the shared {name} of this run failed to start in another test process (its output has the panic)"
        );
        assert!(
            Instant::now() < deadline,
            "the shared {name} of this run was not ready within 300 s ({})",
            ready.display()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The value of `key` in a [`run_shared`] description (`key=value` lines).
pub(crate) fn described<'a>(text: &'a str, key: &str) -> &'a str {
    text.lines()
        .find_map(|l| l.strip_prefix(key).and_then(|r| r.strip_prefix('=')))
        .unwrap_or_else(|| panic!("no {key} in the shared server's description:\n{text}"))
}

/// The example binary `name` (`target/debug/examples/NAME`), built once per test process
/// when it is older than this test binary (`cargo test --no-run`, as deploy/test.sh runs it,
/// builds the examples with the tests, so normally it is used as it is: a `cargo build` here
/// would wait for the target directory's lock while another cargo holds it).
pub fn example_binary(name: &str) -> PathBuf {
    static BUILT: Mutex<Vec<(String, PathBuf)>> = Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, path)) = built.iter().find(|(n, _)| n == name) {
        return path.clone();
    }
    let exe = std::env::current_exe().expect("current_exe");
    // target/debug/deps/main-HASH -> target/debug/examples/NAME
    let path = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target dir")
        .join("examples")
        .join(name);
    let modified = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let fresh = matches!((modified(&path), modified(&exe)), (Some(e), Some(t)) if e >= t);
    if !fresh {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut build = Command::new(cargo);
        // Without the CARGO_* variables cargo set for this test process: build scripts
        // track them, and would rebuild under other values.
        for (k, _) in std::env::vars_os() {
            let k = k.to_string_lossy().into_owned();
            if (k.starts_with("CARGO_") && k != "CARGO_HOME" && k != "CARGO_TARGET_DIR")
                || k == "OUT_DIR"
            {
                build.env_remove(k);
            }
        }
        let status = build
            .args(["build", "--example", name])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .status()
            .expect("run cargo build --example");
        assert!(status.success(), "cargo build --example {name} failed");
        assert!(path.exists(), "{} missing", path.display());
    }
    built.push((name.to_owned(), path.clone()));
    path
}
