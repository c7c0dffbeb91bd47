// SPDX-License-Identifier: Apache-2.0
// tools/io/file.hpp: reading untrusted input files and writing outputs that appear whole or not at all (POSIX).
//
// Inputs: only regular files are read, opened with O_NONBLOCK so that a FIFO without a writer or a device never
// blocks, read whole with every short read and error checked. Outputs: written to a temporary file in the
// destination's folder, synced and closed with every error checked, then renamed over the destination, so a reader
// sees the old file or the whole new one, never a partial one. Large read-only inputs (model weights) can be mapped
// instead of read (MappedFile), with the same checks at open. Errors are plain sentences without the path (callers
// prefix it). Tool code, not a hot path: it allocates.
#pragma once

#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <new>
#include <optional>
#include <span>
#include <string>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <utility>
#include <vector>

namespace kvc {

/// A file's identity: equal ids are the same file, whatever the paths (symbolic or hard links).
struct FileId {
  dev_t device = 0;
  ino_t inode = 0;
  friend bool operator==(FileId const&, FileId const&) = default;
};

/// The identity of the file `path` names (links followed); empty when it does not exist or cannot be examined.
inline std::optional<FileId> file_id(std::string const& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0)
    return std::nullopt;
  return FileId{st.st_dev, st.st_ino};
}

namespace detail {

inline std::string errno_text(char const* what, int err) {
  return std::string(what) + " (" + std::strerror(err) + ")";
}

/// What a file that is not a regular file is, for messages.
inline char const* file_kind(mode_t mode) noexcept {
  if (S_ISDIR(mode))
    return "a directory";
  if (S_ISFIFO(mode))
    return "a FIFO (named pipe)";
  if (S_ISCHR(mode))
    return "a character device";
  if (S_ISBLK(mode))
    return "a block device";
  if (S_ISSOCK(mode))
    return "a socket";
  return "not a regular file";
}

/// Closes a descriptor on scope exit unless released.
struct Descriptor {
  int fd = -1;
  explicit Descriptor(int f) noexcept : fd(f) {}
  Descriptor(Descriptor const&) = delete;
  Descriptor& operator=(Descriptor const&) = delete;
  ~Descriptor() {
    if (fd >= 0)
      ::close(fd);
  }
  int release() noexcept { return std::exchange(fd, -1); }
};

}  // namespace detail

namespace detail {

/// Opens the regular file `path` for reading with the checks described at read_regular_file (stat() before open,
/// regular files only, O_NONBLOCK, same device and inode after open, size at most `max_bytes`). On success `f` holds
/// the descriptor and `size` the file's size at open; on failure returns false and sets `error`.
inline bool open_regular_file(std::string const& path, Descriptor& f, std::uint64_t& size, std::string& error,
                              std::uint64_t max_bytes) {
  struct stat named {};
  if (::stat(path.c_str(), &named) != 0) {
    error = errno_text("cannot open the file for reading", errno);
    return false;
  }
  if (!S_ISREG(named.st_mode)) {
    error = std::string("is ") + file_kind(named.st_mode) + ", expected a regular file";
    return false;
  }
  Descriptor opened(::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY));
  if (opened.fd < 0) {
    error = errno_text("cannot open the file for reading", errno);
    return false;
  }
  struct stat st {};
  if (::fstat(opened.fd, &st) != 0) {
    error = errno_text("cannot examine the file", errno);
    return false;
  }
  if (st.st_dev != named.st_dev || st.st_ino != named.st_ino || !S_ISREG(st.st_mode)) {
    error = "the file was replaced while it was opened";
    return false;
  }
  size = static_cast<std::uint64_t>(st.st_size);
  if (size > max_bytes) {
    error = "the file has " + std::to_string(size) + " bytes, more than the reader's limit of " +
            std::to_string(max_bytes) + " bytes";
    return false;
  }
  if constexpr (sizeof(std::size_t) < sizeof(std::uint64_t)) {
    if (size > SIZE_MAX) {
      error = "the file has " + std::to_string(size) + " bytes, more than this process can address";
      return false;
    }
  }
  if (f.fd >= 0)
    ::close(f.fd);
  f.fd = opened.release();
  return true;
}

}  // namespace detail

/// Reads the whole regular file `path` into `out` (at most `max_bytes`). Anything else (directory, FIFO, device,
/// socket) is refused from stat() before it is opened, since opening a device can act on it (a serial port raises
/// DTR, a tape rewinds); the regular file is then opened with O_NONBLOCK and must be the one examined (same device
/// and inode), so a swap in between never blocks. Reports short reads, a file that changes size while read, and
/// out of memory. On failure returns false and sets `error` (without the path).
inline bool read_regular_file(std::string const& path, std::vector<std::byte>& out, std::string& error,
                              std::uint64_t max_bytes = UINT64_MAX) {
  detail::Descriptor f(-1);
  std::uint64_t size = 0;
  if (!detail::open_regular_file(path, f, size, error, max_bytes))
    return false;
  try {
    out.assign(static_cast<std::size_t>(size), std::byte{});
  } catch (std::bad_alloc const&) {
    error = "out of memory reading " + std::to_string(size) + " bytes";
    return false;
  }
  std::size_t done = 0;
  while (done < out.size()) {
    ssize_t const n = ::read(f.fd, out.data() + done, out.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n < 0) {
      error = detail::errno_text("read error", errno);
      return false;
    }
    if (n == 0) {
      error = "the file shrank while it was read (" + std::to_string(done) + " of " + std::to_string(size) + " bytes)";
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  std::byte extra{};
  ssize_t n = 0;
  while ((n = ::read(f.fd, &extra, 1)) < 0 && errno == EINTR) {
  }
  if (n != 0) {
    error = "the file grew while it was read";
    return false;
  }
  return true;
}

class MappedFile;
inline bool map_regular_file(std::string const& path, MappedFile& out, std::string& error,
                             std::uint64_t max_bytes = UINT64_MAX);

/// A read-only, private (MAP_PRIVATE, PROT_READ) mapping of a whole regular file, made by map_regular_file. Move-only;
/// unmaps on destruction. An empty file maps to an empty span (no mapping is made). The descriptor is closed once the
/// mapping exists, so a MappedFile holds no file descriptor.
///
/// Caveat, as for every mmap-based model loader: the bytes are the file's pages, not a copy. If another process
/// truncates the file while it is mapped, touching a page past the new end raises SIGBUS, and writes to the file by
/// others may show through. The size checks of map_regular_file (and of any parser run on bytes()) are against the
/// size at open. Use read_regular_file where the file may change underneath.
class MappedFile {
 public:
  MappedFile() = default;
  MappedFile(MappedFile const&) = delete;
  MappedFile& operator=(MappedFile const&) = delete;
  MappedFile(MappedFile&& o) noexcept : addr_(std::exchange(o.addr_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  MappedFile& operator=(MappedFile&& o) noexcept {
    if (this != &o) {
      unmap();
      addr_ = std::exchange(o.addr_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~MappedFile() { unmap(); }

  /// The whole file as it was at open: size() bytes (empty for an empty file or a default-constructed MappedFile).
  std::span<std::byte const> bytes() const noexcept { return {static_cast<std::byte const*>(addr_), size_}; }
  std::size_t size() const noexcept { return size_; }

  /// Unmaps (if mapped) and becomes empty.
  void unmap() noexcept {
    if (addr_ != nullptr)
      ::munmap(addr_, size_);
    addr_ = nullptr;
    size_ = 0;
  }

 private:
  friend bool map_regular_file(std::string const&, MappedFile&, std::string&, std::uint64_t);
  void* addr_ = nullptr;  // nullptr when nothing is mapped (also for an empty file)
  std::size_t size_ = 0;  // bytes mapped
};

/// Maps the whole regular file `path` (at most `max_bytes`, checked against its size at open) read-only into `out`,
/// opened with the same checks as read_regular_file: stat() before open, regular files only, O_NONBLOCK, the same
/// device and inode after open. See MappedFile for what happens if the file is truncated while mapped (SIGBUS). On
/// failure returns false, leaves `out` empty and sets `error` (without the path).
inline bool map_regular_file(std::string const& path, MappedFile& out, std::string& error, std::uint64_t max_bytes) {
  out.unmap();
  detail::Descriptor f(-1);
  std::uint64_t size = 0;
  if (!detail::open_regular_file(path, f, size, error, max_bytes))
    return false;
  if (size == 0)
    return true;
  void* const addr = ::mmap(nullptr, static_cast<std::size_t>(size), PROT_READ, MAP_PRIVATE, f.fd, 0);
  if (addr == MAP_FAILED) {
    int const err = errno;
    error = detail::errno_text(("cannot map the file's " + std::to_string(size) + " bytes into memory").c_str(), err);
    return false;
  }
  out.addr_ = addr;
  out.size_ = static_cast<std::size_t>(size);
  return true;
}

/// An output file that appears whole or not at all: open() creates a temporary file beside `path`, write() appends,
/// finish() syncs and closes it, commit() renames it over `path`. Destroyed before commit(), it removes the temporary,
/// so a failure at any step leaves `path` as it was (absent, or the previous file). The temporary is created with
/// mode 0666 less the umask, or with the mode of the file it replaces. Not copyable.
class StagedFile {
 public:
  StagedFile() = default;
  StagedFile(StagedFile const&) = delete;
  StagedFile& operator=(StagedFile const&) = delete;
  StagedFile(StagedFile&& o) noexcept
      : path_(std::move(o.path_)), temp_(std::move(o.temp_)), fd_(std::exchange(o.fd_, -1)) {}
  ~StagedFile() { discard(); }

  /// The destination and the temporary file's name (empty once committed or discarded).
  std::string const& path() const noexcept { return path_; }
  std::string const& temporary() const noexcept { return temp_; }

  /// Creates the temporary file `.NAME.kvc-PID-N` in the destination's folder.
  bool open(std::string path, std::string& error) {
    discard();
    path_ = std::move(path);
    std::size_t const slash = path_.rfind('/');
    std::string const dir = slash == std::string::npos ? std::string() : path_.substr(0, slash + 1);
    std::string const base = slash == std::string::npos ? path_ : path_.substr(slash + 1);
    if (base.empty() || base == "." || base == "..") {
      error = "expected a file name, not a directory";
      return false;
    }
    struct stat old {};
    bool const replaces = ::stat(path_.c_str(), &old) == 0 && S_ISREG(old.st_mode);
    static std::atomic<unsigned> serial{0};
    for (int attempt = 0; attempt < 64 && fd_ < 0; ++attempt) {
      // O_EXCL with a fresh name: the kernel applies the umask (no process-wide umask() call, which would race with
      // other threads), and an existing file is never opened.
      temp_ = dir + "." + base + ".kvc-" + std::to_string(::getpid()) + "-" + std::to_string(serial++);
      fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOCTTY, 0666);
      if (fd_ < 0 && errno != EEXIST)
        break;
    }
    if (fd_ < 0) {
      int const err = errno;
      error = detail::errno_text(("cannot create a temporary file in the folder " + (dir.empty() ? "." : dir)).c_str(),
                                 err);
      temp_.clear();
      return false;
    }
    if (replaces && ::fchmod(fd_, old.st_mode & 07777) != 0) {  // keep the replaced file's permissions
      error = detail::errno_text("cannot give the output the mode of the file it replaces", errno);
      discard();
      return false;
    }
    return true;
  }

  /// Appends `bytes`; a short or failed write (a full disk, a file size limit) is an error.
  bool write(std::span<std::byte const> bytes, std::string& error) {
    std::size_t done = 0;
    while (done < bytes.size()) {
      ssize_t const n = ::write(fd_, bytes.data() + done, bytes.size() - done);
      if (n < 0 && errno == EINTR)
        continue;
      if (n <= 0) {
        error = detail::errno_text("write failed", n < 0 ? errno : EIO);
        discard();
        return false;
      }
      done += static_cast<std::size_t>(n);
    }
    return true;
  }

  /// Syncs the data to the device and closes the temporary file, checking both.
  bool finish(std::string& error) {
    if (::fsync(fd_) != 0) {
      error = detail::errno_text("cannot sync the output to disk", errno);
      discard();
      return false;
    }
    int const fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) {
      error = detail::errno_text("cannot close the output", errno);
      discard();
      return false;
    }
    return true;
  }

  /// Renames the finished temporary file over the destination, then syncs the folder (best effort: the rename
  /// itself is what readers see).
  bool commit(std::string& error) {
    if (::rename(temp_.c_str(), path_.c_str()) != 0) {
      error = detail::errno_text("cannot move the finished output into place", errno);
      discard();
      return false;
    }
    temp_.clear();
    std::size_t const slash = path_.rfind('/');
    detail::Descriptor dir(::open(slash == std::string::npos ? "." : path_.substr(0, slash + 1).c_str(),
                                  O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (dir.fd >= 0)
      (void)::fsync(dir.fd);
    return true;
  }

  /// Removes the temporary file (if any) and leaves the destination untouched.
  void discard() noexcept {
    if (fd_ >= 0)
      ::close(std::exchange(fd_, -1));
    if (!temp_.empty()) {
      ::unlink(temp_.c_str());
      temp_.clear();
    }
  }

 private:
  std::string path_, temp_;
  int fd_ = -1;
};

/// Commits finished StagedFiles as a group: all of them, or none. Each existing destination is first kept under a
/// hard link beside it (`TEMP.old`); if a rename fails, the destinations already replaced get their old file back
/// (or are removed, where there was none) and every temporary is discarded. On failure returns false, sets `error`
/// and `failed` (the index of the file that could not be committed). Where hard links are not supported the group
/// is committed file by file.
inline bool commit_together(std::span<StagedFile> files, std::string& error, std::size_t& failed) {
  std::vector<std::string> backups(files.size());
  std::vector<char> existed(files.size(), 1);
  auto drop_backups = [&] {
    for (std::string const& b : backups)
      if (!b.empty())
        ::unlink(b.c_str());
  };
  for (std::size_t i = 0; i < files.size(); ++i) {
    std::string const backup = files[i].temporary() + ".old";
    if (::link(files[i].path().c_str(), backup.c_str()) == 0)
      backups[i] = backup;
    else
      existed[i] = errno != ENOENT;
  }
  for (std::size_t i = 0; i < files.size(); ++i) {
    if (files[i].commit(error))
      continue;
    failed = i;
    for (std::size_t j = 0; j < i; ++j) {  // put back what the committed ones replaced
      if (!backups[j].empty() && ::rename(backups[j].c_str(), files[j].path().c_str()) == 0)
        backups[j].clear();
      else if (!existed[j])
        ::unlink(files[j].path().c_str());
    }
    for (std::size_t j = i + 1; j < files.size(); ++j)
      files[j].discard();
    drop_backups();
    return false;
  }
  drop_backups();
  return true;
}

}  // namespace kvc
