"""Wrong (fair share: victims): admits fairly, but preempts the newest running request, whatever its tenant."""

from reference_fair_share import ReferenceFairShare


class FairVictimNewest(ReferenceFairShare):
    def choose_victim(self, candidates):
        return candidates[-1]
