// GpuEngine: construction, sequences, step packing and the forward's launch sequence.
#include "gpu/gpu_engine.hpp"

#include <algorithm>
#include <filesystem>
#include <cmath>
#include <cstring>
#include <cstdio>
#include <cstdlib>
#include <set>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/ep_moe_layer.hpp"
#include "gpu/moe/moe_kernels.hpp"
#include "gpu/moe/moe_layer.hpp"
#include "eplb/error.hpp"
#include "gpu/ablation.hpp"
#include "gpu/attention_runner.hpp"
#include "gpu/dense_gemm.hpp"
#include "gpu/graph_cache.hpp"
#include "gpu/kernels/sampler_top_logprobs.hpp"
#include "gpu/kernels/step_ops.hpp"
#include "model/backend.hpp"

namespace fulcrum::gpu {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
// Rows of one LM-head call over rows that do not sample (prompt logprobs, forward_logits): the head's buffers hold
// max(sampling rows, this) rows, so a long prompt's rows take few GEMMs of a useful M.
constexpr int64_t kHeadChunkRows = 256;

template <typename T>
T* device_alloc(int64_t n, int64_t& total) {
  void* p = nullptr;
  const size_t bytes = sizeof(T) * static_cast<size_t>(std::max<int64_t>(n, 1));
  FULCRUM_CUDA_CHECK(cudaMalloc(&p, bytes));
  total += static_cast<int64_t>(bytes);
  return static_cast<T*>(p);
}

void check_launch(cudaError_t status, const char* what) {
  FULCRUM_CHECK(status == cudaSuccess, "GPU engine: {} failed: {}", what, cudaGetErrorString(status));
}

float float_of(int32_t bits) {
  float v = 0.0f;
  std::memcpy(&v, &bits, 4);
  return v;
}

// One entry's prompt logprobs from GpuEngine::prompt_logprobs_to_host's copy (`host`: num_rows logprob bits, then
// ids and logprob bits [num_rows, num_top]), its rows from first_row. A NaN value means the row's logits hold a NaN
// or +inf or are all -inf (no finite maximum, which model::prompt_entry refuses too): the entry fails, false.
bool fill_prompt_entry(const int32_t* host, const model::StepSequence& seq, int64_t first_row, int64_t num_rows,
                       int num_top, int vocab, std::vector<model::TokenLogprob>& dst, std::string& error) {
  const int32_t* const ids = host + num_rows;
  const int32_t* const bits = ids + num_rows * num_top;
  const int wanted = std::min({seq.top_logprobs, num_top, vocab});
  dst.clear();
  for (size_t j = 0; j < seq.prompt_targets.size(); ++j) {
    const int64_t row = first_row + static_cast<int64_t>(j);
    model::TokenLogprob lp;
    lp.logprob = float_of(host[row]);
    if (std::isnan(lp.logprob)) {
      error = fmt::format("prompt logprobs: the logits of prompt row {} of {} hold a NaN or +inf, or are all -inf", j,
                          seq.prompt_targets.size());
      dst.clear();
      return false;
    }
    for (int m = 0; m < wanted; ++m) {
      const int64_t at = row * num_top + m;
      lp.top_ids.push_back(ids[at]);
      lp.top_logprobs.push_back(float_of(bits[at]));
    }
    dst.push_back(std::move(lp));
  }
  return true;
}
}  // namespace

// Device buffers sized for the engine's capacities, allocated once.
struct GpuEngine::Workspace {
  std::vector<void*> owned;
  float* residual = nullptr;   // [T, H] fp32 residual stream
  float* delta = nullptr;      // [T, H] fp32 output of the last block, added by the next add + RMSNorm
  uint16_t* x = nullptr;       // [T, H] bf16 normalized input of a block
  float* qkv = nullptr;        // [T, (Hq + 2 Hkv) D]
  uint16_t* q = nullptr;       // [T, Hq, D]
  uint16_t* attn = nullptr;    // [T, Hq, D]
  float* mlp = nullptr;        // [T, 2 I] dense layers
  uint16_t* act = nullptr;     // [T, I]
  uint16_t* head_x = nullptr;  // [logit_rows, H]
  float* logits = nullptr;     // [logit_rows, V]
  int32_t* head_rows = nullptr;       // [T] token rows through the LM head that do not sample (prompt rows of a
                                      // step; every row in forward_logits), filled per step from its host twin
  int32_t* head_rows_host = nullptr;  // pinned [2 T]: head rows, then prompt targets
  int32_t* prompt_targets = nullptr;  // [T] the token each prompt row's logprob is of (StepSequence::prompt_targets)
  float* prompt_logprobs = nullptr;   // [T]
  int32_t* prompt_top_ids = nullptr;  // [T, kMaxTopLogprobs] (row stride: the step's prompt top count)
  float* prompt_top_logprobs = nullptr;  // [T, kMaxTopLogprobs]
  int32_t* prompt_out_host = nullptr;    // pinned [T] logprob bits, [T, kMaxTopLogprobs] ids, then logprob bits
  int32_t* tokens = nullptr;   // [S]
  float* logprobs = nullptr;   // [S]
  int32_t* top_ids = nullptr;  // [S, kMaxTopLogprobs] (row stride: the step's top count)
  float* top_logprobs = nullptr;  // [S, kMaxTopLogprobs]
  void* sampler_ws = nullptr;
  size_t sampler_ws_bytes = 0;
  float* inv_freq = nullptr;   // [D / 2]
  unsigned long long* histogram = nullptr;  // [moe_layers, E]
  void* step_dev = nullptr;    // StepLayout buffer on the device
  void* step_host = nullptr;   // and its pinned host twin
  int32_t* out_host = nullptr; // pinned [S] tokens, [S] logprob bits, [S, kMaxTopLogprobs] top ids, top logprob bits
  int logit_rows = 0;          // max(S, min(T, kHeadChunkRows))
  cudaEvent_t step_events[3] = {};  // a step's upload, forward and end (GpuEngineOptions::time_steps)

  ~Workspace() {
    for (cudaEvent_t e : step_events) {
      if (e != nullptr) cudaEventDestroy(e);
    }
    for (void* p : owned) cudaFree(p);
    if (step_host != nullptr) cudaFreeHost(step_host);
    if (out_host != nullptr) cudaFreeHost(out_host);
    if (head_rows_host != nullptr) cudaFreeHost(head_rows_host);
    if (prompt_out_host != nullptr) cudaFreeHost(prompt_out_host);
  }
};

GpuEngine::GpuEngine(const model::Qwen3MoeConfig& config, GpuEngineOptions options)
    : config_(config),
      options_(std::move(options)),
      capacity_{options_.max_batch_tokens, options_.max_batch_seqs, 0},
      layout_(StepCapacity{1, 1, 1}) {
  int devices = 0;
  const cudaError_t count_status = cudaGetDeviceCount(&devices);
  FULCRUM_CHECK(count_status == cudaSuccess && devices > 0, "--device cuda: no CUDA device is visible ({})",
                count_status == cudaSuccess ? "0 devices" : cudaGetErrorString(count_status));
  FULCRUM_CHECK(options_.device >= 0 && options_.device < devices, "GPU {} does not exist ({} visible)", options_.device,
                devices);
  FULCRUM_CHECK(options_.max_batch_tokens >= 1 && options_.max_batch_seqs >= 1 &&
                    options_.max_batch_seqs <= options_.max_batch_tokens,
                "GPU engine: batch capacity {} tokens / {} sequences", options_.max_batch_tokens, options_.max_batch_seqs);
  FULCRUM_CHECK(options_.page_size >= 1, "GPU engine: page size {} must be positive", options_.page_size);
  FULCRUM_CHECK(config.head_dim % 2 == 0, "GPU engine: head_dim {} must be even", config.head_dim);
  if (ablation_mask() != 0) {
    std::fprintf(stderr, "fulcrum: FULCRUM_ABLATE=%s skips launches for measurement: outputs are wrong\n",
                 std::getenv("FULCRUM_ABLATE"));
  }
  FULCRUM_CUDA_CHECK(cudaSetDevice(options_.device));
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));

  const int num_moe = static_cast<int>(config.moe_layer_indices().size());
  const int ep_world = ep_size();
  if (num_moe > 0 && options_.placement.num_layers == 0) {
    options_.placement = eplb::trivial_placement(eplb::Topology{config.num_experts, ep_world, 1}, num_moe, config.num_experts);
  }
  if (num_moe > 0) {
    FULCRUM_CHECK(options_.placement.num_layers == num_moe && options_.placement.num_logical_experts == config.num_experts,
                  "placement covers {} MoE layers of {} experts, the model has {} MoE layers of {} experts",
                  options_.placement.num_layers, options_.placement.num_logical_experts, num_moe, config.num_experts);
    FULCRUM_CHECK(options_.placement.topology.num_gpus == ep_world,
                  "GPU engine: a placement over {} GPUs for {} expert-parallel rank(s)", options_.placement.topology.num_gpus,
                  ep_world);
    options_.placement.validate();
  }
  FULCRUM_CHECK(options_.ep == nullptr || !DeviceWeights::fp8_experts_for(config),
                "GPU engine: expert parallelism runs bf16 experts; this checkpoint's experts are FP8");
  weights_ = std::make_unique<DeviceWeights>(config, options_.placement, options_.device, options_.fp8_dense_gemms,
                                             options_.ep != nullptr ? options_.ep->rank() : 0);
  {
    // FP8 projections (an FP8 checkpoint's): the quantized GEMM path's scratch, sized for a whole step's tokens
    // and the widest FP8 projection (every one runs with fp32 output).
    const DeviceWeights::Fp8Dense& fp8 = weights_->fp8_dense();
    const int64_t h = config.hidden_size, q = int64_t{config.num_attention_heads} * config.head_dim;
    const int64_t qkv = q + 2 * int64_t{config.num_key_value_heads} * config.head_dim, i = config.intermediate_size;
    DenseFp8Capacity capacity;
    const auto fits = [&](bool on, int64_t n, int64_t k) {
      if (!on) return;
      capacity.max_rows = options_.max_batch_tokens;
      capacity.max_n = std::max(capacity.max_n, n);
      capacity.max_k = std::max(capacity.max_k, k);
    };
    fits(fp8.qkv, qkv, h);
    fits(fp8.o, h, q);
    fits(fp8.mlp, 2 * i, h);
    fits(fp8.mlp, h, i);
    gemm_ = std::make_unique<DenseGemm>(stream_, options_.device, capacity);
    workspace_bytes_ += gemm_->fp8_scratch_bytes();
  }

  // Workspace.
  ws_ = std::make_unique<Workspace>();
  Workspace& w = *ws_;
  const int64_t t = options_.max_batch_tokens, h = config.hidden_size, d = config.head_dim;
  const int64_t q_width = int64_t{config.num_attention_heads} * d;
  const int64_t qkv_width = q_width + 2 * int64_t{config.num_key_value_heads} * d;
  const int s = options_.max_batch_seqs;
  int64_t& bytes = workspace_bytes_;
  const auto keep = [&](void* p) { w.owned.push_back(p); return p; };
  w.residual = static_cast<float*>(keep(device_alloc<float>(t * h, bytes)));
  w.delta = static_cast<float*>(keep(device_alloc<float>(t * h, bytes)));
  w.x = static_cast<uint16_t*>(keep(device_alloc<uint16_t>(t * h, bytes)));
  w.qkv = static_cast<float*>(keep(device_alloc<float>(t * qkv_width, bytes)));
  w.q = static_cast<uint16_t*>(keep(device_alloc<uint16_t>(t * q_width, bytes)));
  w.attn = static_cast<uint16_t*>(keep(device_alloc<uint16_t>(t * q_width, bytes)));
  if (num_moe < config.num_hidden_layers) {
    w.mlp = static_cast<float*>(keep(device_alloc<float>(t * 2 * config.intermediate_size, bytes)));
    w.act = static_cast<uint16_t*>(keep(device_alloc<uint16_t>(t * config.intermediate_size, bytes)));
  }
  // The head's buffers serve the sampling rows and, in eager steps, chunks of prompt rows: allocated here (at
  // most kHeadChunkRows rows beyond the S sampling rows: 156 MB of logits at a 152k vocabulary), so the prompt
  // path allocates nothing per step and the KV pool is sized after it.
  w.logit_rows = static_cast<int>(std::max<int64_t>(s, std::min(t, kHeadChunkRows)));
  w.head_x = static_cast<uint16_t*>(keep(device_alloc<uint16_t>(int64_t{w.logit_rows} * h, bytes)));
  w.logits = static_cast<float*>(keep(device_alloc<float>(int64_t{w.logit_rows} * config.vocab_size, bytes)));
  w.head_rows = static_cast<int32_t*>(keep(device_alloc<int32_t>(t, bytes)));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&w.head_rows_host, sizeof(int32_t) * 2 * static_cast<size_t>(t)));
  w.prompt_targets = static_cast<int32_t*>(keep(device_alloc<int32_t>(t, bytes)));
  w.prompt_logprobs = static_cast<float*>(keep(device_alloc<float>(t, bytes)));
  w.prompt_top_ids = static_cast<int32_t*>(keep(device_alloc<int32_t>(t * model::kMaxTopLogprobs, bytes)));
  w.prompt_top_logprobs = static_cast<float*>(keep(device_alloc<float>(t * model::kMaxTopLogprobs, bytes)));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&w.prompt_out_host,
                                    sizeof(int32_t) * (1 + 2 * model::kMaxTopLogprobs) * static_cast<size_t>(t)));
  w.tokens = static_cast<int32_t*>(keep(device_alloc<int32_t>(s, bytes)));
  w.logprobs = static_cast<float*>(keep(device_alloc<float>(s, bytes)));
  w.top_ids = static_cast<int32_t*>(keep(device_alloc<int32_t>(int64_t{s} * model::kMaxTopLogprobs, bytes)));
  w.top_logprobs = static_cast<float*>(keep(device_alloc<float>(int64_t{s} * model::kMaxTopLogprobs, bytes)));
  w.sampler_ws_bytes = sampler_workspace_bytes(s, config.vocab_size);
  w.sampler_ws = keep(device_alloc<char>(static_cast<int64_t>(w.sampler_ws_bytes), bytes));
  const std::vector<float> inv_freq = model::rope_inv_freq(d, config.rope_theta);
  w.inv_freq = static_cast<float*>(keep(device_alloc<float>(d / 2, bytes)));
  FULCRUM_CUDA_CHECK(cudaMemcpy(w.inv_freq, inv_freq.data(), inv_freq.size() * 4, cudaMemcpyHostToDevice));
  w.histogram = static_cast<unsigned long long*>(
      keep(device_alloc<unsigned long long>(int64_t{std::max(num_moe, 1)} * std::max(config.num_experts, 1), bytes)));
  FULCRUM_CUDA_CHECK(cudaMemset(w.histogram, 0, sizeof(unsigned long long) * std::max(num_moe, 1) * std::max(config.num_experts, 1)));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&w.out_host, sizeof(int32_t) * 2 * (1 + model::kMaxTopLogprobs) * static_cast<size_t>(s)));

  // MoE layers: one object per layer, all sharing one workspace and the engine's stream.
  if (num_moe > 0) {
    backend::MoeLayerShape shape;
    shape.hidden_size = config.hidden_size;
    shape.moe_intermediate_size = weights_->expert_intermediate_size();  // FP8: padded to whole blocks
    shape.fp8_experts = weights_->fp8_experts();
    shape.num_experts = config.num_experts;
    shape.num_experts_per_tok = config.num_experts_per_tok;
    shape.norm_topk_prob = config.norm_topk_prob;
    shape.num_slots = options_.placement.num_physical_experts();
    shape.max_tokens = t;
    shape.external_weights = true;
    const auto moe_ws = std::make_shared<backend::MoeWorkspace>(shape, options_.device);
    // EP: the exchanged rows' buffers, one set for all layers (they run one after another on stream_).
    const auto ep_rows = options_.ep != nullptr ? std::make_shared<backend::EpRowBuffers>(shape, ep_world) : nullptr;
    for (int m = 0; m < num_moe; ++m) {
      backend::GpuMoeLayer* layer = nullptr;
      if (options_.ep != nullptr) {
        ep_moe_.push_back(std::make_unique<backend::EpMoeLayer>(shape, *options_.ep, options_.device, stream_, moe_ws, ep_rows));
        layer = &ep_moe_.back()->layer();
      } else {
        moe_.push_back(std::make_unique<backend::GpuMoeLayer>(shape, options_.device, stream_, moe_ws));
        layer = moe_.back().get();
      }
      const LayerWeights& lw = weights_->layer(config.moe_layer_indices()[static_cast<size_t>(m)]);
      layer->set_router_weights(lw.router);
      layer->set_recorder(w.histogram + int64_t{m} * config.num_experts);
      layer->set_skinny_max_entries(options_.skinny_max_entries);
      point_moe_layer_at_slots(m);
    }
  }
  attention_ = make_attention_runner(options_.attention, config, options_.page_size, t, s, options_.device);

  // KV pool: what is asked, or a fraction of what is left.
  const int64_t page_bytes = DeviceKvPool::bytes_for(1, options_.page_size, config.num_hidden_layers,
                                                     config.num_key_value_heads, static_cast<int>(d));
  int64_t pages = options_.kv_pages;
  if (pages <= 0) {
    size_t free_bytes = 0, total_bytes = 0;
    FULCRUM_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    pages = static_cast<int64_t>(static_cast<double>(free_bytes) * options_.kv_memory_fraction) / page_bytes;
    FULCRUM_CHECK(pages >= 1, "GPU engine: no memory left for the KV cache ({:.2f} GiB free after {:.2f} GiB of weights "
                  "and {:.2f} GiB of workspace)", free_bytes / kGiB, weights_->bytes() / kGiB, workspace_bytes_ / kGiB);
  }
  kv_ = std::make_unique<DeviceKvPool>(pages, options_.page_size, config.num_hidden_layers, config.num_key_value_heads,
                                       static_cast<int>(d), options_.device);
  capacity_.max_pages = pages;
  layout_ = StepLayout(capacity_);
  w.step_dev = keep(device_alloc<char>(static_cast<int64_t>(layout_.bytes), workspace_bytes_));
  FULCRUM_CUDA_CHECK(cudaMallocHost(&w.step_host, layout_.bytes));
  for (cudaEvent_t& e : w.step_events) FULCRUM_CUDA_CHECK(cudaEventCreate(&e));
  graphs_ = std::make_unique<GraphCache>();
}

GpuEngine::~GpuEngine() {
  graphs_.reset();
  moe_.clear();
  ep_moe_.clear();
  attention_.reset();
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  ws_.reset();
  gemm_.reset();
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

// MoE layer m's slot pointers (the pool's current buffers) and replica tables (the weights' placement, row m): both
// rewritten in place on a layer that had them, so captured decode graphs follow (GpuMoeLayer::set_slot_weights,
// set_replica_choice).
void GpuEngine::point_moe_layer_at_slots(int m) {
  backend::GpuMoeLayer& layer = ep_moe_.empty() ? *moe_[static_cast<size_t>(m)] : ep_moe_[static_cast<size_t>(m)]->layer();
  if (layer.shape().fp8_experts) {
    layer.set_fp8_slot_weights(weights_->slot_pool()->fp8_ptrs(m));
  } else {
    layer.set_slot_weights(weights_->slot_pool()->gate_up_ptrs(m), weights_->slot_pool()->down_ptrs(m));
  }
  const eplb::Placement& placement = weights_->placement();
  const int ep_world = ep_size();
  const eplb::Topology topo{placement.num_physical_experts(), ep_world, 1};
  // Dynamic choice: one draw stream per source (EP: per rank, every rank holding them all and taking its own).
  std::vector<uint64_t> streams;
  if (options_.dispatch == eplb::DispatchAlgorithm::kDynamic) {
    for (int r = 0; r < ep_world; ++r) streams.push_back(options_.dispatch_seed + static_cast<uint64_t>(m) + (uint64_t{r} << 32));
  }
  const model::moe::ReplicaChoiceSpec spec = model::moe::make_replica_choice(
      options_.dispatch, placement.layer(m), config_.num_experts, topo, options_.max_batch_tokens, streams);
  if (ep_moe_.empty()) {
    layer.set_replica_choice(spec);
  } else {
    ep_moe_[static_cast<size_t>(m)]->set_replica_choice(spec);
  }
}

int64_t GpuEngine::apply_placement(const eplb::Placement& next) {
  const eplb::Placement& now = weights_->placement();
  FULCRUM_CHECK(num_moe_layers() > 0, "GPU engine: a placement for a model without MoE layers");
  FULCRUM_CHECK(next.num_layers == now.num_layers && next.num_logical_experts == now.num_logical_experts &&
                    next.num_physical_experts() == now.num_physical_experts() && next.topology.num_gpus == ep_size(),
                "GPU engine: a placement of {} layers x {} slots for {} experts on {} GPUs; this engine runs {} x {} "
                "for {} on {}",
                next.num_layers, next.num_physical_experts(), next.num_logical_experts, next.topology.num_gpus,
                now.num_layers, now.num_physical_experts(), now.num_logical_experts, ep_size());
  next.validate();
  FULCRUM_CHECK(broken_placement_.empty(), "GPU engine: {}", broken_placement_);
  FULCRUM_CUDA_CHECK(cudaSetDevice(options_.device));
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));  // no queued step reads a buffer the migration frees
  int64_t moved = 0;
  for (int m = 0; m < next.num_layers; ++m) {
    const std::span<const int32_t> row = next.layer(m);
    if (std::equal(row.begin(), row.end(), now.layer(m).begin())) continue;
    // On an error nothing of layer m moved; else now's row m is next's. EP ranks: collective over the exchange
    // (every rank skips the same layers: they hold the same placement).
    moved += weights_->migrate_layer(m, row, options_.ep);
    try {
      point_moe_layer_at_slots(m);
    } catch (const std::exception& e) {
      // Layer m's slots moved but the layer may still read the freed buffers: no later step may run on it.
      broken_placement_ = fmt::format("MoE layer {} was left between two placements ({}); rebuild the engine", m, e.what());
      throw Error(broken_placement_);
    }
  }
  return moved;
}

void GpuEngine::load(model::Checkpoint& checkpoint, const std::function<void(int, int)>& on_layer) {
  weights_->load(checkpoint, on_layer);
}

void GpuEngine::fill_random(uint64_t seed) { weights_->fill_random(seed); }

bool GpuEngine::load_weights(const std::string& model_dir, const std::string& cache_dir,
                             const std::function<void(int, int)>& on_layer) {
  if (!cache_dir.empty() && std::filesystem::exists(DeviceWeights::cache_file(cache_dir))) {
    weights_->load_cache(cache_dir, on_layer);
    return true;
  }
  {
    model::Checkpoint checkpoint(model_dir);
    weights_->load(checkpoint, on_layer);
  }
  if (!cache_dir.empty()) weights_->save_cache(cache_dir);
  return false;
}

int64_t GpuEngine::max_sequence_length() const {
  return std::min<int64_t>(config_.max_position_embeddings > 0 ? config_.max_position_embeddings : INT32_MAX,
                           kv_->num_pages() * kv_->page_size());
}

void GpuEngine::allocate(model::SequenceId id, int64_t capacity) {
  FULCRUM_CHECK(capacity <= max_sequence_length(), "sequence {}: capacity {} exceeds the longest sequence {}", id,
                capacity, max_sequence_length());
  kv_->allocate(id, capacity);
}

void GpuEngine::allocate_on_pages(model::SequenceId id, const model::SequencePages& pages) {
  FULCRUM_CHECK(pages.dp_group == 0, "sequence {}: attention-DP group {}, the GPU engine has one", id, pages.dp_group);
  FULCRUM_CHECK(pages.capacity <= max_sequence_length(), "sequence {}: capacity {} exceeds the longest sequence {}", id,
                pages.capacity, max_sequence_length());
  kv_->allocate_on_pages(id, pages.capacity, pages.page_ids, pages.num_cached_tokens, pages.copy_source_page, stream_);
}

void GpuEngine::release(model::SequenceId id) { kv_->release(id); }

std::string GpuEngine::attention_name() const { return attention_->name(); }

StepShape GpuEngine::pack(std::span<const model::StepSequence> batch, bool sample_every_row) {
  FULCRUM_CHECK(!batch.empty(), "GPU engine: empty step");
  FULCRUM_CHECK(static_cast<int64_t>(batch.size()) <= capacity_.max_seqs, "GPU engine: {} sequences in one step, at most {}",
                batch.size(), capacity_.max_seqs);
  const StepArrays a = layout_.at(ws_->step_host);
  const int ps = kv_->page_size();
  StepShape shape;
  shape.num_seqs = static_cast<int>(batch.size());
  shape.decode_only = !sample_every_row;
  std::set<model::SequenceId> seen;
  for (size_t i = 0; i < batch.size(); ++i) {
    const model::StepSequence& seq = batch[i];
    FULCRUM_CHECK(seen.insert(seq.id).second, "GPU engine: sequence {} appears twice in one step", seq.id);
    const KvSequence& kv = kv_->sequence(seq.id);
    const auto n = static_cast<int64_t>(seq.token_ids.size());
    FULCRUM_CHECK(n >= 1, "GPU engine: sequence {} has no new token", seq.id);
    FULCRUM_CHECK(kv.num_tokens + n <= kv.capacity, "sequence {}: kv cache of capacity {} cannot take {} more tokens after {}",
                  seq.id, kv.capacity, n, kv.num_tokens);
    FULCRUM_CHECK(shape.num_tokens + n <= capacity_.max_tokens, "GPU engine: more than {} tokens in one step",
                  capacity_.max_tokens);
    a.q_indptr[i] = static_cast<int32_t>(shape.num_tokens);
    a.kv_page_indptr[i] = static_cast<int32_t>(shape.num_pages);
    for (int64_t j = 0; j < n; ++j) {
      const int32_t token = seq.token_ids[static_cast<size_t>(j)];
      FULCRUM_CHECK(token >= 0 && token < config_.vocab_size, "sequence {}: token id {} outside the vocabulary [0, {})",
                    seq.id, token, config_.vocab_size);
      const int64_t pos = kv.num_tokens + j, row = shape.num_tokens + j;
      a.token_ids[row] = token;
      a.positions[row] = static_cast<int32_t>(pos);
      a.kv_rows[row] = kv.page_ids[static_cast<size_t>(pos / ps)] * ps + static_cast<int32_t>(pos % ps);
    }
    const int64_t len = kv.num_tokens + n, pages = (len + ps - 1) / ps;
    std::copy_n(kv.page_ids.begin(), pages, a.page_ids + shape.num_pages);
    a.kv_len[i] = static_cast<int32_t>(len);
    shape.num_pages += pages;
    shape.max_kv_len = std::max(shape.max_kv_len, len);
    shape.num_tokens += n;
    if (seq.sample) {
      model::validate_sampling_params(seq.sampling);
      a.sample_rows[shape.num_samples] = static_cast<int32_t>(shape.num_tokens - 1);
      a.sampler[shape.num_samples] = SamplerRow{seq.sampling.temperature, seq.sampling.top_p, seq.sampling.top_k, 0,
                                                seq.uniform};
      ++shape.num_samples;
    }
    shape.decode_only = shape.decode_only && n == 1 && seq.sample;
  }
  a.q_indptr[batch.size()] = static_cast<int32_t>(shape.num_tokens);
  a.kv_page_indptr[batch.size()] = static_cast<int32_t>(shape.num_pages);
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(ws_->step_dev, ws_->step_host, layout_.used_bytes(shape.num_pages),
                                     cudaMemcpyHostToDevice, stream_));
  return shape;
}

void GpuEngine::forward_layers(const StepShape& shape) {
  Workspace& w = *ws_;
  const StepArrays d = layout_.at(w.step_dev);
  const auto t = shape.num_tokens;
  const int h = config_.hidden_size, hd = config_.head_dim, hq = config_.num_attention_heads,
            hkv = config_.num_key_value_heads;
  const float eps = config_.rms_norm_eps;
  pending_combine_ = nullptr;  // a step whose head sampled no row left one behind
  check_launch(launch_embedding(weights_->embedding(), d.token_ids, t, h, w.residual, stream_), "embedding");
  AttentionBatch batch;
  batch.q = w.q;
  batch.out = w.attn;
  batch.q_indptr = d.q_indptr;
  batch.kv_page_indptr = d.kv_page_indptr;
  batch.page_ids = d.page_ids;
  batch.kv_len = d.kv_len;
  batch.num_seqs = shape.num_seqs;
  batch.num_tokens = static_cast<int>(t);
  batch.num_heads = hq;
  batch.num_kv_heads = hkv;
  batch.head_dim = hd;
  batch.page_size = kv_->page_size();
  batch.sm_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t qkv_width = int64_t{hq + 2 * hkv} * hd;
  // A projection's GEMM: FP8 where the layer holds it in FP8 (DeviceWeights::fp8_dense_for), else bf16.
  const auto project = [&](const uint16_t* x, const uint16_t* bf16, const Fp8Weight& fp8, int64_t n, int64_t k, float* out) {
    if (fp8.present()) {
      gemm_->run_fp8(x, fp8, t, n, k, out, GemmOut::kF32);
    } else {
      gemm_->run(x, bf16, t, n, k, out, GemmOut::kF32);
    }
  };
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    const LayerWeights& lw = weights_->layer(l);
    if (!ablated(AblatePart::kInputNorm)) add_norm(l > 0, lw.input_norm, nullptr, t, w.x, "input RMSNorm");
    if (!ablated(AblatePart::kQkv)) project(w.x, lw.qkv, lw.qkv_fp8, qkv_width, h, w.qkv);
    if (!ablated(AblatePart::kRope)) {
      check_launch(launch_qk_norm_rope_kv_append(w.qkv, lw.q_norm, lw.k_norm, eps, d.positions, w.inv_freq, d.kv_rows, t,
                                                 hq, hkv, hd, w.q, kv_->k(l), kv_->v(l), stream_),
                   "q/k norm + RoPE + KV append");
    }
    batch.k_pool = kv_->k(l);
    batch.v_pool = kv_->v(l);
    if (!ablated(AblatePart::kAttention)) attention_->run(batch, stream_);
    if (!ablated(AblatePart::kOProj)) project(w.attn, lw.o, lw.o_fp8, h, int64_t{hq} * hd, w.delta);
    if (!ablated(AblatePart::kPostNorm)) add_norm(true, lw.post_norm, nullptr, t, w.x, "post RMSNorm");
    if (lw.moe_layer_idx >= 0 && ablated(AblatePart::kMoe)) {
      pending_combine_ = nullptr;
    } else if (lw.moe_layer_idx >= 0 && !ep_moe_.empty()) {
      ep_moe_[static_cast<size_t>(lw.moe_layer_idx)]->forward(w.x, t, w.delta);  // the ranks' exchange inside
    } else if (lw.moe_layer_idx >= 0) {
      backend::GpuMoeLayer& moe = *moe_[static_cast<size_t>(lw.moe_layer_idx)];
      if (moe_combine_add_rms_norm_supported(h)) {
        moe.forward_experts(w.x, t);  // its combine runs inside the next add + RMSNorm
        pending_combine_ = &moe;
      } else {
        moe.forward(w.x, t, w.delta);
      }
    } else {
      const int64_t i = config_.intermediate_size;
      project(w.x, lw.mlp_gate_up, lw.mlp_gate_up_fp8, 2 * i, h, w.mlp);
      check_launch(launch_silu_mul(w.mlp, t, static_cast<int>(i), w.act, stream_), "SwiGLU");
      project(w.act, lw.mlp_down, lw.mlp_down_fp8, h, i, w.delta);
    }
  }
}

void GpuEngine::add_norm(bool with_delta, const uint16_t* weight, const int32_t* rows, int64_t num_rows, uint16_t* out,
                         const char* what, bool keep_pending) {
  Workspace& w = *ws_;
  if (with_delta && pending_combine_ != nullptr) {
    MoeCombineDelta moe;
    moe.expert_rows = pending_combine_->expert_out();
    moe.entry_row = pending_combine_->entry_row();
    moe.weights = pending_combine_->weights();
    moe.top_k = config_.num_experts_per_tok;
    // The head may take the rows in chunks (forward_logits): each chunk's rows add the same layer's combine, so
    // it stays pending there until the next forward_layers.
    if (!keep_pending) pending_combine_ = nullptr;
    check_launch(launch_moe_combine_add_rms_norm(w.residual, moe, weight, config_.rms_norm_eps, rows, num_rows,
                                                 config_.hidden_size, out, stream_),
                 what);
    return;
  }
  check_launch(launch_add_rms_norm(w.residual, with_delta ? w.delta : nullptr, weight, config_.rms_norm_eps, rows,
                                   num_rows, config_.hidden_size, out, stream_),
               what);
}

void GpuEngine::head(const int32_t* rows, int num_rows, float* logits) {
  if (num_rows == 0) return;
  add_norm(true, weights_->final_norm(), rows, num_rows, ws_->head_x, "final RMSNorm", /*keep_pending=*/true);
  gemm_->run(ws_->head_x, weights_->lm_head(), num_rows, config_.vocab_size, config_.hidden_size, logits, GemmOut::kF32);
}

void GpuEngine::sample(const StepShape& shape) {
  const StepArrays d = layout_.at(ws_->step_dev);
  head(d.sample_rows, shape.num_samples, ws_->logits);
  if (shape.num_samples == 0) return;
  check_launch(static_cast<cudaError_t>(launch_sample(ws_->logits, config_.vocab_size, shape.num_samples, config_.vocab_size, d.sampler, ws_->tokens,
                             ws_->logprobs, ws_->sampler_ws, ws_->sampler_ws_bytes, stream_)),
               "sampler");
}

void GpuEngine::upload_head_rows(int64_t num_rows, bool targets) {
  if (num_rows == 0) return;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(ws_->head_rows, ws_->head_rows_host, 4 * static_cast<size_t>(num_rows),
                                     cudaMemcpyHostToDevice, stream_));
  if (!targets) return;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(ws_->prompt_targets, ws_->head_rows_host + options_.max_batch_tokens,
                                     4 * static_cast<size_t>(num_rows), cudaMemcpyHostToDevice, stream_));
}

void GpuEngine::prompt_logprobs_to_host(int64_t num_rows, int num_top) {
  if (num_rows == 0) return;
  const int v = config_.vocab_size;
  for (int64_t first = 0; first < num_rows; first += ws_->logit_rows) {
    const int n = static_cast<int>(std::min<int64_t>(ws_->logit_rows, num_rows - first));
    head(ws_->head_rows + first, n, ws_->logits);
    check_launch(static_cast<cudaError_t>(launch_top_logprobs(
                     ws_->logits, v, n, v, num_top, ws_->prompt_targets + first, ws_->prompt_logprobs + first,
                     ws_->prompt_top_ids + first * num_top, ws_->prompt_top_logprobs + first * num_top, stream_)),
                 "prompt logprobs");
  }
  const size_t rows = static_cast<size_t>(num_rows), tops = rows * static_cast<size_t>(num_top);
  int32_t* const host = ws_->prompt_out_host;
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host, ws_->prompt_logprobs, 4 * rows, cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host + rows, ws_->prompt_top_ids, 4 * tops, cudaMemcpyDeviceToHost, stream_));
  FULCRUM_CUDA_CHECK(
      cudaMemcpyAsync(host + rows + tops, ws_->prompt_top_logprobs, 4 * tops, cudaMemcpyDeviceToHost, stream_));
}

void GpuEngine::head_rows_to_host(int64_t num_rows, float* host_logits) {
  const int64_t v = config_.vocab_size;
  for (int64_t first = 0; first < num_rows; first += ws_->logit_rows) {
    const int n = static_cast<int>(std::min<int64_t>(ws_->logit_rows, num_rows - first));
    head(ws_->head_rows + first, n, ws_->logits);
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_logits + first * v, ws_->logits, 4 * static_cast<size_t>(n * v),
                                       cudaMemcpyDeviceToHost, stream_));
  }
}

void GpuEngine::plan_attention(const StepShape& shape) {
  const int64_t epoch = attention_->epoch();
  attention_->plan(layout_.at(ws_->step_host), shape, /*for_graph=*/shape.decode_only, stream_);
  if (attention_->epoch() != epoch) graphs_->clear();  // the graphs read buffers the plan replaced
}

void GpuEngine::advance(std::span<const model::StepSequence> batch) {
  for (const model::StepSequence& seq : batch) kv_->sequence(seq.id).num_tokens += static_cast<int64_t>(seq.token_ids.size());
}

model::StepOutput GpuEngine::step(std::span<const model::StepSequence> batch) {
  FULCRUM_CHECK(broken_placement_.empty(), "GPU engine: {}", broken_placement_);
  FULCRUM_CUDA_CHECK(cudaSetDevice(options_.device));
  if (batch.empty() && options_.ep != nullptr) {
    join_exchanges_without_tokens();
    return model::make_step_output(0);
  }
  int64_t num_prompt_rows = 0;
  for (const model::StepSequence& seq : batch) {
    FULCRUM_CHECK(seq.top_logprobs >= 0 && seq.top_logprobs <= model::kMaxTopLogprobs,
                  "sequence {}: top logprobs {} outside [0, {}]", seq.id, seq.top_logprobs, model::kMaxTopLogprobs);
    const int64_t n_pred = static_cast<int64_t>(seq.token_ids.size()) - (seq.sample ? 1 : 0);
    // Only entries with targets: an empty entry is pack()'s "has no new token" error, not this one.
    FULCRUM_CHECK(seq.prompt_targets.empty() || static_cast<int64_t>(seq.prompt_targets.size()) <= n_pred,
                  "sequence {}: {} prompt targets for {} predicting rows", seq.id, seq.prompt_targets.size(), n_pred);
    for (const int32_t target : seq.prompt_targets) {
      FULCRUM_CHECK(target >= 0 && target < config_.vocab_size, "sequence {}: prompt target {} outside the vocabulary [0, {})",
                    seq.id, target, config_.vocab_size);
    }
    num_prompt_rows += static_cast<int64_t>(seq.prompt_targets.size());
  }
  if (options_.time_steps) FULCRUM_CUDA_CHECK(cudaEventRecord(ws_->step_events[0], stream_));
  const StepShape shape = pack(batch, /*sample_every_row=*/false);
  int prompt_top = 1;  // the prompt rows' top count: the most any entry with targets asks for (the kernel's least is 1)
  if (num_prompt_rows > 0) {  // each entry's last prompt_targets.size() rows before its sampling row
    int64_t first_row = 0, k = 0;
    int32_t* const targets = ws_->head_rows_host + options_.max_batch_tokens;
    for (const model::StepSequence& seq : batch) {
      const auto n = static_cast<int64_t>(seq.token_ids.size()), size = static_cast<int64_t>(seq.prompt_targets.size());
      const int64_t from = first_row + n - (seq.sample ? 1 : 0) - size;
      for (int64_t j = 0; j < size; ++j, ++k) {
        ws_->head_rows_host[k] = static_cast<int32_t>(from + j);
        targets[k] = seq.prompt_targets[static_cast<size_t>(j)];
      }
      if (size > 0) prompt_top = std::max(prompt_top, seq.top_logprobs);
      first_row += n;
    }
    upload_head_rows(num_prompt_rows, /*targets=*/true);
  }
  plan_attention(shape);
  // Graphs need MoE layers without host synchronization: CUTLASS expert GEMMs, no balanced replica choice. A step
  // with prompt rows runs eagerly (a decode-only step has none: its entries' single row samples, n_pred = 0).
  const bool graphs = options_.cuda_graphs && options_.ep == nullptr && shape.decode_only && num_prompt_rows == 0 &&
                      attention_->graph_safe() &&
                      options_.dispatch != eplb::DispatchAlgorithm::kBalanced &&
                      std::all_of(moe_.begin(), moe_.end(), [](const auto& m) { return m->uses_cutlass(); });
  if (options_.time_steps) FULCRUM_CUDA_CHECK(cudaEventRecord(ws_->step_events[1], stream_));
  if (graphs) {
    run_decode_graph(shape);
  } else {
    forward_layers(shape);
    sample(shape);
    ++counters_.eager_steps;
  }
  // Top logprobs of the sampled rows (after the graph, which leaves the rows' logits in ws_->logits): one
  // launch at the batch's largest count, only in steps where a row asks.
  int num_top = 0;
  for (const model::StepSequence& seq : batch) {
    if (seq.sample && seq.want_logprob) num_top = std::max(num_top, std::min(seq.top_logprobs, config_.vocab_size));
  }
  const size_t r = static_cast<size_t>(shape.num_samples);
  if (num_top > 0) {
    check_launch(static_cast<cudaError_t>(launch_top_logprobs(ws_->logits, config_.vocab_size, shape.num_samples,
                                                              config_.vocab_size, num_top, ws_->tokens, ws_->logprobs,
                                                              ws_->top_ids, ws_->top_logprobs, stream_)),
                 "top logprobs");
  }
  int32_t* const host_top_ids = ws_->out_host + 2 * r;
  int32_t* const host_top_bits = host_top_ids + r * static_cast<size_t>(num_top);
  if (r > 0) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(ws_->out_host, ws_->tokens, 4 * r, cudaMemcpyDeviceToHost, stream_));
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(ws_->out_host + r, ws_->logprobs, 4 * r, cudaMemcpyDeviceToHost, stream_));
  }
  if (num_top > 0) {
    const size_t n = 4 * r * static_cast<size_t>(num_top);
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_top_ids, ws_->top_ids, n, cudaMemcpyDeviceToHost, stream_));
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(host_top_bits, ws_->top_logprobs, n, cudaMemcpyDeviceToHost, stream_));
  }
  // Prompt rows: the LM head over them into ws_->logits, after the sampler and the top logprobs have read the
  // sampled rows' logits (stream order), their log-softmax values on the device (the sampled rows' kernel and
  // formula, model::token_logprob_with_top), and only those values to the host.
  prompt_logprobs_to_host(num_prompt_rows, prompt_top);
  if (options_.time_steps) FULCRUM_CUDA_CHECK(cudaEventRecord(ws_->step_events[2], stream_));
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (options_.time_steps) {
    float span_ms = 0, forward_ms = 0;
    FULCRUM_CUDA_CHECK(cudaEventElapsedTime(&span_ms, ws_->step_events[0], ws_->step_events[2]));
    FULCRUM_CUDA_CHECK(cudaEventElapsedTime(&forward_ms, ws_->step_events[1], ws_->step_events[2]));
    last_device_times_ = {span_ms, forward_ms};
  }
  advance(batch);

  model::StepOutput out = model::make_step_output(batch.size());
  size_t k = 0;
  int64_t prompt_row = 0;
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto num_prompt = static_cast<int64_t>(batch[i].prompt_targets.size());
    bool prompt_failed = false;
    if (num_prompt > 0) {  // as the CPU engine: a row without a finite maximum fails this entry only
      prompt_failed = !fill_prompt_entry(ws_->prompt_out_host, batch[i], prompt_row, num_prompt_rows, prompt_top,
                                         config_.vocab_size, out.prompt_logprobs[i], out.errors[i]);
      prompt_row += num_prompt;
    }
    if (!batch[i].sample) continue;
    const int32_t token = ws_->out_host[k];
    float logprob = 0.0f;
    std::memcpy(&logprob, ws_->out_host + r + k, 4);
    const size_t row = k++;
    if (prompt_failed) continue;
    if (token < 0) {
      out.errors[i] = "sampling: the logits hold a NaN or +inf, or are all -inf";
      continue;
    }
    out.tokens[i] = token;
    if (!batch[i].want_logprob) continue;
    out.logprobs[i] = logprob;
    model::TokenLogprob& top = out.top_logprobs[i];
    top.logprob = logprob;
    for (int j = 0; j < std::min(batch[i].top_logprobs, num_top); ++j) {
      const size_t at = row * static_cast<size_t>(num_top) + static_cast<size_t>(j);
      float value = 0.0f;
      std::memcpy(&value, host_top_bits + at, 4);
      top.top_ids.push_back(host_top_ids[at]);
      top.top_logprobs.push_back(value);
    }
  }
  return out;
}

void GpuEngine::run_decode_graph(const StepShape& shape) {
  const GraphKey key{shape.num_seqs, attention_->graph_bucket(shape)};
  if (graphs_->contains(key)) {
    if (graphs_->replay(key, stream_)) {
      ++counters_.graph_replays;
    } else {  // its capture failed: eager
      forward_layers(shape);
      sample(shape);
      ++counters_.eager_steps;
    }
    return;
  }
  // First step of this shape: eager (it computes this step), then capture the same launches for the next ones.
  forward_layers(shape);
  sample(shape);
  ++counters_.eager_steps;
  if (graphs_->capture(key, stream_, [&] {
        forward_layers(shape);
        sample(shape);
      })) {
    ++counters_.graph_captures;
  }
}

std::vector<model::HostTensor> GpuEngine::forward_logits(std::span<const model::StepSequence> batch) {
  FULCRUM_CUDA_CHECK(cudaSetDevice(options_.device));
  if (batch.empty() && options_.ep != nullptr) {
    join_exchanges_without_tokens();
    return {};
  }
  const StepShape shape = pack(batch, /*sample_every_row=*/true);
  plan_attention(shape);
  // Every row through the head, a chunk of logit_rows rows at a time.
  for (int64_t row = 0; row < shape.num_tokens; ++row) ws_->head_rows_host[row] = static_cast<int32_t>(row);
  upload_head_rows(shape.num_tokens);
  forward_layers(shape);
  const int64_t v = config_.vocab_size;
  std::vector<float> all(static_cast<size_t>(shape.num_tokens * v));
  head_rows_to_host(shape.num_tokens, all.data());
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  advance(batch);
  std::vector<model::HostTensor> out;
  int64_t row = 0;
  for (const model::StepSequence& seq : batch) {
    const auto n = static_cast<int64_t>(seq.token_ids.size());
    model::HostTensor t;
    t.shape = {n, v};
    t.data.assign(all.begin() + row * v, all.begin() + (row + n) * v);
    out.push_back(std::move(t));
    row += n;
  }
  return out;
}

void GpuEngine::fill_kv_random(uint64_t seed) {
  const int64_t per_pool = kv_->num_pages() * kv_->page_size() * config_.num_key_value_heads * config_.head_dim;
  for (int l = 0; l < config_.num_hidden_layers; ++l) {
    check_launch(cuda::moe::launch_fill_random_bf16(kv_->k(l), per_pool, seed + 2 * static_cast<uint64_t>(l), 1.0f, stream_),
                 "KV fill");
    check_launch(cuda::moe::launch_fill_random_bf16(kv_->v(l), per_pool, seed + 2 * static_cast<uint64_t>(l) + 1, 1.0f, stream_),
                 "KV fill");
  }
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

void GpuEngine::assume_prefilled(model::SequenceId id, int64_t num_tokens) {
  KvSequence& seq = kv_->sequence(id);
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= seq.capacity, "sequence {}: {} positions do not fit its capacity {}", id,
                num_tokens, seq.capacity);
  seq.num_tokens = num_tokens;
}

void GpuEngine::join_exchanges_without_tokens() {
  for (const auto& layer : ep_moe_) layer->forward(ws_->x, 0, ws_->delta);
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

std::vector<int64_t> GpuEngine::expert_counts() {
  const size_t n = static_cast<size_t>(num_moe_layers()) * static_cast<size_t>(config_.num_experts);
  std::vector<unsigned long long> raw(n);
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (n > 0) FULCRUM_CUDA_CHECK(cudaMemcpy(raw.data(), ws_->histogram, 8 * n, cudaMemcpyDeviceToHost));
  return std::vector<int64_t>(raw.begin(), raw.end());
}

void GpuEngine::reset_expert_counts() {
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const size_t n = static_cast<size_t>(num_moe_layers()) * static_cast<size_t>(config_.num_experts);
  if (n > 0) FULCRUM_CUDA_CHECK(cudaMemset(ws_->histogram, 0, 8 * n));
}

}  // namespace fulcrum::gpu
