"""What a new user meets first (issue 23): the `HandshakeTimeout` of a group nobody
serves, exceptions named `zmqdp.X`, the documented exception tree (`DuplicateRequestId`
is an `InvalidRequest`; `SubmitRefused` covers every refusal of a request), and
`help(EngineGroup)` leading with `connect`."""

from __future__ import annotations

import copy
import importlib.util
import inspect
import pickle
import pydoc
import re
import traceback
import typing
from pathlib import Path

import pytest
import trio

import zmqdp
import zmqdp._core.errors as errors_module
from tests.helpers import group_of
from zmqdp import (
    DuplicateRequestId,
    EngineGroup,
    GroupClosed,
    HandshakeTimeout,
    InvalidRequest,
    Request,
    SubmitRefused,
    ZmqdpError,
)
from zmqdp.aio import AsyncioEngineGroup
from zmqdp.mock import MockConfig, run_mock_group

# -- HandshakeTimeout -----------------------------------------------------------------


async def test_a_url_nobody_serves_names_the_url_the_ranks_and_the_next_step(
    tmp_path: Path,
) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(10), pytest.raises(HandshakeTimeout) as info:
        async with EngineGroup.connect(url, 2, ready_timeout=0.2):
            pass  # pragma: no cover
    err = info.value
    assert (err.url, err.size, err.up, err.timeout) == (url, 2, (), 0.2)
    assert err.missing == {0: "no HELLO yet", 1: "no HELLO yet"}
    text = str(err)
    assert (
        text.splitlines()[0]
        == f"engine group at {url} not ready after waiting 0.2 s: 0 of 2 ranks up"
    )
    assert "  rank 0: no HELLO yet" in text and "  rank 1: no HELLO yet" in text
    assert err.next_step is not None and text.endswith(f"next step: {err.next_step}")
    assert f"is an engine group running and connecting to {url}?" in err.next_step
    assert f"`python -m zmqdp mock --url {url} --engines 2`" in err.next_step
    assert "raise ready_timeout (it was 0.2 s)" in err.next_step
    assert isinstance(err, TimeoutError) and type(err).__module__ == "zmqdp"


async def test_a_partly_formed_group_names_the_ranks_that_came_up(tmp_path: Path) -> None:
    url = f"ipc://{tmp_path}/g"
    with trio.fail_after(15):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_mock_group, url, MockConfig(engines=2, ranks=(0,)))
            with pytest.raises(HandshakeTimeout) as info:
                async with EngineGroup.connect(url, 2, ready_timeout=1.0):
                    pass  # pragma: no cover
            nursery.cancel_scope.cancel()
    err = info.value
    assert err.up == (0,) and set(err.missing) == {1}
    assert ": 1 of 2 ranks up (rank 0)" in str(err).splitlines()[0]
    assert err.next_step is not None
    assert err.next_step.startswith(f"start the missing ranks (each connecting to {url})")


def test_the_engine_side_timeout_keeps_its_short_form() -> None:
    err = HandshakeTimeout({1: "no INIT from the client at ipc:///x"}, [], 5.0)
    assert (
        str(err)
        == "engine group not ready after 5 s\n  rank 1: no INIT from the client at ipc:///x"
    )
    assert (err.url, err.size, err.up, err.next_step) == (None, None, (), None)


# -- the exception tree ---------------------------------------------------------------


def _documented_tree() -> dict[str, str]:
    """Class -> its documented parent, from the indented list in the docstring of
    zmqdp._core.errors (the root maps to "")."""
    doc = errors_module.__doc__
    assert doc is not None
    parents: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in doc.splitlines():
        m = re.match(r"^( *)- `(\w+)`", line)
        if m is None:
            continue
        indent, name = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parents[name] = stack[-1][1] if stack else ""
        stack.append((indent, name))
    return parents


def _exported_errors() -> dict[str, type[ZmqdpError]]:
    return {
        name: obj
        for name in zmqdp.__all__
        if isinstance(obj := getattr(zmqdp, name), type) and issubclass(obj, ZmqdpError)
    }


def test_the_documented_tree_is_the_class_tree() -> None:
    documented = _documented_tree()
    exported = _exported_errors()
    assert set(documented) == set(exported), "every exported error is documented, once"
    for name, parent in documented.items():
        cls = exported[name]
        ours = [b for b in cls.__bases__ if issubclass(b, ZmqdpError)]
        if parent:
            assert ours == [exported[parent]], f"{name}: documented under {parent}"
        else:
            assert cls is ZmqdpError and ours == []
    assert set(errors_module.__all__) >= set(exported)


def test_the_tree_as_the_readme_states_it() -> None:
    submit_refusals = {"SubmitRefused", "InvalidRequest", "DuplicateRequestId"}
    submit_refusals |= {"InvalidRank", "Overloaded", "NoEngineAvailable"}
    for name, cls in _exported_errors().items():
        assert issubclass(cls, SubmitRefused) == (name in submit_refusals), name
    assert issubclass(DuplicateRequestId, InvalidRequest)
    assert issubclass(DuplicateRequestId, ValueError)
    assert not issubclass(GroupClosed, SubmitRefused)  # streams end with it too
    assert "help(zmqdp.ZmqdpError)" in (zmqdp.__doc__ or "")
    assert "- `DuplicateRequestId`" in (ZmqdpError.__doc__ or "")


async def test_a_duplicate_id_is_caught_as_an_invalid_request(tmp_path: Path) -> None:
    with trio.fail_after(15):
        async with group_of(tmp_path, 1) as (group, _):
            group.submit(Request("dup", {"hold": True}))
            try:
                group.submit(Request("dup", {"hold": True}))
            except InvalidRequest as exc:
                caught: Exception = exc
            else:  # pragma: no cover
                pytest.fail("a live duplicate id was accepted")
            with pytest.raises(SubmitRefused):
                group.submit(Request("dup", {"hold": True}))
    assert type(caught) is DuplicateRequestId
    assert (caught.request_id, caught.rank) == ("dup", 0)
    assert caught.cause == "the id is already live on rank 0; wait for it to end or abort it first"
    assert str(caught) == (
        "request 'dup' is already live on rank 0; wait for it to end or abort it first"
    )
    if importlib.util.find_spec("prometheus_client") is not None:  # the gateway extra
        from zmqdp.gateway.errors import http_error

        answer = http_error(caught, retry_after=1, size=1)  # a gateway: 400, not 500
        assert (answer.status, answer.code) == (400, "invalid_request")


# -- names, pickling, copies ----------------------------------------------------------

SAMPLES: list[ZmqdpError] = [
    zmqdp.ZmqdpError("plain"),
    zmqdp.SubmitRefused("refused"),
    zmqdp.ProtocolError("bad body", rank=1, request_id="r", message="hello"),
    zmqdp.InvalidRequest("r", "no CBOR form"),
    zmqdp.DuplicateRequestId("r", 2),
    zmqdp.InvalidRank(5, 2, "r", "out of range"),
    zmqdp.NoEngineAvailable("r", 2),
    zmqdp.Overloaded("r", 1, 8),
    zmqdp.RequestTimeout(0, "r", 1.5),
    zmqdp.HandshakeTimeout({1: "no HELLO yet"}, ["bad size"], 3.0, url="ipc:///g", size=2),
    zmqdp.HandshakeRejected(0, "size mismatch"),
    zmqdp.EngineDead(1, "silent", "r"),
    zmqdp.GroupClosed("closed", "r"),
    zmqdp.GroupDraining("r"),
    zmqdp.GroupRecovering("waiting for rank 1"),
    zmqdp.CallTimeout(0, "ping", 2.0),
    zmqdp.CallFailed(0, "ping", "boom"),
    zmqdp.RequestAborted(0, "r"),
    zmqdp.StreamTruncated(0, "r"),
    zmqdp.StreamOverflow(0, "r", 10, aborted=False),
]


def test_every_error_has_a_sample() -> None:
    assert {type(e) for e in SAMPLES} == set(_exported_errors().values())


@pytest.mark.parametrize("error", SAMPLES, ids=lambda e: type(e).__name__)
def test_errors_are_named_zmqdp_and_survive_pickle_and_copy(error: ZmqdpError) -> None:
    name = type(error).__name__
    assert type(error).__module__ == "zmqdp" and getattr(zmqdp, name) is type(error)
    try:
        raise error
    except ZmqdpError:
        printed = traceback.format_exc()
    assert re.search(rf"^zmqdp\.{name}: ", printed, re.MULTILINE), printed
    for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(twin) is type(error)
        assert str(twin) == str(error) and twin.args == error.args
        assert vars(twin) == vars(error)


def test_the_group_classes_are_named_zmqdp_and_every_value_keeps_its_type_hints() -> None:
    for cls in (zmqdp.EngineGroup, zmqdp.RequestStream, zmqdp.RankState, zmqdp.Outcome):
        assert cls.__module__ == "zmqdp"
    assert pickle.loads(pickle.dumps(zmqdp.RankState.UP)) is zmqdp.RankState.UP
    for name in zmqdp.__all__:
        obj = getattr(zmqdp, name)
        if isinstance(obj, type):
            typing.get_type_hints(obj)  # pydantic, Hypothesis' from_type: still resolve


# -- help(EngineGroup) ----------------------------------------------------------------


@pytest.mark.parametrize("cls", [EngineGroup, AsyncioEngineGroup])
def test_help_leads_with_connect_and_calls_init_private(cls: type) -> None:
    doc = inspect.getdoc(cls) or ""
    first = " ".join(doc.split("\n\n")[0].split())
    assert "connect" in first and "never by calling the class" in first
    assert f"{cls.__name__}.connect(" in doc
    init = inspect.getdoc(cls.__init__) or ""
    assert init.startswith("Private:") and f"{cls.__name__}.connect(url, engines)" in init
    text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
    assert text.index(f"{cls.__name__}.connect(") < text.index("__init__")
    with pytest.raises(TypeError, match="no public constructor"):
        cls()


def test_call_and_connect_document_what_a_new_user_meets() -> None:
    call = " ".join((inspect.getdoc(EngineGroup.call) or "").split())
    assert "`EngineDead` if the rank is down when called" in call
    connect = " ".join((inspect.getdoc(EngineGroup.connect) or "").split())
    assert f"after `ready_timeout` ({zmqdp.NativeWire.default_ready_timeout:g} s)" in connect


def test_zmqdp_imports_without_docstrings() -> None:
    """`python -OO` strips docstrings: the exception tree's copy into `help()` must not
    need one (it made `import zmqdp` fail under -OO)."""
    import subprocess
    import sys

    code = "import zmqdp, zmqdp.vllm; print(zmqdp.ZmqdpError.__doc__)"
    done = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "None"
