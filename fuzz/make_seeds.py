#!/usr/bin/env python3
"""Writes the hand-made seed inputs of the fuzz targets into fuzz/seeds/<target>/.

Each seed is a small valid (or nearly valid) message of the kind the target parses, so that
libFuzzer starts from the interesting shapes instead of from nothing. Run from anywhere:
`python3 fuzz/make_seeds.py`; the files are committed, the script only documents them.
"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "seeds")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def envelope(id_, topic, content_type, headers, payload, version=1, **extra):
    h = json.dumps(dict({"id": id_, "topic": topic, "content_type": content_type,
                         "headers": headers}, **extra), separators=(",", ":")).encode()
    return bytes([version]) + struct.pack(">I", len(h)) + h + payload


ENV = envelope("0b6f0a4e-5b1a-4c39-9d38-6f1f4c1f0e11", "orders.created", "application/json",
               {}, b'{"order": 42}')

# pgoutput messages (protocol version 1)
begin = b"B" + struct.pack(">QqI", 0x16B3748, 786_000_000_000_000, 731)
commit = b"C" + struct.pack(">BQQq", 0, 0x16B3748, 0x16B3778, 786_000_000_000_000)


def message(flags, lsn, prefix, content):
    return b"M" + struct.pack(">BQ", flags, lsn) + prefix + b"\0" + struct.pack(">i", len(content)) + content


msg = message(1, 0x16B3700, b"pgoutbox", ENV)
pg = {
    "begin": begin,
    "commit": commit,
    "message_outbox": msg,
    "message_nontransactional": message(0, 0x16B3700, b"pgoutbox", ENV),
    "message_other_prefix": message(1, 0x10, b"other", b"hello"),
    "message_empty": message(1, 0, b"", b""),
    "relation": b"R" + struct.pack(">I", 16384) + b"public\0t\0d" + struct.pack(">h", 1)
                + b"\1id\0" + struct.pack(">Ii", 23, -1),
    "insert": b"I" + struct.pack(">I", 16384) + b"N" + struct.pack(">h", 1) + b"t"
              + struct.pack(">i", 2) + b"42",
    "origin": b"O" + struct.pack(">Q", 0x100) + b"node1\0",
    "truncated_begin": begin[:12],
    "message_negative_length": b"M" + struct.pack(">BQ", 1, 1) + b"p\0" + struct.pack(">i", -1),
}
for k, v in pg.items():
    write("pgoutput", k, v)

# CopyData bodies
def xlog(start, end, payload):
    return b"w" + struct.pack(">QQq", start, end, 786_000_000_000_000) + payload


cd = {
    "xlog_begin": xlog(0x16B3700, 0x16B3800, begin),
    "xlog_message": xlog(0x16B3700, 0x16B3800, msg),
    "xlog_commit": xlog(0x16B3748, 0x16B3800, commit),
    "xlog_empty": xlog(0, 0, b""),
    "keepalive": b"k" + struct.pack(">QqB", 0x16B3800, 786_000_000_000_000, 0),
    "keepalive_reply": b"k" + struct.pack(">QqB", 0x16B3800, 786_000_000_000_000, 1),
    "keepalive_short": b"k" + struct.pack(">Q", 0x16B3800),
}
def frame(tag, body):
    return tag + struct.pack(">i", len(body) + 4) + body


cd["stream_transaction"] = (frame(b"d", cd["xlog_begin"]) + frame(b"d", cd["xlog_message"])
                            + frame(b"d", cd["xlog_commit"]) + frame(b"d", cd["keepalive"]))
cd["stream_notice_error"] = (frame(b"N", b"SWARNING\0Mslow\0\0") + frame(b"d", cd["keepalive_reply"])
                             + frame(b"E", b"SERROR\0C55006\0Mreplication slot is active\0\0"))
cd["stream_end"] = frame(b"d", cd["xlog_empty"]) + frame(b"C", b"COPY 0\0") + frame(b"Z", b"I")
cd["stream_copy_done"] = frame(b"c", b"")
for k, v in cd.items():
    write("copy_data", k, v)

# envelopes
ev = {
    "emit_json": ENV,
    "emit_headers": envelope("id-1", "a.b.c", "application/json",
                             {"tenant": "t1", "attempt": 3, "ratio": 0.5, "urgent": True,
                              "none": None, "tags": ["x", "y"], "meta": {"k": "v"}},
                             b'{"x":[1,2,3]}'),
    "emit_bytes": envelope("id-2", "bin", "application/octet-stream", {}, bytes(range(16))),
    "empty_content_type": envelope("id-3", "t", "", {}, b""),
    "reserved_key": envelope("id-4", "t", "text/plain", {"x-pgoutbox-lsn": "0/1"}, b"p"),
    "cc_key": envelope("id-5", "t", "text/plain", {"CC": "q"}, b"p"),
    "unicode": envelope("\u00e9v\u00e9nement", "caf\u00e9", "text/plain; charset=utf-8",
                        {"cl\u00e9": "\u65e5\u672c"}, "\u00e9".encode()),
    "version_2": envelope("id", "t", "", {}, b"", version=2),
    "version_3": envelope("id-3", "orders.created", "application/json", {"k": "v"}, b"{}",
                          version=3, emitted_by="app", exchange="orders",
                          correlation_id="corr-1", causation_id="cause-0",
                          aggregate_type="order", aggregate_id="42", aggregate_version=7,
                          tenant="acme", expiration_ms=60000, priority=5,
                          traceparent="00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                          tracestate="rojo=00f067aa0ba902b7,congo=t61rcWkgMzE",
                          idempotency_key="create-42"),
    "version_3_bad_priority": envelope("id", "t", "c", {}, b"", version=3, priority=10),
    "version_4": envelope("id", "t", "c", {}, b"", version=4),
    "truncated_header": ENV[:20],
}
for k, v in ev.items():
    write("envelope", k, v)

# start-up: byte 0 = flags (bit 0: the URL has a password), then server messages
def be(tag, body):
    return tag + struct.pack(">i", len(body) + 4) + body


auth_ok = be(b"R", struct.pack(">i", 0))
params = be(b"S", b"server_version\x0015.18\0") + be(b"S", b"client_encoding\0UTF8\0")
key = be(b"K", struct.pack(">ii", 4242, 123456))
ready = be(b"Z", b"I")
notice = be(b"N", b"SNOTICE\0VNOTICE\0C00000\0Mhello\0\0")
error = be(b"E", b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed for user \"u\"\0\0")
su = {
    "trust": b"\0" + auth_ok + params + key + ready,
    "cleartext": b"\1" + be(b"R", struct.pack(">i", 3)) + auth_ok + params + key + ready,
    "cleartext_no_password": b"\0" + be(b"R", struct.pack(">i", 3)),
    "md5": b"\1" + be(b"R", struct.pack(">i", 5) + b"\x01\x02\x03\x04") + auth_ok + ready,
    "sasl": b"\1" + be(b"R", struct.pack(">i", 10) + b"SCRAM-SHA-256\0\0"),
    "sasl_continue": b"\1" + be(b"R", struct.pack(">i", 10) + b"SCRAM-SHA-256-PLUS\0SCRAM-SHA-256\0\0")
                     + be(b"R", struct.pack(">i", 11) + b"r=abc,s=c2FsdA==,i=4096"),
    "sasl_final_first": b"\1" + be(b"R", struct.pack(">i", 12) + b"v=c2ln"),
    "sasl_no_scram": b"\1" + be(b"R", struct.pack(">i", 10) + b"OTHER\0\0"),
    "gss": b"\1" + be(b"R", struct.pack(">i", 7)),
    "kerberos": b"\1" + be(b"R", struct.pack(">i", 2)),
    "error": b"\1" + be(b"R", struct.pack(">i", 3)) + error,
    "notice_then_ready": b"\0" + auth_ok + notice + ready,
    "copy_both_early": b"\0" + auth_ok + be(b"W", b"\0\0\0"),
    "data_row_early": b"\0" + auth_ok + be(b"D", struct.pack(">hi", 1, 1) + b"x"),
}
for k, v in su.items():
    write("startup", k, v)

# stream_frames: frames of the RabbitMQ stream protocol as the broker sends them
def sframe(key, body):
    return struct.pack(">IHH", len(body) + 4, key, 1) + body


def sstr(s):
    return struct.pack(">h", len(s)) + s


sf = {
    "confirm": sframe(0x0003, b"\0" + struct.pack(">i", 2) + struct.pack(">QQ", 65536, 65537)),
    "error": sframe(0x0004, b"\0" + struct.pack(">i", 1) + struct.pack(">QH", 65536, 0x10)),
    "metadata_update": sframe(0x0010, struct.pack(">H", 6) + sstr(b"s1")),
    "tune": sframe(0x0014, struct.pack(">II", 1048576, 60)),
    "close": sframe(0x0016, struct.pack(">IH", 1, 1) + sstr(b"bye")),
    "heartbeat": sframe(0x0017, b""),
    "sequence": sframe(0x8005, struct.pack(">IHQ", 8, 1, 184890884096)),
    "mechanisms": sframe(0x8012, struct.pack(">IHi", 2, 1, 2) + sstr(b"PLAIN") + sstr(b"AMQPLAIN")),
    "open": sframe(0x8015, struct.pack(">IHi", 4, 1, 1) + sstr(b"advertised_host") + sstr(b"h")),
    "metadata": sframe(0x800f, struct.pack(">Ii", 6, 1) + struct.pack(">H", 0) + sstr(b"127.0.0.1")
                       + struct.pack(">I", 5552) + struct.pack(">i", 1) + sstr(b"s1")
                       + struct.pack(">HHi", 1, 0, 0)),
}
for k, v in sf.items():
    write("stream_frames", k, v)
