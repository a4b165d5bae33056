// SPDX-License-Identifier: MIT
// libFuzzer target: what a ps does with bytes from a connection before it trusts them. The
// input is cut into receives (sizes from its own bytes) and fed to a FrameReader as the
// TcpServer does: first with the handshake's limits, expecting a Hello that is checked
// against a challenge; then, as if that client had proved itself, every frame is decoded as
// a request and handed to a ParameterServer, and also as a response and a handshake message
// (what a client decodes). A Malformed frame is the expected way out; anything else that
// escapes (another exception, a crash, a leak, undefined behaviour) is a finding.
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "pulley/optimizers/adam.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/partitioned.hpp"
#include "pulley/sync/sync_replicas.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace {

using Server = pulley::ParameterServer<pulley::FixedShards, pulley::Adam, pulley::SyncReplicas>;

Server ready_server() {
  Server ps(0, 1, pulley::Adam{}, pulley::SyncReplicas(2, 2), pulley::FixedShards{2});
  auto ignore = [](pulley::Response&&) {};
  const std::vector<pulley::VariableSpec> model{{"w", {4, 3}, pulley::Initializer::zeros()},
                                                {"b", {3}, pulley::Initializer::zeros()}};
  ps.handle(pulley::Register{model}, {}, ignore);
  const std::vector<float> w(6, 0.5F), b(3, 0.5F);
  ps.handle(pulley::Initialize{{{0, w}, {1, w}, {2, std::span<const float>(b).first(2)},
                                {3, std::span<const float>(b).subspan(2)}}},
            {}, ignore);
  return ps;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return 0;
  const std::size_t step = 1 + data[0] % 97;  // receive sizes, from the input itself
  const std::span<const std::uint8_t> stream(data + 1, size - 1);
  const pulley::Credentials credentials{"fuzz", "secret"};
  const pulley::wire::Challenge challenge{credentials.job, 0, std::string(32, 'n')};
  pulley::wire::MemoryBudget budget(std::uint64_t{64} << 20U);
  pulley::wire::FrameReader reader(pulley::wire::kHandshakeLimits, 4096, &budget);
  Server ps = ready_server();
  bool welcomed = false;
  std::size_t at = 0;
  auto keep = [&](const pulley::wire::Header& h, std::span<const char>) {
    if (h.payload_bytes > ps.max_request_payload()) throw pulley::wire::Malformed("too large");
    return std::span<const std::span<float>>();
  };
  try {
    while (at < stream.size()) {
      std::size_t got = 0;
      const std::size_t want = std::min(step, stream.size() - at);
      for (std::span<std::byte> b : reader.buffers()) {
        const std::size_t n = std::min(want - got, b.size());
        std::memcpy(b.data(), stream.data() + at + got, n);
        got += n;
        if (got == want) break;
      }
      reader.commit(got);
      at += got;
      while (auto frame = reader.next(keep)) {
        if (!welcomed) {
          const auto hello = pulley::wire::decode_handshake_as<pulley::wire::Hello>(frame->header, frame->meta);
          (void)pulley::wire::refusal_reason(credentials, challenge, hello);
          welcomed = true;  // as if it had proved the secret: go on to the requests
          reader.set_limits({});
          continue;
        }
        try {
          (void)pulley::wire::decode_handshake(frame->header, frame->meta);
        } catch (const pulley::wire::Malformed&) {
        }
        try {
          (void)pulley::wire::decode_response(frame->header, frame->meta, frame->payload);
        } catch (const pulley::wire::Malformed&) {
        }
        pulley::Request request =
            pulley::wire::decode_request(frame->header, frame->meta, frame->payload);
        ps.handle(std::move(request), pulley::RequestContext{frame->finite, pulley::Node::worker(0), 1},
                  [](pulley::Response&&) {});
      }
    }
  } catch (const pulley::wire::Malformed&) {
    // the connection would be closed: the expected end of bad input
  }
  return 0;
}
