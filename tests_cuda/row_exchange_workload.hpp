#pragma once
// The MoE token exchange's rows on a 2-GPU world of rank processes, shared by the test of the device row path
// (nccl_row_exchange_test.cpp) and the benchmark that times it (bench/cuda/nccl_bench.cpp): one dispatcher
// (allgather or alltoall) run once with the host-staged rows and once with the device rows
// (comm::NcclRowExchange) on the same inputs, each run one dispatch, a stand-in expert (out = 2 * row for the
// entries of this rank's slots) and one combine. No gtest here: callers check the results their own way.
#include <algorithm>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/cuda_backend.hpp"
#include "comm/nccl_communicator.hpp"
#include "comm/nccl_row_exchange.hpp"
#include "engine/token_dispatcher.hpp"

namespace fulcrum::test {

struct RowExchangeShape {
  int64_t tokens = 0;  // per rank
  int top_k = 0;
  int hidden = 0;
  int num_experts = 0;
  int ranks_per_ep_rank = 1;  // M: 2 makes both ranks hold every slot, so combine sums 2 partials
};

// This rank's tokens [tokens, hidden] (values a function of rank and index), each with top_k distinct experts
// ascending (the engine's entry order); entry i is (token[i], expert[i]).
struct RowExchangeInputs {
  std::vector<float> host_x;
  model::Tensor x;
  std::vector<int32_t> token;
  std::vector<int32_t> expert;
};

inline RowExchangeInputs row_exchange_inputs(backend::CudaBackend& backend, int rank, const RowExchangeShape& shape) {
  RowExchangeInputs in;
  in.host_x.resize(static_cast<size_t>(shape.tokens * shape.hidden));
  for (size_t i = 0; i < in.host_x.size(); ++i) {
    in.host_x[i] = static_cast<float>((i * 2654435761u + rank * 97u) % 1000003u) * 1e-3f - 500.0f;
  }
  in.x = backend.zeros({shape.tokens, int64_t{shape.hidden}});
  backend.upload(in.x, in.host_x);
  for (int64_t t = 0; t < shape.tokens; ++t) {
    for (int j = 0; j < shape.top_k; ++j) {
      in.token.push_back(static_cast<int32_t>(t));
      in.expert.push_back(
          static_cast<int32_t>((t * 7 + rank * 3 + j * (shape.num_experts / shape.top_k)) % shape.num_experts));
    }
    std::sort(in.expert.end() - shape.top_k, in.expert.end());
  }
  return in;
}

struct ExchangeResult {
  std::vector<float> rows;      // dispatched rows
  std::vector<float> combined;  // combined outputs [my entries, hidden]
  double seconds = 0;           // dispatch + combine, best of the timed repetitions
};

// `repetitions` times: one dispatch, the stand-in expert, one combine; the results of the first.
inline ExchangeResult exchange(engine::TokenDispatcher& dispatcher, backend::CudaBackend& backend,
                               const RowExchangeInputs& in, int rank, const RowExchangeShape& shape, int repetitions) {
  const int ep_ranks = 2 / shape.ranks_per_ep_rank;
  const int slots_per_ep_rank = shape.num_experts / ep_ranks;
  const int first_slot = rank / shape.ranks_per_ep_rank * slots_per_ep_rank;
  ExchangeResult result;
  result.seconds = 1e30;
  for (int rep = 0; rep < repetitions; ++rep) {
    backend.synchronize();
    const auto start = std::chrono::steady_clock::now();
    engine::DispatchedTokens d = dispatcher.dispatch(in.x, in.token, in.expert, in.expert);  // slot = expert
    std::vector<int32_t> entries, rows;
    for (size_t i = 0; i < d.expert.size(); ++i) {
      if (d.expert[i] >= first_slot && d.expert[i] < first_slot + slots_per_ep_rank) {
        entries.push_back(static_cast<int32_t>(i));
        rows.push_back(d.entry_row[i]);
      }
    }
    const model::Tensor outputs = backend.zeros({static_cast<int64_t>(d.expert.size()), int64_t{shape.hidden}});
    if (!entries.empty()) {
      const model::Tensor mine = backend.gather_rows(d.rows, rows);
      backend.add_inplace(mine, mine);
      backend.scatter_rows(outputs, mine, entries);
    }
    const model::Tensor combined = dispatcher.combine(outputs);
    backend.synchronize();
    result.seconds =
        std::min(result.seconds, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (rep == 0) {
      result.rows = backend.download(d.rows);
      result.combined = backend.download(combined);
    }
  }
  return result;
}

// Both row paths of the dispatcher `name` on the same inputs.
struct BothPaths {
  ExchangeResult host;    // host-staged rows (download, host collective, upload)
  ExchangeResult device;  // device rows
  std::string device_path;  // what the device dispatcher's row exchange calls itself
  int64_t device_calls = 0;  // row collectives the device dispatcher made
};

inline BothPaths run_both_paths(const std::string& name, comm::NcclCommunicator& world, backend::CudaBackend& backend,
                                const RowExchangeInputs& in, const RowExchangeShape& shape, int repetitions) {
  const int ep_ranks = 2 / shape.ranks_per_ep_rank;
  auto make = [&](bool device) {
    std::unique_ptr<engine::RowExchange> rows;
    if (device) rows = std::make_unique<comm::NcclRowExchange>(backend, world);
    else rows = engine::make_host_row_exchange(world, backend);
    return engine::make_token_dispatcher(name, world, backend, shape.hidden, shape.num_experts / ep_ranks,
                                         shape.ranks_per_ep_rank, std::move(rows));
  };
  auto host_dispatcher = make(false), device_dispatcher = make(true);
  BothPaths out;
  out.host = exchange(*host_dispatcher, backend, in, world.rank(), shape, repetitions);
  out.device = exchange(*device_dispatcher, backend, in, world.rank(), shape, repetitions);
  out.device_path = std::string(device_dispatcher->row_exchange().path());
  out.device_calls = device_dispatcher->row_exchange().calls();
  return out;
}

}  // namespace fulcrum::test
