#pragma once
// Next-token sampling from one row of logits: greedy, temperature, top-k, top-p (nucleus).
//
// Order of operations (as in common serving stacks): candidates sorted by logit, descending, equal
// logits by lower token id; keep the first top_k (0: all); softmax(logits / temperature) over them;
// keep the smallest prefix whose probability (renormalized over the kept top-k) reaches top_p; draw one
// token proportionally from that prefix with `rng`. temperature == 0 is greedy: the argmax, lowest id
// on ties, and `rng` is not advanced. Results depend only on the inputs and the Rng state, never on
// the standard library.
#include <span>

#include "model/rng.hpp"

namespace fulcrum::model {

struct SamplingParams {
  float temperature = 0.0f;  // 0: greedy; > 0: softmax temperature
  float top_p = 1.0f;        // in (0, 1]; 1 keeps every token
  int top_k = 0;             // 0: off; > 0: keep the k highest logits
};

// Throws fulcrum::Error (one line) on temperature < 0 or not finite, top_p outside (0, 1], top_k < 0.
void validate_sampling_params(const SamplingParams& params);

// Returns a token id in [0, logits.size()). Logits may hold -inf (masked tokens) but no NaN or +inf,
// and at least one must be finite.
int sample_token(std::span<const float> logits, const SamplingParams& params, Rng& rng);

// The same draw with the uniform value given: sample_token(logits, params, rng) is this function with
// uniform = rng.uniform() when params.temperature > 0 (greedy draws nothing and ignores `uniform`). A caller
// that samples elsewhere (the GPU engine's device sampler) takes the uniform from the sequence's Rng itself,
// so every engine advances a sequence's Rng alike. uniform in [0, 1).
int sample_token_from_uniform(std::span<const float> logits, const SamplingParams& params, double uniform);

}  // namespace fulcrum::model
