"""tools/apidoc.py, the API reference's build: its docstring check names every public
name without a docstring (and only those), passes on zmqdp as it is, and fails on zmqdp
with one docstring removed. Needs pdoc (the `dev` extra)."""

from __future__ import annotations

import ast
import importlib.util
import itertools
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("pdoc", reason="tools/apidoc.py needs pdoc: the dev extra")

ROOT = Path(__file__).resolve().parent.parent


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("apidoc", ROOT / "tools" / "apidoc.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("apidoc", module)
    spec.loader.exec_module(module)
    return module


apidoc = _load()

SAMPLE = {
    "__init__.py": '''
        """A package."""
        from ._impl import DOCUMENTED, Record, bare, documented

        __all__ = ["DOCUMENTED", "UNDOCUMENTED", "Record", "bare", "documented"]
        UNDOCUMENTED = 2
        ''',
    "_impl.py": '''
        """Private: its names are checked where they are exported."""
        DOCUMENTED = 1
        """A constant with a docstring where it is defined."""


        def documented() -> None:
            """Says what it does."""


        def bare() -> None:
            pass


        class Record:
            """A record."""

            field: int = 0

            def method(self) -> None:
                pass

            def _private(self) -> None:
                pass
        ''',
    "nodoc.py": """
        def helper() -> None:
            pass
        """,
}


def test_every_kind_of_undocumented_public_name_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "apidoc_sample"
    package.mkdir()
    for name, source in SAMPLE.items():
        (package / name).write_text(textwrap.dedent(source))
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = list(apidoc.undocumented(["apidoc_sample", "apidoc_sample.nodoc"]))
    assert sorted(line.split(":")[0] for line in lines) == [
        "apidoc_sample.Record.method",
        "apidoc_sample.UNDOCUMENTED",
        "apidoc_sample.bare",
        "apidoc_sample.nodoc",
        "apidoc_sample.nodoc.helper",
    ]
    assert "apidoc_sample.bare: function without a docstring (defined as " in "\n".join(lines)


def test_fields_are_checked_only_for_the_listed_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    package = tmp_path / "apidoc_fields"
    package.mkdir()
    (package / "__init__.py").write_text(
        '"""Fields."""\n\n\nclass Listed:\n    """Listed."""\n\n    a: int = 0\n'
        '    b: int = 0\n    """Documented."""\n\n\n'
        'class Other:\n    """Not listed."""\n\n    a: int = 0\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(apidoc, "FIELDS", frozenset({"apidoc_fields.Listed"}))
    assert list(apidoc.undocumented(["apidoc_fields"])) == [
        "apidoc_fields.Listed.a: field without a docstring"
    ]


def _strip_docstring(path: Path, owner: str | None, name: str) -> None:
    """Delete from `path` the docstring of function `name` (of class `owner`), or of
    its field `name`, in the source: what a contributor who forgets one leaves."""
    source = path.read_text()
    tree = ast.parse(source)
    body = tree.body
    if owner is not None:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    doc: ast.stmt | None = None
    for before, after in itertools.pairwise(body):
        if isinstance(before, ast.AnnAssign) and getattr(before.target, "id", None) == name:
            doc = after
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == name:
            doc = node.body[0]
    assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant), name
    assert doc.end_lineno is not None
    lines = source.splitlines(keepends=True)
    indent = lines[doc.lineno - 1][: doc.col_offset]
    lines[doc.lineno - 1 : doc.end_lineno] = [f"{indent}...\n"]
    path.write_text("".join(lines))


def _check(root: Path) -> subprocess.CompletedProcess[str]:
    """`tools/apidoc.py --check` on the clone at `root`, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, str(root / "tools" / "apidoc.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
    )


def test_zmqdp_has_no_undocumented_public_name_and_one_removed_fails(tmp_path: Path) -> None:
    """What CI runs; then the same on a copy of zmqdp with three docstrings removed
    from the source (a function, a method, a field of `ConnectOptions`): each is named,
    and the exit status is 1."""
    clean = _check(ROOT)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "every public name documented" in clean.stdout
    shutil.copytree(
        ROOT / "zmqdp", tmp_path / "zmqdp", ignore=shutil.ignore_patterns("__pycache__")
    )
    (tmp_path / "tools").mkdir()
    shutil.copy(ROOT / "tools" / "apidoc.py", tmp_path / "tools")
    _strip_docstring(tmp_path / "zmqdp" / "keys.py", None, "load_client_keys")
    _strip_docstring(tmp_path / "zmqdp" / "_core" / "metrics.py", "HistogramSnapshot", "quantile")
    _strip_docstring(tmp_path / "zmqdp" / "values.py", "ConnectOptions", "stall_timeout")
    broken = _check(tmp_path)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert broken.stdout.splitlines() == [
        "zmqdp.ConnectOptions.stall_timeout: field without a docstring"
        " (defined as zmqdp.values.ConnectOptions.stall_timeout)",
        "zmqdp.HistogramSnapshot.quantile: method without a docstring"
        " (defined as zmqdp._core.metrics.HistogramSnapshot.quantile)",
        "zmqdp.keys.load_client_keys: function without a docstring",
    ]
    assert "3 public names without a docstring" in broken.stderr


def test_without_pdoc_it_says_which_extra_has_it(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A venv of the quick start's extras has no pdoc: one line, not a traceback."""
    monkeypatch.setitem(sys.modules, "pdoc", None)  # `import pdoc` now fails
    assert apidoc.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert "pdoc is not installed" in err and "'.[dev]'" in err
