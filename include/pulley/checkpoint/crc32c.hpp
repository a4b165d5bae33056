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
/// One stream of the SSE 4.2 instruction, on the raw (not inverted) state.
__attribute__((target("sse4.2"))) inline std::uint64_t crc32c_sse42_stream(
    std::uint64_t state, const unsigned char* p, std::size_t n) noexcept {
  for (; n >= 8; p += 8, n -= 8) {
    std::uint64_t word = 0;
    std::memcpy(&word, p, 8);
    state = __builtin_ia32_crc32di(state, word);
  }
  return state;
}

/// The bytes of each of the three streams crc32c_sse42 runs side by side.
inline constexpr std::size_t kCrcStreamBytes = 8192;

/// The raw CRC state after kCrcStreamBytes zero bytes, as a function of the state before:
/// linear over GF(2), so four tables of 256 entries (one per byte of the state) hold it.
struct CrcShift {
  std::array<std::array<std::uint32_t, 256>, 4> table{};

  CrcShift() noexcept {
    std::array<std::uint32_t, 32> basis{};
    static constexpr unsigned char kZeros[kCrcStreamBytes] = {};
    for (std::size_t i = 0; i < 32; ++i) {
      basis[i] = static_cast<std::uint32_t>(
          crc32c_sse42_stream(std::uint64_t{1} << i, kZeros, kCrcStreamBytes));
    }
    for (std::size_t k = 0; k < 4; ++k) {
      for (std::uint32_t b = 0; b < 256; ++b) {
        std::uint32_t shifted = 0;
        for (std::size_t i = 0; i < 8; ++i) {
          if ((b >> i & 1U) != 0) shifted ^= basis[8 * k + i];
        }
        table[k][b] = shifted;
      }
    }
  }
  [[nodiscard]] std::uint32_t operator()(std::uint32_t state) const noexcept {
    return table[0][state & 0xFFU] ^ table[1][(state >> 8U) & 0xFFU] ^
           table[2][(state >> 16U) & 0xFFU] ^ table[3][state >> 24U];
  }
};

/// The SSE 4.2 version. The instruction takes three cycles and issues one a cycle, so three
/// independent streams over consecutive blocks run about three times as fast as one (what
/// a checkpoint read needs to keep up with the page cache); the CRC is linear, so the
/// streams' states are joined by shifting each past the blocks after it.
__attribute__((target("sse4.2"))) inline std::uint32_t crc32c_sse42(std::uint32_t state,
                                                                   const unsigned char* p,
                                                                   std::size_t n) noexcept {
  static const CrcShift shift;
  constexpr std::size_t kBlock = kCrcStreamBytes;
  std::uint64_t s0 = state;
  for (; n >= 3 * kBlock; p += 3 * kBlock, n -= 3 * kBlock) {
    std::uint64_t s1 = 0;
    std::uint64_t s2 = 0;
    for (std::size_t i = 0; i < kBlock; i += 8) {
      std::uint64_t w0 = 0;
      std::uint64_t w1 = 0;
      std::uint64_t w2 = 0;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kBlock + i, 8);
      std::memcpy(&w2, p + 2 * kBlock + i, 8);
      s0 = __builtin_ia32_crc32di(s0, w0);
      s1 = __builtin_ia32_crc32di(s1, w1);
      s2 = __builtin_ia32_crc32di(s2, w2);
    }
    const std::uint32_t joined = shift(static_cast<std::uint32_t>(s0)) ^ static_cast<std::uint32_t>(s1);
    s0 = shift(joined) ^ static_cast<std::uint32_t>(s2);
  }
  auto s32 = static_cast<std::uint32_t>(crc32c_sse42_stream(s0, p, n));
  for (p += n & ~std::size_t{7}, n &= 7U; n > 0; --n) s32 = __builtin_ia32_crc32qi(s32, *p++);
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
