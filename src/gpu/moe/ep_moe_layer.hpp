#pragma once
// One MoE layer in expert parallelism over W ranks (comm::DeviceExchange: NCCL between GPU rank processes, or
// rows staged through the host for ranks that share a GPU): EP rank r = ep.rank() holds the
// global slots [r * P / W, (r + 1) * P / W) and its own tokens, which are source r of the global replica
// choice. forward, on every rank (a collective):
//   route (router GEMM, fused router with rank r's row of the replica choice tables; recorder += this
//   rank's tokens' counts) -> permute by global slot (rows then lie contiguous per destination rank)
//   -> all-gather of the per-slot row counts ([W][P] int32 host arrays, staged through the device) -> all_to_all_v_device of the bf16 rows
//   -> expert GEMMs over the received rows (GpuMoeLayer::run_experts_on, one problem per (source, local
//   slot)) -> all_to_all_v_device back into the positions the rows left from -> combine with the routing
//   weights (fp32 out).
// Ranks with 0 tokens join every collective. Replica choice: static, dynamic, and balanced, whose split needs
// every rank's per-(source, expert) counts: an all-gather of [E] int32 inside route, then every rank runs
// the same eplb::BalancedSplitter on the same counts and takes its own source's routes.
// Host synchronization per forward: permute's (slot counts; balanced: route's, for the split), the counts
// all-gather, and one wait per
// all_to_all (the exchange returns when the rows landed; the layer stream is synchronized before each, so the
// transport reads rows the layer finished writing).
// NOTES: the output is bitwise the same whatever the other ranks hold in their expert weights' addresses,
// and within bf16 rounding of a one-GPU GpuMoeLayer holding all P slots (GEMM problems are split per source).
// This header includes no CUDA or NCCL header.
#include <cstdint>
#include <memory>
#include <vector>

#include "gpu/moe/moe_layer.hpp"
#include "comm/device_exchange.hpp"

namespace fulcrum::backend {

// What the last forward moved and, with timing on, how long each stage took (ms, host clock around stream
// synchronizations: timing adds a synchronization after each stage that is not there otherwise).
struct EpForwardStats {
  int64_t rows_sent = 0;      // entries of this rank's tokens sent to other ranks' slots
  int64_t rows_received = 0;  // entries of other ranks' tokens received for this rank's slots
  int64_t rows_local = 0;     // entries of this rank's tokens for its own slots (copied, not sent)
  double route_permute_ms = 0;     // router GEMM, router, permutation (with its count download)
  double dispatch_ms = 0;          // count all-gather + rows all_to_all
  double experts_ms = 0;           // expert GEMMs over the received rows
  double combine_exchange_ms = 0;  // rows all_to_all back
  double combine_ms = 0;           // weighted sum into out
};

// The exchanged rows: [W * T * k, H] bf16 received and their expert outputs, [T * k, H] returned. Layers that run
// one after another on one stream may share one set (the GPU engine's MoE layers); a layer checks that it fits.
struct EpRowBuffers {
  EpRowBuffers(const MoeLayerShape& shape, int world);
  int64_t max_entries = 0, max_received = 0, row_bytes = 0;
  DeviceBuffer recv_rows, recv_out, back_rows;
};

class EpMoeLayer {
 public:
  // shape.num_slots = global P (P % W == 0), shape.max_tokens = tokens per rank and forward; the local slot
  // fields are set here. `ep` must outlive the layer; device_idx is the rank's current CUDA device. stream and
  // workspace as GpuMoeLayer takes them (null: the layer's own; the GPU engine shares its stream and one
  // workspace among its layers).
  EpMoeLayer(const MoeLayerShape& shape, comm::DeviceExchange& ep, int device_idx, CUstream_st* stream = nullptr,
             std::shared_ptr<MoeWorkspace> workspace = nullptr, std::shared_ptr<EpRowBuffers> rows = nullptr);
  // The local slot fields EP rank `rank` of `world` gets for a layer of `shape` (P % W == 0, else a one-line error).
  static MoeLayerShape local_shape(MoeLayerShape shape, int rank, int world);
  // The inner layer's balanced count-gather captures this object: it stays where it was made.
  EpMoeLayer(const EpMoeLayer&) = delete;
  EpMoeLayer& operator=(const EpMoeLayer&) = delete;

  // The rank's layer: upload_weights / randomize_weights (its local slots), set_slot_weights,
  // set_expert_gemm, set_recorder. Its forward must not be called (it holds only the local slots).
  GpuMoeLayer& layer() { return *layer_; }
  // Global tables (num_sources = W, num_slots = P; balanced: topo.num_gpus = W); this rank uses row /
  // stream / source r. tokens_per_source is not used (each rank's tokens are its source).
  void set_replica_choice(const model::moe::ReplicaChoiceSpec& spec);

  // x: device bf16 [T, H] of this rank's tokens -> out: device fp32 [T, H]; 0 <= T <= max_tokens. Collective.
  void forward(const uint16_t* x, int64_t num_tokens, float* out);
  void forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out);
  CUstream_st* stream() const { return layer_->stream(); }

  int slot_begin() const { return slot_begin_; }
  int num_local_slots() const { return num_local_; }
  void set_timing(bool on) { timing_ = on; }
  const EpForwardStats& last_stats() const { return stats_; }
  // Rows the last forward received per (source rank, local slot) [W][L]: run_experts_on's segments.

 private:
  // forward with given logits, or (null) the router GEMM's.
  void run(const uint16_t* x, const float* logits, int64_t num_tokens, float* out);

  comm::DeviceExchange& ep_;
  int rank_ = 0, world_ = 1, slot_begin_ = 0, num_local_ = 0;
  MoeLayerShape shape_;  // the global shape
  std::unique_ptr<GpuMoeLayer> layer_;
  bool timing_ = false;
  EpForwardStats stats_;
  std::vector<int32_t> all_counts_;              // [W][P] every rank's per-slot counts, gathered
  std::vector<int32_t> recv_slot_counts_;        // [W][L] rows received per (source, local slot)
  std::vector<int64_t> send_bytes_, recv_bytes_;  // [W]
  std::shared_ptr<EpRowBuffers> rows_;
};

}  // namespace fulcrum::backend
