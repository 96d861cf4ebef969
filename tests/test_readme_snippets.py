"""tools/readme_snippets.py, the snippet runner and link checker of the README and the
docs (CI runs it): its extractor, its markers, its command splitting, its check of
undefined names, its link and anchor check, and the real documents' blocks and links.
One test runs two tiny python blocks (a subprocess each, no engines)."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _load() -> Any:
    spec = importlib.util.spec_from_file_location(
        "readme_snippets", ROOT / "tools" / "readme_snippets.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("readme_snippets", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


rs = _load()

SAMPLE = """\
# title

```sh
echo one   # a comment
```

<!-- snippet: skip (needs a GPU) -->
```python
import torch
```

<!-- snippet: mock=4 asyncio timeout=5 tmp=/etc/zmqdp/g1 fragment -->

````python
print("```")
````

- a list item:

  ~~~bash
  echo two \\
      three
  ~~~

```text
not run
```
"""


def test_blocks_their_lines_languages_and_markers() -> None:
    blocks = rs.extract(SAMPLE)
    assert [(b.line, b.lang) for b in blocks] == [
        (3, "sh"),
        (8, "python"),
        (14, "python"),
        (20, "bash"),
        (25, "text"),
    ]
    sh, skipped, marked, indented, _ = blocks
    assert sh.code == "echo one   # a comment\n" and sh.options == rs.Options()
    assert skipped.options.skip == "needs a GPU"
    assert marked.code == 'print("```")\n'  # a longer fence holds a shorter one
    assert marked.options == rs.Options(
        mock=4, asyncio=True, tmp=("/etc/zmqdp/g1",), timeout=5.0, fragment=True
    )
    assert not skipped.options.fragment  # a block runs as written unless marked
    assert indented.code == "echo two \\\n    three\n"  # the item's indent is removed
    assert [b.runnable for b in blocks] == [True, True, True, True, False]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- snippet: skip -->\n```sh\nx\n```\n", "needs a reason"),
        ("<!-- snippet: mock=two -->\n```sh\nx\n```\n", "bad value"),
        ("<!-- snippet: fast -->\n```sh\nx\n```\n", "unknown snippet option"),
        ("<!-- snippet: mock=2 -->\nsome prose\n```sh\nx\n```\n", "precedes no code block"),
        ("```sh\nx\n```\n<!-- snippet: mock=2 -->\n", "precedes no code block"),
    ],
)
def test_a_malformed_or_dangling_marker_is_an_error(text: str, message: str) -> None:
    with pytest.raises(rs.MarkerError, match=message):
        rs.extract(text)


def test_shell_commands_join_continuations_and_drop_comments() -> None:
    code = "# setup\n\necho a\nrun --x 1 \\\n    --y 2   # why\necho b\n"
    assert list(rs.commands(code, 10)) == [
        (12, "echo a"),
        (13, "run --x 1 \\\n    --y 2   # why"),
        (15, "echo b"),
    ]


def test_substitution_of_the_mock_url_and_temporary_paths(tmp_path: Path) -> None:
    options = rs.Options(mock=2, tmp=("/etc/zmqdp/g1",))
    code = 'connect("ipc:///tmp/zmqdp-g1/g"); keys("/etc/zmqdp/g1")'
    assert rs.substitute(code, options, "ipc:///tmp/x/g1", tmp_path) == (
        f'connect("ipc:///tmp/x/g1"); keys("{tmp_path}/g1")'
    )


def test_undefined_names_finds_what_a_block_uses_unimported() -> None:
    code = (
        "from zmqdp import EngineGroup\n"
        "import zmqdp.vllm\n"
        "body = {}\n"
        "async with EngineGroup.connect(url, 2) as group:\n"
        "    async with connect_engine(url) as eng:\n"
        "        try:\n"
        "            print(zmqdp.vllm, body, [x for x in range(2)], group, eng)\n"
        "        except Overloaded as exc:\n"
        "            print(exc)\n"
    )
    assert sorted(rs.undefined_names(code)) == ["Overloaded", "connect_engine", "url"]


def test_a_block_runs_without_the_prelude_unless_marked_fragment(tmp_path: Path) -> None:
    """A PASS means the block works as written: `body` is not made up for it."""
    readme = tmp_path / "README.md"
    readme.write_text(
        "```python\nprint(body)\n```\n\n"
        "<!-- snippet: fragment -->\n```python\nprint(body, EngineGroup)\n```\n"
    )
    plain, fragment = rs.extract(readme.read_text())
    failed = rs.run_block(plain, readme)
    assert failed.status == "FAIL" and "NameError: name 'body'" in failed.detail
    assert rs.run_block(fragment, readme).status == "PASS"


def test_the_readme_starts_with_its_two_commands() -> None:
    """The README opens with its two set-up commands, and no other block is one."""
    blocks = rs.extract((ROOT / "README.md").read_text())
    first = [line.partition("#")[0].strip() for line in blocks[0].code.splitlines()]
    assert first == ["python3 dev.py demo", "python3 dev.py check"]
    assert rs.is_setup(blocks[0]) and blocks[0].options == rs.Options()  # no marker first
    assert not any(rs.is_setup(b) for b in blocks[1:])
    head = (ROOT / "README.md").read_text().splitlines()
    assert [line for line in head[: blocks[0].line] if line.strip()] == ["# zmqdp", "```sh"]


@pytest.mark.parametrize("path", rs.documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_each_document_parses_and_its_python_blocks_compile(path: Path) -> None:
    """What CI runs, for README.md and every guide: every marker well formed, every
    python block valid Python (an async block compiles with top-level await) that names
    nothing it does not define or import (skipped blocks too: a reader copies them),
    and every block that connects to the docs' URL gets a mock group."""
    name = path.relative_to(ROOT).as_posix()
    for block in rs.extract(path.read_text()):
        if block.lang in rs.PYTHON:
            compile(block.code, f"{name}:{block.line}", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if not block.options.fragment:
                missing = rs.undefined_names(block.code)
                assert not missing, f"{name}:{block.line} uses {missing} undefined"
        connects = rs.MOCK_URL in block.code and ".connect(" in block.code
        if block.options.skip is None and connects:
            assert block.options.mock, f"{name}:{block.line} connects with no mock group"


def test_the_documents_are_the_readme_and_every_markdown_file_under_docs() -> None:
    found = [p.relative_to(ROOT).as_posix() for p in rs.documents()]
    assert found[0] == "README.md"
    assert {"docs/protocol.md", "docs/index.md", "docs/guides/client.md"} <= set(found)


def test_no_relative_link_of_the_readme_or_the_docs_is_broken() -> None:
    broken = [line for path in rs.documents() for line in rs.links(path)]
    assert broken == []


def test_broken_links_and_anchors_are_named_and_code_and_comments_skipped(
    tmp_path: Path,
) -> None:
    (tmp_path / "guides").mkdir()
    (tmp_path / "other.md").write_text(
        "# Other\n\n## The core (`zmqdp/_core/`)\n\n## Twice\n## Twice\n"
    )
    page = tmp_path / "guides" / "page.md"
    page.write_text(
        "# Page\n"
        "[ok](../other.md) [ok](../other.md#the-core-zmqdp_core) [ok](../other.md#twice-1)\n"
        "[ok](#page) ![ok](../other.md) [ok](https://example.com/x.md) [ok](mailto:a@b)\n"
        "[gone](missing.md) and [bad anchor](../other.md#nowhere) and [here](#nope)\n"
        "`[in code](missing.md)`\n"
        "<!-- [in a comment](missing.md) -->\n"
        "```md\n[in a block](missing.md)\n```\n"
        "![gone too](img/x.png)\n"
    )
    found = rs.links(page)
    assert [line.partition(": ")[2] for line in found] == [
        "missing.md: no such file",
        "../other.md#nowhere: no heading #nowhere there",
        "#nope: no heading #nope there",
        "img/x.png: no such file",
    ]
    assert [line.split(":")[1] for line in found] == ["4", "4", "4", "10"]


def test_slugs_follow_github() -> None:
    assert rs.slug("The core (`zmqdp/_core/`)") == "the-core-zmqdp_core"
    assert rs.slug("Open files: a full descriptor table") == "open-files-a-full-descriptor-table"
    assert rs.slug("vLLM's own DP client (P7)") == "vllms-own-dp-client-p7"
    assert rs.slug("2.1 Messages") == "21-messages"
