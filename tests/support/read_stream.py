"""Reads a RabbitMQ stream with rstream, a client pgoutbox did not write (tests/support/stream.rs).

    python read_stream.py URL STREAM EXPECT IDLE_SECONDS

URL is rabbitmq-stream://USER:PASS@HOST:PORT/VHOST (VHOST percent-encoded, %2f for /), or
rabbitmq-stream+tls://...?cacertfile=PEM (stream_url.py).
Subscribes to STREAM from its first offset and reads until it has EXPECT messages or no
message came for IDLE_SECONDS (since the subscription, then since the last message). Every
message delivered before it stops is printed, even past EXPECT (a duplicate must show): one
JSON line each, in delivery order, decoded by rstream's own AMQP 1.0 decoder:

    {"offset": 0, "chunk_timestamp": ms,
     "properties": {"message_id": ..., "user_id": ..., "to": ..., "subject": ...,
                    "reply_to": ..., "correlation_id": ..., "content_type": ...,
                    "content_encoding": ..., "absolute_expiry_time": ..., "creation_time": ...,
                    "group_id": ..., "group_sequence": ..., "reply_to_group_id": ...} or null,
     "application_properties": {...} or null, "message_annotations": {...} or null,
     "body": base64 of the data section or null, "value": ..., "raw": base64 of the message}

rstream decodes an AMQP string, symbol and binary alike as bytes: such a value is printed as
a string when it is UTF-8, else as {"binary": base64}. Timestamps are integers, milliseconds
since the epoch; a UUID is {"uuid": "..."}. Exits 2 with the error on stderr when the
connection or the subscription fails (the stream does not exist, say).
"""

import asyncio
import base64
import json
import sys
import time
import uuid

from rstream import Consumer, ConsumerOffsetSpecification, OffsetType, amqp_decoder

from stream_url import connection_args

PROPERTY_NAMES = (
    "message_id",
    "user_id",
    "to",
    "subject",
    "reply_to",
    "correlation_id",
    "content_type",
    "content_encoding",
    "absolute_expiry_time",
    "creation_time",
    "group_id",
    "group_sequence",
    "reply_to_group_id",
)


def plain(value):
    """A decoded AMQP value as JSON."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = bytes(value)
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return {"binary": base64.b64encode(value).decode("ascii")}
    if isinstance(value, uuid.UUID):
        return {"uuid": str(value)}
    if isinstance(value, dict):
        return {key(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def key(k):
    """A map key as a JSON object key: a string as it is, anything else as its JSON text."""
    k = plain(k)
    return k if isinstance(k, str) else json.dumps(k, sort_keys=True)


def message_json(raw, offset, chunk_timestamp):
    message = amqp_decoder(bytes(raw))
    properties = message.properties
    body = message.body
    if isinstance(body, list):  # several data sections: rstream keeps the last one only
        body = b"".join(bytes(b) for b in body)
    return {
        "offset": offset,
        "chunk_timestamp": chunk_timestamp,
        "properties": None
        if properties is None
        else {name: plain(getattr(properties, name)) for name in PROPERTY_NAMES},
        "application_properties": plain(message.application_properties),
        "message_annotations": plain(message.message_annotations),
        "body": None if body is None else base64.b64encode(bytes(body)).decode("ascii"),
        "value": plain(message.value),
        "raw": base64.b64encode(bytes(raw)).decode("ascii"),
    }


async def read(url, stream, expect, idle):
    lines = []
    last = time.monotonic()
    done = asyncio.Event()

    def on_message(raw, context):
        nonlocal last
        lines.append(message_json(raw, context.offset, context.timestamp))
        last = time.monotonic()
        if len(lines) >= expect:
            done.set()

    consumer = Consumer(
        **connection_args(url),
        connection_name="pgoutbox-tests-read-stream",
    )
    await consumer.start()
    try:
        await consumer.subscribe(
            stream,
            on_message,
            # The message's bytes as stored; decoded in on_message, so that "raw" is exact.
            decoder=lambda raw: raw,
            offset_specification=ConsumerOffsetSpecification(OffsetType.FIRST, None),
            initial_credit=10,
        )
        last = time.monotonic()  # the idle time counts from the subscription
        while not done.is_set():
            left = idle - (time.monotonic() - last)
            if left <= 0:
                break
            try:
                await asyncio.wait_for(done.wait(), timeout=min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        # What was delivered with the last message (the rest of its chunk) was handed over
        # in the same callback run; print everything.
        for line in lines:
            sys.stdout.write(json.dumps(line, sort_keys=True) + "\n")
        sys.stdout.flush()
    finally:
        try:
            await asyncio.wait_for(consumer.close(), timeout=10)
        except Exception:  # the messages are printed; a slow close is no failure
            pass


def main():
    if len(sys.argv) != 5:
        sys.stderr.write(__doc__)
        sys.exit(2)
    url, stream, expect, idle = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    try:
        asyncio.run(read(url, stream, expect, idle))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported to the Rust side
        sys.stderr.write(f"read_stream.py: {type(e).__name__}: {e}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
