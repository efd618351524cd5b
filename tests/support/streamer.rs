//! Spawning the `pgoutbox` binary under test.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// A running `pgoutbox` process. stdout+stderr go to `log_path()` in a
/// private temp dir. Inherited `PGOUTBOX_*` variables (except
/// `PGOUTBOX_TEST_*`) are removed so tests are hermetic, and `PGOUTBOX_HTTP_ADDR=off`
/// unless the caller's env list or `--http-addr` says otherwise; `RUST_LOG=info` unless
/// the caller's env list or the test environment sets it. Killed on Drop.
#[derive(Debug)]
pub struct Streamer {
    child: Mutex<Child>,
    pid: u32,
    dir: tempfile::TempDir,
    log_path: PathBuf,
}

impl Streamer {
    /// Spawn `pgoutbox ARGS` with extra environment `env`. `PGOUTBOX_TEST_BIN` names
    /// another binary to run instead (to see a new test fail on an older build).
    pub fn spawn<A, K, V>(args: &[A], env: &[(K, V)]) -> Streamer
    where
        A: AsRef<std::ffi::OsStr>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let program = std::env::var("PGOUTBOX_TEST_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_pgoutbox").to_owned());
        Streamer::spawn_program(&program, args, env)
    }

    /// Spawn an arbitrary program the same way (handy for tests of the harness).
    pub fn spawn_program<A, K, V>(program: &str, args: &[A], env: &[(K, V)]) -> Streamer
    where
        A: AsRef<std::ffi::OsStr>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let dir = tempfile::Builder::new()
            .prefix("pgoutbox-streamer-")
            .tempdir()
            .expect("temp dir");
        let log_path = dir.path().join("pgoutbox.log");
        let out = std::fs::File::create(&log_path).expect("create log");
        let err = out.try_clone().expect("clone log fd");
        Streamer::spawn_in(dir, log_path, program, args, env, out.into(), err.into())
    }

    /// Spawn `pgoutbox ARGS` like [`Streamer::spawn`], but with stderr a pipe whose read end
    /// is returned: while nobody reads it, a write to stderr waits once the pipe holds
    /// 64 KiB. stdout still goes to `log_path()`.
    pub fn spawn_with_stderr_pipe<A, K, V>(
        args: &[A],
        env: &[(K, V)],
    ) -> (Streamer, std::process::ChildStderr)
    where
        A: AsRef<std::ffi::OsStr>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let program = std::env::var("PGOUTBOX_TEST_BIN")
            .unwrap_or_else(|_| env!("CARGO_BIN_EXE_pgoutbox").to_owned());
        let dir = tempfile::Builder::new()
            .prefix("pgoutbox-streamer-")
            .tempdir()
            .expect("temp dir");
        let log_path = dir.path().join("pgoutbox.log");
        let out = std::fs::File::create(&log_path).expect("create log");
        let streamer = Streamer::spawn_in(
            dir,
            log_path,
            &program,
            args,
            env,
            out.into(),
            Stdio::piped(),
        );
        let stderr = streamer
            .child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .stderr
            .take()
            .expect("piped stderr");
        (streamer, stderr)
    }

    fn spawn_in<A, K, V>(
        dir: tempfile::TempDir,
        log_path: PathBuf,
        program: &str,
        args: &[A],
        env: &[(K, V)],
        out: Stdio,
        err: Stdio,
    ) -> Streamer
    where
        A: AsRef<std::ffi::OsStr>,
        K: AsRef<std::ffi::OsStr>,
        V: AsRef<std::ffi::OsStr>,
    {
        let mut cmd = Command::new(program);
        for (k, _) in std::env::vars_os() {
            let ks = k.to_string_lossy();
            if ks.starts_with("PGOUTBOX_") && !ks.starts_with("PGOUTBOX_TEST_") {
                cmd.env_remove(&k);
            }
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        cmd.env("NO_COLOR", "1");
        // Many streamers run at once: the default metrics address would collide. Tests that
        // scrape pass their own --http-addr (or PGOUTBOX_HTTP_ADDR in `env`).
        cmd.env("PGOUTBOX_HTTP_ADDR", "off");
        cmd.args(args)
            .envs(env.iter().map(|(k, v)| (k.as_ref(), v.as_ref())))
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err);
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"));
        let pid = child.id();
        Streamer {
            child: Mutex::new(child),
            pid,
            dir,
            log_path,
        }
    }

    /// OS process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// Private temp dir (the process's working directory).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Path of the combined stdout/stderr log.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// SIGKILL and reap (no-op if already exited).
    pub fn kill9(&self) {
        let mut c = self.child.lock().unwrap_or_else(|e| e.into_inner());
        if c.try_wait().ok().flatten().is_none() {
            let _ = c.kill();
        }
        let _ = c.wait();
    }

    /// Send SIGTERM (via the `kill` command). Does not wait.
    pub fn sigterm(&self) {
        self.signal("TERM");
    }

    /// Send SIGINT. Does not wait.
    pub fn sigint(&self) {
        self.signal("INT");
    }

    /// Send a signal by name (`TERM`, `INT`, `HUP`, `STOP`, `CONT`…) unless
    /// the process has already exited.
    pub fn signal(&self, name: &str) {
        if self.try_status().is_some() {
            return;
        }
        let _ = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid.to_string())
            .status();
    }

    /// Exit status if the process has exited (reaps it), else None.
    pub fn try_status(&self) -> Option<ExitStatus> {
        self.child
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .try_wait()
            .ok()
            .flatten()
    }

    /// Wait (async, polling every 50 ms) up to `timeout` for the process to exit.
    pub async fn wait_exit(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Blocking variant of [`Streamer::wait_exit`].
    pub fn wait_exit_blocking(&self, timeout: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_status() {
                return Some(s);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// SIGTERM, then waits up to `timeout` for the exit and returns its status; panics,
    /// showing the log, when the process is still running by then.
    pub async fn stop(&self, timeout: Duration) -> ExitStatus {
        self.sigterm();
        match self.wait_exit(timeout).await {
            Some(status) => status,
            None => panic!(
                "pgoutbox (pid {}) still running {timeout:?} after SIGTERM:\n{}",
                self.pid,
                self.log()
            ),
        }
    }

    /// Like [`Streamer::stop`], and the exit must be clean (status 0); panics with the log
    /// otherwise.
    pub async fn stop_ok(&self, timeout: Duration) {
        let status = self.stop(timeout).await;
        assert!(
            status.success(),
            "pgoutbox (pid {}) exited {status} after SIGTERM, not 0:\n{}",
            self.pid,
            self.log()
        );
    }

    /// Everything logged so far.
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    /// Number of occurrences of `pattern` (plain substring) in the log.
    pub fn log_count(&self, pattern: &str) -> usize {
        self.log().matches(pattern).count()
    }

    /// Wait (async) until the log contains `pattern` (plain substring).
    pub async fn wait_for_log(&self, pattern: &str, timeout: Duration) -> bool {
        super::wait_until(timeout, || async { self.log().contains(pattern) }).await
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        self.kill9();
        if std::thread::panicking() {
            eprintln!(
                "----- pgoutbox log (pid {}) -----\n{}\n----- end pgoutbox log -----",
                self.pid,
                self.log()
            );
        }
    }
}
