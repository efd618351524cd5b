-- pgoutbox outbox settings (installed by `pgoutbox setup`, with sql/outbox.sql, in the
-- outbox's schema: `outbox` by default, `--schema S` for another outbox in the same
-- database; see src/outbox_schema.rs for how the schema and prefix are put in).
--
-- One row: the logical decoding message prefix this outbox's helpers (emit, emit_bytes)
-- write with pg_logical_emit_message. `pgoutbox run --schema S` reads it and publishes only
-- messages with that prefix (`--prefix` overrides it); `status`, `peek`, `teardown` and
-- `dead-letters requeue` use it too. Written by setup only; change it with setup --prefix
-- only while nothing is waiting (setup refuses otherwise). A database set up by an older
-- pgoutbox has no such table in schema outbox: its prefix is pgoutbox.
--
-- Idempotent: safe to run again; setup writes the row after it.
CREATE SCHEMA IF NOT EXISTS outbox;

CREATE TABLE IF NOT EXISTS outbox.settings (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    message_prefix  text NOT NULL CHECK (message_prefix <> ''),
    updated_at      timestamptz NOT NULL DEFAULT now()
);

COMMENT ON TABLE outbox.settings IS
    'pgoutbox: this outbox''s logical decoding message prefix (written by pgoutbox setup; read by run, status, peek, teardown).';

-- Readable by every role: the streamer and the inspection commands read it; nothing secret.
GRANT SELECT ON outbox.settings TO PUBLIC;
