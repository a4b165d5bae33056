// SPDX-License-Identifier: MIT
#pragma once

/// InProcessNetwork's ps tasks served (declared in transport/in_process.hpp, which includes
/// this header after the class): a service taken on and its thread started, the queue served
/// by that thread or by a sender that found the task idle, the threads joined, and the
/// network's close.

#include "pulley/transport/in_process.hpp"

namespace pulley {

inline void InProcessNetwork::Fabric::serve(std::unique_ptr<Host> host) {
  const std::uint32_t task = host->task();
  if (task >= num_ps()) {
    throw Error(ErrorCode::kInvalidArgument, "no ps task " + std::to_string(task) + " here");
  }
  Mailbox& box = *mailboxes_[task];
  {
    std::scoped_lock lock(box.serving, box.mutex);
    if (box.host) {
      throw Error(ErrorCode::kAlreadyExists,
                  "ps task " + std::to_string(task) + " is served already");
    }
    if (box.closed) return;
    box.host = std::move(host);
    box.thread_running = true;
  }
  std::scoped_lock lock(threads_mutex_);
  threads_.emplace_back([this, &box, task] { run(box, task); });
}

inline void InProcessNetwork::Fabric::join() {
  std::vector<std::thread> threads;
  {
    std::scoped_lock lock(threads_mutex_);
    threads.swap(threads_);
  }
  for (std::thread& t : threads) t.join();
}

inline void InProcessNetwork::Fabric::close() {
  for (auto& box : mailboxes_) {
    std::scoped_lock lock(box->mutex);
    box->closed = true;
    fail_held(*box, "the in-process network was shut down");
    box->wake.notify_all();
  }
  join();
  for (auto& box : mailboxes_) {
    std::scoped_lock serving(box->serving);
    box->host.reset();
  }
}

inline void InProcessNetwork::Fabric::handle_queued(Mailbox& box, std::uint32_t task) {
  constexpr int kMaxCombined = 8;
  for (int handled = 0;; ++handled) {
    Envelope next;
    {
      std::scoped_lock lock(box.mutex);
      if (box.queue.empty() || box.killed || box.closed || handled == kMaxCombined ||
          delay_of(Node::ps(task)).count() > 0) {
        box.combining = false;
        if (!box.queue.empty()) box.wake.notify_one();
        return;
      }
      next = std::move(box.queue.front());
      box.queue.pop_front();
    }
    handle(*this, box, task, std::move(next.request), next.from, next.session, next.call);
  }
}

inline void InProcessNetwork::Fabric::stop_combining(Mailbox& box) noexcept {
  std::scoped_lock lock(box.mutex);
  box.combining = false;
  box.wake.notify_one();
}

inline void InProcessNetwork::Fabric::run(Mailbox& box, std::uint32_t task) {
  for (;;) {
    {
      std::unique_lock lock(box.mutex);
      box.wake.wait(lock,
                    [&] { return box.killed || box.closed || box.stopped || !box.queue.empty(); });
      if (box.killed || box.closed || box.queue.empty()) {
        box.thread_running = false;
        return;
      }
    }
    if (auto d = delay_of(Node::ps(task)); d.count() > 0) std::this_thread::sleep_for(d);
    std::scoped_lock serving(box.serving);
    Envelope envelope;
    {
      std::scoped_lock lock(box.mutex);
      if (box.queue.empty()) continue;
      envelope = std::move(box.queue.front());
      box.queue.pop_front();
    }
    handle(*this, box, task, std::move(envelope.request), envelope.from, envelope.session,
           envelope.call);
  }
}

}  // namespace pulley
