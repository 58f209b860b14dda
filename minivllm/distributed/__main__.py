"""`python -m minivllm.distributed`: start this node's tensor-parallel workers (engine/executor/worker.py's
`main`). A command, not a library module: nothing imports it, so its import of the engine is no cycle."""

from minivllm.engine.executor.worker import main

if __name__ == "__main__":
    main()
