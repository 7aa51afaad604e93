// GPU MoE layer: buffers, cuBLAS calls and the launch sequence (kernels in moe_kernels.cu).
#include "backend/cuda/moe_layer.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "backend/cuda/cuda_check.hpp"
#include "backend/cuda/moe_kernels.hpp"
#include "eplb/error.hpp"
#include "model/random_weights.hpp"

namespace fulcrum::backend {

DeviceBuffer::DeviceBuffer(size_t bytes) : bytes_(bytes) {
  if (bytes > 0) FULCRUM_CUDA_CHECK(cudaMalloc(&ptr_, bytes));
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
DeviceBuffer upload_array(const std::vector<T>& host, cudaStream_t stream) {
  DeviceBuffer buffer = device_array<T>(static_cast<int64_t>(host.size()));
  if (!host.empty()) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(buffer.as<T>(), host.data(), sizeof(T) * host.size(), cudaMemcpyHostToDevice, stream));
  }
  return buffer;
}

}  // namespace

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

GpuMoeLayer::GpuMoeLayer(const MoeLayerShape& shape, int device_idx) : shape_(shape), device_idx_(device_idx) {
  FULCRUM_CHECK(shape.hidden_size > 0 && shape.moe_intermediate_size > 0 && shape.max_tokens > 0,
                "MoE layer: hidden {} / intermediate {} / max tokens {} must be positive", shape.hidden_size,
                shape.moe_intermediate_size, shape.max_tokens);
  FULCRUM_CHECK(shape.num_experts > 0 && shape.num_experts <= cuda::moe::kMaxRouterExperts,
                "MoE layer: {} experts, the GPU router takes 1..{}", shape.num_experts, cuda::moe::kMaxRouterExperts);
  FULCRUM_CHECK(shape.num_experts_per_tok > 0 && shape.num_experts_per_tok <= cuda::moe::kMaxTopK &&
                    shape.num_experts_per_tok <= shape.num_experts,
                "MoE layer: top-k {} outside 1..min({}, {})", shape.num_experts_per_tok, cuda::moe::kMaxTopK,
                shape.num_experts);
  FULCRUM_CHECK(shape.num_slots >= shape.num_experts, "MoE layer: {} slots for {} experts", shape.num_slots,
                shape.num_experts);
  FULCRUM_CHECK(shape.local_slot_begin >= 0 && shape.local_slots() >= 1 &&
                    shape.local_slot_begin + shape.local_slots() <= shape.num_slots,
                "MoE layer: local slots [{}, {} + {}) outside the {} slots", shape.local_slot_begin,
                shape.local_slot_begin, shape.local_slots(), shape.num_slots);
  FULCRUM_CUDA_CHECK(cudaSetDevice(device_idx));
  cudaStream_t stream = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  stream_ = stream;
  cublasHandle_t handle = nullptr;
  FULCRUM_CUBLAS_CHECK(cublasCreate(&handle));
  cublas_ = handle;
  FULCRUM_CUBLAS_CHECK(cublasSetStream(handle, stream));

  const int64_t h = shape.hidden_size, i = shape.moe_intermediate_size, e = shape.num_experts, p = shape.num_slots;
  const int64_t t = shape.max_tokens, n = t * shape.num_experts_per_tok, l = shape.local_slots();
  router_w_ = device_array<uint16_t>(e * h);
  gate_up_w_ = device_array<uint16_t>(l * 2 * i * h);
  down_w_ = device_array<uint16_t>(l * h * i);
  logits_ = device_array<float>(t * e);
  expert_ids_ = device_array<int32_t>(n);
  weights_ = device_array<float>(n);
  slots_ = device_array<int32_t>(n);
  multi_draws_ = device_array<int32_t>(t);
  draw_base_ = device_array<int32_t>(t + 1);
  counts_ = device_array<int32_t>(p);
  offsets_ = device_array<int32_t>(p + 1);
  cursor_ = device_array<int32_t>(p);
  entry_row_ = device_array<int32_t>(n);
  permuted_ = device_array<uint16_t>(n * h);
  expert_out_ = device_array<uint16_t>(n * h);
  reserve_expert_rows(n);
  own_problems_ = std::make_unique<GemmProblems>();
  recv_problems_ = std::make_unique<GemmProblems>();
  own_problems_->begin(static_cast<int>(l));
  FULCRUM_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&host_counts_), sizeof(int32_t) * (p + 1)));
}

GpuMoeLayer::~GpuMoeLayer() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  own_problems_.reset();
  recv_problems_.reset();
  if (host_counts_ != nullptr) cudaFreeHost(host_counts_);
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void GpuMoeLayer::synchronize() { FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void GpuMoeLayer::reserve_expert_rows(int64_t rows) {
  if (rows <= expert_rows_) return;
  synchronize();  // the old scratch may still be in use
  h_ = device_array<uint16_t>(rows * 2 * shape_.moe_intermediate_size);
  act_ = device_array<uint16_t>(rows * shape_.moe_intermediate_size);
  expert_rows_ = rows;
}

void GpuMoeLayer::check_holds_all_slots() const {
  FULCRUM_CHECK(shape_.local_slots() == shape_.num_slots,
                "MoE layer holds slots [{}, {}) of {}: forward needs them all (expert parallelism: comm::NcclEpMoeLayer)",
                shape_.local_slot_begin, shape_.local_slot_begin + shape_.local_slots(), shape_.num_slots);
}

const uint16_t* GpuMoeLayer::gate_up_of(int local_slot) const {
  if (!slot_gate_up_.empty()) return slot_gate_up_[static_cast<size_t>(local_slot)];
  return gate_up_w_.as<uint16_t>() + int64_t{local_slot} * 2 * shape_.moe_intermediate_size * shape_.hidden_size;
}

const uint16_t* GpuMoeLayer::down_of(int local_slot) const {
  if (!slot_down_.empty()) return slot_down_[static_cast<size_t>(local_slot)];
  return down_w_.as<uint16_t>() + int64_t{local_slot} * shape_.hidden_size * shape_.moe_intermediate_size;
}

void GpuMoeLayer::set_slot_weights(std::span<const uint16_t* const> gate_up, std::span<const uint16_t* const> down) {
  const size_t l = static_cast<size_t>(shape_.local_slots());
  FULCRUM_CHECK(gate_up.size() == down.size() && (gate_up.empty() || gate_up.size() == l),
                "set_slot_weights: {} gate_up and {} down pointers, expected {} each (or none)", gate_up.size(),
                down.size(), l);
  for (size_t q = 0; q < gate_up.size(); ++q) {
    FULCRUM_CHECK(gate_up[q] != nullptr && down[q] != nullptr, "set_slot_weights: null pointer for local slot {}", q);
  }
  slot_gate_up_.assign(gate_up.begin(), gate_up.end());
  slot_down_.assign(down.begin(), down.end());
}

void GpuMoeLayer::upload_weights(std::span<const uint16_t> router, std::span<const uint16_t> gate_up,
                                 std::span<const uint16_t> down) {
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
  const int h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  const float gate_up_scale = model::expert_weight_scale(ExpertTensor::kGateUp, h, i);  // 1/sqrt(H), the router's too
  const float down_scale = model::expert_weight_scale(ExpertTensor::kDown, h, i);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_fill_random_bf16(router_w_.as<uint16_t>(), router_w_.bytes() / 2, seed, gate_up_scale, stream_));
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
    entry_rank_ = device_array<int32_t>(shape_.max_tokens * shape_.num_experts_per_tok);
    chunk_base_ = device_array<int32_t>(static_cast<int64_t>(table) * chunks);
    pair_counts_ = device_array<int32_t>(static_cast<int64_t>(table));
    // A (source, slot) pair is in at most one route, so at most S * P routes.
    routes_ = device_array<int32_t>(static_cast<int64_t>(table) + 1 + 2 * int64_t{spec.num_sources} * spec.num_slots);
  }
  spec_ = spec;
  has_spec_ = true;
  static_slot_of_ = upload_array(spec.static_slot_of, stream_);
  replica_offsets_ = upload_array(spec.replica_offsets, stream_);
  replica_slots_ = upload_array(spec.replica_slots, stream_);
  source_streams_ = upload_array(spec.source_streams, stream_);
  synchronize();
}

void GpuMoeLayer::set_balanced_sources(int source_idx, CountGather gather) {
  FULCRUM_CHECK(source_idx >= 0, "balanced sources: source {} must be >= 0", source_idx);
  FULCRUM_CHECK(static_cast<bool>(gather), "balanced sources: a count gather is required");
  balanced_source_ = source_idx;
  gather_ = std::move(gather);
  has_spec_ = false;  // a balanced spec must be checked against the new source
}

void GpuMoeLayer::router_logits(const uint16_t* x, int64_t num_tokens) {
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= shape_.max_tokens, "MoE layer: {} tokens, at most {}", num_tokens,
                shape_.max_tokens);
  if (num_tokens == 0) return;
  // Row-major logits [T, E] = x [T, H] @ router [E, H]^T, i.e. column-major logits^T = router^T(op T) x.
  const float alpha = 1.0f, beta = 0.0f;
  FULCRUM_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, shape_.num_experts, static_cast<int>(num_tokens),
                                    shape_.hidden_size, &alpha, router_w_.as<uint16_t>(), CUDA_R_16BF, shape_.hidden_size,
                                    x, CUDA_R_16BF, shape_.hidden_size, &beta, logits_.as<float>(), CUDA_R_32F,
                                    shape_.num_experts, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void GpuMoeLayer::route(const float* logits, int64_t num_tokens) {
  FULCRUM_CHECK(has_spec_, "MoE layer: set_replica_choice before the first forward");
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= shape_.max_tokens, "MoE layer: {} tokens, at most {}", num_tokens,
                shape_.max_tokens);
  FULCRUM_CHECK(num_tokens <= spec_.tokens_per_source * spec_.num_sources,
                "MoE layer: {} tokens but {} sources of {} tokens", num_tokens, spec_.num_sources,
                spec_.tokens_per_source);
  num_tokens_ = num_tokens;
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
  args.expert_ids = expert_ids_.as<int32_t>();
  args.weights = weights_.as<float>();
  args.slots = slots_.as<int32_t>();
  args.multi_draws = multi_draws_.as<int32_t>();
  args.histogram = histogram_row_;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_moe_router(args, stream_));
  host_counts_from_route_ = false;
  if (spec_.algorithm == eplb::DispatchAlgorithm::kBalanced) {
    choose_balanced(num_tokens);
    return;
  }
  if (is_static || num_tokens == 0) return;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_exclusive_scan(multi_draws_.as<int32_t>(), num_tokens, draw_base_.as<int32_t>(),
                                                      draw_base_.as<int32_t>() + num_tokens, stream_));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_dynamic_pick(expert_ids_.as<int32_t>(), draw_base_.as<int32_t>(), num_tokens,
                                                    shape_.num_experts_per_tok, spec_.tokens_per_source,
                                                    source_streams_.as<uint64_t>(), replica_offsets_.as<int32_t>(),
                                                    replica_slots_.as<int32_t>(), slots_.as<int32_t>(), stream_));
}

void GpuMoeLayer::choose_balanced(int64_t num_tokens) {
  const int num_sources = spec_.num_sources, num_experts = shape_.num_experts, p = shape_.num_slots;
  const size_t pairs = static_cast<size_t>(num_sources) * num_experts;
  const int k = shape_.num_experts_per_tok;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_balanced_counts(expert_ids_.as<int32_t>(), num_tokens, k, num_experts,
                                                       spec_.tokens_per_source, num_sources, entry_rank_.as<int32_t>(),
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
  FULCRUM_CUDA_CHECK(cuda::moe::launch_balanced_pick(expert_ids_.as<int32_t>(), entry_rank_.as<int32_t>(),
                                                     chunk_base_.as<int32_t>(), num_tokens, k, num_experts,
                                                     spec_.tokens_per_source, offsets, offsets + pairs + 1,
                                                     offsets + pairs + 1 + num_routes, slots_.as<int32_t>(), stream_));
  host_counts_from_route_ = true;
}

void GpuMoeLayer::permute(const uint16_t* x, int64_t num_tokens) {
  FULCRUM_CHECK(num_tokens == num_tokens_, "MoE layer: permute of {} tokens after routing {}", num_tokens, num_tokens_);
  const int p = shape_.num_slots, k = shape_.num_experts_per_tok;
  const int64_t num_entries = num_tokens * k;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_slot_counts(slots_.as<int32_t>(), num_entries, p, counts_.as<int32_t>(),
                                                   offsets_.as<int32_t>(), stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(cursor_.as<int32_t>(), offsets_.as<int32_t>(), sizeof(int32_t) * p,
                                     cudaMemcpyDeviceToDevice, stream_));
  FULCRUM_CUDA_CHECK(cuda::moe::launch_permute_rows(x, num_tokens, k, shape_.hidden_size, slots_.as<int32_t>(),
                                                    cursor_.as<int32_t>(), entry_row_.as<int32_t>(),
                                                    permuted_.as<uint16_t>(), stream_));
  // The one host synchronization: cuBLAS takes the GEMM sizes as host arrays (balanced routing has them
  // already).
  if (!std::exchange(host_counts_from_route_, false)) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_counts_, counts_.as<int32_t>(), sizeof(int32_t) * p, cudaMemcpyDeviceToHost, stream_));
    synchronize();
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
        problems.add(n, gate_up_of(local), permuted_.as<uint16_t>() + row * h, h_.as<uint16_t>() + row * 2 * i,
                     down_of(local), act_.as<uint16_t>() + row * i, expert_out_.as<uint16_t>() + row * h);
      }
    }
    row += n;
  }
  compact_begin_[l] = static_cast<int>(problems.rows.size());
  problems.upload(stream_);
}

void GpuMoeLayer::expert_gemm(const GemmProblems& problems, int gemm_idx, int first, int count, double flops) {
  if (count == 0) return;
  const int out_features = gemm_idx == 0 ? 2 * shape_.moe_intermediate_size : shape_.hidden_size;
  const int in_features = gemm_idx == 0 ? shape_.hidden_size : shape_.moe_intermediate_size;
  const float alpha = 1.0f, beta = 0.0f;
  const void** host_a = problems.at(gemm_idx, 0) + first;
  const void** host_b = problems.at(gemm_idx, 1) + first;
  const void** host_c = problems.at(gemm_idx, 2) + first;
  // Row-major out [n, N] = in [n, K] @ W [N, K]^T is column-major out^T = W^T(op T) in^T: m = N, n = rows, k = K.
  const bool per_slot = expert_gemm_ == ExpertGemm::kPerSlot || (expert_gemm_ == ExpertGemm::kAuto && flops >= kPerSlotMinFlops);
  if (per_slot) {
    for (int q = 0; q < count; ++q) {
      FULCRUM_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, out_features, problems.rows[first + q],
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
      cublas_, trans_a.data(), trans_b.data(), m.data(), problems.rows.data() + first, k.data(), alphas.data(),
      device_ptrs + (3 * gemm_idx) * cap + first, CUDA_R_16BF, k.data(), device_ptrs + (3 * gemm_idx + 1) * cap + first,
      CUDA_R_16BF, k.data(), betas.data(), device_ptrs + (3 * gemm_idx + 2) * cap + first, CUDA_R_16BF, m.data(), count,
      group_size.data(), CUBLAS_COMPUTE_32F));
}

void GpuMoeLayer::run_experts(int slot_begin, int slot_end) {
  const int local_begin = shape_.local_slot_begin, local_end = local_begin + shape_.local_slots();
  FULCRUM_CHECK(local_begin <= slot_begin && slot_begin <= slot_end && slot_end <= local_end,
                "run_experts: slots [{}, {}) outside this layer's [{}, {})", slot_begin, slot_end, local_begin, local_end);
  const int first = compact_begin_[slot_begin - local_begin];
  const int count = compact_begin_[slot_end - local_begin] - first;
  const double flops = expert_flops(slot_begin, slot_end);
  expert_gemm(*own_problems_, 0, first, count, flops);
  int64_t row_begin = 0, num_rows = 0;
  for (int s = 0; s < slot_end; ++s) (s < slot_begin ? row_begin : num_rows) += host_counts_[s];
  const int64_t i = shape_.moe_intermediate_size;
  FULCRUM_CUDA_CHECK(cuda::moe::launch_silu_mul_bf16(h_.as<uint16_t>() + row_begin * 2 * i, num_rows,
                                                     shape_.moe_intermediate_size, act_.as<uint16_t>() + row_begin * i,
                                                     stream_));
  expert_gemm(*own_problems_, 1, first, count, flops);
}

void GpuMoeLayer::run_experts_on(const uint16_t* rows, std::span<const int32_t> rows_per_segment_slot, uint16_t* out) {
  const size_t l = static_cast<size_t>(shape_.local_slots());
  FULCRUM_CHECK(!rows_per_segment_slot.empty() && rows_per_segment_slot.size() % l == 0,
                "run_experts_on: {} counts are not segments of {} local slots", rows_per_segment_slot.size(), l);
  int64_t n = 0;
  for (const int32_t c : rows_per_segment_slot) {
    FULCRUM_CHECK(c >= 0, "run_experts_on: negative row count {}", c);
    n += c;
  }
  FULCRUM_CHECK(n <= expert_rows_, "run_experts_on: {} rows, scratch for {} (reserve_expert_rows)", n, expert_rows_);
  const int64_t h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  GemmProblems& problems = *recv_problems_;
  problems.begin(static_cast<int>(rows_per_segment_slot.size()));
  int64_t row = 0;
  for (size_t q = 0; q < rows_per_segment_slot.size(); ++q) {
    const int c = rows_per_segment_slot[q];
    if (c == 0) continue;
    const int local = static_cast<int>(q % l);
    problems.add(c, gate_up_of(local), rows + row * h, h_.as<uint16_t>() + row * 2 * i, down_of(local),
                 act_.as<uint16_t>() + row * i, out + row * h);
    row += c;
  }
  problems.upload(stream_);
  const int count = static_cast<int>(problems.rows.size());
  const double flops = expert_flops_of_rows(static_cast<double>(n), shape_);
  expert_gemm(problems, 0, 0, count, flops);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_silu_mul_bf16(h_.as<uint16_t>(), n, shape_.moe_intermediate_size,
                                                     act_.as<uint16_t>(), stream_));
  expert_gemm(problems, 1, 0, count, flops);
}

void GpuMoeLayer::combine(int64_t num_tokens, float* out) { combine_rows(expert_out_.as<uint16_t>(), num_tokens, out); }

void GpuMoeLayer::combine_rows(const uint16_t* rows, int64_t num_tokens, float* out) {
  FULCRUM_CHECK(num_tokens == num_tokens_, "MoE layer: combine of {} tokens after routing {}", num_tokens, num_tokens_);
  FULCRUM_CUDA_CHECK(cuda::moe::launch_combine_f32(rows, entry_row_.as<int32_t>(), weights_.as<float>(), num_tokens,
                                                   shape_.num_experts_per_tok, shape_.hidden_size, out, stream_));
}

void GpuMoeLayer::forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out) {
  check_holds_all_slots();
  route(logits, num_tokens);
  permute(x, num_tokens);
  run_experts(0, shape_.num_slots);
  combine(num_tokens, out);
}

void GpuMoeLayer::forward(const uint16_t* x, int64_t num_tokens, float* out) {
  check_holds_all_slots();
  router_logits(x, num_tokens);
  forward_from_logits(x, logits_.as<float>(), num_tokens, out);
}

double GpuMoeLayer::expert_flops(int slot_begin, int slot_end) const {
  double rows = 0;
  for (int s = slot_begin; s < slot_end; ++s) rows += host_counts_[s];
  return expert_flops_of_rows(rows, shape_);
}

double GpuMoeLayer::expert_min_bytes(int slot_begin, int slot_end) const {
  double rows = 0, slots = 0;
  for (int s = slot_begin; s < slot_end; ++s) {
    rows += host_counts_[s];
    slots += host_counts_[s] > 0 ? 1 : 0;
  }
  const double h = shape_.hidden_size, i = shape_.moe_intermediate_size;
  // Weights of the used slots once, input rows read and output rows written once (bf16); the [n, 2I]
  // and [n, I] intermediates are not counted (a fused kernel keeps them on chip).
  return 2.0 * (slots * 3.0 * h * i + rows * 2.0 * h);
}

}  // namespace fulcrum::backend
