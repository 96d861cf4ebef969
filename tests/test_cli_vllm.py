"""`zmqdp serve` as a drop-in frontend for headless vLLM engines (issue 35 §2): the
flags vLLM users type by habit, the wait for engines with its progress, and errors in
the command line's words, each said once.

Subprocess tests wait on the child's exit, never on a sleep; every async test runs
under conftest.py's `trio.fail_after`.
"""

from __future__ import annotations

import argparse
import logging
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

serve = pytest.importorskip("zmqdp.gateway.serve")

ROOT = Path(__file__).resolve().parent.parent
MODEL = Path(__file__).parent / "data" / "tiny-model"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(list(argv))


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zmqdp", "serve", "--port", "0", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env=env,
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- flags ------------------------------------------------------------------------------


def test_vllms_flag_names_are_taken() -> None:
    for flag in ("--data-parallel-size", "-dp", "--engines"):
        assert parse(flag, "3").engines == 3
    args = parse(
        "--vllm",
        "M",
        "--max-model-len",
        "4K",
        "--tokenizer",
        "T",
        "--chat-template",
        "C",
        "--generation-config",
        "vllm",
        "--served-model-name",
        "a",
        "b",
        "--root-path",
        "/llm",
        "--host",
        "0.0.0.0",
    )
    assert (args.max_model_len, args.tokenizer, args.chat_template) == (4096, "T", "C")
    assert (args.generation_config, args.served_model_name) == ("vllm", ["a", "b"])
    assert (args.root_path, args.host) == ("/llm", "0.0.0.0")


@pytest.mark.parametrize(
    ("text", "value"), [("256", 256), ("1k", 1000), ("1K", 1024), ("25.6k", 25600), ("2M", 2 << 20)]
)
def test_max_model_len_reads_as_vllm_reads_it(text: str, value: int) -> None:
    assert parse("--max-model-len", text).max_model_len == value


@pytest.mark.parametrize("text", ["0", "x", "1.5K", "-3"])
def test_a_bad_max_model_len_is_refused_at_the_command_line(text: str) -> None:
    with pytest.raises(SystemExit):
        parse("--max-model-len", text)


def test_the_defaults_are_vllms_where_safe() -> None:
    args = parse()
    assert args.ready_timeout == 600.0  # vLLM's wait, and the vLLM wire's
    assert args.generation_config == "auto"
    assert args.host == "127.0.0.1"  # vLLM listens everywhere; we do not by default


def test_the_api_key_flag_wins_then_zmqdp_then_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ZMQDP_API_KEY", raising=False)
    monkeypatch.setenv("VLLM_API_KEY", "from-vllm")
    assert serve.api_key(None) == "from-vllm"
    monkeypatch.setenv("ZMQDP_API_KEY", "from-zmqdp")
    assert serve.api_key(None) == "from-zmqdp"
    assert serve.api_key("flag") == "flag"
    monkeypatch.setenv("ZMQDP_API_KEY", " ")
    assert serve.api_key(None) == "from-vllm"
    monkeypatch.delenv("VLLM_API_KEY")
    assert serve.api_key(None) is None


@pytest.mark.parametrize(
    "flags", [["--tokenizer", "T"], ["--max-model-len", "9"], ["--generation-config", "vllm"]]
)
def test_model_flags_without_vllm_say_so(flags: list[str]) -> None:
    with pytest.raises(SystemExit, match=f"{flags[0]} is for vLLM engines"):
        serve.app_from_args(parse("--mock", *flags))


def test_mock_with_vllm_is_refused_not_served_natively() -> None:
    """`serve --vllm zmqdp-mock --mock` ran zmqdp's native mock, --vllm ignored."""
    with pytest.raises(SystemExit, match="--mock runs zmqdp's own mock engines") as caught:
        serve.app_from_args(parse("--mock", "--vllm", str(MODEL)))
    assert "zmqdp mock --wire vllm" in str(caught.value)


def test_moe_without_vllm_says_so() -> None:
    with pytest.raises(SystemExit, match="--moe is for vLLM engines"):
        serve.app_from_args(parse("--mock", "--moe"))


def test_a_flag_error_comes_before_a_busy_port(capsys: pytest.CaptureFixture[str]) -> None:
    """Fixing the port first only to be told next that the flags were wrong: no."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        args = parse("--mock", "--tokenizer", "T", "--port", str(busy.getsockname()[1]))
        with pytest.raises(SystemExit, match="--tokenizer is for vLLM engines"):
            serve.run(args)
    assert "in use" not in capsys.readouterr().err


def test_model_flags_reach_the_frontend(tmp_path: Path) -> None:
    template = tmp_path / "t.jinja"
    template.write_text("<{{ messages[0]['content'] }}>")
    args = parse(
        "--vllm",
        str(MODEL),
        "--url",
        "tcp://127.0.0.1:5999",
        "-dp",
        "2",
        "--insecure",
        "--max-model-len",
        "100",
        "--chat-template",
        str(template),
        "--served-model-name",
        "first",
        "second",
    )
    app = serve.app_from_args(args)
    frontend = app._settings.frontend
    assert frontend.max_prompt_tokens == 100
    assert frontend.chat_prompt(({"role": "user", "content": "hi"},)) == "<hi>"
    assert (app._settings.model, app._settings.served) == ("first", ("first", "second"))


def test_a_missing_vllm_extra_is_one_line_naming_the_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # import tokenizers: ImportError
    args = parse("--vllm", str(MODEL), "--url", "tcp://127.0.0.1:5999", "-dp", "1")
    with pytest.raises(SystemExit) as exit:
        serve.app_from_args(args)
    said = str(exit.value)
    assert "pip install 'zmqdp[vllm]'" in said and "tokenizers" in said


# -- errors in the CLI's words ----------------------------------------------------------


def test_every_library_phrase_translated_still_exists() -> None:
    """`cli_text` replaces the library's words: each must still be in the package, or
    the translation silently stops (a reworded library message)."""
    source = "\n".join(p.read_text() for p in (ROOT / "zmqdp").rglob("*.py"))
    flat = re.sub(r'"\s*\n\s*(f?)"', "", source)  # adjacent string literals joined
    for library, _ in serve._CLI_WORDS:
        assert library in flat, library


def test_no_message_of_the_package_says_chmod_a_shared_directory(tmp_path: Path) -> None:
    from zmqdp._addresses import parse_group_url, prepare_ipc_directory

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # as /tmp is: sticky, everyone's
    with pytest.raises(PermissionError) as error:
        prepare_ipc_directory(parse_group_url(f"ipc://{shared}/g"))
    assert "chmod" not in str(error.value)
    assert f"ipc://{shared}/zmqdp-NAME/group" in str(error.value)


@pytest.mark.parametrize("server", ["uvicorn", "hypercorn"])
def test_a_startup_failure_is_one_line_in_flags_never_followed_by_running_on(
    server: str,
) -> None:
    """Before issue 35: the failure twice ('pass insecure=True'), then hypercorn's
    'Running on http://...'."""
    result = _run(
        "--vllm",
        str(MODEL),
        "--url",
        f"tcp://127.0.0.1:{_free_port()}",
        "-dp",
        "1",
        "--server",
        server,
    )
    assert result.returncode != 0
    err = result.stderr
    assert err.count("can be reached by every local user") == 1, err
    assert "pass --insecure" in err and "insecure=True" not in err
    assert "Running on" not in err and "Application startup failed" not in err
    assert "zmqdp serve: group URL" in err and "ValueError" not in err


def test_a_wildcard_url_names_the_advertise_host_flag() -> None:
    result = _run("--url", f"tcp://0.0.0.0:{_free_port()}", "--engines", "1", "--insecure")
    assert result.returncode != 0
    assert "--advertise-host HOST" in result.stderr and "advertise_host=" not in result.stderr


def test_waiting_prints_progress_and_the_engines_command_then_one_timeout() -> None:
    port = _free_port()
    result = _run(
        "--vllm",
        str(MODEL),
        "--url",
        f"tcp://127.0.0.1:{port}",
        "--data-parallel-size",
        "2",
        "--insecure",
        "--ready-timeout",
        "1.5",
        "--progress-interval",
        "0.5",
        "--log-level",
        "WARNING",
    )
    assert result.returncode != 0
    err = result.stderr
    progress = [line for line in err.splitlines() if "waiting for engines" in line]
    assert progress, err
    assert "0 of 2 ranks up (none); missing: 0, 1" in progress[0]
    assert (
        f"vllm serve {MODEL} --headless --data-parallel-size 2 --data-parallel-size-local 1 "
        f"--data-parallel-start-rank R --data-parallel-address 127.0.0.1 "
        f"--data-parallel-rpc-port {port}"
    ) in progress[0]
    assert err.count("not ready after waiting 1.5 s") == 1, err
    assert "raise --ready-timeout (it was 1.5 s)" in err and "ready_timeout" not in err


def test_progress_names_the_ranks_that_came_up() -> None:
    args = parse("--vllm", "M", "--url", "tcp://10.0.0.1:13345", "-dp", "3")
    app = serve.app_from_args(parse("--mock"))
    watch = serve.StartupWatch(app, args, logging.WARNING)
    record = logging.LogRecord(
        "zmqdp", logging.INFO, __file__, 1, "rank %d: up (%s)", (1, "x"), None
    )
    assert watch.filter(record) is False  # seen, not shown under WARNING
    said = watch.progress()
    assert "1 of 3 ranks up (1); missing: 0, 2" in said
    assert "--data-parallel-address 10.0.0.1 --data-parallel-rpc-port 13345" in said


def test_the_native_wire_progress_says_how_to_start_a_mock() -> None:
    args = parse("--url", "ipc:///run/user/1/zmqdp/g", "--engines", "2", "--keys", "K")
    assert serve.start_command(args) == (
        "python -m zmqdp mock --url ipc:///run/user/1/zmqdp/g --engines 2 --keys K"
    )


def test_the_progress_for_the_shipped_mock_model_also_names_the_fake_engines() -> None:
    """`serve --vllm zmqdp-mock` started first: the newcomer has no vLLM to start."""
    args = parse("--vllm", "zmqdp-mock", "--url", "tcp://127.0.0.1:29553", "-dp", "2", "--moe")
    said = serve.start_command(args)
    assert said.startswith("vllm serve zmqdp-mock --headless --data-parallel-size 2 ")
    assert "zmqdp mock --wire vllm --url tcp://127.0.0.1:29553 --engines 2 --moe)" in said
    other = parse("--vllm", str(MODEL), "--url", "tcp://127.0.0.1:29553", "-dp", "2")
    assert "zmqdp mock" not in serve.start_command(other)


def test_the_banner_shows_where_the_api_key_goes_not_the_key() -> None:
    args = parse("--mock", "--api-key", "s3cret")
    said = serve.banner("http://127.0.0.1:8000", "uvicorn", serve.app_from_args(args))
    assert "curl http://127.0.0.1:8000/v1/completions -H 'Authorization: Bearer KEY' -d" in said
    assert "s3cret" not in said
