"""The review of issue 23's change ("a user's first hour"): `zmqdp serve ...` without the
gateway extra, a mock the client rejects, the mock's banner for tcp and CURVE, the
demo's log lines, and `submit` of something that is not a `Request`.

Subprocess tests wait on the child's output or exit, never on a sleep; every async test
runs under conftest.py's `trio.fail_after`, and the I/O ones under their own too.
"""

from __future__ import annotations

import io
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio

from zmqdp import EngineGroup, InvalidRank, InvalidRequest, SubmitRefused
from zmqdp.__main__ import main, mock_banner
from zmqdp.mock import MockConfig, MockRejected, RankFaults, run_mock_group

INSTALL = "pip install -e '.[gateway]'"

# -- 1. serve without the gateway extra ---------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["serve"],
        ["serve", "--mock"],
        ["serve", "--help"],
        ["serve", "-h"],
        ["serve", "--mock", "--port", "8000", "--server", "uvicorn"],
        ["serve", "extra-positional"],
    ],
)
def test_every_serve_says_how_to_install_the_extra_when_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, "zmqdp.gateway.serve", None)  # the import fails
    assert main(args, prog="zmqdp") == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("zmqdp serve: the gateway extra is not installed (")
    assert INSTALL in err and "unrecognized" not in err and len(err.splitlines()) == 1


def test_other_commands_still_refuse_unknown_arguments(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "zmqdp.gateway.serve", None)
    with pytest.raises(SystemExit) as exit:
        main(["mock", "--url", "ipc:///x/g", "--engines", "1", "--bogus"], prog="zmqdp")
    assert exit.value.code == 2
    assert "zmqdp: error: unrecognized arguments: --bogus" in capsys.readouterr().err


def test_serve_mock_without_hypercorn_in_a_real_process() -> None:
    """As in a venv without the extra: its modules cannot be imported at all."""
    code = (
        "import sys\n"
        "for m in ('hypercorn', 'uvicorn', 'prometheus_client'): sys.modules[m] = None\n"
        "from zmqdp.__main__ import main\n"
        "sys.exit(main(sys.argv[1:], prog='zmqdp'))\n"
    )
    for args in (["serve", "--mock"], ["serve", "--help"]):
        result = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2, result
        assert "prometheus_client" in result.stderr and INSTALL in result.stderr
        assert "unrecognized arguments" not in result.stderr


# -- 2. a mock the client rejects ----------------------------------------------------------


async def test_a_mock_of_the_wrong_size_exits_with_one_line(tmp_path: Path) -> None:
    """`zmqdp mock --engines 1` against a client of 2: no "ranks up", no wait forever,
    and the rank said once, with what to do."""
    url = f"ipc://{tmp_path}/b"
    cmd = [sys.executable, "-m", "zmqdp", "mock", "--url", url, "--engines", "1"]
    proc = await trio.lowlevel.open_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = b"", b""
    try:
        assert proc.stdout is not None and proc.stderr is not None
        stdout, stderr = proc.stdout, proc.stderr

        async def read_all() -> None:
            nonlocal out, err

            async def drain(stream: Any, which: str) -> None:
                nonlocal out, err
                while data := await stream.receive_some():
                    if which == "out":
                        out += data
                    else:
                        err += data

            async with trio.open_nursery() as inner:
                inner.start_soon(drain, stdout, "out")
                inner.start_soon(drain, stderr, "err")

        async def client() -> None:  # binds the URL; cancelled once the mock exits
            async with EngineGroup.connect(url, 2, ready_timeout=30):
                pass  # pragma: no cover - no rank comes

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(read_all)
                nursery.start_soon(client)
                assert await proc.wait() == 1
                nursery.cancel_scope.cancel()
            # pipes may still hold the tail: read what is left
            while data := await stderr.receive_some():
                err += data
    finally:
        with trio.CancelScope(shield=True):
            proc.kill()
            await proc.wait()
    text = err.decode()
    lines = text.splitlines()
    assert len(lines) == 1, text
    line = lines[0]
    assert line.startswith("zmqdp mock: error: rank 0: the client rejected it: ")
    assert line.count("rank 0") == 1, line
    assert "HELLO says size 1" in line and "--engines N" in line
    assert "ranks up" not in out.decode() and "up at" not in out.decode()


async def test_run_mock_group_reports_only_the_ranks_that_are_up(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    cfg = MockConfig(engines=2, step_time=0.001, faults={1: RankFaults(bad_hello="size")})
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                async with EngineGroup.connect(url, 2, ready_timeout=30):
                    pass  # pragma: no cover - rank 1 never comes

            nursery.start_soon(client)
            up = await nursery.start(run_mock_group, url, cfg)
            assert up == (0,)
            nursery.cancel_scope.cancel()


async def test_run_mock_group_raises_when_every_rank_is_rejected(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:

            async def client() -> None:
                async with EngineGroup.connect(url, 3, ready_timeout=30):
                    pass  # pragma: no cover - no rank comes

            nursery.start_soon(client)
            with pytest.raises(MockRejected) as rejected:
                await nursery.start(run_mock_group, url, MockConfig(engines=2))
            nursery.cancel_scope.cancel()
    message = str(rejected.value)
    assert message.startswith("rank ") and "(and 1 more rank(s) likewise)" in message
    assert "HELLO says size 2, the client expects 3" in message


# -- 6. the banner's call binds the URL as given --------------------------------------------


def test_the_banner_says_insecure_for_tcp_and_curve_with_keys() -> None:
    ipc = mock_banner("ipc:///tmp/zmqdp-g1/g", 2, None, False)
    assert ipc.endswith("EngineGroup.connect('ipc:///tmp/zmqdp-g1/g', 2)")
    tcp = mock_banner("tcp://127.0.0.1:5555", 2, None, False)
    assert tcp.endswith("EngineGroup.connect('tcp://127.0.0.1:5555', 2, insecure=True)")
    keys = mock_banner("tcp://127.0.0.1:5555", 2, (1,), True, keys="/k/g1")
    assert keys.endswith(
        "EngineGroup.connect('tcp://127.0.0.1:5555', 2, curve=zmqdp.keys.load_client_keys('/k/g1'))"
    )
    assert "rank(s) 1 of a lockstep group of 2" in keys


# -- 3. the demo's log lines ----------------------------------------------------------------


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


# -- 7. submit of something that is not a Request ------------------------------------------


async def test_submit_of_a_dict_is_an_invalid_request(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mock_group, url, MockConfig(engines=1, step_time=0.001))
            async with EngineGroup.connect(url, 1) as group:
                with pytest.raises(InvalidRequest, match="not a dict") as refused:
                    group.submit({"id": "x"})  # type: ignore[arg-type]
                assert isinstance(refused.value, SubmitRefused)
                assert "submit takes a zmqdp.Request" in str(refused.value)
                with pytest.raises(InvalidRank, match="CALL needs an int rank"):
                    await group.call("0", "ping")  # type: ignore[arg-type]
                assert await group.call(0, "ping") == "pong"  # the group serves on
            nursery.cancel_scope.cancel()
