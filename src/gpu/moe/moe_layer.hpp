#pragma once
// One MoE layer on one GPU, bf16 with fp32 accumulation: router GEMM -> fused router (softmax, top-k,
// renormalization, replica choice, recorder histogram) -> permutation by physical slot -> SwiGLU expert
// GEMMs over the slots -> combine with the routing weights. Semantics: model::Qwen3MoeModel's moe_block with
// this layer's physical slots; CPU reference: model::moe::moe_layer_reference.
//
// Expert GEMMs: CUTLASS's grouped GEMM with the group sizes read on the device (gpu/cutlass/grouped_gemm.hpp,
// ExpertGemm::kCutlass, the default for a layer holding all its slots), or cuBLAS, which takes the per-slot
// row counts as host arrays; small steps of a layer holding all its slots take the skinny path
// (kDefaultSkinnyMaxEntries). Router logits of up to 8 tokens come from the skinny GEMM, else cuBLAS.
//
// Host synchronization and CUDA graphs: with CUTLASS and static or dynamic replica choice, forward /
// forward_from_logits issue only kernels, a device-to-device copy, a memset and cuBLAS's router GEMM on the
// layer's stream: no host synchronization, no device-to-host copy, no allocation, so they can be captured
// in a CUDA graph (replays read x / logits from the same addresses; the token count is baked in). With cuBLAS
// expert GEMMs permute synchronizes once to read the per-slot counts. Balanced replica choice always
// synchronizes in routing (eplb::BalancedSplitter runs on the host on this pass's counts): not capturable.
// The recorder never synchronizes: it adds into a device row.
//
// Buffers: every max_tokens-sized buffer lives in a MoeWorkspace, which layers that run one after another on
// one stream share (the GPU engine's 48 layers: one workspace); a layer without one makes its own.
//
// This header includes no CUDA header; device pointers are plain pointers (bf16 as uint16_t bits).
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "gpu/cutlass/grouped_gemm.hpp"
#include "gpu/cutlass/grouped_gemm_fp8.hpp"
#include "model/moe_reference.hpp"

struct CUstream_st;
struct cublasContext;
namespace fulcrum::cuda::moe {
struct RouterArgs;  // moe_kernels.hpp
}

namespace fulcrum::backend {

struct Fp8SlotPtrs;  // gpu_slot_pool.hpp
class GpuSlotPool;

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
  // (backend::EpMoeLayer) routes and permutes over the global slots and runs its local slots' experts on
  // the rows it receives (run_experts_on).
  int local_slot_begin = 0;
  int num_local_slots = -1;
  // The layer allocates no router or expert weights: set_router_weights and set_slot_weights point it at
  // weights held elsewhere (the GPU engine's), and upload_weights / randomize_weights are refused.
  bool external_weights = false;
  // FP8 experts (an FP8 checkpoint): e4m3 weights with fp32 128x128 block scales, per slot the slot pool's FP8
  // matrices (Fp8SlotPtrs, gpu_slot_pool.hpp; H and I multiples of 128: the engine pads I with zero weights).
  // Expert GEMMs: the skinny path with FP8 weights and bf16 activations for small steps, else CUTLASS's FP8
  // blockwise grouped GEMM with 1x128 dynamic activation quantization (gpu/cutlass/grouped_gemm_fp8.hpp);
  // no cuBLAS path (an error names it). Router weights stay bf16, as in the checkpoints.
  bool fp8_experts = false;
  int local_slots() const { return num_local_slots < 0 ? num_slots : num_local_slots; }
};

// How the expert GEMMs are issued:
//   kCutlass  one CUTLASS grouped GEMM per GEMM over the slots, group sizes read on the device (no host
//             sync; needs H and I multiples of 8 and 16-byte aligned weights, else cuBLAS auto with
//             cutlass_fallback_reason() saying why). Tile config chosen by T * k (placement-invariant).
//   kGrouped  one cublasGemmGroupedBatchedEx per GEMM over the non-empty slots (host counts).
//   kPerSlot  one cublasGemmEx per non-empty slot (host counts).
//   kAuto     (the default) kCutlass for a layer holding all its slots (one GPU); for an expert-parallel
//             layer grouped below kPerSlotMinFlops of expert work and per-slot above. Measured on an H200
//             (docs/benchmarks.md, bench/results/moe_layer_h200.json): cuBLAS grouped wins at 256-1024 tokens
//             (0.30-1.84 ms against 1.49-2.77 ms for the per-slot calls), per-slot on large problems; the
//             crossover lies between 0.31 and 1.2 TFLOP per call at both Qwen3 shapes.
enum class ExpertGemm { kGrouped, kPerSlot, kAuto, kCutlass };
constexpr double kPerSlotMinFlops = 0.7e12;

// Small steps of a layer holding all its slots (kAuto / kCutlass): at most this many entries (T x k) run the
// skinny path instead (one-launch permutation without a copy of x, expert skinny GEMMs with SwiGLU fused:
// gpu/kernels/expert_skinny_gemm.hpp); decode batches up to 4 tokens at top-8. Chosen by T x k only, so the
// path, like CUTLASS's tile config, never depends on the placement. set_skinny_max_entries changes it.
// Measured on an H200, the 48-layer Qwen3-30B-A3B decode step at context 512, one run at 3159e85
// (bench/results/skinny_crossover_h200.json): batch 1 4.32 ms against CUTLASS's 5.11, batch 4 even (7.48 / 7.51),
// batch 16 slower (16.7 / 13.7).
constexpr int64_t kDefaultSkinnyMaxEntries = 32;
// Steps of at most this many entries (T x k) above the skinny path, static replicas, every slot local, bf16 experts
// on CUTLASS: routing and the permutation plan come from the single-block launch the skinny path uses
// (launch_small_route_permute), then a gather of x (FULCRUM_FUSED_CUTLASS_ROUTE=0: the multi-launch path, for
// measurement). 256: 32 tokens of top-8. Measured on one H200 (30B-A3B decode steps, context 512;
// bench/results/fused_cutlass_route_sweep_*_3cb94a5_h200.json): the single block 1.8% faster at 16 tokens, 0.8% at
// 24, 0.7% at 32, 1.1% slower at 48 and 2.2% at 64, where one block routes 64 tokens in two rounds of its 32 warps.
constexpr int64_t kFusedCutlassRouteMaxEntries = 256;

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

// The buffers of a forward that scale with max_tokens, the grouped GEMM's workspace and a cuBLAS handle,
// for any number of layers that run one after another on ONE stream (each forward overwrites them; a layer
// that runs its stages one by one must finish route .. combine before another layer sharing it starts).
// Create it, and reserve what it must hold, before capturing: a buffer that grows moves, and a captured
// graph keeps the old address. T = max_tokens, N = T * k entries, P = num_slots.
class MoeWorkspace {
 public:
  // Sized for layers of `shape` (local slot fields ignored): a layer fits when its H, I, E and k are equal
  // and its P and max_tokens are at most these.
  explicit MoeWorkspace(const MoeLayerShape& shape, int device_idx = 0);
  ~MoeWorkspace();
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;

  const MoeLayerShape& shape() const { return shape_; }
  int device() const { return device_idx_; }
  void check_fits(const MoeLayerShape& layer) const;
  // Expert scratch h / act for up to `rows` rows (run_experts_on's received rows); waits for the device
  // when it grows.
  void reserve_expert_rows(int64_t rows);
  int64_t expert_rows() const { return expert_rows_; }
  // Balanced replica choice's entry ranks [N], allocated on first need.
  void reserve_entry_ranks();
  // The cuBLAS handle on `stream` with this workspace's cuBLAS scratch (set again only when the stream changes).
  cublasContext* cublas_on(CUstream_st* stream);
  // Unbinds the cuBLAS handle from `stream` if bound to it (a layer destroying its own stream). No throw.
  void release_stream(CUstream_st* stream) noexcept;
  // CUTLASS grouped GEMM: limits (max_groups = max(P, 1024)) and workspace; cutlass_unavailable() is empty
  // when it can run on this device, else why not.
  const gpu::GroupedGemmLimits& grouped_gemm_limits() const { return gemm_limits_; }
  void* grouped_gemm_workspace() const { return gemm_workspace_.as<void>(); }
  const std::string& cutlass_unavailable() const { return cutlass_unavailable_; }
  // FP8 experts (shape().fp8_experts): the FP8 grouped GEMM's limits and workspace, and the quantized
  // activations: x rows [N, H] e4m3 with scales [N * H / 128], act rows [expert_rows, I] with [.. * I / 128].
  const gpu::Fp8GroupedGemmLimits& fp8_gemm_limits() const { return fp8_limits_; }
  void* fp8_gemm_workspace() const { return fp8_workspace_.as<void>(); }

  DeviceBuffer logits;       // fp32 [T, E]
  DeviceBuffer expert_ids;   // int32 [N]
  DeviceBuffer weights;      // fp32 [N]
  DeviceBuffer slots;        // int32 [N]
  DeviceBuffer multi_draws;  // int32 [T]
  DeviceBuffer draw_base;    // int32 [T + 1]
  DeviceBuffer counts;       // int32 [P]
  DeviceBuffer offsets;      // int32 [P + 1]
  DeviceBuffer cursor;       // int32 [P]
  DeviceBuffer entry_row;    // int32 [N]
  DeviceBuffer permuted;     // bf16 [N, H]
  DeviceBuffer expert_out;   // bf16 [N, H]
  DeviceBuffer h;            // bf16 [expert_rows, 2I]
  DeviceBuffer act;          // bf16 [expert_rows, I]
  DeviceBuffer entry_rank;   // int32 [N] (balanced only; reserve_entry_ranks)
  DeviceBuffer row_token;    // int32 [N] token of each permuted row (the skinny path)
  DeviceBuffer active;       // int32 [N + 1] how many slots have rows, then those slots (the skinny path)
  DeviceBuffer fp8_x;        // e4m3 [N, H] (FP8 experts only)
  DeviceBuffer fp8_x_scales; // fp32 [N * H / 128]
  DeviceBuffer fp8_act;      // e4m3 [expert_rows, I]
  DeviceBuffer fp8_act_scales;  // fp32 [expert_rows * I / 128]

 private:
  MoeLayerShape shape_;
  int device_idx_ = 0;
  int64_t expert_rows_ = 0;
  cublasContext* cublas_ = nullptr;
  CUstream_st* cublas_stream_ = nullptr;
  bool cublas_bound_ = false;
  DeviceBuffer cublas_workspace_;
  gpu::GroupedGemmLimits gemm_limits_;
  DeviceBuffer gemm_workspace_;
  std::string cutlass_unavailable_;
  gpu::Fp8GroupedGemmLimits fp8_limits_;
  DeviceBuffer fp8_workspace_;
};

class GpuMoeLayer {
 public:
  // stream: the layer's stream (null: the layer creates and owns one). workspace: shared buffers (null: the
  // layer makes its own for its shape); it must fit the shape (MoeWorkspace::check_fits) and be on the
  // same device.
  GpuMoeLayer(const MoeLayerShape& shape, int device_idx = 0, CUstream_st* stream = nullptr,
              std::shared_ptr<MoeWorkspace> workspace = nullptr);
  ~GpuMoeLayer();
  GpuMoeLayer(const GpuMoeLayer&) = delete;
  GpuMoeLayer& operator=(const GpuMoeLayer&) = delete;

  const MoeLayerShape& shape() const { return shape_; }
  CUstream_st* stream() const { return stream_; }
  const std::shared_ptr<MoeWorkspace>& workspace() const { return workspace_; }
  void synchronize();

  // Host bf16 weights: router [E, H] (mlp.gate), gate_up [L, 2I, H] (gate rows, then up rows), down [L, H, I]
  // for the L = local_slots() slots this GPU holds (local slot l is global slot local_slot_begin + l).
  void upload_weights(std::span<const uint16_t> router, std::span<const uint16_t> gate_up,
                      std::span<const uint16_t> down);
  // Pseudo-random bf16 weights filled on the device (benchmarks), uniform in +-1/sqrt(fan_in). A value is a
  // function of (seed, its index in the global [P, ...] arrays), so local slot l holds what a one-GPU layer
  // with the same seed holds in global slot local_slot_begin + l.
  void randomize_weights(uint64_t seed);
  // Router weights held elsewhere: device bf16 [E, H], read by every later router GEMM (null: the layer's
  // own again; required with external_weights).
  void set_router_weights(const uint16_t* router);
  // Expert weights held elsewhere (a slot pool): per local slot, device pointers to a gate_up [2I, H] and a
  // down [H, I] bf16 matrix; both spans of L entries, or both empty (back to the layer's own weights; with
  // external_weights: none). Call between forwards only: it rewrites the layer's device pointer arrays in
  // place (stream-ordered, then waits), so a captured forward picks up the new pointers on its next replay.
  void set_slot_weights(std::span<const uint16_t* const> gate_up, std::span<const uint16_t* const> down);
  // The same for FP8 experts (shape().fp8_experts): per local slot the codes and scales of gate_up [2I, H] and
  // down [H, I] (GpuSlotPool::fp8_ptrs); all four of L entries.
  void set_fp8_slot_weights(const Fp8SlotPtrs& slots);
  // Replica choice tables for this layer (static, dynamic or balanced; model::moe::make_replica_choice).
  // Call between forwards (it waits for the layer's stream). A table of the size the previous spec's had is
  // rewritten in place (same device address), so a captured static or dynamic forward follows a switched
  // placement on its next replay, as set_slot_weights; other sizes allocate anew. A captured forward also baked
  // in the algorithm, the sources and tokens_per_source: only a spec that keeps them (a new placement of the same
  // layout) may be set under graphs captured before.
  void set_replica_choice(const model::moe::ReplicaChoiceSpec& spec);
  // Balanced replica choice over expert-parallel ranks (backend::EpMoeLayer): this layer's tokens are the
  // one source of its spec, global source `source_idx` of the spec topology's GPUs; `gather` turns this
  // source's per-expert entry counts [E] into every source's [num_gpus][E] (a collective: route calls it on
  // every forward, also with 0 tokens). The split runs on those; this layer takes its source's routes.
  using CountGather = std::function<void(std::span<const int32_t> mine, std::span<int32_t> all)>;
  void set_balanced_sources(int source_idx, CountGather gather);
  // Recorder: device row [E] of unsigned 64-bit counts that every forward adds into; null turns it off.
  void set_recorder(unsigned long long* histogram_row) { histogram_row_ = histogram_row; }
  void set_expert_gemm(ExpertGemm gemm) { expert_gemm_ = gemm; }
  // Entries (T x k) up to which forward / forward_from_logits take the skinny path (0: never).
  void set_skinny_max_entries(int64_t entries) { skinny_max_entries_ = entries; }
  // Whether a forward of num_tokens tokens takes the skinny path.
  bool uses_skinny(int64_t num_tokens) const;
  // Whether a forward of num_tokens tokens routes through the single-block plan on CUTLASS
  // (kFusedCutlassRouteMaxEntries); set_fused_cutlass_route(false) keeps the multi-launch path (default: on
  // unless FULCRUM_FUSED_CUTLASS_ROUTE=0 or FULCRUM_FUSED_ROUTER=0). Both give the same output bit for bit.
  bool fused_cutlass_route_applies(int64_t num_tokens) const;
  void set_fused_cutlass_route(bool on) { fused_cutlass_route_ = on; }
  // What the permutation's expert GEMMs use now (kAuto resolved; kCutlass falls back to kAuto's cuBLAS
  // choice when it cannot run) and, when kCutlass was asked for or kAuto would pick it but cannot run, why.
  bool uses_cutlass() const;
  std::string cutlass_fallback_reason() const;
  // FP8 experts on the CUTLASS path of a layer holding all its slots: permute writes the e4m3 rows and scales the
  // FP8 grouped GEMM reads straight from x (cuda::moe::launch_permute_rows_fp8; no bf16 permuted copy, so
  // permuted() is not written) and run_experts skips its quantization of x. On unless FULCRUM_FP8_FUSED_PERMUTE=0
  // (read once per process); set_fp8_fused_permute overrides that for this layer from its next permute (tests and
  // benchmarks compare both ways; the outputs are bitwise equal). bf16 layers ignore it.
  void set_fp8_fused_permute(bool on) { fp8_fused_permute_ = on; }
  bool fp8_fused_permute() const;
  // The FP8 grouped GEMM config of the CUTLASS path; empty (the default): gpu::fp8_grouped_gemm_config_for_rows of
  // the total rows. `bench moe` times each config at each size with it, which is how the crossover is set.
  void set_fp8_gemm_config(std::optional<gpu::Fp8GroupedGemmConfig> config) { fp8_gemm_config_ = config; }

  // x: device bf16 [T, H] -> out: device fp32 [T, H]; T <= max_tokens.
  void forward(const uint16_t* x, int64_t num_tokens, float* out);
  // The same from given router logits (device fp32 [T, E]), skipping the router GEMM.
  void forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out);
  // forward without its combine: the expert output rows (expert_out, entry_row, weights) for a caller that fuses
  // the combine into its next kernel (the GPU engine's add + RMSNorm).
  void forward_experts(const uint16_t* x, int64_t num_tokens);

  // Stages, in order (forward runs them all); tests and the benchmark call them one by one.
  void router_logits(const uint16_t* x, int64_t num_tokens);  // -> logits()
  void route(const float* logits, int64_t num_tokens);         // -> expert_ids, weights, slots; histogram
  cuda::moe::RouterArgs router_args(const float* logits, int64_t num_tokens);  // checks; the step's bookkeeping
                                                               //    (balanced: also host slot counts)
  void permute(const uint16_t* x, int64_t num_tokens);         // -> slot offsets, entry_row, permuted rows
                                                               //    (cuBLAS: host counts and GEMM problems)
  void run_experts(int slot_begin, int slot_end);              // permuted rows of those (local) slots -> expert_out rows
  void combine(int64_t num_tokens, float* out);                // expert_out rows -> out [T, H]
  // combine from other expert-output rows [T * k, H] in the permuted order (the EP layer's returned rows).
  void combine_rows(const uint16_t* rows, int64_t num_tokens, float* out);

  // The expert stage over rows that are not this layer's permutation (the EP receive side): rows [n, H] lie
  // in S segments one after another, segment s holding rows_per_segment_slot[s * L + l] rows of local slot
  // l, l ascending (S = size / L). out [n, H] gets each row's SwiGLU expert output, row for row; n is the
  // sum of the counts, at most the reserved rows (reserve_expert_rows, else max_tokens * k). One GEMM problem
  // per (segment, slot): cuBLAS (grouped or per-problem, as set_expert_gemm says; kAuto: cuBLAS), or with
  // kCutlass one grouped GEMM over all S * L groups (offsets uploaded from the host counts).
  void run_experts_on(const uint16_t* rows, std::span<const int32_t> rows_per_segment_slot, uint16_t* out);
  // Scratch for run_experts_on over up to `rows` rows (allocated now in the workspace, so no forward allocates).
  void reserve_expert_rows(int64_t rows);

  // Device buffers of the last forward of ANY layer sharing this layer's workspace (entries [T * k] in
  // router order; rows [T * k] slot-contiguous).
  const float* logits() const { return ws().logits.as<float>(); }              // [T, E]
  const int32_t* expert_ids() const { return ws().expert_ids.as<int32_t>(); }  // [T * k]
  const float* weights() const { return ws().weights.as<float>(); }            // [T * k]
  const int32_t* entry_slots() const { return ws().slots.as<int32_t>(); }      // [T * k]
  const int32_t* slot_offsets() const { return ws().offsets.as<int32_t>(); }   // [P + 1]
  const int32_t* entry_row() const { return ws().entry_row.as<int32_t>(); }    // [T * k]
  const uint16_t* permuted() const { return ws().permuted.as<uint16_t>(); }    // [T * k, H] (not written by
                                                                               //  a fused FP8 permute)
  const uint16_t* expert_out() const { return ws().expert_out.as<uint16_t>(); }  // [T * k, H]
  // Per-slot entry counts of the last permute, on the host [P] (global slots). Unavailable (throws) after a
  // CUTLASS-path permute, which reads nothing back: fetch_slot_counts() copies them (it synchronizes, so
  // never inside a capture). Balanced choice always has them.
  std::span<const int32_t> slot_counts() const;
  std::span<const int32_t> fetch_slot_counts();
  // FLOPs and minimum HBM bytes of run_experts over [slot_begin, slot_end) for the last permute (host counts).
  double expert_flops(int slot_begin, int slot_end) const;
  double expert_min_bytes(int slot_begin, int slot_end) const;

 private:
  // Expert GEMM problems of the cuBLAS paths (moe_layer.cpp): one per group of rows sharing a local slot's weights.
  struct GemmProblems;
  // Host offsets uploaded for run_experts_on's CUTLASS path.
  struct OffsetsUpload;

  MoeWorkspace& ws() const { return *workspace_; }
  // Balanced choice after the router: counts -> host split -> route table -> slots; fills host_counts_.
  void choose_balanced(int64_t num_tokens);
  void check_holds_all_slots() const;
  const uint16_t* gate_up_of(int local_slot) const;
  const uint16_t* down_of(int local_slot) const;
  // Rebuilds the device pointer arrays [L] from gate_up_of / down_of, and whether CUTLASS can read them.
  void upload_slot_pointers();
  // FP8: CUTLASS's FP8 grouped GEMMs with the activation quantizations (moe_layer_fp8.cpp); arguments as
  // cutlass_experts.
  void cutlass_experts_fp8(const uint16_t* in, const int32_t* offsets, int num_groups, int first_local, int num_weights,
                           int64_t max_rows, int64_t total_rows, uint16_t* out);
  // The scatter of permute for an FP8 layer that fuses it with the quantization (fp8_fused_permute() and the
  // CUTLASS path of a layer holding all its slots, x 16-byte aligned): launches it and returns true; else false
  // (permute then copies bf16 rows).
  bool permute_quantize_fp8(const uint16_t* x, int64_t num_tokens);
  void randomize_fp8_experts(uint64_t seed);
  void upload_fp8_slot_pointers();
  // Why CUTLASS cannot run this layer's expert GEMMs (empty: it can).
  std::string cutlass_problem() const;
  // cuBLAS path: the host counts (read back if the last permute did not) and the permutation's problems.
  void build_own_problems();
  // One cuBLAS expert GEMM (0: gate_up, 1: down) over problems [first, first + count) of `problems`; auto picks
  // per-problem GEMMs when `flops` (of both GEMMs) reaches kPerSlotMinFlops.
  void expert_gemm(const GemmProblems& problems, int gemm_idx, int first, int count, double flops);
  // Both CUTLASS grouped GEMMs and the activation over groups [offsets[0], offsets[num_groups]) of rows
  // `in` -> `out`, group g using local slot (first_local + g) % num_weights's weights. FP8: in == nullptr when
  // the rows are already quantized in the workspace's fp8_x / fp8_x_scales (permute_quantize_fp8).
  void cutlass_experts(const uint16_t* in, const int32_t* offsets, int num_groups, int first_local, int num_weights,
                       int64_t max_rows, int64_t total_rows, uint16_t* out);
  // route, then the skinny path or permute + run_experts: expert_out rows for combine.
  void experts_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens);
  // The skinny path after route: permutation, then skinny_gemms: both expert GEMMs (SwiGLU fused) -> expert_out
  // rows (with static replicas experts_from_logits routes and permutes in one launch, then skinny_gemms).
  void skinny_experts(const uint16_t* x, int64_t num_tokens);
  void skinny_gemms(const uint16_t* x, int64_t num_tokens);
  // Static replicas, a small step: routing and the permutation plan in one launch (launch_small_route_permute).
  void route_permute_small(const float* logits, int64_t num_tokens);

  MoeLayerShape shape_;
  int device_idx_ = 0;
  CUstream_st* stream_ = nullptr;
  bool owns_stream_ = false;
  std::shared_ptr<MoeWorkspace> workspace_;
  ExpertGemm expert_gemm_ = ExpertGemm::kAuto;
  int64_t skinny_max_entries_ = kDefaultSkinnyMaxEntries;
  bool fused_cutlass_route_ = fused_cutlass_route_default();
  static bool fused_cutlass_route_default();
  model::moe::ReplicaChoiceSpec spec_;
  bool has_spec_ = false;
  unsigned long long* histogram_row_ = nullptr;
  int64_t num_tokens_ = 0;  // of the last route/permute
  std::optional<bool> fp8_fused_permute_;  // set_fp8_fused_permute; empty: FULCRUM_FP8_FUSED_PERMUTE
  std::optional<gpu::Fp8GroupedGemmConfig> fp8_gemm_config_;  // set_fp8_gemm_config; empty: by total rows
  bool fp8_rows_quantized_ = false;        // the last permute wrote fp8_x / fp8_x_scales, not permuted

  DeviceBuffer router_w_, gate_up_w_, down_w_;  // own weights [E, H], [L, 2I, H], [L, H, I] (none if external)
  const uint16_t* router_ = nullptr;            // what the router GEMM reads: router_w_ or set_router_weights
  std::vector<const uint16_t*> slot_gate_up_, slot_down_;  // set_slot_weights: [L] each, or empty
  DeviceBuffer gate_up_ptrs_, down_ptrs_;       // device [L] pointers (gate_up_of / down_of) for CUTLASS
                                                // (FP8: the e4m3 codes)
  DeviceBuffer gate_up_scale_ptrs_, down_scale_ptrs_;  // FP8: device [L] pointers to the block scales
  std::unique_ptr<Fp8SlotPtrs> fp8_slots_;      // FP8: set_fp8_slot_weights' pointers (null: none yet)
  std::unique_ptr<GpuSlotPool> own_fp8_pool_;   // FP8 without external_weights: the layer's own experts
  bool slot_pointers_aligned_ = true;           // all 16-byte aligned (CUTLASS's TMA needs it)
  bool has_expert_weights_ = true;
  DeviceBuffer static_slot_of_, replica_offsets_, replica_slots_, source_streams_;
  // Balanced: chunk bases, pair counts [S][E], route table (offsets | slots | ends).
  DeviceBuffer chunk_base_, pair_counts_, routes_;
  std::unique_ptr<eplb::BalancedSplitter> splitter_;
  eplb::BalancedDispatch split_;
  eplb::BalancedRouteTable route_table_;
  std::vector<int32_t> host_pair_counts_, all_pair_counts_, host_routes_;
  int balanced_source_ = 0;   // with gather_: this layer's source among the topology's GPUs
  CountGather gather_;
  std::vector<int64_t> pair_tokens_;
  bool host_counts_valid_ = false;  // host_counts_ hold the last route's / permute's slot counts
  bool own_problems_built_ = false; // own_problems_ / compact_begin_ match the last permute
  // The permutation's problems, one per non-empty local slot in slot order: compact_begin_[l] is the first
  // problem of local slot >= l. run_experts_on's problems, one per non-empty (segment, local slot).
  std::unique_ptr<GemmProblems> own_problems_, recv_problems_;
  std::unique_ptr<OffsetsUpload> recv_offsets_;
  std::vector<int> compact_begin_;  // [L + 1]
  int32_t* host_counts_ = nullptr;  // pinned [P + 1]: counts, then the total
};

}  // namespace fulcrum::backend
