#pragma once
// One MoE layer on one GPU, bf16 with fp32 accumulation: router GEMM -> fused router (softmax, top-k,
// renormalization, replica choice, recorder histogram) -> permutation by physical slot -> SwiGLU expert
// GEMMs over the slots (cuBLAS) -> combine with the routing weights. Semantics: model::Qwen3MoeModel's
// moe_block with this layer's physical slots; CPU reference: model::moe::moe_layer_reference.
//
// Host synchronization: one per forward, after the permutation, to read the per-slot token counts that
// cuBLAS's grouped GEMM takes as host arrays. Balanced replica choice moves it into routing: it reads the
// per-(source, expert) counts there for eplb::BalancedSplitter, whose routes also give the per-slot
// counts, so permute does not wait again. The recorder never synchronizes: it adds into a device row.
//
// This header includes no CUDA header; device pointers are plain pointers (bf16 as uint16_t bits).
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "model/moe_reference.hpp"

struct CUstream_st;
struct cublasContext;

namespace fulcrum::backend {

struct MoeLayerShape {
  int hidden_size = 0;            // H
  int moe_intermediate_size = 0;  // I
  int num_experts = 0;            // E logical experts (<= 256)
  int num_experts_per_tok = 8;    // k (<= 16)
  bool norm_topk_prob = true;
  int num_slots = 0;              // P physical slots of the layer, over all GPUs (>= E); routing and the
                                  // permutation run over these global slot ids
  int64_t max_tokens = 0;         // buffers are sized for this many tokens per forward
  // Slots whose weights this GPU holds: [local_slot_begin, local_slot_begin + num_local_slots) (-1: all P,
  // the one-GPU layer). Only a layer holding all P slots runs forward on its own; an expert-parallel rank
  // (comm::NcclEpMoeLayer) routes and permutes over the global slots and runs its local slots' experts on
  // the rows it receives (run_experts_on).
  int local_slot_begin = 0;
  int num_local_slots = -1;
  int local_slots() const { return num_local_slots < 0 ? num_slots : num_local_slots; }
};

// How the expert GEMMs are issued: one cublasGemmGroupedBatchedEx per GEMM over all non-empty slots, or
// one cublasGemmEx per non-empty slot, or (auto, the default) grouped below kPerSlotMinFlops of expert work
// and per-slot above. Measured on an H200 (docs/benchmarks.md, bench/results/moe_layer_h200.json): grouped wins
// at 256-1024 tokens (0.30-1.84 ms against 1.49-2.77 ms for the per-slot calls), per-slot wins on large problems
// (its GEMMs run at 0.37-0.69 of the bf16 roofline where it wins, grouped at 0.31-0.35); the crossover lies
// between 0.31 and 1.2 TFLOP per call at both Qwen3 shapes.
enum class ExpertGemm { kGrouped, kPerSlot, kAuto };
constexpr double kPerSlotMinFlops = 0.7e12;

// A device allocation freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t bytes);
  ~DeviceBuffer();
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

class GpuMoeLayer {
 public:
  GpuMoeLayer(const MoeLayerShape& shape, int device_idx = 0);
  ~GpuMoeLayer();
  GpuMoeLayer(const GpuMoeLayer&) = delete;
  GpuMoeLayer& operator=(const GpuMoeLayer&) = delete;

  const MoeLayerShape& shape() const { return shape_; }
  CUstream_st* stream() const { return stream_; }
  void synchronize();

  // Host bf16 weights: router [E, H] (mlp.gate), gate_up [L, 2I, H] (gate rows, then up rows), down [L, H, I]
  // for the L = local_slots() slots this GPU holds (local slot l is global slot local_slot_begin + l).
  void upload_weights(std::span<const uint16_t> router, std::span<const uint16_t> gate_up,
                      std::span<const uint16_t> down);
  // Pseudo-random bf16 weights filled on the device (benchmarks), uniform in +-1/sqrt(fan_in). A value is a
  // function of (seed, its index in the global [P, ...] arrays), so local slot l holds what a one-GPU layer
  // with the same seed holds in global slot local_slot_begin + l.
  void randomize_weights(uint64_t seed);
  // Expert weights held elsewhere (a slot pool): per local slot, device pointers to a gate_up [2I, H] and a
  // down [H, I] bf16 matrix; both spans of L entries, or both empty (back to the layer's own weights). Call
  // between forwards only: the next permute / run_experts_on builds its GEMM problems from these pointers.
  void set_slot_weights(std::span<const uint16_t* const> gate_up, std::span<const uint16_t* const> down);
  // Replica choice tables for this layer (static, dynamic or balanced; model::moe::make_replica_choice).
  void set_replica_choice(const model::moe::ReplicaChoiceSpec& spec);
  // Balanced replica choice over expert-parallel ranks (comm::NcclEpMoeLayer): this layer's tokens are the
  // one source of its spec, global source `source_idx` of the spec topology's GPUs; `gather` turns this
  // source's per-expert entry counts [E] into every source's [num_gpus][E] (a collective: route calls it on
  // every forward, also with 0 tokens). The split runs on those; this layer takes its source's routes.
  using CountGather = std::function<void(std::span<const int32_t> mine, std::span<int32_t> all)>;
  void set_balanced_sources(int source_idx, CountGather gather);
  // Recorder: device row [E] of unsigned 64-bit counts that every forward adds into; null turns it off.
  void set_recorder(unsigned long long* histogram_row) { histogram_row_ = histogram_row; }
  void set_expert_gemm(ExpertGemm gemm) { expert_gemm_ = gemm; }

  // x: device bf16 [T, H] -> out: device fp32 [T, H]; T <= max_tokens.
  void forward(const uint16_t* x, int64_t num_tokens, float* out);
  // The same from given router logits (device fp32 [T, E]), skipping the router GEMM.
  void forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out);

  // Stages, in order (forward runs them all); tests and the benchmark call them one by one.
  void router_logits(const uint16_t* x, int64_t num_tokens);  // -> logits()
  void route(const float* logits, int64_t num_tokens);         // -> expert_ids, weights, slots; histogram
                                                               //    (balanced: also host slot counts)
  void permute(const uint16_t* x, int64_t num_tokens);         // -> slot offsets, entry_row, permuted rows; host counts
  void run_experts(int slot_begin, int slot_end);              // permuted rows of those (local) slots -> expert_out rows
  void combine(int64_t num_tokens, float* out);                // expert_out rows -> out [T, H]
  // combine from other expert-output rows [T * k, H] in the permuted order (the EP layer's returned rows).
  void combine_rows(const uint16_t* rows, int64_t num_tokens, float* out);

  // The expert stage over rows that are not this layer's permutation (the EP receive side): rows [n, H] lie
  // in S segments one after another, segment s holding rows_per_segment_slot[s * L + l] rows of local slot
  // l, l ascending (S = size / L). out [n, H] gets each row's SwiGLU expert output, row for row; n is the
  // sum of the counts, at most the reserved rows (reserve_expert_rows, else max_tokens * k). One GEMM problem
  // per non-empty (segment, slot); grouped or per-problem GEMMs as set_expert_gemm says.
  void run_experts_on(const uint16_t* rows, std::span<const int32_t> rows_per_segment_slot, uint16_t* out);
  // Scratch for run_experts_on over up to `rows` rows (allocated now, so no forward allocates).
  void reserve_expert_rows(int64_t rows);

  // Device buffers of the last forward (entries [T * k] in router order; rows [T * k] slot-contiguous).
  const float* logits() const { return logits_.as<float>(); }              // [T, E]
  const int32_t* expert_ids() const { return expert_ids_.as<int32_t>(); }  // [T * k]
  const float* weights() const { return weights_.as<float>(); }            // [T * k]
  const int32_t* entry_slots() const { return slots_.as<int32_t>(); }      // [T * k]
  const int32_t* slot_offsets() const { return offsets_.as<int32_t>(); }   // [P + 1]
  const int32_t* entry_row() const { return entry_row_.as<int32_t>(); }    // [T * k]
  const uint16_t* permuted() const { return permuted_.as<uint16_t>(); }    // [T * k, H]
  const uint16_t* expert_out() const { return expert_out_.as<uint16_t>(); }  // [T * k, H]
  // Per-slot entry counts of the last permute, on the host [P] (global slots).
  std::span<const int32_t> slot_counts() const { return {host_counts_, static_cast<size_t>(shape_.num_slots)}; }
  // FLOPs and minimum HBM bytes of run_experts over [slot_begin, slot_end) for the last permute.
  double expert_flops(int slot_begin, int slot_end) const;
  double expert_min_bytes(int slot_begin, int slot_end) const;

 private:
  // Expert GEMM problems (moe_layer.cpp): one per group of rows sharing a local slot's weights.
  struct GemmProblems;

  // Balanced choice after the router: counts -> host split -> route table -> slots; fills host_counts_.
  void choose_balanced(int64_t num_tokens);
  void check_holds_all_slots() const;
  const uint16_t* gate_up_of(int local_slot) const;
  const uint16_t* down_of(int local_slot) const;
  // One expert GEMM (0: gate_up, 1: down) over problems [first, first + count) of `problems`; auto picks
  // per-problem GEMMs when `flops` (of both GEMMs) reaches kPerSlotMinFlops.
  void expert_gemm(const GemmProblems& problems, int gemm_idx, int first, int count, double flops);

  MoeLayerShape shape_;
  int device_idx_ = 0;
  CUstream_st* stream_ = nullptr;
  cublasContext* cublas_ = nullptr;
  ExpertGemm expert_gemm_ = ExpertGemm::kAuto;
  model::moe::ReplicaChoiceSpec spec_;
  bool has_spec_ = false;
  unsigned long long* histogram_row_ = nullptr;
  int64_t num_tokens_ = 0;  // of the last route/permute

  DeviceBuffer router_w_, gate_up_w_, down_w_;  // [E, H], [L, 2I, H], [L, H, I]
  std::vector<const uint16_t*> slot_gate_up_, slot_down_;  // set_slot_weights: [L] each, or empty
  DeviceBuffer static_slot_of_, replica_offsets_, replica_slots_, source_streams_;
  DeviceBuffer logits_, expert_ids_, weights_, slots_, multi_draws_, draw_base_;
  DeviceBuffer counts_, offsets_, cursor_, entry_row_, permuted_, expert_out_;
  DeviceBuffer h_, act_;       // expert scratch [rows, 2I], [rows, I]
  int64_t expert_rows_ = 0;    // rows h_ and act_ hold
  // Balanced: entry ranks [T * k], chunk bases, pair counts [S][E], route table (offsets | slots | ends).
  DeviceBuffer entry_rank_, chunk_base_, pair_counts_, routes_;
  std::unique_ptr<eplb::BalancedSplitter> splitter_;
  eplb::BalancedDispatch split_;
  eplb::BalancedRouteTable route_table_;
  std::vector<int32_t> host_pair_counts_, all_pair_counts_, host_routes_;
  int balanced_source_ = 0;   // with gather_: this layer's source among the topology's GPUs
  CountGather gather_;
  std::vector<int64_t> pair_tokens_;
  bool host_counts_from_route_ = false;  // host_counts_ already hold the last route's slot counts
  // The permutation's problems, one per non-empty local slot in slot order: compact_begin_[l] is the first
  // problem of local slot >= l. run_experts_on's problems, one per non-empty (segment, local slot).
  std::unique_ptr<GemmProblems> own_problems_, recv_problems_;
  std::vector<int> compact_begin_;  // [L + 1]
  int32_t* host_counts_ = nullptr;  // pinned [P + 1]: counts, then the total
};

}  // namespace fulcrum::backend
