# shellcheck shell=bash
# The weight service's steps of the GPU run (`serve --service`, issue 26),
# sourced by scripts/gpu-run.sh (run.sh in a bundle), which defines what
# they use: $cli, $here, $logs, check, ok, bad, log_of, bg_start, bg_stop,
# run_tests, install_wheel, python_script. Steps: service,
# service_containers, service_chaos, service_hostile, service_io, rl_update, engines.

# write_service_checkpoint DIR LOG: a small sharded checkpoint in DIR,
# written with python3 alone (four dtypes, two shards and an index, random
# bytes); its output in LOG.
write_service_checkpoint() {
  python3 - "$1" >"$2" 2>&1 <<'PY'
import json, os, struct, sys
d = sys.argv[1]
def save(path, tensors):
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, dtype, shape, size in tensors:
        data = os.urandom(size)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        blobs.append(data)
        at += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
shards = [
    [("embed.weight", "BF16", [1024, 512], 1024 * 512 * 2), ("norm.weight", "F32", [512], 2048)],
    [("layers.0.q.weight", "F8_E4M3", [777, 512], 777 * 512), ("layers.0.k.weight", "I8", [333, 77], 333 * 77),
     ("lm_head.weight", "F16", [1000, 512], 1000 * 512 * 2)],
]
wm = {}
for i, t in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save(f"{d}/{name}", t)
    wm.update({n[0]: name for n in t})
json.dump({"metadata": {"total_size": 0}, "weight_map": wm}, open(f"{d}/model.safetensors.index.json", "w"))
PY
}

# bg_term: SIGTERM to the command bg_start started, then waits for it;
# returns its exit status.
bg_term() {
  kill -TERM "$bg_pid"
  exec 9>&-
  wait "$bg_pid"
  local rc=$?
  rm -f "$bg_fifo"
  return "$rc"
}

# The weight service (serve --service, issue 26): the GPU tests of
# tests/gpu/service.rs, then the CLI flow on a small checkpoint written with
# python3 alone (four dtypes, two shards and an index): a service with a
# quota that fits one load, `load` (the loading process exits, the set
# stays), `ls`, `stats`, `attach --set --checkpoint` (every byte, mapped
# read-only), a second load over the quota refused, `drop`, a load again,
# then SIGTERM: the service exits 0 and says what it dropped, and `ls`
# then finds no service. Writer sessions first: tests/gpu/service_write.rs
# and examples/python/service_trainer.py (needs torch); then
# examples/python/service_generate.py (needs transformers).
step_service() {
  run_tests "-service" service::
  # Limits: a shutdown during a load, a forced drop held by a reader, the
  # default quota of other uids.
  run_tests "-service-limits" service_limits::
  # Writer sessions: the GPU test, then the Python trainer and reader.
  run_tests "-service-write" service_write::
  if install_wheel; then
    check "service: examples/python/service_trainer.py (versions committed, a reader follows by content)" 0 \
      python3 "$here/examples/python/service_trainer.py" --cli "$cli" --steps 20
    check "service: examples/python/service_generate.py (a fresh process generates from the service's read-only weights)" 0 \
      python3 "$here/examples/python/service_generate.py" --cli "$cli" --tokens 8
    tail -n 1 "$(log_of "service: examples/python/service_generate.py (a fresh process generates from the service's read-only weights)")"
  else
    bad "service: the trainer example: $wheel_error"
  fi
  local dir="$logs/svc-ckpt" sock="$logs/svc.sock"
  rm -rf "$dir" "$sock"
  mkdir -p "$dir"
  if ! write_service_checkpoint "$dir" "$logs/svc-ckpt-write.log"; then
    bad "service: writing the checkpoint with python3 failed: $(tail -n 2 "$logs/svc-ckpt-write.log" | tr '\n' ' ')"
    return
  fi
  # Room for one load of the checkpoint (its bytes and the tensors' alignment), not two.
  # The loads come from the service's own uid, which --quota leaves unlimited: give it one.
  local bytes quota
  bytes=$(cat "$dir"/*.safetensors | wc -c)
  quota=$((bytes * 3 / 2))
  bg_start svc 300 "$cli" serve --service "$sock" --quota-uid "$(id -u)=$quota" --grace 3s
  cat "$logs/svc.json" "$logs/svc.err"
  check "service: load (the loading process exits; the set stays)" 0 "$cli" load --service "$sock" --set model "$dir"
  cat "$(log_of "service: load (the loading process exits; the set stays)")"
  check "service: ls" 0 "$cli" ls --service "$sock"
  grep -q '^model ' "$(log_of "service: ls")" && ok "service: ls lists the set after its loader exited" \
    || bad "service: ls does not list the set: $(tail -n 2 "$(log_of "service: ls")" | tr '\n' ' ')"
  local name="service: attach --set model --checkpoint (every byte, read-only)"
  check "$name" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  grep -q '(read-only)' "$(log_of "$name")" && ok "service: the reader mapped the set read-only" \
    || bad "service: the reader did not say read-only: $(tail -n 1 "$(log_of "$name")")"
  name="service: a second load over the quota is refused (exit 4)"
  check "$name" 4 "$cli" load --service "$sock" --set model2 "$dir"
  grep -q 'quota' "$(log_of "$name")" && ok "service: the refusal names the quota" \
    || bad "service: the over-quota refusal does not name the quota: $(tail -n 1 "$(log_of "$name")")"
  check "service: stats" 0 "$cli" stats --service "$sock"
  cat "$(log_of "service: stats")"
  check "service: drop model" 0 "$cli" drop --service "$sock" model
  check "service: load again after the drop" 0 "$cli" load --service "$sock" --set model "$dir"
  check "service: a second reader reads every byte" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  local saved="$logs/svc-saved"
  rm -rf "$saved" && mkdir -p "$saved"
  check "service: save (the set written as safetensors while served)" 0 "$cli" save --service "$sock" --set model "$saved"
  cat "$(log_of "service: save (the set written as safetensors while served)")"
  check "service: a second save is refused, the file kept (exit 2)" 2 "$cli" save --service "$sock" --set model "$saved"
  bg_term
  local rc=$?
  cat "$logs/svc.err"
  if [ "$rc" -eq 0 ] && grep -q 'dropped set model' "$logs/svc.err"; then
    ok "service: SIGTERM stops it (exit 0), saying what it dropped"
  else
    bad "service: after SIGTERM it exited $rc: $(tail -n 3 "$logs/svc.err" | tr '\n' ' ')"
  fi
  # A new service from what was saved: the same bytes as the checkpoint,
  # at the version saved.
  bg_start svc 300 "$cli" serve --service "$sock" --no-keeper --restore "$saved" --grace 3s
  cat "$logs/svc.json" "$logs/svc.err"
  grep -q '"restored_from_disk":\[{[^]]*"version":2' "$logs/svc.json" \
    && ok "service: --restore serves the saved set at its saved version (2)" \
    || bad "service: --restore did not restore version 2: $(head -c 400 "$logs/svc.json")"
  check "service: the restored set holds every byte of the checkpoint" 0 "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  bg_term || bad "service: the restored service did not stop cleanly"
  run_tests "-service-save" save::
  check "service: ls of a stopped service exits 4 and says how to start one" 4 "$cli" ls --service "$sock"
}


# Containers and another uid (issue 26 item 6; needs root, util-linux
# unshare and setpriv). `unshare` stands in for containers: the socket's
# directory is shared, the PID and IPC namespaces are not (no hostPID, no
# hostIPC). Part 1: the service (root) in the host's namespaces, readers in
# new PID + IPC + mount namespaces (their own /proc, a private /dev/shm) and
# in a new user namespace. Part 2: the service as uid 65534 (setpriv) with
# `--allow-uid 0`, its socket in a directory of that uid; root loads and
# reads through it, also from new namespaces; a client of uid 65533 is
# refused by the service's peer check, with a message naming its uid.
step_service_containers() {
  if [ "$(id -u)" -ne 0 ] || ! unshare --pid --fork --mount-proc true 2>/dev/null; then
    echo "SKIP  service_containers: needs root and unshare --pid (run as root)"
    return
  fi
  if ! command -v setpriv >/dev/null; then
    echo "SKIP  service_containers: setpriv (util-linux) is not on PATH"
    return
  fi
  local root dir sock name
  root=$(mktemp -d /tmp/cuda-ipc-svc-ns.XXXXXX)
  chmod 755 "$root"
  dir="$root/ckpt"
  mkdir -p "$dir"
  if ! write_service_checkpoint "$dir" "$logs/svc-ns-ckpt-write.log"; then
    bad "service_containers: writing the checkpoint with python3 failed: $(tail -n 2 "$logs/svc-ns-ckpt-write.log" | tr '\n' ' ')"
    rm -rf "$root"
    return
  fi
  # Readable by the service of uid 65534 (it opens the files itself).
  chmod -R a+rX "$dir"
  # The command where other uids can run it (the bundle may sit in a
  # directory only root can enter).
  local other_cli="$root/cuda-ipc"
  cp "$cli" "$other_cli"
  chmod 755 "$other_cli"
  local private_shm='mount -t tmpfs tmpfs /dev/shm && exec "$0" "$@"'

  # Part 1: the service in the host's namespaces, as root.
  sock="$root/root.sock"
  bg_start svc-ns 300 "$cli" serve --service "$sock" --grace 3s
  # Expected: exit 0, the set held after the loader exits.
  check "service_containers: load into a service in the host's namespaces" 0 \
    "$cli" load --service "$sock" --set model "$dir"
  # Expected: exit 0, every byte equal to the files: the chunks come over
  # the socket as descriptors, waits go through the fence (events cannot
  # open with a private /dev/shm), the reader sees neither the service's
  # PIDs nor its IPC objects.
  name="service_containers: a reader in new PID + IPC + mount namespaces (private /dev/shm) reads every byte"
  check "$name" 0 unshare --pid --ipc --mount --fork --mount-proc \
    sh -c "$private_shm" "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  grep -q '(read-only)' "$(log_of "$name")" && ok "service_containers: that reader mapped the set read-only" \
    || bad "service_containers: the reader in new namespaces did not say read-only: $(tail -n 1 "$(log_of "$name")")"
  # Expected: exit 0: root in a new user namespace is uid 0 to the
  # service (SO_PEERCRED is translated), so the peer check admits it.
  check "service_containers: a reader in a new user namespace (root mapped) reads every byte" 0 \
    unshare --user --map-root-user "$cli" attach --socket "$sock" --set model --checkpoint "$dir"
  # Expected: exit 0 and the set listed, from a new PID namespace.
  check "service_containers: ls from a new PID namespace" 0 \
    unshare --pid --fork --mount-proc "$cli" ls --service "$sock"
  bg_term
  local rc=$?
  [ "$rc" -eq 0 ] && ok "service_containers: the root service stops on SIGTERM (exit 0)" \
    || bad "service_containers: the root service exited $rc after SIGTERM: $(tail -n 3 "$logs/svc-ns.err" | tr '\n' ' ')"

  # Part 2: the service as uid 65534, admitting root with --allow-uid 0.
  # Its socket directory belongs to 65534 (the service creates the socket
  # there, mode 0600); root reaches it anyway.
  local sockdir="$root/svc-65534"
  mkdir -p "$sockdir"
  chown 65534:65534 "$sockdir"
  chmod 755 "$sockdir"
  sock="$sockdir/svc.sock"
  bg_start svc-other-uid 300 env HOME="$sockdir" setpriv --reuid=65534 --regid=65534 --clear-groups \
    "$other_cli" serve --service "$sock" --allow-uid 0 --grace 3s
  if ! grep -q '"socket"' "$logs/svc-other-uid.json"; then
    bad "service_containers: serve --service as uid 65534 did not start: $(tail -n 3 "$logs/svc-other-uid.err" | tr '\n' ' ')"
    bg_term
    rm -rf "$root"
    return
  fi
  # Expected: exit 4, the client refusing a service of another uid unless
  # told to trust it (--allow-uid 65534), naming that uid.
  name="service_containers: root's client refuses a service of uid 65534 without --allow-uid"
  check "$name" 4 "$cli" ls --service "$sock"
  grep -q 'uid 65534' "$(log_of "$name")" && ok "service_containers: the client's refusal names uid 65534" \
    || bad "service_containers: the client's refusal does not name uid 65534: $(tail -n 2 "$(log_of "$name")" | tr '\n' ' ')"
  # Expected: exit 0: root (allowed by --allow-uid 0) has the service of
  # uid 65534 load root's world-readable files, counted against uid 0.
  check "service_containers: root loads through the service of uid 65534" 0 \
    "$cli" load --service "$sock" --allow-uid 65534 --set model "$dir"
  name="service_containers: stats of the service of uid 65534"
  check "$name" 0 "$cli" stats --service "$sock" --allow-uid 65534 --json
  tr -d ' ' <"$(log_of "$name")" | grep -q '"service_uid":65534' && ok "service_containers: stats says service_uid 65534" \
    || bad "service_containers: stats does not say service_uid 65534: $(tail -n 1 "$(log_of "$name")" | cut -c1-300)"
  # Expected: exit 0, every byte, read-only, in the host's namespaces and
  # from new PID + IPC + mount namespaces.
  check "service_containers: root reads every byte through the service of uid 65534" 0 \
    "$cli" attach --socket "$sock" --allow-uid 65534 --set model --checkpoint "$dir"
  check "service_containers: root in new PID + IPC + mount namespaces reads every byte through it" 0 \
    unshare --pid --ipc --mount --fork --mount-proc \
    sh -c "$private_shm" "$cli" attach --socket "$sock" --allow-uid 65534 --set model --checkpoint "$dir"
  # A uid the service does not allow (65533). The socket is opened to all
  # (0666) so that only the service's peer check stands in the way.
  # Expected: exit 4, the service's refusal naming uid 65533 and the
  # allowed uids.
  chmod 666 "$sock"
  name="service_containers: a client of uid 65533 (not allowed) is refused"
  check "$name" 4 setpriv --reuid=65533 --regid=65533 --clear-groups \
    "$other_cli" ls --service "$sock" --allow-uid 65534
  grep -q 'runs as uid 65533, which is not among the server' "$(log_of "$name")" \
    && ok "service_containers: the refusal names uid 65533 and the allowed uids" \
    || bad "service_containers: the refusal of uid 65533 is not clear: $(tail -n 2 "$(log_of "$name")" | tr '\n' ' ' | cut -c1-300)"
  # Expected: exit 4 too for a reader (attach) of uid 65533; nothing mapped.
  check "service_containers: a reader of uid 65533 is refused" 4 setpriv --reuid=65533 --regid=65533 --clear-groups \
    env HOME=/tmp "$other_cli" attach --socket "$sock" --allow-uid 65534 --set model --checkpoint "$dir"
  # Expected: exit 0: root owns the set it loaded, so it may drop it.
  check "service_containers: root drops its set in the service of uid 65534" 0 \
    "$cli" drop --service "$sock" --allow-uid 65534 model
  bg_term
  rc=$?
  [ "$rc" -eq 0 ] && ok "service_containers: the service of uid 65534 stops on SIGTERM (exit 0)" \
    || bad "service_containers: the service of uid 65534 exited $rc after SIGTERM: $(tail -n 3 "$logs/svc-other-uid.err" | tr '\n' ' ')"
  rm -rf "$root"
}

# The chaos run (issue 26's target): python/tests/gpu_service_chaos.py,
# SERVICE_CHAOS_ROUNDS rounds (default 200) of writers and readers killed
# at random points; readers check every version by content; the service's
# memory and descriptors come back. SERVICE_CHAOS_SEED repeats a run.
step_service_chaos() {
  local seed=()
  [ -n "${SERVICE_CHAOS_SEED:-}" ] && seed=(--seed "$SERVICE_CHAOS_SEED")
  python_script service-chaos "$logs/python-service-chaos.log" '^(seed|round|PASS|FAIL)' \
    python3 "$here/python/tests/gpu_service_chaos.py" --cli "$cli" --rounds "${SERVICE_CHAOS_ROUNDS:-200}" "${seed[@]}"
}

# Another user against the service (root; setpriv): root's ls, stats and
# load keep being answered while uid 65534 flips a link between a file
# only root may read and its own, truncates a file during its load, gives
# a FIFO, /dev/zero, a 99 MB header and a 64 GiB sparse file, then floods
# the service's channel (benches/hostile_peers: shm-freeze, ack-flood);
# root's set keeps every byte; SIGTERM during the flood ends the service
# within 2 s, exit 0 (python/tests/gpu_service_hostile.py).
step_service_hostile() {
  python_script service-hostile "$logs/python-service-hostile.log" '^(PASS|FAIL|      )' \
    python3 "$here/python/tests/gpu_service_hostile.py" --cli "$cli" --hostile "$here/benches/hostile_peers"
}

# Loads and saves at the link (issue 57, items 2 and 3):
# bench/service_io.py writes the 4.37 GB checkpoint, measures the pinned
# copy floors and the anchors (safetensors load_file and save_file,
# PyTorch's pinned loop), then the service's loads (SERVICE_IO_CONFIGS,
# STREAMS:STAGING comma-separated), `cuda-ipc save` to tmpfs and to the
# disk (every tensor compared) and `--restore`; one TARGET line per
# target with its verdict.
step_service_io() {
  if ! install_wheel; then
    bad "service-io: $wheel_error"
    return
  fi
  local configs=()
  [ -n "${SERVICE_IO_CONFIGS:-}" ] && configs=(--configs "$SERVICE_IO_CONFIGS")
  python3 "$here/bench/service_io.py" --cli "$cli" --reps "${SERVICE_IO_REPS:-3}" "${configs[@]}" \
    >"$logs/service-io.json" 2>"$logs/service-io.err"
  local rc=$?
  python3 - "$logs/service-io.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    k = r.get("kind")
    if k == "floor":
        print("FLOOR pinned h2d %.1f GB/s, d2h %.1f GB/s" % (r["h2d_gb_per_s"], r["d2h_gb_per_s"]))
    elif k == "result" and "gb_per_s" in r:
        print("RESULT %s%s%s: best %.2f GB/s of %s" % (r["mode"], " " + r["config"] if "config" in r else "",
              " to " + r["to"] if "to" in r else "", max(r["gb_per_s"]), [round(x, 2) for x in r["gb_per_s"]]))
    elif k == "result":
        print("RESULT %s: %s" % (r["mode"], json.dumps({x: y for x, y in r.items() if x not in ("kind", "mode")})[:400]))
    elif k == "target":
        print("TARGET %s: %.2f against %.2f = %.2fx (want %.2fx) %s" % (
            r["name"], r["measured"], r["anchor"], r["ratio"], r["want"], "MET" if r["met"] else "MISSED"))
    elif k in ("skip", "error"):
        print(k.upper(), r.get("reason") or r.get("message"))
PY
  if [ "$rc" -eq 0 ] && ! grep -q '"verify_failures": [1-9]' "$logs/service-io.json" \
     && grep -q '"kind": "done"' "$logs/service-io.json" && grep -q '"attach_exit": 0' "$logs/service-io.json"; then
    ok "service-io: loads, saves and a restore, every byte checked (the targets' verdicts above)"
  elif grep -q '"kind": "skip"' "$logs/service-io.json"; then
    echo "SKIP  service-io: $(grep -o '"reason": "[^"]*"' "$logs/service-io.json")"
  else
    bad "service-io: exit $rc, $(tail -n 3 "$logs/service-io.err" "$logs/service-io.json" | tr '\n' ' ' | cut -c1-400)"
  fi
}

# RL weight updates on one GPU (issue 58): bench/rl_update.py, a trainer
# and an engine process, the Llama-shaped model (RL_LAYERS decoder layers,
# default 32: about 8 B parameters), every update path in one run
# (RL_STEPS updates each, RL_SOAK in-place updates with resources read
# before and after); one TARGET line per target with its verdict.
step_rl_update() {
  if ! install_wheel; then
    bad "rl-update: $wheel_error"
    return
  fi
  python3 "$here/bench/rl_update.py" --cli "$cli" --layers "${RL_LAYERS:-32}" --steps "${RL_STEPS:-20}" \
    --soak "${RL_SOAK:-1000}" >"$logs/rl-update.json" 2>"$logs/rl-update.err"
  local rc=$?
  python3 - "$logs/rl-update.json" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    k = r.get("kind")
    if k == "anchor":
        print("ANCHOR one device copy of the weights: %.2f ms" % r["device_copy_ms"])
    elif k == "result":
        print("RESULT %s: p50 %.3f ms, p99 %.3f ms, peak device %.1f GB, tokens equal %s" % (
            r["mode"], r["p50_ms"], r["p99_ms"], r["peak_device_bytes"] / 1e9, r["tokens_equal"]))
        if r.get("parts_p50_ms"):
            print("  parts (p50 ms): %s" % ", ".join("%s %.3f" % kv for kv in r["parts_p50_ms"].items()))
    elif k == "soak":
        print("SOAK %d in-place updates: unchanged %s; before %s; after %s" % (
            r["updates"], r["unchanged"], json.dumps(r["before"]), json.dumps(r["after"])))
    elif k == "target":
        print("TARGET %s: %s against %s %s" % (r["name"], r["measured"], r["anchor"], "MET" if r["met"] else "MISSED"))
    elif k in ("skip", "error"):
        print(k.upper(), r.get("reason") or r.get("message"))
PY
  if [ "$rc" -eq 0 ] && grep -q '"kind": "done"' "$logs/rl-update.json" && ! grep -q '"tokens_equal": false' "$logs/rl-update.json"; then
    ok "rl-update: every path updated the engine, tokens equal to the trainer's (the targets' verdicts above)"
  elif grep -q '"kind": "skip"' "$logs/rl-update.json"; then
    echo "SKIP  rl-update: $(grep -o '"reason": "[^"]*"' "$logs/rl-update.json")"
  else
    bad "rl-update: exit $rc, $(tail -n 3 "$logs/rl-update.err" "$logs/rl-update.json" | tr '\n' ' ' | cut -c1-400)"
  fi
}

# An engine ready in one call (issue 58): python/tests/gpu_engines.py, a
# model per architecture family from a service's set with
# cuda_ipc.models.from_service, logits equal to from_pretrained's.
step_engines() {
  python_script engines "$logs/python-engines.log" '^(PASS|FAIL)' \
    python3 "$here/python/tests/gpu_engines.py" --cli "$cli"
}
