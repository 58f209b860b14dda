"""Wrong (the victim rule): ages correctly, but always preempts the newest running request, however urgent."""

from reference_aging import ReferenceAging


class VictimNewest(ReferenceAging):
    def choose_victim(self, candidates):
        return candidates[-1]
