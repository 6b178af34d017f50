"""`LayerLoad`: a load running on a thread of its own, reported layer by layer as it lands.

`StoreClient.start_load` returns one, so that an engine can compute layer i of the rest of a
prompt while layer i + 1 of its prefix is still arriving (`wait_layer(i)` before layer i).
"""

from __future__ import annotations

import threading


class LayerLoad:
    """A load running on its own thread (`StoreClient.start_load`): wait for one layer of it,
    or for all of it and the number of blocks that landed intact."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._layers = 0  # layers 0 .. _layers - 1 have landed
        self._landed: int | None = None  # set when the load has ended

    def layer_done(self, layer: int) -> None:
        with self._cond:
            self._layers = layer + 1
            self._cond.notify_all()

    def finish(self, landed: int) -> None:
        with self._cond:
            self._landed = landed
            self._cond.notify_all()

    def wait_layer(self, layer: int) -> None:
        """Return once layer `layer` has landed or the load has ended (either way: see
        `result()` for whether the blocks are good)."""
        with self._cond:
            self._cond.wait_for(lambda: self._layers > layer or self._landed is not None)

    def result(self) -> int:
        """Blocks that landed intact, once the load has ended (it ends within its timeout)."""
        with self._cond:
            self._cond.wait_for(lambda: self._landed is not None)
            return self._landed
