#pragma once
// Elastic expert parallelism (serve --multi-process --enable-elastic-ep): how the surviving rank processes
// agree on a new world after one is lost, and what that world looks like. Supported layout: one rank per
// attention-DP group and per EP rank (--enable-dp-attention, dp = tp = ep, pp 1), so losing a rank loses
// exactly one KV group and one EP rank's slots.
//
// The recovery, on the mesh's control messages (comm::PeerMesh, elastic mode):
//   1. a rank whose wait fails aborts the epoch (every rank's data waits end, so none hangs in a collective);
//   2. world rank 0 (the front end, the coordinator) calls the roll: every member of the old world answers
//      on the control channel, or is found failed (closed, or silent past --elastic-ep-timeout);
//   3. rank 0 announces the new world (NewWorld) to the members that answered; every member starts the
//      epoch over them and rebuilds its rank of the new layout.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "comm/peer_mesh.hpp"
#include "engine/parallel_layout.hpp"
#include "eplb/loads.hpp"
#include "eplb/placement.hpp"

namespace fulcrum::server {

struct NewWorld {
  uint64_t epoch = 0;
  std::vector<int> members;      // mesh ranks, ascending; members[0] == 0 (the front end)
  std::vector<int> group_hosts;  // [the scheduler's KV groups]: the mesh rank that hosts each now
  int num_physical_experts = 0;  // P of the new layout (slots per MoE layer over every survivor)

  bool operator==(const NewWorld&) const = default;
};
std::vector<std::byte> encode(const NewWorld& world);
NewWorld decode_new_world(std::span<const std::byte> bytes);

// The one-line error for a layout elastic EP does not support ("" when it does). The prefix cache may be on:
// a recovery drops it whole (Scheduler, on WorldReformed) and it refills.
std::string why_elastic_ep_cannot_run(const engine::ParallelFlags& flags, const std::string& device);

// The survivors' KV groups: group g was launched on mesh rank g and goes back there whenever g is in
// `members` (a rank that rejoined); each other group whose host is not in `members` moves to the member
// hosting the fewest groups (the lowest mesh rank on ties); the others stay where they are.
std::vector<int> rehome_groups(std::vector<int> group_hosts, const std::vector<int>& members);
// Slots per MoE layer over `num_ranks` EP ranks: as many per rank as at launch (`launch_slots_per_rank`), or
// more where needed so every expert fits once (so a world that grows back has the launch layout's slots).
int surviving_physical_experts(int num_experts, int launch_slots_per_rank, int num_ranks);

// The flags of the world over `num_ranks` survivors (dp = tp = ep = num_ranks, the redundant slots that fill
// `num_physical_experts`).
engine::ParallelFlags surviving_flags(const engine::ParallelFlags& before, int num_experts, int num_physical_experts,
                                      int num_ranks);

// Per MoE layer of `placement`, the logical experts none of whose replicas is on an EP rank that `survives`
// ([the placement's EP ranks]): their last replica was lost, no survivor can send them.
std::vector<int> experts_without_surviving_replica(const eplb::Placement& placement, const std::vector<bool>& survives);

// The placement over the new layout's EP ranks, planned by the default planner on `loads` (the survivors'
// recorded windows, summed) plus one token per expert (so an expert never seen still gets planned); every
// logical expert has at least one slot (checked). With `current` (what the new world's ranks hold:
// engine::held_placement) the planner is migration-aware: it keeps slots where they are when that costs no balance.
eplb::Placement replan_placement(const eplb::LoadMatrix& loads, int num_physical_experts, int num_ranks,
                                 const eplb::Placement* current = nullptr);

// Step 2 on world rank 0: aborts the epoch, then each of `members` (mesh ranks, ascending, 0 first) answers
// or is dropped; returns those that answered (0 included), ascending. `newcomers` (among `members`): ranks
// that rejoined (PeerMesh::take_rejoined), in no epoch's world yet, whose answer carries no epoch to check.
// With a liveness timeout (--elastic-ep-timeout) every answer is due within one timeout of the call: a member
// that is alive (its heartbeats arrive) but has not answered by then has stopped making progress; it is expelled
// (PeerMesh::recv_control with a deadline) and listed in `silent` when given.
std::vector<int> call_the_roll(comm::PeerMesh& mesh, const std::vector<int>& members,
                               const std::vector<int>& newcomers = {}, std::vector<int>* silent = nullptr);
// Step 3 on world rank 0: sends `world` to every member but itself (one that fails meanwhile is found by the
// new world's first wait).
void announce_new_world(comm::PeerMesh& mesh, const NewWorld& world);
// Steps 2 and 3 on a worker rank: aborts the epoch, answers the roll call, returns the new world. Throws when
// world rank 0 is gone (the front end's own failure is out of scope) or this rank was left out. A rank that
// rejoined (PeerMesh::joined_late, epoch 0) aborts nothing: it waits for rank 0's next roll call.
NewWorld answer_the_roll(comm::PeerMesh& mesh);

}  // namespace fulcrum::server
