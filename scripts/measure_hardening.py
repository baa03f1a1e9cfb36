#!/usr/bin/env python3
"""Measures the figures of docs/HARDENING.md against the real processes.

Starts `ninfer run MODEL --serve` (the tiny fixture by default), then measures:
  * one and eight parallel 7 MB prompts: refusal latency and the gateway's resident memory
    (before, peak during, after);
  * the other large inputs (tool definitions, a token-id prompt, a stop list, logit_bias, an
    inline document, an image data URL), 7 MB each: one and eight at once, refusal latency,
    the gateway's peak resident memory during each burst, and its resident memory --settle
    seconds after the last; each held to its bounds (one refused within 100 ms, eight at once
    within 50 MB of peak growth, the gateway's RSS --settle seconds later within 10 MB of its
    value when it started), a miss printed as FAIL and the exit status 1;
  * N stalled connections (half mid-header, half silent): /health latency while they are open,
    and how long until the gateway has closed every one of them;
  * with --soak SECONDS: 64 concurrent streams against the engine's 32 sequences for that long:
    each answer complete or a 429 before any body byte, the 429s counted in /metrics, every
    process's resident memory sampled, and the engine's log searched for a worker called hung
    (the streams saturate the CPUs);
  * SIGTERM with idle HTTP/2 clients on the gateway: time until every process is gone, and
    whether a shared-memory segment is left.
Standard library only. Usage:
  cargo build --workspace --bins
  scripts/measure_hardening.py [--ninfer target/release/ninfer] [--model tests/fixtures/qwen3_moe]
                               [--stalled 10000] [--soak 600] [--settle 60]
"""

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# The bounds the large inputs are held to (docs/HARDENING.md).
REFUSAL_LIMIT_S = 0.100
BURST_PEAK_LIMIT_KIB = 50 * 1000 * 1000 // 1024
SETTLED_LIMIT_KIB = 10 * 1000 * 1000 // 1024


def rss_kib(pid, field="VmRSS"):
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def post(port, path, body, timeout=60.0):
    """One HTTP/1.1 request; returns (status, seconds)."""
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as connection:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        connection.sendall(head + body)
        answer = b""
        while b"\r\n" not in answer:
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/") else 0
    return status, time.monotonic() - started


def get_health(port):
    started = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as connection:
        connection.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        answer = connection.recv(4096)
    return int(answer.split(b" ", 2)[1]), time.monotonic() - started


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def pid_of(runtime_dir, label):
    with open(os.path.join(runtime_dir, f"{label}.pid")) as pid_file:
        return int(pid_file.read().strip())


def measure_prompts(port, gateway_pid):
    prompt = "lorem ipsum dolor sit amet " * (7 * 1024 * 1024 // 27)
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": prompt}]}).encode()
    name = served_model_name(port)
    body = body.replace(b'"model": "x"', f'"model": "{name}"'.encode(), 1)
    print(f"prompt body: {len(body) / 1e6:.1f} MB")
    before = rss_kib(gateway_pid)
    status, seconds = post(port, "/v1/chat/completions", body)
    print(f"one 7 MB prompt: HTTP {status} in {seconds * 1000:.0f} ms")
    results = []
    threads = [threading.Thread(target=lambda: results.append(post(port, "/v1/chat/completions", body)))
               for _ in range(8)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    slowest = max(seconds for _, seconds in results)
    print(f"eight in parallel: HTTP {sorted(set(s for s, _ in results))}, all done in "
          f"{(time.monotonic() - started) * 1000:.0f} ms, slowest {slowest * 1000:.0f} ms")
    time.sleep(1)
    peak, after = rss_kib(gateway_pid, "VmHWM"), rss_kib(gateway_pid)
    print(f"gateway RSS: before {before / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB, "
          f"after {after / 1024:.1f} MiB (growth {(after - before) / 1024:.1f} MiB)")


class RssSampler:
    """The largest resident memory of a process from now until `stop`: the kernel's high-water
    mark (VmHWM, reset here through clear_refs where the kernel allows it) and, in case it
    does not, samples every 2 ms in the background."""

    def __init__(self, pid):
        self.pid, self.running = pid, True
        try:
            with open(f"/proc/{pid}/clear_refs", "w") as clear_refs:
                clear_refs.write("5")
            self.high_water_reset = True
        except OSError:
            self.high_water_reset = False
        self.peak = rss_kib(pid)
        self.thread = threading.Thread(target=self.sample, daemon=True)
        self.thread.start()

    def sample(self):
        while self.running:
            self.peak = max(self.peak, rss_kib(self.pid))
            time.sleep(0.002)

    def stop(self):
        self.running = False
        self.thread.join()
        if self.high_water_reset:
            self.peak = max(self.peak, rss_kib(self.pid, "VmHWM"))
        return self.peak


def large_input_bodies(name):
    """Seven-megabyte bodies whose bulk is not prompt text, each over one input limit."""
    size = 7 * 1024 * 1024
    words = "lorem ipsum dolor sit amet " * (size // 27)
    hi = [{"role": "user", "content": "Hi"}]
    tool = {"type": "function", "function": {"name": "f", "description": words,
                                             "parameters": {"type": "object"}}}
    return [
        ("tools", "/v1/chat/completions", {"model": name, "messages": hi, "tools": [tool]}),
        ("token-id prompt", "/v1/completions",
         {"model": name, "max_tokens": 1, "prompt": [i % 90 for i in range(size // 6)]}),
        ("stop list", "/v1/chat/completions",
         {"model": name, "messages": hi, "stop": [f"s{i}" for i in range(size // 10)]}),
        ("logit_bias", "/v1/chat/completions",
         {"model": name, "messages": hi, "logit_bias": {str(i): 1 for i in range(size // 12)}}),
        ("document", "/v1/messages",
         {"model": name, "max_tokens": 8, "messages": [{"role": "user", "content": [
             {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                             "data": "QUJD" * (size // 4)}}]}]}),
        ("image data URL", "/v1/chat/completions",
         {"model": name, "messages": [{"role": "user", "content": [
             {"type": "text", "text": "What is this?"},
             {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "QUJD" * (size // 4)}}]}]}),
    ]


def verdict(holds):
    return "ok" if holds else "FAIL"


def measure_large_inputs(port, gateway_pid, settle_seconds, gateway_start_kib):
    """Each large input refused once, then eight at once; the gateway's RSS before, at its peak
    during each burst, and `settle_seconds` after the last. Returns the bounds missed."""
    name = served_model_name(port)
    start = rss_kib(gateway_pid)
    missed = []
    for label, path, request in large_input_bodies(name):
        body = json.dumps(request).encode()
        del request
        status, seconds = post(port, path, body)
        before = rss_kib(gateway_pid)
        sampler = RssSampler(gateway_pid)
        results = []
        threads = [threading.Thread(target=lambda: results.append(post(port, path, body)))
                   for _ in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        peak = sampler.stop()
        slowest = max(seconds for _, seconds in results)
        statuses = sorted(set(s for s, _ in results) | {status})
        refused = statuses == [400]
        fast = seconds < REFUSAL_LIMIT_S
        small = peak - before < BURST_PEAK_LIMIT_KIB
        for holds, what in ((refused, f"{label}: refused with 400"),
                            (fast, f"{label}: one refused within 100 ms"),
                            (small, f"{label}: eight at once within 50 MB of peak growth")):
            if not holds:
                missed.append(what)
        print(f"7 MB {label} ({len(body) / 1e6:.1f} MB body): HTTP {status} in {seconds * 1000:.0f} ms "
              f"[{verdict(refused and fast)}]; eight at once HTTP {sorted(set(s for s, _ in results))}, "
              f"slowest {slowest * 1000:.0f} ms, gateway RSS peak +{(peak - before) / 1024:.1f} MiB "
              f"[{verdict(small)}]")
    time.sleep(settle_seconds)
    after = rss_kib(gateway_pid)
    settled = after - gateway_start_kib < SETTLED_LIMIT_KIB
    if not settled:
        missed.append(f"gateway RSS within 10 MB of its start {settle_seconds} s after the large inputs")
    print(f"gateway RSS: {gateway_start_kib / 1024:.1f} MiB at its start, {start / 1024:.1f} MiB before "
          f"the large inputs, {after / 1024:.1f} MiB {settle_seconds} s after the last "
          f"({(after - start) / 1024:+.1f} MiB; {(after - gateway_start_kib) / 1024:+.1f} MiB over its start) "
          f"[{verdict(settled)}]")
    return missed


def served_model_name(port):
    models = json.loads(subprocess.run(
        ["curl", "-s", f"http://127.0.0.1:{port}/v1/models"], capture_output=True, text=True
    ).stdout or "{}")
    return (models.get("data") or [{"id": "x"}])[0]["id"]


def measure_stalled(port, count):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    stalled = []
    started = time.monotonic()

    def note_closed():
        now = time.monotonic()
        for entry in stalled:
            if entry[2] is not None:
                continue
            try:
                if entry[0].recv(1) == b"":
                    entry[2] = now
            except BlockingIOError:
                pass
            except OSError:
                entry[2] = now

    worst = 0.0
    statuses = set()
    for index in range(count):
        connection = socket.create_connection(("127.0.0.1", port))
        if index % 2 == 0:
            connection.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
        connection.setblocking(False)
        stalled.append([connection, time.monotonic(), None])
        if index % 250 == 0:
            note_closed()
            status, seconds = get_health(port)
            statuses.add(status)
            worst = max(worst, seconds)
    opened = time.monotonic() - started
    while time.monotonic() - started < opened + 60:
        status, seconds = get_health(port)
        statuses.add(status)
        worst = max(worst, seconds)
        note_closed()
        if all(entry[2] is not None for entry in stalled):
            break
        time.sleep(0.1)
    lifetimes = [entry[2] - entry[1] for entry in stalled if entry[2] is not None]
    print(f"{count} stalled connections (opening them took {opened:.1f} s): {len(lifetimes)} closed by "
          f"the gateway, each within {max(lifetimes, default=0):.1f} s of opening; /health "
          f"{sorted(statuses)} throughout, slowest {worst * 1000:.1f} ms")
    for entry in stalled:
        entry[0].close()


def stream_once(port, name):
    """One streaming chat; returns 'ok', '429' or a description of what went wrong."""
    body = json.dumps({"model": name, "stream": True, "max_tokens": 16,
                       "messages": [{"role": "user", "content": "Tell me a story"}]}).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
        connection.sendall((f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
        answer = b""
        while True:
            chunk = connection.recv(65536)
            if not chunk:
                break
            answer += chunk
    head, _, rest = answer.partition(b"\r\n\r\n")
    status = head.split(b" ", 2)[1] if head.startswith(b"HTTP/") else b"?"
    if status == b"429":
        return "429" if b"retry-after" in head.lower() and b"data:" not in rest else "429 without Retry-After or with a body"
    if status != b"200":
        return f"HTTP {status.decode()}"
    if b'"error"' in rest or b"[DONE]" not in rest:
        return "200 stream ended without [DONE] or with an error"
    return "ok"


def soak(port, pids, seconds, log_dir):
    models = json.loads(subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/v1/models"],
                                       capture_output=True, text=True).stdout or "{}")
    name = (models.get("data") or [{"id": "x"}])[0]["id"]
    outcomes = {}
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client():
        while time.monotonic() < stop_at:
            outcome = stream_once(port, name)
            with lock:
                outcomes[outcome] = outcomes.get(outcome, 0) + 1

    threads = [threading.Thread(target=client) for _ in range(64)]
    for thread in threads:
        thread.start()
    samples = []
    while time.monotonic() < stop_at:
        samples.append((time.monotonic(), {label: rss_kib(pid) for label, pid in pids.items()}))
        time.sleep(10)
    for thread in threads:
        thread.join()
    metrics = subprocess.run(["curl", "-s", f"http://127.0.0.1:{port}/metrics"], capture_output=True, text=True).stdout
    counted_429 = sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
                      if line.startswith("ninfer_gateway_requests_total") and 'status="429"' in line)
    print(f"soak {seconds} s, 64 concurrent streams: {outcomes}; /metrics counts {counted_429} as 429")
    half = [sample for sample in samples if sample[0] >= samples[0][0] + seconds / 2]
    for label in pids:
        values = [sample[1][label] for sample in samples]
        late = [(t, sample[label]) for t, sample in half]
        slope = 0.0
        if len(late) >= 2:
            mean_t = sum(t for t, _ in late) / len(late)
            mean_v = sum(v for _, v in late) / len(late)
            variance = sum((t - mean_t) ** 2 for t, _ in late) or 1.0
            slope = sum((t - mean_t) * (v - mean_v) for t, v in late) / variance
        print(f"  {label}: RSS {values[0] / 1024:.1f} -> {values[-1] / 1024:.1f} MiB "
              f"(max {max(values) / 1024:.1f}); second half slope {slope * 60 / 1024:+.2f} MiB/min")
    hung = 0
    for root, _, files in os.walk(log_dir):
        for file in files:
            if file == "engine.log":
                with open(os.path.join(root, file), errors="replace") as log:
                    hung += sum("hung" in line for line in log)
    print(f"  worker called hung in the engine log: {hung} times")


def idle_http2_client(port):
    """An HTTP/2 (prior knowledge) connection that sends its preface and SETTINGS, then idles."""
    connection = socket.create_connection(("127.0.0.1", port))
    connection.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
    return connection


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ninfer", default=os.path.join(ROOT, "target/release/ninfer"))
    parser.add_argument("--model", default=os.path.join(ROOT, "tests/fixtures/qwen3_moe"))
    parser.add_argument("--stalled", type=int, default=10000)
    parser.add_argument("--soak", type=int, default=0, help="seconds of 64 concurrent streams (0: none)")
    parser.add_argument("--settle", type=int, default=60,
                        help="seconds to wait after the large inputs before reading the gateway's RSS")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(prefix="ninfer-hardening-")
    environment = dict(os.environ, XDG_RUNTIME_DIR=scratch, XDG_STATE_HOME=scratch,
                       XDG_CACHE_HOME=os.path.join(scratch, "cache"))
    port = free_port()
    run = subprocess.Popen(
        [args.ninfer, "run", args.model, "--serve", "--listen", f"127.0.0.1:{port}", "--moe-threads", "1"],
        env=environment, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    for line in run.stdout:
        if line.startswith("ready: "):
            break
    runtime_dir = os.path.join(scratch, f"ninfer-{run.pid}")
    pids = {label: pid_of(runtime_dir, label) for label in ("gateway", "engine", "experts-0")}
    gateway_start_kib = rss_kib(pids["gateway"])
    measure_prompts(port, pids["gateway"])
    missed = measure_large_inputs(port, pids["gateway"], args.settle, gateway_start_kib)
    if args.stalled > 0:
        measure_stalled(port, args.stalled)
    if args.soak > 0:
        soak(port, pids, args.soak, os.path.join(scratch, "ninfer", "logs"))
    idle = [idle_http2_client(port) for _ in range(4)]
    time.sleep(0.2)
    started = time.monotonic()
    run.send_signal(signal.SIGTERM)
    run.wait(timeout=30)
    gone = time.monotonic() - started
    while any(os.path.exists(f"/proc/{pid}") for pid in pids.values()) and time.monotonic() - started < 10:
        time.sleep(0.005)
    everything_gone = time.monotonic() - started
    leaked = [name for name in os.listdir("/dev/shm") if name.startswith(f"ninfer-{pids['engine']}-")]
    print(f"SIGTERM with 4 idle HTTP/2 clients: ninfer exited after {gone * 1000:.0f} ms, every process "
          f"gone after {everything_gone * 1000:.0f} ms, shared-memory segments left: {len(leaked)}")
    for connection in idle:
        connection.close()
    for what in missed:
        print(f"FAIL: {what}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
