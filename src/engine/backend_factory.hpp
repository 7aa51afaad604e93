#pragma once
// The model backend for a --device name: "cpu" (always) or "cuda" (builds with FULCRUM_ENABLE_CUDA and a
// CUDA device at run time). Throws fulcrum::Error with a one-line reason otherwise.
#include <memory>
#include <string>

#include "model/backend.hpp"

namespace fulcrum::engine {

std::unique_ptr<model::Backend> make_backend(const std::string& device);

}  // namespace fulcrum::engine
