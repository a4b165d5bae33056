// expect: sharding\.place\(variables, num_ps\)
// SPDX-License-Identifier: MIT
// A sharding policy without `place` is rejected, and the diagnostic names it.
#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sync/async.hpp"

struct ForgotPlace {
  int num_shards = 2;
};

int main() { pulley::ParameterServer<ForgotPlace, pulley::Sgd, pulley::Async> ps(0, 1, {}, {}); }
