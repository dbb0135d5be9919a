#include "loraplex/server/socket_stream.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>

namespace loraplex::server {
namespace {

constexpr size_t kReadBuffer = 4096;
// A read with no deadline set (none is expected: the server sets one around every request).
constexpr std::chrono::milliseconds kReadWithoutDeadline{60000};

void address_of(const sockaddr_storage& addr, socklen_t len, std::string& ip, int& port) {
  char host[NI_MAXHOST];
  char serv[NI_MAXSERV];
  if (::getnameinfo(reinterpret_cast<const sockaddr*>(&addr), len, host, sizeof(host), serv,
                    sizeof(serv), NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(serv);
  }
}

}  // namespace

SocketStream::SocketStream(int fd, std::chrono::milliseconds write_timeout)
    : fd_(fd), write_timeout_(write_timeout), buffer_(kReadBuffer) {}

int SocketStream::wait(short events, std::chrono::milliseconds timeout) const {
  for (;;) {
    auto limit = timeout;
    if (deadline_ != Clock::time_point::max()) {
      const auto left =
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline_ - Clock::now());
      if (left.count() <= 0) return 0;
      limit = std::min(limit, left);
    }
    pollfd p{fd_, events, 0};
    const int rc = ::poll(&p, 1, static_cast<int>(limit.count()));
    if (rc < 0 && errno == EINTR) continue;
    if (rc <= 0) return rc;
    return (p.revents & (events | POLLHUP | POLLERR)) != 0 ? 1 : 0;
  }
}

bool SocketStream::peer_open() const {
  pollfd p{fd_, POLLIN, 0};
  if (::poll(&p, 1, 0) <= 0) return true;  // nothing to read: still there
  char c;
  const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return n > 0 || (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK));
}

bool SocketStream::wait_for_request(std::chrono::milliseconds timeout) {
  if (buffer_begin_ < buffer_end_) return true;  // a pipelined request already read
  clear_read_deadline();
  if (wait(POLLIN, timeout) <= 0) return false;
  return peer_open();
}

bool SocketStream::is_readable() const {
  return buffer_begin_ < buffer_end_ || wait(POLLIN, kReadWithoutDeadline) > 0;
}

bool SocketStream::is_writable() const {
  pollfd p{fd_, POLLOUT, 0};
  int rc;
  do {
    rc = ::poll(&p, 1, static_cast<int>(write_timeout_.count()));
  } while (rc < 0 && errno == EINTR);
  if (rc <= 0 || (p.revents & (POLLERR | POLLHUP | POLLNVAL)) != 0) return false;
  return peer_open();
}

ssize_t SocketStream::read(char* ptr, size_t size) {
  if (buffer_begin_ == buffer_end_) {
    if (wait(POLLIN, kReadWithoutDeadline) <= 0) return -1;
    ssize_t n;
    do {
      n = ::recv(fd_, buffer_.data(), buffer_.size(), 0);
    } while (n < 0 && errno == EINTR);
    if (n <= 0) return n;
    buffer_begin_ = 0;
    buffer_end_ = static_cast<size_t>(n);
  }
  const size_t n = std::min(size, buffer_end_ - buffer_begin_);
  std::copy_n(buffer_.data() + buffer_begin_, n, ptr);
  buffer_begin_ += n;
  return static_cast<ssize_t>(n);
}

ssize_t SocketStream::write(const char* ptr, size_t size) {
  if (!is_writable()) return -1;
  ssize_t n;
  do {
    n = ::send(fd_, ptr, size, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n;
}

void SocketStream::get_remote_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getpeername(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    address_of(addr, len, ip, port);
  }
}

void SocketStream::get_local_ip_and_port(std::string& ip, int& port) const {
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  if (::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
    address_of(addr, len, ip, port);
  }
}

}  // namespace loraplex::server
