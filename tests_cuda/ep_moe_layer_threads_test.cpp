// The expert-parallel MoE layer (backend::EpMoeLayer) with its 2 ranks as threads sharing one GPU, the rows staged
// through host memory (comm::HostStagedExchange over comm::run_in_process): the cases and tolerances of
// ep_moe_layer_check.hpp, which the NCCL test runs on 2 GPUs. So the EP layer, and the GPU engine's EP ranks built
// on it, run on a machine with one GPU, where NCCL refuses two ranks of a communicator on one device.
#include <gtest/gtest.h>

#include "comm/host_staged_exchange.hpp"
#include "comm/in_process_communicator.hpp"
#include "ep_moe_layer_check.hpp"

namespace fulcrum::test {
namespace {

TEST(EpMoeLayerThreads, MatchesReferenceAndOneGpuLayer) {
  comm::run_in_process(kWorld, [](int /*rank*/, comm::Communicator& comm) {
    FULCRUM_CUDA_CHECK(cudaSetDevice(0));
    comm::HostStagedExchange exchange(comm, 0);
    check_every_ep_case(exchange, 0);
  });
}

// The staged exchange alone: rank r sends (r + 1) * (d + 1) bytes of value 16 r + d to rank d; what each rank
// receives, in rank order, and the refusal of counts of another length.
TEST(HostStagedExchange, MovesDeviceRowsBetweenThreads) {
  comm::run_in_process(3, [](int rank, comm::Communicator& comm) {
    FULCRUM_CUDA_CHECK(cudaSetDevice(0));
    comm::HostStagedExchange exchange(comm, 0);
    const int w = exchange.size();
    std::vector<int64_t> send_counts(w), recv_counts(w);
    std::vector<std::byte> send;
    for (int d = 0; d < w; ++d) {
      send_counts[d] = int64_t{rank + 1} * (d + 1);
      recv_counts[d] = int64_t{d + 1} * (rank + 1);
      send.insert(send.end(), static_cast<size_t>(send_counts[d]), static_cast<std::byte>(16 * rank + d));
    }
    std::vector<std::byte> expected;
    for (int s = 0; s < w; ++s) expected.insert(expected.end(), static_cast<size_t>(recv_counts[s]), static_cast<std::byte>(16 * s + rank));
    backend::DeviceBuffer d_send(send.size()), d_recv(expected.size());
    FULCRUM_CUDA_CHECK(cudaMemcpy(d_send.as<void>(), send.data(), send.size(), cudaMemcpyHostToDevice));
    exchange.all_to_all_v_device(d_send.as<std::byte>(), send_counts, d_recv.as<std::byte>(), recv_counts);
    std::vector<std::byte> got(expected.size());
    FULCRUM_CUDA_CHECK(cudaMemcpy(got.data(), d_recv.as<void>(), got.size(), cudaMemcpyDeviceToHost));
    EXPECT_EQ(got, expected) << "rank " << rank;
    const std::vector<int64_t> short_counts(static_cast<size_t>(w - 1), 0);
    EXPECT_THROW(exchange.all_to_all_v_device(d_send.as<std::byte>(), short_counts, d_recv.as<std::byte>(), recv_counts),
                 Error);
  });
}

}  // namespace
}  // namespace fulcrum::test
