#!/usr/bin/env bash
# Runs the GPU-only tests (those marked #[ignore = "needs ..."] in the
# gpu, gpu_arena and gpu_fence suites of cuda-ipc and gpu_floor of
# cuda-ipc-bench) against the fake CUDA driver of crates/cuda-ipc-fake-cuda,
# on a machine without a GPU. Their logic, not the GPU: a pass here is no
# substitute for a run on a real device (scripts/gpu-run.sh).
#
#   scripts/fake-gpu-tests.sh [WORD]     only the tests whose name contains WORD
#
# The fake is built in release mode and linked as libcuda.so into a folder of
# its own (target/fake-cuda), which alone goes on LD_LIBRARY_PATH: the tests'
# child processes inherit it. Each test runs in its own process with a time
# limit (FAKE_GPU_TEST_TIMEOUT seconds, default 300), its log in
# target/fake-gpu-logs. The tests listed in crates/cuda-ipc-fake-cuda/skips.txt
# (each with its reason) are skipped. CUDA_IPC_FAKE_DELAY_US and
# CUDA_IPC_FAKE_TRACE are passed on to the fake (see its lib.rs). The soaks
# run 10,000 exchange and 1,000 set hand-offs here instead of 100,000
# (CUDA_IPC_SOAK_CYCLES, CUDA_IPC_SET_SOAK_CYCLES, unless set): the fake's
# kernels and copies run on the host. The last line is the count:
#
#   fake driver: N GPU tests passed, M failed, K skipped (of T)
#
# and the exit status is 1 when any test failed.
set -uo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
target=${CARGO_TARGET_DIR:-$root/target}
case $target in /*) ;; *) target=$root/$target ;; esac
word=${1:-}
limit=${FAKE_GPU_TEST_TIMEOUT:-300}
skips=crates/cuda-ipc-fake-cuda/skips.txt
logs=$target/fake-gpu-logs
lib=$target/fake-cuda

echo "building the fake driver and the GPU test executables..." >&2
cargo build --release --locked --quiet -p cuda-ipc-fake-cuda || exit 1
rm -rf "$lib" "$logs"
mkdir -p "$lib" "$logs"
cp "$target/release/libcuda_ipc_fake_cuda.so" "$lib/libcuda.so"

# "SUITE EXECUTABLE" for each GPU test executable, from cargo's JSON messages
# (the whole workspace's test build, as `cargo test --workspace` makes it, so
# that nothing is built again with other features).
mapfile -t suites < <(
  cargo test --workspace --locked --no-run --message-format=json 2>/dev/null |
    python3 -c '
import json, sys
suites = {"gpu", "gpu_arena", "gpu_fence", "gpu_floor"}
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and t.get("kind") == ["test"] and t.get("name") in suites:
        print(t["name"] + " " + m["executable"])
'
)
if [ ${#suites[@]} -ne 4 ]; then
  echo "expected 4 GPU test executables, cargo built ${#suites[@]}" >&2
  exit 1
fi

# The skip list: "SUITE/TEST REASON" lines; # starts a comment.
declare -A reason=()
while read -r name why; do
  case $name in '' | '#'*) continue ;; esac
  reason[$name]=$why
done <"$skips"

export LD_LIBRARY_PATH="$lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CUDA_IPC_SOAK_CYCLES=${CUDA_IPC_SOAK_CYCLES:-10000}
export CUDA_IPC_SLEEP_CYCLES=${CUDA_IPC_SLEEP_CYCLES:-200}
export CUDA_IPC_SET_SOAK_CYCLES=${CUDA_IPC_SET_SOAK_CYCLES:-1000}
passed=0 failed=0 skipped=0 total=0
failures=()
for s in "${suites[@]}"; do
  suite=${s%% *} exe=${s#* }
  mapfile -t tests < <("$exe" --list --ignored --format terse 2>/dev/null | sed -n 's/: test$//p')
  for t in "${tests[@]}"; do
    [ -n "$word" ] && [[ $t != *"$word"* ]] && continue
    total=$((total + 1))
    if [ -n "${reason[$suite/$t]+x}" ]; then
      skipped=$((skipped + 1))
      echo "SKIP  $suite/$t: ${reason[$suite/$t]}"
      continue
    fi
    log=$logs/$suite.$(printf '%s' "$t" | tr -c 'A-Za-z0-9._-' '_').log
    start=$(date +%s)
    timeout --kill-after=10 "$limit" "$exe" --ignored --exact --test-threads=1 "$t" >"$log" 2>&1
    rc=$?
    took=$(($(date +%s) - start))
    if [ $rc -eq 0 ] && grep -q "^test result: ok. 1 passed" "$log"; then
      passed=$((passed + 1))
      echo "PASS  $suite/$t (${took} s)"
    else
      failed=$((failed + 1))
      failures+=("$suite/$t")
      why=$(grep -m1 -A3 "panicked at\|cuda-ipc fake driver:" "$log" | tr '\n' ' ' | cut -c1-400)
      [ $rc -eq 124 ] && why="no result within $limit s"
      echo "FAIL  $suite/$t (exit $rc, ${took} s; $log): $why"
    fi
  done
done

# The fake's interprocess events live in /dev/shm: remove those whose
# process is gone (a killed child cannot remove its own).
for f in /dev/shm/cuda-ipc-fake.*; do
  [ -e "$f" ] || continue
  pid=${f#/dev/shm/cuda-ipc-fake.}
  pid=${pid%%.*}
  kill -0 "$pid" 2>/dev/null || rm -f "$f"
done

[ ${#failures[@]} -gt 0 ] && printf 'failed: %s\n' "${failures[@]}"
echo "fake driver: $passed GPU tests passed, $failed failed, $skipped skipped (of $total)"
[ "$failed" -eq 0 ]
