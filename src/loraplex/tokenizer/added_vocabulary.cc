#include "loraplex/tokenizer/added_vocabulary.h"

#include <algorithm>

#include "loraplex/tokenizer/utf8.h"

namespace loraplex::tok {

void AddedVocabulary::Trie::insert(std::string_view content, int32_t id) {
  int32_t node = 0;
  for (const char c : content) {
    const auto byte = static_cast<unsigned char>(c);
    const auto it = nodes[node].children.find(byte);
    if (it != nodes[node].children.end()) {
      node = it->second;
    } else {
      const auto child = static_cast<int32_t>(nodes.size());
      nodes[node].children.emplace(byte, child);
      nodes.emplace_back();
      node = child;
    }
  }
  // The first pattern wins among identical contents, as in the Aho-Corasick automaton.
  if (nodes[node].id < 0) nodes[node].id = id;
}

std::pair<size_t, int32_t> AddedVocabulary::Trie::longest_at(std::string_view text,
                                                             size_t pos) const {
  std::pair<size_t, int32_t> best{0, -1};
  int32_t node = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto it = nodes[node].children.find(static_cast<unsigned char>(text[i]));
    if (it == nodes[node].children.end()) break;
    node = it->second;
    if (nodes[node].id >= 0) best = {i + 1 - pos, nodes[node].id};
  }
  return best;
}

AddedVocabulary::AddedVocabulary(const JsonNode& node, const BpeModel& model,
                                 const Normalizer* normalizer)
    : model_(model) {
  word_char_ = std::make_unique<OnigRegex>(R"([\p{Alphabetic}\p{M}\p{Nd}\p{Pc}\p{Join_Control}])",
                                           "added token word-character class");
  // HF re-derives the ids on load (AddedVocabulary::add_tokens) instead of trusting the "id"
  // fields: an existing token keeps its id, a new one gets the next free id past the model.
  std::vector<AddedToken> special_tokens;
  std::vector<AddedToken> added_tokens;
  if (!node.is_null()) {
    for (const JsonNode& entry : node.elements()) {
      AddedToken t;
      t.content = entry.at("content").as_string();
      t.single_word = entry.bool_or("single_word", false);
      t.lstrip = entry.bool_or("lstrip", false);
      t.rstrip = entry.bool_or("rstrip", false);
      t.normalized = entry.bool_or("normalized", true);
      t.special = entry.bool_or("special", false);
      if (t.content.empty()) continue;
      if (find_invalid_utf8(t.content)) entry.at("content").fail("is not valid UTF-8");
      if (t.special && !special_set_.contains(t.content)) {
        special_tokens.push_back(t);
        special_set_.insert(t.content);
      }
      const bool duplicate = std::any_of(id_to_token_.begin(), id_to_token_.end(),
                                         [&](const auto& kv) { return kv.second == t; });
      if (duplicate) continue;
      int32_t id;
      if (const auto existing = token_to_id(t.content)) {
        id = *existing;
      } else if (max_id_ < 0) {
        id = static_cast<int32_t>(model_.vocab_entries());
      } else {
        const auto model_size = static_cast<int32_t>(model_.vocab_entries());
        id = (max_id_ >= model_size || model_size == 0) ? max_id_ + 1 : model_size;
      }
      token_to_id_[t.content] = id;
      id_to_token_[id] = t;
      decode_form_.erase(id);
      if (t.normalized && normalizer) {
        // Decoding yields the normalized form of a normalized token, so that the decoder can
        // undo the normalization (HF's AddedVocabulary::normalized_cache).
        std::string normalized = t.content;
        normalizer->normalize(normalized);
        if (normalized != t.content) decode_form_[id] = std::move(normalized);
      }
      max_id_ = std::max(max_id_, id);
      if (!special_set_.contains(t.content)) added_tokens.push_back(t);
    }
  }
  for (const auto* list : {&special_tokens, &added_tokens}) {
    for (const AddedToken& t : *list) {
      const int32_t id = *token_to_id(t.content);
      if (t.normalized) {
        std::string content = t.content;
        if (normalizer) normalizer->normalize(content);
        if (!content.empty()) normalized_trie_.insert(content, id);
      } else {
        raw_trie_.insert(t.content, id);
      }
    }
  }
}

std::optional<int32_t> AddedVocabulary::token_to_id(std::string_view content) const {
  const auto it = token_to_id_.find(content);
  if (it != token_to_id_.end()) return it->second;
  return model_.token_to_id(content);
}

const std::string* AddedVocabulary::id_to_token(int32_t id) const {
  const auto form = decode_form_.find(id);
  if (form != decode_form_.end()) return &form->second;
  const auto it = id_to_token_.find(id);
  return it == id_to_token_.end() ? nullptr : &it->second.content;
}

bool AddedVocabulary::is_word_char_at(std::string_view text, size_t pos) const {
  return word_char_->matches_at_start(text.substr(pos, utf8_char_len(text, pos)));
}

std::vector<AddedVocabulary::Match> AddedVocabulary::find_matches(std::string_view text,
                                                                  const Trie& trie) const {
  std::vector<Match> out;
  if (trie.nodes.size() == 1) return out;
  size_t start_offset = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    const auto [len, id] = trie.longest_at(text, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    size_t start = pos;
    size_t stop = pos + len;
    // The automaton moves past a match even when the checks below discard it.
    pos = stop;
    const AddedToken& token = id_to_token_.at(id);
    if (token.single_word) {
      const bool start_space =
          start == 0 || !is_word_char_at(text, utf8_last_char_start(text.substr(0, start)));
      const bool stop_space = stop == text.size() || !is_word_char_at(text, stop);
      if (!start_space || !stop_space) continue;
    }
    if (token.lstrip) {
      size_t new_start = start;
      while (new_start > 0) {
        const size_t prev = utf8_last_char_start(text.substr(0, new_start));
        if (!is_unicode_whitespace(utf8_decode_at(text, prev))) break;
        new_start = prev;
      }
      // Spaces already consumed by the previous match stay with it.
      start = std::max(new_start, start_offset);
    }
    if (token.rstrip) {
      while (stop < text.size() && is_unicode_whitespace(utf8_decode_at(text, stop))) {
        stop += utf8_char_len(text, stop);
      }
    }
    out.push_back({id, start, stop});
    start_offset = stop;
  }
  return out;
}

void AddedVocabulary::split(std::vector<Piece>& pieces, const Trie& trie) const {
  std::vector<Piece> out;
  out.reserve(pieces.size());
  for (Piece& piece : pieces) {
    if (piece.added_id >= 0) {
      out.push_back(std::move(piece));
      continue;
    }
    const std::string& text = piece.text;
    size_t start_offset = 0;
    const auto emit = [&](size_t start, size_t end, int32_t id) {
      if (end > start) {
        out.push_back(Piece{text.substr(start, end - start), id, piece.at_origin && start == 0});
      }
    };
    for (const Match& m : find_matches(text, trie)) {
      // rstrip may have run past the start of this match; HF then emits overlapping slices.
      if (start_offset < m.start) emit(start_offset, m.start, -1);
      emit(m.start, m.end, m.id);
      start_offset = m.end;
    }
    if (start_offset < text.size()) emit(start_offset, text.size(), -1);
  }
  pieces = std::move(out);
}

}  // namespace loraplex::tok
