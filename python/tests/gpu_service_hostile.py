#!/usr/bin/env python3
"""The weight service against another user (uid 65534), on a GPU host, as
root: while the other user attacks, root's ``ls``, ``stats`` and ``load``
keep being answered, the bytes of root's set do not change, and SIGTERM
ends the service within 2 s with exit 0.

The attacks, in two phases:

- files: a symlink flipped between a file only root may read and the
  attacker's own while the attacker asks for raw ``load`` calls of it (the
  service must never load the secret); a file of its own truncated during
  its load (the service must not die of SIGBUS); a FIFO and a link to
  ``/dev/zero`` as a sharded checkpoint's index, a 99 MB header, a 64 GiB
  sparse file (each refused within seconds, the sparse one over the
  default quota of other users);
- the channel (``benches/hostile_peers --attack``): 64 connections that
  do the worst to every descriptor the service gave them (``shm-freeze``)
  and 64 that flood acks (``ack-flood``); SIGTERM comes while they are at
  it.

Usage: ``gpu_service_hostile.py --cli PATH --hostile PATH`` (root; exits 77
with one line when it cannot run here). Ends with "N passed, M failed".
"""

import argparse
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time

OTHER = 65534
# The secret's shape, which a load of it would report.
SECRET_TENSORS = 3
SECRET_SIZE = 3 * 4096

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"PASS  {name}", flush=True)
    else:
        failed += 1
        print(f"FAIL  {name}: {detail}", flush=True)


def save(path, tensors):
    """A safetensors file of `tensors`: (name, size in bytes) of U8."""
    header, at = {}, 0
    for name, size in tensors:
        header[name] = {"dtype": "U8", "shape": [size], "data_offsets": [at, at + size]}
        at += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, size in tensors:
            f.write(os.urandom(size))


def code_of(e):
    return getattr(e, "code", None) or type(e).__name__


# ---------------------------------------------------------------- attacker


def attacker(args):
    """Runs as uid 65534: the file attacks, one JSON line of results."""
    from cuda_ipc import service

    sock, work = args.service, args.work
    # The service runs as root: trust it, as a tenant of a root service does.
    trust = {"allow_uids": (0,)}
    out = {}
    mine = os.path.join(work, "attacker")
    own = os.path.join(mine, "own.safetensors")
    save(own, [("a", 4096)])
    link = os.path.join(mine, "link.safetensors")
    os.symlink(own, link)
    stop = threading.Event()

    def flip():
        # Atomic swaps of the link between the secret and our own file.
        n = 0
        while not stop.is_set():
            tmp = os.path.join(mine, f"tmp{n}")
            os.symlink(args.secret if n % 2 else own, tmp)
            os.replace(tmp, link)
            n += 1

    flipper = threading.Thread(target=flip)
    flipper.start()
    won = loaded = 0
    refused = {}
    for i in range(100):
        try:
            a = service.call(sock, "load", {"set": f"flip{i}", "path": link}, timeout=30, **trust)
            loaded += 1
            if a.get("tensors") == SECRET_TENSORS:
                won += 1
            service.drop(sock, f"flip{i}", **trust)
        except Exception as e:  # noqa: BLE001 - every refusal is counted by its code
            refused[str(code_of(e))] = refused.get(str(code_of(e)), 0) + 1
    stop.set()
    flipper.join()
    out["flip"] = {"won": won, "loaded": loaded, "refused": refused}

    # A file of ours truncated while the service loads it.
    big = os.path.join(mine, "big.safetensors")
    codes = []
    for i in range(3):
        save(big, [(f"t{k}", 64 << 20) for k in range(8)])
        cut = threading.Timer(0.02 * (i + 1), lambda: os.truncate(big, 4096))
        cut.start()
        try:
            service.call(sock, "load", {"set": f"big{i}", "path": big}, timeout=60, **trust)
            codes.append("loaded")
            service.drop(sock, f"big{i}", **trust)
        except Exception as e:  # noqa: BLE001
            codes.append(str(code_of(e)))
        cut.join()
    out["truncate"] = codes

    # Files that are not what they claim.
    bad = {}
    fifo_dir = os.path.join(mine, "fifo")
    os.mkdir(fifo_dir)
    os.mkfifo(os.path.join(fifo_dir, "model.safetensors.index.json"))
    zero_dir = os.path.join(mine, "zero")
    os.mkdir(zero_dir)
    os.symlink("/dev/zero", os.path.join(zero_dir, "model.safetensors.index.json"))
    header = os.path.join(mine, "header.safetensors")
    with open(header, "wb") as f:
        text = b"{" + b" " * (99_000_000 - 2) + b"}"
        f.write(struct.pack("<Q", len(text)) + text)
    sparse = os.path.join(mine, "sparse.safetensors")
    with open(sparse, "wb") as f:
        text = json.dumps({"w": {"dtype": "U8", "shape": [64 << 30],
                                 "data_offsets": [0, 64 << 30]}}).encode()
        text += b" " * (-len(text) % 8)
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + (64 << 30))
    for name, path in [("fifo index", fifo_dir), ("index linked to /dev/zero", zero_dir),
                       ("99 MB header", header), ("64 GiB sparse file", sparse)]:
        t0 = time.monotonic()
        try:
            service.call(sock, "load", {"set": "bad", "path": path}, timeout=30, **trust)
            bad[name] = ["loaded", time.monotonic() - t0]
            service.drop(sock, "bad", **trust)
        except Exception as e:  # noqa: BLE001
            bad[name] = [str(code_of(e)), time.monotonic() - t0]
    out["bad"] = bad
    print(json.dumps(out), flush=True)


# ---------------------------------------------------------------- root


def as_other(cmd, **kw):
    return subprocess.Popen(["setpriv", f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups",
                             *cmd], **kw)


class Prober(threading.Thread):
    """Root's ls, stats and load (with a drop), in turn, until stopped: the
    time each took, or the error."""

    def __init__(self, sock, ckpt):
        super().__init__(daemon=True)
        self.sock, self.ckpt = sock, ckpt
        self.stop = threading.Event()
        self.times = {"ls": [], "stats": [], "load": []}
        self.errors = []

    def run(self):
        from cuda_ipc import service
        n = 0
        while not self.stop.is_set():
            for what, f in [("ls", lambda: service.ls(self.sock)),
                            ("stats", lambda: service.stats(self.sock))]:
                t0 = time.monotonic()
                try:
                    f()
                    self.times[what].append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001
                    self.errors.append(f"{what}: {e}")
            if n % 5 == 0:
                t0 = time.monotonic()
                try:
                    service.load(self.sock, self.ckpt, set="probe", timeout=60)
                    self.times["load"].append(time.monotonic() - t0)
                    service.drop(self.sock, "probe")
                except Exception as e:  # noqa: BLE001
                    self.errors.append(f"load: {e}")
            n += 1
            time.sleep(0.2)

    def finish(self):
        self.stop.set()
        self.join(timeout=120)


def report(phase, prober, base):
    check(f"{phase}: every ls, stats and load of root answered", not prober.errors,
          "; ".join(prober.errors[:5]))
    for what in ("ls", "stats", "load"):
        t = sorted(prober.times[what])
        if not t:
            check(f"{phase}: root's {what} ran", False, "none ran")
            continue
        b = sorted(base[what])[len(base[what]) // 2]
        p50, worst = t[len(t) // 2], t[-1]
        print(f"      {phase}: {what} x{len(t)}: p50 {p50 * 1e3:.2f} ms, max {worst * 1e3:.2f} ms "
              f"(unloaded p50 {b * 1e3:.2f} ms)", flush=True)
        bound = 10.0 if what == "load" else 1.0
        check(f"{phase}: root's {what} within {bound:g} s every time", worst < bound,
              f"max {worst:.3f} s")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cli", required=False)
    p.add_argument("--hostile", help="the hostile_peers bench executable")
    p.add_argument("--role", default="root")
    p.add_argument("--service")
    p.add_argument("--work")
    p.add_argument("--secret")
    args = p.parse_args()
    if args.role == "attacker":
        return attacker(args)
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        print("needs root and setpriv (util-linux) to run the attacker as uid 65534")
        return 77
    if not args.cli or not args.hostile:
        p.error("--cli and --hostile are required")
    import cuda_ipc
    from cuda_ipc import service
    if not cuda_ipc.driver_available():
        print("no CUDA driver here")
        return 77

    work = tempfile.mkdtemp(prefix="cuda-ipc-svc-hostile.")
    os.chmod(work, 0o755)
    # What the attacker runs, where it can read it.
    pkg = os.path.dirname(cuda_ipc.__file__)
    shutil.copytree(pkg, os.path.join(work, "py", "cuda_ipc"))
    shutil.copy(__file__, os.path.join(work, "attack.py"))
    shutil.copy(args.hostile, os.path.join(work, "hostile_peers"))
    subprocess.run(["chmod", "-R", "a+rX", work], check=True)
    mine = os.path.join(work, "attacker")
    os.mkdir(mine)
    os.chown(mine, OTHER, OTHER)
    ckpt = os.path.join(work, "ckpt")
    os.mkdir(ckpt)
    save(os.path.join(ckpt, "model.safetensors"), [(f"w{k}", 1 << 20) for k in range(8)])
    os.chmod(os.path.join(ckpt, "model.safetensors"), 0o644)
    secret = os.path.join(work, "secret.safetensors")
    save(secret, [(f"s{k}", SECRET_SIZE // SECRET_TENSORS) for k in range(SECRET_TENSORS)])
    os.chmod(secret, 0o600)
    sock = os.path.join(work, "svc.sock")
    err = open(os.path.join(work, "service.err"), "w")
    svc = subprocess.Popen([args.cli, "serve", "--service", sock, "--allow-uid", str(OTHER),
                            "--grace", "1s"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                           stderr=err, text=True)
    first = svc.stdout.readline()
    check("the service starts and allows uid 65534", '"socket"' in first, first.strip())
    os.chmod(sock, 0o666)
    env = dict(os.environ, PYTHONPATH=os.path.join(work, "py"), HOME=work)
    try:
        service.load(sock, ckpt, set="base")
        base = {"ls": [], "stats": [], "load": []}
        for i in range(10):
            for what, f in [("ls", lambda: service.ls(sock)), ("stats", lambda: service.stats(sock))]:
                t0 = time.monotonic()
                f()
                base[what].append(time.monotonic() - t0)
            if i % 3 == 0:
                t0 = time.monotonic()
                service.load(sock, ckpt, set="probe")
                base["load"].append(time.monotonic() - t0)
                service.drop(sock, "probe")

        # Phase 1: the files.
        prober = Prober(sock, ckpt)
        prober.start()
        a = as_other([sys.executable, os.path.join(work, "attack.py"), "--role", "attacker",
                      "--service", sock, "--work", work, "--secret", secret],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=work)
        out, errs = a.communicate(timeout=600)
        prober.finish()
        try:
            res = json.loads(out.strip().splitlines()[-1])
        except (ValueError, IndexError):
            res = {}
            check("files: the attacker ran", False, (errs or out)[-500:])
        if res:
            print(f"      files: {json.dumps(res)}", flush=True)
            f = res["flip"]
            check("files: a flipped link never loads a file only root may read",
                  f["won"] == 0, f"{f['won']} of 100 loads read the secret")
            check("files: the flipped link was loaded or refused, 100 calls answered",
                  f["loaded"] + sum(f["refused"].values()) == 100, json.dumps(f))
            check("files: a file truncated during its load is an error or loaded whole, never a crash",
                  all(c in ("loaded", "load_failed", "checkpoint", "io") for c in res["truncate"])
                  and svc.poll() is None, json.dumps(res["truncate"]))
            for name, (c, took) in res["bad"].items():
                want = "over_quota" if "sparse" in name else None
                ok = c != "loaded" and took < 10 and (want is None or c == want)
                check(f"files: a {name} is refused within 10 s{' over the quota' if want else ''}",
                      ok, f"{c} after {took:.1f} s")
        report("files", prober, base)

        # Phase 2: the channel, and SIGTERM during it.
        prober = Prober(sock, ckpt)
        flood = [as_other([os.path.join(work, "hostile_peers"), "--attack", kind, sock],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=work)
                 for kind in ("shm-freeze", "ack-flood")]
        admitted = [f.stdout.readline().strip() for f in flood]
        print(f"      channel: {admitted}", flush=True)
        prober.start()
        time.sleep(10)
        prober.finish()
        report("channel", prober, base)
        r = subprocess.run([args.cli, "attach", "--socket", sock, "--set", "base", "--checkpoint", ckpt],
                           capture_output=True, text=True, timeout=60)
        check("root's set has every byte of its checkpoint after the attacks", r.returncode == 0,
              (r.stderr or r.stdout)[-300:])
        st = service.stats(sock)
        print(f"      stats after: {json.dumps(st)[:400]}", flush=True)
        t0 = time.monotonic()
        svc.send_signal(signal.SIGTERM)
        try:
            rc = svc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        print(f"      SIGTERM: exit {rc} after {took:.3f} s", flush=True)
        check("SIGTERM during the channel attacks ends the service within 2 s, exit 0",
              rc == 0 and took <= 2.0, f"exit {rc} after {took:.2f} s")
        for f in flood:
            f.stdin.close()
            f.wait(timeout=30)
    finally:
        if svc.poll() is None:
            svc.kill()
            svc.wait()
        err.close()
        with open(os.path.join(work, "service.err")) as f:
            print("      service's standard error, last lines:")
            for line in f.read().splitlines()[-8:]:
                print(f"      | {line}")
        shutil.rmtree(work, ignore_errors=True)
    print(f"{passed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
