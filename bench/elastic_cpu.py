#!/usr/bin/env python3
"""Elastic EP on CPU rank processes: request latency across a fault, recovery time, survivors' memory.

Starts `fulcrum serve --multi-process --enable-elastic-ep` (--tp 4 --dp 4 --enable-dp-attention --ep 4, the
tiny preset), runs `fulcrum bench serve` (32 streaming clients) once without a fault and once while rank 2
is killed (SIGKILL) as soon as a quarter of the requests have completed, and writes one JSON: both load
reports, the recovery time from /metrics and the log, and each rank process's RSS before and after.

  python3 bench/elastic_cpu.py --bin build-cpu/bin/fulcrum --out bench/results/elastic_cpu.json
"""
import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def metrics(port):
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="build-cpu/bin/fulcrum")
    ap.add_argument("--out", default="bench/results/elastic_cpu.json")
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--kill-rank", type=int, default=2)
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="fulcrum_elastic_bench_")
    model = os.path.join(work, "model")
    subprocess.run([args.bin, "make-model", "--preset", "tiny", "--output", model, "--dtype", "fp32", "--seed", "7"],
                   check=True, capture_output=True)
    log_path = os.path.join(work, "serve.log")
    serve = [args.bin, "serve", "--model", model, "--port", "0", "--tp", "4", "--dp", "4", "--enable-dp-attention",
             "--ep", "4", "--disable-radix-cache", "--max-running-requests", str(args.clients), "--kv-pages", "256",
             "--page-size", "8", "--multi-process", "--enable-elastic-ep", "--elastic-ep-timeout", "2"]
    server = subprocess.Popen(serve, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    port = None
    for _ in range(3000):
        m = re.search(r"listening on http://[^ ]+:(\d+)", open(log_path).read())
        if m:
            port = int(m.group(1))
            break
        time.sleep(0.01)
    assert port, open(log_path).read()
    pids = {int(r): int(p) for r, p in re.findall(r"rank (\d+) \(pid (\d+)\) joined", open(log_path).read())}

    def load(name):
        path = os.path.join(work, name + ".json")
        run = subprocess.run([args.bin, "bench", "serve", "--url", f"http://127.0.0.1:{port}", "--clients",
                              str(args.clients), "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
                              "--json", path], capture_output=True, text=True)
        return json.load(open(path)) if os.path.exists(path) else {"error": run.stderr.strip()}

    rss_before = {r: rss_kib(p) for r, p in sorted(pids.items())}
    fault_free = load("fault_free")
    done_before = metrics(port).get('fulcrum_requests_total{finish_reason="length"}', 0)

    def kill_when_a_quarter_done():
        while metrics(port).get('fulcrum_requests_total{finish_reason="length"}', 0) < done_before + args.requests / 4:
            time.sleep(0.005)
        os.kill(pids[args.kill_rank], signal.SIGKILL)

    killer = threading.Thread(target=kill_when_a_quarter_done)
    killer.start()
    across = load("across_fault")
    killer.join()
    m = metrics(port)
    rss_after = {r: rss_kib(p) for r, p in sorted(pids.items()) if r != args.kill_rank}
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    log = open(log_path).read()
    doc = {
        "what": "serve --multi-process --enable-elastic-ep on CPU rank processes, tiny preset (4 layers, 128 experts "
                "top-8), --tp 4 --dp 4 --enable-dp-attention --ep 4 --disable-radix-cache; fulcrum bench serve "
                f"(--clients {args.clients} --requests {args.requests} --max-tokens {args.max_tokens}) without a fault, "
                f"then with rank {args.kill_rank} killed (SIGKILL) once a quarter of the requests had completed",
        "command": " ".join(serve),
        "git_commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                     cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip(),
        "host_cpus": os.cpu_count(),
        "host_load_average_at_end": os.getloadavg()[0],
        "fault_free": fault_free,
        "across_fault": across,
        "recovery_s": m.get("fulcrum_elastic_recovery_seconds"),
        "recoveries": m.get("fulcrum_elastic_recoveries_total"),
        "reprefilled_requests": m.get("fulcrum_elastic_reprefilled_requests_total"),
        "live_ranks_after": m.get("fulcrum_live_ranks"),
        "rss_kib_before": rss_before,
        "rss_kib_after": rss_after,
        "elastic_log": [l for l in log.splitlines() if "elastic:" in l or " lost: " in l],
        "server_exit": server.returncode,
    }
    shutil.rmtree(work, ignore_errors=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    print(json.dumps({k: doc[k] for k in ("recovery_s", "reprefilled_requests", "live_ranks_after")}),
          "p99 latency fault-free", fault_free.get("latency_s", {}).get("p99"), "across the fault",
          across.get("latency_s", {}).get("p99"), "failed", across.get("failed"))
    return 0 if across.get("failed") == 0 and server.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
