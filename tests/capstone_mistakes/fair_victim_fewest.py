"""Wrong (fair share: victims): admits fairly, but preempts from the tenant holding the FEWEST candidates."""

from collections import Counter

from reference_fair_share import ReferenceFairShare


class FairVictimFewest(ReferenceFairShare):
    def choose_victim(self, candidates):
        held = Counter(s.priority for s in candidates)
        return min(candidates, key=lambda s: (held[s.priority], -s.arrival_index))
