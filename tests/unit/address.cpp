// SPDX-License-Identifier: MIT
// "host:port" addresses: what parses, what is refused and why, and the round trip through
// to_string.
#include "pulley/core/address.hpp"

#include <doctest/doctest.h>

#include <string>
#include <string_view>

using pulley::Address;
using pulley::parse_address;

namespace {

// The message parse_address throws for `text`; it must be a kInvalidArgument pulley::Error.
std::string message_of(std::string_view text) {
  try {
    parse_address(text);
  } catch (const pulley::Error& e) {
    CHECK(e.code() == pulley::ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("accepted: " << text);
  return {};
}

bool contains(const std::string& text, std::string_view part) {
  if (text.find(part) != std::string::npos) return true;
  MESSAGE("\"" << text << "\" lacks \"" << part << "\"");
  return false;
}

}  // namespace

TEST_CASE("parse_address reads host:port") {
  CHECK(parse_address("localhost:2222") == Address{"localhost", 2222});
  CHECK(parse_address("10.0.0.7:1") == Address{"10.0.0.7", 1});
  CHECK(parse_address("node-01.cluster.example:65535") ==
        Address{"node-01.cluster.example", 65535});
  CHECK(parse_address("h:080") == Address{"h", 80});  // leading zeros are still decimal
  CHECK(parse_address("h:00001").port == 1);
}

TEST_CASE("parse_address reads a bracketed IPv6 host and drops the brackets") {
  CHECK(parse_address("[::1]:2223") == Address{"::1", 2223});
  CHECK(parse_address("[fe80::1%eth0]:80") == Address{"fe80::1%eth0", 80});
  CHECK(parse_address("[::]:9") == Address{"::", 9});
}

TEST_CASE("to_string writes what parse_address reads back") {
  CHECK(Address{"a", 1}.to_string() == "a:1");
  CHECK(Address{"::1", 2223}.to_string() == "[::1]:2223");
  for (const char* text : {"localhost:2222", "[::1]:2223", "10.0.0.7:65535"}) {
    CAPTURE(text);
    CHECK(parse_address(text).to_string() == text);
    CHECK(parse_address(parse_address(text).to_string()) == parse_address(text));
  }
  CHECK(Address{"a", 1} != Address{"a", 2});
  CHECK(Address{"a", 1} != Address{"b", 1});
}

TEST_CASE("parse_address refuses ports outside 1..65535 or not in plain decimal") {
  for (const char* text : {"h:0", "h:65536", "h:99999", "h:100000", "h:-1", "h:+80", "h: 80",
                           "h:80 ", "h:80x", "h:0x50", "h:", "h:1.5", "h:000080"}) {
    CAPTURE(text);
    const std::string m = message_of(text);
    CHECK(contains(m, "address '" + std::string(text) + "' is not host:port"));
    CHECK(contains(m, "the port must be 1..65535"));
  }
}

TEST_CASE("parse_address refuses a bad host, and says why") {
  CHECK(contains(message_of(":80"), "the host is empty"));
  CHECK(contains(message_of("[]:80"), "the host is empty"));
  CHECK(contains(message_of(""), "no ':' before the port"));
  CHECK(contains(message_of("localhost"), "no ':' before the port"));
  CHECK(contains(message_of("a b:80"), "space"));
  CHECK(contains(message_of(" a:80"), "space"));
  CHECK(contains(message_of("a\t:80"), "space"));
  // A control character is shown, not written raw, so the message stays one whole line.
  CHECK(contains(message_of(std::string_view("a\0b:80", 6)), R"('a\x00b:80' is not host:port)"));
  CHECK(contains(message_of(std::string_view("a\0b:80", 6)), "control character"));
  CHECK(contains(message_of("a\nb:80"), R"('a\x0ab:80')"));
  CHECK(contains(message_of("::1:80"), "IPv6 host needs brackets"));
  CHECK(contains(message_of("[::1:80"), "'[' without ']'"));
  CHECK(contains(message_of("[::1]"), "no ':' after ']'"));
  CHECK(contains(message_of("[::1]80"), "no ':' after ']'"));
  CHECK(contains(message_of("a]:80"), "'[' or ']'"));
  CHECK(contains(message_of("[a]b]:80"), "no ':' after ']'"));
}

TEST_CASE("the address rules hold at compile time too") {
  static_assert(pulley::detail::scan_address("h:1").problem.empty());
  static_assert(pulley::detail::scan_address("[::1]:65535").port == 65535);
  static_assert(pulley::detail::scan_address("[::1]:65535").host == "::1");
  static_assert(!pulley::detail::scan_address("h:65536").problem.empty());
  CHECK(true);
}
