// SPDX-License-Identifier: MIT
// Writing your own optimizer: sign-SGD (Bernstein et al., 2018), w -= lr * sign(g), plugged
// into pulley with no change to the library. It fits y = 3x - 1 with two workers in sync.
#include <cmath>
#include <cstdio>
#include <span>
#include <thread>
#include <vector>

#include "pulley/pulley.hpp"

/// The whole optimizer: hyper-parameters, a (here empty) per-part state, and `apply`.
struct SignSgd {
  float learning_rate = 0.01F;

  struct State {};
  State make_state(std::size_t /*n*/) const { return {}; }

  void apply(State& /*state*/, std::span<float> w, std::span<const float> g) const {
    for (std::size_t i = 0; i < w.size(); ++i) {
      w[i] -= learning_rate * static_cast<float>((g[i] > 0.0F) - (g[i] < 0.0F));
    }
  }
};
static_assert(pulley::Optimizer<SignSgd>);  // optional: the ParameterServer checks it too

/// y = a x + b with squared error; a Model needs variables, parameters, gradients and a
/// gradient computation.
class Line {
 public:
  struct Batch {
    std::span<const float> x, y;
  };
  std::span<const pulley::VariableSpec> variables() const { return variables_; }
  std::span<float> parameter(std::size_t i) { return {&params_[i], 1}; }
  std::span<const float> gradient(std::size_t i) const { return {&grads_[i], 1}; }
  float compute_gradients(const Batch& batch) {
    grads_[0] = grads_[1] = 0.0F;
    float loss = 0.0F;
    const auto n = static_cast<float>(batch.x.size());
    for (std::size_t i = 0; i < batch.x.size(); ++i) {
      const float err = params_[0] * batch.x[i] + params_[1] - batch.y[i];
      loss += 0.5F * err * err / n;
      grads_[0] += err * batch.x[i] / n;
      grads_[1] += err / n;
    }
    return loss;
  }

 private:
  std::vector<pulley::VariableSpec> variables_{{"a", {1}, pulley::Initializer::zeros()},
                                               {"b", {1}, pulley::Initializer::zeros()}};
  float params_[2] = {0.0F, 0.0F};
  float grads_[2] = {0.0F, 0.0F};
};

int main() {
  constexpr std::uint32_t kWorkers = 2;
  constexpr std::int64_t kSteps = 400;
  using Server = pulley::ParameterServer<pulley::RoundRobin, SignSgd, pulley::SyncReplicas>;
  pulley::InProcessNetwork network(1);  // owns the ps it serves
  network.serve(Server(0, 1, SignSgd{0.01F}, pulley::SyncReplicas(kWorkers, kWorkers)));
  pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), /*seed=*/1);
  chief.initialize(Line{}.variables());

  std::vector<std::thread> workers;
  for (std::uint32_t w = 0; w < kWorkers; ++w) {
    workers.emplace_back([&network, w] {
      // Each worker sees its own half of the line: x in [-1, 0) or [0, 1).
      std::vector<float> x(16), y(16);
      for (std::size_t i = 0; i < x.size(); ++i) {
        x[i] = (static_cast<float>(i) / 16.0F) - 1.0F + static_cast<float>(w);
        y[i] = 3.0F * x[i] - 1.0F;
      }
      pulley::Worker worker(w, Line{}, pulley::InProcess(network, pulley::Node::worker(w)));
      worker.wait_ready();
      while (const auto result = worker.step({x, y}, kSteps)) {
        if (w == 0 && result->local_step % 100 == 0) {
          std::printf("step %3lld  loss %.4f\n", static_cast<long long>(result->local_step),
                      result->loss);
        }
      }
    });
  }
  for (auto& t : workers) t.join();
  const auto values = chief.read_variables();
  std::printf("learned y = %.3f x %+.3f (want 3x - 1)\n", values[0][0], values[1][0]);
  chief.shutdown();
  return std::abs(values[0][0] - 3.0F) < 0.05F && std::abs(values[1][0] + 1.0F) < 0.05F ? 0 : 1;
}
