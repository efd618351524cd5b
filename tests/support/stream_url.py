"""The connection arguments of rstream's Consumer and Producer for a stream URL (read_stream.py,
publish_stream.py).

    rabbitmq-stream://USER:PASS@HOST:PORT/VHOST
    rabbitmq-stream+tls://USER:PASS@HOST:PORT/VHOST?cacertfile=PEM&certfile=PEM&keyfile=PEM

VHOST is percent-encoded (%2f for /; none: /). Over TLS the server's certificate is verified
against cacertfile (else the system's CAs) and the host name; certfile and keyfile present a
client certificate.
"""

import ssl
from urllib.parse import parse_qs, unquote, urlsplit


def connection_args(url):
    parts = urlsplit(url)
    if parts.scheme not in ("rabbitmq-stream", "rabbitmq-stream+tls"):
        raise SystemExit(f"not a rabbitmq-stream:// or rabbitmq-stream+tls:// URL: {url}")
    args = {
        "host": parts.hostname,
        "port": parts.port or (5551 if parts.scheme.endswith("+tls") else 5552),
        "vhost": unquote(parts.path[1:]) if len(parts.path) > 1 else "/",
        "username": unquote(parts.username or "guest"),
        "password": unquote(parts.password or "guest"),
    }
    if parts.scheme.endswith("+tls"):
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        context = ssl.create_default_context(cafile=query.get("cacertfile"))
        if "certfile" in query:
            context.load_cert_chain(query["certfile"], query.get("keyfile"))
        args["ssl_context"] = context
    return args
