"""Publishes to a RabbitMQ stream with rstream, a client pgoutbox did not write (tests/support/stream.rs).

    python publish_stream.py URL STREAM [PRODUCER_NAME] < messages.jsonl

URL is rabbitmq-stream://USER:PASS@HOST:PORT/VHOST (VHOST percent-encoded, %2f for /), or
rabbitmq-stream+tls://...?cacertfile=PEM (stream_url.py). The
stream must exist. Each line of standard input is one message, as JSON:

    {"body": base64, "message_id": str, "subject": str, "content_type": str,
     "creation_time": ms since the epoch, "correlation_id": str,
     "application_properties": {str: str | int | float | bool | null},
     "publishing_id": int}

every key optional. rstream encodes them as an AMQP 1.0 message: the properties section, the
application properties (string keys), the body as one data section (rstream writes no data
section for an empty body). With PRODUCER_NAME the producer is named (the broker's publisher
deduplication: an id at or below the stored one is confirmed and dropped) and a message's
"publishing_id" is sent as it is; without one rstream numbers them. Each message is sent and
its confirm awaited in turn. Prints one JSON line per message, {"publishing_id": id}, once
confirmed; exits 2 with the error on stderr when anything fails.
"""

import asyncio
import base64
import json
import sys

from rstream import AMQPMessage, Producer, Properties

from stream_url import connection_args


def message(spec):
    properties = Properties(
        message_id=spec.get("message_id"),
        subject=spec.get("subject"),
        content_type=spec.get("content_type"),
        creation_time=spec.get("creation_time"),
        correlation_id=spec.get("correlation_id"),
    )
    m = AMQPMessage(
        body=base64.b64decode(spec.get("body", "")),
        properties=properties,
        application_properties=spec.get("application_properties") or None,
    )
    # Not through the constructor: rstream 1.1.1's AMQPMessage(publishing_id=...) is refused
    # by the NamedTuple underneath.
    m.publishing_id = spec.get("publishing_id")
    return m


async def publish(url, stream, name, specs):
    async with Producer(
        **connection_args(url),
        connection_name="pgoutbox-tests-publish-stream",
    ) as producer:
        for spec in specs:
            # Generous: CI is a loaded 2-core machine.
            publishing_id = await producer.send_wait(stream, message(spec), publisher_name=name, timeout=60)
            sys.stdout.write(json.dumps({"publishing_id": publishing_id}) + "\n")
            sys.stdout.flush()


def main():
    if len(sys.argv) not in (3, 4):
        sys.stderr.write(__doc__)
        sys.exit(2)
    url, stream = sys.argv[1], sys.argv[2]
    name = sys.argv[3] if len(sys.argv) == 4 else None
    specs = [json.loads(line) for line in sys.stdin if line.strip()]
    try:
        asyncio.run(publish(url, stream, name, specs))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001 - reported to the Rust side
        sys.stderr.write(f"publish_stream.py: {type(e).__name__}: {e}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()
