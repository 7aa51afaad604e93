#include "eplb/placement_io.hpp"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "eplb/atomic_file.hpp"
#include "eplb/json_text.hpp"

namespace fulcrum::eplb {

nlohmann::json placement_to_json(const Placement& placement, const LoadMatrix* loads) {
  nlohmann::json doc;
  doc["num_gpus"] = placement.topology.num_gpus;
  doc["num_nodes"] = placement.topology.num_nodes;
  doc["num_physical_experts"] = placement.num_physical_experts();
  doc["num_logical_experts"] = placement.num_logical_experts;
  auto& map = doc["physical_to_logical_map"] = nlohmann::json::array();
  for (int l = 0; l < placement.num_layers; ++l) {
    auto layer = placement.layer(l);
    map.push_back(std::vector<int32_t>(layer.begin(), layer.end()));
  }
  if (loads != nullptr) {
    auto& counts = doc["logical_count"] = nlohmann::json::array();
    for (int l = 0; l < loads->num_layers; ++l) {
      auto layer = loads->layer(l);
      counts.push_back(std::vector<double>(layer.begin(), layer.end()));
    }
  }
  return doc;
}

namespace {

int int_field(const nlohmann::json& doc, const char* key, int fallback, const std::string& origin) {
  if (!doc.contains(key)) return fallback;
  FULCRUM_CHECK(doc[key].is_number_integer(), "{}: \"{}\" must be an integer, got {}", origin, key, json_excerpt(doc[key]));
  const int64_t value = doc[key].get<int64_t>();
  FULCRUM_CHECK(value >= 1 && value <= (int64_t{1} << 24), "{}: \"{}\" = {} is out of range", origin, key, value);
  return static_cast<int>(value);
}

}  // namespace

Placement parse_placement_json(const std::string& text, const std::string& origin) {
  const nlohmann::json doc = parse_json_text(text, origin);
  FULCRUM_CHECK(doc.is_object() && doc.contains("physical_to_logical_map"),
                "{}: expected an object with \"physical_to_logical_map\"", origin);
  const auto& map = doc["physical_to_logical_map"];
  FULCRUM_CHECK(map.is_array() && !map.empty() && map[0].is_array() && !map[0].empty(),
                "{}: physical_to_logical_map must be a non-empty [layers][slots] array", origin);
  Topology topo;
  topo.num_physical_experts = static_cast<int>(map[0].size());
  // The header fields are claims about the map: one that disagrees is an error, not a value to believe.
  const int claimed_physical = int_field(doc, "num_physical_experts", topo.num_physical_experts, origin);
  FULCRUM_CHECK(claimed_physical == topo.num_physical_experts,
                "{}: \"num_physical_experts\" = {} but physical_to_logical_map has {} slots per layer", origin,
                claimed_physical, topo.num_physical_experts);
  topo.num_gpus = int_field(doc, "num_gpus", 1, origin);
  topo.num_nodes = int_field(doc, "num_nodes", 1, origin);
  int max_id = -1;
  std::vector<int32_t> flat;
  for (size_t l = 0; l < map.size(); ++l) {
    FULCRUM_CHECK(map[l].is_array() && map[l].size() == map[0].size(),
                  "{}: physical_to_logical_map[{}] has {} slots, expected {}", origin, l,
                  map[l].is_array() ? map[l].size() : 0, map[0].size());
    for (size_t s = 0; s < map[l].size(); ++s) {
      FULCRUM_CHECK(map[l][s].is_number_integer(), "{}: physical_to_logical_map[{}][{}] is not an integer: {}",
                    origin, l, s, json_excerpt(map[l][s]));
      const int64_t id = map[l][s].get<int64_t>();
      FULCRUM_CHECK(id >= 0 && id < (int64_t{1} << 24), "{}: physical_to_logical_map[{}][{}]: logical expert {} out of range",
                    origin, l, s, id);
      flat.push_back(static_cast<int32_t>(id));
      max_id = std::max(max_id, flat.back());
    }
  }
  // The expert count: "num_logical_experts", else logical_count's width, else the largest id + 1. When both are
  // given they must agree; ids beyond the count, or experts with no slot, are validate()'s to name.
  int num_logical = max_id + 1;
  const bool has_counts = doc.contains("logical_count") && doc["logical_count"].is_array() &&
                          !doc["logical_count"].empty() && doc["logical_count"][0].is_array();
  if (has_counts) num_logical = static_cast<int>(doc["logical_count"][0].size());
  const int claimed_logical = int_field(doc, "num_logical_experts", num_logical, origin);
  FULCRUM_CHECK(!has_counts || claimed_logical == num_logical,
                "{}: \"num_logical_experts\" = {} but logical_count has {} experts per layer", origin, claimed_logical,
                num_logical);
  num_logical = claimed_logical;
  Placement placement(topo, static_cast<int>(map.size()), num_logical);
  FULCRUM_CHECK(static_cast<int>(map[0].size()) == placement.num_physical_experts(), "{}: inconsistent slot count",
                origin);
  placement.physical_to_logical_map = std::move(flat);
  try {
    placement.validate();
  } catch (const Error& e) {
    throw Error(fmt::format("{}: {}", origin, e.what()));
  }
  return placement;
}

Placement read_placement_file(const std::string& path) { return parse_placement_json(read_text_file(path), path); }

void write_placement_file(const std::string& path, const Placement& placement, const LoadMatrix* loads) {
  write_file_atomically(path, placement_to_json(placement, loads).dump() + "\n");
}

}  // namespace fulcrum::eplb
