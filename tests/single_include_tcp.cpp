// SPDX-License-Identifier: MIT
// Built with only single_include/ (plus Asio and cereal) on the include path: proves that
// the generated TCP single header stands alone, and that its user can train over TCP.
#include <doctest/doctest.h>

#include <pulley/pulley_tcp.hpp>
#include <string>
#include <thread>
#include <vector>

namespace {

/// y = w x with one weight, learned from the single example (x = 1, y = 3).
class Scalar {
 public:
  struct Batch {};
  std::span<const pulley::VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t) { return w_; }
  std::span<const float> gradient(std::size_t) const { return g_; }
  float compute_gradients(const Batch&) {
    const float error = w_[0] - 3.0F;
    g_[0] = error;
    return 0.5F * error * error;
  }

 private:
  std::vector<pulley::VariableSpec> variables_{{"w", {1}, pulley::Initializer::zeros()}};
  std::vector<float> w_ = std::vector<float>(1);
  std::vector<float> g_ = std::vector<float>(1);
};

}  // namespace

TEST_CASE("the TCP single header trains a model over loopback") {
  using Server = pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, pulley::SyncReplicas>;
  const pulley::Credentials job{"single-header", "its secret"};
  pulley::TcpServerOptions serving_options;
  serving_options.credentials = job;
  pulley::TcpServer<Server> listener(Server(0, 1, pulley::Sgd{0.5F}, pulley::SyncReplicas(1, 1)),
                                     "127.0.0.1", 0, serving_options);
  std::thread serving([&] { listener.run(); });
  const std::vector<std::string> ps{"127.0.0.1:" + std::to_string(listener.port())};
  pulley::TcpOptions options;
  options.credentials = job;
  {
    pulley::Chief chief(pulley::Tcp(pulley::Node::chief(), ps, options), 1);
    chief.initialize(Scalar{}.variables());
    pulley::Worker worker(0, Scalar{}, pulley::Tcp(pulley::Node::worker(0), ps, options));
    worker.wait_ready();
    while (worker.step({}, 30)) {
    }
    const auto values = chief.read_variables();
    CHECK(values.at(0).at(0) == doctest::Approx(3.0F).epsilon(1e-4));
    chief.shutdown();
  }
  serving.join();
  CHECK(listener.service().ended()->code == pulley::ErrorCode::kOutOfRange);
}

TEST_CASE("the TCP single header trains replicas with a ring all-reduce") {
  // Two ranks over loopback; ports picked free a moment ago.
  asio::io_context io;
  std::vector<std::string> addresses;
  {
    std::vector<asio::ip::tcp::acceptor> held;
    for (int i = 0; i < 2; ++i) {
      held.emplace_back(io, asio::ip::tcp::endpoint(asio::ip::make_address("127.0.0.1"), 0));
      addresses.push_back("127.0.0.1:" + std::to_string(held.back().local_endpoint().port()));
    }
  }
  const pulley::Credentials job{"single-header", "its secret"};
  std::vector<float> learned(2);
  std::vector<std::jthread> ranks;
  for (std::size_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      pulley::AllReduceWorker worker(Scalar{}, pulley::Sgd{0.5F}, pulley::TcpRing(r, addresses, job));
      worker.initialize(1);
      for (int step = 0; step < 20; ++step) (void)worker.step({});
      learned[r] = worker.model().parameter(0)[0];
    });
  }
  ranks.clear();
  CHECK(learned[0] == doctest::Approx(3.0F).epsilon(1e-4));
  CHECK(learned[1] == learned[0]);
}
