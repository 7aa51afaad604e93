#include "server/engine_step_executor.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "eplb/error.hpp"
#include "comm/tcp_communicator.hpp"
#include "engine/rebuild_slots.hpp"
#include "eplb_runtime/slot_copy_executor.hpp"
#include "eplb/metrics.hpp"

namespace fulcrum::server {
namespace {

// Fault injection for the tests: a hook variable holds "N:MESH_RANK" (an epoch or a pass, and the rank it acts on).
// Read once per variable; unset or malformed: the hook never fires.
struct HookPoint {
  unsigned long long n = 0;
  int mesh_rank = -1;
};
std::optional<HookPoint> read_test_hook(const char* name) {
  const char* env = std::getenv(name);
  HookPoint at;
  if (env == nullptr || std::sscanf(env, "%llu:%d", &at.n, &at.mesh_rank) != 2) return std::nullopt;
  return at;
}
bool hook_fires(const std::optional<HookPoint>& at, uint64_t n, int mesh_rank) {
  return at && at->n == n && at->mesh_rank == mesh_rank;
}
// A hooked rank that stays alive (its heartbeats go on) and does nothing until rank 0 has expelled it.
void wait_until_expelled(const comm::PeerMesh& mesh) {
  while (!mesh.peer_failed(0)) std::this_thread::sleep_for(std::chrono::milliseconds(20));
}

// FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD=EPOCH:MESH_RANK makes that rank's process exit in the middle of its rebuild of
// that epoch (after the first collective of the new world), so the others' rebuild fails and is retried without it.
void exit_in_rebuild_if_told(uint64_t epoch, int mesh_rank) {
  static const std::optional<HookPoint> at = read_test_hook("FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD");
  if (!hook_fires(at, epoch, mesh_rank)) return;
  std::fprintf(stderr, "fulcrum serve: elastic: mesh rank %d exits during the rebuild of epoch %llu "
               "(FULCRUM_ELASTIC_TEST_EXIT_IN_REBUILD)\n", mesh_rank, at->n);
  std::fflush(stderr);
  std::_Exit(3);
}

// FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL=EPOCH:MESH_RANK makes that rank leave rank 0's roll call for the world of that
// epoch unanswered until rank 0 has expelled it (the hang of a rank whose main thread stopped making progress).
void stay_silent_in_roll_if_told(const comm::PeerMesh& mesh) {
  static const std::optional<HookPoint> at = read_test_hook("FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL");
  if (!hook_fires(at, mesh.epoch() + 1, mesh.rank())) return;
  std::fprintf(stderr, "fulcrum serve: elastic: mesh rank %d stays silent in the roll call of epoch %llu "
               "(FULCRUM_ELASTIC_TEST_SILENT_IN_ROLL)\n", at->mesh_rank, at->n);
  std::fflush(stderr);
  wait_until_expelled(mesh);
}

// FULCRUM_ELASTIC_TEST_STALL_IN_PASS=PASS:MESH_RANK makes that rank's work stop at the start of that forward pass
// while its process stays alive, until rank 0 has expelled it; then it fails.
void stall_in_pass_if_told(uint64_t pass_idx, const comm::PeerMesh& mesh) {
  static const std::optional<HookPoint> at = read_test_hook("FULCRUM_ELASTIC_TEST_STALL_IN_PASS");
  if (!hook_fires(at, pass_idx, mesh.rank())) return;
  std::fprintf(stderr, "fulcrum serve: elastic: mesh rank %d stalls in pass %llu "
               "(FULCRUM_ELASTIC_TEST_STALL_IN_PASS)\n", at->mesh_rank, at->n);
  std::fflush(stderr);
  wait_until_expelled(mesh);
  throw Error(fmt::format("mesh rank {} was expelled while it stalled", at->mesh_rank));
}

}  // namespace

template <class Attempt>
void EngineStepExecutor::on_world(Attempt&& attempt) {
  // A failure that recurs whatever the world (a bug, not a lost rank) must not spin forever.
  const int max_reforms = options_.elastic_mesh != nullptr ? options_.elastic_mesh->size() + 1 : 0;
  for (int reforms = 0;; ++reforms) {
    try {
      if (options_.elastic_mesh != nullptr) {
        for (const int r : options_.elastic_mesh->take_rejoined()) {
          elastic_log(fmt::format("rank {} rejoins: it comes into the next world", r));
          newcomers_.push_back(r);
          if (!rejoin_at_) rejoin_at_ = std::chrono::steady_clock::now();
        }
        if (!newcomers_.empty()) needs_reform_ = true;
      }
      if (needs_reform_) {
        reform_world();
        needs_reform_ = false;
        break;
      }
      attempt();
      return;
    } catch (const std::exception& e) {
      if (options_.elastic_mesh == nullptr) {
        if (dynamic_cast<const ExecutorFailure*>(&e) != nullptr) throw;
        throw ExecutorFailure(fmt::format("the engine's ranks stopped: {}", e.what()));
      }
      if (reforms >= max_reforms) {
        throw ExecutorFailure(fmt::format("elastic EP: {} recoveries in a row failed: {}", reforms, e.what()));
      }
      if (!fault_at_) {
        fault_at_ = std::chrono::steady_clock::now();
        elastic_log(fmt::format("fault detected by world rank 0: {}", e.what()));
      } else {
        elastic_log(fmt::format("world rank 0: the recovery failed, the roll is called again: {}", e.what()));
      }
      needs_reform_ = true;
    }
  }
  // The new world's ranks hold no sequence: the caller runs each again on pages of the new pools.
  const size_t dropped = live_.size();
  live_.clear();
  pending_releases_.clear();
  throw WorldReformed(fmt::format("elastic EP: a new world of {} rank(s) with empty KV pools; {} sequence(s) to run again",
                                  members_.size(), dropped));
}

EngineStepExecutor::EngineStepExecutor(EngineExecutorOptions options)
    : options_(std::move(options)), config_(model::load_qwen3_moe_config(options_.model_dir)) {
  layout_ = std::make_unique<engine::ParallelLayout>(options_.parallel, config_);
  num_kv_groups_ = layout_->attn_dp_size();
  engine::InProcessRun& run = options_.run;
  FULCRUM_CHECK(run.device == "cpu" || layout_->world_size() == 1,
                "--device {}: the parallel engine's ranks run on cpu only for now (this layout has {} ranks)",
                run.device, layout_->world_size());
  const int num_moe_layers = static_cast<int>(config_.moe_layer_indices().size());
  if (num_moe_layers > 0) {
    recorder_ = std::make_unique<RoutingCountRecorder>(num_moe_layers, config_.num_experts);
    run.engine.on_routing = [recorder = recorder_.get()](const engine::RoutingRecord& record) {
      recorder->record(record.moe_layer_idx, record.expert_ids, record.top_k);
    };
  }
  // With several EP ranks the balancedness gauges are worth having even without EPLB: record routing.
  run.record = run.record || layout_->ep() > 1;
  if (run.eplb.enabled) {
    run.eplb.log = options_.log ? options_.log : [](const std::string& line) {
      std::fprintf(stderr, "fulcrum serve: eplb: %s\n", line.c_str());
      std::fflush(stderr);
    };
  }
  initial_placement_ = engine::prepare_in_process_run(config_, *layout_, run);

  const int world_size = layout_->world_size();
  comm::Communicator* process_world = options_.process_world;
  if (process_world != nullptr) {
    // This process's rank only; the bar counts its own layers.
    FULCRUM_CHECK(process_world->size() == world_size, "the layout has {} ranks, the world {}", world_size,
                  process_world->size());
    world_ = process_world;
    if (options_.elastic_mesh != nullptr) {
      const std::string why = why_elastic_ep_cannot_run(options_.parallel, run.device);
      FULCRUM_CHECK(why.empty(), "{}", why);
      for (int r = 0; r < world_size; ++r) members_.push_back(r);
      group_hosts_ = members_;  // one KV group per rank
      launch_slots_per_rank_ = layout_->num_physical_experts() / layout_->ep();
      if (options_.elastic_mesh->joined_late()) {
        ranks_.resize(1);  // built by the rebuild of the world it is brought into (serve_as_worker)
        return;
      }
    }
    if (options_.metrics != nullptr) options_.metrics->set_live_ranks(world_size);
    run.on_layer_loaded = [&](int, int done, int total) {
      if (options_.on_layers_loaded) options_.on_layers_loaded(done, total);
    };
    ranks_.resize(1);
    try {
      ranks_[0] = engine::build_in_process_rank(options_.model_dir, config_, *layout_, run, initial_placement_,
                                                *process_world);
      if (options_.kv_pages > 0) ranks_[0].engine->model().reserve_kv_pool(options_.kv_pages, options_.page_size);
    } catch (const std::exception& e) {
      throw Error(fmt::format("loading {} on rank {} failed: {}", options_.model_dir, process_world->rank(), e.what()));
    }
    run.on_layer_loaded = nullptr;
    return;
  }
  ranks_.resize(static_cast<size_t>(world_size));
  threads_ = std::make_unique<engine::RankThreads>(world_size);
  std::mutex progress_mutex;
  const int layers_total = layout_->tp() * config_.num_hidden_layers;  // each stage's tp ranks load its layers
  std::vector<int> layers_done(static_cast<size_t>(world_size), 0);
  run.on_layer_loaded = [&](int rank, int done, int) {
    std::lock_guard lock(progress_mutex);
    layers_done[static_cast<size_t>(rank)] = done;
    int sum = 0;
    for (const int d : layers_done) sum += d;
    if (options_.on_layers_loaded) options_.on_layers_loaded(sum, layers_total);
  };
  try {
    threads_->run([&](int rank, comm::Communicator& world) {
      ranks_[static_cast<size_t>(rank)] =
          engine::build_in_process_rank(options_.model_dir, config_, *layout_, run, initial_placement_, world);
      if (options_.kv_pages > 0) {
        ranks_[static_cast<size_t>(rank)].engine->model().reserve_kv_pool(options_.kv_pages, options_.page_size);
      }
    });
  } catch (const std::exception& e) {
    throw Error(fmt::format("loading {} on {} rank(s) failed: {}", options_.model_dir, world_size, e.what()));
  }
  run.on_layer_loaded = nullptr;  // it refers to this constructor's locals
}

EngineStepExecutor::~EngineStepExecutor() {
  if (threads_ == nullptr) {
    if (options_.process_world != nullptr && world_->rank() == 0) {
      try {
        RankCommand stop{.kind = RankCommand::Kind::kStop};
        broadcast_command(*world_, stop);
      } catch (const std::exception&) {
        // a rank already gone; the others see rank 0 leave
      }
    }
    engine::InProcessRank& r = ranks_.at(0);
    r.eplb.reset();
    r.engine.reset();
    r.backend.reset();
    return;
  }
  // Each rank's state is destroyed on its own thread (a device backend belongs to the thread that made it).
  try {
    threads_->run_local([this](int rank, comm::Communicator&) {
      engine::InProcessRank& r = ranks_[static_cast<size_t>(rank)];
      r.eplb.reset();  // users of the backend first, the backend last
      r.engine.reset();
      r.backend.reset();
    });
  } catch (const std::exception&) {
    // the ranks already stopped after a failure; their state goes with this object
  }
}

int64_t EngineStepExecutor::max_sequence_length() const {
  const int n = config_.max_position_embeddings;
  return n > 0 ? n : int64_t{1} << 20;
}

void EngineStepExecutor::allocate(SequenceId id, int64_t capacity) {
  add_on_ranks({.kind = RankCommand::Kind::kAdd, .id = id, .capacity = capacity});
}

void EngineStepExecutor::allocate_on_pages(SequenceId id, const model::SequencePages& pages) {
  FULCRUM_CHECK(pages.dp_group >= 0 && pages.dp_group < num_kv_groups(), "sequence {}: attention-DP group {} outside [0, {})",
                id, pages.dp_group, num_kv_groups());
  FULCRUM_CHECK(pages.num_cached_tokens >= 0 && pages.num_cached_tokens < pages.capacity,
                "sequence {}: {} cached positions of {}", id, pages.num_cached_tokens, pages.capacity);
  add_on_ranks({.kind = RankCommand::Kind::kAddOnPages, .id = id, .capacity = pages.capacity, .dp_group = pages.dp_group,
                .page_ids = {pages.page_ids.begin(), pages.page_ids.end()}, .num_cached_tokens = pages.num_cached_tokens,
                .copy_source_page = pages.copy_source_page});
  live_.at(id).num_tokens = pages.num_cached_tokens;
}

void EngineStepExecutor::apply_add(engine::InProcessRank& me, const RankCommand& add) {
  engine::RankEngine& engine = *me.engine;
  for (const SequenceId r : add.releases) engine.drop_sequence(r);
  if (add.kind == RankCommand::Kind::kAdd) {
    engine.add_sequence(add.id, add.capacity, add.dp_group);
  } else {
    engine.add_sequence_on_pages(add.id, add.capacity, add.dp_group, add.page_ids, add.num_cached_tokens,
                                 add.copy_source_page);
  }
}

void EngineStepExecutor::add_collectively(const RankCommand& add) {
  engine::InProcessRank& me = ranks_.at(0);
  std::string error;
  try {
    apply_add(me, add);
  } catch (const std::exception& e) {
    error = e.what();
  }
  std::vector<std::string> errors;
  try {
    errors = gather_errors(*world_, error);
  } catch (const std::exception& e) {
    throw ExecutorFailure(fmt::format("the engine's ranks stopped: {}", e.what()));
  }
  for (size_t r = 0; r < errors.size(); ++r) {
    if (errors[r].empty()) continue;
    me.engine->drop_sequence(add.id);
    throw Error(r == 0 ? errors[r] : fmt::format("rank {}: {}", r, errors[r]));
  }
}

void EngineStepExecutor::add_on_ranks(RankCommand add) {
  const SequenceId id = add.id;
  FULCRUM_CHECK(!live_.contains(id), "sequence {} is already allocated", id);
  FULCRUM_CHECK(add.capacity > 0 && add.capacity <= max_sequence_length(), "sequence {}: capacity {} outside [1, {}]", id,
                add.capacity, max_sequence_length());
  add.releases = std::move(pending_releases_);
  pending_releases_.clear();
  if (threads_ == nullptr) {
    const int kv_group = add.dp_group;
    std::optional<Error> refused;  // the sequence's own error (e.g. no room), not the world's
    on_world([&] {
      RankCommand sent = add;
      if (options_.elastic_mesh != nullptr) {  // the KV group's host, and its pages within the host's pool
        const int group = kv_group >= 0 ? kv_group : static_cast<int>(id % num_kv_groups_);
        sent.dp_group = physical_group(group);
        if (sent.kind == RankCommand::Kind::kAddOnPages) {
          const int32_t offset = page_offset(group);
          for (int32_t& page : sent.page_ids) page += offset;
          if (sent.copy_source_page >= 0) sent.copy_source_page += offset;
        }
      }
      broadcast_command(*world_, sent);
      try {
        add_collectively(sent);
      } catch (const ExecutorFailure&) {
        throw;
      } catch (const Error& e) {
        refused = e;
      }
    });
    if (refused) throw *refused;
    live_.emplace(id, Capacity{add.capacity, 0, kv_group >= 0 ? kv_group : static_cast<int>(id % num_kv_groups_)});
    return;
  }
  const std::vector<std::exception_ptr> errors =
      threads_->run_local([&](int rank, comm::Communicator&) { apply_add(ranks_[static_cast<size_t>(rank)], add); });
  for (const std::exception_ptr& error : errors) {
    if (!error) continue;
    threads_->run_local([&](int rank, comm::Communicator&) { ranks_[static_cast<size_t>(rank)].engine->drop_sequence(id); });
    std::rethrow_exception(error);
  }
  live_.emplace(id, Capacity{add.capacity, 0, add.dp_group});
}

void EngineStepExecutor::release(SequenceId id) {
  if (live_.erase(id) > 0) pending_releases_.push_back(id);
}

model::StepOutput EngineStepExecutor::step(std::span<const model::StepSequence> batch) {
  RankCommand pass{.kind = RankCommand::Kind::kPass};
  for (const model::StepSequence& in : batch) {
    const auto it = live_.find(in.id);
    FULCRUM_CHECK(it != live_.end(), "step: sequence {} is not allocated", in.id);
    FULCRUM_CHECK(!in.token_ids.empty(), "step: sequence {} has no new token", in.id);
    FULCRUM_CHECK(it->second.num_tokens + static_cast<int64_t>(in.token_ids.size()) <= it->second.capacity,
                  "step: sequence {} would exceed its capacity {}", in.id, it->second.capacity);
    for (const SequenceId seen : pass.batch_ids) FULCRUM_CHECK(seen != in.id, "step: sequence {} twice", in.id);
    const int64_t n_pred = static_cast<int64_t>(in.token_ids.size()) - (in.sample ? 1 : 0);
    FULCRUM_CHECK(static_cast<int64_t>(in.prompt_targets.size()) <= n_pred,
                  "step: sequence {} has {} prompt targets for {} predicting rows", in.id, in.prompt_targets.size(), n_pred);
    // The sampling row and the prompt rows asked for (the last ones of the chunk).
    const auto rows = static_cast<int64_t>(in.prompt_targets.size()) + (in.sample ? 1 : 0);
    pass.batch_ids.push_back(in.id);
    pass.batch_tokens.emplace_back(in.token_ids.begin(), in.token_ids.end());
    pass.batch_last_rows.push_back(std::max<int64_t>(rows, 1));
  }
  pass.releases = std::move(pending_releases_);
  pending_releases_.clear();
  pass.pass_idx = num_passes_++;
  pass.record_routing = recorder_ != nullptr && recorder_->recording();
  std::vector<std::vector<float>> logits;
  if (threads_ == nullptr) {
    on_world([&] { run_pass(pass, logits); });
  } else {
    try {
      run_pass(pass, logits);
    } catch (const std::exception& e) {
      throw ExecutorFailure(fmt::format("the engine's ranks stopped: {}", e.what()));
    }
  }
  for (const model::StepSequence& in : batch) {
    Capacity& c = live_.at(in.id);
    c.num_tokens += static_cast<int64_t>(in.token_ids.size());
  }
  if (fault_at_) {  // the first completed step since the fault
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - *fault_at_).count();
    fault_at_.reset();
    elastic_log(fmt::format("recovered in {:.3f} s (fault detected -> first completed step), {} live rank(s)", seconds,
                            members_.size()));
    if (options_.metrics != nullptr) options_.metrics->add_elastic_recovery(seconds);
  }
  if (rejoin_at_) {
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - *rejoin_at_).count();
    rejoin_at_.reset();
    elastic_log(fmt::format("rejoin done in {:.3f} s (newcomer taken -> first completed step), {} live rank(s)", seconds,
                            members_.size()));
  }
  FULCRUM_CHECK(logits.size() == batch.size(), "step: {} logit rows for {} entries", logits.size(), batch.size());
  model::StepOutput out = model::make_step_output(batch.size());
  const size_t vocab = static_cast<size_t>(config_.vocab_size);
  for (size_t i = 0; i < batch.size(); ++i) {  // [rows, vocab_size] each: prompt rows, then the sampling row
    const std::span<const float> rows(logits[i]);
    const size_t num_prompt = batch[i].prompt_targets.size();
    try {
      model::prompt_entry(rows.first(num_prompt * vocab), batch[i], out, i);
    } catch (const std::exception& e) {
      out.errors[i] = e.what();
      continue;
    }
    if (batch[i].sample) model::sample_entry(rows.last(vocab), batch[i], out, i);
  }
  return out;
}

void EngineStepExecutor::run_pass(const RankCommand& pass, std::vector<std::vector<float>>& logits) {
  if (threads_ == nullptr) {
    RankCommand sent = pass;
    broadcast_command(*world_, sent);
    apply_pass(ranks_.at(0), 0, *world_, pass, &logits);
    return;
  }
  threads_->run([&](int rank, comm::Communicator& world) {
    apply_pass(ranks_[static_cast<size_t>(rank)], rank, world, pass, rank == 0 ? &logits : nullptr);
  });
}

void EngineStepExecutor::apply_pass(engine::InProcessRank& me, int rank, comm::Communicator& world,
                                    const RankCommand& pass, std::vector<std::vector<float>>* logits) {
  // Elastic EP: a pass's waits must see progress within --elastic-ep-timeout (comm/peer_mesh.hpp).
  std::optional<comm::PeerMesh::BoundedWaits> bounded;
  if (options_.elastic_mesh != nullptr) {
    bounded.emplace(*options_.elastic_mesh);
    stall_in_pass_if_told(pass.pass_idx, *options_.elastic_mesh);
  }
  for (const SequenceId r : pass.releases) me.engine->drop_sequence(r);
  std::vector<engine::SequenceTokens> batch;
  batch.reserve(pass.batch_ids.size());
  for (size_t i = 0; i < pass.batch_ids.size(); ++i) {
    batch.push_back({pass.batch_ids[i], pass.batch_tokens[i], pass.batch_last_rows[i]});
  }
  const bool worker_process = threads_ == nullptr && rank != 0;
  if (worker_process && recorder_ != nullptr && pass.record_routing != recorder_->recording()) {
    pass.record_routing ? recorder_->start() : recorder_->stop();  // follow rank 0's endpoints
  }
  std::vector<model::HostTensor> out = me.engine->forward(batch, engine::LogitRows::kLast);
  if (rank == 0) {
    logits->resize(out.size());
    for (size_t i = 0; i < out.size(); ++i) (*logits)[i] = std::move(out[i].data);
  }
  // Ranks as processes: rank 0's recorder gets every rank's counts of this pass (each token once).
  if (threads_ == nullptr && pass.record_routing && recorder_ != nullptr) {
    if (rank != 0) {
      const std::vector<int64_t> counts = recorder_->take_counts();
      world.send(comm::bytes_of(std::span<const int64_t>(counts)), 0);
    } else {
      std::vector<int64_t> counts(static_cast<size_t>(recorder_->num_values()));
      for (int r = 1; r < world.size(); ++r) {
        world.recv(comm::writable_bytes_of(std::span<int64_t>(counts)), r);
        recorder_->add_counts(counts);
      }
    }
  }
  if (me.eplb == nullptr) return;
  const eplb_runtime::PassOutcome outcome = me.eplb->after_forward_pass();
  ServerMetrics* metrics = options_.metrics;
  // Every rank takes the same branch (the outcome and the pass count are the same everywhere); metrics live
  // with rank 0, so with ranks as processes every rank refreshes whether or not rank 0 keeps metrics.
  if (metrics == nullptr && threads_ != nullptr) return;
  if (rank == 0 && metrics != nullptr && outcome.rebalance && !outcome.rebalance->skipped) {
    metrics->add_eplb_rebalance(outcome.rebalance->num_bytes_moved);
  }
  if (outcome.rebalance || !outcome.switched_layers.empty() || (pass.pass_idx + 1) % kRefreshPasses == 0) {
    const eplb::LoadMatrix window = me.eplb->merged_window_loads();
    if (rank == 0 && metrics != nullptr) {
      const eplb::PlacementReport report = eplb::evaluate_placement(me.eplb->live_placement(), window);
      metrics->set_eplb_balancedness(report.balancedness_per_layer, report.balancedness_mean);
    }
  }
}

void EngineStepExecutor::serve_as_worker() {
  FULCRUM_CHECK(threads_ == nullptr && world_->rank() != 0, "serve_as_worker: only a worker rank process runs it");
  if (options_.elastic_mesh != nullptr && options_.elastic_mesh->joined_late()) join_next_world();
  for (;;) {
    try {
      RankCommand command;
      broadcast_command(*world_, command);
      switch (command.kind) {
        case RankCommand::Kind::kStop:
          return;
        case RankCommand::Kind::kAdd:
        case RankCommand::Kind::kAddOnPages:
          try {
            add_collectively(command);
          } catch (const ExecutorFailure&) {
            throw;
          } catch (const Error&) {
            // rank 0 reports it; the sequence was dropped everywhere
          }
          break;
        case RankCommand::Kind::kPass:
          apply_pass(ranks_.at(0), world_->rank(), *world_, command, nullptr);
          break;
      }
    } catch (const std::exception& e) {
      if (options_.elastic_mesh == nullptr) throw;
      // Which rank found the fault is a race: the one that did says what it found (rank 0 logs its own view).
      elastic_log(fmt::format("mesh rank {} leaves the world of epoch {}: {}", options_.elastic_mesh->rank(),
                              options_.elastic_mesh->epoch(), e.what()));
      join_next_world();
    }
  }
}

void EngineStepExecutor::join_next_world() {
  // Answer rank 0's roll call and rebuild, until a rebuild completes (a failure during one: again).
  for (;;) {
    stay_silent_in_roll_if_told(*options_.elastic_mesh);
    const NewWorld next = answer_the_roll(*options_.elastic_mesh);  // throws when rank 0 is gone
    try {
      rebuild(next);
      return;
    } catch (const std::exception& again) {
      elastic_log(fmt::format("mesh rank {}: the rebuild of epoch {} failed: {}", options_.elastic_mesh->rank(),
                              next.epoch, again.what()));
    }
  }
}

int EngineStepExecutor::physical_group(int kv_group) const {
  if (options_.elastic_mesh == nullptr) return kv_group;
  const int host = group_hosts_.at(static_cast<size_t>(kv_group));
  return static_cast<int>(std::find(members_.begin(), members_.end(), host) - members_.begin());
}

int32_t EngineStepExecutor::page_offset(int kv_group) const {
  FULCRUM_CHECK(options_.kv_pages > 0, "elastic EP needs a fixed KV pool (--kv-pages)");
  const int host = group_hosts_.at(static_cast<size_t>(kv_group));
  const auto before = std::count(group_hosts_.begin(), group_hosts_.begin() + kv_group, host);
  return static_cast<int32_t>(before * options_.kv_pages);
}

void EngineStepExecutor::elastic_log(const std::string& line) const {
  const std::string text = "elastic: " + line;
  if (options_.log) {
    options_.log(text);
  } else {
    std::fprintf(stderr, "fulcrum serve: %s\n", text.c_str());
    std::fflush(stderr);
  }
}

void EngineStepExecutor::reform_world() {
  comm::PeerMesh& mesh = *options_.elastic_mesh;
  std::vector<int> called = members_;
  called.insert(called.end(), newcomers_.begin(), newcomers_.end());
  std::sort(called.begin(), called.end());
  called.erase(std::unique(called.begin(), called.end()), called.end());
  std::vector<int> silent;
  const std::vector<int> answered = call_the_roll(mesh, called, newcomers_, &silent);
  if (!silent.empty()) {
    elastic_log(fmt::format("rank(s) {} alive but without an answer to the roll call within {:.1f} s "
                            "(--elastic-ep-timeout): expelled",
                            fmt::join(silent, ", "), mesh.liveness_timeout().count() / 1000.0));
  }
  std::vector<int> lost, rejoined;
  for (const int m : members_) {
    if (std::find(answered.begin(), answered.end(), m) == answered.end()) lost.push_back(m);
  }
  for (const int m : newcomers_) {
    if (std::find(answered.begin(), answered.end(), m) != answered.end()) rejoined.push_back(m);
  }
  newcomers_.clear();  // one that did not answer has failed again: it may rejoin again
  if (rejoined.empty()) rejoin_at_.reset();
  NewWorld next{.epoch = mesh.epoch() + 1, .members = answered, .group_hosts = rehome_groups(group_hosts_, answered)};
  next.num_physical_experts = layout_->num_physical_experts() > 0
                                  ? surviving_physical_experts(config_.num_experts, launch_slots_per_rank_,
                                                               static_cast<int>(answered.size()))
                                  : 0;
  elastic_log(fmt::format("new world (epoch {}): ranks {} of the {} launched{}{}", next.epoch, fmt::join(answered, ", "),
                          mesh.size(), lost.empty() ? "" : fmt::format(", without rank(s) {}", fmt::join(lost, ", ")),
                          rejoined.empty() ? "" : fmt::format(", rank(s) {} rejoined", fmt::join(rejoined, ", "))));
  announce_new_world(mesh, next);
  // Between the announcement and the new epoch nothing may throw: the others already wait in the new world, and a
  // roll called again in the old epoch would never reach them. The line is only a log line.
  std::string last_replicas;
  try {
    last_replicas = describe_lost_last_replicas(answered, lost);
  } catch (const std::exception& e) {
    last_replicas = fmt::format("the logical experts that lost their last replica could not be counted: {}", e.what());
  }
  rebuild(next);
  if (!last_replicas.empty()) elastic_log(last_replicas);
  std::vector<std::string> moved;
  for (size_t g = 0; g < next.group_hosts.size(); ++g) {
    if (next.group_hosts[g] != static_cast<int>(g)) moved.push_back(fmt::format("{} -> rank {}", g, next.group_hosts[g]));
  }
  elastic_log(fmt::format("re-planned onto {} (the default planner on the survivors' recorded loads; every expert "
                          "kept; its slots from surviving replicas where one holds it); KV groups moved: {}",
                          layout_->describe(), moved.empty() ? "none" : fmt::format("{}", fmt::join(moved, ", "))));
  if (options_.metrics != nullptr) options_.metrics->set_live_ranks(static_cast<int>(members_.size()));
}

std::string EngineStepExecutor::describe_lost_last_replicas(const std::vector<int>& answered,
                                                            const std::vector<int>& lost) const {
  if (layout_->num_physical_experts() == 0 || lost.empty()) return "";
  // The placement dispatch ran on (during a migration: switched layers new, the others old; a layer being
  // copied is switched only once complete). EP rank i of the layout is mesh rank members_[i].
  const engine::InProcessRank& me = ranks_.at(0);
  eplb::Placement placement = me.eplb != nullptr ? me.eplb->live_placement() : initial_placement_;
  placement.topology.num_gpus = layout_->ep();
  std::vector<bool> survives(static_cast<size_t>(layout_->ep()), false);
  for (int r = 0; r < layout_->world_size(); ++r) {
    const int mesh_rank = members_.at(static_cast<size_t>(r));
    if (std::find(answered.begin(), answered.end(), mesh_rank) != answered.end()) {
      survives[static_cast<size_t>(layout_->coords(r).ep_rank)] = true;
    }
  }
  const std::vector<int> per_layer = experts_without_surviving_replica(placement, survives);
  int total = 0;
  for (const int n : per_layer) total += n;
  return fmt::format("{} logical expert(s) lost their last replica with rank(s) {} (per MoE layer: {}); reloaded "
                     "from the checkpoint, the re-planned placement's other slots from surviving replicas",
                     total, fmt::join(lost, ", "), fmt::join(per_layer, ", "));
}

void EngineStepExecutor::rebuild(const NewWorld& next) {
  const std::shared_ptr<comm::PeerMesh>& mesh = options_.elastic_mesh;
  mesh->begin_epoch(next.epoch, next.members);
  std::unique_ptr<comm::Communicator> world = comm::TcpCommunicator::over_members(mesh, next.members, next.epoch);
  const int n = world->size();
  const int num_moe_layers = static_cast<int>(config_.moe_layer_indices().size());
  // The loads the survivors recorded (their own windows, summed over the new world: the same everywhere).
  // After a failed rebuild the old rank is gone: its loads were kept with its expert copies.
  engine::InProcessRank& old = ranks_.at(0);
  if (old.eplb != nullptr) held_loads_ = old.eplb->own_window_loads();
  eplb::LoadMatrix loads = held_loads_.value_or(eplb::LoadMatrix(num_moe_layers, config_.num_experts));
  std::vector<float> sums(loads.values.begin(), loads.values.end());
  world->all_reduce_sum(sums);
  std::copy(sums.begin(), sums.end(), loads.values.begin());
  exit_in_rebuild_if_told(next.epoch, mesh->rank());
  // This process's expert slots as they are (a rank that rejoins holds none; after a failed rebuild, no rank: the
  // copies of the last one that ran are still held): the new slots come from them and the other survivors'
  // before the checkpoint. The old rank refers to the old world, layout and placement: it goes next.
  if (old.engine != nullptr) {
    held_ = std::make_unique<engine::HeldExperts>(
        engine::keep_held_experts(old.backend.get(), old.engine->model().expert_slot_views(), num_moe_layers));
  } else if (held_ == nullptr) {
    held_ = std::make_unique<engine::HeldExperts>(engine::keep_held_experts(nullptr, {}, num_moe_layers));
  }
  old.eplb.reset();
  old.engine.reset();
  old.backend.reset();
  // The new world's layout and placement stay local until the rebuild completes: a rebuild that fails (another
  // rank lost meanwhile) leaves members_, layout_, group_hosts_ and initial_placement_ those of the last world
  // that served, which the next roll call and its log lines are about.
  auto layout = std::make_unique<engine::ParallelLayout>(
      surviving_flags(options_.parallel, config_.num_experts, next.num_physical_experts, n), config_);
  std::optional<engine::HeldTable> holders;  // who holds which expert, over the new world
  if (num_moe_layers > 0) holders = engine::gather_held(*held_, config_.num_experts, *world);
  eplb::Placement placement;
  if (num_moe_layers > 0) {  // planned from what the new world holds: slots stay where a copy already is
    const eplb::Topology topology{next.num_physical_experts, n, 1};
    const eplb::Placement held = engine::held_placement(*holders, topology);
    placement = engine::align_to_held(replan_placement(loads, next.num_physical_experts, n, &held), *holders);
  }
  engine::InProcessRun run = options_.run;
  run.weight_cache_dir.clear();  // its files are the old layout's ranks
  run.on_layer_loaded = nullptr;
  // Non-expert weights from the checkpoint (their shards follow the world size); expert slots from a copy this
  // process holds, else from the lowest-ranked survivor holding one, else (no replica survived) the checkpoint.
  std::optional<engine::RebuildSlotPlan> plan;
  if (num_moe_layers > 0) {
    plan = engine::plan_rebuild_slots(placement, *holders);
    run.read_expert_slot = [&plan, rank = world->rank()](int moe_layer_idx, int local_slot) {
      return plan->reads_from_checkpoint(rank, moe_layer_idx, local_slot);
    };
  }
  try {
    old = engine::build_in_process_rank(options_.model_dir, config_, *layout, run, placement, *world);
    if (plan) engine::fill_rebuild_slots(*plan, *held_, *old.backend, old.engine->model().expert_slot_views(), *world);
  } catch (const std::exception&) {
    old.eplb.reset();  // half-filled slots are no copy to keep: the next rebuild uses held_ again
    old.engine.reset();
    old.backend.reset();
    throw;
  }
  held_.reset();
  held_loads_.reset();
  elastic_world_ = std::move(world);
  world_ = elastic_world_.get();
  members_ = next.members;
  group_hosts_ = next.group_hosts;
  layout_ = std::move(layout);
  initial_placement_ = std::move(placement);
  if (plan) {
    const std::vector<model::ExpertSlotView> views = old.engine->model().expert_slot_views();
    if (world_->rank() == 0 && !views.empty()) {
      elastic_log(fmt::format("expert slots of epoch {}'s world: {} copied locally, {} received from surviving "
                              "replicas ({} bytes), {} copied from the rank's first slot of the same expert, {} read "
                              "from the checkpoint ({} logical expert(s) held by no survivor); non-expert weights read "
                              "from the checkpoint",
                              next.epoch, plan->num_local, plan->num_received,
                              plan->num_received * eplb_runtime::slot_bytes(views.front()), plan->num_copied,
                              plan->num_from_checkpoint, plan->num_experts_from_checkpoint));
    }
  }
  const int64_t hosted = std::count(group_hosts_.begin(), group_hosts_.end(), mesh->rank());
  if (options_.kv_pages > 0) old.engine->model().reserve_kv_pool(options_.kv_pages * std::max<int64_t>(hosted, 1), options_.page_size);
}

}  // namespace fulcrum::server
