"""The command line (`zmqdp/__main__.py`): `zmqdp serve ...` without the gateway extra,
`zmqdp mock` against a client that rejects it, and the mock's banner for tcp and CURVE.
(The console script, `python -m zmqdp`, the mock's first line and a port in use are in
tests/test_cli_first_hour.py.)

Subprocess tests wait on the child's output or exit, never on a sleep; every async test
runs under conftest.py's `trio.fail_after`, and the I/O ones under their own too.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from zmqdp import EngineGroup
from zmqdp.__main__ import main, mock_banner

INSTALL = "pip install -e '.[gateway]'"

# -- serve without the gateway extra ---------------------------------------------------


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


# -- a mock the client rejects ----------------------------------------------------------


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


# -- the banner's call binds the URL as given --------------------------------------------


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


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--stream-interval", "0", "must be 1 or more, not 0"),
        ("--max-buffered", "-1", "must be 0 or more, not -1"),
    ],
)
def test_serve_refuses_an_out_of_range_count_at_the_command_line(
    option: str, value: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Refused by argparse (exit status 2, the option named), before anything starts: it
    used to fail at the lifespan's start-up with a ValueError, after "Running on"."""
    with pytest.raises(SystemExit) as exit:
        main(["serve", "--mock", option, value])
    assert exit.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {option}: {says}" in err
