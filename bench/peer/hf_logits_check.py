#!/usr/bin/env python3
"""HF transformers as a second oracle for the GPU engine: runs a checkpoint (bf16 on the GPU) on prompts and
compares its logits with those `fulcrum generate --device cuda --dump-logits FILE` wrote for the same prompts:
max and mean |difference|, mean |logit|, argmax agreement. Prints one JSON object on the last line.
Usage: hf_logits_check.py --model DIR --logits FILE --prompt "1 2 3" [--prompt ...]"""
import argparse, json

import torch
import transformers
from safetensors.torch import load_file


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--logits", required=True)
    p.add_argument("--prompt", action="append", required=True)
    a = p.parse_args()
    model = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16, device_map="cuda").eval()
    ours = load_file(a.logits)
    out = []
    with torch.no_grad():
        for i, text in enumerate(a.prompt):
            ids = torch.tensor([[int(t) for t in text.split()]], device="cuda")
            ref = model(input_ids=ids).logits[0].float().cpu()
            mine = ours[f"seq{i}.logits"].float()
            diff = (mine - ref).abs()
            out.append({"tokens": ids.shape[1], "max_abs_diff": diff.max().item(), "mean_abs_diff": diff.mean().item(),
                        "mean_abs_logit": ref.abs().mean().item(),
                        "argmax_agreement": (mine.argmax(-1) == ref.argmax(-1)).float().mean().item()})
    print(json.dumps({"oracle": "hf-transformers", "transformers": transformers.__version__, "dtype": "bfloat16",
                      "sequences": out}))


if __name__ == "__main__":
    main()
