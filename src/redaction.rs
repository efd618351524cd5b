//! Passwords out of what is shown: a URL (or a connection string that is not one) with its
//! password masked, for logs, errors and `Debug`. Pure text; every layer that shows a URL
//! (the settings, the publisher's socket, `check`) uses this one function.

/// Replaces the password in a URL with `***` for logs and `Debug`; a URL without one is
/// returned as written (not normalised), so an error shows the value the operator typed.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        // A URL with credentials where they belong, and nothing that looks like more of
        // them after its host.
        Ok(u) if u.has_host() && !at_after_authority(url) => {
            if u.password().is_none() && !u.query_pairs().any(|(k, _)| k == "password") {
                return url.to_owned();
            }
            redact_parsed(u)
        }
        // Malformed (`amqp//u:pw@h`, `amqp:/u:pw@h`, no scheme, a second URL glued on
        // after a typo, a bad port): whatever lies before the last '@' may be a password;
        // a `password=` (key=value, a query) hides the whole text.
        _ => match mask_before_last_at(url) {
            masked if masked.contains("password") => "<redacted connection string>".into(),
            masked => masked,
        },
    }
}

/// Masks the password of a parsed URL, and a `?password=` (which libpq also reads).
fn redact_parsed(mut u: url::Url) -> String {
    if u.password().is_some() {
        let _ = u.set_password(Some("***"));
    }
    if u.query_pairs().any(|(k, _)| k == "password") {
        let pairs: Vec<(String, String)> = u
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" {
                    "***".into()
                } else {
                    v.into_owned()
                };
                (k.into_owned(), v)
            })
            .collect();
        u.query_pairs_mut().clear().extend_pairs(pairs);
    }
    u.to_string()
}

/// `scheme://user:***@host...`: keeps the scheme (when written with `://`), the user and
/// what follows the last '@'; masks everything between the first ':' after the scheme and
/// that '@' (indices of ASCII characters, so always character boundaries). Text without an
/// '@' carries no userinfo and is kept; with an '@' and no ':' before it, only a user.
fn mask_before_last_at(url: &str) -> String {
    let Some((before, host)) = url.rsplit_once('@') else {
        return url.to_owned();
    };
    let (scheme, rest) = match before.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), before),
    };
    match rest.split_once(':') {
        Some((user, _)) => format!("{scheme}{user}:***@{host}"),
        None => url.to_owned(),
    }
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
