// fulcrum_eplb._core: thin nanobind bindings over the EPLB core (src/eplb). Arrays come in C-contiguous, on the
// CPU, already in the dtype named here (python/fulcrum_eplb/__init__.py converts numpy, torch and DLPack inputs);
// results go out as numpy arrays that own their memory. fulcrum::Error becomes fulcrum_eplb.FulcrumError, a
// ValueError, carrying the core's one-line message.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "eplb/dispatch.hpp"
#include "eplb/metrics.hpp"
#include "eplb/migration_plan.hpp"
#include "eplb/planner.hpp"
#include "eplb/simulate.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace fulcrum::eplb {
namespace {

template <typename T, size_t N>
using CpuArray = nb::ndarray<const T, nb::ndim<N>, nb::c_contig, nb::device::cpu>;
using Weight = CpuArray<double, 2>;  // [num_layers, num_logical_experts]
using Map = CpuArray<int64_t, 2>;    // [num_layers, num_physical_experts]

// A numpy array that owns `values` (moved to the heap, freed with the array).
template <typename T>
nb::ndarray<nb::numpy, T> to_numpy(std::vector<T>&& values, std::initializer_list<size_t> shape) {
  auto* owned = new std::vector<T>(std::move(values));
  nb::capsule owner(owned, [](void* p) noexcept { delete static_cast<std::vector<T>*>(p); });
  return nb::ndarray<nb::numpy, T>(owned->data(), shape, owner);
}

LoadMatrix to_loads(const Weight& weight) {
  LoadMatrix loads(static_cast<int>(weight.shape(0)), static_cast<int>(weight.shape(1)));
  std::copy(weight.data(), weight.data() + weight.size(), loads.values.begin());
  return loads;
}

// A validated placement; ids are range-checked before the narrowing to int32, so a huge id cannot wrap into range.
Placement to_placement(const Map& map, int num_logical_experts, const Topology& topo, const char* what) {
  FULCRUM_CHECK(map.shape(1) == static_cast<size_t>(topo.num_physical_experts),
                "{} has {} slots per layer, expected num_physical_experts = {}", what, map.shape(1),
                topo.num_physical_experts);
  Placement placement(topo, static_cast<int>(map.shape(0)), num_logical_experts);
  const int64_t* v = map.data();
  for (size_t i = 0; i < map.size(); ++i) {
    FULCRUM_CHECK(v[i] >= 0 && v[i] < num_logical_experts, "{}[{}][{}] = {} is not a logical expert in [0, {})", what,
                  i / map.shape(1), i % map.shape(1), v[i], num_logical_experts);
    placement.physical_to_logical_map[i] = static_cast<int32_t>(v[i]);
  }
  placement.validate();
  return placement;
}

nb::ndarray<nb::numpy, int64_t> map_to_numpy(const Placement& placement) {
  std::vector<int64_t> out(placement.physical_to_logical_map.begin(), placement.physical_to_logical_map.end());
  return to_numpy(std::move(out), {static_cast<size_t>(placement.num_layers),
                                   static_cast<size_t>(placement.num_physical_experts())});
}

nb::ndarray<nb::numpy, int64_t> plan(const Weight& weight, int num_physical_experts, int num_groups, int num_nodes,
                                     int num_gpus, const std::string& algorithm, std::optional<Map> current) {
  const LoadMatrix loads = to_loads(weight);
  PlanOptions options;
  options.topology = {num_physical_experts, num_gpus, num_nodes};
  options.topology.validate(loads.num_logical_experts, loads.num_layers);  // before `current` is sized by it
  options.num_groups = num_groups;
  std::optional<Placement> current_placement;
  if (current) {
    FULCRUM_CHECK(current->shape(0) == weight.shape(0), "current has {} layers but weight has {}", current->shape(0),
                  weight.shape(0));
    current_placement = to_placement(*current, loads.num_logical_experts, options.topology, "current");
    options.current = &*current_placement;
  }
  const auto planner = make_planner(algorithm);
  Placement placement;
  {
    nb::gil_scoped_release release;  // a plan can take milliseconds; other Python threads (a server) keep running
    placement = planner->plan(loads, options);
  }
  return map_to_numpy(placement);
}

// DeepSeek's other two outputs: logical_to_physical_map [L, E, max replicas] (-1 padded, replicas in ascending slot
// order) and logical_count [L, E].
nb::tuple logical_maps(const Map& map, int num_logical_experts) {
  const Topology topo{static_cast<int>(map.shape(1)), 1, 1};
  const Placement placement = to_placement(map, num_logical_experts, topo, "physical_to_logical_map");
  const size_t num_layers = placement.num_layers, num_experts = num_logical_experts;
  std::vector<std::vector<std::vector<int>>> slots;
  size_t max_count = 0;
  for (size_t l = 0; l < num_layers; ++l) {
    slots.push_back(replica_slots(placement.layer(static_cast<int>(l)), num_logical_experts));
    for (const auto& s : slots.back()) max_count = std::max(max_count, s.size());
  }
  std::vector<int64_t> log2phy(num_layers * num_experts * max_count, -1), count(num_layers * num_experts);
  for (size_t l = 0; l < num_layers; ++l) {
    for (size_t e = 0; e < num_experts; ++e) {
      const auto& s = slots[l][e];
      count[l * num_experts + e] = static_cast<int64_t>(s.size());
      std::copy(s.begin(), s.end(), log2phy.begin() + static_cast<ptrdiff_t>((l * num_experts + e) * max_count));
    }
  }
  return nb::make_tuple(to_numpy(std::move(log2phy), {num_layers, num_experts, max_count}),
                        to_numpy(std::move(count), {num_layers, num_experts}));
}

nb::dict evaluate(const Weight& weight, const Map& map, int num_gpus, int num_nodes) {
  const LoadMatrix loads = to_loads(weight);
  FULCRUM_CHECK(map.shape(0) == weight.shape(0), "physical_to_logical_map has {} layers but weight has {}",
                map.shape(0), weight.shape(0));
  const Topology topo{static_cast<int>(map.shape(1)), num_gpus, num_nodes};
  const Placement placement = to_placement(map, loads.num_logical_experts, topo, "physical_to_logical_map");
  PlacementReport report = evaluate_placement(placement, loads);
  std::vector<double> gpu(static_cast<size_t>(placement.num_layers) * num_gpus);
  for (int l = 0; l < placement.num_layers; ++l) {
    const auto layer_loads = gpu_loads(loads.layer(l), placement.layer(l), topo);
    std::copy(layer_loads.begin(), layer_loads.end(), gpu.begin() + static_cast<ptrdiff_t>(l) * num_gpus);
  }
  const size_t num_layers = placement.num_layers;
  nb::dict out;
  out["balancedness_per_layer"] = to_numpy(std::move(report.balancedness_per_layer), {num_layers});
  out["lower_bound_per_layer"] = to_numpy(std::move(report.lower_bound_per_layer), {num_layers});
  out["balancedness_mean"] = report.balancedness_mean;
  out["balancedness_min"] = report.balancedness_min;
  out["lower_bound_balancedness_mean"] = report.lower_bound_balancedness_mean;
  out["gpu_loads"] = to_numpy(std::move(gpu), {num_layers, static_cast<size_t>(num_gpus)});
  return out;
}

nb::dict migration(const Map& from, const Map& to, int num_logical_experts, int num_gpus, int num_nodes) {
  FULCRUM_CHECK(from.shape(0) == to.shape(0) && from.shape(1) == to.shape(1),
                "old map is {} x {} but new map is {} x {}", from.shape(0), from.shape(1), to.shape(0), to.shape(1));
  const Topology topo{static_cast<int>(from.shape(1)), num_gpus, num_nodes};
  const MigrationPlan plan = plan_migration(to_placement(from, num_logical_experts, topo, "old map"),
                                            to_placement(to, num_logical_experts, topo, "new map"));
  std::vector<int64_t> layer, dst, src, expert, kind;
  for (const SlotTransfer& t : plan.transfers) {
    layer.push_back(t.layer_idx);
    dst.push_back(t.dst_slot);
    src.push_back(t.src_slot);
    expert.push_back(t.expert_idx);
    kind.push_back(static_cast<int64_t>(t.kind));
  }
  const size_t n = plan.transfers.size();
  nb::dict out;
  out["layer"] = to_numpy(std::move(layer), {n});
  out["dst_slot"] = to_numpy(std::move(dst), {n});
  out["src_slot"] = to_numpy(std::move(src), {n});
  out["expert"] = to_numpy(std::move(expert), {n});
  out["kind"] = to_numpy(std::move(kind), {n});
  out["num_local"] = plan.num_local;
  out["num_intra_node"] = plan.num_intra_node;
  out["num_inter_node"] = plan.num_inter_node;
  out["max_received_per_gpu_layer"] = plan.max_received_per_gpu_layer;
  out["max_sent_per_gpu_layer"] = plan.max_sent_per_gpu_layer;
  return out;
}

// [L, G, E]: the physical slot each source GPU sends an expert's tokens to under static dispatch.
nb::ndarray<nb::numpy, int64_t> static_dispatch(const Map& map, int num_logical_experts, int num_gpus, int num_nodes) {
  const Topology topo{static_cast<int>(map.shape(1)), num_gpus, num_nodes};
  const Placement placement = to_placement(map, num_logical_experts, topo, "physical_to_logical_map");
  std::vector<int64_t> out;
  for (int l = 0; l < placement.num_layers; ++l) {
    const StaticDispatchTable table = build_static_dispatch(placement.layer(l), num_logical_experts, topo);
    out.insert(out.end(), table.slot_of.begin(), table.slot_of.end());
  }
  return to_numpy(std::move(out), {static_cast<size_t>(placement.num_layers), static_cast<size_t>(num_gpus),
                                   static_cast<size_t>(num_logical_experts)});
}

nb::dict simulate_trace(const CpuArray<double, 3>& windows, int num_physical_experts, int num_gpus, int num_nodes,
                        int num_groups, int rebalance_every, const std::string& algorithm, const std::string& dispatch,
                        int64_t batch_tokens, int batches_per_window, int top_k, uint64_t seed) {
  const size_t num_windows = windows.shape(0), num_layers = windows.shape(1), num_experts = windows.shape(2);
  std::vector<LoadMatrix> trace;
  for (size_t t = 0; t < num_windows; ++t) {
    LoadMatrix w(static_cast<int>(num_layers), static_cast<int>(num_experts));
    const double* begin = windows.data() + t * num_layers * num_experts;
    std::copy(begin, begin + num_layers * num_experts, w.values.begin());
    trace.push_back(std::move(w));
  }
  SimulateOptions options;
  options.topology = {num_physical_experts, num_gpus, num_nodes};
  options.num_groups = num_groups;
  options.rebalance_every = rebalance_every;
  options.algorithm = algorithm;
  options.dispatch = parse_dispatch_algorithm(dispatch);
  options.batch_tokens = batch_tokens;
  options.batches_per_window = batches_per_window;
  options.top_k = top_k;
  options.seed = seed;
  SimulateResult result;
  {
    nb::gil_scoped_release release;
    result = simulate(trace, options);
  }
  nb::dict out;
  out["balancedness_per_window"] = to_numpy(std::move(result.balancedness_per_window), {num_windows});
  out["balancedness_mean"] = result.balancedness_mean;
  out["balancedness_min"] = result.balancedness_min;
  const size_t num_rebalances = result.rebalance_windows.size();
  std::vector<int64_t> rebalance_windows(result.rebalance_windows.begin(), result.rebalance_windows.end());
  out["rebalance_windows"] = to_numpy(std::move(rebalance_windows), {num_rebalances});
  out["experts_moved"] = to_numpy(std::move(result.experts_moved), {num_rebalances});
  return out;
}

}  // namespace
}  // namespace fulcrum::eplb

NB_MODULE(_core, m) {
  using namespace fulcrum::eplb;
  m.doc() = "Fulcrum EPLB core (C++); use the fulcrum_eplb package, which converts inputs and documents the API.";
  nb::exception<fulcrum::Error>(m, "FulcrumError", PyExc_ValueError);
  m.def("planner_names", &planner_names);
  m.def("plan", &plan, "weight"_a, "num_physical_experts"_a, "num_groups"_a, "num_nodes"_a, "num_gpus"_a,
        "algorithm"_a, "current"_a.none());
  m.def("logical_maps", &logical_maps, "physical_to_logical_map"_a, "num_logical_experts"_a);
  m.def("evaluate", &evaluate, "weight"_a, "physical_to_logical_map"_a, "num_gpus"_a, "num_nodes"_a);
  m.def("plan_migration", &migration, "old_map"_a, "new_map"_a, "num_logical_experts"_a, "num_gpus"_a, "num_nodes"_a);
  m.def("static_dispatch", &static_dispatch, "physical_to_logical_map"_a, "num_logical_experts"_a, "num_gpus"_a,
        "num_nodes"_a);
  m.def("simulate", &simulate_trace, "windows"_a, "num_physical_experts"_a, "num_gpus"_a, "num_nodes"_a,
        "num_groups"_a, "rebalance_every"_a, "algorithm"_a, "dispatch"_a, "batch_tokens"_a, "batches_per_window"_a,
        "top_k"_a, "seed"_a);
}
