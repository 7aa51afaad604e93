// Load files (`plan --loads`, `simulate`): the CSV reader and the JSON reader (one window or a window list), and
// the sum of windows, on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <string>

#include "eplb/loads.hpp"
#include "fuzz_util.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  const std::string text(reinterpret_cast<const char*>(data), size);
  fuzz::parses([&] { eplb::parse_loads_csv(text, "loads.csv"); });
  fuzz::parses([&] { eplb::parse_loads_json(text, "loads.json"); });
  return 0;
}
