"""`python -m minivllm.distributed`: start this node's tensor-parallel workers (see worker.main)."""

from minivllm.distributed.worker import main

if __name__ == "__main__":
    main()
