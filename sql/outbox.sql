-- pgoutbox producer functions (PostgreSQL 14+; tested on 15).
--
-- Producers call outbox.emit(...) or outbox.emit_bytes(...) inside their own transaction.
-- The functions validate their arguments, build a version-3 envelope and write it to WAL
-- with pg_logical_emit_message(true, 'pgoutbox', envelope): a *transactional* logical
-- decoding message, delivered to pgoutbox only if, and when, the transaction commits.
-- No table is written, except outbox.idempotency when an idempotency_key is given. Both
-- functions return the message's pg_lsn (NULL when on_duplicate => 'skip' skipped it).
--
--   SELECT outbox.emit('orders.created', '{"order": 42}');
--   SELECT outbox.emit('orders.created', '{"order": 42}',
--                      aggregate_type => 'order', aggregate_id => '42', aggregate_version => 3,
--                      tenant => 'acme', idempotency_key => 'create-order-42');
--
-- Envelope version 3 (see docs/src/reference/envelope.md; decoded by src/envelope.rs, which still reads
-- versions 1 and 2):
--   byte 0        version, 0x03
--   bytes 1..5    N, the header length in bytes, unsigned 32-bit big-endian
--   next N bytes  header: UTF-8 JSON object
--                 {"id": text, "topic": text, "content_type": text, "headers": {object},
--                  "emitted_by": text, and each optional key only when given:
--                  "exchange", "correlation_id", "causation_id", "aggregate_type",
--                  "aggregate_id" (text), "aggregate_version" (integer), "tenant" (text),
--                  "expiration_ms" (integer), "priority" (integer), "traceparent",
--                  "tracestate", "idempotency_key" (text)}
--                 emitted_by is session_user: the role that logged in (or SET SESSION
--                 AUTHORIZATION), not current_user, which inside the SECURITY DEFINER
--                 helpers of `pgoutbox setup --lockdown` is their owner.
--   the rest      payload, raw bytes: for emit, the UTF-8 text of payload::text (the jsonb);
--                 for emit_bytes, the bytea as is. No double encoding; NUL bytes are fine.
-- Version 2 is the same without the optional keys; version 1 also without emitted_by.
--
-- Rules, checked at emit time (and again by the pgoutbox decoder), all raising
-- SQLSTATE 22023 (invalid_parameter_value) naming the argument, with a HINT:
--   topic         not NULL, not empty, at most 255 bytes (AMQP routing key, a short string)
--   message_id    NULL means a fresh gen_random_uuid()::text; otherwise not empty and at
--                 most 255 bytes (AMQP message-id property)
--   payload       not NULL (the JSON value null, 'null'::jsonb, is a valid payload)
--   content_type  not NULL, not empty, at most 255 bytes (AMQP content-type property)
--   headers       not NULL, a JSON object; every key at most 255 bytes (AMQP field-table
--                 key), not starting with "x-pgoutbox-" (any case; reserved for headers
--                 pgoutbox adds), not "CC" or "BCC" (any case; RabbitMQ sender-selected
--                 distribution would copy the message to other queues)
--   exchange, correlation_id, causation_id, aggregate_type, aggregate_id, tenant,
--   idempotency_key
--                 NULL (not given), or 1 to 255 bytes (AMQP short strings; those sent as
--                 headers are held to the same bound). A NULL tenant is "no tenant"; '' is
--                 refused so that it cannot be confused with it (outbox.idempotency stores
--                 no tenant as '': a primary key cannot hold NULL, and NULLS NOT DISTINCT
--                 is PostgreSQL 15+).
--   aggregate_version  NULL, or 0 and more
--   expiration    NULL, or 0 to 4294967295 milliseconds (the AMQP expiration property;
--                 RabbitMQ refuses a larger per-message TTL)
--   priority      NULL, or 0 to 9 (the AMQP priority property)
--   traceparent   NULL, or a W3C Trace Context traceparent (section 3.2, see below)
--   tracestate    NULL, or a W3C Trace Context tracestate (section 3.3, see below), only
--                 together with a traceparent
--   on_duplicate  'raise' (the default) or 'skip'
--
-- Trace context (W3C Trace Context, https://www.w3.org/TR/trace-context/): when the
-- traceparent argument is NULL, the helpers read the settings outbox.traceparent and
-- outbox.tracestate, which a producer sets for its transaction:
--   SET LOCAL outbox.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
-- (an empty setting counts as not set). A traceparent argument takes its tracestate from
-- the tracestate argument only. Checked by section 3.2 ("traceparent Header"): version 2
-- lowercase hex digits, not ff; trace-id 32 and parent-id 16 lowercase hex digits, not all
-- zeros; trace-flags 2 lowercase hex digits; version 00 is exactly 55 characters; a higher
-- version may go on after the flags only with a '-' (section 3.2.4). tracestate, section
-- 3.3, loosely: at most 512 characters, at most 32 comma-separated list-members (empty
-- ones and spaces/tabs around them allowed), each key=value with the key 1 to 256 of
-- a-z 0-9 _ - * / @ (starting with a-z or 0-9, at most one @) and the value 1 to 256
-- printable ASCII characters other than ',' and '=', not ending in a space.
--
-- Idempotent emit: with idempotency_key given, the helper inserts (tenant, key,
-- message_id) into outbox.idempotency in the caller's transaction before it writes the
-- message. If the key was used before (same tenant, committed), the default
-- on_duplicate => 'raise' raises unique_violation (SQLSTATE 23505) naming the key and
-- the tenant, and the caller's transaction rolls back; on_duplicate => 'skip' returns
-- NULL and emits nothing. A concurrent transaction holding the same key makes the call
-- wait for it: if it commits, this one raises or skips; if it rolls back, this one emits.
-- Under REPEATABLE READ or SERIALIZABLE a key committed after the caller's snapshot
-- raises serialization_failure (40001) instead: retry the transaction. Old keys are
-- deleted by pgoutbox's retention.
--
-- Idempotent: safe to run again (CREATE SCHEMA IF NOT EXISTS, CREATE OR REPLACE FUNCTION,
-- CREATE TABLE IF NOT EXISTS). The signatures of earlier pgoutbox versions are dropped
-- first, and their grants with them (EXECUTE is PUBLIC's by default; `setup
-- --create-roles` gives the producer role its grants again). `pgoutbox setup` runs the
-- file in one transaction; with psql use `psql -1 -f sql/outbox.sql`, so that producers
-- never see the helpers missing.
--
-- Privileges: nothing is granted here. Producers need USAGE on schema outbox (a new
-- schema has none for PUBLIC), EXECUTE on outbox.emit / outbox.emit_bytes (functions
-- get EXECUTE for PUBLIC by default) and, to pass an idempotency_key, INSERT on
-- outbox.idempotency, e.g.
--   GRANT USAGE ON SCHEMA outbox TO my_producer_role;
--   GRANT INSERT ON outbox.idempotency TO my_producer_role;
-- pg_logical_emit_message itself needs no special privilege, unless `pgoutbox setup
-- --lockdown` (sql/lockdown.sql) revoked it from PUBLIC: then emit and emit_bytes are
-- SECURITY DEFINER functions owned by the NOLOGIN role pgoutbox_emitter (which has INSERT
-- on outbox.idempotency) and are the only way for ordinary roles to write an outbox
-- message. Running this file again keeps that (see the end of the file).
--
-- The functions pin search_path to pg_catalog, pg_temp and qualify every name, so that
-- producers' search_path settings cannot change what they call.

CREATE SCHEMA IF NOT EXISTS outbox;

COMMENT ON SCHEMA outbox IS
    'pgoutbox producer API: outbox.emit / outbox.emit_bytes write transactional logical decoding messages (prefix pgoutbox) that pgoutbox publishes to RabbitMQ.';

-- The signatures of envelope versions 1 and 2. Changing an argument list creates an
-- overload, so the old ones go first (no-ops once they are gone).
DROP FUNCTION IF EXISTS outbox.emit(text, jsonb, jsonb, text);
DROP FUNCTION IF EXISTS outbox.emit_bytes(text, bytea, text, jsonb, text);
DROP FUNCTION IF EXISTS outbox._envelope(text, bytea, text, jsonb, text);

-- Idempotency keys of outbox.emit(..., idempotency_key => ...): one row per (tenant, key)
-- used, until the retention deletes it. A NULL tenant is stored as '' (emit refuses an
-- empty tenant, so '' means "no tenant" only). Not in any publication.
CREATE TABLE IF NOT EXISTS outbox.idempotency (
    tenant          text NOT NULL DEFAULT '',   -- NULL tenant stored as ''
    idempotency_key text NOT NULL,
    message_id      text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, idempotency_key)
);
CREATE INDEX IF NOT EXISTS idempotency_created_at ON outbox.idempotency (created_at);

COMMENT ON TABLE outbox.idempotency IS
    'pgoutbox: idempotency keys used by outbox.emit/emit_bytes (tenant '''' = no tenant); a second emit with the same (tenant, idempotency_key) raises unique_violation or, with on_duplicate => ''skip'', emits nothing.';

-- Internal: validates the arguments and returns the version-3 envelope bytes.
-- Used by emit_bytes (and so by emit); also callable on its own to inspect the exact bytes
-- (tests compare its output with the Rust decoder). Reads the settings outbox.traceparent
-- and outbox.tracestate when traceparent is NULL. Writes nothing.
CREATE OR REPLACE FUNCTION outbox._envelope(
    topic text,
    payload bytea,
    content_type text,
    headers jsonb,
    message_id text,
    exchange text DEFAULT NULL,
    correlation_id text DEFAULT NULL,
    causation_id text DEFAULT NULL,
    aggregate_type text DEFAULT NULL,
    aggregate_id text DEFAULT NULL,
    aggregate_version bigint DEFAULT NULL,
    tenant text DEFAULT NULL,
    expiration bigint DEFAULT NULL,
    priority integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    tracestate text DEFAULT NULL,
    idempotency_key text DEFAULT NULL
) RETURNS bytea
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    id     text := message_id;
    k      text;
    hdr    bytea;
    names  text[];
    vals   text[];
    meta   jsonb;
    i      integer;
    tp     text := traceparent;
    ts     text := tracestate;
    tp_src text := 'argument traceparent';
    ts_src text := 'argument tracestate';
    m      text;
    n      integer := 0;
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


    -- The optional text metadata: NULL (not given) or 1 to 255 bytes. (Skipped, as the
    -- metadata object below, when none is given: a plain emit stays cheap.)
    IF num_nonnulls(exchange, correlation_id, causation_id, aggregate_type, aggregate_id,
                    tenant, idempotency_key) > 0 THEN
        names := ARRAY['exchange', 'correlation_id', 'causation_id', 'aggregate_type',
                       'aggregate_id', 'tenant', 'idempotency_key'];
        vals := ARRAY[exchange, correlation_id, causation_id, aggregate_type, aggregate_id,
                      tenant, idempotency_key];
        FOR i IN 1 .. array_length(names, 1) LOOP
            CONTINUE WHEN vals[i] IS NULL;
            IF vals[i] = '' THEN
                RAISE EXCEPTION 'outbox: argument % must not be empty', names[i]
                    USING ERRCODE = '22023',
                          HINT = format('Pass NULL (the default) to leave %s out, or a text of 1 to 255 bytes.', names[i]);
            END IF;
            IF octet_length(vals[i]) > 255 THEN
                RAISE EXCEPTION 'outbox: argument % is % bytes long (starts %); the limit is 255 bytes',
                        names[i], octet_length(vals[i]), quote_literal(left(vals[i], 40))
                    USING ERRCODE = '22023',
                          HINT = format('%s is sent as an AMQP short string (or a header held to the same bound): at most 255 bytes.', names[i]);
            END IF;
        END LOOP;
    END IF;

    IF aggregate_version < 0 THEN
        RAISE EXCEPTION 'outbox: argument aggregate_version is %, expected 0 or more', aggregate_version
            USING ERRCODE = '22023',
                  HINT = 'Pass the version of the aggregate after this event (0 or more), or NULL to leave it out.';
    END IF;
    IF expiration < 0 OR expiration > 4294967295 THEN
        RAISE EXCEPTION 'outbox: argument expiration is % ms, expected 0 to 4294967295', expiration
            USING ERRCODE = '22023',
                  HINT = 'The per-message TTL in milliseconds (the AMQP expiration property): RabbitMQ accepts 0 to 2^32-1; NULL for none.';
    END IF;
    IF priority < 0 OR priority > 9 THEN
        RAISE EXCEPTION 'outbox: argument priority is %, expected 0 to 9', priority
            USING ERRCODE = '22023',
                  HINT = 'The AMQP priority property, 0 (lowest) to 9; NULL leaves it out.';
    END IF;

    -- Trace context: the arguments, else the transaction's settings (an empty setting,
    -- what a placeholder holds after its SET LOCAL ended, counts as not set).
    IF tp IS NULL THEN
        tp := nullif(current_setting('outbox.traceparent', true), '');
        tp_src := 'setting outbox.traceparent';
        IF ts IS NULL THEN
            ts := nullif(current_setting('outbox.tracestate', true), '');
            ts_src := 'setting outbox.tracestate';
        END IF;
    END IF;
    -- W3C Trace Context section 3.2: version "-" trace-id "-" parent-id "-" trace-flags.
    IF tp IS NOT NULL AND (
           octet_length(tp) > 255
           OR tp COLLATE "C" !~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-.*)?$'
           OR left(tp, 2) = 'ff'
           OR (left(tp, 2) = '00' AND octet_length(tp) <> 55)
           OR substr(tp, 4, 32) = repeat('0', 32)
           OR substr(tp, 37, 16) = repeat('0', 16)) THEN
        RAISE EXCEPTION 'outbox: % is not a valid W3C traceparent: %', tp_src, quote_literal(left(tp, 60))
            USING ERRCODE = '22023',
                  HINT = 'Expected 00-<32 lowercase hex trace-id>-<16 lowercase hex parent-id>-<2 lowercase hex flags>, trace-id and parent-id not all zeros, version not ff (https://www.w3.org/TR/trace-context/ section 3.2).';
    END IF;
    -- W3C Trace Context section 3.3, loosely (see the top of the file).
    IF ts IS NOT NULL THEN
        IF tp IS NULL THEN
            RAISE EXCEPTION 'outbox: % given without a traceparent', ts_src
                USING ERRCODE = '22023',
                      HINT = 'A tracestate only travels with its traceparent (W3C Trace Context section 3.3): pass traceparent too, or SET LOCAL outbox.traceparent.';
        END IF;
        IF octet_length(ts) > 512 THEN
            RAISE EXCEPTION 'outbox: % is % bytes long; the limit is 512', ts_src, octet_length(ts)
                USING ERRCODE = '22023',
                      HINT = 'W3C Trace Context section 3.3.1.1: a tracestate of at most 512 characters.';
        END IF;
        FOREACH m IN ARRAY string_to_array(ts, ',') LOOP
            m := btrim(m, E' \t');
            CONTINUE WHEN m = '';
            n := n + 1;
            IF m COLLATE "C" !~ E'^[a-z0-9][a-z0-9_*/@-]{0,255}=[\\x20-\\x2b\\x2d-\\x3c\\x3e-\\x7e]{0,255}[\\x21-\\x2b\\x2d-\\x3c\\x3e-\\x7e]$'
               OR split_part(m, '=', 1) LIKE '%@%@%' THEN
                RAISE EXCEPTION 'outbox: % has an invalid list-member %', ts_src, quote_literal(left(m, 60))
                    USING ERRCODE = '22023',
                          HINT = 'W3C Trace Context section 3.3: comma-separated key=value members; the key of a-z 0-9 _ - * / (and one @ at most), the value of printable ASCII other than , and =.';
            END IF;
        END LOOP;
        IF n > 32 THEN
            RAISE EXCEPTION 'outbox: % has % list-members; the limit is 32', ts_src, n
                USING ERRCODE = '22023',
                      HINT = 'W3C Trace Context section 3.3.1.1: at most 32 list-members.';
        END IF;
    END IF;

    -- The optional keys only when given (jsonb_strip_nulls on this object alone: the
    -- producer's headers may hold JSON nulls).
    meta := jsonb_build_object(
        'id', id,
        'topic', topic,
        'content_type', content_type,
        'headers', headers,
        'emitted_by', session_user::text);
    IF num_nonnulls(exchange, correlation_id, causation_id, aggregate_type, aggregate_id,
                    aggregate_version, tenant, expiration, priority, tp, ts,
                    idempotency_key) > 0 THEN
        meta := meta || jsonb_strip_nulls(jsonb_build_object(
            'exchange', exchange,
            'correlation_id', correlation_id,
            'causation_id', causation_id,
            'aggregate_type', aggregate_type,
            'aggregate_id', aggregate_id,
            'aggregate_version', aggregate_version,
            'tenant', tenant,
            'expiration_ms', expiration,
            'priority', priority,
            'traceparent', tp,
            'tracestate', ts,
            'idempotency_key', idempotency_key));
    END IF;
    hdr := convert_to(meta::text, 'UTF8');

    -- decode('03', 'hex') is the version byte 0x03, independent of standard_conforming_strings.
    RETURN decode('03', 'hex') || int4send(octet_length(hdr)) || hdr || payload;
END;
$fn$;

COMMENT ON FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text) IS
    'Internal to pgoutbox: validates the arguments and returns the version-3 envelope bytes (0x03, u32 big-endian header length, UTF-8 JSON header with emitted_by = session_user and the optional keys given, raw payload); a NULL message_id becomes a random UUID, a NULL traceparent is read from the setting outbox.traceparent. Raises SQLSTATE 22023 on invalid arguments. Writes nothing.';

CREATE OR REPLACE FUNCTION outbox.emit_bytes(
    topic text,
    payload bytea,
    content_type text DEFAULT 'application/octet-stream',
    headers jsonb DEFAULT '{}',
    message_id text DEFAULT NULL,
    exchange text DEFAULT NULL,
    correlation_id text DEFAULT NULL,
    causation_id text DEFAULT NULL,
    aggregate_type text DEFAULT NULL,
    aggregate_id text DEFAULT NULL,
    aggregate_version bigint DEFAULT NULL,
    tenant text DEFAULT NULL,
    expiration bigint DEFAULT NULL,
    priority integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    tracestate text DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    on_duplicate text DEFAULT 'raise'
) RETURNS pg_lsn
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
DECLARE
    -- The id exists before the idempotency row is written.
    id       text := coalesce(message_id, gen_random_uuid()::text);
    envelope bytea;
    claimed  bigint;
BEGIN
    IF on_duplicate IS NULL OR on_duplicate NOT IN ('raise', 'skip') THEN
        RAISE EXCEPTION 'outbox: argument on_duplicate must be ''raise'' or ''skip'' (got %)',
                coalesce(quote_literal(on_duplicate), 'NULL')
            USING ERRCODE = '22023',
                  HINT = 'on_duplicate => ''raise'' (the default) raises unique_violation on a used idempotency_key; ''skip'' returns NULL and emits nothing.';
    END IF;
    envelope := outbox._envelope(topic, payload, content_type, headers, id,
        exchange => exchange, correlation_id => correlation_id, causation_id => causation_id,
        aggregate_type => aggregate_type, aggregate_id => aggregate_id,
        aggregate_version => aggregate_version, tenant => tenant, expiration => expiration,
        priority => priority, traceparent => traceparent, tracestate => tracestate,
        idempotency_key => idempotency_key);
    IF idempotency_key IS NOT NULL THEN
        -- Waits for a concurrent transaction holding the same key, and inserts nothing when
        -- the key is (then) taken. No conflict target: the primary key is the table's only
        -- unique index, and a target would need SELECT on the table besides INSERT.
        INSERT INTO outbox.idempotency (tenant, idempotency_key, message_id)
        VALUES (coalesce(tenant, ''), idempotency_key, id)
        ON CONFLICT DO NOTHING;
        GET DIAGNOSTICS claimed = ROW_COUNT;
        IF claimed = 0 THEN
            IF on_duplicate = 'skip' THEN
                RETURN NULL;
            END IF;
            RAISE EXCEPTION 'outbox: idempotency_key % of tenant % was used before: its event was already emitted',
                    quote_literal(idempotency_key), coalesce(quote_literal(tenant), 'NULL (no tenant)')
                USING ERRCODE = 'unique_violation',
                      HINT = 'This transaction rolls back. Pass on_duplicate => ''skip'' to get NULL (and emit nothing) instead of this error.';
        END IF;
    END IF;
    RETURN pg_catalog.pg_logical_emit_message(true, 'pgoutbox', envelope);
END;
$fn$;

COMMENT ON FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) IS
    'pgoutbox: publishes payload (raw bytes, with the given content type) to RabbitMQ with routing key topic when the current transaction commits. headers: JSON object of AMQP headers (keys at most 255 bytes, no x-pgoutbox-*, CC or BCC). message_id: NULL for a random UUID. Optional named arguments: exchange, correlation_id, causation_id, aggregate_type, aggregate_id, aggregate_version, tenant, expiration (ms), priority (0-9), traceparent and tracestate (default: the settings outbox.traceparent / outbox.tracestate), idempotency_key, on_duplicate (raise | skip). Returns the LSN of the logical decoding message, or NULL when a used idempotency_key was skipped. Raises SQLSTATE 22023 on invalid arguments, 23505 on a used idempotency_key.';

CREATE OR REPLACE FUNCTION outbox.emit(
    topic text,
    payload jsonb,
    headers jsonb DEFAULT '{}',
    message_id text DEFAULT NULL,
    exchange text DEFAULT NULL,
    correlation_id text DEFAULT NULL,
    causation_id text DEFAULT NULL,
    aggregate_type text DEFAULT NULL,
    aggregate_id text DEFAULT NULL,
    aggregate_version bigint DEFAULT NULL,
    tenant text DEFAULT NULL,
    expiration bigint DEFAULT NULL,
    priority integer DEFAULT NULL,
    traceparent text DEFAULT NULL,
    tracestate text DEFAULT NULL,
    idempotency_key text DEFAULT NULL,
    on_duplicate text DEFAULT 'raise'
) RETURNS pg_lsn
LANGUAGE plpgsql
VOLATILE
SET search_path = pg_catalog, pg_temp
AS $fn$
BEGIN
    RETURN outbox.emit_bytes(topic, convert_to(payload::text, 'UTF8'), 'application/json',
        headers, message_id,
        exchange => exchange, correlation_id => correlation_id, causation_id => causation_id,
        aggregate_type => aggregate_type, aggregate_id => aggregate_id,
        aggregate_version => aggregate_version, tenant => tenant, expiration => expiration,
        priority => priority, traceparent => traceparent, tracestate => tracestate,
        idempotency_key => idempotency_key, on_duplicate => on_duplicate);
END;
$fn$;

COMMENT ON FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) IS
    'pgoutbox: publishes payload (JSON, content type application/json) to RabbitMQ with routing key topic when the current transaction commits. headers: JSON object of AMQP headers (keys at most 255 bytes, no x-pgoutbox-*, CC or BCC). message_id: NULL for a random UUID. Optional named arguments as for outbox.emit_bytes: exchange, correlation_id, causation_id, aggregate_type, aggregate_id, aggregate_version, tenant, expiration (ms), priority (0-9), traceparent, tracestate, idempotency_key, on_duplicate (raise | skip). Returns the LSN of the logical decoding message, or NULL when a used idempotency_key was skipped. Raises SQLSTATE 22023 on invalid arguments, 23505 on a used idempotency_key.';

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
    reason           text NOT NULL,        -- nacked | returned | poison | too_large | forged | unsupported_envelope
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
-- lockdown's second step wrote (NULL while pending, see sql/lockdown.sql): a pgoutbox
-- message at a later LSN that is not a version-2 (or
-- later) envelope with an emitter is dead-lettered as forged. Readable by every role (it is what
-- `run`, `status` and `check` read; nothing secret).
CREATE TABLE IF NOT EXISTS outbox.lockdown (
    singleton       boolean PRIMARY KEY DEFAULT true CHECK (singleton),
    enabled_at_lsn  pg_lsn,               -- NULL: pending (step 2 of the lockdown not done)
    enabled_at      timestamptz NOT NULL DEFAULT now(),
    enabled_by      text NOT NULL DEFAULT session_user,
    previous_owner  text,                 -- owner of outbox.emit before; unlock restores it
    previous_owners jsonb,                -- owners before of schema, helpers, tables
    helpers_fingerprint text              -- md5 of the helpers' definitions at lockdown
);
-- Tables of earlier pgoutbox versions.
DO $upgrade$
BEGIN
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                WHERE attrelid = 'outbox.lockdown'::regclass AND attname = 'enabled_at_lsn'
                  AND attnotnull) THEN
        ALTER TABLE outbox.lockdown ALTER COLUMN enabled_at_lsn DROP NOT NULL;
    END IF;
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_attribute
                    WHERE attrelid = 'outbox.lockdown'::regclass AND attname = 'helpers_fingerprint'
                      AND NOT attisdropped) THEN
        ALTER TABLE outbox.lockdown ADD COLUMN previous_owners jsonb,
                                    ADD COLUMN helpers_fingerprint text;
    END IF;
END;
$upgrade$;

COMMENT ON TABLE outbox.lockdown IS
    'pgoutbox: present while setup --lockdown is in effect (pg_logical_emit_message revoked from PUBLIC; outbox.emit/emit_bytes SECURITY DEFINER); pgoutbox messages after enabled_at_lsn that did not come through the helpers are dead-lettered as forged.';

GRANT SELECT ON outbox.lockdown TO PUBLIC;

-- CREATE OR REPLACE FUNCTION above resets SECURITY DEFINER (it keeps owner and grants),
-- and an upgrade from envelope version 2 dropped the old signatures (their owner and
-- grants went with them): under lockdown, make the helpers SECURITY DEFINER functions of
-- pgoutbox_emitter again, or producers would lose their only way to emit, and give it the
-- schema and everything the helpers run (see sql/lockdown.sql). `setup` then records the
-- fingerprint of these definitions (src/admin/lockdown.rs).
DO $lockdown$
DECLARE
    schema_owner text;
BEGIN
    IF EXISTS (SELECT 1 FROM outbox.lockdown)
       AND EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = 'pgoutbox_emitter') THEN
        -- A schema owner other than the emitter keeps USAGE (see sql/lockdown.sql), granted
        -- after the change (an owner's grants to itself go with the ownership).
        schema_owner := (SELECT pg_catalog.pg_get_userbyid(n.nspowner)
                           FROM pg_catalog.pg_namespace n JOIN pg_catalog.pg_class c
                             ON c.relnamespace = n.oid
                          WHERE c.oid = 'outbox.lockdown'::regclass);
        ALTER SCHEMA outbox OWNER TO pgoutbox_emitter;
        EXECUTE format('GRANT USAGE ON SCHEMA outbox TO %I', schema_owner);
        ALTER FUNCTION outbox._envelope(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text) OWNER TO pgoutbox_emitter;
        ALTER TABLE outbox.idempotency OWNER TO pgoutbox_emitter;
        ALTER TABLE outbox.lockdown OWNER TO pgoutbox_emitter;
        ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO pgoutbox_emitter;
        ALTER FUNCTION outbox.emit(text, jsonb, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY DEFINER;
        ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) OWNER TO pgoutbox_emitter;
        ALTER FUNCTION outbox.emit_bytes(text, bytea, text, jsonb, text, text, text, text, text, text, bigint, text, bigint, integer, text, text, text, text) SECURITY DEFINER;
    END IF;
END;
$lockdown$;
