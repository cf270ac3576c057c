#!/usr/bin/env bash
# Shrinks fuzz/corpus/TARGET to one input per covered edge, keeping the
# named seed-* and regression-* files (cargo fuzz cmin renames every file it
# keeps to its SHA-1; this brings the named ones back and drops their
# hash-named copies). Run from anywhere: fuzz/tools/minimize.sh descriptor
set -euo pipefail
cd "$(dirname "$0")/../.."
t=${1:?usage: fuzz/tools/minimize.sh TARGET}
dir=fuzz/corpus/$t
saved=$(mktemp -d)
trap 'rm -rf "$saved"' EXIT
cp "$dir"/seed-* "$dir"/regression-* "$saved"/ 2>/dev/null || true
cargo fuzz cmin -s none "$t" -- -use_counters=0
for f in "$saved"/*; do
  [ -e "$f" ] || continue
  rm -f "$dir/$(sha1sum "$f" | cut -d' ' -f1)"
  cp "$f" "$dir/"
done
echo "$t: $(ls "$dir" | wc -l) files, $(cat "$dir"/* | wc -c) bytes"
