#include "engine/row_exchange.hpp"

#include <vector>

#ifdef FULCRUM_WITH_NCCL
#include "comm/nccl_row_exchange.hpp"
#endif

namespace fulcrum::engine {
namespace {

class HostRowExchange final : public RowExchange {
 public:
  HostRowExchange(comm::Communicator& group, model::Backend& backend) : group_(group), backend_(backend) {}
  std::string_view path() const override { return "host"; }

  void all_gather_v(const model::Tensor& send, const model::Tensor& recv, std::span<const int64_t> row_counts) override {
    ++calls_;
    const std::vector<float> host = backend_.download(send);
    std::vector<float> all(static_cast<size_t>(recv.numel()));
    group_.all_gather_v(comm::bytes_of(std::span<const float>(host)), comm::writable_bytes_of(std::span<float>(all)),
                        row_byte_counts(row_counts, recv.row_numel()));
    backend_.upload(recv, all);
  }

  void all_to_all_v(const model::Tensor& send, std::span<const int64_t> send_rows, const model::Tensor& recv,
                    std::span<const int64_t> recv_rows) override {
    ++calls_;
    const std::vector<float> host = backend_.download(send);
    std::vector<float> all(static_cast<size_t>(recv.numel()));
    group_.all_to_all_v(comm::bytes_of(std::span<const float>(host)), row_byte_counts(send_rows, send.row_numel()),
                        comm::writable_bytes_of(std::span<float>(all)), row_byte_counts(recv_rows, recv.row_numel()));
    backend_.upload(recv, all);
  }

  void reduce_scatter_sum(const model::Tensor& send, const model::Tensor& recv) override {
    ++calls_;
    const std::vector<float> host = backend_.download(send);
    std::vector<float> mine(static_cast<size_t>(recv.numel()));
    group_.reduce_scatter_sum(host, mine);
    backend_.upload(recv, mine);
  }

 private:
  comm::Communicator& group_;
  model::Backend& backend_;
};

}  // namespace

std::unique_ptr<RowExchange> make_host_row_exchange(comm::Communicator& group, model::Backend& backend) {
  return std::make_unique<HostRowExchange>(group, backend);
}

std::unique_ptr<RowExchange> make_row_exchange(comm::Communicator& group, model::Backend& backend) {
#ifdef FULCRUM_WITH_NCCL
  auto* cuda = dynamic_cast<backend::CudaBackend*>(&backend);
  auto* nccl = dynamic_cast<comm::NcclCommunicator*>(&group);
  if (cuda != nullptr && nccl != nullptr) return std::make_unique<comm::NcclRowExchange>(*cuda, *nccl);
#endif
  return make_host_row_exchange(group, backend);
}

}  // namespace fulcrum::engine
