// gpu::FlashInferAttention: validation, buffers and the plan/run bookkeeping (host compiler); the FlashInfer calls
// are in src/gpu/flashinfer/*.cu behind flashinfer_launch.hpp.
#include "gpu/flashinfer/flashinfer_attention.hpp"

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"
#include "eplb/error.hpp"
#include "gpu/flashinfer/flashinfer_launch.hpp"

namespace fulcrum::gpu {
namespace {

namespace fi = flashinfer_launch;

size_t align16(size_t bytes) { return (bytes + 15) / 16 * 16; }
int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// FlashInfer's messages name a function, file and line; keep them on one line.
std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

// Makes device_idx current for a scope (construction and destruction may run on any device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device_idx) {
    FULCRUM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device_idx) FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  }
  ~DeviceGuard() { cudaSetDevice(previous_); }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

// What a captured run() baked into its launches: it must not change across the re-plans before its replays.
struct LaunchLayout {
  FlashInferAttention::Kernel kernel = FlashInferAttention::Kernel::kNone;
  int num_seqs = 0;
  int num_tokens = 0;
  std::vector<int64_t> plan;  // FlashInfer's plan info (workspace offsets, padded grid, tile size)
  bool operator==(const LaunchLayout&) const = default;
};

const char* kernel_name(FlashInferAttention::Kernel kernel) {
  switch (kernel) {
    case FlashInferAttention::Kernel::kDecode: return "decode";
    case FlashInferAttention::Kernel::kPrefill: return "prefill";
    case FlashInferAttention::Kernel::kNone: break;
  }
  return "empty";
}

}  // namespace

struct FlashInferAttention::Impl {
  int num_heads = 0, num_kv_heads = 0, head_dim = 0, page_size = 0, max_tokens = 0, max_seqs = 0, device_idx = 0;
  fi::Workspace ws;
  int32_t* last_page_len = nullptr;         // device [max_seqs] (decode: FlashInfer's per-sequence last page fill)
  int32_t* last_page_len_pinned = nullptr;  // its host mirror, uploaded by plan()
  cudaEvent_t upload_done = nullptr;        // the last plan's copies out of the pinned buffers

  // Host copies of the planned batch (FlashInfer's plans take non-const arrays); reserved at construction.
  std::vector<int32_t> q_indptr, kv_page_indptr, kv_len, kv_page_count_indptr;
  bool planned = false;
  bool cuda_graph = false;
  LaunchLayout layout;
  std::optional<LaunchLayout> captured;  // set by a run() under stream capture

  ~Impl() {
    // Best effort: a destructor must not throw. Wait for this object's uploads and kernels to be done first.
    if (ws.float_buffer == nullptr && ws.int_buffer == nullptr && ws.int_pinned == nullptr && last_page_len == nullptr &&
        last_page_len_pinned == nullptr && upload_done == nullptr) {
      return;  // the constructor refused before touching the device
    }
    int previous = 0;
    if (cudaGetDevice(&previous) != cudaSuccess) return;
    cudaSetDevice(device_idx);
    cudaDeviceSynchronize();
    if (upload_done != nullptr) cudaEventDestroy(upload_done);
    cudaFree(ws.float_buffer);
    cudaFree(ws.int_buffer);
    cudaFree(last_page_len);
    cudaFreeHost(ws.int_pinned);
    cudaFreeHost(last_page_len_pinned);
    cudaSetDevice(previous);
  }

  void check_device() const {
    int current = -1;
    FULCRUM_CUDA_CHECK(cudaGetDevice(&current));
    FULCRUM_CHECK(current == device_idx, "FlashInferAttention: built for device {}, called with device {} current",
                  device_idx, current);
  }
};

bool FlashInferAttention::supports(int head_dim, int num_heads, int num_kv_heads) {
  if (head_dim != fi::kHeadDim || num_kv_heads <= 0 || num_heads <= 0 || num_heads % num_kv_heads != 0) return false;
  const int group = num_heads / num_kv_heads;
  return group == 1 || group == 2 || group == 4 || group == 8 || group == 16;
}

FlashInferAttention::FlashInferAttention(int num_heads, int num_kv_heads, int head_dim, int page_size, int max_tokens,
                                         int max_seqs, int device_idx)
    : impl_(std::make_unique<Impl>()) {
  FULCRUM_CHECK(supports(head_dim, num_heads, num_kv_heads),
                "FlashInferAttention: head_dim {} with {} query / {} KV heads is not supported (head_dim 128, GQA group "
                "1, 2, 4, 8 or 16)", head_dim, num_heads, num_kv_heads);
  FULCRUM_CHECK(page_size >= 1 && max_tokens >= 1 && max_seqs >= 1,
                "FlashInferAttention: page_size {}, max_tokens {}, max_seqs {} must be positive", page_size, max_tokens,
                max_seqs);
  // Only the per-head SM90 schedule is instantiated; FlashInfer switches to the other one above this bound.
  const int64_t works_per_head = ceil_div(max_tokens, fi::kSm90CtaTileQ) + max_seqs - 1;
  FULCRUM_CHECK(works_per_head <= fi::kSm90MaxWorksPerHead,
                "FlashInferAttention: ceil(max_tokens {} / 128) + max_seqs {} - 1 = {} exceeds {} query tiles per head",
                max_tokens, max_seqs, works_per_head, fi::kSm90MaxWorksPerHead);
  Impl& m = *impl_;
  m.num_heads = num_heads;
  m.num_kv_heads = num_kv_heads;
  m.head_dim = head_dim;
  m.page_size = page_size;
  m.max_tokens = max_tokens;
  m.max_seqs = max_seqs;
  m.device_idx = device_idx;

  const DeviceGuard guard(device_idx);
  cudaDeviceProp prop{};
  FULCRUM_CUDA_CHECK(cudaGetDeviceProperties(&prop, device_idx));
  FULCRUM_CHECK(prop.major == 9 && prop.minor == 0,
                "FlashInferAttention: the kernels are built for sm_90a, device {} ({}) is sm_{}{}", device_idx,
                prop.name, prop.major, prop.minor);
  const int64_t num_sm = prop.multiProcessorCount;

  // Workspace bounds, from FlashInfer's plans (attention/scheduler.cuh). FlashInfer checks every allocation against
  // the buffer size (a plan that would overflow fails with its message), so these only need to be large enough.
  // FA2 decode (T = S <= max_seqs, query tile 16 rows of packed (token, head) pairs, group <= 16 so one tile per
  // sequence): at most P = max(2 * num_sm / num_kv_heads, S) CTAs (padded ones in CUDA-graph mode), partial
  // outputs for ceil(P * 16 / group) query rows of every head in fp32-sized slots.
  const int64_t group = num_heads / num_kv_heads;
  const int64_t fa2_ctas = std::max<int64_t>(2 * num_sm / num_kv_heads, max_seqs);
  const int64_t fa2_rows = ceil_div(fa2_ctas * fi::kDecodeCtaTileQ, group);
  const size_t fa2_float = align16(sizeof(float) * num_heads * fa2_rows * head_dim) +
                           align16(sizeof(float) * num_heads * fa2_rows) + 256;
  const size_t fa2_int = 3 * align16(4 * fa2_ctas) + 2 * align16(4 * (max_seqs + 1)) + align16(fa2_ctas) + 3 * 16 + 256;
  // SM90 prefill: per head at most ceil(T / 128) + S - 1 query tiles, 7 int32 arrays of them + work_indptr.
  const int64_t sm90_works = works_per_head * num_heads;
  const size_t sm90_int = 7 * align16(4 * sm90_works) + align16(4 * (num_sm + 1)) + 256;
  m.ws.float_bytes = fa2_float;
  m.ws.int_bytes = std::max(fa2_int, sm90_int);

  FULCRUM_CUDA_CHECK(cudaMalloc(&m.ws.float_buffer, m.ws.float_bytes));
  FULCRUM_CUDA_CHECK(cudaMalloc(&m.ws.int_buffer, m.ws.int_bytes));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&m.ws.int_pinned, m.ws.int_bytes));
  FULCRUM_CUDA_CHECK(cudaMalloc(&m.last_page_len, sizeof(int32_t) * max_seqs));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&m.last_page_len_pinned, sizeof(int32_t) * max_seqs));
  FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&m.upload_done, cudaEventDisableTiming));
  m.q_indptr.reserve(max_seqs + 1);
  m.kv_page_indptr.reserve(max_seqs + 1);
  m.kv_len.reserve(max_seqs);
  m.kv_page_count_indptr.reserve(max_seqs + 1);
}

FlashInferAttention::~FlashInferAttention() = default;

void FlashInferAttention::release_captured_graph() { impl_->captured.reset(); }

FlashInferAttention::Kernel FlashInferAttention::planned_kernel() const { return impl_->layout.kernel; }

size_t FlashInferAttention::device_workspace_bytes() const {
  return impl_->ws.float_bytes + impl_->ws.int_bytes + sizeof(int32_t) * impl_->max_seqs;
}

size_t FlashInferAttention::pinned_bytes() const { return impl_->ws.int_bytes + sizeof(int32_t) * impl_->max_seqs; }

void FlashInferAttention::plan(std::span<const int32_t> q_indptr, std::span<const int32_t> kv_page_indptr,
                               std::span<const int32_t> kv_len, bool for_cuda_graph, CUstream_st* stream) {
  Impl& m = *impl_;
  m.check_device();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FULCRUM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  FULCRUM_CHECK(capture == cudaStreamCaptureStatusNone,
                "FlashInferAttention::plan: the stream is being captured (plan on the host before capture and replays)");

  const int64_t num_seqs = static_cast<int64_t>(kv_len.size());
  FULCRUM_CHECK(num_seqs <= m.max_seqs, "FlashInferAttention::plan: {} sequences, built for at most {}", num_seqs,
                m.max_seqs);
  FULCRUM_CHECK(q_indptr.size() == kv_len.size() + 1 && kv_page_indptr.size() == kv_len.size() + 1,
                "FlashInferAttention::plan: {} sequences need {} q_indptr and kv_page_indptr values, got {} and {}",
                num_seqs, num_seqs + 1, q_indptr.size(), kv_page_indptr.size());
  FULCRUM_CHECK(q_indptr[0] == 0, "FlashInferAttention::plan: q_indptr[0] is {}, must be 0", q_indptr[0]);
  FULCRUM_CHECK(kv_page_indptr[0] >= 0, "FlashInferAttention::plan: kv_page_indptr[0] is {}", kv_page_indptr[0]);
  bool every_seq_one_query = true;
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int32_t n = q_indptr[s + 1] - q_indptr[s], pages = kv_page_indptr[s + 1] - kv_page_indptr[s];
    FULCRUM_CHECK(n >= 0 && n <= kv_len[s],
                  "FlashInferAttention::plan: sequence {} has {} query tokens and kv_len {} (need 0 <= q len <= kv_len)",
                  s, n, kv_len[s]);
    FULCRUM_CHECK(pages >= 0 && int64_t{pages} * m.page_size >= kv_len[s],
                  "FlashInferAttention::plan: sequence {} has kv_len {} but {} pages of {}", s, kv_len[s], pages,
                  m.page_size);
    every_seq_one_query = every_seq_one_query && n == 1;
  }
  const int64_t num_tokens = q_indptr[num_seqs];
  FULCRUM_CHECK(num_tokens <= m.max_tokens, "FlashInferAttention::plan: {} query tokens, built for at most {}",
                num_tokens, m.max_tokens);

  m.planned = false;
  LaunchLayout next;
  next.num_seqs = static_cast<int>(num_seqs);
  next.num_tokens = static_cast<int>(num_tokens);
  next.kernel = num_tokens == 0 ? Kernel::kNone : every_seq_one_query ? Kernel::kDecode : Kernel::kPrefill;
  // A captured graph's sizes and kernel are checked before the plan rewrites the workspace it reads (the
  // workspace offsets, known only after FlashInfer's plan, are checked below).
  const bool keeps_capture = !for_cuda_graph || !m.captured.has_value() ||
                             (next.kernel == m.captured->kernel && next.num_seqs == m.captured->num_seqs &&
                              next.num_tokens == m.captured->num_tokens);
  FULCRUM_CHECK(keeps_capture,
                "FlashInferAttention::plan: the captured graph ran the {} kernel on {} sequences / {} tokens; this plan "
                "needs the {} kernel on {} / {} (re-plan a captured batch with the same sizes)",
                kernel_name(m.captured->kernel), m.captured->num_seqs, m.captured->num_tokens,
                kernel_name(next.kernel), next.num_seqs, next.num_tokens);
  m.q_indptr.assign(q_indptr.begin(), q_indptr.end());
  m.kv_page_indptr.assign(kv_page_indptr.begin(), kv_page_indptr.end());
  m.kv_len.assign(kv_len.begin(), kv_len.end());

  if (next.kernel != Kernel::kNone) {
    // The previous plan's upload may still read the pinned buffer this plan rewrites.
    FULCRUM_CUDA_CHECK(cudaEventSynchronize(m.upload_done));
    std::string error;
    cudaError_t status = cudaSuccess;
    if (next.kernel == Kernel::kDecode) {
      // FA2's plan splits KV by page counts: give it the pages the kernel reads, without spare ones (the kernel's
      // page offsets come from the batch's own kv_page_indptr on the device).
      m.kv_page_count_indptr.assign(1, 0);
      for (int64_t s = 0; s < num_seqs; ++s) {
        m.kv_page_count_indptr.push_back(m.kv_page_count_indptr.back() +
                                         static_cast<int32_t>(ceil_div(kv_len[s], m.page_size)));
      }
      status = fi::plan_decode(m.ws, m.q_indptr.data(), m.kv_page_count_indptr.data(), next.num_seqs, m.num_heads,
                               m.num_kv_heads, m.page_size, for_cuda_graph, stream, &next.plan, &error);
      if (status == cudaSuccess) {
        // FlashInfer's length of sequence s is (pages - 1) * page_size + last_page_len[s] over the batch's own page
        // count, spare pages included: this last_page_len makes it kv_len[s] (with spare pages the value is below 1
        // and FlashInfer's uint32 sum wraps to kv_len). The same lengths the plan split by, so the kernel and its
        // schedule agree; batch.kv_len on the device is not read.
        for (int64_t s = 0; s < num_seqs; ++s) {
          m.last_page_len_pinned[s] = kv_len[s] - (kv_page_indptr[s + 1] - kv_page_indptr[s] - 1) * m.page_size;
        }
        status = cudaMemcpyAsync(m.last_page_len, m.last_page_len_pinned, sizeof(int32_t) * num_seqs,
                                 cudaMemcpyHostToDevice, stream);
      }
    } else {
      status = fi::plan_prefill(m.ws, m.q_indptr.data(), m.kv_page_indptr.data(), m.kv_len.data(), next.num_seqs,
                                next.num_tokens, m.num_heads, m.num_kv_heads, m.page_size, for_cuda_graph, stream,
                                &next.plan, &error);
    }
    // Recorded even after a failure: an upload FlashInfer enqueued may still read the pinned buffer.
    const cudaError_t recorded = cudaEventRecord(m.upload_done, stream);
    FULCRUM_CHECK(status == cudaSuccess, "FlashInferAttention::plan ({} kernel, {} sequences, {} tokens) failed: {}{}",
                  kernel_name(next.kernel), num_seqs, num_tokens, cudaGetErrorName(status),
                  error.empty() ? std::string() : ": " + one_line(error));
    FULCRUM_CUDA_CHECK(recorded);
  }

  FULCRUM_CHECK(!for_cuda_graph || !m.captured.has_value() || next.plan == m.captured->plan,
                "FlashInferAttention::plan: FlashInfer's CUDA-graph plan for {} sequences / {} tokens laid the workspace "
                "out differently from the captured one", next.num_seqs, next.num_tokens);
  m.layout = std::move(next);
  m.cuda_graph = for_cuda_graph;
  m.planned = true;
}

void FlashInferAttention::run(const AttentionBatch& batch, CUstream_st* stream) {
  Impl& m = *impl_;
  m.check_device();
  FULCRUM_CHECK(m.planned, "FlashInferAttention::run before a successful plan");
  FULCRUM_CHECK(batch.num_heads == m.num_heads && batch.num_kv_heads == m.num_kv_heads &&
                    batch.head_dim == m.head_dim && batch.page_size == m.page_size,
                "FlashInferAttention::run: batch has {} / {} heads, head_dim {}, page_size {}; built for {} / {}, {}, {}",
                batch.num_heads, batch.num_kv_heads, batch.head_dim, batch.page_size, m.num_heads, m.num_kv_heads,
                m.head_dim, m.page_size);
  FULCRUM_CHECK(batch.num_seqs == m.layout.num_seqs && batch.num_tokens == m.layout.num_tokens,
                "FlashInferAttention::run: batch has {} sequences / {} tokens, the plan {} / {}", batch.num_seqs,
                batch.num_tokens, m.layout.num_seqs, m.layout.num_tokens);
  if (m.layout.kernel == Kernel::kNone) return;
  FULCRUM_CHECK(batch.q != nullptr && batch.out != nullptr && batch.k_pool != nullptr && batch.v_pool != nullptr &&
                    batch.q_indptr != nullptr && batch.kv_page_indptr != nullptr && batch.page_ids != nullptr &&
                    batch.kv_len != nullptr,
                "FlashInferAttention::run: a null device pointer in the batch");
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  FULCRUM_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    FULCRUM_CHECK(m.cuda_graph, "FlashInferAttention::run is being captured after a plan without for_cuda_graph");
    m.captured = m.layout;
  }
  std::string error;
  const cudaError_t status = m.layout.kernel == Kernel::kDecode
                                 ? fi::run_decode(m.ws, m.layout.plan, batch, m.last_page_len, stream, &error)
                                 : fi::run_prefill(m.ws, m.layout.plan, batch, stream, &error);
  FULCRUM_CHECK(status == cudaSuccess, "FlashInferAttention::run ({} kernel) failed: {}{}",
                kernel_name(m.layout.kernel), cudaGetErrorName(status),
                error.empty() ? std::string() : ": " + one_line(error));
}

}  // namespace fulcrum::gpu
