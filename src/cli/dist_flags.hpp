#pragma once
// The flags of ranks as processes (SGLang's names), shared by `generate` and `serve`.
#include <CLI/CLI.hpp>

#include "engine/multi_process_run.hpp"

namespace fulcrum::cli {

inline void add_dist_flags(CLI::App* cmd, engine::DistFlags& dist) {
  cmd->add_option("--nnodes", dist.nnodes, "Nodes the ranks spread over; start one command per node")->capture_default_str();
  cmd->add_option("--node-rank", dist.node_rank, "This node's index in [0, --nnodes)")->capture_default_str();
  cmd->add_option("--dist-init-addr", dist.dist_init_addr,
                  "HOST:PORT of node 0, where world rank 0 serves the rendezvous (default: a free local port)");
  cmd->add_option("--dist-timeout", dist.dist_timeout_s, "Seconds the rendezvous waits for every rank")
      ->capture_default_str();
  cmd->add_flag("--multi-process", dist.multi_process,
                "Ranks as processes (TCP between them) with --device cpu; always so with cuda and several ranks");
}

}  // namespace fulcrum::cli
