"""The gateway's frontend was its "dialect" (issue 33: the word also names the wire's
protocol, `zmqdp.vllm.dialect(...)`), and `mock_command` moved to `zmqdp.mock`. The old
names keep working, each with a `DeprecationWarning` naming the new one; the new names
never warn."""

from __future__ import annotations

import importlib
import warnings

import pytest

import zmqdp.gateway
from zmqdp.gateway import create_app
from zmqdp.gateway.frontend import Frontend, MockFrontend
from zmqdp.gateway.vllm_frontend import FIELDS, VllmFrontend
from zmqdp.mock import MockConfig, mock_command

OLD_NAMES = [
    ("zmqdp.gateway", "Dialect", Frontend, "zmqdp.gateway.frontend.Frontend"),
    ("zmqdp.gateway", "MockDialect", MockFrontend, "zmqdp.gateway.frontend.MockFrontend"),
    ("zmqdp.gateway", "VllmDialect", VllmFrontend, "zmqdp.gateway.vllm_frontend.VllmFrontend"),
    ("zmqdp.gateway.dialect", "Dialect", Frontend, "Frontend"),
    ("zmqdp.gateway.dialect", "MockDialect", MockFrontend, "MockFrontend"),
    ("zmqdp.gateway.dialect", "CompletionRequest", zmqdp.gateway.CompletionRequest, "frontend"),
    ("zmqdp.gateway.vllm_dialect", "VllmDialect", VllmFrontend, "VllmFrontend"),
    ("zmqdp.gateway.vllm_dialect", "FIELDS", FIELDS, "vllm_frontend.FIELDS"),
    ("zmqdp.gateway.backends", "mock_command", mock_command, "zmqdp.mock.mock_command"),
]


@pytest.mark.parametrize(("module", "name", "new", "says"), OLD_NAMES)
def test_an_old_name_is_the_new_object_and_warns(
    module: str, name: str, new: object, says: str
) -> None:
    with pytest.warns(DeprecationWarning, match=f"{name} is deprecated: use .*{says}"):
        old = getattr(importlib.import_module(module), name)
    assert old is new


def test_old_names_import_with_a_warning_at_the_importer() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from zmqdp.gateway import MockDialect
    assert MockDialect is MockFrontend
    assert [(w.category, w.filename) for w in caught] == [(DeprecationWarning, __file__)]


def test_a_star_import_of_an_old_module_still_works() -> None:
    namespace: dict[str, object] = {}
    with pytest.warns(DeprecationWarning):
        exec("from zmqdp.gateway.dialect import *", namespace)
    assert namespace["MockDialect"] is MockFrontend
    assert namespace["Prepared"] is zmqdp.gateway.Prepared


def test_the_new_names_do_not_warn() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        from zmqdp.gateway import Frontend as F
        from zmqdp.gateway import MockFrontend as M
        from zmqdp.gateway import VllmFrontend as V

        app = create_app(mock=MockConfig(engines=1), frontend=MockFrontend())
    assert (Frontend, MockFrontend, VllmFrontend) == (F, M, V)
    assert isinstance(app._settings.frontend, MockFrontend)


def test_create_app_takes_dialect_with_a_warning() -> None:
    frontend = MockFrontend()
    with pytest.warns(DeprecationWarning, match=r"create_app\(dialect=...\) is deprecated"):
        app = create_app(mock=MockConfig(engines=1), dialect=frontend)
    assert app._settings.frontend is frontend
    assert "dialect" not in app._connect_options  # not mistaken for the wire's


def test_create_app_refuses_both_names() -> None:
    with pytest.raises(TypeError, match="not also its deprecated name dialect="):
        create_app(mock=MockConfig(engines=1), frontend=MockFrontend(), dialect=MockFrontend())


@pytest.mark.parametrize("module", ["zmqdp.gateway", "zmqdp.gateway.dialect"])
def test_an_unknown_name_is_still_an_attribute_error(module: str) -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nope'"):
        _ = importlib.import_module(module).Nope
