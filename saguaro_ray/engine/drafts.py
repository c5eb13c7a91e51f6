"""The draft workers as the round loop sees them: which are up, and their recovery.

A lost draft never stalls generation: rounds go on with the drafts that are
left (with none, with point-mass *fast* proposals — still exact, just slower)
while the lost one is restarted in the background; once it is back it
rejoins at the next round (the round loop re-prefills it on demand, through
:class:`NeedsPrefillError`). Which draft plays which part in a round
(the primary that proposes, the shards of an SSD build) is decided from the
drafts that are up at that moment.
"""

from __future__ import annotations

import logging
import threading
from typing import Sequence

from saguaro_ray.engine.transport import WorkerGone, WorkerHandle

log = logging.getLogger(__name__)


class _Draft:
    def __init__(self, handle: WorkerHandle) -> None:
        self.handle = handle
        self.recovery: threading.Thread | None = None
        self.restored = False
        self.gone = False

    @property
    def up(self) -> bool:
        if self.gone:
            return False
        recovery = self.recovery
        if recovery is None:
            return True
        if recovery.is_alive() or not self.restored:
            return False
        self.recovery = None
        return True


class DraftPool:
    """Health of every draft worker."""

    def __init__(self, handles: Sequence[WorkerHandle]) -> None:
        self._drafts = [_Draft(h) for h in handles]
        self.failures = 0

    def __len__(self) -> int:
        return len(self._drafts)

    def up(self) -> list[WorkerHandle]:
        """The drafts usable now, in a fixed order (shard i goes to the i-th)."""
        return [d.handle for d in self._drafts if d.up]

    @property
    def primary(self) -> WorkerHandle | None:
        """The draft that proposes (SD, backups, pyramid): the first one up."""
        ups = self.up()
        return ups[0] if ups else None

    def lost(self, handle: WorkerHandle) -> None:
        """``handle`` failed a call: stop using it and restart it in the background."""
        d = next(d for d in self._drafts if d.handle is handle)
        if d.recovery is not None or d.gone:
            return
        self.failures += 1
        log.warning("%s lost; continuing without it while it restarts", handle.name)
        d.restored = False

        def recover() -> None:
            try:
                handle.recover()
            except WorkerGone:
                d.gone = True
                log.error("%s cannot be restarted; continuing without it", handle.name)
                return
            d.restored = True

        d.recovery = threading.Thread(target=recover, name=f"saguaro-recover-{handle.name}", daemon=True)
        d.recovery.start()
