#include "gpu/graph_cache.hpp"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.hpp"

namespace fulcrum::gpu {

GraphCache::~GraphCache() { clear(); }

void GraphCache::clear() {
  for (auto& [key, exec] : graphs_) {
    if (exec != nullptr) cudaGraphExecDestroy(exec);
  }
  graphs_.clear();
}

bool GraphCache::capture(const GraphKey& key, CUstream_st* stream, const std::function<void()>& launches) {
  FULCRUM_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  bool launched = true;
  try {
    launches();
  } catch (...) {
    launched = false;  // a launch refused capture: end it below and fall back to eager steps
  }
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(stream, &graph);
  cudaGraphExec_t exec = nullptr;
  if (launched && end == cudaSuccess && graph != nullptr) {
    if (cudaGraphInstantiate(&exec, graph, 0) != cudaSuccess) exec = nullptr;
  }
  if (graph != nullptr) cudaGraphDestroy(graph);
  cudaGetLastError();  // a failed capture leaves its error behind; the eager path must not see it
  graphs_[key] = exec;
  return exec != nullptr;
}

bool GraphCache::replay(const GraphKey& key, CUstream_st* stream) {
  const auto it = graphs_.find(key);
  if (it == graphs_.end() || it->second == nullptr) return false;
  FULCRUM_CUDA_CHECK(cudaGraphLaunch(it->second, stream));
  return true;
}

}  // namespace fulcrum::gpu
