-- pgoutbox producer functions (PostgreSQL 14+; tested on 15).
--
-- Producers call outbox.emit(...) or outbox.emit_bytes(...) inside their own transaction.
-- The functions validate their arguments, build a version-2 envelope and write it to WAL
-- with pg_logical_emit_message(true, 'pgoutbox', envelope): a *transactional* logical
-- decoding message, delivered to pgoutbox only if, and when, the transaction commits.
-- Nothing is stored in any table. Both functions return the message's pg_lsn.
--
-- Envelope version 2 (see docs/envelope.md; decoded by src/envelope.rs, which still reads
-- version 1: the same without emitted_by, version byte 0x01):
--   byte 0        version, 0x02
--   bytes 1..5    N, the header length in bytes, unsigned 32-bit big-endian
--   next N bytes  header: UTF-8 JSON object
--                 {"id": text, "topic": text, "content_type": text, "headers": {object},
--                  "emitted_by": text}
--                 emitted_by is session_user: the role that logged in (or SET SESSION
--                 AUTHORIZATION), not current_user, which inside the SECURITY DEFINER
--                 helpers of `pgoutbox setup --lockdown` is their owner.
--   the rest      payload, raw bytes: for emit, the UTF-8 text of payload::text (the jsonb);
--                 for emit_bytes, the bytea as is. No double encoding; NUL bytes are fine.
--
-- Rules, checked at emit time (and again by the pgoutbox decoder), all raising
-- SQLSTATE 22023 (invalid_parameter_value) with a HINT:
--   topic         not NULL, not empty, at most 255 bytes (AMQP routing key, a short string)
--   message_id    NULL means a fresh gen_random_uuid()::text; otherwise not empty and at
--                 most 255 bytes (AMQP message-id property)
--   payload       not NULL (the JSON value null, 'null'::jsonb, is a valid payload)
--   content_type  not NULL, not empty, at most 255 bytes (AMQP content-type property)
--   exchange      NULL (the streamer's --exchange) or 1 to 255 bytes (an AMQP exchange
--                 name), written as the header key "exchange" only when given
--   headers       not NULL, a JSON object; every key at most 255 bytes (AMQP field-table
--                 key), not starting with "x-pgoutbox-" (any case; reserved for headers
--                 pgoutbox adds), not "CC" or "BCC" (any case; RabbitMQ sender-selected
--                 distribution would copy the message to other queues)
--
-- Idempotent: safe to run again (CREATE SCHEMA IF NOT EXISTS, CREATE OR REPLACE FUNCTION).
--
-- Privileges: nothing is granted here. Producers need USAGE on schema outbox (a new
-- schema has none for PUBLIC) and EXECUTE on outbox.emit / outbox.emit_bytes (functions
-- get EXECUTE for PUBLIC by default), e.g.
--   GRANT USAGE ON SCHEMA outbox TO my_producer_role;
-- pg_logical_emit_message itself needs no special privilege, unless `pgoutbox setup
-- --lockdown` (sql/lockdown.sql) revoked it from PUBLIC: then emit and emit_bytes are
-- SECURITY DEFINER functions owned by the NOLOGIN role pgoutbox_emitter and are the only
-- way for ordinary roles to write an outbox message. Running this file again keeps that
-- (see the end of the file).
--
-- The functions pin search_path to pg_catalog, pg_temp and qualify every name, so that
-- producers' search_path settings cannot change what they call.

CREATE SCHEMA IF NOT EXISTS outbox;

-- The helpers before the exchange argument had one parameter less: drop those signatures,
-- or every call that relies on the defaults would be ambiguous between the two.
DROP FUNCTION IF EXISTS outbox.emit(text, jsonb, jsonb, text);
DROP FUNCTION IF EXISTS outbox.emit_bytes(text, bytea, text, jsonb, text);
DROP FUNCTION IF EXISTS outbox._envelope(text, bytea, text, jsonb, text);

COMMENT ON SCHEMA outbox IS
    'pgoutbox producer API: outbox.emit / outbox.emit_bytes write transactional logical decoding messages (prefix pgoutbox) that pgoutbox publishes to RabbitMQ.';

-- Internal: validates the arguments and returns the version-2 envelope bytes.
-- Shared by emit and emit_bytes; also callable on its own to inspect the exact bytes
-- (tests compare its output with the Rust decoder). Does not write to WAL.
CREATE OR REPLACE FUNCTION outbox._envelope(
    topic text,
    payload bytea,
    content_type text,
    headers jsonb,
    message_id text,
    exchange text DEFAULT NULL
) RETURNS bytea
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    id  text := message_id;
    k   text;
    hdr bytea;
BEGIN
    IF topic IS NULL OR topic = '' THEN
        RAISE EXCEPTION 'outbox: argument topic must not be NULL or empty (got %)',
                coalesce(quote_literal(topic), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass the RabbitMQ routing key as a non-empty text of at most 255 bytes.';
    END IF;
    IF octet_length(topic) > 255 THEN
        RAISE EXCEPTION 'outbox: argument topic is % bytes long (starts %); the limit is 255 bytes',
                octet_length(topic), quote_literal(left(topic, 40))
            USING ERRCODE = '22023',
                  HINT = 'The topic is used as an AMQP routing key, a short string of at most 255 bytes.';
    END IF;

    IF id IS NULL THEN
        id := gen_random_uuid()::text;
    ELSIF id = '' THEN
        RAISE EXCEPTION 'outbox: argument message_id must not be empty'
            USING ERRCODE = '22023',
                  HINT = 'Pass NULL (the default) to get a random UUID, or a non-empty id of at most 255 bytes.';
    ELSIF octet_length(id) > 255 THEN
        RAISE EXCEPTION 'outbox: argument message_id is % bytes long (starts %); the limit is 255 bytes',
                octet_length(id), quote_literal(left(id, 40))
            USING ERRCODE = '22023',
                  HINT = 'The id becomes the AMQP message-id property, a short string of at most 255 bytes.';
    END IF;

    IF payload IS NULL THEN
        RAISE EXCEPTION 'outbox: argument payload must not be NULL'
            USING ERRCODE = '22023',
                  HINT = 'Pass a value; for an empty message pass ''null''::jsonb or ''''::bytea.';
    END IF;

    IF content_type IS NULL OR content_type = '' THEN
        RAISE EXCEPTION 'outbox: argument content_type must not be NULL or empty (got %)',
                coalesce(quote_literal(content_type), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass a MIME type such as application/octet-stream, at most 255 bytes.';
    END IF;
    IF octet_length(content_type) > 255 THEN
        RAISE EXCEPTION 'outbox: argument content_type is % bytes long (starts %); the limit is 255 bytes',
                octet_length(content_type), quote_literal(left(content_type, 40))
            USING ERRCODE = '22023',
                  HINT = 'The content type becomes the AMQP content-type property, a short string of at most 255 bytes.';
    END IF;

    IF headers IS NULL OR jsonb_typeof(headers) <> 'object' THEN
        RAISE EXCEPTION 'outbox: argument headers must be a JSON object, got %',
                coalesce(jsonb_typeof(headers), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'Pass a jsonb object such as ''{}''::jsonb or ''{"tenant": "a"}''::jsonb.';
    END IF;
    FOR k IN SELECT jsonb_object_keys(headers) LOOP
        IF octet_length(k) > 255 THEN
            RAISE EXCEPTION 'outbox: header key in argument headers is % bytes long (starts %); the limit is 255 bytes',
                    octet_length(k), quote_literal(left(k, 40))
                USING ERRCODE = '22023',
                      HINT = 'Header keys become AMQP field-table keys, short strings of at most 255 bytes.';
        END IF;
        -- COLLATE "C": ASCII-only case folding, the same as the Rust decoder's check.
        IF starts_with(lower(k COLLATE "C"), 'x-pgoutbox-') THEN
            RAISE EXCEPTION 'outbox: header key % in argument headers is reserved', quote_literal(k)
                USING ERRCODE = '22023',
                      HINT = 'Header keys starting with x-pgoutbox- (in any case) are reserved for headers pgoutbox adds.';
        END IF;
        IF upper(k COLLATE "C") IN ('CC', 'BCC') THEN
            RAISE EXCEPTION 'outbox: header key % in argument headers is not allowed', quote_literal(k)
                USING ERRCODE = '22023',
                      HINT = 'CC and BCC (in any case) trigger RabbitMQ sender-selected distribution, which would route the message to other queues.';
        END IF;
    END LOOP;

    -- exchange: NULL publishes to the streamer's --exchange; a name is written into the
    -- header (the streamer checks it against --allowed-exchanges).
    IF exchange = '' OR octet_length(exchange) > 255 THEN
        RAISE EXCEPTION 'outbox: argument exchange is % bytes long (starts %); use 1 to 255 bytes, or NULL for the streamer''s --exchange',
                octet_length(exchange), quote_literal(left(exchange, 40))
            USING ERRCODE = '22023',
                  HINT = 'The exchange is an AMQP exchange name, a short string of 1 to 255 bytes; pass NULL (the default) to publish to the streamer''s --exchange.';
    END IF;

    hdr := convert_to(
        (jsonb_build_object(
            'id', id,
            'topic', topic,
            'content_type', content_type,
            'headers', headers,
            'emitted_by', session_user::text
        ) || CASE WHEN exchange IS NULL THEN '{}'::jsonb
                  ELSE jsonb_build_object('exchange', exchange) END)::text,
        'UTF8');

    -- decode('02', 'hex') is the version byte 0x02, independent of standard_conforming_strings.
    RETURN decode('02', 'hex') || int4send(octet_length(hdr)) || hdr || payload;
END;
$fn$;

COMMENT ON FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text) IS
    'Internal to pgoutbox: validates the arguments and returns the version-2 envelope bytes (0x02, u32 big-endian header length, UTF-8 JSON header with emitted_by = session_user, raw payload); a NULL message_id becomes a random UUID. Raises SQLSTATE 22023 on invalid arguments. Does not write to WAL.';

CREATE OR REPLACE FUNCTION outbox.emit(
    topic text,
    payload jsonb,
    headers jsonb DEFAULT '{}',
    message_id text DEFAULT NULL,
    exchange text DEFAULT NULL
) RETURNS pg_lsn
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN pg_catalog.pg_logical_emit_message(
        true,
        'pgoutbox',
        outbox._envelope(topic, convert_to(payload::text, 'UTF8'), 'application/json',
                         headers, message_id, exchange));
END;
$fn$;

COMMENT ON FUNCTION outbox.emit(text, jsonb, jsonb, text, text) IS
    'pgoutbox: publishes payload (JSON, content type application/json) to RabbitMQ with routing key topic when the current transaction commits. headers: JSON object of AMQP headers (keys at most 255 bytes, no x-pgoutbox-*, CC or BCC). message_id: NULL for a random UUID. exchange: NULL for the streamer''s --exchange, or an exchange name (1 to 255 bytes) the streamer may restrict with --allowed-exchanges. Returns the LSN of the logical decoding message. Raises SQLSTATE 22023 on invalid arguments.';

CREATE OR REPLACE FUNCTION outbox.emit_bytes(
    topic text,
    payload bytea,
    content_type text DEFAULT 'application/octet-stream',
    headers jsonb DEFAULT '{}',
    message_id text DEFAULT NULL,
    exchange text DEFAULT NULL
) RETURNS pg_lsn
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN pg_catalog.pg_logical_emit_message(
        true,
        'pgoutbox',
        outbox._envelope(topic, payload, content_type, headers, message_id, exchange));
END;
$fn$;

COMMENT ON FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text) IS
    'pgoutbox: publishes payload (raw bytes, with the given content type) to RabbitMQ with routing key topic when the current transaction commits. headers: JSON object of AMQP headers (keys at most 255 bytes, no x-pgoutbox-*, CC or BCC). message_id: NULL for a random UUID. exchange: NULL for the streamer''s --exchange, or an exchange name (1 to 255 bytes) the streamer may restrict with --allowed-exchanges. Returns the LSN of the logical decoding message. Raises SQLSTATE 22023 on invalid arguments.';

-- Dead letters: messages pgoutbox gave up on (nacked past the retry bound, returned as
-- unroutable under --on-unroutable dead-letter, undecodable, too large). pgoutbox writes the
-- row (synchronously committed) before it acknowledges the message's LSN, so a dead letter is
-- durable before the slot moves past it. `pgoutbox dead-letters requeue` re-emits the
-- original envelope through pg_logical_emit_message, with its original message_id.
-- The table is not in any publication, so writing it emits nothing.
CREATE TABLE IF NOT EXISTS outbox.dead_letter (
    id               bigserial PRIMARY KEY,
    message_id       text,                 -- NULL when the envelope could not be decoded
    topic            text,
    lsn              pg_lsn NOT NULL,      -- the message's LSN (x-pgoutbox-lsn)
    commit_lsn       pg_lsn,               -- its transaction's commit LSN (NULL outside one)
    envelope         bytea NOT NULL,       -- the logical message content exactly as emitted
    reason           text NOT NULL,        -- nacked | returned | poison | too_large | forged
    attempts         integer NOT NULL,
    first_error      text,
    last_error       text,
    first_failed_at  timestamptz NOT NULL DEFAULT now(),
    dead_lettered_at timestamptz NOT NULL DEFAULT now(),
    requeued_at      timestamptz,
    -- A crash between this insert and the acknowledgement replays the message: same LSN,
    -- one row.
    CONSTRAINT dead_letter_lsn_key UNIQUE (lsn)
);

COMMENT ON TABLE outbox.dead_letter IS
    'pgoutbox: messages not delivered to RabbitMQ (see reason, last_error); requeue with pgoutbox dead-letters requeue.';

-- Lockdown record (sql/lockdown.sql writes it, sql/unlock.sql deletes it): at most one row,
-- present while pg_logical_emit_message is revoked from PUBLIC in this database.
-- enabled_at_lsn is the LSN of the lockdown marker message (prefix pgoutbox.lockdown) the
-- lockdown transaction wrote: a pgoutbox message at a later LSN that is not a version-2
-- envelope with an emitter is dead-lettered as forged. Readable by every role (it is what
-- `run`, `status` and `check` read; nothing secret).
CREATE TABLE IF NOT EXISTS outbox.lockdown (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    enabled_at_lsn  pg_lsn NOT NULL,
    enabled_at      timestamptz NOT NULL DEFAULT now(),
    enabled_by      text NOT NULL DEFAULT session_user,
    previous_owner  text                  -- owner of outbox.emit before; unlock restores it
);

COMMENT ON TABLE outbox.lockdown IS
    'pgoutbox: present while setup --lockdown is in effect (pg_logical_emit_message revoked from PUBLIC; outbox.emit/emit_bytes SECURITY DEFINER); pgoutbox messages after enabled_at_lsn that did not come through the helpers are dead-lettered as forged.';

GRANT SELECT ON outbox.lockdown TO PUBLIC;

-- CREATE OR REPLACE FUNCTION above resets SECURITY DEFINER (it keeps owner and grants):
-- under lockdown, make the helpers SECURITY DEFINER again, or producers would lose their
-- only way to emit.
DO $lockdown$
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.lockdown) THEN
        ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text) SECURITY DEFINER;
        ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text) SECURITY DEFINER;
    END IF;
END;
$lockdown$;
