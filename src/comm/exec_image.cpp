#include "comm/exec_image.hpp"

#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstring>
#include <string_view>

extern char** environ;

namespace fulcrum::comm {

ExecImage exec_image(const std::vector<std::string>& argv,
                     const std::vector<std::pair<std::string, std::string>>& overrides) {
  std::vector<std::pair<std::string, std::string>> set = overrides;
  set.emplace_back("NCCL_NVLS_ENABLE", "0");
  ExecImage image;
  image.strings = argv;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    bool replaced = false;
    for (const auto& [name, value] : set) replaced = replaced || (entry.starts_with(name) && entry.size() > name.size() &&
                                                                  entry[name.size()] == '=');
    if (!replaced) image.strings.emplace_back(entry);
  }
  for (const auto& [name, value] : set) image.strings.push_back(name + "=" + value);
  for (size_t i = 0; i < image.strings.size(); ++i) {
    (i < argv.size() ? image.argv : image.envp).push_back(image.strings[i].data());
  }
  image.argv.push_back(nullptr);
  image.envp.push_back(nullptr);
  return image;
}

void exec_self(const ExecImage& image, pid_t launcher, int stderr_fd) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);  // the launcher dies: so does this rank
  if (::getppid() != launcher) ::_exit(1);
  if (stderr_fd >= 0) ::dup2(stderr_fd, STDERR_FILENO);
  ::execve("/proc/self/exe", image.argv.data(), image.envp.data());
  static constexpr char kFailed[] = "fulcrum: error: cannot start a rank process: exec of /proc/self/exe failed\n";
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, kFailed, sizeof(kFailed) - 1);
  ::_exit(127);
}

}  // namespace fulcrum::comm
