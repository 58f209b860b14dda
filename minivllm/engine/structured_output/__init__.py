"""Structured outputs: a request's grammar compiled and matched token by token (`grammar.py`, llguidance),
and one step's token bitmasks filled for the scheduler's plan (`grammar_fill.py`).

It imports only request/ (the plan's types): processing/ compiles the grammars, core/ asks for the masks."""
