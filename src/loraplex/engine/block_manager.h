#pragma once
// KV-cache block allocation for the engine: reference-counted blocks, a free list, and a prefix
// cache of full blocks. A full block is named by the hash of (its parent block's hash, its
// tokens, the adapter it was computed under), so a shared prompt prefix under one adapter maps to
// the same blocks, and the same prefix under two adapters (or two loads of one name) does not.
//
// Freed blocks that hold a cached prefix stay findable until they are handed out again: the free
// list is in least-recently-freed order, blocks that cache nothing go to its front (reused
// first), cached ones to its back, and allocation takes from the front, evicting what it takes.
// Pure bookkeeping (no device memory), so the scheduler's invariants can be tested fast.

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

namespace loraplex::engine {

/// The hash naming a full block: (parent hash, tokens, adapter key). 0 is the root's parent.
uint64_t block_hash(uint64_t parent, std::span<const int32_t> tokens, uint64_t adapter_key);

class BlockManager {
 public:
  /// num_blocks blocks of block_size tokens; without caching, lookups always miss and nothing
  /// is kept after a free.
  BlockManager(int64_t num_blocks, int64_t block_size, bool enable_caching);

  int64_t num_blocks() const { return static_cast<int64_t>(blocks_.size()); }
  int64_t block_size() const { return block_size_; }
  bool caching() const { return caching_; }
  /// Blocks no sequence references (cached or not): what allocate() can hand out.
  int64_t num_free_blocks() const { return num_free_; }
  int64_t num_used_blocks() const { return num_blocks() - num_free_; }
  /// Blocks findable by lookup() (referenced or free).
  int64_t num_cached_blocks() const { return static_cast<int64_t>(table_.size()); }
  int32_t ref_count(int32_t block) const { return blocks_[static_cast<size_t>(block)].refs; }
  /// Blocks needed to hold `tokens` tokens.
  int64_t blocks_for(int64_t tokens) const { return (tokens + block_size_ - 1) / block_size_; }

  /// Appends `count` free blocks to `out` with one reference each, evicting the least recently
  /// freed cached blocks as needed; false (taking nothing) when fewer are free.
  bool allocate(int64_t count, std::vector<int32_t>& out);
  /// Drops one reference of each block; the last block is released first, so that a sequence's
  /// tail (the least shared part) is evicted before its head.
  void free(std::span<const int32_t> blocks);

  /// The cached blocks of the longest prefix of `hashes` (the full blocks of a sequence, in
  /// order) whose contents match `tokens` (block i holds tokens[i*block_size ...]) and
  /// `adapter_key`; takes a reference on each and returns them.
  std::vector<int32_t> lookup(std::span<const uint64_t> hashes, std::span<const int32_t> tokens,
                              uint64_t adapter_key);
  /// Offers a full, computed block to the cache under `hash`, whose parent (the previous block's
  /// hash, 0 for the first) and contents are given for exact matching. When another block
  /// already caches the hash, nothing changes.
  void cache_block(int32_t block, uint64_t hash, uint64_t parent, std::span<const int32_t> tokens,
                   uint64_t adapter_key);

 private:
  struct Block {
    int32_t refs = 0;
    bool cached = false;  // table_ maps hash to this block
    uint64_t hash = 0;
    uint64_t parent = 0;
    uint64_t adapter_key = 0;
    std::vector<int32_t> tokens;  // the contents, for exact matching
    int32_t prev = -1;            // free list links, -1 = none
    int32_t next = -1;
    bool in_free_list = false;
  };

  void unlink(int32_t block);
  void push_front(int32_t block);
  void push_back(int32_t block);
  void evict(int32_t block);

  int64_t block_size_;
  bool caching_;
  std::vector<Block> blocks_;
  std::unordered_map<uint64_t, int32_t> table_;
  int32_t head_ = -1;  // the free list: allocate from the head
  int32_t tail_ = -1;
  int64_t num_free_ = 0;
};

}  // namespace loraplex::engine
