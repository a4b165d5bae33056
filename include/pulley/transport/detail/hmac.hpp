// SPDX-License-Identifier: MIT
#pragma once

/// SHA-256 (FIPS 180-4) and HMAC-SHA-256 (RFC 2104), for the TCP handshake's proofs of the
/// shared secret. They run once per connection over a few hundred bytes, so clarity wins
/// over speed; the test checks them against the FIPS and RFC 4231 vectors.

#include <algorithm>
#include <array>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string_view>

namespace pulley::transport_detail {

/// A SHA-256 digest.
using Digest = std::array<std::uint8_t, 32>;

/// Incremental SHA-256.
class Sha256 {
 public:
  /// Adds `data` to the message.
  void update(std::span<const std::uint8_t> data) noexcept {
    for (const std::uint8_t byte : data) {
      block_[filled_++] = byte;
      if (filled_ == block_.size()) {
        compress();
        filled_ = 0;
      }
    }
    length_ += data.size();
  }
  /// Adds the bytes of `text`.
  void update(std::string_view text) noexcept {
    update(std::span(reinterpret_cast<const std::uint8_t*>(text.data()), text.size()));
  }

  /// The digest of everything added; the object is spent afterwards.
  Digest finish() noexcept {
    const std::uint64_t bits = length_ * 8;
    const std::uint8_t one = 0x80;
    update(std::span(&one, 1));
    const std::uint8_t zero = 0;
    while (filled_ != 56) update(std::span(&zero, 1));
    std::array<std::uint8_t, 8> tail{};
    for (int i = 0; i < 8; ++i) tail[static_cast<std::size_t>(i)] = static_cast<std::uint8_t>(bits >> (56 - 8 * i));
    update(tail);
    Digest out{};
    for (std::size_t i = 0; i < 8; ++i) {
      for (std::size_t b = 0; b < 4; ++b) {
        out[4 * i + b] = static_cast<std::uint8_t>(state_[i] >> (24 - 8 * b));
      }
    }
    return out;
  }

 private:
  void compress() noexcept {
    static constexpr std::array<std::uint32_t, 64> k = {
        0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4,
        0xab1c5ed5, 0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe,
        0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f,
        0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7,
        0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc,
        0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85, 0xa2bfe8a1, 0xa81a664b,
        0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116,
        0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
        0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7,
        0xc67178f2};
    std::array<std::uint32_t, 64> w{};
    for (std::size_t i = 0; i < 16; ++i) {
      w[i] = std::uint32_t{block_[4 * i]} << 24U | std::uint32_t{block_[4 * i + 1]} << 16U |
             std::uint32_t{block_[4 * i + 2]} << 8U | std::uint32_t{block_[4 * i + 3]};
    }
    for (std::size_t i = 16; i < 64; ++i) {
      const std::uint32_t s0 = std::rotr(w[i - 15], 7) ^ std::rotr(w[i - 15], 18) ^ (w[i - 15] >> 3U);
      const std::uint32_t s1 = std::rotr(w[i - 2], 17) ^ std::rotr(w[i - 2], 19) ^ (w[i - 2] >> 10U);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    std::array<std::uint32_t, 8> v = state_;
    for (std::size_t i = 0; i < 64; ++i) {
      const std::uint32_t s1 = std::rotr(v[4], 6) ^ std::rotr(v[4], 11) ^ std::rotr(v[4], 25);
      const std::uint32_t ch = (v[4] & v[5]) ^ (~v[4] & v[6]);
      const std::uint32_t t1 = v[7] + s1 + ch + k[i] + w[i];
      const std::uint32_t s0 = std::rotr(v[0], 2) ^ std::rotr(v[0], 13) ^ std::rotr(v[0], 22);
      const std::uint32_t maj = (v[0] & v[1]) ^ (v[0] & v[2]) ^ (v[1] & v[2]);
      const std::uint32_t t2 = s0 + maj;
      v = {t1 + t2, v[0], v[1], v[2], v[3] + t1, v[4], v[5], v[6]};
    }
    for (std::size_t i = 0; i < 8; ++i) state_[i] += v[i];
  }

  std::array<std::uint32_t, 8> state_ = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                         0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::array<std::uint8_t, 64> block_{};
  std::size_t filled_ = 0;
  std::uint64_t length_ = 0;
};

/// HMAC-SHA-256 of the concatenation of `parts` under `key`.
inline Digest hmac_sha256(std::string_view key, std::initializer_list<std::string_view> parts) {
  std::array<std::uint8_t, 64> padded{};
  if (key.size() > padded.size()) {
    Sha256 h;
    h.update(key);
    const Digest d = h.finish();
    std::copy(d.begin(), d.end(), padded.begin());
  } else {
    std::copy(key.begin(), key.end(), padded.begin());
  }
  std::array<std::uint8_t, 64> pad{};
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = padded[i] ^ 0x36U;
  Sha256 inner;
  inner.update(pad);
  for (const std::string_view part : parts) inner.update(part);
  const Digest inner_digest = inner.finish();
  for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = padded[i] ^ 0x5cU;
  Sha256 outer;
  outer.update(pad);
  outer.update(inner_digest);
  return outer.finish();
}

/// Compares two digests in time that does not depend on where they differ.
inline bool same_digest(std::span<const std::uint8_t> a, std::span<const std::uint8_t> b) noexcept {
  if (a.size() != b.size()) return false;
  std::uint8_t diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff = static_cast<std::uint8_t>(diff | (a[i] ^ b[i]));
  return diff == 0;
}

}  // namespace pulley::transport_detail
