#include "model/backend.hpp"

#include "eplb/error.hpp"

namespace fulcrum::model {

void check_write_kv(const Tensor& cache, const Tensor& src, int64_t start_pos) {
  FULCRUM_CHECK(start_pos >= 0 && start_pos + src.dim(0) <= cache.dim(0),
                "kv cache of capacity {} cannot take positions [{}, {})", cache.dim(0), start_pos,
                start_pos + src.dim(0));
  FULCRUM_CHECK(src.row_numel() == cache.row_numel(), "kv cache rows hold {} values, source rows {}",
                cache.row_numel(), src.row_numel());
}

}  // namespace fulcrum::model
