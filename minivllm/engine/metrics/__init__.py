"""What the engine reports about itself: the counters `LLM.get_stats()` returns and the per-step traces
the notebooks draw, read from the scheduler's books (core/). In the engine, only the loop imports it."""
