"""`zmqdp.mock.mock_command`: the command line of a `MockConfig` (the asyncio gateway
runs its embedded mock group with it). Parsed back by `zmqdp mock`'s own parser, it
must give the same config: a field it drops would run another mock than the one asked
for."""

from __future__ import annotations

import argparse
import sys

import pytest

from zmqdp.__main__ import _mock_parser, mock_config
from zmqdp.mock import MockConfig, RankFaults, mock_command

CONFIGS = {
    "default": MockConfig(),
    "lockstep": MockConfig(engines=4, lockstep=True, self_wake=True, wave_agreement=False),
    "everything": MockConfig(
        engines=3,
        step_time=0.003,
        max_num_seqs=5,
        sync_interval=2,
        skew=0.01,
        keys="/etc/zmqdp/g1",
        ranks=(0, 2),
        faults={
            1: RankFaults(dead_after=7, slow=2.5),
            2: RankFaults(rejoin_after=4, rejoins=1, garbage=3, bad_hello="lockstep"),
            0: RankFaults(silent_after=9),
        },
    ),
}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_the_command_parses_back_to_its_config(config: MockConfig) -> None:
    cmd = mock_command("ipc:///tmp/zmqdp-m/g", config)
    assert list(cmd[:4]) == [sys.executable, "-m", "zmqdp", "mock"]
    parser = argparse.ArgumentParser()
    _mock_parser(parser)
    args = parser.parse_args(cmd[4:])
    assert args.url == "ipc:///tmp/zmqdp-m/g"
    assert mock_config(args) == config


def test_a_field_with_no_command_line_form_is_refused() -> None:
    with pytest.raises(ValueError, match="kv_tokens has no command-line form"):
        mock_command("ipc:///tmp/zmqdp-m/g", MockConfig(kv_tokens=1024))


def test_the_vllm_mocks_command_is_one_serve_parses_and_finds_the_model_of() -> None:
    """What `zmqdp mock --wire vllm` prints is a `zmqdp serve` command line whose model
    name leads to the shipped directory (no path needed)."""
    from zmqdp.__main__ import vllm_mock_serve_command
    from zmqdp.gateway.serve import add_arguments
    from zmqdp.gateway.vllm_frontend import VllmFrontend
    from zmqdp.vllm.mock import model_directory

    command = vllm_mock_serve_command("tcp://127.0.0.1:29550", 3, "zmqdp-mock", prog="zmqdp")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(command.split()[2:])
    assert (args.vllm, args.url, args.engines, args.insecure) == (
        "zmqdp-mock",
        "tcp://127.0.0.1:29550",
        3,
        True,
    )
    frontend = VllmFrontend(model_directory(args.vllm))
    assert frontend.model.max_model_len == 4096


def test_the_vllm_wire_options_parse_with_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    _mock_parser(parser)
    args = parser.parse_args(["--wire", "vllm"])
    assert (args.url, args.engines, args.model, args.eos_after) == (None, None, None, 128)
    args = parser.parse_args(["--wire", "vllm", "--data-parallel-size", "4", "--moe"])
    assert (args.engines, args.moe, args.vllm_version) == (4, True, "0.33")
