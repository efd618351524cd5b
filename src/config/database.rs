//! A PostgreSQL connection string, parsed as libpq reads it: tokio-postgres' settings and
//! the TLS parameters its parser does not know ([`PostgresTls`]), checked together once at
//! the edge. Plain data: the transports ([`crate::postgres`], [`crate::replication`]) read
//! it and build the TLS configuration from it.
//!
//! The parameters and their meanings are libpq's ("Database Connection Control Functions /
//! Parameter Key Words" and "SSL Support" in the PostgreSQL docs):
//!
//! | `sslmode` | SSLRequest | chain verified | host name verified |
//! |---|---|---|---|
//! | `disable` | never | - | - |
//! | `allow` | only after the server refused plaintext | if `sslrootcert` is given | no |
//! | `prefer` (default) | yes; plaintext when the server answers `N` | if `sslrootcert` is given | no |
//! | `require` | yes; `N` is an error | if `sslrootcert` is given | no |
//! | `verify-ca` | yes; `N` is an error | yes | no |
//! | `verify-full` | yes; `N` is an error | yes | yes |
//!
//! `sslrootcert` is a PEM file of CA certificates, or `system` for the platform's trust
//! store (`rustls-native-certs`), which, as in libpq 16, needs `sslmode=verify-full`.
//! `sslcert` and `sslkey` are a client certificate chain and its key (PEM), both or
//! neither. `channel_binding` (`disable`, `prefer` = default, `require`) decides whether
//! SCRAM-SHA-256-PLUS with `tls-server-end-point` (RFC 5929 section 4) is used when the
//! server offers it over TLS. Unix-domain sockets never use TLS (libpq ignores `sslmode`
//! there too).
//!
//! Not matched (each refused with a message, never ignored): `sslnegotiation=direct`,
//! `sslcrl`/`sslcrldir`, `sslpassword` (encrypted keys), `sslcertmode`,
//! `ssl_min_protocol_version`/`ssl_max_protocol_version` (rustls offers TLS 1.2 and 1.3);
//! the default files `~/.postgresql/root.crt` and `~/.postgresql/postgresql.{crt,key}` are
//! not read (give `sslrootcert`, `sslcert`, `sslkey`), nor are the `PGSSLMODE`-style
//! environment variables; verify-full checks the certificate's subject alternative names
//! only (rustls has no fallback to the common name); a TLS handshake failure under
//! `prefer` is an error, not a retry in plaintext.

use std::path::PathBuf;

use crate::connection_url::PgUrl;
use crate::redaction::shown_value;
use crate::validation::ValidationError;

/// libpq's `sslmode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SslMode {
    /// Never TLS.
    Disable,
    /// Plaintext first; TLS only when the server refuses the plaintext connection.
    Allow,
    /// TLS when the server accepts the SSLRequest, plaintext when it answers `N`.
    #[default]
    Prefer,
    /// TLS or nothing; the certificate is not verified unless `sslrootcert` is given.
    Require,
    /// TLS, the certificate chain verified against `sslrootcert`, the host name not.
    VerifyCa,
    /// TLS, the chain and the host name verified.
    VerifyFull,
}

impl SslMode {
    /// The value as written in a connection string.
    pub fn as_str(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Allow => "allow",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether a plaintext session is forbidden.
    pub fn requires_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// libpq's `channel_binding`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ChannelBindingMode {
    /// Never SCRAM-SHA-256-PLUS.
    Disable,
    /// SCRAM-SHA-256-PLUS when the server offers it over TLS.
    #[default]
    Prefer,
    /// Authentication must be SCRAM-SHA-256-PLUS: no plaintext, no password or md5, no trust.
    Require,
}

impl ChannelBindingMode {
    /// The value as written in a connection string.
    pub fn as_str(self) -> &'static str {
        match self {
            ChannelBindingMode::Disable => "disable",
            ChannelBindingMode::Prefer => "prefer",
            ChannelBindingMode::Require => "require",
        }
    }
}

/// Where the CA certificates that may sign the server's certificate come from (`sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RootCert {
    /// A PEM file.
    File(PathBuf),
    /// The platform's trust store (`sslrootcert=system`).
    System,
}

/// The TLS settings of a PostgreSQL connection string.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PostgresTls {
    /// `sslmode`.
    pub mode: SslMode,
    /// `sslrootcert`.
    pub root_cert: Option<RootCert>,
    /// `sslcert` and `sslkey` (certificate chain, key), PEM files.
    pub client_cert: Option<(PathBuf, PathBuf)>,
    /// `channel_binding`.
    pub channel_binding: ChannelBindingMode,
}

/// The parameters [`PostgresTls::take_parameter`] consumes (tokio-postgres' parser does not
/// know them, or knows only part of their values).
pub const TLS_PARAMETERS: [&str; 5] = [
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "channel_binding",
];

/// libpq parameters pgoutbox refuses rather than ignores, with why.
const UNSUPPORTED_PARAMETERS: [(&str, &str); 8] = [
    ("sslcrl", "certificate revocation lists are not checked"),
    ("sslcrldir", "certificate revocation lists are not checked"),
    (
        "sslpassword",
        "encrypted private keys are not supported; give sslkey= an unencrypted PEM key",
    ),
    (
        "sslcertmode",
        "a client certificate is sent when sslcert= and sslkey= are given",
    ),
    ("ssl_min_protocol_version", "TLS 1.2 and 1.3 are offered"),
    ("ssl_max_protocol_version", "TLS 1.2 and 1.3 are offered"),
    (
        "gssencmode",
        "GSSAPI encryption is not supported; use sslmode=",
    ),
    (
        "requiressl",
        "it is deprecated in libpq; use sslmode=require",
    ),
];

impl PostgresTls {
    /// Takes one `key=value` of a connection string when it is a TLS parameter: returns
    /// `Ok(true)` when consumed, `Ok(false)` when the key is someone else's.
    ///
    /// # Errors
    /// A message naming the parameter and the accepted values for a bad value, and for the
    /// libpq TLS parameters pgoutbox does not implement (never silently ignored).
    pub fn take_parameter(&mut self, key: &str, value: &str) -> Result<bool, String> {
        match key {
            "sslmode" => {
                self.mode = match value {
                    "disable" => SslMode::Disable,
                    "allow" => SslMode::Allow,
                    "prefer" => SslMode::Prefer,
                    "require" => SslMode::Require,
                    "verify-ca" => SslMode::VerifyCa,
                    "verify-full" => SslMode::VerifyFull,
                    other => return Err(format!("sslmode={} is not an sslmode; use disable, allow, prefer (the default), require, verify-ca or verify-full", shown_value(other))),
                };
            }
            "sslrootcert" => {
                self.root_cert = match value {
                    "" => return Err("sslrootcert= is empty; give the path of a PEM file with the CA certificates, or system for the platform's trust store".into()),
                    "system" => Some(RootCert::System),
                    path => Some(RootCert::File(PathBuf::from(path))),
                };
            }
            "sslcert" | "sslkey" if value.is_empty() => {
                return Err(format!("{key}= is empty; give the path of a PEM file"));
            }
            "sslcert" => {
                let key_file = self.client_cert.take().map(|(_, k)| k).unwrap_or_default();
                self.client_cert = Some((PathBuf::from(value), key_file));
            }
            "sslkey" => {
                let cert_file = self.client_cert.take().map(|(c, _)| c).unwrap_or_default();
                self.client_cert = Some((cert_file, PathBuf::from(value)));
            }
            "channel_binding" => {
                self.channel_binding = match value {
                    "disable" => ChannelBindingMode::Disable,
                    "prefer" => ChannelBindingMode::Prefer,
                    "require" => ChannelBindingMode::Require,
                    other => return Err(format!("channel_binding={} is not a channel_binding mode; use disable, prefer (the default) or require", shown_value(other))),
                };
            }
            "sslnegotiation" => {
                if value != "postgres" {
                    return Err(format!("sslnegotiation={} is not supported: pgoutbox negotiates TLS with an SSLRequest (sslnegotiation=postgres, the default); remove the setting", shown_value(value)));
                }
            }
            "sslsni" => {
                if value != "1" {
                    return Err(format!("sslsni={} is not supported: pgoutbox always sends the host name (SNI) when it is not an address; remove the setting", shown_value(value)));
                }
            }
            // libpq ignores it since PostgreSQL 14.
            "sslcompression" => {}
            _ => {
                if let Some((_, why)) = UNSUPPORTED_PARAMETERS.iter().find(|(k, _)| *k == key) {
                    return Err(format!(
                        "{key}= is not supported by pgoutbox ({why}); remove it"
                    ));
                }
                if key.starts_with("ssl") {
                    return Err(format!("{key}= is not a TLS setting pgoutbox knows; the TLS settings are sslmode, sslrootcert, sslcert, sslkey and channel_binding"));
                }
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Checks the combination once every parameter was taken.
    ///
    /// # Errors
    /// A message naming the settings: `sslcert` without `sslkey` or the reverse,
    /// `sslrootcert=system` with a mode weaker than `verify-full` (libpq 16 refuses it too),
    /// `verify-ca`/`verify-full` without `sslrootcert` (libpq would read
    /// `~/.postgresql/root.crt`; pgoutbox asks for it explicitly), `channel_binding=require`
    /// with `sslmode=disable`.
    pub fn validate(&self) -> Result<(), String> {
        if let Some((cert, key)) = &self.client_cert {
            if key.as_os_str().is_empty() {
                return Err("sslcert= needs sslkey= (the client certificate's private key)".into());
            }
            if cert.as_os_str().is_empty() {
                return Err("sslkey= needs sslcert= (the client certificate it belongs to)".into());
            }
        }
        if self.root_cert == Some(RootCert::System) && self.mode != SslMode::VerifyFull {
            return Err(format!("sslrootcert=system needs sslmode=verify-full (as in libpq): the platform's CAs sign certificates for anyone, so only the host name check makes them mean something; sslmode={} was given", self.mode.as_str()));
        }
        if matches!(self.mode, SslMode::VerifyCa | SslMode::VerifyFull) && self.root_cert.is_none()
        {
            return Err(format!("sslmode={} verifies the server's certificate and needs sslrootcert= (a PEM file with the CA that signed it, or system for the platform's trust store); pgoutbox does not read libpq's default ~/.postgresql/root.crt", self.mode.as_str()));
        }
        if self.channel_binding == ChannelBindingMode::Require && self.mode == SslMode::Disable {
            return Err("channel_binding=require needs TLS, and sslmode=disable turns it off; use sslmode=require or stronger".into());
        }
        Ok(())
    }

    /// Whether the certificate chain is verified: `verify-ca`, `verify-full`, and (as in
    /// libpq) any mode with an `sslrootcert`.
    pub fn verifies_chain(&self) -> bool {
        matches!(self.mode, SslMode::VerifyCa | SslMode::VerifyFull) || self.root_cert.is_some()
    }

    /// What the server's certificate is checked against, for messages.
    pub fn anchors_text(&self) -> String {
        match (&self.root_cert, self.verifies_chain()) {
            (_, false) => {
                "nothing (sslmode=require without sslrootcert verifies no certificate)".into()
            }
            (Some(RootCert::File(p)), true) => format!("sslrootcert={}", p.display()),
            (Some(RootCert::System), true) => "the system trust store (sslrootcert=system)".into(),
            (None, true) => "no CA".into(),
        }
    }
}

/// A parsed `--database-url`: tokio-postgres' settings and the TLS settings
/// ([`PostgresTls`]) that its parser does not know. Derefs to the former, so code
/// that needs only host, user or timeouts reads it as a `tokio_postgres::Config`.
#[derive(Debug, Clone)]
pub struct DatabaseConfig {
    /// Host, port, user, password, dbname, options, timeouts; its `ssl_mode` and
    /// `channel_binding` are set from `tls` for the SQL connection.
    pub pg: tokio_postgres::Config,
    /// `sslmode`, `sslrootcert`, `sslcert`, `sslkey`, `channel_binding` with libpq's meanings.
    pub tls: PostgresTls,
    /// The `application_name` of pgoutbox's ordinary SQL sessions when the connection
    /// string sets none (`run`: `pgoutbox-ID` with its instance id); `None`: `pgoutbox`
    /// (see [`crate::postgres::connect`]).
    pub session_name: Option<String>,
}

impl std::ops::Deref for DatabaseConfig {
    type Target = tokio_postgres::Config;

    fn deref(&self) -> &tokio_postgres::Config {
        &self.pg
    }
}

/// Parses a Postgres connection string (URL or key=value) as libpq does: the TLS
/// parameters (`sslmode` with all six of libpq's modes, `sslrootcert`, `sslcert`,
/// `sslkey`, `channel_binding`) are taken out by [`split_tls_parameters`], the rest is read
/// by tokio-postgres' parser.
///
/// # Errors
/// [`ValidationError`] for `--database-url` when it does not parse, when a TLS parameter
/// has a bad value or an unsupported `ssl*` parameter is given, or the TLS settings do not
/// fit together ([`PostgresTls::validate`]). The error names the URL by its redacted form
/// only ([`PgUrl`]'s `Display`), and the parser's words only when they quote nothing that
/// form hides ([`crate::redaction::only_shown`]).
pub fn parse_database_url(url: &PgUrl) -> Result<DatabaseConfig, ValidationError> {
    let shown = url.to_string();
    let url = url.expose_secret();
    let invalid = |rule: String| {
        ValidationError {
        setting: "--database-url",
        rule: crate::redaction::only_shown(
            rule,
            url,
            &shown,
            "it does not parse as a PostgreSQL connection string (the parser's words would show a part of it that may be a password); expected postgres://user:password@host:port/dbname, with '@', ':', '/', '?' and spaces in a password percent-encoded",
        ),
        value: shown.clone(),
    }
    };
    if crate::redaction::at_after_authority(url) {
        return Err(invalid(
            "an '@' after the host (in the database name or the query): a typo in the URL? Expected postgres://user:password@host:port/dbname; write a literal '@' there as %40".into(),
        ));
    }
    if url.contains("://") && url.trim().contains(char::is_whitespace) {
        return Err(invalid(
            "whitespace in the URL: percent-encode a space as %20, or write key=value settings without a URL (was more text glued on?)".into(),
        ));
    }
    if authority_has_two_ats(url) {
        return Err(invalid(
            "more than one '@' before the host: an '@' in the user or the password is written %40 in a URL (postgres://user:pass%40word@host/dbname)".into(),
        ));
    }
    let (rest, tls) = split_tls_parameters(url).map_err(invalid)?;
    tls.validate().map_err(invalid)?;
    let mut config: tokio_postgres::Config = rest
        .parse()
        .map_err(|e| invalid(explain_parse_error(&rest, &e)))?;
    if config.get_user().is_none() {
        return Err(invalid(
            "no user given; write postgres://USER@host/dbname".into(),
        ));
    }
    let unix = matches!(
        config.get_hosts().first(),
        Some(tokio_postgres::config::Host::Unix(_))
    );
    config.ssl_mode(match tls.mode {
        // libpq ignores sslmode on Unix-domain sockets; `allow` tries plaintext first
        // (crate::postgres::connect retries with TLS).
        _ if unix => tokio_postgres::config::SslMode::Disable,
        SslMode::Disable | SslMode::Allow => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull => {
            tokio_postgres::config::SslMode::Require
        }
    });
    config.channel_binding(match tls.channel_binding {
        ChannelBindingMode::Disable => tokio_postgres::config::ChannelBinding::Disable,
        ChannelBindingMode::Prefer => tokio_postgres::config::ChannelBinding::Prefer,
        ChannelBindingMode::Require => tokio_postgres::config::ChannelBinding::Require,
    });
    Ok(DatabaseConfig {
        pg: config,
        tls,
        session_name: None,
    })
}

/// Whether the authority of a URL (after `://`, up to the first `/`, `?` or `#`) holds more
/// than one '@': an unencoded '@' in a password, which parsers split differently (the url
/// crate at the last '@', tokio-postgres and amq-protocol at the first), so that the rest
/// of the password would be shown as the host.
pub fn authority_has_two_ats(url: &str) -> bool {
    url.split_once("://").is_some_and(|(_, rest)| {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        rest[..end].matches('@').count() > 1
    })
}

/// The parameters tokio-postgres reads besides the TLS ones ([`split_tls_parameters`]),
/// named when a parameter is unknown.
const KNOWN_PARAMETERS: &str = "user, password, dbname, host, hostaddr, port, options, application_name, connect_timeout, tcp_user_timeout, keepalives, keepalives_idle, keepalives_interval, keepalives_retries, target_session_attrs, load_balance_hosts";

/// What tokio-postgres' parser refused in `conn` (the string without its TLS parameters),
/// in words: the parameter, its value as written (never a password's) and the fix. Its own
/// error says only "invalid connection string"; the cause names the parameter alone.
fn explain_parse_error(conn: &str, e: &tokio_postgres::Error) -> String {
    let cause = std::error::Error::source(e).map_or_else(|| e.to_string(), ToString::to_string);
    let named = |prefix: &str| {
        cause
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix('`'))
            .map(str::to_owned)
    };
    if let Some(key) = named("unknown option `") {
        return format!(
            "unknown parameter {}: pgoutbox reads {KNOWN_PARAMETERS}, and sslmode, sslrootcert, sslcert, sslkey, channel_binding; remove it or fix its name",
            shown_parameter(conn, &key)
        );
    }
    if let Some(key) = named("invalid value for option `") {
        let fix = match key.as_str() {
            "port" => "write a port number from 1 to 65535 (one per host, comma-separated)",
            "hostaddr" => "write an IP address (one per host, comma-separated)",
            "host" => {
                "write a host name, an IP address or a socket directory, percent-encoded in a URL"
            }
            "connect_timeout" | "tcp_user_timeout" | "keepalives_idle" | "keepalives_interval" => {
                "write whole seconds"
            }
            "keepalives" => "write 1 (on) or 0 (off)",
            "keepalives_retries" => "write a whole number",
            "target_session_attrs" => "write any, read-write or read-only",
            "load_balance_hosts" => "write disable or random",
            _ => "fix the value",
        };
        return format!(
            "{} is not a valid {key}: {fix}",
            shown_parameter(conn, &key)
        );
    }
    format!(
        "not a PostgreSQL connection string ({cause}); expected postgres://user:password@host:port/dbname"
    )
}

/// `key="value"` as written in `conn` (a URL's query, percent-decoded, or its authority's
/// ports for `port`; a key/value string's pair), `key=***` for the password, `key` alone
/// when the value cannot be found.
fn shown_parameter(conn: &str, key: &str) -> String {
    // The key as the parser named it may be any text a typo left (a whole URL whose scheme
    // lacks its ':'): named only when it is a plain name, its value only when the name is
    // one whose values never hold a secret (crate::redaction::is_shown_key).
    if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return "(a parameter that is not a name: a typo in the URL?)".into();
    }
    if !crate::redaction::is_shown_key(key) {
        return format!("{key}=***");
    }
    let value = if conn.starts_with("postgres://") || conn.starts_with("postgresql://") {
        let query = conn.split_once('?').map(|(_, q)| q).unwrap_or_default();
        query
            .split('&')
            .filter_map(|pair| pair.split_once('='))
            .find(|(k, _)| *k == key)
            .map(|(_, v)| {
                percent_encoding::percent_decode_str(v)
                    .decode_utf8_lossy()
                    .into_owned()
            })
            .or_else(|| (key == "port").then(|| authority_ports(conn)).flatten())
    } else {
        key_value_pairs(conn)
            .ok()
            .and_then(|pairs| pairs.into_iter().find(|(_, _, k, _)| k == key))
            .map(|(_, _, _, v)| v)
    };
    match value {
        Some(v) if shown_value(&v) == v => format!("{key}={v:?}"),
        Some(_) => format!("{key}=***"),
        None => key.to_owned(),
    }
}

/// The ports of a URL's hosts, as written (`h1:5432,h2:x` gives `5432,x`), or `None` when
/// no host has one.
fn authority_ports(url: &str) -> Option<String> {
    // After the last '@' (a password may hold one; parse_database_url refused an '@'
    // after the host already), up to the path.
    let rest = url.split_once("://")?.1;
    let rest = &rest[..rest.find(['?', '#']).unwrap_or(rest.len())];
    let hosts = rest.rsplit_once('@').map_or(rest, |(_, h)| h);
    let hosts = &hosts[..hosts.find('/').unwrap_or(hosts.len())];
    let ports: Vec<&str> = hosts
        .split(',')
        .filter_map(|host| {
            // `[::1]:5432`: the port follows the bracket.
            let after = host.rsplit_once(']').map_or(host, |(_, a)| a);
            after.rsplit_once(':').map(|(_, p)| p)
        })
        .collect();
    (!ports.is_empty()).then(|| ports.join(","))
}

/// Takes the TLS parameters out of a connection string: returns the string without them
/// (everything else exactly as written) and the TLS settings. A `postgres://` or
/// `postgresql://` URL has them in its query (percent-decoded); a key=value string as
/// `key=value` pairs (values optionally single-quoted, with `\'` and `\\` escapes).
///
/// # Errors
/// A message naming the parameter ([`PostgresTls::take_parameter`]),
/// or an unterminated quote.
pub fn split_tls_parameters(text: &str) -> Result<(String, PostgresTls), String> {
    let mut tls = PostgresTls::default();
    if text.starts_with("postgres://") || text.starts_with("postgresql://") {
        let Some((base, query)) = text.split_once('?') else {
            return Ok((text.to_owned(), tls));
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let decode = |s: &str| {
                percent_encoding::percent_decode_str(s)
                    .decode_utf8()
                    .map(|c| c.into_owned())
                    .map_err(|_| {
                        format!("the URL parameter {s:?} is not UTF-8 once percent-decoded")
                    })
            };
            if !tls.take_parameter(&decode(key)?, &decode(value)?)? {
                kept.push(pair);
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, tls));
    }
    let mut rest = String::new();
    let mut last = 0;
    for (start, end, key, value) in key_value_pairs(text)? {
        if tls.take_parameter(&key, &value)? {
            rest.push_str(&text[last..start]);
            last = end;
        }
    }
    rest.push_str(&text[last..]);
    Ok((rest, tls))
}

/// The `key = value` pairs of a libpq key/value connection string, each with its byte span.
fn key_value_pairs(text: &str) -> Result<Vec<(usize, usize, String, String)>, String> {
    let bytes = text.as_bytes();
    let mut pairs = Vec::new();
    let mut i = 0;
    let skip_space = |mut i: usize| {
        while i < bytes.len() && bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        i
    };
    loop {
        i = skip_space(i);
        if i >= bytes.len() {
            return Ok(pairs);
        }
        let start = i;
        while i < bytes.len() && bytes[i] != b'=' && !bytes[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = text[start..i].to_owned();
        i = skip_space(i);
        if bytes.get(i) != Some(&b'=') {
            // Not ours to judge: tokio-postgres' parser reports it.
            return Ok(pairs);
        }
        i = skip_space(i + 1);
        let mut value = Vec::new();
        if bytes.get(i) == Some(&b'\'') {
            i += 1;
            loop {
                match bytes.get(i) {
                    None => {
                        return Err(
                            if key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                                format!("the value of {key} has an unterminated quote")
                            } else {
                                "a value has an unterminated quote".to_owned()
                            },
                        )
                    }
                    Some(b'\'') => {
                        i += 1;
                        break;
                    }
                    Some(b'\\') if i + 1 < bytes.len() => {
                        value.push(bytes[i + 1]);
                        i += 2;
                    }
                    Some(&b) => {
                        value.push(b);
                        i += 1;
                    }
                }
            }
        } else {
            while let Some(&b) = bytes.get(i) {
                if b.is_ascii_whitespace() {
                    break;
                }
                if b == b'\\' && i + 1 < bytes.len() {
                    value.push(bytes[i + 1]);
                    i += 2;
                } else {
                    value.push(b);
                    i += 1;
                }
            }
        }
        pairs.push((start, i, key, String::from_utf8_lossy(&value).into_owned()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(url: &str) -> Result<DatabaseConfig, ValidationError> {
        parse_database_url(&PgUrl::new(url))
    }

    #[test]
    fn reads_libpq_tls_parameters_from_urls_and_key_value_strings() {
        use tokio_postgres::config::SslMode as Pg;
        let c = parse("postgres://u:p%40ss@h:6543/db?sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20x.pem&connect_timeout=3&channel_binding=require").unwrap();
        assert_eq!(c.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            c.tls.root_cert,
            Some(RootCert::File("/etc/ca x.pem".into()))
        );
        assert_eq!(c.tls.channel_binding, ChannelBindingMode::Require);
        assert_eq!(c.get_ssl_mode(), Pg::Require);
        assert_eq!(c.get_password(), Some(&b"p@ss"[..]));
        assert_eq!(
            c.get_connect_timeout(),
            Some(&std::time::Duration::from_secs(3))
        );
        let c = parse(
            "host=h user=u sslmode = verify-ca sslrootcert='/ca dir/it\\'s.pem' sslcert=/c.pem sslkey=/k.pem dbname=d",
        )
        .unwrap();
        assert_eq!(c.tls.mode, SslMode::VerifyCa);
        assert_eq!(
            c.tls.root_cert,
            Some(RootCert::File("/ca dir/it's.pem".into()))
        );
        assert_eq!(c.tls.client_cert, Some(("/c.pem".into(), "/k.pem".into())));
        assert_eq!(c.get_dbname(), Some("d"));
        // The default is prefer, as in libpq; allow starts in plaintext.
        let c = parse("postgres://u@h/db").unwrap();
        assert_eq!(
            (c.tls.mode, c.get_ssl_mode()),
            (SslMode::Prefer, Pg::Prefer)
        );
        let c = parse("postgres://u@h/db?sslmode=allow").unwrap();
        assert_eq!(
            (c.tls.mode, c.get_ssl_mode()),
            (SslMode::Allow, Pg::Disable)
        );
        // A Unix-domain socket never uses TLS (libpq ignores sslmode there).
        let c = parse("host=/tmp user=u sslmode=require").unwrap();
        assert_eq!(c.get_ssl_mode(), Pg::Disable);
        // require with a root certificate verifies the chain, as libpq does.
        let c = parse("postgres://u@h/db?sslmode=require&sslrootcert=/ca.pem").unwrap();
        assert!(c.tls.verifies_chain());
        assert!(!parse("postgres://u@h/db?sslmode=require")
            .unwrap()
            .tls
            .verifies_chain());
        let c = parse("postgres://u@h/db?sslmode=verify-full&sslrootcert=system").unwrap();
        assert_eq!(c.tls.root_cert, Some(RootCert::System));
    }

    #[test]
    fn refuses_bad_or_unsupported_tls_parameters_naming_them() {
        for (url, want) in [
            (
                "postgres://u:secret@h/db?sslmode=verify_full",
                "sslmode=verify_full is not an sslmode; use disable, allow, prefer",
            ),
            ("host=h user=u sslmode=on", "sslmode=on is not an sslmode"),
            (
                "postgres://u@h/db?channel_binding=always",
                "channel_binding=always is not a channel_binding mode",
            ),
            (
                "postgres://u@h/db?sslmode=verify-full",
                "needs sslrootcert=",
            ),
            (
                "postgres://u@h/db?sslmode=verify-ca",
                "does not read libpq's default ~/.postgresql/root.crt",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslrootcert=system",
                "sslrootcert=system needs sslmode=verify-full",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslcert=/c.pem",
                "sslcert= needs sslkey=",
            ),
            (
                "postgres://u@h/db?sslmode=require&sslkey=/k.pem",
                "sslkey= needs sslcert=",
            ),
            ("postgres://u@h/db?sslrootcert=", "sslrootcert= is empty"),
            (
                "postgres://u@h/db?sslcrl=/crl.pem",
                "sslcrl= is not supported by pgoutbox",
            ),
            (
                "postgres://u@h/db?sslnegotiation=direct",
                "sslnegotiation=direct is not supported",
            ),
            (
                "host=h user=u sslfoo=1",
                "sslfoo= is not a TLS setting pgoutbox knows",
            ),
            (
                "postgres://u@h/db?sslmode=disable&channel_binding=require",
                "channel_binding=require needs TLS",
            ),
            ("host=h user=u sslrootcert='/ca.pem", "unterminated quote"),
        ] {
            let e = parse(url).unwrap_err();
            assert_eq!(e.setting, "--database-url");
            let text = e.to_string();
            assert!(text.contains(want), "{url}: {text}");
            assert!(!text.contains("secret"), "{text}");
        }
        // Other parameters are left exactly as written for tokio-postgres' parser.
        let (rest, _) =
            split_tls_parameters("host=h  sslmode=require user='a b' sslrootcert=/x").unwrap();
        assert_eq!(rest, "host=h   user='a b' ");
        let (rest, _) =
            split_tls_parameters("postgres://u@h/db?sslmode=require&application_name=x%20y")
                .unwrap();
        assert_eq!(rest, "postgres://u@h/db?application_name=x%20y");
    }

    #[test]
    fn an_unknown_parameter_or_a_bad_value_is_named_with_its_value_never_a_password() {
        for (conn, want) in [
            // An unknown key's value may be a misspelt secret key's: named, not shown.
            ("postgres://u:secret@h/db?foo=bar", "unknown parameter foo=***"),
            ("host=h user=u password=secret foo=bar", "unknown parameter foo=***"),
            (
                "postgres://u:secret@h/db?port=abc",
                "port=\"abc\" is not a valid port: write a port number from 1 to 65535",
            ),
            (
                "postgres://u:secret@h:abc/db",
                "port=\"abc\" is not a valid port: write a port number from 1 to 65535",
            ),
            (
                "postgres://u:secret@h1:5432,[::1]:abc/db",
                "port=\"5432,abc\" is not a valid port",
            ),
            (
                "postgres://u:secret@x@h1:5432/db",
                "more than one '@' before the host",
            ),
            (
                "host=h port=5432,abc user=u",
                "port=\"5432,abc\" is not a valid port",
            ),
            (
                "postgres://u@h/db?connect_timeout=soon",
                "connect_timeout=\"soon\" is not a valid connect_timeout: write whole seconds",
            ),
            (
                "postgres://u@h/db?target_session_attrs=primary",
                "target_session_attrs=\"primary\" is not a valid target_session_attrs: write any, read-write or read-only",
            ),
        ] {
            let e = parse(conn).unwrap_err();
            assert_eq!(e.setting, "--database-url");
            let text = e.to_string();
            assert!(text.contains(want), "{conn}: {text}");
            assert!(!text.contains("secret"), "{conn}: {text}");
        }
        let text = parse("postgres://u@h/db?foo=bar").unwrap_err().to_string();
        assert!(
            text.contains("remove it or fix its name")
                && text.contains("application_name")
                && text.contains("sslmode"),
            "{text}"
        );
    }
}
