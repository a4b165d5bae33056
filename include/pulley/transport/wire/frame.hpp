// SPDX-License-Identifier: MIT
#pragma once

/// The framing of pulley's messages on a byte stream (TCP).
///
/// A frame is a fixed 32-byte Header, then `meta_bytes` of metadata (the message's fields
/// without its tensors' values: codec.hpp), then zero bytes up to a multiple of 4
/// (`padding`), then `payload_bytes` of float32 tensor values: every tensor of the message,
/// back to back, in field order. A sender gather-writes the tensors from its own buffers
/// and a receiver reads them straight into place; the padding keeps them aligned where a
/// receiver reads several frames into one buffer and uses them there. Integers and floats
/// are little-endian.

#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <variant>
#include <vector>

#include "pulley/protocol/messages.hpp"

static_assert(std::endian::native == std::endian::little,
              "pulley's wire format is little-endian; big-endian hosts are not supported");

namespace pulley::wire {

inline constexpr std::uint32_t kMagic = 0x594C4C50;    ///< "PLLY" in a little-endian dump
inline constexpr std::uint16_t kVersion = 27;          ///< bumped on any incompatible change
inline constexpr std::uint16_t kResponseKind = 0x100;  ///< response kinds start here
inline constexpr std::uint16_t kHandshakeKind = 0x200;  ///< handshake kinds start here
inline constexpr std::size_t kHandshakeKinds = 4;       ///< Challenge, Hello, Welcome, Refusal
/// A ring's rendezvous (transport/tcp_ring_rendezvous.hpp) after its handshake: check-in, view, redirect.
inline constexpr std::uint16_t kRendezvousKind = 0x300;
inline constexpr std::size_t kRendezvousKinds = 3;

/// `Header::flags` of a hello: the client, on a local socket, offers to move the
/// connection's bytes through shared memory; of the welcome: the ps takes the offer. The two
/// ends then hand each other a ring (transport/detail/shared_rings.hpp) before any request.
/// A peer that never sets it (a raw client, another transport) talks on the socket as ever.
inline constexpr std::uint32_t kSharedMemoryFlag = 1;

/// What a receiver accepts in one frame, checked before it allocates anything for it. A
/// frame's metadata is small: 4 MiB holds the placement of ~50 000 variables.
struct FrameLimits {
  std::uint64_t max_meta_bytes = std::uint64_t{4} << 20U;     ///< metadata of one frame
  std::uint64_t max_payload_bytes = std::uint64_t{4} << 30U;  ///< tensor bytes of one frame
};

/// The fixed frame header. `kind` is the index of the message in Request, kResponseKind +
/// its index in Response, or kHandshakeKind + its index in wire::Handshake (handshake.hpp);
/// `call` pairs a response with its request.
struct Header {
  std::uint32_t magic = kMagic;
  std::uint16_t version = kVersion;
  std::uint16_t kind = 0;
  std::uint64_t call = 0;
  std::uint32_t meta_bytes = 0;
  std::uint32_t flags = 0;  ///< a hello's or welcome's: kSharedMemoryFlag; else 0 (ignored)
  std::uint64_t payload_bytes = 0;
};
static_assert(sizeof(Header) == 32 && std::is_trivially_copyable_v<Header>);

/// Index of alternative T in variant V.
template <class V, class T, std::size_t I = 0>
constexpr std::size_t variant_index() {
  if constexpr (std::is_same_v<std::variant_alternative_t<I, V>, T>) {
    return I;
  } else {
    return variant_index<V, T, I + 1>();
  }
}

/// True if T is one of variant V's alternatives.
template <class V, class T>
struct is_alternative;
template <class... A, class T>
struct is_alternative<std::variant<A...>, T> : std::bool_constant<(std::is_same_v<A, T> || ...)> {};

/// The header kind of message type T (a Request or a Response alternative).
template <class T>
constexpr std::uint16_t kind_of() {
  if constexpr (is_alternative<Request, T>::value) {
    return static_cast<std::uint16_t>(variant_index<Request, T>());
  } else {
    return static_cast<std::uint16_t>(kResponseKind + variant_index<Response, T>());
  }
}

/// Zero bytes between a frame's metadata and its payload: the payload starts 4-byte aligned
/// relative to the frame, and every frame's length is a multiple of 4.
constexpr std::size_t padding(std::uint64_t meta_bytes) noexcept {
  return static_cast<std::size_t>((4 - meta_bytes % 4) % 4);
}

/// Bytes of a frame before its payload: header, metadata, padding.
constexpr std::uint64_t head_bytes(const Header& h) noexcept {
  return sizeof(Header) + h.meta_bytes + padding(h.meta_bytes);
}

/// The zero bytes a sender writes as padding.
inline constexpr std::array<char, 4> kZeros{};

/// A frame that cannot be trusted: the receiver logs `what()` and closes the connection.
class Malformed : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Checks a received header against the protocol and `limits`; throws Malformed naming the
/// problem. Nothing else of the frame is read before this passes.
inline void check(const Header& h, const FrameLimits& limits = {}) {
  if (h.magic != kMagic) throw Malformed("bad magic: not a pulley peer");
  if (h.version != kVersion) {
    throw Malformed("protocol version " + std::to_string(h.version) + ", this side speaks " +
                    std::to_string(kVersion));
  }
  const bool request = h.kind < std::variant_size_v<Request>;
  const bool response =
      h.kind >= kResponseKind &&
      static_cast<std::size_t>(h.kind - kResponseKind) < std::variant_size_v<Response>;
  const bool handshake =
      h.kind >= kHandshakeKind && static_cast<std::size_t>(h.kind - kHandshakeKind) < kHandshakeKinds;
  const bool rendezvous =
      h.kind >= kRendezvousKind && static_cast<std::size_t>(h.kind - kRendezvousKind) < kRendezvousKinds;
  if (!request && !response && !handshake && !rendezvous) {
    throw Malformed("unknown message kind " + std::to_string(h.kind));
  }
  if (h.meta_bytes > limits.max_meta_bytes) {
    throw Malformed("metadata of " + std::to_string(h.meta_bytes) + " bytes exceeds the limit");
  }
  if (h.payload_bytes > limits.max_payload_bytes || h.payload_bytes % sizeof(float) != 0) {
    throw Malformed("payload of " + std::to_string(h.payload_bytes) +
                    " bytes is over the limit or not whole floats");
  }
}

/// A message ready to send: header, metadata, and views of the tensors to write after them
/// (after `padding(header.meta_bytes)` zero bytes).
struct Frame {
  Header header;
  std::string meta;
  std::vector<std::span<const float>> payload;

  /// Bytes of the whole frame on the wire.
  [[nodiscard]] std::uint64_t size() const noexcept {
    return head_bytes(header) + header.payload_bytes;
  }
};

}  // namespace pulley::wire
