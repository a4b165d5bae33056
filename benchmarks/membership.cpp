// SPDX-License-Identifier: MIT
// What a change of a job's ps tasks costs, in-process (Adam, FixedShards{12} over 8
// variables; the model's size from 1 to 128 MiB of values). Training stands still for
// all of it. Two tables:
//
//   leave: 3 ps tasks; the chief takes ps 1 out of the membership and restores ps 0 and
//          ps 2 from the checkpoint (Chief::leave, then Chief::restore)
//   join:  2 ps tasks; a third joins (Chief::join: every ps read at one cut, held, then
//          all three restored from it)
//
// Printed per size:
//   state      values and Adam's two slots of the whole model (what a checkpoint holds)
//   least      what any re-sharding must move: ps 1's share (leave), the new ps's (join)
//   moved      what crossed the transport: the restore's every member's whole new share
//              (leave); the cut's read of the whole state plus that restore (join)
//   pause      from the change's start to the restore's end (median of the rounds)
//   GB/s       moved / pause
//   memcpy     one memcpy of the state's bytes (median): the floor of an in-process
//              restore, and the pause's ratio to it
//
//   membership [--rounds 5] [--max-mib 128]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pulley/client/chief.hpp"
#include "pulley/optimizers/adam.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/transport/in_process.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using Server = pulley::ParameterServer<pulley::FixedShards, pulley::Adam, pulley::Async>;

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<pulley::VariableSpec> model_of(std::size_t mib) {
  constexpr std::size_t kVariables = 8;
  const std::size_t rows = mib * (std::size_t{1} << 20U) / sizeof(float) / kVariables / 256;
  std::vector<pulley::VariableSpec> variables;
  for (std::size_t v = 0; v < kVariables; ++v) {
    std::string name(1, 'w');  // (g++ 12 warns falsely of "w" + to_string inlined here)
    name += std::to_string(v);
    variables.push_back({std::move(name), {rows, 256}, pulley::Initializer::uniform(0.1F)});
  }
  return variables;
}

struct Figures {
  double state_mb = 0, least_mb = 0, moved_mb = 0, pause = 0, copy = 0;
};

/// `rounds` changes of a job of `variables`: a leave (3 ps -> 2) or a join (2 ps -> 3).
Figures measure(const std::vector<pulley::VariableSpec>& variables, int rounds, bool join) {
  std::vector<double> pauses, copies;
  Figures f;
  for (int round = 0; round < rounds; ++round) {
    const std::uint32_t before = join ? 2 : 3;
    pulley::InProcessNetwork network(before, join ? 1 : 0);
    for (std::uint32_t i = 0; i < before; ++i) {
      network.serve(Server(i, before, pulley::Adam{0.001F}, pulley::Async{}, pulley::FixedShards{12}));
    }
    pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), 7);
    chief.initialize(variables);
    std::uint64_t state = 0;
    for (const pulley::Part& part : chief.placement().parts) state += 3 * pulley::part_bytes(part, variables);
    std::uint64_t least = 0;
    std::chrono::duration<double> pause{};
    if (join) {
      network.serve(Server(2, 3, pulley::Adam{0.001F}, pulley::Async{}, pulley::FixedShards{12}));
      const auto began = Clock::now();
      (void)chief.join("in-process:2");
      pause = Clock::now() - began;
      for (const pulley::Part& part : chief.placement().parts) {
        if (part.ps == 2) least += 3 * pulley::part_bytes(part, variables);  // values, m, v
      }
    } else {
      const pulley::ModelState saved = chief.save_state();
      for (const pulley::Part& part : chief.placement().parts) {
        if (part.ps == 1) least += 3 * pulley::part_bytes(part, variables);
      }
      network.kill(pulley::Node::ps(1));
      const auto began = Clock::now();
      chief.leave(std::vector<std::uint32_t>{1});
      chief.restore(saved);
      pause = Clock::now() - began;
    }
    pauses.push_back(pause.count());
    f.state_mb = static_cast<double>(state) / 1e6;
    f.least_mb = static_cast<double>(least) / 1e6;
    f.moved_mb = (join ? 2 : 1) * f.state_mb;  // join: read at the cut, then restored
    std::vector<char> from(state, 1), to(state);
    const auto copy_began = Clock::now();
    std::memcpy(to.data(), from.data(), state);
    copies.push_back(std::chrono::duration<double>(Clock::now() - copy_began).count());
    if (to[state / 2] != 1) std::abort();
    chief.shutdown();
  }
  f.pause = median(pauses);
  f.copy = median(copies);
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 5;
  std::size_t max_mib = 128;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--rounds" && i + 1 < argc) {
      rounds = std::max(1, std::atoi(argv[++i]));
    } else if (arg == "--max-mib" && i + 1 < argc) {
      max_mib = static_cast<std::size_t>(std::max(1, std::atoi(argv[++i])));
    } else {
      std::printf("usage: membership [--rounds 5] [--max-mib 128]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  // The leave's own warnings are expected, once a round: only errors are printed.
  pulley::set_log_sink([](pulley::LogLevel level, std::string_view line) {
    if (level == pulley::LogLevel::kError) std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
  });
  for (const bool join : {false, true}) {
    std::printf("\n%s\n\n", join ? "join: 2 ps tasks -> 3 (Chief::join)" : "leave: 3 ps tasks -> 2 (Chief::leave + restore)");
    std::printf("| values | state (values + Adam slots) | least (%s) | moved | moved / least |"
                " pause | GB/s | memcpy of the state | pause / memcpy |\n", join ? "the new ps's share" : "ps 1's share");
    std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for (std::size_t mib = 1; mib <= max_mib; mib *= 4) {
      const Figures f = measure(model_of(mib), rounds, join);
      std::printf("| %zu MiB | %.1f MB | %.1f MB | %.1f MB | %.2f | %.1f ms | %.2f | %.1f ms | %.1f |\n", mib,
                  f.state_mb, f.least_mb, f.moved_mb, f.moved_mb / f.least_mb, f.pause * 1e3,
                  f.moved_mb / 1e3 / f.pause, f.copy * 1e3, f.pause / f.copy);
    }
  }
  return 0;
}
