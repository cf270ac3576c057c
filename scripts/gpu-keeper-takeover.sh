#!/usr/bin/env bash
# The keeper on a GPU host, through the command line as a user runs it: a
# safetensors file of GB gigabytes (default 4.4) is loaded into
# `cuda-ipc serve --service`, the serving process is SIGKILLed, and the
# keeper's next serving process must serve the same set at the same
# version (`ls`), with every byte equal to the file's (`attach
# --checkpoint`). Prints the keeper's log and one summary line.
#
#   scripts/gpu-keeper-takeover.sh CUDA_IPC_BINARY [GB [SERVE OPTIONS ...]]
#
# (for instance `... 4.4 --standby`: a standby started ahead takes over).
set -euo pipefail
bin=$1
gb=${2:-4.4}
shift $(( $# > 1 ? 2 : 1 ))
work=$(mktemp -d)
keeper=
trap '[ -n "$keeper" ] && kill -TERM "$keeper" 2>/dev/null; wait "$keeper" 2>/dev/null; rm -rf "$work"' EXIT
python3 - "$work/model.safetensors" "$gb" <<'PY'
import json, struct, sys
path, gb = sys.argv[1], float(sys.argv[2])
n = 290
each = int(gb * 1e9 / n) // 4 * 4
header, off = {}, 0
for i in range(n):
    header[f"layer.{i}.weight"] = {"dtype": "BF16", "shape": [each // 2], "data_offsets": [off, off + each]}
    off += each
h = json.dumps(header).encode()
h += b" " * (-len(h) % 8)
with open(path, "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    for i in range(n):
        block = bytes((j * 7 + i) & 255 for j in range(4096))
        f.write((block * (each // 4096 + 1))[:each])
PY
name=keeper-takeover-$$
"$bin" serve --service "$name" "$@" > "$work/out" 2> "$work/err" &
keeper=$!
for _ in $(seq 100); do "$bin" ls --service "$name" >/dev/null 2>&1 && break; sleep 0.1; done
"$bin" load --service "$name" --set model "$work/model.safetensors" 2>&1 | tail -1
before=$("$bin" ls --service "$name" --json)
sleep 1  # a standby, if asked for, has opened its device by now
serving=$("$bin" stats --service "$name" --json | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])')
kill -KILL "$serving"
for _ in $(seq 200); do
  now=$("$bin" stats --service "$name" --json 2>/dev/null | python3 -c 'import json,sys; print(json.load(sys.stdin)["pid"])' 2>/dev/null || true)
  [ -n "$now" ] && [ "$now" != "$serving" ] && break
  sleep 0.05
done
after=$("$bin" ls --service "$name" --json)
"$bin" attach --socket "$name" --set model --checkpoint "$work/model.safetensors" 2>&1 | tail -1
cat "$work/err"
cat "$work/out"
python3 - "$before" "$after" "$work/err" <<'PY'
import json, re, sys
b, a = json.loads(sys.argv[1])["sets"][0], json.loads(sys.argv[2])["sets"][0]
serves = [float(x) for x in re.findall(r"serves, ([0-9.]+) ms after its start", open(sys.argv[3]).read())]
same = (b["version"], b["bytes"]) == (a["version"], a["bytes"]) and a["restarts"] == 1
print(f"keeper takeover: set {a['name']} version {a['version']} ({a['bytes']/1e9:.2f} GB) "
      f"{'served again' if same else 'NOT the same'} after SIGKILL; the new process served "
      f"{serves[-1]:.1f} ms after its start (the first: {serves[0]:.1f} ms)")
sys.exit(0 if same and len(serves) >= 2 else 1)
PY
