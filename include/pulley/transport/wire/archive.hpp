// SPDX-License-Identifier: MIT
#pragma once

/// The cereal archives that write and read a frame's metadata: BinaryArchive's format,
/// appended to a string and read from bytes in memory, distrusting them. A tensor field
/// (`std::span<const float>`) is written as its element count, and its values go to the
/// frame's payload (frame.hpp); reading cuts the views from the received payload.

#include <cereal/cereal.hpp>
#include <cereal/types/common.hpp>
#include <cereal/types/string.hpp>
#include <cereal/types/vector.hpp>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "pulley/transport/wire/frame.hpp"

namespace pulley::wire {

/// The output archive for metadata, collecting the message's tensors for the payload.
class MetaWriter : public cereal::OutputArchive<MetaWriter, cereal::AllowEmptyClassElision> {
 public:
  /// Appends metadata to `out`, tensors (views) to `payload`.
  MetaWriter(std::string& out, std::vector<std::span<const float>>& payload)
      : OutputArchive(this), out_(out), payload_(payload) {}
  /// Appends `n` bytes.
  void write(const void* data, std::size_t n) { out_.append(static_cast<const char*>(data), n); }
  /// A tensor: its size here, its values in the payload.
  void tensor(std::span<const float> values) {
    const std::uint64_t n = values.size();
    write(&n, sizeof n);
    payload_.push_back(values);
  }

 private:
  std::string& out_;
  std::vector<std::span<const float>>& payload_;
};

/// The input archive for received metadata. Every length prefix (of a vector, a string) is
/// checked against the bytes still unread before cereal allocates for it, so a frame
/// claiming 2^40 elements is refused instead of exhausting memory: a container can claim at
/// most one element per remaining byte, and a vector of structs grows only as elements
/// arrive. A tensor's size is checked against the payload left. Running past the end
/// throws Malformed.
class MetaReader : public cereal::InputArchive<MetaReader, cereal::AllowEmptyClassElision> {
 public:
  /// Reads `meta`; tensors are cut from `payload`, or, without one, left empty and their
  /// sizes appended to `sizes` (for a receiver that routes the payload elsewhere).
  MetaReader(std::span<const char> meta, std::optional<std::span<const float>> payload,
             std::vector<std::size_t>* sizes = nullptr)
      : InputArchive(this), bytes_(meta), payload_(payload), sizes_(sizes) {}

  /// Copies the next `n` bytes to `out`.
  void read(void* out, std::size_t n) {
    if (n > bytes_.size()) throw Malformed("metadata ends in the middle of a field");
    if (n == 0) return;  // an empty vector's data() may be null
    std::memcpy(out, bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
  }
  /// The next tensor: its size, then a view of the payload.
  std::span<const float> tensor() {
    std::uint64_t n = 0;
    read(&n, sizeof n);
    const std::uint64_t left = payload_floats() - floats_;
    if (n > left) throw Malformed("tensor sizes exceed the payload");
    const std::size_t begin = static_cast<std::size_t>(floats_);
    floats_ += n;
    if (!payload_) {
      if (sizes_ != nullptr) sizes_->push_back(static_cast<std::size_t>(n));
      return {};
    }
    return payload_->subspan(begin, static_cast<std::size_t>(n));
  }
  /// Bytes not read yet.
  [[nodiscard]] std::size_t remaining() const noexcept { return bytes_.size(); }
  /// Throws Malformed unless every byte of the metadata and every float of the payload
  /// (`payload_floats` of them when there is no payload) was claimed: a message is exactly
  /// its frame.
  void finish(std::uint64_t payload_floats) {
    if (!bytes_.empty()) {
      throw Malformed("metadata has " + std::to_string(bytes_.size()) + " bytes past the message");
    }
    expected_floats_ = payload_floats;
    if (floats_ != this->payload_floats()) throw Malformed("payload has bytes no tensor claims");
  }
  /// Before `finish`, the payload's size in floats, when it has none to cut from.
  void expect_payload(std::uint64_t floats) noexcept { expected_floats_ = floats; }

 private:
  [[nodiscard]] std::uint64_t payload_floats() const noexcept {
    return payload_ ? payload_->size() : expected_floats_;
  }

  std::span<const char> bytes_;
  std::optional<std::span<const float>> payload_;
  std::vector<std::size_t>* sizes_;
  std::uint64_t expected_floats_ = 0;
  std::uint64_t floats_ = 0;  ///< payload floats claimed so far
};

// How cereal writes through a MetaWriter and reads through a MetaReader (found by
// argument-dependent lookup).
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
inline void CEREAL_SAVE_FUNCTION_NAME(MetaWriter& a, const std::span<const float>& t) {
  a.tensor(t);
}

template <class T>
std::enable_if_t<std::is_arithmetic_v<T>> CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, T& t) {
  a.read(std::addressof(t), sizeof(t));
}
/// A bool is one byte, 0 or 1: any other byte is refused (it would be no bool at all).
inline void CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, bool& t) {
  static_assert(sizeof(bool) == 1, "a bool is written as one byte");
  std::uint8_t byte = 0;
  a.read(&byte, 1);
  if (byte > 1) throw Malformed("a bool of value " + std::to_string(byte));
  t = byte == 1;
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
inline void CEREAL_LOAD_FUNCTION_NAME(MetaReader& a, std::span<const float>& t) { t = a.tensor(); }
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

}  // namespace pulley::wire

// cereal checks a load against the matching save.
CEREAL_SETUP_ARCHIVE_TRAITS(pulley::wire::MetaReader, pulley::wire::MetaWriter)
