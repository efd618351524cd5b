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

use crate::replication::connect::{Socket, READ_CHUNK};
use crate::replication::error::{Error, ServerError};
use crate::replication::stream::{parse_copy_data, ReplicationMessage, StandbyStatusUpdate};

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
    /// [`Error::Closed`]; an ErrorResponse becomes [`Error::Server`]; notices are skipped.
    ///
    /// # Errors
    /// [`Error::Server`], [`Error::Closed`], [`Error::Protocol`] for an unexpected or
    /// malformed frame, [`Error::Frame`] for a malformed CopyData payload.
    pub fn next_buffered(&mut self) -> Result<Option<ReplicationMessage>, Error> {
        const CTX: &str = "reading the replication stream";
        loop {
            let msg = backend::Message::parse(&mut self.read_buf).map_err(|e| Error::Protocol {
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
                Some(backend::Message::NoticeResponse(_))
                | Some(backend::Message::ParameterStatus(_)) => continue,
                Some(_) => {
                    return Err(Error::Protocol {
                        context: CTX,
                        detail: "unexpected message in CopyBoth mode".into(),
                    })
                }
            }
        }
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
