#include "engine/token_dispatcher.hpp"

#include <algorithm>
#include <numeric>

#include "eplb/error.hpp"

namespace fulcrum::engine {
namespace {

using comm::bytes_of;
using comm::writable_bytes_of;

template <class T>
std::vector<int64_t> byte_counts(const std::vector<int64_t>& counts, int64_t per_item) {
  std::vector<int64_t> bytes(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) bytes[i] = counts[i] * per_item * static_cast<int64_t>(sizeof(T));
  return bytes;
}

std::vector<int64_t> offsets_of(const std::vector<int64_t>& counts) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  std::partial_sum(counts.begin(), counts.end(), offsets.begin() + 1);
  return offsets;
}

class AllGatherDispatcher final : public TokenDispatcher {
 public:
  AllGatherDispatcher(comm::Communicator& stage, model::Backend& backend, int hidden_size,
                      std::unique_ptr<RowExchange> rows)
      : stage_(stage), backend_(backend), hidden_(hidden_size), rows_(std::move(rows)) {}
  std::string_view name() const override { return "allgather"; }
  bool needs_all_tokens() const override { return true; }
  const RowExchange& row_exchange() const override { return *rows_; }

  DispatchedTokens dispatch(const model::Tensor& x, std::span<const int32_t> entry_token,
                            std::span<const int32_t> entry_expert, std::span<const int32_t>) override {
    const int n = stage_.size();
    const int64_t mine[2] = {x.dim(0), static_cast<int64_t>(entry_token.size())};
    std::vector<int64_t> sizes(2 * static_cast<size_t>(n));  // [n][rows, entries]
    stage_.all_gather(bytes_of(std::span<const int64_t>(mine)), writable_bytes_of(std::span<int64_t>(sizes)));
    std::vector<int64_t> row_counts(n);
    entry_counts_.assign(n, 0);
    for (int r = 0; r < n; ++r) {
      row_counts[r] = sizes[2 * r];
      entry_counts_[r] = sizes[2 * r + 1];
    }
    const std::vector<int64_t> row_offsets = offsets_of(row_counts);
    entry_offsets_ = offsets_of(entry_counts_);

    DispatchedTokens out;
    out.rows = backend_.zeros({row_offsets[n], hidden_});  // [all rows, hidden]
    rows_->all_gather_v(x, out.rows, row_counts);
    std::vector<int32_t> pairs;  // [entries][token, expert]
    for (size_t i = 0; i < entry_token.size(); ++i) {
      pairs.push_back(entry_token[i]);
      pairs.push_back(entry_expert[i]);
    }
    std::vector<int32_t> all_pairs(static_cast<size_t>(2 * entry_offsets_[n]));
    stage_.all_gather_v(bytes_of(std::span<const int32_t>(pairs)), writable_bytes_of(std::span<int32_t>(all_pairs)),
                        byte_counts<int32_t>(entry_counts_, 2));

    for (int r = 0; r < n; ++r) {
      for (int64_t k = entry_offsets_[r]; k < entry_offsets_[r + 1]; ++k) {
        out.entry_row.push_back(static_cast<int32_t>(row_offsets[r] + all_pairs[2 * k]));
        out.source.push_back(r);
        out.expert.push_back(all_pairs[2 * k + 1]);
        out.slot.push_back(-1);
      }
    }
    return out;
  }

  model::Tensor combine(const model::Tensor& outputs) override {
    const int n = stage_.size(), me = stage_.rank();
    const int64_t max_entries = *std::max_element(entry_counts_.begin(), entry_counts_.end());
    // Block r (padded to max_entries rows) holds the entries of source r; rank r receives the block's sum.
    const model::Tensor send = backend_.zeros({n * max_entries, hidden_});  // [n][max_entries, hidden]
    for (int r = 0; r < n; ++r) {
      if (entry_counts_[r] == 0) continue;
      backend_.copy(send.rows(r * max_entries, entry_counts_[r]), outputs.rows(entry_offsets_[r], entry_counts_[r]));
    }
    const model::Tensor sum = backend_.zeros({max_entries, hidden_});  // [max_entries, hidden]
    rows_->reduce_scatter_sum(send, sum);
    return sum.rows(0, entry_counts_[me]);  // [my entries, hidden]: a view that keeps `sum` alive
  }

 private:
  comm::Communicator& stage_;
  model::Backend& backend_;
  int64_t hidden_;
  std::vector<int64_t> entry_counts_, entry_offsets_;  // of the last dispatch, per source
  std::unique_ptr<RowExchange> rows_;
};

class AllToAllDispatcher final : public TokenDispatcher {
 public:
  AllToAllDispatcher(comm::Communicator& stage, model::Backend& backend, int hidden_size, int slots_per_ep_rank,
                     int ranks_per_ep_rank, std::unique_ptr<RowExchange> rows)
      : stage_(stage), backend_(backend), hidden_(hidden_size), slots_per_ep_rank_(slots_per_ep_rank),
        ranks_per_ep_rank_(ranks_per_ep_rank), rows_(std::move(rows)) {}
  std::string_view name() const override { return "alltoall"; }
  bool needs_all_tokens() const override { return false; }
  const RowExchange& row_exchange() const override { return *rows_; }

  DispatchedTokens dispatch(const model::Tensor& x, std::span<const int32_t> entry_token,
                            std::span<const int32_t> entry_expert, std::span<const int32_t> entry_slot) override {
    const int n = stage_.size();
    num_entries_ = static_cast<int64_t>(entry_token.size());
    sent_.assign(n, {});  // entries sent to each rank, in entry order
    for (int64_t i = 0; i < num_entries_; ++i) {
      const int first = entry_slot[i] / slots_per_ep_rank_ * ranks_per_ep_rank_;
      FULCRUM_CHECK(entry_slot[i] >= 0 && first + ranks_per_ep_rank_ <= n, "alltoall: slot {} has no rank",
                    entry_slot[i]);
      for (int m = 0; m < ranks_per_ep_rank_; ++m) sent_[first + m].push_back(static_cast<int32_t>(i));
    }
    std::vector<int64_t> send_counts(n), recv_counts(n);
    for (int d = 0; d < n; ++d) send_counts[d] = static_cast<int64_t>(sent_[d].size());
    const std::vector<int64_t> eight(n, sizeof(int64_t));
    stage_.all_to_all_v(bytes_of(std::span<const int64_t>(send_counts)), eight,
                        writable_bytes_of(std::span<int64_t>(recv_counts)), eight);
    recv_counts_ = recv_counts;
    const std::vector<int64_t> recv_offsets = offsets_of(recv_counts);

    std::vector<int32_t> meta;      // [sent entries][expert, slot]
    std::vector<int32_t> send_row;  // [sent entries]: the row of x each sent entry carries
    for (int d = 0; d < n; ++d) {
      for (const int32_t i : sent_[d]) {
        meta.push_back(entry_expert[i]);
        meta.push_back(entry_slot[i]);
        send_row.push_back(entry_token[i]);
      }
    }
    std::vector<int32_t> recv_meta(static_cast<size_t>(2 * recv_offsets[n]));
    stage_.all_to_all_v(bytes_of(std::span<const int32_t>(meta)), byte_counts<int32_t>(send_counts, 2),
                        writable_bytes_of(std::span<int32_t>(recv_meta)), byte_counts<int32_t>(recv_counts, 2));
    DispatchedTokens out;
    out.rows = backend_.zeros({recv_offsets[n], hidden_});  // one row per received entry
    rows_->all_to_all_v(backend_.gather_rows(x, send_row), send_counts, out.rows, recv_counts);
    for (int s = 0; s < n; ++s) {
      for (int64_t k = recv_offsets[s]; k < recv_offsets[s + 1]; ++k) {
        out.entry_row.push_back(static_cast<int32_t>(k));
        out.source.push_back(s);
        out.expert.push_back(recv_meta[2 * k]);
        out.slot.push_back(recv_meta[2 * k + 1]);
      }
    }
    return out;
  }

  model::Tensor combine(const model::Tensor& outputs) override {
    const int n = stage_.size();
    std::vector<int64_t> back_counts(n);
    for (int d = 0; d < n; ++d) back_counts[d] = static_cast<int64_t>(sent_[d].size());
    const model::Tensor back =  // [sent entries, hidden]: each rank's partial results, in the order sent
        backend_.zeros({std::accumulate(back_counts.begin(), back_counts.end(), int64_t{0}), hidden_});
    rows_->all_to_all_v(outputs, recv_counts_, back, back_counts);
    const model::Tensor mine = backend_.zeros({num_entries_, hidden_});  // [my entries, hidden]
    int64_t offset = 0;
    for (int d = 0; d < n; ++d) {  // ascending rank from zero: the same order as the allgather reduction
      if (sent_[d].empty()) continue;
      const auto count = static_cast<int64_t>(sent_[d].size());
      const model::Tensor partial = backend_.gather_rows(mine, sent_[d]);  // an entry goes at most once to d
      backend_.add_inplace(partial, back.rows(offset, count));
      backend_.scatter_rows(mine, partial, sent_[d]);
      offset += count;
    }
    return mine;
  }

 private:
  comm::Communicator& stage_;
  model::Backend& backend_;
  int64_t hidden_;
  int slots_per_ep_rank_, ranks_per_ep_rank_;
  int64_t num_entries_ = 0;
  std::vector<std::vector<int32_t>> sent_;  // of the last dispatch
  std::vector<int64_t> recv_counts_;
  std::unique_ptr<RowExchange> rows_;
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_token_dispatcher(std::string_view name, comm::Communicator& stage,
                                                       model::Backend& backend, int hidden_size,
                                                       int slots_per_ep_rank, int ranks_per_ep_rank,
                                                       std::unique_ptr<RowExchange> rows) {
  if (rows == nullptr) rows = make_row_exchange(stage, backend);
  if (name == "allgather") return std::make_unique<AllGatherDispatcher>(stage, backend, hidden_size, std::move(rows));
  if (name == "alltoall") {
    return std::make_unique<AllToAllDispatcher>(stage, backend, hidden_size, slots_per_ep_rank, ranks_per_ep_rank,
                                                std::move(rows));
  }
  throw Error(fmt::format("unknown --moe-a2a-backend '{}' (known: allgather|alltoall)", name));
}

}  // namespace fulcrum::engine
