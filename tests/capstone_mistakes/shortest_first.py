"""Wrong (priority order): the shortest prompt first, whatever its priority."""

from reference_aging import ReferenceAging


class ShortestFirst(ReferenceAging):
    def admission_order(self, waiting):
        super().admission_order(waiting)  # keeps the clock and the ages
        return sorted(waiting, key=lambda s: (s.num_tokens, s.arrival_index))
