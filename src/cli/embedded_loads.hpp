#pragma once

namespace fulcrum::cli {

// The real Qwen3-30B-A3B load matrix compiled into the binary (data/loads, see its README).
const char* embedded_loads_name();
const char* embedded_loads_csv();

}  // namespace fulcrum::cli
