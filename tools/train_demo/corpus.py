"""Corpus preparation: English prose from the reStructuredText sources of the Python 3.11
documentation as shipped by Debian's python3.11-doc package.

The rst markup is turned into plain text: directives, comments, tables and link targets are
dropped; API signatures (``.. function:: f(x)``) become a plain line; inline roles, literals and
emphasis keep their text; paragraphs are reflowed to one line each. Literal (code) blocks are kept,
dedented, with their line breaks (they are examples under the PSF licence / 0BSD).
"""
import hashlib
import os
import re

SOURCES = "/usr/share/doc/python3.11/html/_sources"
DEBIAN_PACKAGE = "python3.11-doc"

SIG_DIRECTIVES = {"function", "method", "class", "attribute", "data", "exception", "decorator",
                  "decoratormethod", "classmethod", "staticmethod", "module", "c:function", "c:macro",
                  "c:type", "c:member", "c:var", "opcode", "cmdoption", "option", "envvar",
                  "describe", "abstractmethod", "coroutinefunction", "coroutinemethod", "property"}
CODE_DIRECTIVES = {"code-block", "code", "sourcecode", "doctest", "testcode", "testoutput",
                   "testsetup", "testcleanup", "productionlist", "literalinclude", "highlight",
                   "parsed-literal", "csv-table", "table", "list-table", "raw", "toctree", "index",
                   "image", "figure", "only", "include", "impl-detail", "audit-event", "audit-event-table",
                   "availability", "rubric", "sectionauthor", "moduleauthor", "seealso_code", "tabularcolumns",
                   "limited-api-list", "opcode-list", "c:namespace", "currentmodule", "program", "default-role",
                   "contents", "math", "graphviz", "inheritance-diagram", "autoclass", "automodule",
                   "literalinclude", "glossary_code"}
VERSION_DIRECTIVES = {"versionadded": "New in version", "versionchanged": "Changed in version",
                      "deprecated": "Deprecated since version"}

ROLE_RE = re.compile(r":[a-zA-Z0-9_:+-]+:`([^`]*)`")
LINK_RE = re.compile(r"`([^`<]*?)\s*<[^`>]*>`__?")
REF_RE = re.compile(r"`([^`]+)`__?")
LIT_RE = re.compile(r"``(.+?)``")
STRONG_RE = re.compile(r"\*\*(\S(?:.*?\S)?)\*\*")
EM_RE = re.compile(r"(?<![\w*])\*(\S(?:[^*]*?\S)?)\*(?![\w*])")
UNDERLINE_RE = re.compile(r"^([=\-~^*#+\"'`:.])\1{2,}\s*$")


def _role_text(m):
    t = m.group(1)
    lt = re.match(r"^(.*?)\s*<([^>]*)>$", t)
    if lt and lt.group(1):
        t = lt.group(1)
    if t.startswith("~"):
        t = t[1:].split(".")[-1]
    t = t.lstrip("!")
    return t


def inline(text):
    text = ROLE_RE.sub(_role_text, text)
    text = LIT_RE.sub(lambda m: m.group(1), text)
    text = LINK_RE.sub(lambda m: m.group(1), text)
    text = REF_RE.sub(lambda m: m.group(1), text)
    text = STRONG_RE.sub(lambda m: m.group(1), text)
    text = EM_RE.sub(lambda m: m.group(1), text)
    text = text.replace("|release|", "3.11").replace("|version|", "3.11")
    text = re.sub(r"\\(.)", r"\1", text)
    return text


def rst_to_text(src):
    lines = src.replace("\t", "    ").split("\n")
    # group into blocks separated by blank lines
    blocks, cur = [], []
    for ln in lines:
        if ln.strip() == "":
            if cur:
                blocks.append(cur)
                cur = []
        else:
            cur.append(ln.rstrip())
    if cur:
        blocks.append(cur)

    out = []
    code_indent = None  # indentation that the current literal block must exceed
    skip_indent = None  # indented content of a dropped directive
    for blk in blocks:
        ind = min(len(l) - len(l.lstrip()) for l in blk)
        if code_indent is not None:
            if ind > code_indent:
                out.append("\n".join(l[ind:] for l in blk))
                continue
            code_indent = None
        if skip_indent is not None:
            if ind > skip_indent:
                continue
            skip_indent = None
        first = blk[0].strip()
        # headings: [overline] title underline
        if len(blk) in (2, 3) and UNDERLINE_RE.match(blk[-1].strip()) and (
                len(blk) == 2 or UNDERLINE_RE.match(blk[0].strip())):
            title = blk[-2].strip()
            out.append(inline(title))
            continue
        if first.startswith(".. "):
            m = re.match(r"^\.\.\s+([a-zA-Z0-9_:-]+)::\s*(.*)$", first)
            if m is None:  # comment, link target, substitution
                skip_indent = ind
                continue
            name, arg = m.group(1), m.group(2)
            body = [l for l in blk[1:] if not l.strip().startswith(":")]
            if name in SIG_DIRECTIVES:
                sigs = [arg] + [l.strip() for l in blk[1:] if not l.strip().startswith(":")]
                out.append("\n".join(inline(s) for s in sigs if s))
                continue
            if name in VERSION_DIRECTIVES:
                text = VERSION_DIRECTIVES[name] + " " + arg.strip() + "."
                if body:
                    text += " " + " ".join(l.strip() for l in body)
                out.append(inline(text))
                continue
            if name in CODE_DIRECTIVES or name.startswith("c:"):
                code_indent = ind if name in ("code-block", "code", "sourcecode", "doctest", "testcode") else None
                if code_indent is None:
                    skip_indent = ind
                continue
            # note, warning, seealso, attention, ...: keep the content
            if body:
                out.append(inline(" ".join(l.strip() for l in body)))
            elif arg:
                out.append(inline(arg))
            continue
        if first.startswith(("+-", "+=", "===", ":")) and not first.startswith("::") and (
                first.startswith("+") or first.startswith("=") or re.match(r"^:[\w -]+:", first)):
            continue  # tables, field lists
        if first.startswith(">>>") or first.startswith("$ "):
            out.append("\n".join(l[ind:] for l in blk))
            continue
        text = " ".join(l.strip() for l in blk)
        if text.endswith("::"):
            code_indent = ind
            text = text[:-2].rstrip()
            if text.endswith(" ") or text == "":
                text = text.rstrip()
            else:
                text = text + ":"
            if text in ("", ":"):
                continue
            if not text.endswith(":"):
                text += ":"
        text = inline(text)
        if text:
            out.append(text)
    return "\n\n".join(out)


def list_sources(root=SOURCES):
    files = []
    for d, _, fs in os.walk(root):
        for f in fs:
            if f.endswith(".rst.txt"):
                files.append(os.path.relpath(os.path.join(d, f), root))
    return sorted(files)


# Whole files held out from tokenizer and model training. howto/unicode gives heldout.txt.
HELDOUT_FIXED = ("howto/unicode.rst.txt", "tutorial/floatingpoint.rst.txt", "howto/sockets.rst.txt")
SKIP = ("license.rst.txt", "copyright.rst.txt", "whatsnew/changelog.rst.txt")


def is_heldout(rel):
    if rel in HELDOUT_FIXED:
        return True
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % 40 == 0


def build(root=SOURCES):
    train, held = [], []
    for rel in list_sources(root):
        if rel in SKIP:
            continue
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            text = rst_to_text(f.read())
        if len(text) < 200:
            continue
        (held if is_heldout(rel) else train).append((rel, text))
    return train, held
