// SPDX-License-Identifier: MIT
// SHA-256 and HMAC-SHA-256 against the published test vectors (FIPS 180-4 examples, RFC 4231).
#include "pulley/transport/detail/hmac.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <string>

using namespace pulley::transport_detail;

namespace {

std::string hex(const Digest& d) {
  std::string out;
  char byte[3];
  for (const std::uint8_t b : d) {
    std::snprintf(byte, sizeof byte, "%02x", b);
    out += byte;
  }
  return out;
}

std::string sha256(const std::string& text) {
  Sha256 h;
  h.update(text);
  return hex(h.finish());
}

}  // namespace

TEST_CASE("SHA-256 gives the FIPS 180-4 digests, across block boundaries") {
  CHECK(sha256("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha256(std::string(1000000, 'a')) ==
        "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Fed in pieces, the digest is the same.
  Sha256 pieces;
  for (const char* part : {"abcdbcdecdefdefgefgh", "fghighijhijkijkljklmklmnlmno", "mnopnopq"}) {
    pieces.update(std::string_view(part));
  }
  CHECK(hex(pieces.finish()) == "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST_CASE("HMAC-SHA-256 gives the RFC 4231 results, keys longer than a block included") {
  CHECK(hex(hmac_sha256(std::string(20, '\x0b'), {"Hi There"})) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hex(hmac_sha256("Jefe", {"what do ya ", "want for nothing?"})) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  const std::string long_key(131, '\xaa');
  CHECK(hex(hmac_sha256(long_key, {"Test Using Larger Than Block-Size Key - Hash Key First"})) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(hex(hmac_sha256(long_key,
                        {"This is a test using a larger than block-size key and a larger than "
                         "block-size data. The key needs to be hashed before being used by the "
                         "HMAC algorithm."})) ==
        "9b09ffa71b942fcb27635fbcd5b0e944bfdc63644f0713938a7f51535c3a35e2");
}

TEST_CASE("digests compare equal only when every byte agrees") {
  const Digest a = hmac_sha256("k", {"m"});
  Digest b = a;
  CHECK(same_digest(a, b));
  b[31] ^= 1U;
  CHECK_FALSE(same_digest(a, b));
  CHECK_FALSE(same_digest(a, std::span(a).first(31)));
}
