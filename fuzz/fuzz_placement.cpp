// Placement files (`--init-expert-location`, `plan` output): parsed and validated from arbitrary bytes (validate() runs too), and a
// placement that parses is written back and must parse to the same map.
#include <cstddef>
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

#include "eplb/placement_io.hpp"
#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  const std::string text(reinterpret_cast<const char*>(data), size);
  eplb::Placement placement;
  if (!fuzz::parses([&] { placement = eplb::parse_placement_json(text, "placement.json"); })) return 0;
  if (!fuzz::parses([&] { placement.validate(); })) fuzz::fail("a parsed placement does not validate", text);
  const std::string written = eplb::placement_to_json(placement, nullptr).dump();
  eplb::Placement reread;
  if (!fuzz::parses([&] { reread = eplb::parse_placement_json(written, "rewritten placement"); })) {
    fuzz::fail("a parsed placement, written back, does not parse", written);
  }
  if (reread.physical_to_logical_map != placement.physical_to_logical_map) {
    fuzz::fail("a parsed placement, written back, parses to another map", written);
  }
  return 0;
}
