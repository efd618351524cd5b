//! The consumer-side inbox: apply each event exactly once (lapin + tokio-postgres).
//!
//! pgoutbox delivers at least once: a message can arrive twice (a streamer restart resends
//! its unacknowledged window, a producer retried, a consumer crashed before its ack). The
//! inbox turns that into *effectively exactly once* for side effects kept in PostgreSQL:
//!
//! ```text
//!  RabbitMQ queue ──delivery (prefetch)──▶ Inbox::run
//!     BEGIN
//!       SELECT outbox.inbox_claim(consumer, message-id, tenant)   -- sql/inbox.sql
//!       true  → Handler::handle(&tx, &message)                    -- the side effect
//!       false → nothing (already applied)
//!     COMMIT
//!  ◀── basic.ack (only after COMMIT returned)
//! ```
//!
//! # Why this is exactly once
//! - **The claim and the side effect are one transaction.** `outbox.inbox_claim` inserts
//!   `(consumer, coalesce(tenant, ''), message_id)` into `outbox.inbox` with `ON CONFLICT DO
//!   NOTHING` and returns whether it inserted. Both commit together or neither does, so "the
//!   id is recorded" and "the effect happened" are the same fact.
//! - **Ack after commit.** The delivery is acknowledged only once COMMIT returned. A crash (of
//!   this process, PostgreSQL or the connection) before the commit leaves nothing behind and
//!   the broker redelivers the unacknowledged message: the claim is true again, the effect is
//!   applied then.
//! - **A crash between commit and ack** is the one window where the effect is durable and the
//!   broker does not know it: the broker redelivers, the claim returns false, the handler is
//!   not run, and the delivery is acknowledged. The same happens to a duplicate publish.
//! - **Concurrent consumers** (two processes on one queue, each holding one copy of a
//!   duplicate): the second `INSERT` waits for the first transaction's row lock; if the first
//!   commits it inserts nothing (false), if the first rolls back it inserts (true). At most one
//!   commits the effect.
//! - **Handler errors** roll the transaction back (claim included) and the delivery is
//!   nacked with requeue, so a later attempt applies it once. After
//!   [`InboxConfig::max_deliveries`] attempts it is rejected without requeue: RabbitMQ moves it
//!   to the queue's dead-letter exchange (`x-dead-letter-exchange`, by policy or argument), or
//!   **drops it when the queue has none**: give every inbox queue a dead-letter exchange.
//!
//! The guarantee covers effects written through the handler's transaction. A handler that
//! also calls out (HTTP, another broker) gets at-least-once for those calls, and should pass
//! the message id on as an idempotency key.
//!
//! # Counting attempts
//! Quorum queues count deliveries themselves: the broker adds `x-delivery-count` (deliveries
//! before this one) to redelivered messages, and the count survives consumer restarts and is
//! shared by all consumers. Classic queues have no such header, so the inbox counts handler
//! failures in process, by `(tenant, message id)`: **the bound is then per process**. A message
//! that fails in several consumers, or across restarts, can be attempted more often in total
//! (up to `max_deliveries` times per process that sees it), never fewer.
//!
//! Messages are handled one at a time, in delivery order; the prefetch keeps the next ones
//! on the way while one is applied. For parallelism, run several consumers (each with its own
//! database connection and channel) on the queue: the claim keeps them apart.
//!
//! See the RabbitMQ docs, "Consumer Acknowledgements and Publisher Confirms" (acks, nack with
//! requeue, prefetch), "Dead Letter Exchanges" and "Quorum Queues" (`x-delivery-count`, poison
//! message handling).

use std::collections::HashMap;
use std::future::Future;

use futures::StreamExt;
use lapin::message::Delivery;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{BasicProperties, Channel};
use tokio_postgres::{Client, Transaction};

/// `sql/inbox.sql`: the table `outbox.inbox` and the functions `outbox.inbox_claim` and
/// `outbox.inbox_purge`. Installed by `pgoutbox setup`; stands alone in any database.
pub const INBOX_SQL: &str = include_str!("../sql/inbox.sql");

/// Default prefetch (`basic.qos` prefetch count, in messages): enough to keep the next
/// deliveries on the wire while one transaction commits, small enough that a crash returns
/// little to the queue and a second consumer gets a share.
pub const DEFAULT_PREFETCH: u16 = 32;

/// Default bound on attempts (the first delivery included) before a failing message is
/// rejected to the dead-letter exchange: enough to ride out a deadlock or a brief outage of
/// what the handler calls, few enough that a poison message leaves quickly.
pub const DEFAULT_MAX_DELIVERIES: u32 = 5;

/// The header carrying the producer's tenant (`outbox.emit(..., tenant => ...)`): the one
/// the streamer sets, [`crate::contract::HEADER_TENANT`].
pub const TENANT_HEADER: &str = crate::contract::HEADER_TENANT;

/// The header quorum queues add to redelivered messages: how many times the message was
/// delivered before.
pub const DELIVERY_COUNT_HEADER: &str = "x-delivery-count";

/// How many classic-queue failure counts a process keeps before it forgets them all (a
/// message requeued and then taken by another consumer leaves its count behind). After the
/// reset a failing message gets up to [`InboxConfig::max_deliveries`] fresh attempts: the bound
/// can be exceeded, never reached early.
pub const ATTEMPT_MEMORY: usize = 100_000;

/// The statement that claims a message (in the handler's transaction).
const CLAIM: &str = "SELECT outbox.inbox_claim($1, $2, $3)";

/// What the inbox needs to know. Build it with [`InboxConfig::new`] and adjust the fields.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfig {
    /// The consumer's name, the first part of the inbox key: one per consuming service (two
    /// services consuming the same events each apply them once). Not empty.
    pub consumer: String,
    /// The queues to consume from, on the one channel (one consumer on each; deliveries are
    /// handled one at a time, each queue's in its order). Each must exist (the inbox does not
    /// declare it) and should have a dead-letter exchange; names of 1 to 255 bytes, at least
    /// one, none twice. Several queues: the consistent-hash topology of `pgoutbox
    /// declare-topology`, whose quorum queues have a single active consumer, so that several
    /// inbox processes on the same queues stand by for each other queue by queue.
    pub queues: Vec<String>,
    /// `basic.qos` prefetch count, in messages, at least 1 ([`DEFAULT_PREFETCH`]).
    pub prefetch: u16,
    /// Attempts, the first delivery included, before a message whose handler keeps failing is
    /// rejected without requeue, at least 1 ([`DEFAULT_MAX_DELIVERIES`]). Per process on
    /// classic queues (see the module docs).
    pub max_deliveries: u32,
}

impl InboxConfig {
    /// A configuration for one queue with the default prefetch and delivery bound.
    pub fn new(consumer: impl Into<String>, queue: impl Into<String>) -> InboxConfig {
        InboxConfig::with_queues(consumer, [queue])
    }

    /// A configuration for several queues with the default prefetch and delivery bound.
    pub fn with_queues<Q: Into<String>>(
        consumer: impl Into<String>,
        queues: impl IntoIterator<Item = Q>,
    ) -> InboxConfig {
        InboxConfig {
            consumer: consumer.into(),
            queues: queues.into_iter().map(Into::into).collect(),
            prefetch: DEFAULT_PREFETCH,
            max_deliveries: DEFAULT_MAX_DELIVERIES,
        }
    }

    /// Checks every field.
    ///
    /// # Errors
    /// [`Error::Config`] naming the field, the value and the fix.
    pub fn validate(&self) -> Result<(), Error> {
        let bad = |setting: &'static str, value: String, fix: &'static str| {
            Err(Error::Config {
                setting,
                value,
                fix,
            })
        };
        if self.consumer.is_empty() {
            return bad(
                "consumer",
                String::new(),
                "name the consuming service, e.g. \"billing\"; it keys the inbox",
            );
        }
        if self.queues.is_empty() {
            return bad("queues", "none".into(), "name at least one existing queue");
        }
        for (i, queue) in self.queues.iter().enumerate() {
            if queue.is_empty() || queue.len() > 255 {
                return bad(
                    "queues",
                    format!("{} bytes", queue.len()),
                    "name existing queues of 1 to 255 bytes",
                );
            }
            if self.queues[..i].contains(queue) {
                return bad(
                    "queues",
                    queue.clone(),
                    "name each queue once (a second consumer on it in the same channel would only compete with the first)",
                );
            }
        }
        if self.prefetch == 0 {
            return bad(
                "prefetch",
                "0".into(),
                "use at least 1 (0 would mean unlimited); 32 is the default",
            );
        }
        if self.max_deliveries == 0 {
            return bad(
                "max_deliveries",
                "0".into(),
                "use at least 1 (the first delivery counts); 5 is the default",
            );
        }
        Ok(())
    }
}

/// One delivery, as the handler sees it.
#[derive(Debug, Clone, PartialEq)]
pub struct InboxMessage {
    /// The AMQP `message-id` property (outbox.emit's `message_id`).
    pub message_id: String,
    /// The `x-pgoutbox-tenant` header; `None` when absent or empty (one tenant, stored as '').
    pub tenant: Option<String>,
    /// This delivery's attempt number, 1 for the first: from `x-delivery-count` on quorum
    /// queues, from this process's count of handler failures otherwise.
    pub attempt: u32,
    /// The broker's redelivered flag (delivered before, to this or another consumer).
    pub redelivered: bool,
    /// The exchange it was published to.
    pub exchange: String,
    /// The routing key (for pgoutbox: the topic).
    pub routing_key: String,
    /// All AMQP properties and headers.
    pub properties: BasicProperties,
    /// The body (for pgoutbox: the payload, byte for byte).
    pub body: Vec<u8>,
}

impl InboxMessage {
    /// The header `key`, if present.
    pub fn header(&self, key: &str) -> Option<&AMQPValue> {
        header(&self.properties, key)
    }
}

/// What a handler returns on failure: any error (the inbox logs it and retries).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Applies one message inside the inbox's transaction.
///
/// Implement it with an `async fn`:
/// ```no_run
/// use pgoutbox::inbox::{Handler, HandlerError, InboxMessage};
/// use tokio_postgres::Transaction;
///
/// struct Apply;
///
/// impl Handler for Apply {
///     async fn handle(&self, tx: &Transaction<'_>, message: &InboxMessage) -> Result<(), HandlerError> {
///         tx.execute("INSERT INTO seen (id) VALUES ($1)", &[&message.message_id]).await?;
///         Ok(())
///     }
/// }
/// ```
pub trait Handler: Send + Sync {
    /// Applies `message` through `tx` (which already holds the message's claim). It is called
    /// only for a message this consumer has not applied yet. Everything written through `tx`
    /// commits with the claim; do not commit or roll back yourself.
    ///
    /// # Errors
    /// Any error rolls the transaction back; the message is redelivered (nacked with requeue)
    /// until [`InboxConfig::max_deliveries`], then rejected to the dead-letter exchange.
    fn handle(
        &self,
        tx: &Transaction<'_>,
        message: &InboxMessage,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;
}

/// What the inbox did with one delivery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Claimed, handled and committed, then acked.
    Applied,
    /// Claimed before (a redelivery or a duplicate): not handled, acked.
    Duplicate,
    /// The handler (or the commit) failed; nacked with requeue for another attempt.
    Requeued {
        /// The attempt that failed, 1 for the first.
        attempt: u32,
    },
    /// Rejected without requeue: to the queue's dead-letter exchange, if it has one.
    Rejected(RejectReason),
}

/// Why a delivery was rejected without requeue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RejectReason {
    /// No (or an empty) `message-id` property: it cannot be claimed.
    MissingMessageId,
    /// The `x-pgoutbox-tenant` header is not a string.
    InvalidTenant,
    /// The handler failed on every one of this many attempts.
    AttemptsExhausted {
        /// Attempts made (the bound).
        attempts: u32,
    },
}

/// Counts of outcomes since [`Inbox::run`] started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InboxStats {
    /// [`Outcome::Applied`].
    pub applied: u64,
    /// [`Outcome::Duplicate`].
    pub duplicates: u64,
    /// [`Outcome::Requeued`].
    pub requeued: u64,
    /// [`Outcome::Rejected`].
    pub rejected: u64,
}

impl InboxStats {
    fn count(&mut self, outcome: &Outcome) {
        match outcome {
            Outcome::Applied => self.applied += 1,
            Outcome::Duplicate => self.duplicates += 1,
            Outcome::Requeued { .. } => self.requeued += 1,
            Outcome::Rejected(_) => self.rejected += 1,
        }
    }
}

/// What the inbox can fail with. A failure ends [`Inbox::run`]; deliveries not acked by then
/// go back to the queue when the channel closes, so restarting the consumer is safe.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A field of [`InboxConfig`] is invalid.
    #[error("inbox setting {setting} = {value:?} is invalid: {fix}")]
    Config {
        /// The field.
        setting: &'static str,
        /// Its value (or a description of it).
        value: String,
        /// What to do instead.
        fix: &'static str,
    },
    /// `outbox.inbox_claim` does not exist in the consumer's database.
    #[error("outbox.inbox_claim(text, text, text) does not exist in database {database:?}: install sql/inbox.sql there (psql -d {database} -f sql/inbox.sql, or pgoutbox setup on that database)")]
    NotInstalled {
        /// `current_database()`.
        database: String,
    },
    /// A broker operation failed (connection or channel lost, queue missing, ...).
    #[error("rabbitmq: {context}")]
    Amqp {
        /// What we were doing.
        context: &'static str,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// A database operation other than the handler's failed.
    #[error("postgres: {context}")]
    Postgres {
        /// What we were doing.
        context: &'static str,
        /// tokio-postgres' error (carries the SQLSTATE).
        #[source]
        source: tokio_postgres::Error,
    },
    /// The consumer was cancelled by the broker (the queue was deleted, say).
    #[error("rabbitmq cancelled the consumer on queue {queue:?} (was the queue deleted?)")]
    Cancelled {
        /// The queue.
        queue: String,
    },
}

fn amqp(context: &'static str) -> impl FnOnce(lapin::Error) -> Error {
    move |source| Error::Amqp { context, source }
}

fn postgres(context: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Error {
    move |source| Error::Postgres { context, source }
}

/// A consumer that applies each message of a queue exactly once (see the module docs).
#[derive(Debug)]
pub struct Inbox<H> {
    config: InboxConfig,
    client: Client,
    channel: Channel,
    handler: H,
    failures: FailureCounts,
    stats: InboxStats,
}

impl<H: Handler> Inbox<H> {
    /// An inbox on a database connection (holding `sql/inbox.sql` and the handler's tables)
    /// and a channel of its own (the inbox sets its prefetch).
    ///
    /// # Errors
    /// [`Error::Config`] from [`InboxConfig::validate`].
    pub fn new(
        config: InboxConfig,
        client: Client,
        channel: Channel,
        handler: H,
    ) -> Result<Inbox<H>, Error> {
        config.validate()?;
        Ok(Inbox {
            config,
            client,
            channel,
            handler,
            failures: FailureCounts::default(),
            stats: InboxStats::default(),
        })
    }

    /// Consumes until `shutdown` completes (then returns the counts) or something fails.
    ///
    /// Checks that `outbox.inbox_claim` exists, sets the prefetch and starts consuming. A
    /// delivery being handled when `shutdown` completes is finished (committed and acked, or
    /// rolled back and nacked) first; prefetched deliveries not yet handled return to the
    /// queue when the channel closes.
    ///
    /// # Errors
    /// [`Error::NotInstalled`], [`Error::Cancelled`], [`Error::Amqp`] (connection or channel
    /// lost, missing queue), [`Error::Postgres`] (connection lost, claim failed). Nothing is
    /// acked that was not committed; restart to go on.
    ///
    /// # Cancel safety
    /// Dropping the future mid-delivery rolls back its transaction (tokio-postgres rolls back a
    /// dropped `Transaction`) and leaves the delivery unacked: the broker redelivers it once the
    /// channel closes. Nothing is applied twice, but prefer `shutdown` for a clean stop.
    pub async fn run(mut self, shutdown: impl Future<Output = ()>) -> Result<InboxStats, Error> {
        let row = self
            .client
            .query_one(
                "SELECT current_database()::text, to_regprocedure('outbox.inbox_claim(text, text, text)') IS NOT NULL",
                &[],
            )
            .await
            .map_err(postgres("checking that outbox.inbox_claim exists"))?;
        if !row.get::<_, bool>(1) {
            return Err(Error::NotInstalled {
                database: row.get(0),
            });
        }
        self.channel
            .basic_qos(self.config.prefetch, BasicQosOptions::default())
            .await
            .map_err(amqp("setting the prefetch (basic.qos)"))?;
        // One consumer per queue on the channel, merged: each yields its deliveries, then a
        // `None` when it ends (the broker cancelled it).
        let mut consumers = Vec::with_capacity(self.config.queues.len());
        for (i, queue) in self.config.queues.iter().enumerate() {
            let consumer = self
                .channel
                .basic_consume(
                    queue.as_str().into(),
                    "".into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(amqp("starting to consume (basic.consume)"))?;
            consumers.push(
                consumer
                    .map(move |d| (i, Some(d)))
                    .chain(futures::stream::iter([(i, None)]))
                    .boxed(),
            );
        }
        let mut deliveries = futures::stream::select_all(consumers);
        tracing::info!(
            consumer = %self.config.consumer,
            queues = %self.config.queues.join(","),
            prefetch = self.config.prefetch,
            max_deliveries = self.config.max_deliveries,
            "inbox consuming"
        );
        let mut shutdown = std::pin::pin!(shutdown);
        loop {
            let delivery = tokio::select! {
                biased;
                // PRIORITY 1: a requested stop, checked between deliveries only.
                // Cancel safety: the caller's future, polled by reference.
                () = &mut shutdown => break,
                // PRIORITY 2: the next delivery of any queue. Cancel safety: `SelectAll::next`
                // takes an item out of a consumer's buffer only when it returns it.
                next = deliveries.next() => next,
            };
            let (i, delivery) = match delivery {
                Some((i, Some(Ok(delivery)))) => (i, delivery),
                Some((_, Some(Err(source)))) => {
                    return Err(Error::Amqp {
                        context: "receiving deliveries",
                        source,
                    })
                }
                Some((i, None)) => {
                    return Err(Error::Cancelled {
                        queue: self.config.queues[i].clone(),
                    })
                }
                None => {
                    return Err(Error::Cancelled {
                        queue: self.config.queues.join(","),
                    })
                }
            };
            let queue = self.config.queues[i].clone();
            let outcome = self.process(delivery, &queue).await?;
            self.stats.count(&outcome);
        }
        tracing::info!(
            consumer = %self.config.consumer,
            queues = %self.config.queues.join(","),
            applied = self.stats.applied,
            duplicates = self.stats.duplicates,
            requeued = self.stats.requeued,
            rejected = self.stats.rejected,
            "inbox stopped"
        );
        Ok(self.stats)
    }

    /// Claims, handles, commits and then settles one delivery.
    async fn process(&mut self, delivery: Delivery, queue: &str) -> Result<Outcome, Error> {
        let message_id = match delivery.properties.message_id() {
            Some(id) if !id.as_str().is_empty() => id.as_str().to_owned(),
            _ => {
                tracing::error!(
                    consumer = %self.config.consumer,
                    queue = %queue,
                    routing_key = %delivery.routing_key,
                    "inbox: delivery without a message-id property, rejected (to the dead-letter exchange, if the queue has one): it cannot be applied exactly once"
                );
                return reject(&delivery, RejectReason::MissingMessageId).await;
            }
        };
        let tenant = match header(&delivery.properties, TENANT_HEADER) {
            None => None,
            Some(value) => match text(value) {
                Some(t) if t.is_empty() => None,
                Some(t) => Some(t),
                None => {
                    tracing::error!(
                        consumer = %self.config.consumer,
                        message_id = %message_id,
                        "inbox: header x-pgoutbox-tenant is not a string, rejected (to the dead-letter exchange, if the queue has one)"
                    );
                    return reject(&delivery, RejectReason::InvalidTenant).await;
                }
            },
        };
        let key = (tenant.clone().unwrap_or_default(), message_id.clone());
        let attempt = match header(&delivery.properties, DELIVERY_COUNT_HEADER).and_then(integer) {
            Some(before) => u32::try_from(before.saturating_add(1)).unwrap_or(u32::MAX),
            None => self.failures.get(&key).saturating_add(1),
        };
        let message = InboxMessage {
            message_id,
            tenant,
            attempt,
            redelivered: delivery.redelivered,
            exchange: delivery.exchange.as_str().to_owned(),
            routing_key: delivery.routing_key.as_str().to_owned(),
            properties: delivery.properties.clone(),
            body: delivery.data.clone(),
        };

        let applied = {
            let tx = match self.client.transaction().await {
                Ok(tx) => tx,
                Err(e) => {
                    return requeue_and_fail(&delivery, postgres("beginning a transaction")(e))
                        .await
                }
            };
            let claimed: bool = match tx
                .query_one(
                    CLAIM,
                    &[&self.config.consumer, &message.message_id, &message.tenant],
                )
                .await
            {
                Ok(row) => row.get(0),
                Err(e) => {
                    drop(tx);
                    return requeue_and_fail(
                        &delivery,
                        postgres("claiming the message (outbox.inbox_claim)")(e),
                    )
                    .await;
                }
            };
            if !claimed {
                // Nothing was written: end the transaction, then ack.
                if let Err(e) = tx.rollback().await {
                    return requeue_and_fail(
                        &delivery,
                        postgres("ending the transaction of a duplicate")(e),
                    )
                    .await;
                }
                None
            } else {
                match self.handler.handle(&tx, &message).await {
                    Ok(()) => match tx.commit().await {
                        Ok(()) => Some(Ok(())),
                        // A lost connection leaves the commit's outcome unknown: requeue (a
                        // redelivery claims false if it did commit) and stop.
                        Err(e) if self.client.is_closed() => {
                            return requeue_and_fail(&delivery, postgres("committing")(e)).await
                        }
                        // A deferred constraint, a serialization failure: the handler's failure.
                        Err(e) => Some(Err(HandlerError::from(e))),
                    },
                    Err(e) => {
                        if let Err(rollback) = tx.rollback().await {
                            return requeue_and_fail(
                                &delivery,
                                postgres("rolling back after a handler error")(rollback),
                            )
                            .await;
                        }
                        Some(Err(e))
                    }
                }
            }
        };

        match applied {
            None => {
                ack(&delivery).await?;
                self.failures.forget(&key);
                tracing::debug!(consumer = %self.config.consumer, message_id = %message.message_id, attempt, redelivered = message.redelivered, "inbox: duplicate, acked without applying");
                Ok(Outcome::Duplicate)
            }
            Some(Ok(())) => {
                // A crash before this ack: the broker redelivers, the claim is false, ack.
                ack(&delivery).await?;
                self.failures.forget(&key);
                tracing::debug!(consumer = %self.config.consumer, message_id = %message.message_id, attempt, redelivered = message.redelivered, "inbox: applied");
                Ok(Outcome::Applied)
            }
            Some(Err(error)) if attempt >= self.config.max_deliveries => {
                tracing::error!(
                    consumer = %self.config.consumer,
                    queue = %queue,
                    message_id = %message.message_id,
                    attempt,
                    error = %error,
                    "inbox: the handler failed on every attempt, rejected without requeue (to the queue's dead-letter exchange; dropped if it has none)"
                );
                let outcome = reject(
                    &delivery,
                    RejectReason::AttemptsExhausted { attempts: attempt },
                )
                .await?;
                self.failures.forget(&key);
                Ok(outcome)
            }
            Some(Err(error)) => {
                tracing::warn!(
                    consumer = %self.config.consumer,
                    message_id = %message.message_id,
                    attempt,
                    max_deliveries = self.config.max_deliveries,
                    error = %error,
                    "inbox: the handler failed, rolled back and requeued"
                );
                self.failures.record(key);
                delivery
                    .nack(BasicNackOptions {
                        multiple: false,
                        requeue: true,
                    })
                    .await
                    .map_err(amqp("nacking a failed delivery (basic.nack)"))?;
                Ok(Outcome::Requeued { attempt })
            }
        }
    }
}

/// Acks one delivery.
async fn ack(delivery: &Delivery) -> Result<(), Error> {
    delivery
        .ack(BasicAckOptions::default())
        .await
        .map(drop)
        .map_err(amqp("acking a delivery (basic.ack)"))
}

/// Rejects one delivery without requeue.
async fn reject(delivery: &Delivery, reason: RejectReason) -> Result<Outcome, Error> {
    delivery
        .reject(BasicRejectOptions { requeue: false })
        .await
        .map_err(amqp("rejecting a delivery (basic.reject)"))?;
    Ok(Outcome::Rejected(reason))
}

/// Database trouble outside the handler: give the delivery back (not counted as an attempt)
/// and end `run` with `error`.
async fn requeue_and_fail(delivery: &Delivery, error: Error) -> Result<Outcome, Error> {
    // If the nack fails too, the channel is gone and the broker requeues it anyway.
    let _ = delivery
        .nack(BasicNackOptions {
            multiple: false,
            requeue: true,
        })
        .await;
    Err(error)
}

/// The header `key` of `properties`, if present.
fn header<'p>(properties: &'p BasicProperties, key: &str) -> Option<&'p AMQPValue> {
    properties
        .headers()
        .as_ref()?
        .inner()
        .iter()
        .find_map(|(k, v)| (k.as_str() == key).then_some(v))
}

/// A string header's text (long strings as UTF-8; `None` for other types or invalid UTF-8).
fn text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        AMQPValue::LongString(s) => std::str::from_utf8(s.as_bytes()).ok().map(str::to_owned),
        _ => None,
    }
}

/// An integer header's value, when non-negative.
fn integer(value: &AMQPValue) -> Option<u64> {
    let n: i128 = match value {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => (*n).into(),
        _ => return None,
    };
    u64::try_from(n).ok()
}

/// Handler failures per `(tenant, message id)` in this process (classic queues).
#[derive(Debug, Default)]
struct FailureCounts {
    counts: HashMap<(String, String), u32>,
}

impl FailureCounts {
    fn get(&self, key: &(String, String)) -> u32 {
        self.counts.get(key).copied().unwrap_or(0)
    }

    fn record(&mut self, key: (String, String)) {
        if self.counts.len() >= ATTEMPT_MEMORY && !self.counts.contains_key(&key) {
            self.counts.clear();
        }
        let n = self.counts.entry(key).or_insert(0);
        *n = n.saturating_add(1);
    }

    fn forget(&mut self, key: &(String, String)) {
        self.counts.remove(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lapin::types::{LongString, ShortString};

    fn props(headers: &[(&str, AMQPValue)]) -> BasicProperties {
        let mut table = FieldTable::default();
        for (k, v) in headers {
            table.insert(ShortString::from(*k), v.clone());
        }
        BasicProperties::default().with_headers(table)
    }

    #[test]
    fn config_validation_names_the_setting() {
        let good = InboxConfig::new("billing", "q");
        assert!(good.validate().is_ok());
        for (config, setting) in [
            (InboxConfig::new("", "q"), "consumer"),
            (InboxConfig::new("c", ""), "queues"),
            (InboxConfig::new("c", "q".repeat(256)), "queues"),
            (
                InboxConfig::with_queues("c", Vec::<String>::new()),
                "queues",
            ),
            (InboxConfig::with_queues("c", ["a", "b", "a"]), "queues"),
            (
                InboxConfig {
                    prefetch: 0,
                    ..good.clone()
                },
                "prefetch",
            ),
            (
                InboxConfig {
                    max_deliveries: 0,
                    ..good.clone()
                },
                "max_deliveries",
            ),
        ] {
            let err = config.validate().expect_err(setting);
            assert!(
                matches!(err, Error::Config { setting: s, .. } if s == setting),
                "{err}"
            );
            assert!(err.to_string().contains(setting), "{err}");
        }
    }

    #[test]
    fn headers_are_read_by_type() {
        let p = props(&[
            (
                TENANT_HEADER,
                AMQPValue::LongString(LongString::from("acme")),
            ),
            (DELIVERY_COUNT_HEADER, AMQPValue::LongLongInt(2)),
        ]);
        assert_eq!(
            header(&p, TENANT_HEADER).and_then(text).as_deref(),
            Some("acme")
        );
        assert_eq!(header(&p, DELIVERY_COUNT_HEADER).and_then(integer), Some(2));
        assert_eq!(header(&p, "absent"), None);
        assert_eq!(text(&AMQPValue::LongInt(1)), None);
        assert_eq!(integer(&AMQPValue::LongInt(-1)), None);
        assert_eq!(integer(&AMQPValue::LongString("3".into())), None);
        assert_eq!(header(&BasicProperties::default(), TENANT_HEADER), None);
    }

    #[test]
    fn failure_counts_are_kept_per_key_and_forgotten() {
        let mut f = FailureCounts::default();
        let a = ("".to_owned(), "m1".to_owned());
        let b = ("t".to_owned(), "m1".to_owned());
        f.record(a.clone());
        f.record(a.clone());
        f.record(b.clone());
        assert_eq!((f.get(&a), f.get(&b)), (2, 1));
        f.forget(&a);
        assert_eq!(f.get(&a), 0);
    }

    #[test]
    fn the_sql_defines_what_the_inbox_calls() {
        assert!(INBOX_SQL.contains("CREATE OR REPLACE FUNCTION outbox.inbox_claim("));
        assert!(INBOX_SQL.contains("CREATE OR REPLACE FUNCTION outbox.inbox_purge("));
        assert!(INBOX_SQL.contains("PRIMARY KEY (consumer, tenant, message_id)"));
        // Outside comments (which explain why it is not used): PostgreSQL 14 lacks it.
        assert!(INBOX_SQL
            .lines()
            .filter(|l| !l.trim_start().starts_with("--"))
            .all(|l| !l.contains("NULLS NOT DISTINCT")));
    }
}
