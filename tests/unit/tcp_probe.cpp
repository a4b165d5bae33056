// SPDX-License-Identifier: MIT
// probe_ps (transport/tcp_probe.hpp), the chief's look at a ps's address: a ps of the job
// serves (naming its process); a refused address, another ps or something else is gone; a
// listener that never answers, or whose accept queue is full, is silent, within the time
// given (the kernel would wait minutes); so is a name whose DNS server never answers (the
// resolver would wait 10 s and more), for probe_ps and listens_at alike.
#include <arpa/inet.h>
#include <doctest/doctest.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "pulley/optimizers/sgd.hpp"
#include "pulley/ps/parameter_server.hpp"
#include "pulley/sharding/round_robin.hpp"
#include "pulley/sync/async.hpp"
#include "pulley/transport/tcp.hpp"
#include "support/tcp.hpp"

using namespace pulley;
using Kind = ProbeResult::Kind;
using Server = ParameterServer<RoundRobin, Sgd, Async>;

namespace {

/// A listening socket on 127.0.0.1 that nobody serves: it never accepts (backlog
/// `backlog`), or accepts and then does `serve(fd)` with each connection on a thread.
struct Listener {
  int fd = -1;
  std::uint16_t port = 0;
  explicit Listener(int backlog) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0);
    REQUIRE(::listen(fd, backlog) == 0);
    socklen_t size = sizeof address;
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &size);
    port = ntohs(address.sin_port);
  }
  ~Listener() { ::close(fd); }
  [[nodiscard]] std::string address() const { return "127.0.0.1:" + std::to_string(port); }
};

/// A connection to 127.0.0.1:`port`, made by the kernel whether or not anyone accepts it.
int connect_raw(std::uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_port = htons(port);
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  (void)::connect(fd, reinterpret_cast<sockaddr*>(&address), sizeof address);
  return fd;
}

// `within` is generous by default: a look that should hear an answer must not miss it for a
// loaded host's scheduling; only the looks that must come back silent are given less.
ProbeResult look(const std::string& address, std::uint32_t ps = 0,
                 std::chrono::milliseconds within = std::chrono::milliseconds(3000)) {
  return probe_ps(address, ps, Node::chief(), testing::test_credentials(), within);
}

}  // namespace

TEST_CASE("a ps of the job serves, and names its process, and another ps index there is another task") {
  TcpServer<Server> server(Server(1, 2, Sgd{0.1F}, Async{}), "127.0.0.1", 0, testing::test_server_options());
  std::thread serving([&] { server.run(); });
  const std::string address = "127.0.0.1:" + std::to_string(server.port());
  const ProbeResult serves = look(address, 1);
  CHECK(serves.kind == Kind::kServes);
  CHECK(serves.process != 0);
  CHECK(look(address, 1).process == serves.process);  // the same server, looked at again
  const ProbeResult other = look(address, 0);
  CHECK(other.kind == Kind::kGone);
  CHECK(other.detail == "another task answers there");
  ProbeResult stranger = probe_ps(address, 1, Node::chief(), Credentials{"another-job", "x"}, std::chrono::milliseconds(3000));
  CHECK(stranger.kind == Kind::kGone);  // (a ps of another job: not this job's ps)
  server.stop();
  serving.join();
}

TEST_CASE("an address that refuses connections is gone") {
  std::string address;
  {
    const Listener closed(1);
    address = closed.address();
  }
  const ProbeResult refused = look(address);
  CHECK(refused.kind == Kind::kGone);
  CHECK(refused.detail == "its address refuses connections");
}

TEST_CASE("something that is no ps is gone, and a listener that never speaks, or a full accept queue, is silent in time") {
  {  // Speaks another protocol.
    Listener http(4);
    std::thread answering([&] {
      const int fd = ::accept(http.fd, nullptr, nullptr);
      const std::string reply = "HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\nContent-Length: 0\r\n\r\n";
      (void)::write(fd, reply.data(), reply.size());
      std::this_thread::sleep_for(std::chrono::milliseconds(500));
      ::close(fd);
    });
    CHECK(look(http.address()).kind == Kind::kGone);
    answering.join();
  }
  {  // Accepted by the kernel, never spoken to: no challenge in time.
    const Listener mute(4);
    const auto began = std::chrono::steady_clock::now();
    CHECK(look(mute.address(), 0, std::chrono::milliseconds(300)).kind == Kind::kSilent);
    CHECK(std::chrono::steady_clock::now() - began < std::chrono::seconds(10));  // not the kernel's minutes
  }
  {  // The accept queue is full: the kernel drops the look's connection attempts.
    const Listener full(0);
    std::vector<int> queued;
    for (int i = 0; i < 8; ++i) queued.push_back(connect_raw(full.port));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto began = std::chrono::steady_clock::now();
    const ProbeResult seen = look(full.address(), 0, std::chrono::milliseconds(300));
    CHECK(seen.kind == Kind::kSilent);
    CHECK(std::chrono::steady_clock::now() - began < std::chrono::seconds(10));
    for (const int fd : queued) ::close(fd);
  }
}

namespace {

/// In a child process with a network and mount namespace of its own (root only): the
/// loopback up, a DNS "server" on 127.0.0.1:53 that takes queries and never answers, and
/// /etc/resolv.conf (bound over, in that namespace only) naming it, 1 s a try, 2 tries. Runs
/// `body`, whose return is the child's exit status. 77: no namespaces here (not root), 78:
/// the stage could not be set.
template <class Body>
int with_a_mute_dns_server(Body body) {
  const pid_t child = ::fork();
  if (child < 0) return 78;
  if (child == 0) {
    if (::unshare(CLONE_NEWNS | CLONE_NEWNET) != 0) ::_exit(77);
    if (::mount(nullptr, "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) ::_exit(78);
    char conf[] = "/tmp/pulley-resolv-XXXXXX";
    const int conf_fd = ::mkstemp(conf);
    const std::string text = "nameserver 127.0.0.1\noptions timeout:1 attempts:2\n";
    if (conf_fd < 0 ||
        ::write(conf_fd, text.data(), text.size()) != static_cast<ssize_t>(text.size()))
      ::_exit(78);
    ::close(conf_fd);
    const bool bound = ::mount(conf, "/etc/resolv.conf", nullptr, MS_BIND, nullptr) == 0;
    ::unlink(conf);  // (the bind mount keeps it)
    if (!bound) ::_exit(78);
    const int control = ::socket(AF_INET, SOCK_DGRAM, 0);
    ifreq lo{};
    std::snprintf(lo.ifr_name, IFNAMSIZ, "lo");
    lo.ifr_flags = IFF_UP | IFF_LOOPBACK | IFF_RUNNING;
    if (control < 0 || ::ioctl(control, SIOCSIFFLAGS, &lo) != 0) ::_exit(78);
    const int dns = ::socket(AF_INET, SOCK_DGRAM, 0);
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(53);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (dns < 0 || ::bind(dns, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0)
      ::_exit(78);
    ::_exit(body());
  }
  int status = 0;
  ::waitpid(child, &status, 0);
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

TEST_CASE(
    "a name whose DNS server never answers is silent within the look's time, and does not listen") {
  // Exit codes: 0 all held; 1 the resolver itself did not wait (the stage proves nothing:
  // not run); 2 probe_ps took more than its time; 3 probe_ps said something else; 4
  // listens_at took more than its time or said yes. (No doctest in the child: its failures
  // would be lost.)
  const int status = with_a_mute_dns_server([] {
    using Clock = std::chrono::steady_clock;
    const std::string name = "pulley-test-host.example";
    const auto plain = Clock::now();
    {
      asio::io_context io;
      asio::ip::tcp::resolver resolver(io);
      std::error_code ec;
      (void)resolver.resolve(name, "2222", ec);
    }
    if (Clock::now() - plain < std::chrono::milliseconds(1500)) return 1;
    const auto began = Clock::now();
    const ProbeResult seen = look(name + ":2222", 0, std::chrono::milliseconds(300));
    if (Clock::now() - began > std::chrono::milliseconds(1200)) return 2;
    if (seen.kind != Kind::kSilent ||
        seen.detail.find("cannot resolve " + name + ":2222 within 300 ms") != 0)
      return 3;
    const auto asked = Clock::now();
    if (listens_at(name + ":2222", std::chrono::milliseconds(300)) ||
        Clock::now() - asked > std::chrono::milliseconds(1200)) {
      return 4;
    }
    return 0;
  });
  if (status == 77) {
    MESSAGE("not run: no network namespace of its own to be had here (needs root)");
    return;
  }
  if (status == 1) {  // a name service beside DNS answered (nscd, say): nothing to wait on
    MESSAGE("not run: the system's resolver did not wait for the mute DNS server here");
    return;
  }
  CHECK(status == 0);
}
