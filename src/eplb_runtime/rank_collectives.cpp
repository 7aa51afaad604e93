#include "eplb_runtime/rank_collectives.hpp"

#include "eplb/error.hpp"

namespace fulcrum::eplb_runtime {

std::vector<int64_t> all_gather_int64(comm::Communicator& comm, std::span<const int64_t> values) {
  const int64_t my_length = static_cast<int64_t>(values.size());
  std::vector<int64_t> lengths(static_cast<size_t>(comm.size()));
  comm.all_gather(comm::bytes_of(std::span<const int64_t>(&my_length, 1)), comm::writable_bytes_of(std::span(lengths)));
  for (int r = 0; r < comm.size(); ++r) {
    FULCRUM_CHECK(lengths[r] == my_length, "all_gather_int64: rank {} contributes {} values, rank {} has {}", r,
                  lengths[r], comm.rank(), my_length);
  }
  std::vector<int64_t> gathered(values.size() * static_cast<size_t>(comm.size()));
  comm.all_gather(comm::bytes_of(values), comm::writable_bytes_of(std::span(gathered)));
  return gathered;
}

std::vector<int64_t> all_reduce_sum_int64(comm::Communicator& comm, std::span<const int64_t> values) {
  const std::vector<int64_t> gathered = all_gather_int64(comm, values);
  std::vector<int64_t> sum(values.size(), 0);
  for (int r = 0; r < comm.size(); ++r) {
    const int64_t* block = gathered.data() + static_cast<size_t>(r) * values.size();
    for (size_t i = 0; i < values.size(); ++i) sum[i] += block[i];
  }
  return sum;
}

std::vector<int32_t> all_gather_v_int32(comm::Communicator& comm, std::span<const int32_t> values,
                                        std::vector<int64_t>* counts_out) {
  const int64_t my_length = static_cast<int64_t>(values.size());
  std::vector<int64_t> lengths(static_cast<size_t>(comm.size()));
  comm.all_gather(comm::bytes_of(std::span<const int64_t>(&my_length, 1)), comm::writable_bytes_of(std::span(lengths)));
  int64_t total = 0;
  std::vector<int64_t> byte_counts(lengths.size());
  for (size_t r = 0; r < lengths.size(); ++r) {
    total += lengths[r];
    byte_counts[r] = lengths[r] * static_cast<int64_t>(sizeof(int32_t));
  }
  std::vector<int32_t> gathered(static_cast<size_t>(total));
  comm.all_gather_v(comm::bytes_of(values), comm::writable_bytes_of(std::span(gathered)), byte_counts);
  if (counts_out != nullptr) *counts_out = lengths;
  return gathered;
}

}  // namespace fulcrum::eplb_runtime
