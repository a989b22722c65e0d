"""Griffe extension: renders the package's reST (NumPyro-style) docstrings in mkdocstrings.

The package writes docstrings for Sphinx: ``:param x:`` fields, ``:class:`~a.B``` roles,
``.. doctest::`` and ``.. math::`` directives, bare ``>>>`` doctest blocks and examples
after the field list. Griffe's ``sphinx`` parser reads the fields but passes everything else
to Markdown untouched (``>>>`` becomes a nested block quote, roles show up verbatim, and the
text after the last field is swallowed into that field). This extension rewrites each
docstring into what the ``sphinx`` parser and Markdown expect, before it is parsed:

* roles become cross-references (``<autoref ... optional>``: a link when the target is
  documented on the site, plain code otherwise, so unknown targets never warn);
* ``:math:`` and ``.. math::`` become MathJax (pymdownx.arithmatex) spans and blocks;
* ``>>>`` blocks, ``.. doctest::``/``.. code-block::`` bodies and ``::`` literal blocks
  become fenced code;
* ``.. note::``/``.. warning::`` become admonitions;
* ``:ivar type name:`` becomes ``:vartype name: type`` + ``:ivar name:``, and
  ``:raises A, B:`` one entry per exception (griffe reads one name per field);
* text after the field list is rendered after the parameter tables, not inside them;
* module and class attributes documented Sphinx-style with ``#:`` comments above them get
  those comments as their docstring.

It only changes what the site shows; the package's source is not touched.
Loaded from ``mkdocs.yml`` (``extensions: [tools/griffe_rest.py]``).
"""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any

import griffe

_FIELD_NAMES = (
    "param|parameter|arg|argument|key|keyword|type|var|ivar|cvar|vartype|"
    "raises|raise|except|exception|return|returns|rtype|yield|yields"
)
_FIELD_RE = re.compile(rf"^:(?:{_FIELD_NAMES})(?:\s[^:]*)?:")
_ROLE_RE = re.compile(r":(?:py:)?(?P<role>func|class|meth|mod|attr|data|exc|obj|const|math):`(?P<body>[^`]+)`")
_DIRECTIVE_RE = re.compile(r"^(?P<indent>\s*)\.\. (?P<name>[a-z-]+)::\s*(?P<arg>.*)$")
_ADMONITIONS = {"note", "warning", "tip", "important", "caution", "danger", "hint", "seealso"}
_CODE_DIRECTIVES = {"doctest", "testcode", "code-block", "code", "sourcecode"}


def _indent_of(line: str) -> int:
    return len(line) - len(line.lstrip())


def _resolve(name: str, context: griffe.Object, package: griffe.Object) -> str:
    """The documented path of ``name`` as seen from ``context`` (``name`` if unknown)."""
    name = name.lstrip(".")
    candidates = []
    scope: Any = context
    while scope is not None:
        candidates.append(f"{scope.path}.{name}")
        scope = scope.parent
    candidates.append(name)
    for candidate in candidates:
        if candidate == package.path:
            return candidate
        if not candidate.startswith(package.path + "."):
            continue
        try:
            obj = package[candidate[len(package.path) + 1 :]]
        except (KeyError, ValueError, griffe.AliasResolutionError, griffe.CyclicAliasError):
            continue
        if obj.is_alias:
            try:
                return obj.final_target.path
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                return obj.target_path
        return obj.path
    return name


def _replace_roles(text: str, context: griffe.Object, package: griffe.Object) -> str:
    def replace(match: re.Match) -> str:
        role, body = match["role"], match["body"]
        if role == "math":
            return rf"\({body}\)"
        titled = re.fullmatch(r"(?P<title>.*?)\s*<(?P<target>[^>]+)>", body)
        if titled:
            title, target = titled["title"], titled["target"]
        else:
            target = body
            title = body.lstrip("~").split(".")[-1] if body.startswith("~") else body
        target = target.lstrip("~")
        identifier = _resolve(target, context, package)
        return f'<autoref identifier="{html.escape(identifier)}" optional><code>{html.escape(title)}</code></autoref>'

    return _ROLE_RE.sub(replace, text)


def _fence(lines: list[str], indent: str, language: str) -> list[str]:
    body = textwrap.dedent("\n".join(lines)).strip("\n").split("\n")
    return [f"{indent}```{language}", *(indent + line if line else "" for line in body), f"{indent}```"]


def _convert_blocks(lines: list[str]) -> list[str]:
    """Directives and bare doctest blocks to Markdown; everything else unchanged."""
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        directive = _DIRECTIVE_RE.match(line)
        if directive and (directive["name"] in _CODE_DIRECTIVES | _ADMONITIONS | {"math"}):
            indent, name = directive["indent"], directive["name"]
            base = len(indent)
            j = i + 1
            while j < len(lines) and re.match(r"^\s+:[a-z-]+:", lines[j]) and _indent_of(lines[j]) > base:
                j += 1  # directive options
            body = []
            while j < len(lines) and (not lines[j].strip() or _indent_of(lines[j]) > base):
                body.append(lines[j])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            if name == "math":
                content = textwrap.dedent("\n".join(body)).strip("\n").split("\n")
                if directive["arg"]:
                    content.insert(0, directive["arg"])
                out += [f"{indent}$$", *(indent + c for c in content), f"{indent}$$"]
            elif name in _ADMONITIONS:
                kind = "info" if name == "seealso" else name
                content = textwrap.dedent("\n".join(body)).strip("\n").split("\n")
                if directive["arg"]:
                    content.insert(0, directive["arg"])
                out.append(f"{indent}!!! {kind}")
                out += [f"{indent}    {c}" if c else "" for c in _convert_blocks(content)]
            else:
                text = textwrap.dedent("\n".join(body)).strip("\n")
                language = "pycon" if text.lstrip().startswith(">>>") else (directive["arg"] or "python")
                out += _fence(body, indent, language)
            if j < len(lines):
                out.append("")
            i = j
            continue
        literal = line.rstrip().endswith("::") and not line.lstrip().startswith("..")
        if literal and i + 1 < len(lines) and not lines[i + 1].strip():
            # "Paragraph::" followed by an indented literal block
            base = _indent_of(line)
            j = i + 1
            body = []
            while j < len(lines) and (not lines[j].strip() or _indent_of(lines[j]) > base):
                body.append(lines[j])
                j += 1
            while body and not body[-1].strip():
                body.pop()
            if body:
                text = line.rstrip()[:-2].rstrip()
                if text.strip():
                    out += [text + ":", ""]
                indent = line[:base]
                language = "pycon" if textwrap.dedent("\n".join(body)).lstrip().startswith(">>>") else "python"
                out += _fence(body, indent, language)
                if j < len(lines):
                    out.append("")
                i = j
                continue
        if line.lstrip().startswith(">>>"):
            indent = line[: _indent_of(line)]
            j = i
            block = []
            while j < len(lines) and lines[j].strip():
                block.append(lines[j])
                j += 1
            if out and out[-1].strip():
                out.append("")
            out += _fence(block, indent, "pycon")
            i = j
            continue
        out.append(line)
        i += 1
    return out


def _normalise_field(line: str) -> list[str]:
    """One reST field line in the forms griffe's sphinx parser reads."""
    ivar = re.match(r"^:(ivar|var|cvar)\s+(?P<type>[^:\s][^:]*?)\s+(?P<name>\w+):(?P<rest>.*)$", line)
    if ivar:
        kind = ivar.group(1)
        return [f":vartype {ivar['name']}: {ivar['type']}", f":{kind} {ivar['name']}:{ivar['rest']}"]
    raises = re.match(r"^:(raises|raise|except|exception)\s+(?P<types>[^:]+):(?P<rest>.*)$", line)
    if raises:
        types = [t for t in re.split(r"[\s,]+", raises["types"]) if t and t != "or"]
        if len(types) > 1:
            return [f":{raises.group(1)} {t}:{raises['rest']}" for t in types]
    return [line]


def _split_fields(lines: list[str]) -> tuple[list[str], list[str], list[str]]:
    """``(description, fields, tail)``: the text before, in and after the reST field list."""
    head: list[str] = []
    fields: list[str] = []
    tail: list[str] = []
    in_field = False
    fence_open = False
    for index, line in enumerate(lines):
        if line.lstrip().startswith("```"):
            fence_open = not fence_open
        if not fence_open and _FIELD_RE.match(line):
            in_field = True
            fields.extend(_normalise_field(line))
            continue
        if in_field and (not line.strip() or _indent_of(line) > 0 or fence_open):
            # a blank line ends the field unless the field's body continues (indented) after it
            if not line.strip():
                following = next((x for x in lines[index + 1 :] if x.strip()), "")
                if not (_indent_of(following) > 0 or _FIELD_RE.match(following)):
                    in_field = False
                    continue
            fields.append(line)
            continue
        in_field = False
        (tail if fields else head).append(line)
    return head, fields, tail


def _strip(lines: list[str]) -> list[str]:
    text = "\n".join(lines).strip("\n")
    return text.split("\n") if text else []


def _rewrite(obj: griffe.Object, package: griffe.Object) -> None:
    docstring = obj.docstring
    if docstring is None or not docstring.value:
        return
    text = _replace_roles(docstring.value, obj, package)
    lines = _convert_blocks(text.split("\n"))
    head, fields, tail = _split_fields(lines)
    docstring.value = "\n".join(_strip(head) + ([""] if head and fields else []) + fields)
    docstring.__dict__.pop("parsed", None)
    if tail and docstring.parser is not None:
        sections = docstring.parse()
        sections.append(griffe.DocstringSectionText("\n".join(_strip(tail))))
        docstring.__dict__["parsed"] = sections
    elif tail:
        docstring.value += "\n\n" + "\n".join(_strip(tail))


def _comment_docstring(obj: griffe.Object, parent_docstring: griffe.Docstring | None) -> None:
    """Gives an undocumented attribute the ``#:`` comment lines just above it."""
    if not obj.is_attribute or obj.docstring is not None or not obj.lineno:
        return
    try:
        lines = obj.lines_collection[obj.filepath]
    except (KeyError, TypeError):
        return
    comment: list[str] = []
    index = obj.lineno - 2
    while index >= 0 and lines[index].lstrip().startswith("#:"):
        comment.insert(0, lines[index].lstrip()[2:].removeprefix(" "))
        index -= 1
    if comment:
        obj.docstring = griffe.Docstring(
            "\n".join(comment),
            lineno=index + 2,
            endlineno=obj.lineno - 1,
            parent=obj,
            parser=parent_docstring.parser if parent_docstring else None,
            parser_options=parent_docstring.parser_options if parent_docstring else None,
        )


def _walk(obj: griffe.Object, seen: set[int]):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    yield obj
    for member in obj.members.values():
        if member.is_alias:
            continue
        yield from _walk(member, seen)


class RestDocstrings(griffe.Extension):
    """Rewrites every docstring of a loaded package (see the module docstring)."""

    def on_package(self, *, pkg: griffe.Module, loader: griffe.GriffeLoader, **kwargs: Any) -> None:
        for obj in _walk(pkg, set()):
            _comment_docstring(obj, obj.module.docstring or pkg.docstring)
            _rewrite(obj, pkg)
