#!/usr/bin/env python3
"""The HF transformers peer of `fulcrum bench generate`: Qwen3MoeForCausalLM built from a config.json with random
bf16 weights on the GPU (its speed does not depend on the values), decode ms/step at each batch size after a
prefill of --context random tokens, greedy, KV cache on. Prints one JSON object on the last line of stdout.
Run by the benchmark on the GPU machine (PyTorch and transformers are there); usable by hand the same way."""
import argparse, json, statistics, time

import torch
import transformers


def build(config_path):
    config = transformers.AutoConfig.from_pretrained(config_path)
    impl = "grouped_mm"
    try:
        with torch.device("cuda"):
            model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16,
                                                                  experts_implementation=impl)
    except (TypeError, ValueError):
        impl = "default"
        with torch.device("cuda"):
            model = transformers.Qwen3MoeForCausalLM._from_config(config, dtype=torch.bfloat16)
    return model.eval(), impl


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    a = p.parse_args()
    model, impl = build(a.config)
    vocab = model.config.vocab_size
    runs = []
    with torch.no_grad():
        for b in a.batch:
            ids = torch.randint(0, vocab, (b, a.context), device="cuda")
            out = model(input_ids=ids, use_cache=True)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            times = []
            for i in range(a.warmup + a.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = model(input_ids=token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
                torch.cuda.synchronize()
                if i >= a.warmup:
                    times.append((time.perf_counter() - t0) * 1e3)
            runs.append({"batch": b, "context": a.context, "ms_per_step": statistics.median(times)})
            del past, out
            torch.cuda.empty_cache()
    print(json.dumps({"peer": "hf-transformers", "transformers": transformers.__version__, "torch": torch.__version__,
                      "experts_implementation": impl, "runs": runs}))


if __name__ == "__main__":
    main()
