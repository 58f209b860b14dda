"""Wrong (the victim rule): always preempts the request that asked for the block, however urgent."""

from reference_aging import ReferenceAging


class VictimRequester(ReferenceAging):
    def choose_victim(self, candidates):
        return candidates[0]
