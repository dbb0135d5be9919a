#include "loraplex/tokenizer/bpe_model.h"

#include <limits>
#include <mutex>
#include <queue>

#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {
namespace {

uint64_t pair_key(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

struct Symbol {
  int32_t id;
  int64_t prev;
  int64_t next;
  size_t len;  // 0 once merged into its left neighbour
};

struct Merge {
  size_t pos;
  int32_t rank;
  int32_t new_id;
  // std::priority_queue pops the largest: order so the lowest rank, then leftmost, is largest.
  bool operator<(const Merge& other) const {
    if (rank != other.rank) return rank > other.rank;
    return pos > other.pos;
  }
};

}  // namespace

BpeModel::BpeModel(const JsonNode& node) {
  if (node.has("type") && node.type() != "BPE") node.unsupported_type("BPE");
  if (!node.has("type") && !node.has("merges")) {
    node.fail("is not a BPE model (no \"type\" and no \"merges\"); supported: BPE");
  }
  if (node.has("dropout")) {
    const JsonNode dropout = node.at("dropout");
    if (!dropout.value().is_number() || dropout.value().get<double>() != 0.0) {
      dropout.fail("must be null or 0: BPE dropout is randomised and not supported");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (node.has(key) && !node.at(key).as_string().empty()) {
      node.at(key).fail("is not supported (only byte-level and SentencePiece-style BPE are)");
    }
  }
  if (node.has("unk_token")) unk_token_ = node.at("unk_token").as_string();
  fuse_unk_ = node.bool_or("fuse_unk", false);
  byte_fallback_ = node.bool_or("byte_fallback", false);
  ignore_merges_ = node.bool_or("ignore_merges", false);

  const JsonNode vocab = node.at("vocab");
  if (!vocab.value().is_object()) vocab.fail("must be an object of token -> id");
  for (const auto& [token, id_json] : vocab.value().items()) {
    if (!id_json.is_number_integer() || id_json.get<int64_t>() < 0 ||
        id_json.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      vocab.fail("entry \"", token, "\" must map to an id in [0, 2^31), got ", id_json.dump());
    }
    const auto id = static_cast<int32_t>(id_json.get<int64_t>());
    vocab_[token] = id;
    vocab_r_[id] = token;
    max_id_ = std::max(max_id_, id);
  }

  const JsonNode merges = node.at("merges");
  int32_t rank = 0;
  for (const JsonNode& merge : merges.elements()) {
    std::string left, right;
    if (merge.value().is_string()) {
      // "a b": exactly two parts separated by one space, as HF's legacy merges parser.
      const std::string line = merge.as_string();
      if (line.starts_with("#version")) continue;
      const size_t space = line.find(' ');
      if (space == std::string::npos || line.find(' ', space + 1) != std::string::npos) {
        merge.fail("must be \"left right\" (two tokens separated by one space), got \"", line,
                   "\"");
      }
      left = line.substr(0, space);
      right = line.substr(space + 1);
    } else if (merge.value().is_array() && merge.value().size() == 2) {
      left = merge.elements()[0].as_string();
      right = merge.elements()[1].as_string();
    } else {
      merge.fail("must be a \"left right\" string or a [left, right] array");
    }
    const auto left_id = token_to_id(left);
    const auto right_id = token_to_id(right);
    const auto merged_id = token_to_id(left + right);
    if (!left_id || !right_id || !merged_id) {
      merge.fail("refers to a token missing from the vocabulary: \"",
                 !left_id ? left : (!right_id ? right : left + right), "\"");
    }
    // Later duplicates overwrite earlier ones, as collecting into HF's HashMap does.
    merges_[pair_key(*left_id, *right_id)] = {rank, *merged_id};
    ++rank;
  }

  if (unk_token_ && !token_to_id(*unk_token_)) {
    node.at("unk_token").fail("\"", *unk_token_, "\" is not in the vocabulary");
  }
}

std::optional<int32_t> BpeModel::token_to_id(std::string_view token) const {
  const auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* BpeModel::id_to_token(int32_t id) const {
  const auto it = vocab_r_.find(id);
  return it == vocab_r_.end() ? nullptr : &it->second;
}

std::vector<int32_t> BpeModel::merge_word(std::string_view word) const {
  std::vector<Symbol> symbols;
  symbols.reserve(word.size());
  const auto add = [&](int32_t id, size_t len) {
    const auto index = static_cast<int64_t>(symbols.size());
    if (!symbols.empty()) symbols.back().next = index;
    symbols.push_back({id, index - 1, -1, len});
  };
  // A pending unknown token (id >= 0) and the bytes it covers, emitted once known characters
  // resume so that fuse_unk can extend it.
  int32_t unk_id = -1;
  size_t unk_len = 0;
  size_t pos = 0;
  while (pos < word.size()) {
    const size_t len = utf8_char_len(word, pos);
    const std::string_view ch = word.substr(pos, len);
    pos += len;
    if (const auto id = token_to_id(ch)) {
      if (unk_id >= 0) {
        add(unk_id, unk_len);
        unk_id = -1;
      }
      add(*id, len);
      continue;
    }
    if (byte_fallback_) {
      std::vector<int32_t> byte_ids;
      for (const char c : ch) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", static_cast<unsigned char>(c));
        const auto id = token_to_id(name);
        if (!id) break;
        byte_ids.push_back(*id);
      }
      if (byte_ids.size() == ch.size()) {
        // HF adds the byte tokens without flushing a pending unknown first; keep that order.
        for (const int32_t id : byte_ids) add(id, 1);
        continue;
      }
    }
    if (unk_token_) {
      if (unk_id >= 0 && fuse_unk_) {
        unk_len += len;
      } else {
        if (unk_id >= 0) add(unk_id, unk_len);
        unk_id = *token_to_id(*unk_token_);
        unk_len = len;
      }
    }
  }
  if (unk_id >= 0) add(unk_id, unk_len);

  std::priority_queue<Merge> queue;
  const auto find_merge = [&](int32_t left, int32_t right) {
    const auto it = merges_.find(pair_key(left, right));
    return it == merges_.end() ? nullptr : &it->second;
  };
  for (size_t i = 0; i + 1 < symbols.size(); ++i) {
    if (const auto* m = find_merge(symbols[i].id, symbols[i + 1].id)) {
      queue.push({i, m->first, m->second});
    }
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = symbols[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    const auto next_pos = static_cast<size_t>(cur.next);
    const Symbol right = symbols[next_pos];
    // Skip entries made stale by an earlier merge.
    const auto* m = find_merge(cur.id, right.id);
    if (m == nullptr || m->second != top.new_id) continue;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    symbols[next_pos].len = 0;
    if (right.next >= 0 && static_cast<size_t>(right.next) < symbols.size()) {
      symbols[static_cast<size_t>(right.next)].prev = static_cast<int64_t>(top.pos);
    }
    if (cur.prev >= 0) {
      const auto prev = static_cast<size_t>(cur.prev);
      if (const auto* pm = find_merge(symbols[prev].id, cur.id)) {
        queue.push({prev, pm->first, pm->second});
      }
    }
    if (cur.next >= 0) {
      if (const auto* nm = find_merge(cur.id, symbols[static_cast<size_t>(cur.next)].id)) {
        queue.push({top.pos, nm->first, nm->second});
      }
    }
  }
  std::vector<int32_t> ids;
  for (const Symbol& s : symbols) {
    if (s.len != 0) ids.push_back(s.id);
  }
  return ids;
}

void BpeModel::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (ignore_merges_) {
    if (const auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  }
  const bool cacheable = word.size() < kCacheMaxWordBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    const auto it = cache_.find(word);
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> ids = merge_word(word);
  out.insert(out.end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mutex_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(ids));
  }
}

}  // namespace loraplex::tok
