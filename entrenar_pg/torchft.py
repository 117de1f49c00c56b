"""torchft's reconfigurable process group on entrenar (optional: ``pip install entrenar[torchft]``).

torchft (fault-tolerant training across replica groups) runs each step's
cross-replica collectives on an inner process group that it rebuilds on every
membership change. ``ProcessGroupEntrenar`` is that group built on ours:
torchft's ``ProcessGroupWrapper`` does the reconfiguration (``configure``:
abort the old group, connect to the quorum's store, create the new one) and
forwards every collective to the current inner ``EntrenarProcessGroup``; this
class only says how to create one (``_create_pg``) and reports the inner
group's health (``errored``). What torchft's ``Manager`` relies on, and how
ours meets it:

- ``configure`` runs on the Manager's quorum thread on every new quorum and
  must replace the old group and block until the new one works: the old
  group's ``abort()`` returns within a second whatever the dead peers do, and
  the new group's constructor returns only once every link of the new quorum
  is connected and authenticated (bounded by the group's timeout).
- the Manager waits on ``allreduce`` Works with no timeout: each collective
  fails on its own after ``timeout`` without progress, or at once when a
  peer's process dies.
- healing sends the state dict with ``send``/``recv`` and tags on the fresh
  group (torchft's ``PGTransport``), sends possibly posted before their
  receives: entrenar buffers unexpected messages per tag.
- ``errored()`` is asked at every commit: the inner group's first failure.

Importing this module needs torchft; the rest of entrenar never imports it.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torchft.process_group import ProcessGroupWrapper

from .api.process_group import EntrenarProcessGroup
from .config import Options


class ProcessGroupEntrenar(ProcessGroupWrapper):  # type: ignore[misc]
    """A torchft process group whose inner group (one per quorum) is entrenar's.

    ``timeout``: the inner group's no-progress timeout for every collective
    and p2p call, and the bound on set-up (store and connections).
    ``options``: the inner groups' ``Options`` (default: from the environment).
    """

    def __init__(
        self, timeout: timedelta = timedelta(seconds=60), options: Options | None = None
    ) -> None:
        super().__init__(timeout=timeout)
        self._options = options

    def _create_pg(self, store: Any, rank: int, world_size: int) -> EntrenarProcessGroup:
        """The quorum's group (torchft's ``configure`` calls this with a fresh prefixed store)."""
        return EntrenarProcessGroup(
            store,
            rank,
            world_size,
            timeout=self._timeout,
            options=self._options,
            group_name=f"torchft_quorum_{self._quorum_id}",
        )

    def errored(self) -> Exception | None:
        """The current inner group's first failure, or None (asked at every commit)."""
        pg: Any = self._pg
        return pg.errored() if isinstance(pg, EntrenarProcessGroup) else None

    def set_timeout(self, timeout: timedelta) -> None:
        """The timeout of later groups, and of the current one's later calls."""
        super().set_timeout(timeout)
        pg: Any = self._pg
        if isinstance(pg, EntrenarProcessGroup):
            pg.set_timeout(timeout)

    def shutdown(self) -> None:
        """Shut the current inner group down (torchft's wrapper only drops it)."""
        pg: Any = self._pg
        super().shutdown()  # drops it
        if isinstance(pg, EntrenarProcessGroup):
            pg.shutdown()

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return "torchft-entrenar"
