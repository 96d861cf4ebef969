"""`zmqdp serve --routing`: the values `ConnectOptions.routing` accepts, reaching the group."""

from __future__ import annotations

import argparse
from typing import get_args, get_type_hints

import pytest

from zmqdp.values import ConnectOptions

serve = pytest.importorskip("zmqdp.gateway.serve")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    return parser.parse_args(["--mock", "--step-time", "0.002", *argv])


def test_the_choices_are_what_connect_options_accepts() -> None:
    assert set(serve.ROUTING) == set(get_args(get_type_hints(ConnectOptions)["routing"]))
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    text = parser.format_help()
    assert "--routing {speed,least-loaded,prefix}" in text and "fair share" in text
    assert "--no-kv-events" in text


def test_an_unknown_routing_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--routing", "round-robin")
    assert "invalid choice: 'round-robin'" in capsys.readouterr().err


def test_no_kv_events_is_refused_where_no_engine_publishes_them() -> None:
    with pytest.raises(SystemExit, match="--no-kv-events is for --routing prefix"):
        serve.app_from_args(parse("--routing", "prefix", "--no-kv-events"))
    with pytest.raises(SystemExit, match="--no-kv-events is for --routing prefix"):
        serve.app_from_args(parse("--no-kv-events"))


@pytest.mark.parametrize(
    ("argv", "speed"),
    [((), True), (("--routing", "least-loaded"), False), (("--routing", "prefix"), False)],
)
async def test_the_routing_reaches_the_group(argv: tuple[str, ...], speed: bool) -> None:
    from tests.test_gateway import serving

    app = serve.app_from_args(parse(*argv))
    async with serving(app) as client:
        response = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert response.status_code == 200, response.text
        group = app.group
        assert group is not None
        assert group._core.routing._speed is speed  # type: ignore[attr-defined]
        assert (group._core.prefix is not None) is ("prefix" in argv)  # type: ignore[attr-defined]
        metrics = (await client.get("/metrics")).text
        assert ("zmqdp_prefix_blocks" in metrics) is ("prefix" in argv)
