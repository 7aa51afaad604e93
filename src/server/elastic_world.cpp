#include "server/elastic_world.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "eplb/planner.hpp"
#include "eplb_runtime/eplb_manager.hpp"

namespace fulcrum::server {
namespace {

void put_i64(std::vector<std::byte>& out, int64_t v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  out.insert(out.end(), p, p + sizeof(v));
}

int64_t get_i64(std::span<const std::byte> bytes, size_t& at) {
  FULCRUM_CHECK(at + sizeof(int64_t) <= bytes.size(), "new world message: truncated at byte {} of {}", at, bytes.size());
  int64_t v = 0;
  std::memcpy(&v, bytes.data() + at, sizeof(v));
  at += sizeof(v);
  return v;
}

void put_list(std::vector<std::byte>& out, const std::vector<int>& values) {
  put_i64(out, static_cast<int64_t>(values.size()));
  for (const int v : values) put_i64(out, v);
}

std::vector<int> get_list(std::span<const std::byte> bytes, size_t& at) {
  const int64_t n = get_i64(bytes, at);
  FULCRUM_CHECK(n >= 0 && static_cast<uint64_t>(n) <= (bytes.size() - at) / sizeof(int64_t),
                "new world message: a list of {} items", n);
  std::vector<int> values;
  for (int64_t i = 0; i < n; ++i) values.push_back(static_cast<int>(get_i64(bytes, at)));
  return values;
}

}  // namespace

std::vector<std::byte> encode(const NewWorld& world) {
  std::vector<std::byte> out;
  put_i64(out, static_cast<int64_t>(world.epoch));
  put_list(out, world.members);
  put_list(out, world.group_hosts);
  put_i64(out, world.num_physical_experts);
  return out;
}

NewWorld decode_new_world(std::span<const std::byte> bytes) {
  size_t at = 0;
  NewWorld world;
  world.epoch = static_cast<uint64_t>(get_i64(bytes, at));
  world.members = get_list(bytes, at);
  world.group_hosts = get_list(bytes, at);
  world.num_physical_experts = static_cast<int>(get_i64(bytes, at));
  FULCRUM_CHECK(at == bytes.size(), "new world message: {} bytes left over", bytes.size() - at);
  return world;
}

std::string why_elastic_ep_cannot_run(const engine::ParallelFlags& flags, const std::string& device) {
  if (device != "cpu") return "--enable-elastic-ep runs on --device cpu rank processes only";
  if (!flags.enable_dp_attention || flags.dp != flags.tp || flags.ep != flags.tp || flags.pp != 1 || flags.tp < 2) {
    return fmt::format(
        "--enable-elastic-ep needs one rank per attention-DP group and per EP rank: --enable-dp-attention with "
        "--dp = --tp = --ep >= 2 and --pp 1 (got --tp {} --dp {} --ep {} --pp {}{})",
        flags.tp, flags.dp, flags.ep, flags.pp, flags.enable_dp_attention ? "" : ", no --enable-dp-attention");
  }
  return "";
}

std::vector<int> rehome_groups(std::vector<int> group_hosts, const std::vector<int>& members) {
  FULCRUM_CHECK(!members.empty(), "rehome_groups: no surviving member");
  const auto alive = [&](int r) { return std::find(members.begin(), members.end(), r) != members.end(); };
  for (size_t g = 0; g < group_hosts.size(); ++g) {
    if (alive(static_cast<int>(g))) group_hosts[g] = static_cast<int>(g);  // home again
  }
  for (int& host : group_hosts) {
    if (alive(host)) continue;
    int best = members.front();
    int64_t best_count = -1;
    for (const int m : members) {
      const int64_t count = std::count(group_hosts.begin(), group_hosts.end(), m);
      if (best_count < 0 || count < best_count) {
        best = m;
        best_count = count;
      }
    }
    host = best;
  }
  return group_hosts;
}

int surviving_physical_experts(int num_experts, int launch_slots_per_rank, int num_ranks) {
  FULCRUM_CHECK(num_ranks >= 1, "no surviving EP rank");
  const int per_rank = std::max(launch_slots_per_rank, (num_experts + num_ranks - 1) / num_ranks);
  return per_rank * num_ranks;
}

engine::ParallelFlags surviving_flags(const engine::ParallelFlags& before, int num_experts, int num_physical_experts,
                                      int num_ranks) {
  engine::ParallelFlags flags = before;
  flags.tp = flags.dp = flags.ep = num_ranks;
  flags.enable_dp_attention = num_ranks > 1;
  flags.num_redundant_experts = num_physical_experts > 0 ? num_physical_experts - num_experts : 0;
  return flags;
}

std::vector<int> experts_without_surviving_replica(const eplb::Placement& placement, const std::vector<bool>& survives) {
  const int num_ranks = placement.topology.num_gpus;
  FULCRUM_CHECK(num_ranks > 0 && static_cast<int>(survives.size()) == num_ranks &&
                    placement.num_physical_experts() % num_ranks == 0,
                "last replicas: a placement of {} slots on {} EP ranks, {} ranks' fates given",
                placement.num_physical_experts(), num_ranks, survives.size());
  const int slots_per_rank = placement.num_physical_experts() / num_ranks;
  std::vector<int> lost(static_cast<size_t>(placement.num_layers), 0);
  for (int l = 0; l < placement.num_layers; ++l) {
    std::vector<bool> kept(static_cast<size_t>(placement.num_logical_experts), false);
    const auto row = placement.layer(l);
    for (size_t s = 0; s < row.size(); ++s) {
      if (survives[s / static_cast<size_t>(slots_per_rank)]) kept[static_cast<size_t>(row[s])] = true;
    }
    lost[static_cast<size_t>(l)] = static_cast<int>(std::count(kept.begin(), kept.end(), false));
  }
  return lost;
}

eplb::Placement replan_placement(const eplb::LoadMatrix& loads, int num_physical_experts, int num_ranks,
                                 const eplb::Placement* current) {
  eplb::LoadMatrix floor = loads;
  for (double& v : floor.values) v += 1.0;
  const auto planner = eplb::make_planner(eplb_runtime::default_planner_name());
  const eplb::Topology topology{num_physical_experts, num_ranks, 1};
  eplb::Placement placement = planner->plan(floor, eplb::PlanOptions{topology, 1, current});
  for (int l = 0; l < placement.num_layers; ++l) {
    const std::vector<int> counts = eplb::replica_counts(placement.layer(l), placement.num_logical_experts);
    const auto none = std::find(counts.begin(), counts.end(), 0);
    FULCRUM_CHECK(none == counts.end(), "re-planned placement: MoE layer {} has no replica of expert {}", l,
                  none - counts.begin());
  }
  return placement;
}

std::vector<int> call_the_roll(comm::PeerMesh& mesh, const std::vector<int>& members, const std::vector<int>& newcomers,
                               std::vector<int>* silent) {
  FULCRUM_CHECK(mesh.rank() == 0 && !members.empty() && members.front() == 0 &&
                    std::is_sorted(members.begin(), members.end()),
                "the roll is called by world rank 0 over ascending mesh ranks");
  mesh.abort_epoch();
  const uint64_t epoch = mesh.epoch();
  const std::chrono::milliseconds timeout = mesh.liveness_timeout();
  const comm::Clock::time_point deadline = comm::Clock::now() + timeout;
  std::vector<int> answered{0};
  for (const int m : members) {
    if (m == 0) continue;
    const bool was_alive = !mesh.peer_failed(m);
    try {
      const std::vector<std::byte> ack = timeout.count() > 0 ? mesh.recv_control(m, deadline) : mesh.recv_control(m);
      uint64_t theirs = 0;
      FULCRUM_CHECK(ack.size() == sizeof(theirs), "rank {}: malformed answer to the roll", m);
      std::memcpy(&theirs, ack.data(), sizeof(theirs));
      const bool newcomer = std::find(newcomers.begin(), newcomers.end(), m) != newcomers.end();
      FULCRUM_CHECK(newcomer || theirs == epoch, "rank {} answered the roll of epoch {} in epoch {}", m, theirs, epoch);
      answered.push_back(m);
    } catch (const std::exception&) {
      // closed, silent past the liveness timeout, no answer by the deadline, or confused: out of the new world
      if (silent != nullptr && was_alive && timeout.count() > 0 && comm::Clock::now() >= deadline) silent->push_back(m);
    }
  }
  return answered;
}

void announce_new_world(comm::PeerMesh& mesh, const NewWorld& world) {
  const std::vector<std::byte> bytes = encode(world);
  for (const int m : world.members) {
    if (m == 0) continue;
    try {
      mesh.send_control(m, bytes);
    } catch (const std::exception&) {
      // it failed after answering: the new world's first wait on it aborts and the roll is called again
    }
  }
}

NewWorld answer_the_roll(comm::PeerMesh& mesh) {
  const bool newcomer = mesh.joined_late() && mesh.epoch() == 0;
  if (!newcomer) mesh.abort_epoch();
  const uint64_t epoch = mesh.epoch();
  try {
    mesh.send_control(0, std::as_bytes(std::span<const uint64_t>(&epoch, 1)));
    NewWorld world = decode_new_world(mesh.recv_control(0));
    FULCRUM_CHECK(world.epoch == epoch + 1 || (newcomer && world.epoch > epoch),
                  "the new world is epoch {}, this rank was in epoch {}", world.epoch, epoch);
    FULCRUM_CHECK(std::find(world.members.begin(), world.members.end(), mesh.rank()) != world.members.end(),
                  "rank {} was left out of the new world", mesh.rank());
    return world;
  } catch (const std::exception& e) {
    throw Error(fmt::format("elastic EP: world rank 0 (the front end) is gone or left this rank out: {}", e.what()));
  }
}

}  // namespace fulcrum::server
