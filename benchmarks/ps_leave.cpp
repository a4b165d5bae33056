// SPDX-License-Identifier: MIT
// What a ps that leaves a job for good costs, in-process (3 ps tasks, Adam, FixedShards{12}
// over 8 variables; the model's size from 1 to 128 MiB of values): the chief takes ps 1 out
// of the membership and restores ps 0 and ps 2 from the checkpoint (Chief::leave, then
// Chief::restore). Training stands still for all of it. Printed per size:
//
//   state      values and Adam's two slots of the whole model (what a checkpoint holds)
//   lost       what ps 1 held: the least any re-sharding must move
//   sent       what the restore sent: every member's whole new share, from the checkpoint
//   pause      the time from leave to the restore's end (median of the rounds)
//   GB/s       sent / pause
//   memcpy     the same bytes copied once (one memcpy of `sent` bytes, median): the floor of
//              an in-process restore, and the ratio to it
//
//   ps_leave [--rounds 5] [--max-mib 128]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>
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
    variables.push_back({"w" + std::to_string(v), {rows, 256}, pulley::Initializer::uniform(0.1F)});
  }
  return variables;
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
      std::printf("usage: ps_leave [--rounds 5] [--max-mib 128]\n");
      return arg == "--help" ? 0 : 2;
    }
  }
  // The leave's own warnings are expected, once a round: only errors are printed.
  pulley::set_log_sink([](pulley::LogLevel level, std::string_view line) {
    if (level == pulley::LogLevel::kError) std::fprintf(stderr, "%.*s\n", static_cast<int>(line.size()), line.data());
  });
  std::printf("| values | state (values + Adam slots) | lost (ps 1's share) | sent by the restore | sent / lost |"
              " pause (leave + restore) | GB/s | memcpy of as many bytes | pause / memcpy |\n");
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  for (std::size_t mib = 1; mib <= max_mib; mib *= 4) {
    const auto variables = model_of(mib);
    std::vector<double> pauses, copies;
    double state_mb = 0, lost_mb = 0, sent_mb = 0;
    for (int round = 0; round < rounds; ++round) {
      pulley::InProcessNetwork network(3);
      for (std::uint32_t i = 0; i < 3; ++i) {
        network.serve(Server(i, 3, pulley::Adam{0.001F}, pulley::Async{}, pulley::FixedShards{12}));
      }
      pulley::Chief chief(pulley::InProcess(network, pulley::Node::chief()), 7);
      chief.initialize(variables);
      const pulley::ModelState saved = chief.save_state();
      std::uint64_t state = 0, lost = 0;
      for (const pulley::Part& part : chief.placement().parts) {
        const std::uint64_t bytes = 3 * pulley::part_bytes(part, variables);  // values, m, v
        state += bytes;
        if (part.ps == 1) lost += bytes;
      }
      network.kill(pulley::Node::ps(1));
      const auto began = Clock::now();
      chief.leave(std::vector<std::uint32_t>{1});
      chief.restore(saved);
      const auto ended = Clock::now();
      pauses.push_back(std::chrono::duration<double>(ended - began).count());
      state_mb = static_cast<double>(state) / 1e6;
      lost_mb = static_cast<double>(lost) / 1e6;
      sent_mb = state_mb;  // every member's whole new share: the whole state
      std::vector<char> from(state, 1), to(state);
      const auto copy_began = Clock::now();
      std::memcpy(to.data(), from.data(), state);
      copies.push_back(std::chrono::duration<double>(Clock::now() - copy_began).count());
      if (to[state / 2] != 1) return 1;
      chief.shutdown();
    }
    const double pause = median(pauses), copy = median(copies);
    std::printf("| %zu MiB | %.1f MB | %.1f MB | %.1f MB | %.2f | %.1f ms | %.2f | %.1f ms | %.1f |\n", mib, state_mb,
                lost_mb, sent_mb, sent_mb / lost_mb, pause * 1e3, sent_mb / 1e3 / pause, copy * 1e3, pause / copy);
  }
  return 0;
}
