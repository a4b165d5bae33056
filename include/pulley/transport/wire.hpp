// SPDX-License-Identifier: MIT
#pragma once

/// The wire format of pulley's messages, for byte-stream transports (TCP).
///
/// A frame is a fixed 32-byte Header, then `meta_bytes` of metadata (the message without its
/// tensors, serialized with cereal), then zero bytes up to a multiple of 4 (`padding`), then
/// `payload_bytes` of float32 tensor data: every tensor of the message, back to back, in
/// message order. Tensors never pass through cereal, so a sender can gather-write them from
/// their own buffers and a receiver can read them straight into place; the padding keeps
/// them aligned where a receiver reads several frames into one buffer and uses them there.
/// Integers and floats are little-endian.

#include <array>
#include <bit>
#include <cereal/cereal.hpp>
#include <cereal/types/common.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/messages.hpp"

static_assert(std::endian::native == std::endian::little,
              "pulley's wire format is little-endian; big-endian hosts are not supported");

namespace pulley {

template <class A>
void serialize(A& a, Initializer& i) {
  a(i.kind, i.value);
}
template <class A>
void serialize(A& a, VariableSpec& v) {
  a(v.name, v.shape, v.initializer);
}
template <class A>
void serialize(A& a, RowRange& r) {
  a(r.begin, r.end);
}
template <class A>
void serialize(A& a, Part& p) {
  a(p.variable, p.index, p.ps, p.rows);
}
template <class A>
void serialize(A& a, Placement& p) {
  a(p.parts, p.first_part);
}
template <class A>
void serialize(A& a, Slice& s) {
  a(s.part, s.rows);
}
template <class A>
void serialize(A& a, Register& m) {
  a(m.variables);
}
template <class A>
void serialize(A& a, TakeToken& m) {
  a(m.worker);
}
template <class A>
void serialize(A& a, Pull& m) {
  a(m.min_step, m.slices);
}
template <class A>
void serialize(A& a, ErrorReply& m) {
  a(m.code, m.message);
}
template <class A>
void serialize(A& a, PlacementReply& m) {
  a(m.variables, m.placement);
}
template <class A>
void serialize(A& a, TokenReply& m) {
  a(m.local_step, m.global_step, m.one_token_per_step, m.paced);
}
template <class A>
void serialize(A& a, PushReply& m) {
  a(m.stale_parts);
}
template <class A>
void serialize(A& a, StatsReply& m) {
  a(m.stats);
}
template <class A>
void serialize(A&, WaitReady&) {}
template <class A>
void serialize(A&, GetStats&) {}
template <class A>
void serialize(A&, Shutdown&) {}
template <class A>
void serialize(A&, Ack&) {}
template <class A>
void serialize(A& a, Stats& s) {
  a(s.global_step, s.updates_applied, s.gradients_accepted, s.stale_gradients_dropped,
    s.requests_rejected, s.bytes_pushed, s.bytes_pulled);
}

namespace wire {

inline constexpr std::uint32_t kMagic = 0x594C4C50;    ///< "PLLY" in a little-endian dump
inline constexpr std::uint16_t kVersion = 3;           ///< bumped on any incompatible change
inline constexpr std::uint16_t kResponseKind = 0x100;  ///< response kinds start here

/// Limits a receiver enforces before it allocates anything for a frame. A frame's metadata
/// (all but its tensors) is small: 4 MiB holds the placement of ~50 000 variables.
struct Limits {
  std::uint64_t max_meta_bytes = std::uint64_t{4} << 20U;
  std::uint64_t max_payload_bytes = std::uint64_t{4} << 30U;
  /// A server stops reading a connection's requests while more than this many bytes of its
  /// replies wait to be written (a client that does not read cannot grow the ps's memory).
  std::uint64_t max_unsent_bytes = std::uint64_t{64} << 20U;
  /// A server stops reading a connection's requests while this many of them are handled but
  /// not answered (pulls waiting for a step, token requests), since their replies come all
  /// at once later. A pulley client has at most three in flight per ps.
  std::uint32_t max_unanswered_requests = 16;
};

/// The fixed frame header. `kind` is the index of the alternative in Request, or
/// kResponseKind + the index in Response; `call` pairs a response with its request.
struct Header {
  std::uint32_t magic = kMagic;
  std::uint16_t version = kVersion;
  std::uint16_t kind = 0;
  std::uint64_t call = 0;
  std::uint32_t meta_bytes = 0;
  std::uint32_t reserved = 0;
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

/// The cereal input archive for received metadata: BinaryInputArchive's format, read from
/// bytes in memory, distrusting them. Every length prefix (of a vector, a string) is checked
/// against the bytes still unread before cereal allocates for it, so a frame claiming 2^40
/// elements is refused instead of exhausting memory: a container can claim at most one
/// element per remaining byte, and a vector of structs grows only as elements arrive.
/// Running past the end throws Malformed.
class MetaReader : public cereal::InputArchive<MetaReader, cereal::AllowEmptyClassElision> {
 public:
  explicit MetaReader(std::span<const char> bytes) : InputArchive(this), bytes_(bytes) {}

  /// Copies the next `n` bytes to `out`.
  void read(void* out, std::size_t n) {
    if (n > bytes_.size()) throw Malformed("metadata ends in the middle of a field");
    if (n == 0) return;  // an empty vector's data() may be null
    std::memcpy(out, bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
  }
  /// Bytes not read yet.
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size(); }
  /// Throws Malformed unless every byte was read: a message is exactly its metadata.
  void finish() const {
    if (!bytes_.empty()) {
      throw Malformed("metadata has " + std::to_string(bytes_.size()) + " bytes past the message");
    }
  }

 private:
  std::span<const char> bytes_;
};

// How cereal loads through a MetaReader (found by argument-dependent lookup).
template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, T& t) {
  a.read(std::addressof(t), sizeof(t));
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, cereal::NameValuePair<T>& t) {
  a(t.value);
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, cereal::SizeTag<T>& t) {
  a(t.size);
  if (t.size > a.remaining()) {
    throw Malformed("a length of " + std::to_string(t.size) + " with only " +
                    std::to_string(a.remaining()) + " metadata bytes left");
  }
}
template <class T>
void CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, cereal::BinaryData<T>& data) {
  a.read(data.data, static_cast<std::size_t>(data.size));
}
/// Vectors of structs grow as their elements are read, never to the claimed length first:
/// a VariableSpec takes ~64 bytes in memory for ~20 on the wire, so resizing up front would
/// let a frame make the receiver allocate many times its size. (Arithmetic elements are
/// read in one block, at most 8 bytes in memory per byte claimed.)
template <class T, class A>
std::enable_if_t<!std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(MetaReader& a,
                                                                     std::vector<T, A>& v) {
  cereal::size_type n = 0;
  a(cereal::make_size_tag(n));
  v.clear();
  for (cereal::size_type i = 0; i < n; ++i) a(v.emplace_back());
}

/// The cereal output archive for metadata: BinaryOutputArchive's format, appended to a
/// string (no stream, no locale: messages are encoded on every call).
class MetaWriter : public cereal::OutputArchive<MetaWriter, cereal::AllowEmptyClassElision> {
 public:
  explicit MetaWriter(std::string& out) : OutputArchive(this), out_(out) {}
  /// Appends `n` bytes.
  void write(const void* data, std::size_t n) { out_.append(static_cast<const char*>(data), n); }

 private:
  std::string& out_;
};

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_SAVE_FUNCTION_NAME(MetaWriter& a, const T& t) {
  a.write(std::addressof(t), sizeof(t));
}
template <class T>
void CEREAL_SAVE_FUNCTION_NAME(MetaWriter& a, const cereal::NameValuePair<T>& t) {
  a(t.value);
}
template <class T>
void CEREAL_SAVE_FUNCTION_NAME(MetaWriter& a, const cereal::SizeTag<T>& t) {
  a(t.size);
}
template <class T>
void CEREAL_SAVE_FUNCTION_NAME(MetaWriter& a, const cereal::BinaryData<T>& data) {
  a.write(data.data, static_cast<std::size_t>(data.size));
}

/// Checks a received header against the protocol and `limits`; throws Malformed naming the
/// problem. Nothing else of the frame is read before this passes.
inline void check(const Header& h, const Limits& limits = {}) {
  if (h.magic != kMagic) throw Malformed("bad magic: not a pulley peer");
  if (h.version != kVersion) {
    throw Malformed("protocol version " + std::to_string(h.version) + ", this side speaks " +
                    std::to_string(kVersion));
  }
  const bool request = h.kind < std::variant_size_v<Request>;
  const bool response =
      h.kind >= kResponseKind &&
      static_cast<std::size_t>(h.kind - kResponseKind) < std::variant_size_v<Response>;
  if (!request && !response) throw Malformed("unknown message kind " + std::to_string(h.kind));
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

namespace detail {

/// Tensors of a message travel as their sizes in the metadata and their values in the payload.
template <class A>
void sizes_of(A& a, const std::vector<PartValues>& parts) {
  std::vector<std::uint32_t> ids;
  std::vector<std::uint64_t> sizes;
  for (const PartValues& pv : parts) {
    ids.push_back(pv.part);
    sizes.push_back(pv.values.size());
  }
  a(ids, sizes);
}

/// Messages with tensors send their sizes in the metadata and their values as payload;
/// every other message is its cereal `serialize`.
template <class Message>
void write_meta(MetaWriter& a, const Message& m, std::vector<std::span<const float>>& payload) {
  if constexpr (std::is_same_v<Message, Initialize>) {
    sizes_of(a, m.parts);
    for (const PartValues& pv : m.parts) payload.push_back(pv.values);
  } else if constexpr (std::is_same_v<Message, Push>) {
    a(m.worker, m.local_step);
    sizes_of(a, m.gradients);
    for (const PartValues& pv : m.gradients) payload.push_back(pv.values);
  } else if constexpr (std::is_same_v<Message, PullReply>) {
    std::vector<std::uint64_t> sizes;
    for (auto v : m.values) sizes.push_back(v.size());
    a(m.global_step, sizes);
    for (auto v : m.values) payload.push_back(v);
  } else {
    a(m);
  }
}

/// Cuts `payload` into consecutive views of `sizes`; throws Malformed unless they add up.
inline std::vector<std::span<const float>> cut(std::span<const float> payload,
                                               const std::vector<std::uint64_t>& sizes) {
  std::vector<std::span<const float>> views;
  std::uint64_t offset = 0;
  for (std::uint64_t n : sizes) {
    if (n > payload.size() - offset) throw Malformed("tensor sizes exceed the payload");
    views.push_back(payload.subspan(offset, n));
    offset += n;
  }
  if (offset != payload.size()) throw Malformed("payload has bytes no tensor claims");
  return views;
}

inline std::vector<PartValues> read_parts(MetaReader& a, std::span<const float> payload) {
  std::vector<std::uint32_t> ids;
  std::vector<std::uint64_t> sizes;
  a(ids, sizes);
  if (ids.size() != sizes.size()) throw Malformed("part ids and sizes disagree");
  const auto views = cut(payload, sizes);
  std::vector<PartValues> parts;
  for (std::size_t i = 0; i < ids.size(); ++i) parts.push_back({ids[i], views[i]});
  return parts;
}

template <class Message>
Message read_meta(MetaReader& a, std::span<const float> payload) {
  Message m{};
  if constexpr (std::is_same_v<Message, Initialize>) {
    m.parts = read_parts(a, payload);
  } else if constexpr (std::is_same_v<Message, Push>) {
    a(m.worker, m.local_step);
    m.gradients = read_parts(a, payload);
  } else if constexpr (std::is_same_v<Message, PullReply>) {
    std::vector<std::uint64_t> sizes;
    a(m.global_step, sizes);
    m.values = cut(payload, sizes);
  } else {
    if (!payload.empty()) throw Malformed("a message without tensors carries a payload");
    a(m);
  }
  return m;
}

template <class Variant, std::size_t... I>
Variant read_alternative(std::size_t index, MetaReader& a, std::span<const float> payload,
                         std::index_sequence<I...>) {
  Variant out;
  const bool found =
      ((index == I ? (out = read_meta<std::variant_alternative_t<I, Variant>>(a, payload), true)
                   : false) ||
       ...);
  if (!found) throw Malformed("unknown message kind " + std::to_string(index));
  return out;
}

template <class Variant>
Variant decode(std::size_t index, std::span<const char> meta, std::span<const float> payload) {
  try {
    MetaReader archive(meta);
    Variant message = read_alternative<Variant>(
        index, archive, payload, std::make_index_sequence<std::variant_size_v<Variant>>{});
    archive.finish();
    return message;
  } catch (const Malformed&) {
    throw;
  } catch (const std::exception& e) {  // e.g. bad_alloc: the frame is given up, not the process
    throw Malformed(std::string("undecodable metadata: ") + e.what());
  }
}

}  // namespace detail

/// Encodes a request or response (a Request or Response variant) as a frame for call `call`.
/// The frame's payload views alias the message's tensors.
template <class Variant>
Frame encode(const Variant& message, std::uint64_t call) {
  Frame frame;
  MetaWriter archive(frame.meta);
  std::visit([&](const auto& m) { detail::write_meta(archive, m, frame.payload); }, message);
  frame.header.kind = static_cast<std::uint16_t>(
      message.index() + (std::is_same_v<Variant, Response> ? kResponseKind : 0));
  frame.header.call = call;
  frame.header.meta_bytes = static_cast<std::uint32_t>(frame.meta.size());
  for (auto v : frame.payload) frame.header.payload_bytes += v.size_bytes();
  return frame;
}

/// Reads a PullReply's metadata alone: its global step and its tensors' sizes, so that a
/// client can read the payload straight into its pull targets.
inline std::pair<std::int64_t, std::vector<std::uint64_t>> read_pull_reply_meta(
    std::span<const char> meta) {
  std::pair<std::int64_t, std::vector<std::uint64_t>> out;
  try {
    MetaReader archive(meta);
    archive(out.first, out.second);
    archive.finish();
  } catch (const Malformed&) {
    throw;
  } catch (const std::exception& e) {
    throw Malformed(std::string("undecodable pull reply: ") + e.what());
  }
  return out;
}

/// The kind of a frame carrying a PullReply.
inline constexpr std::uint16_t kPullReplyKind =
    static_cast<std::uint16_t>(kResponseKind + variant_index<Response, PullReply>());

/// Decodes a request frame whose header passed `check`; its tensors view `payload`.
inline Request decode_request(const Header& h, std::span<const char> meta,
                              std::span<const float> payload) {
  if (h.kind >= kResponseKind) throw Malformed("a response where a request was expected");
  return detail::decode<Request>(h.kind, meta, payload);
}

/// Decodes a response frame whose header passed `check`; its tensors view `payload`.
inline Response decode_response(const Header& h, std::span<const char> meta,
                                std::span<const float> payload) {
  if (h.kind < kResponseKind) throw Malformed("a request where a response was expected");
  return detail::decode<Response>(h.kind - kResponseKind, meta, payload);
}

}  // namespace wire
}  // namespace pulley

// cereal checks a load against the matching save.
CEREAL_SETUP_ARCHIVE_TRAITS(pulley::wire::MetaReader, pulley::wire::MetaWriter)
