"""Wrong (the queue it is given is read-only): sorts the candidates list in place to find the victim."""

from reference_aging import ReferenceAging


class SortsCandidates(ReferenceAging):
    def choose_victim(self, candidates):
        candidates.sort(key=lambda s: (self._urgency(s), s.arrival_index))
        return candidates[-1]
