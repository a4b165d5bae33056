// SPDX-License-Identifier: MIT
#pragma once

// A TCP proxy on 127.0.0.1 for tests, between clients and one ps task, that cuts
// connections: whenever answer bytes come back from the ps, with probability `loss` (or
// when told to cut the next ones) it drops them and closes both sides instead of passing
// them on. The request they answer has
// taken effect on the ps; the client only learns that its connection broke, as when a link
// fails after the ps answered. It also stands for a partition (`partition`): its clients
// then reach nothing behind it, while other tasks reach the ps directly.

#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <arpa/inet.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace pulley::testing {

class CutProxy {
 public:
  /// @param upstream_port the ps's port on 127.0.0.1
  /// @param loss          the chance that a read of answer bytes cuts the connection
  CutProxy(std::uint16_t upstream_port, double loss, std::uint64_t seed)
      : upstream_port_(upstream_port), loss_(loss), rng_(seed) {
    listener_ = ::socket(AF_INET, SOCK_STREAM, 0);
    if (listener_ < 0) throw std::runtime_error("CutProxy: socket");
    const int on = 1;
    ::setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    sockaddr_in address = loopback(0);
    if (::bind(listener_, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0 ||
        ::listen(listener_, 16) != 0) {
      ::close(listener_);
      throw std::runtime_error("CutProxy: bind/listen");
    }
    socklen_t size = sizeof address;
    ::getsockname(listener_, reinterpret_cast<sockaddr*>(&address), &size);
    port_ = ntohs(address.sin_port);
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  CutProxy(const CutProxy&) = delete;
  CutProxy& operator=(const CutProxy&) = delete;
  ~CutProxy() {
    stop_ = true;
    acceptor_.join();  // no pump starts after this
    for (std::thread& t : threads_) t.join();
    for (const int held : held_) ::close(held);
    ::close(listener_);
  }

  /// Where clients connect.
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }
  /// Connections cut so far.
  [[nodiscard]] int cuts() const noexcept { return cuts_.load(); }
  /// Cuts at the next `n` reads of answer bytes, whatever the chance.
  void cut_next(int n) {
    std::scoped_lock lock(mutex_);
    forced_ += n;
  }
  /// Changes the chance of a cut (0: none from now on).
  void set_loss(double loss) {
    std::scoped_lock lock(mutex_);
    loss_ = loss;
  }
  /// A partition between the proxy's clients and the ps, or its end: while on, every
  /// connection is cut, and new ones are taken by the kernel but never reach the ps nor
  /// hear from it (a handshake that never comes, as from a host behind a dropping
  /// firewall); they are closed when it ends.
  void partition(bool on) {
    partitioned_ = on;
    if (on) return;
    std::scoped_lock lock(mutex_);
    for (const int held : held_) ::close(held);
    held_.clear();
  }

 private:
  static sockaddr_in loopback(std::uint16_t port) {
    sockaddr_in address{};
    address.sin_family = AF_INET;
    address.sin_port = htons(port);
    address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    return address;
  }

  void accept_loop() {
    while (!stop_) {
      pollfd p{listener_, POLLIN, 0};
      if (::poll(&p, 1, 20) <= 0) continue;
      const int client = ::accept(listener_, nullptr, nullptr);
      if (client < 0) continue;
      if (partitioned_) {
        std::scoped_lock lock(mutex_);
        held_.push_back(client);
        continue;
      }
      const int server = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in address = loopback(upstream_port_);
      if (server < 0 || ::connect(server, reinterpret_cast<sockaddr*>(&address), sizeof address) != 0) {
        ::close(client);
        if (server >= 0) ::close(server);
        continue;
      }
      std::scoped_lock lock(mutex_);
      threads_.emplace_back([this, client, server] { pump(client, server); });
    }
  }

  bool cut_now() {
    std::scoped_lock lock(mutex_);
    if (forced_ > 0) {
      --forced_;
      return true;
    }
    return std::uniform_real_distribution<double>(0.0, 1.0)(rng_) < loss_;
  }

  static bool send_all(int fd, const char* data, std::size_t size) {
    while (size > 0) {
      const ssize_t sent = ::send(fd, data, size, MSG_NOSIGNAL);
      if (sent <= 0) return false;
      data += sent;
      size -= static_cast<std::size_t>(sent);
    }
    return true;
  }

  void pump(int client, int server) {
    std::vector<char> buffer(1 << 16);
    while (!stop_ && !partitioned_) {
      pollfd p[2] = {{client, POLLIN, 0}, {server, POLLIN, 0}};
      if (::poll(p, 2, 20) <= 0) continue;
      bool open = true;
      for (int i = 0; i < 2 && open; ++i) {
        if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) == 0) continue;
        const ssize_t got = ::recv(p[i].fd, buffer.data(), buffer.size(), 0);
        if (got <= 0) {
          open = false;
        } else if (i == 1 && cut_now()) {
          ++cuts_;  // the answer is dropped with the connection
          open = false;
        } else {
          open = send_all(p[1 - i].fd, buffer.data(), static_cast<std::size_t>(got));
        }
      }
      if (!open) break;
    }
    ::shutdown(client, SHUT_RDWR);
    ::shutdown(server, SHUT_RDWR);
    ::close(client);
    ::close(server);
  }

  std::uint16_t upstream_port_;
  std::uint16_t port_ = 0;
  int listener_ = -1;
  std::mutex mutex_;
  double loss_;
  int forced_ = 0;
  std::mt19937_64 rng_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> partitioned_{false};
  std::vector<int> held_;  ///< connections taken during a partition
  std::thread acceptor_;
  std::vector<std::thread> threads_;  ///< pumps, one per connection
  std::atomic<int> cuts_{0};
};

}  // namespace pulley::testing
