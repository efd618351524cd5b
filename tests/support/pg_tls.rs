//! A PostgreSQL cluster that takes TCP connections only over TLS, and the throwaway
//! certificates it and its clients use, generated at test time with `rcgen`.
//!
//! One cluster per test process ([`TlsPostgres::shared`]): `ssl = on` with a server
//! certificate a test CA signed for `localhost` and `127.0.0.1`, and a `pg_hba.conf` whose
//! TCP lines are all `hostssl` (so a plaintext TCP connection is refused with "no
//! pg_hba.conf entry ..., no encryption"): `pw_scram` by `scram-sha-256` (for channel
//! binding), `pw_cert` by a client certificate (`cert`: the test CA is the server's
//! `ssl_ca_file`; [`TlsPostgres::client_cert`] is one for `pw_cert`), everyone else by
//! trust. The harness' own `psql` goes over the Unix socket.

use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use super::tls::{ca, leaf};
use super::{is_root, scaled, wait_until_blocking, Postgres};

/// The shared TLS cluster and its certificate files.
#[derive(Debug)]
pub struct TlsPostgres {
    /// The cluster (TCP on 127.0.0.1 at [`Postgres::port`], TLS only).
    pub pg: Postgres,
    /// The CA that signed the server's certificate (PEM).
    pub ca: PathBuf,
    /// Another CA, which signed nothing the server presents (PEM).
    pub other_ca: PathBuf,
    /// A client certificate for the role `pw_cert`, signed by [`TlsPostgres::ca`] (PEM).
    pub client_cert: PathBuf,
    /// Its private key (PKCS#8 PEM, mode 0600).
    pub client_key: PathBuf,
}

static SHARED: OnceLock<TlsPostgres> = OnceLock::new();

impl TlsPostgres {
    /// The per-process TLS cluster (lazy; stopped by its watchdog when the test process
    /// exits). Use a database of your own on it ([`TlsPostgres::create_database`]).
    pub fn shared() -> &'static TlsPostgres {
        SHARED.get_or_init(|| {
            super::run_shared(
                "postgres-tls",
                TlsPostgres::start,
                |t| t.pg.describe(),
                |text| TlsPostgres::of(Postgres::attach(text)),
            )
        })
    }

    /// The cluster's CA files, under its directory.
    fn of(pg: Postgres) -> TlsPostgres {
        let root = pg.root_dir();
        TlsPostgres {
            ca: root.join("ca.pem"),
            other_ca: root.join("other-ca.pem"),
            client_cert: root.join("pw_cert.pem"),
            client_key: root.join("pw_cert.key"),
            pg,
        }
    }

    fn start() -> TlsPostgres {
        let pg = Postgres::start_private(&[]);
        let (ca_pem, issuer) = ca("pgoutbox postgres test CA");
        let (other_ca_pem, _) = ca("pgoutbox other CA");
        let (server_pem, server_key) = leaf("localhost", &["localhost", "127.0.0.1"], &issuer);
        let (client_pem, client_key) = leaf("pw_cert", &["pw_cert"], &issuer);
        let data = pg.data_dir();
        let root = pg.root_dir();
        let write = |path: PathBuf, text: &str, mode: u32| {
            std::fs::write(&path, text).expect("write a certificate file");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).expect("chmod");
            if is_root() {
                let ok = std::process::Command::new("chown")
                    .arg("postgres:")
                    .arg(&path)
                    .status()
                    .expect("chown")
                    .success();
                assert!(ok, "chown {}", path.display());
            }
        };
        write(data.join("server.crt"), &server_pem, 0o644);
        // The server refuses a key others can read.
        write(data.join("server.key"), &server_key, 0o600);
        write(root.join("ca.pem"), &ca_pem, 0o644);
        write(root.join("other-ca.pem"), &other_ca_pem, 0o644);
        // The server verifies client certificates against the test CA.
        write(data.join("ca.pem"), &ca_pem, 0o644);
        write(root.join("pw_cert.pem"), &client_pem, 0o644);
        write(root.join("pw_cert.key"), &client_key, 0o600);
        // The Unix socket keeps trust (the harness' psql); TCP is hostssl only.
        let mut hba = String::from("# TYPE DATABASE USER ADDRESS METHOD\n");
        for db in ["all", "replication"] {
            hba.push_str(&format!("local {db} all trust\n"));
            hba.push_str(&format!(
                "hostssl {db} pw_scram 127.0.0.1/32 scram-sha-256\n"
            ));
            hba.push_str(&format!("hostssl {db} pw_cert 127.0.0.1/32 cert\n"));
            hba.push_str(&format!("hostssl {db} all 127.0.0.1/32 trust\n"));
            hba.push_str(&format!("hostssl {db} all ::1/128 trust\n"));
        }
        write(data.join("pg_hba.conf"), &hba, 0o600);
        for setting in [
            "ssl = on",
            "ssl_cert_file = 'server.crt'",
            "ssl_key_file = 'server.key'",
            "ssl_ca_file = 'ca.pem'",
        ] {
            pg.psql("postgres", &format!("ALTER SYSTEM SET {setting}"));
        }
        pg.psql("postgres", "SELECT pg_reload_conf()");
        let on = wait_until_blocking(scaled(Duration::from_secs(10)), || {
            pg.psql("postgres", "SHOW ssl").trim() == "on"
        });
        assert!(on, "ssl did not turn on:\n{}", pg.log_contents());
        pg.psql("postgres", "CREATE ROLE pw_cert LOGIN REPLICATION");
        eprintln!("[harness] postgres TLS-only on port {}", pg.port());
        TlsPostgres::of(pg)
    }

    /// `postgres://postgres@HOST:PORT/db?QUERY` (superuser, trust over TLS); `host` is
    /// `127.0.0.1` or `localhost` (both in the certificate), or another name to connect by.
    pub fn url(&self, host: &str, db: &str, query: &str) -> String {
        self.url_as("postgres", host, db, query)
    }

    /// Like [`TlsPostgres::url`] as `user` (trust over TLS for every role but `pw_scram`),
    /// e.g. the streamer role [`super::fixture::STREAMER_ROLE`].
    pub fn url_as(&self, user: &str, host: &str, db: &str, query: &str) -> String {
        format!("postgres://{user}@{host}:{}/{db}?{query}", self.pg.port())
    }

    /// `sslrootcert=` for the CA that signed the server's certificate.
    pub fn rootcert(&self) -> String {
        format!("sslrootcert={}", self.ca.display())
    }

    /// A new database (created over the Unix socket), with `pw_scram` allowed in it.
    pub fn create_database(&self, prefix: &str) -> String {
        let name = super::unique(prefix);
        self.pg.psql(
            "postgres",
            &format!("CREATE DATABASE \"{name}\" TEMPLATE template0"),
        );
        self.pg.psql(
            &name,
            &format!("GRANT ALL ON DATABASE \"{name}\" TO pw_scram; GRANT ALL ON SCHEMA public TO pw_scram"),
        );
        name
    }
}
