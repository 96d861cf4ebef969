#!/usr/bin/env python3
"""Run the code blocks of the README and the docs, so that what they show keeps
working, and check their relative links.

    .venv/bin/python tools/readme_snippets.py [--list] [--only LINE]... [-v] [FILE.md...]

(`.ci/run` runs it after `python3 dev.py check`.) The files: those given, else
README.md and every markdown file under docs/ (`documents`). Every fenced block is
found (``` or ~~~, indented or not) and, unless a marker skips it, run under a time
limit; one line per block reports PASS, SKIP (and why) or FAIL (and the end of its
output) with the file and the block's line number. Then every relative link of every
file (`links`: ``[text](path)``, ``[text](path#anchor)``, ``[text](#anchor)``, images
too; not in code, not in HTML comments) must lead to a file or directory that exists,
and an anchor into a markdown file to one of its headings (GitHub's slugs). Exit
status 1 if a block failed, a marker is malformed or a link is broken, 0 otherwise.

How a block runs, by its language:

- ``python``: in a subprocess of this interpreter, from the repository's root, as
  written: nothing is added, so its imports and names must be complete (a PASS means
  the block works as a reader copies it). A block with a top-level ``await``, ``async
  with`` or ``async for`` is awaited under ``trio.run`` (``asyncio.run`` with the
  ``asyncio`` option), as ``python -m trio`` or ``python -m asyncio`` would run it;
  any other block runs as a script. Tracebacks name README.md's own lines. Only a
  block marked ``fragment`` starts in a namespace with ``PRELUDE`` (``from zmqdp import
  *``, ``import trio``, ``body = {"prompt": [1, 2, 3], "max_tokens": 8}`` and, with
  ``mock``, ``url``).
- ``sh``, ``bash`` or ``shell``: each command (lines ending in ``\\`` are
  joined) runs with ``bash -c`` from the repository's root, and must exit 0.
- anything else (``text``, ``json``, none...): not run, not reported.

The README's set-up block (only ``python3 dev.py ...`` commands: CI runs ``check``
itself) is skipped without a marker, so that nothing comes before it; in any other file
such a block is run like any other.

Markers: an HTML comment, invisible on GitHub, on the last non-blank line before the
opening fence, ``<!-- snippet: OPTION ... (why) -->``. Options:

- ``skip``: do not run the block; the ``(why)`` is required (a block that needs vLLM,
  another host, root, minutes of CPU, or that serves until stopped).
- ``mock=N``: start ``python -m zmqdp mock --engines N`` on a private ipc URL (in a
  temporary directory of this run) for the block and stop it after. Every
  ``ipc:///tmp/zmqdp-g1/g`` in the block becomes that URL, and ``url`` names it.
- ``asyncio``: a python block's top-level awaits run under ``asyncio.run``.
- ``tmp=PATH``: every ``PATH`` in the block becomes a path in a fresh temporary
  directory (``/etc/zmqdp/g1`` -> ``$TMP/g1``), so that nothing is written outside it.
- ``timeout=S``: the block's time limit in seconds (default 30).
- ``fragment``: a python block that is knowingly incomplete (an excerpt that leans on
  the text around it): run with ``PRELUDE`` first, and exempt from
  `undefined_names`. The README has none today; prefer a complete block.

Every other block runs as written. The README and the docs together take about 45 s.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DEFAULT_TIMEOUT = 30.0
MOCK_URL = "ipc:///tmp/zmqdp-g1/g"
"""The URL the snippets use; `mock=N` replaces it with a private one."""
PYTHON = frozenset({"python", "py", "python3"})
SHELL = frozenset({"sh", "bash", "shell"})
PRELUDE = 'from zmqdp import *\nimport trio\nbody = {"prompt": [1, 2, 3], "max_tokens": 8}\n'
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>.*)$")
MARKER = re.compile(r"^\s*<!--\s*snippet:(?P<body>.*?)-->\s*$")
WRAPPER = """
import ast, sys
source, filename, mode, prelude = sys.argv[1:5]
namespace = {"__name__": "__main__"}
exec(prelude, namespace)  # empty unless the block is marked `fragment`
code = compile(source, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
if code.co_flags & 0x80:  # CO_COROUTINE: top-level awaits, as in python -m trio
    async def main():
        await eval(code, namespace)
    if mode == "asyncio":
        import asyncio
        asyncio.run(main())
    else:
        import trio
        trio.run(main)
else:
    exec(code, namespace)
"""


class MarkerError(ValueError):
    """A malformed `<!-- snippet: ... -->` marker, or one that precedes no block."""


@dataclass(frozen=True)
class Options:
    skip: str | None = None
    """Why the block is not run (None: it runs)."""
    mock: int | None = None
    asyncio: bool = False
    tmp: tuple[str, ...] = ()
    timeout: float = DEFAULT_TIMEOUT
    fragment: bool = False
    """Run with `PRELUDE` first (a knowingly incomplete block)."""


@dataclass(frozen=True)
class Block:
    line: int
    """The line of the opening fence (1-based)."""
    lang: str
    code: str
    options: Options = field(default_factory=Options)

    @property
    def runnable(self) -> bool:
        return self.lang in PYTHON | SHELL


def parse_marker(text: str, line: int) -> Options:
    """`skip (why)`, `mock=2 asyncio timeout=10 tmp=/etc/x`... -> Options."""
    why = None
    paren = text.find("(")
    if paren >= 0:
        if not text.rstrip().endswith(")"):
            raise MarkerError(f"line {line}: unbalanced '(' in snippet marker")
        why = text[paren + 1 : text.rstrip().rfind(")")].strip()
        text = text[:paren]
    skip: str | None = None
    mock: int | None = None
    use_asyncio = False
    fragment = False
    tmp: list[str] = []
    timeout = DEFAULT_TIMEOUT
    for word in text.split():
        key, eq, value = word.partition("=")
        try:
            if word == "skip":
                if not why:
                    raise MarkerError(f"line {line}: `skip` needs a reason: skip (why)")
                skip = why
            elif word == "asyncio":
                use_asyncio = True
            elif word == "fragment":
                fragment = True
            elif key == "mock" and eq:
                mock = int(value)
                if mock < 1:
                    raise ValueError(value)
            elif key == "timeout" and eq:
                timeout = float(value)
                if timeout <= 0:
                    raise ValueError(value)
            elif key == "tmp" and eq and value.startswith("/"):
                tmp.append(value)
            else:
                raise MarkerError(f"line {line}: unknown snippet option {word!r}")
        except ValueError as exc:
            if isinstance(exc, MarkerError):
                raise
            raise MarkerError(f"line {line}: bad value in snippet option {word!r}") from None
    return Options(skip, mock, use_asyncio, tuple(tmp), timeout, fragment)


def extract(text: str) -> list[Block]:
    """Every fenced code block of a markdown text, with the options of its marker."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, Options] | None = None
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        fence = FENCE.match(line)
        if marker:
            if pending is not None:
                raise MarkerError(f"line {pending[0]}: snippet marker precedes no code block")
            pending = (i + 1, parse_marker(marker["body"], i + 1))
        elif fence:
            indent, mark = len(fence["indent"]), fence["fence"]
            lang = fence["info"].split()[0].lower() if fence["info"].strip() else ""
            body: list[str] = []
            j = i + 1
            while j < len(lines):
                close = FENCE.match(lines[j])
                if (
                    close
                    and close["fence"][0] == mark[0]
                    and len(close["fence"]) >= len(mark)
                    and not close["info"].strip()
                ):
                    break
                body.append(_dedent(lines[j], indent))
                j += 1
            options = pending[1] if pending is not None else Options()
            blocks.append(Block(i + 1, lang, "\n".join(body) + "\n", options))
            pending = None
            i = j
        elif line.strip() and pending is not None:
            raise MarkerError(f"line {pending[0]}: snippet marker precedes no code block")
        i += 1
    if pending is not None:
        raise MarkerError(f"line {pending[0]}: snippet marker precedes no code block")
    return blocks


def _dedent(line: str, indent: int) -> str:
    strip = len(line) - len(line.lstrip(" \t"))
    return line[min(indent, strip) :]


def commands(code: str, first_line: int) -> Iterator[tuple[int, str]]:
    """The shell commands of a block, with the line each starts on; `\\` joins lines;
    blank lines and comment lines are dropped."""
    start = 0
    parts: list[str] = []
    for offset, line in enumerate(code.splitlines()):
        if not parts:
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            start = first_line + offset
        parts.append(line)
        if not line.rstrip().endswith("\\"):
            yield start, "\n".join(parts)
            parts = []
    if parts:
        yield start, "\n".join(parts)


def substitute(code: str, options: Options, url: str | None, tmp: Path) -> str:
    if url is not None:
        code = code.replace(MOCK_URL, url)
    for path in options.tmp:
        code = code.replace(path, str(tmp / Path(path).name))
    return code


def undefined_names(code: str) -> list[str]:
    """Names a python block reads but neither binds nor imports (nor are builtins), each
    once: a block that would fail with `NameError` as written (the test suite checks
    every block, skipped ones included). Scopes are not told apart (a name bound anywhere in the
    block counts), which is enough for README snippets."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    missing: list[str] = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Name)
            and isinstance(node.ctx, ast.Load)
            and node.id not in bound
            and node.id not in missing
        ):
            missing.append(node.id)
    return missing


def documents() -> list[Path]:
    """README.md, then every markdown file under docs/, sorted."""
    return [README, *sorted(DOCS.rglob("*.md"))]


LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
INLINE_CODE = re.compile(r"(`+).*?\1")
COMMENT = re.compile(r"<!--.*?-->", re.DOTALL)
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(?P<text>.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but `-` and `_` dropped,
    spaces as `-` (`The core (`zmqdp/_core/`)` -> `the-core-zmqdp_core`)."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = text.replace("`", "").strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def _prose(text: str, blank_code: bool = True) -> list[tuple[int, str]]:
    """(line number, line) of `text` outside fenced blocks and HTML comments, with
    inline code blanked unless `blank_code` is False."""
    text = COMMENT.sub(lambda m: "\n" * m.group().count("\n"), text)
    out: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match["fence"]
            continue
        if fence is not None:
            closes = match and match["fence"][0] == fence[0] and not match["info"].strip()
            if closes and match and len(match["fence"]) >= len(fence):
                fence = None
            continue
        out.append((number, INLINE_CODE.sub("", line) if blank_code else line))
    return out


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings (a repeated one gets `-1`, `-2`...)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, line in _prose(path.read_text(), blank_code=False):
        heading = HEADING.match(line)
        if heading:
            base = slug(heading["text"])
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(path: Path) -> list[str]:
    """One line per broken relative link of a markdown file: `file:line: why`."""
    broken: list[str] = []
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    for number, line in _prose(path.read_text()):
        for match in LINK.finditer(line):
            target = match["target"]
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):
                continue  # http:, https:, mailto:...
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{name}:{number}: {target}: no such file")
                continue
            if anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{name}:{number}: {target}: no heading #{anchor} there")
    return broken


@dataclass
class Result:
    block: Block
    status: str
    """PASS, FAIL or SKIP."""
    seconds: float = 0.0
    detail: str = ""


def _run(cmd: Sequence[str], timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """(exit status or None on timeout, output); a timeout kills the process group."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out.decode(errors="replace")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return None, out.decode(errors="replace")


def _start_mock(url: str, engines: int, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", str(engines)]
    return subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


SETUP = "the set-up commands (CI runs `dev.py check` itself; docs/guides/testing.md runs demos)"
"""Why the README's first block is skipped with no marker: it must open the README."""


def is_setup(block: Block) -> bool:
    """The README's two set-up commands (`python3 dev.py ...` and nothing else)."""
    if block.lang not in SHELL:
        return False
    found = [command for _, command in commands(block.code, block.line)]
    return bool(found) and all(c.startswith("python3 dev.py ") for c in found)


def _is_setup_of(path: Path, block: Block) -> bool:
    """The set-up block, in a README (the only file that opens with one)."""
    return path.name == "README.md" and is_setup(block)


def run_block(block: Block, readme: Path) -> Result:
    options = block.options
    if options.skip is not None:
        return Result(block, "SKIP", detail=options.skip)
    if _is_setup_of(readme, block):
        return Result(block, "SKIP", detail=SETUP)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.monotonic()
    out = ""
    with tempfile.TemporaryDirectory(prefix="snippet-") as tmp:
        url = f"ipc://{tmp}/g1" if options.mock else None
        mock = _start_mock(url, options.mock, env) if url and options.mock else None
        try:
            code = substitute(block.code, options, url, Path(tmp))
            if block.lang in PYTHON:
                source = "\n" * block.line + code  # tracebacks show README line numbers
                prelude = ""
                if options.fragment:
                    prelude = PRELUDE + (f"url = {url!r}\n" if url else "")
                mode = "asyncio" if options.asyncio else "trio"
                cmd = [sys.executable, "-c", WRAPPER, source, str(readme), mode, prelude]
                status, out = _run(cmd, options.timeout, env)
                if status != 0:
                    why = "timed out" if status is None else f"exit status {status}"
                    return Result(block, "FAIL", time.monotonic() - start, f"{why}\n{out}")
            else:
                for line, command in commands(code, block.line + 1):
                    left = options.timeout - (time.monotonic() - start)
                    status, one = _run(["bash", "-c", command], max(left, 0.1), env)
                    out += f"$ {command}\n{one}"
                    if status != 0:
                        why = "timed out" if status is None else f"exit status {status}"
                        detail = f"line {line}: {why}: {command}\n{one}"
                        return Result(block, "FAIL", time.monotonic() - start, detail)
        finally:
            if mock is not None:
                _stop(mock)
    return Result(block, "PASS", time.monotonic() - start, out)


def _describe(block: Block) -> str:
    opts = block.options
    extra = [f"mock={opts.mock}"] if opts.mock else []
    extra += ["asyncio"] if opts.asyncio else []
    extra += ["fragment"] if opts.fragment else []
    extra += [f"tmp={p}" for p in opts.tmp]
    return f"{block.lang:6} {' '.join(extra)}".rstrip()


def _name(path: Path) -> str:
    return path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[1])
    parser.add_argument("files", nargs="*", type=Path, help="default: README.md and docs/")
    parser.add_argument("--list", action="store_true", help="list the blocks, run none")
    parser.add_argument(
        "--only", type=int, action="append", metavar="LINE", help="run the block at LINE"
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show every output")
    args = parser.parse_args(argv)
    files = [f.resolve() for f in args.files] or documents()
    found: list[tuple[Path, Block]] = []
    for path in files:
        try:
            found += [(path, b) for b in extract(path.read_text()) if b.runnable]
        except MarkerError as exc:
            print(f"{_name(path)}: {exc}")
            return 1
    if args.only:
        found = [(p, b) for p, b in found if b.line in args.only]
    if args.list:
        for path, b in found:
            skip = b.options.skip or (SETUP if _is_setup_of(path, b) else None)
            what = f"skip ({skip})" if skip else "run"
            print(f"{_name(path)}:{b.line:<4} {_describe(b):20} {what}")
        return 0
    started = time.monotonic()
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for path, block in found:
        result = run_block(block, path)
        counts[result.status] += 1
        head = f"{_name(path)}:{block.line:<4} {_describe(block):20} {result.status}"
        if result.status == "SKIP":
            print(f"{head} ({result.detail})", flush=True)
        elif result.status == "PASS":
            print(f"{head} {result.seconds:.1f} s", flush=True)
            if args.verbose and result.detail.strip():
                print("    " + result.detail.rstrip().replace("\n", "\n    "), flush=True)
        else:
            tail = "\n".join(result.detail.rstrip().splitlines()[-40:])
            print(f"{head} {result.seconds:.1f} s\n    " + tail.replace("\n", "\n    "))
    broken = [line for path in files for line in links(path)]
    for line in broken:
        print(f"broken link: {line}")
    print(
        f"snippets: {counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped "
        f"in {time.monotonic() - started:.0f} s; {len(files)} files, {len(broken)} broken links"
    )
    return 1 if counts["FAIL"] or broken else 0


if __name__ == "__main__":
    sys.exit(main())
