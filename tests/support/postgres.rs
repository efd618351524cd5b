//! Throwaway PostgreSQL clusters (wal_level=logical) for integration tests.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::Duration;

use super::{cleanup_now, free_port, is_root, make_server_dir, sh_quote, spawn_watchdog, tail};

/// Roles created in every cluster. Password == role name. Each requires that
/// auth method (pg_hba lines come first), over TCP and the Unix socket.
pub const PASSWORD_ROLES: [(&str, &str); 3] = [
    ("pw_cleartext", "password"),
    ("pw_md5", "md5"),
    ("pw_scram", "scram-sha-256"),
];

/// Role with LOGIN but without REPLICATION (trust auth), for error tests.
pub const NOREPL_ROLE: &str = "norepl";

/// A PostgreSQL cluster in `/tmp/pgoutbox-pg-XXXXXX`:
/// `data/` (PGDATA), `postgres.log`, Unix socket in the directory itself.
///
/// Superuser is `postgres` (trust). Also has roles `pw_cleartext`, `pw_md5`,
/// `pw_scram` (LOGIN REPLICATION, password = name, password auth required) and
/// `norepl` (LOGIN, no REPLICATION, trust).
#[derive(Debug)]
pub struct Postgres {
    root: PathBuf,
    bin: PathBuf,
    port: u16,
    private: bool,
}

static SHARED: OnceLock<Postgres> = OnceLock::new();

impl Postgres {
    /// The per-process shared cluster (started lazily, thread-safe; stopped by
    /// a watchdog when the test process exits). Prefer a fresh database per
    /// test via [`Postgres::create_database`].
    pub fn shared() -> &'static Postgres {
        SHARED.get_or_init(|| {
            super::run_shared(
                "postgres",
                || Postgres::start_new(&[], false),
                Postgres::describe,
                Postgres::attach,
            )
        })
    }

    /// This cluster as `key=value` lines, for [`Postgres::attach`] in another test process.
    pub(crate) fn describe(&self) -> String {
        format!(
            "root={}\nbin={}\nport={}\n",
            self.root.display(),
            self.bin.display(),
            self.port
        )
    }

    /// A handle on a running cluster that [`Postgres::describe`] described, not stopped
    /// when dropped.
    pub(crate) fn attach(text: &str) -> Postgres {
        Postgres {
            root: super::described(text, "root").into(),
            bin: super::described(text, "bin").into(),
            port: super::described(text, "port").parse().expect("port"),
            private: false,
        }
    }

    /// A private cluster with extra `postgresql.conf` settings (appended last,
    /// so they override the defaults). Stopped (fast, then immediate) on Drop.
    pub fn start_private(extra_conf: &[(&str, &str)]) -> Postgres {
        Postgres::start_new(extra_conf, true)
    }

    fn start_new(extra_conf: &[(&str, &str)], private: bool) -> Postgres {
        let t0 = std::time::Instant::now();
        let bin = find_bin_dir();
        let root = make_server_dir("pgoutbox-pg-");
        let port = free_port();
        let pg = Postgres {
            root,
            bin,
            port,
            private,
        };
        pg.write_cleanup_script();
        spawn_watchdog(&pg.root);
        if is_root() {
            run_ok(
                Command::new("chown")
                    .arg("-R")
                    .arg("postgres:")
                    .arg(&pg.root),
            );
        }
        let out = pg
            .pg_cmd("initdb")
            .arg("-D")
            .arg(pg.data_dir())
            .args([
                "-U",
                "postgres",
                "--auth=trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .output()
            .expect("spawn initdb");
        if !out.status.success() {
            panic!(
                "initdb failed: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        // Every outbox a test makes on the shared cluster keeps its slot until the run ends:
        // 479 tests made more than 128 (CI, 2026-12-06: six setups refused with "no free
        // replication slot"), so the bound has room for several times that.
        let mut conf = format!(
            "\n# --- pgoutbox test harness ---\n\
             port = {port}\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{sock}'\n\
             wal_level = logical\n\
             max_replication_slots = 512\n\
             max_wal_senders = 64\n\
             max_connections = 200\n\
             fsync = off\n\
             synchronous_commit = off\n\
             full_page_writes = off\n\
             log_line_prefix = '%m [%p] %q%u@%d '\n\
             log_connections = off\n",
            sock = pg.root.display(),
        );
        for (k, v) in extra_conf {
            conf.push_str(&format!("{k} = '{}'\n", v.replace('\'', "''")));
        }
        append(&pg.data_dir().join("postgresql.conf"), &conf);
        let mut hba = String::from("# TYPE DATABASE USER ADDRESS METHOD\n");
        for (user, method) in PASSWORD_ROLES {
            for db in ["all", "replication"] {
                hba.push_str(&format!("local {db} {user} {method}\n"));
                hba.push_str(&format!("host {db} {user} 127.0.0.1/32 {method}\n"));
                hba.push_str(&format!("host {db} {user} ::1/128 {method}\n"));
            }
        }
        for db in ["all", "replication"] {
            hba.push_str(&format!("local {db} all trust\n"));
            hba.push_str(&format!("host {db} all 127.0.0.1/32 trust\n"));
            hba.push_str(&format!("host {db} all ::1/128 trust\n"));
        }
        std::fs::write(pg.data_dir().join("pg_hba.conf"), hba).expect("write pg_hba.conf");
        pg.start();
        pg.psql(
            "postgres",
            "SET password_encryption = 'md5'; \
             CREATE ROLE pw_md5 LOGIN REPLICATION PASSWORD 'pw_md5'; \
             SET password_encryption = 'scram-sha-256'; \
             CREATE ROLE pw_scram LOGIN REPLICATION PASSWORD 'pw_scram'; \
             CREATE ROLE pw_cleartext LOGIN REPLICATION PASSWORD 'pw_cleartext'; \
             CREATE ROLE norepl LOGIN;",
        );
        let version = pg.server_version_num();
        if let Some(major) = requested_major() {
            assert_eq!(
                version / 10000,
                major,
                "PGOUTBOX_TEST_PG={major} but {} runs server_version_num {version}",
                pg.bin.display()
            );
        }
        eprintln!(
            "[harness] postgres {version} {} on port {} ready in {:.1?} ({})",
            if private { "private" } else { "shared" },
            pg.port,
            t0.elapsed(),
            pg.root.display()
        );
        pg
    }

    /// `server_version_num` of the running server (e.g. 170009 for 17.9).
    pub fn server_version_num(&self) -> u32 {
        let v = self.psql("postgres", "SHOW server_version_num");
        v.trim()
            .parse()
            .unwrap_or_else(|_| panic!("server_version_num: {v:?}"))
    }

    /// The running server's major version (e.g. 17).
    pub fn major(&self) -> u32 {
        self.server_version_num() / 10000
    }

    /// TCP port (on 127.0.0.1).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Directory holding the Unix socket (`.s.PGSQL.<port>`).
    pub fn socket_dir(&self) -> PathBuf {
        self.root.clone()
    }

    /// The cluster's root directory (data dir is `root/data`).
    pub fn root_dir(&self) -> PathBuf {
        self.root.clone()
    }

    /// PGDATA.
    pub fn data_dir(&self) -> PathBuf {
        self.root.join("data")
    }

    /// PostgreSQL bin directory in use (initdb, pg_ctl, postgres; psql and the other clients
    /// only for the system's builds, not for the npm ones of `PGOUTBOX_TEST_PG`).
    pub fn bin_dir(&self) -> PathBuf {
        self.bin.clone()
    }

    /// `postgres://postgres@127.0.0.1:PORT/db` (superuser, trust).
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@127.0.0.1:{}/{db}", self.port)
    }

    /// `postgres://user:password@127.0.0.1:PORT/db` (user/password percent-encoded).
    pub fn url_as(&self, user: &str, password: &str, db: &str) -> String {
        let mut u = url::Url::parse(&format!("postgres://127.0.0.1:{}/", self.port)).unwrap();
        u.set_username(user).unwrap();
        if !password.is_empty() {
            u.set_password(Some(password)).unwrap();
        }
        u.set_path(db);
        u.to_string()
    }

    /// Connected superuser client to `db`; the connection task is spawned on
    /// the current tokio runtime. Retries for a few seconds (e.g. after restart).
    pub async fn client(&self, db: &str) -> tokio_postgres::Client {
        connect_retry(&self.url(db)).await
    }

    /// Connected client for any URL (e.g. from [`Postgres::url_as`]); no retries.
    pub async fn client_url(url: &str) -> Result<tokio_postgres::Client, tokio_postgres::Error> {
        let (client, conn) = tokio_postgres::connect(url, tokio_postgres::NoTls).await?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(client)
    }

    /// Create a database named `unique(prefix)`; returns its name. Also grants
    /// ALL on it and its public schema to the password roles and `norepl`.
    pub async fn create_database(&self, prefix: &str) -> String {
        let name = super::unique(prefix);
        let client = self.client("postgres").await;
        let mut last_err = None;
        for _ in 0..50 {
            match client
                .batch_execute(&format!("CREATE DATABASE \"{name}\""))
                .await
            {
                Ok(()) => {
                    last_err = None;
                    break;
                }
                // "source database template1 is being accessed by other users"
                Err(e) => {
                    last_err = Some(e);
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        }
        if let Some(e) = last_err {
            panic!("CREATE DATABASE {name}: {e:?}");
        }
        let db_client = self.client(&name).await;
        db_client
            .batch_execute(&format!(
                "GRANT ALL ON DATABASE \"{name}\" TO pw_cleartext, pw_md5, pw_scram, norepl; \
                 GRANT ALL ON SCHEMA public TO pw_cleartext, pw_md5, pw_scram, norepl;"
            ))
            .await
            .expect("grant");
        name
    }

    /// Run SQL through `psql` (superuser, Unix socket, ON_ERROR_STOP); panics on
    /// failure; returns stdout (unaligned, tuples only). Synchronous.
    pub fn psql(&self, db: &str, sql: &str) -> String {
        let out = Command::new(psql_for(&self.bin))
            .args([
                "-X",
                "-q",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-U",
                "postgres",
            ])
            .arg("-h")
            .arg(&self.root)
            .arg("-p")
            .arg(self.port.to_string())
            .arg("-d")
            .arg(db)
            .arg("-c")
            .arg(sql)
            .stdin(Stdio::null())
            .output()
            .expect("spawn psql");
        if !out.status.success() {
            panic!(
                "psql {sql:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// (Re)start the cluster with the same data dir and port; waits until it
    /// accepts connections. Panics with the log tail on failure.
    pub fn start(&self) {
        let out = self
            .pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .arg("-l")
            .arg(self.log_path())
            .args(["-w", "-t", "60", "start"])
            .stdin(Stdio::null())
            .output()
            .expect("spawn pg_ctl start");
        if !out.status.success() {
            panic!(
                "pg_ctl start failed: {}\n--- log tail ---\n{}",
                String::from_utf8_lossy(&out.stderr),
                tail(&self.log_path(), 40)
            );
        }
    }

    /// `pg_ctl stop -m fast` (10 s × scale), falling back to immediate mode.
    /// No-op if not running.
    pub fn stop_fast(&self) {
        let secs = (10.0 * super::scale()).ceil() as u64;
        if !self.pg_ctl_stop("fast", secs) {
            self.stop_immediate();
        }
    }

    /// `pg_ctl stop -m immediate` (crash-like; recovery on next start).
    pub fn stop_immediate(&self) {
        self.pg_ctl_stop("immediate", 30);
    }

    /// True if the postmaster accepts TCP connections.
    pub fn is_running(&self) -> bool {
        super::port_open(self.port)
    }

    /// Path of the server log file.
    pub fn log_path(&self) -> PathBuf {
        self.root.join("postgres.log")
    }

    /// The server log so far.
    pub fn log_contents(&self) -> String {
        std::fs::read(self.log_path())
            .map(|b| String::from_utf8_lossy(&b).into_owned())
            .unwrap_or_default()
    }

    fn pg_ctl_stop(&self, mode: &str, timeout_secs: u64) -> bool {
        if !self.data_dir().join("postmaster.pid").exists() {
            return true;
        }
        self.pg_cmd("pg_ctl")
            .arg("-D")
            .arg(self.data_dir())
            .args(["-m", mode, "-w", "-t", &timeout_secs.to_string(), "stop"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(false)
    }

    /// Command for a PostgreSQL binary, run as the `postgres` OS user when we
    /// are root (initdb/postgres refuse to run as root).
    pub fn pg_cmd(&self, program: &str) -> Command {
        let prog = self.bin.join(program);
        if is_root() {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(prog);
            c
        } else {
            Command::new(prog)
        }
    }

    fn write_cleanup_script(&self) {
        let pg_ctl = sh_quote(&self.bin.join("pg_ctl").display().to_string());
        let data = sh_quote(&self.data_dir().display().to_string());
        let runas = if is_root() {
            "runuser -u postgres -- "
        } else {
            ""
        };
        let script = format!(
            "[ -e {data}/postmaster.pid ] || exit 0\n\
             {runas}{pg_ctl} -D {data} -m fast -w -t 10 stop || \
             {runas}{pg_ctl} -D {data} -m immediate -w -t 30 stop\n\
             true\n"
        );
        std::fs::write(self.root.join("cleanup.sh"), script).expect("write cleanup.sh");
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if self.private {
            cleanup_now(&self.root);
        }
    }
}

async fn connect_retry(url: &str) -> tokio_postgres::Client {
    let deadline = std::time::Instant::now() + super::scaled(Duration::from_secs(10));
    loop {
        match Postgres::client_url(url).await {
            Ok(c) => return c,
            Err(e) if std::time::Instant::now() < deadline => {
                let _ = e;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("connect {url}: {e:?}"),
        }
    }
}

/// The PostgreSQL major version the tests ask for, from `PGOUTBOX_TEST_PG` (14 to 18), or
/// `None` when unset (the system's newest installed server).
pub fn requested_major() -> Option<u32> {
    let v = std::env::var("PGOUTBOX_TEST_PG").ok()?;
    let v = v.trim();
    if v.is_empty() {
        return None;
    }
    match v.parse::<u32>() {
        Ok(m) if (14..=18).contains(&m) => Some(m),
        _ => panic!("PGOUTBOX_TEST_PG={v:?}: expected a PostgreSQL major version, 14 to 18"),
    }
}

/// The server bin directory, found once per test process: `PGOUTBOX_PG_BIN_DIR` when set;
/// else, with `PGOUTBOX_TEST_PG=N`, the system's `/usr/lib/postgresql/N/bin` when present and
/// otherwise the pinned npm build that `deploy/pg-version.sh N` installs (and caches); else the
/// newest server the system has.
fn find_bin_dir() -> PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(find_bin_dir_uncached).clone()
}

fn find_bin_dir_uncached() -> PathBuf {
    if let Ok(d) = std::env::var("PGOUTBOX_PG_BIN_DIR") {
        return PathBuf::from(d);
    }
    if let Some(major) = requested_major() {
        let system = PathBuf::from(format!("/usr/lib/postgresql/{major}/bin"));
        if system.join("initdb").exists() && system.join("postgres").exists() {
            return system;
        }
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy/pg-version.sh");
        let out = Command::new("bash")
            .arg(&script)
            .arg(major.to_string())
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .unwrap_or_else(|e| panic!("spawn {}: {e}", script.display()));
        if !out.status.success() {
            panic!(
                "{} {major} failed (PGOUTBOX_TEST_PG={major}): {}",
                script.display(),
                out.status
            );
        }
        let bin = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        assert!(
            bin.join("initdb").exists(),
            "{} {major} printed {}, which has no initdb",
            script.display(),
            bin.display()
        );
        return bin;
    }
    if let Some(bin) = system_bin_dirs().pop() {
        return bin;
    }
    if let Ok(out) = Command::new("pg_config").arg("--bindir").output() {
        let d = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        if d.join("initdb").exists() {
            return d;
        }
    }
    panic!(
        "PostgreSQL binaries not found: run `deploy/stack.sh install` or set PGOUTBOX_PG_BIN_DIR"
    );
}

/// The system's server bin directories (`/usr/lib/postgresql/N/bin` with an initdb), oldest
/// first.
fn system_bin_dirs() -> Vec<PathBuf> {
    let mut candidates: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let v: u32 = e.file_name().to_str()?.parse().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").exists().then_some((v, bin))
        })
        .collect();
    candidates.sort();
    candidates.into_iter().map(|(_, b)| b).collect()
}

/// The `psql` client for a server bin directory: its own when it has one, else the newest
/// client the system has (the npm server builds ship none; psql speaks to newer servers for
/// the plain statements the harness sends), else `psql` on the PATH.
fn psql_for(bin: &Path) -> PathBuf {
    static PSQL: OnceLock<PathBuf> = OnceLock::new();
    if bin.join("psql").exists() {
        return bin.join("psql");
    }
    PSQL.get_or_init(|| {
        let mut dirs = system_bin_dirs();
        dirs.retain(|d| d.join("psql").exists());
        dirs.pop()
            .map(|d| d.join("psql"))
            .unwrap_or_else(|| PathBuf::from("psql"))
    })
    .clone()
}

fn append(path: &Path, s: &str) {
    use std::io::Write;
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()));
    f.write_all(s.as_bytes()).expect("append");
}

fn run_ok(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn");
    if !out.status.success() {
        panic!("{cmd:?} failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    out
}
