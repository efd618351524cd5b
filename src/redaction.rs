//! Passwords out of what is shown: a URL (or a connection string that is not one) with its
//! password masked, for logs, errors and `Debug`. Pure text; every layer that shows a URL
//! (the settings, the publisher's socket, `check`) uses this one function.

/// Replaces the password in a URL with `***` for logs and `Debug`; a URL without one is
/// returned as written (not normalised), so an error shows the value the operator typed.
pub fn redact_url(url: &str) -> String {
    match url::Url::parse(url) {
        Ok(mut u) if u.password().is_some() || u.query_pairs().any(|(k, _)| k == "password") => {
            if u.password().is_some() {
                let _ = u.set_password(Some("***"));
            }
            // libpq also reads `?password=`.
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
        Ok(_) => url.to_owned(),
        Err(_) if url.contains("password") => "<redacted connection string>".into(),
        // Not a URL the parser accepts, yet it may carry `user:secret@`: mask what lies
        // between the first ':' after the scheme and the last '@' (indices of ASCII
        // characters, so always character boundaries).
        Err(_) => match url.split_once("://") {
            Some((scheme, rest)) => match rest.rsplit_once('@') {
                Some((userinfo, host)) => match userinfo.split_once(':') {
                    Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                    None => url.to_owned(),
                },
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
    }
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
}
