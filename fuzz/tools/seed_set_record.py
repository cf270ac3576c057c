#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz target `set_record` into
fuzz/corpus/set_record/: valid set records of each mechanism and near-valid
ones that each break one rule."""
import copy
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "corpus", "set_record")
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


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    for m in ("vmm", "legacy", "pool", "fabric"):
        seeds["valid-" + m] = record(m)
    with_event = record("vmm")
    with_event["event"] = "0f" * 64
    seeds["valid-event"] = with_event

    def broken(name, edit):
        r = record("vmm")
        edit(r)
        seeds[name] = r

    broken("overlap", lambda r: r["entries"][1].__setitem__(4, 262140))
    broken("past-end", lambda r: r["entries"][1].__setitem__(4, 4 * MIB - 4))
    broken("duplicate-name", lambda r: r["entries"][1].__setitem__(0, "layer0.weight"))
    broken("duplicate-chunk", lambda r: r["chunks"][1].__setitem__("id", 0))
    broken("same-memory", lambda r: r["chunks"][1]["descriptor"].__setitem__("fd", 10))
    broken("unknown-version", lambda r: r.__setitem__("cuda_ipc_set", 2))
    broken("unknown-field", lambda r: r.__setitem__("extra", True))
    broken("short-entry", lambda r: r["entries"].__setitem__(1, ["x", "u8", [1]]))
    broken("len-mismatch", lambda r: r["entries"][1].__setitem__(5, 1028))
    broken("unused-chunk", lambda r: r["chunks"].append(chunk(5, "vmm", 3)))
    broken("chunk-event", lambda r: r["chunks"][0]["descriptor"].__setitem__("event", "ab" * 64))
    for name, value in seeds.items():
        with open(os.path.join(OUT, "seed-" + name), "w") as f:
            f.write(json.dumps(value, separators=(",", ":")))


if __name__ == "__main__":
    main()
