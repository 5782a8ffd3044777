"""Bring lines over a width (default 100) down to it without changing what the code does.

    python tools/wrap_lines.py [--width 100] [--check] PATH...

PATH is a .py file or a folder (searched for *.py). For each file, in this order:

1. standalone comment blocks: prose lines (`# text`) and list items (`# - text` and the lines
   indented under it) of a block with a long line are re-filled to the width, keeping the
   indentation; the dashes of a heading (`# --- name -----`) are cut at the width; other lines that
   look like code, tables, lists or URLs (`# ...`, `# -`, `# |`, `# *`, `# 1.`, `http`, pragmas such
   as `# noqa`) stay as they are and end a paragraph;
2. docstrings (and other bare string statements): paragraphs with a long line are re-filled, keeping
   the opening quotes on the first line and the closing quotes where they were, and so are list
   items with a hanging indent; paragraphs that look like code, tables or doctest, or are indented
   deeper than the docstring, stay as they are. A dataclass's docstring keeps its first line as it
   is (an option group's title is that line);
3. a trailing `# comment` that makes a line long moves onto its own line(s) just above it (not
   pragmas such as `# noqa` or `# type: ignore`, not inside a multi-line string, not on an import);
4. any other long code line: its statement is reformatted by `ruff format --range` at the width
   (import statements are left to ruff's isort, `ruff check --fix`, once ruff.toml has the width);
5. a string literal still running past the width is cut, after a space and outside f-string fields,
   into adjacent literals (one constant, as before; parenthesised when outside brackets), and its
   statement is formatted again. This relies on Python 3.11's tokenize (one token per f-string).

Before writing, each file is checked: its AST must equal the old one once docstrings are
whitespace-normalised (the text of each may change only in whitespace), a dataclass docstring's
first line must be unchanged, and the words of its comments must be the same, in the same order. A
file that fails is not written. At the end it prints, per file, the lines still over the width.
--check writes nothing and only reports what would change.
"""
from __future__ import annotations

import argparse
import ast
import io
import re
import subprocess
import sys
import textwrap
import tokenize
from pathlib import Path

# Comment lines that are not prose: kept as they are and never merged with their neighbours.
_SPECIAL_COMMENT = re.compile(
    r"#(?! \S)|# ([-*+>] |[|]|-{3,}|={3,}|\d+[.)] |noqa|type:|pragma|fmt:|ruff:)"
)
# The dashes that draw a section heading in a comment (`# --- the model -----`).
_RULER = re.compile(r"(-{3,}|={3,})$")
# Trailing comments that must stay on their line.
_PRAGMA = re.compile(r"#\s*(noqa|type:|pragma|fmt:|ruff:|pylint:|isort:)")
# A list item in a comment (`# - text`, `# 1. text`), continued on lines indented to its text.
_COMMENT_ITEM = re.compile(r"# ([-*+]|\d+[.)]) +(?=\S)")
# A list item in a docstring.
_DOC_ITEM = re.compile(r"([-*+]|\d+[.)]) +(?=\S)")
# Docstring lines that are not prose.
_SPECIAL_DOC = re.compile(r"([-*+>] |[|]|-{3,}|={3,}|\d+[.)] |\.\. |:\w+:|[A-Z][\w ]*:$)")


def _tokens(src: str) -> list[tokenize.TokenInfo]:
    return list(tokenize.generate_tokens(io.StringIO(src).readline))


def _lines(src: str) -> list[str]:
    return src.split("\n")


def _fill(words: list[str], first: str, rest: str, width: int) -> list[str]:
    """`words` filled to `width`; when that leaves a last line of a word or two, the same number of
    lines as even as they come (the narrowest width that needs no more lines)."""

    def wrap(w: int) -> list[str]:
        return textwrap.TextWrapper(
            width=w,
            initial_indent=first,
            subsequent_indent=rest,
            break_long_words=False,
            break_on_hyphens=False,
        ).wrap(" ".join(words))

    out = wrap(width)
    if len(out) < 2 or len(out[-1]) - len(rest) >= (width - len(rest)) // 4:
        return out
    low, high = max(len(first), len(rest)) + 10, width  # wrap(high) has len(out) lines
    while low < high:
        mid = (low + high) // 2
        if len(wrap(mid)) <= len(out):
            high = mid
        else:
            low = mid + 1
    return wrap(high)


# -- 1. standalone comment blocks ------------------------------------------------------------------


def wrap_comment_blocks(src: str, width: int) -> str:
    lines = _lines(src)
    starts = {(t.start[0], t.start[1]) for t in _tokens(src) if t.type == tokenize.COMMENT}
    standalone = set()
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.lstrip().startswith("#") and (i + 1, indent) in starts:
            standalone.add(i)
    out: list[str] = []
    i = 0
    while i < len(lines):
        if i not in standalone:
            out.append(lines[i])
            i += 1
            continue
        indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
        j = i
        while j < len(lines) and j in standalone and lines[j].startswith(indent + "#"):
            j += 1
        out.extend(_refill_comment_lines(lines[i:j], indent, width))
        i = j
    return "\n".join(out)


def _prose_comment(text: str) -> bool:
    return not (
        _SPECIAL_COMMENT.match(text) or "http" in text or "`" * 3 in text or _RULER.search(text)
    )


def _refill_comment_lines(block: list[str], indent: str, width: int) -> list[str]:
    out: list[str] = []
    k = 0
    while k < len(block):
        text = block[k][len(indent):]
        item = _COMMENT_ITEM.match(text)
        if item:  # a list item and its hanging-indented continuation lines
            hang = "#" + " " * (item.end() - 1)
            m = k + 1
            while m < len(block) and re.match(re.escape(hang) + r"\S", block[m][len(indent):]):
                m += 1
            run = block[k:m]
            if any(len(line) > width for line in run) and not any("http" in line for line in run):
                words = " ".join(
                    [text[item.end() :]] + [line[len(indent) + 1 :] for line in run[1:]]
                ).split()
                out.extend(_fill(words, indent + item.group(0), indent + hang, width))
            else:
                out.extend(run)
            k = m
            continue
        if not _prose_comment(text):
            line = block[k]
            if len(line) > width and (ruler := re.search(r"([-=])\1{2,}$", line)):
                line = line[: max(width, ruler.start() + 3)]  # a heading's dashes end at the width
            out.append(line)
            k += 1
            continue
        m = k
        while m < len(block) and _prose_comment(block[m][len(indent):]):
            m += 1
        run = block[k:m]
        if any(len(line) > width for line in run):
            words = " ".join(line[len(indent) + 1:] for line in run).split()
            out.extend(_fill(words, indent + "# ", indent + "# ", width))
        else:
            out.extend(run)
        k = m
    return out


# -- 2. docstrings ---------------------------------------------------------------------------------


def _string_statements(tree: ast.AST):
    """Bare string statements: docstrings, and strings standing alone (attribute docstrings)."""
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            yield node


def _is_dataclass(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and any(
        "dataclass" in ast.unparse(d) for d in node.decorator_list
    )


def _class_docstrings(tree: ast.AST) -> list[str]:
    """First lines of dataclasses' docstrings:
    `core.options.add_options` titles an option group with one."""
    out = []
    for node in ast.walk(tree):
        if _is_dataclass(node):
            doc = ast.get_docstring(node, clean=True)
            out.append(doc.splitlines()[0] if doc else "")
    return out


def _char_col(line: str, byte_col: int) -> int:
    return len(line.encode()[:byte_col].decode())


def wrap_docstrings(src: str, width: int) -> str:
    lines = _lines(src)
    tree = ast.parse(src)
    class_docs = {
        id(n.body[0])
        for n in ast.walk(tree)
        if _is_dataclass(n) and isinstance(n.body[0], ast.Expr)
    }
    # bottom-up, so that line numbers above stay valid
    for node in sorted(_string_statements(tree), key=lambda n: -n.lineno):
        first, last = node.lineno - 1, node.end_lineno - 1
        if not any(len(lines[k]) > width for k in range(first, last + 1)):
            continue
        new = _refill_docstring(
            lines[first : last + 1], node, width, keep_first=id(node) in class_docs
        )
        if new is not None:
            lines[first:last + 1] = new
    return "\n".join(lines)


def _refill_docstring(
    block: list[str], node: ast.Expr, width: int, keep_first: bool
) -> list[str] | None:
    col = node.col_offset  # the indentation is ASCII, so bytes == characters
    base = block[0][:col]
    if base.strip():
        return None  # something else before the string on its line
    m = re.match(r"([rRuU]?)(\"\"\"|''')", block[0][col:])
    if not m:
        return None
    head = block[0][: col + m.end()]
    end = _char_col(block[-1], node.value.end_col_offset)
    quote = m.group(2)
    if block[-1][:end][-3:] != quote:
        return None  # implicit concatenation or the like
    tail = block[-1][end - 3:]
    # text of each line, without the opening quotes (first line) and the closing ones (last line)
    texts = list(block)
    texts[-1] = texts[-1][: end - 3]
    texts[0] = texts[0][len(head):]
    n = len(block)

    def prose(k: int) -> bool:
        t = texts[k]
        if not t.strip() or "\\" in t or "\t" in t:
            return False
        if k == 0 and keep_first:
            return False
        body = t.strip()
        if _SPECIAL_DOC.match(body) or body.startswith(">>>") or "http" in body or "  " in body:
            return False
        if k > 0 and not (t.startswith(base) and not t[len(base):][:1].isspace()):
            return False  # indented deeper (or shallower) than the docstring
        return True

    def item(k: int) -> re.Match | None:
        t = texts[k]
        if (
            k == 0
            or "\\" in t
            or "http" in t
            or not t.startswith(base)
            or t[len(base) :][:1].isspace()
        ):
            return None
        return _DOC_ITEM.match(t[len(base):])

    out: list[str] = []
    k = 0
    while k < n:
        if it := item(k):  # a list item and its hanging-indented continuation lines
            hang = base + " " * it.end()
            j = k + 1
            while j < n and re.match(re.escape(hang) + r"\S", texts[j]) and "\\" not in texts[j]:
                j += 1
            if any(len(block[x]) > width for x in range(k, j)):
                words = " ".join(texts[x] for x in range(k, j))[len(base) + it.end():].split()
                if j == n:
                    words[-1] += tail
                out.extend(_fill(words, base + it.group(0), hang, width))
            else:
                out.extend(block[k:j])
            k = j
            continue
        if not prose(k):
            out.append(block[k])
            k += 1
            continue
        j = k
        while j < n and prose(j):
            j += 1
        if any(len(block[x]) > width for x in range(k, j)):
            words = " ".join(texts[x] for x in range(k, j)).split()
            if j == n:
                words[-1] += tail
            out.extend(_fill(words, head if k == 0 else base, base, width))
        else:
            out.extend(block[k:j])
        k = j
    return out


# -- 3. trailing comments --------------------------------------------------------------------------


def move_trailing_comments(src: str, width: int) -> str:
    lines = _lines(src)
    toks = _tokens(src)
    inside_string = set()  # lines that begin inside a multi-line token
    for t in toks:
        for row in range(t.start[0] + 1, t.end[0] + 1):
            inside_string.add(row - 1)
    comments = {}
    for t in toks:
        if t.type == tokenize.COMMENT:
            comments[t.start[0] - 1] = t
    imports = {k - 1 for k in _import_lines(src)}  # isort wraps these itself, comments and all
    for i in sorted(comments, reverse=True):
        line, t = lines[i], comments[i]
        if len(line) <= width or i in inside_string or i in imports:
            continue
        if i > 0 and lines[i - 1].endswith("\\"):
            continue
        code = line[: t.start[1]].rstrip()
        if not code.strip() or _PRAGMA.match(t.string):
            continue
        indent = line[: len(line) - len(line.lstrip())]
        text = t.string[1:].strip()
        if not text:
            lines[i] = code
            continue
        above = [indent + "# " + text]
        if len(above[0]) > width and _prose_comment("# " + text):
            above = _fill(text.split(), indent + "# ", indent + "# ", width)
        lines[i:i + 1] = above + [code]
    return "\n".join(lines)


# -- 4. long code lines ----------------------------------------------------------------------------


def _long_code_lines(src: str, width: int) -> list[int]:
    """1-based numbers of long lines that are code (not comments, not inside a string)."""
    lines = _lines(src)
    in_string = set()
    for t in _tokens(src):
        if t.type == tokenize.STRING or t.type == getattr(tokenize, "FSTRING_MIDDLE", -1):
            for row in range(t.start[0] + 1, t.end[0] + 1):
                in_string.add(row)
    out = []
    for k, line in enumerate(lines, 1):
        if len(line) > width and not line.lstrip().startswith("#") and k not in in_string:
            out.append(k)
    return out


def ruff_format_range(src: str, path: Path, start: int, end: int, width: int) -> str:
    lines = _lines(src)
    rng = f"{start}:1-{end}:{len(lines[end - 1]) + 1}"
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--line-length",
            str(width),
            "--range",
            rng,
            "--stdin-filename",
            str(path),
            "-",
        ],
        input=src,
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        return src
    return res.stdout


def _import_lines(src: str) -> set[int]:
    """Lines of import statements: left to ruff's isort
    (`ruff check --fix`) once the line length is set."""
    return {k for node in ast.walk(ast.parse(src)) if isinstance(node, (ast.Import, ast.ImportFrom))
            for k in range(node.lineno, node.end_lineno + 1)}


def format_long_code(src: str, path: Path, width: int) -> str:
    cursor = len(_lines(src)) + 1
    while True:
        imports = _import_lines(src)
        todo = [k for k in _long_code_lines(src, width) if k < cursor and k not in imports]
        if not todo:
            return src
        k = todo[-1]
        src = ruff_format_range(src, path, k, k, width)
        cursor = k


# -- 5. long string literals -----------------------------------------------------------------------


def _split_points(content: str, prefix: str) -> list[int]:
    """Where `content` (a string literal's text between its quotes)
    can be cut into two literals that concatenate to the same value:
    after a space that ends a word, outside an f-string's fields."""
    fstring, raw = "f" in prefix.lower(), "r" in prefix.lower()
    if not raw and "\\N{" in content:
        return []
    out, depth, k = [], 0, 0
    while k < len(content):
        ch = content[k]
        if not raw and ch == "\\" and depth == 0:
            k += 2
            continue
        if fstring and ch in "{}":
            if depth == 0 and content[k:k + 2] in ("{{", "}}"):
                k += 2
                continue
            depth += 1 if ch == "{" else -1
        elif depth == 0 and ch == " " and k + 1 < len(content) and content[k + 1] != " " and k > 0:
            if content[k - 1] != "\\":
                out.append(k + 1)
        k += 1
    return out


def _parse_literal(tok: str) -> tuple[str, str, str] | None:
    """(prefix, quote, text between the quotes) of a one-line
    string literal; None for a triple-quoted one."""
    m = re.match(r"([A-Za-z]*)(['\"])", tok)
    if not m or tok[m.end() - 1:m.end() + 2] in ('"""', "'''") or "u" in m.group(1).lower():
        return None
    return m.group(1), m.group(2), tok[m.end():-1]


def _string_pieces(prefix: str, quote: str, content: str, first_room: int, room: int,
                   last_extra: int) -> list[str] | None:
    """`content` as literals whose lines fit: the first in `first_room` columns, the others in
    `room`, the last with `last_extra` columns after it."""
    points = _split_points(content, prefix)
    overhead = len(prefix) + 2
    pieces, start, avail = [], 0, first_room
    while len(content) - start + overhead + last_extra > avail:
        fits = [p for p in points if start < p and p - start + overhead <= avail]
        later = [p for p in points if p > start]
        if not later:
            break
        cut = fits[-1] if fits else later[0]
        pieces.append(content[start:cut])
        start, avail = cut, room
    pieces.append(content[start:])

    def literal(text: str) -> str:
        pre = prefix
        if "f" in pre.lower() and not re.search(r"[{}]", text):
            pre = pre.replace("f", "").replace("F", "")
        return pre + quote + text + quote

    return [literal(p) for p in pieces]


def _reflow_group(
    lines: list[str], group: list[tokenize.TokenInfo], width: int
) -> list[str] | None:
    """The lines of an implicit concatenation, one literal per line at one column, re-cut so that
    each fits; None when the group is not laid out that way or its literals cannot be joined."""
    col, row0 = group[0].start[1], group[0].start[0] - 1
    parsed = [_parse_literal(t.string) for t in group]
    if any(p is None for p in parsed):
        return None
    for n, t in enumerate(group):
        line = lines[t.start[0] - 1]
        if (
            t.start != (row0 + n + 1, col)
            or line[:col].strip()
            or (n < len(group) - 1 and line[t.end[1] :].strip())
        ):
            return None
    flags = [set(p[0].lower()) for p in parsed]
    if len({p[1] for p in parsed}) > 1 or len({frozenset(f - {"f"}) for f in flags}) > 1:
        return None  # different quotes, or raw and not raw, or bytes and text
    fstring = any("f" in f for f in flags)
    content = "".join(c if "f" in f or not fstring else c.replace("{", "{{").replace("}", "}}")
                      for (_, _, c), f in zip(parsed, flags))
    prefix = "".join(sorted(flags[0] - {"f"})) + ("f" if fstring else "")
    last = lines[group[-1].start[0] - 1]
    rest = last[group[-1].end[1]:]
    pieces = _string_pieces(prefix, parsed[0][1], content, width - col, width - col, len(rest))
    indent = lines[row0][:col]
    new = [indent + p for p in pieces]
    new[-1] += rest
    return new


def split_long_strings(src: str, width: int) -> tuple[str, list[tuple[int, int]]]:
    """Cut string literals that run past the width into adjacent literals
    (the same constant), one per line; a literal outside brackets is put
    in parentheses. Returns the source and the changed line ranges."""
    lines = _lines(src)
    toks = [t for t in _tokens(src) if t.type not in (tokenize.NL, tokenize.COMMENT)]
    depth, todo = 0, {}
    for n, t in enumerate(toks):
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            depth -= 1
        elif t.type == tokenize.STRING and t.start[0] == t.end[0] and t.start[1] < width - 10:
            row = t.start[0] - 1
            if len(lines[row]) <= width:
                continue
            prev = toks[n - 1] if n else None
            nxt = toks[n + 1] if n + 1 < len(toks) else None
            if depth == 0:
                if prev is None or prev.type in (
                    tokenize.NEWLINE,
                    tokenize.INDENT,
                    tokenize.DEDENT,
                ):
                    continue  # a string statement (a docstring): pass 2's
                if prev.type == tokenize.STRING or (
                    nxt is not None and nxt.type == tokenize.STRING
                ):
                    continue
            todo[row] = (t, depth == 0)  # the last such string on its line
    groups, prev_tok = [], None  # implicit concatenations: runs of string tokens
    for t in toks:
        if t.type == tokenize.STRING and groups and groups[-1][-1] is prev_tok:
            groups[-1].append(t)
        elif t.type == tokenize.STRING:
            groups.append([t])
        prev_tok = t
    group_of = {id(t): g for g in groups for t in g}
    changed, done = [], set()
    for row in sorted(todo, reverse=True):
        t, paren = todo[row]
        g = group_of[id(t)]
        if id(g) in done:
            continue  # re-cut whole below
        if len(g) > 1 and not paren:
            if (new := _reflow_group(lines, g, width)) is not None:
                done.add(id(g))
                first, last = g[0].start[0] - 1, g[-1].start[0] - 1
                lines[first:last + 1] = new
                changed = [
                    (s + len(new) - (last - first + 1), e + len(new) - (last - first + 1))
                    for s, e in changed
                ]
                changed.append((first + 1, first + len(new)))
                continue
        line = lines[row]
        a, b = t.start[1], t.end[1]  # tokenize counts characters
        indent = line[: len(line) - len(line.lstrip())]
        ind = " " * a if not paren and not line[:a].strip() else indent + "    "
        if (parsed := _parse_literal(t.string)) is None:
            continue
        pieces = _string_pieces(*parsed, width - a - paren, width - len(ind), len(line) - b + paren)
        if len(pieces) == 1:
            continue
        new = [line[:a] + "(" * paren + pieces[0]] + [ind + p for p in pieces[1:]]
        new[-1] += ")" * paren + line[b:]
        lines[row:row + 1] = new
        # the ones below moved down
        changed = [(s + len(new) - 1, e + len(new) - 1) for s, e in changed]
        changed.append((row + 1, row + len(new)))
    return "\n".join(lines), sorted(changed)


def format_split_strings(src: str, path: Path, width: int) -> str:
    src, changed = split_long_strings(src, width)
    for start, end in reversed(changed):  # bottom-up; ruff extends each range to its statement
        src = ruff_format_range(src, path, start, end, width)
    return src


# -- checks ----------------------------------------------------------------------------------------


class _NormaliseStrings(ast.NodeTransformer):
    def visit_Expr(self, node: ast.Expr) -> ast.Expr:
        if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            node.value.value = " ".join(node.value.value.split())
        return self.generic_visit(node)


def _comment_words(src: str) -> list[str]:
    words = [
        w for t in _tokens(src) if t.type == tokenize.COMMENT for w in t.string.lstrip("#").split()
    ]
    return ["---" if _RULER.fullmatch(w) else w for w in words]


def same_behaviour(old: str, new: str) -> str | None:
    """None when `new` is `old` up to layout, else what differs."""
    try:
        new_tree = ast.parse(new)
    except SyntaxError as e:
        return f"does not parse: {e}"
    old_tree = ast.parse(old)
    if _class_docstrings(old_tree) != _class_docstrings(new_tree):
        return "a class docstring's first line changed"
    if ast.dump(_NormaliseStrings().visit(old_tree)) != ast.dump(
        _NormaliseStrings().visit(new_tree)
    ):
        return "the AST differs"
    if _comment_words(old) != _comment_words(new):
        return "the comments differ"
    return None


def wrap_source(src: str, path: Path, width: int) -> str:
    new = wrap_comment_blocks(src, width)
    new = wrap_docstrings(new, width)
    new = move_trailing_comments(new, width)
    new = format_long_code(new, path, width)
    new = format_split_strings(new, path, width)
    return new


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="+", type=Path)
    ap.add_argument("--width", type=int, default=100)
    ap.add_argument("--check", action="store_true", help="write nothing, only report")
    args = ap.parse_args(argv)
    files = sorted({f for p in args.paths for f in ([p] if p.is_file() else p.rglob("*.py"))})
    before_total = after_total = refused = 0
    for f in files:
        old = f.read_text()
        before = sum(len(line) > args.width for line in _lines(old))
        before_total += before
        if not before:
            continue
        new = wrap_source(old, f, args.width)
        problem = same_behaviour(old, new)
        if problem:
            print(f"{f}: REFUSED, {problem}", file=sys.stderr)
            refused += 1
            after_total += before
            continue
        left = [k for k, line in enumerate(_lines(new), 1) if len(line) > args.width]
        after_total += len(left)
        print(
            f"{f}: {before} -> {len(left)} lines over {args.width}"
            + (f" (left: {left})" if left else "")
        )
        if new != old and not args.check:
            f.write_text(new)
    print(
        f"total: {before_total} -> {after_total} lines over {args.width}; {refused} file(s) refused"
    )
    return 1 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
