#!/usr/bin/env python3
"""Builds the tokenizer test corpus and the expected ids/decodes from the Python `tokenizers`
package (the independent reference), for the real tokenizers in ../shared/data/tokenizers.

Deterministic: a fixed seed and hand-written cases; rerunning gives byte-identical files.

Writes (under tests/data/tokenizer/):
  corpus.jsonl                 one case a line: {"kind": ..., "text": ...} or, for input that is
                               not valid UTF-8, {"kind": "invalid_utf8", "hex": ...}
  <name>.golden.json.gz        {"tokenizers_version", "cases": [{"e": ids without special
                               tokens, "s": ids with, "d": decode(s), "ds": decode(s, skip
                               special), "t": ids with special tokens in the text read as
                               plain text}], "random_decode": [{"ids", "d", "ds"}]}

Invalid UTF-8 cases are encoded by `tokenizers` as bytes.decode("utf-8", "replace"): vireo's
defined behaviour for such input.

Usage: /work/pyenv/bin/python tools/make_tokenizer_goldens.py [--shared ../shared]
"""
import argparse
import gzip
import io
import json
import os
import random
import sys

import tokenizers
from tokenizers import Tokenizer

NAMES = ["deepseek_v3", "qwen3", "gemma3"]

# Variants of the real tokenizers with other components swapped in, so that components the three
# do not use (Metaspace, Digits, Prepend, Strip, NFKC, ByteLevel with its regex, ignore_merges,
# Roberta post-processing) are also checked against `tokenizers`. Written to variants.json; the
# C++ test applies the same patches. Keys are top-level fields, or "model.<field>".
VARIANTS = {
    "gemma3_llama": {"base": "gemma3", "set": {
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "\u2581"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
        "pre_tokenizer": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}}},
    "gemma3_metaspace": {"base": "gemma3", "set": {
        "normalizer": {"type": "NFKC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": False},
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True}]},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first", "split": True},
            {"type": "ByteFallback"}, {"type": "Fuse"}]}}},
    "qwen3_bytelevel_regex": {"base": "qwen3", "set": {
        "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}]},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}]},
        "post_processor": {"type": "RobertaProcessing", "sep": ["<|im_end|>", 151645],
                           "cls": ["<|im_start|>", 151644], "trim_offsets": True, "add_prefix_space": True},
        "model.ignore_merges": True}},
}


def variant_json(name):
    v = VARIANTS[name]
    d = load_json(v["base"])
    for key, value in v["set"].items():
        if key.startswith("model."):
            d["model"][key[len("model."):]] = value
        else:
            d[key] = value
    return d
SEED = 20240611

WORDS = """the of and to in is was for that with on as by at from his her it an were are which this
be or has had not but first one their its new after who they have two been other when there all
during into school time may years more most only over city some world would where later up such
used many can state about national out known university united then made year under also people
three team game season between both well through however being government these film number
march music including american part would like than work city could make way back each water long
little very after word called just where most know get through back much before go good new write
our used me man too any day same right look think also around another came come work three word
must because does part even place well such here take why things help put years different away
again off went old number great tell men say small every found still between name should home big
give air line set own under read last never us left end along while might next sound below saw
something thought both few those always looks show large often together asked house don't world
going want school important until form food keep children feet land side without boy once animals
life enough took sometimes four head above kind began almost live page got earth need far hand high
year mother light parents country father let night following picture being study second eyes soon
times story boys since white days ever paper hard near sentence better best across during today
others however sure means knew it's try told young miles sun ways thing whole hear example heard
several change answer room sea against top turned learn point city play toward five using himself
usually money seen didn't car morning I'm body upon family later turn move face door cut done group
true leave color red friends pretty eat seven problem quite fast order area idea fire slowly
internet algorithm function variable tokenizer inference quantization transformer attention""".split()

CONTRACTIONS = ["I'm", "you're", "he's", "she'd", "we've", "they'll", "don't", "CAN'T", "It'S",
                "WE'RE", "O'Neil", "rock'n'roll", "'tis", "y'all", "ma'am", "I'D", "You'Ll"]

CODE_TEMPLATES = [
    "def {f}({a}, {b}):\n    return {a} {op} {b}\n",
    "for (int {a} = 0; {a} < {n}; ++{a}) {{\n\t{b}[{a}] = {a} * {n2};\n}}\n",
    "const {f} = ({a}) => {{ console.log(`{a}=${{{a}}}`); return {a}?.{b} ?? {n}; }};\n",
    "fn {f}(&mut self, {a}: u32) -> Result<Vec<u8>, Error> {{\n        Ok(vec![{n}; {a} as usize])\n    }}\n",
    "{{\"{a}\": {n}, \"{b}\": [\"{f}\", null, true, {n2}.5e-3]}}\n",
    "<div class=\"{a}\" id='{b}'>{f} &amp; {n}</div>\n",
    "if [ -f \"${a}\" ]; then\n  echo \"{f}\" | grep -E '^[0-9]+$' >> /tmp/{b}.log\nfi\n",
    "SELECT {a}, COUNT(*) FROM {b} WHERE {f} >= {n} GROUP BY {a};\n",
    "#include <{a}.h>\nstatic inline int {f}(const char *{b}) {{ return {b}[{n}] == '\\0'; }}\n",
    "class {F}({B}):\n    \"\"\"{f} docstring.\"\"\"\n    {a}: int = {n}\n\n    def __init__(self):\n        self.{b} = [{n}, {n2}]\n",
    "    # TODO({a}): handle {b} when n > {n}\n    x_{a}__{b} = {f}(**kwargs)  # noqa: E501\n",
    "{a}.{b}.{f}({n}, {n2});;\r\n",
]

SCRIPTS = {
    "cjk": (0x4E00, 0x9FA5), "hiragana": (0x3041, 0x3096), "katakana": (0x30A1, 0x30FA),
    "hangul": (0xAC00, 0xD7A3), "arabic": (0x0621, 0x064A), "devanagari": (0x0905, 0x0939),
    "thai": (0x0E01, 0x0E30), "cyrillic": (0x0410, 0x044F), "greek": (0x0391, 0x03C9),
    "hebrew": (0x05D0, 0x05EA),
}
MARKS = {"arabic": (0x064B, 0x0652), "devanagari": (0x093E, 0x094D), "thai": (0x0E31, 0x0E3A),
         "hebrew": (0x05B0, 0x05BC)}
PUNCT = {"cjk": "。，、！？「」：；（）", "hiragana": "。、！？", "katakana": "・ー。", "hangul": ".,?! ",
         "arabic": "،؛؟ ", "devanagari": "। ,", "thai": " ", "cyrillic": ".,!? ", "greek": ".,;· ",
         "hebrew": ".,? "}

EMOJI = ["😀", "😂", "🥲", "👍", "👍🏽", "👩‍💻", "👨‍👩‍👧‍👦", "🏳️‍🌈", "🇺🇸", "🇯🇵", "❤️", "1️⃣", "🧑🏿‍🚀",
         "🐈‍⬛", "👁️‍🗨️", "🤷‍♀️", "🫶🏻", "☕", "✅", "🚀", "🔥", "💯", "🙏", "👨🏻‍❤️‍💋‍👨🏼", "©️", "™", "🫠"]

WHITESPACE = [" ", "  ", "\t", "\n", "\r\n", "\n\n", "\u00a0", "\u3000", "\u2009", "\u2028", "\r",
              "\x0b", "\x0c", "\u0085", "\u200b", "\u180e", "\u2581"]


def special_tokens():
    out = set()
    for name in NAMES:
        for t in load_json(name)["added_tokens"]:
            out.add(t["content"])
    return sorted(out)


def load_json(name):
    with gzip.open(os.path.join(ARGS.shared, "data/tokenizers", name, "tokenizer.json.gz"), "rt",
                   encoding="utf-8") as f:
        return json.load(f)


def rand_script_text(r, script, n):
    lo, hi = SCRIPTS[script]
    out = []
    for _ in range(n):
        out.append(chr(r.randint(lo, hi)))
        if script in MARKS and r.random() < 0.3:
            out.append(chr(r.randint(*MARKS[script])))
        if r.random() < 0.15:
            out.append(r.choice(PUNCT[script]))
    return "".join(out)


def english(r, n):
    words = []
    for i in range(n):
        w = r.choice(WORDS) if r.random() > 0.08 else r.choice(CONTRACTIONS)
        if i == 0 or r.random() < 0.05:
            w = w.capitalize()
        if r.random() < 0.03:
            w = w.upper()
        words.append(w)
        if r.random() < 0.1:
            words[-1] += r.choice([",", ".", ";", ":", "!", "?", "...", "—", ")", "\""])
    s = " ".join(words)
    return s + r.choice([".", "!", "?", "", "\n"])


def ident(r):
    parts = [r.choice(WORDS).replace("'", "") for _ in range(r.randint(1, 3))]
    return r.choice(["_".join(parts), "".join(p.capitalize() for p in parts), parts[0]])


def code(r):
    t = r.choice(CODE_TEMPLATES)
    s = t.format(f=ident(r), a=ident(r), b=ident(r), F=ident(r).capitalize(), B=ident(r).capitalize(),
                 n=r.randint(0, 100000), n2=r.randint(0, 999), op=r.choice("+-*/%^&|"))
    if r.random() < 0.3:
        s = s.replace("    ", "\t")
    return s


def number(r):
    k = r.randint(0, 9)
    if k == 0:
        return str(r.randint(0, 10 ** r.randint(1, 25)))
    if k == 1:
        return f"{r.uniform(-1e6, 1e6):.{r.randint(0, 8)}f}"
    if k == 2:
        return f"{r.randint(1, 9999):,}"
    if k == 3:
        return f"+1 ({r.randint(100, 999)}) {r.randint(100, 999)}-{r.randint(1000, 9999)}"
    if k == 4:
        return f"{r.randint(1900, 2100)}-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}T{r.randint(0, 23):02d}:00Z"
    if k == 5:
        return "".join(chr(0x0660 + r.randint(0, 9)) for _ in range(r.randint(1, 8)))  # Arabic-Indic
    if k == 6:
        return "".join(chr(0x0966 + r.randint(0, 9)) for _ in range(r.randint(1, 8)))  # Devanagari
    if k == 7:
        return "".join(chr(0xFF10 + r.randint(0, 9)) for _ in range(r.randint(1, 8)))  # fullwidth
    if k == 8:
        return r.choice(["½", "²³", "Ⅻ", "①②③", "0x1F", "1e-9", "3.14159", "v1.2.3"])
    return ident(r) + str(r.randint(0, 99999)) + ident(r)


def combining(r):
    out = []
    for _ in range(r.randint(1, 12)):
        out.append(r.choice("aeiouAEIOUnczsgkqwy"))
        for _ in range(r.randint(0, 3)):
            out.append(chr(r.randint(0x0300, 0x036F)))
        if r.random() < 0.2:
            out.append(" ")
    s = "".join(out)
    if r.random() < 0.5:  # decomposed Hangul jamo and precomposed/decomposed Latin
        s += "".join(chr(c) for c in (0x1100 + r.randint(0, 18), 0x1161 + r.randint(0, 20), 0x11A8))
    return s


def whitespace_run(r):
    parts = []
    for _ in range(r.randint(1, 6)):
        parts.append("".join(r.choice(WHITESPACE) for _ in range(r.randint(1, 40))))
        if r.random() < 0.7:
            parts.append(r.choice(WORDS + ["", "x", "123", "中文", "!!"]))
    return "".join(parts)


def emoji(r):
    return "".join(r.choice(EMOJI) + r.choice(["", "", " ", "\u200d", "\ufe0f", "a"])
                   for _ in range(r.randint(1, 8)))


def random_unicode(r):
    out = []
    for _ in range(r.randint(1, 30)):
        plane = r.random()
        if plane < 0.6:
            c = r.randint(0x20, 0xFFFF)
        elif plane < 0.9:
            c = r.randint(0x10000, 0x2FFFF)
        else:
            c = r.randint(0xE0000, 0x10FFFF)
        if 0xD800 <= c <= 0xDFFF:
            c = 0xFFFD
        out.append(chr(c))
    return "".join(out)


def with_specials(r, specials):
    parts = []
    for _ in range(r.randint(2, 6)):
        k = r.random()
        if k < 0.4:
            parts.append(r.choice(specials))
        elif k < 0.5:
            s = r.choice(specials)
            parts.append(s[: r.randint(1, max(1, len(s) - 1))])  # broken prefix of a token
        else:
            parts.append(english(r, r.randint(1, 6)) if r.random() < 0.7 else rand_script_text(r, "cjk", 5))
        parts.append(r.choice(["", "", " ", "\n", "  ", "\n\n"]))
    return "".join(parts)


def mixed(r):
    gens = [lambda: english(r, r.randint(3, 20)), lambda: code(r), lambda: number(r),
            lambda: rand_script_text(r, r.choice(list(SCRIPTS)), r.randint(2, 20)), lambda: emoji(r)]
    return r.choice([" ", "", "\n", "\t"]).join(
        g() for g in (r.choice(gens) for _ in range(r.randint(2, 5))))


HAND = [
    "", " ", "  ", "\n", "\t", "\r\n", "a", "Hello, world!", "Hello world", " Hello world",
    "hello  world", "   leading and trailing   ", "I'm sure it's fine, isn't it? We'll see.",
    "DON'T SHOUT'S", "ſ's 'S 'ſ", "K k \u212a", "ﬁ ﬂ ﬃ", "Ǆ ǅ ǆ", "İstanbul ıi", "straße STRASSE",
    "1234567890", "3.14159265358979", "12,345,678.90", "a1b22c333d4444", "٣٤٥ ١٢", "१२३४",
    "０１２３", "²³¹", "x = 10**9 + 7", "e\u0301 \u00e9 e\u0301\u0301", "\u1100\u1161\u11a8 \uac01",
    "A\u030a \u00c5 \u212b", "\u0958\u0959", "ﾃｽﾄ テスト", "𝕳𝖊𝖑𝖑𝖔 𝒽𝑒𝓁𝓁𝑜", "①②③ ⑴⑵",
    "你好，世界！", "今天天气很好。我们去公园吧", "東京都渋谷区", "ひらがなカタカナ漢字", "한국어 텍스트입니다.",
    "안녕하세요 세계", "مرحبا بالعالم", "السَّلَامُ عَلَيْكُمْ", "नमस्ते दुनिया", "हिन्दी में लिखा गया वाक्य।",
    "สวัสดีชาวโลก", "Привет, мир!", "Γειά σου Κόσμε", "שָׁלוֹם עוֹלָם", "ԲԱՐԵՎ", "ሰላም ልዑል",
    "👨‍👩‍👧‍👦", "🏳️‍🌈 🏴‍☠️", "👍🏻👍🏼👍🏽👍🏾👍🏿", "🇺🇸🇬🇧🇯🇵", "1️⃣#️⃣*️⃣", "🧑‍🤝‍🧑", "🫱🏻‍🫲🏿",
    "a\u200bb\u200cc\u200dd", "\ufeffBOM at start", "nbsp\u00a0here", "ideographic\u3000space",
    "line\u2028sep\u2029para", "nel\u0085x", "mongolian\u180evs", "\x00\x01\x02\x1f\x7f",
    "\ue000\uf8ff private", "\ufffe\uffff nonchars", "\U0010ffff \U000e0001", "\ufffd replacement",
    " " * 100, " " * 1000 + "x", "\t" * 50, "\n" * 40, "\r\n" * 20, " \n \n \n ", "x" + " " * 17 + "y",
    "\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n\n",
    "a" * 3000, "ab" * 1500, "🙂" * 300, "中" * 500, "1" * 700, "." * 200, "-=" * 100,
    "▁▁ already metaspace ▁", "▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁▁", "\t\t\t\t\t\t\t\tx",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><|endoftext|>", "<|im_start", "<|im_start|", "<think>\nhmm\n</think>\n\nAnswer",
    "<tool_call>{\"name\": \"f\"}</tool_call>", "<｜begin▁of▁sentence｜>Hello<｜end▁of▁sentence｜>",
    "<｜User｜>hi<｜Assistant｜>", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}",
    "<bos><start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n", "<bos>", "<eos><pad>",
    "text<start_of_image>img<end_of_image>", "<unused0><unused99>", "<mask>[multimodal]",
    "x <bos> y", "<<bos>>", "<start_of_turn", "def f():\n\treturn 1\n", "    indented\n        more",
    "https://example.com/path?q=1&r=2#frag", "user@example.org", "C:\\Windows\\System32",
    "$HOME/.config/*.json", "#!/usr/bin/env python3", "// comment\n/* block */", "<!-- html -->",
    "¡Hola! ¿Qué tal?", "Ça va? Œuvre, naïve café", "Zürich Øresund Łódź", "ÀÉÎÕÜ àéîõü",
    "tab\tseparated\tvalues", "mixed 中文 and English 和 한국어", "عربي English mixed 123",
    "emoji🙂in🙂words", "😀😃😄😁", "👩🏽‍🔬 scientist", "a\u0308\u0301", "\u0301leading mark",
    "\u0300\u0301\u0302", "ا\u064b\u064c", "क्\u200dष", "\u202eRLO\u202c", "ﷺ ﷽", "㍻ ㌀ ㎏",
]

INVALID = [
    b"\xff", b"\xc0\xaf", b"abc\x80def", b"\xe2\x82", b"\xe2\x82abc", b"\xf0\x9f\x98", b"\xf0\x9f\x98 x",
    b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xf8\x88\x80\x80\x80", b"\xfe\xff", b"caf\xe9",
    b"\xe0\x80\xaf", b"hello \xf0world", b"\x80\x80\x80", b"ok \xe4\xb8\xad\xe6\x96 broken",
    b"<|im_start|>\xff<|im_end|>", b"\xc3", b"a\xc3", b"\xc3\x28", b"\xa0\xa1", b"\xe1\x80\x41",
    b"\xf1\x80\x80", b"\xef\xbf\xbd\xef\xbf", b"  \xff  \xfe  ", b"\xf0\x90\x28\xbc",
]


def build_corpus():
    r = random.Random(SEED)
    specials = special_tokens()
    cases = [("hand", s) for s in HAND]
    gens = [
        ("english", lambda: " ".join(english(r, r.randint(3, 40)) for _ in range(r.randint(1, 4)))),
        ("code", lambda: "".join(code(r) for _ in range(r.randint(1, 4)))),
        ("digits", lambda: " ".join(number(r) for _ in range(r.randint(1, 6)))),
        ("cjk", lambda: rand_script_text(r, "cjk", r.randint(1, 60))),
        ("japanese", lambda: rand_script_text(r, r.choice(["hiragana", "katakana", "cjk"]), r.randint(1, 40))
         + rand_script_text(r, "hiragana", r.randint(1, 20))),
        ("korean", lambda: " ".join(rand_script_text(r, "hangul", r.randint(1, 6)) for _ in range(r.randint(1, 10)))),
        ("arabic", lambda: " ".join(rand_script_text(r, "arabic", r.randint(1, 8)) for _ in range(r.randint(1, 10)))),
        ("hindi", lambda: " ".join(rand_script_text(r, "devanagari", r.randint(1, 8)) for _ in range(r.randint(1, 10)))),
        ("other_scripts", lambda: " ".join(rand_script_text(r, r.choice(["thai", "cyrillic", "greek", "hebrew"]),
                                                            r.randint(1, 10)) for _ in range(r.randint(1, 8)))),
        ("emoji", lambda: emoji(r)),
        ("combining", lambda: combining(r)),
        ("whitespace", lambda: whitespace_run(r)),
        ("specials", lambda: with_specials(r, specials)),
        ("mixed", lambda: mixed(r)),
        ("random_unicode", lambda: random_unicode(r)),
    ]
    per_kind = {"english": 260, "code": 260, "digits": 150, "cjk": 120, "japanese": 80, "korean": 100,
                "arabic": 100, "hindi": 100, "other_scripts": 80, "emoji": 120, "combining": 120,
                "whitespace": 150, "specials": 200, "mixed": 200, "random_unicode": 100}
    for kind, gen in gens:
        for _ in range(per_kind[kind]):
            cases.append((kind, gen()))
    return cases


def main():
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared"))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "data", "tokenizer"))
    ARGS = ap.parse_args()
    os.makedirs(ARGS.out, exist_ok=True)

    cases = build_corpus()
    with open(os.path.join(ARGS.out, "corpus.jsonl"), "w", encoding="utf-8", newline="\n") as f:
        for kind, text in cases:
            f.write(json.dumps({"kind": kind, "text": text}, ensure_ascii=False) + "\n")
        for b in INVALID:
            f.write(json.dumps({"kind": "invalid_utf8", "hex": b.hex()}) + "\n")
    texts = [t for _, t in cases] + [b.decode("utf-8", "replace") for b in INVALID]
    print(f"corpus: {len(texts)} strings", file=sys.stderr)

    with open(os.path.join(ARGS.out, "variants.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump(VARIANTS, f, ensure_ascii=False, indent=1)
        f.write("\n")
    for name in NAMES + list(VARIANTS):
        raw = json.dumps(load_json(name) if name in NAMES else variant_json(name))
        tok = Tokenizer.from_str(raw)
        out_cases = []
        for t in texts:
            e = tok.encode(t, add_special_tokens=False).ids
            s = tok.encode(t, add_special_tokens=True).ids
            out_cases.append({"e": e, "s": s, "d": tok.decode(s, skip_special_tokens=False),
                              "ds": tok.decode(s, skip_special_tokens=True)})
        # Special tokens spelled in the text encoded as plain text (encode_special_tokens).
        tok.encode_special_tokens = True
        for c, t in zip(out_cases, texts):
            c["t"] = tok.encode(t, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        # Random id sequences exercise decoding of partial characters and invalid byte runs.
        r = random.Random(SEED + (NAMES + list(VARIANTS)).index(name))
        vocab = tok.get_vocab_size(with_added_tokens=True)
        # Sorted: get_vocab() order varies from run to run.
        byte_ids = sorted(i for tkn, i in tok.get_vocab(with_added_tokens=True).items()
                    if (len(tkn) == 6 and tkn.startswith("<0x")) or len(tkn) == 1)
        specials_ids = [tok.token_to_id(t) for t in special_tokens() if tok.token_to_id(t) is not None]
        rnd = []
        for _ in range(300):
            ids = []
            for _ in range(r.randint(1, 25)):
                k = r.random()
                ids.append(r.choice(byte_ids) if k < 0.5 else r.choice(specials_ids) if k < 0.6
                           else r.randrange(vocab))
            rnd.append({"ids": ids, "d": tok.decode(ids, skip_special_tokens=False),
                        "ds": tok.decode(ids, skip_special_tokens=True)})
        doc = {"tokenizer": name, "tokenizers_version": tokenizers.__version__, "cases": out_cases,
               "random_decode": rnd}
        buf = io.BytesIO()
        with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as g:
            g.write(json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        with open(os.path.join(ARGS.out, f"{name}.golden.json.gz"), "wb") as f:
            f.write(buf.getvalue())
        print(f"{name}: {sum(len(c['s']) for c in out_cases)} ids", file=sys.stderr)


if __name__ == "__main__":
    main()
