//! A replication session in CopyBoth mode: frames in, standby status updates out.
//!
//! Reading is split in two so the pipeline can race it in `select!`: [`ReplicationStream::fill`]
//! reads more bytes (cancel safe) and [`ReplicationStream::next_buffered`] parses one complete
//! frame from what was read, with no I/O. Source: PostgreSQL docs, "Streaming Replication
//! Protocol" (XLogData, primary keepalive, standby status update) and "Message Formats"
//! (CopyData `d`, CopyDone `c`, ErrorResponse `E`).

use bytes::BytesMut;
use postgres_protocol::message::backend;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::replication::error::{Error, ServerError};
use crate::replication::socket::{Socket, READ_CHUNK};
use crate::replication::stream::{parse_copy_data, ReplicationMessage, StandbyStatusUpdate};

/// The largest length field of a server message in CopyBoth mode, in bytes.
///
/// PostgreSQL builds each message it sends (the walsender's XLogData included, header and
/// all) in one `StringInfo`, which it keeps below `MaxAllocSize` (1 GiB − 1); the length
/// field adds its own 4 bytes.
pub const MAX_FRAME_LEN: usize = (1 << 30) + 4;

/// An open CopyBoth replication stream.
pub struct ReplicationStream {
    socket: Box<dyn Socket>,
    read_buf: BytesMut,
    write_buf: BytesMut,
}

impl std::fmt::Debug for ReplicationStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplicationStream")
            .field("buffered_bytes", &self.read_buf.len())
            .finish_non_exhaustive()
    }
}

impl ReplicationStream {
    pub(crate) fn new(socket: Box<dyn Socket>, read_buf: BytesMut) -> Self {
        ReplicationStream {
            socket,
            read_buf,
            write_buf: BytesMut::with_capacity(256),
        }
    }

    /// Reads more bytes from the socket into the buffer, in chunks of up to 1 MiB.
    ///
    /// # Cancel safety
    /// Cancel safe: `read_buf` either read bytes into the buffer or did nothing.
    ///
    /// # Errors
    /// [`Error::Io`] on a socket error, [`Error::Closed`] on EOF.
    pub async fn fill(&mut self) -> Result<usize, Error> {
        const CTX: &str = "reading the replication stream";
        if self.read_buf.capacity() - self.read_buf.len() < READ_CHUNK / 16 {
            self.read_buf.reserve(READ_CHUNK);
        }
        let n = self
            .socket
            .read_buf(&mut self.read_buf)
            .await
            .map_err(|source| Error::Io {
                context: CTX,
                source,
            })?;
        if n == 0 {
            return Err(Error::Closed { context: CTX });
        }
        Ok(n)
    }

    /// Like [`ReplicationStream::fill`], but when bytes arrive before `not_before` it first
    /// sleeps until then, so that everything the server sends meanwhile is taken in one read.
    ///
    /// Under a steady trickle of small transactions this turns one wake-up per transaction
    /// into one per interval; when the stream is idle the first bytes are read as soon as
    /// they arrive (`not_before` is then in the past). Returns the number of bytes read.
    ///
    /// # Cancel safety
    /// Cancel safe: waiting for readiness and sleeping consume nothing, and the read is
    /// [`ReplicationStream::fill`].
    ///
    /// # Errors
    /// As [`ReplicationStream::fill`].
    pub async fn fill_not_before(
        &mut self,
        not_before: tokio::time::Instant,
    ) -> Result<usize, Error> {
        if tokio::time::Instant::now() < not_before {
            std::future::poll_fn(|cx| self.socket.poll_read_ready(cx))
                .await
                .map_err(|source| Error::Io {
                    context: "waiting for the replication stream",
                    source,
                })?;
            tokio::time::sleep_until(not_before).await;
        }
        self.fill().await
    }

    /// Bytes read but not yet parsed.
    pub fn buffered_bytes(&self) -> usize {
        self.read_buf.len()
    }

    /// Parses the next complete frame from the buffer, without I/O.
    ///
    /// Returns `Ok(None)` when more bytes are needed. CopyDone ends the stream with
    /// [`Error::Closed`], CommandComplete or ReadyForQuery (a server shutting down) with
    /// [`Error::StreamEnded`]; an ErrorResponse becomes [`Error::Server`]; notices are skipped.
    ///
    /// # Errors
    /// [`Error::Server`], [`Error::Closed`], [`Error::StreamEnded`], [`Error::Protocol`] for an unexpected or
    /// malformed frame, [`Error::Frame`] for a malformed CopyData payload.
    pub fn next_buffered(&mut self) -> Result<Option<ReplicationMessage>, Error> {
        parse_stream_frame(&mut self.read_buf)
    }

    /// Sends one standby status update (a CopyData `r` frame).
    ///
    /// # Cancel safety
    /// Not cancel safe (a partial write would corrupt the stream): call it from a branch
    /// body, never as a `select!` branch future.
    ///
    /// # Errors
    /// [`Error::Io`] when the write fails.
    pub async fn send_status(&mut self, update: &StandbyStatusUpdate) -> Result<(), Error> {
        self.write_buf.clear();
        update.encode_copy_data(&mut self.write_buf);
        self.socket
            .write_all(&self.write_buf)
            .await
            .map_err(|source| Error::Io {
                context: "sending a standby status update",
                source,
            })?;
        self.socket.flush().await.map_err(|source| Error::Io {
            context: "sending a standby status update",
            source,
        })
    }

    /// Sends CopyDone and Terminate, ending the session politely (best effort).
    pub async fn close(mut self) {
        let mut buf = BytesMut::new();
        postgres_protocol::message::frontend::copy_done(&mut buf);
        postgres_protocol::message::frontend::terminate(&mut buf);
        let _ = self.socket.write_all(&buf).await;
        let _ = self.socket.shutdown().await;
    }
}

/// Splits the next complete frame of a CopyBoth stream off the front of `read_buf` and
/// parses it, without I/O: what [`ReplicationStream::next_buffered`] does with its buffer.
///
/// Returns `Ok(None)` when more bytes are needed (notices before that are consumed).
/// CopyDone ends the stream with [`Error::Closed`], CommandComplete or ReadyForQuery with
/// [`Error::StreamEnded`]; an ErrorResponse becomes [`Error::Server`].
///
/// # Errors
/// [`Error::Server`], [`Error::Closed`], [`Error::StreamEnded`], [`Error::Protocol`] for an
/// unexpected or malformed frame or one declaring more than [`MAX_FRAME_LEN`] bytes,
/// [`Error::Frame`] for a malformed CopyData payload.
pub fn parse_stream_frame(read_buf: &mut BytesMut) -> Result<Option<ReplicationMessage>, Error> {
    const CTX: &str = "reading the replication stream";
    loop {
        let tag = read_buf.first().copied();
        // postgres-protocol reserves the declared length before the body arrives: bound it
        // first, so a corrupt or hostile header cannot become a 4 GiB allocation.
        if let Some(header) = read_buf.get(..5) {
            let declared = u32::from_be_bytes([header[1], header[2], header[3], header[4]]);
            if usize::try_from(declared).map_or(true, |l| l > MAX_FRAME_LEN) {
                return Err(Error::Protocol {
                    context: CTX,
                    detail: format!(
                        "server message {:?} declares {declared} bytes, more than the \
                         {MAX_FRAME_LEN} PostgreSQL can send",
                        char::from(header[0])
                    ),
                });
            }
        }
        let msg = backend::Message::parse(read_buf).map_err(|e| Error::Protocol {
            context: CTX,
            detail: e.to_string(),
        })?;
        match msg {
            None => return Ok(None),
            Some(backend::Message::CopyData(body)) => {
                return Ok(Some(parse_copy_data(body.into_bytes())?));
            }
            Some(backend::Message::ErrorResponse(body)) => {
                return Err(Error::Server {
                    context: CTX,
                    error: Box::new(ServerError::from_body(&body)),
                })
            }
            Some(backend::Message::CopyDone) => return Err(Error::Closed { context: CTX }),
            Some(backend::Message::CommandComplete(_))
            | Some(backend::Message::ReadyForQuery(_)) => {
                return Err(Error::StreamEnded { context: CTX })
            }
            Some(backend::Message::NoticeResponse(_))
            | Some(backend::Message::ParameterStatus(_)) => continue,
            Some(_) => {
                return Err(Error::Protocol {
                    context: CTX,
                    detail: format!(
                        "unexpected message {:?} in CopyBoth mode",
                        tag.map(char::from).unwrap_or('?')
                    ),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream over one end of a Unix socket pair whose read buffer already holds `bytes`.
    fn stream_with(bytes: &[u8]) -> (ReplicationStream, tokio::net::UnixStream) {
        let (a, b) = tokio::net::UnixStream::pair().expect("socket pair");
        (
            ReplicationStream::new(Box::new(a), BytesMut::from(bytes)),
            b,
        )
    }

    /// CommandComplete "COPY 0", as a walsender sends it from `WalSndDone` at shutdown.
    fn command_complete() -> Vec<u8> {
        let mut frame = vec![b'C', 0, 0, 0, 11];
        frame.extend_from_slice(b"COPY 0\0");
        frame
    }

    #[tokio::test]
    async fn command_complete_in_copy_both_is_a_server_shutdown_not_a_protocol_violation() {
        let (mut s, _peer) = stream_with(&command_complete());
        let e = s.next_buffered().expect_err("stream ended");
        assert!(matches!(e, Error::StreamEnded { .. }), "{e:?}");
        assert!(e.is_connection_loss(), "reconnecting is right");
        assert!(e.to_string().contains("shutting down or restarting"), "{e}");
    }

    /// The same kind of bug the `startup` fuzz target found in start-up: postgres-protocol
    /// reserves the whole declared length of a frame before its body arrives, so a header
    /// declaring 4 GiB was a 4 GiB allocation.
    #[tokio::test]
    async fn a_declared_frame_length_is_neither_reserved_up_front_nor_unbounded() {
        let (mut s, _peer) = stream_with(&[b'd', 0xff, 0xff, 0xff, 0xff]);
        let r = s.next_buffered();
        assert!(
            s.read_buf.capacity() < 1 << 24,
            "reserved {} bytes for a frame declaring 4 GiB",
            s.read_buf.capacity()
        );
        let e = r.expect_err("a CopyData longer than PostgreSQL can build");
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
        assert!(e.to_string().contains("declares 4294967295 bytes"), "{e}");

        // Just over what PostgreSQL can send is refused; the largest it can send is awaited.
        let over = u32::try_from(MAX_FRAME_LEN + 1).unwrap().to_be_bytes();
        let (mut s, _peer) = stream_with(&[b'd', over[0], over[1], over[2], over[3], b'w']);
        assert!(matches!(s.next_buffered(), Err(Error::Protocol { .. })));
        let max = u32::try_from(MAX_FRAME_LEN).unwrap().to_be_bytes();
        let (mut s, _peer) = stream_with(&[b'd', max[0], max[1], max[2], max[3], b'w']);
        assert!(s.next_buffered().expect("incomplete").is_none());
        assert_eq!(s.buffered_bytes(), 6, "nothing consumed");
    }

    #[tokio::test]
    async fn an_unexpected_message_is_named_by_its_tag() {
        // ParseComplete ('1'), which never belongs in COPY BOTH.
        let (mut s, _peer) = stream_with(&[b'1', 0, 0, 0, 4]);
        let e = s.next_buffered().expect_err("protocol violation");
        assert!(matches!(e, Error::Protocol { .. }), "{e:?}");
        assert!(e.to_string().contains("'1'"), "{e}");
    }
}
