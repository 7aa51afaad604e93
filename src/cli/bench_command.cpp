// `fulcrum bench`: `bench moe` (the GPU MoE layer, src/bench_moe/) and, with the server, `bench serve`.
#include <memory>

#include "bench_moe/moe_bench.hpp"
#include "cli/commands.hpp"
#include "cli/gpu_commands.hpp"
#include "eplb/error.hpp"
#ifdef FULCRUM_WITH_NCCL
#include "engine/multi_process_run.hpp"
#endif

namespace fulcrum::cli {
namespace {

void run_bench_moe(const bench_moe::MoeBenchOptions& opt) {
  bench_moe::validate(opt);
#ifdef FULCRUM_WITH_CUDA
#ifdef FULCRUM_WITH_NCCL
  if (const auto me = engine::launched_rank()) return bench_moe::run_as_rank(opt, *me);
#endif
  bench_moe::check_visible_gpus(opt.gpus);
  if (opt.gpus == 1) return bench_moe::run_single_gpu(opt);
#ifdef FULCRUM_WITH_NCCL
  engine::launch_rank_processes(engine::DistFlags{}, opt.gpus, "cuda");  // each rank process runs this command again
#else
  throw Error("bench moe --gpus > 1 needs a build with NCCL (FULCRUM_ENABLE_CUDA and NCCL found)");
#endif
#else
  (void)opt;
  throw Error("bench moe runs on a GPU: this fulcrum was built without CUDA (cmake -DFULCRUM_ENABLE_CUDA=ON)");
#endif
}

void register_bench_moe_command(CLI::App& bench) {
  auto o = std::make_shared<bench_moe::MoeBenchOptions>();
  CLI::App* cmd = bench.add_subcommand("moe", "The bf16 GPU MoE layer at Qwen3 shapes: throughput, recorder, EP, migration");
  cmd->add_option("--loads", o->loads, "Load matrix CSV routing is drawn from (../shared/data/loads/*.csv)")->required();
  cmd->add_option("--models", o->models, "qwen3-30b-a3b and/or qwen3-235b-a22b")->capture_default_str();
  cmd->add_option("--tokens", o->tokens, "Batch sizes, tokens per forward (several GPUs: per rank)")->capture_default_str();
  cmd->add_option("--gpus", o->gpus, "GPUs: 1 (EP ranks simulated) or more (one process per GPU, NCCL)")
      ->capture_default_str()->check(CLI::Range(1, 64));
  cmd->add_option("--ep", o->ep, "Simulated EP ranks on one GPU (several GPUs: ignored, EP = --gpus)")
      ->capture_default_str()->check(CLI::Range(1, 128));
  cmd->add_option("--redundant", o->redundant, "EPLB redundant slots")->capture_default_str()->check(CLI::Range(0, 1024));
  cmd->add_option("--loads-layer", o->loads_layer, "Layer of the load matrix (default: the least balanced over the EP ranks)");
  cmd->add_option("--reps", o->reps, "Timed repetitions (median)")->capture_default_str()->check(CLI::Range(1, 10000));
  cmd->add_option("--warmup", o->warmup, "Untimed repetitions first")->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--passes", o->passes, "Several GPUs: forward passes per migration-inflation figure")
      ->capture_default_str()->check(CLI::Range(1, 10000));
  cmd->add_option("--layers-per-pass", o->layers_per_pass, "Several GPUs: MoE layer forwards per pass (0: the model's, 48 / 94)")
      ->capture_default_str()->check(CLI::Range(0, 1000));
  cmd->add_option("--migration-max-ctas", o->migration_max_ctas,
                  "Several GPUs: cap on the SMs the migration's NCCL kernels use (0: NCCL's choice)")
      ->capture_default_str()->check(CLI::Range(0, 64));
  cmd->add_option("--torch-peer", o->torch_peer,
                  "One GPU: PyTorch grouped_mm MoE peer script run after the timings on the same routing (auto: "
                  "bench/peer/torch_moe_peer.py when python3 imports torch; off: none)")
      ->capture_default_str();
  cmd->add_option("--json", o->json_path, "Write the results here (JSON; written whole or not at all)");
  cmd->add_option("--git-commit", o->git_commit, "Commit recorded in the JSON")->capture_default_str();
  cmd->callback([o] {
    o->command = command_line();
    run_bench_moe(*o);
  });
}

}  // namespace

void register_bench_command(CLI::App& app) {
  CLI::App* bench = app.add_subcommand("bench", "Benchmarks: the GPU MoE layer (moe), a running server (serve)");
  bench->require_subcommand(1);
  register_bench_moe_command(*bench);
#ifdef FULCRUM_WITH_CUDA
  register_bench_generate_command(*bench);
#endif
#ifdef FULCRUM_WITH_SERVER
  register_bench_serve_command(*bench);
#endif
}

}  // namespace fulcrum::cli
