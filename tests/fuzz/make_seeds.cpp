// SPDX-License-Identifier: MIT
// Writes the fuzzer's seed inputs: well-formed streams (a hello, then requests of every
// kind) for it to mutate from. Each file is one input: a byte choosing the receive size,
// then the stream.   make_seeds DIR
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace {

void append(std::string& out, const pulley::wire::Frame& f) {
  out.append(reinterpret_cast<const char*>(&f.header), sizeof f.header);
  out.append(f.meta);
  out.append(pulley::wire::kZeros.data(), pulley::wire::padding(f.meta.size()));
  for (auto v : f.payload) out.append(reinterpret_cast<const char*>(v.data()), v.size_bytes());
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) return 2;
  using namespace pulley;
  const std::string hello_stream = [] {
    std::string s;
    append(s, wire::encode(wire::Handshake{wire::Hello{"fuzz", Node::worker(0),
                                                       std::string(32, 'c'), std::string(32, 'p')}},
                           0));
    return s;
  }();
  const std::vector<float> six(6, 0.25F), three(3, 0.5F), one(1, 1.0F);
  const std::vector<Request> requests{
      Register{{{"w", {4, 3}, Initializer::zeros()}, {"b", {3}, Initializer::zeros()}}},
      Initialize{{{0, six}}},
      WaitReady{},
      TakeToken{0},
      Pull{0, {{0, {0, 2}}, {2, {0, 1}}}},
      Pull{1, {{1, {2, 4}}}},
      Push{0, 0, {{0, six}, {1, six}, {2, std::span<const float>(three).first(2)}, {3, one}}},
      GetStats{},
      Shutdown{false, "done"},
  };
  int n = 0;
  for (const Request& r : requests) {
    std::string input(1, static_cast<char>(7 * n + 3));
    input += hello_stream;
    append(input, wire::encode(r, static_cast<std::uint64_t>(n + 1)));
    std::ofstream(std::string(argv[1]) + "/seed-" + std::to_string(n++), std::ios::binary) << input;
  }
  std::string all(1, '\x40');  // every request in one stream
  all += hello_stream;
  for (const Request& r : requests) append(all, wire::encode(r, 99));
  std::ofstream(std::string(argv[1]) + "/seed-all", std::ios::binary) << all;
  std::printf("wrote %d seeds\n", n + 1);
  return 0;
}
