#!/usr/bin/env python3
"""Writes the seeds of the fuzz targets notice_record (records of the
channel's shared-memory rings), shm_ring (rings with a hostile peer's
writes) and admin_body (the weight service's admin bodies) into
fuzz/corpus/<target>/seed-*. Run from anywhere: fuzz/tools/seed_notices.py"""
import json
import os
import struct

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "corpus")


def write(target, name, data):
    d = os.path.join(ROOT, target)
    os.makedirs(d, exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def record(count, payload, version=1, kind=1, fds=0, length=None):
    if isinstance(payload, str):
        payload = payload.encode()
    n = len(payload) if length is None else length
    return struct.pack("<Q4sHHIHH", count, b"CIPC", version, kind, n, fds, 0) + payload


# notice_record: whole records, then bare payloads (the target frames them).
ACK = '{"type":"ack","lease":3,"slot":1,"seq":9}'
MAX = 2**64 - 1
notices = {
    "record-ack": record(42, ACK),
    "record-ack-max": record(MAX, '{"type":"ack","lease":%d,"slot":%d,"seq":%d}' % (MAX, 2**32 - 1, MAX)),
    "record-ack-zeros": record(0, '{"type":"ack","lease":0,"slot":0,"seq":0}'),
    "record-ack-reordered": record(1, '{"seq":9,"slot":1,"lease":3,"type":"ack"}'),
    "record-ack-spaced": record(1, '{ "type": "ack", "lease": 3, "slot": 1, "seq": 9 }'),
    "record-ack-leading-zero": record(1, '{"type":"ack","lease":03,"slot":1,"seq":9}'),
    "record-ack-slot-too-big": record(1, '{"type":"ack","lease":3,"slot":4294967296,"seq":9}'),
    "record-ack-lease-too-big": record(1, '{"type":"ack","lease":18446744073709551616,"slot":1,"seq":9}'),
    "record-ack-float": record(1, '{"type":"ack","lease":3.0,"slot":1,"seq":9}'),
    "record-ack-extra": record(1, '{"type":"ack","lease":3,"slot":1,"seq":9,"x":0}'),
    "record-ack-duplicate": record(1, '{"type":"ack","lease":3,"lease":4,"slot":1,"seq":9}'),
    "record-ack-trailing": record(1, ACK + " "),
    "record-update": record(5, '{"type":"update","lease":9,"name":"weights","generation":1,"notice":{"step":1}}'),
    "record-ring-frame": record(5, '{"type":"ring_frame","lease":10,"slot":1,"seq":2,"notice":null}'),
    "record-unpublished": record(6, '{"type":"unpublished","lease":9,"name":"weights"}'),
    "record-ring-late": record(7, '{"type":"ring_late","lease":10,"stale_through":4,"evicted":false,"reason":"slow"}'),
    "record-with-fds": record(1, ACK, fds=1),
    "record-bad-version": record(1, ACK, version=2),
    "record-bad-kind": record(1, ACK, kind=2),
    "record-long-header": record(1, ACK, length=len(ACK) + 1),
    "record-short-header": record(1, ACK, length=len(ACK) - 1),
    "record-too-large": record(1, ACK, length=(1 << 20) + 1),
    "record-short": b"\x01\x02\x03",
    "record-count-only": struct.pack("<Q", 9),
    "payload-ack": ACK,
    "payload-ack-reordered": '{"lease":3,"seq":9,"slot":1,"type":"ack"}',
    "payload-ack-negative": '{"type":"ack","lease":-3,"slot":1,"seq":9}',
    "payload-ack-exponent": '{"type":"ack","lease":3e0,"slot":1,"seq":9}',
    "payload-ack-unicode-escape": '{"type":"\\u0061ck","lease":3,"slot":1,"seq":9}',
    "payload-ping": '{"type":"ping","id":1}',
}


def binary(count, tag, *fields, rest=b""):
    # A binary record: the count, a tag byte, then fields as (format, value).
    out = struct.pack("<QB", count, tag)
    for fmt, v in fields:
        out += struct.pack("<" + fmt, v)
    return out + (rest.encode() if isinstance(rest, str) else rest)


def bin_update(count, lease, version, name, notice, length=None):
    n = name.encode() if isinstance(name, str) else name
    return binary(count, 0xA3, ("Q", lease), ("Q", version), ("I", len(n) if length is None else length), rest=n + notice.encode())


notices.update({
    "binary-ack": binary(42, 0xA1, ("Q", 3), ("I", 1), ("Q", 9)),
    "binary-ack-max": binary(MAX, 0xA1, ("Q", MAX), ("I", 2**32 - 1), ("Q", MAX)),
    "binary-ack-trailing": binary(1, 0xA1, ("Q", 3), ("I", 1), ("Q", 9), rest=b"\0"),
    "binary-ack-short": binary(1, 0xA1, ("Q", 3), ("I", 1)),
    "binary-ring-frame": binary(5, 0xA2, ("Q", 10), ("I", 1), ("Q", 2), rest="null"),
    "binary-ring-frame-meta": binary(5, 0xA2, ("Q", 10), ("I", 1), ("Q", 2), rest='{"bytes":4096,"shape":[2,3],"t":1.5}'),
    "binary-ring-frame-no-notice": binary(5, 0xA2, ("Q", 10), ("I", 1), ("Q", 2)),
    "binary-ring-frame-two-values": binary(5, 0xA2, ("Q", 10), ("I", 1), ("Q", 2), rest="1 2"),
    "binary-update": bin_update(5, 9, 1, "weights", '{"step":1}'),
    "binary-update-empty-name": bin_update(5, 9, 1, "", "null"),
    "binary-update-unicode": bin_update(5, 9, 1, "w\u00e9ights", '"\\u00e9"'),
    "binary-update-bad-utf8": bin_update(5, 9, 1, b"w\xffights", "null"),
    "binary-update-name-too-long": bin_update(5, 9, 1, "weights", "null", length=1000),
    "binary-update-name-huge": bin_update(5, 9, 1, "weights", "null", length=2**32 - 1),
    "binary-update-deep": bin_update(5, 9, 1, "weights", "[" * 200 + "]" * 200),
    "binary-unknown-tag": binary(5, 0xA4, ("Q", 10)),
    "binary-tag-only": binary(5, 0xA3),
})
for name, data in notices.items():
    write("notice_record", name, data)

# shm_ring: sends (mod 32), reads, a length seed, then patches
# (u16 offset, u8 length, bytes) over an area of two rings of 4 KiB.
CAP, HDR = 4096, 256
RING1 = HDR + CAP


def patch(at, data):
    return struct.pack("<HB", at, len(data)) + data


q = lambda v: struct.pack("<Q", v)
rings = {
    "empty": bytes([0, 0, 0]),
    "clean": bytes([5, 2, 3]),
    "clean-all-read": bytes([6, 6, 9]),
    "wrapped": bytes([24, 20, 5]),
    "full": bytes([31, 0, 1]),
    "head-far": bytes([4, 1, 2]) + patch(64, q(MAX)),
    "head-odd": bytes([4, 1, 2]) + patch(64, q(13)),
    "head-back": bytes([4, 4, 2]) + patch(RING1 + 64, q(8)),
    "length-too-long": bytes([3, 0, 2]) + patch(HDR, q(4000)),
    "length-huge": bytes([3, 0, 2]) + patch(RING1 + HDR, q(MAX)),
    "tail-ahead": bytes([4, 1, 2]) + patch(128, q(1 << 40)),
    "sleeping": bytes([2, 0, 1]) + patch(192, q(1)) + patch(RING1 + 192, q(1)),
    "data-scribbled": bytes([8, 3, 7]) + patch(HDR + 40, b"\xff" * 64),
    "header-zeroed": bytes([2, 1, 1]) + patch(0, bytes(255)),
    "forged-record": bytes([0, 0, 0]) + patch(64, q(24)) + patch(HDR, q(11) + b"hello world"),
}
for name, data in rings.items():
    write("shm_ring", name, data)

# admin_body: the request and answer of each method, and near misses.
HOLDER = {"pid": 7, "uid": 1000}
ROW = {"name": "model", "bytes": 768, "payload_bytes": 700, "tensors": 3, "version": 1,
       "owner_uid": 1000, "loaded_from": "/data/m.safetensors", "created_unix": 1764547200,
       "leases": [HOLDER]}
USAGE = {"uid": 1000, "used": 768, "reserved": 0, "quota": None, "sets": 1}
bodies = {
    "load": {"set": "model", "path": "/data/m.safetensors"},
    "load-copies": {"set": "model", "path": "/data/m.safetensors", "streams": 8, "staging": 2097152},
    "load-null-streams": {"set": "model", "path": "/p", "streams": None},
    "load-relative": {"set": "model", "path": "m.safetensors"},
    "load-hidden-name": {"set": ".cuda-ipc/x", "path": "/p"},
    "load-answer": {"set": "model", "version": 1, "path": "/data/m.safetensors", "files": 1,
                    "tensors": 3, "bytes": 100, "allocated": 768, "streams": 8,
                    "load_s": 0.25, "gb_per_s": 4e-7},
    "load-answer-int-seconds": {"set": "m", "version": 1, "path": "/p", "files": 1, "tensors": 1,
                                "bytes": 1, "allocated": 1, "streams": 1, "load_s": 1,
                                "gb_per_s": 1e308},
    "empty": {},
    "ls-answer": {"sets": [ROW]},
    "stats-answer": {"pid": 7, "service_uid": 0, "default_quota": 1 << 30, "uids": [USAGE],
                     "sets": 1, "total_bytes": 768, "loads_in_progress": 0, "leases": 1,
                     "device_free": None, "device_total": 80 << 30, "stopping": False},
    "drop": {"set": "model"},
    "drop-force": {"set": "model", "force": True},
    "drop-answer": {"set": "model", "bytes": 768, "held_by": [HOLDER]},
    "shutdown-answer": {"stopping": True},
    "unknown-field": {"set": "model", "path": "/p", "x": 1},
    "wrong-type": {"set": "model", "force": 1},
    "negative": {"set": "model", "bytes": -1, "held_by": []},
    "too-big": {"stopping": True, "pid": 2**64},
}
for name, body in bodies.items():
    write("admin_body", name, json.dumps(body, separators=(",", ":")))
write("admin_body", "null", "null")
write("admin_body", "array", "[]")
write("admin_body", "duplicate-key", '{"set":"a","set":"b"}')
write("admin_body", "not-json", "{")
