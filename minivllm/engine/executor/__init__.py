"""Executors: who runs a step's forward — this process alone (`UniProcExecutor`), or this process
and one worker process per other tensor-parallel rank (`MultiprocExecutor`). The engine owns one and
calls `execute_model(scheduler_output)`; neither the scheduler nor the model runner knows which."""
