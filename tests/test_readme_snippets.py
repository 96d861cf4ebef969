"""tools/readme_snippets.py, the README's snippet runner (CI runs it on the README): its
extractor, its markers, its command splitting and its check of undefined names. One test
runs two tiny python blocks (a subprocess each, no engines)."""

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


def test_the_readme_parses_and_its_python_blocks_compile() -> None:
    """What CI runs: every marker well formed, every python block valid Python (an async
    block compiles with top-level await) that names nothing it does not define or
    import (skipped blocks too: a reader copies them), every block that connects to the
    README's URL gets a mock group, and the README still starts with its two
    commands."""
    blocks = rs.extract((ROOT / "README.md").read_text())
    first = [line.partition("#")[0].strip() for line in blocks[0].code.splitlines()]
    assert first == ["python3 dev.py demo", "python3 dev.py check"]
    assert rs.is_setup(blocks[0]) and blocks[0].options == rs.Options()  # no marker first
    assert not any(rs.is_setup(b) for b in blocks[1:])
    head = (ROOT / "README.md").read_text().splitlines()
    assert [line for line in head[: blocks[0].line] if line.strip()] == ["# zmqdp", "```sh"]
    for block in blocks:
        if block.lang in rs.PYTHON:
            compile(block.code, f"README.md:{block.line}", "exec", ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
            if not block.options.fragment:
                missing = rs.undefined_names(block.code)
                assert not missing, f"README.md:{block.line} uses {missing} undefined"
        connects = rs.MOCK_URL in block.code and ".connect(" in block.code
        if block.options.skip is None and connects:
            assert block.options.mock, f"README.md:{block.line} connects with no mock group"
