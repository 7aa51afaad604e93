#pragma once
#include <string>

namespace fulcrum {

// Writes `contents` to `path` through a temporary file in the same folder and a rename, so a reader
// never sees a half-written file and a failed write leaves no output. Throws fulcrum::Error.
void write_file_atomically(const std::string& path, const std::string& contents);

}  // namespace fulcrum
