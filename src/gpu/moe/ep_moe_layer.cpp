// Expert-parallel MoE layer (see ep_moe_layer.hpp).
#include "gpu/moe/ep_moe_layer.hpp"

#include <chrono>
#include <numeric>

#include "eplb/error.hpp"

namespace fulcrum::backend {
namespace {

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

const std::byte* bytes_of(const uint16_t* p) { return reinterpret_cast<const std::byte*>(p); }
std::byte* bytes_of(uint16_t* p) { return reinterpret_cast<std::byte*>(p); }

}  // namespace

// Rank `rank` of `world` holds the contiguous slots [rank * P / W, (rank + 1) * P / W).
MoeLayerShape EpMoeLayer::local_shape(MoeLayerShape shape, int rank, int world) {
  FULCRUM_CHECK(shape.num_slots > 0 && shape.num_slots % world == 0,
                "EP MoE layer: {} slots do not split evenly over {} EP ranks", shape.num_slots, world);
  shape.num_local_slots = shape.num_slots / world;
  shape.local_slot_begin = rank * shape.num_local_slots;
  return shape;
}

EpRowBuffers::EpRowBuffers(const MoeLayerShape& shape, int world)
    : max_entries(shape.max_tokens * shape.num_experts_per_tok),
      max_received(max_entries * world),  // worst case: every rank sends all its entries here
      row_bytes(2 * int64_t{shape.hidden_size}),
      recv_rows(static_cast<size_t>(row_bytes * max_received)),
      recv_out(static_cast<size_t>(row_bytes * max_received)),
      back_rows(static_cast<size_t>(row_bytes * max_entries)) {}

EpMoeLayer::EpMoeLayer(const MoeLayerShape& shape, comm::DeviceExchange& ep, int device_idx, CUstream_st* stream,
                       std::shared_ptr<MoeWorkspace> workspace, std::shared_ptr<EpRowBuffers> rows)
    : ep_(ep), rank_(ep.rank()), world_(ep.size()), shape_(shape), rows_(std::move(rows)) {
  const MoeLayerShape local = local_shape(shape, rank_, world_);
  slot_begin_ = local.local_slot_begin;
  num_local_ = local.num_local_slots;
  layer_ = std::make_unique<GpuMoeLayer>(local, device_idx, stream, std::move(workspace));  // validates the rest of the shape
  // Balanced choice splits every rank's (source, expert) counts: an all-gather inside route.
  layer_->set_balanced_sources(rank_, [this](std::span<const int32_t> mine, std::span<int32_t> all) {
    ep_.all_gather(std::as_bytes(mine), std::as_writable_bytes(all));
  });
  if (rows_ == nullptr) rows_ = std::make_shared<EpRowBuffers>(shape, world_);
  const int64_t max_entries = shape.max_tokens * shape.num_experts_per_tok;
  FULCRUM_CHECK(rows_->row_bytes == 2 * int64_t{shape.hidden_size} && rows_->max_entries >= max_entries &&
                    rows_->max_received >= max_entries * world_,
                "EP MoE layer: shared row buffers for {} entries of {} bytes, the layer needs {} of {}", rows_->max_entries,
                rows_->row_bytes, max_entries, 2 * shape.hidden_size);
  layer_->reserve_expert_rows(max_entries * world_);
  all_counts_.assign(static_cast<size_t>(world_) * shape.num_slots, 0);
  recv_slot_counts_.assign(static_cast<size_t>(world_) * num_local_, 0);
  send_bytes_.assign(static_cast<size_t>(world_), 0);
  recv_bytes_.assign(static_cast<size_t>(world_), 0);
}

void EpMoeLayer::set_replica_choice(const model::moe::ReplicaChoiceSpec& spec) {
  const int e = shape_.num_experts;
  FULCRUM_CHECK(spec.num_sources == world_ && spec.num_slots == shape_.num_slots && spec.num_logical_experts == e,
                "EP MoE layer: replica choice for {} sources / {} slots / {} experts, the layer has {} ranks / {} / {}",
                spec.num_sources, spec.num_slots, spec.num_logical_experts, world_, shape_.num_slots, e);
  // This rank's view: one source (its own tokens) with row / stream `rank_` of the global tables.
  model::moe::ReplicaChoiceSpec mine;
  mine.algorithm = spec.algorithm;
  mine.num_logical_experts = e;
  mine.num_slots = spec.num_slots;
  mine.num_sources = 1;
  mine.tokens_per_source = shape_.max_tokens;
  if (spec.algorithm == eplb::DispatchAlgorithm::kStatic) {
    FULCRUM_CHECK(spec.static_slot_of.size() == static_cast<size_t>(world_) * e,
                  "EP MoE layer: static table of {} entries, expected {} x {}", spec.static_slot_of.size(), world_, e);
    mine.static_slot_of.assign(spec.static_slot_of.begin() + static_cast<ptrdiff_t>(rank_) * e,
                               spec.static_slot_of.begin() + static_cast<ptrdiff_t>(rank_ + 1) * e);
  } else if (spec.algorithm == eplb::DispatchAlgorithm::kBalanced) {
    FULCRUM_CHECK(spec.topo.num_gpus == world_, "EP MoE layer: balanced split over {} GPUs for {} ranks",
                  spec.topo.num_gpus, world_);
    mine.replica_offsets = spec.replica_offsets;
    mine.replica_slots = spec.replica_slots;
    mine.layer_map = spec.layer_map;
    mine.topo = spec.topo;
  } else {
    FULCRUM_CHECK(spec.source_streams.size() == static_cast<size_t>(world_),
                  "EP MoE layer: {} dynamic source streams for {} ranks", spec.source_streams.size(), world_);
    mine.replica_offsets = spec.replica_offsets;
    mine.replica_slots = spec.replica_slots;
    mine.source_streams = {spec.source_streams[static_cast<size_t>(rank_)]};
  }
  layer_->set_replica_choice(mine);  // checks the tables' slots and sizes
}

void EpMoeLayer::forward(const uint16_t* x, int64_t num_tokens, float* out) { run(x, nullptr, num_tokens, out); }

void EpMoeLayer::forward_from_logits(const uint16_t* x, const float* logits, int64_t num_tokens, float* out) {
  FULCRUM_CHECK(logits != nullptr || num_tokens == 0, "EP MoE layer: null logits for {} tokens", num_tokens);
  run(x, logits != nullptr ? logits : layer_->logits(), num_tokens, out);
}

void EpMoeLayer::run(const uint16_t* x, const float* logits, int64_t num_tokens, float* out) {
  FULCRUM_CHECK(num_tokens >= 0 && num_tokens <= shape_.max_tokens, "EP MoE layer: {} tokens, at most {} per rank",
                num_tokens, shape_.max_tokens);
  GpuMoeLayer& layer = *layer_;
  stats_ = EpForwardStats{};
  double mark = timing_ ? now_ms() : 0.0;
  const auto lap = [&](double& field) {
    if (!timing_) return;
    layer.synchronize();
    const double t = now_ms();
    field = t - mark;
    mark = t;
  };

  if (logits == nullptr) {
    layer.router_logits(x, num_tokens);
    logits = layer.logits();
  }
  layer.route(logits, num_tokens);
  layer.permute(x, num_tokens);  // rows slot-sorted, so contiguous per destination rank; host slot counts
  lap(stats_.route_permute_ms);

  // Every rank's per-slot counts [W][P] (small host arrays; over NCCL staged through the device): what
  // each rank sends to whom.
  const std::span<const int32_t> my_counts = layer.slot_counts();
  ep_.all_gather(std::as_bytes(my_counts), std::as_writable_bytes(std::span(all_counts_)));
  const int p = shape_.num_slots, l = num_local_;
  const int64_t row_bytes = 2 * int64_t{shape_.hidden_size};
  for (int r = 0; r < world_; ++r) {
    const auto mine = my_counts.begin() + static_cast<ptrdiff_t>(r) * l;
    send_bytes_[r] = row_bytes * std::accumulate(mine, mine + l, int64_t{0});
    const auto theirs = all_counts_.begin() + static_cast<ptrdiff_t>(r) * p + slot_begin_;
    std::copy(theirs, theirs + l, recv_slot_counts_.begin() + static_cast<ptrdiff_t>(r) * l);
    recv_bytes_[r] = row_bytes * std::accumulate(theirs, theirs + l, int64_t{0});
  }
  stats_.rows_local = send_bytes_[rank_] / row_bytes;
  stats_.rows_sent = std::accumulate(send_bytes_.begin(), send_bytes_.end(), int64_t{0}) / row_bytes - stats_.rows_local;
  stats_.rows_received = std::accumulate(recv_bytes_.begin(), recv_bytes_.end(), int64_t{0}) / row_bytes - stats_.rows_local;

  // The transport reads the rows on its own stream: the layer's writes must be complete first.
  layer.synchronize();
  ep_.all_to_all_v_device(bytes_of(layer.permuted()), send_bytes_, bytes_of(rows_->recv_rows.as<uint16_t>()), recv_bytes_);
  lap(stats_.dispatch_ms);

  layer.run_experts_on(rows_->recv_rows.as<uint16_t>(), recv_slot_counts_, rows_->recv_out.as<uint16_t>());
  layer.synchronize();
  lap(stats_.experts_ms);

  // Each source's rows go back to the positions they left from (the same counts, the other way).
  ep_.all_to_all_v_device(bytes_of(rows_->recv_out.as<uint16_t>()), recv_bytes_, bytes_of(rows_->back_rows.as<uint16_t>()),
                          send_bytes_);
  lap(stats_.combine_exchange_ms);

  layer.combine_rows(rows_->back_rows.as<uint16_t>(), num_tokens, out);
  lap(stats_.combine_ms);
}

}  // namespace fulcrum::backend
