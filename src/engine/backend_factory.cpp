#include "engine/backend_factory.hpp"

#include "backend/cpu/cpu_backend.hpp"
#include "eplb/error.hpp"
#ifdef FULCRUM_WITH_CUDA
#include "backend/cuda/cuda_backend.hpp"
#endif

namespace fulcrum::engine {

std::unique_ptr<model::Backend> make_backend(const std::string& device) {
  if (device == "cpu") return std::make_unique<backend::CpuBackend>();
  if (device == "cuda") {
#ifdef FULCRUM_WITH_CUDA
    FULCRUM_CHECK(backend::CudaBackend::device_count() > 0,
                  "--device cuda: no CUDA device (none visible to this process)");
    return std::make_unique<backend::CudaBackend>();
#else
    throw Error("--device cuda: this build has no CUDA support (configure with -DFULCRUM_ENABLE_CUDA=ON)");
#endif
  }
  throw Error("unknown device '" + device + "' (available: cpu, cuda)");
}

}  // namespace fulcrum::engine
