// Safetensors files (every checkpoint load): arbitrary bytes as a whole file (u64 header length, JSON header,
// data), opened through the real reader (the file lives in a memfd: SafetensorsFile maps a path), then every
// tensor the header validated is read, so an offset the header check let through would read out of bounds.
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.hpp"
#include "model/safetensors.hpp"

namespace {

// Reads of tensors above this many values are skipped: they are valid, and only slow the fuzzer down.
constexpr int64_t kMaxReadValues = int64_t{1} << 16;

int memfd() {
  static const int fd = ::memfd_create("fuzz.safetensors", MFD_CLOEXEC);
  if (fd < 0) fulcrum::fuzz::fail("memfd_create failed", "");
  return fd;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fulcrum;
  const int fd = memfd();
  if (::ftruncate(fd, 0) != 0 || (size > 0 && ::pwrite(fd, data, size, 0) != static_cast<ssize_t>(size))) {
    fuzz::fail("cannot write the memfd", "");
  }
  const std::string path = "/proc/self/fd/" + std::to_string(fd);
  fuzz::parses([&] {
    model::SafetensorsFile file(path);
    for (const std::string& name : file.names()) {
      const model::TensorInfo& info = file.info(name);
      if (info.numel() > kMaxReadValues) continue;
      if (info.dtype == model::Dtype::kI64 || info.dtype == model::Dtype::kI32) {
        file.read_i64(name);
        continue;
      }
      const model::HostTensor tensor = file.read_f32(name);
      if (info.shape.size() == 2 && info.shape[0] > 0 && info.shape[1] > 0) {
        // The last row's last column: the block reader's own offset arithmetic.
        std::vector<float> one(1);
        file.read_f32_block_into(name, info.shape[0] - 1, 1, info.shape[1] - 1, 1, one);
        if (!(one[0] == tensor.data.back() || (one[0] != one[0] && tensor.data.back() != tensor.data.back()))) {
          fuzz::fail("a block read disagrees with the whole-tensor read", name);
        }
      }
    }
  });
  return 0;
}
