// SPDX-License-Identifier: MIT
#pragma once

#include <asio.hpp>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <istream>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "pulley/core/error.hpp"

namespace pulley {

/// A plain HTTP/1.1 endpoint that a monitoring system scrapes: `GET /metrics` is answered
/// 200 with what `body()` returns (Prometheus' text format, version 0.0.4), any other
/// path 404, any other method 405; the connection is then closed. It serves on a thread of
/// its own until destroyed. What it serves is read-only and unauthenticated: bind it to
/// loopback (the default of `--metrics-bind`) unless the network is trusted. A client
/// gets 5 s and 8 KiB for its request, and at most 16 are served at once (others wait in
/// the listen queue).
class MetricsEndpoint {
 public:
  /// Listens on `bind`:`port` (0: a port the system picks; `port()` says which). Throws
  /// kUnavailable naming the address when it cannot listen there.
  MetricsEndpoint(const std::string& bind, std::uint16_t port, std::function<std::string()> body)
      : body_(std::move(body)), acceptor_(io_) {
    try {
      const asio::ip::tcp::endpoint at(asio::ip::make_address(bind), port);
      acceptor_.open(at.protocol());
      acceptor_.set_option(asio::socket_base::reuse_address(true));
      acceptor_.bind(at);
      acceptor_.listen();
      port_ = acceptor_.local_endpoint().port();
    } catch (const std::exception& e) {
      throw Error(ErrorCode::kUnavailable,
                  "metrics: cannot listen on " + bind + ":" + std::to_string(port) + ": " + e.what());
    }
    accept();
    thread_ = std::thread([this] { io_.run(); });
  }

  MetricsEndpoint(const MetricsEndpoint&) = delete;
  MetricsEndpoint& operator=(const MetricsEndpoint&) = delete;

  ~MetricsEndpoint() {
    io_.stop();
    thread_.join();
  }

  /// The port it listens on.
  [[nodiscard]] std::uint16_t port() const noexcept { return port_; }

 private:
  static constexpr std::size_t kMaxRequest = 8192;
  static constexpr int kMaxServing = 16;
  static constexpr std::chrono::seconds kTimeout{5};

  struct Session {
    explicit Session(asio::io_context& io) : socket(io), timer(io), request(kMaxRequest) {}
    asio::ip::tcp::socket socket;
    asio::steady_timer timer;
    asio::streambuf request;
    std::string reply;
  };

  void accept() {
    if (serving_ >= kMaxServing) return;  // resumed when a session ends
    accepting_ = true;
    auto session = std::make_shared<Session>(io_);
    acceptor_.async_accept(session->socket, [this, session](const asio::error_code& error) {
      accepting_ = false;
      if (error == asio::error::operation_aborted) return;
      if (!error) {
        serve(session);
        return accept();
      }
      // Out of descriptors, say: try again in a while rather than at once, in a loop.
      accepting_ = true;
      retry_.expires_after(std::chrono::milliseconds(100));
      retry_.async_wait([this](const asio::error_code& waited) {
        accepting_ = false;
        if (waited != asio::error::operation_aborted) accept();
      });
    });
  }

  void serve(const std::shared_ptr<Session>& session) {
    ++serving_;
    session->timer.expires_after(kTimeout);
    session->timer.async_wait([session](const asio::error_code& error) {
      if (!error) {
        asio::error_code ignored;
        session->socket.close(ignored);
      }
    });
    asio::async_read_until(session->socket, session->request, "\r\n\r\n",
                           [this, session](const asio::error_code& error, std::size_t) {
                             if (error) return done(session);
                             answer(session);
                           });
  }

  void answer(const std::shared_ptr<Session>& session) {
    std::istream in(&session->request);
    std::string method, target;
    in >> method >> target;
    std::string status = "200 OK", body;
    std::string allow;
    if (method != "GET" && method != "HEAD") {
      status = "405 Method Not Allowed";
      allow = "Allow: GET, HEAD\r\n";
      body = "only GET\n";
    } else if (target != "/metrics" && !target.starts_with("/metrics?")) {
      status = "404 Not Found";
      body = "the metrics are at /metrics\n";
    } else {
      try {
        body = body_();
      } catch (const std::exception& e) {
        status = "500 Internal Server Error";
        body = std::string(e.what()) + "\n";
      }
    }
    session->reply = "HTTP/1.1 " + status + "\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n" +
                     "Content-Length: " + std::to_string(body.size()) + "\r\n" + allow + "Connection: close\r\n\r\n" +
                     (method == "HEAD" ? std::string() : body);
    asio::async_write(session->socket, asio::buffer(session->reply),
                      [this, session](const asio::error_code&, std::size_t) { done(session); });
  }

  void done(const std::shared_ptr<Session>& session) {
    asio::error_code ignored;
    session->socket.shutdown(asio::ip::tcp::socket::shutdown_both, ignored);
    session->socket.close(ignored);
    session->timer.cancel();
    --serving_;
    if (!accepting_) accept();
  }

  std::function<std::string()> body_;
  asio::io_context io_;
  asio::ip::tcp::acceptor acceptor_;
  asio::steady_timer retry_{io_};  ///< a failed accept is tried again after it
  std::uint16_t port_ = 0;
  int serving_ = 0;         ///< sessions open (on the io thread only)
  bool accepting_ = false;  ///< an accept is pending (on the io thread only)
  std::thread thread_;
};

}  // namespace pulley
