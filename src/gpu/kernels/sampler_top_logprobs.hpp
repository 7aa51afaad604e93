#pragma once
// Logprobs of sampled rows on the device: the GPU engine's form of model::token_logprob_with_top
// (src/model/step_model.hpp, the definition and the CPU reference). For each row, the log-softmax at
// temperature 1 over the full vocabulary of the sampled token and of the row's `num_top` most likely tokens
// (descending logit, lower id first on ties), every value logit - max - log(sum exp(logit - max)) with the sum
// in double, from one normalizer per row: the sampled token's value and its top entry are the same float.
// Runs after launch_sample on its tokens, for the steps where a row asks (OpenAI top_logprobs); it rewrites
// token_logprobs[r] with its own normalizer so that the two agree bitwise.
//
// Launcher as sampler.hpp's: enqueues on `stream`, returns a cudaError_t value as int (0: success); one launch,
// grid = num_rows, nothing allocated or synchronized (capturable).
#include <cstdint>

struct CUstream_st;  // cudaStream_t

namespace fulcrum::gpu {

// For row r (logits + r * logits_row_stride, vocab_size floats) with tokens[r] >= 0: token_logprobs[r] = the
// value of tokens[r]; top_ids[r * num_top + j] / top_logprobs[r * num_top + j] = the j-th most likely token and
// its value, for j < min(num_top, vocab_size) (the rest get id -1, value NaN). Rows with tokens[r] < 0 (the
// sampler refused them) get ids -1 and NaN throughout. num_top in [1, 20]; device pointers; returns
// cudaErrorInvalidValue (as int) for a bad argument; num_rows == 0 launches nothing.
int launch_top_logprobs(const float* logits, int64_t logits_row_stride, int num_rows, int vocab_size, int num_top,
                        const int32_t* tokens, float* token_logprobs, int32_t* top_ids, float* top_logprobs,
                        CUstream_st* stream);

}  // namespace fulcrum::gpu
