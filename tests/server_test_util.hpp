#pragma once
// Helpers of the server tests: a fake StepExecutor whose logits are a pure function of each sequence's
// own history (for scheduler logic), and a tiny synthetic model with a tokenizer, made once per process.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include <unistd.h>

#include "eplb/error.hpp"
#include "model/make_model.hpp"
#include "server/engine_step_executor.hpp"
#include "server/step_executor.hpp"
#include "test_data.hpp"
#include "tokenizer/tokenizer.hpp"

namespace fulcrum::test {

// Logits = one-hot on a hash of the sequence's tokens so far, mod vocab, sampled with model::sample_entry
// (the host sampling every logits-producing executor uses); every step's entries are recorded.
// Over caller-chosen pages (allocate_on_pages, what the scheduler uses) it is a paged KV cache of token ids:
// each step writes its tokens into the page table's slots and reads the history back through the table, so a
// wrong page table changes the tokens. A write to a slot already written since the page was handed out
// fresh, a fresh page that another live sequence holds, or a cached page not fully written throws.
class FakeExecutor final : public server::StepExecutor {
 public:
  // What step() saw of one entry (its token span does not outlive the step).
  struct SeenEntry {
    server::SequenceId id = 0;
    int num_tokens = 0;
    bool sample = false;
    float temperature = 0.0f;
    double uniform = 0.0;
  };

  explicit FakeExecutor(int vocab = 50, int64_t max_len = 4096, int page_size = 4)
      : vocab_(vocab), max_len_(max_len), page_size_(page_size) {}

  int vocab_size() const override { return vocab_; }
  int64_t max_sequence_length() const override { return max_len_; }
  bool supports_prompt_logprobs() const override { return prompt_logprobs; }
  bool prompt_logprobs = true;  // false: as an engine without them, prompt logprobs are refused at submit
  void allocate(server::SequenceId id, int64_t capacity) override {
    FULCRUM_CHECK(!live.contains(id), "double allocate {}", id);
    live[id] = {};
    capacity_[id] = capacity;
  }
  void allocate_on_pages(server::SequenceId id, const model::SequencePages& p) override {
    if (reform_next_allocate) {
      reform_next_allocate = false;
      reform();
    }
    FULCRUM_CHECK(!live.contains(id), "double allocate {}", id);
    const auto num_pages = static_cast<size_t>((p.capacity + page_size_ - 1) / page_size_);
    FULCRUM_CHECK(p.page_ids.size() == num_pages, "sequence {}: {} pages for capacity {}", id, p.page_ids.size(), p.capacity);
    const auto num_cached_pages = static_cast<size_t>(p.num_cached_tokens / page_size_);
    const auto copied = static_cast<size_t>(p.num_cached_tokens % page_size_);
    FULCRUM_CHECK((copied > 0) == (p.copy_source_page >= 0), "sequence {}: {} cached tokens, copy source {}", id,
                  p.num_cached_tokens, p.copy_source_page);
    for (size_t i = 0; i < num_pages; ++i) {
      FULCRUM_CHECK(p.dp_group >= 0 && p.dp_group < num_groups, "sequence {}: group {}", id, p.dp_group);
      const PageKey page{p.dp_group, p.page_ids[i]};
      std::vector<int32_t>& slots = pages_[page];
      if (i < num_cached_pages) {
        FULCRUM_CHECK(slots.size() == static_cast<size_t>(page_size_) &&
                          std::find(slots.begin(), slots.end(), -1) == slots.end(),
                      "sequence {}: cached page {} is not written", id, page.second);
        continue;
      }
      for (const auto& [other, table] : tables_) {
        FULCRUM_CHECK(std::find(table.begin(), table.end(), page) == table.end(),
                      "sequence {}: fresh page {} is held by sequence {}", id, page.second, other);
      }
      slots.assign(static_cast<size_t>(page_size_), -1);
      if (i == num_cached_pages && copied > 0) {  // copy on write of the source page's first rows
        FULCRUM_CHECK(std::find(p.page_ids.begin(), p.page_ids.end(), p.copy_source_page) == p.page_ids.end(),
                      "sequence {}: copy source page {} is in its table", id, p.copy_source_page);
        const std::vector<int32_t>& src = pages_.at({p.dp_group, p.copy_source_page});
        FULCRUM_CHECK(std::find(src.begin(), src.begin() + static_cast<ptrdiff_t>(copied), -1) ==
                          src.begin() + static_cast<ptrdiff_t>(copied),
                      "sequence {}: copy source page {} is not written", id, p.copy_source_page);
        std::copy_n(src.begin(), copied, slots.begin());
        num_copied_positions += static_cast<int64_t>(copied);
      }
    }
    for (const int32_t page : p.page_ids) tables_[id].push_back({p.dp_group, page});
    group_of[id] = p.dp_group;
    live[id] = read_positions(tables_[id], p.num_cached_tokens);
    capacity_[id] = p.capacity;
    num_cached_tokens_seen += p.num_cached_tokens;
  }
  int num_kv_groups() const override { return num_groups; }
  void release(server::SequenceId id) override {
    if (on_release) on_release(id);
    live.erase(id);
    capacity_.erase(id);
    tables_.erase(id);
  }
  model::StepOutput step(std::span<const model::StepSequence> batch) override {
    if (fail_next_step) {
      fail_next_step = false;
      throw Error("injected step failure");
    }
    if (failed_for_good) throw server::ExecutorFailure("injected executor failure");
    if (reform_next_step) {
      reform_next_step = false;
      reform();
    }
    model::StepOutput out = model::make_step_output(batch.size());
    std::vector<SeenEntry>& seen = steps_seen.emplace_back();
    for (size_t i = 0; i < batch.size(); ++i) {
      const model::StepSequence& in = batch[i];
      std::vector<int32_t>& history = live.at(in.id);
      if (const auto table = tables_.find(in.id); table != tables_.end()) {
        const auto start = static_cast<int64_t>(history.size());
        FULCRUM_CHECK(start + static_cast<int64_t>(in.token_ids.size()) <= capacity_.at(in.id), "sequence {} over capacity", in.id);
        for (size_t j = 0; j < in.token_ids.size(); ++j) {
          const int64_t pos = start + static_cast<int64_t>(j);
          const PageKey page = table->second[static_cast<size_t>(pos / page_size_)];
          int32_t& slot = pages_.at(page)[static_cast<size_t>(pos % page_size_)];
          FULCRUM_CHECK(slot == -1, "sequence {}: page {} of group {} slot {} written twice", in.id, page.second,
                        page.first, pos % page_size_);
          slot = in.token_ids[j];
          ++num_written_positions;
        }
        history = read_positions(table->second, start + static_cast<int64_t>(in.token_ids.size()));
      } else {
        history.insert(history.end(), in.token_ids.begin(), in.token_ids.end());
      }
      FULCRUM_CHECK(static_cast<int64_t>(history.size()) <= capacity_.at(in.id), "sequence {} over capacity", in.id);
      std::vector<float> row = logits(history, vocab_);  // [vocab]
      if (nan_logits.contains(in.id)) row[3] = std::nanf("");
      model::sample_entry(row, in, out, i);
      seen.push_back({in.id, static_cast<int>(in.token_ids.size()), in.sample, in.sampling.temperature, in.uniform});
    }
    ++steps;
    return out;
  }
  // The fake model's logits after `history`: 1 at next_token(history), 0 elsewhere.
  static std::vector<float> logits(const std::vector<int32_t>& history, int vocab) {
    std::vector<float> row(static_cast<size_t>(vocab), 0.0f);
    row[static_cast<size_t>(next_token(history, vocab))] = 1.0f;
    return row;
  }
  // The greedy continuation of `prompt` by `n` tokens, computed without any scheduler.
  static std::vector<int32_t> expected(std::vector<int32_t> prompt, int n, int vocab) {
    std::vector<int32_t> out;
    for (int i = 0; i < n; ++i) {
      out.push_back(next_token(prompt, vocab));
      prompt.push_back(out.back());
    }
    return out;
  }
  static int32_t next_token(const std::vector<int32_t>& history, int vocab) {
    uint64_t h = 1469598103934665603ull;
    for (const int32_t t : history) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
    return static_cast<int32_t>(h % static_cast<uint64_t>(vocab));
  }

  std::map<server::SequenceId, std::vector<int32_t>> live;  // each live sequence's tokens in its KV cache
  int steps = 0;
  int64_t num_written_positions = 0;  // KV positions written (computed) over caller-chosen pages
  int64_t num_cached_tokens_seen = 0;  // positions allocate_on_pages said were cached
  int64_t num_copied_positions = 0;    // of which copied from a partly shared page
  int num_groups = 1;                  // attention-DP groups it reports
  std::map<server::SequenceId, int> group_of;  // group of each sequence allocated on pages (kept after release)
  std::vector<std::vector<SeenEntry>> steps_seen;  // per step, in batch order
  std::set<server::SequenceId> nan_logits;         // these sequences' logits hold a NaN (token 3)
  bool fail_next_step = false;
  bool failed_for_good = false;  // every step throws ExecutorFailure
  std::function<void(server::SequenceId)> on_release;  // called before a sequence's KV is dropped
  // Elastic EP's recovery: every sequence and page is gone (pages read -1 until written again), the call
  // throws WorldReformed.
  bool reform_next_step = false;
  bool reform_next_allocate = false;
  int num_reforms = 0;

 private:
  using PageKey = std::pair<int, int32_t>;  // (attention-DP group, page id)
  [[noreturn]] void reform() {
    ++num_reforms;
    live.clear();
    capacity_.clear();
    tables_.clear();
    pages_.clear();
    throw server::WorldReformed("injected world re-formed");
  }
  std::vector<int32_t> read_positions(const std::vector<PageKey>& table, int64_t n) const {
    std::vector<int32_t> out;
    for (int64_t pos = 0; pos < n; ++pos) {
      out.push_back(pages_.at(table[static_cast<size_t>(pos / page_size_)])[static_cast<size_t>(pos % page_size_)]);
    }
    return out;
  }

  int vocab_;
  int64_t max_len_;
  int page_size_;
  std::map<server::SequenceId, int64_t> capacity_;
  std::map<server::SequenceId, std::vector<PageKey>> tables_;  // caller-chosen page tables
  std::map<PageKey, std::vector<int32_t>> pages_;              // page -> token per slot (-1: not written)
};

inline std::string golden_tokenizer_file() { return shared_path("golden/tokenizer/bpe-qwen-style-2k/tokenizer.json"); }

// A tiny synthetic model (2 layers) with the golden tokenizer beside it, its vocabulary sized to the
// tokenizer; made on first use, removed when the process exits.
inline const std::string& tiny_served_model() {
  static const std::string dir = [] {
    const std::filesystem::path path =
        std::filesystem::temp_directory_path() / ("fulcrum_server_model_" + std::to_string(::getpid()));
    std::filesystem::remove_all(path);
    const tokenizer::Tokenizer tok = tokenizer::Tokenizer::from_file(golden_tokenizer_file());
    model::MakeModelOptions options;
    options.preset = "tiny";
    options.output = path.string();
    options.layers = 2;
    options.vocab_size = tok.id_bound();
    options.seed = 7;
    model::make_model(options);
    std::filesystem::copy_file(golden_tokenizer_file(), path / "tokenizer.json");
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / ("fulcrum_server_model_" + std::to_string(::getpid())), ignored);
    });
    return path.string();
  }();
  return dir;
}

// A tiny synthetic model (4 MoE layers, 128 experts top-8, vocab 256, no tokenizer: token-id prompts)
// whose routers follow the real Qwen3-30B-A3B gsm8k load matrix (make-model --router-skew), so a trivial
// placement is measurably unbalanced and EPLB has something to do; made on first use, removed at exit.
inline const std::string& skewed_served_model() {
  static const std::string dir = [] {
    const std::string path =
        (std::filesystem::temp_directory_path() / ("fulcrum_server_skewed_" + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(path);
    model::MakeModelOptions options;
    options.preset = "tiny";
    options.output = path;
    options.seed = 7;
    options.dtype = model::Dtype::kF32;
    options.router_skew = shared_path("data/loads/qwen3-30b-a3b_prefill_gsm8k_en.csv");
    options.calibration.num_tokens = 1024;  // as the demo: enough for a clear skew, quick to make
    options.calibration.max_rounds = 4;
    options.measure_tokens = 1024;
    model::make_model(options);
    std::atexit([] {
      std::error_code ignored;
      std::filesystem::remove_all(
          std::filesystem::temp_directory_path() / ("fulcrum_server_skewed_" + std::to_string(::getpid())), ignored);
    });
    return path;
  }();
  return dir;
}

// A tp 4 / ep 4 world in two attention-DP groups with 4 redundant slots, alltoall dispatch, and EPLB rebalancing
// every two passes whenever the planner improves a layer: live migration while a test serves.
inline void set_live_eplb_layout(server::EngineExecutorOptions& options) {
  options.parallel = {.tp = 4, .dp = 2, .ep = 4, .enable_dp_attention = true, .num_redundant_experts = 4};
  options.run.engine.moe_a2a_backend = "alltoall";
  options.run.eplb.enabled = true;
  options.run.eplb.rebalance_num_iterations = 2;
  options.run.eplb.recorder_buffer_size = 4;
  options.run.eplb.skip_balancedness = 1.0;
}

}  // namespace fulcrum::test
