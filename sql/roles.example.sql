-- Example provisioning for platform teams (adapt names and passwords).
--
-- The streamer's role: REPLICATION to hold the slot. `pgoutbox setup` also needs CREATE on
-- the database (for the schema and the publication): run setup as this role, or as an owner.
CREATE ROLE pgoutbox LOGIN REPLICATION PASSWORD 'change-me';
GRANT CREATE ON DATABASE app TO pgoutbox;
-- When `setup` ran as another role (an owner), `run` as pgoutbox needs exactly these, after
-- setup created schema outbox: it writes dead letters (the insert's ON CONFLICT check reads
-- the table, and its bigserial id uses the sequence). `run` checks them at start and prints
-- these statements when one is missing.
GRANT USAGE ON SCHEMA outbox TO pgoutbox;
GRANT SELECT, INSERT ON outbox.dead_letter TO pgoutbox;
GRANT USAGE ON SEQUENCE outbox.dead_letter_id_seq TO pgoutbox;
-- It records the slot's history (the last flush LSN it reported) in outbox.stream_state.
GRANT SELECT, INSERT, UPDATE ON outbox.stream_state TO pgoutbox;
-- Its retention task deletes expired idempotency keys (--idempotency-retention, 7d) and
-- journal rows (--journal-retention); `run --journal` inserts into outbox.journal. Without
-- these `run` warns at start (retention) or refuses to start (--journal).
GRANT SELECT, DELETE ON outbox.idempotency TO pgoutbox;
GRANT SELECT, INSERT, DELETE ON outbox.journal TO pgoutbox;
-- Producers: after `pgoutbox setup` created schema outbox (INSERT on outbox.idempotency
-- only for emits with an idempotency_key).
GRANT USAGE ON SCHEMA outbox TO app_writer;
GRANT INSERT ON outbox.idempotency TO app_writer;
