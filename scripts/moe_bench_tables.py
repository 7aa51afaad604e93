#!/usr/bin/env python3
"""Markdown tables for docs/benchmarks.md from `fulcrum bench moe --json` files (one GPU or several).

Usage: scripts/moe_bench_tables.py bench/results/moe_layer_h200.json bench/results/moe_ep_h200x2.json
(one-GPU runs with --torch-peer add the PyTorch peer table)
       scripts/moe_bench_tables.py --fp8 bench/results/moe_fp8_sweep_h200.json   (the FP8 tables only)
Every figure printed is read from the JSON; nothing is computed but ratios and unit changes.
"""
import json
import sys


def row(cells):
    return "| " + " | ".join(str(c) for c in cells) + " |"


def header(cells, right_from=2):
    return row(cells) + "\n" + row(["---"] * right_from + ["---:"] * (len(cells) - right_from))


def by(results, model, tokens, scenario, tokens_key):
    for r in results:
        if r["model"] == model and r[tokens_key] == tokens and r["scenario"] == scenario:
            return r
    return None


def single_gpu(doc):
    res = doc["results"]
    keys = sorted({(r["model"], r["tokens"]) for r in res}, key=lambda k: (k[0] != "qwen3-30b-a3b", k[1]))
    scen = ["uniform", "loads_no_eplb", "loads_eplb_static", "loads_eplb_dynamic", "loads_eplb_balanced"]
    print("### Layer time, one GPU (recorder on)\n")
    print(header(["model", "T", "uniform", "loads, no EPLB", "EPLB static", "EPLB dynamic", "EPLB balanced",
                  "EPLB static / uniform"]))
    for m, t in keys:
        rs = [by(res, m, t, s, "tokens") for s in scen]
        cells = [f"{r['layer_ms_recorder_on']:.3f} ms ({r['tokens_per_s'] / 1e6:.2f} M tok/s)" for r in rs]
        print(row([m, t] + cells + [f"{rs[0]['layer_ms_recorder_on'] / rs[2]['layer_ms_recorder_on']:.3f}"]))
    print("\n### Simulated EP %d on one GPU: slowest rank's expert stage\n" % doc["ep_ranks"])
    print(header(["model", "T", "uniform", "loads, no EPLB", "EPLB static", "EPLB dynamic", "EPLB balanced",
                  "EPLB static / uniform", "no EPLB / uniform"]))
    for m, t in keys:
        rs = [by(res, m, t, s, "tokens") for s in scen]
        cells = [f"{r['ep_max_rank_expert_ms']:.3f} ms (tok {r['ep_token_balancedness']:.2f})" for r in rs]
        u = rs[0]["ep_max_rank_expert_ms"]
        print(row([m, t] + cells + [f"{u / rs[2]['ep_max_rank_expert_ms']:.3f}", f"{u / rs[1]['ep_max_rank_expert_ms']:.3f}"]))
    print("\n### Recorder overhead, one GPU (layer time on vs off, interleaved; router kernel on / off)\n")
    print(header(["model", "T", "scenario", "on", "off", "difference", "router kernel on / off"], 3))
    diffs, router = [], []
    for m, t in keys:
        for s in scen:
            r = by(res, m, t, s, "tokens")
            diffs.append(r["recorder_overhead_fraction"])
            router.append(1e3 * (r["router_kernel_ms_recorder_on"] - r["router_kernel_ms_recorder_off"]))
            if s in ("uniform", "loads_eplb_static"):
                print(row([m, t, s, f"{r['layer_ms_recorder_on']:.3f} ms", f"{r['layer_ms_recorder_off']:.3f} ms",
                           f"{100 * r['recorder_overhead_fraction']:+.2f}%",
                           f"{1e3 * r['router_kernel_ms_recorder_on']:.0f} / {1e3 * r['router_kernel_ms_recorder_off']:.0f} us"]))
    print(f"\nAll {len(diffs)} configurations: layer difference {100 * min(diffs):+.2f}% .. {100 * max(diffs):+.2f}%, "
          f"router kernel difference at most {max(router):.1f} us.")
    print("\n### Expert GEMMs, one GPU (auto choice; fraction of the roofline measured in the same run)\n")
    print(header(["model", "T", "scenario", "grouped", "per-slot", "auto", "auto TFLOP/s", "bound", "auto / roofline"], 3))
    for m, t in keys:
        for s in ("uniform", "loads_eplb_static"):
            g = by(res, m, t, s, "tokens")["expert_gemm"]
            print(row([m, t, s, f"{g['grouped']['ms']:.3f} ms", f"{g['per_slot']['ms']:.3f} ms", f"{g['auto']['ms']:.3f} ms",
                       f"{g['auto']['tflops']:.0f}", g["auto"]["bound"], f"{g['auto']['roofline_fraction']:.2f}"]))

    fp8(doc, keys)
    torch_peer(doc, keys)


def fp8(doc, keys):
    """The FP8-expert layer (e4m3 weights, 128x128 scales, 1x128 activation quantization) on the uniform rows."""
    rows = [(m, t, by(doc["results"], m, t, "uniform", "tokens")) for m, t in keys]
    rows = [(m, t, r) for m, t, r in rows if r is not None and "fp8" in r]
    if not rows:
        return
    print("\n### FP8 experts, one GPU (uniform routing; FP8 roofline at 2x the measured bf16 tensor peak)\n")
    print(header(["model", "T", "bf16 layer", "FP8 layer", "layer bf16 / FP8", "bf16 experts (CUTLASS)", "FP8 experts",
                  "experts bf16 / FP8", "FP8 experts TFLOP/s", "FP8 experts / roofline"]))
    for m, t, r in rows:
        f = r["fp8"]
        print(row([m, t, f"{r['layer_ms_recorder_on']:.3f} ms", f"{f['layer_ms_recorder_on']:.3f} ms",
                   f"{f['layer_speedup_over_bf16']:.2f}x", f"{r['expert_gemm']['cutlass']['ms']:.3f} ms",
                   f"{f['experts_ms']:.3f} ms", f"{f['experts_speedup_over_bf16_cutlass']:.2f}x",
                   f"{f['experts_tflops']:.0f}", f"{f['experts_roofline_fraction']:.2f} ({f['experts_bound']})"]))
    rows = [(m, t, r) for m, t, r in rows if "layer_ms_by_permute" in r["fp8"]]
    if not rows:
        return
    print("\n### FP8 layer: quantization fused into the permutation or its own pass; expert stage by CUTLASS config\n")
    print(header(["model", "T", "rows (T x 8)", "layer, fused", "layer, separate", "fused / separate", "experts, pingpong 64x128x128",
                  "experts, cooperative 128x128x128", "cooperative / pingpong", "default config"]))
    for m, t, r in rows:
        f = r["fp8"]
        lp, ec = f["layer_ms_by_permute"], f["experts_ms_by_config"]
        print(row([m, t, 8 * t, f"{lp['fused_quantize']:.3f} ms", f"{lp['separate_quantize']:.3f} ms",
                   f"{lp['fused_quantize'] / lp['separate_quantize']:.3f}", f"{ec['pingpong_64x128x128']:.3f} ms",
                   f"{ec['cooperative_128x128x128']:.3f} ms",
                   f"{ec['cooperative_128x128x128'] / ec['pingpong_64x128x128']:.3f}", f["default_config"]]))


def provenance(doc):
    """The command, commit and GPU, and the FULCRUM_* switches the run was under (JSON "environment", when set)."""
    env = " ".join(f"{k}={v}" for k, v in sorted(doc.get("environment", {}).items()))
    return f"{doc['command']} (commit {doc['git_commit']}, {doc['machine']['gpu']}{', environment ' + env if env else ''})"


def fp8_only(doc):
    keys = sorted({(r["model"], r["tokens"]) for r in doc["results"]}, key=lambda k: (k[0] != "qwen3-30b-a3b", k[1]))
    print(f"<!-- {provenance(doc)} -->")
    fp8(doc, keys)


def torch_peer(doc, keys):
    """`bench moe --torch-peer`: PyTorch's grouped_mm MoE on the uniform rows' routing (ratios from the JSON)."""
    peer = doc.get("torch_peer")
    if not peer:
        return
    if "results" not in peer:
        print(f"\nPyTorch peer: {peer.get('error') or peer.get('off')}")
        return
    print(f"\n### PyTorch peer, one GPU (uniform routing; torch {peer['torch']}, CUDA {peer['cuda']}, {peer['device']})\n")
    print(f"{peer['timing']}. Layer: {peer['layer']}. FP8 rowwise: {peer['fp8_rowwise']}; FP8 blockwise: "
          f"{peer['fp8_blockwise']}. Fulcrum layer = recorder off; Fulcrum experts = CUTLASS.\n")
    print(header(["model", "T", "Fulcrum layer", "torch layer", "layer torch / Fulcrum", "Fulcrum experts", "torch experts",
                  "experts torch / Fulcrum", "torch FP8 rowwise experts (GEMMs only)"]))
    rows = {(p["model"], p["tokens"]): p for p in peer["results"]}
    ms = lambda v: f"{v:.3f} ms" if v is not None else "n/a"
    for m, t in keys:
        r, p = by(doc["results"], m, t, "uniform", "tokens"), rows.get((m, t))
        if p is None or "layer_vs_torch" not in r:
            continue
        print(row([m, t, ms(r["layer_ms_recorder_off"]), ms(p["layer_ms"]), f"{r['layer_vs_torch']:.2f}x",
                   ms(r["expert_gemm"]["cutlass"]["ms"]), ms(p["experts_ms"]), f"{r['experts_vs_torch']:.2f}x",
                   f"{ms(p['fp8_rowwise_experts_ms'])} ({ms(p['fp8_rowwise_gemms_ms'])})"]))


def expert_parallel(doc):
    res = doc["results"]
    keys = sorted({(r["model"], r["tokens_per_rank"]) for r in res}, key=lambda k: (k[0] != "qwen3-30b-a3b", k[1]))
    scen = ["uniform", "loads_no_eplb", "loads_eplb_static", "loads_eplb_dynamic", "loads_eplb_balanced"]
    print("### EP %d step, one process per GPU (slowest rank's median; recorder on)\n" % doc["gpus"])
    print(header(["model", "T / rank", "uniform", "loads, no EPLB", "EPLB static", "EPLB dynamic", "EPLB balanced"]))
    for m, t in keys:
        rs = [by(res, m, t, s, "tokens_per_rank") for s in scen]
        print(row([m, t] + [f"{r['step_ms_recorder_on']:.3f} ms ({r['tokens_per_s'] / 1e6:.2f} M tok/s)" for r in rs]))
    print("\n### EP %d throughput as a fraction of uniform routing's, and the recorder\n" % doc["gpus"])
    print(header(["model", "T / rank", "no EPLB", "EPLB static", "EPLB dynamic", "EPLB balanced",
                  "recorder on vs off (static)", "rank 0 stages, static: route / dispatch / experts / back / combine"]))
    for m, t in keys:
        rs = [by(res, m, t, s, "tokens_per_rank") for s in scen]
        st = rs[2]["rank0_stage_ms"]
        print(row([m, t] + [f"{r['throughput_vs_uniform']:.3f}" for r in rs[1:]] +
                  [f"{100 * rs[2]['recorder_overhead_fraction']:+.2f}%",
                   " / ".join(f"{st[k]:.2f}" for k in ("route_permute", "dispatch", "experts", "combine_exchange", "combine")) + " ms"]))
    print("\n### Live migration during EP %d (one layer, every slot shifted one GPU)\n" % doc["gpus"])
    print(header(["model", "bytes / direction", "raw P2P", "migration (begin -> commit)", "of P2P", "switch",
                  "pass (layers)", "pass, migration in flight", "inflation"], 1))
    for g in doc["migration"]:
        print(row([g["model"], f"{g['busiest_gpu_bytes_per_direction'] / 2**20:.0f} MiB",
                   f"{g['raw_p2p_ms']:.3f} ms ({g['raw_p2p_gb_per_s']:.0f} GB/s)",
                   f"{g['migration_ms']:.3f} ms ({g['migration_gb_per_s']:.0f} GB/s)",
                   f"{100 * g['migration_fraction_of_p2p']:.1f}%", f"{g['switch_ms']:.3f} ms",
                   f"{g['pass_ms_without_migration']:.1f} ms ({g['layers_per_pass']})",
                   f"{g['pass_ms_with_migration']:.1f} ms", f"{100 * g['forward_inflation_fraction']:+.2f}%"]))


if sys.argv[1:2] == ["--fp8"]:
    for path in sys.argv[2:]:
        fp8_only(json.load(open(path)))
    sys.exit(0)
for path in sys.argv[1:]:
    doc = json.load(open(path))
    print(f"<!-- {path}: {provenance(doc)} -->\n")
    (single_gpu if doc["mode"] == "single_gpu" else expert_parallel)(doc)
    print()
