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
  AllGatherDispatcher(comm::Communicator& stage, model::Backend& backend, int hidden_size)
      : stage_(stage), backend_(backend), hidden_(hidden_size) {}
  std::string_view name() const override { return "allgather"; }
  bool needs_all_tokens() const override { return true; }

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

    const std::vector<float> host = backend_.download(x);                               // [rows, hidden]
    std::vector<float> all_rows(static_cast<size_t>(row_offsets[n] * hidden_));          // [all rows, hidden]
    stage_.all_gather_v(bytes_of(std::span<const float>(host)), writable_bytes_of(std::span<float>(all_rows)),
                        byte_counts<float>(row_counts, hidden_));
    std::vector<int32_t> pairs;  // [entries][token, expert]
    for (size_t i = 0; i < entry_token.size(); ++i) {
      pairs.push_back(entry_token[i]);
      pairs.push_back(entry_expert[i]);
    }
    std::vector<int32_t> all_pairs(static_cast<size_t>(2 * entry_offsets_[n]));
    stage_.all_gather_v(bytes_of(std::span<const int32_t>(pairs)), writable_bytes_of(std::span<int32_t>(all_pairs)),
                        byte_counts<int32_t>(entry_counts_, 2));

    DispatchedTokens out;
    out.rows = backend_.zeros({row_offsets[n], hidden_});
    backend_.upload(out.rows, all_rows);
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
    const std::vector<float> host = backend_.download(outputs);  // [all entries, hidden]
    // Block r (padded to max_entries rows) holds the entries of source r; rank r receives the block's sum.
    std::vector<float> send(static_cast<size_t>(n * max_entries * hidden_), 0.0f);  // [n][max_entries, hidden]
    for (int r = 0; r < n; ++r) {
      std::copy(host.begin() + entry_offsets_[r] * hidden_, host.begin() + entry_offsets_[r + 1] * hidden_,
                send.begin() + r * max_entries * hidden_);
    }
    std::vector<float> recv(static_cast<size_t>(max_entries * hidden_));  // [max_entries, hidden]
    stage_.reduce_scatter_sum(send, recv);
    model::Tensor mine = backend_.zeros({entry_counts_[me], hidden_});  // [my entries, hidden]
    backend_.upload(mine, std::span<const float>(recv).first(static_cast<size_t>(entry_counts_[me] * hidden_)));
    return mine;
  }

 private:
  comm::Communicator& stage_;
  model::Backend& backend_;
  int64_t hidden_;
  std::vector<int64_t> entry_counts_, entry_offsets_;  // of the last dispatch, per source
};

class AllToAllDispatcher final : public TokenDispatcher {
 public:
  AllToAllDispatcher(comm::Communicator& stage, model::Backend& backend, int hidden_size, int slots_per_ep_rank,
                     int ranks_per_ep_rank)
      : stage_(stage), backend_(backend), hidden_(hidden_size), slots_per_ep_rank_(slots_per_ep_rank),
        ranks_per_ep_rank_(ranks_per_ep_rank) {}
  std::string_view name() const override { return "alltoall"; }
  bool needs_all_tokens() const override { return false; }

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

    const std::vector<float> host = backend_.download(x);  // [num_tokens, hidden]
    std::vector<int32_t> meta;                              // [sent entries][expert, slot]
    std::vector<float> rows;                                // [sent entries, hidden]
    for (int d = 0; d < n; ++d) {
      for (const int32_t i : sent_[d]) {
        meta.push_back(entry_expert[i]);
        meta.push_back(entry_slot[i]);
        const auto begin = host.begin() + static_cast<int64_t>(entry_token[i]) * hidden_;
        rows.insert(rows.end(), begin, begin + hidden_);
      }
    }
    std::vector<int32_t> recv_meta(static_cast<size_t>(2 * recv_offsets[n]));
    stage_.all_to_all_v(bytes_of(std::span<const int32_t>(meta)), byte_counts<int32_t>(send_counts, 2),
                        writable_bytes_of(std::span<int32_t>(recv_meta)), byte_counts<int32_t>(recv_counts, 2));
    std::vector<float> recv_rows(static_cast<size_t>(recv_offsets[n] * hidden_));
    stage_.all_to_all_v(bytes_of(std::span<const float>(rows)), byte_counts<float>(send_counts, hidden_),
                        writable_bytes_of(std::span<float>(recv_rows)), byte_counts<float>(recv_counts, hidden_));

    DispatchedTokens out;
    out.rows = backend_.zeros({recv_offsets[n], hidden_});  // one row per received entry
    backend_.upload(out.rows, recv_rows);
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
    const std::vector<float> host = backend_.download(outputs);  // [received entries, hidden], source order
    std::vector<int64_t> back_counts(n);
    for (int d = 0; d < n; ++d) back_counts[d] = static_cast<int64_t>(sent_[d].size());
    std::vector<float> back(static_cast<size_t>(std::accumulate(back_counts.begin(), back_counts.end(), int64_t{0}) * hidden_));
    stage_.all_to_all_v(bytes_of(std::span<const float>(host)), byte_counts<float>(recv_counts_, hidden_),
                        writable_bytes_of(std::span<float>(back)), byte_counts<float>(back_counts, hidden_));
    std::vector<float> sum(static_cast<size_t>(num_entries_ * hidden_), 0.0f);  // [my entries, hidden]
    size_t offset = 0;
    for (int d = 0; d < n; ++d) {  // ascending rank: the same order as the allgather reduction
      for (const int32_t i : sent_[d]) {
        float* dst = sum.data() + static_cast<int64_t>(i) * hidden_;
        for (int64_t h = 0; h < hidden_; ++h) dst[h] += back[offset + h];
        offset += hidden_;
      }
    }
    model::Tensor mine = backend_.zeros({num_entries_, hidden_});
    backend_.upload(mine, sum);
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
};

}  // namespace

std::unique_ptr<TokenDispatcher> make_token_dispatcher(std::string_view name, comm::Communicator& stage,
                                                       model::Backend& backend, int hidden_size,
                                                       int slots_per_ep_rank, int ranks_per_ep_rank) {
  if (name == "allgather") return std::make_unique<AllGatherDispatcher>(stage, backend, hidden_size);
  if (name == "alltoall") {
    return std::make_unique<AllToAllDispatcher>(stage, backend, hidden_size, slots_per_ep_rank, ranks_per_ep_rank);
  }
  throw Error(fmt::format("unknown --moe-a2a-backend '{}' (known: allgather|alltoall)", name));
}

}  // namespace fulcrum::engine
