// SPDX-License-Identifier: MIT
// Built with only single_include/ on the include path: proves the generated single header
// stands alone. Extend it as the public API grows.
#include <doctest/doctest.h>

#include <pulley/pulley.hpp>
#include <thread>
#include <utility>
#include <vector>

TEST_CASE("the single header provides the core vocabulary") {
  const std::vector<pulley::VariableSpec> model{
      {"dense/kernel", {784, 128}, pulley::Initializer::glorot_uniform()},
      {"dense/bias", {128}, pulley::Initializer::zeros()}};
  CHECK(model[0].size() == 784U * 128U);

  const pulley::Placement placement = pulley::RoundRobin{}.place(model, 2);
  REQUIRE(placement.num_variables() == 2U);
  CHECK(placement.parts_of(0)[0].ps == 0U);
  CHECK(placement.parts_of(1)[0].ps == 1U);
}

TEST_CASE("the single header provides the hosts and stock policies") {
  pulley::ParameterServer<pulley::RoundRobin, pulley::Sgd, pulley::Async> ps(
      0, 1, pulley::Sgd{0.1F}, pulley::Async{});
  CHECK(ps.task() == 0U);
  CHECK_FALSE(ps.stopped());
}

TEST_CASE("the single header runs a cluster: chief initializes, reads back, shuts down") {
  using Server = pulley::ParameterServer<pulley::FixedShards, pulley::Adam, pulley::SyncReplicas>;
  pulley::InProcessNetwork network(2);
  for (std::uint32_t i = 0; i < 2; ++i) {
    network.serve(Server(i, 2, pulley::Adam{}, pulley::SyncReplicas(1, 1), pulley::FixedShards{2}));
  }
  pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), 3);
  const std::vector<pulley::VariableSpec> model{{"v", {5, 2}, pulley::Initializer::constant(0.5F)}};
  CHECK(chief.initialize(model).parts_of(0).size() == 2U);
  const auto values = chief.read_variables();
  CHECK(values.at(0) == std::vector<float>(10, 0.5F));
  chief.shutdown();
}

TEST_CASE("the single header sums over a ring of threads") {
  auto ring = pulley::InProcessRing::make(3);
  std::vector<std::vector<float>> data{{1, 2, 3, 4}, {10, 20, 30, 40}, {100, 200, 300, 400}};
  std::vector<std::jthread> threads;
  for (std::size_t r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] { pulley::RingAllReduce().sum(ring[r], data[r]); });
  }
  threads.clear();
  for (const auto& d : data) CHECK(d == std::vector<float>{111, 222, 333, 444});
}
