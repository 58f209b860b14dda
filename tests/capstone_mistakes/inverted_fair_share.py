"""Wrong (fair share: admissions): the sign flipped: the tenant served MOST goes first."""

from reference_fair_share import ReferenceFairShare


class InvertedFairShare(ReferenceFairShare):
    def admission_order(self, waiting):
        order = super().admission_order(waiting)
        served = {s.request_id: self.served[s.priority] for s in waiting}
        return sorted(order, key=lambda s: (-served[s.request_id], s.arrival_index))
