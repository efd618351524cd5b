//! The AMQP publisher as a [`Sink`]: one connection, one confirm window, the message
//! mapping of [`super::encode`].
//!
//! Everything the wire does is [`Publisher`]'s; this only encodes each [`Delivery`] with
//! the run's [`Encoder`] and maps the publisher's errors onto the seam's [`SinkError`].

use std::collections::VecDeque;
use std::task::{Context, Poll};
use std::time::Instant;

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
    /// First publishes not yet written whole: (the connection's byte count once its last
    /// byte is written, when the read that completed it returned), in write order.
    unwritten: VecDeque<(u64, Instant)>,
    /// Where their residence time goes once written (`None`: not recorded).
    residence: Option<crate::metrics::Residence>,
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
            unwritten: VecDeque::new(),
            residence: config.signals.residence.clone(),
        })
    }

    /// Records the residence time of every first publish whose last byte is written now.
    /// A message held until its producer-named exchange is declared is encoded later than it
    /// was accepted, so its time ends at the next write instead (a rare first use of an
    /// exchange, counted short).
    fn note_written(&mut self) {
        let Some(residence) = &self.residence else {
            return;
        };
        let written = self.publisher.written_bytes();
        if self.unwritten.front().is_none_or(|(end, _)| *end > written) {
            return;
        }
        let now = Instant::now();
        while let Some(&(end, read_at)) = self.unwritten.front() {
            if end > written {
                break;
            }
            residence.observe(now.saturating_duration_since(read_at));
            self.unwritten.pop_front();
        }
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
        let delivery_read_at = delivery.read_at;
        let message = self
            .encoder
            .encode(delivery)
            .map_err(SinkError::Unencodable)?;
        let read_at = delivery_read_at;
        self.publisher.publish(message).map_err(sink_error)?;
        self.published += 1;
        if let (Some(at), Some(_)) = (read_at, &self.residence) {
            self.unwritten
                .push_back((self.publisher.encoded_bytes(), at));
        }
        Ok(())
    }

    fn poll_settled(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Result<Vec<(Seq, PublishOutcome)>, SinkError>> {
        let polled = self.publisher.poll_outcomes(cx);
        self.note_written();
        polled.map(|r| r.map_err(sink_error))
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
