//! Secrets out of argv: connection strings read from files (`--database-url-file`,
//! `--amqp-url-file`, the container-secret convention), a password alone read from a file
//! (`--database-password-file`, `--amqp-password-file`) and put into the connection string,
//! the AMQP TLS files as flags (`--amqp-ca-file`, `--amqp-cert-file`, `--amqp-key-file`),
//! and [`Secret`], a string whose `Debug` never shows a password.
//!
//! Every function here is pure apart from reading the named files, and every failure is a
//! [`ValidationError`] naming the flag (and so its environment variable), the value (a path,
//! or a redacted URL) and the fix. No error or `Debug` output of this module carries a
//! password.

use std::path::{Path, PathBuf};

use crate::redaction::redact_url;
use crate::validation::ValidationError;

/// A connection string that may carry a password: `Debug` shows it redacted
/// ([`redact_url`]), so a derived `Debug` of the CLI structs never prints it.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", redact_url(&self.0))
    }
}

impl From<String> for Secret {
    fn from(s: String) -> Self {
        Secret(s)
    }
}

/// Which connection string is being put together: the flags that name its parts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// `--database-url`, `--database-url-file`, `--database-password-file`.
    Postgres,
    /// `--amqp-url`, `--amqp-url-file`, `--amqp-password-file`.
    Amqp,
}

impl Target {
    /// The flag of the connection string itself.
    pub fn url_flag(self) -> &'static str {
        match self {
            Target::Postgres => "--database-url",
            Target::Amqp => "--amqp-url",
        }
    }

    /// The flag of the file holding the connection string.
    pub fn file_flag(self) -> &'static str {
        match self {
            Target::Postgres => "--database-url-file",
            Target::Amqp => "--amqp-url-file",
        }
    }

    /// The flag of the file holding the password alone.
    pub fn password_flag(self) -> &'static str {
        match self {
            Target::Postgres => "--database-password-file",
            Target::Amqp => "--amqp-password-file",
        }
    }
}

/// Where the parts of one connection string come from (any of them may be unset).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sources {
    /// The connection string itself (`--database-url` / `--amqp-url`).
    pub url: Option<Secret>,
    /// A file holding it (`--database-url-file` / `--amqp-url-file`).
    pub url_file: Option<PathBuf>,
    /// A file holding the password alone (`--database-password-file` / `--amqp-password-file`).
    pub password_file: Option<PathBuf>,
}

/// Reads a secret file: its text without the trailing newline(s) an editor or `echo` adds
/// (`\n` or `\r\n`; other whitespace is kept, a password may end in a space).
///
/// # Errors
/// [`ValidationError`] for `setting` naming the path: unreadable (with the OS reason), not
/// UTF-8, or empty.
pub fn read_secret_file(setting: &'static str, path: &Path) -> Result<String, ValidationError> {
    let bad = |rule: String| ValidationError {
        setting,
        value: path.display().to_string(),
        rule,
    };
    let bytes = std::fs::read(path).map_err(|e| {
        bad(format!(
            "cannot read the file ({e}); fix the path, or the file's permissions for the user pgoutbox runs as"
        ))
    })?;
    let text = String::from_utf8(bytes)
        .map_err(|_| bad("the file is not UTF-8 text; write the value as text".into()))?;
    let text = text.trim_end_matches(['\n', '\r']);
    if text.is_empty() {
        return Err(bad("the file is empty; write the value into it".into()));
    }
    Ok(text.to_owned())
}

/// Puts the connection string together: from the flag or from its file (exactly one), then
/// with the password from the password file, when one is named.
///
/// # Errors
/// [`ValidationError`]: neither or both of the string and its file, an unreadable file, a
/// password file for a connection string that already has a password or no user.
pub fn resolve(target: Target, sources: &Sources) -> Result<String, ValidationError> {
    let (url, url_flag) = match (&sources.url, &sources.url_file) {
        (Some(_), Some(file)) => {
            return Err(ValidationError {
                setting: target.file_flag(),
                value: file.display().to_string(),
                rule: format!(
                    "{} is given too; give the connection string one way only (unset one of them)",
                    target.url_flag()
                ),
            })
        }
        (Some(url), None) => (url.0.clone(), target.url_flag()),
        (None, Some(file)) => (
            read_secret_file(target.file_flag(), file)?,
            target.file_flag(),
        ),
        (None, None) => {
            return Err(ValidationError {
                setting: target.url_flag(),
                value: String::new(),
                rule: format!(
                    "missing: pass it, or name a file holding it with {} ({})",
                    target.file_flag(),
                    crate::validation::env_of(target.file_flag()).unwrap_or_default()
                ),
            })
        }
    };
    match &sources.password_file {
        None => Ok(url),
        Some(file) => {
            if has_password(&url) {
                return Err(ValidationError {
                    setting: target.password_flag(),
                    value: file.display().to_string(),
                    rule: format!(
                        "{url_flag} {} already has a password; give the password one way only: remove it from {url_flag}, or drop {}",
                        redact_url(&url),
                        target.password_flag()
                    ),
                });
            }
            let password = read_secret_file(target.password_flag(), file)?;
            add_password(target, url_flag, &url, &password)
        }
    }
}

/// Whether a connection string (URL or keyword/value) carries a password.
pub fn has_password(conn: &str) -> bool {
    if is_url(conn) {
        match url::Url::parse(conn) {
            Ok(u) => u.password().is_some() || u.query_pairs().any(|(k, _)| k == "password"),
            // Unparseable: assume the worst when it looks like user:secret@.
            Err(_) => redact_url(conn) != conn,
        }
    } else {
        conn.parse::<tokio_postgres::Config>()
            .map(|c| c.get_password().is_some())
            .unwrap_or_else(|_| conn.contains("password"))
    }
}

fn is_url(conn: &str) -> bool {
    conn.contains("://")
}

/// `conn` (a `postgres://` URL or a keyword/value string) with `password` added: in a URL's
/// userinfo, percent-encoded (as a `password=` query parameter when the URL has no host,
/// e.g. `postgres:///db?host=/run/postgresql`); in a keyword/value string as a quoted
/// `password='...'` with `\` and `'` escaped, as libpq reads it.
///
/// # Errors
/// [`ValidationError`] for `--database-url` (its value redacted) when the string already
/// has a password or does not parse.
pub fn with_postgres_password(conn: &str, password: &str) -> Result<String, ValidationError> {
    add_password(
        Target::Postgres,
        Target::Postgres.url_flag(),
        conn,
        password,
    )
}

/// `conn` with `password` added ([`with_postgres_password`] for Postgres, the userinfo of
/// an `amqp://` URL). `url_flag` is where `conn` came from (the URL's flag or its file's),
/// named in the error with `conn` redacted; the rule names the password's flag.
fn add_password(
    target: Target,
    url_flag: &'static str,
    conn: &str,
    password: &str,
) -> Result<String, ValidationError> {
    let password_flag = target.password_flag();
    let bad = |rule: String| ValidationError {
        setting: url_flag,
        value: redact_url(conn),
        rule,
    };
    if has_password(conn) {
        return Err(bad(format!(
            "already has a password, and {password_flag} gives one too; give the password one way only: remove it from {url_flag}, or drop {password_flag}"
        )));
    }
    if target == Target::Postgres && !is_url(conn) {
        let quoted = password.replace('\\', "\\\\").replace('\'', "\\'");
        return Ok(format!("{conn} password='{quoted}'"));
    }
    let mut u = url::Url::parse(conn).map_err(|e| {
        bad(format!(
            "not a URL ({e}), so the password of {password_flag} cannot be put into it"
        ))
    })?;
    if u.username().is_empty() && target == Target::Amqp {
        return Err(bad(format!(
            "names no user for the password of {password_flag}; write amqp://USER@host/..."
        )));
    }
    // Without a user in the userinfo (it may be a `user=` parameter) or without a host,
    // userinfo cannot carry the password.
    if u.username().is_empty() || u.set_password(Some(password)).is_err() {
        // No host to carry userinfo (a Unix socket given as ?host=): libpq also reads the
        // password as a parameter.
        if target == Target::Postgres {
            // Percent-encoded, a space as %20: libpq and tokio-postgres do not read `+`.
            let encoded = url::form_urlencoded::byte_serialize(password.as_bytes())
                .collect::<String>()
                .replace('+', "%20");
            let query = match u.query() {
                Some(q) if !q.is_empty() => format!("{q}&password={encoded}"),
                _ => format!("password={encoded}"),
            };
            u.set_query(Some(&query));
        } else {
            return Err(bad(format!(
                "has no host, so it cannot carry the password of {password_flag}"
            )));
        }
    }
    Ok(u.to_string())
}

/// The AMQP TLS files given as flags (`--amqp-ca-file`, `--amqp-cert-file`,
/// `--amqp-key-file`); each is RabbitMQ's URL parameter of the same meaning.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AmqpTlsFiles {
    /// `cacertfile=`: PEM CA certificates to trust instead of the system's.
    pub ca_file: Option<PathBuf>,
    /// `certfile=`: the client certificate chain (PEM).
    pub cert_file: Option<PathBuf>,
    /// `keyfile=`: the client certificate's private key (PEM).
    pub key_file: Option<PathBuf>,
}

/// `amqp_url` with the TLS flags added as its query parameters, so the publisher reads one
/// set of options. A flag whose parameter the URL already has with the same value changes
/// nothing.
///
/// # Errors
/// [`ValidationError`] naming the flag: the URL is not `amqps://`, or has the parameter
/// with another value (both are named).
pub fn with_amqp_tls_files(
    amqp_url: &str,
    files: &AmqpTlsFiles,
) -> Result<String, ValidationError> {
    let flags = [
        ("--amqp-ca-file", "cacertfile", &files.ca_file),
        ("--amqp-cert-file", "certfile", &files.cert_file),
        ("--amqp-key-file", "keyfile", &files.key_file),
    ];
    if flags.iter().all(|(_, _, v)| v.is_none()) {
        return Ok(amqp_url.to_owned());
    }
    let mut u = url::Url::parse(amqp_url).map_err(|e| ValidationError {
        setting: "--amqp-url",
        value: redact_url(amqp_url),
        rule: format!("not an AMQP URL ({e}); expected amqps://user:password@host:port/vhost"),
    })?;
    for (flag, key, value) in flags {
        let Some(path) = value else { continue };
        let path_text = path.to_str().ok_or_else(|| ValidationError {
            setting: flag,
            value: path.display().to_string(),
            rule: "the path is not UTF-8; use a UTF-8 path".into(),
        })?;
        if path_text.is_empty() {
            return Err(ValidationError {
                setting: flag,
                value: String::new(),
                rule: "is empty; give the path of a PEM file".into(),
            });
        }
        if u.scheme() != "amqps" {
            return Err(ValidationError {
                setting: flag,
                value: path_text.to_owned(),
                rule: format!(
                    "is a TLS setting, and --amqp-url {} does not use TLS; use amqps:// (RabbitMQ's TLS listener, port 5671 by default)",
                    redact_url(amqp_url)
                ),
            });
        }
        let existing: Vec<String> = u
            .query_pairs()
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v.into_owned())
            .collect();
        match existing.first() {
            Some(v) if v == path_text => {}
            Some(v) => {
                return Err(ValidationError {
                    setting: flag,
                    value: path_text.to_owned(),
                    rule: format!(
                        "conflicts with {key}={v} in --amqp-url; give the file one way only (drop {key}= from the URL or the flag)"
                    ),
                })
            }
            None => {
                u.query_pairs_mut().append_pair(key, path_text);
            }
        }
    }
    Ok(u.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    const PW: &str = "Tr0ub4dor&3 'x' \\y@z:/?#%";

    fn temp_file(name: &str, content: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pgoutbox-secrets-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn files_lose_their_trailing_newline_only() {
        let p = temp_file("a", "postgres://u@h/db\n");
        assert_eq!(
            read_secret_file("--database-url-file", &p).unwrap(),
            "postgres://u@h/db"
        );
        let p = temp_file("b", "pw \r\n");
        assert_eq!(read_secret_file("--x", &p).unwrap(), "pw ");
        let e = read_secret_file("--database-url-file", Path::new("/nonexistent/url")).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("--database-url-file (PGOUTBOX_DATABASE_URL_FILE)")
                && text.contains("/nonexistent/url")
                && text.contains("cannot read"),
            "{text}"
        );
        let p = temp_file("c", "\n");
        assert!(read_secret_file("--x", &p)
            .unwrap_err()
            .to_string()
            .contains("empty"));
    }

    #[test]
    fn url_and_file_are_exclusive_and_one_is_needed() {
        let file = temp_file("u", "amqp://g:g@h/%2f\n");
        let both = Sources {
            url: Some(Secret("amqp://g:hunter2@h".into())),
            url_file: Some(file.clone()),
            password_file: None,
        };
        let e = resolve(Target::Amqp, &both).unwrap_err().to_string();
        assert!(
            e.contains("--amqp-url-file") && e.contains("--amqp-url is given too"),
            "{e}"
        );
        assert!(!e.contains("hunter2"), "{e}");
        let e = resolve(Target::Postgres, &Sources::default())
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing") && e.contains("PGOUTBOX_DATABASE_URL_FILE"),
            "{e}"
        );
        let from_file = Sources {
            url_file: Some(file),
            ..Sources::default()
        };
        assert_eq!(
            resolve(Target::Amqp, &from_file).unwrap(),
            "amqp://g:g@h/%2f"
        );
    }

    #[test]
    fn passwords_are_encoded_into_urls_and_quoted_into_keyword_strings() {
        let url = with_postgres_password("postgres://u@h:5432/db", PW).unwrap();
        let parsed: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(PW.as_bytes()));
        assert_eq!(parsed.get_hosts().len(), 1);
        assert_eq!(parsed.get_dbname(), Some("db"));
        // No host: a password= parameter.
        let url = with_postgres_password("postgres:///db?host=/tmp&user=u", PW).unwrap();
        let parsed: tokio_postgres::Config = url.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(PW.as_bytes()));
        assert!(
            !redact_url(&url).contains("Tr0ub4dor"),
            "{}",
            redact_url(&url)
        );
        let kv = with_postgres_password("host=h user=u dbname=db", PW).unwrap();
        let parsed: tokio_postgres::Config = kv.parse().unwrap();
        assert_eq!(parsed.get_password(), Some(PW.as_bytes()));
        let amqp = add_password(Target::Amqp, "--amqp-url", "amqp://g@h:5672/%2f", PW).unwrap();
        let parsed = url::Url::parse(&amqp).unwrap();
        let password = percent_encoding::percent_decode_str(parsed.password().unwrap())
            .decode_utf8()
            .unwrap();
        assert_eq!((parsed.username(), password.as_ref()), ("g", PW));
        // Twice is a conflict, without showing either password.
        for (conn, target) in [
            ("postgres://u:old@h/db", Target::Postgres),
            ("host=h user=u password=old", Target::Postgres),
            ("amqp://g:old@h/%2f", Target::Amqp),
        ] {
            let e = match target {
                Target::Postgres => with_postgres_password(conn, PW),
                Target::Amqp => add_password(target, "--amqp-url", conn, PW),
            }
            .unwrap_err()
            .to_string();
            assert!(e.contains("already has a password"), "{e}");
            assert!(!e.contains("old") && !e.contains("Tr0ub4dor"), "{e}");
        }
        let e = add_password(Target::Amqp, "--amqp-url", "amqp://h/%2f", PW).unwrap_err();
        assert!(e.to_string().contains("no user"), "{e}");
    }

    #[test]
    fn password_file_conflict_names_the_file_the_url_and_the_fix() {
        let file = temp_file("pw", &format!("{PW}\n"));
        let path = file.display().to_string();
        for (target, conn, shown) in [
            (
                Target::Postgres,
                "postgres://u:old@h/db",
                "--database-url postgres://u:***@h/db",
            ),
            (
                Target::Postgres,
                "host=h user=u password=old",
                "--database-url host=h user=u password=***",
            ),
            (
                Target::Amqp,
                "amqp://g:old@h/%2f",
                "--amqp-url amqp://g:***@h/%2f",
            ),
        ] {
            let sources = Sources {
                url: Some(Secret(conn.into())),
                url_file: None,
                password_file: Some(file.clone()),
            };
            let e = resolve(target, &sources).unwrap_err().to_string();
            let flag = target.password_flag();
            let env = crate::validation::env_of(flag).unwrap();
            assert!(
                e.starts_with(&format!("invalid setting {flag} ({env}) = {path:?}:")),
                "{e}"
            );
            assert!(
                e.contains(&format!("{shown} already has a password")),
                "{e}"
            );
            assert!(
                e.contains(&format!(
                    "remove it from {}, or drop {flag}",
                    target.url_flag()
                )),
                "{e}"
            );
            assert!(!e.contains("old") && !e.contains("Tr0ub4dor"), "{e}");
        }
    }

    #[test]
    fn tls_flags_become_url_parameters_and_conflicts_name_both() {
        let files = AmqpTlsFiles {
            ca_file: Some("/etc/ca.pem".into()),
            ..AmqpTlsFiles::default()
        };
        let url = with_amqp_tls_files("amqps://g:g@h/%2f", &files).unwrap();
        let query = |url: &str| -> Vec<(String, String)> {
            url::Url::parse(url)
                .unwrap()
                .query_pairs()
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect()
        };
        assert_eq!(query(&url), [("cacertfile".into(), "/etc/ca.pem".into())]);
        // The same value twice is fine.
        assert!(with_amqp_tls_files("amqps://h/%2f?cacertfile=/etc/ca.pem", &files).is_ok());
        let e = with_amqp_tls_files("amqps://g:secret@h/%2f?cacertfile=/other.pem", &files)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--amqp-ca-file (PGOUTBOX_AMQP_CA_FILE)")
                && e.contains("/etc/ca.pem")
                && e.contains("cacertfile=/other.pem in --amqp-url"),
            "{e}"
        );
        let e = with_amqp_tls_files("amqp://g:secret@h/%2f", &files)
            .unwrap_err()
            .to_string();
        assert!(e.contains("amqps://") && !e.contains("secret"), "{e}");
        let both = AmqpTlsFiles {
            cert_file: Some("/c.pem".into()),
            key_file: Some("/k.pem".into()),
            ..AmqpTlsFiles::default()
        };
        let url = with_amqp_tls_files("amqps://h/%2f", &both).unwrap();
        assert_eq!(
            query(&url),
            [
                ("certfile".into(), "/c.pem".into()),
                ("keyfile".into(), "/k.pem".into())
            ]
        );
    }

    #[test]
    fn secret_debug_is_redacted() {
        let s = Secret("postgres://u:hunter2@h/db".into());
        assert!(!format!("{s:?}").contains("hunter2"));
        let s = Secret("host=h password=hunter2".into());
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
