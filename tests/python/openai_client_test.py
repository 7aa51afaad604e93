"""The official `openai` client against a running `fulcrum serve` (scripts/openai_client_test.sh starts it on a
tiny model with the golden tokenizer): completions and chat logprobs, lm-eval's scoring request (echo +
logprobs + max_tokens 0 / 1, prompts as token-id lists), streaming with logprobs, and the OpenAI error shape
for out-of-range values. Each case asserts what the response must hold; the first failure exits non-zero.

Usage: python openai_client_test.py BASE_URL MODEL_NAME
"""
import math
import sys

import openai


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def completions_logprobs(client, model):
    out = client.completions.create(model=model, prompt="hello world", max_tokens=4, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    check(len(lp.tokens) == 4 and len(lp.token_logprobs) == 4, f"4 positions: {lp}")
    check(len(lp.text_offset) == 4 and lp.text_offset[0] == 0, f"text offsets: {lp.text_offset}")
    for value, top in zip(lp.token_logprobs, lp.top_logprobs):
        check(value <= 0.0, f"a logprob above 0: {value}")
        check(1 <= len(top) <= 3, f"top of 3: {top}")
        check(value == max(top.values()), f"greedy: the token is its row's best: {value} vs {top}")
        check(sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-6, f"probabilities over 1: {top}")


def echo_scoring(client, model):
    """lm-eval local-completions' loglikelihood request (lm_eval/models/openai_completions.py)."""
    context, continuation = [11, 22, 33, 44, 55], [66, 77, 88]
    prompt = context + continuation
    scores = {}
    for max_tokens in (1, 0):
        out = client.completions.create(model=model, prompt=[prompt], temperature=0, max_tokens=max_tokens, logprobs=1,
                                        seed=1234, echo=True)
        choice = out.choices[0]
        lp = choice.logprobs
        check(len(lp.token_logprobs) == len(prompt) + max_tokens, f"max_tokens {max_tokens}: {len(lp.token_logprobs)}")
        check(lp.token_logprobs[0] is None and lp.top_logprobs[0] is None, "the first prompt token has no logprob")
        ctxlen = len(context)
        # lm-eval slices [ctxlen:-1] with max_tokens 1 (the last entry is the generated token).
        end = len(prompt)
        scores[max_tokens] = sum(lp.token_logprobs[ctxlen:end])
        for value, top in zip(lp.token_logprobs[ctxlen:end], lp.top_logprobs[ctxlen:end]):
            check(len(top) == 1 and value <= max(top.values()), f"top 1 is at least the token: {value} {top}")
        check(out.usage.completion_tokens == max_tokens, f"usage: {out.usage}")
    check(scores[0] == scores[1], f"the continuation's score does not depend on max_tokens: {scores}")


def chat_logprobs(client, model):
    out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                         temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    check(len(content) == 3, f"3 tokens: {content}")
    for entry in content:
        check(len(entry.top_logprobs) == 2, f"top 2: {entry}")
        check(entry.top_logprobs[0].logprob == entry.logprob, f"greedy: {entry}")
        check(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob, f"descending: {entry}")


def streaming(client, model):
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                           temperature=0, logprobs=True, top_logprobs=1, extra_body={"ignore_eos": True})
    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                            temperature=0, logprobs=True, top_logprobs=1, stream=True,
                                            extra_body={"ignore_eos": True})
    streamed = [e for chunk in stream for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    check([e.logprob for e in streamed] == [e.logprob for e in whole.choices[0].logprobs.content],
          "streamed chat logprobs equal the whole response's")
    stream = client.completions.create(model=model, prompt="hello", max_tokens=3, temperature=0, logprobs=2, stream=True,
                                       extra_body={"ignore_eos": True})
    values = [v for chunk in stream for choice in chunk.choices if choice.logprobs for v in choice.logprobs.token_logprobs]
    check(len(values) == 3, f"3 streamed completion logprobs: {values}")


def errors(client, model):
    cases = [
        lambda: client.completions.create(model=model, prompt="x", max_tokens=1, logprobs=6),
        lambda: client.completions.create(model=model, prompt="x", max_tokens=0),
        lambda: client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], logprobs=True,
                                               top_logprobs=21),
    ]
    for case in cases:
        try:
            case()
        except openai.BadRequestError as e:
            check(e.status_code == 400 and "message" in e.body, f"OpenAI error shape: {e.body}")
            continue
        raise AssertionError("an out-of-range value was accepted")


def main():
    base_url, model = sys.argv[1], sys.argv[2]
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    for case in (completions_logprobs, echo_scoring, chat_logprobs, streaming, errors):
        case(client, model)
        print(f"ok {case.__name__}")


if __name__ == "__main__":
    main()
