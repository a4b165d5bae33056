// SPDX-License-Identifier: MIT
// TF_CONFIG, TensorFlow's cluster description: valid documents parse, invalid ones are
// refused with a message that says what is wrong.
#include "pulley/cluster/tf_config.hpp"

#include <doctest/doctest.h>

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

using pulley::parse_tf_config;

namespace {

std::string message_of(const std::string& doc) {
  try {
    parse_tf_config(doc);
  } catch (const pulley::Error& e) {
    CHECK(e.code() == pulley::ErrorCode::kInvalidArgument);
    return e.what();
  }
  FAIL("accepted: " << doc);
  return {};
}

const std::string kCluster =
    R"("cluster": {"chief": ["host0:2222"], "worker": ["host1:2222", "host2:2222"],
                   "ps": ["host3:2222", "[::1]:2223"], "evaluator": ["host4:2222"]})";

}  // namespace

TEST_CASE("TF_CONFIG in TensorFlow's format parses") {
  const auto c = parse_tf_config("{" + kCluster + R"(, "task": {"type": "worker", "index": 1}})");
  CHECK(c.task.type == "worker");
  CHECK(c.task.index == 1);
  CHECK(c.cluster.tasks("worker").size() == 2);
  CHECK(c.cluster.tasks("ps").at(1) == "[::1]:2223");
  CHECK(c.cluster.tasks("chief").at(0) == "host0:2222");
  CHECK(c.cluster.tasks("nobody").empty());
}

TEST_CASE("TF_CONFIG: the legacy master role is the chief, and an unlisted evaluator is fine") {
  const auto m = parse_tf_config(
      R"({"cluster": {"master": ["a:1"], "ps": ["b:2"]}, "task": {"type": "master", "index": 0}})");
  CHECK(m.task.type == "chief");
  CHECK(m.cluster.tasks("chief").at(0) == "a:1");
  const auto e = parse_tf_config(
      R"({"cluster": {"chief": ["a:1"], "ps": ["b:2"]}, "task": {"type": "evaluator"}})");
  CHECK(e.task.type == "evaluator");
  CHECK(e.task.index == 0);
}

TEST_CASE("TF_CONFIG: a cluster of workers only (an all-reduce job's, as MultiWorkerMirroredStrategy's) parses") {
  const auto w = parse_tf_config(R"({"cluster": {"worker": ["a:1", "b:2"]}, "task": {"type": "worker", "index": 1}})");
  CHECK(w.cluster.tasks("ps").empty());
  CHECK(w.cluster.tasks("worker").size() == 2);
  CHECK(w.task.index == 1);
}

TEST_CASE("TF_CONFIG errors say what is wrong") {
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}})").find("\"task\"") != std::string::npos);
  CHECK(message_of("{" + kCluster + R"(, "task": {"type": "worker", "index": 2}})")
            .find("index 2 is out of range: role \"worker\" has 2") != std::string::npos);
  CHECK(message_of("{" + kCluster + R"(, "task": {"type": "trainer", "index": 0}})")
            .find("\"trainer\" is not a role") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"], "gpu": ["b:2"]}, "task": {"type": "ps"}})")
            .find("unknown role \"gpu\"") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["nohost"]}, "task": {"type": "ps"}})")
            .find("not \"host:port\"") != std::string::npos);
  CHECK(
      message_of(R"({"cluster": {"ps": ["a:70000"]}, "task": {"type": "ps"}})").find("host:port") !=
      std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": -1}})")
            .find("non-negative integer") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 0.5}})")
            .find("non-negative integer") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": )").find("TF_CONFIG: invalid JSON") !=
        std::string::npos);
  CHECK(message_of(R"([1, 2])").find("not a JSON object") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}} extra)")
            .find("expected end of input") != std::string::npos);
}

TEST_CASE("TF_CONFIG is read from the environment") {
  ::setenv("TF_CONFIG", R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}})", 1);
  const auto c = pulley::tf_config_from_environment();
  REQUIRE(c.has_value());
  CHECK(c->task.type == "ps");
  ::setenv("TF_CONFIG", "", 1);
  CHECK_FALSE(pulley::tf_config_from_environment().has_value());
  ::unsetenv("TF_CONFIG");
}

TEST_CASE("TF_CONFIG: odd ports, huge indices and bad escapes are refused, not misread") {
  CHECK(message_of(R"({"cluster": {"ps": ["a:+80"]}, "task": {"type": "ps"}})").find("host:port") !=
        std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a: 80"]}, "task": {"type": "ps"}})").find("host:port") !=
        std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps", "index": 1e20}})")
            .find("non-negative integer") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "p\uzzzz"}})")
            .find("'\\u' must be followed by 4 hex digits") != std::string::npos);
  CHECK(parse_tf_config(R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "p\u0073"}})").task.type ==
        "ps");
}

TEST_CASE("TF_CONFIG: the task index is a non-negative integer that fits 32 bits") {
  const std::string ps2 = R"({"cluster": {"ps": ["a:1", "b:1", "c:1"]}, "task": {"type": "ps", )";
  CHECK(parse_tf_config(ps2 + R"("index": 2}})").task.index == 2);
  CHECK(parse_tf_config(ps2 + R"("index": 2.0}})").task.index == 2);  // integral, as before
  CHECK(parse_tf_config(ps2 + R"("index": 0}})").task.index == 0);
  for (const char* index : {"1.5", "-1", "\"1\"", "1e10", "4294967296", "true", "null", "[1]"}) {
    CAPTURE(index);
    CHECK(message_of(ps2 + R"("index": )" + index + "}}").find("non-negative integer") !=
          std::string::npos);
  }
  // In range of 32 bits, so it gets as far as the range check against the role's size.
  CHECK(message_of(ps2 + R"("index": 4294967295}})").find("index 4294967295 is out of range") !=
        std::string::npos);
}

TEST_CASE("TF_CONFIG: addresses follow parse_address") {
  const auto c = parse_tf_config(
      R"({"cluster": {"ps": ["[fe80::1]:2222", "10.0.0.1:65535"]}, "task": {"type": "ps"}})");
  CHECK(c.cluster.tasks("ps") == std::vector<std::string>{"[fe80::1]:2222", "10.0.0.1:65535"});
  for (const char* address : {"\"a:0\"", "\"a:65536\"", "\":80\"", "\"a b:80\"", "\"::1:80\"",
                              "\"[::1]80\"", "\"a:80x\"", "80", "null"}) {
    CAPTURE(address);
    const std::string m = message_of(std::string(R"({"cluster": {"ps": [)") + address +
                                     R"(]}, "task": {"type": "ps"}})");
    CHECK(m.find("TF_CONFIG: role \"ps\" has an address that is not \"host:port\"") !=
          std::string::npos);
  }
  CHECK(message_of(R"({"cluster": {"ps": ["a:0"]}, "task": {"type": "ps"}})")
            .find(R"("a:0" (the port must be 1..65535)") != std::string::npos);
}

TEST_CASE("TF_CONFIG: an address listed twice is refused, naming both tasks") {
  CHECK(message_of(R"({"cluster": {"ps": ["h:1"], "worker": ["w:1", "h:1"]},
                       "task": {"type": "ps"}})") ==
        "invalid_argument: TF_CONFIG: address 'h:1' is listed twice (ps 0 and worker 1)");
  CHECK(message_of(R"({"cluster": {"ps": ["h:1", "h:1"]}, "task": {"type": "ps"}})")
            .find("address 'h:1' is listed twice (ps 0 and ps 1)") != std::string::npos);
  // The same host and port however the port is spelled, and IPv6 printed with brackets.
  CHECK(message_of(R"({"cluster": {"ps": ["h:80"], "chief": ["h:080"]}, "task": {"type": "ps"}})")
            .find("address 'h:80' is listed twice (chief 0 and ps 0)") != std::string::npos);
  CHECK(message_of(R"({"cluster": {"ps": ["[::1]:5", "[::1]:5"]}, "task": {"type": "ps"}})")
            .find("address '[::1]:5' is listed twice") != std::string::npos);
  // "master" is the chief, so its tasks number after the chief's.
  CHECK(message_of(R"({"cluster": {"ps": ["p:1"], "chief": ["c:1"], "master": ["p:1"]},
                       "task": {"type": "ps"}})")
            .find("(chief 1 and ps 0)") != std::string::npos);
  // Another port, or another host, is another task.
  CHECK(parse_tf_config(R"({"cluster": {"ps": ["h:1", "h:2", "g:1"]}, "task": {"type": "ps"}})")
            .cluster.tasks("ps")
            .size() == 3);
}

TEST_CASE("TF_CONFIG: a JSON syntax error is kInvalidArgument naming TF_CONFIG") {
  for (const char* doc : {"", "{", R"({"cluster": {"ps": ["a:1",]}})", "{'cluster': 1}",
                          R"({"cluster": {"ps": ["a:1"]}, "task": {"type": "ps"}}})", "\xff"}) {
    CAPTURE(doc);
    const std::string m = message_of(doc);
    CHECK(m.find("TF_CONFIG: invalid JSON") != std::string::npos);
  }
}
