"""Tensor parallelism's failure model: a worker that dies, hangs or raises ends the engine with a clear
`EngineDeadError` on rank 0, in bounded time, and no process is left behind. Also: the ranks of
"another node" started by hand (`python -m minivllm.distributed`)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time

import pytest
from tp_helpers import child_pids, interrupt_rank_0, raise_on_workers, shard_summary

from minivllm import LLM, SamplingParams
from minivllm.engine.request.errors import EngineDeadError

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 80]}, {"prompt_token_ids": list(range(40, 61))}]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(block_size=4, num_kv_blocks=64, warmup=False)


def generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def worker_pid(llm: LLM) -> int:
    (process,) = llm.llm_engine.executor.worker_processes
    return process.pid


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_a_killed_worker_ends_the_engine_at_once(qwen3_dir, one_thread_per_rank):
    before = child_pids()
    # A step timeout past the test's own: waiting for it instead of noticing the dead peer (whose closed
    # connections say so at once) would be a hang the test's timeout catches, not a slow machine's wall clock.
    llm = LLM(qwen3_dir, tensor_parallel_size=2, distributed_timeout_s=3600, **ENGINE)
    assert generate(llm)
    os.kill(worker_pid(llm), signal.SIGKILL)
    with pytest.raises(EngineDeadError, match=r"(?s)worker rank 1 .*SIGKILL"):  # its death, not a timeout
        generate(llm)
    with pytest.raises(EngineDeadError, match="SIGKILL"):  # dead for good, and still says why
        generate(llm)
    assert not llm.llm_engine.requests  # the failed requests were aborted by generate()
    llm.shutdown()
    assert not child_pids() - before


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_a_hung_worker_ends_the_engine_after_the_timeout(qwen3_dir, one_thread_per_rank):
    before = child_pids()
    llm = LLM(qwen3_dir, tensor_parallel_size=2, distributed_timeout_s=3, **ENGINE)
    assert generate(llm)
    time.sleep(4)  # idling longer than the timeout is no failure: the workers wait on the wake group
    assert generate(llm)
    pid = worker_pid(llm)
    os.kill(pid, signal.SIGSTOP)  # alive, holding its connections, answering nothing
    start = time.monotonic()
    with pytest.raises(EngineDeadError, match=r"(?s)Timed out.*distributed_timeout_s=3 s"):
        generate(llm)
    assert time.monotonic() - start >= 3  # the timeout was waited for (a bound above it would time the machine)
    assert pid not in child_pids(), "the hung worker was killed"
    llm.shutdown()
    assert not child_pids() - before


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_ctrl_c_waits_for_the_step_and_a_worker_that_raises_reports_its_traceback(qwen3_dir, one_thread_per_rank):
    before = child_pids()
    llm = LLM(qwen3_dir, tensor_parallel_size=2, distributed_timeout_s=30, **ENGINE)
    with pytest.raises(TypeError, match="module-level function"):  # refused before anything is sent
        llm.collective_rpc(lambda rank, runner: rank)
    with pytest.raises(KeyboardInterrupt):  # raised once the ranks are done: they stay in step
        llm.collective_rpc(interrupt_rank_0)
    assert generate(llm) and llm.collective_rpc(shard_summary)[1]["rank"] == 1  # alive and well
    with pytest.raises(EngineDeadError, match=r"(?s)worker rank 1 .*raised.*ValueError: injected failure on rank 1"):
        llm.collective_rpc(raise_on_workers)
    with pytest.raises(EngineDeadError, match="injected failure"):
        generate(llm)
    llm.shutdown()
    llm.shutdown()  # twice is fine
    assert not child_pids() - before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_ranks_started_by_hand_as_on_another_node(qwen3_dir, monkeypatch, one_thread_per_rank):
    """Rank 0 starts no worker (LOCAL_WORLD_SIZE=1); rank 1 joins through MASTER_ADDR / MASTER_PORT."""
    expected = generate(LLM(qwen3_dir, **ENGINE))
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "RANK": "1", "LOCAL_WORLD_SIZE": "1",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}
    node = subprocess.Popen([sys.executable, "-m", "minivllm.distributed", "--device", "cpu"], env=env)
    try:
        for var in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.setenv(var, env[var])
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        with LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE) as llm:
            assert llm.llm_engine.executor.worker_processes == []
            assert generate(llm) == expected
            assert [s["rank"] for s in llm.collective_rpc(shard_summary)] == [0, 1]
        assert node.wait(timeout=30) == 0  # Shutdown reached the other "node": its ranks left cleanly
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


SLOW_WORKER_WARMUP = """
import time
import minivllm.engine.worker.model_runner as model_runner

measure = model_runner.ModelRunner.measure_cpu_kernels


def slowly(self, *args):  # a worker's warm-up on a busy machine, or compiling the C++ kernels the first time
    time.sleep(8)
    return measure(self, *args)


model_runner.ModelRunner.measure_cpu_kernels = slowly
"""


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_a_worker_warming_up_longer_than_a_steps_timeout_is_waited_for(qwen3_dir, tmp_path, monkeypatch,
                                                                        one_thread_per_rank):
    """Start-up is not a step: a worker still timing (or compiling) its CPU kernels when rank 0 is ready is
    waited for with the start-up bound, not failed by distributed_timeout_s (60 s by default, which a busy
    machine's start-up once outlasted)."""
    (tmp_path / "sitecustomize.py").write_text(SLOW_WORKER_WARMUP)  # imported by every process spawned now
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    with LLM(qwen3_dir, tensor_parallel_size=2, distributed_timeout_s=3, block_size=4, num_kv_blocks=64) as llm:
        assert generate(llm) == generate(LLM(qwen3_dir, **ENGINE))


DIES_WHILE_STARTING = """
import os
import minivllm.engine.executor.worker as worker


def crash(*args):  # a worker that dies before it joins: a missing library, the OOM killer
    os._exit(3)


worker.worker_main = crash
"""


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_a_worker_that_dies_while_starting_ends_the_start_at_once(qwen3_dir, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(DIES_WHILE_STARTING)  # only the spawned workers import it
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    before = child_pids()
    # "exited while starting": seen as it happened, not after the join's 120 s timeout ("did not start
    # within"); the message says which, so no wall clock (a busy machine's) is needed to tell them apart.
    with pytest.raises(RuntimeError, match=r"(?s)starting 2 tensor-parallel ranks failed.*exit code 3"
                                           r".*exited while starting"):
        LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE)
    assert not child_pids() - before


def test_a_one_node_group_listens_on_no_network_interface(qwen3_dir, one_thread_per_rank):
    """One node meets through a file (torch's TCP store would listen on every interface, for the engine's
    whole life); the ranks' own connections are on loopback."""
    if shutil.which("ss") is None:
        assert not os.environ.get("CI"), "CI must check this: install iproute2 (ss)"
        pytest.skip("no `ss` (iproute2) to list listening sockets")
    with LLM(qwen3_dir, tensor_parallel_size=2, **ENGINE) as llm:
        pids = {os.getpid(), worker_pid(llm)}
        listening = subprocess.run(["ss", "-Hltnp"], capture_output=True, text=True).stdout.splitlines()
        ours = [line for line in listening if any(f"pid={pid}," in line for pid in pids)]
        assert ours, listening  # gloo's pairs
        assert all(line.split()[3].startswith(("127.0.0.1:", "[::1]:")) for line in ours), ours
        assert generate(llm)


SHORT_STARTUP_BOUND = """
import minivllm.distributed.parallel_state as parallel_state

parallel_state.STARTUP_TIMEOUT_S = 4.0
"""


@pytest.mark.timeout(600)  # a hang; a busy machine takes minutes
def test_idling_past_the_start_up_bound_before_the_first_request_is_no_failure(qwen3_dir, tmp_path, monkeypatch,
                                                                              one_thread_per_rank):
    """Without a warm-up, the first command is the first request, which may come much later: by then every
    rank must have left the start-up group (whose waits are bounded) for the wake group (whose are not)."""
    from minivllm.distributed import parallel_state

    (tmp_path / "sitecustomize.py").write_text(SHORT_STARTUP_BOUND)  # the workers' bound...
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(parallel_state, "STARTUP_TIMEOUT_S", 4.0)  # ... and rank 0's
    with LLM(qwen3_dir, tensor_parallel_size=2, distributed_timeout_s=3, **ENGINE) as llm:
        time.sleep(6)
        assert generate(llm) == generate(LLM(qwen3_dir, **ENGINE))


@pytest.mark.timeout(900)
def test_the_interpreter_exit_ends_the_workers(qwen3_dir):
    """A script that never calls shutdown(): its workers must not outlive it. (No hang at exit was found: the
    100 s this test once took on a busy machine went to the ranks' warm-up compiling the C++ kernels in CI's
    fresh build folder. It has no warm-up now, and a bound that only a hang reaches.)"""
    script = ("import torch\nfrom minivllm import LLM\nif __name__ == '__main__':\n"
              "    torch.set_num_threads(1)\n"
              f"    llm = LLM({qwen3_dir!r}, tensor_parallel_size=2, block_size=4, num_kv_blocks=16, warmup=False)\n"
              "    print(llm.llm_engine.executor.worker_processes[0].pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[-1])
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
