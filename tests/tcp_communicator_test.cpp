// Rank processes over TCP on loopback: the rendezvous (address table, one-line errors for an unreachable
// address, mismatched world sizes, missing ranks, a peer that dies, dead-peer detection on every socket) and
// the TCP communicator against the same checks as the in-process one. Ranks are threads here (each with its
// own mesh, as a process would have), except where a rank must die: that one is a forked process.
#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <exception>
#include <functional>
#include <thread>

#include "comm/in_process_communicator.hpp"
#include "comm/peer_mesh.hpp"
#include "comm/tcp_communicator.hpp"
#include "communicator_checks.hpp"
#include "eplb/error.hpp"

namespace fulcrum::comm {
namespace {

using namespace std::chrono_literals;

DistInit loopback(int port, int world_size, int rank, std::chrono::milliseconds timeout = 20s) {
  return {{"127.0.0.1", port}, world_size, rank, timeout};
}

// Runs fn(rank, init) on one thread per rank; returns each rank's error message ("" when it returned).
std::vector<std::string> run_ranks(int n, const std::function<void(int, const DistInit&)>& fn,
                                   std::function<DistInit(int)> init_of = {}) {
  const int port = pick_free_port();
  if (!init_of) init_of = [&](int r) { return loopback(port, n, r); };
  std::vector<std::string> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, init_of(r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void run_tcp(int n, const std::function<void(int, Communicator&)>& fn) {
  const auto errors = run_ranks(n, [&](int r, const DistInit& init) {
    TcpCommunicator world(PeerMesh::connect(init));
    fn(r, world);
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

class TcpCollectives : public ::testing::TestWithParam<int> {};

TEST_P(TcpCollectives, MatchTheirDefinitions) {
  const int n = GetParam();
  run_tcp(n, [n](int rank, Communicator& comm) { test::check_collectives(rank, n, comm); });
}

INSTANTIATE_TEST_SUITE_P(GroupSizes, TcpCollectives, ::testing::Values(1, 2, 3, 5));

TEST(TcpCommunicator, SplitGroupsByColorOrderedByKey) {
  run_tcp(6, [](int rank, Communicator& comm) { test::check_split(rank, comm); });
}

TEST(TcpCommunicator, BitwiseTheInProcessResults) {
  const int n = 3;  // float sums of 3 ranks depend on the order: both add in rank order
  std::vector<std::vector<std::vector<std::byte>>> expected(n);
  run_in_process(n, [&](int rank, Communicator& comm) { expected[rank] = test::collective_outputs(rank, n, comm); });
  run_tcp(n, [&](int rank, Communicator& comm) { EXPECT_EQ(test::collective_outputs(rank, n, comm), expected[rank]); });
}

TEST(Rendezvous, UnreachableAddressIsAOneLineError) {
  const int port = pick_free_port();  // nobody listens there
  try {
    PeerMesh::connect(loopback(port, 2, 1, 300ms));
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot connect to 127.0.0.1:" + std::to_string(port)), std::string::npos)
        << e.what();
  }
}

TEST(Rendezvous, MismatchedWorldSizesFailOnEveryRank) {
  const int port = pick_free_port();
  const auto errors = run_ranks(
      2, [](int, const DistInit& init) { PeerMesh::connect(init); },
      [&](int r) { return loopback(port, r == 0 ? 2 : 3, r); });
  for (const std::string& e : errors) EXPECT_NE(e.find("mismatched world sizes: rank 1"), std::string::npos) << e;
}

TEST(Rendezvous, MissingRankTimesOutNamingIt) {
  const int port = pick_free_port();
  const auto errors = run_ranks(
      2, [](int, const DistInit& init) { PeerMesh::connect(init); },
      [&](int r) { return loopback(port, 3, r, 500ms); });  // rank 2 never comes
  EXPECT_NE(errors[0].find("only 2 of 3 ranks joined"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("missing ranks 2"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], errors[0]);  // rank 0 tells the ranks that did join
}

TEST(Rendezvous, BadAddressesAreRejected) {
  EXPECT_THROW(parse_host_port("localhost", "--dist-init-addr"), Error);
  EXPECT_THROW(parse_host_port("host:99999", "--dist-init-addr"), Error);
  EXPECT_THROW(parse_host_port(":80", "--dist-init-addr"), Error);
  EXPECT_EQ(parse_host_port("10.0.0.2:5000", "--dist-init-addr").port, 5000);
}

// The rendezvous and the mesh connect through accept_tcp / connect_tcp, which set the options.
TEST(TcpSocket, ConnectionsDetectDeadPeers) {
  const Socket listener = listen_tcp(0, "test listener");
  const auto deadline = Clock::now() + 5s;
  const Socket client = connect_tcp({"127.0.0.1", local_port(listener)}, deadline, "test client");
  const Socket server = accept_tcp(listener, deadline, "test server");
  EXPECT_EQ(dead_peer_detection(client), kDeadPeerDetection);
  EXPECT_EQ(dead_peer_detection(server), kDeadPeerDetection);
  EXPECT_NE(dead_peer_detection(listener), kDeadPeerDetection);  // the kernel's defaults differ
}

// Outgoing connections take ports from the ephemeral range; a picked rendezvous port must lie outside it.
TEST(TcpSocket, PickedPortsLieBelowTheEphemeralRangeAndAreFree) {
  const auto [low, high] = ephemeral_port_range();
  ASSERT_LE(low, high);
  for (int i = 0; i < 20; ++i) {
    const int port = pick_free_port();
    if (low - 10000 >= 1000) {
      EXPECT_GE(port, 10000);
      EXPECT_LT(port, low);
    }
    EXPECT_NO_THROW(listen_tcp(port, "test listener")) << port;
  }
}

TEST(PeerMesh, EverySocketDetectsDeadPeers) {
  const int n = 3;
  const auto errors = run_ranks(n, [n](int rank, const DistInit& init) {
    auto mesh = PeerMesh::connect(init);
    for (int peer = 0; peer < n; ++peer) {
      if (peer == rank) continue;
      EXPECT_EQ(dead_peer_detection(mesh->peer_socket(peer)), kDeadPeerDetection) << rank << "->" << peer;
    }
  });
  for (int r = 0; r < n; ++r) EXPECT_EQ(errors[r], "") << "rank " << r;
}

TEST(PeerMesh, APeerThatDiesIsReportedNotWaitedFor) {
  const int port = pick_free_port();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: joins, then dies without a goodbye
    try {
      auto mesh = PeerMesh::connect(loopback(port, 2, 1));
      ::_exit(0);
    } catch (...) {
      ::_exit(2);
    }
  }
  std::string error;
  try {
    TcpCommunicator world(PeerMesh::connect(loopback(port, 2, 0)));
    world.barrier();  // rank 1 never arrives
  } catch (const Error& e) {
    error = e.what();
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_NE(error.find("rank 1 (127.0.0.1:"), std::string::npos) << error;
  EXPECT_NE(error.find("closed its connection without finishing"), std::string::npos) << error;
}

TEST(PeerMesh, APeerThatFinishedIsNotAFailure) {
  const auto errors = run_ranks(2, [](int rank, const DistInit& init) {
    auto mesh = PeerMesh::connect(init);
    TcpCommunicator world(mesh);
    world.barrier();
    if (rank == 1) return;  // leaves first, with a goodbye
    std::this_thread::sleep_for(100ms);
    EXPECT_EQ(mesh->failure(), "");
    std::vector<std::byte> one(1);
    world.recv(one, 1);  // nothing will come: a clear error, not a hang
  });
  EXPECT_NE(errors[0].find("rank 1 (127.0.0.1:"), std::string::npos) << errors[0];
  EXPECT_NE(errors[0].find("finished while rank 0 still expected a message"), std::string::npos) << errors[0];
  EXPECT_EQ(errors[1], "");
}

}  // namespace
}  // namespace fulcrum::comm
