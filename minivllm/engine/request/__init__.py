"""The data both sides share: one request (`Sequence`), the hand-offs of a step (`step_types.py`: the plan
out of the scheduler, the runner's output back), a hybrid model's state layout, the journal that undoes a
failed step, and the failure model's exceptions.

The bottom layer: it imports no other subpackage of the engine (a `Sequence` names its detokenizer and
grammar matcher for type checkers only), and every other layer may import it."""
