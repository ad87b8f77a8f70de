"""actors/heap_freeze.py: what an actor built while loading is frozen out of the cyclic collector
(tests/actors/test_expert_parallel.py checks every served actor does it)."""

import gc
import weakref

import pytest

from raymoe.actors import heap_freeze



@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the test process goes on with its collector as Python set it


def test_freezing_moves_every_live_object_out_of_the_collectors_reach(unfrozen, monkeypatch):
    monkeypatch.delenv(heap_freeze.ENV, raising=False)
    loaded = [[i] for i in range(10_000)]  # what "loading" built: containers the collector tracks
    frozen = heap_freeze.freeze_loaded_heap()
    # (another thread of the process may free a frozen object meanwhile: the count only falls)
    assert frozen >= gc.get_freeze_count() > len(loaded)
    # A collection walks only what came after: none of what was loaded, far fewer than were frozen.
    after = [[i] for i in range(100)]
    walked = {id(o) for o in gc.get_objects()}
    assert not walked & {id(item) for item in loaded} and id(after[0]) in walked
    assert len(walked) < frozen


def test_the_switch_leaves_the_collector_alone(unfrozen, monkeypatch):
    monkeypatch.setenv(heap_freeze.ENV, "0")
    assert not heap_freeze.enabled()
    assert heap_freeze.freeze_loaded_heap() == 0 and gc.get_freeze_count() == 0


def test_the_cycles_loading_left_are_collected_before_freezing(unfrozen, monkeypatch):
    monkeypatch.delenv(heap_freeze.ENV, raising=False)
    gc.disable()  # (no automatic collection may take the cycle first)
    try:
        cycle = Node()
        cycle.next = cycle
        alive = weakref.ref(cycle)
        del cycle
        assert alive() is not None  # only the cyclic collector can free it
        heap_freeze.freeze_loaded_heap()
        assert alive() is None  # collected, not frozen for the life of the process
    finally:
        gc.enable()


class Node:
    next: "Node | None" = None
