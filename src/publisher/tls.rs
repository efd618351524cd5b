//! TLS for `amqps://`: the options read from the URL, the rustls client configuration built
//! from them, and what a failed handshake means for the operator.
//!
//! The options are RabbitMQ's URI query parameters ("URI Query Parameters" in RabbitMQ's
//! URI spec): `cacertfile=` (a PEM file with the CA certificates to trust instead of the
//! system's), `certfile=` and `keyfile=` (a client certificate chain and its private key,
//! both or neither), and `server_name_indication=` (the name sent in SNI and checked against
//! the broker's certificate; the URL host by default). There is no way to skip verification:
//! `verify=verify_none` is refused.
//!
//! Without `cacertfile=`, the broker's certificate is checked against the platform's trust
//! store (`rustls-native-certs`: `/etc/ssl/certs`, or `SSL_CERT_FILE` / `SSL_CERT_DIR`), so
//! the CAs an operator installed are trusted and updates come with the OS. The files are
//! read on every connect, so a rotated CA or client certificate is picked up by the next
//! reconnect. The crypto provider is rustls' ring provider; TLS 1.2 and 1.3 are offered.
//!
//! Source: RFC 8446 (TLS 1.3), RFC 6066 section 3 (SNI), RabbitMQ "TLS Support" and
//! "URI Query Parameters".

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{self, CertificateError, ClientConfig, RootCertStore};

use super::Error;
use crate::pem::{read_certificates, read_reason};

/// The TLS query parameters (RabbitMQ's names), in the order they are documented.
pub const TLS_QUERY_KEYS: [&str; 5] = [
    "cacertfile",
    "certfile",
    "keyfile",
    "server_name_indication",
    "verify",
];

/// Where the certificates that may sign the broker's certificate come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TrustAnchors {
    /// The platform's trust store.
    System,
    /// Only the CA certificates in this PEM file (`cacertfile=`).
    CaFile(PathBuf),
}

/// A client certificate chain and its key (`certfile=`, `keyfile=`), both PEM files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientIdentity {
    /// The certificate chain, leaf first.
    pub certfile: PathBuf,
    /// The private key (PKCS#8, PKCS#1 or SEC1).
    pub keyfile: PathBuf,
}

/// The TLS settings of an `amqps://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsOptions {
    /// The name sent in SNI and verified against the broker's certificate: the URL host,
    /// or `server_name_indication=`.
    pub server_name: ServerName<'static>,
    /// What the broker's certificate is verified against.
    pub anchors: TrustAnchors,
    /// A client certificate, when the broker asks for one.
    pub identity: Option<ClientIdentity>,
}

impl TlsOptions {
    /// Reads the TLS query parameters. `host` is the URL host (a name or an address);
    /// `tls` whether the scheme is `amqps`. No file is read here.
    ///
    /// # Errors
    /// A message naming the parameter: a TLS parameter on `amqp://` (never ignored: it
    /// would mean plaintext where TLS was meant), `verify=verify_none`, `certfile=` without
    /// `keyfile=` or the reverse, an empty path, a `server_name_indication=` that is not a
    /// DNS name or an IP address, a parameter given twice.
    pub fn from_query<'a>(
        pairs: impl Iterator<Item = (&'a str, &'a str)>,
        host: &str,
        tls: bool,
    ) -> Result<Option<TlsOptions>, String> {
        let mut found: [Option<&str>; 5] = [None; 5];
        for (key, value) in pairs {
            let Some(i) = TLS_QUERY_KEYS.iter().position(|k| *k == key) else {
                continue;
            };
            if found[i].replace(value).is_some() {
                return Err(format!("{key}= is given twice"));
            }
        }
        let [cacertfile, certfile, keyfile, sni, verify] = found;
        if !tls {
            if let Some(i) = found.iter().position(Option::is_some) {
                return Err(format!(
                    "{}= is a TLS setting, and amqp:// does not use TLS; use amqps:// (RabbitMQ's TLS listener, port 5671 by default)",
                    TLS_QUERY_KEYS[i]
                ));
            }
            return Ok(None);
        }
        match verify {
            None | Some("verify_peer") => {}
            Some("verify_none") => {
                return Err("verify=verify_none is not supported: pgoutbox always verifies the broker's certificate; set cacertfile= to the CA that signed it".into())
            }
            Some(other) => {
                return Err(format!(
                    "verify={other} is not a verify mode (verify_peer is the only one, and the default)"
                ))
            }
        }
        let path = |key: &str, value: &str| {
            if value.is_empty() {
                Err(format!("{key}= is empty; give the path of a PEM file"))
            } else {
                Ok(PathBuf::from(value))
            }
        };
        let anchors = match cacertfile {
            Some(p) => TrustAnchors::CaFile(path("cacertfile", p)?),
            None => TrustAnchors::System,
        };
        let identity = match (certfile, keyfile) {
            (Some(c), Some(k)) => Some(ClientIdentity {
                certfile: path("certfile", c)?,
                keyfile: path("keyfile", k)?,
            }),
            (None, None) => None,
            (Some(_), None) => {
                return Err(
                    "certfile= needs keyfile= (the client certificate's private key)".into(),
                )
            }
            (None, Some(_)) => {
                return Err(
                    "keyfile= needs certfile= (the client certificate it belongs to)".into(),
                )
            }
        };
        let name = sni.unwrap_or(host);
        let server_name = ServerName::try_from(name.to_owned()).map_err(|_| {
            if sni.is_some() {
                format!("server_name_indication={name} is neither a DNS name nor an IP address")
            } else {
                format!("the host {name:?} is neither a DNS name nor an IP address, so TLS cannot verify it; set server_name_indication= to the name in the broker's certificate")
            }
        })?;
        Ok(Some(TlsOptions {
            server_name,
            anchors,
            identity,
        }))
    }

    /// Reads the files and builds the rustls client configuration (ring provider, TLS 1.2
    /// and 1.3, the trust anchors, the client certificate if any).
    ///
    /// # Errors
    /// [`Error::TlsSetup`] (definite) when a file cannot be read, holds no usable PEM
    /// block, or the key does not fit the certificate, and when the system trust store
    /// holds no CA certificate.
    pub async fn load_client_config(&self) -> Result<Arc<ClientConfig>, Error> {
        let options = self.clone();
        // On the blocking pool, not the runtime's one thread: a file read may block (a
        // FIFO, a hung network file system) and would stall the stream and signals.
        match tokio::task::spawn_blocking(move || options.client_config()).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(Error::Connect {
                url: String::new(),
                context: format!("reading the TLS files was cancelled: {e}"),
            }),
        }
    }

    /// [`TlsOptions::load_client_config`] on the calling thread.
    ///
    /// # Errors
    /// As [`TlsOptions::load_client_config`].
    pub fn client_config(&self) -> Result<Arc<ClientConfig>, Error> {
        let mut roots = RootCertStore::empty();
        match &self.anchors {
            TrustAnchors::CaFile(file) => {
                let what = format!("cacertfile={}", file.display());
                let fix = "point cacertfile= at a readable PEM file holding the CA certificate that signed the broker's certificate (RabbitMQ's ssl_options.cacertfile, or the CA that issued its certfile)";
                let certs = read_certificates(file).map_err(|reason| Error::TlsSetup {
                    what: what.clone(),
                    reason,
                    fix,
                })?;
                for (i, cert) in certs.into_iter().enumerate() {
                    roots.add(cert).map_err(|e| Error::TlsSetup {
                        what: what.clone(),
                        reason: format!(
                            "certificate {} in it is not a usable CA certificate ({e})",
                            i + 1
                        ),
                        fix,
                    })?;
                }
            }
            TrustAnchors::System => {
                let found = rustls_native_certs::load_native_certs();
                let (added, _ignored) = roots.add_parsable_certificates(found.certs);
                if added == 0 {
                    let errors: Vec<String> = found.errors.iter().map(|e| e.to_string()).collect();
                    return Err(Error::TlsSetup {
                        what: "the system trust store".into(),
                        reason: if errors.is_empty() {
                            "it holds no CA certificate".into()
                        } else {
                            format!("no CA certificate could be loaded ({})", errors.join("; "))
                        },
                        fix: "install the platform's CA certificates (Debian: the ca-certificates package), or set cacertfile= in the URL to the CA that signed the broker's certificate",
                    });
                }
            }
        }
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()
                .map_err(|e| Error::TlsSetup {
                    what: "the TLS configuration".into(),
                    reason: e.to_string(),
                    fix: "report this: the ring provider offers TLS 1.2 and 1.3",
                })?
                .with_root_certificates(roots);
        let config = match &self.identity {
            None => builder.with_no_client_auth(),
            Some(id) => {
                let certfile = format!("certfile={}", id.certfile.display());
                let chain = read_certificates(&id.certfile).map_err(|reason| Error::TlsSetup {
                    what: certfile.clone(),
                    reason,
                    fix: "point certfile= at a readable PEM file holding the client certificate (and its intermediates)",
                })?;
                let keyfile = format!("keyfile={}", id.keyfile.display());
                let key_fix = "point keyfile= at the readable, unencrypted PEM private key of the client certificate in certfile=";
                let bytes = std::fs::read(&id.keyfile).map_err(|e| Error::TlsSetup {
                    what: keyfile.clone(),
                    reason: read_reason(&e),
                    fix: key_fix,
                })?;
                let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| Error::TlsSetup {
                    what: keyfile.clone(),
                    reason: format!("no private key in it ({e})"),
                    fix: key_fix,
                })?;
                builder
                    .with_client_auth_cert(chain, key)
                    .map_err(|e| Error::TlsSetup {
                        what: format!("{certfile} with {keyfile}"),
                        reason: e.to_string(),
                        fix: "give the key that belongs to the certificate, of a type rustls supports (RSA, ECDSA P-256/P-384, Ed25519)",
                    })?
            }
        };
        Ok(Arc::new(config))
    }

    /// Where the broker's certificate is verified against, for messages.
    fn anchors_text(&self) -> String {
        match &self.anchors {
            TrustAnchors::System => "the system trust store".into(),
            TrustAnchors::CaFile(p) => format!("cacertfile={}", p.display()),
        }
    }
}

/// Turns a failed TLS handshake with `address` (`host:port`) into an error that says what
/// happened and the fix. Retryable: the broker's certificate or listener may change.
pub fn handshake_error(e: &io::Error, options: &TlsOptions, address: &str, url: &str) -> Error {
    let name = options.server_name.to_str();
    let not_tls_fix = format!(
        "is {address} the TLS listener? RabbitMQ takes TLS on listeners.ssl (5671 by default) and plain AMQP on listeners.tcp (5672); use amqp:// for a plain listener"
    );
    let (context, fix) = match e.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()) {
        Some(rustls::Error::InvalidCertificate(cert)) => match cert {
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => (
                format!("the broker's certificate is not valid for the name {name:?} ({e})"),
                "connect by a name the certificate lists (its subject alternative names), or set server_name_indication= to one of them".to_owned(),
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } | CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => (
                format!("the broker's certificate for {name:?} is outside its validity period ({e})"),
                "renew the broker's certificate (ssl_options.certfile), or check this machine's clock".to_owned(),
            ),
            _ => (
                format!("certificate verification failed for {name:?} against {} ({e})", options.anchors_text()),
                "set cacertfile= in the URL to the CA that signed the broker's certificate".to_owned(),
            ),
        },
        Some(rustls::Error::InvalidMessage(_)) | Some(rustls::Error::InappropriateMessage { .. }) | Some(rustls::Error::InappropriateHandshakeMessage { .. }) => (
            format!("the server at {address} did not answer in TLS ({e})"),
            not_tls_fix,
        ),
        Some(rustls::Error::AlertReceived(alert)) => (
            format!("the broker refused the TLS handshake with the alert {alert:?}"),
            "if the broker asks for a client certificate (ssl_options.verify = verify_peer with fail_if_no_peer_cert = true), set certfile= and keyfile= to one its CA signed; otherwise compare its ssl_options.versions and ciphers with TLS 1.2/1.3".to_owned(),
        ),
        Some(other) => (
            format!("the TLS handshake with {address} failed ({other})"),
            "check the broker's ssl_options (versions, ciphers, certificate)".to_owned(),
        ),
        None if e.kind() == io::ErrorKind::UnexpectedEof || e.kind() == io::ErrorKind::ConnectionReset => (
            format!("the server at {address} closed the connection during the TLS handshake ({e})"),
            not_tls_fix,
        ),
        None => (
            format!("the TLS handshake with {address} failed ({e})"),
            "check that RabbitMQ is running and its TLS listener answers there".to_owned(),
        ),
    };
    Error::Tls {
        url: url.to_owned(),
        context,
        fix,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(query: &[(&str, &str)], host: &str, tls: bool) -> Result<Option<TlsOptions>, String> {
        TlsOptions::from_query(query.iter().copied(), host, tls)
    }

    #[test]
    fn the_url_host_is_the_server_name_unless_sni_overrides_it() {
        let o = parse(&[], "rabbit.example", true).unwrap().unwrap();
        assert_eq!(o.server_name.to_str(), "rabbit.example");
        assert_eq!(o.anchors, TrustAnchors::System);
        assert_eq!(o.identity, None);
        let o = parse(
            &[
                ("server_name_indication", "mq.internal"),
                ("cacertfile", "/ca.pem"),
            ],
            "10.0.0.5",
            true,
        )
        .unwrap()
        .unwrap();
        assert_eq!(o.server_name.to_str(), "mq.internal");
        assert_eq!(o.anchors, TrustAnchors::CaFile("/ca.pem".into()));
        let o = parse(&[], "127.0.0.1", true).unwrap().unwrap();
        assert!(matches!(o.server_name, ServerName::IpAddress(_)));
        assert_eq!(parse(&[("heartbeat", "5")], "h", false), Ok(None));
    }

    #[test]
    fn tls_settings_are_never_ignored_and_verification_cannot_be_skipped() {
        let e = parse(&[("cacertfile", "/ca.pem")], "h", false).unwrap_err();
        assert!(
            e.contains("amqp:// does not use TLS") && e.contains("cacertfile="),
            "{e}"
        );
        for (query, want) in [
            (vec![("verify", "verify_none")], "always verifies"),
            (vec![("verify", "sometimes")], "not a verify mode"),
            (vec![("certfile", "/c.pem")], "certfile= needs keyfile="),
            (vec![("keyfile", "/k.pem")], "keyfile= needs certfile="),
            (vec![("cacertfile", "")], "cacertfile= is empty"),
            (
                vec![("cacertfile", "/a"), ("cacertfile", "/b")],
                "given twice",
            ),
            (
                vec![("server_name_indication", "not a name")],
                "neither a DNS name",
            ),
        ] {
            let e = parse(&query, "h", true).unwrap_err();
            assert!(e.contains(want), "{query:?}: {e}");
        }
        assert!(parse(&[("verify", "verify_peer")], "h", true)
            .unwrap()
            .is_some());
    }

    #[test]
    fn an_unusable_ca_file_names_the_setting_the_path_and_the_fix() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let garbage = dir.path().join("garbage.pem");
        std::fs::write(&garbage, "not a certificate\n").unwrap();
        for (file, want) in [
            (&missing, "no such file"),
            (&garbage, "no PEM CERTIFICATE block"),
        ] {
            let options = TlsOptions {
                server_name: ServerName::try_from("h").unwrap(),
                anchors: TrustAnchors::CaFile(file.clone()),
                identity: None,
            };
            let e = options.client_config().unwrap_err();
            let text = e.to_string();
            assert!(matches!(e, Error::TlsSetup { .. }), "{text}");
            assert!(
                text.contains(&format!("cacertfile={}", file.display()))
                    && text.contains(want)
                    && text.contains("the CA certificate that signed the broker's certificate"),
                "{text}"
            );
        }
    }

    #[test]
    fn each_handshake_failure_names_its_fix() {
        let options = TlsOptions {
            server_name: ServerName::try_from("mq.example").unwrap(),
            anchors: TrustAnchors::System,
            identity: None,
        };
        let tls_err = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let cases = [
            (
                tls_err(rustls::Error::InvalidCertificate(
                    CertificateError::UnknownIssuer,
                )),
                "certificate verification failed for \"mq.example\" against the system trust store",
                "set cacertfile= in the URL to the CA that signed the broker's certificate",
            ),
            (
                tls_err(rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForName,
                )),
                "not valid for the name \"mq.example\"",
                "server_name_indication=",
            ),
            (
                tls_err(rustls::Error::InvalidCertificate(CertificateError::Expired)),
                "outside its validity period",
                "renew the broker's certificate",
            ),
            (
                tls_err(rustls::Error::InvalidMessage(
                    rustls::InvalidMessage::InvalidContentType,
                )),
                "the server at mq.example:5672 did not answer in TLS",
                "is mq.example:5672 the TLS listener?",
            ),
            (
                io::Error::new(io::ErrorKind::UnexpectedEof, "tls handshake eof"),
                "closed the connection during the TLS handshake",
                "is mq.example:5672 the TLS listener?",
            ),
            (
                tls_err(rustls::Error::AlertReceived(
                    rustls::AlertDescription::CertificateRequired,
                )),
                "refused the TLS handshake with the alert CertificateRequired",
                "set certfile= and keyfile=",
            ),
        ];
        for (e, context, fix) in cases {
            let err = handshake_error(
                &e,
                &options,
                "mq.example:5672",
                "amqps://u:***@mq.example:5672/%2f",
            );
            let text = err.to_string();
            assert!(matches!(err, Error::Tls { .. }), "{text}");
            assert!(text.contains(context) && text.contains(fix), "{text}");
            assert!(
                text.starts_with("RabbitMQ at amqps://u:***@mq.example:5672/%2f: "),
                "{text}"
            );
        }
    }
}
