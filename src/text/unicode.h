#pragma once
// Unicode helpers for the tokenizer: UTF-8 coding and repair, normalization forms (via
// libutf8proc), and the few character classes the Hugging Face `tokenizers` semantics need.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace vireo::unicode {

// Appends the UTF-8 encoding of `cp` (which must be a Unicode scalar value).
void append_utf8(std::string& out, char32_t cp);

// Decodes the code point starting at s[i] of a string known to be valid UTF-8 and advances i.
char32_t next_code_point(std::string_view s, std::size_t& i);

// Length of the UTF-8 sequence introduced by lead byte `b` in a valid string (1..4).
inline std::size_t utf8_len(unsigned char b) {
  return b < 0x80 ? 1 : b < 0xE0 ? 2 : b < 0xF0 ? 3 : 4;
}

// Length of the well-formed UTF-8 sequence at s[i], or 0 when the bytes there are not one. When
// not, `*bad_len` (if given) is the length of the maximal ill-formed subpart (>= 1), the unit that
// Unicode's "substitution of maximal subparts" (Rust's from_utf8_lossy, Python's
// errors="replace") turns into one U+FFFD. `*truncated` says the subpart was cut by the end of
// the input, i.e. more bytes could still complete it.
std::size_t valid_sequence_len(std::string_view s, std::size_t i, std::size_t* bad_len = nullptr,
                               bool* truncated = nullptr);

bool is_valid_utf8(std::string_view s);

// Replaces each maximal ill-formed subpart by U+FFFD; valid input comes back unchanged.
std::string to_valid_utf8(std::string_view s);

// Normalization forms. Input must be valid UTF-8.
std::string nfc(std::string_view s);
std::string nfd(std::string_view s);
std::string nfkc(std::string_view s);
std::string nfkd(std::string_view s);

// Rust's char::is_whitespace / the regex crate's \s: the White_Space property.
bool is_white_space(char32_t cp);
// The regex crate's \w: alphabetic, marks, decimal digits, connector punctuation.
bool is_word_char(char32_t cp);
// Rust's char::is_numeric: general categories Nd, Nl, No.
bool is_numeric(char32_t cp);

}  // namespace vireo::unicode
