#!/usr/bin/env python3
"""SGLang's own frontend (sglang.lang, RuntimeEndpoint) against a running `fulcrum serve`: the few-shot gsm8k
program of SGLang's benchmark/gsm8k/bench_sglang.py (an @sgl.function that appends few-shot examples and a
question, then sgl.gen with stop strings, run_batch at temperature 0 over several threads), on a tiny model.

Usage: sglang_frontend_check.py URL [--questions N] [--json OUT]
SGLang is not a dependency of Fulcrum: this is the manual interop check of issue 13 (sglang imports torch, so it
runs where torch is: the GPU machine, with the sglang wheel's Python sources carried, see scripts/sglang_check.sh).
Checks: the endpoint connects (GET /get_model_info), every program run ends without an error, each answer is text,
temperature-0 runs repeat exactly, and a one-question run equals the same question inside the batch. Exit 1 on a
failed check (one line each), 2 when sglang cannot be imported.
"""
import argparse
import json
import sys
import time

FEW_SHOT = (
    "Question: Tom has 3 apples and buys 2 more. How many apples does he have?\nAnswer: 3 + 2 = 5. The answer is 5.\n\n"
    "Question: A box holds 4 rows of 6 eggs. How many eggs are in the box?\nAnswer: 4 * 6 = 24. The answer is 24.\n\n"
)
# Third-party modules sglang's frontend import chain may pull in (reported when the import fails).
PROBE = ["aiohttp", "dill", "einops", "fastapi", "filelock", "huggingface_hub", "IPython", "msgspec", "numpy", "openai",
         "orjson", "packaging", "partial_json_parser", "PIL", "prometheus_client", "psutil", "pybase64", "pydantic",
         "regex", "requests", "setproctitle", "starlette", "torch", "tqdm", "transformers", "triton", "uvicorn", "yaml",
         "zmq"]
QUESTIONS = [
    "Sara reads 12 pages a day for 5 days. How many pages does she read?",
    "A train travels 60 miles per hour for 3 hours. How far does it go?",
    "There are 9 birds on a tree and 4 fly away. How many are left?",
    "Mike has 20 dollars and spends 7. How much money is left?",
    "A class has 5 groups of 4 students. How many students are there?",
    "Anna bakes 3 trays of 8 cookies. How many cookies does she bake?",
    "A rope is 15 meters long and is cut into 3 equal parts. How long is each part?",
    "Ben scores 7 points in each of 6 games. How many points does he score?",
]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--json")
    args = parser.parse_args()
    try:
        import sglang as sgl
        from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint
    except Exception as e:  # noqa: BLE001 - any import failure is the one-line skip reason
        import importlib.util
        missing = [m for m in PROBE if importlib.util.find_spec(m) is None]
        print(f"sglang_frontend_check: cannot import sglang: {type(e).__name__}: {e} (not importable here: "
              f"{' '.join(missing) or 'none of the probed'})", file=sys.stderr)
        return 2

    @sgl.function
    def few_shot_gsm8k(s, question):
        s += FEW_SHOT + "Question: " + question + "\nAnswer:"
        s += sgl.gen("answer", max_tokens=24, stop=["Question", "Assistant:", "<|separator|>"])

    failures = []
    backend = RuntimeEndpoint(args.url)
    sgl.set_default_backend(backend)
    questions = (QUESTIONS * ((args.questions + len(QUESTIONS) - 1) // len(QUESTIONS)))[: args.questions]
    arguments = [{"question": q} for q in questions]
    start = time.time()
    states = few_shot_gsm8k.run_batch(arguments, temperature=0, num_threads=4, progress_bar=False)
    batch_s = time.time() - start
    answers = []
    for i, state in enumerate(states):
        try:
            answers.append(state["answer"])
        except Exception as e:  # noqa: BLE001
            failures.append(f"question {i}: {type(e).__name__}: {e}")
            answers.append(None)
    for i, a in enumerate(answers):
        if a is not None and not isinstance(a, str):
            failures.append(f"question {i}: answer is {type(a).__name__}, not text")
    again = [s["answer"] for s in few_shot_gsm8k.run_batch(arguments, temperature=0, num_threads=4, progress_bar=False)]
    if again != answers:
        failures.append("temperature-0 run_batch did not repeat exactly")
    alone = few_shot_gsm8k.run(question=questions[0], temperature=0)["answer"]
    if alone != answers[0]:
        failures.append("question 0 alone differs from question 0 in the batch")
    result = {
        "url": args.url,
        "model_info": backend.model_info,
        "sglang": getattr(sgl, "__version__", "?"),
        "questions": len(questions),
        "batch_seconds": batch_s,
        "answers": answers,
        "failures": failures,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    print(f"sglang {result['sglang']} RuntimeEndpoint -> {args.url}: model_info {backend.model_info}")
    for q, a in zip(questions, answers):
        print(f"  Q: {q}\n  A: {a!r}")
    for f in failures:
        print(f"FAILED: {f}")
    print(f"{len(questions)} programs in {batch_s:.2f} s, {len(failures)} failed checks")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
