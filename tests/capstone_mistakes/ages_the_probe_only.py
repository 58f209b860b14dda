"""Wrong (open load): ages only priority-2 requests, the level the bounded-wait probe uses; a request of
any other level still waits behind a stream of more urgent ones."""

from reference_aging import ReferenceAging


class AgesTheProbeOnly(ReferenceAging):
    def _urgency(self, seq):
        return super()._urgency(seq) if seq.priority == 2 else seq.priority
