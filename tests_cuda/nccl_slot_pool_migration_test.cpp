// Zero-copy slot migration of the bf16 slot pool (comm::NcclSlotPoolMigration) on 2 GPUs, ranks as processes
// (nccl_rank_util.hpp), over a communicator dedicated to migration (NcclCommunicator::duplicate):
//  - after begin + commit every local slot holds its new logical expert's generated weights, bit for bit, on
//    both ranks: replicas, local copies (also from slots that change themselves), both directions, one direction,
//    a layer without changes, and back again into the freed buffers;
//  - until commit the old pointers are the layer's pointers and hold the old weights (the forward pass's
//    collectives on the world communicator run meanwhile);
//  - a freed buffer that a reader stream still reads is not overwritten by the next layer's transfer, also when
//    a reservation takes buffers freed by two commits with two reader streams;
//  - begin while in flight, commit / ready without begin and bad rows are one-line errors; a dead peer ends an
//    async exchange with the communicator's one-line abort error.
// Bandwidth: `fulcrum bench moe --gpus 2` (docs/benchmarks.md).
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <chrono>
#include <cstdio>
#include <numeric>
#include <thread>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.hpp"
#include "gpu/moe/gpu_slot_pool.hpp"
#include "gpu/moe/nccl_slot_pool_migration.hpp"
#include "eplb/error.hpp"
#include "nccl_rank_util.hpp"
#include "slot_pool_test_util.hpp"
#include "test_data.hpp"

namespace fulcrum::test {
namespace {

constexpr uint64_t kSeed = 2026;

// Rank `rank`'s local part of a global row [P].
std::vector<int32_t> local_row(const std::vector<int32_t>& row, int rank, int slots_per_rank) {
  return {row.begin() + rank * slots_per_rank, row.begin() + (rank + 1) * slots_per_rank};
}

// begin_layer, then (while the transfer runs) the world's collectives and checks that the old pointers are
// still the layer's and hold the old experts; commit; then every slot holds its new expert.
void migrate_and_check(comm::NcclSlotPoolMigration& migration, comm::NcclCommunicator& world,
                       backend::GpuSlotPool& pool, int layer, const std::vector<int32_t>& from,
                       const std::vector<int32_t>& to) {
  const int rank = world.rank(), spr = pool.shape().slots_per_layer;
  const std::vector<const uint16_t*> old_gate_up = pool.gate_up_ptrs(layer);
  migration.begin_layer(layer, from, to);
  EXPECT_TRUE(migration.in_flight());
  EXPECT_EQ(migration.layer_in_flight(), layer);
  world.barrier();  // a forward-pass collective on the other communicator while the migration is in flight
  while (!migration.ready()) std::this_thread::yield();
  EXPECT_EQ(pool.gate_up_ptrs(layer), old_gate_up);
  expect_slots_hold(pool, layer, local_row(from, rank, spr), kSeed);  // transfer done, old slots untouched
  EXPECT_EQ(migration.commit(nullptr), layer);
  EXPECT_FALSE(migration.in_flight());
  const std::vector<int32_t> now = local_row(to, rank, spr);
  expect_slots_hold(pool, layer, now, kSeed);
  const std::vector<const uint16_t*> new_gate_up = pool.gate_up_ptrs(layer);
  for (int s = 0; s < spr; ++s) {
    const bool changed = from[static_cast<size_t>(rank * spr + s)] != now[static_cast<size_t>(s)];
    EXPECT_EQ(new_gate_up[static_cast<size_t>(s)] != old_gate_up[static_cast<size_t>(s)], changed) << "slot " << s;
  }
  EXPECT_EQ(pool.map().num_free(), pool.shape().spare);
}

TEST(NcclRank, SlotPoolMigrationHoldsTheNewExperts) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  // 6 logical experts in 8 slots (4 per GPU), 3 layers, awkward H / I.
  const eplb::Topology topo{.num_physical_experts = 8, .num_gpus = 2, .num_nodes = 1};
  backend::GpuSlotPool pool({.num_layers = 3, .slots_per_layer = 4, .hidden_size = 40, .moe_intermediate_size = 24},
                            env->rank);
  const std::vector<int32_t> trivial{0, 1, 2, 3, 4, 5, 0, 1};
  for (int l = 0; l < 3; ++l) pool.fill_layer(l, local_row(trivial, env->rank, 4), kSeed);
  comm::NcclSlotPoolMigration migration(pool, *migration_comm, topo);

  // Layer 0, both directions: rank 0 receives expert 4 and copies expert 0 into two slots (a replica, from a
  // slot that itself stays), rank 1 receives experts 2 and 3 (consecutive on both sides).
  const std::vector<int32_t> both{4, 1, 0, 0, 2, 5, 3, 1};
  migrate_and_check(migration, *world, pool, 0, trivial, both);
  const comm::SlotPoolMigrationStats after_first = migration.stats();
  EXPECT_EQ(after_first.num_local_copies, env->rank == 0 ? 2 : 0);
  EXPECT_EQ(after_first.num_received, env->rank == 0 ? 1 : 2);
  EXPECT_EQ(after_first.num_sent, env->rank == 0 ? 2 : 1);
  EXPECT_EQ(after_first.num_nccl_ops, 4);  // one send and one recv op per tensor: the pair's runs merged
  // Layer 1, one direction (rank 0 -> 1) only.
  migrate_and_check(migration, *world, pool, 1, trivial, {0, 1, 2, 3, 4, 5, 2, 3});
  // Layer 2 does not change: nothing moves, commit only ends it.
  migrate_and_check(migration, *world, pool, 2, trivial, trivial);
  // Layer 0 again: a swap inside each rank (local copies whose sources change too) plus a move, into the
  // buffers freed by the first commit.
  migrate_and_check(migration, *world, pool, 0, both, {1, 4, 0, 3, 5, 2, 1, 0});
  EXPECT_EQ(migration.stats().num_layers_committed, 4);
  world->barrier();
}

// A freed buffer is still read by work queued on a reader stream before the commit (a host function holds that
// stream 300 ms, then a copy reads the old buffers); the next layer's transfer, which can only reserve exactly
// those buffers (spare = 2), must wait for it: the copy sees the old weights.
TEST(NcclRank, SlotPoolMigrationWaitsForReadersOfFreedBuffers) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  const eplb::Topology topo{.num_physical_experts = 4, .num_gpus = 2, .num_nodes = 1};
  backend::GpuSlotPool pool({.num_layers = 1, .slots_per_layer = 2, .hidden_size = 64, .moe_intermediate_size = 32,
                             .spare = 2},
                            env->rank);
  const std::vector<int32_t> first{0, 1, 2, 3}, second{2, 3, 0, 1};
  pool.fill_layer(0, local_row(first, env->rank, 2), kSeed);
  comm::NcclSlotPoolMigration migration(pool, *migration_comm, topo);
  cudaStream_t reader = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&reader, cudaStreamNonBlocking));
  uint16_t* seen = nullptr;  // [2 slots, 2I, H]: what the reader copied out of the old buffers
  FULCRUM_CUDA_CHECK(cudaMalloc(&seen, 2 * pool.gate_up_elems() * 2));

  migration.begin_layer(0, first, second);
  const std::vector<const uint16_t*> old_ptrs = pool.gate_up_ptrs(0);
  FULCRUM_CUDA_CHECK(cudaLaunchHostFunc(
      reader, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }, nullptr));
  for (int s = 0; s < 2; ++s) {
    FULCRUM_CUDA_CHECK(cudaMemcpyAsync(seen + s * pool.gate_up_elems(), old_ptrs[static_cast<size_t>(s)],
                                       pool.gate_up_elems() * 2, cudaMemcpyDeviceToDevice, reader));
  }
  migration.commit(reader);
  migration.begin_layer(0, second, first);  // reserves exactly the two buffers the reader still reads
  EXPECT_EQ(pool.map().reserved(0), (std::vector<int32_t>{0, 1}));
  migration.commit(nullptr);
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(reader));
  for (int s = 0; s < 2; ++s) {
    std::vector<uint16_t> got(static_cast<size_t>(pool.gate_up_elems()));
    FULCRUM_CUDA_CHECK(cudaMemcpy(got.data(), seen + s * pool.gate_up_elems(), got.size() * 2, cudaMemcpyDeviceToHost));
    EXPECT_TRUE(got == expected_expert(pool, 0, first[static_cast<size_t>(env->rank * 2 + s)], kSeed).first)
        << "the reader saw overwritten weights in slot " << s;
  }
  expect_slots_hold(pool, 0, local_row(first, env->rank, 2), kSeed);
  FULCRUM_CUDA_CHECK(cudaFree(seen));
  FULCRUM_CUDA_CHECK(cudaStreamDestroy(reader));
  world->barrier();
}

// Freed buffers of two commits with two reader streams (each layer's forward has its own stream): the slow
// reader of the EARLIER commit must still be waited for when a later reservation takes buffers of both commits
// (the later commit's event, on the other stream, does not cover it). Per rank, buffers: layer 0 {0, 1},
// layer 1 {2, 3}, spare {4, 5, 6}. Layer 0 slot 1 changes (into 4; frees 1, reader A holds it 1.5 s), then all
// of layer 1 (into 5, 6; frees 2, 3, reader B), then all of layer 0: it reserves {1, 2}, one buffer of each.
TEST(NcclRank, SlotPoolMigrationWaitsForEveryReaderStream) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  const eplb::Topology topo{.num_physical_experts = 4, .num_gpus = 2, .num_nodes = 1};
  backend::GpuSlotPool pool({.num_layers = 2, .slots_per_layer = 2, .hidden_size = 64, .moe_intermediate_size = 32,
                             .spare = 3},
                            env->rank);
  const std::vector<int32_t> start{0, 1, 2, 3}, layer0_step1{0, 3, 2, 1}, layer1_step2{2, 3, 0, 1}, layer0_step3{2, 1, 0, 3};
  pool.fill_layer(0, local_row(start, env->rank, 2), kSeed);
  pool.fill_layer(1, local_row(start, env->rank, 2), kSeed);
  comm::NcclSlotPoolMigration migration(pool, *migration_comm, topo);
  cudaStream_t reader_a = nullptr, reader_b = nullptr;
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&reader_a, cudaStreamNonBlocking));
  FULCRUM_CUDA_CHECK(cudaStreamCreateWithFlags(&reader_b, cudaStreamNonBlocking));
  uint16_t* seen = nullptr;  // [2I, H]: what reader A copied out of layer 0's old slot 1
  FULCRUM_CUDA_CHECK(cudaMalloc(&seen, pool.gate_up_elems() * 2));

  migration.begin_layer(0, start, layer0_step1);
  const uint16_t* old_slot1 = pool.gate_up_ptrs(0)[1];
  FULCRUM_CUDA_CHECK(cudaLaunchHostFunc(
      reader_a, [](void*) { std::this_thread::sleep_for(std::chrono::milliseconds(1500)); }, nullptr));
  FULCRUM_CUDA_CHECK(cudaMemcpyAsync(seen, old_slot1, pool.gate_up_elems() * 2, cudaMemcpyDeviceToDevice, reader_a));
  migration.commit(reader_a);
  migration.begin_layer(1, start, layer1_step2);
  migration.commit(reader_b);  // nothing queued on B: its event completes at once
  migration.begin_layer(0, layer0_step1, layer0_step3);
  EXPECT_EQ(pool.map().reserved(0), (std::vector<int32_t>{1, 2}));
  migration.commit(nullptr);
  FULCRUM_CUDA_CHECK(cudaStreamSynchronize(reader_a));
  std::vector<uint16_t> got(static_cast<size_t>(pool.gate_up_elems()));
  FULCRUM_CUDA_CHECK(cudaMemcpy(got.data(), seen, got.size() * 2, cudaMemcpyDeviceToHost));
  EXPECT_TRUE(got == expected_expert(pool, 0, start[static_cast<size_t>(env->rank * 2 + 1)], kSeed).first)
      << "reader A saw its freed buffer overwritten";
  expect_slots_hold(pool, 0, local_row(layer0_step3, env->rank, 2), kSeed);
  expect_slots_hold(pool, 1, local_row(layer1_step2, env->rank, 2), kSeed);
  FULCRUM_CUDA_CHECK(cudaFree(seen));
  FULCRUM_CUDA_CHECK(cudaStreamDestroy(reader_a));
  FULCRUM_CUDA_CHECK(cudaStreamDestroy(reader_b));
  world->barrier();
}

TEST(NcclRank, SlotPoolMigrationMisuseIsAOneLineError) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  const eplb::Topology topo{.num_physical_experts = 4, .num_gpus = 2, .num_nodes = 1};
  backend::GpuSlotPool pool({.num_layers = 2, .slots_per_layer = 2, .hidden_size = 16, .moe_intermediate_size = 8},
                            env->rank);
  const std::vector<int32_t> from{0, 1, 2, 3}, to{2, 1, 0, 3};
  for (int l = 0; l < 2; ++l) pool.fill_layer(l, local_row(from, env->rank, 2), kSeed);
  comm::NcclSlotPoolMigration migration(pool, *migration_comm, topo);
  const auto expect_error = [](const std::function<void()>& call, const std::string& message) {
    const std::string error = error_of(call);
    EXPECT_NE(error.find("slot pool migration: " + message), std::string::npos) << error;
    EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  };
  expect_error([&] { migration.commit(nullptr); }, "commit without begin_layer (no layer in flight)");
  expect_error([&] { migration.ready(); }, "ready() with no layer in flight");
  expect_error([&] { migration.begin_layer(0, from, std::vector<int32_t>{0, 1, 2}); },
               "layer 0: rows of 4 and 3 slots, the topology has 4");
  // The rows as a one-layer placement (its layer 0) must be valid: every expert held before and after.
  expect_error([&] { migration.begin_layer(0, from, std::vector<int32_t>{0, 1, 2, 2}); },
               "layer 0: layer 0: logical expert 3 has no replica");
  expect_error([&] { migration.begin_layer(0, from, std::vector<int32_t>{0, 1, 2, 4}); },
               "layer 0: new row slot 3 holds logical expert 4, which no slot of the old row holds");
  expect_error([&] { migration.begin_layer(0, from, std::vector<int32_t>{0, 1, 2, -3}); },
               "layer 0: logical expert -3 in a row");
  expect_error([&] { migration.begin_layer(2, from, to); }, "layer 2 outside [0, 2)");
  expect_error([&] { comm::NcclSlotPoolMigration(pool, *migration_comm, {.num_physical_experts = 6, .num_gpus = 2}); },
               "topology of 6 slots on 2 GPUs, the communicator has 2 ranks and the pool 2 slots per layer");
  EXPECT_EQ(pool.map().num_free(), 2);  // nothing reserved by the failed calls

  migration.begin_layer(0, from, to);
  expect_error([&] { migration.begin_layer(1, from, to); },
               "begin_layer(1) while layer 0 is in flight (staging holds one layer)");
  migration.commit(nullptr);  // the failed begin changed nothing
  expect_slots_hold(pool, 0, local_row(to, env->rank, 2), kSeed);
  expect_slots_hold(pool, 1, local_row(from, env->rank, 2), kSeed);
  world->barrier();
}

// exchange_device_async keeps exchange_device's abort-on-failure handling: rank 1 never posts its send and dies
// 1 s later; rank 0's polling (ready) or the enqueue itself ends with the one-line abort error.
TEST(NcclRank, AsyncExchangeAbortsWhenThePeerDies) {
  FULCRUM_RANK_ONLY(env);
  auto world = comm::join_local_world(*env);
  auto migration_comm = world->duplicate();
  world->barrier();
  if (env->rank == 1) {
    std::this_thread::sleep_for(std::chrono::seconds(1));
    ::_exit(3);  // no goodbye
  }
  std::byte* recv = nullptr;
  FULCRUM_CUDA_CHECK(cudaMalloc(&recv, 1 << 20));
  const std::vector<comm::NcclCommunicator::DeviceRecv> recvs{{recv, 1 << 20, 1}};
  const std::string error = error_of([&] {
    auto pending = migration_comm->exchange_device_async({}, recvs);
    while (!pending.ready()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  });
  EXPECT_NE(error.find("NCCL communicator aborted: rank 1"), std::string::npos) << error;
  EXPECT_EQ(error.find('\n'), std::string::npos) << error;
  std::fflush(nullptr);
  ::_exit(::testing::Test::HasFailure() ? 1 : 0);  // the aborted communicators are not torn down again
}

TEST(NcclSlotPoolMigration, HoldsTheNewExpertsOnTwoGpus) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotPoolMigrationHoldsTheNewExperts"), (std::vector<int>{0, 0}));
}

TEST(NcclSlotPoolMigration, WaitsForReadersOfFreedBuffers) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotPoolMigrationWaitsForReadersOfFreedBuffers"), (std::vector<int>{0, 0}));
}

TEST(NcclSlotPoolMigration, WaitsForEveryReaderStream) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotPoolMigrationWaitsForEveryReaderStream"), (std::vector<int>{0, 0}));
}

TEST(NcclSlotPoolMigration, MisuseIsAOneLineError) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.SlotPoolMigrationMisuseIsAOneLineError"), (std::vector<int>{0, 0}));
}

TEST(NcclSlotPoolMigration, AsyncExchangeAbortsWhenThePeerDies) {
  FULCRUM_NEEDS_GPUS(2);
  EXPECT_EQ(run_rank_processes(2, "NcclRank.AsyncExchangeAbortsWhenThePeerDies"), (std::vector<int>{0, 3}));
}

}  // namespace
}  // namespace fulcrum::test
