"""distributed.group_hosts: the host names of a group's ranks, which cuda_ep uses to keep the symmetric-memory EP
kernels to groups inside one host. The collective is torch's; here a stand-in for all_gather_object gives each
rank's host name, and the test checks what group_hosts makes of them: sorted, without repeats, one collective per
group (cached), another group asked anew, and the cache holding no group alive."""

import gc
import weakref

import pytest

from mok_nn import distributed


@pytest.fixture
def gathered(monkeypatch):
    """The host names the stand-in collective reports per group, and the groups it was called for."""
    names, calls = {}, []

    def all_gather_object(out, obj, group=None):
        calls.append(group)
        out[:] = names[group]

    monkeypatch.setattr(distributed.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(distributed.dist, "get_world_size", lambda group=None: len(names[group]))
    monkeypatch.setattr(distributed, "_HOSTS", type(distributed._HOSTS)())  # an empty cache of its own
    return names, calls


class _Group:
    """A stand-in process group (object() takes no weak references; ProcessGroup does)."""


def test_two_hosts_sorted_and_cached(gathered):
    names, calls = gathered
    group = _Group()
    names[group] = ["node-b", "node-a", "node-b", "node-a"]
    assert distributed.group_hosts(group) == ["node-a", "node-b"]
    assert distributed.group_hosts(group) == ["node-a", "node-b"]
    assert calls == [group]  # cached: no second collective


def test_one_host_and_another_group_asked_anew(gathered):
    names, calls = gathered
    a, b = _Group(), _Group()
    names[a], names[b] = ["node-a", "node-a"], ["node-c", "node-a"]
    assert distributed.group_hosts(a) == ["node-a"]
    assert distributed.group_hosts(b) == ["node-a", "node-c"]
    assert calls == [a, b]


def test_the_cache_keeps_no_group_alive(gathered):
    """A group the user destroyed and dropped is freed then, not at interpreter shutdown (where freeing a gloo
    group can abort the process)."""
    names, calls = gathered
    group = _Group()
    names[group] = ["node-a"]
    assert distributed.group_hosts(group) == ["node-a"]
    ref = weakref.ref(group)
    names.clear(), calls.clear()  # the stand-in collective's own records
    del group
    gc.collect()
    assert ref() is None
    assert len(distributed._HOSTS) == 0
