#!/usr/bin/env python3
"""Build the API reference from the docstrings (pdoc), and fail on a public name
without one.

    .venv/bin/python tools/apidoc.py [--check] [--out DIR]

(`.ci/run` runs it.) The reference documents every module of the `zmqdp` package whose
dotted name has no part starting with an underscore, except `EXCLUDED` (the command
line, implementation modules whose public names their package re-exports, deprecated
aliases). In each, the
public names are what pdoc shows: a module's `__all__` (or, without one, its names
without a leading underscore), and a class's own members without a leading underscore.

The check (`undocumented`) walks pdoc's own model of those modules, so that what it
checks is exactly what the reference shows, and requires a docstring of:

- every module, class, function and method;
- every module-level constant that a module exports (`zmqdp.NATIVE`);
- every field of the records in `FIELDS` (the options and values users read field by
  field; the other classes describe their fields in their own docstrings).

An inherited docstring counts (a method that implements a documented protocol method
says what it does there), as it does for pdoc and `help()`. A name re-exported under
several modules is reported once, under the first. Exit status 1 and one line per
undocumented name, naming where it is defined; else the HTML goes to `--out` (default
`build/api/`, not tracked) unless `--check`. About 5 s.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import itertools
import pkgutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "zmqdp"
EXCLUDED = frozenset(
    {
        # the command line and the demo's runner: `zmqdp --help` documents them
        "zmqdp.__main__",
        "zmqdp.demo",
        # implementation modules: what users need of them, their package re-exports
        # (zmqdp.EngineGroup, zmqdp.gateway.GroupLike, zmqdp.vllm.SamplingParams...)
        "zmqdp.client",
        "zmqdp.stream",
        "zmqdp.gateway.backends",
        "zmqdp.gateway.completions",
        "zmqdp.gateway.http",
        "zmqdp.gateway.openai",
        "zmqdp.vllm.codec",
        "zmqdp.vllm.group",
        "zmqdp.vllm.handshake",
        "zmqdp.vllm.sockets",
        "zmqdp.vllm.wire",
        # deprecated aliases of the frontend modules (their names resolve lazily)
        "zmqdp.gateway.dialect",
        "zmqdp.gateway.vllm_dialect",
    }
)
"""Modules without a leading underscore that the reference leaves out, and why."""
FIELDS = frozenset(
    {
        "zmqdp.values.ConnectOptions",
        "zmqdp.values.GroupStatistics",
        "zmqdp.values.RankStatistics",
        "zmqdp.values.GroupHealth",
        "zmqdp.values.EngineInfo",
        "zmqdp.values.Request",
        "zmqdp.RankState",
        "zmqdp.Outcome",
        "zmqdp._core.metrics.HistogramSnapshot",
        "zmqdp._core.messages.Load",
        "zmqdp._core.messages.Output",
    }
)
"""Records (by defining module and name) every field of which needs a docstring."""


def modules() -> list[str]:
    """The modules the reference documents, in pdoc's order (a package before its
    submodules)."""
    sys.path.insert(0, str(ROOT))
    package = __import__(PACKAGE)
    found = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, PACKAGE + "."):
        name = info.name
        if name in EXCLUDED or any(part.startswith("_") for part in name.split(".")):
            continue
        found.append(name)
    return found


def _origin(doc: object) -> str:
    """Where a pdoc member is defined, as module.qualname."""
    module, qualname = doc.taken_from  # type: ignore[attr-defined]
    return f"{module}.{qualname}"


def _defining_docstring(module: str, name: str) -> str:
    """The docstring of constant `name` re-exported by `module`, from the module that
    defines it (pdoc reads a constant's docstring from the source of the module it
    documents, so `zmqdp.vllm.WIRE_VERSIONS` would show none). pdoc caches its modules,
    so setting it on the member makes the HTML show it too."""
    import pdoc.doc

    value = getattr(sys.modules[module], name)
    package = module.split(".")[0]
    for other, mod in sorted(sys.modules.items()):
        if other == module or not other.startswith(package + ".") or mod is None:
            continue
        if vars(mod).get(name, None) is value:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                docstring = pdoc.doc.Module.from_name(other)._var_docstrings.get(name, "")
            if docstring.strip():
                return docstring
    return ""


def _source_docstrings(cls: type) -> dict[str, str]:
    """The attribute docstrings of `cls` read from the module that defines it. pdoc
    looks for a class's source in `cls.__module__`, which `zmqdp` rewrites for the
    classes it reports as its own (`zmqdp.RankState`, `zmqdp.Outcome`), so it finds none
    of their members' docstrings."""
    package = cls.__module__.split(".")[0]
    for mod in list(sys.modules.values()):
        name = getattr(mod, "__name__", "")
        if name.split(".")[0] == package and vars(mod).get(cls.__name__) is cls:
            try:
                tree = ast.parse(inspect.getsource(mod))
            except (OSError, TypeError):
                continue
            for node in tree.body:
                if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
                    return _attribute_docstrings(node)
    return {}


def _attribute_docstrings(node: ast.ClassDef) -> dict[str, str]:
    """`name = ...` or `name: T` followed by a string: {name: string}."""
    found: dict[str, str] = {}
    for before, after in itertools.pairwise(node.body):
        if not (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)):
            continue
        if not isinstance(after.value.value, str):
            continue
        if isinstance(before, ast.AnnAssign) and isinstance(before.target, ast.Name):
            found[before.target.id] = inspect.cleandoc(after.value.value)
        elif isinstance(before, ast.Assign) and isinstance(before.targets[0], ast.Name):
            found[before.targets[0].id] = inspect.cleandoc(after.value.value)
    return found


def undocumented(names: Sequence[str]) -> Iterator[str]:
    """One line per public name of `names`' modules that has no docstring."""
    import pdoc.doc

    seen: set[str] = set()

    def report(doc: pdoc.doc.Doc, kind: str) -> Iterator[str]:
        origin = _origin(doc)
        if origin in seen:
            return
        seen.add(origin)
        if not doc.docstring.strip():
            where = "" if origin == doc.fullname else f" (defined as {origin})"
            yield f"{doc.fullname}: {kind} without a docstring{where}"

    def walk_class(cls: pdoc.doc.Class) -> Iterator[str]:
        fields = _origin(cls) in FIELDS
        for member in cls.own_members:
            if member.name.startswith("_"):
                continue
            if isinstance(member, pdoc.doc.Variable) and not member.docstring.strip():
                member.docstring = _source_docstrings(cls.obj).get(member.name, "")
            if isinstance(member, pdoc.doc.Function):
                yield from report(member, "method")
            elif isinstance(member, pdoc.doc.Class):
                yield from report(member, "class")
                yield from walk_class(member)
            elif isinstance(member, pdoc.doc.Variable) and fields:
                yield from report(member, "field")

    for name in names:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            module = pdoc.doc.Module.from_name(name)
        if not module.docstring.strip():
            yield f"{name}: module without a docstring"
        exported = getattr(module.obj, "__all__", None)
        for member in module.members.values():
            if member.name.startswith("_"):
                continue
            if isinstance(member, pdoc.doc.Class):
                yield from report(member, "class")
                yield from walk_class(member)
            elif isinstance(member, pdoc.doc.Function):
                yield from report(member, "function")
            elif (
                isinstance(member, pdoc.doc.Variable)
                and exported is not None
                and member.name in exported
                and not inspect.ismodule(member.default_value)
            ):
                if not member.docstring.strip():
                    member.docstring = _defining_docstring(name, member.name)
                yield from report(member, "constant")


def build(names: Sequence[str], out: Path) -> None:
    """The HTML reference of `names` in `out`."""
    import pdoc
    import pdoc.render

    pdoc.render.configure(
        docformat="markdown",
        footer_text=f"{PACKAGE} API reference",
        search=True,
        show_source=True,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        pdoc.pdoc(*names, output_directory=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--check", action="store_true", help="check docstrings, write no HTML")
    parser.add_argument("--out", type=Path, default=ROOT / "build" / "api")
    args = parser.parse_args(argv)
    try:
        import pdoc  # noqa: F401
    except ModuleNotFoundError:  # e.g. a venv of the gateway extra only
        print(
            "apidoc: pdoc is not installed: it is in the dev extra "
            "(pip install -e '.[dev]'; python3 dev.py check sets up a .venv with it)",
            file=sys.stderr,
        )
        return 2
    names = modules()
    missing = list(undocumented(names))
    for line in missing:
        print(line)
    if missing:
        print(f"apidoc: {len(missing)} public names without a docstring", file=sys.stderr)
        return 1
    if not args.check:
        build(names, args.out)
        print(f"apidoc: {len(names)} modules documented in {args.out}")
    else:
        print(f"apidoc: {len(names)} modules, every public name documented")
    return 0


if __name__ == "__main__":
    sys.exit(main())
