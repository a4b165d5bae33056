// SPDX-License-Identifier: MIT
#pragma once

#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <random>

#if defined(__linux__)
#include <sys/random.h>
#endif

namespace pulley::detail {

/// Fills `out` with `n` bytes from the operating system's random source: getrandom(2) on
/// Linux (no file descriptor, so it works in a process that has used up its descriptors),
/// std::random_device elsewhere.
inline void random_bytes(void* out, std::size_t n) {
  auto* bytes = static_cast<unsigned char*>(out);
#if defined(__linux__)
  std::size_t filled = 0;
  while (filled < n) {
    const ssize_t got = ::getrandom(bytes + filled, n - filled, 0);
    if (got > 0) {
      filled += static_cast<std::size_t>(got);
    } else if (errno != EINTR) {
      break;
    }
  }
  if (filled == n) return;
#endif
  std::random_device source;
  for (std::size_t i = 0; i < n; ++i) bytes[i] = static_cast<unsigned char>(source());
}

/// A random 64-bit number.
inline std::uint64_t random_u64() {
  std::uint64_t value = 0;
  random_bytes(&value, sizeof value);
  return value;
}

}  // namespace pulley::detail
