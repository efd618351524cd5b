//! The byte stream under a replication connection: TCP, a Unix-domain socket, or TLS over
//! TCP, with a readiness check that does not consume bytes. Shared by the startup
//! ([`super::connect`]) and the CopyBoth session ([`super::session`]).

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpStream, UnixStream};

/// Initial capacity of the read buffer in bytes. Large reads keep the walsender from being
/// woken for every small chunk (see FACTS.md: the reader should read eagerly, in big chunks).
pub(crate) const READ_CHUNK: usize = 1 << 20;

/// A byte stream to the server: TCP or a Unix-domain socket.
pub(crate) trait Socket: AsyncRead + AsyncWrite + Unpin + Send {
    /// Ready when the socket has bytes to read (or an error or EOF), without reading them.
    fn poll_read_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>>;
}

impl Socket for TcpStream {
    fn poll_read_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        TcpStream::poll_read_ready(self, cx)
    }
}

impl Socket for UnixStream {
    fn poll_read_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        UnixStream::poll_read_ready(self, cx)
    }
}

impl Socket for tokio_rustls::client::TlsStream<TcpStream> {
    /// Ready when rustls holds decrypted bytes not yet read (`wants_read` is false then),
    /// else when the TCP socket is: waiting on the socket alone could sleep on plaintext
    /// already received.
    fn poll_read_ready(
        &self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let (tcp, session) = self.get_ref();
        if !session.wants_read() {
            return std::task::Poll::Ready(Ok(()));
        }
        tcp.poll_read_ready(cx)
    }
}
