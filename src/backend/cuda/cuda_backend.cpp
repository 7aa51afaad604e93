// Host side of the CUDA backend: validation (same checks and messages as the CPU reference), memory,
// cuBLAS matmul, index uploads and kernel launches. Kernels live in the .cu files beside this one.
#include "backend/cuda/cuda_backend.hpp"

#include <cmath>
#include <algorithm>
#include <limits>
#include <utility>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/kernels.hpp"

namespace fulcrum::backend {

using model::Tensor;

namespace {

void check_cuda_tensor(const Tensor& t, const char* what) {
  FULCRUM_CHECK(t.device() == model::Device::kCuda, "cuda backend: {} is not a device tensor", what);
}

// Device memory for the duration of one operation, allocated and freed in stream order.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    if (bytes > 0) FULCRUM_CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream_));
  }
  ~Scratch() {
    if (ptr_ != nullptr) cudaFreeAsync(ptr_, stream_);  // no throw from a destructor; errors resurface later
  }
  Scratch(Scratch&& other) noexcept : ptr_(std::exchange(other.ptr_, nullptr)), stream_(other.stream_) {}
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  Scratch& operator=(Scratch&&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

// Copies a host span into fresh stream-ordered device memory. The runtime documents an asynchronous copy
// from pageable memory only as "might be synchronous", so the stream is synchronized before returning: the
// span may go away right after (a pinned staging buffer would remove this wait; correctness first).
template <typename T>
Scratch upload_span(std::span<const T> values, cudaStream_t stream) {
  Scratch scratch(values.size_bytes(), stream);
  if (!values.empty()) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(scratch.as<void>(), values.data(), values.size_bytes(), cudaMemcpyHostToDevice,
                                       stream));
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  return scratch;
}

int checked_int(int64_t v, const char* what) {
  FULCRUM_CHECK(v >= 0 && v <= std::numeric_limits<int>::max(), "cuda backend: {} = {} does not fit cuBLAS' int", what,
                v);
  return static_cast<int>(v);
}

}  // namespace

int CudaBackend::device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    (void)cudaGetLastError();  // clear the sticky-free error (no driver, no device)
    return 0;
  }
  return count;
}

CudaBackend::CudaBackend(int device_idx) : device_idx_(device_idx) {
  const int count = device_count();
  FULCRUM_CHECK(device_idx >= 0 && device_idx < count, "no CUDA device {} (this process sees {} CUDA devices)",
                device_idx, count);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  int max_shared = 0;
  FULCRUM_CUDA_CHECK(cudaDeviceGetAttribute(&max_shared, cudaDevAttrMaxSharedMemoryPerBlockOptin, device_idx_));
  max_shared_bytes_per_block_ = static_cast<size_t>(max_shared);
  cudaStream_t stream = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  cublasHandle_t handle = nullptr;
  const cublasStatus_t status = cublasCreate(&handle);
  if (status != CUBLAS_STATUS_SUCCESS) {
    cudaStreamDestroy(stream_);
    FULCRUM_CUBLAS_CHECK(status);
  }
  cublas_ = handle;
  FULCRUM_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
  // Plain fp32: no TF32 or other reduced-precision shortcut.
  FULCRUM_CUBLAS_CHECK(cublasSetMathMode(cublas_, CUBLAS_PEDANTIC_MATH));
}

CudaBackend::~CudaBackend() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CudaBackend::synchronize() { FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

Tensor CudaBackend::zeros(std::vector<int64_t> shape) {
  int64_t numel = 1;
  for (const int64_t d : shape) {
    FULCRUM_CHECK(d >= 0, "cuda backend: negative dimension {}", d);
    numel *= d;
  }
  const size_t bytes = static_cast<size_t>(std::max<int64_t>(numel, 1)) * sizeof(float);
  void* ptr = nullptr;
  FULCRUM_CUDA_CHECK(cudaMalloc(&ptr, bytes));
  // The deleter waits for the device first: a tensor may go while kernels that read it are queued.
  std::shared_ptr<void> storage(ptr, [](void* p) {
    cudaDeviceSynchronize();
    cudaFree(p);
  });
  FULCRUM_CUDA_CHECK(cudaMemsetAsync(ptr, 0, bytes, stream_));
  return Tensor(std::move(storage), static_cast<float*>(ptr), std::move(shape), model::Device::kCuda);
}

void CudaBackend::upload(const Tensor& dst, std::span<const float> src) {
  check_cuda_tensor(dst, "upload destination");
  FULCRUM_CHECK(static_cast<int64_t>(src.size()) == dst.numel(), "upload of {} values into a tensor of {}",
                src.size(), dst.numel());
  if (src.empty()) return;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), src.size_bytes(), cudaMemcpyHostToDevice, stream_));
  synchronize();
}

std::vector<float> CudaBackend::download(const Tensor& src) {
  check_cuda_tensor(src, "download source");
  std::vector<float> out(static_cast<size_t>(src.numel()));
  if (out.empty()) return out;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(out.data(), src.data(), out.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                     stream_));
  synchronize();
  return out;
}

void CudaBackend::copy(const Tensor& dst, const Tensor& src) {
  check_cuda_tensor(dst, "copy destination");
  check_cuda_tensor(src, "copy source");
  FULCRUM_CHECK(dst.numel() == src.numel(), "copy of {} values into a tensor of {}", src.numel(), dst.numel());
  if (src.numel() == 0 || dst.data() == src.data()) return;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(dst.data(), src.data(), static_cast<size_t>(src.numel()) * sizeof(float),
                                     cudaMemcpyDeviceToDevice, stream_));
}

Tensor CudaBackend::embedding(const Tensor& table, std::span<const int32_t> token_ids) {
  check_cuda_tensor(table, "embedding table");
  const int64_t vocab_size = table.dim(0);
  const int64_t hidden_size = table.dim(1);
  for (const int32_t id : token_ids) {
    FULCRUM_CHECK(id >= 0 && id < vocab_size, "token id {} out of range [0, {})", id, vocab_size);
  }
  Tensor out = zeros({static_cast<int64_t>(token_ids.size()), hidden_size});  // [num_tokens, hidden_size]
  const Scratch ids = upload_span(token_ids, stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_gather_rows(table.data(), ids.as<int32_t>(), out.data(),
                                              static_cast<int64_t>(token_ids.size()), hidden_size, stream_));
  return out;
}

Tensor CudaBackend::rms_norm(const Tensor& x, const Tensor& weight, float eps) {
  check_cuda_tensor(x, "rms_norm input");
  check_cuda_tensor(weight, "rms_norm weight");
  const int64_t dim = weight.numel();
  FULCRUM_CHECK(dim > 0 && x.numel() % dim == 0, "rms_norm: {} values are not rows of {}", x.numel(), dim);
  Tensor out = zeros(x.shape());  // same shape as x
  FULCRUM_CUDA_CHECK(cuda::launch_rms_norm(x.data(), weight.data(), out.data(), x.numel() / dim, dim, eps, stream_));
  return out;
}

Tensor CudaBackend::matmul(const Tensor& x, const Tensor& weight) {
  check_cuda_tensor(x, "matmul input");
  check_cuda_tensor(weight, "matmul weight");
  FULCRUM_CHECK(x.rank() == 2 && weight.rank() == 2 && x.dim(1) == weight.dim(1),
                "matmul: x [{}, {}] does not match weight [{}, {}]", x.rank() ? x.dim(0) : 0, x.rank() > 1 ? x.dim(1) : 0,
                weight.rank() ? weight.dim(0) : 0, weight.rank() > 1 ? weight.dim(1) : 0);
  const int64_t num_rows = x.dim(0), in_features = x.dim(1), out_features = weight.dim(0);
  Tensor out = zeros({num_rows, out_features});  // [num_rows, out_features]
  if (num_rows == 0 || out_features == 0 || in_features == 0) return out;
  // Row-major out [M, N] = x [M, K] @ W [N, K]^T is, read column-major, out^T [N, M] = W^T^T [N, K] @ x^T [K, M]:
  // A = weight (column-major K x N, transposed), B = x (column-major K x M), C = out (column-major N x M).
  const int m = checked_int(out_features, "out_features"), n = checked_int(num_rows, "num_rows"),
            k = checked_int(in_features, "in_features");
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, m, n, k, &alpha, weight.data(), CUDA_R_32F, k,
                                    x.data(), CUDA_R_32F, k, &beta, out.data(), CUDA_R_32F, m,
                                    CUBLAS_COMPUTE_32F_PEDANTIC, CUBLAS_GEMM_DEFAULT));
  return out;
}

void CudaBackend::rope_inplace(const Tensor& x, std::span<const int32_t> positions, double rope_theta) {
  check_cuda_tensor(x, "rope input");
  const int64_t num_tokens = x.dim(0), num_heads = x.dim(1), head_dim = x.dim(2);
  FULCRUM_CHECK(static_cast<int64_t>(positions.size()) == num_tokens, "rope: {} positions for {} tokens",
                positions.size(), num_tokens);
  const int64_t half = head_dim / 2;
  // The angles on the host exactly as the CPU reference computes them (fp32 inv_freq as HF), so that the
  // device only rotates: cos_sin [num_tokens, 2, half].
  const std::vector<float> inv_freq = model::rope_inv_freq(head_dim, rope_theta);
  std::vector<float> cos_sin(static_cast<size_t>(num_tokens * 2 * half));
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      cos_sin[t * 2 * half + i] = std::cos(angle);
      cos_sin[t * 2 * half + half + i] = std::sin(angle);
    }
  }
  const Scratch table = upload_span(std::span<const float>(cos_sin), stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_rope(x.data(), table.as<float>(), num_tokens, num_heads, head_dim, stream_));
}

Tensor CudaBackend::paged_attention(const Tensor& q, const Tensor& k_pool, const Tensor& v_pool, model::KvPages pages,
                                   int64_t start_pos) {
  check_cuda_tensor(q, "attention query");
  check_cuda_tensor(k_pool, "attention key pool");
  check_cuda_tensor(v_pool, "attention value pool");
  const int64_t num_tokens = q.dim(0), num_heads = q.dim(1), head_dim = q.dim(2);
  const int64_t num_kv_heads = k_pool.dim(1);
  model::check_paged_attention(q, k_pool, v_pool, pages, start_pos);
  const size_t shared_bytes = cuda::attention_shared_bytes(head_dim, start_pos + num_tokens);
  FULCRUM_CHECK(shared_bytes <= max_shared_bytes_per_block_,
                "attention: {} keys of head_dim {} need {} bytes of shared memory, the device allows {}",
                start_pos + num_tokens, head_dim, shared_bytes, max_shared_bytes_per_block_);
  Tensor out = zeros({num_tokens, num_heads * head_dim});  // [num_tokens, num_heads * head_dim]
  if (num_tokens == 0) return out;
  // Only the pages that hold positions [0, start_pos + num_tokens).
  const int64_t num_used_pages = (start_pos + num_tokens + pages.page_size - 1) / pages.page_size;
  const Scratch page_ids = upload_span(pages.page_ids.first(static_cast<size_t>(num_used_pages)), stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_paged_attention(q.data(), k_pool.data(), v_pool.data(), page_ids.as<int32_t>(),
                                                  pages.page_size, out.data(), num_tokens, num_heads, num_kv_heads,
                                                  head_dim, start_pos, stream_));
  return out;
}

Tensor CudaBackend::silu_mul(const Tensor& gate_up) {
  check_cuda_tensor(gate_up, "silu_mul input");
  FULCRUM_CHECK(gate_up.rank() == 2 && gate_up.dim(1) % 2 == 0, "silu_mul: input is not [rows, 2 * n]");
  const int64_t num_rows = gate_up.dim(0), width = gate_up.dim(1) / 2;
  Tensor out = zeros({num_rows, width});  // [num_rows, width]
  FULCRUM_CUDA_CHECK(cuda::launch_silu_mul(gate_up.data(), out.data(), num_rows, width, stream_));
  return out;
}

void CudaBackend::add_inplace(const Tensor& x, const Tensor& y) {
  check_cuda_tensor(x, "add destination");
  check_cuda_tensor(y, "add operand");
  FULCRUM_CHECK(x.shape() == y.shape(), "add: shapes differ");
  FULCRUM_CUDA_CHECK(cuda::launch_add_inplace(x.data(), y.data(), x.numel(), stream_));
}

model::RouterChoice CudaBackend::route(const Tensor& router_logits, int top_k, bool norm_topk_prob) {
  check_cuda_tensor(router_logits, "router logits");
  const int64_t num_tokens = router_logits.dim(0), num_experts = router_logits.dim(1);
  FULCRUM_CHECK(top_k > 0 && top_k <= num_experts, "route: top-k {} out of range for {} experts", top_k, num_experts);
  FULCRUM_CHECK(num_experts <= cuda::kMaxRouteExperts, "route: {} experts, the CUDA router handles at most {}",
                num_experts, cuda::kMaxRouteExperts);
  model::RouterChoice choice;
  choice.top_k = top_k;
  const size_t num_entries = static_cast<size_t>(num_tokens * top_k);
  choice.expert_ids.resize(num_entries);
  choice.weights.resize(num_entries);
  if (num_entries == 0) return choice;
  const Scratch ids(num_entries * sizeof(int32_t), stream_);
  const Scratch weights(num_entries * sizeof(float), stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_route(router_logits.data(), ids.as<int32_t>(), weights.as<float>(), num_tokens,
                                        static_cast<int>(num_experts), top_k, norm_topk_prob, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(choice.expert_ids.data(), ids.as<int32_t>(), num_entries * sizeof(int32_t),
                                     cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(choice.weights.data(), weights.as<float>(), num_entries * sizeof(float),
                                     cudaMemcpyDeviceToHost, stream_));
  synchronize();
  return choice;
}

Tensor CudaBackend::gather_rows(const Tensor& x, std::span<const int32_t> row_idx) {
  check_cuda_tensor(x, "gather_rows source");
  for (const int32_t row : row_idx) {
    FULCRUM_CHECK(row >= 0 && row < x.dim(0), "gather_rows: row {} out of range", row);
  }
  std::vector<int64_t> shape = x.shape();
  shape[0] = static_cast<int64_t>(row_idx.size());
  Tensor out = zeros(shape);  // [row_idx.size(), row...]
  if (row_idx.empty()) return out;
  const Scratch idx = upload_span(row_idx, stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_gather_rows(x.data(), idx.as<int32_t>(), out.data(),
                                              static_cast<int64_t>(row_idx.size()), x.row_numel(), stream_));
  return out;
}

void CudaBackend::scatter_rows(const Tensor& dst, const Tensor& src, std::span<const int32_t> row_idx) {
  check_cuda_tensor(dst, "scatter_rows destination");
  check_cuda_tensor(src, "scatter_rows source");
  const int64_t width = dst.row_numel();
  FULCRUM_CHECK(src.row_numel() == width && src.dim(0) == static_cast<int64_t>(row_idx.size()),
                "scatter_rows: {} source rows of {} for {} indices into rows of {}", src.dim(0), src.row_numel(),
                row_idx.size(), width);
  for (const int32_t row : row_idx) {
    FULCRUM_CHECK(row >= 0 && row < dst.dim(0), "scatter_rows: row {} out of range", row);
  }
  if (row_idx.empty()) return;
  const Scratch idx = upload_span(row_idx, stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_scatter_rows(dst.data(), src.data(), idx.as<int32_t>(),
                                               static_cast<int64_t>(row_idx.size()), width, stream_));
}

Tensor CudaBackend::weighted_sum(const Tensor& rows, std::span<const float> weights, int k) {
  check_cuda_tensor(rows, "weighted_sum rows");
  FULCRUM_CHECK(k > 0 && rows.dim(0) % k == 0 && static_cast<int64_t>(weights.size()) == rows.dim(0),
                "weighted_sum: {} rows and {} weights do not form groups of {}", rows.dim(0), weights.size(), k);
  const int64_t num_tokens = rows.dim(0) / k, dim = rows.row_numel();
  Tensor out = zeros({num_tokens, dim});  // [num_tokens, dim]
  if (num_tokens == 0) return out;
  const Scratch w = upload_span(weights, stream_);
  FULCRUM_CUDA_CHECK(cuda::launch_weighted_sum(rows.data(), w.as<float>(), out.data(), num_tokens, k, dim, stream_));
  return out;
}

}  // namespace fulcrum::backend
