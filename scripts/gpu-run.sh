#!/usr/bin/env bash
# Runs the GPU checks of a bundle made by scripts/gpu-bundle.sh, on a GPU host
# with no Rust toolchain. Usage:
#
#   run.sh [STEP ...]      steps: info tests soak demo cli exchange samples python lifetimes sleep peer bench bench-full parts containers sets checkpoint load service service_containers service_chaos service_hostile service_model service_io rl_update engines stress mps hostile
#                          (default: info tests soak demo cli exchange samples python lifetimes sleep)
#
# `tests` runs every GPU test but the 100,000-cycle soaks, which `soak` runs
# (they take a minute or two). `sets` hands off weight sets through the CLI;
# `checkpoint` serves a safetensors checkpoint written there with python3 +
# safetensors + torch and checks every byte from another process;
# `service` runs the weight service (`serve --service`): its GPU tests and
# the CLI flow (load, ls, stats, attach, quota, drop, SIGTERM);
# `service_containers` (root) reads a service's sets from new PID, IPC,
# mount and user namespaces and through a service of another uid
# (`--allow-uid`); `service_chaos` kills writers and readers of a service
# at random points (SERVICE_CHAOS_ROUNDS, default 200; the service steps
# are in gpu-run-service.sh, sourced from next to this script);
# `stress` kills 200 subscribers (CHAOS_ROUNDS) and runs the exchange soak for
# 1,000,000 cycles (SOAK_CYCLES), about ten minutes. PYTHON_ONLY=WORD runs only the Python interop
# cases whose name contains WORD. `peer` and the benches use two GPUs
# (`--devices 0,1`) where there are two.
#
# Each step prints PASS or FAIL with a one-line reason; full logs go to
# $LOGS (default: ./logs), and, when $OUT is set, into $OUT/logs.tgz. The last line is the summary:
# "N passed, M failed" over the GPU tests and the other checks.
set -uo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cli=$here/cuda-ipc
logs=${LOGS:-$here/logs}
mkdir -p "$logs"
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(info tests soak demo cli exchange samples python lifetimes sleep)
passed=0
failed=0
failures=()

ok() { passed=$((passed + 1)); echo "PASS  $*"; }
bad() { failed=$((failed + 1)); failures+=("$*"); echo "FAIL  $*"; }

# log_of NAME: the log file of check NAME.
log_of() { printf "%s/%s.log" "$logs" "$(printf "%s" "$1" | tr -c 'A-Za-z0-9._-' '_')"; }

# check NAME EXPECTED_EXIT COMMAND...: runs COMMAND, logs it, compares the exit code.
check() {
  local name=$1 want=$2
  shift 2
  local log
  log=$(log_of "$name")
  "$@" >"$log" 2>&1
  local got=$?
  if [ "$got" -eq "$want" ]; then
    ok "$name"
  else
    bad "$name (exit $got, expected $want; see $(basename "$log")): $(tail -n 2 "$log" | tr '\n' ' ' | cut -c1-300)"
  fi
}

# bg_start TAG TRIES COMMAND...: runs COMMAND (an export or a serve) in the
# background, its standard input a fifo held open here until bg_stop, its
# standard output in $logs/TAG.json and its standard error in $logs/TAG.err;
# waits up to TRIES tenths of a second for its first line. One at a time.
bg_tag= bg_fifo= bg_pid=
bg_start() {
  bg_tag=$1
  local tries=$2
  shift 2
  bg_fifo="$logs/stdin-$bg_tag"
  rm -f "$bg_fifo"
  mkfifo "$bg_fifo"
  "$@" <"$bg_fifo" >"$logs/$bg_tag.json" 2>"$logs/$bg_tag.err" &
  bg_pid=$!
  exec 9>"$bg_fifo"
  for _ in $(seq "$tries"); do [ -s "$logs/$bg_tag.json" ] && break; sleep 0.1; done
}

# bg_stop [PASS_NAME FAIL_WHAT]: ends the command's standard input and waits
# for it; with names, PASS_NAME when it exited 0, else FAIL "FAIL_WHAT
# exited N: its standard error".
bg_stop() {
  exec 9>&-
  wait "$bg_pid"
  local rc=$?
  rm -f "$bg_fifo"
  [ $# -eq 0 ] && return 0
  [ "$rc" -eq 0 ] && ok "$1" || bad "$2 exited $rc: $(cat "$logs/$bg_tag.err")"
}

step_info() {
  check "info" 0 "$cli" info
  "$cli" info --json >"$logs/info.json" 2>&1
  cat "$logs/info.log" 2>/dev/null
  # Its probe child alone may take our file descriptors (PR_SET_PTRACER pid).
  check "info: the probe child opens the vmm and pool exports" 0 python3 -c '
import json, sys
probes = json.load(open(sys.argv[1]))["devices"][0]["probes"]
bad = {m: probes.get(m) for m in ("vmm", "pool") if not (probes.get(m) or {}).get("works")}
sys.exit("not working: %s" % bad if bad else 0)' "$logs/info.json"
  check "info without a driver exits 3" 3 env CUDA_IPC_DISABLE_DRIVER=1 "$cli" info
}

step_tests() { run_tests "" --skip soak_a_hundred_thousand_cycles; }
step_soak() { run_tests "-soak" soak_a_hundred_thousand_cycles; }

# run_tests SUFFIX ARGS...: every test executable with ARGS, counted.
run_tests() {
  local suffix=$1
  shift
  for t in "$here"/tests/*; do
    local name log
    name=$(basename "$t")$suffix
    log="$logs/test-$name.log"
    local started=$SECONDS
    "$t" --ignored --test-threads=1 --nocapture "$@" >"$log" 2>&1
    local rc=$?
    local p f
    p=$(grep -Eo '[0-9]+ passed' "$log" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
    f=$(grep -Eo '[0-9]+ failed' "$log" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
    passed=$((passed + p))
    failed=$((failed + f))
    echo "TESTS $name: $p passed, $f failed in $((SECONDS - started)) s (exit $rc)"
    grep -E '^test .* FAILED$|^---- |panicked at' "$log" | head -n 20
    if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
      bad "$name exited $rc without a failed test (crash?)"
      tail -n 5 "$log"
    fi
    [ "$f" -gt 0 ] && failures+=("$name: $f tests")
    grep -E '^(legacy|vmm|pool|fabric|without|consumer|freed|ring|soak|lease|publisher|refused)' "$log" | head -n 40
  done
}

step_demo() {
  check "demo (auto)" 0 "$cli" demo
  cat "$logs/demo__auto_.log" 2>/dev/null
  for m in legacy vmm pool; do
    check "demo --mechanism $m --size 1GiB" 0 "$cli" demo --mechanism "$m" --size 1GiB
  done
  check "demo --mechanism fabric exits 3 here (no IMEX)" 3 "$cli" demo --mechanism fabric --size 2MiB
}

# The export/open contract, per mechanism, at an offset.
step_cli() {
  for m in legacy vmm pool; do
    bg_start "export-$m" 100 "$cli" export --size 3MiB --offset 1MiB --fill-u32 0x12345678 --mechanism "$m"
    local d
    d=$(head -n 1 "$logs/export-$m.json")
    check "cli $m: open --expect-u32 at offset 1MiB" 0 "$cli" open --descriptor "$d" --expect-u32 0x12345678 --fill-u32 0x9
    check "cli $m: the consumer's fill is seen" 0 "$cli" open --descriptor "$d" --expect-u32 9
    check "cli $m: a wrong value exits 1" 1 "$cli" open --descriptor "$d" --expect-u32 0x12345678
    bg_stop "cli $m: export exits 0 at end of stdin" "cli $m: export"
  done
  check "cli: a malformed descriptor exits 2" 2 "$cli" open --descriptor '{"cuda_ipc":1}'
  check "cli: a random legacy handle exits 2" 2 "$cli" open --handle "$(printf 'ab%.0s' $(seq 64))" --size 4096
  check "cli: a bad size exits 2" 2 "$cli" export --size 12XB --fill-u32 1
  check "cli: export without a driver exits 3" 3 env CUDA_IPC_DISABLE_DRIVER=1 "$cli" export --size 4096 --fill-u32 1
  check "cli: open without a driver exits 3" 3 env CUDA_IPC_DISABLE_DRIVER=1 "$cli" open --handle "$(printf 'ab%.0s' $(seq 64))" --size 4096
  check "cli: demo without a driver exits 3" 3 env CUDA_IPC_DISABLE_DRIVER=1 "$cli" demo
}

# serve/attach over the channel, and the streaming demo.
step_exchange() {
  local sock="$logs/serve.sock"
  rm -f "$sock"
  bg_start serve 100 "$cli" serve --socket "$sock" --size 64MiB --fill-u32 0xFEED --buffers 2
  check "exchange: attach --expect-u32, then fill" 0 "$cli" attach --socket "$sock" --buffer buf1 --expect-u32 0xFEED --fill-u32 0xBEEF
  check "exchange: the fill is seen by the next subscriber" 0 "$cli" attach --socket "$sock" --buffer buf1 --expect-u32 0xBEEF
  check "exchange: a wrong value exits 1" 1 "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 1
  check "exchange: an unknown buffer exits 2" 2 "$cli" attach --socket "$sock" --buffer nope
  bg_stop "exchange: serve exits 0 once every lease is released" "exchange: serve"
  for size in 4KiB 1MiB 64MiB; do
    check "demo --stream --frame-size $size" 0 "$cli" demo --stream --frame-size "$size" --seconds 3
    grep -E 'frames/s|latency|OK|FAILED' "$logs/demo_--stream_--frame-size_$size.log"
  done
}

# The consumer in new namespaces (needs root and util-linux unshare): serve
# outside, attach inside a new PID namespace, PID + IPC, and with a private
# /dev/shm (events cannot open there: the exchange uses fences); the demo
# and the fresh and cached bench rows with their consumers in new namespaces
# (--consumer-namespaces); a vmm descriptor opened from a new PID namespace
# says the exporter is not visible.
step_containers() {
  if ! unshare --pid --fork --mount-proc true 2>/dev/null; then
    echo "SKIP  containers: unshare --pid is not allowed here (run as root)"
    return
  fi
  local m value=0
  for m in legacy vmm pool; do
    value=$((value + 0x1000))
    local sock="$logs/ns-$m.sock"
    rm -f "$sock"
    bg_start "ns-serve-$m" 100 "$cli" serve --socket "$sock" --size 64MiB --fill-u32 "$value" --buffers 1 --mechanism "$m"
    check "containers $m: attach in a new PID namespace" 0 \
      unshare --pid --fork --mount-proc "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 "$value" --fill-u32 $((value + 1))
    check "containers $m: attach in a new PID + IPC namespace sees the fill" 0 \
      unshare --pid --ipc --fork --mount-proc "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 $((value + 1)) --fill-u32 $((value + 2))
    check "containers $m: attach with a private /dev/shm (fences) sees the fill" 0 \
      unshare --mount sh -c "mount -t tmpfs tmpfs /dev/shm && exec \"\$0\" \"\$@\"" "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 $((value + 2)) --fill-u32 $((value + 3))
    grep -h "synchronised with" "$logs"/containers_"$m"__attach_with_a_private__dev_shm*.log 2>/dev/null
    check "containers $m: attach --sync fence in a new PID namespace" 0 \
      unshare --pid --fork --mount-proc "$cli" attach --socket "$sock" --buffer buf0 --sync fence --expect-u32 $((value + 3)) --fill-u32 $((value + 4))
    check "containers $m: attach in a new user namespace (root mapped to ours)" 0 \
      unshare --user --map-root-user "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 $((value + 4)) --fill-u32 $((value + 5))
    bg_stop "containers $m: serve exits 0 once every lease is released" "containers $m: serve"
  done
  # A new PID namespace that still sees the parent's /proc: the driver
  # does not start there (cuInit: CUDA_ERROR_OPERATING_SYSTEM on driver
  # 580); the command must say so, name the fix and exit 3.
  check "containers: in a new PID namespace without its own /proc the driver cannot start (exit 3)" 3 \
    unshare --pid --fork "$cli" info
  if grep -q -- "--mount-proc" "$logs"/containers__in_a_new_PID_namespace_without*.log; then
    ok "containers: the message names the fix (--mount-proc)"
  else
    bad "containers: the message does not name --mount-proc: $(tail -n 2 "$logs"/containers__in_a_new_PID_namespace_without*.log | tr '\n' ' ' | cut -c1-300)"
  fi
  # The demo and the bench with their consumers in new namespaces
  # (--consumer-namespaces: each consumer through unshare, the buffer over
  # the channel).
  local name
  for m in legacy vmm pool; do
    name="containers $m: demo --consumer-namespaces pid,ipc"
    check "$name" 0 "$cli" demo --mechanism "$m" --consumer-namespaces pid,ipc
    grep -h -E "own namespaces|^OK|^FAILED" "$(log_of "$name")"
  done
  name="containers: demo --consumer-namespaces shm (a private /dev/shm)"
  check "$name" 0 "$cli" demo --consumer-namespaces shm
  if grep -q "synchronised with the publisher's fence" "$(log_of "$name")"; then
    ok "containers: demo with a private /dev/shm synchronises with fences"
  else
    bad "containers: demo with a private /dev/shm did not use fences: $(grep -h "synchronised with" "$(log_of "$name")" | cut -c1-300)"
  fi
  name="containers: bench --quick --only fresh,cached --consumer-namespaces pid,ipc"
  check "$name" 0 "$cli" bench --quick --only fresh,cached --consumer-namespaces pid,ipc --no-torch --json-out "$logs/bench-ns.json"
  grep -h "consumers in new namespaces" "$(log_of "$name")"
  sed -n '/Fresh hand-off/,/^Targets/p' "$(log_of "$name")"
  if tr -d ' \n' <"$logs/bench-ns.json" 2>/dev/null | grep -q '"consumer_namespaces":\["pid","ipc"\]'; then
    ok "containers: bench-ns.json names the consumers' namespaces"
  else
    bad "containers: bench-ns.json does not say \"consumer_namespaces\": [\"pid\", \"ipc\"]"
  fi
  bg_start ns-export 100 "$cli" export --size 2MiB --fill-u32 0x77 --mechanism vmm
  local d
  d=$(head -n 1 "$logs/ns-export.json")
  check "containers: open --descriptor of a vmm export in a new PID namespace exits 3" 3 \
    unshare --pid --fork --mount-proc "$cli" open --descriptor "$d" --expect-u32 0x77
  if grep -q "not visible from this PID namespace" "$logs/containers__open_--descriptor_of_a_vmm_export_in_a_new_PID_namespace_exits_3.log"; then
    ok "containers: the message says the exporter is not visible from this PID namespace"
  else
    bad "containers: the message does not say the exporter is not visible: $(tail -n 2 "$logs/containers__open_--descriptor_of_a_vmm_export_in_a_new_PID_namespace_exits_3.log" | tr '\n' ' ')"
  fi
  local uuid
  uuid=$(printf '%s' "$d" | grep -o '"device_uuid":"[^"]*"' | cut -d'"' -f4)
  check "containers: open --descriptor with CUDA_VISIBLE_DEVICES=$uuid finds the GPU by UUID" 0 \
    env CUDA_VISIBLE_DEVICES="$uuid" "$cli" open --descriptor "$d" --expect-u32 0x77
  bg_stop
}

# Weight sets through the CLI: 1,000 buffers (4 GiB) in one hand-off, and
# serve --set with two consumers in turn.
step_sets() {
  check "sets: demo --set 1000 --size 4GiB" 0 "$cli" demo --set 1000 --size 4GiB
  grep -E 'set|attached|OK|FAILED' "$logs/sets__demo_--set_1000_--size_4GiB.log" | head -n 12
  local sock="$logs/serve-set.sock"
  rm -f "$sock"
  bg_start serve-set 100 "$cli" serve --socket "$sock" --size 1GiB --set 100
  check "sets: attach --set weights (100 buffers, 1 GiB)" 0 "$cli" attach --socket "$sock" --set weights
  check "sets: a second consumer attaches the same set" 0 "$cli" attach --socket "$sock" --set weights
  check "sets: an unknown set exits 2" 2 "$cli" attach --socket "$sock" --set nope
  grep -hE 'attached|checked|OK' "$logs"/sets__attach_--set_weights*.log | head -n 4
  bg_stop "sets: serve --set exits 0 once every lease is released" "sets: serve --set"
}

# serve --checkpoint: a sharded checkpoint of several dtypes written with
# python3 + safetensors (+ torch), loaded on 2 streams through 1 MiB
# staging buffers and published as one set; attach --set --checkpoint
# compares every byte with the files; a consumer of the wrong checkpoint
# exits 1; a bad path exits 2; served again --read-only, a reader maps it
# read-only and still reads every byte.
step_checkpoint() {
  local dir="$logs/ckpt" sock="$logs/serve-ckpt.sock"
  rm -rf "$dir" "$sock"
  mkdir -p "$dir/other"
  if ! python3 - "$dir" >"$logs/ckpt-write.log" 2>&1 <<'PY'
import json, sys, torch
from safetensors.torch import save_file
d = sys.argv[1]
torch.manual_seed(0)
shards = [
    {"model.embed_tokens.weight": torch.randn(4096, 512).to(torch.bfloat16),
     "model.norm.weight": torch.randn(512), "model.step": torch.tensor(7, dtype=torch.int64)},
    {"layers.0.q.weight": torch.randn(1024, 512).to(torch.float8_e4m3fn),
     "layers.0.k.weight": torch.randint(-128, 127, (333, 77), dtype=torch.int8),
     "layers.0.mask": torch.rand(1001) > 0.5},
    {"lm_head.weight": torch.randn(3000, 512).to(torch.float16)},
]
wm = {}
for i, t in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(t, f"{d}/{name}", metadata={"format": "pt"})
    wm.update({k: name for k in t})
json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, open(f"{d}/model.safetensors.index.json", "w"))
save_file({"model.norm.weight": torch.randn(512)}, f"{d}/other/model.safetensors")
PY
  then
    bad "checkpoint: writing the checkpoint with python3 + safetensors failed: $(tail -n 2 "$logs/ckpt-write.log" | tr '\n' ' ')"
    return
  fi
  bg_start serve-ckpt 300 "$cli" serve --socket "$sock" --checkpoint "$dir" --name model --streams 2 --staging 1MiB
  cat "$logs/serve-ckpt.json" "$logs/serve-ckpt.err"
  check "checkpoint: attach --set model --checkpoint (every byte)" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  check "checkpoint: a second consumer reads the same set" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir/model.safetensors.index.json"
  check "checkpoint: another checkpoint does not match (exit 1)" 1 "$cli" attach --socket "$sock" --set model --checkpoint "$dir/other"
  grep -hE 'attached|mismatch' "$logs"/checkpoint__*.log | head -n 4
  bg_stop "checkpoint: serve --checkpoint exits 0 once every lease is released" "checkpoint: serve --checkpoint"
  check "checkpoint: a missing checkpoint exits 2" 2 "$cli" serve --socket "$logs/none.sock" --checkpoint "$dir/nope.safetensors"
  # serve --read-only: readers map the set read-only; every byte still reads.
  rm -f "$sock"
  bg_start serve-ckpt-ro 300 "$cli" serve --socket "$sock" --checkpoint "$dir" --name model --read-only
  local name="checkpoint: serve --read-only, attach --set --checkpoint reads every byte read-only"
  check "$name" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  grep -q '(read-only)' "$(log_of "$name")" && ok "checkpoint: the reader says it mapped the set read-only" \
    || bad "checkpoint: the reader of a --read-only set did not say read-only: $(tail -n 1 "$(log_of "$name")")"
  bg_stop "checkpoint: serve --checkpoint --read-only exits 0 once every lease is released" "checkpoint: serve --checkpoint --read-only"
}

# Loading a 4.37 GB checkpoint from the page cache (issue 26's loader
# target, 20 GB/s): bench/load_checkpoint.py writes the Qwen2-shaped bf16
# model of first_attach.py as a sharded checkpoint in $LOAD_DIR (default
# /tmp/cuda-ipc-load; not in the logs) and times its anchor,
# safetensors.torch.load_file of every shard onto the device; then `serve
# --checkpoint` loads it with several stream counts and staging sizes, the
# defaults last (each a new process; the JSON line's load_s covers the
# device chunks, the staging buffers and the copies; LOAD_CONFIGS overrides
# the list, STREAMS:STAGING each), and one load with the defaults is read
# back byte for byte by `attach --set --checkpoint`.
step_load() {
  local dir=${LOAD_DIR:-/tmp/cuda-ipc-load} sock="$logs/serve-load.sock"
  rm -rf "$dir" "$sock"
  if ! python3 "$here/bench/load_checkpoint.py" --dir "$dir" --reps 3 >"$logs/load-anchor.json" 2>"$logs/load-anchor.err"; then
    bad "load: writing the checkpoint or the safetensors anchor failed: $(tail -n 2 "$logs/load-anchor.err" "$logs/load-anchor.json" | tr '\n' ' ')"
    return
  fi
  cat "$logs/load-anchor.json"
  if grep -q '"kind": "skip"' "$logs/load-anchor.json"; then
    echo "SKIP  load: $(grep -o '"reason": "[^"]*"' "$logs/load-anchor.json")"
    return
  fi
  local cfg streams staging
  for cfg in ${LOAD_CONFIGS:-4:64MiB 4:8MiB 4:2MiB 8:4MiB 16:2MiB 8:1MiB 8:2MiB}; do
    streams=${cfg%%:*} staging=${cfg#*:}
    check "load: serve --checkpoint, $streams streams, $staging staging" 0 \
      "$cli" serve --socket "$sock" --checkpoint "$dir" --name model --streams "$streams" --staging "$staging" </dev/null
    grep -h '"gb_per_s"' "$(log_of "load: serve --checkpoint, $streams streams, $staging staging")" | tail -n 1
  done
  bg_start serve-load 600 "$cli" serve --socket "$sock" --checkpoint "$dir" --name model
  check "load: attach --set model --checkpoint (every byte of 4.37 GB)" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  grep -hE 'attached|mismatch' "$(log_of "load: attach --set model --checkpoint (every byte of 4.37 GB)")" | head -n 2
  bg_stop "load: serve --checkpoint exits 0 once the lease is released" "load: serve --checkpoint"
  rm -rf "$dir"
}

# A transformers model from the weight service (issue 26's targets):
# bench/service_model.py writes the 4.37 GB Qwen2-shaped checkpoint with
# its config.json, has `serve --service` load it (`cuda-ipc load`), and
# times fresh processes that build the model on the meta device, attach
# read-only, assign and generate (sleep and wake too), 8 readers at once,
# and transformers' from_pretrained as the anchor. SERVICE_MODEL_REPS
# (WARMUP:REPS, default 1:5) and SERVICE_MODEL_DIR (default a temporary
# folder) override.
step_service_model() {
  if ! install_wheel; then
    bad "service-model: $wheel_error"
    return
  fi
  local dir=()
  [ -n "${SERVICE_MODEL_DIR:-}" ] && dir=(--dir "$SERVICE_MODEL_DIR")
  python3 "$here/bench/service_model.py" --cli "$cli" --reps "${SERVICE_MODEL_REPS:-1:5}" "${dir[@]}" \
    >"$logs/service-model.json" 2>"$logs/service-model.err"
  local rc=$?
  grep -E '"kind": "(skip|error|loaded|stopped)"' "$logs/service-model.json" | cut -c1-600
  python3 - "$logs/service-model.json" <<'PY'
import json, sys
med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("kind") != "result":
        continue
    parts = {k: med(v) for k, v in r.get("parts_ms", {}).items()}
    print("RESULT %s: p50 %s ms of %s, max %s, failures %s, parts p50 %s%s" % (
        r["mode"], med(r["samples_ms"]), r["samples_ms"] and len(r["samples_ms"]), max(r["samples_ms"] or [0]),
        r.get("verify_failures"), json.dumps(parts), " single %s ms" % r["single_ms"] if "single_ms" in r else ""))
    if "single_parts_ms" in r:
        print("  alone, parts p50 %s; starts spread over %.2f ms" % (
            json.dumps(r["single_parts_ms"]), r.get("start_spread_ms", -1)))
PY
  if [ "$rc" -eq 0 ] && ! grep -q '"verify_failures": [1-9]' "$logs/service-model.json" \
     && grep -q '"kind": "done"' "$logs/service-model.json"; then
    ok "service-model: a transformers model from the service in fresh processes, every parameter checked"
  elif grep -q '"kind": "skip"' "$logs/service-model.json"; then
    echo "SKIP  service-model: $(grep -o '"reason": "[^"]*"' "$logs/service-model.json")"
  else
    bad "service-model: exit $rc, $(tail -n 3 "$logs/service-model.err" | tr '\n' ' ')"
  fi
}

# Every mechanism under MPS: a private control daemon (its own pipe and log
# folders, as `--mps` makes one; no GPU setting changed) for the demo, the
# exchange and the streaming demo, then legacy IPC between an MPS client and
# a process outside MPS both ways; then `demo --stream --mps` and
# `bench --mps` with their own daemons, and no daemon left behind.
# mps_daemons: the MPS control daemons running, one "PID STAT COMMAND" line
# each; exited ones not yet reaped (STAT Z: a daemon forks away from its
# starter, and a container's PID 1 may never reap it) are not running.
mps_daemons() { ps -eo pid=,stat=,comm= | awk '$2 !~ /^Z/ && $3 == "nvidia-cuda-mps"'; }

step_mps() {
  local control
  control=$(command -v nvidia-cuda-mps-control)
  if [ -z "$control" ]; then
    echo "SKIP  mps: nvidia-cuda-mps-control is not on PATH"
    return
  fi
  local root
  root=$(mktemp -d /tmp/cuda-ipc-mps-run.XXXXXX)
  mkdir -p "$root/pipe" "$root/log"
  local mpsenv=(env CUDA_MPS_PIPE_DIRECTORY="$root/pipe" CUDA_MPS_LOG_DIRECTORY="$root/log")
  local before
  before=$(mps_daemons | wc -l)
  if ! "${mpsenv[@]}" "$control" -d; then
    bad "mps: the private control daemon did not start"
    return
  fi
  for _ in $(seq 100); do [ -S "$root/pipe/control" ] && break; sleep 0.1; done
  check "mps: info under the daemon" 0 "${mpsenv[@]}" "$cli" info --no-probe
  grep -h "MPS" "$(log_of "mps: info under the daemon")"
  if grep -q "go through an MPS server" "$(log_of "mps: info under the daemon")"; then
    ok "mps: the driver says the contexts go through MPS"
  else
    bad "mps: the driver does not say the contexts go through MPS"
  fi
  # A fences-only ring's readers of every sync mode under MPS.
  check "mps: a fences-only ring's readers" 0 "${mpsenv[@]}" "$here/tests/gpu" --ignored --exact containers::a_fences_only_ring_serves_fence_readers_and_refuses_event_readers --test-threads=1
  local m
  for m in legacy vmm pool; do
    check "mps $m: demo --size 64MiB" 0 "${mpsenv[@]}" "$cli" demo --mechanism "$m" --size 64MiB
    local sock="$logs/mps-$m.sock"
    rm -f "$sock"
    bg_start "mps-serve-$m" 100 "${mpsenv[@]}" "$cli" serve --socket "$sock" --size 64MiB --fill-u32 0x4d5053 --buffers 1 --mechanism "$m"
    check "mps $m: attach under MPS" 0 "${mpsenv[@]}" "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 0x4d5053 --fill-u32 0x11
    check "mps $m: attach outside MPS from an MPS publisher" 0 "$cli" attach --socket "$sock" --buffer buf0 --expect-u32 0x11
    bg_stop "mps $m: serve exits 0" "mps $m: serve"
  done
  # Legacy handles between an MPS client and a process outside MPS, the
  # other way round: exported outside, opened under MPS.
  bg_start mps-export 100 "$cli" export --size 2MiB --fill-u32 0x77 --mechanism legacy
  check "mps legacy: open under MPS a handle exported outside" 0 "${mpsenv[@]}" "$cli" open --descriptor "$(head -n 1 "$logs/mps-export.json")" --expect-u32 0x77
  bg_stop
  check "mps: demo --stream --frame-size 4KiB under the daemon" 0 "${mpsenv[@]}" "$cli" demo --stream --frame-size 4KiB --seconds 3
  grep -E 'frames/s|latency|limited|OK|FAILED' "$(log_of "mps: demo --stream --frame-size 4KiB under the daemon")"
  echo quit | "${mpsenv[@]}" "$control"
  for _ in $(seq 100); do [ -S "$root/pipe/control" ] || break; sleep 0.1; done
  rm -rf "$root"
  # The CLI's own private daemons.
  check "mps: demo --stream --mps" 0 "$cli" demo --stream --mps --frame-size 4KiB --seconds 3
  grep -E 'MPS|frames/s|latency|limited|OK|FAILED' "$(log_of "mps: demo --stream --mps")"
  check "mps: bench --quick --only ring,sync --mps" 0 "$cli" bench --quick --only ring,sync --mps --no-torch --json-out "$logs/bench-mps.json"
  sed -n '/^MPS:/p;/Streaming ring/,/^Targets/p' "$(log_of "mps: bench --quick --only ring,sync --mps")"
  sleep 1
  local after
  after=$(mps_daemons | wc -l)
  if [ "$after" -le "$before" ]; then
    ok "mps: no MPS daemon left behind ($after running, $before before)"
  else
    bad "mps: $((after - before)) MPS daemon(s) left behind: $(mps_daemons | tr '\n' ' ')"
  fi
}

# Long runs: subscribers killed at random points, and the million-cycle soak.
step_stress() {
  local gpu=$here/tests/gpu
  check "stress: ${CHAOS_ROUNDS:-200} subscribers killed at random points" 0 \
    env CUDA_IPC_CHAOS_ROUNDS="${CHAOS_ROUNDS:-200}" "$gpu" --ignored --exact chaos::subscribers_killed_at_random_points --test-threads=1 --nocapture
  grep -hE '^(seed|chaos|killed|free|fds|leases)' "$logs"/stress__*subscribers_killed*.log | head -n 8
  check "stress: exchange soak of ${SOAK_CYCLES:-1000000} cycles" 0 \
    env CUDA_IPC_SOAK_CYCLES="${SOAK_CYCLES:-1000000}" "$gpu" --ignored --exact exchange::soak_a_hundred_thousand_cycles --test-threads=1 --nocapture
  grep -hE '^soak' "$logs"/stress__exchange_soak*.log | head -n 8
}

step_samples() {
  if [ -x "$here/examples/producer" ] && [ -x "$here/examples/consumer" ]; then
    check "samples: producer + consumer" 0 "$here/examples/producer" --consumer "$here/examples/consumer"
  else
    echo "SKIP  samples: not in this bundle"
  fi
  # The numbered examples: each runs itself as its second process.
  for ex in 01-share-buffer 02-channel 03-weight-set 04-ring 05-service 06-push; do
    if [ -x "$here/examples/$ex" ]; then
      check "example $ex" 0 "$here/examples/$ex"
    else
      echo "SKIP  example $ex: not in this bundle"
    fi
  done
  # README.md's PyTorch example: the trainer in the background, the reader
  # (100 versions) once the trainer's socket is there.
  if ! python3 -c 'import torch' 2>/dev/null || ! install_wheel; then
    echo "SKIP  example trainer_inference.py: no torch or no wheel"
    return
  fi
  local py=$here/examples/python sock
  sock="${XDG_RUNTIME_DIR:-/nonexistent}/cuda-ipc/demo.sock"
  [ -d "${XDG_RUNTIME_DIR:-/nonexistent}" ] || sock="/tmp/cuda-ipc-$(id -u)/demo.sock"
  rm -f "$sock"
  (cd "$py" && exec python3 trainer_inference.py train) >"$logs/trainer_inference-train.log" 2>&1 &
  local trainer=$!
  for _ in $(seq 600); do [ -S "$sock" ] && break; sleep 0.1; done
  check "example trainer_inference.py: the reader follows 100 versions of the trainer's weights" 0 \
    sh -c "cd '$py' && timeout 120 python3 trainer_inference.py"
  tail -n 2 "$(log_of "example trainer_inference.py: the reader follows 100 versions of the trainer's weights")"
  kill "$trainer" 2>/dev/null
  wait "$trainer" 2>/dev/null
}

# The wheel, installed once into $site for the Python steps and the
# benches' Python rows (bench/cuda_ipc_share.py imports cuda_ipc): exported
# on PYTHONPATH for everything after. Returns 1 with the reason in
# $wheel_error (not to be called in a subshell: the export would be lost).
site=/tmp/cuda_ipc_site
wheel_installed=
wheel_error=
install_wheel() {
  [ -n "$wheel_installed" ] && return 0
  local wheel
  wheel=$(ls "$here"/wheels/cuda_ipc-*.whl 2>/dev/null | head -n 1)
  if [ -z "$wheel" ]; then
    wheel_error="no wheel in $here/wheels (build the bundle with scripts/gpu-bundle.sh)"
    return 1
  fi
  rm -rf "$site"
  if ! python3 -m pip install -q --no-index --no-deps --target "$site" "$wheel" >"$logs/python-install.log" 2>&1; then
    wheel_error="installing $(basename "$wheel") failed: $(tail -n 3 "$logs/python-install.log" | tr '\n' ' ')"
    return 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
  wheel_installed=1
}

# python_script NAME LOG SHOW COMMAND...: runs a Python GPU script that ends
# with "N passed, M failed" (exit 77: skipped, its last line says why), adds
# its counts, shows its lines that match SHOW, and fails when it exits
# non-zero with no failure counted.
python_script() {
  local name=$1 log=$2 show=$3
  shift 3
  if ! python3 -c 'import torch' 2>/dev/null; then
    echo "SKIP  $name: torch is not importable"
    return
  fi
  if ! install_wheel; then
    bad "$name: $wheel_error"
    return
  fi
  "$@" >"$log" 2>&1
  local rc=$?
  if [ "$rc" -eq 77 ]; then
    # The script found no driver, GPU or PyTorch and said so in one line.
    echo "SKIP  $name: $(tail -n 1 "$log")"
    return
  fi
  local p f
  p=$(grep -Eo '^[0-9]+ passed' "$log" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
  f=$(grep -Eo '[0-9]+ failed' "$log" | tail -n 1 | grep -Eo '[0-9]+' || echo 0)
  passed=$((passed + p))
  failed=$((failed + f))
  echo "PYTHON $name: $p passed, $f failed (exit $rc)"
  grep -E "$show" "$log" | head -n 20
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then bad "python $name exited $rc: $(tail -n 3 "$log" | tr '\n' ' ')"; fi
}

step_python() {
  local script=$here/python/tests/gpu_interop.py
  if [ ! -f "$script" ]; then
    echo "SKIP  python: no interop script in this bundle"
    return
  fi
  local only=()
  [ -n "${PYTHON_ONLY:-}" ] && only=(--only "$PYTHON_ONLY")
  python_script interop "$logs/python-interop.log" 'FAIL' python3 "$script" --cli "$cli" "${only[@]}"
}

# The lifetime checks from Python (python/tests/gpu_lifetimes.py): kept
# tensors, closed mappings, DLPack, SIGSTOP, the chaos run.
step_lifetimes() {
  python_script lifetimes "$logs/python-lifetimes.log" '^(PASS|FAIL)' \
    python3 "$here/python/tests/gpu_lifetimes.py" --rounds "${LIFETIME_ROUNDS:-200}"
}

# Sleep and wake from Python (python/tests/gpu_sleep.py): a CUDA graph
# captured over attached tensors replays after a sleep and a wake, at the
# same addresses, reading what the publisher wrote meanwhile.
step_sleep() {
  python_script sleep "$logs/python-sleep.log" '^(PASS|FAIL)|^wake of' \
    python3 "$here/python/tests/gpu_sleep.py" --mib "${SLEEP_MIB:-64}"
}

# The benches' rows from Python need the wheel; without it they are skipped
# (the bench says why).
bench_python() {
  install_wheel || echo "NOTE  the bench's rows from Python will be skipped: $wheel_error"
}

gpus() { nvidia-smi -L 2>/dev/null | grep -c '^GPU'; }

# --devices 0,1 where there are two GPUs (the benches add the peer section).
two_gpus() { [ "$(gpus)" -ge 2 ] && echo "--devices 0,1"; }

# Two GPUs: the peer section alone, and the errors when the second is missing.
step_peer() {
  check "bench --devices 0,1 with one GPU visible exits 3" 3 env CUDA_VISIBLE_DEVICES=0 "$cli" bench --quick --devices 0,1 --no-torch
  grep -h "device 1 is not available" "$logs"/bench_--devices_0_1_with_one_GPU_visible_exits_3.log
  if [ "$(gpus)" -lt 2 ]; then
    echo "SKIP  peer: $(gpus) GPU here; the peer section needs two"
    return
  fi
  grep -h '^peer ' "$logs/info.log" 2>/dev/null
  check "bench --quick --devices 0,1 --only fresh,peer" 0 "$cli" bench --quick --devices 0,1 --only fresh,peer --json-out "$logs/bench-peer.json"
  sed -n '/Across two GPUs/,/^Targets/p' "$logs/bench_--quick_--devices_0_1_--only_fresh_peer.log"
  grep -E 'peer/' "$logs/bench_--quick_--devices_0_1_--only_fresh_peer.log"
}

# What hostile clients cost a channel server (benches/hostile_peers: 17
# attacks of 256 connections, as uid 65534 when root): a legitimate attach
# and ring subscription within 2x their unloaded time, the server's
# threads, descriptors and memory back after each attack.
step_hostile() {
  check "hostile_peers: every attack within its bounds" 0 sh -c \
    "'$here/benches/hostile_peers' | tee '$logs/hostile-peers.txt'; ! grep -q '^OUT OF BOUNDS' '$logs/hostile-peers.txt'"
  cat "$logs/hostile-peers.txt"
}

step_bench() {
  bench_python
  # Bad arguments and unwritable outputs: exit 2 at once, with a driver present.
  check "bench --json-out in a missing folder exits 2" 2 "$cli" bench --quick --json-out "$logs/no-such-folder/x.json"
  check "bench --reps 0 exits 2" 2 "$cli" bench --quick --reps 0
  # shellcheck disable=SC2046 # two words or none
  check "bench --quick" 0 "$cli" bench --quick $(two_gpus) --json-out "$logs/bench-quick.json" --plot "$logs/bench-quick.svg"
  tail -n 60 "$logs/bench_--quick.log"
}

# Where a hand-off's time goes: attach_parts.py at 1,000 and 10,000 tensors
# (the extension's and the library's phases of a Python publish and attach,
# back to back), then the bench's sets section (every row's phases as
# `CALL: PHASE` parts in bench-sets.json).
step_parts() {
  bench_python
  for n in 1000 10000; do
    check "attach_parts.py --count $n" 0 python3 "$here/bench/attach_parts.py" --count "$n" --reps 10 --publish-reps 10
    grep -E '"kind": "(parts|publish|phases)"' "$(log_of "attach_parts.py --count $n")"
  done
  check "bench --quick --only sets" 0 "$cli" bench --quick --only sets --json-out "$logs/bench-sets.json"
  grep -E 'ours|parts|producer' "$(log_of "bench --quick --only sets")" | head -n 30
  [ -n "${OUT:-}" ] && cp "$logs/bench-sets.json" "$OUT/" 2>/dev/null
}

step_bench-full() {
  bench_python
  # BENCH_ARGS: more of the bench's options (e.g. --mps), split on spaces.
  # shellcheck disable=SC2046,SC2086 # two words or none; the options' words
  check "bench" 0 "$cli" bench $(two_gpus) ${BENCH_ARGS:-} --json-out "$logs/bench.json" --plot "$logs/bench.svg"
  tail -n 100 "$logs/bench.log"
  [ -n "${OUT:-}" ] && cp "$logs/bench.json" "$logs/bench.svg" "$OUT/" 2>/dev/null
}

# The weight service's steps (service, service_containers, service_chaos).
# shellcheck source=scripts/gpu-run-service.sh
. "$here/gpu-run-service.sh"

nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/GPU   /'
for s in "${steps[@]}"; do
  if declare -F "step_$s" >/dev/null; then
    echo "== $s"
    "step_$s"
  else
    bad "unknown step $s"
  fi
done
echo "== summary"
for f in "${failures[@]}"; do echo "  failed: $f"; done
[ -n "${OUT:-}" ] && tar czf "$OUT/logs.tgz" -C "$logs" . 2>/dev/null
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
