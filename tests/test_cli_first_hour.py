"""A user's first hour with the command line (issue 23): the `zmqdp` console script,
`python -m zmqdp` beside a `zmqdp/` folder, the mock's first line, one-line errors for
a port in use, and the demo's error table and log lines.

Subprocess tests wait on the child's output or exit, never on a sleep; every async test
runs under conftest.py's `trio.fail_after`.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import importlib.util
import io
import logging
import socket
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import trio

from zmqdp import EngineDead, GroupClosed
from zmqdp.__main__ import main
from zmqdp.demo import Result, error_groups, normalized_error

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqdp", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
        check=False,
    )


# -- the console script and the program name ------------------------------------------------


def test_python_m_zmqdp_help_names_itself_python_m_zmqdp() -> None:
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m zmqdp ")
    assert all(cmd in result.stdout for cmd in ("demo", "mock", "keys", "serve"))


def test_the_console_script_in_pyproject_resolves_to_the_cli() -> None:
    """`[project.scripts] zmqdp` names a callable that is the command line (checked
    without installing: the entry point is imported as pip's wrapper would)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    target = project["scripts"]["zmqdp"]
    module_name, _, attr = target.partition(":")
    entry = getattr(importlib.import_module(module_name), attr)
    assert callable(entry) and entry is main


@pytest.fixture
def argv0(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(sys, "argv", ["/somewhere/bin/zmqdp"])  # as the console script
    yield


@pytest.mark.usefixtures("argv0")
def test_the_console_script_names_itself_zmqdp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["mock", "--help"])
    assert info.value.code == 0
    assert capsys.readouterr().out.startswith("usage: zmqdp mock ")


def test_python_m_zmqdp_works_beside_a_zmqdp_folder(tmp_path: Path) -> None:
    """A `zmqdp/` folder in the current directory (no `__init__.py`: the socket
    directory `ipc:///tmp/zmqdp/g` makes, run from /tmp) is a namespace package that,
    with an editable install, hides the real one; `python -m zmqdp` loads the real one.
    (A regular install or the console script never sees the folder: they pass too.)"""
    try:
        importlib.metadata.distribution("zmqdp")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover
        pytest.skip("zmqdp is not installed: from another directory it is not importable")
    (tmp_path / "zmqdp").mkdir()
    result = _run("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: python -m zmqdp ")
    version = _run("--version", cwd=tmp_path)
    assert version.stdout.startswith("zmqdp "), version.stderr


# -- the mock ---------------------------------------------------------------------------------


async def test_the_mock_says_at_once_what_it_is_and_that_it_waits(tmp_path: Path) -> None:
    """No client ever binds the URL: the first line still comes, naming the URL, the
    ranks and what to connect with; and a signal still stops the mock."""
    url = f"ipc://{tmp_path}/g"
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", "2"]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        out = b""
        with trio.fail_after(15):
            while b"\n" not in out:
                data = await proc.stdout.receive_some()
                assert data, out
                out += data
        line = out.split(b"\n", 1)[0].decode()
        assert line.startswith("zmqdp mock: "), line
        assert url in line and "rank(s) 0, 1" in line and "group of 2" in line
        assert "waiting for a client" in line and f"EngineGroup.connect({url!r}, 2)" in line
        proc.terminate()  # still waiting for a client: SIGTERM (or Ctrl-C) stops it at once
        with trio.fail_after(10):
            assert await proc.wait() == 0
    finally:
        with trio.CancelScope(shield=True):
            proc.terminate()
            await proc.wait()


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--fault", "1:bogus"], "unknown fault 'bogus'"),
        (["--ranks", "0,x"], "invalid literal"),
        (["--ranks", "5"], "from 0 to 1"),
        (["--ranks", "0", "--lockstep"], "lockstep ranks step together"),
    ],
)
def test_the_mock_refuses_bad_options_in_one_line(args: list[str], says: str) -> None:
    result = _run("mock", "--url", "ipc:///nonexistent/g", "--engines", "2", *args)
    assert result.returncode == 2
    assert result.stderr.startswith("zmqdp mock: error: ") and says in result.stderr
    assert result.stderr.count("\n") == 1, result.stderr


# -- serve: a port in use -------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.timeout_s(60)
@pytest.mark.parametrize(
    "server",
    [
        pytest.param(
            s,
            marks=pytest.mark.skipif(
                importlib.util.find_spec(s) is None, reason=f"{s}: the gateway extra"
            ),
        )
        for s in ("hypercorn", "uvicorn")
    ],
)
async def test_serve_on_a_port_in_use_is_one_line_before_the_group(
    busy_port: int, server: str
) -> None:
    cmd = [sys.executable, "-m", "zmqdp", "serve", "--mock", "--port", str(busy_port)]
    cmd += ["--server", server, "--log-level", "INFO"]
    result = await trio.run_process(cmd, capture_stdout=True, capture_stderr=True, check=False)
    err = result.stderr.decode()
    assert result.returncode == 1, err
    assert err.count("\n") == 1, err  # one line: nothing logged, the group never started
    assert err.startswith(f"zmqdp serve: cannot listen on 127.0.0.1:{busy_port}: ")
    assert "in use" in err and "--port 0" in err
    assert result.stdout == b""


@pytest.mark.parametrize("server", ["hypercorn", "uvicorn"])
def test_a_port_taken_after_the_check_is_one_line_too(
    busy_port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], server: str
) -> None:
    """The port is taken between the check and the server's own bind (which comes after
    the group connected): hypercorn's nested exception groups, and uvicorn's log of the
    bare OSError, become the same line."""
    serve = pytest.importorskip("zmqdp.gateway.serve")
    monkeypatch.setattr(serve, "listen_problem", lambda host, port: None)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    options = ["--mock", "--port", str(busy_port), "--step-time", "0.01", "--ready-timeout"]
    args = parser.parse_args([*options, "20", "--server", server])
    args.log_level = "ERROR"
    assert serve.run(args) == 1
    err = capsys.readouterr().err
    assert f"zmqdp serve: cannot listen on 127.0.0.1:{busy_port}: the port is in use" in err
    assert "ExceptionGroup" not in err and "Traceback" not in err
    assert "Errno" not in err, err  # uvicorn's own line is held back


def test_serve_http_httptools_needs_uvicorn_and_httptools(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--http httptools` is refused, one line and exit status 2, before anything starts:
    with hypercorn (whose parser is h11), and where httptools is not installed."""
    serve = pytest.importorskip("zmqdp.gateway.serve")
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--mock", "--http", "httptools", "--server", "hypercorn"])
    assert serve.run(args) == 2
    assert capsys.readouterr().err == (
        "zmqdp serve: --http httptools is uvicorn's parser (hypercorn's is h11): drop "
        "--server hypercorn (uvicorn is the default)\n"
    )
    real = importlib.util.find_spec
    missing = lambda name, *a: None if name == "httptools" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing)
    args = parser.parse_args(["--mock", "--http", "httptools"])  # uvicorn, the default
    assert serve.run(args) == 2
    assert "pip install 'zmqdp[gateway]'" in capsys.readouterr().err


def test_bind_errors_are_found_in_nested_groups_and_nothing_else() -> None:
    serve = pytest.importorskip("zmqdp.gateway.serve")
    in_use = OSError(errno.EADDRINUSE, "Address already in use")
    nested = ExceptionGroup("outer", [ExceptionGroup("inner", [in_use])])
    assert serve._bind_error(nested) is in_use
    assert serve._bind_error(in_use) is in_use
    assert serve._bind_error(ExceptionGroup("g", [in_use, ValueError("other")])) is None
    assert serve._bind_error(OSError(errno.ENOENT, "No such file")) is None
    assert serve._bind_error(ValueError("x")) is None


def test_listen_problem_says_what_to_do(busy_port: int) -> None:
    serve = pytest.importorskip("zmqdp.gateway.serve")
    assert serve.listen_problem("127.0.0.1", 0) is None  # any free port
    problem = serve.listen_problem("127.0.0.1", busy_port)
    assert problem is not None and "in use" in problem and "--port 0" in problem
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    assert serve.listen_problem("127.0.0.1", port) is None


# -- the demo's error table ---------------------------------------------------------------


def _dead(rid: str, rank: int = 1) -> EngineDead:
    return EngineDead(rank, "announced dead: 'injected fault: dead_after'", request_id=rid)


def test_errors_group_by_cause_with_the_request_id_normalized() -> None:
    results = [Result(f"req-{i}", error=_dead(f"req-{i}")) for i in range(5)]
    results += [Result("req-9", error=GroupClosed("the group is closed"))]
    results += [Result("ok")]
    groups = error_groups(results)
    assert [(g.count, g.example) for g in groups] == [(5, "req-0"), (1, "req-9")]
    assert groups[0].error.startswith("EngineDead: ") and "<id>" in groups[0].error
    assert "req-" not in groups[0].error
    assert groups[1].error == "GroupClosed: the group is closed"


def test_a_different_rank_is_a_different_cause() -> None:
    results = [Result("a", error=_dead("a", 0)), Result("b", error=_dead("b", 1))]
    assert [g.count for g in error_groups(results)] == [1, 1]


def test_normalized_error_replaces_the_quoted_id_only() -> None:
    err = GroupClosed("request 'a' failed: a rank is gone; 'ab' lives")
    assert normalized_error(err, "a") == (
        "GroupClosed: request <id> failed: a rank is gone; 'ab' lives"
    )


# -- the demo's log lines -------------------------------------------------------------------


def test_the_demo_labels_zmqdp_log_lines_and_notes_the_planned_fault() -> None:
    rich_console = pytest.importorskip("rich.console")
    from zmqdp.demo import ConsoleLog, fault_note

    buffer = io.StringIO()
    handler = ConsoleLog(rich_console.Console(file=buffer, width=200))
    log = logging.getLogger("zmqdp")
    log.addHandler(handler)
    try:
        log.warning("rank %d: its connection closed", 1)
        log.info("not shown: below WARNING")
    finally:
        log.removeHandler(handler)
    assert buffer.getvalue() == "zmqdp: WARNING: rank 1: its connection closed\n"
    assert handler.count == 1
    args = SimpleNamespace(fault="rejoin", fault_rank=1)
    note = fault_note(args, handler.count)  # type: ignore[arg-type]
    assert note is not None and "injected fault (--fault rejoin on rank 1)" in note
    assert "restarted engine" in note
    assert fault_note(SimpleNamespace(fault=None, fault_rank=1), 3) is None  # type: ignore[arg-type]
    assert fault_note(args, 0) is None  # type: ignore[arg-type]
