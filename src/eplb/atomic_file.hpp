#pragma once
#include <string>

namespace fulcrum {

// Writes `contents` to `path` through a temporary file in the same folder and a rename, so a reader
// never sees a half-written file and a failed write leaves no output. Throws fulcrum::Error.
void write_file_atomically(const std::string& path, const std::string& contents);

// For a process about to end without unwinding (std::_Exit on a signal): removes the temporary files of the
// atomic writes in progress and makes later writes fail, so no temporary file is left behind.
void abandon_atomic_writes();

}  // namespace fulcrum
