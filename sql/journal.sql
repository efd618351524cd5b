-- pgoutbox's delivery journal and the idempotency-key table it keeps trimmed (installed by
-- `pgoutbox setup`). Idempotent: safe to run again; rows are never touched by setup.
--
-- outbox.journal: with `run --journal`, one row per message confirmed by RabbitMQ as routed
-- (a message redelivered after a nack, a reconnect or a crash has a row per confirmed
-- delivery). Written in batches, one INSERT per status-update interval, by a task of its
-- own: an audit record, not part of delivery. It never holds back acknowledgement, so a
-- crash (or a full buffer, or a failed write) may lose the rows of its last interval.
-- Rows older than `--journal-retention` (default 7 days) are deleted in small batches by
-- `run` and by `pgoutbox maintenance`. Look one up with `pgoutbox journal MESSAGE_ID`.
CREATE SCHEMA IF NOT EXISTS outbox;

CREATE TABLE IF NOT EXISTS outbox.journal (
    message_id   text NOT NULL,
    topic        text NOT NULL,
    -- The message's own LSN and its transaction's commit record LSN (as in the
    -- x-pgoutbox-lsn and x-pgoutbox-commit-lsn headers).
    lsn          pg_lsn NOT NULL,
    commit_lsn   pg_lsn NOT NULL,
    -- Publish attempts of the confirmed delivery (1 unless nacked or returned before).
    attempts     integer NOT NULL,
    -- When the broker's confirm arrived (the streamer's clock).
    confirmed_at timestamptz NOT NULL,
    -- The slot of the streamer that published it.
    slot_name    text NOT NULL,
    -- The exchange it was published to (the producer's `exchange`, or the streamer's
    -- --exchange). NULL in rows written before the column existed. Last, so that a table
    -- upgraded by the ALTER below has the same column order.
    exchange     text
);
-- Added after the first release of the table: `setup` run again adds it.
ALTER TABLE outbox.journal ADD COLUMN IF NOT EXISTS exchange text;
CREATE INDEX IF NOT EXISTS journal_message_id ON outbox.journal (message_id);
CREATE INDEX IF NOT EXISTS journal_confirmed_at ON outbox.journal (confirmed_at);

COMMENT ON TABLE outbox.journal IS
    'pgoutbox: delivery journal (run --journal): one row per confirmed delivery; may miss the last status interval before a crash. Trimmed by --journal-retention.';

-- outbox.idempotency: the keys of idempotent emits (sql/outbox.sql inserts them). The same
-- definition as there, so either file may create it first. A NULL tenant is stored as ''
-- (PostgreSQL 14 has no NULLS NOT DISTINCT). Keys older than `--idempotency-retention`
-- (default 7 days) are deleted in small batches by `run` and `pgoutbox maintenance`; after
-- that a retried command with the same key emits again.
CREATE TABLE IF NOT EXISTS outbox.idempotency (
    tenant text NOT NULL DEFAULT '',
    idempotency_key text NOT NULL,
    message_id text NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, idempotency_key));
CREATE INDEX IF NOT EXISTS idempotency_created_at ON outbox.idempotency (created_at);
