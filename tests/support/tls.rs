//! A RabbitMQ node with a TLS listener, and the throwaway certificates it and its clients
//! use, generated at test time with `rcgen`.
//!
//! One node per test process ([`TlsRabbit::shared`]): a plain listener (for the tests'
//! own consumers, and to test `amqps://` against a plaintext port) and an `ssl` listener
//! whose certificate a test CA signed for `localhost` and `127.0.0.1`, for AMQP and for the
//! stream protocol ([`TlsRabbit::stream_tls_url`]). Client certificates
//! are asked for and verified, but not required (`fail_if_no_peer_cert = false`), so the
//! same node serves clients with and without one.

use std::path::PathBuf;
use std::sync::OnceLock;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

use super::{free_port, port_open, scaled, wait_until_blocking, RabbitMq};

/// The subject CN of the client certificate [`TlsRabbit::client_cert`] holds.
pub const CLIENT_CN: &str = "pgoutbox-test-client";

/// The shared TLS node and its certificate files.
#[derive(Debug)]
pub struct TlsRabbit {
    /// The node (plain listener at [`RabbitMq::port`]).
    pub rabbit: RabbitMq,
    /// The TLS listener's port on 127.0.0.1.
    pub tls_port: u16,
    /// The stream protocol's TLS listener's port on 127.0.0.1 (also its advertised TLS port);
    /// `None` on a node without the stream plugin ([`TlsRabbit::start_tls_only`]).
    pub stream_tls_port: Option<u16>,
    /// The CA that signed the broker's and the client's certificates (PEM).
    pub ca: PathBuf,
    /// Another CA, which signed nothing the broker presents (PEM).
    pub other_ca: PathBuf,
    /// A client certificate the CA signed (PEM).
    pub client_cert: PathBuf,
    /// Its private key (PKCS#8 PEM).
    pub client_key: PathBuf,
}

static SHARED: OnceLock<TlsRabbit> = OnceLock::new();

/// A CA: its self-signed certificate (PEM) and the issuer that signs with it.
pub fn ca(name: &str) -> (String, Issuer<'static, KeyPair>) {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name.push(DnType::CommonName, name);
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let key = KeyPair::generate().expect("CA key");
    let cert = params.self_signed(&key).expect("self-sign CA");
    (cert.pem(), Issuer::new(params, key))
}

/// A leaf certificate for `names` (DNS names or addresses) signed by `issuer`: (cert PEM,
/// key PEM).
pub fn leaf(cn: &str, names: &[&str], issuer: &Issuer<'_, KeyPair>) -> (String, String) {
    let mut params =
        CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<String>>())
            .expect("leaf params");
    params.distinguished_name.push(DnType::CommonName, cn);
    let key = KeyPair::generate().expect("leaf key");
    let cert = params.signed_by(&key, issuer).expect("sign leaf");
    (cert.pem(), key.serialize_pem())
}

impl TlsRabbit {
    /// The per-process TLS node (lazy; stopped by its watchdog when the test process
    /// exits). Use unique exchange and queue names on it.
    pub fn shared() -> &'static TlsRabbit {
        SHARED.get_or_init(|| {
            super::run_shared(
                "rabbitmq-tls",
                TlsRabbit::start,
                |t| {
                    format!(
                        "{}tls_port={}\nstream_tls_port={}\n",
                        t.rabbit.describe(),
                        t.tls_port,
                        t.stream_tls_port.unwrap_or(0)
                    )
                },
                |text| {
                    let port = |key: &str| super::described(text, key).parse().expect(key);
                    TlsRabbit::of(
                        RabbitMq::attach(text),
                        port("tls_port"),
                        Some(port("stream_tls_port")).filter(|p| *p != 0),
                    )
                },
            )
        })
    }

    /// The node's certificate files, under its directory.
    fn of(rabbit: RabbitMq, tls_port: u16, stream_tls_port: Option<u16>) -> TlsRabbit {
        let root = rabbit.root_dir().to_path_buf();
        TlsRabbit {
            tls_port,
            stream_tls_port,
            ca: root.join("ca.pem"),
            other_ca: root.join("other-ca.pem"),
            client_cert: root.join("client.pem"),
            client_key: root.join("client.key"),
            rabbit,
        }
    }

    fn start() -> TlsRabbit {
        let (ca_pem, issuer) = ca("pgoutbox test CA");
        let (other_ca_pem, _) = ca("pgoutbox other CA");
        let (server_pem, server_key) = leaf("localhost", &["localhost", "127.0.0.1"], &issuer);
        let (client_pem, client_key) = leaf(CLIENT_CN, &[CLIENT_CN], &issuer);
        let tls_port = free_port();
        let stream_tls_port = super::free_port_outside_ephemeral_range();
        let conf = format!(
            "listeners.ssl.default = 127.0.0.1:{tls_port}\n\
             stream.listeners.ssl.1 = 127.0.0.1:{stream_tls_port}\n\
             stream.advertised_tls_host = 127.0.0.1\n\
             stream.advertised_tls_port = {stream_tls_port}\n\
             ssl_options.cacertfile = {{root}}/ca.pem\n\
             ssl_options.certfile = {{root}}/server.pem\n\
             ssl_options.keyfile = {{root}}/server.key\n\
             ssl_options.verify = verify_peer\n\
             ssl_options.fail_if_no_peer_cert = false\n"
        );
        let rabbit = RabbitMq::start_private_with_files(
            &conf,
            &[
                ("ca.pem", ca_pem.as_bytes()),
                ("other-ca.pem", other_ca_pem.as_bytes()),
                ("server.pem", server_pem.as_bytes()),
                ("server.key", server_key.as_bytes()),
                ("client.pem", client_pem.as_bytes()),
                ("client.key", client_key.as_bytes()),
            ],
        );
        let up = wait_until_blocking(scaled(std::time::Duration::from_secs(30)), || {
            port_open(tls_port) && port_open(stream_tls_port)
        });
        assert!(
            up,
            "the TLS listeners on {tls_port} and {stream_tls_port} (stream) did not open:\n{}",
            rabbit.log_contents()
        );
        TlsRabbit::of(rabbit, tls_port, Some(stream_tls_port))
    }

    /// A private node with no plain listener at all: `listeners.tcp = none`, its `ssl`
    /// listener at [`RabbitMq::port`] (so [`TlsRabbit::tls_port`] is that port, and
    /// [`RabbitMq::url`] names a TLS port) and no plugin (the stream plugin would open a
    /// plain port of its own). The same certificates as [`TlsRabbit::shared`]'s kind; the
    /// tests reach it with `rabbitmqctl`, never over AMQP in plaintext. Stopped on Drop.
    pub fn start_tls_only() -> TlsRabbit {
        let (ca_pem, issuer) = ca("pgoutbox test CA");
        let (other_ca_pem, _) = ca("pgoutbox other CA");
        let (server_pem, server_key) = leaf("localhost", &["localhost", "127.0.0.1"], &issuer);
        let (client_pem, client_key) = leaf(CLIENT_CN, &[CLIENT_CN], &issuer);
        let options = super::rabbit::NodeOptions {
            extra_conf: "listeners.tcp = none\n\
                 listeners.ssl.default = 127.0.0.1:{amqp_port}\n\
                 ssl_options.cacertfile = {root}/ca.pem\n\
                 ssl_options.certfile = {root}/server.pem\n\
                 ssl_options.keyfile = {root}/server.key\n\
                 ssl_options.verify = verify_peer\n\
                 ssl_options.fail_if_no_peer_cert = false\n"
                .to_owned(),
            plugins: Some(Vec::new()),
            ..Default::default()
        };
        let rabbit = RabbitMq::start_node(
            true,
            &options,
            &[
                ("ca.pem", ca_pem.as_bytes()),
                ("other-ca.pem", other_ca_pem.as_bytes()),
                ("server.pem", server_pem.as_bytes()),
                ("server.key", server_key.as_bytes()),
                ("client.pem", client_pem.as_bytes()),
                ("client.key", client_key.as_bytes()),
            ],
        );
        let tls_port = rabbit.port();
        TlsRabbit::of(rabbit, tls_port, None)
    }

    /// `amqps://guest:guest@127.0.0.1:TLS_PORT/%2f`, with `query` appended when not empty.
    pub fn amqps_url(&self, query: &str) -> String {
        let base = format!("amqps://guest:guest@127.0.0.1:{}/%2f", self.tls_port);
        if query.is_empty() {
            base
        } else {
            format!("{base}?{query}")
        }
    }

    /// `rabbitmq-stream+tls://guest:guest@127.0.0.1:STREAM_TLS_PORT/%2f`, with `query`
    /// appended when not empty (`support::read_stream_url` takes [`TlsRabbit::cacertfile`]
    /// there).
    pub fn stream_tls_url(&self, query: &str) -> String {
        let port = self
            .stream_tls_port
            .expect("this TLS node has no stream plugin (start_tls_only)");
        let base = format!("rabbitmq-stream+tls://guest:guest@127.0.0.1:{port}/%2f");
        if query.is_empty() {
            base
        } else {
            format!("{base}?{query}")
        }
    }

    /// `cacertfile=` for the CA that signed the broker's certificate.
    pub fn cacertfile(&self) -> String {
        format!("cacertfile={}", self.ca.display())
    }
}
