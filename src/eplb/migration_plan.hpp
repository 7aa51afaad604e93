#pragma once
// Migration plans: the weight transfers that turn one placement into another.
// NOTES: every slot whose logical expert changes is received exactly once, from a slot that holds that
// expert in the OLD placement. Receivers write into a staging buffer and a layer switches to its new map
// only when all its transfers are complete, so a source slot may itself be overwritten in the same layer.
#include <cstdint>
#include <vector>

#include "eplb/placement.hpp"

namespace fulcrum::eplb {

enum class TransferKind { kLocal, kIntraNode, kInterNode };

struct SlotTransfer {
  int layer_idx = 0;
  int dst_slot = 0;  // physical slot receiving the expert
  int src_slot = 0;  // physical slot holding it in the old placement
  int expert_idx = 0;
  TransferKind kind = TransferKind::kLocal;
};

struct MigrationPlan {
  // Per layer in layer order; inside a layer local copies first, then intra-node, then inter-node.
  std::vector<SlotTransfer> transfers;
  int64_t num_local = 0;
  int64_t num_intra_node = 0;
  int64_t num_inter_node = 0;
  int64_t max_received_per_gpu_layer = 0;  // most slots any GPU receives over the network in one layer
  int64_t max_sent_per_gpu_layer = 0;      // most slots any GPU sends over the network in one layer
  int64_t num_transfers() const { return static_cast<int64_t>(transfers.size()); }
};

// Sources are chosen on the receiving GPU when possible, else on its node, else across nodes; among
// equally close holders the one that has sent least so far in this layer (spreading network load).
MigrationPlan plan_migration(const Placement& from, const Placement& to);

}  // namespace fulcrum::eplb
