#pragma once
// Starting a rank process from a threaded launcher: everything the child needs (argv, environment) is built
// before fork, because between fork and exec only async-signal-safe calls are safe (no allocation, no
// formatting, no setenv). Used by the CLI's launcher and by the local-rank launcher of tests and benchmarks.
#include <string>
#include <sys/types.h>
#include <utility>
#include <vector>

namespace fulcrum::comm {

struct ExecImage {
  std::vector<std::string> strings;  // the arguments, then the environment entries
  std::vector<char*> argv, envp;     // null-terminated pointers into strings
  // Movable (the strings keep their storage), not copyable (a copy would point into the original).
  ExecImage() = default;
  ExecImage(ExecImage&&) = default;
  ExecImage& operator=(ExecImage&&) = default;
  ExecImage(const ExecImage&) = delete;
  ExecImage& operator=(const ExecImage&) = delete;
};

// `argv`, and this process's environment with each of `overrides` (NAME, VALUE) set, replacing any NAME there.
// NCCL_NVLS_ENABLE=0 is always among them: NVLink multicast stays off in every rank.
ExecImage exec_image(const std::vector<std::string>& argv,
                     const std::vector<std::pair<std::string, std::string>>& overrides);

// In the child after fork: dies with the launcher, redirects stderr to `stderr_fd` (when >= 0) and execs this
// program with the image; exits 127 with a one-line error if the exec fails. Async-signal-safe only.
[[noreturn]] void exec_self(const ExecImage& image, pid_t launcher, int stderr_fd = -1);

}  // namespace fulcrum::comm
