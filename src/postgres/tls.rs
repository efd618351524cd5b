//! TLS to PostgreSQL, for both connections (the SQL session through tokio-postgres, the
//! replication session through our own client): the rustls client configuration built
//! from the connection string's TLS parameters ([`crate::config::PostgresTls`], where the
//! parameters and their libpq meanings are listed), the `tls-server-end-point` channel
//! binding, and what a failed negotiation means for the operator.

use std::io;
use std::sync::Arc;

use crate::config::{PostgresTls, RootCert, SslMode};
use crate::pem::{read_certificates, read_reason};

use tokio_rustls::rustls::client::danger::{
    HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier,
};
use tokio_rustls::rustls::client::WebPkiServerVerifier;
use tokio_rustls::rustls::crypto::{
    verify_tls12_signature, verify_tls13_signature, CryptoProvider,
};
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio_rustls::rustls::{
    self, CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};

/// The rustls side of the connection string's TLS settings (the settings are plain data in
/// [`crate::config`]; this transport reads them).
impl PostgresTls {
    /// Reads the files and builds the rustls client configuration: ring provider, TLS 1.2
    /// and 1.3, the verifier of the mode, the client certificate if any. The files are read
    /// on every call, so a rotated CA or client certificate is used by the next connect.
    ///
    /// # Errors
    /// [`TlsError`] (definite) when a file cannot be read, holds no usable PEM block, the
    /// key does not fit the certificate, or the system trust store is empty.
    pub async fn load_client_config(&self, target: &str) -> Result<Arc<ClientConfig>, TlsError> {
        let (tls, owned) = (self.clone(), target.to_owned());
        // On the blocking pool, not the runtime's one thread: a file read may block (a
        // FIFO, a hung network file system) and would stall the stream and signals.
        match tokio::task::spawn_blocking(move || tls.client_config(&owned)).await {
            Ok(result) => result,
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            Err(e) => Err(TlsError {
                target: target.to_owned(),
                context: format!("reading the TLS files was cancelled: {e}"),
                fix: "retry (the process is shutting down)".into(),
                definite: false,
            }),
        }
    }

    /// [`PostgresTls::load_client_config`] on the calling thread.
    ///
    /// # Errors
    /// As [`PostgresTls::load_client_config`].
    pub fn client_config(&self, target: &str) -> Result<Arc<ClientConfig>, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let setup = |what: String, reason: String, fix: &str| TlsError {
            target: target.to_owned(),
            context: format!(
                "cannot use {what} from --database-url (PGOUTBOX_DATABASE_URL): {reason}"
            ),
            fix: fix.to_owned(),
            definite: true,
        };
        let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|e| {
                setup(
                    "the TLS configuration".into(),
                    e.to_string(),
                    "report this: the ring provider offers TLS 1.2 and 1.3",
                )
            })?;
        let verifier: Arc<dyn ServerCertVerifier> = if self.verifies_chain() {
            let mut roots = RootCertStore::empty();
            match &self.root_cert {
                Some(RootCert::File(file)) => {
                    let what = format!("sslrootcert={}", file.display());
                    let fix = "point sslrootcert= at a readable PEM file holding the CA certificate that signed the server's certificate (the server's ssl_ca_file, or the CA that issued its ssl_cert_file)";
                    let certs = read_certificates(file).map_err(|r| setup(what.clone(), r, fix))?;
                    for (i, cert) in certs.into_iter().enumerate() {
                        roots.add(cert).map_err(|e| {
                            setup(
                                what.clone(),
                                format!(
                                    "certificate {} in it is not a usable CA certificate ({e})",
                                    i + 1
                                ),
                                fix,
                            )
                        })?;
                    }
                }
                Some(RootCert::System) => {
                    let found = rustls_native_certs::load_native_certs();
                    let (added, _) = roots.add_parsable_certificates(found.certs);
                    if added == 0 {
                        return Err(setup("sslrootcert=system".into(), "the system trust store holds no CA certificate".into(), "install the platform's CA certificates (Debian: the ca-certificates package), or set sslrootcert= to the CA that signed the server's certificate"));
                    }
                }
                None => {
                    unreachable!("verify-ca/verify-full without sslrootcert is refused by validate")
                }
            }
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), Arc::clone(&provider))
                    .build()
                    .map_err(|e| {
                        setup(
                            "sslrootcert".into(),
                            e.to_string(),
                            "give sslrootcert= a PEM file with at least one CA certificate",
                        )
                    })?;
            if self.mode == SslMode::VerifyFull {
                webpki
            } else {
                Arc::new(ChainOnly(webpki))
            }
        } else {
            Arc::new(Unverified(provider))
        };
        let builder = builder
            .dangerous()
            .with_custom_certificate_verifier(verifier);
        let config = match &self.client_cert {
            None => builder.with_no_client_auth(),
            Some((cert_file, key_file)) => {
                let what = format!("sslcert={}", cert_file.display());
                let chain = read_certificates(cert_file).map_err(|r| setup(what.clone(), r, "point sslcert= at a readable PEM file holding the client certificate (and its intermediates)"))?;
                let key_what = format!("sslkey={}", key_file.display());
                let key_fix = "point sslkey= at the readable, unencrypted PEM private key of the client certificate in sslcert=";
                let bytes = std::fs::read(key_file)
                    .map_err(|e| setup(key_what.clone(), read_reason(&e), key_fix))?;
                let key = PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| {
                    setup(
                        key_what.clone(),
                        format!("no private key in it ({e})"),
                        key_fix,
                    )
                })?;
                builder.with_client_auth_cert(chain, key).map_err(|e| setup(format!("{what} with {key_what}"), e.to_string(), "give the key that belongs to the certificate, of a type rustls supports (RSA, ECDSA P-256/P-384, Ed25519)"))?
            }
        };
        Ok(Arc::new(config))
    }
}

/// The name the server's certificate is verified against and sent in SNI (when it is not
/// an address): the connection string's host.
///
/// # Errors
/// [`TlsError`] (definite) when the host is neither a DNS name nor an IP address.
pub fn server_name(host: &str, target: &str) -> Result<ServerName<'static>, TlsError> {
    ServerName::try_from(host.to_owned()).map_err(|_| TlsError {
        target: target.to_owned(),
        context: format!(
            "the host {host:?} is neither a DNS name nor an IP address, so TLS cannot verify it"
        ),
        fix: "connect by the host name in the server's certificate".into(),
        definite: true,
    })
}

/// A TLS failure of a PostgreSQL connection: what was asked, what happened, the fix.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{target}: {context}; {fix}")]
pub struct TlsError {
    /// `PostgreSQL user@host:port/dbname` (no password).
    pub target: String,
    /// What happened.
    pub context: String,
    /// What to change.
    pub fix: String,
    /// Retrying cannot help (a certificate that does not verify, a server without TLS, an
    /// unusable file): `run` stops instead of reconnecting for ever.
    pub definite: bool,
}

/// The server answered `N` to the SSLRequest and the mode forbids plaintext.
pub fn refused_tls(tls: &PostgresTls, target: &str) -> TlsError {
    TlsError {
        target: target.to_owned(),
        context: format!("sslmode={} asks for TLS and the server does not offer it (it answered the SSLRequest with N: ssl = off)", tls.mode.as_str()),
        fix: "turn TLS on in the server (ssl = on, with ssl_cert_file and ssl_key_file, then reload), or connect with sslmode=prefer or disable if plaintext is acceptable on this network".into(),
        definite: true,
    }
}

/// `channel_binding=require` could not be honoured: `offered` says what the server did.
pub fn channel_binding_unavailable(target: &str, offered: &str) -> TlsError {
    TlsError {
        target: target.to_owned(),
        context: format!("channel_binding=require, and {offered}"),
        fix: "connect over TLS (sslmode=require or stronger, ssl = on in the server) as a role whose password is stored as SCRAM-SHA-256 and authenticated by scram-sha-256 in pg_hba.conf; or set channel_binding=prefer".into(),
        definite: true,
    }
}

/// The hint for the server's `no pg_hba.conf entry ..., no encryption` (28000): the server
/// takes this user only over TLS (`hostssl`) and the connection was plaintext.
pub fn hba_hint(message: &str, tls: &PostgresTls) -> Option<String> {
    if message.contains("no pg_hba.conf entry") && message.contains("no encryption") {
        Some(format!("the server accepts this connection only over TLS (hostssl in pg_hba.conf) and sslmode={} connected in plaintext; use sslmode=require, or verify-full with sslrootcert=", tls.mode.as_str()))
    } else if message.contains("requires a valid client certificate") {
        // `cert` in pg_hba.conf (or clientcert=verify-full): a password cannot help.
        Some("the server authenticates this user by a client certificate (cert or clientcert in pg_hba.conf): set sslcert= and sslkey= in --database-url to a certificate the server's CA (ssl_ca_file) signed, with the user name as its CN".into())
    } else if message.contains("certificate authentication failed for user") {
        Some("the client certificate's CN is not this user name (nor mapped to it in pg_ident.conf): connect as the user the certificate names, or use one issued for this user".into())
    } else {
        None
    }
}

/// Turns a failed TLS handshake into what happened and the fix. Certificate failures are
/// definite; an alert or a closed connection is retried.
pub fn handshake_error(e: &io::Error, tls: &PostgresTls, host: &str, target: &str) -> TlsError {
    let (context, fix, definite) = match rustls_error(e) {
        Some(rustls::Error::InvalidCertificate(cert)) => match cert {
            CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => (
                format!("sslmode=verify-full: the server's certificate is not valid for the host name {host:?} ({e})"),
                "connect by a name the certificate lists (its subject alternative names), or reissue the server's certificate for this name; sslmode=verify-ca skips the name check".to_owned(),
                true,
            ),
            CertificateError::Expired | CertificateError::ExpiredContext { .. } | CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => (
                format!("the server's certificate is outside its validity period ({e})"),
                "renew the server's certificate (ssl_cert_file), or check this machine's clock".to_owned(),
                true,
            ),
            _ => (
                format!("sslmode={}: the server's certificate did not verify against {} ({e})", tls.mode.as_str(), tls.anchors_text()),
                "set sslrootcert= to the CA that signed the server's certificate".to_owned(),
                true,
            ),
        },
        Some(rustls::Error::AlertReceived(alert)) => (
            format!("the server refused the TLS handshake with the alert {alert:?}"),
            "if the server asks for a client certificate (clientcert in pg_hba.conf, ssl_ca_file), set sslcert= and sslkey= to one its CA signed".to_owned(),
            false,
        ),
        Some(other) => (
            format!("the TLS handshake failed ({other})"),
            "check the server's ssl settings (ssl_cert_file, ssl_min_protocol_version)".to_owned(),
            false,
        ),
        None => (
            format!("the TLS handshake failed ({e})"),
            "check that PostgreSQL is running there with ssl = on".to_owned(),
            false,
        ),
    };
    TlsError {
        target: target.to_owned(),
        context,
        fix,
        definite,
    }
}

/// The rustls error inside an I/O error, if it is one.
pub fn rustls_error(e: &io::Error) -> Option<&rustls::Error> {
    e.get_ref()?.downcast_ref::<rustls::Error>()
}

/// The `tls-server-end-point` channel binding data of a server certificate (RFC 5929
/// section 4.1): the certificate's DER hashed with its signature's hash, where MD5 and
/// SHA-1 become SHA-256. `None` for a signature without a single hash (Ed25519, RSASSA-PSS)
/// or a certificate that does not parse.
pub fn tls_server_end_point(cert: &[u8]) -> Option<Vec<u8>> {
    use sha2::Digest;
    use x509_cert::der::Decode;
    let parsed = x509_cert::Certificate::from_der(cert).ok()?;
    let oid = parsed.signature_algorithm.oid.to_string();
    match oid.as_str() {
        // md5WithRSAEncryption, sha1WithRSAEncryption, sha256WithRSAEncryption,
        // ecdsa-with-SHA1, ecdsa-with-SHA256, id-dsa-with-sha1, dsa-with-sha256
        "1.2.840.113549.1.1.4"
        | "1.2.840.113549.1.1.5"
        | "1.2.840.113549.1.1.11"
        | "1.2.840.10045.4.1"
        | "1.2.840.10045.4.3.2"
        | "1.2.840.10040.4.3"
        | "2.16.840.1.101.3.4.3.2" => Some(sha2::Sha256::digest(cert).to_vec()),
        // sha384WithRSAEncryption, ecdsa-with-SHA384
        "1.2.840.113549.1.1.12" | "1.2.840.10045.4.3.3" => {
            Some(sha2::Sha384::digest(cert).to_vec())
        }
        // sha512WithRSAEncryption, ecdsa-with-SHA512
        "1.2.840.113549.1.1.13" | "1.2.840.10045.4.3.4" => {
            Some(sha2::Sha512::digest(cert).to_vec())
        }
        _ => None,
    }
}

/// verify-ca: the chain is verified by webpki; only a name mismatch is forgiven (webpki
/// checks the chain before the name, so a forgiven mismatch always had a valid chain).
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// `sslmode=require` (or `prefer`, `allow`) without `sslrootcert`: as in libpq, any
/// certificate is accepted (the session is encrypted, the server not authenticated). The
/// handshake signatures are still checked, so the server holds the certificate's key and
/// channel binding binds to it.
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};

    /// A CA (its DER) and a leaf for `names` it signed (the leaf's DER).
    fn ca_and_leaf(names: &[&str]) -> (CertificateDer<'static>, CertificateDer<'static>) {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().unwrap();
        let ca = params.self_signed(&key).unwrap();
        let issuer = Issuer::new(params, key);
        let leaf_key = KeyPair::generate().unwrap();
        let leaf = CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
            .unwrap()
            .signed_by(&leaf_key, &issuer)
            .unwrap();
        (ca.der().clone(), leaf.der().clone())
    }

    fn verifier(ca: CertificateDer<'static>, mode: SslMode) -> Arc<dyn ServerCertVerifier> {
        let mut roots = RootCertStore::empty();
        roots.add(ca).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .unwrap();
        if mode == SslMode::VerifyFull {
            webpki
        } else {
            Arc::new(ChainOnly(webpki))
        }
    }

    #[test]
    fn verify_ca_forgives_only_the_name_and_verify_full_checks_it() {
        let (ca, leaf) = ca_and_leaf(&["db.example"]);
        let (other_ca, _) = ca_and_leaf(&["x"]);
        let name = ServerName::try_from("127.0.0.1").unwrap();
        let check = |v: &Arc<dyn ServerCertVerifier>, name: &ServerName<'_>| {
            v.verify_server_cert(&leaf, &[], name, &[], UnixTime::now())
        };
        assert!(check(&verifier(ca.clone(), SslMode::VerifyCa), &name).is_ok());
        let e = check(&verifier(ca.clone(), SslMode::VerifyFull), &name).unwrap_err();
        assert!(
            matches!(
                e,
                rustls::Error::InvalidCertificate(
                    CertificateError::NotValidForNameContext { .. }
                        | CertificateError::NotValidForName
                )
            ),
            "{e:?}"
        );
        let right = ServerName::try_from("db.example").unwrap();
        assert!(check(&verifier(ca, SslMode::VerifyFull), &right).is_ok());
        // A chain from another CA fails in both modes.
        for mode in [SslMode::VerifyCa, SslMode::VerifyFull] {
            let e = check(&verifier(other_ca.clone(), mode), &right).unwrap_err();
            assert!(
                matches!(
                    e,
                    rustls::Error::InvalidCertificate(
                        CertificateError::UnknownIssuer | CertificateError::BadSignature
                    )
                ),
                "{mode:?}: {e:?}"
            );
        }
    }

    #[test]
    fn tls_server_end_point_hashes_the_certificate_with_its_signature_hash() {
        use sha2::Digest;
        // rcgen signs with ECDSA P-256 / SHA-256 by default.
        let (_, leaf) = ca_and_leaf(&["db.example"]);
        assert_eq!(
            tls_server_end_point(&leaf),
            Some(sha2::Sha256::digest(leaf.as_ref()).to_vec())
        );
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P384_SHA384).unwrap();
        let p384 = CertificateParams::new(vec!["h".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(
            tls_server_end_point(p384.der()),
            Some(sha2::Sha384::digest(p384.der().as_ref()).to_vec())
        );
        let key = KeyPair::generate_for(&rcgen::PKCS_ED25519).unwrap();
        let ed = CertificateParams::new(vec!["h".to_string()])
            .unwrap()
            .self_signed(&key)
            .unwrap();
        assert_eq!(
            tls_server_end_point(ed.der()),
            None,
            "Ed25519 names no hash"
        );
        assert_eq!(tls_server_end_point(b"not a certificate"), None);
    }

    #[test]
    fn certificate_failures_are_definite_and_name_the_fix() {
        let tls = PostgresTls {
            mode: SslMode::VerifyFull,
            root_cert: Some(RootCert::File("/ca.pem".into())),
            ..PostgresTls::default()
        };
        let io = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let target = "PostgreSQL u@db:5432/d";
        let e = handshake_error(
            &io(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName,
            )),
            &tls,
            "db",
            target,
        );
        assert!(e.definite);
        assert!(
            e.to_string().contains("not valid for the host name \"db\"")
                && e.to_string()
                    .contains("connect by a name the certificate lists"),
            "{e}"
        );
        let e = handshake_error(
            &io(rustls::Error::InvalidCertificate(
                CertificateError::UnknownIssuer,
            )),
            &tls,
            "db",
            target,
        );
        assert!(e.definite);
        assert!(
            e.to_string()
                .contains("did not verify against sslrootcert=/ca.pem")
                && e.to_string().contains("set sslrootcert="),
            "{e}"
        );
        let e = handshake_error(
            &io::Error::new(io::ErrorKind::UnexpectedEof, "eof"),
            &tls,
            "db",
            target,
        );
        assert!(!e.definite, "a dropped handshake is retried");
        let e = refused_tls(&tls, target);
        assert!(e.definite && e.to_string().contains("ssl = on"), "{e}");
        assert!(hba_hint("no pg_hba.conf entry for host \"127.0.0.1\", user \"u\", database \"d\", no encryption", &tls).is_some());
        assert!(hba_hint("password authentication failed", &tls).is_none());
        assert!(
            hba_hint("connection requires a valid client certificate", &tls)
                .is_some_and(|h| h.contains("sslcert=") && h.contains("sslkey="))
        );
        assert!(
            hba_hint("certificate authentication failed for user \"u\"", &tls)
                .is_some_and(|h| h.contains("CN"))
        );
    }
}
