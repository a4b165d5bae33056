// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "pulley/core/error.hpp"

namespace pulley {

/// Where a task listens: a host (a name, an IPv4 address, or an IPv6 address without its
/// brackets) and a port. Compared as written: "localhost:80" and "127.0.0.1:80" differ.
struct Address {
  /// A host name or numeric address; never empty, never bracketed, no whitespace.
  std::string host;
  /// The TCP port, 1..65535 once parsed (0 only in a default-constructed Address).
  std::uint16_t port = 0;

  /// "host:port", brackets around IPv6 hosts ("[::1]:2222"), so that parse_address reads it
  /// back as the same Address.
  [[nodiscard]] std::string to_string() const {
    const bool v6 = host.find(':') != std::string::npos;
    return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
  }

  /// Same host (exactly, case included) and same port.
  friend bool operator==(const Address&, const Address&) = default;
};

namespace detail {

/// An address split into its parts without allocating, or why it cannot be: when `problem`
/// is not empty, `host` and `port` mean nothing.
struct AddressParts {
  std::string_view host;
  std::uint16_t port = 0;
  std::string_view problem;
};

/// The port `text` spells in 1..65535 with one to five decimal digits and nothing else (no
/// sign, no space); 0 when it spells none.
constexpr std::uint16_t address_port(std::string_view text) noexcept {
  if (text.empty() || text.size() > 5) return 0;
  std::uint32_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return 0;
    value = value * 10 + static_cast<std::uint32_t>(c - '0');
  }
  return value <= 65535 ? static_cast<std::uint16_t>(value) : 0;
}

/// The rules of parse_address, for callers that report a bad address in their own words.
constexpr AddressParts scan_address(std::string_view text) noexcept {
  AddressParts parts;
  std::size_t colon = 0;  // the ':' before the port
  if (!text.empty() && text.front() == '[') {
    const std::size_t close = text.find(']');
    if (close == std::string_view::npos) return {{}, 0, "'[' without ']'"};
    parts.host = text.substr(1, close - 1);
    colon = close + 1;
    if (colon >= text.size() || text[colon] != ':') return {{}, 0, "no ':' after ']'"};
  } else {
    colon = text.rfind(':');
    if (colon == std::string_view::npos) return {{}, 0, "no ':' before the port"};
    parts.host = text.substr(0, colon);
    if (parts.host.find(':') != std::string_view::npos) {
      return {{}, 0, "an IPv6 host needs brackets, as in [::1]:2222"};
    }
  }
  if (parts.host.empty()) return {{}, 0, "the host is empty"};
  for (const char c : parts.host) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) return {{}, 0, "the host holds a space or a control character"};
    if (c == '[' || c == ']') return {{}, 0, "a '[' or ']' that does not enclose the host"};
  }
  parts.port = address_port(text.substr(colon + 1));
  if (parts.port == 0) return {{}, 0, "the port must be 1..65535 in decimal digits"};
  return parts;
}

/// `text` with its control characters written as \xNN, so that a message quoting it stays
/// one readable line.
inline std::string printable_text(std::string_view text) {
  std::string out;
  for (const char c : text) {
    const auto u = static_cast<unsigned char>(c);
    if (u >= 0x20 && u != 0x7f) {
      out += c;
    } else {
      constexpr std::string_view kHex = "0123456789abcdef";
      out += "\\x";
      out += kHex[u >> 4];
      out += kHex[u & 0xf];
    }
  }
  return out;
}

}  // namespace detail

/// Parses "host:port" or "[v6::addr]:port" (the brackets are dropped from `host`). The port
/// is 1..65535 in at most five decimal digits, with no sign and no space; the host is not
/// empty and holds no whitespace. An IPv6 host must be bracketed, as "::1:80" could split
/// in more than one place. Throws kInvalidArgument "address '<text>' is not host:port: <why>".
inline Address parse_address(std::string_view text) {
  const detail::AddressParts parts = detail::scan_address(text);
  if (!parts.problem.empty()) {
    throw Error(ErrorCode::kInvalidArgument,
                "address '" + detail::printable_text(text) +
                    "' is not host:port: " + std::string(parts.problem));
  }
  return Address{std::string(parts.host), parts.port};
}

}  // namespace pulley
