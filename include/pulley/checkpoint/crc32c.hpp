// SPDX-License-Identifier: MIT
#pragma once

/// CRC-32C (Castagnoli), the checksum of every tensor in a checkpoint: what TensorFlow's
/// checkpoints and most storage formats use. x86-64 computes it with the SSE 4.2 `crc32`
/// instruction when the processor has it (checked at run time, no compiler flag needed),
/// elsewhere with a table, eight bytes at a time.

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

namespace pulley::checkpoint {

namespace detail {

/// Eight tables of 256 entries: table[k][b] is the CRC of byte b followed by k zero bytes.
constexpr std::array<std::array<std::uint32_t, 256>, 8> make_crc_tables() noexcept {
  std::array<std::array<std::uint32_t, 256>, 8> t{};
  for (std::uint32_t b = 0; b < 256; ++b) {
    std::uint32_t c = b;
    for (int i = 0; i < 8; ++i) c = (c & 1U) != 0 ? (c >> 1U) ^ 0x82F63B78U : c >> 1U;
    t[0][b] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::uint32_t b = 0; b < 256; ++b) t[k][b] = (t[k - 1][b] >> 8U) ^ t[0][t[k - 1][b] & 0xFFU];
  }
  return t;
}

inline constexpr auto kCrcTables = make_crc_tables();

/// The table version, on the running CRC's inverted state.
inline std::uint32_t crc32c_table(std::uint32_t state, const unsigned char* p, std::size_t n) noexcept {
  const auto& t = kCrcTables;
  while (n >= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    word ^= state;
    state = t[7][word & 0xFFU] ^ t[6][(word >> 8U) & 0xFFU] ^ t[5][(word >> 16U) & 0xFFU] ^
            t[4][(word >> 24U) & 0xFFU] ^ t[3][(word >> 32U) & 0xFFU] ^
            t[2][(word >> 40U) & 0xFFU] ^ t[1][(word >> 48U) & 0xFFU] ^ t[0][word >> 56U];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) state = (state >> 8U) ^ t[0][(state ^ *p++) & 0xFFU];
  return state;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
/// The SSE 4.2 version: three independent streams would go faster still, but one already
/// runs at several GB/s, beyond the disks a checkpoint is written to.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t state,
                                                                   const unsigned char* p,
                                                                   std::size_t n) noexcept {
  std::uint64_t s = state;
  while (n >= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    s = __builtin_ia32_crc32di(s, word);
    p += 8;
    n -= 8;
  }
  auto s32 = static_cast<std::uint32_t>(s);
  while (n-- > 0) s32 = __builtin_ia32_crc32qi(s32, *p++);
  return s32;
}

inline bool have_sse42() noexcept {
  static const bool have = __builtin_cpu_supports("sse4.2");
  return have;
}
#endif

}  // namespace detail

/// Extends the CRC-32C `crc` of earlier bytes with `bytes` (start with 0).
inline std::uint32_t crc32c(std::span<const std::byte> bytes, std::uint32_t crc = 0) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  std::uint32_t state = ~crc;
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  if (detail::have_sse42()) return ~detail::crc32c_sse42(state, p, bytes.size());
#endif
  return ~detail::crc32c_table(state, p, bytes.size());
}

/// The CRC-32C of a tensor's bytes.
inline std::uint32_t crc32c(std::span<const float> values, std::uint32_t crc = 0) noexcept {
  return crc32c(std::as_bytes(values), crc);
}

}  // namespace pulley::checkpoint
