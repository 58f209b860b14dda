"""Wrong (stale state): remembers every request it ever saw; nothing is dropped when a request finishes."""

from reference_aging import ReferenceAging


class NeverPruned(ReferenceAging):
    def admission_order(self, waiting):
        self.clock += 1
        self._see(waiting)
        return sorted(waiting, key=lambda s: (self._urgency(s), s.arrival_index))
