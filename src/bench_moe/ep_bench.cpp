// `fulcrum bench moe --gpus W`: one process per GPU, real expert parallelism over NCCL (backend::EpMoeLayer:
// route, permute, all_to_all of bf16 rows, expert GEMMs on the owning GPU, all_to_all back, combine).
// Every rank holds T tokens per forward (--tokens is per rank) and P / W slots. Per model and T it measures
// the step (host clock from a barrier to the end of the forward on every rank; the figure is the slowest
// rank's median) for the routing scenarios of the one-GPU run: uniform, real loads without EPLB, real loads
// with the fulcrum planner's placement of E + --redundant slots over the W GPUs (static, dynamic and balanced
// replica choice); recorder on and off interleaved. Then live migration (migration_bench.cpp).
#include <chrono>
#include <numeric>

#include <fmt/format.h>

#include "bench_moe/bench_util.hpp"
#include "bench_moe/ep_bench.hpp"
#include "comm/nccl_communicator.hpp"
#include "gpu/moe/ep_moe_layer.hpp"
#include "comm/peer_mesh.hpp"
#include "engine/multi_process_run.hpp"
#include "eplb/dispatch.hpp"
#include "eplb/error.hpp"

namespace fulcrum::bench_moe {

using backend::DeviceBuffer;
using nlohmann::json;

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double slowest_rank(comm::Communicator& ep, double value) {
  std::vector<double> all(static_cast<size_t>(ep.size()));
  ep.all_gather(std::as_bytes(std::span<const double>(&value, 1)), std::as_writable_bytes(std::span<double>(all)));
  return *std::max_element(all.begin(), all.end());
}

model::moe::ReplicaChoiceSpec ep_replica_choice(eplb::DispatchAlgorithm algorithm, const std::vector<int32_t>& map,
                                                int world) {
  const eplb::Topology topo{static_cast<int>(map.size()), world, 1};
  return model::moe::make_replica_choice(algorithm, map, kExperts, topo, /*tokens_per_source=*/1,
                                         dispatch_streams(algorithm, world));
}

EpRoutingInput::EpRoutingInput(const std::vector<double>& loads, int64_t tokens, int rank, uint64_t seed) {
  logits = upload(logits_for(loads, tokens, kTopK, seed + 7919 * static_cast<uint64_t>(rank)));
}

double ep_step_ms(comm::NcclCommunicator& ep, backend::EpMoeLayer& layer, const uint16_t* x, const float* logits,
                  int64_t tokens, float* out) {
  ep.barrier();
  const double start = now_ms();
  layer.forward_from_logits(x, logits, tokens, out);
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(layer.stream()));
  return now_ms() - start;
}

namespace {

using EpScenario = Scenario<backend::EpMoeLayer>;

json run_ep_scenario(const EpScenario& sc, int64_t tokens, const MoeBenchOptions& opt, comm::NcclCommunicator& ep,
                     const DeviceBuffer& x, DeviceBuffer& out, unsigned long long* histogram) {
  backend::EpMoeLayer& layer = *sc.layer;
  const int world = ep.size();
  layer.set_replica_choice(ep_replica_choice(sc.dispatch, sc.map, world));
  const EpRoutingInput input(*sc.loads, tokens, ep.rank(), 77 + static_cast<uint64_t>(tokens));
  std::vector<double> on, off;
  for (int r = 0; r < opt.warmup + opt.reps; ++r) {
    for (const bool record : {true, false}) {
      layer.layer().set_recorder(record ? histogram : nullptr);
      const double ms = ep_step_ms(ep, layer, x.as<uint16_t>(), input.logits.as<float>(), tokens, out.as<float>());
      if (r >= opt.warmup) (record ? on : off).push_back(ms);
    }
  }
  layer.layer().set_recorder(histogram);
  const backend::EpForwardStats rows = layer.last_stats();
  // Stage split (timing on adds a synchronization after each stage, so it is a separate set of runs).
  layer.set_timing(true);
  std::vector<double> route, dispatch, experts, back, combine;
  for (int r = 0; r < opt.reps; ++r) {
    ep_step_ms(ep, layer, x.as<uint16_t>(), input.logits.as<float>(), tokens, out.as<float>());
    const backend::EpForwardStats& s = layer.last_stats();
    route.push_back(s.route_permute_ms);
    dispatch.push_back(s.dispatch_ms);
    experts.push_back(s.experts_ms);
    back.push_back(s.combine_exchange_ms);
    combine.push_back(s.combine_ms);
  }
  layer.set_timing(false);
  const double step_on = slowest_rank(ep, median(on)), step_off = slowest_rank(ep, median(off));
  const double experts_max = slowest_rank(ep, median(experts));
  const double received_max = slowest_rank(ep, static_cast<double>(rows.rows_received + rows.rows_local));
  return {{"scenario", sc.name}, {"num_slots", sc.map.size()}, {"dispatch", std::string(eplb::to_string(sc.dispatch))},
          {"tokens_per_rank", tokens}, {"step_ms_recorder_on", step_on}, {"step_ms_recorder_off", step_off},
          {"tokens_per_s", world * tokens / (step_on * 1e-3)},
          {"recorder_overhead_fraction", (step_on - step_off) / step_off},
          {"rank0_stage_ms", {{"route_permute", median(route)}, {"dispatch", median(dispatch)}, {"experts", median(experts)},
                              {"combine_exchange", median(back)}, {"combine", median(combine)}}},
          {"max_rank_experts_ms", experts_max},
          {"rank0_rows", {{"sent", rows.rows_sent}, {"received", rows.rows_received}, {"local", rows.rows_local}}},
          {"max_rank_rows_in", received_max}};
}

}  // namespace

void run_ep_rank(const MoeBenchOptions& opt, comm::NcclCommunicator& ep, comm::NcclCommunicator& migration) {
  const int world = ep.size(), rank = ep.rank();
  const bool printer = rank == 0;
  const LoadRouting routing = load_routing(opt, world);
  const json machine = machine_json(0);
  if (printer) {
    fmt::print("{} x {}: EP {} over NCCL\n", world, machine["gpu"].get<std::string>(), world);
    fmt::print("{}\n", routing.describe(opt, world));
  }
  json results = json::array(), migrations = json::array();
  const int64_t max_tokens = *std::max_element(opt.tokens.begin(), opt.tokens.end());
  for (const std::string& model_name : opt.models) {
    const ModelShape m = model_shape(model_name);
    backend::MoeLayerShape shape{m.hidden, m.intermediate, kExperts, kTopK, true, kExperts, max_tokens};
    backend::EpMoeLayer plain(shape, ep, 0);
    shape.num_slots = routing.eplb_slots;
    backend::EpMoeLayer balanced(shape, ep, 0);
    plain.layer().randomize_weights(5);
    balanced.layer().randomize_weights(5);
    LayerInputs in(max_tokens, m.hidden, 9 + static_cast<uint64_t>(rank), plain.stream());
    const auto scenarios = routing_scenarios(plain, balanced, routing.trivial, routing.eplb_map, routing.uniform, routing.real);
    for (const int64_t tokens : opt.tokens) {
      double uniform_ms = 0;
      for (const EpScenario& sc : scenarios) {
        json r = run_ep_scenario(sc, tokens, opt, ep, in.x, in.out, in.histogram.as<unsigned long long>());
        r["model"] = m.name;
        const double step = r["step_ms_recorder_on"].get<double>();
        if (sc.name == "uniform") uniform_ms = step;
        r["throughput_vs_uniform"] = uniform_ms / step;
        if (printer) {
          const json& st = r["rank0_stage_ms"];
          fmt::print("{:16} T/rank={:6} {:19} P={:3} step {:8.3f} ms ({:10.0f} tok/s, {:.3f} of uniform) rec-off {:8.3f} ms "
                     "({:+.2f}%) | rank 0 route {:.3f} dispatch {:.3f} experts {:.3f} back {:.3f} combine {:.3f} ms | "
                     "max rank experts {:.3f} ms, rows in {:.0f}\n",
                     m.name, tokens, sc.name, sc.map.size(), step, r["tokens_per_s"].get<double>(),
                     r["throughput_vs_uniform"].get<double>(), r["step_ms_recorder_off"].get<double>(),
                     100 * r["recorder_overhead_fraction"].get<double>(), st["route_permute"].get<double>(),
                     st["dispatch"].get<double>(), st["experts"].get<double>(), st["combine_exchange"].get<double>(),
                     st["combine"].get<double>(), r["max_rank_experts_ms"].get<double>(), r["max_rank_rows_in"].get<double>());
        }
        results.push_back(r);
      }
    }
    migrations.push_back(run_migration_bench(opt, ep, migration, m, routing));
  }
  if (printer) {
    write_json(opt, {{"mode", "expert_parallel"}, {"gpus", world}, {"machine", machine}, {"loads_layer", routing.layer_idx},
                     {"eplb_slots", routing.eplb_slots}, {"results", results}, {"migration", migrations}});
  }
}

void run_as_rank(const MoeBenchOptions& opt, const engine::LaunchedRank& me) {
  try {
    FULCRUM_CUDA_CHECK(cudaSetDevice(0));  // the launcher gives each rank process its one GPU
    std::shared_ptr<comm::PeerMesh> mesh = comm::PeerMesh::connect(me.dist_init());
    const std::unique_ptr<comm::NcclCommunicator> ep = comm::NcclCommunicator::create_world(mesh);
    const std::unique_ptr<comm::NcclCommunicator> migration = ep->duplicate(opt.migration_max_ctas);  // its own NCCL communicator, stream
    run_ep_rank(opt, *ep, *migration);
  } catch (const std::exception& e) {
    throw Error(fmt::format("rank {}: {}", me.world_rank, e.what()));
  }
}

}  // namespace fulcrum::bench_moe
