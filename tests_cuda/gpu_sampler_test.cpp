// The device sampler (src/gpu/kernels/sampler.hpp) against its definition and CPU reference,
// model::sample_token_from_uniform (src/model/sampling.hpp), on fresh random logits: vocabularies of 151936 (Qwen3)
// and 256 / 320 (tiny models), batches of 1, 7 and 64 rows, temperature 0 / 0.3 / 0.7 / 1.5, top_k 0 / 1 / 40 /
// 1000 / V, top_p 1 / 0.95 / 0.5 / 0.01, uniforms random (model::Rng) and the edges 0 and 1 - 2^-53; logits
// normal * 1 / 3 / 8, normal * 40 (large spreads) and normal * 3 with a third masked to -inf; rows 16-byte aligned
// and not (row stride V + 3, NaN between rows so a read past a row shows). Then planted ties (greedy: the lowest
// id; sampling: all-equal rows, tie groups larger than the 2048 tokens the device sorts, logits on a 0.25 grid or
// rounded to bf16), masked rows, invalid rows (NaN, +inf, all -inf, parameters the definition rejects: token -1,
// logprob NaN, neighbours right), no logprobs, a CUDA graph replayed with new inputs, argument checks, timings.
// Outputs are poisoned before every launch. Top logprobs (sampler_top_logprobs.hpp) against
// model::token_logprob_with_top: ids exact (the selection only compares logits), values within kLogprobTolerance,
// the sampled token's value equal to its own top entry bitwise; ties, -inf, refused rows, N > V.
//
// Tolerances and why:
//   tokens    exact. The device keeps the definition's order exactly (descending logit, lower id first) and
//             computes the same double weights (CUDA's exp is within 1 ulp of glibc's), but sums them in another
//             order, and keeps the terms the CPU's running sum absorbs (each below half an ulp of the sum; at most
//             V * 2^-53 of the mass together, 1.7e-11 at V = 151936). So a token can differ only when the target
//             (top_p * total, uniform * mass) lies within ~1e-11 relative of a cumulative boundary: below 1e-9 per
//             row for these random uniforms. The edge uniform = 1 - 2^-53 puts the target one ulp below the mass by
//             construction; the definition then returns the last token its running sum still took in, and the
//             device applies that rule explicitly (sampler.cu), so the edge is compared exactly too.
//   logprobs  1e-5 absolute vs log-softmax in double: the device sums fp32 exponentials (each within ~2 ulp,
//             2.4e-7 relative) in double, so log(sum) is off by < 1e-6.
#include <cuda_runtime.h>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/kernels/sampler.hpp"
#include "gpu/kernels/sampler_top_logprobs.hpp"
#include "model/step_model.hpp"
#include "model/rng.hpp"
#include "model/sampling.hpp"

namespace fulcrum::test {
namespace {

using gpu::SamplerRow;

constexpr int kQwenVocab = 151936;
constexpr double kLogprobTolerance = 1e-5;
constexpr int32_t kPoisonToken = 0x5A5A5A5A;
constexpr float kPoisonLogprob = 1234.5f;
constexpr double kTopEdge = 1.0 - 0x1p-53;  // the largest uniform below 1
constexpr float kInf = INFINITY;

template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(size_t n) : n_(n) { FULCRUM_CUDA_CHECK(cudaMalloc(&ptr_, sizeof(T) * std::max<size_t>(n, 1))); }
  ~DeviceArray() { cudaFree(ptr_); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* get() const { return ptr_; }
  void upload(const std::vector<T>& host) {
    ASSERT_LE(host.size(), n_);
    FULCRUM_CUDA_CHECK(cudaMemcpy(ptr_, host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> host(n_);
    FULCRUM_CUDA_CHECK(cudaMemcpy(host.data(), ptr_, sizeof(T) * n_, cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

// Rows of logits [num_rows, vocab] and their parameters.
struct Batch {
  explicit Batch(int vocab_size) : vocab(vocab_size) {}
  int vocab;
  std::vector<float> logits;
  std::vector<SamplerRow> rows;
  int num_rows() const { return static_cast<int>(rows.size()); }
  std::span<const float> row(int r) const {
    return {logits.data() + static_cast<size_t>(r) * vocab, static_cast<size_t>(vocab)};
  }
  void add(const std::vector<float>& row_logits, const SamplerRow& params) {
    logits.insert(logits.end(), row_logits.begin(), row_logits.end());
    rows.push_back(params);
  }
};

struct Output {
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
};

std::string describe(const SamplerRow& p) {
  return fmt::format("temperature {} top_p {} top_k {} uniform {:.17g}", p.temperature, p.top_p, p.top_k, p.uniform);
}

// The batch laid out for the device: row stride vocab, or vocab + 3 with the first row one float past a 16-byte
// boundary (the scalar load path); NaN between rows.
std::vector<float> device_layout(const Batch& b, bool misaligned, int64_t* stride, size_t* offset) {
  *stride = b.vocab + (misaligned ? 3 : 0);
  *offset = misaligned ? 1 : 0;
  std::vector<float> padded(*offset + static_cast<size_t>(*stride) * b.num_rows(), NAN);
  for (int r = 0; r < b.num_rows(); ++r)
    std::copy(b.row(r).begin(), b.row(r).end(), padded.begin() + *offset + r * *stride);
  return padded;
}

Output sample_on_device(const Batch& b, bool misaligned, bool with_logprobs = true) {
  const int num_rows = b.num_rows();
  int64_t stride = 0;
  size_t offset = 0;
  const std::vector<float> padded = device_layout(b, misaligned, &stride, &offset);
  DeviceArray<float> logits(padded.size());
  logits.upload(padded);
  DeviceArray<SamplerRow> rows(num_rows);
  rows.upload(b.rows);
  DeviceArray<int32_t> tokens(num_rows);
  tokens.upload(std::vector<int32_t>(num_rows, kPoisonToken));
  DeviceArray<float> logprobs(num_rows);
  logprobs.upload(std::vector<float>(num_rows, kPoisonLogprob));
  const size_t workspace_bytes = gpu::sampler_workspace_bytes(num_rows, b.vocab);
  DeviceArray<uint8_t> workspace(workspace_bytes);
  FULCRUM_CUDA_CHECK(static_cast<cudaError_t>(
      gpu::launch_sample(logits.get() + offset, stride, num_rows, b.vocab, rows.get(), tokens.get(),
                         with_logprobs ? logprobs.get() : nullptr, workspace.get(), workspace_bytes, nullptr)));
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
  return Output{tokens.download(), logprobs.download()};
}

int definition_token(std::span<const float> logits, const SamplerRow& p) {
  try {
    return model::sample_token_from_uniform(logits, model::SamplingParams{p.temperature, p.top_p, p.top_k}, p.uniform);
  } catch (const Error&) {
    return -1;
  }
}

double definition_logprob(std::span<const float> logits, int token) {
  double max = -INFINITY;
  for (const float x : logits) max = std::max(max, static_cast<double>(x));
  double sum = 0.0;
  for (const float x : logits) sum += std::exp(static_cast<double>(x) - max);
  return static_cast<double>(logits[token]) - max - std::log(sum);
}

// Every row's token equals the definition's (-1 where it throws), its logprob is within kLogprobTolerance of
// the CPU log-softmax (NaN for -1; untouched poison without logprobs). Returns the definition's tokens.
std::vector<int> expect_definition(const Batch& b, const Output& out, const std::string& what,
                                   bool with_logprobs = true) {
  std::vector<int> expected(b.num_rows());
  int mismatches = 0;
  for (int r = 0; r < b.num_rows(); ++r) {
    const SamplerRow& p = b.rows[r];
    expected[r] = definition_token(b.row(r), p);
    if (out.tokens[r] != expected[r] && ++mismatches <= 10) {
      ADD_FAILURE() << what << " row " << r << " (" << describe(p) << "): device " << out.tokens[r] << ", definition "
                    << expected[r];
    }
    if (!with_logprobs) {
      EXPECT_EQ(out.logprobs[r], kPoisonLogprob) << what << " row " << r << ": logprobs were not asked for";
    } else if (expected[r] < 0) {
      EXPECT_TRUE(std::isnan(out.logprobs[r])) << what << " row " << r << ": logprob " << out.logprobs[r];
    } else if (out.tokens[r] == expected[r]) {
      EXPECT_NEAR(out.logprobs[r], definition_logprob(b.row(r), expected[r]), kLogprobTolerance)
          << what << " row " << r;
    }
  }
  EXPECT_EQ(mismatches, 0) << what;
  return expected;
}

constexpr float kTemperatures[] = {0.0f, 0.3f, 0.7f, 1.5f};
constexpr float kTopPs[] = {1.0f, 0.95f, 0.5f, 0.01f};
constexpr int kNumCombos = 4 * 5 * 4 * 3;  // temperature x top_k x top_p x uniform kind

// Parameter combination `combo` of the grid above (uniform: random, 0, the top edge).
SamplerRow grid_params(int combo, int vocab, model::Rng& rng) {
  const int top_ks[] = {0, 1, 40, 1000, vocab};
  const int uniform_kind = combo / 80;
  return SamplerRow{kTemperatures[combo % 4], kTopPs[combo / 20 % 4], top_ks[combo / 4 % 5], 0,
                    uniform_kind == 0 ? rng.uniform() : (uniform_kind == 1 ? 0.0 : kTopEdge)};
}

// kind 0..4: normal * 1, * 3, * 8, * 40 (large spreads), * 3 with a third masked to -inf.
std::vector<float> random_logits(model::Rng& rng, int vocab, int kind) {
  const double scales[] = {1.0, 3.0, 8.0, 40.0, 3.0};
  std::vector<float> logits(vocab);
  for (float& x : logits) x = static_cast<float>(rng.normal() * scales[kind % 5]);
  if (kind % 5 == 4) {
    for (float& x : logits) {
      if (rng.next() % 3 == 0) x = -kInf;
    }
  }
  return logits;
}

float round_to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  bits = (bits + 0x7FFFu + ((bits >> 16) & 1u)) & 0xFFFF0000u;
  std::memcpy(&x, &bits, 4);
  return x;
}

class GpuSamplerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (backend::CudaBackend::device_count() == 0) GTEST_SKIP() << "no CUDA device: the GPU sampler tests need a GPU";
  }
};

TEST_F(GpuSamplerTest, MatchesDefinitionOnRandomLogits) {
  model::Rng rng(2026, "gpu_sampler_random");
  for (const int vocab : {256, 320, kQwenVocab}) {
    for (const int num_rows : {1, 7, 64}) {
      // Every combination at least once per (vocab, batch), except the large vocabulary's 1- and 7-row batches,
      // which take every 7th (the 64-row batches there cover all of them).
      const int total_rows = vocab == kQwenVocab && num_rows < 64 ? num_rows * (num_rows == 1 ? 24 : 10) : kNumCombos;
      for (int launch = 0; launch * num_rows < total_rows; ++launch) {
        Batch b{vocab};
        for (int r = 0; r < num_rows; ++r) {
          const int row_idx = launch * num_rows + r;
          const int combo = vocab == kQwenVocab && num_rows < 64 ? row_idx * 7 % kNumCombos : row_idx % kNumCombos;
          b.add(random_logits(rng, vocab, row_idx), grid_params(combo, vocab, rng));
        }
        const bool misaligned = launch % 2 == 1;
        expect_definition(
            b, sample_on_device(b, misaligned),
            fmt::format("V {} R {} launch {}{}", vocab, num_rows, launch, misaligned ? " misaligned" : ""));
      }
    }
  }
}

TEST_F(GpuSamplerTest, GreedyTakesTheLowestIdAmongTies) {
  model::Rng rng(7, "gpu_sampler_greedy");
  for (const int vocab : {320, kQwenVocab}) {
    Batch b{vocab};
    std::vector<int> want;
    const auto add = [&](std::vector<float> logits, int expected_token) {
      b.add(logits,
            SamplerRow{0.0f, 1.0f, 0, 0, b.num_rows() % 2 ? rng.uniform() : 0.0});  // greedy ignores the uniform
      want.push_back(expected_token);
    };
    std::vector<float> l = random_logits(rng, vocab, 1);
    l[vocab - 1] = l[77] = l[5] = 100.0f;
    add(l, 5);
    l = random_logits(rng, vocab, 2);
    l[vocab - 1] = l[0] = 100.0f;
    add(l, 0);
    l = random_logits(rng, vocab, 3);
    l[vocab - 1] = 1000.0f;
    add(l, vocab - 1);
    l.assign(vocab, -kInf);
    l[9] = l[3] = 1.0f;
    add(l, 3);
    l.assign(vocab, -1.0f);
    l[10] = -0.0f, l[3] = 0.0f;  // -0 == +0: a tie
    add(l, 3);
    l[10] = 0.0f, l[3] = -0.0f;
    add(l, 3);
    add(std::vector<float>(vocab, 0.25f), 0);
    l = random_logits(rng, vocab, 4);  // masked
    add(l, static_cast<int>(std::max_element(l.begin(), l.end()) - l.begin()));
    for (const bool misaligned : {false, true}) {
      const Output out = sample_on_device(b, misaligned);
      const std::vector<int> expected = expect_definition(b, out, fmt::format("greedy V {}", vocab));
      EXPECT_EQ(expected, want) << "the planted ties (a check of the test itself)";
    }
  }
}

TEST_F(GpuSamplerTest, SamplingKeepsTheDefinitionsTieOrder) {
  model::Rng rng(11, "gpu_sampler_ties");
  for (const int vocab : {320, kQwenVocab}) {
    Batch b{vocab};
    int combo = 0;
    const auto add = [&](const std::vector<float>& logits) {
      for (int rep = 0; rep < 8; ++rep, combo += 37) {  // 37 is prime to 240: the combinations cycle
        SamplerRow p = grid_params(combo % kNumCombos, vocab, rng);
        if (p.temperature == 0.0f) p.temperature = 1.0f;
        if (rep == 7) p.top_k = 5000;  // a top-k cut larger than the device's sorted list
        b.add(logits, p);
      }
    };
    add(std::vector<float>(vocab, 0.5f));  // one tie group of V
    std::vector<float> l = random_logits(rng, vocab, 1);
    for (float& x : l) x = std::min(x, 9.0f);
    for (int i = 0; i < vocab / 40; ++i) l[rng.next() % vocab] = 10.0f;  // ~3700 tied at the top for V = 151936
    add(l);
    l = random_logits(rng, vocab, 1);
    for (float& x : l) x = std::round(x * 4.0f) / 4.0f;  // a 0.25 grid: ~100 values
    add(l);
    l = random_logits(rng, vocab, 1);
    for (float& x : l) x = round_to_bf16(x);  // as if the LM head wrote bf16
    add(l);
    l = random_logits(rng, vocab, 1);
    for (float& x : l) x = std::round(x) * 10.0f;  // few values, far apart
    add(l);
    for (float& x : l) x = rng.next() % 3 == 0 ? -0.0f : (rng.next() % 2 ? 0.0f : -1.0f);  // -0 and +0 tie
    add(l);
    expect_definition(b, sample_on_device(b, false), fmt::format("ties V {}", vocab));
  }
}

TEST_F(GpuSamplerTest, MaskedLogitsAreNeverDrawn) {
  model::Rng rng(13, "gpu_sampler_masked");
  for (const int vocab : {256, kQwenVocab}) {
    Batch b{vocab};
    int combo = 5;
    const auto add = [&](const std::vector<float>& logits) {
      for (int rep = 0; rep < 6; ++rep, combo += 41) b.add(logits, grid_params(combo % kNumCombos, vocab, rng));
    };
    std::vector<float> l(vocab, -kInf);
    l[rng.next() % vocab] = 3.0f;  // one finite logit
    add(l);
    l[rng.next() % vocab] = 3.0f, l[rng.next() % vocab] = 3.0f;  // up to three, equal
    add(l);
    l = random_logits(rng, vocab, 1);
    for (float& x : l) {
      if (rng.next() % 50 != 0) x = -kInf;  // 2% finite: top_k 1000 may reach past them
    }
    add(l);
    l = random_logits(rng, vocab, 8);  // kind 3: normal * 40
    for (int i = 0; i < vocab; i += 2) l[i] = -kInf;
    add(l);
    const Output out = sample_on_device(b, true);
    const std::vector<int> expected = expect_definition(b, out, fmt::format("masked V {}", vocab));
    for (int r = 0; r < b.num_rows(); ++r) {
      if (out.tokens[r] >= 0) {
        EXPECT_NE(b.row(r)[out.tokens[r]], -kInf) << "row " << r;
      }
    }
  }
}

TEST_F(GpuSamplerTest, InvalidRowsGetMinusOneAndTheOthersAreRight) {
  model::Rng rng(17, "gpu_sampler_invalid");
  for (const int vocab : {320, kQwenVocab}) {
    Batch b{vocab};
    const SamplerRow sample{0.7f, 0.95f, 40, 0, 0.25};
    const auto valid = [&] { b.add(random_logits(rng, vocab, 1), SamplerRow{0.7f, 0.95f, 0, 0, rng.uniform()}); };
    std::vector<float> l = random_logits(rng, vocab, 1);
    valid();
    l[vocab / 2] = NAN;
    b.add(l, sample);
    valid();
    l[vocab / 2] = kInf;
    b.add(l, SamplerRow{0.0f, 1.0f, 0, 0, 0.0});
    b.add(std::vector<float>(vocab, -kInf), sample);
    valid();
    l = random_logits(rng, vocab, 1);
    for (const SamplerRow bad :
         {SamplerRow{-1.0f, 1.0f, 0, 0, 0.5}, SamplerRow{NAN, 1.0f, 0, 0, 0.5}, SamplerRow{kInf, 1.0f, 0, 0, 0.5},
          SamplerRow{1.0f, 0.0f, 0, 0, 0.5}, SamplerRow{1.0f, 1.5f, 0, 0, 0.5}, SamplerRow{1.0f, 1.0f, -3, 0, 0.5},
          SamplerRow{1.0f, 1.0f, 0, 0, 1.0}, SamplerRow{0.0f, 1.0f, 0, 0, -0.5}}) {
      b.add(l, bad);
    }
    valid();
    const Output out = sample_on_device(b, false);
    const std::vector<int> expected = expect_definition(b, out, fmt::format("invalid V {}", vocab));
    const std::vector<int> valid_rows = {0, 2, 5, b.num_rows() - 1};
    for (int r = 0; r < b.num_rows(); ++r) {
      const bool is_valid = std::find(valid_rows.begin(), valid_rows.end(), r) != valid_rows.end();
      EXPECT_EQ(expected[r] >= 0, is_valid) << "row " << r << " (a check of the test itself)";
    }
  }
}

TEST_F(GpuSamplerTest, LogprobsAreOptional) {
  model::Rng rng(19, "gpu_sampler_no_logprobs");
  Batch b{kQwenVocab};
  for (int r = 0; r < 7; ++r)
    b.add(random_logits(rng, kQwenVocab, r), grid_params(r * 53 % kNumCombos, kQwenVocab, rng));
  expect_definition(b, sample_on_device(b, false, /*with_logprobs=*/false), "no logprobs", /*with_logprobs=*/false);
}

TEST_F(GpuSamplerTest, CapturedGraphReplaysWithNewInputs) {
  constexpr int kRows = 7;
  model::Rng rng(23, "gpu_sampler_graph");
  DeviceArray<float> logits(static_cast<size_t>(kRows) * kQwenVocab);
  DeviceArray<SamplerRow> rows(kRows);
  DeviceArray<int32_t> tokens(kRows);
  DeviceArray<float> logprobs(kRows);
  const size_t workspace_bytes = gpu::sampler_workspace_bytes(kRows, kQwenVocab);
  DeviceArray<uint8_t> workspace(workspace_bytes);
  cudaStream_t stream = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  const int status = gpu::launch_sample(logits.get(), kQwenVocab, kRows, kQwenVocab, rows.get(), tokens.get(),
                                        logprobs.get(), workspace.get(), workspace_bytes, stream);
  FULCRUM_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  FULCRUM_CUDA_CHECK(static_cast<cudaError_t>(status));
  FULCRUM_CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 3; ++replay) {
    Batch b{kQwenVocab};
    for (int r = 0; r < kRows; ++r) {
      b.add(random_logits(rng, kQwenVocab, r + replay),
            grid_params((replay * kRows + r) * 31 % kNumCombos, kQwenVocab, rng));
    }
    logits.upload(b.logits);
    rows.upload(b.rows);
    tokens.upload(std::vector<int32_t>(kRows, kPoisonToken));
    logprobs.upload(std::vector<float>(kRows, kPoisonLogprob));
    FULCRUM_CUDA_CHECK(cudaGraphLaunch(exec, stream));
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));
    expect_definition(b, Output{tokens.download(), logprobs.download()}, fmt::format("graph replay {}", replay));
  }
  FULCRUM_CUDA_CHECK(cudaGraphExecDestroy(exec));
  FULCRUM_CUDA_CHECK(cudaGraphDestroy(graph));
  FULCRUM_CUDA_CHECK(cudaStreamDestroy(stream));
}

TEST_F(GpuSamplerTest, RejectsBadArguments) {
  DeviceArray<float> logits(320 * 2);
  DeviceArray<SamplerRow> rows(2);
  DeviceArray<int32_t> tokens(2);
  const size_t workspace_bytes = gpu::sampler_workspace_bytes(2, 320);
  DeviceArray<uint8_t> workspace(workspace_bytes + 16);
  const auto launch = [&](int64_t stride, int num_rows, int vocab, int32_t* out, void* ws, size_t ws_bytes) {
    return gpu::launch_sample(logits.get(), stride, num_rows, vocab, rows.get(), out, nullptr, ws, ws_bytes, nullptr);
  };
  const int invalid = static_cast<int>(cudaErrorInvalidValue);
  EXPECT_EQ(launch(320, 2, 0, tokens.get(), workspace.get(), workspace_bytes), invalid);
  EXPECT_EQ(launch(319, 2, 320, tokens.get(), workspace.get(), workspace_bytes), invalid);
  EXPECT_EQ(launch(320, 2, 320, tokens.get(), workspace.get(), workspace_bytes - 1), invalid);
  EXPECT_EQ(launch(320, 2, 320, tokens.get(), workspace.get() + 8, workspace_bytes), invalid);
  EXPECT_EQ(launch(320, 2, 320, nullptr, workspace.get(), workspace_bytes), invalid);
  EXPECT_EQ(launch(320, -1, 320, tokens.get(), workspace.get(), workspace_bytes), invalid);
  EXPECT_EQ(launch(3 << 20, 2, 3 << 20, tokens.get(), workspace.get(), workspace_bytes), invalid) << "vocab > 2^21";
  EXPECT_EQ(gpu::launch_sample(nullptr, 320, 0, 320, nullptr, nullptr, nullptr, nullptr, 0, nullptr), 0) << "no rows";
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
}

// Not a check: device time per call (CUDA events, L2 flushed before each call) at V = 151936, printed for the
// performance notes. Rows are 16 distinct normal * 3 rows, repeated.
TEST_F(GpuSamplerTest, PrintsTimings) {
  model::Rng rng(29, "gpu_sampler_timing");
  constexpr int kMaxRows = 256, kDistinct = 16, kIters = 10;
  std::vector<float> host(static_cast<size_t>(kMaxRows) * kQwenVocab);
  for (int r = 0; r < kDistinct; ++r) {
    const std::vector<float> row = random_logits(rng, kQwenVocab, 1);
    for (int copy = r; copy < kMaxRows; copy += kDistinct)
      std::copy(row.begin(), row.end(), host.begin() + static_cast<size_t>(copy) * kQwenVocab);
  }
  DeviceArray<float> logits(host.size());
  logits.upload(host);
  DeviceArray<SamplerRow> rows(kMaxRows);
  DeviceArray<int32_t> tokens(kMaxRows);
  DeviceArray<float> logprobs(kMaxRows);
  const size_t workspace_bytes = gpu::sampler_workspace_bytes(kMaxRows, kQwenVocab);
  DeviceArray<uint8_t> workspace(workspace_bytes);
  DeviceArray<uint8_t> flush(256u << 20);
  cudaEvent_t start, stop;
  FULCRUM_CUDA_CHECK(cudaEventCreate(&start));
  FULCRUM_CUDA_CHECK(cudaEventCreate(&stop));
  struct Config {
    const char* name;
    SamplerRow params;
  };
  const Config configs[] = {{"greedy", {0.0f, 1.0f, 0, 0, 0.0}},
                            {"T0.7", {0.7f, 1.0f, 0, 0, 0.5}},
                            {"T0.7 top_p 0.95", {0.7f, 0.95f, 0, 0, 0.5}},
                            {"T0.7 top_k 40", {0.7f, 1.0f, 40, 0, 0.5}},
                            {"T0.7 top_k 1000 top_p 0.95", {0.7f, 0.95f, 1000, 0, 0.5}}};
  for (const Config& config : configs) {
    for (const int num_rows : {1, 64, 256}) {
      std::vector<SamplerRow> params(num_rows, config.params);
      for (int r = 0; r < num_rows; ++r) params[r].uniform = config.params.temperature > 0 ? rng.uniform() : 0.0;
      rows.upload(params);
      float total_ms = 0.0f;
      for (int it = 0; it < kIters + 1; ++it) {
        FULCRUM_CUDA_CHECK(cudaMemset(flush.get(), it, 256u << 20));
        FULCRUM_CUDA_CHECK(cudaEventRecord(start));
        FULCRUM_CUDA_CHECK(static_cast<cudaError_t>(gpu::launch_sample(logits.get(), kQwenVocab, num_rows, kQwenVocab,
                                                                       rows.get(), tokens.get(), logprobs.get(),
                                                                       workspace.get(), workspace_bytes, nullptr)));
        FULCRUM_CUDA_CHECK(cudaEventRecord(stop));
        FULCRUM_CUDA_CHECK(cudaEventSynchronize(stop));
        float ms = 0.0f;
        FULCRUM_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
        if (it > 0) total_ms += ms;  // the first call warms up
      }
      const double us = 1000.0 * total_ms / kIters;
      const double gb_per_s = static_cast<double>(num_rows) * kQwenVocab * sizeof(float) / (us * 1e-6) / 1e9;
      fmt::print("sampler V {} R {:>3} {:<28} {:>8.1f} us  ({:.0f} GB/s of logits)\n", kQwenVocab, num_rows,
                 config.name, us, gb_per_s);
      const std::vector<int32_t> out = tokens.download();
      for (int r = 0; r < num_rows; ++r) EXPECT_GE(out[r], 0) << config.name << " row " << r;
    }
  }
  FULCRUM_CUDA_CHECK(cudaEventDestroy(start));
  FULCRUM_CUDA_CHECK(cudaEventDestroy(stop));
}

// Top logprobs of `b`'s rows for `tokens` (the sampler's, or planted) on the device.
struct TopOutput {
  std::vector<float> token_logprobs;
  std::vector<int32_t> ids;
  std::vector<float> values;
};
TopOutput top_on_device(const Batch& b, const std::vector<int32_t>& tokens, int num_top, bool misaligned) {
  const int num_rows = b.num_rows();
  int64_t stride = 0;
  size_t offset = 0;
  const std::vector<float> padded = device_layout(b, misaligned, &stride, &offset);
  DeviceArray<float> logits(padded.size());
  logits.upload(padded);
  DeviceArray<int32_t> dev_tokens(num_rows);
  dev_tokens.upload(tokens);
  DeviceArray<float> token_logprobs(num_rows);
  token_logprobs.upload(std::vector<float>(num_rows, kPoisonLogprob));
  const size_t n = static_cast<size_t>(num_rows) * num_top;
  DeviceArray<int32_t> ids(n);
  ids.upload(std::vector<int32_t>(n, kPoisonToken));
  DeviceArray<float> values(n);
  values.upload(std::vector<float>(n, kPoisonLogprob));
  FULCRUM_CUDA_CHECK(static_cast<cudaError_t>(gpu::launch_top_logprobs(logits.get() + offset, stride, num_rows, b.vocab,
                                                                       num_top, dev_tokens.get(), token_logprobs.get(),
                                                                       ids.get(), values.get(), nullptr)));
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());
  return {token_logprobs.download(), ids.download(), values.download()};
}

void expect_top_definition(const Batch& b, const std::vector<int32_t>& tokens, int num_top, const TopOutput& out,
                           const std::string& what) {
  for (int r = 0; r < b.num_rows(); ++r) {
    const size_t at = static_cast<size_t>(r) * num_top;
    if (tokens[r] < 0) {
      EXPECT_TRUE(std::isnan(out.token_logprobs[r])) << what << " row " << r;
      for (int j = 0; j < num_top; ++j) EXPECT_EQ(out.ids[at + j], -1) << what << " row " << r << " top " << j;
      continue;
    }
    const model::TokenLogprob want = model::token_logprob_with_top(b.row(r), tokens[r], std::min(num_top, b.vocab));
    EXPECT_NEAR(out.token_logprobs[r], want.logprob, kLogprobTolerance) << what << " row " << r;
    for (int j = 0; j < num_top; ++j) {
      if (j >= static_cast<int>(want.top_ids.size())) {  // N > V: the rest is empty
        EXPECT_EQ(out.ids[at + j], -1) << what << " row " << r << " top " << j;
        continue;
      }
      EXPECT_EQ(out.ids[at + j], want.top_ids[j]) << what << " row " << r << " top " << j;
      if (std::isinf(want.top_logprobs[j])) {  // a masked token: -inf exactly
        EXPECT_EQ(out.values[at + j], want.top_logprobs[j]) << what << " row " << r << " top " << j;
      } else {
        EXPECT_NEAR(out.values[at + j], want.top_logprobs[j], kLogprobTolerance) << what << " row " << r << " top " << j;
      }
      if (out.ids[at + j] == tokens[r]) {
        EXPECT_EQ(out.values[at + j], out.token_logprobs[r]) << what << " row " << r << ": one normalizer per row";
      }
      if (j > 0) EXPECT_GE(out.values[at + j - 1], out.values[at + j]) << what << " row " << r << ": descending";
    }
  }
}

TEST_F(GpuSamplerTest, TopLogprobsMatchTheDefinition) {
  model::Rng rng(23, "gpu_top_logprobs");
  for (const int vocab : {kQwenVocab, 320}) {
    for (const bool misaligned : {false, true}) {
      Batch b{vocab};
      for (int r = 0; r < 9; ++r) b.add(random_logits(rng, vocab, r), grid_params(r * 37 % kNumCombos, vocab, rng));
      const Output sampled = sample_on_device(b, misaligned);
      for (const int num_top : {1, 5, 20}) {
        const std::string what = fmt::format("V {} top {}{}", vocab, num_top, misaligned ? " misaligned" : "");
        expect_top_definition(b, sampled.tokens, num_top, top_on_device(b, sampled.tokens, num_top, misaligned), what);
      }
    }
  }
}

TEST_F(GpuSamplerTest, TopLogprobsBreakTiesByLowerIdAndSkipRefusedRows) {
  Batch b{40};
  std::vector<float> ties(40, -1.0f);
  for (const int id : {3, 17, 29}) ties[id] = 2.0f;  // three-way tie at the top, then 37 equal ones
  b.add(ties, SamplerRow{0.0f, 1.0f, 0, 0, 0.0});
  std::vector<float> masked(40, -kInf);
  masked[7] = 0.5f, masked[11] = 0.5f;  // two finite tokens: the rest of the top is -inf, by id
  b.add(masked, SamplerRow{0.0f, 1.0f, 0, 0, 0.0});
  b.add(std::vector<float>(40, 0.0f), SamplerRow{0.0f, 1.0f, 0, 0, 0.0});  // token -1: as the sampler refuses a row
  const std::vector<int32_t> tokens = {17, 11, -1};
  const TopOutput out = top_on_device(b, tokens, 5, false);
  expect_top_definition(b, tokens, 5, out, "ties");
  EXPECT_EQ((std::vector<int32_t>(out.ids.begin(), out.ids.begin() + 5)), (std::vector<int32_t>{3, 17, 29, 0, 1}));
  EXPECT_EQ((std::vector<int32_t>(out.ids.begin() + 5, out.ids.begin() + 10)), (std::vector<int32_t>{7, 11, 0, 1, 2}));
  // Past the vocabulary: ids -1.
  Batch tiny{3};
  tiny.add({1.0f, 2.0f, 3.0f}, SamplerRow{0.0f, 1.0f, 0, 0, 0.0});
  const TopOutput few = top_on_device(tiny, {2}, 5, false);
  expect_top_definition(tiny, {2}, 5, few, "N > V");
  EXPECT_EQ(few.ids[0], 2);
  EXPECT_EQ(few.ids[3], -1);
}

TEST_F(GpuSamplerTest, TopLogprobsRejectBadArguments) {
  DeviceArray<float> logits(8);
  DeviceArray<int32_t> tokens(1), ids(32);
  DeviceArray<float> lp(1), values(32);
  const auto launch = [&](int rows, int vocab, int top) {
    return gpu::launch_top_logprobs(logits.get(), 8, rows, vocab, top, tokens.get(), lp.get(), ids.get(), values.get(),
                                    nullptr);
  };
  EXPECT_EQ(launch(1, 8, 0), static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(launch(1, 8, 21), static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(launch(1, 0, 1), static_cast<int>(cudaErrorInvalidValue));
  EXPECT_EQ(launch(1, 9, 1), static_cast<int>(cudaErrorInvalidValue));  // stride below vocab
  EXPECT_EQ(launch(0, 8, 1), static_cast<int>(cudaSuccess));
}

}  // namespace
}  // namespace fulcrum::test
