"""A deployment's routers or expert workers as a constructor argument of a restartable actor:
pickled as the deployment's name, looked up again by name where unpickled.

A restarted router or controller unpickles its arguments again; after a resize the pools have
other sizes than at deploy, and a fixed list of names would name actors that no longer exist
(or miss added ones). ``{name}-{role}-0``, ``-1``, ... up to the first name Ray does not know.
"""

from __future__ import annotations

from typing import Any

import ray


def live_handles(name: str, namespace: str, role: str) -> list[Any]:
    """``{name}-{role}-0``, ``-1``, ... up to the first name Ray does not know."""
    handles = []
    while True:
        try:
            handles.append(ray.get_actor(f"{name}-{role}-{len(handles)}", namespace=namespace))
        except ValueError:
            return handles


class LiveActors(list):
    """Handles of one role's actors (a subclass names the role), pickled by name."""

    role = ""

    def __init__(self, handles: list[Any], name: str, namespace: str):
        super().__init__(handles)
        self.name, self.namespace = name, namespace

    def __reduce__(self):
        return _look_up, (type(self), self.name, self.namespace)


def _look_up(cls: type, name: str, namespace: str) -> LiveActors:
    return cls(live_handles(name, namespace, cls.role), name, namespace)
