#!/usr/bin/env bash
# Builds everything the GPU checks need into one folder that runs on a GPU
# host with no Rust toolchain:
#
#   scripts/gpu-bundle.sh [FOLDER]        (default: gpu-bundle, git-ignored)
#   ... copy FOLDER to the GPU host ...
#   FOLDER/run.sh [STEP ...]              (default: every step)
#
# The folder holds the release CLI, the release GPU test executables, the
# examples, the Python wheel (wheels/) and its GPU script, the benchmark scripts and
# run.sh (with gpu-run-service.sh, which it sources), which runs them all and prints a summary. Binaries are built here
# (glibc 2.36) and run on newer hosts (the H200 machine has glibc 2.39).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-$root/gpu-bundle}
case $out in /*) ;; *) out=$PWD/$out ;; esac
cd "$root"
target=${CARGO_TARGET_DIR:-$root/target}

echo "building release binaries..." >&2
cargo build --release --locked --bin cuda-ipc --examples >&2
# artifacts KIND PREFIX: "NAME EXECUTABLE" for each executable of target
# kind KIND whose name starts with PREFIX, from cargo's JSON messages on
# standard input.
artifacts() {
  python3 -c '
import json, sys
kind, prefix = sys.argv[1:3]
for line in sys.stdin:
    try:
        m = json.loads(line)
    except ValueError:
        continue
    t = m.get("target") or {}
    if m.get("reason") == "compiler-artifact" and m.get("executable") \
            and t.get("kind") == [kind] and t["name"].startswith(prefix):
        print(t["name"] + " " + m["executable"])
' "$1" "$2"
}
# The test executables.
mapfile -t tests < <(cargo test --release --locked --no-run --message-format=json 2>/dev/null | artifacts test gpu)
# The attack harness (a bench without a harness of its own).
hostile=$(cargo bench --locked --no-run -p cuda-ipc-channel --bench hostile_peers --message-format=json 2>/dev/null |
  artifacts bench hostile_peers | cut -d' ' -f2-)
if [ ${#tests[@]} -eq 0 ]; then
  echo "no GPU test executables were built" >&2
  exit 1
fi

rm -rf "$out"
mkdir -p "$out/tests" "$out/examples" "$out/benches"
cp "$target/release/cuda-ipc" "$out/"
[ -n "$hostile" ] && cp "$hostile" "$out/benches/hostile_peers"
for t in "${tests[@]}"; do
  name=${t%% *}
  cp "${t#* }" "$out/tests/$name"
done
for ex in "$target"/release/examples/*; do
  # Not the copies cargo names with a hash (NAME-0123456789abcdef).
  case $(basename "$ex") in *.d | *-[0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]) continue ;; esac
  [ -x "$ex" ] && [ -f "$ex" ] && cp "$ex" "$out/examples/"
done
cp -r python "$out/python"
rm -rf "$out/python/tests/__pycache__" "$out/python/cuda_ipc/__pycache__" "$out/python/cuda_ipc"/_core*.so
# The Python package as an abi3 wheel (Python 3.10+, manylinux tag of this
# machine's glibc or lower): the GPU host installs it without Rust or network.
echo "building the Python wheel..." >&2
maturin=$(command -v maturin || true)
if [ -z "$maturin" ]; then
  venv=$target/maturin-venv
  [ -x "$venv/bin/maturin" ] || { python3 -m venv "$venv" && "$venv/bin/pip" install -q 'maturin>=1.5,<2'; } >&2
  maturin=$venv/bin/maturin
fi
mkdir -p "$out/wheels"
(cd python && "$maturin" build --release --locked -i python3 -o "$out/wheels") >&2
[ -d bench ] && cp -r bench "$out/bench"
# The Python examples (the interop script runs weight_sync.py from here).
mkdir -p "$out/examples/python"
cp examples/python/*.py "$out/examples/python/"
cp scripts/gpu-run.sh "$out/run.sh"
cp scripts/gpu-run-service.sh "$out/gpu-run-service.sh"
chmod +x "$out/run.sh"
strip --strip-debug "$out/cuda-ipc" "$out"/tests/* "$out"/examples/* "$out"/benches/* 2>/dev/null || true
du -sh "$out" >&2
echo "bundle ready: $out (run $out/run.sh on a GPU host)" >&2
