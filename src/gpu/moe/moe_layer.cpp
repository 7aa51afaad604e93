// GPU MoE layer: the shared workspace, buffers, cuBLAS / CUTLASS calls and the launch sequence (kernels in
// moe_kernels.cu, the grouped GEMM in src/gpu/cutlass/).
#include "gpu/moe/moe_layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <utility>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "eplb/error.hpp"
#include "gpu/ablation.hpp"
#include "gpu/env_switch.hpp"
#include "gpu/kernels/expert_skinny_gemm.hpp"
#include "gpu/kernels/skinny_gemm.hpp"
#include "model/random_weights.hpp"

namespace fulcrum::backend {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes == 0) return;
  const cudaError_t status = cudaMalloc(&ptr_, bytes);
  if (status == cudaErrorMemoryAllocation) {
    cudaGetLastError();  // clear it: the caller reports, the device stays usable
    size_t free_bytes = 0, total_bytes = 0;
    cudaMemGetInfo(&free_bytes, &total_bytes);
    throw Error(fmt::format("GPU out of memory: a buffer of {:.1f} MiB does not fit ({:.1f} MiB free of {:.1f} MiB); "
                            "ask for fewer sequences, tokens or KV pages", bytes / 1048576.0, free_bytes / 1048576.0,
                            total_bytes / 1048576.0));
  }
  FULCRUM_CUDA_CHECK(status);
}
DeviceBuffer::~DeviceBuffer() {
  if (ptr_ != nullptr) cudaFree(ptr_);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    if (ptr_ != nullptr) cudaFree(ptr_);
    ptr_ = std::exchange(other.ptr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

namespace {

// FLOPs of the expert stage over `rows` rows: gate_up [rows, H] x [H, 2I] and down [rows, I] x [I, H].
double expert_flops_of_rows(double rows, const MoeLayerShape& shape) {
  return rows * 6.0 * static_cast<double>(shape.hidden_size) * static_cast<double>(shape.moe_intermediate_size);
}

template <typename T>
DeviceBuffer device_array(int64_t n) {
  return DeviceBuffer(sizeof(T) * static_cast<size_t>(n < 1 ? 1 : n));
}

template <typename T>
void copy_host_array(DeviceBuffer& buffer, const std::vector<T>& host, cudaStream_t stream) {
  if (!host.empty()) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(buffer.as<T>(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice, stream));
  }
}

template <typename T>
DeviceBuffer upload_array(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer buffer = device_array<T>(static_cast<int64_t>(host.size()));
  copy_host_array(buffer, host, stream);
  return buffer;
}

// `host` into `buffer`: in place when the buffer has exactly its size (a captured CUDA graph keeps reading the
// same address, so a dispatch table switched between steps reaches graphs captured before), else a new buffer.
template <typename T>
void upload_into(DeviceBuffer& buffer, const std::vector<T>& host, cudaStream_t stream) {
  const size_t bytes = sizeof(T) * std::max<size_t>(host.size(), 1);
  if (buffer.bytes() != bytes) {
    buffer = upload_array(host, stream);
  } else {
    copy_host_array(buffer, host, stream);
  }
}

// cuBLAS's scratch for the router GEMM and the cuBLAS expert GEMMs: set explicitly so that a captured call
// uses the same workspace (and so the same algorithm) as an eager one; 32 MiB as cuBLAS asks on Hopper.
constexpr size_t kCublasWorkspaceBytes = size_t{32} << 20;
constexpr int64_t kMinGroupedGemmGroups = 1024;

void check_grouped_gemm(const gpu::GroupedGemmStatus& status, const char* which) {
  FULCRUM_CHECK(status.ok(), "CUTLASS grouped GEMM ({}): {} ({})", which, status.failed,
                cudaGetErrorString(static_cast<cudaError_t>(status.cuda_error)));
}

void check_moe_shape(const MoeLayerShape& shape, const char* what) {
  FULCRUM_CHECK(shape.hidden_size > 0 && shape.moe_intermediate_size > 0 && shape.max_tokens > 0,
                "{}: hidden {} / intermediate {} / max tokens {} must be positive", what, shape.hidden_size,
                shape.moe_intermediate_size, shape.max_tokens);
  FULCRUM_CHECK(shape.num_experts > 0 && shape.num_experts <= cuda::moe::kMaxRouterExperts,
                "{}: {} experts, the GPU router takes 1..{}", what, shape.num_experts, cuda::moe::kMaxRouterExperts);
  FULCRUM_CHECK(shape.num_experts_per_tok > 0 && shape.num_experts_per_tok <= cuda::moe::kMaxTopK &&
                    shape.num_experts_per_tok <= shape.num_experts,
                "{}: top-k {} outside 1..min({}, {})", what, shape.num_experts_per_tok, cuda::moe::kMaxTopK,
                shape.num_experts);
  FULCRUM_CHECK(shape.num_slots >= shape.num_experts, "{}: {} slots for {} experts", what, shape.num_slots,
                shape.num_experts);
  FULCRUM_CHECK(!shape.fp8_experts || (shape.hidden_size % gpu::kFp8BlockSize == 0 &&
                                       shape.moe_intermediate_size % gpu::kFp8BlockSize == 0),
                "{}: FP8 experts need hidden {} and intermediate {} to be multiples of 128 (whole scale blocks)", what,
                shape.hidden_size, shape.moe_intermediate_size);
}

}  // namespace

MoeWorkspace::MoeWorkspace(const MoeLayerShape& shape, int device_idx) : shape_(shape), device_idx_(device_idx) {
  check_moe_shape(shape, "MoE workspace");
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  const int64_t h = shape.hidden_size, e = shape.num_experts, p = shape.num_slots;
  const int64_t t = shape.max_tokens, n = t * shape.num_experts_per_tok;
  logits = device_array<float>(t * e);
  expert_ids = device_array<int32_t>(n);
  weights = device_array<float>(n);
  slots = device_array<int32_t>(n);
  multi_draws = device_array<int32_t>(t);
  draw_base = device_array<int32_t>(t + 1);
  counts = device_array<int32_t>(p);
  offsets = device_array<int32_t>(p + 1);
  cursor = device_array<int32_t>(p);
  entry_row = device_array<int32_t>(n);
  row_token = device_array<int32_t>(n);
  active = device_array<int32_t>(n + 1);
  permuted = device_array<uint16_t>(n * h);
  expert_out = device_array<uint16_t>(n * h);
  if (shape.fp8_experts) {
    fp8_x = device_array<uint8_t>(n * h);
    fp8_x_scales = device_array<float>(n * h / gpu::kFp8BlockSize);
  }
  reserve_expert_rows(n);
  cublasHandle_t handle = nullptr;
  FULCRUM_CUBLAS_CHECK(cublasCreate(&handle));
  cublas_ = handle;
  cublas_workspace_ = DeviceBuffer(kCublasWorkspaceBytes);

  // The CUTLASS kernels are compiled for sm_90a only; elsewhere the layers use cuBLAS.
  int major = 0, minor = 0;
  FULCRUM_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_idx));
  FULCRUM_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_idx));
  if (major != 9 || minor != 0) {
    cutlass_unavailable_ = fmt::format("the CUTLASS grouped GEMM is built for sm_90a, device {} is sm_{}{}", device_idx,
                                       major, minor);
    return;
  }
  // Groups: the P slots, or run_experts_on's (segment, local slot) pairs; a group costs ~60 bytes of arrays.
  const int max_groups = static_cast<int>(std::max<int64_t>(p, kMinGroupedGemmGroups));
  const gpu::GroupedGemmStatus status = gpu::prepare_grouped_gemm(device_idx, max_groups, &gemm_limits_);
  if (!status.ok()) {
    cutlass_unavailable_ = fmt::format("prepare_grouped_gemm: {} ({})", status.failed,
                                       cudaGetErrorString(static_cast<cudaError_t>(status.cuda_error)));
    (void)cudaGetLastError();
    return;
  }
  gemm_workspace_ = DeviceBuffer(gemm_limits_.workspace_bytes);
  if (shape.fp8_experts) {
    const gpu::GroupedGemmStatus fp8 = gpu::prepare_fp8_grouped_gemm(device_idx, max_groups, &fp8_limits_);
    if (!fp8.ok()) {
      cutlass_unavailable_ = fmt::format("prepare_fp8_grouped_gemm: {} ({})", fp8.failed,
                                         cudaGetErrorString(static_cast<cudaError_t>(fp8.cuda_error)));
      (void)cudaGetLastError();
      return;
    }
    fp8_workspace_ = DeviceBuffer(fp8_limits_.workspace_bytes);
  }
}

MoeWorkspace::~MoeWorkspace() {
  if (cublas_ != nullptr) cublasDestroy(cublas_);
}

void MoeWorkspace::check_fits(const MoeLayerShape& layer) const {
  FULCRUM_CHECK(layer.hidden_size == shape_.hidden_size && layer.moe_intermediate_size == shape_.moe_intermediate_size &&
                    layer.num_experts == shape_.num_experts && layer.num_experts_per_tok == shape_.num_experts_per_tok &&
                    layer.fp8_experts == shape_.fp8_experts,
                "MoE workspace for H {} / I {} / E {} / k {} / fp8 {}, the layer has {} / {} / {} / {} / {}",
                shape_.hidden_size, shape_.moe_intermediate_size, shape_.num_experts, shape_.num_experts_per_tok,
                shape_.fp8_experts, layer.hidden_size, layer.moe_intermediate_size, layer.num_experts,
                layer.num_experts_per_tok, layer.fp8_experts);
  FULCRUM_CHECK(layer.num_slots <= shape_.num_slots && layer.max_tokens <= shape_.max_tokens,
                "MoE workspace for {} slots / {} tokens, the layer has {} / {}", shape_.num_slots, shape_.max_tokens,
                layer.num_slots, layer.max_tokens);
}

void MoeWorkspace::reserve_expert_rows(int64_t rows) {
  if (rows <= expert_rows_) return;
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx_));
  FULCRUM_CUDA_CHECK(cudaDeviceSynchronize());  // any layer's stream may still use the old scratch
  h = device_array<uint16_t>(rows * 2 * shape_.moe_intermediate_size);
  act = device_array<uint16_t>(rows * shape_.moe_intermediate_size);
  if (shape_.fp8_experts) {
    fp8_act = device_array<uint8_t>(rows * shape_.moe_intermediate_size);
    fp8_act_scales = device_array<float>(rows * shape_.moe_intermediate_size / gpu::kFp8BlockSize);
  }
  expert_rows_ = rows;
}

void MoeWorkspace::reserve_entry_ranks() {
  if (entry_rank.bytes() == 0) entry_rank = device_array<int32_t>(shape_.max_tokens * shape_.num_experts_per_tok);
}

void MoeWorkspace::release_stream(CUstream_st* stream) noexcept {
  if (!cublas_bound_ || cublas_stream_ != stream) return;
  cublasSetStream(cublas_, nullptr);
  cublas_bound_ = false;
  cublas_stream_ = nullptr;
}

cublasContext* MoeWorkspace::cublas_on(CUstream_st* stream) {
  if (!cublas_bound_ || stream != cublas_stream_) {
    FULCRUM_CUBLAS_CHECK(cublasSetStream(cublas_, stream));
    // cublasSetStream resets the workspace to cuBLAS's pool: set ours again.
    FULCRUM_CUBLAS_CHECK(cublasSetWorkspace(cublas_, cublas_workspace_.as<void>(), cublas_workspace_.bytes()));
    cublas_stream_ = stream;
    cublas_bound_ = true;
  }
  return cublas_;
}

// Pointer arrays [2 GEMMs][A, B, C][capacity] in pinned host memory and on the device (cuBLAS's grouped GEMM
// reads them there), one entry per problem. `uploaded` follows the last upload; the host array is rewritten
// only after it (begin waits), so a problem list can be rebuilt while the GPU still runs the last forward.
struct GpuMoeLayer::GemmProblems {
  int capacity = 0;
  std::vector<int> rows;  // [problems]
  const void** host = nullptr;
  DeviceBuffer device;
  cudaEvent_t uploaded = nullptr;

  GemmProblems() { FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming)); }
  ~GemmProblems() {
    if (uploaded != nullptr) cudaEventSynchronize(uploaded);
    if (host != nullptr) cudaFreeHost(host);
    if (uploaded != nullptr) cudaEventDestroy(uploaded);
  }
  GemmProblems(const GemmProblems&) = delete;
  GemmProblems& operator=(const GemmProblems&) = delete;

  // Starts a new list of up to `n` problems.
  void begin(int n) {
    FULCRUM_CUDA_CHECK(cudaEventSynchronize(uploaded));
    if (n > capacity) {
      if (host != nullptr) FULCRUM_CUDA_CHECK(cudaFreeHost(host));
      host = nullptr;
      capacity = 0;  // a failed allocation below must not leave a capacity without storage
      FULCRUM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(void*) * 6 * n));
      device = device_array<void*>(6 * static_cast<int64_t>(n));
      capacity = n;
    }
    rows.clear();
  }
  const void** at(int gemm_idx, int operand) const { return host + (3 * gemm_idx + operand) * capacity; }
  void add(int n, const void* w1, const void* x, void* h, const void* w2, const void* act, void* out) {
    const size_t q = rows.size();
    const void* values[6] = {w1, x, h, w2, act, out};
    for (int v = 0; v < 6; ++v) at(v / 3, v % 3)[q] = values[v];
    rows.push_back(n);
  }
  void upload(cudaStream_t stream) {
    if (capacity == 0) return;
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(device.as<void*>(), host, sizeof(void*) * 6 * capacity, cudaMemcpyHostToDevice, stream));
    FULCRUM_CUDA_CHECK(cudaEventRecord(uploaded, stream));
  }
};

// Host offsets [n] in pinned memory and on the device (run_experts_on's CUTLASS groups); the host array is
// rewritten only after its last upload finished (begin waits).
struct GpuMoeLayer::OffsetsUpload {
  int capacity = 0;
  int32_t* host = nullptr;
  DeviceBuffer device;
  cudaEvent_t uploaded = nullptr;

  OffsetsUpload() { FULCRUM_CUDA_CHECK(cudaEventCreateWithFlags(&uploaded, cudaEventDisableTiming)); }
  ~OffsetsUpload() {
    if (uploaded != nullptr) cudaEventSynchronize(uploaded);
    if (host != nullptr) cudaFreeHost(host);
    if (uploaded != nullptr) cudaEventDestroy(uploaded);
  }
  OffsetsUpload(const OffsetsUpload&) = delete;
  OffsetsUpload& operator=(const OffsetsUpload&) = delete;

  void begin(int n, cudaStream_t stream) {
    FULCRUM_CUDA_CHECK(cudaEventSynchronize(uploaded));
    if (n <= capacity) return;
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream));  // a GEMM may still read the old device array
    if (host != nullptr) FULCRUM_CUDA_CHECK(cudaFreeHost(host));
    host = nullptr;
    capacity = 0;
    FULCRUM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host), sizeof(int32_t) * n));
    device = device_array<int32_t>(n);
    capacity = n;
  }
  void upload(int n, cudaStream_t stream) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(device.as<int32_t>(), host, sizeof(int32_t) * n, cudaMemcpyHostToDevice, stream));
    FULCRUM_CUDA_CHECK(cudaEventRecord(uploaded, stream));
  }
};

GpuMoeLayer::GpuMoeLayer(const MoeLayerShape& shape, int device_idx, CUstream_st* stream,
                         std::shared_ptr<MoeWorkspace> workspace)
    : shape_(shape), device_idx_(device_idx), workspace_(std::move(workspace)) {
  check_moe_shape(shape, "MoE layer");
  FULCRUM_CHECK(shape.local_slot_begin >= 0 && shape.local_slots() >= 1 &&
                    shape.local_slot_begin + shape.local_slots() <= shape.num_slots,
                "MoE layer: local slots [{}, {} + {}) outside the {} slots", shape.local_slot_begin,
                shape.local_slot_begin, shape.local_slots(), shape.num_slots);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  if (workspace_ == nullptr) {
    workspace_ = std::make_shared<MoeWorkspace>(shape, device_idx);
  } else {
    FULCRUM_CHECK(workspace_->device() == device_idx, "MoE layer on device {} with a workspace on device {}", device_idx,
                  workspace_->device());
    workspace_->check_fits(shape);
  }
  if (stream == nullptr) {
    cudaStream_t own = nullptr;
    FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&own, cudaStreamNonBlocking));
    stream_ = own;
    owns_stream_ = true;
  } else {
    stream_ = stream;
  }
  ws().cublas_on(stream_);

  const int64_t h = shape.hidden_size, i = shape.moe_intermediate_size, e = shape.num_experts, l = shape.local_slots();
  gate_up_ptrs_ = device_array<const uint16_t*>(l);
  down_ptrs_ = device_array<const uint16_t*>(l);
  if (shape.fp8_experts) {
    gate_up_scale_ptrs_ = device_array<const float*>(l);
    down_scale_ptrs_ = device_array<const float*>(l);
  }
  if (!shape.external_weights) {
    router_w_ = device_array<uint16_t>(e * h);
    router_ = router_w_.as<uint16_t>();
    if (shape.fp8_experts) {
      // The layer's own FP8 experts live in a one-layer slot pool (no spare buffers): the same blobs as the engine's.
      own_fp8_pool_ = std::make_unique<GpuSlotPool>(
          SlotPoolShape{1, static_cast<int>(l), static_cast<int>(h), static_cast<int>(i), 0, true}, device_idx);
      fp8_slots_ = std::make_unique<Fp8SlotPtrs>(own_fp8_pool_->fp8_ptrs(0));
    } else {
      gate_up_w_ = device_array<uint16_t>(l * 2 * i * h);
      down_w_ = device_array<uint16_t>(l * h * i);
    }
  }
  has_expert_weights_ = !shape.external_weights;
  upload_slot_pointers();
  own_problems_ = std::make_unique<GemmProblems>();
  recv_problems_ = std::make_unique<GemmProblems>();
  recv_offsets_ = std::make_unique<OffsetsUpload>();
  own_problems_->begin(static_cast<int>(l));
  FULCRUM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_counts_), sizeof(int32_t) * (shape.num_slots + 1)));
}

GpuMoeLayer::~GpuMoeLayer() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  own_problems_.reset();
  recv_problems_.reset();
  recv_offsets_.reset();
  if (host_counts_ != nullptr) cudaFreeHost(host_counts_);
  if (owns_stream_) {
    workspace_->release_stream(stream_);  // the shared cuBLAS handle must not keep a destroyed stream
    cudaStreamDestroy(stream_);
  }
}

void GpuMoeLayer::synchronize() { FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void GpuMoeLayer::reserve_expert_rows(int64_t rows) { ws().reserve_expert_rows(rows); }

void GpuMoeLayer::check_holds_all_slots() const {
  FULCRUM_CHECK(shape_.local_slots() == shape_.num_slots,
                "MoE layer holds slots [{}, {}) of {}: forward needs them all (expert parallelism: backend::EpMoeLayer)",
                shape_.local_slot_begin, shape_.local_slot_begin + shape_.local_slots(), shape_.num_slots);
}

const uint16_t* GpuMoeLayer::gate_up_of(int local_slot) const {
  if (!slot_gate_up_.empty()) return slot_gate_up_[static_cast<size_t>(local_slot)];
  if (gate_up_w_.bytes() == 0) return nullptr;  // external weights not set
  return gate_up_w_.as<uint16_t>() + int64_t{local_slot} * 2 * shape_.moe_intermediate_size * shape_.hidden_size;
}

const uint16_t* GpuMoeLayer::down_of(int local_slot) const {
  if (!slot_down_.empty()) return slot_down_[static_cast<size_t>(local_slot)];
  if (down_w_.bytes() == 0) return nullptr;
  return down_w_.as<uint16_t>() + int64_t{local_slot} * shape_.hidden_size * shape_.moe_intermediate_size;
}

void GpuMoeLayer::upload_slot_pointers() {
  const int l = shape_.local_slots();
  if (shape_.fp8_experts) {
    upload_fp8_slot_pointers();
    return;
  }
  std::vector<const uint16_t*> gate_up(static_cast<size_t>(l)), down(static_cast<size_t>(l));
  bool aligned = true;
  for (int q = 0; q < l; ++q) {
    gate_up[q] = gate_up_of(q);
    down[q] = down_of(q);
    aligned = aligned && gpu::grouped_gemm_aligned(gate_up[q]) && gpu::grouped_gemm_aligned(down[q]);
  }
  // Stream-ordered: a forward still in flight reads the old pointers; then wait, the host vectors go away.
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(gate_up_ptrs_.as<const uint16_t*>(), gate_up.data(), sizeof(void*) * l,
                                     cudaMemcpyHostToDevice, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(down_ptrs_.as<const uint16_t*>(), down.data(), sizeof(void*) * l,
                                     cudaMemcpyHostToDevice, stream_));
  synchronize();
  slot_pointers_aligned_ = aligned;
}

void GpuMoeLayer::set_slot_weights(std::span<const uint16_t* const> gate_up, std::span<const uint16_t* const> down) {
  FULCRUM_CHECK(!shape_.fp8_experts, "set_slot_weights: the layer's experts are FP8 (set_fp8_slot_weights)");
  const size_t l = static_cast<size_t>(shape_.local_slots());
  FULCRUM_CHECK(gate_up.size() == down.size() && (gate_up.empty() || gate_up.size() == l),
                "set_slot_weights: {} gate_up and {} down pointers, expected {} each (or none)", gate_up.size(),
                down.size(), l);
  for (size_t q = 0; q < gate_up.size(); ++q) {
    FULCRUM_CHECK(gate_up[q] != nullptr && down[q] != nullptr, "set_slot_weights: null pointer for local slot {}", q);
  }
  slot_gate_up_.assign(gate_up.begin(), gate_up.end());
  slot_down_.assign(down.begin(), down.end());
  has_expert_weights_ = !gate_up.empty() || !shape_.external_weights;
  own_problems_built_ = false;  // the cuBLAS problems hold weight pointers
  upload_slot_pointers();
}

void GpuMoeLayer::set_router_weights(const uint16_t* router) {
  FULCRUM_CHECK(router != nullptr || !shape_.external_weights,
                "set_router_weights: null router, and the layer has no weights of its own (external_weights)");
  router_ = router != nullptr ? router : router_w_.as<uint16_t>();
}

void GpuMoeLayer::upload_weights(std::span<const uint16_t> router, std::span<const uint16_t> gate_up,
                                 std::span<const uint16_t> down) {
  FULCRUM_CHECK(!shape_.external_weights, "upload_weights: the layer holds no weights of its own (external_weights)");
  FULCRUM_CHECK(!shape_.fp8_experts, "upload_weights: bf16 weights for FP8 experts");
  FULCRUM_CHECK(router.size() * 2 == router_w_.bytes() && gate_up.size() * 2 == gate_up_w_.bytes() &&
                    down.size() * 2 == down_w_.bytes(),
                "MoE layer weights: router {} / gate_up {} / down {} values, expected {} / {} / {}", router.size(),
                gate_up.size(), down.size(), router_w_.bytes() / 2, gate_up_w_.bytes() / 2, down_w_.bytes() / 2);
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(router_w_.as<uint16_t>(), router.data(), router_w_.bytes(), cudaMemcpyHostToDevice, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(gate_up_w_.as<uint16_t>(), gate_up.data(), gate_up_w_.bytes(), cudaMemcpyHostToDevice, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(down_w_.as<uint16_t>(), down.data(), down_w_.bytes(), cudaMemcpyHostToDevice, stream_));
  synchronize();  // the host spans may go away after return
}

void GpuMoeLayer::randomize_weights(uint64_t seed) {
  using model::ExpertTensor;
  FULCRUM_CHECK(!shape_.external_weights, "randomize_weights: the layer holds no weights of its own (external_weights)");
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  const float gate_up_scale = model::expert_weight_scale(ExpertTensor::kGateUp, h, i);  // 1/sqrt(H), the router's too
  const float down_scale = model::expert_weight_scale(ExpertTensor::kDown, h, i);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(router_w_.as<uint16_t>(), router_w_.bytes() / 2, seed, gate_up_scale, stream_));
  if (shape_.fp8_experts) {
    randomize_fp8_experts(seed);
    return;
  }
  // Local slot l takes the values of global slot local_slot_begin + l in the global [P, ...] arrays.
  const int64_t slot_values = int64_t{shape_.hidden_size} * shape_.moe_intermediate_size, first = shape_.local_slot_begin;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(gate_up_w_.as<uint16_t>(), gate_up_w_.bytes() / 2, seed + 1,
                                                        gate_up_scale, stream_, first * 2 * slot_values));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(down_w_.as<uint16_t>(), down_w_.bytes() / 2, seed + 2,
                                                        down_scale, stream_, first * slot_values));
}

void GpuMoeLayer::set_replica_choice(const model::moe::ReplicaChoiceSpec& spec) {
  has_spec_ = false;  // a failed call below leaves no half-set spec (route() then asks for one)
  FULCRUM_CHECK(spec.num_logical_experts == shape_.num_experts && spec.num_slots == shape_.num_slots,
                "replica choice for {} experts / {} slots, the layer has {} / {}", spec.num_logical_experts,
                spec.num_slots, shape_.num_experts, shape_.num_slots);
  FULCRUM_CHECK(spec.num_sources > 0 && spec.tokens_per_source > 0, "replica choice: {} sources of {} tokens",
                spec.num_sources, spec.tokens_per_source);
  const bool is_static = spec.algorithm == eplb::DispatchAlgorithm::kStatic;
  const bool is_balanced = spec.algorithm == eplb::DispatchAlgorithm::kBalanced;
  const size_t table = static_cast<size_t>(spec.num_sources) * spec.num_logical_experts;
  FULCRUM_CHECK(!is_static || spec.static_slot_of.size() == table, "static table has {} entries, expected {}",
                spec.static_slot_of.size(), table);
  FULCRUM_CHECK(is_static || (spec.replica_offsets.size() == static_cast<size_t>(spec.num_logical_experts) + 1 &&
                              spec.replica_slots.size() == static_cast<size_t>(spec.num_slots)),
                "replica index has the wrong sizes");
  FULCRUM_CHECK(spec.algorithm != eplb::DispatchAlgorithm::kDynamic ||
                    spec.source_streams.size() == static_cast<size_t>(spec.num_sources),
                "dynamic dispatch has {} streams for {} sources", spec.source_streams.size(), spec.num_sources);
  for (const int32_t s : is_static ? spec.static_slot_of : spec.replica_slots) {
    FULCRUM_CHECK(s >= 0 && s < spec.num_slots, "replica table names slot {} outside [0, {})", s, spec.num_slots);
  }
  synchronize();  // a forward in flight may still read the tables replaced below
  splitter_.reset();
  if (is_balanced) {
    // Every source is here, or (expert parallelism) this layer's one source is one of the topology's GPUs.
    const bool sources_ok = gather_ ? spec.num_sources == 1 && balanced_source_ < spec.topo.num_gpus
                                    : spec.topo.num_gpus == spec.num_sources;
    FULCRUM_CHECK(sources_ok && spec.topo.num_physical_experts == spec.num_slots,
                  "balanced dispatch: topology of {} GPUs / {} slots for {} sources / {} slots", spec.topo.num_gpus,
                  spec.topo.num_physical_experts, spec.num_sources, spec.num_slots);
    splitter_ = std::make_unique<eplb::BalancedSplitter>(spec.layer_map, spec.num_logical_experts, spec.topo);
    const int64_t chunks = cuda::moe::balanced_chunks_per_source(spec.tokens_per_source, shape_.max_tokens);
    ws().reserve_entry_ranks();
    chunk_base_ = device_array<int32_t>(static_cast<int64_t>(table) * chunks);
    pair_counts_ = device_array<int32_t>(static_cast<int64_t>(table));
    // A (source, slot) pair is in at most one route, so at most S * P routes.
    routes_ = device_array<int32_t>(static_cast<int64_t>(table) + 1 + 2 * int64_t{spec.num_sources} * spec.num_slots);
  }
  spec_ = spec;
  has_spec_ = true;
  upload_into(static_slot_of_, spec.static_slot_of, stream_);
  upload_into(replica_offsets_, spec.replica_offsets, stream_);
  upload_into(replica_slots_, spec.replica_slots, stream_);
  upload_into(source_streams_, spec.source_streams, stream_);
  synchronize();
}

void GpuMoeLayer::set_balanced_sources(int source_idx, CountGather gather) {
  FULCRUM_CHECK(source_idx >= 0, "balanced sources: source {} must be >= 0", source_idx);
  FULCRUM_CHECK(static_cast<bool>(gather), "balanced sources: a count gather is required");
  balanced_source_ = source_idx;
  gather_ = std::move(gather);
  has_spec_ = false;  // a balanced spec must be checked against the new source
}

std::string GpuMoeLayer::cutlass_problem() const {
  if (!ws().cutlass_unavailable().empty()) return ws().cutlass_unavailable();
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  if (shape_.fp8_experts && shape_.local_slots() > ws().fp8_gemm_limits().max_groups) {
    return fmt::format("{} local slots, the workspace's FP8 grouped GEMM holds {} groups", shape_.local_slots(),
                       ws().fp8_gemm_limits().max_groups);
  }
  if (const char* why = gpu::grouped_gemm_shape_problem(2 * i, h)) {
    return fmt::format("gate_up GEMM N = 2I = {}, K = H = {}: {}", 2 * i, h, why);
  }
  if (const char* why = gpu::grouped_gemm_shape_problem(h, i)) {
    return fmt::format("down GEMM N = H = {}, K = I = {}: {}", h, i, why);
  }
  if (!slot_pointers_aligned_) return "an expert weight pointer is not 16-byte aligned";
  if (shape_.local_slots() > ws().grouped_gemm_limits().max_groups) {
    return fmt::format("{} local slots, the workspace's grouped GEMM holds {} groups", shape_.local_slots(),
                       ws().grouped_gemm_limits().max_groups);
  }
  return {};
}

bool GpuMoeLayer::uses_cutlass() const {
  const bool wanted = expert_gemm_ == ExpertGemm::kCutlass ||
                      (expert_gemm_ == ExpertGemm::kAuto && shape_.local_slots() == shape_.num_slots);
  return wanted && cutlass_problem().empty();
}

std::string GpuMoeLayer::cutlass_fallback_reason() const {
  const bool wanted = expert_gemm_ == ExpertGemm::kCutlass ||
                      (expert_gemm_ == ExpertGemm::kAuto && shape_.local_slots() == shape_.num_slots);
  return wanted ? cutlass_problem() : std::string();
}

void GpuMoeLayer::router_logits(const uint16_t* x, int64_t num_tokens) {
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= shape_.max_tokens, "MoE layer: {} tokens, at most {}", num_tokens,
                shape_.max_tokens);
  FULCRUM_CHECK(router_ != nullptr, "MoE layer: no router weights (external_weights: set_router_weights first)");
  if (num_tokens == 0) return;
  if (num_tokens <= gpu::kSkinnyGemmMaxRows && shape_.hidden_size % 8 == 0 &&
      reinterpret_cast<uintptr_t>(x) % 16 == 0 && reinterpret_cast<uintptr_t>(router_) % 16 == 0) {
    FULCRUM_CUDA_CHECK(gpu::launch_skinny_gemm(x, router_, static_cast<int>(num_tokens), shape_.num_experts,
                                               shape_.hidden_size, ws().logits.as<float>(), nullptr, stream_));
    return;
  }
  // Row-major logits [T, E] = x [T, H] @ router [E, H]^T, i.e. column-major logits^T = router^T(op T) x.
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasGemmEx(ws().cublas_on(stream_), CUBLAS_OP_T, CUBLAS_OP_N, shape_.num_experts,
                                    static_cast<int>(num_tokens), shape_.hidden_size, &alpha, router_, CUDA_R_16BF,
                                    shape_.hidden_size, x, CUDA_R_16BF, shape_.hidden_size, &beta,
                                    ws().logits.as<float>(), CUDA_R_32F, shape_.num_experts, CUBLAS_COMPUTE_32F,
                                    CUBLAS_GEMM_DEFAULT));
}

cuda::moe::RouterArgs GpuMoeLayer::router_args(const float* logits, int64_t num_tokens) {
  FULCRUM_CHECK(has_spec_, "MoE layer: set_replica_choice before the first forward");
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= shape_.max_tokens, "MoE layer: {} tokens, at most {}", num_tokens,
                shape_.max_tokens);
  FULCRUM_CHECK(num_tokens <= spec_.tokens_per_source * spec_.num_sources,
                "MoE layer: {} tokens but {} sources of {} tokens", num_tokens, spec_.num_sources,
                spec_.tokens_per_source);
  num_tokens_ = num_tokens;
  host_counts_valid_ = false;
  own_problems_built_ = false;
  MoeWorkspace& w = ws();
  const bool is_static = spec_.algorithm == eplb::DispatchAlgorithm::kStatic;
  cuda::moe::RouterArgs args;
  args.logits = logits;
  args.num_tokens = num_tokens;
  args.num_experts = shape_.num_experts;
  args.top_k = shape_.num_experts_per_tok;
  args.norm_topk_prob = shape_.norm_topk_prob;
  args.tokens_per_source = spec_.tokens_per_source;
  args.static_slot_of = is_static ? static_slot_of_.as<int32_t>() : nullptr;  // else multi_draws (unused by balanced)
  args.replica_offsets = replica_offsets_.as<int32_t>();
  args.expert_ids = w.expert_ids.as<int32_t>();
  args.weights = w.weights.as<float>();
  args.slots = w.slots.as<int32_t>();
  args.multi_draws = w.multi_draws.as<int32_t>();
  args.histogram = histogram_row_;
  return args;
}

void GpuMoeLayer::route(const float* logits, int64_t num_tokens) {
  MoeWorkspace& w = ws();
  const bool is_static = spec_.algorithm == eplb::DispatchAlgorithm::kStatic;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_moe_router(router_args(logits, num_tokens), stream_));
  if (spec_.algorithm == eplb::DispatchAlgorithm::kBalanced) {
    choose_balanced(num_tokens);
    return;
  }
  if (is_static || num_tokens == 0) return;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_exclusive_scan(w.multi_draws.as<int32_t>(), num_tokens, w.draw_base.as<int32_t>(),
                                                      w.draw_base.as<int32_t>() + num_tokens, stream_));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_dynamic_pick(w.expert_ids.as<int32_t>(), w.draw_base.as<int32_t>(), num_tokens,
                                                    shape_.num_experts_per_tok, spec_.tokens_per_source,
                                                    source_streams_.as<uint64_t>(), replica_offsets_.as<int32_t>(),
                                                    replica_slots_.as<int32_t>(), w.slots.as<int32_t>(), stream_));
}

void GpuMoeLayer::choose_balanced(int64_t num_tokens) {
  MoeWorkspace& w = ws();
  const int num_sources = spec_.num_sources, num_experts = shape_.num_experts, p = shape_.num_slots;
  const size_t pairs = static_cast<size_t>(num_sources) * num_experts;
  const int k = shape_.num_experts_per_tok;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_balanced_counts(w.expert_ids.as<int32_t>(), num_tokens, k, num_experts,
                                                       spec_.tokens_per_source, num_sources, w.entry_rank.as<int32_t>(),
                                                       chunk_base_.as<int32_t>(), pair_counts_.as<int32_t>(), stream_));
  host_pair_counts_.resize(pairs);
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_pair_counts_.data(), pair_counts_.as<int32_t>(), sizeof(int32_t) * pairs,
                                     cudaMemcpyDeviceToHost, stream_));
  synchronize();  // the split needs this pass's counts
  // The split's sources: this layer's, or (expert parallelism) every rank's, this layer's being number
  // balanced_source_; this layer takes the routes of its own pairs [pair_begin, pair_begin + pairs).
  const int split_sources = gather_ ? spec_.topo.num_gpus : num_sources;
  const size_t pair_begin = gather_ ? static_cast<size_t>(balanced_source_) * num_experts : 0;
  if (gather_) {
    all_pair_counts_.resize(static_cast<size_t>(split_sources) * num_experts);
    gather_(host_pair_counts_, all_pair_counts_);
    pair_tokens_.assign(all_pair_counts_.begin(), all_pair_counts_.end());
  } else {
    pair_tokens_.assign(host_pair_counts_.begin(), host_pair_counts_.end());
  }
  splitter_->split(pair_tokens_, split_);
  eplb::build_balanced_route_table(split_, split_sources, route_table_);
  const int32_t route_begin = route_table_.offsets[pair_begin], route_end = route_table_.offsets[pair_begin + pairs];
  const auto num_routes = static_cast<size_t>(route_end - route_begin);
  FULCRUM_CHECK(num_routes <= static_cast<size_t>(num_sources) * p, "balanced split: {} routes, at most {}", num_routes,
                static_cast<size_t>(num_sources) * p);
  // Table for the pick kernel: offsets [S * E + 1] | slots [R] | cumulative ends [R]; slot counts on the host.
  host_routes_.clear();
  for (size_t pair = pair_begin; pair <= pair_begin + pairs; ++pair) host_routes_.push_back(route_table_.offsets[pair] - route_begin);
  host_routes_.insert(host_routes_.end(), route_table_.slots.begin() + route_begin, route_table_.slots.begin() + route_end);
  std::fill_n(host_counts_, p, 0);
  for (size_t pair = pair_begin; pair < pair_begin + pairs; ++pair) {
    int64_t routed = 0;  // the pair's routes must hold exactly its entries (the pick kernel relies on it)
    for (int32_t r = route_table_.offsets[pair]; r < route_table_.offsets[pair + 1]; ++r) {
      host_counts_[route_table_.slots[r]] += static_cast<int32_t>(route_table_.ends[r] - routed);
      routed = route_table_.ends[r];
    }
    FULCRUM_CHECK(routed == pair_tokens_[pair], "balanced split routes {} of {} tokens of (source {}, expert {})",
                  routed, pair_tokens_[pair], pair / num_experts, pair % num_experts);
  }
  for (int32_t r = route_begin; r < route_end; ++r) host_routes_.push_back(static_cast<int32_t>(route_table_.ends[r]));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(routes_.as<int32_t>(), host_routes_.data(), sizeof(int32_t) * host_routes_.size(),
                                     cudaMemcpyHostToDevice, stream_));
  const int32_t* offsets = routes_.as<int32_t>();
  FULCRUM_CUDA_CHECK(cuda::moe::launch_balanced_pick(w.expert_ids.as<int32_t>(), w.entry_rank.as<int32_t>(),
                                                     chunk_base_.as<int32_t>(), num_tokens, k, num_experts,
                                                     spec_.tokens_per_source, offsets, offsets + pairs + 1,
                                                     offsets + pairs + 1 + num_routes, w.slots.as<int32_t>(), stream_));
  host_counts_valid_ = true;
}

void GpuMoeLayer::permute(const uint16_t* x, int64_t num_tokens) {
  FULCRUM_CHECK(num_tokens == num_tokens_, "MoE layer: permute of {} tokens after routing {}", num_tokens, num_tokens_);
  MoeWorkspace& w = ws();
  const int p = shape_.num_slots, k = shape_.num_experts_per_tok;
  const int64_t num_entries = num_tokens * k;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_slot_counts(w.slots.as<int32_t>(), num_entries, p, w.counts.as<int32_t>(),
                                                   w.offsets.as<int32_t>(), stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(w.cursor.as<int32_t>(), w.offsets.as<int32_t>(), sizeof(int32_t) * p,
                                     cudaMemcpyDeviceToDevice, stream_));
  // FP8 on CUTLASS: e4m3 rows and scales straight from x (moe_layer_fp8.cpp); else the bf16 rows.
  fp8_rows_quantized_ = permute_quantize_fp8(x, num_tokens);
  if (!fp8_rows_quantized_) {
    FULCRUM_CUDA_CHECK(cuda::moe::launch_permute_rows(x, num_tokens, k, shape_.hidden_size, w.slots.as<int32_t>(),
                                                      w.cursor.as<int32_t>(), w.entry_row.as<int32_t>(),
                                                      w.permuted.as<uint16_t>(), stream_));
  }
  own_problems_built_ = false;
  // CUTLASS reads the offsets on the device: nothing comes back. An expert-parallel layer needs the host
  // counts for its exchange whatever its GEMMs.
  if (uses_cutlass() && shape_.local_slots() == shape_.num_slots) return;
  build_own_problems();
}

void GpuMoeLayer::build_own_problems() {
  FULCRUM_CHECK(!shape_.fp8_experts, "MoE layer: FP8 experts run on CUTLASS's FP8 grouped GEMM or the skinny path, "
                "not cuBLAS ({})", cutlass_fallback_reason().empty() ? "cuBLAS was asked for" : cutlass_fallback_reason());
  MoeWorkspace& w = ws();
  const int p = shape_.num_slots;
  // The cuBLAS paths' one host synchronization: cuBLAS takes the GEMM sizes as host arrays (balanced routing
  // has them already).
  if (!host_counts_valid_) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_counts_, w.counts.as<int32_t>(), sizeof(int32_t) * p, cudaMemcpyDeviceToHost, stream_));
    synchronize();
    host_counts_valid_ = true;
  }
  // One problem per non-empty local slot; pointers of both GEMMs for all of them, uploaded once.
  const int64_t h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  const int local_begin = shape_.local_slot_begin, l = shape_.local_slots();
  GemmProblems& problems = *own_problems_;
  problems.begin(l);
  compact_begin_.assign(static_cast<size_t>(l) + 1, 0);
  int64_t row = 0;
  for (int s = 0; s < p; ++s) {
    const int n = host_counts_[s], local = s - local_begin;
    if (local >= 0 && local < l) {
      compact_begin_[local] = static_cast<int>(problems.rows.size());
      if (n > 0) {
        problems.add(n, gate_up_of(local), w.permuted.as<uint16_t>() + row * h, w.h.as<uint16_t>() + row * 2 * i,
                     down_of(local), w.act.as<uint16_t>() + row * i, w.expert_out.as<uint16_t>() + row * h);
      }
    }
    row += n;
  }
  compact_begin_[l] = static_cast<int>(problems.rows.size());
  problems.upload(stream_);
  own_problems_built_ = true;
}

void GpuMoeLayer::expert_gemm(const GemmProblems& problems, int gemm_idx, int first, int count, double flops) {
  if (count == 0) return;
  const int out_features = gemm_idx == 0 ? 2 * shape_.moe_intermediate_size : shape_.hidden_size;
  const int in_features = gemm_idx == 0 ? shape_.hidden_size : shape_.moe_intermediate_size;
  const float alpha = 1.0f, beta = 0.0f;
  const void** host_a = problems.at(gemm_idx, 0) + first;
  const void** host_b = problems.at(gemm_idx, 1) + first;
  const void** host_c = problems.at(gemm_idx, 2) + first;
  cublasHandle_t cublas = ws().cublas_on(stream_);
  // Row-major out [n, N] = in [n, K] @ W [N, K]^T is column-major out^T = W^T(op T) in^T: m = N, n = rows, k = K.
  // kAuto (and kCutlass falling back here) pick per-slot calls on large problems.
  const bool per_slot = expert_gemm_ == ExpertGemm::kPerSlot || (expert_gemm_ != ExpertGemm::kGrouped && flops >= kPerSlotMinFlops);
  if (per_slot) {
    for (int q = 0; q < count; ++q) {
      FULCRUM_CUBLAS_CHECK(cublasGemmEx(cublas, CUBLAS_OP_T, CUBLAS_OP_N, out_features, problems.rows[first + q],
                                        in_features, &alpha, host_a[q], CUDA_R_16BF, in_features, host_b[q],
                                        CUDA_R_16BF, in_features, &beta, const_cast<void*>(host_c[q]), CUDA_R_16BF,
                                        out_features, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
    return;
  }
  const std::vector<cublasOperation_t> trans_a(count, CUBLAS_OP_T), trans_b(count, CUBLAS_OP_N);
  const std::vector<int> m(count, out_features), k(count, in_features), group_size(count, 1);
  const std::vector<float> alphas(count, alpha), betas(count, beta);
  void** device_ptrs = problems.device.as<void*>();
  const int64_t cap = problems.capacity;
  FULCRUM_CUBLAS_CHECK(cublasGemmGroupedBatchedEx(
      cublas, trans_a.data(), trans_b.data(), m.data(), problems.rows.data() + first, k.data(), alphas.data(),
      device_ptrs + (3 * gemm_idx) * cap + first, CUDA_R_16BF, k.data(), device_ptrs + (3 * gemm_idx + 1) * cap + first,
      CUDA_R_16BF, k.data(), betas.data(), device_ptrs + (3 * gemm_idx + 2) * cap + first, CUDA_R_16BF, m.data(), count,
      group_size.data(), CUBLAS_COMPUTE_32F));
}

// FULCRUM_BF16_GEMM_CONFIGS=U,D (GroupedGemmConfig values) sets the gate_up and the down GEMM's configs where the
// rows pick the large tile (steps of >= kGroupedGemmLargeTileMinRows rows), for measurement (bench/moe_config_sweep.sh);
// FULCRUM_BF16_SMALL_GEMM_CONFIGS=U,D the same for the smaller steps (decode: bench/run_gpu_env_sweep.sh). Read once.
// Unset: `config` for both. Either way the choice depends on the total rows only (placement-invariant).
static std::pair<gpu::GroupedGemmConfig, gpu::GroupedGemmConfig> bf16_gemm_configs(gpu::GroupedGemmConfig config) {
  static const std::pair<int, int> large = gpu::env_config_pair("FULCRUM_BF16_GEMM_CONFIGS", gpu::kNumGroupedGemmConfigs);
  static const std::pair<int, int> small =
      gpu::env_config_pair("FULCRUM_BF16_SMALL_GEMM_CONFIGS", gpu::kNumGroupedGemmConfigs);
  const std::pair<int, int>& forced = config == gpu::GroupedGemmConfig::kPingpong128x128x64 ? large : small;
  if (forced.first < 0) return {config, config};
  return {static_cast<gpu::GroupedGemmConfig>(forced.first), static_cast<gpu::GroupedGemmConfig>(forced.second)};
}

void GpuMoeLayer::cutlass_experts(const uint16_t* in, const int32_t* offsets, int num_groups, int first_local,
                                  int num_weights, int64_t max_rows, int64_t total_rows, uint16_t* out) {
  if (num_groups == 0 || max_rows == 0) return;
  if (shape_.fp8_experts) {
    cutlass_experts_fp8(in, offsets, num_groups, first_local, num_weights, max_rows, total_rows, out);
    return;
  }
  MoeWorkspace& w = ws();
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  // By the batch's total rows, never per group: the config is the same whatever the placement (grouped_gemm.hpp).
  const gpu::GroupedGemmConfig config = gpu::grouped_gemm_config_for_rows(total_rows);
  const auto [up_config, down_config] = bf16_gemm_configs(config);
  gpu::GroupedGemmArgs up;
  up.a = in;                        // [rows, H]
  up.offsets = offsets;             // [num_groups + 1]
  up.num_groups = num_groups;
  up.b = gate_up_ptrs_.as<const uint16_t*>() + first_local;  // [2I, H] each
  up.num_b = num_weights;
  up.d = w.h.as<uint16_t>();        // [rows, 2I]
  up.n = 2 * i;
  up.k = h;
  gpu::GroupedGemmArgs down = up;
  down.a = w.act.as<uint16_t>();    // [rows, I], SwiGLU's output
  down.b = down_ptrs_.as<const uint16_t*>() + first_local;  // [H, I] each
  down.d = out;                     // [rows, H]
  down.n = h;
  down.k = i;
  void* workspace = w.grouped_gemm_workspace();
  const gpu::GroupedGemmLimits& limits = w.grouped_gemm_limits();
  // One setup launch for both GEMMs when they share a config (FULCRUM_GEMM_PAIR_SETUP=0: a setup before each, for
  // measurement): a kernel less between the GEMMs.
  static const bool pair_setup_on = gpu::env_switch_on("FULCRUM_GEMM_PAIR_SETUP");
  const bool paired = pair_setup_on && up_config == down_config;
  if (paired) {
    check_grouped_gemm(gpu::setup_grouped_gemm_pair(up, down, up_config, limits, workspace, stream_), "expert setup");
    check_grouped_gemm(gpu::launch_grouped_gemm(up, 0, up_config, limits, workspace, stream_), "gate_up");
  } else {
    check_grouped_gemm(gpu::run_grouped_gemm(up, up_config, limits, workspace, stream_), "gate_up");
  }
  FULCRUM_CUDA_CHECK(cuda::moe::launch_silu_mul_bf16_rows(w.h.as<uint16_t>(), offsets, offsets + num_groups, max_rows, i,
                                                          w.act.as<uint16_t>(), stream_));
  check_grouped_gemm(paired ? gpu::launch_grouped_gemm(down, 1, down_config, limits, workspace, stream_)
                            : gpu::run_grouped_gemm(down, down_config, limits, workspace, stream_),
                     "down");
}

void GpuMoeLayer::run_experts(int slot_begin, int slot_end) {
  const int local_begin = shape_.local_slot_begin, local_end = local_begin + shape_.local_slots();
  FULCRUM_CHECK(local_begin <= slot_begin && slot_begin <= slot_end && slot_end <= local_end,
                "run_experts: slots [{}, {}) outside this layer's [{}, {})", slot_begin, slot_end, local_begin, local_end);
  FULCRUM_CHECK(has_expert_weights_, "MoE layer: no expert weights (external_weights: set_slot_weights first)");
  MoeWorkspace& w = ws();
  const int64_t total_rows = num_tokens_ * shape_.num_experts_per_tok;
  if (uses_cutlass()) {
    // Groups = the slots [slot_begin, slot_end), rows from the device offsets of the last permute (null: it
    // quantized them already, FP8).
    cutlass_experts(fp8_rows_quantized_ ? nullptr : w.permuted.as<uint16_t>(), w.offsets.as<int32_t>() + slot_begin,
                    slot_end - slot_begin, slot_begin - local_begin, slot_end - slot_begin, total_rows, total_rows,
                    w.expert_out.as<uint16_t>());
    return;
  }
  if (!own_problems_built_) build_own_problems();  // the last permute took the CUTLASS path
  const int first = compact_begin_[slot_begin - local_begin];
  const int count = compact_begin_[slot_end - local_begin] - first;
  const double flops = expert_flops(slot_begin, slot_end);
  expert_gemm(*own_problems_, 0, first, count, flops);
  int64_t row_begin = 0, num_rows = 0;
  for (int s = 0; s < slot_end; ++s) (s < slot_begin ? row_begin : num_rows) += host_counts_[s];
  const int64_t i = shape_.moe_intermediate_size;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_silu_mul_bf16(w.h.as<uint16_t>() + row_begin * 2 * i, num_rows,
                                                     shape_.moe_intermediate_size, w.act.as<uint16_t>() + row_begin * i,
                                                     stream_));
  expert_gemm(*own_problems_, 1, first, count, flops);
}

void GpuMoeLayer::run_experts_on(const uint16_t* rows, std::span<const int32_t> rows_per_segment_slot, uint16_t* out) {
  const size_t l = static_cast<size_t>(shape_.local_slots());
  FULCRUM_CHECK(!rows_per_segment_slot.empty() && rows_per_segment_slot.size() % l == 0,
                "run_experts_on: {} counts are not segments of {} local slots", rows_per_segment_slot.size(), l);
  FULCRUM_CHECK(has_expert_weights_, "MoE layer: no expert weights (external_weights: set_slot_weights first)");
  int64_t n = 0;
  for (const int32_t c : rows_per_segment_slot) {
    FULCRUM_CHECK(c >= 0, "run_experts_on: negative row count {}", c);
    n += c;
  }
  MoeWorkspace& w = ws();
  FULCRUM_CHECK(n <= w.expert_rows(), "run_experts_on: {} rows, scratch for {} (reserve_expert_rows)", n, w.expert_rows());
  const int num_groups = static_cast<int>(rows_per_segment_slot.size());
  FULCRUM_CHECK(!shape_.fp8_experts || (expert_gemm_ == ExpertGemm::kCutlass && cutlass_problem().empty()),
                "run_experts_on: FP8 experts need ExpertGemm::kCutlass and a device it runs on ({})", cutlass_problem());
  if (expert_gemm_ == ExpertGemm::kCutlass && cutlass_problem().empty() &&
      num_groups <= w.grouped_gemm_limits().max_groups && gpu::grouped_gemm_aligned(rows) && gpu::grouped_gemm_aligned(out)) {
    // One group per (segment, local slot), group g using local slot g % L; offsets from the host counts.
    OffsetsUpload& upload = *recv_offsets_;
    upload.begin(num_groups + 1, stream_);
    upload.host[0] = 0;
    for (int g = 0; g < num_groups; ++g) upload.host[g + 1] = upload.host[g] + rows_per_segment_slot[g];
    upload.upload(num_groups + 1, stream_);
    cutlass_experts(rows, upload.device.as<int32_t>(), num_groups, 0, static_cast<int>(l), n, n, out);
    return;
  }
  const int64_t h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  GemmProblems& problems = *recv_problems_;
  problems.begin(num_groups);
  int64_t row = 0;
  for (size_t q = 0; q < rows_per_segment_slot.size(); ++q) {
    const int c = rows_per_segment_slot[q];
    if (c == 0) continue;
    const int local = static_cast<int>(q % l);
    problems.add(c, gate_up_of(local), rows + row * h, w.h.as<uint16_t>() + row * 2 * i, down_of(local),
                 w.act.as<uint16_t>() + row * i, out + row * h);
    row += c;
  }
  problems.upload(stream_);
  const int count = static_cast<int>(problems.rows.size());
  const double flops = expert_flops_of_rows(static_cast<double>(n), shape_);
  expert_gemm(problems, 0, 0, count, flops);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_silu_mul_bf16(w.h.as<uint16_t>(), n, shape_.moe_intermediate_size,
                                                     w.act.as<uint16_t>(), stream_));
  expert_gemm(problems, 1, 0, count, flops);
}

void GpuMoeLayer::combine(int64_t num_tokens, float* out) { combine_rows(ws().expert_out.as<uint16_t>(), num_tokens, out); }

void GpuMoeLayer::combine_rows(const uint16_t* rows, int64_t num_tokens, float* out) {
  FULCRUM_CHECK(num_tokens == num_tokens_, "MoE layer: combine of {} tokens after routing {}", num_tokens, num_tokens_);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_combine_f32(rows, ws().entry_row.as<int32_t>(), ws().weights.as<float>(),
                                                   num_tokens, shape_.num_experts_per_tok, shape_.hidden_size, out,
                                                   stream_));
}

bool GpuMoeLayer::uses_skinny(int64_t num_tokens) const {
  const int64_t entries = num_tokens * shape_.num_experts_per_tok;
  return (expert_gemm_ == ExpertGemm::kAuto || expert_gemm_ == ExpertGemm::kCutlass) && entries > 0 &&
         entries <= std::min(skinny_max_entries_, cuda::moe::kSmallPlanMaxEntries) &&
         shape_.local_slots() == shape_.num_slots && shape_.num_slots <= cuda::moe::kSmallPlanMaxSlots &&
         shape_.hidden_size % 8 == 0 && shape_.moe_intermediate_size % 8 == 0 && slot_pointers_aligned_ &&
         has_expert_weights_;
}

// Read once; FULCRUM_FUSED_ROUTER=0 keeps the router and the small permutation in two launches, for measurement.
static bool fused_small_route_enabled() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_FUSED_ROUTER");
  return enabled;
}

void GpuMoeLayer::route_permute_small(const float* logits, int64_t num_tokens) {
  MoeWorkspace& w = ws();
  FULCRUM_CUDA_CHECK(cuda::moe::launch_small_route_permute(
      router_args(logits, num_tokens), shape_.num_slots, w.counts.as<int32_t>(), w.offsets.as<int32_t>(),
      w.entry_row.as<int32_t>(), w.row_token.as<int32_t>(), w.active.as<int32_t>(), stream_));
}

void GpuMoeLayer::skinny_experts(const uint16_t* x, int64_t num_tokens) {
  MoeWorkspace& w = ws();
  const int p = shape_.num_slots, k = shape_.num_experts_per_tok;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_small_permutation(w.slots.as<int32_t>(), num_tokens * k, k, p,
                                                         w.counts.as<int32_t>(), w.offsets.as<int32_t>(),
                                                         w.entry_row.as<int32_t>(), w.row_token.as<int32_t>(),
                                                         w.active.as<int32_t>(), stream_));
  skinny_gemms(x, num_tokens);
}

void GpuMoeLayer::skinny_gemms(const uint16_t* x, int64_t num_tokens) {
  MoeWorkspace& w = ws();
  const int p = shape_.num_slots;
  const int64_t entries = num_tokens * shape_.num_experts_per_tok;
  own_problems_built_ = false;
  gpu::ExpertSkinnyArgs gemm;
  gemm.x = x;  // token rows [T, H], read through row_token
  gemm.row_source = w.row_token.as<int32_t>();
  gemm.offsets = w.offsets.as<int32_t>();
  gemm.active = w.active.as<int32_t>();
  gemm.weights = gate_up_ptrs_.as<const uint16_t* const>();
  if (shape_.fp8_experts) {  // codes and block scales instead (expert_skinny_gemm.hpp)
    gemm.weights = nullptr;
    gemm.fp8_weights = gate_up_ptrs_.as<const uint8_t* const>();
    gemm.fp8_scales = gate_up_scale_ptrs_.as<const float* const>();
  }
  gemm.n = shape_.moe_intermediate_size;
  gemm.k = shape_.hidden_size;
  gemm.max_rows = static_cast<int>(entries);
  gemm.num_slots = p;
  gemm.max_slot_rows = static_cast<int>(num_tokens);
  gemm.swiglu = true;
  gemm.out = w.act.as<uint16_t>();  // [rows, I]
  if (!gpu::ablated(gpu::AblatePart::kGateUp)) FULCRUM_CUDA_CHECK(gpu::launch_expert_skinny_gemm(gemm, stream_));
  gemm.x = w.act.as<uint16_t>();
  gemm.row_source = nullptr;
  gemm.weights = down_ptrs_.as<const uint16_t* const>();
  if (shape_.fp8_experts) {
    gemm.weights = nullptr;
    gemm.fp8_weights = down_ptrs_.as<const uint8_t* const>();
    gemm.fp8_scales = down_scale_ptrs_.as<const float* const>();
  }
  gemm.n = shape_.hidden_size;
  gemm.k = shape_.moe_intermediate_size;
  gemm.swiglu = false;
  // The plan came before the gate_up GEMM: written by the kernel before last, complete when this one starts. Not so
  // when the gate_up launch is ablated (the plan's kernel is then the one just before).
  gemm.plan_ready_early = !gpu::ablated(gpu::AblatePart::kGateUp);
  gemm.out = w.expert_out.as<uint16_t>();  // [rows, H]
  if (!gpu::ablated(gpu::AblatePart::kDown)) FULCRUM_CUDA_CHECK(gpu::launch_expert_skinny_gemm(gemm, stream_));
}

bool GpuMoeLayer::fused_cutlass_route_default() {
  static const bool enabled = gpu::env_switch_on("FULCRUM_FUSED_CUTLASS_ROUTE") && fused_small_route_enabled();
  return enabled;
}

bool GpuMoeLayer::fused_cutlass_route_applies(int64_t num_tokens) const {
  return fused_cutlass_route_ && num_tokens > 0 &&
         num_tokens * shape_.num_experts_per_tok <= kFusedCutlassRouteMaxEntries &&
         spec_.algorithm == eplb::DispatchAlgorithm::kStatic && !shape_.fp8_experts && uses_cutlass() &&
         shape_.local_slots() == shape_.num_slots && shape_.num_slots <= cuda::moe::kSmallPlanMaxSlots;
}

void GpuMoeLayer::experts_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens) {
  check_holds_all_slots();
  const bool skinny = uses_skinny(num_tokens) && reinterpret_cast<uintptr_t>(x) % 16 == 0;
  if (skinny && num_tokens > 0 && spec_.algorithm == eplb::DispatchAlgorithm::kStatic && fused_small_route_enabled()) {
    // Static replicas: the router and the permutation in one launch (one kernel less per layer in decode).
    if (!gpu::ablated(gpu::AblatePart::kRoute)) route_permute_small(logits, num_tokens);
    skinny_gemms(x, num_tokens);
    return;
  }
  if (!skinny && fused_cutlass_route_applies(num_tokens)) {
    // Static replicas on CUTLASS, a decode-sized step: routing and the permutation plan in one launch, then a
    // gather of x by the plan's rows, in place of router + count + scan + cursor copy + scatter (five launches and
    // a memset / memcpy node that break the dependent-launch chain).
    MoeWorkspace& w = ws();
    if (!gpu::ablated(gpu::AblatePart::kRoute)) {
      route_permute_small(logits, num_tokens);
      FULCRUM_CUDA_CHECK(cuda::moe::launch_gather_rows(x, w.row_token.as<int32_t>(),
                                                       num_tokens * shape_.num_experts_per_tok, shape_.hidden_size,
                                                       w.permuted.as<uint16_t>(), stream_));
    }
    fp8_rows_quantized_ = false;
    own_problems_built_ = false;
    if (!gpu::ablated(gpu::AblatePart::kGateUp)) run_experts(0, shape_.num_slots);
    return;
  }
  route(logits, num_tokens);
  if (skinny) {
    skinny_experts(x, num_tokens);
  } else {
    permute(x, num_tokens);
    run_experts(0, shape_.num_slots);
  }
}

void GpuMoeLayer::forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out) {
  experts_from_logits(x, logits, num_tokens);
  combine(num_tokens, out);
}

void GpuMoeLayer::forward_experts(const uint16_t* x, int64_t num_tokens) {
  check_holds_all_slots();
  if (!gpu::ablated(gpu::AblatePart::kRouter)) router_logits(x, num_tokens);
  experts_from_logits(x, ws().logits.as<float>(), num_tokens);
}

void GpuMoeLayer::forward(const uint16_t* x, int64_t num_tokens, float* out) {
  forward_experts(x, num_tokens);
  combine(num_tokens, out);
}

std::span<const int32_t> GpuMoeLayer::slot_counts() const {
  FULCRUM_CHECK(host_counts_valid_,
                "slot_counts: the last permute took the CUTLASS path, which reads no counts back (fetch_slot_counts "
                "copies them and synchronizes)");
  return {host_counts_, static_cast<size_t>(shape_.num_slots)};
}

std::span<const int32_t> GpuMoeLayer::fetch_slot_counts() {
  if (!host_counts_valid_) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_counts_, ws().counts.as<int32_t>(), sizeof(int32_t) * shape_.num_slots,
                                       cudaMemcpyDeviceToHost, stream_));
    synchronize();
    host_counts_valid_ = true;
  }
  return slot_counts();
}

double GpuMoeLayer::expert_flops(int slot_begin, int slot_end) const {
  const std::span<const int32_t> counts = slot_counts();
  double rows = 0;
  for (int s = slot_begin; s < slot_end; ++s) rows += counts[s];
  return expert_flops_of_rows(rows, shape_);
}

double GpuMoeLayer::expert_min_bytes(int slot_begin, int slot_end) const {
  const std::span<const int32_t> counts = slot_counts();
  double rows = 0, slots = 0;
  for (int s = slot_begin; s < slot_end; ++s) {
    rows += counts[s];
    slots += counts[s] > 0 ? 1 : 0;
  }
  const double h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  // Weights of the used slots once (bf16: 2 bytes, FP8: 1 byte and its scales), input rows read and output
  // rows written once (bf16); the [n, 2I] and [n, I] intermediates are not counted (a fused kernel keeps them
  // on chip).
  const double weight_bytes = shape_.fp8_experts ? 1.0 + 4.0 / (128.0 * 128.0) : 2.0;
  return slots * 3.0 * h * i * weight_bytes + rows * 4.0 * h;
}

}  // namespace fulcrum::backend
