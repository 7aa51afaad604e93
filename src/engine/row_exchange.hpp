#pragma once
// Moves rows of backend tensors ([rows, hidden] floats: the token rows and partial outputs of the MoE
// exchange) between the ranks of a group. Two paths behind one interface:
//   host    download, a comm::Communicator collective on host spans, upload (any backend, any communicator);
//   device  NCCL on the tensors' device memory (CUDA backend and an NcclCommunicator group: see
//           comm/nccl_row_exchange.hpp), chosen by make_row_exchange.
// Both give bitwise the same rows: they move bytes, and reduce_scatter_sum reduces through the same
// communicator either way. This header includes no CUDA or NCCL header.
#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "comm/communicator.hpp"
#include "model/backend.hpp"

namespace fulcrum::engine {

class RowExchange {
 public:
  virtual ~RowExchange() = default;
  virtual std::string_view path() const = 0;  // "host" | "device"
  // Collectives over the group; tensors are [rows, hidden] of the backend the exchange was made for.
  // recv = every rank's send in rank order; rank r contributes row_counts[r] rows (its send's).
  virtual void all_gather_v(const model::Tensor& send, const model::Tensor& recv,
                            std::span<const int64_t> row_counts) = 0;
  // send holds send_rows[r] rows for each rank r in rank order; recv gets recv_rows[r] rows from each r.
  virtual void all_to_all_v(const model::Tensor& send, std::span<const int64_t> send_rows, const model::Tensor& recv,
                            std::span<const int64_t> recv_rows) = 0;
  // send = size() blocks of recv's rows; recv = sum over ranks of block rank().
  virtual void reduce_scatter_sum(const model::Tensor& send, const model::Tensor& recv) = 0;
  // Collectives made so far (a counter: tests and logs tell which path ran).
  int64_t calls() const { return calls_; }

 protected:
  int64_t calls_ = 0;
};

// Bytes of rows[r] rows of row_floats floats each, per rank: the byte counts of the communicators' calls.
inline std::vector<int64_t> row_byte_counts(std::span<const int64_t> rows, int64_t row_floats) {
  std::vector<int64_t> bytes(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) bytes[i] = rows[i] * row_floats * static_cast<int64_t>(sizeof(float));
  return bytes;
}

// Host path over `group` for any backend.
std::unique_ptr<RowExchange> make_host_row_exchange(comm::Communicator& group, model::Backend& backend);
// The device path when the backend is CUDA and `group` an NcclCommunicator (in a build with NCCL), else
// the host path. Both must outlive the exchange.
std::unique_ptr<RowExchange> make_row_exchange(comm::Communicator& group, model::Backend& backend);

}  // namespace fulcrum::engine
