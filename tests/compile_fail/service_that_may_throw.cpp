// expect: noexcept\(service\.handle
// SPDX-License-Identifier: MIT
// A service whose `handle` may throw is rejected by the transports: it must answer every
// failure itself, and the diagnostic says so.
#include "pulley/transport/in_process.hpp"

struct Careless {
  void handle(pulley::Request&&, const pulley::RequestContext&, pulley::Responder) {}
  std::uint32_t task() const { return 0; }
  bool stopped() const { return false; }
};

int main() {
  pulley::InProcessNetwork network(1);
  network.serve(Careless{});
}
