"""The scheduler's side: who runs this step (`Scheduler` and its policy), the books of the paged KV blocks
and of a hybrid model's state (integers only, journaled so that a failed step is undone), and the one
commit of a step's results with its stop rules.

It imports request/, structured_output/ and processing/'s detokenizer, never worker/ or executor/: what it
shares with the runner is the plan, a `SchedulerOutput` (request/step_types.py)."""
