#include "engine/rebuild_slots.hpp"

#include <algorithm>
#include <map>
#include <set>

#include "engine/backend_factory.hpp"
#include "eplb/error.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"

namespace fulcrum::engine {

int HeldExperts::slot_of(int moe_layer_idx, int expert_idx) const {
  const std::vector<int32_t>& mine = experts.at(static_cast<size_t>(moe_layer_idx));
  const auto it = std::lower_bound(mine.begin(), mine.end(), expert_idx);
  return it != mine.end() && *it == expert_idx ? static_cast<int>(it - mine.begin()) : -1;
}

HeldExperts keep_held_experts(model::Backend* backend, std::span<const model::ExpertSlotView> views,
                              int num_moe_layers) {
  FULCRUM_CHECK(backend != nullptr || views.empty(), "rebuild: slot views without their backend");
  HeldExperts held;
  held.host = make_backend("cpu");
  held.experts.resize(static_cast<size_t>(num_moe_layers));
  held.views.resize(static_cast<size_t>(num_moe_layers));
  for (const model::ExpertSlotView& view : views) {
    FULCRUM_CHECK(view.moe_layer_idx >= 0 && view.moe_layer_idx < num_moe_layers,
                  "rebuild: a slot view of MoE layer {} outside the model's {}", view.moe_layer_idx, num_moe_layers);
    std::vector<int32_t>& experts = held.experts[static_cast<size_t>(view.moe_layer_idx)];
    FULCRUM_CHECK(experts.empty(), "rebuild: two slot views of MoE layer {}", view.moe_layer_idx);
    // The slot map is what the weights are (a migration writes both together), whatever the placement says.
    std::set<int32_t> seen;
    for (int s = 0; s < view.num_slots; ++s) seen.insert(view.physical_to_logical[s]);
    experts.assign(seen.begin(), seen.end());
    if (experts.empty()) continue;
    const auto& gate_up_shape = view.gate_up.shape();
    const auto& down_shape = view.down.shape();
    model::ExpertSlotView& copy = held.views[static_cast<size_t>(view.moe_layer_idx)];
    copy.layer_idx = view.layer_idx;
    copy.moe_layer_idx = view.moe_layer_idx;
    copy.num_slots = static_cast<int>(experts.size());
    copy.num_logical_experts = view.num_logical_experts;
    copy.gate_up = held.host->zeros({copy.num_slots, gate_up_shape[1], gate_up_shape[2]});  // [n, 2w, H]
    copy.down = held.host->zeros({copy.num_slots, down_shape[1], down_shape[2]});           // [n, H, w]
    for (int i = 0; i < copy.num_slots; ++i) {
      const auto at = std::find(view.physical_to_logical.begin(), view.physical_to_logical.end(), experts[i]);
      const int s = static_cast<int>(at - view.physical_to_logical.begin());
      held.host->upload(copy.gate_up.index(i), backend->download(view.gate_up.index(s)));
      held.host->upload(copy.down.index(i), backend->download(view.down.index(s)));
    }
  }
  return held;
}

HeldTable::HeldTable(int ranks, int layers, int experts)
    : num_ranks(ranks), num_layers(layers), num_experts(experts),
      held(static_cast<size_t>(ranks) * layers * experts, 0) {}

bool HeldTable::holds(int rank, int moe_layer_idx, int expert_idx) const {
  return held.at((static_cast<size_t>(rank) * num_layers + moe_layer_idx) * num_experts + expert_idx) != 0;
}

void HeldTable::set(int rank, int moe_layer_idx, int expert_idx) {
  held.at((static_cast<size_t>(rank) * num_layers + moe_layer_idx) * num_experts + expert_idx) = 1;
}

HeldTable gather_held(const HeldExperts& mine, int num_experts, comm::Communicator& world) {
  HeldTable table(world.size(), mine.num_layers(), num_experts);
  HeldTable own(1, mine.num_layers(), num_experts);
  for (int l = 0; l < mine.num_layers(); ++l) {
    for (const int32_t e : mine.experts[static_cast<size_t>(l)]) own.set(0, l, e);
  }
  world.all_gather(std::as_bytes(std::span<const uint8_t>(own.held)),
                   std::as_writable_bytes(std::span<uint8_t>(table.held)));
  return table;
}

eplb::Placement held_placement(const HeldTable& held, const eplb::Topology& topology) {
  const int g = topology.num_gpus, e = held.num_experts, p = topology.num_physical_experts;
  FULCRUM_CHECK(g == held.num_ranks && p % g == 0 && p >= e, "held_placement: {} slots over {} GPUs for {} ranks and {} experts",
                p, g, held.num_ranks, e);
  const int per_rank = p / g;
  eplb::Placement placement;
  placement.topology = topology;
  placement.num_layers = held.num_layers;
  placement.num_logical_experts = e;
  placement.physical_to_logical_map.assign(static_cast<size_t>(held.num_layers) * p, -1);
  const auto room = [&](const std::vector<int32_t>& block) { return static_cast<int>(block.size()) < per_rank; };
  for (int l = 0; l < held.num_layers; ++l) {
    std::vector<std::vector<int32_t>> blocks(static_cast<size_t>(g));
    std::vector<int32_t> missing;
    // Each held expert once, on the holder with room and the fewest so far (lowest rank on ties); the rest missing.
    for (int x = 0; x < e; ++x) {
      int best = -1;
      for (int d = 0; d < g; ++d) {
        if (held.holds(d, l, x) && room(blocks[d]) && (best < 0 || blocks[d].size() < blocks[best].size())) best = d;
      }
      if (best >= 0) {
        blocks[best].push_back(x);
      } else {
        missing.push_back(x);
      }
    }
    for (const int32_t x : missing) {  // to the rank with the most room (there is room: p >= e)
      int best = 0;
      for (int d = 1; d < g; ++d) {
        if (blocks[d].size() < blocks[best].size()) best = d;
      }
      blocks[best].push_back(x);
    }
    for (int d = 0; d < g; ++d) {  // free slots: the rank's other held experts first, then others, cyclically
      std::vector<bool> has(static_cast<size_t>(e), false);
      for (const int32_t x : blocks[d]) has[x] = true;
      for (int x = 0; x < e && room(blocks[d]); ++x) {
        if (!has[x] && held.holds(d, l, x)) blocks[d].push_back(x), has[x] = true;
      }
      for (int x = (d * e) / g, tried = 0; room(blocks[d]); x = (x + 1) % e, ++tried) {
        if (!has[x] || tried >= e) blocks[d].push_back(x), has[x] = true;
      }
      std::copy(blocks[d].begin(), blocks[d].end(),
                placement.physical_to_logical_map.begin() + static_cast<int64_t>(l) * p + static_cast<int64_t>(d) * per_rank);
    }
  }
  placement.validate();
  return placement;
}

eplb::Placement align_to_held(eplb::Placement placement, const HeldTable& held) {
  const eplb::Topology& topo = placement.topology;
  const int n = topo.num_gpus, per_rank = topo.slots_per_gpu();
  FULCRUM_CHECK(n == held.num_ranks && placement.num_layers == held.num_layers,
                "rebuild: the placement has {} EP ranks and {} layers, the held table {} and {}", n,
                placement.num_layers, held.num_ranks, held.num_layers);
  for (int l = 0; l < placement.num_layers; ++l) {
    const auto row = placement.layer(l);
    const std::vector<int32_t> planned(row.begin(), row.end());
    std::vector<int> overlap(static_cast<size_t>(n) * n, 0);  // [block, rank]: slots of the block the rank holds
    for (int b = 0; b < n; ++b) {
      for (int s = b * per_rank; s < (b + 1) * per_rank; ++s) {
        for (int r = 0; r < n; ++r) overlap[static_cast<size_t>(b) * n + r] += held.holds(r, l, planned[s]) ? 1 : 0;
      }
    }
    std::vector<bool> block_taken(static_cast<size_t>(n), false), rank_taken(static_cast<size_t>(n), false);
    for (int k = 0; k < n; ++k) {
      int best_b = -1, best_r = -1;
      for (int b = 0; b < n; ++b) {
        for (int r = 0; r < n && !block_taken[b]; ++r) {
          if (rank_taken[r]) continue;
          if (best_b < 0 || overlap[static_cast<size_t>(b) * n + r] > overlap[static_cast<size_t>(best_b) * n + best_r]) {
            best_b = b;
            best_r = r;
          }
        }
      }
      block_taken[best_b] = rank_taken[best_r] = true;
      std::copy(planned.begin() + best_b * per_rank, planned.begin() + (best_b + 1) * per_rank,
                row.begin() + best_r * per_rank);
    }
  }
  placement.validate();
  return placement;
}

bool RebuildSlotPlan::reads_from_checkpoint(int rank, int moe_layer_idx, int local_slot) const {
  const int slot = rank * topology.slots_per_gpu() + local_slot;
  return fills.at(static_cast<size_t>(moe_layer_idx)).at(static_cast<size_t>(slot)).source == SlotSource::kCheckpoint;
}

RebuildSlotPlan plan_rebuild_slots(const eplb::Placement& to, const HeldTable& held) {
  to.validate();
  FULCRUM_CHECK(to.topology.num_gpus == held.num_ranks && to.num_layers == held.num_layers &&
                    to.num_logical_experts == held.num_experts,
                "rebuild: the placement has {} EP ranks, {} layers, {} experts; the held table {}, {}, {}",
                to.topology.num_gpus, to.num_layers, to.num_logical_experts, held.num_ranks, held.num_layers,
                held.num_experts);
  RebuildSlotPlan plan;
  plan.topology = to.topology;
  plan.fills.resize(static_cast<size_t>(to.num_layers));
  for (int l = 0; l < to.num_layers; ++l) {
    const auto map = to.layer(l);
    std::vector<SlotFill>& fills = plan.fills[static_cast<size_t>(l)];
    fills.resize(map.size());
    std::set<int32_t> unheld;
    std::map<std::pair<int, int32_t>, int> first_fetched;  // (rank, expert) -> its first slot received or read
    for (size_t s = 0; s < map.size(); ++s) {
      const int32_t e = map[s];
      const int dst = to.topology.gpu_of_slot(static_cast<int>(s));
      if (held.holds(dst, l, e)) {
        fills[s] = {SlotSource::kLocal, dst, e};
        ++plan.num_local;
        continue;
      }
      if (const auto first = first_fetched.find({dst, e}); first != first_fetched.end()) {
        fills[s] = {SlotSource::kCopy, dst, e, first->second};
        ++plan.num_copied;
        continue;
      }
      first_fetched[{dst, e}] = static_cast<int>(s);
      int src = 0;
      while (src < held.num_ranks && !held.holds(src, l, e)) ++src;
      if (src < held.num_ranks) {
        fills[s] = {SlotSource::kSurvivor, src, e};
        ++plan.num_received;
      } else {
        fills[s] = {SlotSource::kCheckpoint, -1, e};
        ++plan.num_from_checkpoint;
        unheld.insert(e);
      }
    }
    plan.num_experts_from_checkpoint += static_cast<int64_t>(unheld.size());
  }
  return plan;
}

RebuildFillStats fill_rebuild_slots(const RebuildSlotPlan& plan, const HeldExperts& held, model::Backend& backend,
                                    std::span<const model::ExpertSlotView> views, comm::Communicator& world) {
  const eplb::Topology& topo = plan.topology;
  FULCRUM_CHECK(topo.num_gpus == world.size(), "rebuild: the plan has {} EP ranks, the world {}", topo.num_gpus,
                world.size());
  const int rank = world.rank();
  const int per_rank = topo.slots_per_gpu();
  const int first_slot = rank * per_rank;
  // The held copies send from host memory; this rank's slots receive through staging on their backend.
  eplb_runtime::BackendSlotCopyExecutor sender(*held.host, world);
  eplb_runtime::BackendSlotCopyExecutor receiver(backend, world);
  RebuildFillStats stats;
  std::vector<const model::ExpertSlotView*> by_layer(plan.fills.size(), nullptr);
  for (const model::ExpertSlotView& view : views) {
    FULCRUM_CHECK(view.moe_layer_idx >= 0 && view.moe_layer_idx < static_cast<int>(by_layer.size()) &&
                      view.num_slots == per_rank && view.slot_begin == first_slot,
                  "rebuild: MoE layer {}: the view holds slots [{}, +{}), EP rank {} should hold [{}, +{})",
                  view.moe_layer_idx, view.slot_begin, view.num_slots, rank, first_slot, per_rank);
    by_layer[static_cast<size_t>(view.moe_layer_idx)] = &view;
  }
  for (size_t l = 0; l < plan.fills.size(); ++l) {
    const std::vector<SlotFill>& fills = plan.fills[l];
    const int layer = static_cast<int>(l);
    // Sends first (buffered), in slot order: each (sender, receiver) pair matches in that order.
    for (size_t s = 0; s < fills.size(); ++s) {
      const int dst = topo.gpu_of_slot(static_cast<int>(s));
      if (fills[s].source != SlotSource::kSurvivor || fills[s].src_rank != rank || dst == rank) continue;
      const int32_t expert_idx = fills[s].expert_idx;
      const int src_slot = held.slot_of(layer, expert_idx);
      FULCRUM_CHECK(src_slot >= 0, "rebuild: MoE layer {}: rank {} sends logical expert {}, which it does not hold",
                    layer, rank, expert_idx);
      sender.send(held.views[l], src_slot, dst);
      ++stats.num_sent;
    }
    const model::ExpertSlotView* view = by_layer[l];
    if (view == nullptr) continue;
    int num_incoming = 0;
    for (int local = 0; local < per_rank; ++local) {
      if (fills[static_cast<size_t>(first_slot + local)].source == SlotSource::kSurvivor) ++num_incoming;
    }
    receiver.begin_layer(*view, num_incoming);
    std::vector<int> staged;  // local slot of each staging entry
    for (int local = 0; local < per_rank; ++local) {
      const SlotFill& fill = fills[static_cast<size_t>(first_slot + local)];
      const int32_t expert_idx = fill.expert_idx;
      FULCRUM_CHECK(view->physical_to_logical[local] == expert_idx,
                    "rebuild: MoE layer {} slot {} holds logical expert {}, the plan says {}", layer, first_slot + local,
                    view->physical_to_logical[local], expert_idx);
      if (fill.source == SlotSource::kLocal) {
        const int src_slot = held.slot_of(layer, expert_idx);
        FULCRUM_CHECK(src_slot >= 0, "rebuild: MoE layer {}: rank {} does not hold logical expert {}", layer, rank,
                      expert_idx);
        backend.upload(view->gate_up.index(local), held.host->download(held.views[l].gate_up.index(src_slot)));
        backend.upload(view->down.index(local), held.host->download(held.views[l].down.index(src_slot)));
        ++stats.num_local;
      } else if (fill.source == SlotSource::kSurvivor) {
        receiver.recv(*view, static_cast<int>(staged.size()), fill.src_rank);
        staged.push_back(local);
        ++stats.num_received;
        stats.bytes_received += eplb_runtime::slot_bytes(*view);
      }
    }
    receiver.wait();
    for (size_t i = 0; i < staged.size(); ++i) receiver.commit_slot(*view, static_cast<int>(i), staged[i]);
    receiver.end_layer();
    // Second slots of an expert this rank fetched: from the first, now received or read from the checkpoint.
    for (int local = 0; local < per_rank; ++local) {
      const SlotFill& fill = fills[static_cast<size_t>(first_slot + local)];
      if (fill.source != SlotSource::kCopy) continue;
      const int from = fill.copy_of - first_slot;
      FULCRUM_CHECK(from >= 0 && from < local, "rebuild: MoE layer {} slot {} copies slot {}, not an earlier one of rank {}",
                    layer, first_slot + local, fill.copy_of, rank);
      backend.upload(view->gate_up.index(local), backend.download(view->gate_up.index(from)));
      backend.upload(view->down.index(local), backend.download(view->down.index(from)));
      ++stats.num_copied;
    }
  }
  return stats;
}

}  // namespace fulcrum::engine
