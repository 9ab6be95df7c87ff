"""mok_nn.envvars.getenv reads what os.environ.get reads, also after changes made at run time."""

import os

import pytest

from mok_nn.envvars import getenv


@pytest.mark.parametrize("value", ["1", "", "scatter", "Ünïcode", "a b=c"])
def test_getenv_equals_os_environ_get(monkeypatch, value):
    var = "MOK_TEST_ENVVARS_SWITCH"
    monkeypatch.delenv(var, raising=False)
    assert getenv(var) == os.environ.get(var, "") == ""
    assert getenv(var, "auto") == "auto"
    monkeypatch.setenv(var, value)  # set after the first read: the next read must see it
    assert getenv(var) == os.environ.get(var, "") == value
    assert getenv(var, "auto") == os.environ.get(var, "auto") == value
    monkeypatch.delenv(var)
    assert getenv(var, "auto") == "auto"


def test_getenv_non_str_default_returned_as_is(monkeypatch):
    monkeypatch.delenv("MOK_TEST_ENVVARS_INT", raising=False)
    assert getenv("MOK_TEST_ENVVARS_INT", 7) == 7  # as os.environ.get (cuda_ep passes int defaults)


def test_getenv_with_os_environ_replaced_by_a_dict(monkeypatch):
    monkeypatch.setattr(os, "environ", {"MOK_TEST_ENVVARS_SWITCH": "0"})
    assert getenv("MOK_TEST_ENVVARS_SWITCH", "1") == "0"
    assert getenv("MOK_TEST_ENVVARS_UNSET", "1") == "1"
