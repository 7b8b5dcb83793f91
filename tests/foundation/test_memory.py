"""avpipe._memory: the arena limit is set once per process, from AVPIPE_MALLOC_ARENAS."""

from __future__ import annotations

import pytest

from avpipe import _memory


class _Libc:
    def __init__(self):
        self.calls = []

        def mallopt(param, value):
            self.calls.append((param, value))
            return 1

        self.mallopt = mallopt


@pytest.fixture
def libc(monkeypatch):
    fake = _Libc()
    monkeypatch.setattr(_memory.ctypes, "CDLL", lambda name: fake)
    monkeypatch.setattr(_memory, "_DONE", {})
    return fake


def test_the_limit_is_set_once(libc, monkeypatch):
    monkeypatch.delenv("AVPIPE_MALLOC_ARENAS", raising=False)
    assert _memory.limit_malloc_arenas() == 2
    assert _memory.limit_malloc_arenas() is None
    assert libc.calls == [(-8, 2)]
    monkeypatch.setenv("AVPIPE_MALLOC_ARENAS", "4")
    assert _memory.limit_malloc_arenas() == 4
    assert libc.calls == [(-8, 2), (-8, 4)]


def test_zero_leaves_the_allocator_alone(libc, monkeypatch):
    monkeypatch.setenv("AVPIPE_MALLOC_ARENAS", "0")
    assert _memory.limit_malloc_arenas() is None
    assert libc.calls == []


def test_a_bad_value_names_the_variable(libc, monkeypatch):
    monkeypatch.setenv("AVPIPE_MALLOC_ARENAS", "-1")
    with pytest.raises(ValueError, match="AVPIPE_MALLOC_ARENAS"):
        _memory.limit_malloc_arenas()


def test_without_glibc_nothing_is_set(monkeypatch):
    def no_libc(name):
        raise OSError("no libc")

    monkeypatch.setattr(_memory.ctypes, "CDLL", no_libc)
    monkeypatch.setattr(_memory, "_DONE", {})
    monkeypatch.delenv("AVPIPE_MALLOC_ARENAS", raising=False)
    assert _memory.limit_malloc_arenas() is None
