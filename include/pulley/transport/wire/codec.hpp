// SPDX-License-Identifier: MIT
#pragma once

/// Encoding and decoding whole messages, as their declarations (protocol/messages/, listed in
/// protocol/messages.hpp) say: a message's `serialize` is its metadata, its tensor fields its
/// payload.

#include <cstddef>
#include <cstdint>
#include <exception>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/protocol/messages.hpp"
#include "pulley/transport/wire/archive.hpp"
#include "pulley/transport/wire/frame.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley::wire {

/// The first frame kind of a Request, Response or Handshake variant.
template <class Variant>
constexpr std::uint16_t first_kind() noexcept {
  if constexpr (std::is_same_v<Variant, Response>) {
    return kResponseKind;
  } else if constexpr (std::is_same_v<Variant, Handshake>) {
    return kHandshakeKind;
  } else {
    static_assert(std::is_same_v<Variant, Request>);
    return 0;
  }
}

/// Encodes a request, a response or a handshake message (a Request, Response or Handshake
/// variant) as a frame for call `call`. The frame's payload views alias the message's
/// tensors.
template <class Variant>
Frame encode(const Variant& message, std::uint64_t call) {
  Frame frame;
  MetaWriter archive(frame.meta, frame.payload);
  // cereal saves through a const message; `serialize` is the one declaration of its fields.
  std::visit([&](const auto& m) { archive(const_cast<std::remove_cvref_t<decltype(m)>&>(m)); },
             message);
  frame.header.kind = static_cast<std::uint16_t>(message.index() + first_kind<Variant>());
  frame.header.call = call;
  frame.header.meta_bytes = static_cast<std::uint32_t>(frame.meta.size());
  for (auto v : frame.payload) frame.header.payload_bytes += v.size_bytes();
  return frame;
}

namespace detail {

template <class Variant, std::size_t... I>
Variant read_alternative(std::size_t index, MetaReader& a, std::index_sequence<I...>) {
  Variant out;
  const bool found = ((index == I ? (a(out.template emplace<I>()), true) : false) || ...);
  if (!found) throw Malformed("unknown message kind " + std::to_string(index));
  return out;
}

template <class Variant>
Variant decode(std::size_t index, std::span<const char> meta,
               std::optional<std::span<const float>> payload, std::uint64_t payload_floats,
               std::vector<std::size_t>* sizes = nullptr) {
  try {
    MetaReader archive(meta, payload, sizes);
    archive.expect_payload(payload_floats);
    Variant message = read_alternative<Variant>(
        index, archive, std::make_index_sequence<std::variant_size_v<Variant>>{});
    archive.finish(payload_floats);
    return message;
  } catch (const Malformed&) {
    throw;
  } catch (const std::exception& e) {  // e.g. bad_alloc: the frame is given up, not the process
    throw Malformed(std::string("undecodable metadata: ") + e.what());
  }
}

}  // namespace detail

/// Decodes a request frame whose header passed `check`; its tensors view `payload`.
inline Request decode_request(const Header& h, std::span<const char> meta,
                              std::span<const float> payload) {
  if (h.kind >= kResponseKind) throw Malformed("a reply or a handshake where a request was expected");
  return detail::decode<Request>(h.kind, meta, payload, payload.size());
}

/// Decodes a response frame whose header passed `check`; its tensors view `payload`.
inline Response decode_response(const Header& h, std::span<const char> meta,
                                std::span<const float> payload) {
  if (h.kind < kResponseKind || h.kind >= kHandshakeKind) {
    throw Malformed("a request or a handshake where a response was expected");
  }
  return detail::decode<Response>(h.kind - kResponseKind, meta, payload, payload.size());
}

/// Decodes a response frame's metadata alone, before its payload arrives: its tensors are
/// empty views, and their sizes (which add up to the header's payload) go to `sizes`. A
/// receiver routes the payload into its own buffers and then points the views at them.
inline Response decode_response_meta(const Header& h, std::span<const char> meta,
                                     std::vector<std::size_t>& sizes) {
  if (h.kind < kResponseKind || h.kind >= kHandshakeKind) {
    throw Malformed("a request or a handshake where a response was expected");
  }
  sizes.clear();
  return detail::decode<Response>(h.kind - kResponseKind, meta, std::nullopt,
                                  h.payload_bytes / sizeof(float), &sizes);
}

/// Decodes a handshake frame whose header passed `check`; throws Malformed for a frame that
/// is no handshake message.
inline Handshake decode_handshake(const Header& h, std::span<const char> meta) {
  if (h.kind < kHandshakeKind || h.payload_bytes != 0) {
    throw Malformed("a request or a reply where the handshake was expected");
  }
  return detail::decode<Handshake>(h.kind - kHandshakeKind, meta, std::nullopt, 0);
}

/// Decodes a handshake frame that must hold alternative `Expected`.
template <class Expected>
Expected decode_handshake_as(const Header& h, std::span<const char> meta) {
  Handshake message = decode_handshake(h, meta);
  if (auto* expected = std::get_if<Expected>(&message)) return std::move(*expected);
  throw Malformed("expected " + std::string(Expected::kName) + " in the handshake, got " +
                  std::string(message_name(message)));
}

}  // namespace pulley::wire
