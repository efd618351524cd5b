//! Reading PEM files of certificates for the TLS settings of both connections (RabbitMQ's
//! `cacertfile=`/`certfile=`, Postgres's `sslrootcert`/`sslcert`), with error texts that
//! name what is wrong with the file.

use std::io;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;

/// Every `CERTIFICATE` block of a PEM file.
///
/// # Errors
/// A text for the caller's message: unreadable ([`read_reason`]), not PEM, or no
/// `CERTIFICATE` block.
pub fn read_certificates(file: &std::path::Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let bytes = std::fs::read(file).map_err(|e| read_reason(&e))?;
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("it is not valid PEM ({e})"))?;
    if certs.is_empty() {
        return Err("it holds no PEM CERTIFICATE block".into());
    }
    Ok(certs)
}

/// Why a file could not be read, as the end of an error text.
pub fn read_reason(e: &io::Error) -> String {
    match e.kind() {
        io::ErrorKind::NotFound => "no such file".into(),
        io::ErrorKind::PermissionDenied => {
            "permission denied (the file must be readable by the user pgoutbox runs as)".into()
        }
        _ => format!("cannot read it ({e})"),
    }
}
