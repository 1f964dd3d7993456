"""hybridcomm.tools.launch: ranks started by forkserver see the caller's environment as
it is at each launch (not the server's, which is the caller's at the server's start),
and give what spawn gives."""

import operator
import os

import pytest

from hybridcomm.tools.launch import launch


def _env_and_sum(rank, world, name):
    return os.environ.get(name), rank + world


def test_forkserver_ranks_get_the_environment_of_each_launch(monkeypatch):
    name = "HYBRIDCOMM_TEST_LAUNCH_ENV"
    monkeypatch.setenv(name, "first")
    first = launch(_env_and_sum, 2, name, backend="gloo", start_method="forkserver")
    assert first == [("first", 2), ("first", 3)]
    monkeypatch.setenv(name, "second")  # the server is running by now: it has "first"
    assert launch(_env_and_sum, 2, name, backend="gloo", start_method="forkserver") == [
        ("second", 2),
        ("second", 3),
    ]
    monkeypatch.delenv(name)
    assert launch(_env_and_sum, 2, name, backend="gloo", start_method="forkserver") == [
        (None, 2),
        (None, 3),
    ]
    assert launch(operator.add, 3, backend="gloo", start_method="forkserver") == [3, 4, 5]


def test_forkserver_refuses_what_it_cannot_pickle_before_starting_a_rank():
    with pytest.raises(ValueError, match="picklable"):
        launch(lambda rank, world: rank, 2, backend="gloo", start_method="forkserver")
