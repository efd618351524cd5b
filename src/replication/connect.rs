//! Opening a `replication=database` session and entering CopyBoth.
//!
//! Follows the PostgreSQL docs, "Frontend/Backend Protocol / Message Flow / Start-up" and
//! "Streaming Replication Protocol": an SSLRequest and the TLS handshake when `sslmode`
//! asks for it ([`crate::postgres::tls`]), a StartupMessage with `replication=database`, then
//! authentication (trust, cleartext password, MD5, SCRAM-SHA-256, SCRAM-SHA-256-PLUS with
//! `tls-server-end-point` channel binding over TLS),
//! then simple-query commands (`IDENTIFY_SYSTEM`, `SHOW`), then
//! `START_REPLICATION SLOT s LOGICAL lsn (options)`, which the server answers with a
//! CopyBothResponse (`W`). postgres-protocol does not parse `W`, so it is handled here.

use std::time::Duration;

use bytes::{Buf, BytesMut};
use postgres_protocol::authentication::sasl::{
    ChannelBinding, ScramSha256, SCRAM_SHA_256, SCRAM_SHA_256_PLUS,
};
use postgres_protocol::message::{backend, frontend};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpStream, UnixStream};
use tokio_postgres::config::Host;

use crate::config::DatabaseConfig;
use crate::config::{ChannelBindingMode, SslMode};
use crate::postgres::tls as postgres_tls;

use crate::lsn::Lsn;
use crate::replication::error::{Error, ServerError};
use crate::replication::session::ReplicationStream;
use crate::replication::socket::{Socket, READ_CHUNK};

/// Which encryption one connection attempt asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Encryption {
    /// No SSLRequest.
    Off,
    /// SSLRequest; plaintext when the server answers `N`.
    Preferred,
    /// SSLRequest; `N` is an error.
    Required,
}

/// Sends an SSLRequest and reads the one-byte answer: `true` for `S` (start the TLS
/// handshake), `false` for `N`. Exactly one byte is read, so nothing the server might send
/// before the handshake is taken as part of it (CVE-2021-23222).
async fn request_ssl(socket: &mut TcpStream) -> Result<bool, Error> {
    const CTX: &str = "negotiating TLS (SSLRequest)";
    let mut buf = BytesMut::new();
    frontend::ssl_request(&mut buf);
    socket.write_all(&buf).await.map_err(|source| Error::Io {
        context: CTX,
        source,
    })?;
    let mut answer = [0u8; 1];
    socket
        .read_exact(&mut answer)
        .await
        .map_err(|source| Error::Io {
            context: CTX,
            source,
        })?;
    match answer[0] {
        b'S' => Ok(true),
        b'N' => Ok(false),
        other => Err(Error::Protocol {
            context: CTX,
            detail: format!("the server answered the SSLRequest with {:?}, not S or N (is this a PostgreSQL server?)", char::from(other)),
        }),
    }
}

/// How long the handshake (TCP connect, startup, authentication, up to ReadyForQuery) may
/// take when the URL sets no `connect_timeout` ([`crate::postgres::DEFAULT_CONNECT_TIMEOUT`]).
pub const CONNECT_TIMEOUT: Duration = crate::postgres::DEFAULT_CONNECT_TIMEOUT;

/// What `IDENTIFY_SYSTEM` returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SystemIdentity {
    /// The cluster's system identifier.
    pub system_id: String,
    /// The current timeline ID.
    pub timeline: u32,
    /// The current WAL flush position (not used for acknowledgement).
    pub xlogpos: Lsn,
    /// The database this session is connected to.
    pub dbname: Option<String>,
}

/// The lines of a timeline history file: each parent timeline and the LSN where it ended
/// (`parentTLI<TAB>switchpoint<TAB>reason`); blank lines, `#` comments and lines that do
/// not parse are skipped.
pub fn timeline_history(content: &str) -> Vec<(u32, Lsn)> {
    content
        .lines()
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let tli = fields.next()?.parse().ok()?;
            let switch = fields.next()?.parse().ok()?;
            Some((tli, switch))
        })
        .collect()
}

/// A replication session before `START_REPLICATION`: it can run simple-query commands.
pub struct ReplicationConnection {
    socket: Box<dyn Socket>,
    read_buf: BytesMut,
    write_buf: BytesMut,
}

impl std::fmt::Debug for ReplicationConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationConnection")
            .finish_non_exhaustive()
    }
}

/// How many hosts the database URL lists (`host=a,b` or `postgres://a,b/db`; `hostaddr`
/// alone counts too), at least one (the default Unix socket).
fn host_count(config: &tokio_postgres::Config) -> usize {
    config
        .get_hosts()
        .len()
        .max(config.get_hostaddrs().len())
        .max(1)
}

/// Host `index` of the URL with its `hostaddr` and port, as libpq pairs them: one port
/// for every host, or one port per host (default 5432); no host is the default Unix socket.
fn host_at(config: &tokio_postgres::Config, index: usize) -> (Host, Option<std::net::IpAddr>, u16) {
    let hostaddr = config.get_hostaddrs().get(index).copied();
    let host = match (config.get_hosts().get(index), hostaddr) {
        (Some(h), _) => h.clone(),
        (None, Some(addr)) => Host::Tcp(addr.to_string()),
        (None, None) => Host::Unix("/var/run/postgresql".into()),
    };
    let ports = config.get_ports();
    let port = match ports.len() {
        0 => 5432,
        1 => ports[0],
        _ => ports.get(index).copied().unwrap_or(5432),
    };
    (host, hostaddr, port)
}

/// `PostgreSQL user@host:port/db` for host `index` of the URL (no password), for errors.
fn describe_host(config: &tokio_postgres::Config, index: usize) -> String {
    let (host, _, port) = host_at(config, index);
    let host = match host {
        Host::Tcp(h) => h,
        Host::Unix(p) => p.display().to_string(),
    };
    format!(
        "PostgreSQL {}@{}:{}/{}",
        config.get_user().unwrap_or("?"),
        host,
        port,
        config.get_dbname().unwrap_or("?")
    )
}

impl ReplicationConnection {
    /// Connects and authenticates with `replication=database`.
    ///
    /// `config` comes from a `postgres://` URL or a key=value string
    /// ([`crate::config::parse_database_url`]). Its hosts are tried in order, as libpq does
    /// (`host=a,b port=5432,5433`, one port for all or one per host; TCP to a host's
    /// `hostaddr` when one is given, the host name still being the one TLS verifies; a host
    /// starting with `/` is a Unix-socket directory); with `target_session_attrs=read-write`
    /// (or `read-only`) a host whose `transaction_read_only` does not match is skipped, so a
    /// reconnect after a failover finds the new primary. TLS follows `sslmode` as libpq does
    /// ([`crate::postgres::tls`]): an SSLRequest, then the rustls handshake over the same
    /// socket on `S`; on `N` plaintext only when the mode allows it. `application_name`
    /// shows up in `pg_stat_replication` and the server log. The whole handshake, from the
    /// TCP connect to the first ReadyForQuery, is bounded by the URL's `connect_timeout`
    /// ([`crate::postgres::connect_timeout`], 10 s when unset), per host.
    ///
    /// # Errors
    /// [`Error::Tls`] when TLS is refused where the mode needs it, the handshake or the
    /// certificate fails, or `channel_binding=require` cannot be met;
    /// [`Error::ConnectTimeout`] when the handshake does not finish in time; [`Error::Io`]
    /// when the connect fails; [`Error::Server`] when authentication or the startup is
    /// refused (for example `42501` when the role lacks `REPLICATION`);
    /// [`Error::PasswordMissing`], [`Error::UnsupportedAuth`]; [`Error::SessionAttrs`] when
    /// a host does not match `target_session_attrs`. With several hosts, the last host's
    /// error (each skipped host is logged at warn).
    pub async fn connect(
        config: &DatabaseConfig,
        application_name: &str,
    ) -> Result<ReplicationConnection, Error> {
        let timeout = crate::postgres::connect_timeout(config);
        let hosts = host_count(config);
        let mut last = None;
        // libpq's multi-host rule: each host in turn (its own connect_timeout), the first
        // that connects, authenticates and (with target_session_attrs) matches wins.
        for index in 0..hosts {
            let attempt = async {
                let mut conn = Self::negotiate(config, index, application_name).await?;
                conn.check_session_attrs(config, index).await?;
                Ok(conn)
            };
            let result = tokio::time::timeout(timeout, attempt)
                .await
                .map_err(|_| Error::ConnectTimeout {
                    target: describe_host(config, index),
                    timeout_s: timeout.as_secs(),
                })
                .and_then(|r| r);
            match result {
                Ok(conn) => return Ok(conn),
                // One host only: its error as it is (no list to name).
                Err(e) if hosts == 1 => return Err(e),
                Err(e) => {
                    tracing::warn!(
                        host = %describe_host(config, index),
                        error = %crate::report::one_line(&e),
                        "PostgreSQL host skipped; trying the next one of the database URL"
                    );
                    last = Some(e);
                }
            }
        }
        Err(last.unwrap_or_else(|| Error::Settings("no host in the database URL".into())))
    }

    /// `target_session_attrs=read-write` / `read-only`: libpq's check of a connected
    /// session (`SHOW transaction_read_only`, a replication command too).
    async fn check_session_attrs(
        &mut self,
        config: &DatabaseConfig,
        index: usize,
    ) -> Result<(), Error> {
        use tokio_postgres::config::TargetSessionAttrs;
        let want_read_only = match config.get_target_session_attrs() {
            TargetSessionAttrs::ReadWrite => false,
            TargetSessionAttrs::ReadOnly => true,
            _ => return Ok(()),
        };
        let rows = self
            .simple_query(
                "SHOW transaction_read_only",
                "checking target_session_attrs",
            )
            .await?;
        let read_only = rows
            .first()
            .and_then(|r| r.first().cloned().flatten())
            .is_some_and(|v| v == "on");
        if read_only == want_read_only {
            return Ok(());
        }
        Err(Error::SessionAttrs(format!(
            "{} is {} (transaction_read_only = {}), but target_session_attrs={} asks for {}; list the primary among the hosts",
            describe_host(config, index),
            if read_only { "read-only (a standby?)" } else { "read-write" },
            if read_only { "on" } else { "off" },
            if want_read_only { "read-only" } else { "read-write" },
            if want_read_only { "a read-only server" } else { "the primary" },
        )))
    }

    /// libpq's order of attempts for the mode: `allow` tries plaintext, then TLS when the
    /// server refused the plaintext session (an ErrorResponse during start-up).
    async fn negotiate(
        config: &DatabaseConfig,
        index: usize,
        application_name: &str,
    ) -> Result<ReplicationConnection, Error> {
        match config.tls.mode {
            SslMode::Disable => {
                Self::handshake(config, index, application_name, Encryption::Off).await
            }
            SslMode::Allow => {
                match Self::handshake(config, index, application_name, Encryption::Off).await {
                    Err(Error::Server { .. }) => {
                        Self::handshake(config, index, application_name, Encryption::Required).await
                    }
                    other => other,
                }
            }
            SslMode::Prefer => {
                Self::handshake(config, index, application_name, Encryption::Preferred).await
            }
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
                Self::handshake(config, index, application_name, Encryption::Required).await
            }
        }
    }

    /// TCP connect, SSLRequest and TLS as `encryption` says, startup message,
    /// authentication, up to ReadyForQuery (unbounded: the caller bounds it).
    async fn handshake(
        config: &DatabaseConfig,
        index: usize,
        application_name: &str,
        encryption: Encryption,
    ) -> Result<ReplicationConnection, Error> {
        let target = describe_host(config, index);
        let user = config
            .get_user()
            .ok_or_else(|| Error::Settings("no user in the database URL".into()))?
            .to_owned();
        let (host, hostaddr, port) = host_at(config, index);
        let connecting = |source| Error::Io {
            context: "connecting",
            source,
        };
        let mut binding = None;
        let mut encrypted = false;
        let socket: Box<dyn Socket> = match &host {
            Host::Tcp(name) => {
                let mut s = match hostaddr {
                    Some(addr) => TcpStream::connect((addr, port)).await,
                    None => TcpStream::connect((name.as_str(), port)).await,
                }
                .map_err(connecting)?;
                s.set_nodelay(true).map_err(connecting)?;
                if encryption == Encryption::Off || !request_ssl(&mut s).await? {
                    if encryption == Encryption::Required {
                        return Err(Error::Tls(postgres_tls::refused_tls(&config.tls, &target)));
                    }
                    Box::new(s)
                } else {
                    let rustls = config
                        .tls
                        .load_client_config(&target)
                        .await
                        .map_err(Error::Tls)?;
                    let server_name =
                        postgres_tls::server_name(name, &target).map_err(Error::Tls)?;
                    let tls = tokio_rustls::TlsConnector::from(rustls)
                        .connect(server_name, s)
                        .await
                        .map_err(|e| {
                            Error::Tls(postgres_tls::handshake_error(
                                &e,
                                &config.tls,
                                name,
                                &target,
                            ))
                        })?;
                    binding = tls
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|certs| certs.first())
                        .and_then(|cert| postgres_tls::tls_server_end_point(cert));
                    encrypted = true;
                    Box::new(tls)
                }
            }
            // libpq never uses TLS on a Unix-domain socket, whatever sslmode says.
            Host::Unix(dir) => {
                let path = dir.join(format!(".s.PGSQL.{port}"));
                Box::new(UnixStream::connect(path).await.map_err(connecting)?)
            }
        };

        let mut conn = ReplicationConnection {
            socket,
            read_buf: BytesMut::with_capacity(64 * 1024),
            write_buf: BytesMut::with_capacity(1024),
        };
        let dbname = config.get_dbname().unwrap_or(&user).to_owned();
        let mut params: Vec<(&str, &str)> = vec![
            ("user", user.as_str()),
            ("database", dbname.as_str()),
            ("replication", "database"),
            ("application_name", application_name),
            ("client_encoding", "UTF8"),
        ];
        let options = config.get_options().map(str::to_owned);
        if let Some(options) = options.as_deref() {
            params.push(("options", options));
        }
        frontend::startup_message(params.iter().copied(), &mut conn.write_buf).map_err(
            |source| Error::Io {
                context: "encoding the startup message",
                source,
            },
        )?;
        conn.flush("sending the startup message").await?;
        let startup =
            Startup::new(&user, config.get_password()).with_channel_binding(ChannelBindingState {
                mode: config.tls.channel_binding,
                encrypted,
                end_point: binding,
                target: target.clone(),
            });
        match conn.authenticate(startup).await {
            Err(Error::Server { context, mut error }) => {
                if error.hint.is_none() {
                    error.hint = postgres_tls::hba_hint(&error.message, &config.tls);
                }
                Err(Error::Server { context, error })
            }
            Err(e) => Err(e),
            Ok(()) => Ok(conn),
        }
    }

    async fn authenticate(&mut self, mut startup: Startup<'_>) -> Result<(), Error> {
        loop {
            let msg = self.read_message(STARTUP_CTX).await?;
            match startup.step(msg, &mut self.write_buf)? {
                StartupStep::Wait => {}
                StartupStep::Send { context } => self.flush(context).await?,
                StartupStep::Ready => {
                    // Which method was used, SCRAM-SHA-256-PLUS showing channel binding.
                    tracing::debug!(
                        method = startup.method(),
                        "replication connection authenticated"
                    );
                    return Ok(());
                }
            }
        }
    }

    async fn flush(&mut self, context: &'static str) -> Result<(), Error> {
        self.socket
            .write_all(&self.write_buf)
            .await
            .map_err(|source| Error::Io { context, source })?;
        self.write_buf.clear();
        Ok(())
    }

    /// Reads one backend message; a `W` (CopyBothResponse) is returned as `None`.
    async fn read_message_or_copy_both(
        &mut self,
        context: &'static str,
    ) -> Result<Option<backend::Message>, Error> {
        loop {
            match parse_backend_message(&mut self.read_buf, context)? {
                Some(BackendFrame::Message(msg)) => return Ok(Some(msg)),
                Some(BackendFrame::CopyBothResponse) => return Ok(None),
                None => {}
            }
            let n = self
                .socket
                .read_buf(&mut self.read_buf)
                .await
                .map_err(|source| Error::Io { context, source })?;
            if n == 0 {
                return Err(Error::Closed { context });
            }
        }
    }

    async fn read_message(&mut self, context: &'static str) -> Result<backend::Message, Error> {
        self.read_message_or_copy_both(context)
            .await?
            .ok_or_else(|| Error::Protocol {
                context,
                detail: "unexpected CopyBothResponse".into(),
            })
    }

    /// Runs one simple-query command and returns its rows as text (NULL as `None`).
    ///
    /// # Errors
    /// [`Error::Server`] when the command fails; I/O and protocol errors.
    pub async fn simple_query(
        &mut self,
        sql: &str,
        context: &'static str,
    ) -> Result<Vec<Vec<Option<String>>>, Error> {
        frontend::query(sql, &mut self.write_buf)
            .map_err(|source| Error::Io { context, source })?;
        self.flush(context).await?;
        let mut rows = Vec::new();
        let mut failure = None;
        loop {
            match self.read_message(context).await? {
                backend::Message::DataRow(body) => {
                    use fallible_iterator::FallibleIterator;
                    let buf = body.buffer();
                    let mut row = Vec::new();
                    let mut ranges = body.ranges();
                    while let Some(range) = ranges.next().map_err(|e| Error::Protocol {
                        context,
                        detail: e.to_string(),
                    })? {
                        row.push(
                            range
                                .and_then(|r| buf.get(r))
                                .map(|b| String::from_utf8_lossy(b).into_owned()),
                        );
                    }
                    rows.push(row);
                }
                backend::Message::ErrorResponse(body) => {
                    failure = Some(ServerError::from_body(&body));
                }
                backend::Message::ReadyForQuery(_) => {
                    return match failure {
                        Some(error) => Err(Error::Server {
                            context,
                            error: Box::new(error),
                        }),
                        None => Ok(rows),
                    };
                }
                _ => {}
            }
        }
    }

    /// Runs `IDENTIFY_SYSTEM`.
    ///
    /// # Errors
    /// As [`ReplicationConnection::simple_query`], plus [`Error::Protocol`] on a short row.
    pub async fn identify_system(&mut self) -> Result<SystemIdentity, Error> {
        const CTX: &str = "running IDENTIFY_SYSTEM";
        let rows = self.simple_query("IDENTIFY_SYSTEM", CTX).await?;
        let bad = |detail: &str| Error::Protocol {
            context: CTX,
            detail: detail.to_owned(),
        };
        let row = rows.first().ok_or_else(|| bad("no row"))?;
        let field = |i: usize| row.get(i).cloned().flatten();
        Ok(SystemIdentity {
            system_id: field(0).ok_or_else(|| bad("no systemid"))?,
            timeline: field(1)
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| bad("bad timeline"))?,
            xlogpos: field(2)
                .and_then(|t| t.parse().ok())
                .ok_or_else(|| bad("bad xlogpos"))?,
            dbname: field(3),
        })
    }

    /// Where timeline `timeline` began: the switch point of the last line of its history
    /// file (`TIMELINE_HISTORY`); `None` for timeline 1, which has no history.
    ///
    /// # Errors
    /// As [`ReplicationConnection::simple_query`], plus [`Error::Protocol`] when the
    /// history has no line for a timeline above 1.
    pub async fn timeline_switch_point(&mut self, timeline: u32) -> Result<Option<Lsn>, Error> {
        const CTX: &str = "running TIMELINE_HISTORY";
        if timeline <= 1 {
            return Ok(None);
        }
        let rows = self
            .simple_query(&format!("TIMELINE_HISTORY {timeline}"), CTX)
            .await?;
        let content = rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().nth(1).flatten())
            .unwrap_or_default();
        timeline_history(&content)
            .last()
            .map(|(_, switch)| Some(*switch))
            .ok_or_else(|| Error::Protocol {
                context: CTX,
                detail: format!("no switch point in the history of timeline {timeline}"),
            })
    }

    /// Reads a server setting with `SHOW name` (allowed on replication connections).
    ///
    /// # Errors
    /// As [`ReplicationConnection::simple_query`].
    pub async fn show(&mut self, name: &str) -> Result<Option<String>, Error> {
        let rows = self
            .simple_query(&format!("SHOW {name}"), "reading a server setting")
            .await?;
        Ok(rows
            .into_iter()
            .next()
            .and_then(|r| r.into_iter().next().flatten()))
    }

    /// Sends `START_REPLICATION SLOT slot LOGICAL start (options)` and waits for CopyBoth.
    ///
    /// `options` are pgoutput's, e.g. `[("proto_version", "1"), ("publication_names", "p"),
    /// ("messages", "true")]`; values are quoted here. The slot name must be a valid
    /// identifier (checked by the caller's config validation).
    ///
    /// # Errors
    /// [`Error::Server`] when the server refuses (slot missing `42704`, slot active `55006`,
    /// bad option `22023`); I/O errors.
    pub async fn start_logical_replication(
        mut self,
        slot: &str,
        start: Lsn,
        options: &[(&str, &str)],
    ) -> Result<ReplicationStream, Error> {
        const CTX: &str = "starting replication";
        let opts = options
            .iter()
            .map(|(k, v)| format!("\"{k}\" '{}'", v.replace('\'', "''")))
            .collect::<Vec<_>>()
            .join(", ");
        let sql = format!("START_REPLICATION SLOT \"{slot}\" LOGICAL {start} ({opts})");
        frontend::query(&sql, &mut self.write_buf).map_err(|source| Error::Io {
            context: CTX,
            source,
        })?;
        self.flush(CTX).await?;
        loop {
            match self.read_message_or_copy_both(CTX).await? {
                None => break,
                Some(backend::Message::ErrorResponse(body)) => {
                    return Err(Error::Server {
                        context: CTX,
                        error: Box::new(ServerError::from_body(&body)),
                    })
                }
                Some(backend::Message::NoticeResponse(_)) => {}
                Some(_) => {
                    return Err(Error::Protocol {
                        context: CTX,
                        detail: "expected CopyBothResponse".into(),
                    })
                }
            }
        }
        let mut read_buf = std::mem::take(&mut self.read_buf);
        read_buf.reserve(READ_CHUNK);
        Ok(ReplicationStream::new(self.socket, read_buf))
    }
}

/// The largest server message accepted before COPY BOTH, in bytes (length field value).
///
/// Before `START_REPLICATION` the server sends only authentication requests, parameter
/// statuses, notices, errors and the few short rows of `IDENTIFY_SYSTEM` and `SHOW`; libpq
/// treats anything but rows, errors and notices above 30,000 bytes as a corrupt stream. 1 MiB
/// leaves room for any error text while bounding what a wrong peer can make us buffer.
pub const MAX_MESSAGE_BEFORE_COPY: usize = 1 << 20;

/// The error context of the start-up and authentication exchange.
const STARTUP_CTX: &str = "authenticating";

/// One server message before COPY BOTH, as [`parse_backend_message`] splits it off.
pub enum BackendFrame {
    /// A message postgres-protocol parses (authentication requests, `ErrorResponse`,
    /// `ReadyForQuery`, rows, ...).
    Message(backend::Message),
    /// A CopyBothResponse (`W`), which postgres-protocol does not parse; its body is skipped.
    CopyBothResponse,
}

impl std::fmt::Debug for BackendFrame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BackendFrame::Message(_) => f.write_str("BackendFrame::Message(..)"),
            BackendFrame::CopyBothResponse => f.write_str("BackendFrame::CopyBothResponse"),
        }
    }
}

/// Splits one complete server message off the front of `buf`, without I/O.
///
/// Returns `Ok(None)` when `buf` does not yet hold a complete message: read more bytes into
/// it and call again. `context` names what the caller was doing, for errors.
///
/// # Errors
/// [`Error::Protocol`] when the message header or body is malformed (for example a length
/// below 4), or when the header declares more than [`MAX_MESSAGE_BEFORE_COPY`] bytes.
pub fn parse_backend_message(
    buf: &mut BytesMut,
    context: &'static str,
) -> Result<Option<BackendFrame>, Error> {
    // postgres-protocol reserves room for the whole declared length before the body has
    // arrived, so a length is checked here first: 4 GiB declared by anything that is not a
    // PostgreSQL server must not become a 4 GiB allocation.
    if let Some(header) = buf.get(..5) {
        let declared = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
        if usize::try_from(declared).map_or(true, |l| l > MAX_MESSAGE_BEFORE_COPY) {
            return Err(Error::Protocol {
                context,
                detail: format!(
                    "server message {:?} declares {declared} bytes, more than the                      {MAX_MESSAGE_BEFORE_COPY} allowed before replication starts (is this a                      PostgreSQL server?)",
                    char::from(header[0])
                ),
            });
        }
    }
    if buf.first() == Some(&b'W') && buf.len() >= 5 {
        let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
        let total = usize::try_from(len)
            .ok()
            .filter(|l| *l >= 4)
            .map(|l| l + 1)
            .ok_or_else(|| Error::Protocol {
                context,
                detail: format!("CopyBothResponse with length {len}"),
            })?;
        if buf.len() >= total {
            buf.advance(total);
            return Ok(Some(BackendFrame::CopyBothResponse));
        }
        return Ok(None);
    }
    let msg = backend::Message::parse(buf).map_err(|e| Error::Protocol {
        context,
        detail: e.to_string(),
    })?;
    Ok(msg.map(BackendFrame::Message))
}

/// What to do after [`Startup::step`] handled one server message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartupStep {
    /// Nothing to send: read the next message.
    Wait,
    /// Send the frontend message(s) `step` appended to its `out` buffer, then read the next
    /// message; `context` names the send in I/O errors.
    Send {
        /// What the send is, e.g. `"sending the password"`.
        context: &'static str,
    },
    /// `ReadyForQuery`: start-up is complete and the session takes commands.
    Ready,
}

/// What channel binding the start-up may use: the mode, whether the session is over TLS,
/// and the server certificate's `tls-server-end-point` data.
#[derive(Debug, Clone, Default)]
pub struct ChannelBindingState {
    /// `channel_binding` from the connection string.
    pub mode: ChannelBindingMode,
    /// Whether the session is over TLS.
    pub encrypted: bool,
    /// The RFC 5929 hash of the server's certificate ([`postgres_tls::tls_server_end_point`]);
    /// `None` in plaintext or when the certificate's signature names no single hash.
    pub end_point: Option<Vec<u8>>,
    /// `PostgreSQL user@host:port/dbname`, for messages.
    pub target: String,
}

/// The client side of start-up and authentication, without I/O: one server message in,
/// one [`StartupStep`] (and maybe a frontend message appended to a buffer) out.
///
/// Speaks trust, cleartext password, MD5, SCRAM-SHA-256 and (over TLS)
/// SCRAM-SHA-256-PLUS with `tls-server-end-point`, and refuses other methods with
/// [`Error::UnsupportedAuth`]. With `channel_binding=require` anything but a completed
/// SCRAM-SHA-256-PLUS exchange is an [`Error::Tls`], as in libpq. Follows the PostgreSQL
/// docs, "Frontend/Backend Protocol / Message Flow / Start-up" and "SASL Authentication".
pub struct Startup<'a> {
    user: &'a str,
    password: Option<&'a [u8]>,
    scram: Option<ScramSha256>,
    binding: ChannelBindingState,
    /// SCRAM-SHA-256-PLUS was chosen.
    bound: bool,
    /// How the server authenticated us so far: `trust` until it asks for something.
    method: &'static str,
}

impl std::fmt::Debug for Startup<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Startup")
            .field("user", &self.user)
            .field("has_password", &self.password.is_some())
            .field("scram_started", &self.scram.is_some())
            .field("channel_binding", &self.binding.mode)
            .field("bound", &self.bound)
            .field("method", &self.method)
            .finish()
    }
}

impl<'a> Startup<'a> {
    /// A new exchange for role `user`, with the URL's password if it has one, in plaintext
    /// (no channel binding; see [`Startup::with_channel_binding`]).
    pub fn new(user: &'a str, password: Option<&'a [u8]>) -> Self {
        Startup {
            user,
            password,
            scram: None,
            binding: ChannelBindingState::default(),
            bound: false,
            method: "trust",
        }
    }

    /// The authentication method the server asked for (`trust` when it asked for none):
    /// `password`, `md5`, `SCRAM-SHA-256` or `SCRAM-SHA-256-PLUS` (channel binding used).
    pub fn method(&self) -> &'static str {
        self.method
    }

    /// The channel binding this session can offer.
    pub fn with_channel_binding(mut self, binding: ChannelBindingState) -> Self {
        self.binding = binding;
        self
    }

    /// `channel_binding=require` cannot be met: `offered` says what the server did.
    fn unbound(&self, offered: &str) -> Error {
        Error::Tls(postgres_tls::channel_binding_unavailable(
            &self.binding.target,
            offered,
        ))
    }

    /// Under `channel_binding=require`, refuses an authentication that is not SCRAM-PLUS.
    fn check_unbound(&self, method: &str) -> Result<(), Error> {
        if self.binding.mode != ChannelBindingMode::Require || self.bound {
            return Ok(());
        }
        let offered = if self.binding.encrypted {
            format!("the server authenticated with {method}, which has no channel binding")
        } else {
            format!("the session is not over TLS (the server answered the SSLRequest with N, or a Unix-domain socket), and the server authenticated with {method}")
        };
        Err(self.unbound(&offered))
    }

    /// Handles one server message of the start-up phase, appending any reply to `out`.
    ///
    /// # Errors
    /// [`Error::Server`] for an `ErrorResponse` (for example a wrong password, `28P01`);
    /// [`Error::PasswordMissing`] when the server asks for a password and there is none;
    /// [`Error::UnsupportedAuth`] for Kerberos, SCM, GSSAPI/SSPI or SASL without
    /// SCRAM-SHA-256; [`Error::Scram`] when the SCRAM exchange fails;
    /// [`Error::Protocol`] for a message that does not belong in start-up.
    pub fn step(
        &mut self,
        msg: backend::Message,
        out: &mut BytesMut,
    ) -> Result<StartupStep, Error> {
        const CTX: &str = STARTUP_CTX;
        let need_password = || Error::PasswordMissing {
            user: self.user.to_owned(),
        };
        match msg {
            backend::Message::AuthenticationOk => {
                self.check_unbound("trust (no password)")?;
                Ok(StartupStep::Wait)
            }
            backend::Message::AuthenticationCleartextPassword => {
                self.check_unbound("a cleartext password")?;
                self.method = "password";
                let pw = self.password.ok_or_else(need_password)?;
                password_step(pw, out)
            }
            backend::Message::AuthenticationMd5Password(body) => {
                self.check_unbound("md5")?;
                self.method = "md5";
                let pw = self.password.ok_or_else(need_password)?;
                let hash = postgres_protocol::authentication::md5_hash(
                    self.user.as_bytes(),
                    pw,
                    body.salt(),
                );
                password_step(hash.as_bytes(), out)
            }
            backend::Message::AuthenticationSasl(body) => {
                use fallible_iterator::FallibleIterator;
                let pw = self.password.ok_or_else(need_password)?;
                let mut mechanisms = body.mechanisms();
                let (mut has_scram, mut has_plus) = (false, false);
                while let Some(m) = mechanisms.next().map_err(|e| Error::Protocol {
                    context: CTX,
                    detail: format!("bad SASL mechanism list: {e}"),
                })? {
                    has_scram |= m == SCRAM_SHA_256;
                    has_plus |= m == SCRAM_SHA_256_PLUS;
                }
                let end_point = match self.binding.mode {
                    ChannelBindingMode::Disable => None,
                    _ => self.binding.end_point.clone(),
                };
                // RFC 5802 section 6: 'p' when both sides bind; 'y' when we could but the
                // server did not offer PLUS (it detects a downgrade); 'n' when we cannot.
                let (mechanism, binding) = match end_point {
                    Some(data) if has_plus => (
                        SCRAM_SHA_256_PLUS,
                        ChannelBinding::tls_server_end_point(data),
                    ),
                    _ if self.binding.mode == ChannelBindingMode::Require => {
                        let offered = if !self.binding.encrypted {
                            "the session is not over TLS (the server answered the SSLRequest with N, or a Unix-domain socket), so there is nothing to bind to".to_owned()
                        } else if !has_plus {
                            "the server did not offer SCRAM-SHA-256-PLUS over TLS".to_owned()
                        } else {
                            "the server's certificate is signed with an algorithm that names no hash (Ed25519 or RSASSA-PSS), so tls-server-end-point has no value".to_owned()
                        };
                        return Err(self.unbound(&offered));
                    }
                    _ if !has_scram => {
                        return Err(Error::UnsupportedAuth {
                            method: "SASL without SCRAM-SHA-256".into(),
                        })
                    }
                    Some(_) => (SCRAM_SHA_256, ChannelBinding::unrequested()),
                    None => (SCRAM_SHA_256, ChannelBinding::unsupported()),
                };
                self.bound = mechanism == SCRAM_SHA_256_PLUS;
                self.method = mechanism;
                let s = ScramSha256::new(pw, binding);
                frontend::sasl_initial_response(mechanism, s.message(), out).map_err(|source| {
                    Error::Io {
                        context: CTX,
                        source,
                    }
                })?;
                self.scram = Some(s);
                Ok(StartupStep::Send { context: CTX })
            }
            backend::Message::AuthenticationSaslContinue(body) => {
                let s = self.scram.as_mut().ok_or_else(|| Error::Protocol {
                    context: CTX,
                    detail: "SASLContinue before SASL".into(),
                })?;
                s.update(body.data()).map_err(Error::Scram)?;
                frontend::sasl_response(s.message(), out).map_err(|source| Error::Io {
                    context: CTX,
                    source,
                })?;
                Ok(StartupStep::Send { context: CTX })
            }
            backend::Message::AuthenticationSaslFinal(body) => {
                let s = self.scram.as_mut().ok_or_else(|| Error::Protocol {
                    context: CTX,
                    detail: "SASLFinal before SASL".into(),
                })?;
                s.finish(body.data()).map_err(Error::Scram)?;
                Ok(StartupStep::Wait)
            }
            backend::Message::AuthenticationKerberosV5 => Err(Error::UnsupportedAuth {
                method: "Kerberos V5".into(),
            }),
            backend::Message::AuthenticationScmCredential => Err(Error::UnsupportedAuth {
                method: "SCM credential".into(),
            }),
            backend::Message::AuthenticationGss | backend::Message::AuthenticationSspi => {
                Err(Error::UnsupportedAuth {
                    method: "GSSAPI/SSPI".into(),
                })
            }
            backend::Message::ParameterStatus(_)
            | backend::Message::BackendKeyData(_)
            | backend::Message::NoticeResponse(_) => Ok(StartupStep::Wait),
            backend::Message::ReadyForQuery(_) => Ok(StartupStep::Ready),
            backend::Message::ErrorResponse(body) => Err(Error::Server {
                context: "the connection",
                error: Box::new(ServerError::from_body(&body)),
            }),
            _ => Err(Error::Protocol {
                context: CTX,
                detail: "unexpected message during startup".into(),
            }),
        }
    }
}

/// Appends a PasswordMessage carrying `pw` (cleartext or an MD5 hash) to `out`.
fn password_step(pw: &[u8], out: &mut BytesMut) -> Result<StartupStep, Error> {
    const CTX: &str = "sending the password";
    frontend::password_message(pw, out).map_err(|source| Error::Io {
        context: CTX,
        source,
    })?;
    Ok(StartupStep::Send { context: CTX })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_timeline_history_gives_each_parent_and_its_switch_point() {
        let history = "1\t0/3000148\tno recovery target specified\n\n# comment\n2\t0/5A00A0\tno recovery target specified\nnot a line\n";
        assert_eq!(
            timeline_history(history),
            vec![(1, Lsn(0x300_0148)), (2, Lsn(0x5A_00A0))]
        );
        assert!(timeline_history("").is_empty());
    }

    /// A backend message: tag, Int32 length counting itself, body.
    fn be(tag: u8, body: &[u8]) -> Vec<u8> {
        let mut m = vec![tag];
        m.extend_from_slice(&i32::try_from(body.len() + 4).unwrap().to_be_bytes());
        m.extend_from_slice(body);
        m
    }

    /// An authentication request (`R`) with its Int32 code.
    fn auth(code: i32, rest: &[u8]) -> Vec<u8> {
        let mut body = code.to_be_bytes().to_vec();
        body.extend_from_slice(rest);
        be(b'R', &body)
    }

    fn ready() -> Vec<u8> {
        be(b'Z', b"I")
    }

    /// Feeds every message of `server` through the parser and `Startup::step` as `connect`
    /// does; returns each step with what it asked to send, or the first error.
    fn run(password: Option<&[u8]>, server: &[u8]) -> Result<Vec<(StartupStep, Vec<u8>)>, Error> {
        let mut startup = Startup::new("alice", password);
        let mut buf = BytesMut::from(server);
        let mut steps = Vec::new();
        while !buf.is_empty() {
            let frame = parse_backend_message(&mut buf, "testing")?
                .expect("the test feeds complete messages");
            let BackendFrame::Message(msg) = frame else {
                panic!("CopyBothResponse during start-up");
            };
            let mut out = BytesMut::new();
            let step = startup.step(msg, &mut out)?;
            steps.push((step, out.to_vec()));
        }
        Ok(steps)
    }

    #[test]
    fn trust_waits_through_parameters_and_ends_at_ready_for_query() {
        let mut server = auth(0, b"");
        server.extend(be(b'S', b"server_version\x0015.18\0"));
        server.extend(be(b'K', &[0, 0, 0, 1, 0, 0, 0, 2]));
        server.extend(be(b'N', b"SNOTICE\0Mhi\0\0"));
        server.extend(ready());
        let steps = run(None, &server).expect("trust");
        let kinds: Vec<_> = steps.iter().map(|(s, _)| *s).collect();
        assert_eq!(
            kinds,
            [
                StartupStep::Wait,
                StartupStep::Wait,
                StartupStep::Wait,
                StartupStep::Wait,
                StartupStep::Ready
            ]
        );
        assert!(steps.iter().all(|(_, out)| out.is_empty()));
    }

    #[test]
    fn cleartext_and_md5_send_one_password_message() {
        let password = StartupStep::Send {
            context: "sending the password",
        };
        let mut server = auth(3, b"");
        server.extend(auth(0, b""));
        server.extend(ready());
        let steps = run(Some(b"pw"), &server).expect("cleartext");
        assert_eq!(steps[0], (password, b"p\0\0\0\x07pw\0".to_vec()));
        assert_eq!(steps[2].0, StartupStep::Ready);

        let steps = run(Some(b"pw"), &auth(5, &[1, 2, 3, 4])).expect("md5");
        let hash = postgres_protocol::authentication::md5_hash(b"alice", b"pw", [1, 2, 3, 4]);
        let (step, out) = &steps[0];
        assert_eq!(*step, password);
        assert_eq!(out.first(), Some(&b'p'));
        assert_eq!(&out[5..out.len() - 1], hash.as_bytes());
    }

    #[test]
    fn sasl_sends_a_scram_first_message_and_refuses_what_it_cannot_speak() {
        let steps = run(
            Some(b"pw"),
            &auth(10, b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0"),
        )
        .expect("scram offered");
        let (step, out) = &steps[0];
        assert_eq!(
            *step,
            StartupStep::Send {
                context: "authenticating"
            }
        );
        assert_eq!(out.first(), Some(&b'p'));
        assert!(out.windows(13).any(|w| w == b"SCRAM-SHA-256"));

        let e = run(Some(b"pw"), &auth(10, b"OTHER\0\0")).expect_err("no scram");
        assert!(matches!(e, Error::UnsupportedAuth { .. }), "{e:?}");
        let e = run(Some(b"pw"), &auth(11, b"r=abc")).expect_err("continue first");
        assert!(e.to_string().contains("SASLContinue before SASL"), "{e}");
        let e = run(Some(b"pw"), &auth(7, b"")).expect_err("gss");
        assert!(e.to_string().contains("GSSAPI/SSPI"), "{e}");
    }

    #[test]
    fn a_password_request_without_a_password_names_the_user() {
        for request in [
            auth(3, b""),
            auth(5, &[0; 4]),
            auth(10, b"SCRAM-SHA-256\0\0"),
        ] {
            let e = run(None, &request).expect_err("no password");
            assert!(
                matches!(&e, Error::PasswordMissing { user } if user == "alice"),
                "{e:?}"
            );
        }
    }

    #[test]
    fn an_error_response_is_a_server_error_with_its_sqlstate() {
        let mut server = auth(3, b"");
        server.extend(be(
            b'E',
            b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed\0\0",
        ));
        let e = run(Some(b"pw"), &server).expect_err("refused");
        assert_eq!(e.code(), Some(SQLSTATE_28P01));
        assert!(
            e.to_string().contains("password authentication failed"),
            "{e}"
        );
    }

    const SQLSTATE_28P01: &str = crate::replication::error::SQLSTATE_INVALID_PASSWORD;

    #[test]
    fn a_message_that_does_not_belong_in_start_up_is_a_protocol_violation() {
        let e = run(None, &be(b'D', &[0, 0])).expect_err("data row");
        assert!(
            e.to_string().contains("unexpected message during startup"),
            "{e}"
        );
    }

    #[test]
    fn the_parser_splits_copy_both_and_waits_for_incomplete_messages() {
        let mut buf = BytesMut::from(&be(b'W', &[0, 0, 0])[..]);
        buf.extend_from_slice(&ready());
        let f = parse_backend_message(&mut buf, "testing").unwrap();
        assert!(matches!(f, Some(BackendFrame::CopyBothResponse)), "{f:?}");
        assert_eq!(buf.as_ref(), ready().as_slice(), "only the W was consumed");

        let whole = ready();
        for cut in 0..whole.len() {
            let mut buf = BytesMut::from(&whole[..cut]);
            let f = parse_backend_message(&mut buf, "testing").unwrap();
            assert!(f.is_none(), "cut at {cut}");
            assert_eq!(buf.len(), cut, "an incomplete message is not consumed");
        }
        let mut buf = BytesMut::from(&[b'W', 0xff, 0xff, 0xff, 0xff][..]);
        let e = parse_backend_message(&mut buf, "testing").expect_err("negative length");
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
    }

    /// Found by the `startup` fuzz target: a header declaring 4 GiB made the parser reserve
    /// 4 GiB before a single byte of the body arrived (libFuzzer: out-of-memory
    /// (malloc(4294967296))). Anything that is not a PostgreSQL server can send this.
    #[test]
    fn a_huge_declared_length_is_refused_before_any_allocation() {
        for tag in [8, b'R', b'E', b'D', b'W'] {
            let mut buf = BytesMut::from(&[tag, 0xff, 0xff, 0xff, 0xff][..]);
            let r = parse_backend_message(&mut buf, "testing");
            assert!(
                buf.capacity() < 1 << 24,
                "tag {tag}: reserved {} bytes for a declared 4 GiB message",
                buf.capacity()
            );
            let e = r.expect_err("a 4 GiB message before COPY BOTH");
            assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
            assert!(e.to_string().contains("declares 4294967295 bytes"), "{e}");
        }
        // A notice exactly at the bound still parses.
        let mut body = b"SNOTICE\0M".to_vec();
        body.resize(MAX_MESSAGE_BEFORE_COPY - 4 - 2, b'a');
        body.extend_from_slice(b"\0\0");
        let mut buf = BytesMut::from(&be(b'N', &body)[..]);
        let f = parse_backend_message(&mut buf, "testing").expect("at the bound");
        assert!(matches!(f, Some(BackendFrame::Message(_))), "{f:?}");
        assert!(buf.is_empty());
    }
}
