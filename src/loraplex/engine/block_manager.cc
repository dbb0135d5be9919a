#include "loraplex/engine/block_manager.h"

#include <algorithm>

#include "loraplex/core/error.h"

namespace loraplex::engine {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {
  // splitmix64 of the running state xor the value: every input bit reaches every output bit.
  uint64_t z = (h ^ v) + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

}  // namespace

uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens, uint64_t adapter_key) {
  uint64_t h = mix(0x6c6f7261706c6578ull, parent);
  h = mix(h, adapter_key);
  for (int32_t t : tokens) h = mix(h, static_cast<uint32_t>(t));
  h = mix(h, tokens.size());
  return h == 0 ? 1 : h;  // 0 is reserved for "no parent"
}

BlockManager::BlockManager(int64_t num_blocks, int64_t block_size, bool enable_caching)
    : block_size_(block_size), caching_(enable_caching) {
  LORAPLEX_CHECK(num_blocks >= 1, "KV cache: ", num_blocks, " blocks, expected >= 1");
  LORAPLEX_CHECK(block_size >= 1, "KV cache: block size ", block_size, ", expected >= 1");
  LORAPLEX_CHECK(num_blocks < (int64_t{1} << 31), "KV cache: ", num_blocks, " blocks is too many");
  blocks_.resize(static_cast<size_t>(num_blocks));
  // The lowest ids are handed out first.
  for (int64_t b = 0; b < num_blocks; ++b) push_back(static_cast<int32_t>(b));
}

void BlockManager::unlink(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  if (blk.prev >= 0) {
    blocks_[static_cast<size_t>(blk.prev)].next = blk.next;
  } else {
    head_ = blk.next;
  }
  if (blk.next >= 0) {
    blocks_[static_cast<size_t>(blk.next)].prev = blk.prev;
  } else {
    tail_ = blk.prev;
  }
  blk.prev = blk.next = -1;
  blk.in_free_list = false;
  --num_free_;
}

void BlockManager::push_front(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  blk.prev = -1;
  blk.next = head_;
  if (head_ >= 0) blocks_[static_cast<size_t>(head_)].prev = b;
  head_ = b;
  if (tail_ < 0) tail_ = b;
  blk.in_free_list = true;
  ++num_free_;
}

void BlockManager::push_back(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  blk.next = -1;
  blk.prev = tail_;
  if (tail_ >= 0) blocks_[static_cast<size_t>(tail_)].next = b;
  tail_ = b;
  if (head_ < 0) head_ = b;
  blk.in_free_list = true;
  ++num_free_;
}

void BlockManager::evict(int32_t b) {
  Block& blk = blocks_[static_cast<size_t>(b)];
  if (!blk.cached) return;
  table_.erase(blk.hash);
  blk.cached = false;
  blk.tokens.clear();
}

bool BlockManager::allocate(int64_t count, std::vector<int32_t>& out) {
  LORAPLEX_CHECK(count >= 0, "allocate ", count, " blocks");
  if (count > num_free_) return false;
  for (int64_t i = 0; i < count; ++i) {
    const int32_t b = head_;
    unlink(b);
    evict(b);
    blocks_[static_cast<size_t>(b)].refs = 1;
    out.push_back(b);
  }
  return true;
}

void BlockManager::free(std::span<const int32_t> blocks) {
  for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
    const int32_t b = *it;
    LORAPLEX_CHECK(b >= 0 && b < num_blocks(), "free of block ", b, " (", num_blocks(), " blocks)");
    Block& blk = blocks_[static_cast<size_t>(b)];
    LORAPLEX_CHECK(blk.refs > 0, "free of block ", b, ", which is not in use");
    if (--blk.refs > 0) continue;
    if (blk.cached) {
      push_back(b);
    } else {
      push_front(b);
    }
  }
}

std::vector<int32_t> BlockManager::lookup(std::span<const uint64_t> hashes,
                                          std::span<const int32_t> tokens, uint64_t adapter_key) {
  std::vector<int32_t> hit;
  if (!caching_) return hit;
  const size_t bs = static_cast<size_t>(block_size_);
  for (size_t i = 0; i < hashes.size() && (i + 1) * bs <= tokens.size(); ++i) {
    const auto it = table_.find(hashes[i]);
    if (it == table_.end()) break;
    Block& blk = blocks_[static_cast<size_t>(it->second)];
    const uint64_t parent = i == 0 ? 0 : hashes[i - 1];
    const std::span<const int32_t> want = tokens.subspan(i * bs, bs);
    if (blk.parent != parent || blk.adapter_key != adapter_key ||
        !std::equal(want.begin(), want.end(), blk.tokens.begin(), blk.tokens.end())) {
      break;
    }
    if (blk.refs == 0) unlink(it->second);
    ++blk.refs;
    hit.push_back(it->second);
  }
  return hit;
}

void BlockManager::cache_block(int32_t block, uint64_t hash, uint64_t parent,
                               std::span<const int32_t> tokens, uint64_t adapter_key) {
  if (!caching_) return;
  Block& blk = blocks_[static_cast<size_t>(block)];
  LORAPLEX_CHECK(blk.refs > 0, "cache_block of block ", block, ", which is not in use");
  LORAPLEX_CHECK(static_cast<int64_t>(tokens.size()) == block_size_, "cache_block of ",
                 tokens.size(), " tokens, blocks hold ", block_size_);
  if (blk.cached || table_.count(hash) != 0) return;
  blk.cached = true;
  blk.hash = hash;
  blk.parent = parent;
  blk.adapter_key = adapter_key;
  blk.tokens.assign(tokens.begin(), tokens.end());
  table_.emplace(hash, block);
}

}  // namespace loraplex::engine
