// Atomic file writes: what a process that ends on a signal (std::_Exit, no unwinding) leaves behind.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <thread>

#include "eplb/atomic_file.hpp"
#include "eplb/error.hpp"
#include "model_test_util.hpp"

namespace fulcrum {
namespace {

int temporary_files_in(const std::filesystem::path& dir) {
  int n = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    n += entry.path().filename().string().find(".tmp.") != std::string::npos ? 1 : 0;
  }
  return n;
}

// In a child process (abandoning is for good): a write in progress on another thread loses its temporary file,
// and a later write fails with one line and creates nothing.
TEST(AtomicFile, AbandonRemovesTemporaryFilesAndRefusesLaterWrites) {
  test::TempDir dir("atomic_abandon");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    int failures = 0;
    std::thread writer([&] {
      try {
        write_file_atomically(dir.file("big.bin"), std::string(size_t{256} << 20, 'x'));
      } catch (const Error&) {
        // its temporary file went away under it: the rename fails
      }
    });
    for (int i = 0; i < 5000 && temporary_files_in(dir.path()) == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (temporary_files_in(dir.path()) == 0) ::_exit(16);  // the write never showed its temporary file
    abandon_atomic_writes();  // while the 256 MiB are being written (about 0.1 s)
    writer.join();
    failures += temporary_files_in(dir.path()) == 0 ? 0 : 1;
    failures += std::filesystem::exists(dir.file("big.bin")) ? 32 : 0;  // its rename must have failed
    try {
      write_file_atomically(dir.file("later.txt"), "x");
      failures += 2;
    } catch (const Error& e) {
      failures += std::string(e.what()) == dir.file("later.txt") + ": not written: the process is stopping" ? 0 : 4;
    }
    failures += std::filesystem::exists(dir.file("later.txt")) ? 8 : 0;
    ::_exit(failures);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "1: a temporary file remains, 2: a later write succeeded, 4: wrong message, "
                                       "8: the later file exists, 16: no write seen in progress, 32: the abandoned write completed";
}

}  // namespace
}  // namespace fulcrum
