"""The namespaces clients described in their lookups, bounded by bytes.

A Lookup may carry the full ``Namespace`` (model, dtype, layout, ...) beside its
fingerprint; the server remembers it so that ``kvstore ls`` and a lookup's
``explain`` can name a fingerprint. Those descriptions come from clients, so the
table is bounded by what they weigh, not by how many there are: a description
larger than ``max_entry_bytes`` is not kept (the lookup is served all the same),
and past ``max_bytes`` in all the least recently described ones are forgotten.
Nothing depends on a name being here: a forgotten one is shown as its fingerprint.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstore.keys import Fingerprint, Namespace

KiB, MiB = 1 << 10, 1 << 20


class NameBook:
    def __init__(self, *, max_bytes: int = 16 * MiB, max_entry_bytes: int = 4 * KiB) -> None:
        self.max_bytes = max_bytes
        self.max_entry_bytes = max_entry_bytes
        self._lock = threading.Lock()
        self._names: OrderedDict[Fingerprint, tuple[Namespace, int]] = OrderedDict()
        self.bytes = 0
        self.too_large = 0  # descriptions not kept: larger than max_entry_bytes
        self.forgotten = 0  # descriptions dropped to stay under max_bytes

    def remember(self, fp: Fingerprint, ns: Namespace, nbytes: int) -> None:
        """Keep ``ns`` (``nbytes`` on the wire) as the name of ``fp``."""
        if nbytes > self.max_entry_bytes:
            with self._lock:
                self.too_large += 1
            return
        with self._lock:
            if fp in self._names:
                self._names.move_to_end(fp)
                return
            self._names[fp] = (ns, nbytes)
            self.bytes += nbytes
            while self.bytes > self.max_bytes:
                _, (_, n) = self._names.popitem(last=False)
                self.bytes -= n
                self.forgotten += 1

    def get(self, fp: Fingerprint) -> Namespace | None:
        with self._lock:
            got = self._names.get(fp)
        return None if got is None else got[0]

    def snapshot(self) -> dict[Fingerprint, Namespace]:
        with self._lock:
            return {fp: ns for fp, (ns, _) in self._names.items()}
