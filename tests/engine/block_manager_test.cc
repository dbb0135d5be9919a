// BlockManager: reference counts, the free list's order (uncached blocks reused first, cached
// ones least recently freed first), and prefix-cache lookups that match only the same
// contents under the same adapter.

#include <gtest/gtest.h>

#include <random>
#include <set>
#include <vector>

#include "loraplex/core/error.h"
#include "loraplex/engine/block_manager.h"

namespace loraplex::test {
namespace {

using engine::block_hash;
using engine::BlockManager;

// The hashes of the full blocks of `tokens`.
std::vector<uint64_t> hashes_of(const std::vector<int32_t>& tokens, int64_t bs, uint64_t key) {
  std::vector<uint64_t> h;
  for (size_t i = 0; (i + 1) * static_cast<size_t>(bs) <= tokens.size(); ++i) {
    h.push_back(block_hash(h.empty() ? 0 : h.back(),
                           std::span<const int32_t>(tokens).subspan(i * bs, bs), key));
  }
  return h;
}

void cache_all(BlockManager& m, const std::vector<int32_t>& blocks,
               const std::vector<int32_t>& tokens, uint64_t key) {
  const int64_t bs = m.block_size();
  const std::vector<uint64_t> h = hashes_of(tokens, bs, key);
  for (size_t i = 0; i < h.size() && i < blocks.size(); ++i) {
    m.cache_block(blocks[i], h[i], i == 0 ? 0 : h[i - 1],
                  std::span<const int32_t>(tokens).subspan(i * bs, bs), key);
  }
}

TEST(BlockManager, AllocatesAllOrNothingAndCountsReferences) {
  BlockManager m(5, 4, true);
  std::vector<int32_t> a;
  ASSERT_TRUE(m.allocate(3, a));
  EXPECT_EQ(a, (std::vector<int32_t>{0, 1, 2}));
  std::vector<int32_t> b;
  EXPECT_FALSE(m.allocate(3, b));
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(m.num_free_blocks(), 2);
  EXPECT_EQ(m.ref_count(1), 1);
  m.free(a);
  EXPECT_EQ(m.num_free_blocks(), 5);
  EXPECT_THROW(m.free(a), Error);  // not in use any more
  EXPECT_EQ(m.blocks_for(0), 0);
  EXPECT_EQ(m.blocks_for(4), 1);
  EXPECT_EQ(m.blocks_for(5), 2);
}

TEST(BlockManager, HitsFullBlocksOfTheSamePrefixAndAdapterOnly) {
  const int64_t bs = 4;
  BlockManager m(16, bs, true);
  const std::vector<int32_t> tokens = {5, 9, 2, 7, 1, 1, 3, 8, 4, 6, 0, 2, 11};
  std::vector<int32_t> owner;
  ASSERT_TRUE(m.allocate(4, owner));
  cache_all(m, owner, tokens, 7);
  EXPECT_EQ(m.num_cached_blocks(), 3);

  std::vector<int32_t> hit = m.lookup(hashes_of(tokens, bs, 7), tokens, 7);
  EXPECT_EQ(hit, (std::vector<int32_t>(owner.begin(), owner.begin() + 3)));
  EXPECT_EQ(m.ref_count(owner[0]), 2);
  m.free(hit);

  // Another adapter: nothing, even for identical tokens.
  EXPECT_TRUE(m.lookup(hashes_of(tokens, bs, 8), tokens, 8).empty());
  // A different second block: only the first matches.
  std::vector<int32_t> other = tokens;
  other[5] = 42;
  hit = m.lookup(hashes_of(other, bs, 7), other, 7);
  EXPECT_EQ(hit.size(), 1u);
  m.free(hit);
  // A hash that collides but names other contents is not a hit.
  std::vector<uint64_t> forged = hashes_of(tokens, bs, 7);
  hit = m.lookup(forged, other, 7);
  EXPECT_EQ(hit.size(), 1u);
  m.free(hit);
}

TEST(BlockManager, FreedCachedBlocksStayFindableUntilReused) {
  const int64_t bs = 2;
  BlockManager m(4, bs, true);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  std::vector<int32_t> owner;
  ASSERT_TRUE(m.allocate(2, owner));
  cache_all(m, owner, tokens, 0);
  m.free(owner);
  EXPECT_EQ(m.num_free_blocks(), 4);
  EXPECT_EQ(m.num_cached_blocks(), 2);
  // The two uncached blocks are handed out before the cached ones.
  std::vector<int32_t> fresh;
  ASSERT_TRUE(m.allocate(2, fresh));
  EXPECT_EQ(std::set<int32_t>(fresh.begin(), fresh.end()), (std::set<int32_t>{2, 3}));
  std::vector<int32_t> hit = m.lookup(hashes_of(tokens, bs, 0), tokens, 0);
  EXPECT_EQ(hit, owner);
  m.free(hit);
  // Now every free block is cached: allocating one evicts the sequence's tail first (freed
  // first, so least recently), and the head stays findable.
  std::vector<int32_t> one;
  ASSERT_TRUE(m.allocate(1, one));
  EXPECT_EQ(one[0], owner[1]);
  EXPECT_EQ(m.num_cached_blocks(), 1);
  hit = m.lookup(hashes_of(tokens, bs, 0), tokens, 0);
  EXPECT_EQ(hit, (std::vector<int32_t>{owner[0]}));
}

TEST(BlockManager, WithoutCachingNothingIsKept) {
  BlockManager m(4, 2, false);
  const std::vector<int32_t> tokens = {1, 2, 3, 4};
  std::vector<int32_t> owner;
  ASSERT_TRUE(m.allocate(2, owner));
  cache_all(m, owner, tokens, 0);
  EXPECT_EQ(m.num_cached_blocks(), 0);
  EXPECT_TRUE(m.lookup(hashes_of(tokens, 2, 0), tokens, 0).empty());
}

TEST(BlockManager, RandomUseKeepsCountsConsistent) {
  std::mt19937_64 rng(3);
  const int64_t n = 37;
  BlockManager m(n, 3, true);
  std::vector<std::vector<int32_t>> held;
  std::vector<int32_t> refs(n, 0);
  for (int step = 0; step < 5000; ++step) {
    const int op = static_cast<int>(rng() % 3);
    if (op == 0) {
      std::vector<int32_t> b;
      const int64_t want = static_cast<int64_t>(rng() % 6);
      const bool ok = m.allocate(want, b);
      ASSERT_EQ(ok, want <= m.num_free_blocks() + static_cast<int64_t>(b.size()));
      for (int32_t x : b) ASSERT_EQ(refs[x]++, 0);
      if (ok && !b.empty()) {
        std::vector<int32_t> toks(b.size() * 3);
        for (auto& t : toks) t = static_cast<int32_t>(rng() % 3);  // few distinct: collisions
        cache_all(m, b, toks, rng() % 2);
        held.push_back(b);
      }
    } else if (op == 1 && !held.empty()) {
      const size_t i = rng() % held.size();
      for (int32_t x : held[i]) --refs[x];
      m.free(held[i]);
      held.erase(held.begin() + static_cast<long>(i));
    } else {
      std::vector<int32_t> toks(9);
      for (auto& t : toks) t = static_cast<int32_t>(rng() % 3);
      const uint64_t key = rng() % 2;
      std::vector<int32_t> hit = m.lookup(hashes_of(toks, 3, key), toks, key);
      for (int32_t x : hit) ++refs[x];
      if (!hit.empty()) held.push_back(hit);
    }
    int64_t free_count = 0;
    for (int64_t b = 0; b < n; ++b) {
      ASSERT_EQ(m.ref_count(static_cast<int32_t>(b)), refs[b]) << "block " << b;
      free_count += refs[b] == 0;
    }
    ASSERT_EQ(m.num_free_blocks(), free_count);
  }
}

}  // namespace
}  // namespace loraplex::test
