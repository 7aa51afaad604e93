// `fulcrum bench moe --gpus W`, live migration part. The layer's slots live in a backend::GpuSlotPool and
// move with comm::NcclSlotPoolMigration on a communicator of their own (received into free buffers on the
// migration's streams, committed by remapping pointers). The placement change: the EPLB placement and the
// same placement with every GPU's slot range shifted by one GPU (slot s takes the expert of slot s + P/W),
// which moves nearly every slot across GPUs while leaving the balance, hence the forward time, unchanged.
// Figures, at one batch (the largest --tokens <= 4096 per rank):
//   raw P2P     one ncclSend/ncclRecv per peer pair of the bytes the migration moves between them (both
//               directions busy, as in the migration), on the forward's communicator (no SM cap)
//   migration   begin_layer -> commit (the whole migration of the layer's weights, host clock) on every rank;
//               the switch that follows (the layer reads the new pointers and routes by the new placement's
//               tables) is timed on its own
//   inflation   a pass = one forward per MoE layer of the model (--layers-per-pass) of this one layer;
//               passes with a migration begun at the pass's start and committed (and switched) at its end
//               alternate with passes without; median of --passes each
#include <fmt/format.h>

#include "gpu/moe/gpu_slot_pool.hpp"
#include "bench_moe/ep_bench.hpp"
#include "gpu/moe/nccl_slot_pool_migration.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::bench_moe {

using backend::DeviceBuffer;
using nlohmann::json;

namespace {

// Bytes each ordered (source GPU, destination GPU) pair moves for from -> to, [W][W].
std::vector<int64_t> pair_bytes(const std::vector<int32_t>& from, const std::vector<int32_t>& to, int world,
                                int64_t slot_bytes) {
  const eplb::Topology topo{static_cast<int>(from.size()), world, 1};
  eplb::Placement a(topo, 1, kExperts), b(topo, 1, kExperts);
  std::copy(from.begin(), from.end(), a.layer(0).begin());
  std::copy(to.begin(), to.end(), b.layer(0).begin());
  std::vector<int64_t> bytes(static_cast<size_t>(world * world), 0);
  for (const auto& t : eplb::plan_migration(a, b).transfers) {
    const int src = topo.gpu_of_slot(t.src_slot), dst = topo.gpu_of_slot(t.dst_slot);
    if (src != dst) bytes[static_cast<size_t>(src * world + dst)] += slot_bytes;
  }
  return bytes;
}

}  // namespace

json run_migration_bench(const MoeBenchOptions& opt, comm::NcclCommunicator& ep, comm::NcclCommunicator& migration,
                         const ModelShape& m, const LoadRouting& routing) {
  const int world = ep.size(), rank = ep.rank();
  int64_t tokens = *std::min_element(opt.tokens.begin(), opt.tokens.end());
  for (const int64_t t : opt.tokens) {
    if (t <= 4096) tokens = std::max(tokens, t);
  }
  const int p = routing.eplb_slots, local = p / world;
  const std::vector<int32_t>& map_a = routing.eplb_map;
  std::vector<int32_t> map_b(map_a.size());
  for (int s = 0; s < p; ++s) map_b[static_cast<size_t>(s)] = map_a[static_cast<size_t>((s + local) % p)];

  backend::SlotPoolShape pool_shape;
  pool_shape.num_layers = 1;
  pool_shape.slots_per_layer = local;
  pool_shape.hidden_size = m.hidden;
  pool_shape.moe_intermediate_size = m.intermediate;
  backend::GpuSlotPool pool(pool_shape, 0);
  pool.fill_layer(0, std::span<const int32_t>(map_a).subspan(static_cast<size_t>(rank * local), static_cast<size_t>(local)), 5);
  backend::MoeLayerShape shape{m.hidden, m.intermediate, kExperts, kTopK, true, p, tokens};
  backend::EpMoeLayer layer(shape, ep, 0);
  comm::NcclSlotPoolMigration mover(pool, migration, eplb::Topology{p, world, 1});
  const std::vector<int32_t>* live = &map_a;
  const auto use_live = [&] {
    layer.layer().set_slot_weights(pool.gate_up_ptrs(0), pool.down_ptrs(0));
    layer.set_replica_choice(ep_replica_choice(eplb::DispatchAlgorithm::kStatic, *live, world));
  };
  use_live();
  const auto begin_next = [&] {
    const std::vector<int32_t>* next = live == &map_a ? &map_b : &map_a;
    mover.begin_layer(0, *live, *next);
    live = next;
  };
  const auto commit = [&] {
    mover.commit(layer.stream());
    use_live();
  };
  const int layers_per_pass = opt.layers_per_pass > 0 ? opt.layers_per_pass : m.num_layers;

  const LayerInputs in(tokens, m.hidden, 9 + rank, layer.stream());
  const EpRoutingInput input(routing.real, tokens, rank, 4242);
  const auto forward = [&] {
    layer.forward_from_logits(in.x.as<uint16_t>(), input.logits.as<float>(), tokens, in.out.as<float>());
  };

  // Raw P2P of the a -> b move's bytes per peer pair. With 2 GPUs the b -> a move mirrors it (the same counts
  // the other way); with more GPUs the raw figure follows the a -> b pattern only.
  const int64_t slot_bytes = pool.slot_bytes();
  const std::vector<int64_t> ab = pair_bytes(map_a, map_b, world, slot_bytes);
  int64_t max_send = 0, max_recv = 0, my_sent = 0, my_received = 0;
  for (int peer = 0; peer < world; ++peer) {
    my_sent += ab[static_cast<size_t>(rank * world + peer)];
    my_received += ab[static_cast<size_t>(peer * world + rank)];
  }
  for (int g = 0; g < world; ++g) {
    int64_t s = 0, r = 0;
    for (int peer = 0; peer < world; ++peer) s += ab[static_cast<size_t>(g * world + peer)], r += ab[static_cast<size_t>(peer * world + g)];
    max_send = std::max(max_send, s), max_recv = std::max(max_recv, r);
  }
  DeviceBuffer send_buf(static_cast<size_t>(std::max<int64_t>(my_sent, 1))), recv_buf(static_cast<size_t>(std::max<int64_t>(my_received, 1)));
  std::vector<comm::NcclCommunicator::DeviceSend> sends;
  std::vector<comm::NcclCommunicator::DeviceRecv> recvs;
  int64_t send_off = 0, recv_off = 0;
  for (int peer = 0; peer < world; ++peer) {
    const int64_t out_bytes = ab[static_cast<size_t>(rank * world + peer)], in_bytes = ab[static_cast<size_t>(peer * world + rank)];
    if (out_bytes > 0) sends.push_back({send_buf.as<std::byte>() + send_off, out_bytes, peer}), send_off += out_bytes;
    if (in_bytes > 0) recvs.push_back({recv_buf.as<std::byte>() + recv_off, in_bytes, peer}), recv_off += in_bytes;
  }
  std::vector<double> raw, moved, switched;
  for (int r = 0; r < opt.warmup + opt.reps; ++r) {
    ep.barrier();
    double start = now_ms();
    ep.exchange_device(sends, recvs);  // NCCL's own choice of SMs, whatever cap the migration has
    if (r >= opt.warmup) raw.push_back(now_ms() - start);
    migration.barrier();
    start = now_ms();
    begin_next();
    mover.commit(layer.stream());
    const double committed = now_ms();
    use_live();
    if (r >= opt.warmup) moved.push_back(committed - start), switched.push_back(now_ms() - committed);
  }
  const double raw_ms = slowest_rank(ep, median(raw)), moved_ms = slowest_rank(ep, median(moved));
  const double switch_ms = slowest_rank(ep, median(switched));
  const double bytes = static_cast<double>(std::max(max_send, max_recv));  // the busiest GPU's direction

  // Forward passes with and without a migration in flight, alternating.
  std::vector<double> plain, during;
  int not_ready_at_end = 0;
  for (int w = 0; w < opt.warmup; ++w) forward();
  for (int pass = 0; pass < 2 * opt.passes; ++pass) {
    const bool migrating = pass % 2 == 1;
    ep.barrier();
    migration.barrier();
    const double start = now_ms();
    if (migrating) begin_next();
    for (int l = 0; l < layers_per_pass; ++l) forward();
    if (migrating) {
      not_ready_at_end += mover.ready() ? 0 : 1;
      commit();
    }
    FULCRUM_CUDA_CHECK(cudaStreamSynchronize(layer.stream()));
    (migrating ? during : plain).push_back(now_ms() - start);
  }
  const double plain_ms = slowest_rank(ep, median(plain)), during_ms = slowest_rank(ep, median(during));
  const json r{{"model", m.name}, {"tokens_per_rank", tokens}, {"num_slots", p}, {"loads_layer", routing.layer_idx},
               {"slot_bytes", slot_bytes}, {"busiest_gpu_bytes_per_direction", bytes},
               {"raw_p2p_ms", raw_ms}, {"raw_p2p_gb_per_s", bytes / (raw_ms * 1e-3) / 1e9},
               {"migration_ms", moved_ms}, {"migration_gb_per_s", bytes / (moved_ms * 1e-3) / 1e9},
               {"migration_fraction_of_p2p", raw_ms / moved_ms}, {"switch_ms", switch_ms},
               {"migration_max_ctas", opt.migration_max_ctas},
               {"layers_per_pass", layers_per_pass}, {"passes_each", opt.passes},
               {"pass_ms_without_migration", plain_ms}, {"pass_ms_with_migration", during_ms},
               {"forward_inflation_fraction", during_ms / plain_ms - 1},
               {"rank0_passes_where_migration_outlasted_the_pass", not_ready_at_end},
               {"rank0_nccl_ops_total", mover.stats().num_nccl_ops}};
  if (rank == 0) {
    fmt::print("{:16} migration T/rank={} P={}: {:.1f} MiB per direction (busiest GPU): raw P2P {:.3f} ms ({:.1f} GB/s), "
               "migration {:.3f} ms ({:.1f} GB/s, {:.1f}% of P2P), then switch {:.3f} ms | pass of {} layers {:.3f} ms, with a migration in flight "
               "{:.3f} ms ({:+.2f}%), migration outlasted {} of {} passes\n",
               m.name, tokens, p, bytes / (1 << 20), raw_ms, r["raw_p2p_gb_per_s"].get<double>(), moved_ms,
               r["migration_gb_per_s"].get<double>(), 100 * raw_ms / moved_ms, switch_ms, layers_per_pass, plain_ms, during_ms,
               100 * (during_ms / plain_ms - 1), not_ready_at_end, opt.passes);
  }
  return r;
}

}  // namespace fulcrum::bench_moe
