-- pgoutbox's record of the slot's history (installed by `pgoutbox setup`; `run` creates it
-- on a database set up by an older version when it may).
--
-- One row per slot. `run` writes it on each session start and, before any standby status
-- update reports a flush position beyond `flush_lsn`, raises `flush_lsn` in a small committed
-- write: so the row is never behind what the server was told. On start `run` compares it
-- with the slot and IDENTIFY_SYSTEM: a slot that now begins after `flush_lsn` (dropped and
-- recreated) or another system identifier is a gap in the slot's history, and `run` refuses
-- unless --accept-gap, which appends the gap to `accepted_gaps`.
--
-- Idempotent: safe to run again. Rows are never reset by setup.
CREATE SCHEMA IF NOT EXISTS outbox;

CREATE TABLE IF NOT EXISTS outbox.stream_state (
    slot_name         text PRIMARY KEY,
    -- IDENTIFY_SYSTEM's systemid and timeline at the last session start.
    system_identifier text NOT NULL,
    timeline          integer NOT NULL,
    -- The last flush LSN pgoutbox reported to the server (or is about to).
    flush_lsn         pg_lsn NOT NULL,
    updated_at        timestamptz NOT NULL DEFAULT now(),
    -- Gaps started over with --accept-gap: [{"from_lsn", "to_lsn", "reason", "accepted_at"}].
    accepted_gaps     jsonb NOT NULL DEFAULT '[]'::jsonb
);

COMMENT ON TABLE outbox.stream_state IS
    'pgoutbox: per slot, the last flush LSN reported, the system identifier and timeline, and gaps accepted with --accept-gap. Written by pgoutbox run; do not edit.';
