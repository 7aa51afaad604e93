#pragma once
// A dense, row-major fp32 tensor owned by a backend (host memory for the CPU backend, device memory
// for a GPU one). Copies share storage; views (rows, index, reshape) alias their parent's memory.
#include <cstdint>
#include <memory>
#include <vector>

#include "eplb/error.hpp"

namespace fulcrum::model {

enum class Device { kCpu, kCuda };

class Tensor {
 public:
  Tensor() = default;
  // `data` points into the allocation kept alive by `storage`.
  Tensor(std::shared_ptr<void> storage, float* data, std::vector<int64_t> shape, Device device)
      : storage_(std::move(storage)), data_(data), shape_(std::move(shape)), device_(device) {}

  bool defined() const { return data_ != nullptr || numel() == 0; }
  float* data() const { return data_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int rank() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int axis) const {
    FULCRUM_CHECK(axis >= 0 && axis < rank(), "tensor axis {} out of range for rank {}", axis, rank());
    return shape_[static_cast<size_t>(axis)];
  }
  int64_t numel() const {
    int64_t n = 1;
    for (const int64_t d : shape_) n *= d;
    return n;
  }
  // Elements of one dim-0 entry (the product of the other dims, also when there are no rows).
  int64_t row_numel() const {
    int64_t n = 1;
    for (size_t axis = 1; axis < shape_.size(); ++axis) n *= shape_[axis];
    return n;
  }

  // Entries [begin, begin + count) along dim 0: same rank.
  Tensor rows(int64_t begin, int64_t count) const {
    FULCRUM_CHECK(rank() >= 1 && begin >= 0 && count >= 0 && begin + count <= dim(0),
                  "rows [{}, {}) out of range of a tensor with {} rows", begin, begin + count, rank() ? dim(0) : 0);
    std::vector<int64_t> shape = shape_;
    shape[0] = count;
    return Tensor(storage_, data_ + begin * row_numel(), std::move(shape), device_);
  }
  // Entry `index` along dim 0: rank - 1.
  Tensor index(int64_t index) const {
    FULCRUM_CHECK(rank() >= 1 && index >= 0 && index < dim(0), "index {} out of range of a tensor with {} rows", index,
                  rank() ? dim(0) : 0);
    return Tensor(storage_, data_ + index * row_numel(), std::vector<int64_t>(shape_.begin() + 1, shape_.end()),
                  device_);
  }
  // Same elements, another shape of the same size.
  Tensor reshape(std::vector<int64_t> shape) const {
    int64_t n = 1;
    for (const int64_t d : shape) n *= d;
    FULCRUM_CHECK(n == numel(), "cannot reshape {} elements into {}", numel(), n);
    return Tensor(storage_, data_, std::move(shape), device_);
  }

 private:
  std::shared_ptr<void> storage_;
  float* data_ = nullptr;
  std::vector<int64_t> shape_;
  Device device_ = Device::kCpu;
};

}  // namespace fulcrum::model
