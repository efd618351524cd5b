//! The publisher layer's error: connecting, TLS, the broker's refusals, and the
//! connection's failures, each naming what to change.

/// An error of the publisher layer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The AMQP URL is not usable.
    #[error("invalid AMQP URL: {0}")]
    Url(String),
    /// Connecting failed: TCP, the AMQP handshake (a TLS listener reached with `amqp://`
    /// among the causes), or a close the broker sent during it. Retryable.
    #[error("RabbitMQ at {url}: {context}; check host, port, user, password and vhost in --amqp-url (PGOUTBOX_AMQP_URL) and that RabbitMQ is running")]
    Connect {
        /// The redacted URL.
        url: String,
        /// What failed.
        context: String,
    },
    /// The broker refused the login (403 `ACCESS_REFUSED`: wrong user or password) or the
    /// vhost (530 `NOT_ALLOWED`: missing vhost, or no permission on it). Definite: retrying
    /// cannot fix it.
    #[error("RabbitMQ at {url} refused the connection with {reply_code} {reply_text}; {fix}")]
    Refused {
        /// The redacted URL.
        url: String,
        /// The broker's reply code, e.g. 403.
        reply_code: u16,
        /// The broker's reply text, e.g. `ACCESS_REFUSED - Login was refused ...`.
        reply_text: String,
        /// What to change.
        fix: String,
    },
    /// A TLS file named in the URL (`cacertfile=`, `certfile=`, `keyfile=`) cannot be used,
    /// or the system trust store holds no CA certificate. Definite: the same file fails
    /// again.
    #[error("amqps: cannot use {what} from --amqp-url (PGOUTBOX_AMQP_URL): {reason}; {fix}")]
    TlsSetup {
        /// The setting and its value (`cacertfile=/etc/ca.pem`), or "the system trust store".
        what: String,
        /// What is wrong with it.
        reason: String,
        /// What to change.
        fix: &'static str,
    },
    /// The TLS handshake failed: the broker's certificate did not verify (unknown CA, wrong
    /// name, expired), the port is not a TLS listener, or the broker sent an alert.
    /// Retryable: a broker's certificate or listener can change while we wait.
    #[error("RabbitMQ at {url}: {context}; {fix}")]
    Tls {
        /// The redacted URL.
        url: String,
        /// What happened, with rustls' reason.
        context: String,
        /// What to change.
        fix: String,
    },
    /// The AMQP handshake did not finish in time (the host accepted TCP and never answered,
    /// or nobody answered). Retryable.
    #[error("RabbitMQ: connecting to {url} timed out after {timeout_s} s: the AMQP handshake did not finish; check host and port in --amqp-url (PGOUTBOX_AMQP_URL) and that RabbitMQ is running and answering there")]
    ConnectTimeout {
        /// The redacted URL.
        url: String,
        /// The timeout, in seconds.
        timeout_s: u64,
    },
    /// The broker refused `exchange.declare`: 406 PRECONDITION_FAILED when the exchange
    /// exists with another type or durability, 403 ACCESS_REFUSED when the user may not
    /// configure it.
    #[error("could not declare exchange {exchange:?} (durable topic): RabbitMQ answered {reply_code} {reply_text}; {}", declare_fix(*.reply_code))]
    Declare {
        /// The exchange name.
        exchange: String,
        /// The broker's reply code.
        reply_code: u16,
        /// The broker's reply text.
        reply_text: String,
    },
    /// The connection failed and every publish unsettled then was already reported as
    /// [`super::PublishOutcome::Failed`]. Retryable.
    #[error("the RabbitMQ connection was lost: {0}")]
    Lost(String),
    /// The broker broke the settling rule (a `basic.return` without our key or matching no
    /// unconfirmed publish, an ack of an unknown delivery tag): nothing more was settled on
    /// the connection, including outcomes not yet handed out. Definite.
    #[error("RabbitMQ broke the publisher-confirm protocol: {0}; nothing after it was acknowledged. Report this with the broker's version")]
    Protocol(String),
    /// This message cannot be sent on this connection (its content header exceeds the
    /// negotiated `frame_max`); nothing was written for it.
    #[error("{0}")]
    Unsendable(String),
}

fn declare_fix(reply_code: u16) -> &'static str {
    match reply_code {
        403 => "grant the user configure permission on it (rabbitmqctl set_permissions), or declare it beforehand and grant write",
        404 => "it does not exist and run has --no-declare (PGOUTBOX_NO_DECLARE), which only checks: declare it as a durable topic exchange, or drop --no-declare; run retries meanwhile",
        _ => "if it exists with another type or durability, delete it or pick another --exchange",
    }
}

impl Error {
    /// The error for a `connection.close` received while connecting: 403 and 530 are
    /// [`Error::Refused`] with the fix, anything else [`Error::Connect`].
    pub fn refused_or_closed(url: &str, reply_code: u16, reply_text: &str) -> Error {
        let fix = match reply_code {
            403 => "check the user and password in --amqp-url (PGOUTBOX_AMQP_URL); `rabbitmqctl list_users` shows the users, `rabbitmqctl change_password USER PASSWORD` sets one".to_owned(),
            530 => {
                let vhost = url::Url::parse(url)
                    .ok()
                    .and_then(|u| u.path().strip_prefix('/').map(str::to_owned))
                    .filter(|p| !p.is_empty())
                    .map(|p| percent_decode(&p))
                    .unwrap_or_else(|| "/".into());
                format!(
                    "the vhost {vhost:?} is missing or the user may not use it: create it with `rabbitmqctl add_vhost {vhost}` and grant the user with `rabbitmqctl set_permissions -p {vhost} USER '.*' '.*' '.*'`, or fix the vhost (the URL path, %2f for /) in --amqp-url (PGOUTBOX_AMQP_URL)"
                )
            }
            _ => {
                return Error::Connect {
                    url: url.to_owned(),
                    context: format!(
                        "the broker closed the connection with {reply_code} {reply_text}"
                    ),
                }
            }
        };
        Error::Refused {
            url: url.to_owned(),
            reply_code,
            reply_text: reply_text.to_owned(),
            fix,
        }
    }
}

/// Percent-decodes a URL path segment (`%2f` → `/`); invalid escapes stay as they are.
fn percent_decode(path: &str) -> String {
    let bytes = path.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_vhost_names_the_percent_decoded_vhost() {
        let e = Error::refused_or_closed(
            "amqp://u:***@h:5672/orders%2Feu",
            530,
            "NOT_ALLOWED - vhost orders/eu not found",
        );
        let text = e.to_string();
        assert!(text.contains("\"orders/eu\""), "{text}");
        assert!(text.contains("rabbitmqctl add_vhost orders/eu"), "{text}");
        let e = Error::refused_or_closed("amqp://u:***@h:5672/%2f", 530, "NOT_ALLOWED");
        assert!(e.to_string().contains("\"/\""));
        let e = Error::refused_or_closed("amqp://u:***@h:5672", 530, "NOT_ALLOWED");
        assert!(e.to_string().contains("\"/\""));
        assert!(matches!(
            Error::refused_or_closed("amqp://h", 403, "ACCESS_REFUSED"),
            Error::Refused {
                reply_code: 403,
                ..
            }
        ));
        assert!(matches!(
            Error::refused_or_closed("amqp://h", 320, "CONNECTION_FORCED"),
            Error::Connect { .. }
        ));
        assert_eq!(percent_decode("a+b%"), "a+b%");
    }
}
