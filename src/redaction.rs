//! Passwords out of what is shown: a URL (or a connection string that is not one) with its
//! password masked, for logs, errors and `Debug`. Pure text; every layer that shows a URL
//! (the settings, the publisher's socket, `check`) uses this one function.

/// The query parameters (and key=value keywords) whose values are shown: libpq's and
/// amqp://'s settings that never hold a secret. Every other key's value is masked, a
/// misspelt `sslpasword=` or an unknown key included: what cannot be named safe is not
/// shown (issue 32, item 1).
const SHOWN_KEYS: &[&str] = &[
    "sslmode",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "channel_binding",
    "dbname",
    "host",
    "hostaddr",
    "port",
    "user",
    "application_name",
    "connect_timeout",
    "tcp_user_timeout",
    "keepalives",
    "keepalives_idle",
    "keepalives_interval",
    "keepalives_retries",
    "target_session_attrs",
    "load_balance_hosts",
    "heartbeat",
    "channel_max",
    "frame_max",
    "connection_timeout",
    "auth_mechanism",
    "cacertfile",
    "certfile",
    "keyfile",
    "verify",
    "server_name_indication",
    "sslnegotiation",
    "sslsni",
    "sslcompression",
    "sslcrl",
    "sslcrldir",
    "ssl_min_protocol_version",
    "ssl_max_protocol_version",
    "gssencmode",
    "requirepeer",
    "replication",
];

/// Whether the value of `key` may be shown ([`SHOWN_KEYS`]).
pub fn is_shown_key(key: &str) -> bool {
    SHOWN_KEYS.contains(&key)
}

/// The form of a connection string that may be shown, in logs, errors and `Debug`: built so
/// that it cannot show a secret, whatever the input. For a URL (or what a typo left of
/// one): everything between the user and the **last** `@` of the text is masked (a
/// password, an unencoded `@` in it, a list whose first URL has a typo), and each query
/// value is masked unless its key is one of [`SHOWN_KEYS`]. For a libpq key=value string:
/// each value is masked unless its key is one of [`SHOWN_KEYS`]; one that does not
/// tokenize is not shown at all. A URL without anything to mask is returned as written (not
/// normalised), so an error shows the value the operator typed.
pub fn redact_url(url: &str) -> String {
    if !url.contains("://") && url.contains('=') {
        return redact_keywords(url);
    }
    let (authority_end, query) = match url.rfind('@') {
        // The query is what follows the first '?' after the last '@' (or the start).
        Some(at) => match url[at..].find('?') {
            Some(q) => (at + q, Some(&url[at + q + 1..])),
            None => (url.len(), None),
        },
        None => match url.find('?') {
            Some(q) => (q, Some(&url[q + 1..])),
            None => (url.len(), None),
        },
    };
    let mut shown = mask_userinfo(&url[..authority_end]);
    if let Some(query) = query {
        shown.push('?');
        shown.push_str(&redact_query(query));
    }
    shown
}

/// `scheme://user:***@host...` for the text before the query: keeps a scheme (letters,
/// digits, `+.-`, then `://`), the user (up to the first ':') and what follows the last
/// '@'; masks everything between. Without an '@' there is no userinfo and the text is
/// kept; with one and no ':' before it, `***@` replaces all before it but the scheme (a
/// user holding an '@' is not told from a password).
fn mask_userinfo(text: &str) -> String {
    let Some(at) = text.rfind('@') else {
        return mask_glued_keywords(text);
    };
    let (scheme, rest) = match text.split_once("://") {
        Some((scheme, rest))
            if scheme.len() < at
                && scheme
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c)) =>
        {
            (&text[..scheme.len() + 3], rest)
        }
        _ => ("", text),
    };
    let userinfo = &rest[..at - scheme.len()];
    let host = mask_glued_keywords(&text[at + 1..]);
    // A user is shown only when it looks like one: what a typo leaves before the first ':'
    // may be a key=value string or another URL.
    let plain = |user: &str| {
        !user.is_empty()
            && user
                .chars()
                .all(|c| c.is_alphanumeric() || "._-%+/!$*~".contains(c))
    };
    match userinfo.split_once(':') {
        Some((user, _)) if plain(user) => format!("{scheme}{user}:***@{host}"),
        None if plain(userinfo) => format!("{scheme}{userinfo}@{host}"),
        _ => format!("{scheme}***@{host}"),
    }
}

/// What follows a URL's last '@' (or a URL without one), before its query: kept up to
/// whatever cannot be part of hosts and a path (whitespace or an '=': a key=value string
/// glued on), which is masked from the ',' or ';' before it.
fn mask_glued_keywords(text: &str) -> String {
    match text.find(|c: char| c.is_whitespace() || c == '=') {
        None => text.to_owned(),
        Some(bad) => {
            let cut = text[..bad].rfind([',', ';']).unwrap_or(bad);
            format!("{}***", &text[..cut])
        }
    }
}

/// Words of a connection string that name, never hold, a secret (besides [`SHOWN_KEYS`]):
/// an error may quote them.
const NAMES: &[&str] = &[
    "password",
    "sslpassword",
    "postgres",
    "postgresql",
    "amqp",
    "amqps",
    "options",
];

/// `text` (an error's words about `input`) when every piece of `input` it quotes is one that
/// `shown` ([`redact_url`]'s form of `input`) shows too, else `fallback`: the last guard
/// that an error about a connection string is built from its redacted form only. A piece is
/// a run of 3 or more letters and digits (a password's, say) that the redacted form hides.
pub fn only_shown(text: String, input: &str, shown: &str, fallback: &str) -> String {
    let quotes_hidden = input.split(|c: char| !c.is_alphanumeric()).any(|piece| {
        piece.chars().count() >= 3
            && !shown.contains(piece)
            && !is_shown_key(piece)
            && !NAMES.contains(&piece)
            && text.contains(piece)
    });
    if quotes_hidden {
        fallback.to_owned()
    } else {
        text
    }
}

/// Whether a value of a [`SHOWN_KEYS`] key looks like one alone: no whitespace, '=' or '@'
/// (which would be more text glued on by a typo).
fn plain_value(value: &str) -> bool {
    !value.contains(|c: char| c.is_whitespace() || c == '=' || c == '@')
}

/// A value of a setting whose values never hold a secret, for an error about it: as written
/// when it looks like one value alone ([`plain_value`], at most 64 bytes), else `***` (a
/// typo glued more text onto it, which may hold a password).
pub fn shown_value(value: &str) -> &str {
    if plain_value(value) && value.len() <= 64 {
        value
    } else {
        "***"
    }
}

/// A URL's query with every value masked but those of [`SHOWN_KEYS`] (compared after
/// percent-decoding the key).
fn redact_query(query: &str) -> String {
    query
        .split('&')
        .map(|pair| match pair.split_once('=') {
            Some((key, value)) => {
                let decoded = percent_encoding::percent_decode_str(key).decode_utf8_lossy();
                if is_shown_key(&decoded) && plain_value(value) {
                    pair.to_owned()
                } else {
                    format!("{key}=***")
                }
            }
            None => pair.to_owned(),
        })
        .collect::<Vec<_>>()
        .join("&")
}

/// A libpq key=value string with every value masked but those of [`SHOWN_KEYS`]; one that
/// does not tokenize (an unclosed quote, a key without `=`) is not shown at all.
fn redact_keywords(text: &str) -> String {
    const HIDDEN: &str =
        "<connection string not shown: it does not parse, and may hold a password>";
    let mut out = Vec::new();
    let mut rest = text.trim_start();
    while !rest.is_empty() {
        let Some(eq) = rest.find('=') else {
            return HIDDEN.into();
        };
        let key = rest[..eq].trim_end();
        if key.is_empty() || !key.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return HIDDEN.into();
        }
        let value_text = rest[eq + 1..].trim_start();
        let (value, after) = if let Some(quoted) = value_text.strip_prefix('\'') {
            let mut end = None;
            let mut escaped = false;
            for (i, c) in quoted.char_indices() {
                match c {
                    _ if escaped => escaped = false,
                    '\\' => escaped = true,
                    '\'' => {
                        end = Some(i);
                        break;
                    }
                    _ => {}
                }
            }
            let Some(end) = end else {
                return HIDDEN.into();
            };
            (&value_text[..end + 2], &quoted[end + 1..])
        } else {
            let end = value_text
                .find(char::is_whitespace)
                .unwrap_or(value_text.len());
            (&value_text[..end], &value_text[end..])
        };
        if is_shown_key(key) && plain_value(value) {
            out.push(format!("{key}={value}"));
        } else {
            out.push(format!("{key}=***"));
        }
        rest = after.trim_start();
    }
    out.join(" ")
}

/// Whether an '@' appears after the host of `url` (in its path, query or fragment): a
/// second URL glued on by a typo in a comma-separated list, say
/// `amqp://u:p@h1/%2f,amqp//u:PW@h2`, whose password would become part of the first URL's
/// vhost. A literal '@' there is written `%40`.
pub fn at_after_authority(url: &str) -> bool {
    let Some((_, rest)) = url.split_once("://") else {
        return false;
    };
    // The authority ends at the first '/', '?' or '#' after its last '@' (a password may
    // hold an unescaped '@', never one of these).
    let host_at = rest.find(['/', '?', '#']).map_or(rest.len(), |end| {
        rest[..end].rfind('@').map_or(0, |at| at + 1)
    });
    rest[host_at..]
        .find(['/', '?', '#'])
        .is_some_and(|end| rest[host_at + end..].contains('@'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redacts_passwords() {
        assert_eq!(
            redact_url("postgres://u:secret@h:5/db"),
            "postgres://u:***@h:5/db"
        );
        assert!(!redact_url("amqp://guest:guest@h/%2f").contains("guest@"));
        // Unparseable, with a password: masked all the same.
        assert_eq!(
            redact_url("amqp://g:s3cr@t@h:99999999/%2f"),
            "amqp://g:***@h:99999999/%2f"
        );
        assert_eq!(
            redact_url("postgres://日:é@[::1/db"),
            "postgres://日:***@[::1/db"
        );
        // A secret query key, misspelt or not, and an unknown one: masked.
        assert_eq!(
            redact_url("postgres://u@h/db?sslmode=require&sslpasword=PW&x=PW"),
            "postgres://u@h/db?sslmode=require&sslpasword=***&x=***"
        );
        assert_eq!(
            redact_url("host=h password='a b' port=5"),
            "host=h password=*** port=5"
        );
        assert_eq!(
            redact_url("host='h password=PW"),
            "<connection string not shown: it does not parse, and may hold a password>"
        );
        // Without a password, the text as written.
        assert_eq!(redact_url("postgres://u@h/é"), "postgres://u@h/é");
    }

    #[test]
    fn malformed_urls_never_show_their_password() {
        for url in [
            "amqp//u:PW@host/%2f",
            "amqp:/u:PW@host/%2f",
            "amqp:u:PW@host",
            "u:PW@host:5672/%2f",
            "postgres//u:PW@host/db",
            "postgres:/u:PW@host/db",
            "amqp://a:b@h1/%2f,amqp//u:PW@h2/%2f",
            "amqp://a:b@h1/%2f?heartbeat=5,amqp:/u:PW@h2",
            "postgres://a:b@h1/db,postgres//u:PW@h2/db",
            "host=h password=PW",
            "postgres://u@h:999999/db?password=PW",
        ] {
            let shown = redact_url(url);
            assert!(!shown.contains("PW"), "{url} -> {shown}");
        }
        assert_eq!(redact_url("amqp//u:PW@host/%2f"), "amqp//u:***@host/%2f");
        assert!(at_after_authority("amqp://a:b@h1/%2f,amqp//u:PW@h2"));
        assert!(at_after_authority("amqp://h1?x=1,amqp//u:PW@h2"));
        assert!(!at_after_authority("amqp://g:s3cr@t@h:5672/%2f"));
        assert!(!at_after_authority("amqp://h/%2f"));
    }
}
