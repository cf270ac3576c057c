#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz targets `set_record` and `set_table`
into fuzz/corpus/set_record/ and fuzz/corpus/set_table/: valid set records
of each mechanism in formats 1 and 2 (and with the read-only policy) and
near-valid ones that each break one rule; entry tables of format 2, valid
and broken."""
import base64
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "corpus", "set_record")
TABLES = os.path.join(HERE, "..", "corpus", "set_table")
UUID = "GPU-07070707-0707-0707-0707-070707070707"
MIB = 1 << 20


def chunk(cid, mechanism, n, size=4 * MIB):
    d = {"cuda_ipc": 1, "mechanism": mechanism, "alloc_size": size, "offset": 0,
         "len": size, "dtype": "u8", "elem_size": 1, "device_uuid": UUID,
         "pid": 4242, "generation": 100 + n}
    if mechanism in ("vmm", "pool"):
        d["fd"] = 10 + n
    if mechanism in ("legacy", "pool", "fabric"):
        d["handle"] = ("%02x" % (n + 1)) * 64
    return {"id": cid, "descriptor": d}


def record(mechanism):
    return {"cuda_ipc_set": 1, "name": "weights", "arena": 1311768467294899695,
            "chunks": [chunk(0, mechanism, 0), chunk(2, mechanism, 1)],
            "entries": [["layer0.weight", "f32", [256, 256], 0, 0, 262144],
                        ["layer0.bias", "f32", [256], 0, 262144, 1024],
                        ["layer1.weight", "bf16", [1024, 1024], 2, 1024, 2097152],
                        ["step", "i64", [], 0, 263168, 8]]}


def uleb(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def table(entries):
    """Format 2's entry table (see crates/cuda-ipc/src/set/table.rs)."""
    out = bytearray(uleb(len(entries)))
    for name, dtype, shape, chunk_id, offset, length in entries:
        for text in (name, dtype):
            raw = text.encode()
            out += uleb(len(raw)) + raw
        out += uleb(len(shape)) + b"".join(uleb(d) for d in shape)
        out += uleb(chunk_id) + uleb(offset) + uleb(length)
    return bytes(out)


def format2(r):
    r = dict(r)
    r["cuda_ipc_set"] = 2
    r["entries"] = base64.b64encode(table(r["entries"])).decode()
    return r


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    for m in ("vmm", "legacy", "pool", "fabric"):
        seeds["valid-" + m] = record(m)
        seeds["valid-v2-" + m] = format2(record(m))
    with_event = record("vmm")
    with_event["event"] = "0f" * 64
    seeds["valid-event"] = with_event
    read_only = record("vmm")
    read_only["read_only"] = True
    seeds["valid-read-only"] = read_only
    seeds["valid-v2-read-only"] = format2(read_only)
    seeds["valid-v2-fabric-read-only"] = dict(format2(record("fabric")), read_only=True)

    def broken(name, edit):
        r = record("vmm")
        edit(r)
        seeds[name] = r

    broken("overlap", lambda r: r["entries"][1].__setitem__(4, 262140))
    broken("past-end", lambda r: r["entries"][1].__setitem__(4, 4 * MIB - 4))
    broken("duplicate-name", lambda r: r["entries"][1].__setitem__(0, "layer0.weight"))
    broken("duplicate-chunk", lambda r: r["chunks"][1].__setitem__("id", 0))
    broken("same-memory", lambda r: r["chunks"][1]["descriptor"].__setitem__("fd", 10))
    broken("unknown-version", lambda r: r.__setitem__("cuda_ipc_set", 3))
    broken("unknown-field", lambda r: r.__setitem__("extra", True))
    broken("short-entry", lambda r: r["entries"].__setitem__(1, ["x", "u8", [1]]))
    broken("len-mismatch", lambda r: r["entries"][1].__setitem__(5, 1028))
    broken("unused-chunk", lambda r: r["chunks"].append(chunk(5, "vmm", 3)))
    broken("chunk-event", lambda r: r["chunks"][0]["descriptor"].__setitem__("event", "ab" * 64))
    broken("read-only-not-bool", lambda r: r.__setitem__("read_only", 1))
    legacy = record("legacy")
    legacy["read_only"] = True
    seeds["read-only-legacy"] = legacy
    pool = format2(record("pool"))
    pool["read_only"] = True
    seeds["read-only-pool"] = pool
    v2 = format2(record("vmm"))
    v2["entries"] = v2["entries"][:-4]
    seeds["v2-cut-table"] = v2
    v2 = format2(record("vmm"))
    v2["entries"] = "not base64!"
    seeds["v2-not-base64"] = v2
    for name, value in seeds.items():
        with open(os.path.join(OUT, "seed-" + name), "w") as f:
            f.write(json.dumps(value, separators=(",", ":")))

    os.makedirs(TABLES, exist_ok=True)
    entries = record("vmm")["entries"]
    good = table(entries)
    tables = {
        "valid": good,
        "valid-one": table(entries[:1]),
        "valid-scalar": table([entries[3]]),
        "cut": good[:-3],
        "trailing": good + b"\x00",
        "overlong": b"\x81\x00" + good[1:],
        "past-64-bits": b"\xff" * 10,
        "too-many": uleb(100_001),
        "not-utf8": uleb(1) + uleb(2) + b"\xff\xfe" + uleb(3) + b"f32" + uleb(1) + uleb(1) + uleb(0) + uleb(0) + uleb(4),
        "bad-dtype": table([["w", "f128", [1], 0, 0, 16]]),
    }
    for name, value in tables.items():
        with open(os.path.join(TABLES, "seed-" + name), "wb") as f:
            f.write(value)


if __name__ == "__main__":
    main()
