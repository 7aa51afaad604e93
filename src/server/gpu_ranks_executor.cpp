// GPU engine EP ranks as threads behind one StepExecutor (see gpu_ranks_executor.hpp).
#include "server/gpu_ranks_executor.hpp"

#include <algorithm>
#include <numeric>
#include <optional>

#include <fmt/format.h>

#include "backend/cuda/cuda_backend.hpp"
#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "engine/rank_eplb.hpp"
#include "eplb/error.hpp"
#include "eplb/metrics.hpp"
#include "gpu/gpu_engine.hpp"
#include "gpu/gpu_rank_eplb.hpp"
#include "server/metrics.hpp"

namespace fulcrum::server {

// A rank's thread waits on `cv` for a task and signals it done on the same variable.
struct GpuRanksExecutor::Rank {
  int device = 0;
  gpu::GpuRankEplb* eplb = nullptr;  // --enable-eplb: the rank's EPLB loop (owned by rank_main)
  std::mutex m;
  std::condition_variable cv;
  Task task;
  bool has_task = false, collective = false, done = false;
  std::string error;
};

GpuRanksExecutor::GpuRanksExecutor(const GpuExecutorOptions& options)
    : config_(model::load_qwen3_moe_config(options.model_dir)), world_size_(options.parallel.tp),
      metrics_(options.metrics) {
  FULCRUM_CHECK(engine::runs_gpu_engine_ranks(options.parallel, options.run), "serve: the GPU engine's ranks take "
                "--device cuda --tp W --dp W --enable-dp-attention --ep W (one pipeline stage)");
  const std::string why = engine::why_gpu_engine_ranks_cannot_run(options.run);
  FULCRUM_CHECK(why.empty(), "{}", why);
  const int devices = backend::CudaBackend::device_count();
  FULCRUM_CHECK(devices > 0, "--device cuda: no CUDA device is visible");
  for (int r = 0; r < world_size_; ++r) {
    ranks_.push_back(std::make_unique<Rank>());
    ranks_.back()->device = r % devices;
  }
  // The engines' options once (placement included); each rank sets its device and exchange.
  const gpu::GpuEngineOptions base = gpu_engine_options(options, config_);
  world_ = std::thread([this, options, base] {
    try {
      comm::run_in_process(world_size_, [&](int r, comm::Communicator& comm) { rank_main(r, comm, options, base); });
    } catch (const std::exception& e) {
      const std::lock_guard lock(state_mutex_);
      if (failure_.empty()) failure_ = e.what();
    }
    stop_ranks();
  });
  {
    std::unique_lock lock(state_mutex_);
    state_cv_.wait(lock, [&] { return ready_ == world_size_ || !failure_.empty(); });
  }
  if (!failure_.empty()) {
    stop_ranks();
    world_.join();
    throw Error(failure_);
  }
  std::vector<int64_t> lengths(static_cast<size_t>(world_size_), 0);
  const std::string error = run_on_all(
      [&lengths](int r, gpu::GpuEngine& e) { lengths[static_cast<size_t>(r)] = e.max_sequence_length(); }, false);
  FULCRUM_CHECK(error.empty(), "serve: {}", error);
  max_sequence_length_ = *std::min_element(lengths.begin(), lengths.end());
  description_ = fmt::format("{} GPU engine ranks (threads on {} GPU(s), expert parallelism and data-parallel attention "
                             "over {}, rows staged through host memory)", world_size_, std::min(world_size_, devices),
                             world_size_);
  recorder_ = std::make_unique<GpuCountsRecorder>(mutex_, config_, [this] {
    std::vector<std::vector<int64_t>> per_rank(static_cast<size_t>(world_size_));
    const std::string why = run_on_all(
        [&per_rank](int r, gpu::GpuEngine& e) { per_rank[static_cast<size_t>(r)] = e.expert_counts(); }, false);
    FULCRUM_CHECK(why.empty(), "expert distribution: {}", why);
    std::vector<int64_t> sum = per_rank.front();
    for (size_t r = 1; r < per_rank.size(); ++r) {
      for (size_t k = 0; k < sum.size(); ++k) sum[k] += per_rank[r][k];
    }
    return sum;
  });
}

GpuRanksExecutor::~GpuRanksExecutor() {
  stop_ranks();
  if (world_.joinable()) world_.join();
}

void GpuRanksExecutor::stop_ranks() {
  {
    const std::lock_guard lock(state_mutex_);
    stopping_ = true;
  }
  state_cv_.notify_all();
  for (const auto& rank : ranks_) {
    const std::lock_guard lock(rank->m);
    rank->cv.notify_all();
  }
}

bool GpuRanksExecutor::stopping() {
  const std::lock_guard lock(state_mutex_);
  return stopping_;
}

void GpuRanksExecutor::rank_main(int r, comm::Communicator& comm, const GpuExecutorOptions& options,
                                 const gpu::GpuEngineOptions& base) {
  Rank& me = *ranks_[static_cast<size_t>(r)];
  std::unique_ptr<comm::HostStagedExchange> exchange;
  std::unique_ptr<gpu::GpuEngine> engine;
  std::unique_ptr<gpu::GpuRankEplb> eplb;
  try {
    exchange = std::make_unique<comm::HostStagedExchange>(comm, me.device);
    gpu::GpuEngineOptions eo = base;
    eo.device = me.device;
    eo.ep = exchange.get();
    engine = std::make_unique<gpu::GpuEngine>(config_, eo);
    fill_gpu_engine(*engine, options, /*report_progress=*/r == 0);
    if (options.run.eplb.enabled) {
      eplb_runtime::ManagerOptions manager = engine::manager_options_of(options.run.eplb);
      manager.log = engine::eplb_log_of(options.run.eplb, /*this_rank_logs=*/r == 0);
      eplb = std::make_unique<gpu::GpuRankEplb>(*engine, *exchange, std::move(manager));
      me.eplb = eplb.get();
    }
  } catch (const std::exception& e) {
    {
      const std::lock_guard lock(state_mutex_);
      if (failure_.empty()) failure_ = fmt::format("GPU engine rank {}: {}", r, e.what());
    }
    stop_ranks();
    throw;
  }
  {
    const std::lock_guard lock(state_mutex_);
    ++ready_;
  }
  state_cv_.notify_all();
  for (;;) {
    Task task;
    bool collective = false;
    {
      std::unique_lock lock(me.m);
      me.cv.wait(lock, [&] { return me.has_task || stopping(); });
      if (!me.has_task) return;
      task = me.task;
      collective = me.collective;
    }
    std::string error;
    try {
      task(*engine);
    } catch (const std::exception& e) {
      error = e.what();
    }
    {
      const std::lock_guard lock(me.m);
      me.has_task = false;
      me.done = true;
      me.error = error;
    }
    me.cv.notify_all();
    if (!error.empty() && collective) {
      // The other ranks may wait in this step's exchanges: ending this thread with an error aborts the group, so
      // theirs fail too and every rank stops; the executor refuses later calls.
      {
        const std::lock_guard lock(state_mutex_);
        if (failure_.empty()) failure_ = fmt::format("GPU engine rank {}: {}", r, error);
      }
      stop_ranks();
      throw Error(error);
    }
  }
}

std::string GpuRanksExecutor::run_on(const std::vector<int>& ranks, const RankTask& task, bool collective) {
  for (const int r : ranks) {
    Rank& k = *ranks_[static_cast<size_t>(r)];
    {
      const std::lock_guard lock(k.m);
      k.task = [&task, r](gpu::GpuEngine& e) { task(r, e); };
      k.collective = collective;
      k.done = false;
      k.error.clear();
      k.has_task = true;
    }
    k.cv.notify_all();
  }
  std::string first;
  for (const int r : ranks) {
    Rank& k = *ranks_[static_cast<size_t>(r)];
    std::unique_lock lock(k.m);
    k.cv.wait(lock, [&] { return k.done || stopping(); });
    if (!k.done) {
      k.has_task = false;
      if (first.empty()) first = fmt::format("GPU engine rank {} stopped", r);
    } else if (!k.error.empty() && first.empty()) {
      first = fmt::format("GPU engine rank {}: {}", r, k.error);
    }
  }
  return first;
}

std::string GpuRanksExecutor::run_on_all(const RankTask& task, bool collective) {
  std::vector<int> all(static_cast<size_t>(world_size_));
  std::iota(all.begin(), all.end(), 0);
  return run_on(all, task, collective);
}

void GpuRanksExecutor::run_one(int rank, const std::function<void(gpu::GpuEngine&)>& task) {
  {
    const std::lock_guard lock(state_mutex_);
    if (!failure_.empty()) throw ExecutorFailure(fmt::format("the GPU engine ranks stopped: {}", failure_));
  }
  const std::string error = run_on({rank}, [&task](int, gpu::GpuEngine& e) { task(e); }, /*collective=*/false);
  if (!error.empty()) throw Error(error);
}

int GpuRanksExecutor::vocab_size() const { return config_.vocab_size; }
int64_t GpuRanksExecutor::max_sequence_length() const { return max_sequence_length_; }
std::string GpuRanksExecutor::describe() const { return description_; }

void GpuRanksExecutor::allocate(SequenceId id, int64_t capacity) {
  const std::lock_guard lock(mutex_);
  FULCRUM_CHECK(!group_of_.contains(id), "sequence {} is already live", id);
  std::vector<int> live(static_cast<size_t>(world_size_), 0);
  for (const auto& [seq, group] : group_of_) ++live[static_cast<size_t>(group)];
  const int group = static_cast<int>(std::min_element(live.begin(), live.end()) - live.begin());
  run_one(group, [&](gpu::GpuEngine& e) { e.allocate(id, capacity); });
  group_of_[id] = group;
}

void GpuRanksExecutor::allocate_on_pages(SequenceId id, const model::SequencePages& pages) {
  const std::lock_guard lock(mutex_);
  FULCRUM_CHECK(pages.dp_group >= 0 && pages.dp_group < world_size_, "sequence {}: attention-DP group {} outside [0, {})",
                id, pages.dp_group, world_size_);
  FULCRUM_CHECK(!group_of_.contains(id), "sequence {} is already live", id);
  model::SequencePages own = pages;
  own.dp_group = 0;  // the rank's engine has one pool: its group's
  run_one(pages.dp_group, [&](gpu::GpuEngine& e) { e.allocate_on_pages(id, own); });
  group_of_[id] = pages.dp_group;
}

void GpuRanksExecutor::release(SequenceId id) {
  const std::lock_guard lock(mutex_);
  const auto it = group_of_.find(id);
  if (it == group_of_.end()) return;
  const int group = it->second;
  group_of_.erase(it);
  run_one(group, [&](gpu::GpuEngine& e) { e.release(id); });
}

void GpuRanksExecutor::after_step(int r) {
  gpu::GpuRankEplb* eplb = ranks_[static_cast<size_t>(r)]->eplb;
  if (eplb == nullptr) return;
  const std::optional<eplb_runtime::RebalanceReport> report = eplb->after_step();  // collective when due
  if (r != 0 || metrics_ == nullptr || !report) return;
  if (!report->skipped) metrics_->add_eplb_rebalance(report->num_bytes_moved);
  const eplb::PlacementReport placement = eplb::evaluate_placement(eplb->placement(), eplb->last_window());
  metrics_->set_eplb_balancedness(placement.balancedness_per_layer, placement.balancedness_mean);
}

model::StepOutput GpuRanksExecutor::step(std::span<const model::StepSequence> batch) {
  const std::lock_guard lock(mutex_);
  {
    const std::lock_guard state(state_mutex_);
    if (!failure_.empty()) throw ExecutorFailure(fmt::format("the GPU engine ranks stopped: {}", failure_));
  }
  const auto w = static_cast<size_t>(world_size_);
  std::vector<std::vector<model::StepSequence>> parts(w);
  std::vector<std::vector<size_t>> where(w);
  for (size_t i = 0; i < batch.size(); ++i) {
    const auto it = group_of_.find(batch[i].id);
    FULCRUM_CHECK(it != group_of_.end(), "sequence {} is not live", batch[i].id);
    parts[static_cast<size_t>(it->second)].push_back(batch[i]);
    where[static_cast<size_t>(it->second)].push_back(i);
  }
  // Every rank steps, those without entries with an empty batch (they join the MoE layers' exchanges).
  std::vector<model::StepOutput> outs(w);
  const std::string error = run_on_all(
      [&](int r, gpu::GpuEngine& e) {
        outs[static_cast<size_t>(r)] = e.step(parts[static_cast<size_t>(r)]);
        after_step(r);
      },
      /*collective=*/true);
  if (!error.empty()) throw ExecutorFailure(fmt::format("the GPU engine ranks stopped: {}", error));
  model::StepOutput out = model::make_step_output(batch.size());
  for (size_t r = 0; r < w; ++r) {
    for (size_t k = 0; k < where[r].size(); ++k) {
      const size_t i = where[r][k];
      out.tokens[i] = outs[r].tokens[k];
      out.logprobs[i] = outs[r].logprobs[k];
      out.top_logprobs[i] = std::move(outs[r].top_logprobs[k]);
      out.prompt_logprobs[i] = std::move(outs[r].prompt_logprobs[k]);
      out.errors[i] = std::move(outs[r].errors[k]);
    }
  }
  return out;
}

}  // namespace fulcrum::server
