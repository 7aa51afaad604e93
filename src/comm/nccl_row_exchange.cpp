#include "comm/nccl_row_exchange.hpp"

#include <numeric>
#include <vector>

#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

std::byte* bytes_at(const model::Tensor& t) { return reinterpret_cast<std::byte*>(t.data()); }

void check_rows(const model::Tensor& t, std::span<const int64_t> rows, const char* what) {
  const int64_t total = std::accumulate(rows.begin(), rows.end(), int64_t{0});
  FULCRUM_CHECK(t.rank() >= 1 && total <= t.dim(0), "row exchange: {} has {} rows, its counts add up to {}", what,
                t.rank() >= 1 ? t.dim(0) : 0, total);
}

}  // namespace

void NcclRowExchange::all_gather_v(const model::Tensor& send, const model::Tensor& recv,
                                   std::span<const int64_t> row_counts) {
  FULCRUM_CHECK(static_cast<int>(row_counts.size()) == group_.size() && row_counts[group_.rank()] == send.dim(0),
                "row exchange: all_gather_v counts do not match this rank's {} rows", send.dim(0));
  check_rows(recv, row_counts, "all_gather_v recv");
  ++calls_;
  backend_.synchronize();
  // Every peer gets this rank's rows; this rank's own block is a copy (sent to itself).
  const int64_t row_bytes = recv.row_numel() * static_cast<int64_t>(sizeof(float));
  std::vector<NcclCommunicator::DeviceSend> sends;
  std::vector<NcclCommunicator::DeviceRecv> recvs;
  int64_t offset = 0;
  for (int r = 0; r < group_.size(); ++r) {
    const int64_t bytes = row_counts[r] * row_bytes;
    if (r == group_.rank()) {
      if (bytes > 0) backend_.copy(recv.rows(offset / row_bytes, row_counts[r]), send);
    } else {
      sends.push_back({bytes_at(send), send.dim(0) * row_bytes, r});
      recvs.push_back({bytes_at(recv) + offset, bytes, r});
    }
    offset += bytes;
  }
  backend_.synchronize();  // the own block's copy, before NCCL's stream runs
  group_.exchange_device(sends, recvs);
}

void NcclRowExchange::all_to_all_v(const model::Tensor& send, std::span<const int64_t> send_rows,
                                   const model::Tensor& recv, std::span<const int64_t> recv_rows) {
  check_rows(send, send_rows, "all_to_all_v send");
  check_rows(recv, recv_rows, "all_to_all_v recv");
  ++calls_;
  backend_.synchronize();
  group_.all_to_all_v_device(bytes_at(send), engine::row_byte_counts(send_rows, send.row_numel()), bytes_at(recv),
                             engine::row_byte_counts(recv_rows, recv.row_numel()));
}

void NcclRowExchange::reduce_scatter_sum(const model::Tensor& send, const model::Tensor& recv) {
  FULCRUM_CHECK(send.numel() == recv.numel() * group_.size(), "row exchange: reduce_scatter send has {} floats, "
                "expected {} x {}", send.numel(), group_.size(), recv.numel());
  ++calls_;
  backend_.synchronize();
  group_.reduce_scatter_sum_device(send.data(), recv.data(), recv.numel());
}

}  // namespace fulcrum::comm
