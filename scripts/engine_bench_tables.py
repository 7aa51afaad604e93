#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from `fulcrum bench generate --json` and `fulcrum bench serve --json`.

Usage: scripts/engine_bench_tables.py bench/results/generate_h200.json [bench/results/serve_h200.json]
       scripts/engine_bench_tables.py --compare A.json B.json LABEL_A LABEL_B
       scripts/engine_bench_tables.py --prefix-cache PREFIX_CACHE.json ...
       scripts/engine_bench_tables.py --sweep SWEEP.json ...   (the sweep_VAR.json bench/run_gpu_env_sweep.sh writes)
       scripts/engine_bench_tables.py --side-by-side LABEL=RUN.json ...   (runs of one call; ratios to the first)
       scripts/engine_bench_tables.py --dense-fp8 bench/results/dense_fp8_gemm_h200.json
Every figure printed is read from the JSON; nothing is computed but ratios and unit changes.
"""
import json
import sys


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def generate(doc):
    runs = doc["runs"]
    print(f"Run: `{doc['command']}` at commit {doc['git_commit']} on {doc['gpu']}; measured in the same run: "
          f"{doc['copy_bandwidth_gbs']:.0f} GB/s device copy, {doc['gemm_tflops']:.0f} TFLOP/s bf16 GEMM; "
          f"{doc['layers']} layers.\n")
    print("#### Decode (ms per step; roofline = bytes the step must read / measured copy bandwidth)\n")
    # Runs since e0e0a04 also hold the step's time on the device (CUDA events); the rest is host work between steps.
    device = any("device_span_ms" in r for r in runs if r["phase"] == "decode")
    extra = ["device ms (forward)", "host share"] if device else []
    print(row(["batch", "context", "ms/step", "tok/s", "roofline ms", "of roofline", "HF transformers ms", "vs HF"] + extra))
    print(row(["---:"] * (8 + len(extra))))
    for r in runs:
        if r["phase"] != "decode":
            continue
        peer = r.get("peer_ms_per_step")
        cells = [r["batch"], r["context"], f"{r['ms_per_step']:.3f}", f"{r['tokens_per_s']:.0f}", f"{r['roofline_ms']:.3f}",
                 f"{100 * r['roofline_ms'] / r['ms_per_step']:.1f}%", f"{peer:.1f}" if peer else "",
                 f"{peer / r['ms_per_step']:.1f}x" if peer else ""]
        if device:
            span = r.get("device_span_ms")
            cells += [f"{span:.3f} ({r['device_forward_ms']:.3f})" if span is not None else "",
                      f"{100 * (1 - span / r['ms_per_step']):.1f}%" if span is not None else ""]
        print(row(cells))
    if not any(r["phase"] == "prefill" for r in runs):  # a decode-only run (--prefill none)
        print()
        return
    print("\n#### Prefill (one step; roofline = FLOPs / measured bf16 GEMM rate)\n")
    print(row(["sequences x tokens", "ms", "tok/s", "roofline ms", "of roofline"]))
    print(row(["---:"] * 5))
    for r in runs:
        if r["phase"] == "prefill":
            print(row([f"{r['batch']} x {r['context']}", f"{r['ms_per_step']:.1f}", f"{r['tokens_per_s']:.0f}",
                       f"{r['roofline_ms']:.1f}", f"{100 * r['roofline_ms'] / r['ms_per_step']:.1f}%"]))
    print()


def serve(doc):
    print(f"### `bench serve` against `serve --device cuda`\n\nRun: `{doc['command']}`, {doc['clients']} clients, "
          f"prompts {doc['prompt_len']} tokens, {doc['max_tokens']} output tokens.\n")
    print(row(["requests ok / failed", "output tok/s", "TTFT p50 / p90 / p99 ms", "ITL (TPOT) p50 / p90 / p99 ms"]))
    print(row(["---:"] * 4))
    t, i = doc["ttft_s"], doc["itl_s"]
    print(row([f"{doc['succeeded']} / {doc['failed']}", f"{doc['output_tokens_per_s']:.1f}",
               f"{1e3 * t['p50']:.1f} / {1e3 * t['p90']:.1f} / {1e3 * t['p99']:.1f}",
               f"{1e3 * i['p50']:.2f} / {1e3 * i['p90']:.2f} / {1e3 * i['p99']:.2f}"]))
    print()


def decode_ms(doc):
    return {(r["batch"], r["context"]): r["ms_per_step"] for r in doc["runs"] if r["phase"] == "decode"}


def compare(doc_a, doc_b, label_a, label_b):
    """Decode ms/step of two runs side by side (same call on the device), and their ratio."""
    a, b = decode_ms(doc_a), decode_ms(doc_b)
    print(f"Runs: `{doc_a['command']}` and `{doc_b['command']}` (commit {doc_a['git_commit']}).\n")
    print(row(["batch", "context", f"{label_a} ms/step", f"{label_b} ms/step", f"{label_a} / {label_b}"]))
    print(row(["---:"] * 5))
    for key in sorted(a):
        if key in b:
            print(row([key[0], key[1], f"{a[key]:.3f}", f"{b[key]:.3f}", f"{a[key] / b[key]:.2f}"]))
    print()


def prefix_cache(doc):
    """scripts/prefix_cache_bench.sh's JSON: the shared-prefix pattern with and without the prefix cache."""
    on, off = doc["with_cache"], doc["without_cache"]
    print(f"Run: `{doc['script']}`, engine {doc['engine']}, commit {doc['git_commit']}, {doc['machine']}; "
          f"{on['clients']} clients, {on['succeeded']} requests, {on['shared_prefix']} shared + {on['prompt_len']} "
          f"prompt tokens, {on['max_tokens']} output tokens.\n")
    print(row(["", "TTFT p50 / p90 ms", "requests/s", "output tok/s", "prompt tokens from the cache"]))
    print(row(["---"] + ["---:"] * 4))
    for name, r in (("with the cache", on), ("--disable-radix-cache", off)):
        t = r["ttft_s"]
        print(row([name, f"{1e3 * t['p50']:.1f} / {1e3 * t['p90']:.1f}", f"{r['requests_per_s']:.2f}",
                   f"{r['output_tokens_per_s']:.1f}", f"{r['server_prefix_cache_hit_tokens']} of {r['server_prompt_tokens']}"]))
    print(f"\nTTFT p50 {doc['ttft_p50_ratio']:.1f}x lower with the cache; prompt tokens computed with it "
          f"{doc['prompt_tokens_computed_with_cache']} against {doc['unshared_prompt_tokens']} unshared "
          f"({doc['prompt_tokens_computed_with_cache'] / doc['unshared_prompt_tokens']:.2f}x).\n")


def sweep(doc):
    """A tuning sweep: {"what", "command" or "commands", "runs_by_value" or "runs": {label: bench generate JSON}}.
    Columns are batches, or (batch, context) pairs when the runs cover several contexts."""
    by_label = doc.get("runs_by_value") or doc["runs"]
    decode = [r for d in by_label.values() for r in d["runs"] if r["phase"] == "decode"]
    several = len({r["context"] for r in decode}) > 1
    key = (lambda r: (r["batch"], r["context"])) if several else (lambda r: r["batch"])
    columns = sorted({key(r) for r in decode}, key=lambda k: (k[1], k[0]) if several else k)
    commands = doc.get("commands") or [doc["command"]]
    print(f"{doc['what']}\n\nRun: " + "; ".join(f"`{c}`" for c in commands) + "\n")
    print(row(["setting"] + [(f"batch {c[0]} context {c[1]}" if several else f"batch {c}") + " ms/step (of roofline)"
                             for c in columns]))
    print(row(["---"] + ["---:"] * len(columns)))
    for label, d in by_label.items():
        cells = {key(r): r for r in d["runs"] if r["phase"] == "decode"}
        print(row([label] + [f"{cells[c]['ms_per_step']:.3f} ({100 * cells[c]['roofline_ms'] / cells[c]['ms_per_step']:.1f}%)"
                             if c in cells else "" for c in columns]))
    print()


def side_by_side(labelled):
    """ms of every decode and prefill run in several `bench generate` files of one call, and the first / each."""
    docs = [(label, json.load(open(path))) for label, path in labelled]
    for label, doc in docs:
        print(f"- {label}: `{doc['command']}` (commit {doc['git_commit']})")
    print()
    labels = [label for label, _ in docs]
    print(row(["phase", "batch", "context"] + [f"{l} ms" for l in labels] + [f"{labels[0]} / {l}" for l in labels[1:]]))
    print(row(["---"] + ["---:"] * (2 + 2 * len(labels) - 1)))
    keyed = [{(r["phase"], r["batch"], r["context"]): r["ms_per_step"] for r in doc["runs"]} for _, doc in docs]
    for key in keyed[0]:
        ms = [k.get(key) for k in keyed]
        print(row(list(key) + [f"{m:.3f}" if m else "" for m in ms] + [f"{ms[0] / m:.3f}x" if m else "" for m in ms[1:]]))
    print()


def dense_fp8(doc):
    print(f"Run: `{doc['command']}` at commit {doc['git_commit']} on {doc['machine']['gpu']}. {doc['what']}.\n")
    print(row(["projection", "n x k", "rows", "FP8 skinny us", "FP8 quantized (CUTLASS) us", "bf16 (engine's GEMM) us",
               "best FP8 / bf16"]))
    print(row(["---"] + ["---:"] * 6))
    for r in doc["rows"]:
        best = min(r["fp8_skinny_us"], r["fp8_quantized_cutlass_us"])
        print(row([r["shape"], f"{r['n']} x {r['k']}", r["m"], f"{r['fp8_skinny_us']:.2f}", f"{r['fp8_quantized_cutlass_us']:.2f}",
                   f"{r['bf16_engine_gemm_us']:.2f}", f"{best / r['bf16_engine_gemm_us']:.2f}"]))
    print()


args = sys.argv[1:]
if args and args[0] == "--sweep":
    for path in args[1:]:
        sweep(json.load(open(path)))
    args = []
elif args and args[0] == "--compare":
    compare(json.load(open(args[1])), json.load(open(args[2])), args[3], args[4])
    args = []
elif args and args[0] == "--side-by-side":
    side_by_side([a.split("=", 1) for a in args[1:]])
    args = []
elif args and args[0] == "--dense-fp8":
    for path in args[1:]:
        dense_fp8(json.load(open(path)))
    args = []
elif args and args[0] == "--prefix-cache":
    for path in args[1:]:
        prefix_cache(json.load(open(path)))
    args = []
for path in args:
    doc = json.load(open(path))
    (generate if "runs" in doc else serve)(doc)
