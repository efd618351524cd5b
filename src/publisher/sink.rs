//! The AMQP publisher as a [`Sink`]: one connection, one confirm window, the message
//! mapping of [`super::encode`].
//!
//! Everything the wire does is [`Publisher`]'s; this only encodes each [`Delivery`] with
//! the run's [`Encoder`] and maps the publisher's errors onto the seam's [`SinkError`].

use std::task::{Context, Poll};

use futures::future::BoxFuture;

use super::encode::Encoder;
use super::{Error, Publisher, PublisherConfig};
use crate::sink::{
    Delivery, PartFigures, PartHealth, PublishOutcome, Seq, Sink, SinkError, SinkHealth,
};

/// One AMQP 0-9-1 connection with publisher confirms, as a [`Sink`].
#[derive(Debug)]
pub struct AmqpSink {
    publisher: Publisher<Seq>,
    encoder: Encoder,
    /// Publishes accepted since it connected (for the per-partition metrics).
    published: u64,
}

impl AmqpSink {
    /// Connects as [`Publisher::connect`] does; deliveries are encoded with `encoder`.
    ///
    /// # Errors
    /// As [`Publisher::connect`].
    pub async fn connect(config: &PublisherConfig, encoder: Encoder) -> Result<Self, Error> {
        let publisher = Publisher::connect(config).await?;
        Ok(AmqpSink {
            publisher,
            encoder,
            published: 0,
        })
    }

    /// The publisher underneath (its negotiated limits, for tests and logs).
    pub fn publisher(&self) -> &Publisher<Seq> {
        &self.publisher
    }
}

/// The seam's name for the publisher's errors on the publish and confirm path.
fn sink_error(e: Error) -> SinkError {
    match e {
        Error::Unsendable(reason) => SinkError::Unsendable(reason),
        Error::Lost(reason) => SinkError::Lost(reason),
        // The full text ("RabbitMQ broke the publisher-confirm protocol: ...").
        e @ Error::Protocol(_) => SinkError::Violated(e.to_string()),
        // Connect-time errors never come from publish or poll; retryable by default.
        e => SinkError::Lost(e.to_string()),
    }
}

impl Sink for AmqpSink {
    fn publish(&mut self, delivery: Delivery) -> Result<(), SinkError> {
        let message = self
            .encoder
            .encode(delivery)
            .map_err(SinkError::Unencodable)?;
        self.publisher.publish(message).map_err(sink_error)?;
        self.published += 1;
        Ok(())
    }

    fn poll_settled(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
        self.publisher
            .poll_outcomes(cx)
            .map(|r| r.map_err(sink_error))
    }

    /// True while the connection is open. A blocked connection (`connection.blocked`) is
    /// still writable: RabbitMQ stops reading our socket, the publishes wait in the write
    /// buffer, and the loop's window bounds them (what `operations`' blocked-broker tests
    /// hold: the window fills, the connection survives).
    fn is_writable(&self) -> bool {
        self.publisher.is_connected()
    }

    fn health(&self) -> SinkHealth {
        SinkHealth::single(if !self.publisher.is_connected() {
            PartHealth::Lost
        } else if self.publisher.is_blocked() {
            PartHealth::Blocked
        } else {
            PartHealth::Connected
        })
    }

    fn unsettled(&self) -> usize {
        self.publisher.unsettled()
    }

    fn parts(&self) -> Vec<PartFigures> {
        vec![PartFigures {
            health: self.health().parts[0],
            unsettled: self.unsettled(),
            published: self.published,
        }]
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        Box::pin(self.publisher.close())
    }
}
