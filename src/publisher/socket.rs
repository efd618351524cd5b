//! Where the broker is and the byte stream to it: an [`Endpoint`] parsed from the URL, and
//! a [`Socket`] that is plain TCP (`amqp://`) or TLS over TCP (`amqps://`, [`super::tls`]).
//! Both the handshake ([`super::connection`]) and the session ([`super::Publisher`]) read
//! and write through [`Socket`] and never know which it is.
//!
//! [`connect`] is the first half of the connect step: TCP, then the TLS handshake when the
//! URL asks for it. It holds no session state, so trying several brokers in turn is a loop
//! around it and the AMQP handshake.

use std::io;
use std::net::IpAddr;
use std::pin::Pin;
use std::str::FromStr;
use std::task::{Context, Poll};

use amq_protocol::uri::{AMQPScheme, AMQPUri};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::TlsConnector;

use super::tls::{self, TlsOptions, TLS_QUERY_KEYS};
use super::Error;

/// The query parameters `amq-protocol` reads (RabbitMQ's names); with
/// [`TLS_QUERY_KEYS`], every parameter the URL may carry.
const AMQP_QUERY_KEYS: [&str; 5] = [
    "heartbeat",
    "frame_max",
    "channel_max",
    "connection_timeout",
    "auth_mechanism",
];

/// Why an AMQP URL was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UrlError {
    /// It is not an AMQP URL at all (syntax, port, a number that does not parse).
    #[error("not an AMQP URL ({0}); expected amqp://user:password@host:port/vhost")]
    Malformed(String),
    /// A query parameter is unknown or cannot be used.
    #[error("{0}")]
    Setting(String),
}

/// A broker to connect to, parsed from an `amqp://` or `amqps://` URL. Its `Debug` shows
/// the redacted URL, never the credentials in `uri`.
#[derive(Clone)]
pub struct Endpoint {
    /// Credentials, vhost, heartbeat and `frame_max` as `amq-protocol` reads them.
    pub uri: AMQPUri,
    /// The host to connect to, as written in the URL (a name, or an address).
    pub host: Host,
    /// The TCP port (the scheme's default, 5672 or 5671, when the URL names none).
    pub port: u16,
    /// TLS settings; `None` for `amqp://`.
    pub tls: Option<TlsOptions>,
    /// The URL with its password replaced, for messages.
    pub redacted_url: String,
}

/// The URL's host: a DNS name (resolved at connect time) or an IP address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A DNS name.
    Name(String),
    /// An IPv4 or IPv6 address.
    Ip(IpAddr),
}

impl std::fmt::Display for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Host::Name(n) => f.write_str(n),
            Host::Ip(IpAddr::V6(a)) => write!(f, "[{a}]"),
            Host::Ip(IpAddr::V4(a)) => write!(f, "{a}"),
        }
    }
}

impl std::fmt::Debug for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Endpoint")
            .field("url", &self.redacted_url)
            .field("user", &self.uri.authority.userinfo.username)
            .field("vhost", &self.uri.vhost)
            .field("host", &self.host)
            .field("port", &self.port)
            .field("tls", &self.tls)
            .finish_non_exhaustive()
    }
}

impl Endpoint {
    /// Parses `url`. No I/O: the TLS files are read by [`connect`].
    ///
    /// # Errors
    /// [`UrlError::Malformed`] when `amq-protocol` cannot read it; [`UrlError::Setting`]
    /// for an unknown query parameter or a TLS setting that cannot be used
    /// ([`TlsOptions::from_query`]).
    pub fn parse(url: &str) -> Result<Endpoint, UrlError> {
        // Errors never carry the input: the url crate's say what is wrong in words of their
        // own; amq-protocol's may quote the text, so they are not shown.
        let parsed = url::Url::parse(url).map_err(|e| UrlError::Malformed(e.to_string()))?;
        if url.contains(char::is_whitespace) {
            return Err(UrlError::Malformed(
                "whitespace in the URL: percent-encode a space as %20 (or was more text glued on?)"
                    .into(),
            ));
        }
        if crate::config::authority_has_two_ats(url) {
            return Err(UrlError::Malformed(
                "more than one '@' before the host: an '@' in the user or the password is written %40".into(),
            ));
        }
        let uri = AMQPUri::from_str(url).map_err(|e| {
            // amq-protocol's words ("invalid digit found in string") are shown unless they
            // quote a piece of the input that the redacted form hides.
            let shown = crate::config::redact_url(url);
            UrlError::Malformed(crate::redaction::only_shown(
                e,
                url,
                &shown,
                "amq-protocol cannot read it",
            ))
        })?;
        for (key, _) in parsed.query_pairs() {
            if !AMQP_QUERY_KEYS.contains(&key.as_ref()) && !TLS_QUERY_KEYS.contains(&key.as_ref()) {
                return Err(UrlError::Setting(format!(
                    "unknown query parameter {key:?}; the URL takes {} and, for amqps://, {}",
                    AMQP_QUERY_KEYS.join(", "),
                    TLS_QUERY_KEYS.join(", ")
                )));
            }
        }
        // The url crate keeps an amqp:// host as written ("127.0.0.1" stays text) except an
        // IPv6 address, which amq-protocol then turns into "localhost": take the host from
        // the URL itself.
        let host = match parsed.host() {
            Some(url::Host::Domain(d)) if !d.is_empty() => match d.parse::<IpAddr>() {
                Ok(a) => Host::Ip(a),
                Err(_) => Host::Name(uri.authority.host.clone()),
            },
            Some(url::Host::Ipv4(a)) => Host::Ip(IpAddr::V4(a)),
            Some(url::Host::Ipv6(a)) => Host::Ip(IpAddr::V6(a)),
            _ => Host::Name(uri.authority.host.clone()),
        };
        let host_text = match &host {
            Host::Name(n) => n.clone(),
            Host::Ip(a) => a.to_string(),
        };
        let pairs: Vec<(String, String)> = parsed.query_pairs().into_owned().collect();
        let tls = TlsOptions::from_query(
            pairs.iter().map(|(k, v)| (k.as_str(), v.as_str())),
            &host_text,
            uri.scheme == AMQPScheme::AMQPS,
        )
        .map_err(UrlError::Setting)?;
        Ok(Endpoint {
            port: uri.authority.port,
            uri,
            host,
            tls,
            redacted_url: crate::config::redact_url(url),
        })
    }

    /// `host:port` (an IPv6 address in brackets), for messages.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// The byte stream to the broker.
#[derive(Debug)]
pub enum Socket {
    /// Plain TCP (`amqp://`).
    Tcp(TcpStream),
    /// TLS over TCP (`amqps://`), handshake done.
    Tls(Box<TlsStream<TcpStream>>),
}

/// Opens TCP to `endpoint` and, for `amqps://`, runs the TLS handshake over it (the server
/// name and trust anchors from the URL). Reads the TLS files first, so a bad file is
/// reported even when the broker is down. Not bounded in time: the caller is.
///
/// # Errors
/// [`Error::TlsSetup`] (definite) for an unusable `cacertfile=`, `certfile=` or `keyfile=`
/// or an empty system trust store; [`Error::Connect`] when TCP fails; [`Error::Tls`] when
/// the handshake fails (certificate verification, a plaintext port, an alert from the
/// broker).
pub async fn connect(endpoint: &Endpoint) -> Result<Socket, Error> {
    let tls = match &endpoint.tls {
        Some(options) => Some((options, options.load_client_config().await?)),
        None => None,
    };
    let tcp = match &endpoint.host {
        Host::Name(name) => TcpStream::connect((name.as_str(), endpoint.port)).await,
        Host::Ip(a) => TcpStream::connect((*a, endpoint.port)).await,
    }
    .map_err(|e| Error::Connect {
        url: endpoint.redacted_url.clone(),
        context: format!("TCP connect to {} failed: {e}", endpoint.address()),
    })?;
    let _ = tcp.set_nodelay(true);
    let Some((options, config)) = tls else {
        return Ok(Socket::Tcp(tcp));
    };
    TlsConnector::from(config)
        .connect(options.server_name.clone(), tcp)
        .await
        .map(|s| Socket::Tls(Box::new(s)))
        .map_err(|e| tls::handshake_error(&e, options, &endpoint.address(), &endpoint.redacted_url))
}

impl AsyncRead for Socket {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_read(cx, buf),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Socket {
    /// For TLS, the bytes accepted may still sit in rustls' buffer as records: poll
    /// [`AsyncWrite::poll_flush`] once everything is written.
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_write(cx, buf),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_flush(cx),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Socket::Tcp(s) => Pin::new(s).poll_shutdown(cx),
            Socket::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_taken_as_written_and_unknown_parameters_are_refused() {
        let e = Endpoint::parse("amqps://u:p@127.0.0.1:5671/%2f?cacertfile=/ca.pem").unwrap();
        assert_eq!(e.host, Host::Ip(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)));
        assert_eq!(e.address(), "127.0.0.1:5671");
        assert!(e.tls.is_some());
        assert!(!e.redacted_url.contains(":p@"));
        let e = Endpoint::parse("amqps://[::1]/%2f").unwrap();
        assert_eq!(e.address(), "[::1]:5671");
        let e = Endpoint::parse("amqp://rabbit.example/%2f?heartbeat=5").unwrap();
        assert_eq!(e.host, Host::Name("rabbit.example".into()));
        assert_eq!(e.port, 5672);
        assert!(e.tls.is_none());
        let e = Endpoint::parse("amqps://h/%2f?cacertfil=/ca.pem").unwrap_err();
        assert!(
            matches!(&e, UrlError::Setting(t) if t.contains("\"cacertfil\"") && t.contains("cacertfile")),
            "{e}"
        );
        let e = Endpoint::parse("amqp://h/%2f?cacertfile=/ca.pem").unwrap_err();
        assert!(e.to_string().contains("use amqps://"), "{e}");
        assert!(matches!(
            Endpoint::parse("amqp://h:99999999/%2f"),
            Err(UrlError::Malformed(_))
        ));
    }
}
