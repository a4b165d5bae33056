// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "pulley/error.hpp"

namespace pulley::detail {

/// A JSON value: just enough JSON to read small configuration documents (TF_CONFIG).
struct Json {
  using Object = std::map<std::string, Json, std::less<>>;
  using Array = std::vector<Json>;
  std::variant<std::nullptr_t, bool, double, std::string, Array, Object> value;

  [[nodiscard]] const Object* object() const { return std::get_if<Object>(&value); }
  [[nodiscard]] const Array* array() const { return std::get_if<Array>(&value); }
  [[nodiscard]] const std::string* string() const { return std::get_if<std::string>(&value); }
  [[nodiscard]] const double* number() const { return std::get_if<double>(&value); }
};

/// Parses `text` as one JSON document; throws kInvalidArgument with the byte offset.
class JsonReader {
 public:
  explicit JsonReader(std::string_view text) : text_(text) {}

  Json document() {
    Json v = value(0);
    skip_space();
    if (pos_ != text_.size()) fail("trailing characters");
    return v;
  }

 private:
  static constexpr int kMaxDepth = 64;

  [[noreturn]] void fail(const std::string& what) const {
    throw Error(ErrorCode::kInvalidArgument,
                "invalid JSON at byte " + std::to_string(pos_) + ": " + what);
  }
  void skip_space() {
    while (pos_ < text_.size() && (text_[pos_] == ' ' || text_[pos_] == '\n' ||
                                   text_[pos_] == '\r' || text_[pos_] == '\t')) {
      ++pos_;
    }
  }
  bool eat(char c) {
    skip_space();
    if (pos_ < text_.size() && text_[pos_] == c) {
      ++pos_;
      return true;
    }
    return false;
  }
  void expect(char c) {
    if (!eat(c)) fail(std::string("expected '") + c + "'");
  }
  bool literal(std::string_view word) {
    if (text_.substr(pos_, word.size()) != word) return false;
    pos_ += word.size();
    return true;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nested too deeply");
    skip_space();
    if (pos_ >= text_.size()) fail("unexpected end");
    const char c = text_[pos_];
    if (c == '{') return object(depth);
    if (c == '[') return array(depth);
    if (c == '"') return {string()};
    if (literal("true")) return {true};
    if (literal("false")) return {false};
    if (literal("null")) return {nullptr};
    if (c == '-' || (c >= '0' && c <= '9')) return {number()};
    fail(std::string("unexpected '") + c + "'");
  }

  Json object(int depth) {
    ++pos_;
    Json::Object members;
    if (eat('}')) return {std::move(members)};
    do {
      skip_space();
      if (pos_ >= text_.size() || text_[pos_] != '"') fail("expected a member name");
      std::string key = string();
      expect(':');
      members.insert_or_assign(std::move(key), value(depth + 1));
    } while (eat(','));
    expect('}');
    return {std::move(members)};
  }

  Json array(int depth) {
    ++pos_;
    Json::Array items;
    if (eat(']')) return {std::move(items)};
    do {
      items.push_back(value(depth + 1));
    } while (eat(','));
    expect(']');
    return {std::move(items)};
  }

  std::string string() {
    ++pos_;  // opening quote
    std::string out;
    while (pos_ < text_.size() && text_[pos_] != '"') {
      char c = text_[pos_++];
      if (static_cast<unsigned char>(c) < 0x20) fail("control character in a string");
      if (c == '\\') {
        if (pos_ >= text_.size()) fail("unterminated escape");
        switch (c = text_[pos_++]) {
          case '"':
          case '\\':
          case '/':
            out += c;
            break;
          case 'b':
            out += '\b';
            break;
          case 'f':
            out += '\f';
            break;
          case 'n':
            out += '\n';
            break;
          case 'r':
            out += '\r';
            break;
          case 't':
            out += '\t';
            break;
          case 'u': {
            if (pos_ + 4 > text_.size()) fail("short \\u escape");
            unsigned code = 0;
            for (int k = 0; k < 4; ++k) {
              const char h = text_[pos_++];
              const int digit = h >= '0' && h <= '9'   ? h - '0'
                                : h >= 'a' && h <= 'f' ? h - 'a' + 10
                                : h >= 'A' && h <= 'F' ? h - 'A' + 10
                                                       : -1;
              if (digit < 0) fail("bad \\u escape");
              code = code * 16 + static_cast<unsigned>(digit);
            }
            if (code >= 0x80) fail("only ASCII \\u escapes are supported");
            out += static_cast<char>(code);
            break;
          }
          default:
            fail("unknown escape");
        }
      } else {
        out += c;
      }
    }
    if (pos_ >= text_.size()) fail("unterminated string");
    ++pos_;
    return out;
  }

  double number() {
    const std::size_t start = pos_;
    if (text_[pos_] == '-') ++pos_;
    while (pos_ < text_.size() &&
           std::string_view("0123456789.eE+-").find(text_[pos_]) != std::string_view::npos) {
      ++pos_;
    }
    try {
      std::size_t used = 0;
      const std::string digits(text_.substr(start, pos_ - start));
      const double v = std::stod(digits, &used);
      if (used != digits.size()) fail("malformed number");
      return v;
    } catch (const std::logic_error&) {
      fail("malformed number");
    }
  }

  std::string_view text_;
  std::size_t pos_ = 0;
};

}  // namespace pulley::detail
