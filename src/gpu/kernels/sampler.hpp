#pragma once
// Next-token sampling on the device, one token per row of logits: the GPU engine's form of
// model::sample_token_from_uniform (src/model/sampling.hpp, the definition and the CPU reference). Greedy rows
// (temperature 0) take the argmax, lowest id on ties; the others keep the top_k highest logits (0: all) in the
// definition's order (descending logit, lower id first), softmax at the temperature in double, the nucleus
// (smallest prefix whose mass reaches top_p * total) and the inverse-CDF draw at uniform * nucleus mass. The
// host draws each sequence's uniform from its own model::Rng (Rng::uniform(), as sample_token does) and passes
// it in, so every engine advances a sequence's Rng alike. Algorithm: sampler.cu (top comment).
//
// Launcher in the style of src/gpu/moe/moe_kernels.hpp: enqueues on `stream`, returns the launch status
// (a cudaError_t value, returned as int so that this header includes no CUDA header; 0 is cudaSuccess).
// CUDA-graph capture: two launches (pass A split over the row, then a block per row), both programmatic dependents
// (dependent_launch.cuh), nothing allocated or synchronized; the parameters, uniforms and logits are read from
// device memory, so a captured graph replays with new ones.
#include <cstddef>
#include <cstdint>

struct CUstream_st;  // cudaStream_t

namespace fulcrum::gpu {

// One row's sampling parameters, the same layout on host and device (model::SamplingParams + the uniform).
struct SamplerRow {
  float temperature;  // 0: greedy; > 0: softmax temperature (finite)
  float top_p;        // in (0, 1]; 1 keeps every kept token
  int32_t top_k;      // 0: off (all V); > 0: keep the top_k highest logits (values >= V keep all)
  int32_t pad;        // unused
  double uniform;     // in [0, 1): the sequence's Rng::uniform(); greedy rows ignore it (pass 0) but, as in the
                      // definition, a value outside [0, 1) makes the row invalid
};
static_assert(sizeof(SamplerRow) == 24, "SamplerRow layout is shared with the device");

// Bytes of the workspace launch_sample needs for up to max_rows rows (a per-row histogram copy, 12 KiB a row, and
// 32 bytes of partial stats per 4096 logits of a row). 16-byte aligned memory (cudaMalloc's is).
size_t sampler_workspace_bytes(int max_rows, int vocab_size);

// tokens[r] = the definition's token for row r of logits (row r starts at logits + r * logits_row_stride,
// vocab_size floats). A row whose logits hold a NaN or +inf, or are all -inf, or whose parameters the
// definition rejects (temperature < 0 or not finite, top_p outside (0, 1], top_k < 0, uniform outside [0, 1))
// gets token -1 (the host turns that into a one-line error naming the sequence).
// logprobs[r] (logprobs may be null) = log-softmax at temperature 1 over the full vocabulary of the chosen
// token, logit - max - log(sum exp(logit - max)) with the sum in double (an OpenAI `logprobs` value); NaN for a
// row with token -1.
// All pointers are device pointers; logits_row_stride >= vocab_size (rows need not be 16-byte aligned: they
// take vector loads when they are). Returns cudaErrorInvalidValue (as int) for vocab_size < 1 or > 2^21, a short or
// misaligned workspace or a null pointer; num_rows == 0 launches nothing.
int launch_sample(const float* logits, int64_t logits_row_stride, int num_rows, int vocab_size, const SamplerRow* rows,
                  int32_t* tokens, float* logprobs, void* workspace, size_t workspace_bytes, CUstream_st* stream);

}  // namespace fulcrum::gpu
