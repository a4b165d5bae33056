// SPDX-License-Identifier: MIT
#pragma once

/// The fields of a checkpoint's index: detail::IndexWriter appends little-endian fields to
/// a byte string, detail::IndexReader reads them back, each checked against the bytes left,
/// and detail::TensorRef (where a tensor lies in the data file) is written and read with
/// put_ref and get_ref.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "pulley/checkpoint/format_constants.hpp"  // the format is little-endian (asserted there)
#include "pulley/core/error.hpp"

namespace pulley::checkpoint::detail {

/// Appends little-endian fields to a byte string.
class IndexWriter {
 public:
  template <class T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    bytes_.append(reinterpret_cast<const char*>(&value), sizeof value);
  }
  void put(std::string_view text) {
    put(static_cast<std::uint32_t>(text.size()));
    bytes_.append(text);
  }
  [[nodiscard]] const std::string& bytes() const noexcept { return bytes_; }
  std::string& bytes() noexcept { return bytes_; }

 private:
  std::string bytes_;
};

/// Reads fields back, each checked against the bytes left; a count is checked to fit.
class IndexReader {
 public:
  IndexReader(std::span<const char> bytes, std::string where)
      : bytes_(bytes), where_(std::move(where)) {}

  template <class T>
  T get() {
    static_assert(std::is_arithmetic_v<T>);
    T value{};
    take(&value, sizeof value);
    return value;
  }
  std::string get_string() {
    const auto n = get<std::uint32_t>();
    if (n > bytes_.size()) bad("a string longer than the index");
    std::string out(bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
    return out;
  }
  /// A count of items of at least `bytes_each` bytes each: no more than can follow.
  std::uint32_t get_count(std::size_t bytes_each) {
    const auto n = get<std::uint32_t>();
    if (static_cast<std::uint64_t>(n) * bytes_each > bytes_.size())
      bad("a count larger than the index");
    return n;
  }
  [[nodiscard]] std::size_t left() const noexcept { return bytes_.size(); }
  [[noreturn]] void bad(const std::string& what) const {
    throw Error(ErrorCode::kDataLoss, where_ + ": " + what);
  }

 private:
  void take(void* out, std::size_t n) {
    if (n > bytes_.size()) bad("the index ends in the middle of a field");
    std::memcpy(out, bytes_.data(), n);
    bytes_ = bytes_.subspan(n);
  }

  std::span<const char> bytes_;
  std::string where_;
};

/// Where a tensor lies in the data file.
struct TensorRef {
  std::uint64_t offset = 0;
  std::uint64_t floats = 0;
  std::uint32_t crc = 0;
};

inline void put_ref(IndexWriter& w, const TensorRef& r) {
  w.put(r.offset);
  w.put(r.floats);
  w.put(r.crc);
}
inline TensorRef get_ref(IndexReader& r) {
  TensorRef ref;
  ref.offset = r.get<std::uint64_t>();
  ref.floats = r.get<std::uint64_t>();
  ref.crc = r.get<std::uint32_t>();
  return ref;
}

}  // namespace pulley::checkpoint::detail
