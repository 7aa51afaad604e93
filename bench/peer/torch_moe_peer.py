#!/usr/bin/env python3
"""The PyTorch peer of `fulcrum bench moe`: the Qwen3 MoE layer as a server written in plain PyTorch runs it,
timed on the GPU with the routing the benchmark used.

Per model and token count it times (CUDA events; --warmup untimed runs, then the median of --reps runs timed one
by one, the upper median as the C++ side takes it; the L2 cache is NOT flushed between runs, as on the C++ side):
  experts     torch._grouped_mm gate_up [R, H] x [E, H, 2I] over the rows permuted by expert, SwiGLU
              (F.silu(gate) * up), torch._grouped_mm down [R, I] x [E, I, H]; bf16 weights, random
  layer       from router logits [T, E] (fp32): softmax, top-k, renormalised weights (Qwen3's norm_topk_prob),
              argsort by expert, index_select of the token rows, the experts as above, the weighted rows
              index_add_-ed into a bf16 [T, H] output
  fp8         where this torch build has torch._scaled_grouped_mm: the experts with e4m3 weights and
              activations, rowwise scales (activation quantization in plain torch ops included, and the two
              GEMMs alone); a blockwise 1x128 / 128x128 attempt through F.scaled_grouped_mm. Each records
              "unavailable: <reason>" where the build refuses it.

The routing comes from the benchmark (--routing FILE, written by `fulcrum bench moe`):
  {"experts": 128, "top_k": 8, "models": [{"name", "hidden", "intermediate"}],
   "routing": [{"tokens": T, "expert_counts": [E ints], "topk_ids": [T * top_k ints, row-major] (optional)}]}
Without topk_ids, each token's experts are made from the counts (rows of expert e go to consecutive tokens,
round robin, so no token gets an expert twice). Without --routing, --models and --tokens with uniform routing
drawn here (by hand; the figures then use another routing than the benchmark's).

Result: one JSON object to --out (else the last line of stdout). Without torch, CUDA or torch._grouped_mm it exits
2 with one line on stderr, "torch_moe_peer: ...". Usable by hand: python3 bench/peer/torch_moe_peer.py --tokens 4096
"""
import argparse
import json
import random
import sys

MODELS = {"qwen3-30b-a3b": (2048, 768), "qwen3-235b-a22b": (4096, 1536)}
EXPERTS, TOP_K = 128, 8


class PeerError(Exception):
    """A one-line reason the peer cannot run (printed as `torch_moe_peer: <reason>`, exit status 2)."""


def topk_ids_from_counts(counts, tokens, top_k):
    """Per-token expert lists (flat, [tokens * top_k]) with exactly counts[e] rows of expert e.

    Entry i of the expert-sorted row list goes to token i % tokens: an expert's rows are consecutive there and
    number at most `tokens`, so they land on distinct tokens, and every token gets top_k entries."""
    if sum(counts) != tokens * top_k:
        raise PeerError(f"expert counts sum to {sum(counts)}, {tokens} tokens x top-{top_k} need {tokens * top_k}")
    per_token = [[] for _ in range(tokens)]
    i = 0
    for e, c in enumerate(counts):
        for _ in range(c):
            per_token[i % tokens].append(e)
            i += 1
    return [e for row in per_token for e in row]


def check_routing_entry(entry, experts, top_k):
    """Validates one routing entry; returns (tokens, counts, topk_ids) with topk_ids made from counts if absent."""
    if not isinstance(entry, dict) or "tokens" not in entry or "expert_counts" not in entry:
        raise PeerError("routing entry without 'tokens' and 'expert_counts'")
    tokens, counts = entry["tokens"], entry["expert_counts"]
    if not isinstance(tokens, int) or tokens < 1:
        raise PeerError(f"routing: tokens {tokens!r} is not a positive integer")
    if not isinstance(counts, list) or len(counts) != experts:
        raise PeerError(f"routing T={tokens}: expert_counts must list {experts} counts")
    for c in counts:
        if not isinstance(c, int) or c < 0 or c > tokens:
            raise PeerError(f"routing T={tokens}: expert count {c!r} outside [0, {tokens}]")
    ids = entry.get("topk_ids")
    if ids is None:
        return tokens, counts, topk_ids_from_counts(counts, tokens, top_k)
    if not isinstance(ids, list) or len(ids) != tokens * top_k:
        raise PeerError(f"routing T={tokens}: topk_ids must hold {tokens * top_k} ids ({tokens} x {top_k})")
    seen = [0] * experts
    for t in range(tokens):
        row = ids[t * top_k:(t + 1) * top_k]
        for e in row:
            if not isinstance(e, int) or e < 0 or e >= experts:
                raise PeerError(f"routing T={tokens}: token {t} has expert id {e!r} outside [0, {experts})")
            seen[e] += 1
        if len(set(row)) != top_k:
            raise PeerError(f"routing T={tokens}: token {t} lists an expert twice")
    if seen != counts:
        raise PeerError(f"routing T={tokens}: topk_ids disagree with expert_counts")
    return tokens, counts, ids


def read_routing(path):
    """The benchmark's routing file: (models [(name, hidden, intermediate)] or None, experts, top_k,
    [(tokens, counts, topk_ids)])."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise PeerError(f"--routing {path}: {e.strerror}")
    except ValueError as e:
        raise PeerError(f"--routing {path}: not JSON ({e})")
    if not isinstance(doc, dict) or not isinstance(doc.get("routing"), list) or not doc["routing"]:
        raise PeerError(f"--routing {path}: expected an object with a non-empty 'routing' list")
    experts, top_k = doc.get("experts", EXPERTS), doc.get("top_k", TOP_K)
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise PeerError(f"--routing {path}: experts {experts!r} and top_k {top_k!r} must be integers, 1 <= top_k <= experts")
    models = None
    if "models" in doc:
        models = []
        for m in doc["models"]:
            try:
                models.append((str(m["name"]), int(m["hidden"]), int(m["intermediate"])))
            except (KeyError, TypeError, ValueError):
                raise PeerError(f"--routing {path}: each model needs name, hidden and intermediate")
    return models, experts, top_k, [check_routing_entry(e, experts, top_k) for e in doc["routing"]]


def uniform_routing(tokens, experts, top_k, seed):
    """Each token's top-k uniform without replacement (for runs by hand without --routing)."""
    rng = random.Random(seed)
    ids = [e for _ in range(tokens) for e in rng.sample(range(experts), top_k)]
    counts = [0] * experts
    for e in ids:
        counts[e] += 1
    return tokens, counts, ids


def parse_args(argv):
    p = argparse.ArgumentParser(description="PyTorch grouped_mm MoE peer of `fulcrum bench moe`")
    p.add_argument("--routing", help="routing file written by `fulcrum bench moe` (models and per-T routing)")
    p.add_argument("--models", nargs="+", default=list(MODELS), help="without --routing: " + ", ".join(MODELS))
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384], help="without --routing")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", help="write the JSON result here (default: stdout)")
    a = p.parse_args(argv)
    if a.reps < 1 or a.warmup < 0:
        raise PeerError("--reps must be positive and --warmup >= 0")
    for m in a.models:
        if m not in MODELS:
            raise PeerError(f"--models: unknown model '{m}' (known: {', '.join(MODELS)})")
    if any(t < 1 for t in a.tokens):
        raise PeerError("--tokens must be positive")
    return a


def plan(a):
    """(models, experts, top_k, routings) from the routing file or from --models / --tokens."""
    if a.routing:
        models, experts, top_k, routings = read_routing(a.routing)
        if models is None:
            models = [(m, *MODELS[m]) for m in a.models]
        return models, experts, top_k, routings
    return ([(m, *MODELS[m]) for m in a.models], EXPERTS, TOP_K,
            [uniform_routing(t, EXPERTS, TOP_K, a.seed + t) for t in a.tokens])


def load_torch():
    try:
        import torch
    except ImportError as e:
        raise PeerError(f"PyTorch is not installed here (import torch: {e})")
    if not torch.cuda.is_available():
        raise PeerError(f"no CUDA device for torch {torch.__version__} (CUDA build {torch.version.cuda})")
    if not hasattr(torch, "_grouped_mm"):
        raise PeerError(f"torch {torch.__version__} has no torch._grouped_mm (PyTorch 2.8 or later has it)")
    return torch


def one_line(e):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return text[0][:300] if text else type(e).__name__


def main(argv):
    a = parse_args(argv)
    torch = load_torch()
    models, experts, top_k, routings = plan(a)
    import torch.nn.functional as F

    dev = torch.device("cuda")

    def median_ms(fn):
        for _ in range(a.warmup):
            fn()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(a.reps):
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return sorted(times)[len(times) // 2]  # bench_util.cpp median(): the upper median

    def experts_bf16(x_perm, offs, w13, w2, inter):
        h = torch._grouped_mm(x_perm, w13, offs=offs)  # [R, 2I]: gate | up
        return torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2, offs=offs)

    def quant_rows(t):  # [R, K] -> e4m3 [R, K] and fp32 scales [R] (amax / 448 per row)
        scale = t.abs().amax(dim=-1).float().clamp(min=1e-12) / 448.0
        return (t.float() / scale.unsqueeze(-1)).to(torch.float8_e4m3fn), scale

    def quant_weight(w):  # bf16 [E, N, K] -> e4m3 as [E, K, N] column-major (what the kernel wants), scales [E, N]
        q, s = quant_rows(w)
        return q.transpose(1, 2), s

    def experts_fp8(x_perm, offs, w13q, s13, w2q, s2, inter):
        xq, sx = quant_rows(x_perm)
        h = torch._scaled_grouped_mm(xq, w13q, sx, s13, offs=offs, out_dtype=torch.bfloat16)
        aq, sa = quant_rows(F.silu(h[:, :inter]) * h[:, inter:])
        return torch._scaled_grouped_mm(aq, w2q, sa, s2, offs=offs, out_dtype=torch.bfloat16)

    def layer(x, logits, w13, w2, inter):
        tokens = x.shape[0]
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = ids.reshape(-1)
        order = torch.argsort(flat)
        # Counts by scatter_add_ rather than bincount, which reads its maximum back to the host.
        counts = torch.zeros(experts, dtype=torch.int32, device=dev).scatter_add_(
            0, flat, torch.ones_like(flat, dtype=torch.int32))
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        token_of_row = order // top_k
        y = experts_bf16(x.index_select(0, token_of_row), offs, w13, w2, inter)
        y = y * weights.reshape(-1)[order].to(y.dtype).unsqueeze(-1)
        return torch.zeros(tokens, x.shape[1], dtype=x.dtype, device=dev).index_add_(0, token_of_row, y)

    fp8_rowwise = "ok" if hasattr(torch, "_scaled_grouped_mm") else (
        f"unavailable: torch {torch.__version__} has no torch._scaled_grouped_mm")
    fp8_blockwise = "ok" if hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType") else (
        f"unavailable: torch {torch.__version__} has no torch.nn.functional.scaled_grouped_mm")
    results = []
    with torch.no_grad():
        for name, hidden, inter in models:
            gen = torch.Generator(device=dev).manual_seed(a.seed)
            # Server layout: per expert [out, in] (nn.Linear), seen by the GEMM as [E, in, out] column-major.
            w13_rows = torch.randn(experts, 2 * inter, hidden, device=dev, generator=gen).mul_(0.02).bfloat16()
            w2_rows = torch.randn(experts, hidden, inter, device=dev, generator=gen).mul_(0.02).bfloat16()
            w13, w2 = w13_rows.transpose(1, 2), w2_rows.transpose(1, 2)
            fp8_weights = None
            if fp8_rowwise == "ok" or fp8_blockwise == "ok":
                fp8_weights = (*quant_weight(w13_rows), *quant_weight(w2_rows))
            for tokens, counts, ids in routings:
                ids_t = torch.tensor(ids, dtype=torch.int64, device=dev).view(tokens, top_k)
                # Logits as the benchmark draws them: chosen experts 4 + U(0,1), others U(-1,1).
                logits = torch.rand(tokens, experts, device=dev, generator=gen).mul_(2).sub_(1)
                logits.scatter_(1, ids_t, torch.rand(tokens, top_k, device=dev, generator=gen).add_(4))
                x = torch.randn(tokens, hidden, device=dev, generator=gen).bfloat16()
                order = torch.argsort(ids_t.reshape(-1))
                x_perm = x.index_select(0, order // top_k)
                offs = torch.cumsum(torch.tensor(counts, dtype=torch.int32, device=dev), 0, dtype=torch.int32)
                picked = torch.topk(logits, top_k, dim=-1).indices.sort(dim=-1).values
                if not torch.equal(picked, ids_t.sort(dim=-1).values):
                    raise PeerError(f"T={tokens}: top-k of the rebuilt logits is not the given routing")
                r = {"model": name, "hidden": hidden, "intermediate": inter, "tokens": tokens,
                     "rows": tokens * top_k, "max_expert_rows": max(counts),
                     "experts_ms": median_ms(lambda: experts_bf16(x_perm, offs, w13, w2, inter)),
                     "layer_ms": median_ms(lambda: layer(x, logits, w13, w2, inter)),
                     "fp8_rowwise_experts_ms": None, "fp8_rowwise_gemms_ms": None, "fp8_blockwise_gemms_ms": None}
                if fp8_rowwise == "ok":
                    try:
                        w13q, s13, w2q, s2 = fp8_weights
                        r["fp8_rowwise_experts_ms"] = median_ms(lambda: experts_fp8(x_perm, offs, w13q, s13, w2q, s2, inter))
                        xq, sx = quant_rows(x_perm)
                        aq, sa = quant_rows(torch.randn(tokens * top_k, inter, device=dev, generator=gen).bfloat16())
                        r["fp8_rowwise_gemms_ms"] = median_ms(lambda: (
                            torch._scaled_grouped_mm(xq, w13q, sx, s13, offs=offs, out_dtype=torch.bfloat16),
                            torch._scaled_grouped_mm(aq, w2q, sa, s2, offs=offs, out_dtype=torch.bfloat16)))
                    except Exception as e:  # the build has the op but refuses these operands
                        fp8_rowwise = "unavailable: " + one_line(e)
                if fp8_blockwise == "ok":
                    try:
                        r["fp8_blockwise_gemms_ms"] = blockwise_gemms_ms(torch, F, median_ms, x_perm, offs, w13_rows,
                                                                         w2_rows, inter, gen)
                    except Exception as e:
                        fp8_blockwise = "unavailable: " + one_line(e)
                results.append(r)
                print(f"# torch {name} T={tokens}: experts {r['experts_ms']:.3f} ms, layer {r['layer_ms']:.3f} ms",
                      flush=True)
                del x, x_perm, logits
            del w13_rows, w2_rows, w13, w2, fp8_weights
            torch.cuda.empty_cache()
    doc = {"peer": "torch-grouped-mm", "torch": torch.__version__, "cuda": torch.version.cuda,
           "device": torch.cuda.get_device_name(0), "experts": experts, "top_k": top_k,
           "warmup": a.warmup, "reps": a.reps, "routing": "benchmark's (--routing)" if a.routing else "uniform, drawn here",
           "timing": "CUDA events per run, upper median of reps after warm-up; L2 not flushed between runs; eager (no CUDA graph)",
           "layer": "softmax + top-k + renormalise, argsort + index_select, grouped_mm experts, index_add_ into bf16 [T, H]",
           "fp8_rowwise": fp8_rowwise, "fp8_blockwise": fp8_blockwise, "results": results}
    text = json.dumps(doc)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def blockwise_gemms_ms(torch, F, median_ms, x_perm, offs, w13_rows, w2_rows, inter, gen):
    """The two expert GEMMs with DeepSeek-style scales: activations 1x128, weights 128x128 (all scales 1: the
    speed does not depend on them). Raises where the build has no such kernel (sm90 builds may not)."""
    def quant_1x128(t):  # [R, K] -> e4m3, scales [R, K / 128]
        return t.to(torch.float8_e4m3fn), torch.ones(t.shape[0], t.shape[1] // 128, device=t.device)

    def quant_128x128(w):  # [E, N, K] -> e4m3 [E, K, N] column-major, scales [E, N / 128, K / 128]
        e, n, k = w.shape
        return w.to(torch.float8_e4m3fn).transpose(1, 2), torch.ones(e, n // 128, k // 128, device=w.device)

    st = F.ScalingType
    xq, sx = quant_1x128(x_perm)
    aq, sa = quant_1x128(torch.randn(x_perm.shape[0], inter, device=x_perm.device, generator=gen).bfloat16())
    w13q, s13 = quant_128x128(w13_rows)
    w2q, s2 = quant_128x128(w2_rows)

    def run():
        F.scaled_grouped_mm(xq, w13q, sx, st.Blockwise_1x128, s13, st.Blockwise_128x128, offs=offs)
        F.scaled_grouped_mm(aq, w2q, sa, st.Blockwise_1x128, s2, st.Blockwise_128x128, offs=offs)
    return median_ms(run)


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except PeerError as e:
        print(f"torch_moe_peer: {e}", file=sys.stderr)
        sys.exit(2)
